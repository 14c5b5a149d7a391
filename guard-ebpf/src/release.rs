//! The paths by which an admitted socket reaches TCP_CLOSE. Each calls
//! `accounting::release`, which acts once per admission. A socket that connects again
//! after a failure is released by the connect hook before it is admitted again.
//!
//! The state callback (sock_ops STATE_CB) sees an admitted socket's move to TCP_CLOSE:
//! connect4 asks for it when it admits (bpf_setsockopt TCP_BPF_SOCK_OPS_CB_FLAGS, Linux
//! 6.12), before the local port search, so a search that fails (EADDRNOTAVAIL) is seen
//! too; TCP_CONNECT_CB asks again, where the kernel refuses the option. Where the
//! callback alone can miss a release, the `inet_sock_set_state` tracepoint
//! (set_state.rs) sees the same moves, and the first to swap `admitted` releases: the
//! daemon attaches it where the kernel refuses the option (the port search's failure
//! is then before any callback), while any other sock_ops program is loaded on the
//! host (bpf_sock_ops_cb_flags_set() replaces a socket's flags, so a program that sets
//! only its own turns ours off), and while listener guards have per-caller budgets,
//! which it counts (callers.rs). A tracing program interrupted by an IRQ whose softirq
//! closes another socket on the same CPU skips the nested run (`recursion_misses`),
//! which alone would leak an admission at times (docs/architecture.md says how often).
use core::ffi::c_void;

use aya_ebpf::{
    bindings::{
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_STATE_CB, BPF_SOCK_OPS_TCP_CONNECT_CB,
    },
    helpers::generated::{bpf_get_current_comm, bpf_getsockopt, bpf_setsockopt},
    macros::{cgroup_sock, sock_ops},
    programs::{SockContext, SockOpsContext},
};
use guard_common::{
    EaddrKey, SockState, TimeWaitKey,
    linux::{
        AF_INET, BPF_SOCK_OPS_STATE_CB_FLAG, IPPROTO_TCP, SOL_TCP, TCP_BPF_SOCK_OPS_CB_FLAGS,
        TCP_CLOSE, TCP_CLOSING, TCP_FIN_WAIT1, TCP_FIN_WAIT2, TCP_SYN_SENT,
    },
};

use crate::{
    accounting::{bump, end_handshake, release},
    breaker,
    maps::{EADDRNOTAVAIL, TIME_WAITS, storage},
    net::{ipv4_mapped, words_addr},
};

/// States whose move to TCP_CLOSE is the birth of a TIME_WAIT entry (tcp_time_wait(),
/// net/ipv4/tcp_minisocks.c): FIN_WAIT1 (FIN+ACK at once), FIN_WAIT2, CLOSING. A reset
/// in these states is counted too; it is rare.
const TIME_WAIT_FROM: [u32; 3] = [TCP_FIN_WAIT1, TCP_FIN_WAIT2, TCP_CLOSING];

/// TCP_CONNECT_CB (tcp_connect, before the SYN) asks for state callbacks on admitted
/// sockets (again, where connect4 could not) and notes the local address; STATE_CB then
/// sees every transition into TCP_CLOSE: reset, timeout, orderly close, the birth of a
/// TIME_WAIT entry (FIN_WAIT2 -> CLOSE), the abort of a pending connect, and the port
/// search's failure. ACTIVE_ESTABLISHED_CB (the SYN-ACK came; every sock_ops program
/// gets it, with no flag to set) ends the handshake that `max_connecting` counts.
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
        if !state.is_null() {
            to_close(state, ctx.arg(0), true);
        }
    } else if !state.is_null() && unsafe { (*state).admitted } == 1 {
        let _ = ctx.set_cb_flags((ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG as u32) as i32);
        unsafe {
            (*state).src = local_addr(&ctx);
            (*state).armed = 1;
        }
    }
    1
}

/// 1 when sock_ops programs may call bpf_get_current_comm, as the daemon's probe found.
/// Cleared, `sock_state` leaves a failed port search to the state tracepoint (which the
/// daemon then keeps attached), to be counted with the caller's name; the verifier
/// skips the call on the dead branch, because .rodata is frozen.
#[unsafe(no_mangle)]
static SOCK_OPS_COMM: u8 = 1;

