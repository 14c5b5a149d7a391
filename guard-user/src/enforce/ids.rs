//! Stable ids for scope and rule names: the keys of their counters.
use std::collections::{BTreeSet, HashMap, HashSet};

use anyhow::{Context, bail};
use guard_common::{ID_RULE, ID_SCOPE, IdKey, MAX_ID_NAME, MAX_RULE_IDS, MAX_SCOPE_IDS};

use crate::{kernel::maps::Hashed, policy::Policy};

/// Stable numeric ids for scope and rule names, for the life of the pinned state: a
/// scope or rule removed by a reload and added again by a later one, or by the next
/// daemon, gets its id, and so its counts, back. Ids index the kernel's SCOPE_COUNTERS
/// and RULE_COUNTERS arrays, so there are at most MAX_SCOPE_IDS scope ids and
/// MAX_RULE_IDS rule ids (unique across scopes); a policy that needs more is refused.
///
/// The scopes of annotated pods come and go with their pods, under names that do not
/// come back: their ids are `retire`d with them and given again once their counters
/// are idle and cleared (`reuse`).
#[derive(Default, Clone)]
pub struct Ids {
    scopes: HashMap<String, u32>,
    rules: HashMap<(String, String), u32>,
    /// The next ids to give: above every id given.
    next_scope: u32,
    next_rule: u32,
    /// Ids that no name holds, whose counters may still count connections: not given
    /// until `reuse` (ids below `next_*` that no restored name holds are among them).
    retired_scopes: BTreeSet<u32>,
    retired_rules: BTreeSet<u32>,
    /// Ids cleared for reuse, given before new ones.
    free_scopes: BTreeSet<u32>,
    free_rules: BTreeSet<u32>,
}

impl Ids {
    /// Gives every scope and rule of `policy` an id, or, when that would take more
    /// ids than the arrays hold, none (and says so).
    pub fn assign(&mut self, policy: &Policy) -> anyhow::Result<()> {
        let new_scopes: HashSet<&str> = policy
            .scopes
            .iter()
            .map(|s| s.name.as_str())
            .filter(|name| !self.scopes.contains_key(*name))
            .collect();
        let new_rules: HashSet<(&str, &str)> = policy
            .scopes
            .iter()
            .flat_map(|s| s.rules.iter().map(|r| (s.name.as_str(), r.name.as_str())))
            .filter(|(s, r)| !self.rules.contains_key(&(s.to_string(), r.to_string())))
            .collect();
        let spare_scopes =
            MAX_SCOPE_IDS as usize - self.next_scope as usize + self.free_scopes.len();
        let spare_rules = MAX_RULE_IDS as usize - self.next_rule as usize + self.free_rules.len();
        if new_scopes.len() > spare_scopes {
            bail!(
                "too many scope names: {} used since the pinned state was created and {} new, \
                 at most {MAX_SCOPE_IDS} (counts are kept by name; `connguard stop`, then a \
                 start, starts over)",
                self.next_scope,
                new_scopes.len()
            );
        }
        if new_rules.len() > spare_rules {
            bail!(
                "too many rule names: {} (scope, rule) pairs used since the pinned state was \
                 created and {} new, at most {MAX_RULE_IDS} (counts are kept by name; \
                 `connguard stop`, then a start, starts over)",
                self.next_rule,
                new_rules.len()
            );
        }
        // In policy order, so ids follow the file on a first start.
        for s in &policy.scopes {
            if !self.scopes.contains_key(&s.name) {
                let id = give(&mut self.free_scopes, &mut self.next_scope);
                self.scopes.insert(s.name.clone(), id);
            }
            for r in &s.rules {
                let pair = (s.name.clone(), r.name.clone());
                if !self.rules.contains_key(&pair) {
                    let id = give(&mut self.free_rules, &mut self.next_rule);
                    self.rules.insert(pair, id);
                }
            }
        }
        Ok(())
    }

