//! Types shared by the eBPF programs and the daemon. Every type is `#[repr(C)]`, with
//! explicit padding, because both sides read the same map memory.
//!
//! Addresses are 16 bytes in network byte order; IPv4 is stored IPv4-mapped
//! (`::ffff:a.b.c.d`), so an IPv4 destination reached through an AF_INET6 socket has
//! the same key as through an AF_INET socket. Ports are stored in host byte order.
//!
//! The names of the maps and programs (`names`) and the kernel constants both sides use
//! (`linux`) are defined here once; the `user` feature adds what only the daemon needs
//! (aya::Pod impls, the text form of an endpoint), and std with it.
#![cfg_attr(not(feature = "user"), no_std)]

pub mod addr;
pub mod callers;
pub mod drill;
pub mod linux;
pub mod names;

/// Rule id of connections that matched no rule of their scope.
pub const NO_RULE: u32 = u32::MAX;
/// Most candidate rules an address prefix can carry (see [`Candidates`]).
pub const MAX_CANDIDATES: usize = 8;
/// Most port ranges one rule can list.
pub const MAX_PORT_RANGES: usize = 8;

pub const MODE_OBSERVE: u32 = 0;
pub const MODE_ENFORCE: u32 = 1;

// Indices into the `STATS` per-CPU array of internal counters.

/// Fail-open admissions: connections let through uncounted at a level (a full counter
/// map) or at all (no socket storage).
pub const STAT_INTERNAL_ERRORS: u32 = 0;
/// Connections let through over a budget because the daemon's lease had run out.
pub const STAT_LEASE_EXPIRED: u32 = 1;
/// Diagnostic events lost to a full map: TIME_WAIT births, EADDRNOTAVAIL failures,
/// listener RSTs. No connection is let through or refused because of them.
pub const STAT_LOST_EVENTS: u32 = 2;
pub const STAT_COUNT: u32 = 3;

/// The daemon's default state root in bpffs (`connguard run --state-dir`): each layout's
/// state is its directory `v<STATE_LAYOUT>` there.
pub const STATE_ROOT: &str = "/sys/fs/bpf/connguard";

/// Version of the layout of the pinned maps (`names::map::PINNED`): their types, keys,
/// values and sizes, and the meaning of their fields. A daemon adopts pinned state of its
/// own layout only, so a change to any of them takes a new number: the next start
/// then seeds its counts from the socket table instead of misreading the old maps.
/// `COUNTERS` is the exception in size: the daemon that makes it sizes it
/// (`--max-destinations`), and the next ones adopt it at that size.
pub const STATE_LAYOUT: u32 = 8;

/// setsockopt(2) level and option name of a seeding request: the daemon, at a start with
/// no pinned state, asks the `seed` program (attached for that moment) to count a
/// connection that existed before, through a copy of its socket's fd (pidfd_getfd), with
/// a [`SeedRequest`] as the option value. The program answers 0 (seeded) or EPERM (the
/// socket has storage already, or no scope), and the kernel's own setsockopt never sees
/// the option.
pub const SOL_CONNGUARD: i32 = 0x636e_6775;
pub const SEED_SOCKET: i32 = 1;
/// setsockopt(2) option (level [`SOL_CONNGUARD`]) of the daemon's probe at start: the
/// `state_cb_probe` program, attached to the daemon's own cgroup for that moment, asks
/// the kernel for the socket's state callback the way connect4 does, and answers 0 (the
/// kernel takes `TCP_BPF_SOCK_OPS_CB_FLAGS` from cgroup programs) or EPERM.
pub const PROBE_STATE_CB: i32 = 2;

