//! Per-caller budgets of a listener guard (`per_source`): each caller (a source address
//! prefix) holds at most `max_connections` connections to the guarded listeners and
//! opens new ones at most at a rate; a SYN over either is refused before the kernel
//! makes any state for it.
//!
//! A caller's connection counts from the handshake's completion (the server socket's
//! move SYN_RECV -> ESTABLISHED) until that socket reaches TCP_CLOSE, in `CALLERS`,
//! whose entries only completed handshakes create: a spoofed source, which never
//! completes one, neither holds a count nor takes an entry. The SYN is checked against
//! the completed connections plus the caller's handshakes in flight (admitted SYNs not
//! yet completed, each held for [`HANDSHAKE_SLOT_NS`] to twice that), kept with the
//! caller's token bucket in `SOURCES`, an LRU table that spoofed sources may churn.

/// Key of `CALLERS` and `SOURCES`: a caller of a listener guard.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CallerKey {
    /// Stable id of the `[[listener]]` guard (`LISTENER_IDS`).
    pub listener_id: u32,
    /// The caller's address masked to the guard's prefix (network order, IPv4
    /// IPv4-mapped): an IPv4 caller is masked to 96 + `prefix` bits, an IPv6 one to
    /// `prefix6`.
    pub addr: [u8; 16],
}

/// Value of `CALLERS`: a caller's completed connections. Made by the first handshake it
/// completes; the daemon removes an entry that stayed at 0 active for a whole sweep.
/// Every field is updated with atomic instructions. Units: connections.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallerCount {
    /// Completed and not yet in TCP_CLOSE.
    pub active: u64,
    /// Highest `active` seen.
    pub peak: u64,
    /// Handshakes completed (total).
    pub admitted: u64,
    /// When the entry was made (ns since boot): a socket releases into the entry it was
    /// counted in, never into one made again after the daemon removed it.
    pub epoch: u64,
}

/// Value of `SOURCES`: what a caller's SYNs are checked with, made by its first SYN.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SourceState {
    /// The caller's token bucket, as a theoretical arrival time (see
    /// `Counter::rate_tat`).
    pub rate_tat: u64,
    /// Admitted SYNs whose handshakes have not completed, in two slots of
    /// HANDSHAKE_SLOT_NS: each word holds its slot number (low 32 bits of
    /// now / HANDSHAKE_SLOT_NS) in its high half and its count in its low half. A slot
    /// counts while it is the current or the previous one.
    pub in_flight: [u64; 2],
    /// SYNs refused (enforce mode), and those observe mode would have refused (totals).
    pub refused: u64,
    pub would_refuse: u64,
    /// Of `refused` and `would_refuse`: over the rate (the others were over
    /// `max_connections`).
    pub rate_limited: u64,
    /// CLOCK_MONOTONIC ns (tick clock) of the first refusal since the last admission; 0
    /// while none: one event when it starts, one when it stops.
    pub refusing_since: u64,
}

/// Socket storage `CALLER_SOCKS`: on a server socket whose completed handshake a
/// caller's count holds, made by the completion.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallerHold {
    /// 1 while the count is held; swapped to 0 by the one path that releases it.
    pub held: u32,
    pub _pad: u32,
    /// `CallerCount::epoch` of the entry counted in.
    pub epoch: u64,
    pub key: CallerKey,
}

/// Value of `PER_SOURCE_TOTALS`, by listener id: the guard's per-source refusals of
/// SYNs (totals), as `SourceState` counts them per caller.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PerSourceTotals {
    pub refused: u64,
    pub would_refuse: u64,
    pub rate_limited: u64,
}

/// A guard's per-caller budgets, in its `ListenerEntry`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PerSource {
    /// PER_SOURCE_OFF, PER_SOURCE_RST or PER_SOURCE_DROP: what a refused SYN gets.
    pub action: u32,
    /// Most connections a caller holds (completed, plus handshakes in flight); 0: none.
    pub max_connections: u32,
    /// The caller's new-connection rate, as ns between two tokens; 0: no rate.
    pub rate_interval_ns: u64,
    /// Tokens the caller's bucket holds when full.
    pub burst: u32,
    /// Bits of the IPv4-mapped address that name an IPv4 caller (96 + prefix), and of
    /// an IPv6 address an IPv6 caller.
    pub prefix4: u32,
    pub prefix6: u32,
    pub _pad: u32,
}

pub const PER_SOURCE_OFF: u32 = 0;
pub const PER_SOURCE_RST: u32 = 1;
pub const PER_SOURCE_DROP: u32 = 2;

/// How long an admitted SYN counts as a handshake in flight at least (at most twice
/// this): the kernel's initial SYN-ACK timeout (TCP_TIMEOUT_INIT), past which a
/// handshake that has not completed is a slow client's or a spoofed source's.
pub const HANDSHAKE_SLOT_NS: u64 = 1_000_000_000;

/// Size of `CALLERS`: callers with completed connections (or, until the daemon's next
/// sweep, none left), over every guard.
pub const MAX_CALLERS: u32 = 65536;
/// Size of `SOURCES` (an LRU table): callers whose SYNs were seen, over every guard.
pub const MAX_SOURCES: u32 = 131072;

/// `Event::level` of a caller's refusal events: the key's `scope_id` is the listener
/// id, `rule_id` the prefix length of its address (bits of the IPv4-mapped form), and
/// `addr` the caller's masked address.
pub const LEVEL_CALLER: u32 = 3;
