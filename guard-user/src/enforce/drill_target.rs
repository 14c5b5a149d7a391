//! A drill's target when it names workloads (pods, containers, units): the scope that
//! governs them, and the cgroups the drill narrows that scope to.
use std::collections::BTreeMap;

use guard_common::drill::MAX_DRILL_CGROUPS;

use super::scopes::governing;
use crate::{policy::Policy, workload::Identity};

/// The scope a drill runs in, and the cgroups (path below the mount, and workload) it
/// narrows that scope to.
#[derive(Debug, PartialEq, Eq)]
pub struct Narrowed {
    pub scope: String,
    pub cgroups: Vec<(String, Identity)>,
}

/// The target of a drill whose selectors (`what`, for messages) found `found` on this
/// node: the found cgroups `policy` governs by `scope` (a name; "" when the drill names
/// none, and then they must all be governed by one scope). Cgroups no scope governs are
/// left out: the drill could fault none of their connects.
pub fn narrow(
    policy: &Policy,
    scope: &str,
    what: &str,
    found: &BTreeMap<String, Identity>,
) -> Result<Narrowed, String> {
    if found.is_empty() {
        return Err(format!("{what} selects no workload on this node"));
    }
    let governed: Vec<(&String, &Identity, Option<&str>)> = found
        .iter()
        .map(|(rel, who)| {
            let s = governing(policy, rel).map(|i| policy.scopes[i].name.as_str());
            (rel, who, s)
        })
        .collect();
    let scope = if scope.is_empty() {
        let mut scopes: Vec<&str> = governed.iter().filter_map(|g| g.2).collect();
        scopes.sort_unstable();
        scopes.dedup();
        match scopes.as_slice() {
            [] => {
                return Err(format!(
                    "{what} selects {}, in no scope of the policy in force: a drill faults \
                     governed connects only",
                    names(&governed)
                ));
            }
            [one] => one.to_string(),
            many => {
                return Err(format!(
                    "{what} selects workloads of scopes {}: name one with scope",
                    many.join(", ")
                ));
            }
        }
    } else {
        scope.to_string()
    };
    let cgroups: Vec<(String, Identity)> = governed
        .iter()
        .filter(|g| g.2 == Some(scope.as_str()))
        .map(|(rel, who, _)| (rel.to_string(), (*who).clone()))
        .collect();
    if cgroups.is_empty() {
        return Err(format!(
            "{what} selects {}, none of them in scope {scope}",
            names(&governed)
        ));
    }
    if cgroups.len() > MAX_DRILL_CGROUPS {
        return Err(format!(
            "{what} selects {} workloads of scope {scope}; a drill takes at most \
             {MAX_DRILL_CGROUPS}: narrow the selector",
            cgroups.len()
        ));
    }
    Ok(Narrowed { scope, cgroups })
}

/// `pod shop/a (scope orders), unit b.service (no scope)`.
fn names(governed: &[(&String, &Identity, Option<&str>)]) -> String {
    governed
        .iter()
        .map(|(_, who, s)| match s {
            Some(s) => format!("{who} (scope {s})"),
            None => format!("{who} (no scope)"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy;

    fn found(units: &[&str]) -> BTreeMap<String, Identity> {
        units
            .iter()
            .map(|rel| (rel.to_string(), Identity::unit(rel)))
            .collect()
    }

    #[test]
    fn workloads_are_targeted_in_the_scope_that_governs_them() {
        let p = policy::parse(
            "[[scope]]\nname = \"shop\"\ncgroup = \"shop.slice\"\n\
             [[scope]]\nname = \"web\"\ncgroup = \"web.slice/*\"\n",
            "p.toml",
        )
        .unwrap();
        let one = found(&["shop.slice/a.service", "other.slice/a.service"]);
        let n = narrow(&p, "", "unit a.service", &one).unwrap();
        assert_eq!(n.scope, "shop");
        assert_eq!(n.cgroups.len(), 1, "the ungoverned one is left out");
        assert_eq!(n.cgroups[0].0, "shop.slice/a.service");

        let two = found(&["shop.slice/b.service", "web.slice/b.service"]);
        let err = narrow(&p, "", "unit b.service", &two).unwrap_err();
        assert_eq!(
            err,
            "unit b.service selects workloads of scopes shop, web: name one with scope"
        );
        let n = narrow(&p, "web", "unit b.service", &two).unwrap();
        assert_eq!(
            (n.scope.as_str(), n.cgroups[0].0.as_str()),
            ("web", "web.slice/b.service")
        );

        let err = narrow(&p, "web", "unit a.service", &one).unwrap_err();
        assert_eq!(
            err,
            "unit a.service selects unit a.service (no scope), unit a.service (scope shop), \
             none of them in scope web"
        );
        let err = narrow(&p, "", "unit c.service", &found(&["c.slice/c.service"])).unwrap_err();
        assert!(err.contains("in no scope of the policy in force"), "{err}");
        let err = narrow(&p, "", "unit d.service", &found(&[])).unwrap_err();
        assert_eq!(err, "unit d.service selects no workload on this node");
        let many: Vec<String> = (0..=MAX_DRILL_CGROUPS)
            .map(|i| format!("shop.slice/x{i}.service"))
            .collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        let err = narrow(&p, "", "unit x*.service", &found(&many)).unwrap_err();
        assert!(err.contains("a drill takes at most 16"), "{err}");
    }
}