/// The option value of a seeding request, from the socket table (sock_diag).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SeedRequest {
    /// The value the daemon put in `SEED_KEY` for this seeding (random, never 0): a
    /// request from any other process is refused.
    pub key: u64,
    /// cgroup v2 id of the selected cgroup whose scope governs the socket.
    pub cgroup_id: u64,
    /// Cookie of the socket's network namespace (0 when the kernel cannot name it).
    pub netns: u64,
    /// Local and remote addresses, network order, IPv4 IPv4-mapped.
    pub src: [u8; 16],
    pub dst: [u8; 16],
    /// Remote port, host byte order.
    pub dport: u16,
    pub _pad: [u8; 6],
}

/// A correction of the daemon's audit, given to the `adjust` program as the data of a
/// BPF_PROG_TEST_RUN after a 14-byte Ethernet header: one count of one counter set from
/// `expected` to `target` with a compare-and-swap, so that a concurrent update is never
/// lost (the correction waits for the next audit instead).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Adjustment {
    /// The destination counter's key; at rule level its `rule_id`, at scope level its
    /// `scope_id`, is the one read.
    pub key: CounterKey,
    /// 0 destination, 1 rule, 2 scope.
    pub level: u32,
    /// The count corrected: ADJUST_ACTIVE or ADJUST_CONNECTING.
    pub count: u32,
    pub _pad: u32,
    /// Connections (two's complement, as `Counter::active` and `connecting` are read).
    pub expected: u64,
    pub target: u64,
}

/// `Adjustment::count`: `Counter::active` or `Counter::connecting`.
pub const ADJUST_ACTIVE: u32 = 0;
pub const ADJUST_CONNECTING: u32 = 1;

/// Key of `IDS`: a scope name (`kind` ID_SCOPE), or a scope name, a NUL and a rule name
/// (`kind` ID_RULE), NUL-padded. Value: the id (u32). Names are at most
/// [`MAX_ID_NAME`] bytes together.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IdKey {
    pub kind: u32,
    pub name: [u8; MAX_ID_NAME],
}
pub const ID_SCOPE: u32 = 0;
pub const ID_RULE: u32 = 1;
/// Bytes of a scope name, or of a scope name, a NUL and a rule name.
pub const MAX_ID_NAME: usize = 252;
/// Longest scope or rule name, in bytes (two and a NUL fit in [`MAX_ID_NAME`]).
pub const MAX_NAME: usize = 125;

/// Key of `SCOPES`: which scope governs sockets created in a cgroup, for one policy
/// generation (`gen` is 0 or 1; the daemon fills the idle one, then flips `ACTIVE_GEN`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CgroupKey {
    pub gen_: u32,
    pub _pad: u32,
    /// cgroup v2 id (the inode number of the cgroup directory).
    pub cgroup_id: u64,
}

/// Value of `SCOPES`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScopeConf {
    /// Stable id of the scope, kept across reloads so that counts survive.
    pub scope_id: u32,
    /// MODE_OBSERVE or MODE_ENFORCE.
    pub mode: u32,
    /// Positive errno returned by connect() when shed (ECONNREFUSED = 111).
    pub errno: u32,
    /// 1 when the scope has rules, so the rule lookup can be skipped otherwise.
    pub has_rules: u32,
    /// Limits of the whole scope.
    pub limits: Limits,
    /// The breaker of each destination endpoint the scope's connections go to, but for
    /// those of a rule with its own (`window_ns` 0: none).
    pub breaker: BreakerConf,
    /// Shed when ports held toward the destination reach this many thousandths of the
    /// ephemeral range (see `PORT_USE`); 0 = no watermark. A matching rule's own
    /// watermark takes precedence.
    pub port_watermark: u32,
    /// New (odd, so never 0) each time the daemon applies a policy: random at its first,
    /// 2 more at each after; a destination's breaker is looked at again after a reload
    /// (`Counter::breaker_clear`).
    pub serial: u32,
}

/// Key of `PORT_USE`: a destination in a network namespace. Value: the thousandths of
/// the ephemeral range held toward it (the highest over source addresses), written by
/// the daemon from the kernel's socket table for destinations near a watermark.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PortUseKey {
    /// Network namespace cookie.
    pub netns: u64,
    /// Destination port, host byte order.
    pub port: u16,
    pub _pad: [u8; 6],
    /// Destination address, network order, IPv4 IPv4-mapped.
    pub addr: [u8; 16],
}

