//! What a scope may name instead of cgroup paths: pods by namespace and labels,
//! containers by name and labels, systemd units by name; and the cgroups each selects.
use std::{collections::BTreeMap, fmt, path::Path};

use globset::{Glob, GlobMatcher};

use super::{
    Container, Pod,
    labels::{LabelSelector, SelectorError},
    systemd,
};

#[derive(Debug, Clone)]
pub enum WorkloadSelector {
    Pod(PodSelector),
    Container(ContainerSelector),
    Unit(UnitSelector),
}

/// Kubernetes pods: a namespace (a glob; None = every namespace) and a label selector.
#[derive(Debug, Clone)]
pub struct PodSelector {
    namespace: Option<GlobMatcher>,
    labels: LabelSelector,
}

/// Containers: a name (a glob; None = any) and a label selector.
#[derive(Debug, Clone)]
pub struct ContainerSelector {
    name: Option<GlobMatcher>,
    labels: LabelSelector,
}

/// systemd units by name (a glob), e.g. `orders.service`, `shop-web.slice`.
#[derive(Debug, Clone)]
pub struct UnitSelector {
    name: GlobMatcher,
}

/// The workload a cgroup is the cgroup of, as a person names it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Identity {
    Pod { namespace: String, name: String },
    Container { name: String },
    Unit { name: String },
}

impl fmt::Display for Identity {
    /// `pod shop/orders-5d9f`, `container orders`, `unit orders.service`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Identity::Pod { namespace, name } => write!(f, "pod {namespace}/{name}"),
            Identity::Container { name } => write!(f, "container {name}"),
            Identity::Unit { name } => write!(f, "unit {name}"),
        }
    }
}

fn glob(pattern: &str, what: &str) -> Result<GlobMatcher, SelectorError> {
    Glob::new(pattern)
        .map(|g| g.compile_matcher())
        .map_err(|e| SelectorError(format!("{what} {pattern:?}: {}", e.kind())))
}

impl PodSelector {
    pub fn new(namespace: Option<&str>, labels: LabelSelector) -> Result<Self, SelectorError> {
        Ok(PodSelector {
            namespace: namespace.map(|n| glob(n, "namespace")).transpose()?,
            labels,
        })
    }

    pub fn matches(&self, pod: &Pod) -> bool {
        self.namespace
            .as_ref()
            .is_none_or(|n| n.is_match(&pod.namespace))
            && self.labels.matches(&pod.labels)
    }
}

impl ContainerSelector {
    pub fn new(name: Option<&str>, labels: LabelSelector) -> Result<Self, SelectorError> {
        Ok(ContainerSelector {
            name: name.map(|n| glob(n, "container name")).transpose()?,
            labels,
        })
    }

    pub fn matches(&self, container: &Container) -> bool {
        self.name
            .as_ref()
            .is_none_or(|n| n.is_match(&container.name))
            && self.labels.matches(&container.labels)
    }
}

impl UnitSelector {
    /// `name` must end in the suffix of a unit type with a cgroup (.service, .scope,
    /// .slice, .socket, .mount, .swap).
    pub fn new(name: &str) -> Result<Self, SelectorError> {
        if !systemd::is_cgroup_unit(name) {
            return Err(SelectorError(format!(
                "unit {name:?}: a unit name ends in .service, .scope, .slice, .socket, .mount or .swap"
            )));
        }
        Ok(UnitSelector {
            name: glob(name, "unit")?,
        })
    }
}

/// The cgroups of the pods or containers `selector` selects.
pub(super) fn workloads<'a>(
    selector: &WorkloadSelector,
    pods: impl Iterator<Item = &'a Pod>,
    containers: impl Iterator<Item = &'a Container>,
) -> BTreeMap<String, Identity> {
    let mut out = BTreeMap::new();
    match selector {
        WorkloadSelector::Pod(s) => {
            for p in pods.filter(|p| s.matches(p)) {
                if let Some(cgroup) = &p.cgroup {
                    out.insert(
                        cgroup.clone(),
                        Identity::Pod {
                            namespace: p.namespace.clone(),
                            name: p.name.clone(),
                        },
                    );
                }
            }
        }
        WorkloadSelector::Container(s) => {
            for c in containers.filter(|c| s.matches(c)) {
                if let Some(cgroup) = &c.cgroup {
                    out.insert(
                        cgroup.clone(),
                        Identity::Container {
                            name: c.name.clone(),
                        },
                    );
                }
            }
        }
        WorkloadSelector::Unit(_) => {}
    }
    out
}

