//! Circuit breakers per destination endpoint, on connect outcomes seen in the kernel.
//!
//! The connect hook decides (`decide`) and makes every transition, at the first attempt
//! that finds one due: closed to open when the window holds `min_samples` outcomes and
//! a ratio is reached; open to half-open when `open_until` passes; half-open to open on
//! a failure, to the next ramp step after `step_successes` successes, and to closed at
//! 100 %. Each move is a compare-and-swap of `status`, so one attempt makes it and
//! reports it (`EVENTS`). The outcome paths (`outcome`) only count: sock_ops
//! ACTIVE_ESTABLISHED_CB a success (slow when the handshake took `slow_ns` or more),
//! the move from SYN_SENT to TCP_CLOSE a failure: refused (a RST to the SYN), timed out
//! (the kernel's SYN retries ran out), unreachable (an ICMP error), or abandoned by its
//! owner (closed while connecting: an application's own connect timeout).
//!
//! A closed breaker with nothing due costs a connect no lookup: the connect hook keeps
//! in the destination's counter the policy's serial and the count of failed and slow
//! outcomes and openings at which `decide` last found it so (`Counter::breaker_clear`,
//! `breaker_bad`), and skips the breaker while both still hold. A failed or slow outcome
//! adds to the count after it is in the window, and an opening adds to it, so the next
//! connect decides again, whatever word a concurrent decision wrote. A closed breaker
//! thus opens at the first attempt after a failed or slow outcome, a reload or another
//! opening that finds the window past a ratio (a window that gets there by successes
//! alone, or by older outcomes ageing out, waits for the next failed or slow one).
use core::intrinsics::{AtomicOrdering::SeqCst, atomic_cxchg, atomic_xchg};

use aya_ebpf::bindings::BPF_NOEXIST;
use guard_common::{
    BREAKER_CLOSED, BREAKER_HALF_OPEN, BREAKER_OPEN, BREAKER_SLOTS, Breaker, BreakerConf,
    Counter, CounterKey, EVENT_BREAKER_CLOSED, EVENT_BREAKER_HALF_OPEN, EVENT_BREAKER_OPENED,
    MAX_RAMP_STEPS, SockState,
};

use crate::{
    accounting::{add, dst_counter, replace},
    clock,
    events::{self, Detail},
    maps::BREAKERS,
    net::opaque_zero,
};

/// The phase of an attempt admitted past a clear breaker (no lookup: its phase is not
/// known). Only a half-open phase is ever compared, and a breaker would need 2^32
/// transitions to reach this one.
const NO_PHASE: u32 = u32::MAX;

/// A zeroed breaker in read-only data, inserted as it is (one built on the stack costs
/// a byte-by-byte memset).
static CLOSED: Breaker = Breaker {
    status: 0,
    open_until: 0,
    ramp_credit: 0,
    slot_ns: 0,
    slow_ns: 0,
    slots: [0; BREAKER_SLOTS],
    opens_in_row: 0,
    successes: 0,
    half_open_failed: 0,
    _pad: 0,
};

/// BREAKER_SLOTS, from read-only data (see `window`).
static SLOTS: usize = BREAKER_SLOTS;

/// Bits of a slot word: its number (low 16 bits of time / slot_ns) and three counts.
const SLOT_TAG: u64 = 0xffff << 48;
const ENDED: u64 = 1 << 32;
const FAILED: u64 = 1 << 16;
const SLOW: u64 = 1;

/// What the breaker says of one attempt.
pub struct Decision {
    pub shed: bool,
    /// Closed, and the window short of every ratio: nothing is due until an outcome
    /// fails or is slow.
    pub clear: bool,
    /// The phase an admitted attempt's outcome counts in.
    pub phase: u32,
    /// The transition this attempt made (an EVENT_BREAKER_* kind), or 0.
    pub moved: u32,
}

impl Decision {
    /// Out of `decide`'s word: None for 0.
    #[inline(always)]
    pub fn unpack(word: u64) -> Option<Decision> {
        (word & VALID != 0).then(|| Decision {
            shed: word & 1 != 0,
            clear: word & CLEAR != 0,
            phase: (word >> 32) as u32,
            moved: ((word >> 8) & 0xff) as u32,
        })
    }
}

/// Bits of `decide`'s word: a decision (else the breaker's entry could not be made);
/// `Decision::clear`.
const VALID: u64 = 2;
const CLEAR: u64 = 4;

#[inline(always)]
fn status(state: u32, step: u32, phase: u32) -> u64 {
    state as u64 | ((step as u64) << 8) | ((phase as u64) << 32)
}

