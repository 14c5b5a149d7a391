//! `connguard stats --json` (the control request `stats`): the snapshot of the daemon's
//! policy, counters, listener guards, watched ports, jobs and kernel. Counts are in
//! connections (or connection attempts, where a field says so); totals run from the
//! daemon's start, or from the creation of the pinned state where a field says so.
use std::sync::Arc;

use guard_common::{Counter, CounterKey};
use serde::{Deserialize, Serialize};

use crate::{kernel::Features, ports::EaddrnotavailCount};

/// The host-wide tracepoint programs (`sock_set_state`, `caller_destroy`), which run
/// for every TCP socket of the host: attached only while a socket may need them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostWide {
    /// The programs attached, by name; empty while the state callback alone releases.
    pub attached: Vec<String>,
    /// Why `sock_set_state` is attached, one reason each.
    pub because: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Snapshot {
    pub policy: PolicyStatus,
    pub scopes: Vec<ScopeStats>,
    /// Fail-open events: a full map or another internal problem let a connection
    /// through uncounted.
    pub internal_errors: u64,
    /// Diagnostic events (TIME_WAIT births, EADDRNOTAVAIL failures, listener RSTs) that
    /// found their map full and were not counted, since the pinned state was created
    /// (absent from the answers of older daemons).
    #[serde(default)]
    pub lost_events: u64,
    /// Connections let through over a budget because no daemon held the lease (it was
    /// gone or stuck for longer than `--lease`), since the pinned state was created
    /// (absent from the answers of older daemons).
    #[serde(default)]
    pub lease_expired: u64,
    /// Counters the audit found different from the live sockets and corrected, since
    /// the daemon started: 0 but for a bug (absent from the answers of older daemons).
    #[serde(default)]
    pub audit_corrections: u64,
    /// Per-program cost from the kernel's bpf_stats (`connguard run --bpf-stats`).
    pub programs: Vec<ProgramCost>,
    /// The host-wide tracepoint programs attached, and why (absent from the answers of
    /// older daemons).
    #[serde(default)]
    pub host_wide: HostWide,
    /// connect() failures with EADDRNOTAVAIL, per scope and process name.
    pub eaddrnotavail: Vec<EaddrnotavailCount>,
    /// Destinations near a port watermark, as last read from the socket tables.
    pub watched_ports: Vec<WatchedPort>,
    /// `[[listener]]` guards.
    pub listeners: Vec<ListenerStats>,
    /// The kernel's tables of listener guards' callers, shared by every guard (absent
    /// from the answers of older daemons).
    #[serde(default)]
    pub caller_tables: CallerTables,
    /// The kernel's destination counter map (absent from the answers of older daemons).
    #[serde(default)]
    pub destination_table: DestinationTable,
    /// The daemon's periodic jobs (absent from the answers of daemons older than this
    /// field).
    #[serde(default)]
    pub jobs: Vec<JobStats>,
    /// The kernel's release and the features probed at start (absent from the answers
    /// of older daemons).
    #[serde(default)]
    pub kernel: Option<Features>,
    /// The container runtimes the daemon follows for the policy's pod and container
    /// selectors (absent from the answers of older daemons).
    #[serde(default)]
    pub runtimes: Vec<RuntimeStatus>,
    /// This host's part in the policy's fleet budgets; null without any.
    #[serde(default)]
    pub fleet: Option<crate::fleet::Status>,
    /// The running drills and the last ended ones (`connguard drill list`; absent from
    /// the answers of older daemons).
    #[serde(default)]
    pub drills: Vec<crate::drill::DrillView>,
}

/// A container runtime the daemon follows: while it is unreachable, the workloads it
/// last listed stay selected, and the daemon retries with a backoff (to 30 s).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct RuntimeStatus {
    /// "containerd" (pods, through CRI) or "docker" (containers, through the Docker
    /// Engine API of Docker or Podman).
    pub source: String,
    /// The socket it is reached on.
    pub endpoint: String,
    /// Listed its workloads and follows their events now.
    pub connected: bool,
    /// When `connected` last changed, or the daemon started following it: ms since the
    /// Unix epoch.
    pub since_unix_ms: u64,
    /// Why the last attempt failed or the last connection ended.
    pub last_error: Option<String>,
    /// Failed attempts since it was last connected.
    pub failures: u32,
}