/// Data part of the `RULES` LPM-trie key: generation, scope, destination address.
/// The prefix length counts bits from the start of this struct, so a rule CIDR of
/// length L is stored with prefix length 64 + L (+ 96 for IPv4, which is IPv4-mapped).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuleAddrKey {
    pub gen_: u32,
    pub scope_id: u32,
    pub addr: [u8; 16],
}

/// Bit length of the fixed (generation, scope) part of [`RuleAddrKey`].
pub const RULE_KEY_FIXED_BITS: u32 = 64;

/// Inclusive port range, host byte order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortRange {
    pub first: u16,
    pub last: u16,
}

/// The limits of a scope, or of a rule (for each endpoint or for the whole rule): 0 in a
/// field means no such limit.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    /// Budget of active connections (admitted, not yet in TCP_CLOSE); `BUDGET_OF_NONE`
    /// admits none.
    pub max_connections: u64,
    /// The new-connection rate, as ns between two tokens of its bucket (1e9 / attempts
    /// per second, rounded).
    pub rate_interval_ns: u64,
    /// Tokens the bucket holds when full: attempts admitted at once after a quiet spell.
    pub rate_burst: u32,
    /// Connections in the handshake (admitted, SYN_SENT, neither established nor
    /// closed) at once.
    pub max_connecting: u32,
}

/// `Limits::max_connections` of a budget that admits nothing (a fleet share of 0): the
/// programs compare counts signed, and every count is at least -1.
pub const BUDGET_OF_NONE: u64 = u64::MAX;

/// A circuit breaker's policy, per destination endpoint, on connect outcomes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BreakerConf {
    /// The sliding window over which outcomes are counted, ns; 0 = no breaker. Kept in
    /// BREAKER_SLOTS slots of window / BREAKER_SLOTS.
    pub window_ns: u64,
    /// How long it stays open the first time, and at most (doubled at each opening in a
    /// row), ns.
    pub open_ns: u64,
    pub max_open_ns: u64,
    /// A handshake that takes this long (ns) or longer is slow; 0 = none is.
    pub slow_ns: u64,
    /// Outcomes the window must hold before it may open.
    pub min_samples: u32,
    /// It opens when failures (slow handshakes), in thousandths of the window's
    /// outcomes, reach this (0 = never for slow ones).
    pub failure_permille: u32,
    pub slow_permille: u32,
    /// Successes in a row that take half-open to its next step.
    pub step_successes: u32,
    /// Positive errno of a connect() it sheds.
    pub errno: u32,
    /// Steps of `ramp` in use; the last is 100.
    pub n_steps: u32,
    /// Percent of attempts let through at each half-open step.
    pub ramp: [u8; MAX_RAMP_STEPS],
}

/// Bits of the connect hook's `CONTROLS` (read-only data, set by the daemon from its
/// first policy): the code of each control is verified and run only when set. Each is
/// paths for the verifier, which on older kernels (6.1) cannot take them all at once.
/// EVENTS: keys starting and stopping to shed.
pub const CONTROL_RATE: u32 = 1;
pub const CONTROL_HANDSHAKES: u32 = 2;
pub const CONTROL_BREAKER: u32 = 4;
pub const CONTROL_EVENTS: u32 = 8;

/// Most steps a breaker's half-open ramp has.
pub const MAX_RAMP_STEPS: usize = 8;
/// Slots of a breaker's window (a power of two: its index is a mask).
pub const BREAKER_SLOTS: usize = 16;

pub const BREAKER_CLOSED: u32 = 0;
pub const BREAKER_OPEN: u32 = 1;
pub const BREAKER_HALF_OPEN: u32 = 2;

