//! The listener guards' Prometheus series: each guarded socket's queues and its own
//! RSTs, each guard's totals, and its per-caller budgets: the busiest callers (at most
//! stats::TOP_CALLERS by active connections and as many by refusals), the rest summed
//! as caller="other".
use std::collections::HashMap;

use connguard_api::stats::{CallerStats, ListenerStats, Snapshot};
use prometheus_client::registry::Registry;

use super::prometheus::{counter, gauge};

/// What /metrics exported of the guards' callers' refusals, kept from one scrape to the
/// next so that no `_total` series goes down. A listed caller's series grows by what
/// its count grew while listed (an entry the kernel dropped and made again counts from
/// 0: then by its new count); a caller that enters the list starts its series at its
/// count, its past staying in `other`; `caller="other"` is the guard's total less what
/// listed series gained while listed, never below its last export.
#[derive(Default)]
pub struct CallerTotals {
    /// (guard, caller) -> per count (refused, would_refuse): its count at the last
    /// scrape and its series' value.
    listed: HashMap<(String, String), [(u64, u64); 2]>,
    /// By guard, per count: what listed series gained while listed (at the guard's
    /// first scrape, all they had), and `other` as last exported.
    others: HashMap<String, [(u64, u64); 2]>,
}

impl CallerTotals {
    /// The series of guard `g`'s listed callers, and its `other`, per count (refused,
    /// would_refuse).
    fn export(
        &mut self,
        g: &str,
        top: &[CallerStats],
        totals: [u64; 2],
    ) -> Vec<(String, [u64; 2])> {
        let first = !self.others.contains_key(g);
        let others = self.others.entry(g.to_string()).or_default();
        let mut listed = HashMap::new();
        let mut rows = Vec::new();
        for c in top {
            let key = (g.to_string(), c.caller.clone());
            let now = [c.refused, c.would_refuse];
            let before = self.listed.get(&key);
            let mut row = [(0, 0); 2];
            for i in 0..2 {
                row[i] = match before {
                    Some(b) => {
                        let (seen, value) = b[i];
                        let gain = if now[i] >= seen {
                            now[i] - seen
                        } else {
                            now[i]
                        };
                        others[i].0 += gain;
                        (now[i], value + gain)
                    }
                    None => {
                        if first {
                            others[i].0 += now[i];
                        }
                        (now[i], now[i])
                    }
                };
            }
            rows.push((c.caller.clone(), [row[0].1, row[1].1]));
            listed.insert(key, row);
        }
        let mut other = [0; 2];
        for i in 0..2 {
            let (credited, exported) = &mut others[i];
            *exported = (*exported).max(totals[i].saturating_sub(*credited));
            other[i] = *exported;
        }
        rows.push(("other".into(), other));
        self.listed.retain(|(guard, _), _| guard != g);
        self.listed.extend(listed);
        rows
    }
}

/// The listener guards' series.
pub fn fill(reg: &mut Registry, snap: &Snapshot, exported: &mut CallerTotals) {
    sockets(reg, &snap.listeners);
    guards(reg, &snap.listeners);
    callers(reg, snap, exported);
}

/// Each guarded socket's queues and its own RSTs, labelled by guard, address and inode
/// (the members of a SO_REUSEPORT group share an address).
fn sockets(reg: &mut Registry, listeners: &[ListenerStats]) {
    let queue = gauge(
        reg,
        "listener_accept_queue",
        "Connections waiting to be accepted (guarded listeners)",
    );
    let backlog = gauge(
        reg,
        "listener_backlog",
        "Effective backlog, min(listen() backlog, somaxconn) (guarded listeners)",
    );
    let syn_recv = gauge(
        reg,
        "listener_syn_recv",
        "Half-open connections (guarded listeners)",
    );
    let rst = counter(
        reg,
        "listener_socket_rst_shed",
        "SYNs answered with RST because this listening socket's own queues were past a limit (kernels that decide per SYN)",
    );
    let would_rst = counter(
        reg,
        "listener_socket_would_rst",
        "SYNs observe mode would have answered with RST because this listening socket's own queues were past a limit",
    );
    for l in listeners {
        for q in &l.queues {
            let labels = vec![
                ("listener", l.name.clone()),
                ("addr", q.addr.clone()),
                ("inode", q.inode.to_string()),
            ];
            queue.get_or_create(&labels).set(q.accept_queue as i64);
            backlog.get_or_create(&labels).set(q.backlog as i64);
            syn_recv.get_or_create(&labels).set(q.syn_recv as i64);
            if l.per_syn {
                rst.get_or_create(&labels).inc_by(q.rst_shed);
                would_rst.get_or_create(&labels).inc_by(q.would_rst);
            }
        }
    }
}

