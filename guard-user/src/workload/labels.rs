//! Kubernetes label selectors (`metav1.LabelSelector`), with Kubernetes' own semantics and
//! validation, from k8s.io/apimachinery: `pkg/labels/selector.go` (`Requirement.Matches`),
//! `pkg/apis/meta/v1/validation` (`ValidateLabelSelectorRequirement`) and
//! `pkg/util/validation` (`IsQualifiedName`, `IsValidLabelValue`).
use std::{collections::BTreeMap, fmt};

/// `matchLabels` and `matchExpressions`, all of which must hold. An empty selector
/// matches every set of labels, as `LabelSelectorAsSelector` makes it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector {
    match_labels: BTreeMap<String, String>,
    match_expressions: Vec<Requirement>,
}

/// One of `matchExpressions`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Requirement {
    pub key: String,
    pub operator: Operator,
    pub values: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operator {
    /// The label is set to one of the values.
    In,
    /// The label is not set, or set to none of the values.
    NotIn,
    /// The label is set, to any value.
    Exists,
    /// The label is not set.
    DoesNotExist,
}

impl std::str::FromStr for Operator {
    type Err = SelectorError;

    /// Kubernetes' spelling, case included.
    fn from_str(s: &str) -> Result<Operator, SelectorError> {
        match s {
            "In" => Ok(Operator::In),
            "NotIn" => Ok(Operator::NotIn),
            "Exists" => Ok(Operator::Exists),
            "DoesNotExist" => Ok(Operator::DoesNotExist),
            _ => Err(SelectorError(format!(
                "unknown operator {s:?}: one of In, NotIn, Exists, DoesNotExist"
            ))),
        }
    }
}

/// Why a label selector is not valid, in Kubernetes' terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SelectorError(pub String);

impl fmt::Display for SelectorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SelectorError {}

impl LabelSelector {
    /// Validates keys as qualified names, values as label values, and each operator's
    /// values (In and NotIn need at least one; Exists and DoesNotExist take none).
    pub fn new(
        match_labels: BTreeMap<String, String>,
        match_expressions: Vec<Requirement>,
    ) -> Result<LabelSelector, SelectorError> {
        for (key, value) in &match_labels {
            check_key(key)?;
            check_value(key, value)?;
        }
        for r in &match_expressions {
            check_key(&r.key)?;
            match r.operator {
                Operator::In | Operator::NotIn if r.values.is_empty() => {
                    return Err(SelectorError(format!(
                        "{:?}: values must be given with operator {:?}",
                        r.key, r.operator
                    )));
                }
                Operator::Exists | Operator::DoesNotExist if !r.values.is_empty() => {
                    return Err(SelectorError(format!(
                        "{:?}: values may not be given with operator {:?}",
                        r.key, r.operator
                    )));
                }
                _ => {}
            }
            for value in &r.values {
                check_value(&r.key, value)?;
            }
        }
        Ok(LabelSelector {
            match_labels,
            match_expressions,
        })
    }

    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.match_labels
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
            && self.match_expressions.iter().all(|r| r.matches(labels))
    }
}

impl fmt::Display for LabelSelector {
    /// Kubernetes' string form (`app=orders,tier in (web,api),!canary`); "" for the empty
    /// selector, which matches everything.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let labels = self.match_labels.iter().map(|(k, v)| format!("{k}={v}"));
        let exprs = self.match_expressions.iter().map(|r| match r.operator {
            Operator::In => format!("{} in ({})", r.key, r.values.join(",")),
            Operator::NotIn => format!("{} notin ({})", r.key, r.values.join(",")),
            Operator::Exists => r.key.clone(),
            Operator::DoesNotExist => format!("!{}", r.key),
        });
        f.write_str(&labels.chain(exprs).collect::<Vec<_>>().join(","))
    }
}

impl Requirement {
    fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        let value = labels.get(&self.key);
        match self.operator {
            Operator::In => value.is_some_and(|v| self.values.contains(v)),
            Operator::NotIn => value.is_none_or(|v| !self.values.contains(v)),
            Operator::Exists => value.is_some(),
            Operator::DoesNotExist => value.is_none(),
        }
    }
}

/// `IsQualifiedName`: an optional DNS subdomain prefix and '/', then a name of at most 63
/// characters, alphanumeric at both ends, with '-', '_' and '.' inside.
fn check_key(key: &str) -> Result<(), SelectorError> {
    let bad = |why: &str| Err(SelectorError(format!("label key {key:?}: {why}")));
    let (prefix, name) = match key.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if let Some(p) = prefix
        && !is_dns_subdomain(p)
    {
        return bad("the prefix must be a DNS subdomain (lower case, at most 253 characters)");
    }
    if name.is_empty() || !is_label_word(name) {
        return bad(
            "the name must be 1 to 63 characters, alphanumeric at both ends, with '-', '_' and '.' inside",
        );
    }
    Ok(())
}

/// `IsValidLabelValue`: empty, or what a qualified name's name part may be.
fn check_value(key: &str, value: &str) -> Result<(), SelectorError> {
    if value.is_empty() || is_label_word(value) {
        Ok(())
    } else {
        Err(SelectorError(format!(
            "label {key:?}: value {value:?} must be at most 63 characters, alphanumeric at both ends, with '-', '_' and '.' inside"
        )))
    }
}

