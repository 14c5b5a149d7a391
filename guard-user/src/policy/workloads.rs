//! The policy in force on this node: a policy file's scopes with the cgroups their pod
//! and container selectors resolve to now, and, for a scope with `annotations = true`, a
//! scope of its own for each of its pods whose annotations ask for budgets.
//!
//! Such a scope, `SCOPE/NAMESPACE/POD`, selects the pod's cgroup and takes the scope's
//! place for it: it comes just before its scope, with its scope's mode, errno, breakers
//! and rules, and budgets lowered to what the pod asks (never raised: a pod gets at most
//! its scope's budget). Its name, and so its counters' ids, stay the same as long as
//! the pod does; it goes with the pod.
use std::collections::BTreeMap;

use super::{Policy, Scope, Selector};
use crate::workload::{
    Identity, Pod, Registry, WorkloadSelector,
    annotations::{self, Budgets},
};

/// What joins a scope's name, a pod's namespace and its name in the name of the pod's
/// own scope; no scope of a policy file has it in its name.
pub const DERIVED_SEPARATOR: char = '/';

/// The runtimes `policy` needs followed: containerd (pod selectors), the Docker Engine
/// API (container selectors).
pub fn sources(policy: &Policy) -> (bool, bool) {
    let kinds = || policy.scopes.iter().flat_map(|s| &s.workloads);
    (
        kinds().any(|w| matches!(w, WorkloadSelector::Pod(_))),
        kinds().any(|w| matches!(w, WorkloadSelector::Container(_))),
    )
}

/// `base` (a policy file's) with the workloads `registry` holds now.
pub fn resolve(base: &Policy, registry: &Registry) -> Policy {
    let pods = registry.pods();
    let mut scopes = Vec::new();
    for scope in &base.scopes {
        let mut resolved = BTreeMap::new();
        let mut warnings = Vec::new();
        for w in &scope.workloads {
            let found = registry.select(w);
            if found.is_empty() {
                let place = match w {
                    WorkloadSelector::Unit(_) => "in the cgroup tree",
                    _ => "on this node",
                };
                warnings.push(format!("{w} matches no {} {place}", w.kind()));
            }
            if !matches!(w, WorkloadSelector::Unit(_)) {
                resolved.extend(found);
            }
        }
        let mut derived = Vec::new();
        if scope.annotations {
            for pod in selected_pods(scope, &pods) {
                let Some(cgroup) = pod.cgroup.as_ref().filter(|c| resolved.contains_key(*c)) else {
                    continue;
                };
                let (mut budgets, errors) = annotations::budgets(&pod.annotations);
                let who = format!("pod {}/{}", pod.namespace, pod.name);
                for e in errors {
                    warnings.push(format!("{who}: {e}; the scope's budget applies"));
                }
                budgets.rules.retain(|rule, _| {
                    let known = scope.rules.iter().any(|r| &r.name == rule);
                    if !known {
                        warnings.push(format!(
                            "{who}: annotation {}.{rule}: scope {} has no rule {rule}",
                            annotations::MAX_CONNECTIONS,
                            scope.name
                        ));
                    }
                    known
                });
                if budgets == Budgets::default() {
                    continue;
                }
                let who = resolved.remove(cgroup).expect("resolved above");
                derived.push(pod_scope(scope, pod, cgroup, who, &budgets));
            }
        }
        derived.sort_by(|a, b| a.name.cmp(&b.name));
        scopes.extend(derived);
        scopes.push(Scope {
            selector: scope.selector.with_resolved(resolved),
            warnings,
            ..scope.clone()
        });
    }
    Policy {
        source: base.source.clone(),
        scopes,
        listeners: base.listeners.clone(),
        fleet: base.fleet.clone(),
        fleet_budgets: base.fleet_budgets.clone(),
    }
}

/// The pods `scope`'s pod selectors select.
fn selected_pods<'a>(scope: &'a Scope, pods: &'a [Pod]) -> impl Iterator<Item = &'a Pod> {
    pods.iter().filter(|p| {
        scope
            .workloads
            .iter()
            .any(|w| matches!(w, WorkloadSelector::Pod(s) if s.matches(p)))
    })
}

/// The scope of one annotated pod of `scope`, at `cgroup`.
fn pod_scope(scope: &Scope, pod: &Pod, cgroup: &str, who: Identity, budgets: &Budgets) -> Scope {
    let mut out = Scope {
        name: derived_name(&scope.name, &pod.namespace, &pod.name),
        cgroup: None,
        workloads: Vec::new(),
        annotations: false,
        parent: Some(scope.name.clone()),
        warnings: Vec::new(),
        selector: Selector::default().with_resolved(BTreeMap::from([(cgroup.to_string(), who)])),
        ..scope.clone()
    };
    out.limits.max_connections =
        Budgets::capped(budgets.max_connections, scope.limits.max_connections);
    for r in &mut out.rules {
        r.limits.max_connections = Budgets::capped(
            budgets.rules.get(&r.name).copied(),
            r.limits.max_connections,
        );
    }
    out
}

/// `SCOPE/NAMESPACE/POD`, cut to what a scope's name may be ([`guard_common::MAX_NAME`]
/// bytes) with a hash of the whole in its last 9 bytes when longer.
pub fn derived_name(scope: &str, namespace: &str, pod: &str) -> String {
    let s = DERIVED_SEPARATOR;
    let name = format!("{scope}{s}{namespace}{s}{pod}");
    let max = guard_common::MAX_NAME;
    if name.len() <= max {
        return name;
    }
    // FNV-1a: a hash that stays the same across builds, as the name must.
    let hash = name.bytes().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ b as u32).wrapping_mul(0x0100_0193)
    });
    let mut cut = max - 9;
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}~{hash:08x}", &name[..cut])
}

