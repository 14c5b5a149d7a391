//! Chaos drills (guard_common::drill): the connect hooks ask `decide` whether an attempt
//! of a scope gets its drill's fault; `drill_egress` drops the packets of a socket given
//! a blackhole or a delay.
//!
//! Every bound is checked here, not by the daemon alone: the deadline, the daemon's
//! lease (a daemon that dies ends its drills when the lease does), and the caps, which
//! reserve before they look so that concurrent connects never fault more than the cap.
use aya_ebpf::{
    bindings::bpf_sock,
    helpers::generated::{bpf_get_prandom_u32, bpf_ktime_get_ns, bpf_sk_fullsock},
    macros::cgroup_skb,
    programs::SkBuffContext,
};
use guard_common::{
    SockState,
    drill::{DrillConf, DrillMark, DrillNet, FAULT_DELAY, FAULT_REFUSE, MAX_DRILL_NETS},
};

use crate::{
    accounting::{add, replace},
    maps::{DRILL_COUNTS, DRILL_SOCKS, DRILLS, lease_held_at, sk_storage_of},
};

const PASS: i32 = 1;
const DROP: i32 = 0;

/// The FAULT_* of the drill set on scope `scope_id`, 0 for none: one load, inlined,
/// for every governed connect.
#[inline(always)]
pub fn fault_of(scope_id: u32) -> u32 {
    match DRILLS.get(scope_id) {
        Some(c) if c.serial != 0 => c.fault,
        _ => 0,
    }
}

/// After an admission (`state` holds it): a blackhole or delay drill of its scope may
/// give the socket `sk` its fault. Attempts shed before this are not the drill's.
#[inline(always)]
pub fn fault_admitted(sk: *mut bpf_sock, state: *mut SockState) {
    let scope_id = unsafe { (*state).dst.scope_id };
    if fault_of(scope_id) > FAULT_REFUSE {
        let (addr, port) = unsafe { ((*state).dst.addr, (*state).dst.port) };
        let packed = decide(scope_id, &addr, port);
        if packed != 0 {
            mark(sk, packed);
        }
    }
}

/// The fault for an attempt of the scope `scope_id` toward `addr` (the maps' form) and
/// `port` (host order), packed: 0 for none, else the FAULT_* in bits 0-7, in bits 8-23
/// the errno (FAULT_REFUSE) or the scope id (the others, for `mark`), and the drill's
/// serial in bits 32-63. A BPF subprogram: one path for the
/// verifier through the connect hook, whatever the drill decides.
#[inline(never)]
pub fn decide(scope_id: u32, addr: &[u8; 16], port: u16) -> u64 {
    let Some(conf) = DRILLS.get(scope_id) else {
        return 0;
    };
    if conf.serial == 0 {
        return 0;
    }
    let now = unsafe { bpf_ktime_get_ns() };
    if now >= conf.deadline_ns || !lease_held_at(now) || !targets(conf, addr, port) {
        return 0;
    }
    let Some(c) = DRILL_COUNTS.get_ptr_mut(scope_id) else {
        return 0;
    };
    add(unsafe { &raw mut (*c).attempts }, 1);
    let windowed = conf.window_ns != 0;
    let mut in_window = 0;
    if windowed {
        let start = unsafe { core::ptr::read_volatile(&raw const (*c).window_start) };
        // The attempt that moves the window on empties it; attempts racing it may count
        // in either window.
        if now.wrapping_sub(start) >= conf.window_ns
            && replace(unsafe { &raw mut (*c).window_start }, start, now)
        {
            unsafe {
                core::ptr::write_volatile(&raw mut (*c).window_attempts, 0);
                core::ptr::write_volatile(&raw mut (*c).window_faulted, 0);
            }
        }
        in_window = add(unsafe { &raw mut (*c).window_attempts }, 1) + 1;
    }
    if unsafe { bpf_get_prandom_u32() } as u64 >= conf.threshold {
        return 0;
    }
    if windowed {
        let faulted = add(unsafe { &raw mut (*c).window_faulted }, 1) + 1;
        if faulted * 1000 > conf.max_permille as u64 * in_window {
            add(unsafe { &raw mut (*c).window_faulted }, u64::MAX);
            add(unsafe { &raw mut (*c).capped }, 1);
            return 0;
        }
    }
    let before = add(unsafe { &raw mut (*c).faulted }, 1);
    if conf.max_faults != 0 && before >= conf.max_faults {
        add(unsafe { &raw mut (*c).faulted }, u64::MAX);
        if windowed {
            add(unsafe { &raw mut (*c).window_faulted }, u64::MAX);
        }
        add(unsafe { &raw mut (*c).capped }, 1);
        return 0;
    }
    let detail = if conf.fault == FAULT_REFUSE {
        conf.errno
    } else {
        scope_id
    };
    (conf.fault & 0xff) as u64 | ((detail & 0xffff) as u64) << 8 | (conf.serial as u64) << 32
}

/// Whether the drill targets `addr` and `port`.
#[inline(always)]
fn targets(conf: &DrillConf, addr: &[u8; 16], port: u16) -> bool {
    let mut net_ok = conf.n_nets == 0;
    for i in 0..MAX_DRILL_NETS {
        if net_ok || i as u32 >= conf.n_nets {
            break;
        }
        net_ok = in_net(&conf.nets[i], addr);
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

#[inline(always)]
fn in_net(net: &DrillNet, addr: &[u8; 16]) -> bool {
    let bits = net.prefix_len;
    for i in 0..16u32 {
        let first = i * 8;
        if first >= bits {
            break;
        }
        let mask: u8 = if bits - first >= 8 {
            0xff
        } else {
            0xffu8 << (8 - (bits - first))
        };
        if (addr[i as usize] ^ net.addr[i as usize]) & mask != 0 {
            return false;
        }
    }
    true
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

/// cgroup_skb egress of the drilled scope's cgroups, attached while a blackhole or delay
/// drill runs: a packet of a socket given a blackhole is dropped, and so is the first of
/// a socket given a delay; tcp_connect() ignores the error (net/ipv4/tcp_output.c) and
/// the retransmit timer runs as for a lost SYN. Everything else passes, and so does
/// every packet once the drill is over.
#[cgroup_skb(egress)]
pub fn drill_egress(ctx: SkBuffContext) -> i32 {
    let sk = unsafe { (*ctx.skb.skb).__bindgen_anon_2.sk };
    if sk.is_null() {
        return PASS;
    }
    let sk = unsafe { bpf_sk_fullsock(sk) };
    if sk.is_null() {
        return PASS;
    }
    let m: *mut DrillMark = sk_storage_of(&raw const DRILL_SOCKS, sk, false);
    if m.is_null() {
        return PASS;
    }
    let (scope_id, serial, fault) = unsafe { ((*m).scope_id, (*m).serial, (*m).fault) };
    let Some(conf) = DRILLS.get(scope_id) else {
        return PASS;
    };
    let now = unsafe { bpf_ktime_get_ns() };
    if conf.serial != serial || now >= conf.deadline_ns || !lease_held_at(now) {
        return PASS;
    }
    if fault == FAULT_DELAY {
        let dropped = unsafe { &raw mut (*m).dropped };
        // 32-bit swap through the 64-bit helper would touch the next field: one load
        // and store, the socket's own packets being sent one at a time.
        if unsafe { core::ptr::read_volatile(dropped) } != 0 {
            return PASS;
        }
        unsafe { core::ptr::write_volatile(dropped, 1) };
    }
    DROP
}
