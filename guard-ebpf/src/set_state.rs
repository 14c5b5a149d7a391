//! tp_btf `inet_sock_set_state`: releases an admitted socket that reaches TCP_CLOSE
//! (for an armed one, with sock_ops STATE_CB, whichever comes first: see release.rs),
//! counts connect() failures for want of a local port, and reports a handshake that
//! failed (SYN_SENT to TCP_CLOSE) to its breaker. For listener guards' per-caller
//! budgets, counts a server socket's completed handshake (SYN_RECV to ESTABLISHED) and
//! releases it at TCP_CLOSE (callers.rs).
//!
//! The one host-wide program: a tracepoint runs for every socket of the host, which is
//! what makes it see the sockets the state callback does not (another sock_ops program
//! cleared it, or the socket was admitted before sock_ops was attached to its cgroup,
//! just created). For a socket without
//! storage it costs a compare of the new state and, for moves to TCP_CLOSE, two storage
//! lookups (SOCKS, CALLER_SOCKS); a server socket's completed handshake costs a lookup
//! of CALLER_GUARDS, and where guards have per-caller budgets, its listener's.
//!
//! tcp_v4_connect()/tcp_v6_connect() move the socket to SYN_SENT, then search a local
//! port (inet_hash_connect); when none is free they return EADDRNOTAVAIL and move it
//! back to TCP_CLOSE, before tcp_connect() (so before sock_ops arms the socket). This
//! runs in the caller's syscall, so the current task is the process that failed.
use aya_ebpf::{
    bindings::bpf_sock, helpers::generated::bpf_get_current_comm, macros::btf_tracepoint,
    programs::BtfTracePointContext,
};
use guard_common::{
    EaddrKey,
    linux::{TCP_CLOSE, TCP_ESTABLISHED, TCP_SYN_RECV, TCP_SYN_SENT},
};

use crate::{
    accounting::{bump, release},
    breaker, callers,
    maps::{EADDRNOTAVAIL, storage},
    release::closed,
};

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
    if state.is_null() {
        return 0;
    }
    // Whichever path releases it, this sees the failed handshake (the state callback
    // runs first, and releases).
    if old == TCP_SYN_SENT {
        breaker::outcome(state, true);
    }
    if unsafe { (*state).admitted } != 1 {
        return 0;
    }
    if unsafe { (*state).armed } != 0 {
        closed(state, old);
        return 0;
    }
    // Admitted but not armed: the failure came before tcp_connect().
    if !release(state) || old != TCP_SYN_SENT {
        return 0;
    }
    let mut key = EaddrKey {
        scope_id: unsafe { (*state).dst.scope_id },
        comm: [0; 16],
    };
    unsafe { bpf_get_current_comm(key.comm.as_mut_ptr().cast(), 16) };
    bump(&EADDRNOTAVAIL, &key);
    0
}
