//! The policy: what each scope governs and with which budgets, and the listener guards.
//! `parse` reads it from TOML and validates it; `compile` turns it into the entries the
//! kernel maps take.
use std::{collections::BTreeMap, fmt, net::IpAddr, path::PathBuf, sync::Arc};

use globset::{GlobBuilder, GlobMatcher};
use guard_common::{MODE_ENFORCE, PortRange};
use ipnet::IpNet;

use crate::workload::{Identity, WorkloadSelector, selector::UnitSelector};

pub mod compile;
pub mod drill;
mod parse;
pub mod workloads;

pub use parse::{load_file, parse};

/// The policy used when `connguard run` is given none: observe the whole host.
pub const DEFAULT_POLICY: &str = include_str!("../../../policies/default.toml");
pub const DEFAULT_SOURCE: &str = "<embedded default>";

#[derive(Debug, Clone)]
pub struct Policy {
    /// File name, or DEFAULT_SOURCE.
    pub source: String,
    pub scopes: Vec<Scope>,
    pub listeners: Vec<ListenerPolicy>,
    /// Where the fleet budgets are shared (`[fleet]`); Some exactly when there are some.
    pub fleet: Option<FleetPolicy>,
    pub fleet_budgets: Vec<FleetBudget>,
}

/// `[fleet]`: the etcd the fleet budgets are shared through, and this host's part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FleetPolicy {
    /// etcd v3 client URLs (`http://` or `https://`).
    pub endpoints: Vec<String>,
    /// This host's identity in the fleet; None = the host name.
    pub identity: Option<String>,
    pub prefix: Option<String>,
    pub ttl_secs: Option<u64>,
    pub refresh_ms: Option<u64>,
    pub user: Option<String>,
    /// A file holding the etcd user's password (first line).
    pub password_file: Option<PathBuf>,
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

/// `[[fleet_budget]]`: one destination set's budget of active connections, shared by
/// the fleet; the one rule that says `fleet = NAME` draws from it on this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FleetBudget {
    pub name: String,
    pub dst: Vec<IpNet>,
    /// Empty = every port.
    pub ports: Vec<PortRange>,
    /// The fleet's total (`max_connections`).
    pub total: u64,
    pub weight: u32,
    pub floor: u64,
    pub safe_share: u64,
}

/// A listener guard: shed SYNs with RSTs while the accept queue is past a watermark,
/// and a caller's SYNs past its per-caller budgets.
#[derive(Debug, Clone)]
pub struct ListenerPolicy {
    pub name: String,
    pub ports: Vec<PortRange>,
    /// The listener's address; None = any.
    pub addr: Option<IpAddr>,
    /// Network namespace file; None = the daemon's own.
    pub netns: Option<PathBuf>,
    /// Interfaces to guard in that namespace; empty = all of them, loopback included.
    pub interfaces: Vec<String>,
    /// Shed from this accept queue length, in thousandths of the effective backlog.
    pub accept_queue_watermark: Option<u32>,
    /// Shed from this many SYN_RECV entries.
    pub max_syn_recv: Option<u32>,
    /// Budgets of each caller (source address prefix).
    pub per_source: Option<PerSourcePolicy>,
    pub mode: u32,
}

/// `per_source` of a listener guard: what each caller (source address masked to
/// `prefix` bits, IPv6 to `prefix6`) may hold and open; at least one limit is set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PerSourcePolicy {
    pub prefix: u8,
    pub prefix6: u8,
    /// Connections a caller holds: completed, plus handshakes in flight.
    pub max_connections: Option<u32>,
    /// New connections a caller opens.
    pub rate: Option<Rate>,
    /// What a refused SYN gets: guard_common::callers::PER_SOURCE_RST or _DROP.
    pub action: u32,
}

impl PerSourcePolicy {
    /// How stats and logs write the action.
    pub fn action_name(&self) -> &'static str {
        if self.action == guard_common::callers::PER_SOURCE_DROP {
            "drop"
        } else {
            "rst"
        }
    }
}

