//! Which destinations a policy's circuit breakers govern: a destination's breaker is its
//! rule's, else its scope's (as the connect program chooses between them).
use std::collections::HashMap;

use guard_common::CounterKey;

use super::ids::Ids;
use crate::policy::Policy;

/// The ramps of a policy's breakers, by the id of the rule or scope that carries one.
pub struct BreakerRamps<'p> {
    rules: HashMap<u32, &'p [u8]>,
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
                if let (Some(id), Some(b)) = (ids.rule(&s.name, &r.name), &r.breaker) {
                    rules.insert(id, b.ramp.as_slice());
                }
            }
        }
        BreakerRamps { rules, scopes }
    }

    /// The ramp of the breaker that governs destination `key`; None when no breaker
    /// does.
    pub fn of(&self, key: &CounterKey) -> Option<&'p [u8]> {
        self.rules
            .get(&key.rule_id)
            .or_else(|| self.scopes.get(&key.scope_id))
            .copied()
    }
}
