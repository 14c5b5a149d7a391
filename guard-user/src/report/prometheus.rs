//! Prometheus text exposition of a snapshot: the `connguard_` prefix, base units,
//! `_total` counters, and bounded label cardinality (the busiest destinations per scope,
//! the rest summed as dst="other").
use std::sync::atomic::AtomicU64;

use prometheus_client::{
    encoding::text::encode,
    metrics::{counter::Counter as PromCounter, family::Family, gauge::Gauge},
    registry::Registry,
};

use super::snapshot::Snapshot;

/// Destinations per scope that get their own Prometheus series; the rest are summed
/// under dst="other" to bound cardinality.
pub const METRIC_TOP_DESTINATIONS: usize = 20;

/// Prometheus text exposition of a snapshot cut to the busiest destinations.
pub fn render(snap: &Snapshot) -> String {
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
    let feature = gauge(
        &mut reg,
        "kernel_feature",
        "1 when the kernel has the feature (probed at start; names as in `connguard kernel`), 0 when the daemon runs without it",
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
        // (built with METRIC_TOP_DESTINATIONS): label cardinality stays bounded.
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
    let job_runs = counter(&mut reg, "job_runs", "Runs of the daemon's periodic jobs");
    let job_failures = counter(
        &mut reg,
        "job_failures",
        "Runs of the daemon's periodic jobs that failed (logged, run again at the next period)",
    );
    let job_failing = gauge(&mut reg, "job_failing", "1 while the job's last run failed");
    for j in &snap.jobs {
        let l = vec![("job", j.name.clone())];
        job_runs.get_or_create(&l).inc_by(j.runs);
        job_failures.get_or_create(&l).inc_by(j.failures);
        job_failing
            .get_or_create(&l)
            .set(j.last_error.is_some() as i64);
    }
    internal.inc_by(snap.internal_errors);
    lease_expired.inc_by(snap.lease_expired);
    audit_corrections.inc_by(snap.audit_corrections);
    for (name, present) in snap.kernel.iter().flat_map(|k| &k.features) {
        feature
            .get_or_create(&vec![("feature", name.clone())])
            .set(i64::from(*present));
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::snapshot::{Counts, DestStats, PolicyStatus, ScopeStats};

    #[test]
    fn metrics_show_the_listed_destinations_and_the_rest_as_other() {
        let listed = DestStats {
            rule: Some("db".into()),
            dst: "10.0.0.1:80".into(),
            counts: Counts {
                active: 3,
                admitted: 7,
                shed: 1,
                ..Default::default()
            },
        };
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
            lease_expired: 0,
            audit_corrections: 0,
            programs: Vec::new(),
            eaddrnotavail: Vec::new(),
            watched_ports: Vec::new(),
            listeners: Vec::new(),
            jobs: Vec::new(),
            kernel: None,
        };
        let text = render(&snap);
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
}