#[derive(Debug, Clone)]
pub struct Scope {
    pub name: String,
    /// Pattern below the cgroup2 mount, without leading or trailing '/'; "" = root; None
    /// when the scope selects workloads only.
    pub cgroup: Option<String>,
    /// The pods, containers and units it selects besides (`pod`, `container`, `unit`).
    pub workloads: Vec<WorkloadSelector>,
    /// Its pods' annotations set their own budgets (`annotations = true`).
    pub annotations: bool,
    /// A scope of one annotated pod, made from the scope so named (see `workloads`).
    pub parent: Option<String>,
    /// What the workloads' resolution found wrong or empty: selectors that match nothing,
    /// annotations that cannot be honoured.
    pub warnings: Vec<String>,
    pub selector: Selector,
    pub mode: u32,
    pub errno: i32,
    pub limits: Limits,
    /// The breaker of each endpoint its connections go to, but under a rule with its own.
    pub breaker: Option<BreakerPolicy>,
    /// Port watermark in thousandths of the ephemeral range; None = none.
    pub port_watermark: Option<u32>,
    pub rules: Vec<Rule>,
}

impl Scope {
    /// Whether this scope or one of its rules sets a port watermark.
    pub fn watches_ports(&self) -> bool {
        self.port_watermark.is_some() || self.rules.iter().any(|r| r.port_watermark.is_some())
    }
}

/// The cgroups a scope selects: those its `cgroup` pattern matches, the cgroups of the
/// units it names (decided from their paths, as a pattern is), and the cgroups its pod
/// and container selectors resolve to on this node (`resolved`, kept current from the
/// runtimes by `workloads::resolve`).
#[derive(Debug, Clone, Default)]
pub struct Selector {
    pattern: Option<Pattern>,
    units: Vec<UnitSelector>,
    /// Path below the mount -> the workload it is the cgroup of.
    resolved: Arc<BTreeMap<String, Identity>>,
}

/// A `cgroup` pattern.
#[derive(Debug, Clone)]
struct Pattern {
    /// None for the root.
    whole: Option<GlobMatcher>,
    /// One matcher per path segment of the pattern; None for a segment with `**`.
    segments: Vec<Option<GlobMatcher>>,
}

impl Pattern {
    fn new(pattern: &str) -> Result<Pattern, globset::Error> {
        let glob = |p: &str| {
            GlobBuilder::new(p)
                .literal_separator(true)
                .build()
                .map(|g| g.compile_matcher())
        };
        if pattern.is_empty() {
            return Ok(Pattern {
                whole: None,
                segments: Vec::new(),
            });
        }
        let whole = glob(pattern)?;
        // A segment that does not compile alone (a `/` inside braces) matches anything:
        // `may_select_below` may then say yes too often, never no wrongly.
        let segments = pattern
            .split('/')
            .map(|seg| {
                if seg.contains("**") {
                    None
                } else {
                    glob(seg).ok()
                }
            })
            .collect();
        Ok(Pattern {
            whole: Some(whole),
            segments,
        })
    }

    fn selects(&self, rel: &str) -> bool {
        match &self.whole {
            None => rel.is_empty(),
            Some(m) => m.is_match(rel),
        }
    }

    fn may_select_below(&self, rel: &str) -> bool {
        let dirs: Vec<&str> = if rel.is_empty() {
            Vec::new()
        } else {
            rel.split('/').collect()
        };
        for (i, dir) in dirs.iter().enumerate() {
            match self.segments.get(i) {
                None => return false,
                Some(None) => return true,
                Some(Some(m)) if !m.is_match(dir) => return false,
                Some(Some(_)) => {}
            }
        }
        self.segments.len() > dirs.len()
    }
}

impl Selector {
    /// `pattern`: below the cgroup2 mount, without leading or trailing '/' (None: no
    /// pattern); `units`: the units it names.
    pub fn new(
        pattern: Option<&str>,
        units: Vec<UnitSelector>,
    ) -> Result<Selector, globset::Error> {
        Ok(Selector {
            pattern: pattern.map(Pattern::new).transpose()?,
            units,
            resolved: Arc::default(),
        })
    }

