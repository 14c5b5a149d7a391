//! EVENTS, the ring buffer of what changed and why (guard_common::Event): breaker
//! transitions, and keys that start and stop shedding. Each is written in place in the
//! ring buffer (no copy on the stack, which the connect hook has little of left).
use guard_common::{CounterKey, Event, STAT_LOST_EVENTS};

use crate::{accounting::count_stat, maps::EVENTS};

/// What an event says besides its kind, key and time; zeros where it does not apply.
#[derive(Clone, Copy)]
pub struct Detail {
    pub level: u32,
    pub reasons: u32,
    pub step: u32,
    pub percent: u32,
    /// Outcomes ended, failed and slow.
    pub counts: [u32; 3],
    pub open_ns: u64,
}

/// Writes an event; a full ring buffer loses it, counted as a lost event. Inlined: a
/// frame of its own below the breaker's would pass the 512 bytes that 6.1 allows for a
/// chain of calls.
#[inline(always)]
pub fn emit(kind: u32, key: &CounterKey, now: u64, d: &Detail) {
    let Some(mut entry) = EVENTS.reserve::<Event>(0) else {
        count_stat(STAT_LOST_EVENTS);
        return;
    };
    let p = entry.as_mut_ptr();
    // Field by field, volatile: stores of zeros side by side would be merged into a
    // memset, a byte-by-byte loop on BPF.
    unsafe {
        use core::ptr::write_volatile as w;
        w(&raw mut (*p).time_ns, now);
        w(&raw mut (*p).kind, kind);
        w(&raw mut (*p).step, d.step);
        w(&raw mut (*p).percent, d.percent);
        w(&raw mut (*p).ended, d.counts[0]);
        w(&raw mut (*p).failures, d.counts[1]);
        w(&raw mut (*p).slow, d.counts[2]);
        w(&raw mut (*p).reasons, d.reasons);
        w(&raw mut (*p).open_ns, d.open_ns);
        w(&raw mut (*p).key, *key);
        w(&raw mut (*p).level, d.level);
    }
    entry.submit(0);
}