/// Each guard's totals: RSTs past the queue limits, shedding, and per-caller refusals.
fn guards(reg: &mut Registry, listeners: &[ListenerStats]) {
    let rst = counter(
        reg,
        "listener_rst_shed",
        "SYNs answered with RST by a listener guard past the queue limits",
    );
    let would_rst = counter(
        reg,
        "listener_would_rst",
        "SYNs a listener guard in observe mode would have answered with RST past the queue limits",
    );
    let shedding = gauge(
        reg,
        "listener_shedding",
        "1 while the listener's accept queue is past its watermark",
    );
    let refused = counter(
        reg,
        "listener_per_source_refused",
        "SYNs a listener guard refused past a caller's per-source budgets",
    );
    let would_refuse = counter(
        reg,
        "listener_per_source_would_refuse",
        "SYNs a listener guard in observe mode would have refused past a caller's per-source budgets",
    );
    let rate_limited = counter(
        reg,
        "listener_per_source_rate_limited",
        "Of the per-source refusals (and would-be refusals), those over the caller's rate",
    );
    let held = gauge(
        reg,
        "listener_per_source_active_connections",
        "Completed connections the callers of a listener guard with per-source budgets hold",
    );
    let callers = gauge(
        reg,
        "listener_per_source_callers",
        "Callers holding connections to a listener guard with per-source budgets",
    );
    let refusing = gauge(
        reg,
        "listener_per_source_refusing_callers",
        "Callers whose last SYN a listener guard refused (or would have, in observe mode)",
    );
    for l in listeners {
        let labels = vec![("listener", l.name.clone())];
        rst.get_or_create(&labels).inc_by(l.rst_shed);
        would_rst.get_or_create(&labels).inc_by(l.would_rst);
        shedding.get_or_create(&labels).set(l.shedding as i64);
        if let Some(p) = &l.per_source {
            refused.get_or_create(&labels).inc_by(p.refused);
            would_refuse.get_or_create(&labels).inc_by(p.would_refuse);
            rate_limited.get_or_create(&labels).inc_by(p.rate_limited);
            held.get_or_create(&labels).set(p.active as i64);
            callers.get_or_create(&labels).set(p.callers as i64);
            refusing.get_or_create(&labels).set(p.refusing as i64);
        }
    }
}

/// The busiest callers of each guard with per-source budgets, the rest as
/// caller="other"; and the use of the kernel's callers' tables.
fn callers(reg: &mut Registry, snap: &Snapshot, exported: &mut CallerTotals) {
    let active = gauge(
        reg,
        "listener_caller_active_connections",
        "Completed connections a caller holds to a listener guard (busiest callers; the rest summed as caller=\"other\")",
    );
    let refused = counter(
        reg,
        "listener_caller_refused",
        "SYNs of a caller a listener guard refused (busiest callers; the rest summed as caller=\"other\")",
    );
    let would_refuse = counter(
        reg,
        "listener_caller_would_refuse",
        "SYNs of a caller a listener guard in observe mode would have refused (busiest callers; the rest summed as caller=\"other\")",
    );
    let entries = gauge(
        reg,
        "caller_table_entries",
        "Entries of the kernel's tables of listener guards' callers (callers: with completed connections; sources: whose SYNs were seen)",
    );
    let capacity = gauge(
        reg,
        "caller_table_capacity",
        "Entries the kernel's tables of listener guards' callers hold at most",
    );
    for l in &snap.listeners {
        let Some(p) = &l.per_source else { continue };
        let rows = exported.export(&l.name, &p.top, [p.refused, p.would_refuse]);
        let actives = p
            .top
            .iter()
            .chain(std::iter::once(&p.other))
            .map(|c| (c.caller.clone(), c.active));
        for (caller, n) in actives {
            let labels = vec![("listener", l.name.clone()), ("caller", caller)];
            active.get_or_create(&labels).set(n as i64);
        }
        for (caller, [r, w]) in rows {
            let labels = vec![("listener", l.name.clone()), ("caller", caller)];
            refused.get_or_create(&labels).inc_by(r);
            would_refuse.get_or_create(&labels).inc_by(w);
        }
    }
    let t = &snap.caller_tables;
    for (table, n, cap) in [
        ("callers", t.callers, t.callers_capacity),
        ("sources", t.sources, t.sources_capacity),
    ] {
        let labels = vec![("table", table.to_string())];
        entries.get_or_create(&labels).set(n as i64);
        capacity.get_or_create(&labels).set(cap as i64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caller(name: &str, refused: u64) -> CallerStats {
        CallerStats {
            caller: name.into(),
            refused,
            ..CallerStats::default()
        }
    }

    /// A listed caller's series grows by its gains, also across an entry the kernel
    /// made again; `other` is the rest of the guard's total and never goes down.
    #[test]
    fn caller_series_never_go_down() {
        let mut t = CallerTotals::default();
        let rows = t.export("api", &[caller("a", 10)], [15, 0]);
        assert_eq!(rows, [("a".into(), [10, 0]), ("other".into(), [5, 0])]);
        // a's entry was dropped and made again (3 since); b enters with 4.
        let rows = t.export("api", &[caller("a", 3), caller("b", 4)], [22, 0]);
        assert_eq!(
            rows,
            [
                ("a".into(), [13, 0]),
                ("b".into(), [4, 0]),
                ("other".into(), [9, 0])
            ]
        );
        // b leaves the list; a read before the guard's total: other stays.
        let rows = t.export("api", &[caller("a", 5)], [22, 0]);
        assert_eq!(rows, [("a".into(), [15, 0]), ("other".into(), [9, 0])]);
    }
}