/// Value of `BREAKERS` (key: the destination's [`CounterKey`]): one endpoint's breaker.
/// The connect hook makes every transition, at the attempt that finds it due; the
/// outcome paths only count.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Breaker {
    /// BREAKER_* in bits 0-7, the half-open step in bits 8-15, and in bits 32-63 the
    /// phase: +1 at every transition, so that an outcome counts in the phase of its
    /// attempt. Changed by compare-and-swap, by the one attempt that makes the move.
    pub status: u64,
    /// CLOCK_MONOTONIC ns at which an open breaker half-opens.
    pub open_until: u64,
    /// Half-open: attempts so far times the step's percent (an attempt is let through
    /// each time this passes a multiple of 100).
    pub ramp_credit: u64,
    /// Copies of the policy's slot length and slow threshold, for the outcome paths
    /// (written by the connect hook).
    pub slot_ns: u64,
    pub slow_ns: u64,
    /// Each slot: its number (time / slot_ns, low 16 bits) in bits 48-63, and outcomes
    /// ended, failed and slow, 16 bits each (saturating), in bits 32-47, 16-31, 0-15.
    pub slots: [u64; BREAKER_SLOTS],
    /// Openings in a row since it was last closed.
    pub opens_in_row: u32,
    /// Half-open: successes in a row in this phase; a failure sets `half_open_failed`.
    pub successes: u32,
    pub half_open_failed: u32,
    pub _pad: u32,
}

/// A record of `EVENTS`, the ring buffer of what changed and why.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Event {
    /// CLOCK_MONOTONIC ns.
    pub time_ns: u64,
    /// EVENT_*.
    pub kind: u32,
    /// Breaker: the half-open step (0-based) and its percent; limit events: 0.
    pub step: u32,
    pub percent: u32,
    /// Breaker opening: the window's outcomes, failures and slow handshakes that
    /// tripped it (half-open: those of the phase); limit events: 0.
    pub ended: u32,
    pub failures: u32,
    pub slow: u32,
    /// Shedding started: REASON_* bits of the attempt that started it.
    pub reasons: u32,
    /// Breaker opening: how long it stays open, ns.
    pub open_ns: u64,
    /// The destination's key; for shedding events at rule or scope level (`level` 1,
    /// 2), the address and port are zero; for a caller's (`level` LEVEL_CALLER), see
    /// there.
    pub key: CounterKey,
    /// 0 destination, 1 rule, 2 scope, callers::LEVEL_CALLER a listener guard's caller.
    pub level: u32,
}

pub const EVENT_BREAKER_OPENED: u32 = 1;
pub const EVENT_BREAKER_HALF_OPEN: u32 = 2;
pub const EVENT_BREAKER_CLOSED: u32 = 3;
/// A key started to shed (observe mode: would shed), and stopped: the first attempt
/// admitted within every limit after sheds.
pub const EVENT_SHEDDING_STARTED: u32 = 4;
pub const EVENT_SHEDDING_STOPPED: u32 = 5;
/// A caller of a listener guard started to be refused (observe mode: would be) by its
/// per-source budget, and stopped: the first SYN of its admitted after refusals
/// (`callers::LEVEL_CALLER`).
pub const EVENT_CALLER_REFUSED: u32 = 6;
pub const EVENT_CALLER_ADMITTED: u32 = 7;

/// Why an attempt was shed: a spent `max_connections` or port watermark, no token, a
/// full `max_connecting`, a breaker; OBSERVE: only counted (observe mode).
pub const REASON_BUDGET: u32 = 1;
pub const REASON_RATE: u32 = 2;
pub const REASON_HANDSHAKES: u32 = 4;
pub const REASON_BREAKER: u32 = 8;
pub const REASON_OBSERVE: u32 = 0x80;

