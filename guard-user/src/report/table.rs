//! The readable form of `connguard stats`.
use std::fmt::Write;

use connguard_api::{
    drill::DrillsReply,
    fleet::FleetView,
    stats::{DestinationTable, ScopeStats, Snapshot},
};

/// The readable form of `connguard stats`.
pub fn stats(snap: &Snapshot) -> String {
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
    let t = &snap.destination_table;
    if t.capacity > 0 {
        let _ = writeln!(out, "{}", destination_table(t));
    }
    let running = snap.drills.iter().filter(|d| d.state == "running").count();
    if running > 0 {
        let _ = writeln!(
            out,
            "chaos drills running: {running} (see connguard drill list; their faults are not sheds)"
        );
    }
    if snap.lost_events > 0 {
        let _ = writeln!(
            out,
            "diagnostic events lost to a full map (TIME_WAIT, EADDRNOTAVAIL, RST counts): {}",
            snap.lost_events
        );
    }
    if snap.audit_corrections > 0 {
        let _ = writeln!(
            out,
            "counters corrected by the audit (a bug, see the log): {}",
            snap.audit_corrections
        );
    }
    if snap.lease_expired > 0 {
        let _ = writeln!(
            out,
            "let through over budget while no daemon held the lease: {}",
            snap.lease_expired
        );
    }
    for r in &snap.runtimes {
        let state = match (&r.last_error, r.connected) {
            (_, true) => "connected".to_string(),
            (Some(e), false) => format!("UNREACHABLE ({} failed attempt(s)): {e}", r.failures),
            (None, false) => "connecting".to_string(),
        };
        let _ = writeln!(out, "runtime {} at {}: {state}", r.source, r.endpoint);
    }
    if let Some(f) = &snap.fleet {
        let sync = f.last_sync_ms.map_or("never".to_string(), |ms| {
            format!("{:.1} s ago", ms as f64 / 1000.0)
        });
        let _ = writeln!(
            out,
            "fleet as {:?}: last sync {sync}, {} store error(s){}",
            f.identity,
            f.store_errors,
            f.last_error
                .as_ref()
                .map_or(String::new(), |e| format!(", last: {e}"))
        );
        for b in &f.budgets {
            let share = b.share.map_or("none yet".to_string(), |s| s.to_string());
            let _ = writeln!(
                out,
                "  fleet budget {}: total {}  share {share}{}  active {}  wants {}  hosts {}",
                b.name,
                b.total,
                if b.safe { " (safe share)" } else { "" },
                b.active,
                b.wants,
                b.hosts
            );
        }
    }
    for s in &snap.scopes {
        let l = &s.limits;
        let budget = l
            .max_connections
            .map_or("none".to_string(), |m| m.to_string());
        let mut limits = format!("budget {budget}");
        if let Some(n) = l.max_connecting {
            let _ = write!(limits, "  max_connecting {n}");
        }
        if let (Some(rate), Some(burst)) = (&l.rate, l.burst) {
            let _ = write!(limits, "  rate {rate} burst {burst}");
        }
        let mut selects: Vec<String> = s.cgroup.iter().map(|c| format!("cgroup {c}")).collect();
        selects.extend(s.selectors.iter().cloned());
        if s.annotations {
            selects.push("honouring annotations".into());
        }
        if let Some(p) = &s.parent {
            selects.push(format!("an annotated pod of scope {p}"));
        }
        let _ = writeln!(
            out,
            "\nscope {} [{}] {}  {limits}",
            s.name,
            s.mode,
            selects.join(", ")
        );
        let listed = member_summary(s, 5);
        let sep = if listed.is_empty() { "" } else { ": " };
        let _ = writeln!(out, "  members {}{sep}{listed}", s.member_count);
        for w in &s.warnings {
            let _ = writeln!(out, "  WARNING: {w}");
        }
        let c = &s.counts;
        let _ = writeln!(
            out,
            "  active {}  peak {}  connecting {}  admitted {}  shed {}  would_shed {}  (over rate {}, over max_connecting {})",
            c.active,
            c.peak,
            c.connecting,
            c.admitted,
            c.shed,
            c.would_shed,
            c.rate_limited,
            c.handshake_limited
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
    let hw = &snap.host_wide;
    if !hw.attached.is_empty() {
        let _ = writeln!(
            out,
            "\nhost-wide programs attached: {} (every TCP socket of the host runs them)",
            hw.attached.join(", ")
        );
        for why in &hw.because {
            let _ = writeln!(out, "  because {why}");
        }
    }
    out
}

/// How full the destination counter map is, and what FULL means.
pub(super) fn destination_table(t: &DestinationTable) -> String {
    format!(
        "destination counter map: {} of {} entries{}",
        t.entries,
        t.capacity,
        if t.full() {
            "; FULL: new destinations are counted and budgeted at their rule and scope only"
        } else {
            ""
        }
    )
}

/// The first `shown` members of a scope, by workload (else cgroup):
/// `pod shop/orders-1, pod shop/orders-2 and 3 more`; "" for none.
pub fn member_summary(s: &ScopeStats, shown: usize) -> String {
    let names: Vec<&str> = s
        .members
        .iter()
        .take(shown)
        .map(|m| m.workload.as_deref().unwrap_or(&m.cgroup))
        .collect();
    let more = s.member_count.saturating_sub(names.len() as u64);
    match (names.is_empty(), more) {
        (true, _) => String::new(),
        (false, 0) => names.join(", "),
        (false, more) => format!("{} and {more} more", names.join(", ")),
    }
}

/// `connguard fleet`: each budget's hosts, as etcd holds their records.
pub fn fleet(view: &FleetView) -> String {
    let mut out = format!("etcd revision {}\n", view.revision);
    for b in &view.budgets {
        let has: u64 = b.hosts.iter().map(|h| h.has).sum();
        let total = b.hosts.iter().map(|h| h.total).min().unwrap_or(0);
        let _ = writeln!(
            out,
            "fleet budget {}: total {total}, {} host(s) holding {has}",
            b.name,
            b.hosts.len()
        );
        let _ = writeln!(
            out,
            "  {:<24} {:>8} {:>8} {:>8} {:>6} {:>6}",
            "HOST", "HAS", "ACTIVE", "WANTS", "WEIGHT", "FLOOR"
        );
        for h in &b.hosts {
            let _ = writeln!(
                out,
                "  {:<24} {:>8} {:>8} {:>8} {:>6} {:>6}",
                h.identity, h.has, h.active, h.wants, h.weight, h.floor
            );
        }
    }
    out
}

/// The readable form of `connguard drill list` (and of a drill started or stopped).
pub fn drills(reply: &DrillsReply) -> String {
    let mut out = String::new();
    if reply.drills.is_empty() {
        out.push_str("no drills\n");
    }
    for d in &reply.drills {
        let s = &d.spec;
        let mut caps = Vec::new();
        if let Some(k) = s.max_faults {
            caps.push(format!("at most {k} faults"));
        }
        if let Some(f) = s.max_fraction {
            caps.push(format!(
                "at most {f} of attempts per {} ms",
                s.window_ms.unwrap_or(10_000)
            ));
        }
        let _ = writeln!(
            out,
            "drill {}: {}{} scope {} {}, p {}, {}",
            s.name,
            d.state,
            d.reason
                .as_ref()
                .map_or(String::new(), |r| format!(" ({r})")),
            s.scope,
            s.fault,
            s.probability,
            caps.join(", ")
        );
        if !d.workloads.is_empty() {
            let _ = writeln!(out, "  workloads: {}", d.workloads.join(", "));
        }
        if !s.dst.is_empty() || !s.ports.is_empty() {
            let _ = writeln!(out, "  dst {:?} ports {:?}", s.dst, s.ports);
        }
        let _ = writeln!(
            out,
            "  attempts {}  faulted {}  capped {}",
            d.attempts, d.faulted, d.capped
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The map's line says FULL exactly when it holds as many entries as it can, of a
    /// size the daemon read.
    #[test]
    fn the_destination_map_line_says_full_at_its_capacity() {
        let line = |entries, capacity| destination_table(&DestinationTable { entries, capacity });
        assert_eq!(
            line(4095, 4096),
            "destination counter map: 4095 of 4096 entries"
        );
        assert_eq!(
            line(4096, 4096),
            "destination counter map: 4096 of 4096 entries; FULL: new destinations are \
             counted and budgeted at their rule and scope only"
        );
        assert!(
            !DestinationTable {
                entries: 10,
                capacity: 0
            }
            .full()
        );
    }
}
