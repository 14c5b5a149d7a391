//! A drill's target when it names workloads (pods, containers, units): the scope that
//! governs them, and the cgroups the drill narrows that scope to.
use std::collections::{BTreeMap, BTreeSet};

use guard_common::drill::MAX_DRILL_CGROUPS;

use crate::{policy::Policy, workload::Identity};

/// The scope a drill runs in, and the cgroups (path below the mount, and workload) it
/// narrows that scope to.
#[derive(Debug)]
pub struct Narrowed {
    pub scope: String,
    pub cgroups: Vec<(String, Identity)>,
}

/// The target of a drill whose selectors (each described, with the cgroups it found on
/// this node) are `found`: the found cgroups where `policy` governs a cgroup by `scope`
/// (a name; "" when the drill names none, and then the found cgroups must all lie in
/// one scope). `scopes_of` gives the scopes (indices in `policy`) that govern a cgroup
/// and those below it. Cgroups no scope governs are left out: the drill could fault
/// none of their connects.
pub fn narrow(
    policy: &Policy,
    scope: &str,
    found: &[(String, BTreeMap<String, Identity>)],
    scopes_of: impl Fn(&str) -> BTreeSet<usize>,
) -> Result<Narrowed, String> {
    if !scope.is_empty() && !policy.scopes.iter().any(|s| s.name == scope) {
        return Err(format!("no scope {scope:?} in the policy in force"));
    }
    if let Some((what, _)) = found.iter().find(|(_, cgroups)| cgroups.is_empty()) {
        return Err(format!("{what} selects no workload on this node"));
    }
    let what: Vec<&str> = found.iter().map(|(w, _)| w.as_str()).collect();
    let what = what.join(" or ");
    let all: BTreeMap<&String, &Identity> = found.iter().flat_map(|(_, c)| c).collect();
    let governed: Vec<(&String, &Identity, BTreeSet<&str>)> = all
        .into_iter()
        .map(|(rel, who)| {
            let scopes = scopes_of(rel)
                .into_iter()
                .filter_map(|i| policy.scopes.get(i).map(|s| s.name.as_str()))
                .collect();
            (rel, who, scopes)
        })
        .collect();
    let scope = if scope.is_empty() {
        let scopes: BTreeSet<&str> = governed.iter().flat_map(|g| g.2.iter().copied()).collect();
        match scopes.len() {
            0 => {
                return Err(format!(
                    "{what} selects {}, in no scope of the policy in force: a drill faults \
                     governed connects only",
                    names(&governed)
                ));
            }
            1 => scopes.into_iter().next().unwrap_or_default().to_string(),
            _ => {
                let scopes: Vec<&str> = scopes.into_iter().collect();
                return Err(format!(
                    "{what} selects workloads of scopes {}: name one with scope",
                    scopes.join(", ")
                ));
            }
        }
    } else {
        scope.to_string()
    };
    let cgroups: Vec<(String, Identity)> = governed
        .iter()
        .filter(|g| g.2.contains(scope.as_str()))
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
            "{what} selects {} workloads in scope {scope}; a drill takes at most \
             {MAX_DRILL_CGROUPS}: narrow the selector",
            cgroups.len()
        ));
    }
    Ok(Narrowed { scope, cgroups })
}

/// `pod shop/a (scope orders), unit b.service (no scope)`.
fn names(governed: &[(&String, &Identity, BTreeSet<&str>)]) -> String {
    governed
        .iter()
        .map(|(_, who, scopes)| match scopes.len() {
            0 => format!("{who} (no scope)"),
            _ => {
                let scopes: Vec<&str> = scopes.iter().copied().collect();
                format!("{who} (scope {})", scopes.join(", "))
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{enforce::scopes::governing, policy};

    fn found(what: &str, units: &[&str]) -> Vec<(String, BTreeMap<String, Identity>)> {
        let cgroups = units
            .iter()
            .map(|rel| (rel.to_string(), Identity::unit(rel)))
            .collect();
        vec![(what.to_string(), cgroups)]
    }

    #[test]
    fn workloads_are_targeted_in_the_scope_that_governs_them() {
        let p = policy::parse(
            "[[scope]]\nname = \"shop\"\ncgroup = \"shop.slice\"\n\
             [[scope]]\nname = \"web\"\ncgroup = \"web.slice/*\"\n\
             [[scope]]\nname = \"jobs\"\ncgroup = \"shop.slice/j.service/*\"\n",
            "p.toml",
        )
        .unwrap();
        // The cgroup's own scope, and those of the cgroups below it that a walk found.
        let below = |rel: &str| -> BTreeSet<usize> {
            let mut s: BTreeSet<usize> = governing(&p, rel).into_iter().collect();
            if rel == "shop.slice/j.service" || rel == "other.slice/j.service" {
                s.insert(2);
            }
            s
        };
        let one = found(
            "unit a.service",
            &["shop.slice/a.service", "other.slice/a.service"],
        );
        let n = narrow(&p, "", &one, below).unwrap();
        assert_eq!(n.scope, "shop");
        assert_eq!(n.cgroups.len(), 1, "the ungoverned one is left out");
        assert_eq!(n.cgroups[0].0, "shop.slice/a.service");

        let two = found(
            "unit b.service",
            &["shop.slice/b.service", "web.slice/b.service"],
        );
        let err = narrow(&p, "", &two, below).unwrap_err();
        assert_eq!(
            err,
            "unit b.service selects workloads of scopes shop, web: name one with scope"
        );
        let n = narrow(&p, "web", &two, below).unwrap();
        assert_eq!(
            (n.scope.as_str(), n.cgroups[0].0.as_str()),
            ("web", "web.slice/b.service")
        );
        let err = narrow(&p, "web", &one, below).unwrap_err();
        assert_eq!(
            err,
            "unit a.service selects unit a.service (no scope), unit a.service (scope shop), \
             none of them in scope web"
        );
        let err = narrow(&p, "wbe", &one, below).unwrap_err();
        assert_eq!(err, "no scope \"wbe\" in the policy in force");

        // A unit governed by one scope, its children by another: either is named.
        let j = found("unit j.service", &["shop.slice/j.service"]);
        let err = narrow(&p, "", &j, below).unwrap_err();
        assert!(err.contains("scopes jobs, shop: name one"), "{err}");
        assert_eq!(narrow(&p, "jobs", &j, below).unwrap().scope, "jobs");
        // Ungoverned itself, with governed children: the children's scope.
        let j = found("unit j.service", &["other.slice/j.service"]);
        assert_eq!(narrow(&p, "", &j, below).unwrap().scope, "jobs");

        let err = narrow(
            &p,
            "",
            &found("unit c.service", &["c.slice/c.service"]),
            below,
        )
        .unwrap_err();
        assert!(err.contains("in no scope of the policy in force"), "{err}");
        let mut two_selectors = found("unit a.service", &["shop.slice/a.service"]);
        two_selectors.extend(found("pod namespace=shop", &[]));
        let err = narrow(&p, "", &two_selectors, below).unwrap_err();
        assert_eq!(err, "pod namespace=shop selects no workload on this node");
        let many: Vec<String> = (0..=MAX_DRILL_CGROUPS)
            .map(|i| format!("shop.slice/x{i}.service"))
            .collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        let err = narrow(&p, "", &found("unit x*.service", &many), below).unwrap_err();
        assert!(err.contains("a drill takes at most 16"), "{err}");
    }
}