/// One rule as the kernel sees it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RuleRef {
    /// Stable id of the rule (kept across reloads, like scope ids).
    pub rule_id: u32,
    /// 1: every ip:port has its own limits; 0: one set shared by the rule.
    pub per_endpoint: u32,
    /// All 0: the rule only names traffic.
    pub limits: Limits,
    /// The breaker of each endpoint of the rule (`window_ns` 0: the scope's).
    pub breaker: BreakerConf,
    /// Number of used entries in `ports`; 0 = every port.
    pub n_ports: u32,
    pub ports: [PortRange; MAX_PORT_RANGES],
    /// Port watermark in thousandths of the ephemeral range; 0 = the scope's.
    pub port_watermark: u32,
}

/// Value of `RULES`: for the longest rule prefix containing a destination, every rule
/// of the scope whose CIDR contains that prefix, in policy order. These are exactly the
/// rules whose `dst` matches the destination, so the first whose ports match applies.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Candidates {
    pub n: u32,
    pub _pad: u32,
    pub rules: [RuleRef; MAX_CANDIDATES],
}

/// The deepest cgroup level, counted from the daemon's cgroup2 mount (level 0), at which
/// a selected cgroup is seen: `SCOPE_LEVELS` is a bit per level. Also how deep below
/// the kernel's own root that mount may be (a cgroup namespace's root).
pub const MAX_CGROUP_LEVEL: u32 = 31;

/// Size of `SCOPE_COUNTERS`: scope ids are below this. The daemon gives each scope name
/// it sees an id for its whole life (so counts survive reloads); a policy that would
/// need more ids is refused.
pub const MAX_SCOPE_IDS: u32 = 4096;
/// Size of `RULE_COUNTERS`: rule ids are below this. Rule ids are unique across scopes
/// (one per scope and rule name pair), kept for the daemon's life like scope ids.
pub const MAX_RULE_IDS: u32 = 65536;

/// Destinations the destination counter map (`COUNTERS`) holds unless the daemon is
/// told otherwise (`connguard run --max-destinations`).
pub const DEFAULT_DESTINATIONS: u32 = 262_144;

/// Key of `COUNTERS`: the destination level, one connection's (scope, rule or NO_RULE,
/// address and port). The connection is also counted at its scope (`SCOPE_COUNTERS`)
/// and, when a rule matched, at its rule (`RULE_COUNTERS`), arrays indexed by id.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CounterKey {
    pub scope_id: u32,
    pub rule_id: u32,
    /// Destination port, host byte order.
    pub port: u16,
    pub _pad: u16,
    /// Destination address (network order, IPv4-mapped).
    pub addr: [u8; 16],
}

