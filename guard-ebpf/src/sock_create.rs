//! cgroup sock_create: remember the cgroup a TCP socket is created in, because the
//! socket belongs to that cgroup's scope whichever task later calls connect().
use aya_ebpf::{
    helpers::generated::bpf_get_current_cgroup_id, macros::cgroup_sock, programs::SockContext,
};
use guard_common::{STAT_INTERNAL_ERRORS, SockState};

use crate::{accounting::internal_error, maps::storage};

const IPPROTO_TCP: u32 = 6;

#[cgroup_sock(sock_create)]
pub fn sock_create(ctx: SockContext) -> i32 {
    if unsafe { (*ctx.sock).protocol } == IPPROTO_TCP {
        let mut init = SockState {
            cgroup_id: unsafe { bpf_get_current_cgroup_id() },
            ..Default::default()
        };
        if storage(ctx.sock, Some(&mut init)).is_null() {
            // Fail-open: connect() falls back to the caller's cgroup.
            internal_error(STAT_INTERNAL_ERRORS);
        }
    }
    1
}
