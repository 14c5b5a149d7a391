//! Per-caller budgets of listener guards (guard_common::callers). The per-SYN listener
//! program checks a SYN (`check`) against its caller's completed connections
//! (`CALLERS`), handshakes in flight and token bucket (`SOURCES`); the state tracepoint
//! counts a handshake's completion (`established`) and releases it when the server
//! socket reaches TCP_CLOSE (`closed`).
//!
//! The release is never missed and made once: the swap of `CallerHold::held` decides,
//! and two programs try it. A tracing program is skipped when it fires while the same
//! program runs on that CPU (a softirq closing a socket during a run in process
//! context; the kernel counts the skip in the program's recursion_misses), and no run
//! is inside two programs at once: `caller_destroy`, at the socket's destruction
//! (tcp_v4_destroy_sock, also IPv6's), releases what the state tracepoint's skipped run
//! left. Only the socket's own state changes release, which a forged RST outside the
//! window never makes (the kernel checks its sequence number first).
use core::intrinsics::{AtomicOrdering::SeqCst, atomic_cxchg, atomic_xchg};

use aya_ebpf::{
    bindings::{BPF_NOEXIST, bpf_sock},
    helpers::generated::bpf_ktime_get_ns,
    macros::btf_tracepoint,
    programs::BtfTracePointContext,
};
use guard_common::{
    CounterKey, EVENT_CALLER_ADMITTED, EVENT_CALLER_REFUSED, ListenerEntry, ListenerKey,
    MODE_ENFORCE, NO_LISTENER, REASON_BUDGET, REASON_OBSERVE, REASON_RATE, STAT_INTERNAL_ERRORS,
    callers::{
        CallerCount, CallerKey, HANDSHAKE_SLOT_NS, LEVEL_CALLER, PER_SOURCE_OFF, PerSource,
        PerSourceTotals, SourceState,
    },
};

use crate::{
    accounting::{add, count_stat, raise_peak, replace, take_token_at},
    clock,
    events::{self, Detail},
    maps::{CALLER_GUARDS, CALLERS, LISTENERS, PER_SOURCE_TOTALS, SOURCES, caller_hold},
    net::{opaque_zero, words_addr},
    sock_fields,
};

/// No slot was taken.
const NO_SLOT: u64 = u64::MAX;
/// Slot numbers are the low 32 bits of now / HANDSHAKE_SLOT_NS.
const SLOT_MASK: u64 = 0xffff_ffff;

/// The verdict on a SYN from `addr` (words of the maps' form) to a guard of `entry`: 0
/// to let it pass, else the PER_SOURCE_* action that refuses it. Observe mode counts a
/// would-be refusal and lets it pass.
#[inline(always)]
pub fn check(addr: [u32; 4], entry: &ListenerEntry) -> u32 {
    let ps = entry.per_source;
    if ps.action == PER_SOURCE_OFF {
        return 0;
    }
    let (key, bits) = caller_key(entry.listener_id, addr, &ps);
    let Some(src) = source(&key) else {
        count_stat(STAT_INTERNAL_ERRORS);
        return 0;
    };
    let now = clock::now_ns();
    let mut reasons = 0;
    let mut slot = NO_SLOT;
    if ps.max_connections != 0 {
        // Taken first, then checked: of SYNs checked at once on several CPUs, each sees
        // the others' slots, so together they never pass the budget.
        slot = reserve(src, now);
        // Handshakes in flight first, then the completed: a completion counts itself
        // completed, then leaves the flight, so between the two reads it is seen at most
        // twice (a SYN refused that would fit, at the edge of the budget), never missed.
        let flying = in_flight(src, now);
        let active = match CALLERS.get_ptr(&key) {
            Some(c) => unsafe { core::ptr::read_volatile(&raw const (*c).active) },
            None => 0,
        };
        // Signed: a release into an entry the daemon swept and made again is skipped.
        let active = if (active as i64) < 0 { 0 } else { active };
        if active + flying > ps.max_connections as u64 {
            reasons |= REASON_BUDGET;
        }
    }
    if reasons == 0
        && ps.rate_interval_ns != 0
        && !take_token_at(
            unsafe { &raw mut (*src).rate_tat },
            ps.rate_interval_ns,
            ps.burst,
            now,
        )
    {
        reasons |= REASON_RATE;
    }
    let since = unsafe { &raw mut (*src).refusing_since };
    if reasons == 0 {
        if unsafe { core::ptr::read_volatile(since) } != 0 {
            report(since, &key, bits, 0, now);
        }
        return 0;
    }
    let enforce = entry.mode == MODE_ENFORCE;
    if enforce && slot != NO_SLOT {
        leave(src, slot);
    }
    refused(src, entry.listener_id, enforce, reasons);
    if unsafe { core::ptr::read_volatile(since) } == 0 {
        let observe = if enforce { 0 } else { REASON_OBSERVE };
        report(since, &key, bits, reasons | observe, now);
    }
    if enforce { ps.action } else { 0 }
}

