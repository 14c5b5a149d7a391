//! The shedding events of the connect path: a level (destination, rule, scope) that
//! starts to refuse attempts over a limit, and one that admits within every limit again.
//! One event per change, by the attempt that swaps the counter's `shedding_since`.
use guard_common::{Counter, CounterKey, EVENT_SHEDDING_STARTED, EVENT_SHEDDING_STOPPED, NO_RULE};

use crate::{
    accounting::replace,
    clock,
    events::{self, Detail},
    net::{opaque_zero, words_addr},
};

/// The levels of `over_levels` that were not shedding start to, for `reasons`. A BPF
/// subprogram, like `stopped`, so that the verifier's paths through it end at its
/// return.
#[inline(never)]
pub fn started(counters: &[*mut Counter; 3], dst: &CounterKey, over_levels: u32, reasons: u32) {
    for (i, &c) in counters.iter().enumerate() {
        if over_levels & (1 << i) != 0
            && !c.is_null()
            && unsafe { core::ptr::read_volatile(&raw const (*c).shedding_since) } == 0
        {
            report(c, dst, i as u32, reasons);
        }
    }
}

/// After an attempt admitted within every limit: every level that was shedding stops.
/// Looks first, so that the common case (nothing was shedding) makes no call.
#[inline(always)]
pub fn stopped_if_shedding(counters: &[*mut Counter; 3], dst: &CounterKey) {
    if counters.iter().any(|&c| {
        !c.is_null() && unsafe { core::ptr::read_volatile(&raw const (*c).shedding_since) } != 0
    }) {
        stopped(counters, dst);
    }
}

/// Every level that was shedding stops.
#[inline(never)]
fn stopped(counters: &[*mut Counter; 3], dst: &CounterKey) {
    for (i, &c) in counters.iter().enumerate() {
        if !c.is_null() {
            report(c, dst, i as u32, 0);
        }
    }
}

/// The change found: started for `reasons`, or stopped for 0.
#[inline(always)]
fn report(c: *mut Counter, dst: &CounterKey, level: u32, reasons: u32) {
    let since = unsafe { &raw mut (*c).shedding_since };
    let seen = unsafe { core::ptr::read_volatile(since) };
    let now = clock::now_ns();
    let (kind, next) = if reasons != 0 {
        (EVENT_SHEDDING_STARTED, now)
    } else {
        (EVENT_SHEDDING_STOPPED, 0)
    };
    if (seen == 0) == (next == 0) || !replace(since, seen, next) {
        return;
    }
    let z = opaque_zero();
    let key = match level {
        0 => *dst,
        _ => CounterKey {
            scope_id: dst.scope_id,
            rule_id: if level == 1 { dst.rule_id } else { NO_RULE },
            port: 0,
            _pad: 0,
            addr: words_addr([z, z, z, z]),
        },
    };
    events::emit(
        kind,
        &key,
        now,
        &Detail {
            level,
            reasons,
            step: z,
            percent: z,
            counts: [z; 3],
            open_ns: z as u64,
        },
    );
}
