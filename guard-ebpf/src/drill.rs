//! Chaos drills (guard_common::drill): the connect hooks ask `decide` whether an attempt
//! of a scope gets its drill's fault; `drill_egress` drops the SYNs of a socket given a
//! blackhole or a delay.
//!
//! Every bound is checked here, not by the daemon alone: the deadline, the lease of the
//! daemon that owns the drill's maps (a daemon that dies ends its drills when that lease
//! does, whoever starts next), and the cap, which reserves before it looks so that
//! concurrent connects never fault more than `max_faults`.
use aya_ebpf::{
    bindings::bpf_sock,
    helpers::generated::{
        bpf_get_current_ancestor_cgroup_id, bpf_get_prandom_u32, bpf_ktime_get_ns,
        bpf_sk_fullsock, bpf_sk_storage_delete,
    },
    macros::cgroup_skb,
    programs::SkBuffContext,
};
use guard_common::{
    SockState,
    drill::{
        DrillConf, DrillCounts, DrillMark, FAULT_DELAY, FAULT_REFUSE, FAULT_RESET,
        MAX_DRILL_CGROUPS, MAX_DRILL_NETS, words,
    },
    linux::TCP_SYN_SENT,
};

use crate::{
    accounting::{add, replace},
    maps::{DRILL_COUNTS, DRILL_LEASE, DRILL_ON, DRILL_SOCKS, DRILLS, sk_storage_of},
    scope::mount_level,
};

const PASS: i32 = 1;
const DROP: i32 = 0;

/// The FAULT_* of the drill set on scope `scope_id`, 0 for none: one array load,
/// inlined, for every governed connect.
#[inline(always)]
pub fn fault_of(scope_id: u32) -> u32 {
    DRILL_ON.get(scope_id).copied().unwrap_or(0)
}

/// The drill of scope `scope_id` when it is set and in force at `now`: its serial
/// matches, before its deadline, under its daemon's lease.
#[inline(always)]
fn in_force(scope_id: u32, now: u64) -> Option<&'static DrillConf> {
    let conf = unsafe { DRILLS.get(&scope_id) }?;
    let lease = DRILL_LEASE.get(0).copied().unwrap_or(0);
    (conf.serial != 0 && now < conf.deadline_ns && now < lease).then_some(conf)
}

/// After an admission (`state` holds it): a blackhole, delay or reset drill of its
/// scope may give the socket `sk` its fault; a socket it does not choose loses the mark
/// of an earlier connect. Attempts shed before this are not the drill's. Returns
/// whether the connect is to be reset (the caller sends it to the loopback's port 0).
#[inline(always)]
pub fn fault_admitted(sk: *mut bpf_sock, state: *mut SockState) -> bool {
    let scope_id = unsafe { (*state).dst.scope_id };
    let fault = fault_of(scope_id);
    if fault <= FAULT_REFUSE {
        return false;
    }
    let (addr, port) = unsafe { ((*state).dst.addr, (*state).dst.port) };
    let packed = decide(scope_id, &addr, port, fault);
    if packed & 0xff == FAULT_RESET as u64 {
        return true;
    }
    if packed != 0 {
        mark(sk, packed);
    } else {
        unsafe { bpf_sk_storage_delete((&raw const DRILL_SOCKS).cast_mut().cast(), sk.cast()) };
    }
    false
}

