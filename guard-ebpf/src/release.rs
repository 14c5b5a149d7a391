//! The paths by which an admitted socket reaches TCP_CLOSE. Each calls
//! `accounting::release`, which acts once per admission. A socket that connects again
//! after a failure is released by the connect hook before it is admitted again.
use core::ffi::c_void;

use aya_ebpf::{
    EbpfContext,
    helpers::generated::bpf_get_socket_cookie,
    macros::{btf_tracepoint, cgroup_sock},
    programs::{BtfTracePointContext, SockContext},
};

use crate::{accounting::release, maps::SOCK_CGROUP};

const TCP_CLOSE: u32 = 7;
const IPPROTO_TCP: u32 = 6;

/// Every transition into TCP_CLOSE: reset, timeout, orderly close, the birth of a
/// TIME_WAIT entry (FIN_WAIT2 -> CLOSE), abort of a pending connect, and the failure
/// of tcp_v4/v6_connect after SYN_SENT (EADDRNOTAVAIL).
#[btf_tracepoint(function = "inet_sock_set_state")]
pub fn sock_set_state(ctx: BtfTracePointContext) -> i32 {
    let newstate: i32 = ctx.arg(2);
    if newstate as u32 == TCP_CLOSE {
        let sk: *mut c_void = ctx.arg(0);
        release(unsafe { bpf_get_socket_cookie(sk) });
    }
    0
}

/// The socket is released (close() or exit) while still in TCP_CLOSE. This ends the
/// admissions that no state transition ends: a connect that failed before leaving
/// TCP_CLOSE (ENETUNREACH, EINVAL from the route lookup) or that another cgroup program
/// refused. (fexit on tcp_v4_connect would end them at once, but on the hosts this was
/// built on, which run with lockdown=integrity, loading fexit programs fails with EPERM.) A socket
/// in any other state still reaches TCP_CLOSE later.
#[cgroup_sock(sock_release)]
pub fn sock_release(ctx: SockContext) -> i32 {
    let sk = unsafe { &*ctx.sock };
    if sk.protocol == IPPROTO_TCP {
        let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
        let _ = SOCK_CGROUP.remove(&cookie);
        if sk.state == TCP_CLOSE {
            release(cookie);
        }
    }
    1
}