impl Snapshot {
    /// The scope named `name`.
    pub fn scope(&self, name: &str) -> Option<&ScopeStats> {
        self.scopes.iter().find(|s| s.name == name)
    }

    /// The runtime `source` ("containerd", "docker").
    pub fn runtime(&self, source: &str) -> Option<&RuntimeStatus> {
        self.runtimes.iter().find(|r| r.source == source)
    }

    /// The listener guard named `name`.
    pub fn listener(&self, name: &str) -> Option<&ListenerStats> {
        self.listeners.iter().find(|l| l.name == name)
    }

    /// The periodic job named `name`.
    pub fn job(&self, name: &str) -> Option<&JobStats> {
        self.jobs.iter().find(|j| j.name == name)
    }
}

/// One periodic job of the daemon (cgroup rescan, listener watch, ...). A job that fails
/// is logged and run again at its next period.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct JobStats {
    pub name: String,
    /// The period it is meant to keep, ms.
    pub period_ms: f64,
    /// Runs (total), and of those, runs that failed.
    pub runs: u64,
    pub failures: u64,
    /// The error of the last run, when it failed.
    pub last_error: Option<String>,
    /// Time from the start of one run to the start of the next, ms: median, 99th
    /// percentile and highest over the last runs (at most 256). Null before 2 runs.
    pub period_p50_ms: Option<f64>,
    pub period_p99_ms: Option<f64>,
    pub period_max_ms: Option<f64>,
    /// How long the run going now has been going, ms; null between runs. A run that
    /// goes on for 10 s is logged.
    pub running_ms: Option<f64>,
}

/// The policy in force.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PolicyStatus {
    /// The policy file, or the name of the embedded default.
    pub source: String,
    /// 1 for the first policy applied, +1 per successful reload.
    pub generation: u64,
    /// The last rejected policy's error (file:line:column: reason), until a reload succeeds.
    pub last_error: Option<String>,
}

/// Counts in connections; counters are totals since the daemon started.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Counts {
    pub active: u64,
    pub peak: u64,
    pub admitted: u64,
    pub shed: u64,
    pub would_shed: u64,
    /// Admitted and in the handshake (SYN_SENT) now, at a level that sets max_connecting;
    /// 0 at the others (absent from the answers of older daemons, like the two below).
    #[serde(default)]
    pub connecting: u64,
    /// Of `shed` and `would_shed`: attempts over the rate, and over `max_connecting`.
    #[serde(default)]
    pub rate_limited: u64,
    #[serde(default)]
    pub handshake_limited: u64,
    /// Of `shed` and `would_shed`: attempts met by an open breaker (or half-open, past
    /// its share).
    #[serde(default)]
    pub breaker_limited: u64,
    /// Breaker transitions (totals) of the destination, or of the rule's or scope's
    /// destinations: to open (from closed or half-open), to a half-open step, to closed.
    #[serde(default)]
    pub breaker_opened: u64,
    #[serde(default)]
    pub breaker_half_opened: u64,
    #[serde(default)]
    pub breaker_closed: u64,
}

impl From<&Counter> for Counts {
    fn from(c: &Counter) -> Self {
        Counts {
            // Below 0 for a moment after a correction (guard_common::Counter): none.
            active: (c.active as i64).max(0) as u64,
            peak: c.peak,
            admitted: c.admitted,
            shed: c.shed,
            would_shed: c.would_shed,
            connecting: (c.connecting as i64).max(0) as u64,
            rate_limited: c.rate_limited,
            handshake_limited: c.handshake_limited,
            breaker_limited: c.breaker_limited,
            breaker_opened: c.breaker_opened,
            breaker_half_opened: c.breaker_half_opened,
            breaker_closed: c.breaker_closed,
        }
    }
}

