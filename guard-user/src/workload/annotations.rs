//! Budgets a pod asks for in its annotations, which a scope with `annotations = true`
//! honours within its own budgets:
//! - `connguard.io/max-connections: "50"`: the pod's budget of active connections (the
//!   scope's `max_connections`);
//! - `connguard.io/max-connections.RULE: "20"`: its budget toward the destinations of
//!   the scope's rule RULE (that rule's `max_connections`). An annotation key's name
//!   part is at most 63 characters of `[A-Za-z0-9._-]`, so only rules so named can be
//!   given one.
use std::{collections::BTreeMap, fmt};

/// The prefix of connguard's annotations.
pub const PREFIX: &str = "connguard.io/";
/// The annotation of a pod's budget of active connections.
pub const MAX_CONNECTIONS: &str = "connguard.io/max-connections";

/// What a pod's annotations ask for; None and absent rules ask nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Budgets {
    pub max_connections: Option<u64>,
    /// Rule name -> its budget.
    pub rules: BTreeMap<String, u64>,
}

/// An annotation of connguard's that cannot be honoured; the scope's own budget applies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnnotationError {
    pub key: String,
    pub value: String,
    pub reason: String,
}

impl fmt::Display for AnnotationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "annotation {}: {:?}: {}",
            self.key, self.value, self.reason
        )
    }
}

impl Budgets {
    /// This budget and `cap`, whichever is lower: a pod never gets more than its scope.
    pub fn capped(asked: Option<u64>, cap: Option<u64>) -> Option<u64> {
        match (asked, cap) {
            (Some(a), Some(c)) => Some(a.min(c)),
            (a, c) => a.or(c),
        }
    }
}

/// The budgets in `annotations`, and the errors of connguard's annotations that are
/// malformed (each left out of the budgets) or unknown.
pub fn budgets(annotations: &BTreeMap<String, String>) -> (Budgets, Vec<AnnotationError>) {
    let mut out = Budgets::default();
    let mut errors = Vec::new();
    for (key, value) in annotations {
        let Some(name) = key.strip_prefix(PREFIX) else {
            continue;
        };
        let error = |reason: String| AnnotationError {
            key: key.clone(),
            value: value.clone(),
            reason,
        };
        // Some(None): the pod's budget; Some(Some(rule)): a rule's; None: unknown.
        let rule = match name.strip_prefix("max-connections") {
            Some("") => Some(None),
            Some(rest) => rest.strip_prefix('.').filter(|r| !r.is_empty()).map(Some),
            None => None,
        };
        let Some(rule) = rule else {
            errors.push(error(format!(
                "unknown annotation: {MAX_CONNECTIONS} or {MAX_CONNECTIONS}.RULE"
            )));
            continue;
        };
        let budget = match value.trim().parse::<u64>() {
            Ok(0) => Err("a budget is at least 1".to_string()),
            Ok(n) => Ok(n),
            Err(e) => Err(format!("not a whole number of connections ({e})")),
        };
        match (budget, rule) {
            (Ok(n), None) => out.max_connections = Some(n),
            (Ok(n), Some(rule)) => {
                out.rules.insert(rule.to_string(), n);
            }
            (Err(reason), _) => errors.push(error(reason)),
        }
    }
    (out, errors)
}

#[cfg(test)]
mod tests {
    use super::super::string_map as annotations;
    use super::*;

    #[test]
    fn budgets_are_read_per_pod_and_per_rule() {
        let (b, errors) = budgets(&annotations(&[
            ("connguard.io/max-connections", "50"),
            ("connguard.io/max-connections.orders-db", " 20 "),
            ("qos.projectcalico.org/egressMaxConnections", "7"),
            ("app", "orders"),
        ]));
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(b.max_connections, Some(50));
        assert_eq!(b.rules, BTreeMap::from([("orders-db".to_string(), 20)]));
        assert_eq!(budgets(&annotations(&[])).0, Budgets::default());
    }

    #[test]
    fn malformed_annotations_are_named_and_left_out() {
        let (b, errors) = budgets(&annotations(&[
            ("connguard.io/max-connections", "fifty"),
            ("connguard.io/max-connections.db", "0"),
            ("connguard.io/max-connections.", "5"),
            ("connguard.io/max-conns", "5"),
            ("connguard.io/max-connections.cache", "-3"),
        ]));
        assert_eq!(b, Budgets::default());
        let text: Vec<String> = errors.iter().map(ToString::to_string).collect();
        assert_eq!(
            text,
            [
                "annotation connguard.io/max-connections: \"fifty\": not a whole number of connections (invalid digit found in string)",
                "annotation connguard.io/max-connections.: \"5\": unknown annotation: connguard.io/max-connections or connguard.io/max-connections.RULE",
                "annotation connguard.io/max-connections.cache: \"-3\": not a whole number of connections (invalid digit found in string)",
                "annotation connguard.io/max-connections.db: \"0\": a budget is at least 1",
                "annotation connguard.io/max-conns: \"5\": unknown annotation: connguard.io/max-connections or connguard.io/max-connections.RULE",
            ]
        );
    }

    #[test]
    fn a_pod_never_gets_more_than_its_scope() {
        assert_eq!(Budgets::capped(Some(50), Some(20)), Some(20));
        assert_eq!(Budgets::capped(Some(5), Some(20)), Some(5));
        assert_eq!(Budgets::capped(Some(5), None), Some(5));
        assert_eq!(Budgets::capped(None, Some(20)), Some(20));
        assert_eq!(Budgets::capped(None, None), None);
    }
}
