//! Prometheus text exposition of a snapshot: the `connguard_` prefix, base units,
//! `_total` counters that never go down, and bounded label cardinality (the busiest
//! destinations per scope, the rest as dst="other"; listener guards' busiest callers,
//! the rest as caller="other").
use std::{
    collections::{HashMap, HashSet},
    sync::atomic::AtomicU64,
};

use connguard_api::stats::{Counts, ScopeStats, Snapshot};
use guard_common::CounterKey;

use crate::report::rollup::Rolled;
use prometheus_client::{
    encoding::text::encode,
    metrics::{counter::Counter as PromCounter, family::Family, gauge::Gauge},
    registry::Registry,
};

use super::listener_metrics::{self, CallerTotals};

/// Destinations per scope that get their own Prometheus series; the rest are counted
/// under dst="other" to bound cardinality.
pub const METRIC_TOP_DESTINATIONS: usize = 20;

/// What the `_total` series of a scope or destination count, in the order of TOTALS.
type Totals = [u64; TOTALS.len()];

/// The `_total` counters of scopes and destinations: NAME in
/// `connguard_{scope,destination}_NAME_total`, and its help.
const TOTALS: [(&str, &str); 9] = [
    ("admitted_connections", "Connections admitted"),
    ("shed_connections", "Connections refused at connect()"),
    (
        "would_shed_connections",
        "Connections observe mode would have refused",
    ),
    (
        "rate_limited_connections",
        "Connection attempts over a new-connection rate (shed, or would be in observe mode)",
    ),
    (
        "handshake_limited_connections",
        "Connection attempts over a max_connecting (shed, or would be in observe mode)",
    ),
    (
        "breaker_limited_connections",
        "Connection attempts met by an open breaker, or a half-open one past its share (shed, or would be in observe mode)",
    ),
    (
        "breaker_opened",
        "Breaker transitions to open (from closed or half-open)",
    ),
    (
        "breaker_half_opened",
        "Breaker transitions to a half-open step",
    ),
    ("breaker_closed", "Breaker transitions to closed"),
];

fn totals(c: &Counts) -> Totals {
    [
        c.admitted,
        c.shed,
        c.would_shed,
        c.rate_limited,
        c.handshake_limited,
        c.breaker_limited,
        c.breaker_opened,
        c.breaker_half_opened,
        c.breaker_closed,
    ]
}

/// What /metrics exported of each scope's destinations, kept from one scrape to the
/// next so that no `_total` series goes down (Prometheus reads a fall as a counter
/// reset, and rate() then counts the whole value again). A listed destination's series
/// is its counter's totals; `dst="other"` is a running total, the scope's totals less
/// what listed series gained while listed. So a destination that leaves the list (or
/// is forgotten) counts in `other` from then on, and one that enters it leaves its past
/// in `other` (the first value of a new series is no increase to rate()). The daemon
/// forgets no destination while it is listed (`lists`): its series never starts again
/// from 0.
#[derive(Default)]
pub struct Exported {
    /// Every scope's listed destinations at the last scrape, with their totals then.
    listed: HashMap<CounterKey, Totals>,
    /// By scope name: what its listed series gained while listed (at the scope's first
    /// scrape, all they had), and its `other` totals as last exported.
    others: HashMap<String, (Totals, Totals)>,
    /// The annotated pods' scopes, counted in their scopes' series.
    rolled: Rolled,
    /// EADDRNOTAVAIL failures by (scope, comm) as last exported: an annotated pod's go
    /// with its scope, and the series stays where it was.
    eaddrnotavail: HashMap<(String, String), u64>,
    /// What listener guards' callers' listed series gained while listed, and their
    /// `other` totals as last exported (as `others` for scopes).
    callers: CallerTotals,
}

impl Exported {
    /// Whether the last scrape listed destination `key`.
    pub fn lists(&self, key: &CounterKey) -> bool {
        self.listed.contains_key(key)
    }