    /// This selector with `resolved` the cgroups its workload selectors resolve to now.
    pub fn with_resolved(&self, resolved: BTreeMap<String, Identity>) -> Selector {
        Selector {
            resolved: Arc::new(resolved),
            ..self.clone()
        }
    }

    /// The cgroups its workload selectors resolved to, with their workloads.
    pub fn resolved(&self) -> &BTreeMap<String, Identity> {
        &self.resolved
    }

    /// Whether the cgroup at `rel` (its path below the mount, "" for the root) is
    /// selected.
    pub fn selects(&self, rel: &str) -> bool {
        self.pattern.as_ref().is_some_and(|p| p.selects(rel))
            || self.units.iter().any(|u| u.selects(rel))
            || self.resolved.contains_key(rel)
    }

    /// The workload whose cgroup is at `rel`, when a workload selector selects it.
    pub fn identity(&self, rel: &str) -> Option<Identity> {
        if let Some(who) = self.resolved.get(rel) {
            return Some(who.clone());
        }
        self.units
            .iter()
            .any(|u| u.selects(rel))
            .then(|| Identity::unit(rel))
    }

    /// Whether a cgroup below the one at `rel` may be selected: false only when none can
    /// be, so that a creation there need not be watched for.
    pub fn may_select_below(&self, rel: &str) -> bool {
        let prefix = format!("{rel}/");
        self.pattern
            .as_ref()
            .is_some_and(|p| p.may_select_below(rel))
            || self.units.iter().any(|u| u.may_select_below(rel))
            || if rel.is_empty() {
                !self.resolved.is_empty()
            } else {
                self.resolved
                    .range(prefix.clone()..)
                    .next()
                    .is_some_and(|(r, _)| r.starts_with(&prefix))
            }
    }
}

#[derive(Debug, Clone)]
pub struct Rule {
    pub name: String,
    /// Destination networks; IPv4 networks are kept as IPv4 (`compile` maps them).
    /// Empty = every address.
    pub dst: Vec<IpNet>,
    /// Empty = every port.
    pub ports: Vec<PortRange>,
    /// For each endpoint when `per_endpoint`, else for the whole rule.
    pub limits: Limits,
    /// For each endpoint, whatever `per_endpoint` says.
    pub breaker: Option<BreakerPolicy>,
    pub per_endpoint: bool,
    /// Port watermark in thousandths of the ephemeral range; None = the scope's.
    pub port_watermark: Option<u32>,
    /// The fleet budget the rule draws from: its `max_connections` is this host's share
    /// of it (set by the daemon), for the whole rule.
    pub fleet: Option<String>,
}

/// The limits of a scope or a rule; None = no such limit.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Limits {
    /// Budget of active connections.
    pub max_connections: Option<u64>,
    /// Most connections in the handshake (SYN_SENT) at once.
    pub max_connecting: Option<u32>,
    /// Budget of new connection attempts.
    pub rate: Option<Rate>,
}

/// A token bucket of new connection attempts: `count` tokens per `unit`, `burst` held at
/// most.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rate {
    pub count: u64,
    pub unit: RateUnit,
    pub burst: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RateUnit {
    Second,
    Minute,
}

impl RateUnit {
    pub fn ns(self) -> u64 {
        match self {
            RateUnit::Second => 1_000_000_000,
            RateUnit::Minute => 60_000_000_000,
        }
    }

    pub fn suffix(self) -> &'static str {
        match self {
            RateUnit::Second => "s",
            RateUnit::Minute => "min",
        }
    }
}

impl Rate {
    /// ns between two tokens, rounded to the nearest (at least 1).
    pub fn interval_ns(&self) -> u64 {
        ((self.unit.ns() + self.count / 2) / self.count).max(1)
    }
}

impl fmt::Display for Rate {
    /// As the policy writes it: `200/s`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.count, self.unit.suffix())
    }
}