/// A `[[scope]]` of the policy with its totals, its rules and its destinations; or the
/// scope of an annotated pod of such a scope (`parent`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScopeStats {
    pub name: String,
    /// The cgroup pattern, below the cgroup2 mount ("/" for the whole host); null for a
    /// scope that selects workloads only.
    pub cgroup: Option<String>,
    /// Its pod, container and unit selectors, written `pod namespace=shop app=orders`,
    /// `container name=orders-* app=orders`, `unit orders.service` (absent from the
    /// answers of older daemons, like the fields below but `mode`).
    #[serde(default)]
    pub selectors: Vec<String>,
    /// Honours its pods' budget annotations (`annotations = true`).
    #[serde(default)]
    pub annotations: bool,
    /// The scope of one annotated pod (named `SCOPE/NAMESPACE/POD`): the scope whose
    /// selector selected the pod. Its counts are its own; its scope's leave it out.
    #[serde(default)]
    pub parent: Option<String>,
    /// The cgroups it selects (each governs its descendants), by path, with the
    /// workload each is the cgroup of: at most [`MEMBERS_LISTED`], `member_count` in all.
    #[serde(default)]
    pub members: Vec<Member>,
    #[serde(default)]
    pub member_count: u64,
    /// Selectors that match nothing on this node, budget annotations that cannot be
    /// honoured.
    #[serde(default)]
    pub warnings: Vec<String>,
    /// "enforce" or "observe".
    pub mode: String,
    #[serde(flatten)]
    pub limits: LimitStats,
    #[serde(flatten)]
    pub counts: Counts,
    /// TIME_WAIT entries born on the scope's connections (total).
    pub time_wait_created: u64,
    pub rules: Vec<RuleStats>,
    /// Busiest first: most active, then most admitted, then by `dst`.
    pub destinations: Vec<DestStats>,
    /// The destinations whose breaker is open or half-open, all of them (whatever the
    /// request's cut of `destinations`; absent from the answers of older daemons).
    #[serde(default)]
    pub open_breakers: Vec<OpenBreaker>,
    /// `connecting` summed over the destinations the request's cut left out: the
    /// metrics' `other` row. Not the scope's own `connecting` less the listed ones, which
    /// counts only when the scope itself sets max_connecting. Not part of the JSON.
    #[serde(skip)]
    pub unlisted_connecting: u64,
}

/// The members a scope's stats list; the rest are counted in `member_count`.
pub const MEMBERS_LISTED: usize = 50;

/// A cgroup a scope selects.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Member {
    /// Below the cgroup2 mount.
    pub cgroup: String,
    /// The workload it is the cgroup of (`pod shop/orders-7d9f`, `container orders`,
    /// `unit orders.service`); null for a cgroup the scope's `cgroup` pattern selects.
    pub workload: Option<String>,
}

impl ScopeStats {
    /// The rule named `name`.
    pub fn rule(&self, name: &str) -> Option<&RuleStats> {
        self.rules.iter().find(|r| r.name == name)
    }

    /// The first row of `destinations` toward `dst` (`a.b.c.d:port`, `[v6]:port`).
    pub fn destination(&self, dst: &str) -> Option<&DestStats> {
        self.destinations.iter().find(|d| d.dst == dst)
    }
}

/// A destination whose breaker is not closed.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct OpenBreaker {
    pub rule: Option<String>,
    pub dst: String,
    /// "open" or "half_open".
    pub state: String,
    /// Percent of attempts it lets through now.
    pub percent: u32,
}

/// A `[[scope.rule]]` with its totals (over its destinations when `per` is "endpoint").
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RuleStats {
    pub name: String,
    #[serde(flatten)]
    pub limits: LimitStats,
    /// "endpoint" or "rule".
    pub per: String,
    /// The fleet budget the rule draws from: its `max_connections` is this host's
    /// share (absent from the answers of older daemons).
    #[serde(default)]
    pub fleet: Option<String>,
    #[serde(flatten)]
    pub counts: Counts,
}

/// A scope's or rule's limits as the policy sets them; null for none.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct LimitStats {
    pub max_connections: Option<u64>,
    /// Absent from the answers of older daemons, like the two below.
    #[serde(default)]
    pub max_connecting: Option<u32>,
    /// New connection attempts, as the policy writes it: "200/s", "30/min".
    #[serde(default)]
    pub rate: Option<String>,
    /// Tokens the rate's bucket holds when full.
    #[serde(default)]
    pub burst: Option<u32>,
}