/// The fault for an attempt of the scope `scope_id` toward `addr` (the maps' form) and
/// `port` (host order), when its drill's fault is `fault`, packed: 0 for none, else the
/// FAULT_* in bits 0-7, in bits 8-23 the errno (FAULT_REFUSE) or the scope id (the
/// others, for `mark`), and the drill's serial in bits 32-63. A BPF subprogram: one
/// path for the verifier through the connect hook, whatever the drill decides.
#[inline(never)]
pub fn decide(scope_id: u32, addr: &[u8; 16], port: u16, fault: u32) -> u64 {
    let now = unsafe { bpf_ktime_get_ns() };
    let Some(conf) = in_force(scope_id, now) else {
        return 0;
    };
    // A drill set again meanwhile, with another fault: not this caller's to give.
    if conf.fault != fault || !targets(conf, addr, port) || !in_cgroups(conf) {
        return 0;
    }
    let Some(c) = DRILL_COUNTS.get_ptr_mut(scope_id) else {
        return 0;
    };
    add(unsafe { &raw mut (*c).attempts }, 1);
    let windowed = conf.window_ns != 0;
    // The sliding window's attempts, this one included (0 without the cap).
    let in_window = if windowed {
        window_attempts(c, conf.window_ns, now)
    } else {
        0
    };
    if unsafe { bpf_get_prandom_u32() } as u64 >= conf.threshold {
        return 0;
    }
    if windowed {
        let faulted = window_faulted(c, conf.window_ns, now);
        if (faulted + 1) * 1000 > conf.max_permille as u64 * in_window {
            add(unsafe { &raw mut (*c).capped }, 1);
            return 0;
        }
    }
    // Signed: an attempt of the drill before, on this scope, giving its place back
    // after the counts were zeroed takes them below 0, which caps nothing.
    let before = add(unsafe { &raw mut (*c).reserved }, 1) as i64;
    if conf.max_faults != 0 && before >= conf.max_faults as i64 {
        add(unsafe { &raw mut (*c).reserved }, u64::MAX);
        add(unsafe { &raw mut (*c).capped }, 1);
        return 0;
    }
    if windowed {
        add(unsafe { &raw mut (*c).window_faulted }, 1);
    }
    add(unsafe { &raw mut (*c).faulted }, 1);
    let detail = if conf.fault == FAULT_REFUSE {
        conf.errno
    } else {
        scope_id
    };
    (conf.fault & 0xff) as u64 | ((detail & 0xffff) as u64) << 8 | (conf.serial as u64) << 32
}

/// The fraction cap's sliding window of `window` ns ending at `now`, estimated from two
/// fixed windows (the current one, and the one before it weighted by how much of it
/// the sliding window still covers): counts this attempt in the current window, and
/// returns the window's attempts. The attempt that finds the current window over moves
/// it on; attempts racing it may count in either.
#[inline(always)]
fn window_attempts(c: *mut DrillCounts, window: u64, now: u64) -> u64 {
    let start = unsafe { core::ptr::read_volatile(&raw const (*c).window_start) };
    let elapsed = now.saturating_sub(start);
    if elapsed >= window {
        // Right after the current window: it becomes the one before; later: both empty.
        let next = if elapsed < 2 * window { start + window } else { now };
        if replace(unsafe { &raw mut (*c).window_start }, start, next) {
            let (a, f) = if elapsed < 2 * window {
                unsafe {
                    (
                        core::ptr::read_volatile(&raw const (*c).window_attempts),
                        core::ptr::read_volatile(&raw const (*c).window_faulted),
                    )
                }
            } else {
                (0, 0)
            };
            unsafe {
                core::ptr::write_volatile(&raw mut (*c).prev_attempts, a);
                core::ptr::write_volatile(&raw mut (*c).prev_faulted, f);
                core::ptr::write_volatile(&raw mut (*c).window_attempts, 0);
                core::ptr::write_volatile(&raw mut (*c).window_faulted, 0);
            }
        }
    }
    let current = add(unsafe { &raw mut (*c).window_attempts }, 1) + 1;
    current + weighted(unsafe { &raw const (*c).prev_attempts }, c, window, now)
}

/// The sliding window's faults, as `window_attempts` counts attempts.
#[inline(always)]
fn window_faulted(c: *mut DrillCounts, window: u64, now: u64) -> u64 {
    let current = unsafe { core::ptr::read_volatile(&raw const (*c).window_faulted) };
    current + weighted(unsafe { &raw const (*c).prev_faulted }, c, window, now)
}

/// `*prev` (a count of the window before the current one) times the share of that
/// window the sliding window ending at `now` still covers; in ms, so that a day's
/// window times millions of attempts fits.
#[inline(always)]
fn weighted(prev: *const u64, c: *mut DrillCounts, window: u64, now: u64) -> u64 {
    let start = unsafe { core::ptr::read_volatile(&raw const (*c).window_start) };
    let window_ms = window / 1_000_000;
    let into_ms = (now.saturating_sub(start) / 1_000_000).min(window_ms);
    if window_ms == 0 {
        return 0;
    }
    let prev = unsafe { core::ptr::read_volatile(prev) };
    prev * (window_ms - into_ms) / window_ms
}

