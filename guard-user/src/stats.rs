//! What the daemon reports: the JSON snapshot (DESIGN.md), the table of
//! `connguard stats`, and Prometheus text.
use std::{
    cmp::Reverse,
    collections::HashMap,
    fmt::Write,
    sync::{Arc, atomic::AtomicU64},
};

use guard_common::{Counter, MODE_ENFORCE, NO_RULE};
use prometheus_client::{
    encoding::text::encode,
    metrics::{counter::Counter as PromCounter, family::Family, gauge::Gauge},
    registry::Registry,
};
use serde::{Deserialize, Serialize};

use crate::{
    accounting::{Accounting, unmapped},
    loader::ProgramCost,
    ports::EaddrnotavailCount,
};

/// Destinations per scope that get their own Prometheus series; the rest are summed
/// under dst="other" to bound cardinality.
pub const METRIC_TOP_DESTINATIONS: usize = 20;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Snapshot {
    pub policy: PolicyStatus,
    pub scopes: Vec<ScopeStats>,
    /// Fail-open events: a full map or another internal problem let a connection
    /// through uncounted.
    pub internal_errors: u64,
    /// Per-program cost from the kernel's bpf_stats (`connguard run --bpf-stats`).
    pub programs: Vec<ProgramCost>,
    /// connect() failures with EADDRNOTAVAIL, per scope and process name.
    pub eaddrnotavail: Vec<EaddrnotavailCount>,
    /// Destinations near a port watermark, as last read from the socket tables.
    pub watched_ports: Vec<WatchedPort>,
    /// `[[listener]]` guards.
    pub listeners: Vec<crate::listeners::ListenerStats>,
}

/// Ports held toward a destination in a watched network namespace.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WatchedPort {
    /// Network namespace cookie (SO_NETNS_COOKIE).
    pub netns: u64,
    pub dst: String,
    /// Ports held / ephemeral ports (the most over source addresses).
    pub ratio: f64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PolicyStatus {
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
}

impl Counts {
    /// Adds `c`'s active, admitted, shed and would_shed (peaks do not add up).
    fn add_totals(&mut self, c: &Counts) {
        self.active += c.active;
        self.admitted += c.admitted;
        self.shed += c.shed;
        self.would_shed += c.would_shed;
    }
}

