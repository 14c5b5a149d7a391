//! tp_btf `inet_sock_set_state`: with the state callback, releases an admitted socket
//! that reaches TCP_CLOSE, counts connect() failures for want of a local port, and
//! reports a handshake that failed to its breaker (release.rs says when the daemon
//! attaches it). For listener guards' per-caller budgets, counts a server socket's
//! completed handshake (SYN_RECV to ESTABLISHED) and releases it at TCP_CLOSE
//! (callers.rs).
//!
//! A tracepoint runs for every socket of the host, which is what makes it see the
//! sockets the state callback does not. For a socket without storage it costs a compare
//! of the new state and, for moves to TCP_CLOSE, two storage lookups (SOCKS,
//! CALLER_SOCKS); a server socket's completed handshake costs a lookup of CALLER_GUARDS,
//! and where guards have per-caller budgets, its listener's.
use aya_ebpf::{bindings::bpf_sock, macros::btf_tracepoint, programs::BtfTracePointContext};
use guard_common::linux::{TCP_CLOSE, TCP_ESTABLISHED, TCP_SYN_RECV};

use crate::{callers, maps::storage, release::to_close};

#[btf_tracepoint(function = "inet_sock_set_state")]
pub fn sock_set_state(ctx: BtfTracePointContext) -> i32 {
    let (old, new): (u32, u32) = (ctx.arg(1), ctx.arg(2));
    let sk: *mut bpf_sock = ctx.arg(0);
    if new == TCP_ESTABLISHED {
        if old == TCP_SYN_RECV {
            callers::established(sk);
        }
        return 0;
    }
    if new != TCP_CLOSE {
        return 0;
    }
    callers::closed(sk);
    let state = storage(sk, false);
    if !state.is_null() {
        to_close(state, old, false);
    }
    0
}
