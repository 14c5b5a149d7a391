//! The snapshot the daemon reports (`connguard stats --json`, connguard_api::stats),
//! built from raw counter dumps without any of the daemon's locks held.
use std::{
    cmp::Reverse,
    collections::{BTreeMap, HashMap},
    path::Path,
    sync::Arc,
};

use connguard_api::stats::{
    BreakerStats, Counts, DestStats, LimitStats, MEMBERS_LISTED, Member, OpenBreaker, RuleStats,
    ScopeStats,
};
use guard_common::{
    BREAKER_HALF_OPEN, BREAKER_OPEN, BREAKER_SLOTS, Breaker, Counter, NO_RULE,
    addr::{endpoint, unmapped},
};

use crate::{
    enforce::{breakers::BreakerRamps, counters::CounterDump, ids::Ids, scopes::Governed},
    policy::{Limits, Policy, mode_name},
};

/// The cgroups a scope selects: the first MEMBERS_LISTED by path, and how many in all.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Members {
    pub listed: Vec<Member>,
    pub count: u64,
}

/// Each scope's members (by its index in `policy`), from `governed` (a walk of the
/// cgroups below `root` for `policy`).
pub fn members(policy: &Policy, governed: &BTreeMap<u64, Governed>, root: &Path) -> Vec<Members> {
    let mut paths: Vec<Vec<String>> = vec![Vec::new(); policy.scopes.len()];
    for g in governed.values().filter(|g| g.selected) {
        let rel = g.dir.strip_prefix(root).unwrap_or(&g.dir);
        if let Some(p) = paths.get_mut(g.scope) {
            p.push(rel.to_string_lossy().into_owned());
        }
    }
    paths
        .into_iter()
        .zip(&policy.scopes)
        .map(|(mut p, scope)| {
            let count = p.len() as u64;
            if p.len() > MEMBERS_LISTED {
                p.select_nth_unstable(MEMBERS_LISTED);
                p.truncate(MEMBERS_LISTED);
            }
            p.sort_unstable();
            let listed = p
                .into_iter()
                .map(|cgroup| Member {
                    workload: scope.selector.identity(&cgroup).map(|w| w.to_string()),
                    cgroup,
                })
                .collect();
            Members { listed, count }
        })
        .collect()
}

/// A scope's or rule's limits as `stats` shows them.
pub fn limit_stats(l: &Limits) -> LimitStats {
    LimitStats {
        max_connections: l.max_connections,
        max_connecting: l.max_connecting,
        rate: l.rate.as_ref().map(|r| r.to_string()),
        burst: l.rate.as_ref().map(|r| r.burst),
    }
}

/// The stats of breaker `b` read at CLOCK_MONOTONIC `now_ns`, under a policy whose ramp
/// is `ramp`.
pub fn breaker_stats(b: &Breaker, ramp: &[u8], now_ns: u64) -> BreakerStats {
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

/// The scopes of `policy` with their counters from `dump`, destinations busiest first.
/// With `top`, each scope lists at most that many destinations (what a scrape needs,
/// without sorting every destination).
pub fn scopes(
    policy: &Policy,
    ids: &Ids,
    dump: CounterDump,
    top: Option<usize>,
    mut members: Vec<Members>,
) -> Vec<ScopeStats> {
    members.resize(policy.scopes.len(), Members::default());
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
    // Each scope's rows allocated once, at their number: grown by doubling, they would
    // take up to twice the memory, and a copy of the rows at each step.
    let mut rows_of: HashMap<u32, usize> = HashMap::new();
    for (k, _) in dump.destinations.iter().flatten() {
        *rows_of.entry(k.scope_id).or_default() += 1;
    }
    let mut destinations_of: HashMap<u32, Vec<DestStats>> = rows_of
        .into_iter()
        .map(|(id, n)| (id, Vec::with_capacity(n)))
        .collect();
    // Chunk by chunk, each freed once its rows are made: the counters read and the
    // rows made from them are not held whole at once.
    for (k, c) in dump.destinations.into_iter().flatten() {
        // The ramp is looked up only for a destination with a breaker.
        let breaker = breakers.get(&k).and_then(|b| {
            ramps
                .of(&k)
                .map(|ramp| Box::new(breaker_stats(b, ramp, now_ns)))
        });
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
    for ((s, (scope_id, rule_ids)), members) in policy.scopes.iter().zip(scope_ids).zip(members) {
        let rules = s
            .rules
            .iter()
            .zip(rule_ids)
            .map(|(r, id)| RuleStats {
                name: r.name.clone(),
                limits: limit_stats(&r.limits),
                per: if r.per_endpoint { "endpoint" } else { "rule" }.into(),
                fleet: r.fleet.clone(),
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
            cgroup: s
                .cgroup
                .as_ref()
                .map(|c| if c.is_empty() { "/".into() } else { c.clone() }),
            selectors: s.workloads.iter().map(ToString::to_string).collect(),
            annotations: s.annotations,
            parent: s.parent.clone(),
            members: members.listed,
            member_count: members.count,
            warnings: s.warnings.clone(),
            mode: mode_name(s.mode).into(),
            limits: limit_stats(&s.limits),
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
    use guard_common::CounterKey;

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