impl From<&Counter> for Counts {
    fn from(c: &Counter) -> Self {
        Counts {
            active: c.active,
            peak: c.peak,
            admitted: c.admitted,
            shed: c.shed,
            would_shed: c.would_shed,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScopeStats {
    pub name: String,
    pub cgroup: String,
    pub mode: String,
    pub max_connections: Option<u64>,
    #[serde(flatten)]
    pub counts: Counts,
    /// TIME_WAIT entries born on the scope's connections (total).
    pub time_wait_created: u64,
    pub rules: Vec<RuleStats>,
    pub destinations: Vec<DestStats>,
    /// The destinations left out of `destinations` (see [`scopes`]), summed; `peak` is
    /// not summed. Not part of the JSON.
    #[serde(skip)]
    pub other: Option<Counts>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RuleStats {
    pub name: String,
    pub max_connections: Option<u64>,
    /// "endpoint" or "rule".
    pub per: String,
    #[serde(flatten)]
    pub counts: Counts,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DestStats {
    /// The rule that matched, or null when none did (shared by its destinations).
    pub rule: Option<Arc<str>>,
    /// `a.b.c.d:port` or `[v6]:port`.
    pub dst: String,
    #[serde(flatten)]
    pub counts: Counts,
}

/// The scopes of the policy in force with their counters, destinations busiest first.
/// With `top`, each scope lists at most that many destinations and sums the others in
/// [`ScopeStats::other`] (what a scrape needs, without sorting every destination).
pub fn scopes(acct: &Accounting, top: Option<usize>) -> Vec<ScopeStats> {
    let Some(policy) = acct.policy.clone() else {
        return Vec::new();
    };
    // Ids (assigned when the policy was applied), then one reverse map of rule names.
    let ids: Vec<(Option<u32>, Vec<Option<u32>>)> = policy
        .scopes
        .iter()
        .map(|s| {
            let scope_id = acct.ids.scope(&s.name);
            let rules = s.rules.iter().map(|r| acct.ids.rule(&s.name, &r.name));
            (scope_id, rules.collect())
        })
        .collect();
    let rule_names: HashMap<u32, Arc<str>> = acct
        .ids
        .rule_names()
        .into_iter()
        .map(|(id, name)| (id, name.into()))
        .collect();
    // Scope and rule totals by id, from their arrays; one pass over the destination
    // counters, by scope.
    let scope_totals = acct.scope_counters();
    let rule_totals = acct.rule_counters();
    let total = |totals: &[Counter], id: Option<u32>| -> Counts {
        id.and_then(|id| totals.get(id as usize))
            .map(Counts::from)
            .unwrap_or_default()
    };
    let mut destinations_of: HashMap<u32, Vec<DestStats>> = HashMap::new();
    for (k, c) in acct.counters() {
        let rule = (k.rule_id != NO_RULE).then(|| {
            rule_names
                .get(&k.rule_id)
                .cloned()
                .unwrap_or_else(|| "?".into())
        });
        destinations_of
            .entry(k.scope_id)
            .or_default()
            .push(DestStats {
                rule,
                dst: crate::ports::endpoint(unmapped(k.addr), k.port),
                counts: (&c).into(),
            });
    }
    let time_waits = acct.time_wait_created();
    let mut out = Vec::new();
    for (s, (scope_id, rule_ids)) in policy.scopes.iter().zip(ids) {
        let rules = s
            .rules
            .iter()
            .zip(rule_ids)
            .map(|(r, id)| RuleStats {
                name: r.name.clone(),
                max_connections: r.max_connections,
                per: if r.per_endpoint { "endpoint" } else { "rule" }.into(),
                counts: total(&rule_totals, id),
            })
            .collect();
        let all = scope_id
            .and_then(|id| destinations_of.remove(&id))
            .unwrap_or_default();
        let (order, other) = busiest_first(&all, top);
        let destinations = in_order(all, &order);
        out.push(ScopeStats {
            name: s.name.clone(),
            cgroup: if s.cgroup.is_empty() {
                "/".into()
            } else {
                s.cgroup.clone()
            },
            mode: if s.mode == MODE_ENFORCE {
                "enforce"
            } else {
                "observe"
            }
            .into(),
            max_connections: s.max_connections,
            counts: total(&scope_totals, scope_id),
            time_wait_created: scope_id
                .and_then(|id| time_waits.get(&id).copied())
                .unwrap_or(0),
            rules,
            destinations,
            other,
        });
    }
    out
}

/// Indices of `destinations` busiest first: most active, then most admitted, then by address
/// text. With `top`, only the first `top`, and the counts of the others summed.
///
/// The order is worked out on small keys, not on the destinations, and the first 16 bytes of
/// the text (as a number) settle most ties without reaching the strings. Rows that
/// compare equal (one endpoint under two rules) have no order to keep.
fn busiest_first(destinations: &[DestStats], top: Option<usize>) -> (Vec<usize>, Option<Counts>) {
    let mut order: Vec<(Reverse<u64>, Reverse<u64>, u128, usize)> = destinations
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let c = &d.counts;
            (Reverse(c.active), Reverse(c.admitted), text_head(&d.dst), i)
        })
        .collect();
    let cmp = |a: &(Reverse<u64>, Reverse<u64>, u128, usize),
               b: &(Reverse<u64>, Reverse<u64>, u128, usize)| {
        (a.0, a.1, a.2)
            .cmp(&(b.0, b.1, b.2))
            .then_with(|| destinations[a.3].dst.cmp(&destinations[b.3].dst))
    };
    let mut other = None;
    if let Some(top) = top.filter(|&top| top < order.len()) {
        order.select_nth_unstable_by(top, cmp);
        let mut rest = Counts::default();
        for &(.., i) in &order[top..] {
            rest.add_totals(&destinations[i].counts);
        }
        order.truncate(top);
        other = Some(rest);
    }
    order.sort_unstable_by(cmp);
    (order.into_iter().map(|(.., i)| i).collect(), other)
}

/// `items[order[0]], items[order[1]], ...`: in place when `order` is a permutation of
/// all the items (no second 100,000-entry vector), else taken out one by one.
fn in_order<T: Default>(mut items: Vec<T>, order: &[usize]) -> Vec<T> {
    if order.len() < items.len() {
        return order
            .iter()
            .map(|&i| std::mem::take(&mut items[i]))
            .collect();
    }
    // Follow each cycle of the permutation: slot i takes the item now at order[i],
    // which is still its original item except for the cycle's start (then it is done).
    let mut placed = vec![false; items.len()];
    for start in 0..items.len() {
        let mut i = start;
        while !placed[i] {
            placed[i] = true;
            let from = order[i];
            if from == start {
                break;
            }
            items.swap(i, from);
            i = from;
        }
    }
    items
}

/// The first 16 bytes of `text`, zero-padded, as a number that orders like the text.
fn text_head(text: &str) -> u128 {
    let mut head = [0u8; 16];
    let n = text.len().min(head.len());
    head[..n].copy_from_slice(&text.as_bytes()[..n]);
    u128::from_be_bytes(head)
}

/// Prometheus text exposition of a snapshot cut to the busiest destinations.
pub fn prometheus(snap: &Snapshot) -> String {
    let mut reg = Registry::with_prefix("connguard");
    type Labels = Vec<(&'static str, String)>;
    let gauge = |reg: &mut Registry, name: &str, help: &str| {
        let f = Family::<Labels, Gauge>::default();
        reg.register(name, help, f.clone());
        f
    };
    let counter = |reg: &mut Registry, name: &str, help: &str| {
        let f = Family::<Labels, PromCounter>::default();
        reg.register(name, help, f.clone());
        f
    };
    let s_active = gauge(
        &mut reg,
        "scope_active_connections",
        "Active connections of the scope (admitted, not yet in TCP_CLOSE)",
    );
    let s_peak = gauge(
        &mut reg,
        "scope_peak_connections",
        "Highest active connections seen for the scope",
    );
    let s_adm = counter(
        &mut reg,
        "scope_admitted_connections",
        "Connections admitted for the scope",
    );
    let s_shed = counter(
        &mut reg,
        "scope_shed_connections",
        "Connections refused at connect() for the scope",
    );
    let s_would = counter(
        &mut reg,
        "scope_would_shed_connections",
        "Connections observe mode would have refused",
    );
    let d_active = gauge(
        &mut reg,
        "destination_active_connections",
        "Active connections per destination (top destinations; the rest summed as dst=\"other\")",
    );
    let d_adm = counter(
        &mut reg,
        "destination_admitted_connections",
        "Connections admitted per destination",
    );
    let d_shed = counter(
        &mut reg,
        "destination_shed_connections",
        "Connections refused per destination",
    );
    let d_would = counter(
        &mut reg,
        "destination_would_shed_connections",
        "Connections observe mode would have refused per destination",
    );
    let internal = PromCounter::<u64>::default();
    reg.register(
        "internal_errors",
        "Fail-open events: connections let through uncounted because of an internal problem",
        internal.clone(),
    );
    let generation = Gauge::<i64>::default();
    reg.register(
        "policy_generation",
        "Generation of the policy in force (1 = first)",
        generation.clone(),
    );
    let policy_error = Gauge::<i64>::default();
    reg.register(
        "policy_last_reload_failed",
        "1 when the last reload was rejected and the previous policy stays in force",
        policy_error.clone(),
    );
    let runs = counter(
        &mut reg,
        "program_runs",
        "eBPF program runs (kernel bpf_stats)",
    );
    let run_time = Family::<Labels, PromCounter<f64, AtomicU64>>::default();
    reg.register(
        "program_run_time_seconds",
        "eBPF program run time (kernel bpf_stats)",
        run_time.clone(),
    );

    for s in &snap.scopes {
        let l = || vec![("scope", s.name.clone())];
        s_active.get_or_create(&l()).set(s.counts.active as i64);
        s_peak.get_or_create(&l()).set(s.counts.peak as i64);
        s_adm.get_or_create(&l()).inc_by(s.counts.admitted);
        s_shed.get_or_create(&l()).inc_by(s.counts.shed);
        s_would.get_or_create(&l()).inc_by(s.counts.would_shed);
        // The snapshot lists the busiest destinations and sums the rest in `other`
        // (`scopes(acct, Some(METRIC_TOP_DESTINATIONS))`): label cardinality stays bounded.
        let rows = s
            .destinations
            .iter()
            .map(|d| {
                (
                    d.rule.as_deref().unwrap_or_default(),
                    d.dst.as_str(),
                    &d.counts,
                )
            })
            .chain(s.other.iter().map(|c| ("", "other", c)));
        for (rule, dst, c) in rows {
            let l = vec![
                ("scope", s.name.clone()),
                ("rule", rule.to_string()),
                ("dst", dst.to_string()),
            ];
            d_active.get_or_create(&l).set(c.active as i64);
            d_adm.get_or_create(&l).inc_by(c.admitted);
            d_shed.get_or_create(&l).inc_by(c.shed);
            d_would.get_or_create(&l).inc_by(c.would_shed);
        }
    }
    let tw = counter(
        &mut reg,
        "scope_time_wait_created",
        "TIME_WAIT entries born on the scope's connections",
    );
    let eaddr = counter(
        &mut reg,
        "eaddrnotavail",
        "connect() failures with EADDRNOTAVAIL (no local port), per scope and process name",
    );
    let port_use = Family::<Labels, Gauge<f64, AtomicU64>>::default();
    reg.register(
        "port_use_ratio",
        "Ports held toward a destination near a watermark / ephemeral ports",
        port_use.clone(),
    );
    for s in &snap.scopes {
        tw.get_or_create(&vec![("scope", s.name.clone())])
            .inc_by(s.time_wait_created);
    }
    for e in &snap.eaddrnotavail {
        eaddr
            .get_or_create(&vec![("scope", e.scope.clone()), ("comm", e.comm.clone())])
            .inc_by(e.count);
    }
    for w in &snap.watched_ports {
        port_use
            .get_or_create(&vec![
                ("netns", w.netns.to_string()),
                ("dst", w.dst.clone()),
            ])
            .set(w.ratio);
    }
    let rst = counter(
        &mut reg,
        "listener_rst_shed",
        "SYNs answered with RST by a listener guard",
    );
    let would_rst = counter(
        &mut reg,
        "listener_would_rst",
        "SYNs a listener guard in observe mode would have answered with RST",
    );
    let shedding = gauge(
        &mut reg,
        "listener_shedding",
        "1 while the listener's accept queue is past its watermark",
    );
    let queue = gauge(
        &mut reg,
        "listener_accept_queue",
        "Connections waiting to be accepted (guarded listeners)",
    );
    let backlog = gauge(
        &mut reg,
        "listener_backlog",
        "Effective backlog, min(listen() backlog, somaxconn) (guarded listeners)",
    );
    let syn_recv = gauge(
        &mut reg,
        "listener_syn_recv",
        "Half-open connections (guarded listeners)",
    );
    for l in &snap.listeners {
        for q in &l.queues {
            let labels = vec![("listener", l.name.clone()), ("addr", q.addr.clone())];
            queue.get_or_create(&labels).set(q.accept_queue as i64);
            backlog.get_or_create(&labels).set(q.backlog as i64);
            syn_recv.get_or_create(&labels).set(q.syn_recv as i64);
        }
        let labels = vec![("listener", l.name.clone())];
        rst.get_or_create(&labels).inc_by(l.rst_shed);
        would_rst.get_or_create(&labels).inc_by(l.would_rst);
        shedding.get_or_create(&labels).set(l.shedding as i64);
    }
    internal.inc_by(snap.internal_errors);
    generation.set(snap.policy.generation as i64);
    policy_error.set(snap.policy.last_error.is_some() as i64);
    for p in &snap.programs {
        let l = vec![("program", p.name.clone())];
        runs.get_or_create(&l).inc_by(p.run_count);
        run_time
            .get_or_create(&l)
            .inc_by(p.run_time_ns as f64 / 1e9);
    }
    let mut out = String::new();
    encode(&mut out, &reg).expect("writing to a String cannot fail");
    out
}

/// The readable form of `connguard stats`.
pub fn table(snap: &Snapshot) -> String {
    let mut out = String::new();
    let p = &snap.policy;
    let _ = writeln!(out, "policy: {} (generation {})", p.source, p.generation);
    if let Some(e) = &p.last_error {
        let _ = writeln!(
            out,
            "last reload REJECTED, previous policy still in force: {e}"
        );
    }
    let _ = writeln!(out, "internal errors (fail-open): {}", snap.internal_errors);
    for s in &snap.scopes {
        let budget = s
            .max_connections
            .map_or("none".to_string(), |m| m.to_string());
        let _ = writeln!(
            out,
            "\nscope {} [{}] cgroup {}  budget {}",
            s.name, s.mode, s.cgroup, budget
        );
        let c = &s.counts;
        let _ = writeln!(
            out,
            "  active {}  peak {}  admitted {}  shed {}  would_shed {}",
            c.active, c.peak, c.admitted, c.shed, c.would_shed
        );
        if s.destinations.is_empty() {
            continue;
        }
        let _ = writeln!(
            out,
            "  {:<16} {:<46} {:>8} {:>8} {:>10} {:>8} {:>10}",
            "RULE", "DESTINATION", "ACTIVE", "PEAK", "ADMITTED", "SHED", "WOULD_SHED"
        );
        for d in &s.destinations {
            let c = &d.counts;
            let _ = writeln!(
                out,
                "  {:<16} {:<46} {:>8} {:>8} {:>10} {:>8} {:>10}",
                d.rule.as_deref().unwrap_or("-"),
                d.dst,
                c.active,
                c.peak,
                c.admitted,
                c.shed,
                c.would_shed
            );
        }
    }
    if snap.programs.iter().any(|p| p.run_count > 0) {
        let _ = writeln!(out, "\nprogram costs (kernel bpf_stats):");
        for p in &snap.programs {
            let avg = p.avg_ns.map_or("-".into(), |a| format!("{a:.0} ns"));
            let _ = writeln!(
                out,
                "  {:<22} runs {:>10}  avg {}",
                p.name, p.run_count, avg
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(dst: &str, active: u64, admitted: u64) -> DestStats {
        let counts = Counts {
            active,
            admitted,
            shed: 1,
            ..Default::default()
        };
        DestStats {
            rule: None,
            dst: dst.to_string(),
            counts,
        }
    }

    #[test]
    fn destinations_are_ordered_busiest_then_by_text_and_cut_to_the_top() {
        let rows = vec![
            row("127.1.0.10:9", 0, 1),
            row("127.1.0.1:9", 0, 1),
            row("[fd00::1]:8080", 2, 5),
            row("192.168.100.200:8081", 0, 1),
            row("192.168.100.200:8080", 0, 1),
            row("127.1.0.2:9", 0, 3),
            row("10.0.0.1:80", 1, 1),
            row("127.1.0.1:10", 0, 1),
        ];
        let mut expected: Vec<usize> = (0..rows.len()).collect();
        expected.sort_by(|&a, &b| {
            let (a, b) = (&rows[a], &rows[b]);
            let (ca, cb) = (&a.counts, &b.counts);
            (cb.active, cb.admitted, &a.dst).cmp(&(ca.active, ca.admitted, &b.dst))
        });
        assert_eq!(busiest_first(&rows, None), (expected.clone(), None));
        assert_eq!(busiest_first(&rows, Some(rows.len())).0, expected);
        let (top, other) = busiest_first(&rows, Some(3));
        assert_eq!(top, expected[..3]);
        let mut rest = Counts::default();
        for &i in &expected[3..] {
            rest.add_totals(&rows[i].counts);
        }
        assert_eq!(other, Some(rest));
        assert_eq!(other.unwrap().shed, 5);
    }

    #[test]
    fn metrics_show_the_listed_destinations_and_the_rest_as_other() {
        let mut listed = row("10.0.0.1:80", 3, 7);
        listed.rule = Some("db".into());
        let scope = ScopeStats {
            name: "api".into(),
            cgroup: "/".into(),
            mode: "enforce".into(),
            max_connections: None,
            counts: Counts::default(),
            time_wait_created: 0,
            rules: Vec::new(),
            destinations: vec![listed],
            other: Some(Counts {
                active: 4,
                admitted: 9,
                shed: 2,
                would_shed: 1,
                peak: 0,
            }),
        };
        let snap = Snapshot {
            policy: PolicyStatus::default(),
            scopes: vec![scope],
            internal_errors: 0,
            programs: Vec::new(),
            eaddrnotavail: Vec::new(),
            watched_ports: Vec::new(),
            listeners: Vec::new(),
        };
        let text = prometheus(&snap);
        for line in [
            "connguard_destination_active_connections{scope=\"api\",rule=\"db\",dst=\"10.0.0.1:80\"} 3",
            "connguard_destination_admitted_connections_total{scope=\"api\",rule=\"db\",dst=\"10.0.0.1:80\"} 7",
            "connguard_destination_active_connections{scope=\"api\",rule=\"\",dst=\"other\"} 4",
            "connguard_destination_admitted_connections_total{scope=\"api\",rule=\"\",dst=\"other\"} 9",
            "connguard_destination_shed_connections_total{scope=\"api\",rule=\"\",dst=\"other\"} 2",
            "connguard_destination_would_shed_connections_total{scope=\"api\",rule=\"\",dst=\"other\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
        // 4 series for the listed destination, 4 for the rest.
        let series = text
            .lines()
            .filter(|l| l.starts_with("connguard_destination_"));
        assert_eq!(series.count(), 8, "{text}");
    }

    #[test]
    fn items_are_put_in_order_in_place_or_taken_out() {
        let n = 1000;
        let items: Vec<usize> = (0..n).map(|i| i * 10).collect();
        for order in [
            (0..n).map(|i| (i * 7 + 3) % n).collect::<Vec<_>>(),
            (0..n).rev().collect(),
            (0..n).collect(),
            vec![5, 999, 0],
        ] {
            let expected: Vec<usize> = order.iter().map(|&i| items[i]).collect();
            assert_eq!(in_order(items.clone(), &order), expected);
        }
    }
}