/// `decide`'s word for `key`, or a pass without a look while the destination's counter
/// `dc` says the breaker is clear under the policy of `serial`. Keeps that word: stored
/// when the decision finds the breaker clear, made stale when it opens it.
#[inline(always)]
pub fn decide_unless_clear(
    dc: *mut Counter,
    serial: u32,
    key: &CounterKey,
    conf: &BreakerConf,
    now: u64,
) -> u64 {
    // What a clear breaker left, and what it leaves now: both read before the window is.
    let (seen, clear) = if dc.is_null() {
        (0, u64::MAX)
    } else {
        let bad = unsafe { core::ptr::read_volatile(&raw const (*dc).breaker_bad) };
        (
            unsafe { core::ptr::read_volatile(&raw const (*dc).breaker_clear) },
            (serial as u64) << 32 | (bad & 0xffff_ffff),
        )
    };
    if seen == clear {
        return VALID | (NO_PHASE as u64) << 32;
    }
    let word = decide(key, conf, now);
    if let Some(d) = Decision::unpack(word)
        && !dc.is_null()
    {
        if d.clear {
            let _ = replace(unsafe { &raw mut (*dc).breaker_clear }, seen, clear);
        } else if d.moved == EVENT_BREAKER_OPENED {
            // Stales every clear word, this one and one a concurrent decision made from
            // the window before the opening.
            add(unsafe { &raw mut (*dc).breaker_bad }, 1);
        }
    }
    word
}

/// The breaker of `key` under `conf` at `now` (CLOCK_MONOTONIC ns), as a word for
/// `Decision::unpack`: 0 when its entry cannot be made (a full map: no breaker,
/// fail-open). A function of its own (a BPF subprogram), so that its stack is not the
/// connect hook's, which has little left, and its paths end at its return for the
/// verifier; a word, because BTF cannot describe an Option.
#[inline(never)]
fn decide(key: &CounterKey, conf: &BreakerConf, now: u64) -> u64 {
    match decision(key, conf, now) {
        Some(d) => {
            VALID
                | d.shed as u64
                | (d.clear as u64 * CLEAR)
                | ((d.moved as u64) << 8)
                | ((d.phase as u64) << 32)
        }
        None => 0,
    }
}

#[inline(always)]
fn decision(key: &CounterKey, conf: &BreakerConf, now: u64) -> Option<Decision> {
    let b = match BREAKERS.get_ptr_mut(key) {
        Some(b) => b,
        None => {
            let _ = BREAKERS.insert(key, &CLOSED, BPF_NOEXIST as u64);
            BREAKERS.get_ptr_mut(key)?
        }
    };
    let slot_ns = conf.window_ns / BREAKER_SLOTS as u64 + 1;
    unsafe {
        if (*b).slot_ns != slot_ns {
            (*b).slot_ns = slot_ns;
        }
        if (*b).slow_ns != conf.slow_ns {
            (*b).slow_ns = conf.slow_ns;
        }
    }
    let decision = |shed: bool, phase: u32, moved: u32| {
        Some(Decision {
            shed,
            clear: false,
            phase,
            moved,
        })
    };
    let mut st = unsafe { core::ptr::read_volatile(&raw const (*b).status) };
    let state = (st & 0xff) as u32;
    let phase = (st >> 32) as u32;
    if state == BREAKER_CLOSED {
        let w = window(b, now / slot_ns);
        let (ended, failed, slow) = (
            (w & 0xfffff) as u32,
            ((w >> 20) & 0xfffff) as u32,
            (w >> 40) as u32,
        );
        let trips = ended >= conf.min_samples
            && ended != 0
            && (failed as u64 * 1000 >= conf.failure_permille as u64 * ended as u64
                || (conf.slow_permille != 0
                    && slow as u64 * 1000 >= conf.slow_permille as u64 * ended as u64));
        if !trips {
            return Some(Decision {
                shed: false,
                clear: true,
                phase,
                moved: 0,
            });
        }
        let moved = open(b, st, conf, now, key, [ended, failed, slow]);
        return decision(true, phase, moved);
    }
    let mut moved = 0;
    if state == BREAKER_OPEN {
        if now < unsafe { core::ptr::read_volatile(&raw const (*b).open_until) } {
            return decision(true, phase, 0);
        }
        let next = status(BREAKER_HALF_OPEN, 0, phase.wrapping_add(1));
        // The half-open fields are made new before the status says half-open: an
        // attempt on another CPU that sees the new status must not see the last phase's.
        // (Nothing reads them while it is open.)
        unsafe {
            (*b).successes = 0;
            (*b).half_open_failed = 0;
            (*b).ramp_credit = 0;
        }
        if !cas(unsafe { &raw mut (*b).status }, st, next) {
            // Another attempt moved it first; this one waits for the next.
            return decision(true, phase, 0);
        }
        emit(
            key,
            EVENT_BREAKER_HALF_OPEN,
            0,
            conf.ramp[0] as u32,
            [0; 3],
            0,
            now,
        );
        moved = EVENT_BREAKER_HALF_OPEN;
        st = next;
    }
    // Half-open.
    let mut phase = (st >> 32) as u32;
    let mut step = ((st >> 8) & 0xff) as u32;
    if unsafe { core::ptr::read_volatile(&raw const (*b).half_open_failed) } != 0 {
        let successes = unsafe { (*b).successes };
        let moved = open(b, st, conf, now, key, [successes + 1, 1, 0]);
        return decision(true, phase, moved);
    }
    if unsafe { core::ptr::read_volatile(&raw const (*b).successes) } >= conf.step_successes {
        let up = step + 1;
        let percent = if (up as usize) < MAX_RAMP_STEPS && up < conf.n_steps {
            conf.ramp[up as usize] as u32
        } else {
            100
        };
        let next = if percent >= 100 {
            status(BREAKER_CLOSED, 0, phase.wrapping_add(1))
        } else {
            status(BREAKER_HALF_OPEN, up, phase.wrapping_add(1))
        };
        // As above: the step's fields are new before the step is.
        unsafe {
            (*b).successes = 0;
            (*b).ramp_credit = 0;
        }
        if !cas(unsafe { &raw mut (*b).status }, st, next) {
            return decision(true, phase, moved);
        }
        phase = phase.wrapping_add(1);
        if percent >= 100 {
            unsafe {
                (*b).opens_in_row = 0;
                clear(b);
            }
            emit(key, EVENT_BREAKER_CLOSED, 0, 100, [0; 3], 0, now);
            return decision(false, phase, EVENT_BREAKER_CLOSED);
        }
        emit(key, EVENT_BREAKER_HALF_OPEN, up, percent, [0; 3], 0, now);
        moved = EVENT_BREAKER_HALF_OPEN;
        step = up;
    }
    // Let through each attempt that takes the credit past a multiple of 100: exactly
    // the step's share of attempts, spread evenly.
    // A step past the ramp (a reload shortened it) lets everything through.
    let percent = if (step as usize) < MAX_RAMP_STEPS && step < conf.n_steps {
        conf.ramp[step as usize] as u64
    } else {
        100
    };
    let old = add(unsafe { &raw mut (*b).ramp_credit }, percent);
    let pass = (old + percent) / 100 > old / 100;
    decision(!pass, phase, moved)
}

