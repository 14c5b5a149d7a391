//! cgroup sock_create: find the scope of a new TCP socket, because the socket belongs to
//! the scope of the cgroup it is created in, whichever task later calls connect().
//! Only sockets with a scope get storage.
use aya_ebpf::{macros::cgroup_sock, programs::SockContext};
use guard_common::{STAT_INTERNAL_ERRORS, SockState, linux::IPPROTO_TCP};

use crate::{
    accounting::count_stat,
    maps::{ACTIVE_GEN, storage},
    scope::nearest_selected,
};

#[cgroup_sock(sock_create)]
pub fn sock_create(ctx: SockContext) -> i32 {
    if unsafe { (*ctx.sock).protocol } != IPPROTO_TCP {
        return 1;
    }
    let gen_ = ACTIVE_GEN.get(0).copied().unwrap_or(0);
    let selected = nearest_selected(gen_);
    if selected == 0 {
        return 1;
    }
    // The socket is new: its storage is created here, zeroed (nothing admitted).
    let state: *mut SockState = storage(ctx.sock, true);
    if state.is_null() {
        // Fail-open: without storage the socket passes connect() unguarded.
        count_stat(STAT_INTERNAL_ERRORS);
    } else {
        unsafe { (*state).cgroup_id = selected };
    }
    1
}
