//! The scopes as /metrics exports them: the scope of an annotated pod
//! (`SCOPE/NAMESPACE/POD`, `parent` SCOPE) counts in its scope's series, whose `scope`
//! label is the policy's scope name, so that the series follow the policy, not the pods.
//! Its destinations count in the scope's `dst="other"` row.
use std::collections::HashMap;

use connguard_api::stats::{Counts, MEMBERS_LISTED, ScopeStats};

/// What the scrapes before saw of the annotated pods' scopes, so that a scope's totals
/// never go down when one of them goes with its pod.
#[derive(Default)]
pub struct Rolled {
    /// Each annotated pod's scope at the last scrape: its scope's name, its counts and
    /// its TIME_WAIT births then.
    seen: HashMap<String, (String, Counts, u64)>,
    /// By scope: the totals of its annotated pods' scopes that are gone, as last seen.
    gone: HashMap<String, (Counts, u64)>,
}

impl Rolled {
    /// `scopes` with each annotated pod's scope added into its scope: counts (but
    /// `peak`, the scope's own), TIME_WAIT births and members. One whose scope is not
    /// in `scopes` stays a scope of its own.
    pub fn roll(&mut self, scopes: &[ScopeStats]) -> Vec<ScopeStats> {
        let is_parent = |name: &str| scopes.iter().any(|s| s.parent.is_none() && s.name == name);
        let mut seen = HashMap::new();
        for s in scopes {
            if let Some(p) = s.parent.as_ref().filter(|p| is_parent(p)) {
                seen.insert(
                    s.name.clone(),
                    (p.clone(), s.counts.clone(), s.time_wait_created),
                );
            }
        }
        for (name, (parent, counts, tw)) in self.seen.drain() {
            if !seen.contains_key(&name) {
                let (c, t) = self.gone.entry(parent).or_default();
                // Its totals, not its gauges.
                add(
                    c,
                    &Counts {
                        active: 0,
                        connecting: 0,
                        ..counts
                    },
                );
                *t += tw;
            }
        }
        self.seen = seen;
        let mut out: Vec<ScopeStats> = scopes
            .iter()
            .filter(|s| s.parent.as_ref().is_none_or(|p| !is_parent(p)))
            .cloned()
            .collect();
        for s in &mut out {
            if let Some((c, tw)) = self.gone.get(&s.name) {
                add(&mut s.counts, c);
                s.time_wait_created += tw;
            }
            for d in scopes.iter().filter(|d| d.parent.as_ref() == Some(&s.name)) {
                add(&mut s.counts, &d.counts);
                s.time_wait_created += d.time_wait_created;
                s.member_count += d.member_count;
                s.members.extend(d.members.iter().cloned());
            }
            s.members.truncate(MEMBERS_LISTED);
        }
        out
    }
}

/// Adds `c` into `into`, but `peak`.
fn add(into: &mut Counts, c: &Counts) {
    into.active += c.active;
    into.admitted += c.admitted;
    into.shed += c.shed;
    into.would_shed += c.would_shed;
    into.connecting += c.connecting;
    into.rate_limited += c.rate_limited;
    into.handshake_limited += c.handshake_limited;
    into.breaker_limited += c.breaker_limited;
    into.breaker_opened += c.breaker_opened;
    into.breaker_half_opened += c.breaker_half_opened;
    into.breaker_closed += c.breaker_closed;
}

#[cfg(test)]
mod tests {
    use connguard_api::stats::Member;

    use super::*;

    fn scope(name: &str, parent: Option<&str>, active: u64, admitted: u64) -> ScopeStats {
        ScopeStats {
            name: name.into(),
            cgroup: None,
            selectors: Vec::new(),
            annotations: false,
            parent: parent.map(String::from),
            members: vec![Member {
                cgroup: format!("kubepods/{name}"),
                workload: Some(format!("pod {name}")),
            }],
            member_count: 1,
            warnings: Vec::new(),
            mode: "enforce".into(),
            limits: Default::default(),
            counts: Counts {
                active,
                admitted,
                peak: active,
                ..Default::default()
            },
            time_wait_created: admitted,
            rules: Vec::new(),
            destinations: Vec::new(),
            open_breakers: Vec::new(),
            unlisted_connecting: 0,
        }
    }

    #[test]
    fn annotated_pods_count_in_their_scope_whose_totals_never_go_down() {
        let mut r = Rolled::default();
        let first = r.roll(&[
            scope("orders/shop/a", Some("orders"), 2, 10),
            scope("orders", None, 1, 5),
            scope("lost/shop/b", Some("lost"), 1, 1),
        ]);
        let shown: Vec<(&str, u64, u64, u64, u64)> = first
            .iter()
            .map(|s| {
                (
                    s.name.as_str(),
                    s.counts.active,
                    s.counts.admitted,
                    s.counts.peak,
                    s.member_count,
                )
            })
            .collect();
        assert_eq!(
            shown,
            [("orders", 3, 15, 1, 2), ("lost/shop/b", 1, 1, 1, 1)]
        );
        assert_eq!(first[0].time_wait_created, 15);
        assert_eq!(first[0].members.len(), 2);
        // The pod goes: what it admitted stays in its scope's totals.
        let second = r.roll(&[scope("orders", None, 0, 6)]);
        assert_eq!(
            (
                second[0].counts.active,
                second[0].counts.admitted,
                second[0].time_wait_created
            ),
            (0, 16, 16)
        );
        let third = r.roll(&[
            scope("orders", None, 0, 7),
            scope("orders/shop/c", Some("orders"), 1, 1),
        ]);
        assert_eq!((third[0].counts.admitted, third[0].member_count), (18, 2));
    }
}
