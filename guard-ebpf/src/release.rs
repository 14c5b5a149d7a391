//! The paths by which an admitted socket reaches TCP_CLOSE. Each calls
//! `accounting::release`, which acts once per admission. A socket that connects again
//! after a failure is released by the connect hook before it is admitted again.
//!
//! An armed socket's move to TCP_CLOSE is seen twice, and the first to swap `admitted`
//! releases it: by sock_ops STATE_CB, and by the `inet_sock_set_state` tracepoint
//! (set_state.rs). Either alone can miss it. bpf_sock_ops_cb_flags_set() replaces a
//! socket's flags, so another sock_ops program on the host that sets only its own turns
//! our state callback off; a tracing program interrupted by an IRQ whose softirq closes
//! another socket on the same CPU skips the nested run (`recursion_misses`), which
//! alone would leak an admission at times (docs/architecture.md says how often).
use aya_ebpf::{
    bindings::{
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_STATE_CB, BPF_SOCK_OPS_STATE_CB_FLAG,
        BPF_SOCK_OPS_TCP_CONNECT_CB,
    },
    macros::{cgroup_sock, sock_ops},
    programs::{SockContext, SockOpsContext},
};
use guard_common::{
    SockState, TimeWaitKey,
    linux::{AF_INET, IPPROTO_TCP, TCP_CLOSE, TCP_CLOSING, TCP_FIN_WAIT1, TCP_FIN_WAIT2},
};

use crate::{
    accounting::{bump, end_handshake, release},
    breaker,
    maps::{TIME_WAITS, storage},
    net::{ipv4_mapped, words_addr},
};

/// States whose move to TCP_CLOSE is the birth of a TIME_WAIT entry (tcp_time_wait(),
/// net/ipv4/tcp_minisocks.c): FIN_WAIT1 (FIN+ACK at once), FIN_WAIT2, CLOSING. A reset
/// in these states is counted too; it is rare.
const TIME_WAIT_FROM: [u32; 3] = [TCP_FIN_WAIT1, TCP_FIN_WAIT2, TCP_CLOSING];

/// TCP_CONNECT_CB (tcp_connect, before the SYN) asks for state callbacks on admitted
/// sockets and notes the local address; STATE_CB then sees every transition into
/// TCP_CLOSE: reset, timeout, orderly close, the birth of a TIME_WAIT entry
/// (FIN_WAIT2 -> CLOSE), and the abort of a pending connect. ACTIVE_ESTABLISHED_CB
/// (the SYN-ACK came; every sock_ops program gets it, with no flag to set) ends the
/// handshake that `max_connecting` counts.
#[sock_ops]
pub fn sock_state(ctx: SockOpsContext) -> u32 {
    let op = ctx.op();
    if op != BPF_SOCK_OPS_TCP_CONNECT_CB
        && op != BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB
        && !(op == BPF_SOCK_OPS_STATE_CB && ctx.arg(1) == TCP_CLOSE)
    {
        return 1;
    }
    let sk = unsafe { (*ctx.ops).__bindgen_anon_2.sk };
    if sk.is_null() {
        return 1;
    }
    let state = storage(sk, false);
    if op == BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB {
        end_handshake(state);
        breaker::outcome(state, false);
    } else if op == BPF_SOCK_OPS_STATE_CB {
        // Only an armed admission: the callback flag outlives a failed connect, and an
        // unarmed one (the port search failed) is the tracepoint's to count.
        if !state.is_null() && unsafe { (*state).armed } != 0 {
            closed(state, ctx.arg(0));
        }
    } else if !state.is_null() && unsafe { (*state).admitted } == 1 {
        let _ = ctx.set_cb_flags((ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG) as i32);
        unsafe {
            (*state).src = local_addr(&ctx);
            (*state).armed = 1;
        }
    }
    1
}

/// The socket moved from `old` to TCP_CLOSE: release its admission, and count the
/// TIME_WAIT entry it leaves, by the path that released (once).
#[inline(always)]
pub fn closed(state: *mut SockState, old: u32) {
    if release(state) && TIME_WAIT_FROM.contains(&old) {
        let dst = unsafe { (*state).dst };
        let key = TimeWaitKey {
            netns: unsafe { (*state).netns },
            scope_id: dst.scope_id,
            dport: dst.port,
            _pad: 0,
            src: unsafe { (*state).src },
            dst: dst.addr,
        };
        bump(&TIME_WAITS, &key);
    }
}

/// The socket's local address in the maps' form.
#[inline(always)]
fn local_addr(ctx: &SockOpsContext) -> [u8; 16] {
    let ops = ctx.ops;
    // Every field is loaded, then chosen: branches that load different offsets into the
    // same place get merged by LLVM into one load from a computed context offset, which
    // the verifier refuses.
    let word = |p: *const u32| unsafe { core::ptr::read_volatile(p) };
    let v4 = word(unsafe { &raw const (*ops).local_ip4 });
    let v6 = [
        word(unsafe { &raw const (*ops).local_ip6[0] }),
        word(unsafe { &raw const (*ops).local_ip6[1] }),
        word(unsafe { &raw const (*ops).local_ip6[2] }),
        word(unsafe { &raw const (*ops).local_ip6[3] }),
    ];
    if ctx.family() == AF_INET {
        ipv4_mapped(v4)
    } else {
        words_addr(v6)
    }
}

/// The socket is released (close() or exit). This ends the admissions that no move to
/// TCP_CLOSE will end: a connect that failed before the socket left TCP_CLOSE
/// (ENETUNREACH from the route lookup), or that another cgroup program refused. (fexit
/// on tcp_v4_connect would end them at once, but on a host that runs with
/// lockdown=integrity loading an fexit program fails with EPERM.) A socket that
/// reached SYN_SENT is released when it moves to TCP_CLOSE, by the state callback if
/// armed, and by the tracepoint in any case: that includes the port search failing
/// (EADDRNOTAVAIL) and a TCP Fast Open connect deferred to a first send that never came.
#[cgroup_sock(sock_release)]
pub fn sock_release(ctx: SockContext) -> i32 {
    if unsafe { (*ctx.sock).protocol } == IPPROTO_TCP {
        let state = storage(ctx.sock, false);
        // An armed socket already in TCP_CLOSE that both close watchers missed (a foreign
        // sock_ops program cleared the callback, and the tracepoint's run was skipped)
        // is released here too; one still open goes on, orphaned, to its own close.
        if !state.is_null()
            && (unsafe { (*state).armed } == 0 || unsafe { (*ctx.sock).state } == TCP_CLOSE)
        {
            let _ = release(state);
        }
    }
    1
}