/// Value of `COUNTERS`, `SCOPE_COUNTERS` and `RULE_COUNTERS`; every field is updated
/// with atomic instructions. The fields a connect reads come first (`epoch` only for
/// the destination), in the first 72 bytes: a connect touches two cache lines of the
/// value at most (map values are 8-byte aligned, not 64).
/// Units: connections.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counter {
    /// Admitted and not yet in TCP_CLOSE. Read as signed (two's complement): a release
    /// after an audit's correction of an admission it could not see (a socket no table
    /// lists) takes it below 0 until the next audits correct it back; no budget is
    /// spent then.
    pub active: u64,
    /// Connections admitted (total).
    pub admitted: u64,
    /// Highest `active` seen.
    pub peak: u64,
    /// CLOCK_MONOTONIC ns of the first shed (or would-be shed) since the last admission
    /// within every limit; 0 while none: one event when it starts, one when it stops.
    pub shedding_since: u64,
    /// Admitted and in the handshake: not yet established, nor closed. Counted only at
    /// a level whose limits set max_connecting (0 at the others). Read as signed, like
    /// `active`, which the audit's corrections can take below 0 the same way.
    pub connecting: u64,
    /// The token bucket of the new-connection rate, as the generic cell rate
    /// algorithm's theoretical arrival time: the CLOCK_MONOTONIC ns at which the bucket
    /// is full again (in the past: full). An admission moves it one interval later,
    /// from now at the earliest; an attempt that would move it past now + burst
    /// intervals has no token.
    pub rate_tat: u64,
    /// `ScopeConf::serial << 32 | breaker_bad` (low 32 bits) when the connect hook last
    /// found the destination's breaker closed with nothing due: while it still matches,
    /// a connect skips the breaker (no lookup, no window walk).
    pub breaker_clear: u64,
    /// Failed and slow handshakes reported to the destination's breaker, and its
    /// openings (total).
    pub breaker_bad: u64,
    /// When this entry was created (ns since boot): tells a destination entry that the
    /// daemon forgot and the kernel created again from the one an admission charged.
    /// 0 in the scope and rule arrays, whose entries are never forgotten.
    pub epoch: u64,
    /// Connections refused (enforce mode, total).
    pub shed: u64,
    /// Connections that would have been refused (observe mode, total).
    pub would_shed: u64,
    /// Of `shed` and `would_shed`: attempts over the new-connection rate, over
    /// `max_connecting`, and met by an open breaker (an attempt over several counts in
    /// each).
    pub rate_limited: u64,
    pub handshake_limited: u64,
    pub breaker_limited: u64,
    /// Breaker transitions of the destination's endpoint (at rule and scope level, of
    /// their endpoints): to open (from closed or half-open), to a half-open step, to
    /// closed.
    pub breaker_opened: u64,
    pub breaker_half_opened: u64,
    pub breaker_closed: u64,
}

/// Socket-local storage (`SOCKS`, a BPF_MAP_TYPE_SK_STORAGE): created with the TCP
/// socket, freed by the kernel with it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockState {
    /// cgroup v2 id of the selected cgroup whose scope governs the socket: the nearest
    /// to the cgroup it was created in, among that cgroup and its ancestors.
    pub cgroup_id: u64,
    /// 1 while the socket holds an admission; swapped to 0 atomically by the one path
    /// that releases it.
    pub admitted: u32,
    /// 1 once tcp_connect() ran for this admission (sock_ops TCP_CONNECT_CB), which
    /// turns on the state callback that will release it; 0 means no callback will.
    pub armed: u32,
    /// Bit i set: level i (0 destination, 1 rule, 2 scope) was charged. A level whose
    /// counter could not be found or created (full map) is neither checked nor charged.
    pub charged: u32,
    /// Bit i set (as in `charged`): level i counts the admission in `connecting`, which
    /// only levels with max_connecting do; swapped to 0 by the one path that ends the
    /// handshake (established, or released).
    pub connecting: u32,
    /// 1 while the connect's outcome is owed to its destination's breaker; swapped to 0
    /// by the path that reports it (established, or closed from SYN_SENT).
    pub breaker_owed: u32,
    /// The breaker's phase at the attempt.
    pub breaker_phase: u32,
    /// CLOCK_MONOTONIC ns of the connect, when a breaker is owed its outcome.
    pub connect_ns: u64,
    /// Scratch of the connect hook: a word stored and loaded back, because the
    /// verifier does not follow values through map memory, so the paths that differ
    /// only in its value are verified once.
    pub scratch: u64,
    /// `epoch` of the destination entry the admission charged.
    pub dst_epoch: u64,
    /// Network namespace cookie of the socket, taken at connect (sock_ops programs get
    /// bpf_get_netns_cookie only from Linux 5.15; a socket never changes namespace).
    pub netns: u64,
    /// Local address, network order, IPv4 IPv4-mapped: taken at tcp_connect() (sock_ops
    /// TCP_CONNECT_CB), when the route has chosen it, for the TIME_WAIT key whichever
    /// path releases.
    pub src: [u8; 16],
    /// The destination key of the admission (valid while `admitted` is 1).
    pub dst: CounterKey,
}