/// A circuit breaker per destination endpoint, on connect outcomes (`[scope.breaker]`,
/// `[scope.rule.breaker]`). Durations in ns, ratios in thousandths.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BreakerPolicy {
    pub window_ns: u64,
    pub min_samples: u32,
    pub failure_permille: u32,
    /// With `slow_connect_ns`: the share of slow handshakes that opens it.
    pub slow_permille: Option<u32>,
    pub slow_connect_ns: Option<u64>,
    pub open_ns: u64,
    pub max_open_ns: u64,
    /// Percent of attempts let through at each half-open step, rising to 100.
    pub ramp: Vec<u8>,
    pub step_successes: u32,
    /// None: the scope's errno.
    pub errno: Option<i32>,
}

/// A policy error at a place in a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyError {
    pub file: String,
    pub line: usize,
    pub column: usize,
    pub reason: String,
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}",
            self.file, self.line, self.column, self.reason
        )
    }
}

impl std::error::Error for PolicyError {}

/// Errnos a scope may return from a shed connect(): the ones a TCP client is written
/// to handle.
pub const ERRNOS: &[(&str, i32)] = &[
    ("ECONNREFUSED", libc::ECONNREFUSED),
    ("EPERM", libc::EPERM),
    ("EACCES", libc::EACCES),
    ("ECONNRESET", libc::ECONNRESET),
    ("ETIMEDOUT", libc::ETIMEDOUT),
    ("ENETUNREACH", libc::ENETUNREACH),
    ("EHOSTUNREACH", libc::EHOSTUNREACH),
    ("EADDRNOTAVAIL", libc::EADDRNOTAVAIL),
    ("EAGAIN", libc::EAGAIN),
];

/// The value of the errno named `name`, when it is one of [`ERRNOS`].
pub fn errno(name: &str) -> Option<i32> {
    ERRNOS.iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
}

/// Every scope and rule of the policy, named for messages, with its limits and breaker.
fn levels(p: &Policy) -> impl Iterator<Item = (String, &Limits, &Option<BreakerPolicy>)> {
    p.scopes.iter().flat_map(|s| {
        std::iter::once((format!("scope {}", s.name), &s.limits, &s.breaker)).chain(
            s.rules.iter().map(move |r| {
                (
                    format!("scope {} rule {}", s.name, r.name),
                    &r.limits,
                    &r.breaker,
                )
            }),
        )
    })
}

/// The controls (guard_common::CONTROL_* bits) the policy's connect hook needs: a
/// rate, max_connecting, a breaker; and the shedding events, with any of them.
pub fn controls(p: &Policy) -> u32 {
    use guard_common::{CONTROL_BREAKER, CONTROL_EVENTS, CONTROL_HANDSHAKES, CONTROL_RATE};
    let mut bits = 0;
    for (_, l, b) in levels(p) {
        if l.rate.is_some() {
            bits |= CONTROL_RATE;
        }
        if l.max_connecting.is_some() {
            bits |= CONTROL_HANDSHAKES;
        }
        if b.is_some() {
            bits |= CONTROL_BREAKER;
        }
    }
    if bits != 0 {
        bits |= CONTROL_EVENTS;
    }
    bits
}