    /// Takes the ids of the scopes named `names` and of their rules from them: retired,
    /// until `reuse`. Returns the `IDS` keys they were kept under, to be removed.
    pub fn retire<'a>(&mut self, names: impl IntoIterator<Item = &'a str>) -> Vec<IdKey> {
        let mut keys = Vec::new();
        for name in names {
            if let Some(id) = self.scopes.remove(name) {
                self.retired_scopes.insert(id);
                keys.push(id_key(ID_SCOPE, &[name]));
            }
            let rules: Vec<(String, String)> = self
                .rules
                .keys()
                .filter(|(s, _)| s == name)
                .cloned()
                .collect();
            for pair in rules {
                if let Some(id) = self.rules.remove(&pair) {
                    self.retired_rules.insert(id);
                    keys.push(id_key(ID_RULE, &[&pair.0, &pair.1]));
                }
            }
        }
        keys
    }

    /// The retired scope and rule ids.
    pub fn retired(&self) -> (Vec<u32>, Vec<u32>) {
        (
            self.retired_scopes.iter().copied().collect(),
            self.retired_rules.iter().copied().collect(),
        )
    }

    /// Retired ids whose counters were found idle and cleared: given again from now on.
    pub fn reuse(&mut self, scopes: &[u32], rules: &[u32]) {
        for id in scopes {
            if self.retired_scopes.remove(id) {
                self.free_scopes.insert(*id);
            }
        }
        for id in rules {
            if self.retired_rules.remove(id) {
                self.free_rules.insert(*id);
            }
        }
    }

    /// The names of the scopes that hold an id.
    pub fn scope_names(&self) -> impl Iterator<Item = &str> {
        self.scopes.keys().map(String::as_str)
    }

    /// The ids kept in the pinned `IDS` map (none on a first start).
    pub fn restore(map: &Hashed<IdKey, u32>) -> anyhow::Result<Ids> {
        let mut ids = Ids::default();
        for entry in map.iter() {
            let (key, id) = entry.context("reading IDS")?;
            let end = key.name.iter().position(|b| *b == 0).unwrap_or(MAX_ID_NAME);
            let name = String::from_utf8_lossy(&key.name[..end]).into_owned();
            if key.kind == ID_SCOPE {
                ids.scopes.insert(name, id);
            } else {
                let rule = key.name[end..]
                    .iter()
                    .skip(1)
                    .take_while(|b| **b != 0)
                    .copied()
                    .collect::<Vec<u8>>();
                let rule = String::from_utf8_lossy(&rule).into_owned();
                ids.rules.insert((name, rule), id);
            }
        }
        ids.next_scope = ids.scopes.values().max().map_or(0, |m| m + 1);
        ids.next_rule = ids.rules.values().max().map_or(0, |m| m + 1);
        // Gaps: ids retired by a daemon before, whose counters it may not have cleared.
        let held: HashSet<u32> = ids.scopes.values().copied().collect();
        ids.retired_scopes = (0..ids.next_scope).filter(|i| !held.contains(i)).collect();
        let held: HashSet<u32> = ids.rules.values().copied().collect();
        ids.retired_rules = (0..ids.next_rule).filter(|i| !held.contains(i)).collect();
        Ok(ids)
    }

    /// Writes into `map` the ids this holds and `before` did not; returns their keys
    /// (to be removed again if the policy that took them is refused).
    pub fn persist(
        &self,
        before: &Ids,
        map: &mut Hashed<IdKey, u32>,
    ) -> anyhow::Result<Vec<IdKey>> {
        let scopes = self
            .scopes
            .iter()
            .filter(|(name, _)| !before.scopes.contains_key(*name))
            .map(|(name, id)| (id_key(ID_SCOPE, &[name]), *id));
        let rules = self
            .rules
            .iter()
            .filter(|(pair, _)| !before.rules.contains_key(*pair))
            .map(|((scope, rule), id)| (id_key(ID_RULE, &[scope, rule]), *id));
        let mut written = Vec::new();
        for (key, id) in scopes.chain(rules) {
            if let Err(e) = map.insert(key, id, 0) {
                for k in &written {
                    let _ = map.remove(k);
                }
                return Err(anyhow::Error::from(e).context("writing IDS"));
            }
            written.push(key);
        }
        Ok(written)
    }

    /// The id of a scope name, once assigned.
    pub fn scope(&self, name: &str) -> Option<u32> {
        self.scopes.get(name).copied()
    }

    /// The id of a rule of a scope, once assigned.
    pub fn rule(&self, scope: &str, rule: &str) -> Option<u32> {
        self.rules
            .get(&(scope.to_string(), rule.to_string()))
            .copied()
    }

    /// Bounds of the scope ids and rule ids assigned (ids are below these).
    pub fn counts(&self) -> (u32, u32) {
        (self.next_scope, self.next_rule)
    }

    pub fn scope_name(&self, id: u32) -> Option<&str> {
        self.scopes
            .iter()
            .find(|(_, v)| **v == id)
            .map(|(name, _)| name.as_str())
    }

    /// Rule id -> rule name, for every rule named so far.
    pub fn rule_names(&self) -> HashMap<u32, &str> {
        self.rules
            .iter()
            .map(|((_, r), id)| (*id, r.as_str()))
            .collect()
    }
}

