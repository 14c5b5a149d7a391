//! cgroup sock_create: remember the cgroup a TCP socket is created in, because the
//! socket belongs to that cgroup's scope whichever task later calls connect().
use aya_ebpf::{
    EbpfContext,
    helpers::generated::{bpf_get_current_cgroup_id, bpf_get_socket_cookie},
    macros::cgroup_sock,
    programs::SockContext,
};
use guard_common::STAT_INTERNAL_ERRORS;

use crate::{accounting::internal_error, maps::SOCK_CGROUP};

const IPPROTO_TCP: u32 = 6;

#[cgroup_sock(sock_create)]
pub fn sock_create(ctx: SockContext) -> i32 {
    if unsafe { (*ctx.sock).protocol } == IPPROTO_TCP {
        let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
        let cgroup_id = unsafe { bpf_get_current_cgroup_id() };
        if SOCK_CGROUP.insert(&cookie, cgroup_id, 0).is_err() {
            // Fail-open: connect() falls back to the caller's cgroup.
            internal_error(STAT_INTERNAL_ERRORS);
        }
    }
    1
}