/// `([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]`, at most 63 characters.
pub(super) fn is_label_word(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(c))
}

/// RFC 1123 subdomain: dot-separated lower-case labels, alphanumeric at both ends, with
/// '-' inside, at most 253 characters in all.
fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253
        && s.split('.').all(|label| {
            let b = label.as_bytes();
            !b.is_empty()
                && b[0].is_ascii_alphanumeric()
                && b[b.len() - 1].is_ascii_alphanumeric()
                && b.iter()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        })
}

#[cfg(test)]
mod tests {
    use super::super::string_map as labels;
    use super::*;

    fn req(key: &str, operator: Operator, values: &[&str]) -> Requirement {
        Requirement {
            key: key.into(),
            operator,
            values: values.iter().map(|v| v.to_string()).collect(),
        }
    }

    fn expr(r: Requirement) -> LabelSelector {
        LabelSelector::new(BTreeMap::new(), vec![r]).unwrap()
    }

    #[test]
    fn each_operator_matches_as_kubernetes_defines_it() {
        let orders = labels(&[("app", "orders"), ("tier", "web")]);
        let cache = labels(&[("app", "cache")]);
        let bare = labels(&[]);
        let cases = [
            (
                req("app", Operator::In, &["orders", "db"]),
                [true, false, false],
            ),
            // NotIn holds where the label is absent, as in apimachinery's Matches.
            (
                req("app", Operator::NotIn, &["orders"]),
                [false, true, true],
            ),
            (req("tier", Operator::Exists, &[]), [true, false, false]),
            (
                req("tier", Operator::DoesNotExist, &[]),
                [false, true, true],
            ),
        ];
        for (r, want) in cases {
            let s = expr(r.clone());
            let got = [&orders, &cache, &bare].map(|l| s.matches(l));
            assert_eq!(got, want, "{r:?}");
        }
    }

    #[test]
    fn match_labels_and_expressions_must_all_hold_and_empty_matches_everything() {
        let s = LabelSelector::new(
            labels(&[("app", "orders")]),
            vec![req("track", Operator::NotIn, &["canary"])],
        )
        .unwrap();
        assert!(s.matches(&labels(&[("app", "orders")])));
        assert!(s.matches(&labels(&[("app", "orders"), ("track", "stable")])));
        assert!(!s.matches(&labels(&[("app", "orders"), ("track", "canary")])));
        assert!(!s.matches(&labels(&[("app", "order")])));
        assert!(!s.matches(&labels(&[("track", "stable")])));
        assert!(LabelSelector::default().matches(&labels(&[])));
        assert!(LabelSelector::default().matches(&labels(&[("any", "thing")])));
    }

    #[test]
    fn selectors_are_written_as_kubernetes_writes_them() {
        let s = LabelSelector::new(
            labels(&[("app", "orders")]),
            vec![
                req("tier", Operator::In, &["web", "api"]),
                req("track", Operator::NotIn, &["canary"]),
                req("team", Operator::Exists, &[]),
                req("legacy", Operator::DoesNotExist, &[]),
            ],
        )
        .unwrap();
        assert_eq!(
            s.to_string(),
            "app=orders,tier in (web,api),track notin (canary),team,!legacy"
        );
        assert_eq!(LabelSelector::default().to_string(), "");
    }

    #[test]
    fn values_must_fit_the_operator() {
        let err = |r| LabelSelector::new(BTreeMap::new(), vec![r]).unwrap_err().0;
        assert_eq!(
            err(req("app", Operator::In, &[])),
            "\"app\": values must be given with operator In"
        );
        assert_eq!(
            err(req("app", Operator::NotIn, &[])),
            "\"app\": values must be given with operator NotIn"
        );
        assert_eq!(
            err(req("app", Operator::Exists, &["x"])),
            "\"app\": values may not be given with operator Exists"
        );
        assert_eq!(
            err(req("app", Operator::DoesNotExist, &["x"])),
            "\"app\": values may not be given with operator DoesNotExist"
        );
        assert!("Equals".parse::<Operator>().is_err());
        assert!("in".parse::<Operator>().is_err());
        assert_eq!(
            "DoesNotExist".parse::<Operator>(),
            Ok(Operator::DoesNotExist)
        );
    }

    #[test]
    fn keys_and_values_are_validated_as_kubernetes_does() {
        let ok = |k: &str, v: &str| LabelSelector::new(labels(&[(k, v)]), Vec::new()).is_ok();
        assert!(ok("app", "orders"));
        assert!(ok("app.kubernetes.io/name", "orders-v1.2_x"));
        assert!(ok("app", ""));
        assert!(ok(&"k".repeat(63), &"v".repeat(63)));
        assert!(!ok(&"k".repeat(64), "v"));
        assert!(!ok("app", &"v".repeat(64)));
        assert!(!ok("", "v"));
        assert!(!ok("-app", "v"));
        assert!(!ok("app", "orders-"));
        assert!(!ok("app", "a b"));
        assert!(!ok("Example.com/app", "v"));
        assert!(!ok("/app", "v"));
        assert!(!ok("example.com/", "v"));
        assert!(!ok("a/b/c", "v"));
        let in_bad = LabelSelector::new(BTreeMap::new(), vec![req("app", Operator::In, &["a b"])]);
        assert!(in_bad.is_err());
    }
}
