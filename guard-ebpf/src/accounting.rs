//! Atomic counter updates and the release of an admission.
use core::intrinsics::{
    AtomicOrdering::{Relaxed, SeqCst},
    atomic_cxchg, atomic_xadd, atomic_xchg,
};

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::generated::bpf_ktime_get_ns};
use guard_common::{Counter, CounterKey, NO_RULE, STAT_INTERNAL_ERRORS, SockState};

use crate::{
    maps::{COUNTERS, RULE_COUNTERS, SCOPE_COUNTERS, STATS},
    net::opaque_zero,
};

/// Atomic fetch-and-add; returns the previous value.
///
/// SeqCst, not Relaxed: LLVM 22's BPF backend lowers a Relaxed fetch-add to the
/// non-fetching `lock +=` (BPF_ADD without BPF_FETCH) even when the old value is used,
/// and then reads the increment back as if it were the old value.
#[inline(always)]
pub fn add(field: *mut u64, delta: u64) -> u64 {
    unsafe { atomic_xadd::<u64, u64, { SeqCst }>(field, delta) }
}

/// Sets `field` from `expected` to `target` if it still holds `expected`: an audit's
/// correction, which a concurrent update makes wait for the next audit.
#[inline(always)]
pub fn replace(field: *mut u64, expected: u64, target: u64) -> bool {
    unsafe { atomic_cxchg::<u64, { SeqCst }, { SeqCst }>(field, expected, target) }.1
}

/// Raises `peak` to `value` unless a concurrent update already went higher. A BPF
/// subprogram: the paths of its retries end at its return for the verifier.
#[inline(never)]
pub fn raise_peak(peak: *mut u64, value: u64) {
    let mut seen = unsafe { *peak };
    for _ in 0..8 {
        if seen >= value {
            return;
        }
        let (now, ok) = unsafe { atomic_cxchg::<u64, { Relaxed }, { Relaxed }>(peak, seen, value) };
        if ok {
            return;
        }
        seen = now;
    }
}

/// Adds 1 to the internal counter `index` (guard_common::STAT_*) of this CPU.
pub fn count_stat(index: u32) {
    if let Some(p) = STATS.get_ptr_mut(index) {
        unsafe { *p += 1 };
    }
}

/// The counter for `key`, created at zero when missing. None when the map is full.
#[inline(always)]
pub fn counter(key: &CounterKey) -> Option<*mut Counter> {
    if let Some(p) = COUNTERS.get_ptr_mut(key) {
        return Some(p);
    }
    // A concurrent creator may win the insert; the lookup below finds its entry.
    // Zeros from `opaque_zero`, not `..Default::default()`: see there.
    let z = opaque_zero() as u64;
    let fresh = Counter {
        active: z,
        peak: z,
        admitted: z,
        shed: z,
        would_shed: z,
        epoch: unsafe { bpf_ktime_get_ns() },
        connecting: z,
        rate_limited: z,
        handshake_limited: z,
        breaker_limited: z,
        breaker_opened: z,
        breaker_half_opened: z,
        breaker_closed: z,
        shedding_since: z,
        rate_tat: z,
        breaker_bad: z,
        breaker_clear: z,
    };
    let _ = COUNTERS.insert(key, fresh, BPF_NOEXIST as u64);
    COUNTERS.get_ptr_mut(key)
}

/// The counter of rule `rule_id`; null for NO_RULE (or an id past the array, which the
/// daemon never hands out). An array lookup, which the verifier inlines.
#[inline(always)]
pub fn rule_counter(rule_id: u32) -> *mut Counter {
    if rule_id == NO_RULE {
        return core::ptr::null_mut();
    }
    match RULE_COUNTERS.get_ptr_mut(rule_id) {
        Some(p) => p,
        None => core::ptr::null_mut(),
    }
}

/// The counter of scope `scope_id`; null for an id past the array (never handed out).
#[inline(always)]
pub fn scope_counter(scope_id: u32) -> *mut Counter {
    match SCOPE_COUNTERS.get_ptr_mut(scope_id) {
        Some(p) => p,
        None => core::ptr::null_mut(),
    }
}

/// Releases the admission the socket holds, if any; true for the one caller that did.
/// The atomic swap of `admitted` succeeds for exactly one caller, so concurrent paths
/// release once. A handshake still counted ends with it.
#[inline(always)]
pub fn release(state: *mut SockState) -> bool {
    // Most sockets hold no admission when asked (every connect asks first): a plain
    // load spares them the atomic swap. Only the swap decides who releases.
    if state.is_null() || unsafe { core::ptr::read_volatile(&raw const (*state).admitted) } != 1 {
        return false;
    }
    if unsafe { atomic_xchg::<u32, { SeqCst }>(&raw mut (*state).admitted, 0) } != 1 {
        return false;
    }
    end_handshake(state);
    for c in charged_counters(state) {
        if !c.is_null() {
            add(unsafe { &raw mut (*c).active }, u64::MAX);
        }
    }
    true
}