    /// The `other` totals of scope `s`, whose destinations are listed from now on (added
    /// to `listed`).
    fn other(&mut self, s: &ScopeStats, listed: &mut HashMap<CounterKey, Totals>) -> Totals {
        let first = !self.others.contains_key(&s.name);
        let (credited, exported) = self.others.entry(s.name.clone()).or_default();
        for d in &s.destinations {
            let now = totals(&d.counts);
            let before = match self.listed.get(&d.key) {
                Some(before) => *before,
                None if first => [0; TOTALS.len()],
                None => now,
            };
            for i in 0..TOTALS.len() {
                credited[i] += now[i].saturating_sub(before[i]);
            }
            listed.insert(d.key, now);
        }
        let scope = totals(&s.counts);
        // Never below the last export: a connection is counted at its destination just
        // before its scope, and a scrape between the two sees the scope short.
        for i in 0..TOTALS.len() {
            exported[i] = exported[i].max(scope[i].saturating_sub(credited[i]));
        }
        *exported
    }
}

/// Prometheus text exposition of a snapshot cut to the busiest destinations, with
/// `exported` what the scrapes before exported (updated).
pub fn render(snap: &Snapshot, exported: &mut Exported) -> String {
    let mut reg = Registry::with_prefix("connguard");
    // Families are written in the order they are registered.
    let scopes = ScopeFamilies::register(&mut reg);
    let daemon = DaemonFamilies::register(&mut reg);
    let rolled = exported.rolled.roll(&snap.scopes);
    scopes.fill(&rolled, exported);
    members(&mut reg, &rolled);
    ports(&mut reg, snap, &rolled, exported);
    listener_metrics::fill(&mut reg, snap, &mut exported.callers);
    jobs(&mut reg, snap);
    runtimes(&mut reg, snap);
    fleet(&mut reg, snap);
    drills(&mut reg, snap);
    daemon.fill(snap);
    let mut out = String::new();
    encode(&mut out, &reg).expect("writing to a String cannot fail");
    text_format(&out)
}

