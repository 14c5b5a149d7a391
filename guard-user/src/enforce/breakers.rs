//! Which destinations a policy's circuit breakers govern. The connect program keys a
//! destination by a rule of the policy in force (or by none) and takes the rule's
//! breaker, else its scope's.
use std::collections::HashMap;

use guard_common::{CounterKey, NO_RULE};

use super::ids::Ids;
use crate::policy::Policy;

/// The ramps of a policy's breakers: every rule of the policy by id, with its own
/// breaker's ramp if it has one, and the scopes that carry a breaker.
pub struct BreakerRamps<'p> {
    rules: HashMap<u32, Option<&'p [u8]>>,
    scopes: HashMap<u32, &'p [u8]>,
}

impl<'p> BreakerRamps<'p> {
    pub fn new(policy: &'p Policy, ids: &Ids) -> Self {
        let (mut rules, mut scopes) = (HashMap::new(), HashMap::new());
        for s in &policy.scopes {
            if let (Some(id), Some(b)) = (ids.scope(&s.name), &s.breaker) {
                scopes.insert(id, b.ramp.as_slice());
            }
            for r in &s.rules {
                if let Some(id) = ids.rule(&s.name, &r.name) {
                    rules.insert(id, r.breaker.as_ref().map(|b| b.ramp.as_slice()));
                }
            }
        }
        BreakerRamps { rules, scopes }
    }

    /// The ramp of the breaker that governs destination `key`; None when no breaker
    /// does. A key of a rule the policy no longer has (ids outlive their names) is
    /// governed by none: no connect makes that key any more.
    pub fn of(&self, key: &CounterKey) -> Option<&'p [u8]> {
        let scope = || self.scopes.get(&key.scope_id).copied();
        if key.rule_id == NO_RULE {
            return scope();
        }
        match self.rules.get(&key.rule_id) {
            Some(Some(ramp)) => Some(ramp),
            Some(None) => scope(),
            None => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::parse;

    #[test]
    fn a_destination_takes_its_rules_breaker_else_its_scopes_and_a_gone_rule_none() {
        let before = parse(
            "[[scope]]\nname = \"s\"\ncgroup = \"x\"\n[scope.breaker]\nramp = [50, 100]\n\
             [[scope.rule]]\nname = \"own\"\ndst = [\"10.0.0.1\"]\n[scope.rule.breaker]\nramp = [20, 100]\n\
             [[scope.rule]]\nname = \"plain\"\ndst = [\"10.0.0.2\"]\n\
             [[scope.rule]]\nname = \"gone\"\ndst = [\"10.0.0.3\"]\n\
             [[scope]]\nname = \"t\"\ncgroup = \"y\"\n[[scope.rule]]\nname = \"r\"\ndst = [\"10.0.0.4\"]\n",
            "t",
        )
        .unwrap();
        let mut ids = Ids::default();
        ids.assign(&before).unwrap();
        // The same policy without the rule "gone": its id stays assigned.
        let mut after = before.clone();
        after.scopes[0].rules.pop();
        let ramps = BreakerRamps::new(&after, &ids);
        let key = |scope: &str, rule: Option<&str>| CounterKey {
            scope_id: ids.scope(scope).unwrap(),
            rule_id: rule.map_or(NO_RULE, |r| ids.rule(scope, r).unwrap()),
            ..Default::default()
        };
        let (own, scope): (&[u8], &[u8]) = (&[20, 100], &[50, 100]);
        assert_eq!(ramps.of(&key("s", Some("own"))), Some(own));
        assert_eq!(ramps.of(&key("s", Some("plain"))), Some(scope));
        assert_eq!(ramps.of(&key("s", None)), Some(scope));
        assert_eq!(ramps.of(&key("s", Some("gone"))), None);
        assert_eq!(ramps.of(&key("t", Some("r"))), None);
        assert_eq!(ramps.of(&key("t", None)), None);
    }
}