/// Asks for the state callbacks of a socket (`sock`: the program's context or the
/// socket, as bpf_setsockopt takes it), keeping the flags other programs set; false
/// where the kernel refuses the option (before Linux 6.12).
#[inline(always)]
pub fn ask_state_callback(sock: *mut c_void) -> bool {
    let mut flags: i32 = 0;
    let p: *mut c_void = (&raw mut flags).cast();
    let size = core::mem::size_of::<i32>() as i32;
    if unsafe { bpf_getsockopt(sock, SOL_TCP, TCP_BPF_SOCK_OPS_CB_FLAGS, p, size) } != 0 {
        return false;
    }
    if flags & BPF_SOCK_OPS_STATE_CB_FLAG != 0 {
        return true;
    }
    let mut flags = flags | BPF_SOCK_OPS_STATE_CB_FLAG;
    let p: *mut c_void = (&raw mut flags).cast();
    (unsafe { bpf_setsockopt(sock, SOL_TCP, TCP_BPF_SOCK_OPS_CB_FLAGS, p, size) }) == 0
}

/// A socket with storage moved from `old` to TCP_CLOSE, seen by the state callback or
/// the tracepoint: reports a failed handshake to its breaker, releases its admission,
/// and counts what the move leaves (a TIME_WAIT entry, or a connect() that failed for
/// want of a local port), once, by the path that released (`sock_ops`: the state
/// callback's).
#[inline(always)]
pub fn to_close(state: *mut SockState, old: u32, sock_ops: bool) {
    // Before the release: a handshake that failed owes its breaker an outcome.
    if old == TCP_SYN_SENT {
        breaker::outcome(state, true);
    }
    if unsafe { (*state).admitted } != 1 {
        return;
    }
    if unsafe { (*state).armed } != 0 {
        closed(state, old);
        return;
    }
    // Admitted but not armed: the failure came before tcp_connect().
    if old != TCP_SYN_SENT {
        let _ = release(state);
        return;
    }
    // tcp_v4_connect()/tcp_v6_connect() move the socket to SYN_SENT, then search a local
    // port (inet_hash_connect); when none is free they return EADDRNOTAVAIL and move it
    // back to TCP_CLOSE, before tcp_connect(). This runs in the caller's syscall, so the
    // current task is the process that failed. Where sock_ops cannot name it, the
    // tracepoint releases and counts (this check is on every path to the call, so the
    // verifier skips the call there).
    if sock_ops && unsafe { core::ptr::read_volatile(&SOCK_OPS_COMM) } == 0 {
        return;
    }
    if !release(state) {
        return;
    }
    let mut key = EaddrKey {
        scope_id: unsafe { (*state).dst.scope_id },
        comm: [0; 16],
    };
    unsafe { bpf_get_current_comm(key.comm.as_mut_ptr().cast(), 16) };
    bump(&EADDRNOTAVAIL, &key);
}

/// The armed socket moved from `old` to TCP_CLOSE: release its admission, and count the
/// TIME_WAIT entry it leaves, by the path that released (once).
#[inline(always)]
fn closed(state: *mut SockState, old: u32) {
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
/// reached SYN_SENT is released when it moves to TCP_CLOSE, by the state callback (and
/// the tracepoint, where attached): that includes the port search failing
/// (EADDRNOTAVAIL) and a TCP Fast Open connect deferred to a first send that never came.
#[cgroup_sock(sock_release)]
pub fn sock_release(ctx: SockContext) -> i32 {
    if unsafe { (*ctx.sock).protocol } == IPPROTO_TCP {
        let state = storage(ctx.sock, false);
        // An armed socket already in TCP_CLOSE that the close watchers missed (a foreign
        // sock_ops program cleared the callback before the daemon attached the
        // tracepoint, or the tracepoint's run was skipped) is released here too; one
        // still open goes on, orphaned, to its own close.
        if !state.is_null()
            && (unsafe { (*state).armed } == 0 || unsafe { (*ctx.sock).state } == TCP_CLOSE)
        {
            let _ = release(state);
        }
    }
    1
}