/// One destination endpoint of a scope, under the rule that matched it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DestStats {
    /// The rule that matched, or null when none did (shared by its destinations).
    pub rule: Option<Arc<str>>,
    /// `a.b.c.d:port` or `[v6]:port`.
    pub dst: String,
    #[serde(flatten)]
    pub counts: Counts,
    /// The endpoint's circuit breaker, when one governs it (absent from the answers of
    /// older daemons). Boxed: most rows have none, and a snapshot holds a row per
    /// destination.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub breaker: Option<Box<BreakerStats>>,
    /// The kernel's key of the counter, which /metrics keeps its series by. Not part of
    /// the JSON.
    #[serde(skip)]
    pub key: CounterKey,
}

/// A destination's breaker: where it stands and how it got there.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct BreakerStats {
    /// "closed", "open" or "half_open".
    pub state: String,
    /// Half-open: the ramp step (0-based); null otherwise.
    pub step: Option<u32>,
    /// Percent of attempts it lets through now: 100 closed, 0 open, the step's share
    /// half-open.
    pub percent: u32,
    /// Open: ms until it half-opens; null otherwise.
    pub open_remaining_ms: Option<u64>,
    /// The window's connect outcomes now: ended, failed and slow (since the last
    /// opening or closing, which empty it).
    pub window_ended: u32,
    pub window_failures: u32,
    pub window_slow: u32,
}

/// One program's cost from the kernel's bpf_stats (zero unless stats are enabled).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProgramCost {
    pub name: String,
    /// Runs (total).
    pub run_count: u64,
    /// Time spent in the program over those runs, ns.
    pub run_time_ns: u64,
    /// run_time_ns / run_count, in ns; null before the first run.
    pub avg_ns: Option<f64>,
}

/// Ports held toward a destination in a watched network namespace.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WatchedPort {
    /// Network namespace cookie (SO_NETNS_COOKIE).
    pub netns: u64,
    /// `a.b.c.d:port` or `[v6]:port`.
    pub dst: String,
    /// Ports held / ephemeral ports (the most over source addresses).
    pub ratio: f64,
}

/// Live state of one `[[listener]]` policy.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ListenerStats {
    pub name: String,
    /// The policy's netns file, or "self".
    pub netns: String,
    /// The policy's ports, as inclusive [first, last] ranges.
    pub ports: Vec<[u16; 2]>,
    /// "enforce" or "observe".
    pub mode: String,
    /// True where the kernel decides per SYN on each socket's own queues (each socket's
    /// RSTs are its own, in `queues`); false where it applies the daemon's reading, for
    /// the guard's sockets together (absent from the answers of older daemons).
    #[serde(default)]
    pub per_syn: bool,
    /// True while, at the last reading, a matching listener socket was past a limit
    /// (`max_syn_recv` judged on `syn_recv`, as old as it is).
    pub shedding: bool,
    /// SYNs answered with RST past the queue limits (enforce mode, total): the sum of
    /// the sockets' own counts in `queues`, and of the daemon's decisions for the guard
    /// where the kernel cannot decide per SYN.
    pub rst_shed: u64,
    /// SYNs observe mode would have answered with RST past the queue limits (total).
    pub would_rst: u64,
    /// The matching listener sockets at the last reading (every 50 ms; `syn_recv`
    /// every second).
    pub queues: Vec<QueueReading>,
    /// The guard's per-caller budgets and its busiest callers; null without
    /// `per_source` (absent from the answers of older daemons).
    #[serde(default)]
    pub per_source: Option<PerSourceStats>,
}