/// Ends the handshake the admission counts in `connecting`, once: when the connection
/// is established (sock_ops ACTIVE_ESTABLISHED_CB) or released, whichever is first.
#[inline(always)]
pub fn end_handshake(state: *mut SockState) {
    if state.is_null() || unsafe { core::ptr::read_volatile(&raw const (*state).connecting) } == 0
    {
        return;
    }
    let levels = unsafe { atomic_xchg::<u32, { SeqCst }>(&raw mut (*state).connecting, 0) };
    for (i, c) in charged_counters(state).into_iter().enumerate() {
        if levels & (1 << i) != 0 && !c.is_null() {
            add(unsafe { &raw mut (*c).connecting }, u64::MAX);
        }
    }
}

/// The destination counter the socket's admission charged, if it charged one and it is
/// still there; else null.
#[inline(always)]
pub fn dst_counter(state: *mut SockState) -> *mut Counter {
    let (charged, dst_epoch) = unsafe { ((*state).charged, (*state).dst_epoch) };
    if charged & 1 == 0 {
        return core::ptr::null_mut();
    }
    match COUNTERS.get_ptr_mut(unsafe { &(*state).dst }) {
        // The daemon forgets idle destination entries; one created again since this
        // admission does not hold it.
        Some(c) if unsafe { (*c).epoch } == dst_epoch => c,
        _ => core::ptr::null_mut(),
    }
}

/// The counters the socket's admission charged (null where a level was not): bit 0 of
/// `charged` destination, 1 rule, 2 scope.
#[inline(always)]
fn charged_counters(state: *mut SockState) -> [*mut Counter; 3] {
    let (dst, charged) = unsafe { ((*state).dst, (*state).charged) };
    [
        dst_counter(state),
        if charged & 2 != 0 {
            rule_counter(dst.rule_id)
        } else {
            core::ptr::null_mut()
        },
        if charged & 4 != 0 {
            scope_counter(dst.scope_id)
        } else {
            core::ptr::null_mut()
        },
    ]
}

/// Takes a token from the counter's bucket (`take_token_at`).
#[inline(always)]
pub fn take_token(c: *mut Counter, interval: u64, burst: u32, now: u64) -> bool {
    take_token_at(unsafe { &raw mut (*c).rate_tat }, interval, burst, now)
}

/// Takes a token from the bucket of `burst` tokens refilled one per `interval` ns whose
/// theoretical arrival time is at `tat`, at `now` (CLOCK_MONOTONIC ns); false when it
/// holds none. A compare-and-swap of the theoretical arrival time, so concurrent
/// attempts each take a distinct token. Beyond 8 lost races it admits, counted as an
/// internal error. A BPF subprogram, like `raise_peak`.
#[inline(never)]
pub fn take_token_at(tat: *mut u64, interval: u64, burst: u32, now: u64) -> bool {
    let limit = now + interval * burst as u64;
    let mut seen = unsafe { core::ptr::read_volatile(tat) };
    if seen > limit {
        // Past what these limits allow: a reload lowered the interval or the burst. The
        // bucket is empty, not in debt (and not refilled).
        let _ = replace(tat, seen, limit);
        return false;
    }
    for _ in 0..8 {
        let next = if seen > now { seen } else { now } + interval;
        if next > limit {
            return false;
        }
        let (cur, ok) = unsafe { atomic_cxchg::<u64, { SeqCst }, { SeqCst }>(tat, seen, next) };
        if ok {
            return true;
        }
        seen = cur;
    }
    count_stat(STAT_INTERNAL_ERRORS);
    true
}

/// Adds 1 to the count under `key`, creating it at 1. A full map loses the event (these
/// counts feed diagnosis, not admission), which is counted as a lost event, not as an
/// internal error: no connection went uncounted.
#[inline(always)]
pub fn bump<K>(map: &aya_ebpf::maps::HashMap<K, u64>, key: &K) {
    if let Some(p) = map.get_ptr_mut(key) {
        add(p, 1);
        return;
    }
    if map.insert(key, 1, BPF_NOEXIST as u64).is_ok() {
        return;
    }
    // A concurrent creator won the insert, or the map is full.
    match map.get_ptr_mut(key) {
        Some(p) => {
            add(p, 1);
        }
        None => count_stat(guard_common::STAT_LOST_EVENTS),
    }
}