/// Counts a refusal (observe mode: a would-be one) for `reasons`, for the caller and the
/// guard.
#[inline(always)]
fn refused(src: *mut SourceState, listener_id: u32, enforce: bool, reasons: u32) {
    let rate = reasons & REASON_RATE != 0;
    unsafe {
        add(
            if enforce {
                &raw mut (*src).refused
            } else {
                &raw mut (*src).would_refuse
            },
            1,
        );
        if rate {
            add(&raw mut (*src).rate_limited, 1);
        }
    }
    let Some(t) = totals(listener_id) else {
        count_stat(guard_common::STAT_LOST_EVENTS);
        return;
    };
    unsafe {
        add(
            if enforce {
                &raw mut (*t).refused
            } else {
                &raw mut (*t).would_refuse
            },
            1,
        );
        if rate {
            add(&raw mut (*t).rate_limited, 1);
        }
    }
}

/// The state tracepoint saw the server socket `sk` complete its handshake (SYN_RECV to
/// ESTABLISHED): the caller's count takes it, if its listener's guard has per-caller
/// budgets, and it leaves the caller's handshakes in flight.
#[inline(always)]
pub fn established(sk: *mut bpf_sock) {
    // With no offsets the rest is dead code to the verifier (read-only data).
    if !sock_fields::known() || CALLER_GUARDS.get(0).copied().unwrap_or(0) == 0 {
        return;
    }
    let conn = sock_fields::connection(sk.cast_const().cast());
    let Some(entry) = listener(conn.netns, conn.port, conn.local) else {
        return;
    };
    if entry.listener_id == NO_LISTENER || entry.per_source.action == PER_SOURCE_OFF {
        return;
    }
    let (key, _) = caller_key(entry.listener_id, conn.remote, &entry.per_source);
    hold(sk, &key);
    if let Some(src) = SOURCES.get_ptr_mut(&key) {
        let now = clock::now_ns();
        let slot = now / HANDSHAKE_SLOT_NS & SLOT_MASK;
        // The oldest first: handshakes complete about in the order of their SYNs.
        if !leave(src, slot.wrapping_sub(1) & SLOT_MASK) {
            leave(src, slot);
        }
    }
}

/// The guard of the listener a connection to `local`:`port` in namespace `netns` came
/// through: the listener on that address, else the wildcard one.
#[inline(always)]
fn listener(netns: u32, port: u16, local: [u32; 4]) -> Option<ListenerEntry> {
    let mut key = ListenerKey {
        netns,
        port,
        _pad: 0,
        addr: words_addr(local),
    };
    if let Some(e) = unsafe { LISTENERS.get(&key) } {
        return Some(*e);
    }
    let z = opaque_zero();
    key.addr = words_addr([z, z, z, z]);
    unsafe { LISTENERS.get(&key) }.copied()
}

/// Counts socket `sk`'s connection for caller `key`, noting it in the socket. A full
/// CALLERS, or storage that cannot be made, lets it go uncounted (an internal error).
#[inline(always)]
fn hold(sk: *mut bpf_sock, key: &CallerKey) {
    let Some(c) = caller_count(key) else {
        count_stat(STAT_INTERNAL_ERRORS);
        return;
    };
    let hold = caller_hold(sk, true);
    if hold.is_null() {
        count_stat(STAT_INTERNAL_ERRORS);
        return;
    }
    unsafe {
        if core::ptr::read_volatile(&raw const (*hold).held) != 0 {
            return;
        }
        (*hold).key = *key;
        (*hold).epoch = (*c).epoch;
        core::ptr::write_volatile(&raw mut (*hold).held, 1);
        let before = add(&raw mut (*c).active, 1);
        raise_peak(&raw mut (*c).peak, before.wrapping_add(1));
        add(&raw mut (*c).admitted, 1);
    }
}