/// The lowest of `free`, else `next` (then moved on).
fn give(free: &mut BTreeSet<u32>, next: &mut u32) -> u32 {
    free.pop_first().unwrap_or_else(|| {
        *next += 1;
        *next - 1
    })
}

/// The `IDS` key of `names` (a scope's, or a scope's and a rule's), NUL-separated. The
/// policy keeps names short enough (`MAX_NAME`).
fn id_key(kind: u32, names: &[&str]) -> IdKey {
    let mut key = IdKey {
        kind,
        name: [0; MAX_ID_NAME],
    };
    let joined = names.join("\0");
    let n = joined.len().min(MAX_ID_NAME);
    key.name[..n].copy_from_slice(&joined.as_bytes()[..n]);
    key
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::parse;

    /// A policy of one scope per name, each with a rule "r".
    fn policy(names: &[&str]) -> crate::policy::Policy {
        let text: String = names
            .iter()
            .map(|n| {
                format!("[[scope]]\nname = \"{n}\"\ncgroup = \"x\"\n[[scope.rule]]\nname = \"r\"\n")
            })
            .collect();
        parse(&text, "t").unwrap()
    }

    #[test]
    fn ids_follow_names_and_stop_at_the_array_sizes() {
        let mut ids = Ids::default();
        ids.assign(&policy(&["a", "b"])).unwrap();
        ids.assign(&policy(&["b"])).unwrap();
        ids.assign(&policy(&["c", "a"])).unwrap();
        assert_eq!(
            (ids.scope("a"), ids.scope("b"), ids.scope("c")),
            (Some(0), Some(1), Some(2))
        );
        // Rule ids are unique across scopes.
        assert_eq!(
            (ids.rule("a", "r"), ids.rule("b", "r"), ids.rule("c", "r")),
            (Some(0), Some(1), Some(2))
        );
        assert_eq!(ids.counts(), (3, 3));

        let names: Vec<String> = (0..MAX_SCOPE_IDS - 3).map(|i| format!("s{i}")).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        ids.assign(&policy(&names)).unwrap();
        assert_eq!(ids.counts().0, MAX_SCOPE_IDS);
        let err = ids.assign(&policy(&["a", "new"])).unwrap_err().to_string();
        assert!(err.starts_with("too many scope names"), "{err}");
        assert_eq!(ids.scope("new"), None, "nothing assigned");
        assert_eq!(ids.counts().0, MAX_SCOPE_IDS);
        ids.assign(&policy(&["a", "s7"])).unwrap();
    }

    #[test]
    fn retired_ids_are_given_again_only_once_reused() {
        let mut ids = Ids::default();
        ids.assign(&policy(&["a", "b", "c"])).unwrap();
        let keys = ids.retire(["b", "none"]);
        assert_eq!(keys.len(), 2, "the scope's key and its rule's");
        assert_eq!(ids.scope("b"), None);
        assert_eq!(ids.retired(), (vec![1], vec![1]));
        // Not given while retired.
        ids.assign(&policy(&["d"])).unwrap();
        assert_eq!((ids.scope("d"), ids.rule("d", "r")), (Some(3), Some(3)));
        ids.reuse(&[1], &[1]);
        ids.assign(&policy(&["e", "f"])).unwrap();
        assert_eq!((ids.scope("e"), ids.rule("e", "r")), (Some(1), Some(1)));
        assert_eq!((ids.scope("f"), ids.rule("f", "r")), (Some(4), Some(4)));
        assert_eq!(ids.retired(), (vec![], vec![]));
        assert_eq!(ids.counts(), (5, 5));
    }
}
