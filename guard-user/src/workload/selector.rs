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

impl Identity {
    /// The unit whose cgroup is at `rel`, by its directory's name.
    pub fn unit(rel: &str) -> Identity {
        Identity::Unit {
            name: rel.rsplit('/').next().unwrap_or_default().to_string(),
        }
    }
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

impl fmt::Display for WorkloadSelector {
    /// What it selects, for stats and logs: `pod namespace=shop app=orders`,
    /// `container name=orders-* app=orders`, `unit orders.service`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let named = |kind: &str, key: &str, name: &Option<GlobMatcher>, labels: &LabelSelector| {
            let mut parts = vec![kind.to_string()];
            if let Some(n) = name {
                parts.push(format!("{key}={}", n.glob().glob()));
            }
            let labels = labels.to_string();
            if !labels.is_empty() {
                parts.push(labels);
            }
            parts.join(" ")
        };
        f.write_str(&match self {
            WorkloadSelector::Pod(p) => named("pod", "namespace", &p.namespace, &p.labels),
            WorkloadSelector::Container(c) => named("container", "name", &c.name, &c.labels),
            WorkloadSelector::Unit(u) => format!("unit {}", u.name.glob().glob()),
        })
    }
}

impl WorkloadSelector {
    /// The kind of workload it selects, as messages name it: "pod", "container", "unit".
    pub fn kind(&self) -> &'static str {
        match self {
            WorkloadSelector::Pod(_) => "pod",
            WorkloadSelector::Container(_) => "container",
            WorkloadSelector::Unit(_) => "unit",
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

    /// Whether the cgroup at `rel` (below the mount) is the cgroup of a unit this names,
    /// where systemd puts units: what [`Registry::select`](super::Registry::select)
    /// finds, decided from the path alone.
    pub fn selects(&self, rel: &str) -> bool {
        systemd::is_unit_place(rel) && self.name.is_match(rel.rsplit('/').next().unwrap_or(rel))
    }

    /// Whether a cgroup below the one at `rel` may be one this names.
    pub fn may_select_below(&self, rel: &str) -> bool {
        systemd::holds_units_below(rel)
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
    fn units_are_selected_by_path_where_systemd_puts_them() {
        let s = UnitSelector::new("orders*.service").unwrap();
        assert!(s.selects("system.slice/orders.service"));
        assert!(s.selects("shop.slice/shop-web.slice/orders-v2.service"));
        assert!(s.selects("orders.service"));
        assert!(!s.selects("system.slice/cron.service/orders.service"));
        assert!(!s.selects("system.slice/web.service"));
        assert!(s.may_select_below("shop.slice"));
        assert!(!s.may_select_below("system.slice/cron.service"));
        assert_eq!(
            Identity::unit("system.slice/orders.service").to_string(),
            "unit orders.service"
        );
    }

    #[test]
    fn selectors_say_what_they_select() {
        let labels = LabelSelector::new(map(&[("app", "orders")]), Vec::new()).unwrap();
        let pod = WorkloadSelector::Pod(PodSelector::new(Some("shop"), labels.clone()).unwrap());
        let any = WorkloadSelector::Pod(PodSelector::new(None, LabelSelector::default()).unwrap());
        let c =
            WorkloadSelector::Container(ContainerSelector::new(Some("orders-*"), labels).unwrap());
        let u = WorkloadSelector::Unit(UnitSelector::new("orders.service").unwrap());
        let text = [&pod, &any, &c, &u].map(ToString::to_string);
        assert_eq!(
            text,
            [
                "pod namespace=shop app=orders",
                "pod",
                "container name=orders-* app=orders",
                "unit orders.service"
            ]
        );
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