/// Releases the caller's count the socket holds, if it holds one: the one path that
/// swaps `held` does. Called when the socket reaches TCP_CLOSE, and at its destruction.
#[inline(always)]
pub fn closed(sk: *mut bpf_sock) {
    let hold = caller_hold(sk, false);
    if hold.is_null() || unsafe { core::ptr::read_volatile(&raw const (*hold).held) } != 1 {
        return;
    }
    if unsafe { atomic_xchg::<u32, { SeqCst }>(&raw mut (*hold).held, 0) } != 1 {
        return;
    }
    if let Some(c) = CALLERS.get_ptr_mut(unsafe { &(*hold).key })
        && unsafe { (*c).epoch == (*hold).epoch }
    {
        add(unsafe { &raw mut (*c).active }, u64::MAX);
    }
}

/// tp_btf `tcp_destroy_sock`: a socket is destroyed (tcp_v4_destroy_sock, which IPv6
/// sockets run too). Releases a count that its move to TCP_CLOSE did not (see the
/// module's note). For a socket without storage it costs one storage lookup.
#[btf_tracepoint(function = "tcp_destroy_sock")]
pub fn caller_destroy(ctx: BtfTracePointContext) -> i32 {
    closed(ctx.arg(0));
    0
}

/// The caller's key of `addr` under a guard's budgets, and its prefix length (bits of
/// the maps' form).
#[inline(always)]
fn caller_key(listener_id: u32, addr: [u32; 4], ps: &PerSource) -> (CallerKey, u32) {
    let v4 = addr[0] == 0 && addr[1] == 0 && addr[2] == u32::from_ne_bytes([0, 0, 0xff, 0xff]);
    let bits = if v4 { ps.prefix4 } else { ps.prefix6 };
    let mut words = [0u32; 4];
    for (i, w) in words.iter_mut().enumerate() {
        *w = addr[i] & word_mask(bits.saturating_sub(i as u32 * 32));
    }
    (
        CallerKey {
            listener_id,
            addr: words_addr(words),
        },
        bits,
    )
}

/// The mask of a word (in memory order: network order) that keeps its first `keep` bits.
#[inline(always)]
fn word_mask(keep: u32) -> u32 {
    if keep >= 32 {
        u32::MAX
    } else if keep == 0 {
        0
    } else {
        (u32::MAX << (32 - keep)).to_be()
    }
}

/// The caller's SOURCES entry, made when missing (the least recently used one goes when
/// the table is full). None only when it cannot be made.
#[inline(always)]
fn source(key: &CallerKey) -> Option<*mut SourceState> {
    if let Some(p) = SOURCES.get_ptr_mut(key) {
        return Some(p);
    }
    let z = opaque_zero() as u64;
    let fresh = SourceState {
        rate_tat: z,
        in_flight: [z, z],
        refused: z,
        would_refuse: z,
        rate_limited: z,
        refusing_since: z,
    };
    let _ = SOURCES.insert(key, fresh, BPF_NOEXIST as u64);
    SOURCES.get_ptr_mut(key)
}

/// The caller's CALLERS entry, made when missing. None when the table is full.
#[inline(always)]
fn caller_count(key: &CallerKey) -> Option<*mut CallerCount> {
    if let Some(p) = CALLERS.get_ptr_mut(key) {
        return Some(p);
    }
    let z = opaque_zero() as u64;
    let fresh = CallerCount {
        active: z,
        peak: z,
        admitted: z,
        epoch: unsafe { bpf_ktime_get_ns() },
    };
    let _ = CALLERS.insert(key, fresh, BPF_NOEXIST as u64);
    CALLERS.get_ptr_mut(key)
}

