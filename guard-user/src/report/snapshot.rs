//! The snapshot the daemon reports (`connguard stats --json`, the README's shape), built
//! from raw counter dumps without any of the daemon's locks held.
use std::{cmp::Reverse, collections::HashMap, sync::Arc};

use guard_common::{
    BREAKER_HALF_OPEN, BREAKER_OPEN, BREAKER_SLOTS, Breaker, Counter, CounterKey, NO_RULE,
    addr::{endpoint, unmapped},
};
use serde::{Deserialize, Serialize};

use crate::{
    diagnose::attribution::EaddrnotavailCount,
    enforce::{breakers::BreakerRamps, counters::CounterDump, ids::Ids, port_watch::WatchedPort},
    kernel::{features::Features, object::ProgramCost},
    listen::ListenerStats,
    policy::{Limits, Policy, mode_name},
};

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
    /// connect() failures with EADDRNOTAVAIL, per scope and process name.
    pub eaddrnotavail: Vec<EaddrnotavailCount>,
    /// Destinations near a port watermark, as last read from the socket tables.
    pub watched_ports: Vec<WatchedPort>,
    /// `[[listener]]` guards.
    pub listeners: Vec<ListenerStats>,
    /// The daemon's periodic jobs (absent from the answers of daemons older than this
    /// field).
    #[serde(default)]
    pub jobs: Vec<JobStats>,
    /// The kernel's release and the features probed at start (absent from the answers
    /// of older daemons).
    #[serde(default)]
    pub kernel: Option<Features>,
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

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScopeStats {
    pub name: String,
    pub cgroup: String,
    pub mode: String,
    #[serde(flatten)]
    pub limits: LimitStats,
    #[serde(flatten)]
    pub counts: Counts,
    /// TIME_WAIT entries born on the scope's connections (total).
    pub time_wait_created: u64,
    pub rules: Vec<RuleStats>,
    pub destinations: Vec<DestStats>,
    /// The destinations whose breaker is open or half-open, all of them (whatever the
    /// request's cut of `destinations`; absent from the answers of older daemons).
    #[serde(default)]
    pub open_breakers: Vec<OpenBreaker>,
    /// `connecting` summed over the destinations the request's cut left out: the
    /// metrics' `other` row. Not the scope's own `connecting` less the listed ones, which
    /// counts only when the scope itself sets max_connecting.
    #[serde(skip)]
    pub unlisted_connecting: u64,
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

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RuleStats {
    pub name: String,
    #[serde(flatten)]
    pub limits: LimitStats,
    /// "endpoint" or "rule".
    pub per: String,
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

impl From<&Limits> for LimitStats {
    fn from(l: &Limits) -> Self {
        LimitStats {
            max_connections: l.max_connections,
            max_connecting: l.max_connecting,
            rate: l.rate.as_ref().map(|r| r.to_string()),
            burst: l.rate.as_ref().map(|r| r.burst),
        }
    }
}

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
    /// destination (a row is 176 bytes boxed, 232 inline).
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

impl BreakerStats {
    /// `b` read at CLOCK_MONOTONIC `now_ns`, under a policy whose ramp is `ramp`.
    pub fn new(b: &Breaker, ramp: &[u8], now_ns: u64) -> Self {
        let state = (b.status & 0xff) as u32;
        let step = ((b.status >> 8) & 0xff) as u32;
        let current = now_ns.checked_div(b.slot_ns).unwrap_or(0) as u16;
        let (mut ended, mut failures, mut slow) = (0, 0, 0);
        for w in b.slots {
            if current.wrapping_sub((w >> 48) as u16) < BREAKER_SLOTS as u16 {
                ended += ((w >> 32) & 0xffff) as u32;
                failures += ((w >> 16) & 0xffff) as u32;
                slow += (w & 0xffff) as u32;
            }
        }
        let (name, percent) = match state {
            BREAKER_OPEN => ("open", 0),
            BREAKER_HALF_OPEN => (
                "half_open",
                ramp.get(step as usize).copied().unwrap_or(100) as u32,
            ),
            _ => ("closed", 100),
        };
        BreakerStats {
            state: name.into(),
            step: (state == BREAKER_HALF_OPEN).then_some(step),
            percent,
            open_remaining_ms: (state == BREAKER_OPEN)
                .then(|| b.open_until.saturating_sub(now_ns) / 1_000_000),
            window_ended: ended,
            window_failures: failures,
            window_slow: slow,
        }
    }
}

/// The scopes of `policy` with their counters from `dump`, destinations busiest first.
/// With `top`, each scope lists at most that many destinations (what a scrape needs,
/// without sorting every destination).
pub fn scopes(
    policy: &Policy,
    ids: &Ids,
    dump: CounterDump,
    top: Option<usize>,
) -> Vec<ScopeStats> {
    // Ids (assigned when the policy was applied), then one reverse map of rule names.
    let scope_ids: Vec<(Option<u32>, Vec<Option<u32>>)> = policy
        .scopes
        .iter()
        .map(|s| {
            let scope_id = ids.scope(&s.name);
            let rules = s.rules.iter().map(|r| ids.rule(&s.name, &r.name));
            (scope_id, rules.collect())
        })
        .collect();
    let rule_names: HashMap<u32, Arc<str>> = ids
        .rule_names()
        .into_iter()
        .map(|(id, name)| (id, name.into()))
        .collect();
    // Scope and rule totals by id, from their arrays; one pass over the destination
    // counters, by scope.
    let scope_totals = dump.scopes;
    let rule_totals = dump.rules;
    let total = |totals: &[Counter], id: Option<u32>| -> Counts {
        id.and_then(|id| totals.get(id as usize))
            .map(Counts::from)
            .unwrap_or_default()
    };
    // A breaker entry is shown only while a breaker governs its destination: one left
    // by a policy since reloaded without it is not.
    let ramps = BreakerRamps::new(policy, ids);
    let now_ns = guard_common::monotonic_ns();
    let breakers = dump.breakers;
    // Each scope's rows allocated once, at their number: grown by doubling, they took
    // up to twice the memory, and a copy of the rows at each step.
    let mut rows_of: HashMap<u32, usize> = HashMap::new();
    for (k, _) in &dump.destinations {
        *rows_of.entry(k.scope_id).or_default() += 1;
    }
    let mut destinations_of: HashMap<u32, Vec<DestStats>> = rows_of
        .into_iter()
        .map(|(id, n)| (id, Vec::with_capacity(n)))
        .collect();
    for (k, c) in dump.destinations {
        let breaker = breakers
            .get(&k)
            .zip(ramps.of(&k))
            .map(|(b, ramp)| Box::new(BreakerStats::new(b, ramp, now_ns)));
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
                dst: endpoint(unmapped(k.addr), k.port),
                counts: (&c).into(),
                breaker,
                key: k,
            });
    }
    let time_waits = dump.time_wait_created;
    let mut out = Vec::new();
    for (s, (scope_id, rule_ids)) in policy.scopes.iter().zip(scope_ids) {
        let rules = s
            .rules
            .iter()
            .zip(rule_ids)
            .map(|(r, id)| RuleStats {
                name: r.name.clone(),
                limits: (&r.limits).into(),
                per: if r.per_endpoint { "endpoint" } else { "rule" }.into(),
                counts: total(&rule_totals, id),
            })
            .collect();
        let all = scope_id
            .and_then(|id| destinations_of.remove(&id))
            .unwrap_or_default();
        // Before the destinations are cut to the busiest: `top` asks for none.
        let open_breakers = all
            .iter()
            .filter(|d| d.breaker.as_ref().is_some_and(|b| b.state != "closed"))
            .map(|d| OpenBreaker {
                rule: d.rule.as_deref().map(str::to_string),
                dst: d.dst.clone(),
                state: d
                    .breaker
                    .as_ref()
                    .map(|b| b.state.clone())
                    .unwrap_or_default(),
                percent: d.breaker.as_ref().map_or(0, |b| b.percent),
            })
            .collect();
        let connecting = |ds: &[DestStats]| ds.iter().map(|d| d.counts.connecting).sum::<u64>();
        let all_connecting = connecting(&all);
        let order = busiest_first(&all, top);
        let destinations = in_order(all, &order);
        let unlisted_connecting = all_connecting - connecting(&destinations);
        out.push(ScopeStats {
            name: s.name.clone(),
            cgroup: if s.cgroup.is_empty() {
                "/".into()
            } else {
                s.cgroup.clone()
            },
            mode: mode_name(s.mode).into(),
            limits: (&s.limits).into(),
            counts: total(&scope_totals, scope_id),
            time_wait_created: scope_id
                .and_then(|id| time_waits.get(&id).copied())
                .unwrap_or(0),
            rules,
            destinations,
            open_breakers,
            unlisted_connecting,
        });
    }
    out
}

/// Indices of `destinations` busiest first: most active, then most admitted, then by address
/// text. With `top`, only the first `top`.
///
/// The order is worked out on small keys, not on the destinations, and the first 16 bytes of
/// the text (as a number) settle most ties without reaching the strings. Rows that
/// compare equal (one endpoint under two rules) have no order to keep.
fn busiest_first(destinations: &[DestStats], top: Option<usize>) -> Vec<usize> {
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
    if let Some(top) = top.filter(|&top| top < order.len()) {
        order.select_nth_unstable_by(top, cmp);
        order.truncate(top);
    }
    order.sort_unstable_by(cmp);
    order.into_iter().map(|(.., i)| i).collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    fn row(dst: &str, active: u64, admitted: u64) -> DestStats {
        let counts = Counts {
            active,
            admitted,
            ..Default::default()
        };
        DestStats {
            rule: None,
            dst: dst.to_string(),
            counts,
            breaker: None,
            key: CounterKey::default(),
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
        assert_eq!(busiest_first(&rows, None), expected);
        assert_eq!(busiest_first(&rows, Some(rows.len())), expected);
        assert_eq!(busiest_first(&rows, Some(3)), expected[..3]);
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