/// Whether `a` and `b` hold the same scopes, in the same order, with the same budgets:
/// one can be put in force for the other without a new generation (the cgroups they
/// select may differ).
pub fn same_scopes(a: &Policy, b: &Policy) -> bool {
    a.scopes.len() == b.scopes.len()
        && a.scopes.iter().zip(&b.scopes).all(|(x, y)| {
            x.name == y.name
                && x.limits == y.limits
                && x.rules.len() == y.rules.len()
                && x.rules
                    .iter()
                    .zip(&y.rules)
                    .all(|(r, q)| r.name == q.name && r.limits == q.limits)
        })
}

impl Scope {
    /// The one workload this scope governs, when it selects exactly one and nothing
    /// else: an annotated pod's scope, say.
    pub fn workload(&self) -> Option<&Identity> {
        let resolved = self.selector.resolved();
        let only_resolved = self.cgroup.is_none()
            && !self
                .workloads
                .iter()
                .any(|w| matches!(w, WorkloadSelector::Unit(_)));
        match (only_resolved, resolved.len()) {
            (true, 1) => resolved.values().next(),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{policy::parse, workload::string_map};

    fn pod(name: &str, app: &str, annotations: &[(&str, &str)]) -> Pod {
        Pod {
            sandbox: format!("sb-{name}"),
            namespace: "shop".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
            labels: string_map(&[("app", app)]),
            annotations: string_map(annotations),
            ready: true,
            cgroup: Some(format!("kubepods/pod-{name}")),
        }
    }

    const POLICY: &str = r#"
[[scope]]
name = "orders"
pod = { namespace = "shop", labels = { app = "orders" } }
annotations = true
max_connections = 5
[[scope.rule]]
name = "db"
dst = ["10.0.0.5"]
max_connections = 4

[[scope]]
name = "cart"
pod = { labels = { app = "cart" } }
max_connections = 7
"#;

    fn resolved(pods: Vec<Pod>) -> Policy {
        let registry = Registry::new(std::env::temp_dir().join("connguard-no-such-mount"));
        registry.set_pods(pods);
        resolve(&parse(POLICY, "p.toml").unwrap(), &registry)
    }

    #[test]
    fn annotated_pods_get_a_scope_of_their_own_capped_by_theirs() {
        let p = resolved(vec![
            pod("orders-1", "orders", &[]),
            pod(
                "orders-2",
                "orders",
                &[
                    ("connguard.io/max-connections", "3"),
                    ("connguard.io/max-connections.db", "50"),
                ],
            ),
            pod(
                "orders-3",
                "orders",
                &[("connguard.io/max-connections", "50")],
            ),
            pod(
                "orders-4",
                "orders",
                &[("connguard.io/max-connections.nope", "2")],
            ),
            // Annotations of a scope without `annotations = true` ask nothing.
            pod("cart-1", "cart", &[("connguard.io/max-connections", "1")]),
        ]);
        let names: Vec<&str> = p.scopes.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "orders/shop/orders-2",
                "orders/shop/orders-3",
                "orders",
                "cart"
            ]
        );
        let budget = |i: usize| {
            let s = &p.scopes[i];
            (s.limits.max_connections, s.rules[0].limits.max_connections)
        };
        assert_eq!(budget(0), (Some(3), Some(4)));
        assert_eq!(budget(1), (Some(5), Some(4)));
        let d = &p.scopes[0];
        assert_eq!(d.parent.as_deref(), Some("orders"));
        assert!(d.selector.selects("kubepods/pod-orders-2"));
        assert_eq!(
            d.workload().map(ToString::to_string).as_deref(),
            Some("pod shop/orders-2")
        );
        // The parent keeps its other pods.
        let orders = &p.scopes[2];
        let members: Vec<&String> = orders.selector.resolved().keys().collect();
        assert_eq!(members, ["kubepods/pod-orders-1", "kubepods/pod-orders-4"]);
        assert_eq!(
            orders.warnings,
            [
                "pod shop/orders-4: annotation connguard.io/max-connections.nope: scope orders has no rule nope"
            ]
        );
        assert_eq!(p.scopes[3].selector.resolved().len(), 1);
        assert_eq!(
            p.scopes[3].workload().map(ToString::to_string).as_deref(),
            Some("pod shop/cart-1")
        );
    }

    #[test]
    fn selectors_that_match_nothing_are_warned_about() {
        let p = resolved(Vec::new());
        assert_eq!(p.scopes.len(), 2);
        assert_eq!(
            p.scopes[0].warnings,
            ["pod namespace=shop app=orders matches no pod on this node"]
        );
        assert!(same_scopes(
            &p,
            &resolved(vec![pod("orders-1", "orders", &[])])
        ));
        let annotated = resolved(vec![pod(
            "orders-1",
            "orders",
            &[("connguard.io/max-connections", "2")],
        )]);
        assert!(!same_scopes(&p, &annotated));
    }

    #[test]
    fn derived_names_fit_a_scope_name() {
        assert_eq!(derived_name("orders", "shop", "o-1"), "orders/shop/o-1");
        let long = derived_name("orders", "shop", &"p".repeat(253));
        assert_eq!(long.len(), guard_common::MAX_NAME);
        assert!(long.starts_with("orders/shop/ppp"));
        assert_ne!(long, derived_name("orders", "shop", &"p".repeat(252)));
        assert_eq!(long, derived_name("orders", "shop", &"p".repeat(253)));
    }
}
