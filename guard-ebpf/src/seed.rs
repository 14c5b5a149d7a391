//! cgroup setsockopt, attached only for a moment: `seed` counts a connection that
//! existed before the daemon's first start (guard_common::SeedRequest), attached to the
//! governed cgroups while the daemon seeds; `state_cb_probe` is the daemon's probe of the
//! state callback option at start. Every other setsockopt passes untouched.
use aya_ebpf::{bindings::bpf_sockopt, macros::cgroup_sockopt, programs::SockoptContext};
use guard_common::{
    PROBE_STATE_CB, SEED_SOCKET, SOL_CONNGUARD, STAT_INTERNAL_ERRORS, SeedRequest,
    linux::{IPPROTO_TCP, TCP_CLOSE, TCP_LISTEN},
};

use crate::{
    accounting::count_stat,
    charge::{Charge, charge},
    maps::{ACTIVE_GEN, SEED_KEY, storage},
    release::ask_state_callback,
};

/// The kernel goes on with the option (ours: skips it, as optlen is -1).
const PASS: i32 = 1;
/// The most of an option value a program sees (PAGE_SIZE on x86-64 and arm64).
const OPTVAL_SEEN: i32 = 4096;
/// setsockopt() fails with EPERM.
const REFUSE: i32 = 0;

/// Whether the option is connguard's `optname`, taken away from the kernel's own
/// setsockopt (optlen -1, Documentation/bpf/prog_cgroup_sockopt.rst); any other is left
/// to pass untouched.
#[inline(always)]
fn take_option(so: &mut bpf_sockopt, optname: i32) -> bool {
    if so.level != SOL_CONNGUARD || so.optname != optname {
        // A longer value than the program sees must be handed back whole (optlen 0),
        // or the kernel fails the call with EFAULT (before Linux 6.5).
        if so.optlen > OPTVAL_SEEN {
            so.optlen = 0;
        }
        return false;
    }
    so.optlen = -1;
    true
}

#[cgroup_sockopt(setsockopt)]
pub fn seed(ctx: SockoptContext) -> i32 {
    let so = unsafe { &mut *ctx.sockopt };
    if !take_option(so, SEED_SOCKET) {
        return PASS;
    }
    let start = unsafe { so.__bindgen_anon_2.optval } as *const u8;
    let end = unsafe { so.__bindgen_anon_3.optval_end } as *const u8;
    if unsafe { start.add(core::mem::size_of::<SeedRequest>()) } > end {
        return REFUSE;
    }
    let req = unsafe { &*start.cast::<SeedRequest>() };
    let key = SEED_KEY.get(0).copied().unwrap_or(0);
    if key == 0 || req.key != key {
        return REFUSE;
    }
    let sk = unsafe { so.__bindgen_anon_1.sk };
    if sk.is_null() || unsafe { (*sk).protocol } != IPPROTO_TCP {
        return REFUSE;
    }
    let tcp_state = unsafe { (*sk).state };
    // Storage already there: the socket was created, or connected, since the programs
    // were attached, and is theirs.
    if tcp_state == TCP_CLOSE || tcp_state == TCP_LISTEN || !storage(sk, false).is_null() {
        return REFUSE;
    }
    let state = storage(sk, true);
    if state.is_null() {
        count_stat(STAT_INTERNAL_ERRORS);
        return REFUSE;
    }
    unsafe { (*state).cgroup_id = req.cgroup_id };
    let gen_ = ACTIVE_GEN.get(0).copied().unwrap_or(0);
    match charge(state, gen_, req.dst, req.dport, req.netns, false) {
        Charge::Admitted => {
            // Released when it reaches TCP_CLOSE, by its state callback, asked for here
            // (where the kernel refuses, by the state tracepoint).
            unsafe {
                (*state).src = req.src;
                (*state).armed = 1;
            }
            let _ = ask_state_callback(sk.cast());
            PASS
        }
        Charge::NoScope | Charge::Shed(_) => REFUSE,
    }
}

/// The daemon's probe at start (guard_common::PROBE_STATE_CB): asks for the state
/// callback of the probe's socket as connect4 does; setsockopt() answers 0 where the
/// kernel takes it, else EPERM. Every other setsockopt passes untouched.
#[cgroup_sockopt(setsockopt)]
pub fn state_cb_probe(ctx: SockoptContext) -> i32 {
    let so = unsafe { &mut *ctx.sockopt };
    if !take_option(so, PROBE_STATE_CB) {
        return PASS;
    }
    let sk = unsafe { so.__bindgen_anon_1.sk };
    if sk.is_null() || unsafe { (*sk).protocol } != IPPROTO_TCP {
        return REFUSE;
    }
    if ask_state_callback(sk.cast()) {
        PASS
    } else {
        REFUSE
    }
}