/// Key of `TIME_WAITS`: TIME_WAIT entries born on admitted connections, per network
/// namespace, source address, destination and scope. Value: a count (entries).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TimeWaitKey {
    /// Network namespace cookie (SO_NETNS_COOKIE / bpf_get_netns_cookie).
    pub netns: u64,
    pub scope_id: u32,
    /// Destination port, host byte order.
    pub dport: u16,
    pub _pad: u16,
    /// Source and destination addresses, network order, IPv4 IPv4-mapped.
    pub src: [u8; 16],
    pub dst: [u8; 16],
}

/// Key of `EADDRNOTAVAIL`: connect() failures for want of a local port, per scope and
/// process name (comm). Value: a count (failures).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EaddrKey {
    pub scope_id: u32,
    pub comm: [u8; 16],
}

/// Key of `LISTENERS`: a guarded listening socket as the kernel's lookup finds it for a
/// SYN: the inode number of its network namespace (as `stat` of /proc/PID/ns/net shows
/// it; always 0 for the polled program, which cannot read it, so guarded namespaces
/// share keys there),
/// its bound port (host byte order) and bound address (network order, IPv4
/// IPv4-mapped; all zeros for 0.0.0.0 or ::). The namespace is the listener's own:
/// bpf_get_netns_cookie() in tc would report the sending socket's, across a veth the
/// client's.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ListenerKey {
    pub netns: u32,
    pub port: u16,
    pub _pad: u16,
    pub addr: [u8; 16],
}

/// Value of `LISTENERS`: a guarded listener's policy, written by the daemon at every
/// reading of the listeners (every 50 ms; removed when its namespace cannot be read).
/// Nothing is shed `LISTENER_TTL_NS` after the daemon's last heartbeat (per SYN) or
/// the entry's last reading (polled): a daemon that died or hangs never leaves a
/// listener refusing SYNs.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ListenerEntry {
    /// Stable id of the `[[listener]]` guard (`LISTENER_IDS`), which keys RST_SHED,
    /// WOULD_RST and the per-caller maps; NO_LISTENER for an entry that guards nothing.
    pub listener_id: u32,
    /// MODE_OBSERVE or MODE_ENFORCE.
    pub mode: u32,
    /// Shed while the accept queue holds at least this many thousandths of the
    /// effective backlog (0: no such limit).
    pub accept_queue_permille: u32,
    /// Shed while the listener has at least this many half-open (SYN_RECV) requests
    /// (0: no such limit).
    pub max_syn_recv: u32,
    /// The daemon's own decision from its reading, used only by the polled program
    /// (kernels where the per-SYN one cannot read the socket): 1 to shed.
    pub shed: u32,
    pub _pad: u32,
    /// CLOCK_MONOTONIC (bpf_ktime_get_ns), ns, of the last renewal.
    pub renewed_ns: u64,
    /// The guard's per-caller budgets (per-SYN program only).
    pub per_source: callers::PerSource,
}

/// An entry of `LISTENERS` that guards nothing: a listener on a specific address that
/// no guard selects, on the port of a guarded wildcard listener. The state tracepoint
/// finds a completed connection's listener by its local address first, then the
/// wildcard: this entry keeps the unguarded listener's connections out of the wildcard
/// guard's per-caller counts.
pub const NO_LISTENER: u32 = u32::MAX;

/// Key of `RST_SHED` and `WOULD_RST`: a guard and the listening socket whose queues
/// decided (its inode, as sock_diag and /proc name it), or 0 where the decision was the
/// daemon's, for the guard's listeners together (the polled program).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RstKey {
    pub listener_id: u32,
    pub inode: u32,
}

/// How long listener guards shed without renewal: 5 heartbeats, 10 readings.
pub const LISTENER_TTL_NS: u64 = 500_000_000;