const _: () = assert!(MAX_DRILL_CGROUPS.is_power_of_two(), "the index mask needs it");

/// Whether the connecting task is in one of the cgroups the drill narrows its scope
/// to, or below one (every task of the scope when it names none).
#[inline(always)]
fn in_cgroups(conf: &DrillConf) -> bool {
    if conf.n_cgroups == 0 {
        return true;
    }
    let Some(base) = mount_level() else {
        return false;
    };
    for i in 0..MAX_DRILL_CGROUPS {
        if i as u32 >= conf.n_cgroups {
            break;
        }
        // Older verifiers (6.1) lose the loop's bound and see a read past the array:
        // the index is read back, which the compiler cannot see through, and masked,
        // which bounds it for any verifier.
        let i = unsafe { core::ptr::read_volatile(&i) } & (MAX_DRILL_CGROUPS - 1);
        let cg = &conf.cgroups[i];
        // An ancestor level deeper than the task's cgroup reads 0, never an id.
        let id = unsafe { bpf_get_current_ancestor_cgroup_id((base + cg.level) as i32) };
        if id == cg.id {
            return true;
        }
    }
    false
}

/// Whether the drill targets `addr` and `port`.
#[inline(always)]
fn targets(conf: &DrillConf, addr: &[u8; 16], port: u16) -> bool {
    let addr = words(addr);
    let mut net_ok = conf.n_nets == 0;
    for i in 0..MAX_DRILL_NETS {
        if net_ok || i as u32 >= conf.n_nets {
            break;
        }
        net_ok = conf.nets[i].contains(&addr);
    }
    if !net_ok {
        return false;
    }
    if conf.n_ports == 0 {
        return true;
    }
    for (i, r) in conf.ports.iter().enumerate() {
        if i as u32 >= conf.n_ports {
            break;
        }
        if r.first <= port && port <= r.last {
            return true;
        }
    }
    false
}

/// Marks the socket `sk` with the blackhole or delay fault `decide` packed. Without
/// storage (a full map) the socket goes unfaulted: counted faulted, and let through.
#[inline(always)]
fn mark(sk: *mut bpf_sock, packed: u64) {
    let m: *mut DrillMark = sk_storage_of(&raw const DRILL_SOCKS, sk, true);
    if !m.is_null() {
        unsafe {
            *m = DrillMark {
                scope_id: (packed >> 8) as u32 & 0xffff,
                serial: (packed >> 32) as u32,
                fault: packed as u32 & 0xff,
                dropped: 0,
            }
        };
    }
}

/// cgroup_skb egress of the governed cgroups, attached while a blackhole or delay drill
/// runs: a SYN of a socket given a blackhole is dropped (while the socket is in
/// SYN_SENT: nothing of a connection that got through), and so is the first of a
/// socket given a delay; tcp_connect() ignores the error (net/ipv4/tcp_output.c) and
/// the retransmit timer runs as for a lost SYN. Everything else passes, and so does
/// every packet once the drill is over.
#[cgroup_skb(egress)]
pub fn drill_egress(ctx: SkBuffContext) -> i32 {
    let sk = unsafe { (*ctx.skb.skb).__bindgen_anon_2.sk };
    if sk.is_null() {
        return PASS;
    }
    let sk = unsafe { bpf_sk_fullsock(sk) };
    if sk.is_null() || unsafe { (*sk).state } != TCP_SYN_SENT {
        return PASS;
    }
    let m: *mut DrillMark = sk_storage_of(&raw const DRILL_SOCKS, sk, false);
    if m.is_null() {
        return PASS;
    }
    let (scope_id, serial, fault) = unsafe { ((*m).scope_id, (*m).serial, (*m).fault) };
    let now = unsafe { bpf_ktime_get_ns() };
    match in_force(scope_id, now) {
        Some(conf) if conf.serial == serial => {}
        _ => return PASS,
    }
    if fault == FAULT_DELAY {
        let dropped = unsafe { &raw mut (*m).dropped };
        // A socket's packets are sent under its lock, one at a time.
        if unsafe { core::ptr::read_volatile(dropped) } != 0 {
            return PASS;
        }
        unsafe { core::ptr::write_volatile(dropped, 1) };
    }
    DROP
}