/// A series' labels.
type Labels = Vec<(&'static str, String)>;

pub(super) fn gauge(reg: &mut Registry, name: &str, help: &str) -> Family<Labels, Gauge> {
    let f = Family::<Labels, Gauge>::default();
    reg.register(name, help, f.clone());
    f
}

/// A gauge of one series, without labels.
fn single_gauge(reg: &mut Registry, name: &str, help: &str) -> Gauge {
    let g = Gauge::<i64>::default();
    reg.register(name, help, g.clone());
    g
}

pub(super) fn counter(reg: &mut Registry, name: &str, help: &str) -> Family<Labels, PromCounter> {
    let f = Family::<Labels, PromCounter>::default();
    reg.register(name, help, f.clone());
    f
}

/// One counter family per TOTALS entry, `connguard_{level}_NAME_total`, helped as of
/// `of`.
fn totals_families(reg: &mut Registry, level: &str, of: &str) -> Vec<Family<Labels, PromCounter>> {
    TOTALS
        .iter()
        .map(|(name, help)| counter(reg, &format!("{level}_{name}"), &format!("{help}, {of}")))
        .collect()
}

/// The series of scopes and of their destinations: connections, totals, breakers.
struct ScopeFamilies {
    active: Family<Labels, Gauge>,
    peak: Family<Labels, Gauge>,
    totals: Vec<Family<Labels, PromCounter>>,
    connecting: Family<Labels, Gauge>,
    d_active: Family<Labels, Gauge>,
    d_totals: Vec<Family<Labels, PromCounter>>,
    d_connecting: Family<Labels, Gauge>,
    breaker_state: Family<Labels, Gauge>,
}

/// A destination's series: its `active` and `connecting` gauges, its totals, and its
/// breaker's state (`breaker_state`), if it has a breaker.
type DestinationRow = ([u64; 2], Totals, Option<i64>);

impl ScopeFamilies {
    fn register(reg: &mut Registry) -> Self {
        let active = gauge(
            reg,
            "scope_active_connections",
            "Active connections of the scope (admitted, not yet in TCP_CLOSE)",
        );
        let peak = gauge(
            reg,
            "scope_peak_connections",
            "Highest active connections seen for the scope",
        );
        let totals = totals_families(reg, "scope", "per scope");
        let connecting = gauge(
            reg,
            "scope_connecting_connections",
            "Connections of the scope in the handshake (admitted, SYN_SENT), counted when the scope sets max_connecting",
        );
        let d_active = gauge(
            reg,
            "destination_active_connections",
            "Active connections per destination (top destinations; the rest summed as dst=\"other\")",
        );
        let d_totals = totals_families(reg, "destination", "per destination");
        let d_connecting = gauge(
            reg,
            "destination_connecting_connections",
            "Connections in the handshake (admitted, SYN_SENT) per destination, counted when its rule sets max_connecting per endpoint (the rest summed as dst=\"other\")",
        );
        let breaker_state = gauge(
            reg,
            "breaker_state",
            "The circuit breaker of a listed destination: 0 closed, 1 open, 2 half-open",
        );
        ScopeFamilies {
            active,
            peak,
            totals,
            connecting,
            d_active,
            d_totals,
            d_connecting,
            breaker_state,
        }
    }

    /// Every scope's series and its destinations', with `exported` (updated) what the
    /// scrapes before exported.
    fn fill(&self, scopes: &[ScopeStats], exported: &mut Exported) {
        let mut listed_now = HashMap::new();
        for s in scopes {
            self.scope(s);
            // The snapshot lists the busiest destinations (METRIC_TOP_DESTINATIONS) and
            // `other` counts the rest: label cardinality stays bounded.
            let other = exported.other(s, &mut listed_now);
            for (rule, dst, row) in destination_rows(s, other) {
                self.destination(&s.name, rule, dst, row);
            }
        }
        exported.listed = listed_now;
    }

    fn scope(&self, s: &ScopeStats) {
        let l = vec![("scope", s.name.clone())];
        self.active.get_or_create(&l).set(s.counts.active as i64);
        self.peak.get_or_create(&l).set(s.counts.peak as i64);
        for (f, v) in self.totals.iter().zip(totals(&s.counts)) {
            f.get_or_create(&l).inc_by(v);
        }
        self.connecting
            .get_or_create(&l)
            .set(s.counts.connecting as i64);
    }

    fn destination(&self, scope: &str, rule: &str, dst: &str, row: DestinationRow) {
        let ([active, connecting], counts, breaker) = row;
        let l = vec![
            ("scope", scope.to_string()),
            ("rule", rule.to_string()),
            ("dst", dst.to_string()),
        ];
        self.d_active.get_or_create(&l).set(active as i64);
        self.d_connecting.get_or_create(&l).set(connecting as i64);
        for (f, v) in self.d_totals.iter().zip(counts) {
            f.get_or_create(&l).inc_by(v);
        }
        if let Some(state) = breaker {
            self.breaker_state.get_or_create(&l).set(state);
        }
    }
}

/// The rows of scope `s`'s destinations (rule, dst, series): each listed one, then
/// dst="other" with `other` its totals.
fn destination_rows(
    s: &ScopeStats,
    other: Totals,
) -> impl Iterator<Item = (&str, &str, DestinationRow)> {
    // What the listed destinations leave of a scope's gauge.
    let unlisted = |f: fn(&Counts) -> u64| -> u64 {
        let sum: u64 = s.destinations.iter().map(|d| f(&d.counts)).sum();
        f(&s.counts).saturating_sub(sum)
    };
    let other_gauges = [unlisted(|c| c.active), s.unlisted_connecting];
    s.destinations
        .iter()
        .map(|d| {
            (
                d.rule.as_deref().unwrap_or_default(),
                d.dst.as_str(),
                (
                    [d.counts.active, d.counts.connecting],
                    totals(&d.counts),
                    d.breaker.as_ref().map(|b| match b.state.as_str() {
                        "open" => 1,
                        "half_open" => 2,
                        _ => 0,
                    }),
                ),
            )
        })
        .chain([("", "other", (other_gauges, other, None))])
}

/// The daemon's own series: fail-open and lost counts, the policy, the kernel, the
/// programs' costs.
struct DaemonFamilies {
    internal: PromCounter,
    lost: PromCounter,
    lease_expired: PromCounter,
    audit_corrections: PromCounter,
    generation: Gauge,
    policy_error: Gauge,
    feature: Family<Labels, Gauge>,
    destinations: Gauge,
    destinations_capacity: Gauge,
    runs: Family<Labels, PromCounter>,
    run_time: Family<Labels, PromCounter<f64, AtomicU64>>,
}

impl DaemonFamilies {
    fn register(reg: &mut Registry) -> Self {
        let internal = PromCounter::<u64>::default();
        reg.register(
            "internal_errors",
            "Fail-open events: connections let through uncounted because of an internal problem",
            internal.clone(),
        );
        let lost = PromCounter::<u64>::default();
        reg.register(
            "lost_events",
            "Diagnostic events (TIME_WAIT births, EADDRNOTAVAIL failures, listener RSTs) not counted because their map was full",
            lost.clone(),
        );
        let lease_expired = PromCounter::<u64>::default();
        reg.register(
            "lease_expired",
            "Connections let through over a budget because no daemon held the lease",
            lease_expired.clone(),
        );
        let audit_corrections = PromCounter::<u64>::default();
        reg.register(
            "audit_corrections",
            "Counters the audit found different from the live sockets and corrected (0 but for a bug)",
            audit_corrections.clone(),
        );
        let generation = single_gauge(
            reg,
            "policy_generation",
            "Generation of the policy in force (1 = first)",
        );
        let policy_error = single_gauge(
            reg,
            "policy_last_reload_failed",
            "1 when the last reload was rejected and the previous policy stays in force",
        );
        let feature = gauge(
            reg,
            "kernel_feature",
            "1 when the kernel has the feature (probed at start; names as in `connguard kernel`), 0 when the daemon runs without it",
        );
        let destinations = single_gauge(
            reg,
            "destination_table_entries",
            "Entries of the kernel's destination counter map: (scope, rule, address, port) keys of every scope",
        );
        let destinations_capacity = single_gauge(
            reg,
            "destination_table_capacity",
            "The most entries the kernel's destination counter map holds",
        );
        let runs = counter(reg, "program_runs", "eBPF program runs (kernel bpf_stats)");
        let run_time = Family::<Labels, PromCounter<f64, AtomicU64>>::default();
        reg.register(
            "program_run_time_seconds",
            "eBPF program run time (kernel bpf_stats)",
            run_time.clone(),
        );
        DaemonFamilies {
            internal,
            lost,
            lease_expired,
            audit_corrections,
            generation,
            policy_error,
            feature,
            destinations,
            destinations_capacity,
            runs,
            run_time,
        }
    }

    fn fill(&self, snap: &Snapshot) {
        self.internal.inc_by(snap.internal_errors);
        self.lost.inc_by(snap.lost_events);
        self.lease_expired.inc_by(snap.lease_expired);
        self.audit_corrections.inc_by(snap.audit_corrections);
        for (name, present) in snap.kernel.iter().flat_map(|k| &k.features) {
            self.feature
                .get_or_create(&vec![("feature", name.clone())])
                .set(i64::from(*present));
        }
        let t = &snap.destination_table;
        self.destinations.set(t.entries as i64);
        self.destinations_capacity.set(t.capacity as i64);
        self.generation.set(snap.policy.generation as i64);
        self.policy_error
            .set(snap.policy.last_error.is_some() as i64);
        for p in &snap.programs {
            let l = vec![("program", p.name.clone())];
            self.runs.get_or_create(&l).inc_by(p.run_count);
            self.run_time
                .get_or_create(&l)
                .inc_by(p.run_time_ns as f64 / 1e9);
        }
    }
}

/// Each scope's members: how many cgroups it selects, and the workloads of the first
/// MEMBERS_LISTED (an info series each).
fn members(reg: &mut Registry, scopes: &[ScopeStats]) {
    let count = gauge(
        reg,
        "scope_members",
        "Cgroups the scope selects (its pattern's, its workloads', its annotated pods'), each governing its descendants",
    );
    let info = gauge(
        reg,
        "scope_workload_info",
        "1 for each workload (pod, container, unit) among the first 50 members of the scope, by cgroup path",
    );
    for s in scopes {
        count
            .get_or_create(&vec![("scope", s.name.clone())])
            .set(s.member_count as i64);
        for w in s.members.iter().filter_map(|m| m.workload.clone()) {
            info.get_or_create(&vec![("scope", s.name.clone()), ("workload", w)])
                .set(1);
        }
    }
}

/// The container runtimes followed for the policy's pod and container selectors.
fn runtimes(reg: &mut Registry, snap: &Snapshot) {
    let connected = gauge(
        reg,
        "runtime_connected",
        "1 while the runtime (containerd, docker) is followed; 0 while unreachable: its workloads last listed stay selected",
    );
    let failures = gauge(
        reg,
        "runtime_failures",
        "Failed attempts to reach the runtime since it was last connected",
    );
    for r in &snap.runtimes {
        let l = vec![("source", r.source.clone())];
        connected.get_or_create(&l).set(r.connected as i64);
        failures.get_or_create(&l).set(r.failures as i64);
    }
}

/// This host's part in the fleet budgets: one series per budget (a few per policy).
fn fleet(reg: &mut Registry, snap: &Snapshot) {
    let Some(f) = &snap.fleet else { return };
    let share = gauge(
        reg,
        "fleet_share",
        "This host's share of the fleet budget: the max_connections its kernel enforces over the drawing rule (-1 before the first)",
    );
    let total = gauge(
        reg,
        "fleet_total",
        "The fleet budget's total as split (the smallest any live host names)",
    );
    let wants = gauge(
        reg,
        "fleet_wants",
        "This host's demand on the fleet budget: active connections plus recent sheds, with headroom",
    );
    let hosts = gauge(
        reg,
        "fleet_hosts",
        "Hosts with a live record for the fleet budget",
    );
    let safe = gauge(
        reg,
        "fleet_safe_share_in_force",
        "1 while this host enforces the budget's safe share (no live lease in etcd to show)",
    );
    for b in &f.budgets {
        let l = vec![("budget", b.name.clone())];
        share
            .get_or_create(&l)
            .set(b.share.map_or(-1, |s| s as i64));
        total.get_or_create(&l).set(b.total as i64);
        wants.get_or_create(&l).set(b.wants as i64);
        hosts.get_or_create(&l).set(b.hosts as i64);
        safe.get_or_create(&l).set(b.safe as i64);
    }
    let sync = Family::<Labels, Gauge<f64, AtomicU64>>::default();
    reg.register(
        "fleet_last_sync_seconds",
        "Seconds since etcd last acknowledged this host's lease (NaN before the first)",
        sync.clone(),
    );
    sync.get_or_create(&vec![("identity", f.identity.clone())])
        .set(f.last_sync_ms.map_or(f64::NAN, |ms| ms as f64 / 1000.0));
    let errors = counter(reg, "fleet_store_errors", "Failed requests to etcd");
    errors
        .get_or_create(&vec![("identity", f.identity.clone())])
        .inc_by(f.store_errors);
}

/// What the port diagnosis counts: TIME_WAIT births per scope (`scopes`, rolled up),
/// EADDRNOTAVAIL failures per scope and process, and the use of the watched
/// destinations' ports.
fn ports(reg: &mut Registry, snap: &Snapshot, scopes: &[ScopeStats], exported: &mut Exported) {
    let tw = counter(
        reg,
        "scope_time_wait_created",
        "TIME_WAIT entries born on the scope's connections",
    );
    let eaddr = counter(
        reg,
        "eaddrnotavail",
        "connect() failures with EADDRNOTAVAIL (no local port), per scope and process name",
    );
    let port_use = Family::<Labels, Gauge<f64, AtomicU64>>::default();
    reg.register(
        "port_use_ratio",
        "Ports held toward a destination near a watermark / ephemeral ports",
        port_use.clone(),
    );
    for s in scopes {
        tw.get_or_create(&vec![("scope", s.name.clone())])
            .inc_by(s.time_wait_created);
    }
    // An annotated pod's failures count in its scope's series.
    let rolled_into = |name: &str| -> String {
        let parent = snap.scope(name).and_then(|s| s.parent.as_deref());
        match parent.filter(|p| scopes.iter().any(|s| s.name == *p)) {
            Some(p) => p.to_string(),
            None => name.to_string(),
        }
    };
    let mut failures: HashMap<(String, String), u64> = HashMap::new();
    for e in &snap.eaddrnotavail {
        *failures
            .entry((rolled_into(&e.scope), e.comm.clone()))
            .or_default() += e.count;
    }
    for (key, last) in &exported.eaddrnotavail {
        let now = failures.entry(key.clone()).or_default();
        *now = (*now).max(*last);
    }
    for ((scope, comm), n) in &failures {
        eaddr
            .get_or_create(&vec![("scope", scope.clone()), ("comm", comm.clone())])
            .inc_by(*n);
    }
    exported.eaddrnotavail = failures;
    for w in &snap.watched_ports {
        port_use
            .get_or_create(&vec![
                ("netns", w.netns.to_string()),
                ("dst", w.dst.clone()),
            ])
            .set(w.ratio);
    }
}

/// The daemon's periodic jobs: runs, failures, and whether the last run failed.
fn jobs(reg: &mut Registry, snap: &Snapshot) {
    let job_runs = counter(reg, "job_runs", "Runs of the daemon's periodic jobs");
    let job_failures = counter(
        reg,
        "job_failures",
        "Runs of the daemon's periodic jobs that failed (logged, run again at the next period)",
    );
    let job_failing = gauge(reg, "job_failing", "1 while the job's last run failed");
    for j in &snap.jobs {
        // Not `job`: Prometheus gives every target a `job` label, and would rename this
        // one `exported_job`.
        let l = vec![("job_name", j.name.clone())];
        job_runs.get_or_create(&l).inc_by(j.runs);
        job_failures.get_or_create(&l).inc_by(j.failures);
        job_failing
            .get_or_create(&l)
            .set(j.last_error.is_some() as i64);
    }
}

/// The drills `stats` lists (running, and the last ended), each run its own series:
/// `started` (ms since the Unix epoch) tells two runs of one name apart, so that a
/// counter never restarts under the same labels.
fn drills(reg: &mut Registry, snap: &Snapshot) {
    let attempts = counter(
        reg,
        "drill_attempts",
        "Connection attempts of a drill's target while it ran",
    );
    let faults = counter(
        reg,
        "drill_faults",
        "Connection attempts a drill faulted (apart from sheds)",
    );
    let capped = counter(
        reg,
        "drill_capped",
        "Attempts a drill's probability chose that its blast-radius cap let through",
    );
    let running = gauge(reg, "drill_running", "1 while the drill runs");
    let aborted = gauge(
        reg,
        "drill_aborted",
        "1 when the drill was aborted (its steady state broke)",
    );
    for d in &snap.drills {
        let l = vec![
            ("drill", d.spec.name.clone()),
            ("scope", d.spec.scope.clone()),
            ("fault", d.spec.fault.to_string()),
            ("started", d.started_unix_ms.to_string()),
        ];
        attempts.get_or_create(&l).inc_by(d.attempts);
        faults.get_or_create(&l).inc_by(d.faulted);
        capped.get_or_create(&l).inc_by(d.capped);
        running.get_or_create(&l).set((d.state == "running") as i64);
        aborted.get_or_create(&l).set((d.state == "aborted") as i64);
    }
}

/// OpenMetrics text, which prometheus_client writes, as Prometheus text format 0.0.4,
/// which /metrics serves: a counter family is named as its samples are, with `_total`,
/// and there is no `# EOF`. Read as 0.0.4, OpenMetrics counters are samples of a family
/// with no type nor help (Prometheus stores them untyped; `promtool check metrics`
/// says "no help text").
fn text_format(open_metrics: &str) -> String {
    let counters: HashSet<&str> = open_metrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(open_metrics.len() + 16 * counters.len());
    for line in open_metrics.lines().filter(|l| *l != "# EOF") {
        let family = ["# HELP ", "# TYPE "].into_iter().find_map(|prefix| {
            let (name, rest) = line.strip_prefix(prefix)?.split_once(' ')?;
            counters.contains(name).then_some((prefix, name, rest))
        });
        match family {
            Some((prefix, name, rest)) => {
                out.push_str(prefix);
                out.push_str(name);
                out.push_str("_total ");
                out.push_str(rest);
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use connguard_api::stats::{DestStats, PolicyStatus};

    use super::*;

    fn counts(active: u64, admitted: u64) -> Counts {
        Counts {
            active,
            admitted,
            shed: admitted / 2,
            ..Default::default()
        }
    }

    /// Scope "api" with `scope` totals, listing `listed` (port, active, admitted), rule "db".
    fn snapshot(scope: Counts, listed: &[(u16, u64, u64)]) -> Snapshot {
        let destinations = listed
            .iter()
            .map(|&(port, active, admitted)| DestStats {
                rule: Some("db".into()),
                dst: format!("10.0.0.1:{port}"),
                counts: counts(active, admitted),
                breaker: None,
                key: CounterKey {
                    port,
                    ..Default::default()
                },
            })
            .collect();
        Snapshot {
            policy: PolicyStatus::default(),
            scopes: vec![ScopeStats {
                name: "api".into(),
                cgroup: Some("/".into()),
                selectors: Vec::new(),
                annotations: false,
                parent: None,
                members: Vec::new(),
                member_count: 0,
                warnings: Vec::new(),
                mode: "enforce".into(),
                limits: Default::default(),
                counts: scope,
                time_wait_created: 0,
                rules: Vec::new(),
                destinations,
                open_breakers: Vec::new(),
                unlisted_connecting: 2,
            }],
            internal_errors: 0,
            lost_events: 0,
            lease_expired: 0,
            audit_corrections: 0,
            programs: Vec::new(),
            host_wide: Default::default(),
            eaddrnotavail: Vec::new(),
            watched_ports: Vec::new(),
            listeners: Vec::new(),
            caller_tables: Default::default(),
            destination_table: Default::default(),
            jobs: Vec::new(),
            kernel: None,
            runtimes: Vec::new(),
            fleet: None,
            drills: Vec::new(),
        }
    }

    /// The value of the series `name{labels}` in `text`.
    fn value(text: &str, name: &str, labels: &str) -> Option<u64> {
        let prefix = format!("{name}{{{labels}}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .map(|v| v.parse().unwrap())
    }

    const OTHER: &str = "scope=\"api\",rule=\"\",dst=\"other\"";
    const ADMITTED: &str = "connguard_destination_admitted_connections_total";

    #[test]
    fn other_is_the_rest_of_the_scope_and_never_goes_down() {
        let mut exported = Exported::default();
        // Port 1 listed (7 admitted); 9 more in destinations not listed, 3 of them active.
        let text = render(&snapshot(counts(5, 16), &[(1, 2, 7)]), &mut exported);
        let port1 = "scope=\"api\",rule=\"db\",dst=\"10.0.0.1:1\"";
        assert_eq!(value(&text, ADMITTED, port1), Some(7), "{text}");
        assert_eq!(value(&text, ADMITTED, OTHER), Some(9), "{text}");
        assert_eq!(
            value(&text, "connguard_destination_shed_connections_total", OTHER),
            Some(8 - 3),
            "{text}"
        );
        assert_eq!(
            value(&text, "connguard_destination_active_connections", OTHER),
            Some(3),
            "{text}"
        );
        // The unlisted destinations' own handshakes, not the scope's count less the
        // listed ones (the scope counts none without a max_connecting of its own).
        assert_eq!(
            value(&text, "connguard_destination_connecting_connections", OTHER),
            Some(2),
            "{text}"
        );
        assert!(exported.lists(&CounterKey {
            port: 1,
            ..Default::default()
        }));
        // Port 2, with 4 admitted before and 2 since, takes port 1's place, which
        // admitted 1 more; a third destination (5 admitted) was forgotten. The rest of
        // the old listing (the 4, the 5) stays in `other`, which gains the 3 new.
        let text = render(&snapshot(counts(2, 19), &[(2, 2, 6)]), &mut exported);
        assert_eq!(value(&text, ADMITTED, port1), None, "{text}");
        assert_eq!(value(&text, ADMITTED, OTHER), Some(12), "{text}");
        // What port 2 gains from now on is its own series', not `other`'s.
        let text = render(&snapshot(counts(2, 20), &[(2, 2, 7)]), &mut exported);
        assert_eq!(value(&text, ADMITTED, OTHER), Some(12), "{text}");
        // A scrape that reads the destination's new connection before its scope's:
        // `other` stays where it was.
        let text = render(&snapshot(counts(2, 20), &[(2, 2, 8)]), &mut exported);
        assert_eq!(value(&text, ADMITTED, OTHER), Some(12), "{text}");
        // Prometheus text format 0.0.4: counters' families named as their samples.
        assert!(
            text.contains(&format!("\n# TYPE {ADMITTED} counter\n")),
            "{text}"
        );
        assert!(
            text.contains(&format!("\n# HELP {ADMITTED} Connections admitted")),
            "{text}"
        );
        assert!(!text.contains("# EOF"), "{text}");
        // 11 series per listed destination, 11 for the rest.
        let series = text.lines().filter(|l| {
            l.starts_with("connguard_destination_")
                && !l.starts_with("connguard_destination_table_")
        });
        assert_eq!(series.count(), 22, "{text}");
    }
}
