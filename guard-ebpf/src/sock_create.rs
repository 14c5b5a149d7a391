//! cgroup sock_create: remember the cgroup a TCP socket is created in, because the
//! socket belongs to that cgroup's scope whichever task later calls connect(). Only
//! sockets created in a governed cgroup get storage; the others cost one lookup here and
//! pass connect() untouched.
use aya_ebpf::{
    helpers::generated::bpf_get_current_cgroup_id, macros::cgroup_sock, programs::SockContext,
};
use guard_common::{CgroupKey, STAT_INTERNAL_ERRORS, SockState, linux::IPPROTO_TCP};

use crate::{
    accounting::internal_error,
    maps::{ACTIVE_GEN, SCOPES, storage},
};

#[cgroup_sock(sock_create)]
pub fn sock_create(ctx: SockContext) -> i32 {
    if unsafe { (*ctx.sock).protocol } != IPPROTO_TCP {
        return 1;
    }
    let gen_ = ACTIVE_GEN.get(0).copied().unwrap_or(0);
    let cgroup_id = unsafe { bpf_get_current_cgroup_id() };
    if unsafe {
        SCOPES.get(&CgroupKey {
            gen_,
            _pad: 0,
            cgroup_id,
        })
    }
    .is_none()
    {
        return 1;
    }
    // The socket is new: its storage is created here, zeroed (nothing admitted).
    let state: *mut SockState = storage(ctx.sock, true);
    if state.is_null() {
        // Fail-open: without storage the socket passes connect() unguarded.
        internal_error(STAT_INTERNAL_ERRORS);
    } else {
        unsafe { (*state).cgroup_id = cgroup_id };
    }
    1
}