/// One guarded listener socket's queues at the last reading (units: connections), and
/// the RSTs decided on them.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QueueReading {
    /// The daemon's id of the `[[listener]]` policy it matched. Not part of the JSON.
    #[serde(skip)]
    pub listener_id: u32,
    /// `a.b.c.d:port` or `[v6]:port`.
    pub addr: String,
    /// The socket's inode (as `ss -e` and /proc/PID/fd show it; absent from the answers
    /// of older daemons).
    #[serde(default)]
    pub inode: u32,
    pub accept_queue: u32,
    pub backlog: u32,
    /// Half-open connections (SYN_RECV) to the listener's address and port; shared by
    /// the members of a SO_REUSEPORT group, whose own counts sock_diag does not give.
    /// Read every second, unless the polled program sheds on it (`max_syn_recv`):
    /// then at every reading.
    pub syn_recv: u32,
    /// SYNs answered with RST (enforce mode), or that would have been (observe mode),
    /// because this socket's own queues were past a limit (totals). Decided per SYN on
    /// the socket the kernel picks, so a SO_REUSEPORT group's members each have their
    /// own; 0 where the daemon's reading decides (then the guard's `rst_shed` has them).
    #[serde(default)]
    pub rst_shed: u64,
    #[serde(default)]
    pub would_rst: u64,
}

/// A listener guard's per-caller budgets (`per_source`), what they refused, and its
/// busiest callers.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct PerSourceStats {
    /// Bits of an IPv4 (`prefix`) and an IPv6 (`prefix6`) source address that name a
    /// caller.
    pub prefix: u8,
    pub prefix6: u8,
    /// Connections a caller may hold (completed, plus handshakes in flight); null for
    /// no such limit.
    pub max_connections: Option<u32>,
    /// New connections a caller may open (`"50/s"`), and its bucket's burst; null for
    /// no rate.
    pub rate: Option<String>,
    pub burst: Option<u32>,
    /// "rst" or "drop": what a refused SYN gets.
    pub action: String,
    /// SYNs refused (enforce mode), and SYNs observe mode would have refused (totals);
    /// of both, those over the rate (the others were over `max_connections`).
    pub refused: u64,
    pub would_refuse: u64,
    pub rate_limited: u64,
    /// Completed connections held by callers now, and the callers holding any.
    pub active: u64,
    pub callers: u64,
    /// Callers whose last SYN was refused (or would have been, in observe mode).
    pub refusing: u64,
    /// The callers with the most active connections and those with the most refusals
    /// (at most `TOP_CALLERS` of each, most active first).
    pub top: Vec<CallerStats>,
    /// The other callers' counts, summed (`caller` is "other").
    pub other: CallerStats,
}

/// Callers of each guard that `stats` lists by active connections, and by refusals.
pub const TOP_CALLERS: usize = 10;

/// One caller of a listener guard.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct CallerStats {
    /// The caller: its source address prefix, `a.b.c.d/prefix` or `v6/prefix6`.
    pub caller: String,
    /// Completed connections it holds (not yet in TCP_CLOSE), the most it held, and its
    /// completed handshakes (total), while the kernel keeps its entry (removed once
    /// idle at 0 active).
    pub active: u64,
    pub peak: u64,
    pub admitted: u64,
    /// Its SYNs refused, would-be refusals in observe mode, and of both those over the
    /// rate, while the kernel keeps its entry (the least recently seen callers' go
    /// first when the table is full).
    pub refused: u64,
    pub would_refuse: u64,
    pub rate_limited: u64,
    /// True while its last SYN was refused.
    pub refusing: bool,
}

/// The kernel's destination counter map (`COUNTERS`): its entries now, one per (scope,
/// rule, address, port) of every scope, idle ones until they are forgotten, and the most
/// it holds (`connguard run --max-destinations`, or the size of the pinned map a
/// restarted daemon adopted; 0 when the daemon could not read it). A destination that
/// finds it full gets no counter of its own: its connections are counted and budgeted at
/// their rule and scope only, without the destination's limits and breaker, each one an
/// `internal_errors`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct DestinationTable {
    pub entries: u64,
    pub capacity: u64,
}

impl DestinationTable {
    /// True when the map holds as many entries as it can (of a size the daemon read).
    pub fn full(&self) -> bool {
        self.capacity > 0 && self.entries >= self.capacity
    }
}

/// The kernel's tables of listener guards' callers: `CALLERS` (callers with completed
/// connections, made at a handshake's completion only) and `SOURCES` (callers whose SYNs
/// were seen: token buckets, handshakes in flight, refusals; the least recently used
/// entry goes when it is full). Entries now, and the most each holds.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct CallerTables {
    pub callers: u64,
    pub callers_capacity: u64,
    pub sources: u64,
    pub sources_capacity: u64,
}