/// Opens breaker `b` (status `st` when read) for its next opening's length, and reports
/// it with the counts that tripped it; EVENT_BREAKER_OPENED, or 0 when another attempt
/// moved it first.
#[inline(always)]
fn open(
    b: *mut Breaker,
    st: u64,
    conf: &BreakerConf,
    now: u64,
    key: &CounterKey,
    counts: [u32; 3],
) -> u32 {
    let phase = (st >> 32) as u32;
    let in_row = unsafe { (*b).opens_in_row };
    let shift = if in_row < 16 { in_row } else { 16 };
    // Capped before the shift, which could overflow.
    let open_ns = if conf.open_ns > conf.max_open_ns >> shift {
        conf.max_open_ns
    } else {
        conf.open_ns << shift
    };
    // Written before the status says open: an attempt on another CPU that sees it open
    // must see when it half-opens (nothing reads this in another state).
    unsafe { (*b).open_until = now + open_ns };
    if !cas(
        unsafe { &raw mut (*b).status },
        st,
        status(BREAKER_OPEN, 0, phase.wrapping_add(1)),
    ) {
        return 0;
    }
    unsafe {
        (*b).opens_in_row = in_row + 1;
        clear(b);
    }
    emit(key, EVENT_BREAKER_OPENED, 0, 0, counts, open_ns, now);
    EVENT_BREAKER_OPENED
}

/// Outcomes ended, failed and slow in the slots of the window ending with slot number
/// `slot`, in bits 0-19, 20-39 and 40-59 (16 slots of up to 65,535 each). Without a
/// branch per slot, each of which would be a path for the verifier to walk; a function
/// of its own (a BPF subprogram), whose stack is not its caller's.
#[inline(never)]
fn window(b: *mut Breaker, slot: u64) -> u64 {
    let current = slot & 0xffff;
    let (mut ended, mut failed, mut slow) = (0u64, 0u64, 0u64);
    // A loop, not sixteen copies of its body (whose registers would spill to the stack): the
    // compiler cannot unroll a count it does not know.
    let n = unsafe { core::ptr::read_volatile(&SLOTS) };
    for i in 0..n {
        let Some(&w) = (unsafe { &(*b).slots }).get(i) else {
            break;
        };
        let w = unsafe { core::ptr::read_volatile(&w) };
        // Age in slots, 0 to 65535; all ones when below BREAKER_SLOTS, else 0.
        let age = current.wrapping_sub(w >> 48) & 0xffff;
        let keep = 0u64.wrapping_sub(age.wrapping_sub(BREAKER_SLOTS as u64) >> 63);
        ended += (w >> 32) & 0xffff & keep;
        failed += (w >> 16) & 0xffff & keep;
        slow += w & 0xffff & keep;
    }
    ended | failed << 20 | slow << 40
}

