//! Workload resolution against real runtimes: the workload registry follows a containerd
//! started by the test (driven through CRI as kubelet drives it) and Podman's Docker
//! Engine API, and reads a systemd-shaped cgroup tree. Runs on the host only (the guests
//! run the tests that depend on the kernel): containerd, runc and podman are the host's.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use connguard::workload::{
    Identity, Pod, Registry, WorkloadSelector,
    labels::{LabelSelector, Operator, Requirement},
    selector::{ContainerSelector, PodSelector, UnitSelector},
    string_map as map,
};
use connguard_tests::{
    Cgroup, cgroup2_mount,
    containerd::{Containerd, PodSpec},
    podman::Podman,
    unique,
};

/// The longest a pod may take to be resolved after RunPodSandbox returns.
const RESOLVED_WITHIN: Duration = Duration::from_secs(2);

/// A registry following one runtime, and when each pod sandbox was first seen with its
/// cgroup (by a task woken by the registry's change notification).
struct Follower {
    rt: tokio::runtime::Runtime,
    registry: Arc<Registry>,
    seen: Arc<Mutex<HashMap<String, Instant>>>,
}

impl Follower {
    fn new(registry: Registry) -> Follower {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let registry = Arc::new(registry);
        let seen = Arc::new(Mutex::new(HashMap::new()));
        let (r, s) = (registry.clone(), seen.clone());
        let mut changes = registry.subscribe();
        rt.spawn(async move {
            while changes.changed().await.is_ok() {
                let now = Instant::now();
                let mut seen = s.lock().unwrap();
                for p in r.pods().into_iter().filter(|p| p.cgroup.is_some()) {
                    seen.entry(p.sandbox).or_insert(now);
                }
            }
        });
        Follower { rt, registry, seen }
    }

    fn containerd(c: &Containerd) -> Follower {
        let f = Follower::new(Registry::new(cgroup2_mount()));
        f.rt.spawn(connguard::workload::containerd::follow(
            f.registry.clone(),
            c.socket.clone(),
        ));
        f.wait_connected(true);
        f
    }

    fn docker(p: &Podman) -> Follower {
        let f = Follower::new(Registry::new(cgroup2_mount()));
        f.rt.spawn(connguard::workload::docker::follow(
            f.registry.clone(),
            p.socket.clone(),
        ));
        f.wait_connected(true);
        f
    }