/// Warnings for controls finer than the kernel tick (`tick_ns`), at which the kernel
/// reads their clock: a rate (of a scope, a rule, or a listener guard's callers) whose
/// bucket holds less than one tick of tokens refills at
/// most `burst` tokens a tick, below its rate; a `slow_connect_ms` under two ticks
/// tells handshakes apart by a tick's error.
pub fn coarse_controls(p: &Policy, tick_ns: u64) -> Vec<String> {
    let tick_us = tick_ns / 1000;
    let mut warnings = Vec::new();
    let rates = levels(p)
        .filter_map(|(name, l, _)| l.rate.clone().map(|r| (name, r)))
        .chain(p.listeners.iter().filter_map(|l| {
            let r = l.per_source.as_ref()?.rate.clone()?;
            Some((format!("listener {} per_source", l.name), r))
        }));
    for (name, r) in rates {
        if r.interval_ns().saturating_mul(r.burst as u64) < tick_ns {
            warnings.push(format!(
                "{name}: rate {r} with burst {} holds less than one kernel tick ({tick_us} µs) \
                 of tokens, so it admits at most {} a tick ({}/s): raise burst to {} or more",
                r.burst,
                r.burst,
                r.burst as u64 * 1_000_000_000 / tick_ns,
                tick_ns.div_ceil(r.interval_ns()),
            ));
        }
    }
    for (name, _, breaker) in levels(p) {
        if let Some(slow) = breaker.as_ref().and_then(|b| b.slow_connect_ns)
            && slow < 2 * tick_ns
        {
            warnings.push(format!(
                "{name}: slow_connect_ms {} is under two kernel ticks ({tick_us} µs each): \
                 handshake durations are known to a tick",
                slow / 1_000_000
            ));
        }
    }
    warnings
}

/// The policy keys that `controls` bits stand for, for messages.
pub fn control_names(bits: u32) -> String {
    use guard_common::{CONTROL_BREAKER, CONTROL_HANDSHAKES, CONTROL_RATE};
    [
        (CONTROL_RATE, "rate"),
        (CONTROL_HANDSHAKES, "max_connecting"),
        (CONTROL_BREAKER, "breaker"),
    ]
    .iter()
    .filter(|(b, _)| bits & b != 0)
    .map(|(_, n)| *n)
    .collect::<Vec<_>>()
    .join(", ")
}

/// A one-line summary of a policy, for logs and `connguard check`.
pub fn describe(p: &Policy) -> String {
    let rules: usize = p.scopes.iter().map(|s| s.rules.len()).sum();
    format!(
        "{} scope(s), {} rule(s), {} listener guard(s)",
        p.scopes.len(),
        rules,
        p.listeners.len()
    )
}

/// How stats and logs write a mode (MODE_ENFORCE or MODE_OBSERVE).
pub fn mode_name(mode: u32) -> &'static str {
    if mode == MODE_ENFORCE {
        "enforce"
    } else {
        "observe"
    }
}

#[cfg(test)]
mod tests {
    /// At HZ 250 (a 4 ms tick), 10,000/s is 40 tokens a tick: a burst of 10 is warned
    /// about, a burst of 40 is not; 100/s (one token each 10 ms) never is. A
    /// slow_connect_ms of 7 is under two ticks, 8 is not.
    #[test]
    fn controls_finer_than_the_tick_are_warned_about() {
        let policy = |rate: &str, burst: u32| {
            super::parse::parse(
                &format!(
                    "[[scope]]\nname = \"s\"\ncgroup = \"a\"\n[[scope.rule]]\nname = \"r\"\n\
                     rate = \"{rate}\"\nburst = {burst}\n"
                ),
                "test.toml",
            )
            .unwrap()
        };
        let tick = 4_000_000;
        let w = super::coarse_controls(&policy("10000/s", 10), tick);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].starts_with("scope s rule r: rate 10000/s with burst 10")
                && w[0].contains("at most 10 a tick (2500/s): raise burst to 40"),
            "{w:?}"
        );
        assert!(super::coarse_controls(&policy("10000/s", 40), tick).is_empty());
        assert!(super::coarse_controls(&policy("100/s", 1), tick).is_empty());
        let slow = |ms: u32| {
            let text = format!(
                "[[scope]]\nname = \"s\"\ncgroup = \"a\"\n[scope.breaker]\n\
                 slow_connect_ms = {ms}\nslow_ratio = 0.5\n"
            );
            super::coarse_controls(&super::parse::parse(&text, "t.toml").unwrap(), tick)
        };
        assert_eq!(
            slow(7),
            [
                "scope s: slow_connect_ms 7 is under two kernel ticks (4000 µs each): \
              handshake durations are known to a tick"
            ]
        );
        assert!(slow(8).is_empty());
    }
}