/// The cgroups below `mount` of the units `selector` names.
pub(super) fn units(selector: &UnitSelector, mount: &Path) -> BTreeMap<String, Identity> {
    systemd::find_units(mount, &selector.name)
        .into_iter()
        .map(|cgroup| {
            let name = cgroup.rsplit('/').next().unwrap_or_default().to_string();
            (cgroup, Identity::Unit { name })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::labels::{Operator, Requirement};
    use super::super::string_map as map;
    use super::*;

    fn pod(namespace: &str, name: &str, labels: &[(&str, &str)], cgroup: Option<&str>) -> Pod {
        Pod {
            sandbox: format!("sb-{name}"),
            namespace: namespace.into(),
            name: name.into(),
            uid: format!("uid-{name}"),
            labels: map(labels),
            annotations: BTreeMap::new(),
            ready: true,
            cgroup: cgroup.map(String::from),
        }
    }

    #[test]
    fn pods_are_selected_by_namespace_glob_and_labels() {
        let pods = [
            pod(
                "shop",
                "orders-1",
                &[("app", "orders")],
                Some("kubepods/pod1"),
            ),
            pod(
                "shop-eu",
                "orders-2",
                &[("app", "orders"), ("track", "canary")],
                Some("kubepods/pod2"),
            ),
            pod("shop", "cart-1", &[("app", "cart")], Some("kubepods/pod3")),
            pod(
                "bank",
                "orders-3",
                &[("app", "orders")],
                Some("kubepods/pod4"),
            ),
            // Not yet with a cgroup: selected once it has one.
            pod("shop", "orders-4", &[("app", "orders")], None),
        ];
        let select = |namespace: Option<&str>, labels: LabelSelector| {
            let s = WorkloadSelector::Pod(PodSelector::new(namespace, labels).unwrap());
            workloads(&s, pods.iter(), [].iter())
                .into_iter()
                .map(|(cgroup, who)| format!("{cgroup} {who}"))
                .collect::<Vec<_>>()
        };
        let app = |v: &str| LabelSelector::new(map(&[("app", v)]), Vec::new()).unwrap();
        assert_eq!(
            select(Some("shop"), app("orders")),
            ["kubepods/pod1 pod shop/orders-1"]
        );
        assert_eq!(
            select(Some("shop*"), app("orders")),
            [
                "kubepods/pod1 pod shop/orders-1",
                "kubepods/pod2 pod shop-eu/orders-2"
            ]
        );
        assert_eq!(select(None, app("orders")).len(), 3);
        assert!(select(Some("shop"), app("payments")).is_empty());
        let stable = LabelSelector::new(
            map(&[("app", "orders")]),
            vec![Requirement {
                key: "track".into(),
                operator: Operator::NotIn,
                values: vec!["canary".into()],
            }],
        )
        .unwrap();
        assert_eq!(
            select(Some("shop*"), stable),
            ["kubepods/pod1 pod shop/orders-1"]
        );
        assert_eq!(select(Some("shop"), LabelSelector::default()).len(), 2);
    }

    #[test]
    fn containers_are_selected_by_name_glob_and_labels() {
        let c = |name: &str, labels: &[(&str, &str)]| Container {
            id: format!("id-{name}"),
            name: name.into(),
            labels: map(labels),
            cgroup: Some(format!("libpod_parent/libpod-{name}")),
        };
        let containers = [
            c("orders-a", &[("app", "orders")]),
            c("orders-b", &[]),
            c("db", &[("app", "orders")]),
        ];
        let select = |name: Option<&str>, labels: &[(&str, &str)]| {
            let labels = LabelSelector::new(map(labels), Vec::new()).unwrap();
            let s = WorkloadSelector::Container(ContainerSelector::new(name, labels).unwrap());
            workloads(&s, [].iter(), containers.iter())
                .into_values()
                .map(|who| who.to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            select(Some("orders-*"), &[]),
            ["container orders-a", "container orders-b"]
        );
        assert_eq!(
            select(None, &[("app", "orders")]),
            ["container db", "container orders-a"]
        );
        assert_eq!(
            select(Some("orders-*"), &[("app", "orders")]),
            ["container orders-a"]
        );
        assert!(select(Some("cart"), &[]).is_empty());
    }

    #[test]
    fn bad_selectors_say_why() {
        assert_eq!(
            UnitSelector::new("orders").unwrap_err().0,
            "unit \"orders\": a unit name ends in .service, .scope, .slice, .socket, .mount or .swap"
        );
        assert!(UnitSelector::new("orders-[.service").is_err());
        assert!(PodSelector::new(Some("shop["), LabelSelector::default()).is_err());
        assert!(ContainerSelector::new(Some("{a"), LabelSelector::default()).is_err());
    }
}