    fn wait_connected(&self, connected: bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self
            .registry
            .sources()
            .first()
            .is_none_or(|s| s.connected != connected)
        {
            assert!(
                Instant::now() < deadline,
                "not connected = {connected} within 10 s: {:?}",
                self.registry.sources()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn pod(&self, sandbox: &str) -> Option<Pod> {
        self.registry
            .pods()
            .into_iter()
            .find(|p| p.sandbox == sandbox)
    }

    /// Sandbox `id` once the registry holds it with its cgroup: when it was first seen.
    fn resolved(&self, id: &str) -> Instant {
        wait_until(RESOLVED_WITHIN, &format!("sandbox {id} resolved"), || {
            self.seen.lock().unwrap().contains_key(id)
        });
        self.seen.lock().unwrap()[id]
    }

    fn select(&self, selector: &WorkloadSelector) -> BTreeMap<String, Identity> {
        self.registry.select(selector)
    }
}

fn wait_until(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(Instant::now() < deadline, "not within {limit:?}: {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn pods(
    namespace: Option<&str>,
    labels: &[(&str, &str)],
    exprs: Vec<Requirement>,
) -> WorkloadSelector {
    let labels = LabelSelector::new(map(labels), exprs).unwrap();
    WorkloadSelector::Pod(PodSelector::new(namespace, labels).unwrap())
}

fn spec(namespace: &str, name: &str, app: &str) -> PodSpec {
    PodSpec {
        namespace: namespace.into(),
        name: name.into(),
        uid: unique("uid"),
        labels: map(&[("app", app), ("tier", "web")]),
        annotations: map(&[("connguard.io/max-connections", "5"), ("team", "shop")]),
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

#[test]
fn pods_are_resolved_when_their_sandbox_starts() {
    let c = Containerd::start();
    let f = Follower::containerd(&c);
    const PODS: usize = 20;
    let (mut from_call, mut after_return) = (Vec::new(), Vec::new());
    let mut sandboxes = Vec::new();
    for i in 0..PODS {
        let app = if i % 2 == 0 { "orders" } else { "cart" };
        let spec = spec("shop", &format!("{app}-{i}"), app);
        let called = Instant::now();
        let sb = c.run_pod(&spec);
        let returned = Instant::now();
        let seen = f.resolved(&sb.id);
        from_call.push(seen - called);
        // Negative: resolved before RunPodSandbox returned to "kubelet".
        after_return.push(if seen >= returned {
            ms(seen - returned)
        } else {
            -ms(returned - seen)
        });
        sandboxes.push((spec, sb));
    }
    from_call.sort();
    after_return.sort_by(f64::total_cmp);
    let p = |q: f64| ((q * PODS as f64).ceil() as usize).clamp(1, PODS) - 1;
    println!(
        "RunPodSandbox call to resolved over {PODS} pods: p50 {:.1} ms, p99 {:.1} ms; \
         RunPodSandbox return to resolved: p50 {:.1} ms, p99 {:.1} ms; {} resolved before it returned",
        ms(from_call[p(0.5)]),
        ms(from_call[p(0.99)]),
        after_return[p(0.5)],
        after_return[p(0.99)],
        after_return.iter().filter(|d| **d < 0.0).count(),
    );

    // Each pod as kubelet described it, with the cgroup kubelet gave it.
    for (spec, sb) in &sandboxes {
        let pod = f.pod(&sb.id).unwrap();
        assert_eq!(
            (&pod.namespace, &pod.name, &pod.uid),
            (&spec.namespace, &spec.name, &spec.uid)
        );
        assert_eq!(pod.labels, spec.labels, "kubelet's own labels are left out");
        assert_eq!(pod.annotations, spec.annotations);
        assert!(pod.ready);
        assert_eq!(pod.cgroup.as_deref(), Some(sb.cgroup.as_str()));
        assert!(cgroup2_mount().join(&sb.cgroup).is_dir());
    }

    // Selectors: exactly the pods they name.
    let cgroups_of = |app: &str| -> BTreeSet<String> {
        sandboxes
            .iter()
            .filter(|(s, _)| s.labels["app"] == app)
            .map(|(_, sb)| sb.cgroup.clone())
            .collect()
    };
    let orders = f.select(&pods(Some("shop"), &[("app", "orders")], Vec::new()));
    assert_eq!(
        orders.keys().cloned().collect::<BTreeSet<_>>(),
        cgroups_of("orders")
    );
    assert!(orders.values().all(|who| matches!(who,
        Identity::Pod { namespace, name } if namespace == "shop" && name.starts_with("orders-"))));
    assert!(
        f.select(&pods(Some("shop"), &[("app", "payments")], Vec::new()))
            .is_empty()
    );
    assert!(
        f.select(&pods(Some("bank"), &[("app", "orders")], Vec::new()))
            .is_empty()
    );
    let either = Requirement {
        key: "app".into(),
        operator: Operator::In,
        values: vec!["orders".into(), "cart".into()],
    };
    assert_eq!(f.select(&pods(Some("sh*"), &[], vec![either])).len(), PODS);
    let not_cart = Requirement {
        key: "app".into(),
        operator: Operator::NotIn,
        values: vec!["cart".into()],
    };
    assert_eq!(
        f.select(&pods(None, &[("tier", "web")], vec![not_cart]))
            .len(),
        PODS / 2
    );

    // An app container runs below its pod's cgroup: governing the pod's cgroup governs it.
    let (_, first) = &sandboxes[0];
    let app = c.run_container(first, "app", &["/bin/busybox", "sleep", "2147483647"], &[]);
    let procs = cgroup2_mount()
        .join(&first.cgroup)
        .join(&app)
        .join("cgroup.procs");
    let text = std::fs::read_to_string(&procs).unwrap();
    assert_eq!(text.lines().count(), 1, "{}: {text:?}", procs.display());

    // Deleted, then created again under the same name: resolved again.
    let (spec0, sb0) = sandboxes.remove(0);
    c.remove_pod(&sb0.id);
    wait_until(RESOLVED_WITHIN, "the removed pod forgotten", || {
        f.pod(&sb0.id).is_none()
    });
    let orders = f.select(&pods(Some("shop"), &[("app", "orders")], Vec::new()));
    assert!(!orders.contains_key(&sb0.cgroup));
    assert_eq!(orders.len(), PODS / 2 - 1);
    let again = PodSpec {
        uid: unique("uid"),
        ..spec0
    };
    let sb = c.run_pod(&again);
    f.resolved(&sb.id);
    let pod = f.pod(&sb.id).unwrap();
    assert_eq!(
        (pod.name.as_str(), pod.uid.as_str()),
        ("orders-0", again.uid.as_str())
    );
    let orders = f.select(&pods(Some("shop"), &[("app", "orders")], Vec::new()));
    assert_eq!(orders.len(), PODS / 2);
    assert!(orders.contains_key(&sb.cgroup));
}

#[test]
fn the_mapping_is_kept_while_containerd_is_away() {
    let mut c = Containerd::start();
    let f = Follower::containerd(&c);
    let before = c.run_pod(&spec("shop", "orders-1", "orders"));
    f.resolved(&before.id);
    let selector = pods(Some("shop"), &[("app", "orders")], Vec::new());
    assert_eq!(f.select(&selector).len(), 1);

    c.stop();
    f.wait_connected(false);
    // Retried with backoff, the pod kept all the while.
    wait_until(Duration::from_secs(5), "two failed attempts", || {
        f.registry.sources()[0].failures >= 2
    });
    let status = f.registry.sources()[0].clone();
    assert!(!status.connected);
    assert_eq!(status.endpoint, c.socket);
    let error = status.last_error.unwrap();
    assert!(error.contains("connecting"), "{error}");
    assert_eq!(f.select(&selector).len(), 1);
    assert!(f.pod(&before.id).is_some());

    c.resume();
    f.wait_connected(true);
    let status = f.registry.sources()[0].clone();
    assert_eq!(status.failures, 0);
    assert!(f.pod(&before.id).is_some_and(|p| p.ready));
    // Events are followed again.
    let after = c.run_pod(&spec("shop", "orders-2", "orders"));
    f.resolved(&after.id);
    assert_eq!(f.select(&selector).len(), 2);
}

#[test]
fn podman_containers_are_resolved_by_name_and_labels() {
    let p = Podman::start();
    let f = Follower::docker(&p);
    let web = unique("orders-web");
    let cache = unique("cache");
    let web_id = p.run(&web, &[("app", "orders")]);
    let cache_id = p.run(&cache, &[("app", "cache")]);
    wait_until(RESOLVED_WITHIN, "both containers resolved", || {
        f.registry
            .containers()
            .iter()
            .filter(|c| c.cgroup.is_some())
            .count()
            == 2
    });
    let containers = f.registry.containers();
    let c = containers.iter().find(|c| c.id == web_id).unwrap();
    assert_eq!(c.name, web);
    assert_eq!(c.labels.get("app").map(String::as_str), Some("orders"));
    let cgroup = c.cgroup.clone().unwrap();
    assert!(cgroup.starts_with(&p.cgroup_root), "{cgroup}");
    assert!(cgroup2_mount().join(&cgroup).join("cgroup.procs").exists());

    let select = |name: Option<&str>, labels: &[(&str, &str)]| {
        let labels = LabelSelector::new(map(labels), Vec::new()).unwrap();
        let s = WorkloadSelector::Container(ContainerSelector::new(name, labels).unwrap());
        f.select(&s)
    };
    let by_label = select(None, &[("app", "orders")]);
    assert_eq!(
        by_label,
        BTreeMap::from([(cgroup.clone(), Identity::Container { name: web.clone() })])
    );
    assert_eq!(select(Some("orders-web-*"), &[]), by_label);
    assert!(select(None, &[("app", "payments")]).is_empty());

    p.remove(&web);
    wait_until(RESOLVED_WITHIN, "the removed container forgotten", || {
        f.registry.containers().iter().all(|c| c.id != web_id)
    });
    assert!(select(None, &[("app", "orders")]).is_empty());
    assert_eq!(select(None, &[("app", "cache")]).len(), 1);
    assert!(f.registry.containers().iter().any(|c| c.id == cache_id));
}

#[test]
fn units_are_resolved_in_a_systemd_shaped_tree() {
    // A cgroup2 subtree laid out as systemd lays out the root.
    let root = Cgroup::new("units");
    let mut made = Vec::new();
    for path in [
        "system.slice",
        "system.slice/orders.service",
        "system.slice/cron.service",
        "shop.slice",
        "shop.slice/shop-web.slice",
        "shop.slice/shop-web.slice/orders.service",
        "shop.slice/shop-web.slice/web.service",
    ] {
        let (parent, name) = path.rsplit_once('/').unwrap_or(("", path));
        let parent = made
            .iter()
            .find(|(p, _): &&(String, Cgroup)| p == parent)
            .map_or(&root, |(_, c)| c);
        let child = parent.child(name);
        made.push((path.to_string(), child));
    }
    let registry = Registry::new(root.path.clone());
    let units = |name: &str| {
        registry
            .select(&WorkloadSelector::Unit(UnitSelector::new(name).unwrap()))
            .into_iter()
            .map(|(cgroup, who)| format!("{cgroup} {who}"))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        units("orders.service"),
        [
            "shop.slice/shop-web.slice/orders.service unit orders.service",
            "system.slice/orders.service unit orders.service",
        ]
    );
    assert_eq!(
        units("shop-web.slice"),
        ["shop.slice/shop-web.slice unit shop-web.slice"]
    );
    assert_eq!(units("*.service").len(), 4);
    assert!(units("payments.service").is_empty());
    // Children before parents.
    while let Some((_, c)) = made.pop() {
        drop(c);
    }
}