/// Empties the window (at opening and closing: outcomes from before do not count after).
#[inline(always)]
unsafe fn clear(b: *mut Breaker) {
    for i in 0..BREAKER_SLOTS {
        unsafe { atomic_xchg::<u64, { SeqCst }>(&raw mut (*b).slots[i], 0) };
    }
}

#[inline(always)]
fn cas(p: *mut u64, expected: u64, new: u64) -> bool {
    unsafe { atomic_cxchg::<u64, { SeqCst }, { SeqCst }>(p, expected, new) }.1
}

/// Reports the outcome the socket's connect owes its breaker, once: `failed`, or a
/// success (slow when the handshake took the breaker's `slow_ns` or more). A socket
/// whose SYN never left (`armed` 0: the local port search failed) owes nothing.
#[inline(always)]
pub fn outcome(state: *mut SockState, failed: bool) {
    if state.is_null()
        || unsafe { core::ptr::read_volatile(&raw const (*state).breaker_owed) } != 1
        || unsafe { atomic_xchg::<u32, { SeqCst }>(&raw mut (*state).breaker_owed, 0) } != 1
        || unsafe { (*state).armed } == 0
    {
        return;
    }
    let b = BREAKERS.get_ptr_mut(unsafe { &(*state).dst });
    let now = clock::now_ns();
    let slow = b.is_some_and(|b| {
        let slow_ns = unsafe { (*b).slow_ns };
        // Saturating: a restart measures the clock's offset anew, which can put `now`
        // a little behind a connect time that the previous daemon's clock gave.
        !failed && slow_ns != 0 && now.saturating_sub(unsafe { (*state).connect_ns }) >= slow_ns
    });
    if let Some(b) = b {
        count(b, now, failed, slow);
    }
    // Once in the window (or with no entry, which the next decision makes again): the
    // next connect decides.
    if failed || slow {
        let c = dst_counter(state);
        if !c.is_null() {
            add(unsafe { &raw mut (*c).breaker_bad }, 1);
        }
    }
    let Some(b) = b else {
        return;
    };
    let st = unsafe { core::ptr::read_volatile(&raw const (*b).status) };
    if (st & 0xff) as u32 == BREAKER_HALF_OPEN
        && (st >> 32) as u32 == unsafe { (*state).breaker_phase }
    {
        if failed || slow {
            unsafe { (*b).half_open_failed = 1 };
        } else {
            unsafe {
                core::intrinsics::atomic_xadd::<u32, u32, { SeqCst }>(&raw mut (*b).successes, 1)
            };
        }
    }
}

/// Adds an outcome to the window's current slot, starting the slot anew when it holds an
/// older one. Counts saturate at 65,535 a slot.
#[inline(always)]
fn count(b: *mut Breaker, now: u64, failed: bool, slow: bool) {
    let slot_ns = unsafe { (*b).slot_ns };
    if slot_ns == 0 {
        return;
    }
    let number = now / slot_ns;
    // A mask, not a remainder: the verifier bounds the index from it.
    let i = (number & (BREAKER_SLOTS as u64 - 1)) as usize;
    let p = unsafe { &raw mut (*b).slots[i] };
    let tag = (number & 0xffff) << 48;
    let add = ENDED | (failed as u64 * FAILED) | (slow as u64 * SLOW);
    let mut seen = unsafe { core::ptr::read_volatile(p) };
    for _ in 0..4 {
        let base = if seen & SLOT_TAG == tag { seen } else { tag };
        // A count at 0xffff stays there: its bit of `add` is dropped.
        let full = |shift: u64| ((base >> shift) & 0xffff).wrapping_add(1) >> 16 << shift;
        let next = base + (add & !(full(32) | full(16) | full(0)));
        let (now_seen, ok) = unsafe { atomic_cxchg::<u64, { SeqCst }, { SeqCst }>(p, seen, next) };
        if ok {
            return;
        }
        seen = now_seen;
    }
}

/// Reports a transition of `key`'s breaker.
#[inline(always)]
fn emit(
    key: &CounterKey,
    kind: u32,
    step: u32,
    percent: u32,
    counts: [u32; 3],
    open_ns: u64,
    now: u64,
) {
    let z = opaque_zero();
    events::emit(
        kind,
        key,
        now,
        &Detail {
            level: z,
            reasons: z,
            step,
            percent,
            counts,
            open_ns,
        },
    );
}