/// The guard's totals, made when missing. None when the table is full.
#[inline(always)]
fn totals(listener_id: u32) -> Option<*mut PerSourceTotals> {
    if let Some(p) = PER_SOURCE_TOTALS.get_ptr_mut(&listener_id) {
        return Some(p);
    }
    let z = opaque_zero() as u64;
    let fresh = PerSourceTotals {
        refused: z,
        would_refuse: z,
        rate_limited: z,
    };
    let _ = PER_SOURCE_TOTALS.insert(&listener_id, fresh, BPF_NOEXIST as u64);
    PER_SOURCE_TOTALS.get_ptr_mut(&listener_id)
}

/// The word of handshake slot `index` (0 or 1).
#[inline(always)]
fn slot_word(src: *mut SourceState, index: u64) -> *mut u64 {
    unsafe { (&raw mut (*src).in_flight).cast::<u64>().add((index & 1) as usize) }
}

/// Counts an admitted SYN in the current slot; returns the slot's number, or NO_SLOT
/// past 8 lost races (then the SYN goes uncounted, an internal error). A BPF
/// subprogram, like `raise_peak`.
#[inline(never)]
fn reserve(src: *mut SourceState, now: u64) -> u64 {
    let slot = now / HANDSHAKE_SLOT_NS & SLOT_MASK;
    let w = slot_word(src, slot);
    let mut seen = unsafe { core::ptr::read_volatile(w) };
    for _ in 0..8 {
        // A word of an older slot starts over.
        let next = if seen >> 32 == slot {
            seen + 1
        } else {
            (slot << 32) | 1
        };
        let (cur, ok) = unsafe { atomic_cxchg::<u64, { SeqCst }, { SeqCst }>(w, seen, next) };
        if ok {
            return slot;
        }
        seen = cur;
    }
    count_stat(STAT_INTERNAL_ERRORS);
    NO_SLOT
}

/// Takes one handshake out of slot number `slot`, if its word still holds that slot
/// with one in it; whether it did. A BPF subprogram.
#[inline(never)]
fn leave(src: *mut SourceState, slot: u64) -> bool {
    let w = slot_word(src, slot);
    let mut seen = unsafe { core::ptr::read_volatile(w) };
    for _ in 0..8 {
        if seen >> 32 != slot || seen & SLOT_MASK == 0 {
            return false;
        }
        let (cur, ok) = unsafe { atomic_cxchg::<u64, { SeqCst }, { SeqCst }>(w, seen, seen - 1) };
        if ok {
            return true;
        }
        seen = cur;
    }
    false
}

/// The caller's handshakes in flight: those of the current slot and the previous one.
#[inline(always)]
fn in_flight(src: *mut SourceState, now: u64) -> u64 {
    let slot = now / HANDSHAKE_SLOT_NS & SLOT_MASK;
    let previous = slot.wrapping_sub(1) & SLOT_MASK;
    let mut n = 0;
    for i in 0..2 {
        let w = unsafe { core::ptr::read_volatile(slot_word(src, i)) };
        if w >> 32 == slot || w >> 32 == previous {
            n += w & SLOT_MASK;
        }
    }
    n
}

/// The caller started to be refused for `reasons`, or (0) admitted again: one event
/// per change, by the SYN that swaps `since`. A BPF subprogram.
#[inline(never)]
fn report(since: *mut u64, key: &CallerKey, bits: u32, reasons: u32, now: u64) {
    let seen = unsafe { core::ptr::read_volatile(since) };
    let (kind, next) = if reasons != 0 {
        (EVENT_CALLER_REFUSED, now)
    } else {
        (EVENT_CALLER_ADMITTED, 0)
    };
    if (seen == 0) == (next == 0) || !replace(since, seen, next) {
        return;
    }
    let z = opaque_zero();
    events::emit(
        kind,
        &CounterKey {
            scope_id: key.listener_id,
            rule_id: bits,
            port: 0,
            _pad: 0,
            addr: key.addr,
        },
        now,
        &Detail {
            level: LEVEL_CALLER,
            reasons,
            step: z,
            percent: z,
            counts: [z; 3],
            open_ns: z as u64,
        },
    );
}