/// Byte offsets in the running kernel's struct tcp_sock (and struct net) of what the
/// per-SYN listener program reads, from kernel BTF at start: Rust eBPF has no CO-RE.
/// A read-only global, so the verifier checks each access against the kernel's BTF.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockOffsets {
    /// sk_ack_backlog (u32): connections in the accept queue.
    pub ack_backlog: u32,
    /// sk_max_ack_backlog (u32): the effective backlog.
    pub max_ack_backlog: u32,
    /// icsk_accept_queue.qlen (atomic_t): half-open requests (SYN_RECV).
    pub syn_queue: u32,
    /// icsk_accept_queue.young (atomic_t): the half-open requests whose SYN-ACK has not
    /// been retransmitted yet (under the 1 s initial RTO): handshakes in flight.
    pub young: u32,
    /// __sk_common.skc_net (possible_net_t: struct net *).
    pub net: u32,
    /// ns.inum (unsigned int), in struct net.
    pub net_inum: u32,
    /// The socket's inode: sk_socket (struct socket *), then its file (struct file *),
    /// the file's f_inode (struct inode *), and the inode's i_ino (unsigned long).
    pub sk_socket: u32,
    pub socket_file: u32,
    pub file_inode: u32,
    pub inode_ino: u32,
    /// __sk_common's skc_family (unsigned short), skc_num (the local port, host order,
    /// __u16), skc_daddr and skc_rcv_saddr (__be32), skc_v6_daddr and skc_v6_rcv_saddr
    /// (struct in6_addr): a completed connection's caller and listener, read by the
    /// state tracepoint.
    pub family: u32,
    pub num: u32,
    pub daddr: u32,
    pub rcv_saddr: u32,
    pub v6_daddr: u32,
    pub v6_rcv_saddr: u32,
}

/// The controls' clock (rate buckets, breakers, shedding events), read-only data set by
/// the daemon: CLOCK_MONOTONIC ns at the kernel tick's resolution, as
/// `jiffies_64 * tick_ns - offset_ns` (wrapping). The kernel advances jiffies from
/// CLOCK_MONOTONIC (tick_do_update_jiffies64, kernel/time/tick-sched.c), so the offset
/// holds; the verifier inlines bpf_jiffies64 into a load, where bpf_ktime_get_ns is a
/// helper call: a cost on every connect that reads the clock (docs/performance.md has
/// it).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TickClock {
    /// ns per jiffy (TICK_NSEC: CLOCK_MONOTONIC_COARSE's resolution).
    pub tick_ns: u64,
    pub offset_ns: u64,
}

/// CLOCK_MONOTONIC in ns: the clock of the programs' bpf_ktime_get_ns (the lease's).
#[cfg(feature = "user")]
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(feature = "user")]
mod pod {
    use super::*;
    unsafe impl aya::Pod for CgroupKey {}
    unsafe impl aya::Pod for ScopeConf {}
    unsafe impl aya::Pod for Limits {}
    unsafe impl aya::Pod for Breaker {}
    unsafe impl aya::Pod for Event {}
    unsafe impl aya::Pod for RuleAddrKey {}
    unsafe impl aya::Pod for Candidates {}
    unsafe impl aya::Pod for CounterKey {}
    unsafe impl aya::Pod for Counter {}
    unsafe impl aya::Pod for TimeWaitKey {}
    unsafe impl aya::Pod for PortUseKey {}
    unsafe impl aya::Pod for ListenerKey {}
    unsafe impl aya::Pod for ListenerEntry {}
    unsafe impl aya::Pod for RstKey {}
    unsafe impl aya::Pod for callers::CallerKey {}
    unsafe impl aya::Pod for callers::CallerCount {}
    unsafe impl aya::Pod for callers::SourceState {}
    unsafe impl aya::Pod for callers::PerSourceTotals {}
    unsafe impl aya::Pod for SockOffsets {}
    unsafe impl aya::Pod for TickClock {}
    unsafe impl aya::Pod for EaddrKey {}
    unsafe impl aya::Pod for IdKey {}
    unsafe impl aya::Pod for drill::DrillConf {}
    unsafe impl aya::Pod for drill::DrillCounts {}
}
