//! Atomic counter updates and the release of an admission.
use core::intrinsics::{
    AtomicOrdering::{Relaxed, SeqCst},
    atomic_cxchg, atomic_xadd, atomic_xchg,
};

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::generated::bpf_ktime_get_ns};
use guard_common::{Counter, CounterKey, LEVEL_DST, LEVEL_RULE, LEVEL_SCOPE, NO_RULE, SockState};

use crate::maps::{COUNTERS, STATS};

/// Atomic fetch-and-add; returns the previous value.
///
/// SeqCst, not Relaxed: LLVM 22's BPF backend lowers a Relaxed fetch-add to the
/// non-fetching `lock +=` (BPF_ADD without BPF_FETCH) even when the old value is used,
/// and then reads the increment back as if it were the old value.
#[inline(always)]
pub fn add(field: *mut u64, delta: u64) -> u64 {
    unsafe { atomic_xadd::<u64, u64, { SeqCst }>(field, delta) }
}

/// Raises `peak` to `value` unless a concurrent update already went higher.
#[inline(always)]
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

pub fn internal_error(index: u32) {
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
    // Zeros from `opaque_zero`, not `..Default::default()`: see `levels`.
    let z = opaque_zero() as u64;
    let fresh = Counter {
        active: z,
        peak: z,
        admitted: z,
        shed: z,
        would_shed: z,
        epoch: unsafe { bpf_ktime_get_ns() },
    };
    let _ = COUNTERS.insert(key, fresh, BPF_NOEXIST as u64);
    COUNTERS.get_ptr_mut(key)
}

/// The levels a destination key is counted at: destination, rule (when one matched),
/// scope. The same keys as `CounterKey::at_level`, built from a zero the compiler cannot
/// see: zeros it sees are merged into a call to memset, which on BPF is a subprogram
/// storing one byte per iteration (about five instructions a byte).
#[inline(always)]
pub fn levels(dst: &CounterKey) -> [Option<CounterKey>; 3] {
    let z = opaque_zero();
    let above = |rule_id: u32, level: u32| CounterKey {
        scope_id: dst.scope_id,
        rule_id,
        level,
        port: z as u16,
        _pad: z as u16,
        addr: words_addr([z; 4]),
    };
    let rule = if dst.rule_id == NO_RULE {
        None
    } else {
        Some(above(dst.rule_id, LEVEL_RULE))
    };
    [
        Some(dst.at_level(LEVEL_DST)),
        rule,
        Some(above(NO_RULE, LEVEL_SCOPE)),
    ]
}

/// The bytes of an address (network order) given as four words holding them in memory
/// order, as the connect contexts give them: stored as four words, where building the
/// bytes one by one on a zeroed array costs a memset loop (see `levels`).
#[inline(always)]
pub fn words_addr(words: [u32; 4]) -> [u8; 16] {
    // Same size, and every bit pattern is a valid [u8; 16].
    unsafe { core::mem::transmute::<[u32; 4], [u8; 16]>(words) }
}

/// 0, from read-only data: see `levels`.
#[inline(always)]
pub fn opaque_zero() -> u32 {
    static ZERO: u32 = 0;
    unsafe { core::ptr::read_volatile(&ZERO) }
}

/// Releases the admission the socket holds, if any. The atomic swap of `admitted`
/// succeeds for exactly one caller, so concurrent paths release once.
#[inline(always)]
pub fn release(state: *mut SockState) {
    // Most sockets hold no admission when asked (every connect asks first): a plain
    // load spares them the atomic swap. Only the swap decides who releases.
    if state.is_null() || unsafe { core::ptr::read_volatile(&raw const (*state).admitted) } != 1 {
        return;
    }
    if unsafe { atomic_xchg::<u32, { SeqCst }>(&raw mut (*state).admitted, 0) } != 1 {
        return;
    }
    let (dst, charged, dst_epoch) = unsafe { ((*state).dst, (*state).charged, (*state).dst_epoch) };
    for (i, key) in levels(&dst).iter().enumerate() {
        if charged & (1 << i) == 0 {
            continue;
        }
        if let Some(c) = key.as_ref().and_then(|k| COUNTERS.get_ptr_mut(k)) {
            // The daemon forgets idle destination entries; one created again since
            // this admission does not hold it.
            if i == 0 && unsafe { (*c).epoch } != dst_epoch {
                continue;
            }
            add(unsafe { &raw mut (*c).active }, u64::MAX);
        }
    }
}

/// Adds 1 to the count under `key`, creating it at 1. A full map loses the event (these
/// counts feed diagnosis, not admission) and counts an internal error.
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
        None => internal_error(guard_common::STAT_INTERNAL_ERRORS),
    }
}
