//! Governing services by name: the daemon started as the tests crate starts it, with a
//! scope that selects pods of a containerd started by the test (driven through CRI as
//! kubelet drives it), a container of Podman's Docker Engine API, or a unit in a cgroup
//! tree laid out as systemd lays it out; a budget of 5 toward a loopback server. Runs
//! on the host only: containerd, runc and podman are the host's.
//!
//! The pods' app containers run guard-probe from the image's busybox shell, with the
//! host's /lib and /lib64 mounted read-only (guard-probe links glibc) and its outcome
//! written to a directory of the test's.

use std::{
    path::{Path, PathBuf},
    sync::Mutex,
    time::{Duration, Instant},
};

use connguard_api::{
    policy::{Containers, Labelled, Limited, Pods, Policy, Scope},
    stats::ScopeStats,
};
use connguard_tests::{
    BPF_CGROUP_INET4_CONNECT, Cgroup, Daemon, Outcome, Probe, Server, attached_programs,
    cgroup2_mount, connguard_bin,
    containerd::{Containerd, PodSpec, Sandbox},
    hold_in,
    podman::Podman,
    probe_bin, unique,
};

/// One daemon at a time (it pins its state in one place), whatever the test threads.
static ONE_DAEMON: Mutex<()> = Mutex::new(());

/// The budget of every scope here.
const BUDGET: u64 = 5;
/// Connections each app attempts at once.
const ATTEMPTS: u64 = 8;
/// The longest a pod may take to be governed after RunPodSandbox returns.
const GOVERNED_WITHIN: Duration = Duration::from_secs(2);

fn one_daemon() -> std::sync::MutexGuard<'static, ()> {
    ONE_DAEMON.lock().unwrap_or_else(|e| e.into_inner())
}

fn wait_until(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(Instant::now() < deadline, "not within {limit:?}: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Scope `orders`: the pods of namespace `shop` labelled app=orders (and tier in
/// (web)), a budget of BUDGET, a rate high enough never to shed (it turns the
/// kernel's shedding events on).
fn orders(annotations: bool) -> Policy {
    let pods = Pods::new()
        .namespace("shop")
        .label("app", "orders")
        .expression("tier", connguard_api::policy::Operator::In, ["web"]);
    Policy::new().scope(
        Scope::named("orders")
            .pod(pods)
            .annotations(annotations)
            .max_connections(BUDGET)
            .rate("100000/s"),
    )
}

fn spec(name: &str, app: &str, annotations: &[(&str, &str)]) -> PodSpec {
    let map = |pairs: &[(&str, &str)]| {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    PodSpec {
        namespace: "shop".into(),
        name: name.into(),
        uid: unique("uid"),
        labels: map(&[("app", app), ("tier", "web")]),
        annotations: map(annotations),
    }
}

/// A containerd, a loopback server and a directory for the apps' outcomes.
struct Node {
    containerd: Containerd,
    server: Server,
    out: PathBuf,
}

impl Node {
    fn start() -> Node {
        let out = std::env::temp_dir().join(unique("connguard-pods"));
        std::fs::create_dir_all(&out).unwrap();
        Node {
            containerd: Containerd::start(),
            server: Server::start("127.0.0.1:0"),
            out,
        }
    }

    fn daemon(&self, policy: &Policy) -> Daemon {
        let socket = self.containerd.socket.to_str().unwrap();
        Daemon::builder(policy)
            .metrics()
            .args(&["--containerd-socket", socket])
            .start()
    }

    /// The app container `name` of `pod`: guard-probe attempts ATTEMPTS connections to
    /// the server at once, from its first socket on, and holds those admitted until
    /// the pod goes. Its outcome.
    fn app(&self, pod: &Sandbox, name: &str) -> Outcome {
        let file = self.out.join(format!("{name}.json"));
        let probe = Probe::Hold {
            addr: self.server.addr,
            count: ATTEMPTS,
            concurrency: ATTEMPTS,
        };
        let script = format!(
            "exec /probe/guard-probe {} > /out/{name}.json",
            probe.args().join(" ")
        );
        let probe_dir = probe_bin().parent().unwrap().to_path_buf();
        let (probe_dir, out) = (probe_dir.to_str().unwrap(), self.out.to_str().unwrap());
        self.containerd.run_container_with(
            pod,
            name,
            &["/bin/busybox", "sh", "-c", &script],
            &[
                ("/lib", "/lib", false),
                ("/lib64", "/lib64", false),
                (probe_dir, "/probe", false),
                (out, "/out", true),
            ],
        );
        let mut outcome = None;
        wait_until(
            Duration::from_secs(20),
            &format!("{name}'s outcome"),
            || {
                outcome = std::fs::read_to_string(&file)
                    .ok()
                    .and_then(|t| serde_json::from_str::<Outcome>(&t).ok());
                outcome.is_some()
            },
        );
        outcome.unwrap()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.out);
    }
}

/// (admitted, refused with ECONNREFUSED, other failures) of an app.
fn admitted(o: &Outcome) -> (u64, u64, u64) {
    let refused = o.errors("ECONNREFUSED");
    (o.ok, refused, o.attempts - o.ok - refused)
}

fn workloads(s: &ScopeStats) -> Vec<String> {
    s.members
        .iter()
        .filter_map(|m| m.workload.clone())
        .collect()
}

/// The series `name{labels}` of a scrape, if there is one.
fn metric(text: &str, name: &str, labels: &str) -> Option<f64> {
    let prefix = format!("{name}{{{labels}}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map(|v| v.trim().parse().unwrap())
}

#[test]
fn a_pod_selected_by_labels_is_governed_from_its_first_connection() {
    let _one = one_daemon();
    let mut node = Node::start();
    let d = node.daemon(&orders(false));
    // Nothing matches yet: a warning, not an error.
    let s = d.scope("orders");
    assert_eq!(
        s.warnings,
        ["pod namespace=shop app=orders,tier in (web) matches no pod on this node"]
    );
    assert_eq!((s.cgroup.as_deref(), s.member_count), (None, 0));
    assert!(
        d.log
            .lock()
            .unwrap()
            .contains("scope orders: pod namespace=shop"),
        "the warning is logged"
    );

    // The app container starts at once after its sandbox, as kubelet starts it.
    let first = node.containerd.run_pod(&spec("orders-1", "orders", &[]));
    let app = node.app(&first, "orders-1-app");
    assert_eq!(admitted(&app), (BUDGET, ATTEMPTS - BUDGET, 0), "{app:?}");
    let s = d.scope("orders");
    assert_eq!(
        (s.counts.active, s.counts.shed),
        (BUDGET, ATTEMPTS - BUDGET)
    );
    assert_eq!(workloads(&s), ["pod shop/orders-1"]);
    assert_eq!(s.members[0].cgroup, first.cgroup);
    assert!(s.warnings.is_empty(), "{:?}", s.warnings);
    assert_eq!(s.selectors, ["pod namespace=shop app=orders,tier in (web)"]);

    // A pod the selector does not match is not governed.
    let cart = node.containerd.run_pod(&spec("cart-1", "cart", &[]));
    let app = node.app(&cart, "cart-1-app");
    assert_eq!(admitted(&app), (ATTEMPTS, 0, 0), "{app:?}");
    assert_eq!(
        attached_programs(
            &cgroup2_mount().join(&cart.cgroup),
            BPF_CGROUP_INET4_CONNECT
        ),
        Some(0)
    );

    // Identity where a person looks: events, metrics, the table.
    let events = d.events();
    let started = events
        .iter()
        .find(|e| e.kind == "shedding_started")
        .unwrap_or_else(|| panic!("no shedding_started in {events:?}"));
    assert_eq!(
        (started.scope.as_str(), started.workload.as_deref()),
        ("orders", Some("pod shop/orders-1"))
    );
    let text = d.metrics();
    assert_eq!(
        metric(&text, "connguard_scope_members", "scope=\"orders\""),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &text,
            "connguard_scope_workload_info",
            "scope=\"orders\",workload=\"pod shop/orders-1\""
        ),
        Some(1.0)
    );
    let table = d.cli(&["stats"]);
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(table.contains("members 1: pod shop/orders-1"), "{table}");

    // containerd restarts: while it is down, the runtime is named unreachable and the
    // pod it last listed stays selected; then it is followed again.
    let connected = || d.stats().runtime("containerd").map(|r| r.connected);
    node.containerd.stop();
    wait_until(
        Duration::from_secs(5),
        "containerd seen unreachable",
        || connected() == Some(false),
    );
    let s = d.scope("orders");
    assert_eq!(
        workloads(&s),
        ["pod shop/orders-1"],
        "the last mapping kept"
    );
    assert_eq!(s.counts.active, BUDGET);
    node.containerd.resume();
    wait_until(Duration::from_secs(10), "containerd followed again", || {
        connected() == Some(true)
    });
    assert_eq!(workloads(&d.scope("orders")), ["pod shop/orders-1"]);

    // Deleted, then created again (a new uid, so a new cgroup): governed again.
    node.containerd.remove_pod(&first.id);
    let s = d.wait_scope("orders", Duration::from_secs(5), |s| {
        s.member_count == 0 && s.counts.active == 0
    });
    assert_eq!((s.member_count, s.counts.active), (0, 0));
    let again = node.containerd.run_pod(&spec("orders-1", "orders", &[]));
    assert_ne!(again.cgroup, first.cgroup);
    let app = node.app(&again, "orders-1-again");
    assert_eq!(admitted(&app), (BUDGET, ATTEMPTS - BUDGET, 0), "{app:?}");
    assert_eq!(d.scope("orders").members[0].cgroup, again.cgroup);
}

#[test]
fn annotation_budgets_hold_and_are_capped_by_the_scope() {
    let _one = one_daemon();
    let node = Node::start();
    let d = node.daemon(&orders(true));
    let budget = "connguard.io/max-connections";
    let three = node
        .containerd
        .run_pod(&spec("orders-3", "orders", &[(budget, "3")]));
    let fifty = node
        .containerd
        .run_pod(&spec("orders-50", "orders", &[(budget, "50")]));
    let plain = node.containerd.run_pod(&spec("orders-0", "orders", &[]));
    // A malformed budget: a warning, and the pod stays in its scope.
    node.containerd
        .run_pod(&spec("orders-bad", "orders", &[(budget, "many")]));
    // Each annotated pod its own budget, the scope's other pods the scope's.
    let outcomes = [
        (node.app(&three, "three"), 3),
        (node.app(&fifty, "fifty"), BUDGET),
        (node.app(&plain, "plain"), BUDGET),
    ];
    for (o, want) in &outcomes {
        assert_eq!(admitted(o), (*want, ATTEMPTS - want, 0), "{o:?}");
    }
    let stats = d.stats();
    let pod_scope = |name: &str| {
        let s = stats
            .scope(&format!("orders/shop/{name}"))
            .unwrap_or_else(|| panic!("no scope of pod {name}: {stats:#?}"));
        (
            s.parent.as_deref(),
            s.limits.max_connections,
            s.counts.active,
            workloads(s),
        )
    };
    assert_eq!(
        pod_scope("orders-3"),
        (
            Some("orders"),
            Some(3),
            3,
            vec!["pod shop/orders-3".to_string()]
        )
    );
    assert_eq!(
        pod_scope("orders-50"),
        (
            Some("orders"),
            Some(BUDGET),
            BUDGET,
            vec!["pod shop/orders-50".to_string()]
        )
    );
    let s = stats.scope("orders").unwrap();
    assert_eq!(workloads(s), ["pod shop/orders-0", "pod shop/orders-bad"]);
    assert_eq!(s.counts.active, BUDGET, "the annotated pods count apart");
    assert_eq!(
        s.warnings,
        [
            "pod shop/orders-bad: annotation connguard.io/max-connections: \"many\": not a whole number of connections (invalid digit found in string); the scope's budget applies"
        ]
    );
    // In metrics, the annotated pods count in their scope's series.
    let text = d.metrics();
    let active = metric(
        &text,
        "connguard_scope_active_connections",
        "scope=\"orders\"",
    );
    assert_eq!(active, Some((3 + BUDGET + BUDGET) as f64), "{text}");
    assert_eq!(
        metric(&text, "connguard_scope_members", "scope=\"orders\""),
        Some(4.0)
    );
    assert!(!text.contains("scope=\"orders/"), "{text}");

    // The pod goes, and its scope with it.
    node.containerd.remove_pod(&three.id);
    wait_until(Duration::from_secs(5), "the pod's scope gone", || {
        d.stats().scope("orders/shop/orders-3").is_none()
    });
    let admitted_total = |t: &str| {
        metric(
            t,
            "connguard_scope_admitted_connections_total",
            "scope=\"orders\"",
        )
        .unwrap()
    };
    assert!(admitted_total(&d.metrics()) >= admitted_total(&text));
    // Created again with the same name: its own budget again.
    let back = node
        .containerd
        .run_pod(&spec("orders-3", "orders", &[(budget, "3")]));
    let o = node.app(&back, "three-again");
    assert_eq!(admitted(&o), (3, ATTEMPTS - 3, 0), "{o:?}");
}

#[test]
fn pods_are_governed_when_their_sandbox_starts() {
    const PODS: usize = 100;
    let _one = one_daemon();
    let node = Node::start();
    let d = node.daemon(&orders(false));
    let mount = cgroup2_mount();
    // ms from RunPodSandbox's return to the programs attached to the pod's cgroup
    // (after its SCOPES entry is written); negative: before it returned.
    let mut governed = Vec::new();
    let started = Instant::now();
    for i in 0..PODS {
        let spec = spec(&format!("orders-{i}"), "orders", &[]);
        let dir = mount.join(format!("{}/pod{}", node.containerd.pod_root, spec.uid));
        let poller = std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                if attached_programs(&dir, BPF_CGROUP_INET4_CONNECT).is_some_and(|n| n > 0) {
                    return Some(Instant::now());
                }
                if Instant::now() > deadline {
                    return None;
                }
                std::thread::sleep(Duration::from_micros(100));
            }
        });
        node.containerd.run_pod(&spec);
        let returned = Instant::now();
        let at = poller.join().unwrap().expect("the pod's cgroup governed");
        governed.push(if at >= returned {
            (at - returned).as_secs_f64() * 1e3
        } else {
            -(returned - at).as_secs_f64() * 1e3
        });
    }
    let elapsed = started.elapsed();
    governed.sort_by(f64::total_cmp);
    let rank = |q: f64| governed[((q * PODS as f64).ceil() as usize).clamp(1, PODS) - 1];
    println!(
        "RunPodSandbox's return to governed over {PODS} pods: p50 {:.1} ms, p99 {:.1} ms, \
         max {:.1} ms; {} governed before it returned ({:.1} s for the {PODS} pods)",
        rank(0.5),
        rank(0.99),
        governed[PODS - 1],
        governed.iter().filter(|g| **g < 0.0).count(),
        elapsed.as_secs_f64()
    );
    assert!(
        governed[PODS - 1] < GOVERNED_WITHIN.as_secs_f64() * 1e3,
        "{governed:?}"
    );
    let s = d.scope("orders");
    assert_eq!(s.member_count, PODS as u64);
    assert_eq!(s.members.len(), connguard_api::stats::MEMBERS_LISTED);
}

/// A drill that names a pod by its labels faults that pod's connects alone (its app
/// container's cgroup lies below the pod's), in the scope that governs it; another pod
/// of the same scope connects. The drill lists the pod with its cgroup.
#[test]
fn a_pod_drill_faults_that_pod_alone() {
    let _one = one_daemon();
    let node = Node::start();
    let shop = Policy::new().scope(Scope::named("shop").pod(Pods::new().namespace("shop")));
    let d = node.daemon(&shop);
    let orders = node.containerd.run_pod(&spec("orders-1", "orders", &[]));
    let cart = node.containerd.run_pod(&spec("cart-1", "cart", &[]));
    d.wait_scope("shop", Duration::from_secs(5), |s| s.member_count == 2);
    let out = d.cli(&[
        "drill",
        "start",
        "--name",
        "orders-down",
        "--pod-namespace",
        "shop",
        "--pod-label",
        "app=orders",
        "--fault",
        "refuse",
        "--probability",
        "1",
        "--duration",
        "5min",
        "--max-faults",
        "100",
    ]);
    assert!(out.status.success(), "{out:?}");
    let app = node.app(&orders, "orders-1-app");
    assert_eq!(admitted(&app), (0, ATTEMPTS, 0), "{app:?}");
    let app = node.app(&cart, "cart-1-app");
    assert_eq!(admitted(&app), (ATTEMPTS, 0, 0), "{app:?}");
    let list = d.cli(&["drill", "list", "--json"]);
    let reply: connguard_api::drill::DrillsReply =
        serde_json::from_slice(&list.stdout).expect("drill list --json");
    let v = &reply.drills[0];
    assert_eq!(v.spec.scope, "shop");
    assert_eq!(
        v.workloads,
        [format!("pod shop/orders-1 (/{})", orders.cgroup)]
    );
    assert_eq!((v.attempts, v.faulted), (ATTEMPTS, ATTEMPTS), "{v:?}");
}

#[test]
fn a_labelled_podman_container_is_governed() {
    let _one = one_daemon();
    let podman = Podman::start();
    let server = Server::start("127.0.0.1:0");
    let policy = Policy::new().scope(
        Scope::named("web")
            .container(Containers::new().name("web-*").label("app", "orders"))
            .max_connections(BUDGET),
    );
    let d = Daemon::builder(&policy)
        .args(&["--docker-socket", podman.socket.to_str().unwrap()])
        .start();
    let name = unique("web");
    let other = unique("web");
    podman.run(&name, &[("app", "orders")]);
    podman.run(&other, &[("app", "cart")]);
    let s = d.wait_scope("web", Duration::from_secs(10), |s| s.member_count == 1);
    assert_eq!(workloads(&s), [format!("container {name}")]);
    let dir = cgroup2_mount().join(&s.members[0].cgroup);
    let hold = |dir: &Path| {
        hold_in(
            dir,
            Probe::Hold {
                addr: server.addr,
                count: ATTEMPTS,
                concurrency: ATTEMPTS,
            },
        )
    };
    let inside = hold(&dir);
    assert_eq!(admitted(&inside.outcome), (BUDGET, ATTEMPTS - BUDGET, 0));
    let runtime = d.stats().runtime("docker").cloned().unwrap();
    assert!(runtime.connected, "{runtime:?}");
    assert_eq!(runtime.endpoint, podman.socket.display().to_string());
    drop(inside);
    podman.remove(&name);
    let s = d.wait_scope("web", Duration::from_secs(10), |s| s.member_count == 0);
    assert_eq!(s.member_count, 0);
}

#[test]
fn a_unit_in_a_systemd_shaped_tree_is_governed() {
    let _one = one_daemon();
    let server = Server::start("127.0.0.1:0");
    // The daemon's cgroup2 is this tree, in a cgroup namespace rooted at it.
    let root = Cgroup::new("units");
    let system = root.child("system.slice");
    let web = system.child("web.service");
    let orders = system.child("orders.service");
    let policy = Policy::new().scope(
        Scope::named("orders")
            .unit("orders.service")
            .max_connections(BUDGET),
    );
    let d = Daemon::builder(&policy).in_cgroup_namespace(&root).start();
    let probe = Probe::Hold {
        addr: server.addr,
        count: ATTEMPTS,
        concurrency: ATTEMPTS,
    };
    let s = d.scope("orders");
    assert_eq!(workloads(&s), ["unit orders.service"]);
    assert_eq!(s.members[0].cgroup, "system.slice/orders.service");
    let held = orders.hold(probe.clone());
    assert_eq!(admitted(&held.outcome), (BUDGET, ATTEMPTS - BUDGET, 0));
    assert_eq!(admitted(&web.hold(probe.clone()).outcome), (ATTEMPTS, 0, 0));
    // The service restarts: systemd makes its cgroup again, governed at once.
    drop(held);
    drop(orders);
    d.wait_scope("orders", Duration::from_secs(5), |s| s.member_count == 0);
    let again = system.child("orders.service");
    connguard_tests::wait_attached(&again, BPF_CGROUP_INET4_CONNECT);
    assert_eq!(
        admitted(&again.hold(probe).outcome),
        (BUDGET, ATTEMPTS - BUDGET, 0)
    );
    let s = d.wait_scope("orders", Duration::from_secs(5), |s| s.member_count == 1);
    assert_eq!(workloads(&s), ["unit orders.service"]);
}

#[test]
fn bad_input_is_named() {
    let _one = one_daemon();
    // A malformed selector: FILE:LINE:COL, the daemon not started.
    let dir = std::env::temp_dir().join(unique("connguard-bad"));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("policy.toml");
    let line = "pod = { match_expressions = [{ key = \"tier\", operator = \"Equal\", values = [\"web\"] }] }";
    std::fs::write(&file, format!("[[scope]]\nname = \"orders\"\n{line}\n")).unwrap();
    let col = line.find("\"Equal\"").unwrap() + 1;
    let out = std::process::Command::new(connguard_bin())
        .arg("check")
        .arg(&file)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        format!(
            "{}:3:{col}: unknown operator \"Equal\": one of In, NotIn, Exists, DoesNotExist",
            file.display()
        )
    );

    // Runtimes that cannot be reached: named at start and in stats, retried.
    let policy =
        orders(false).scope(Scope::named("web").container(Containers::new().label("app", "web")));
    let d = Daemon::builder(&policy)
        .metrics()
        .args(&[
            "--containerd-socket",
            "/nonexistent/containerd.sock",
            "--docker-socket",
            "/nonexistent/docker.sock",
        ])
        .start();
    let log = d.log.lock().unwrap().clone();
    for source in ["containerd", "docker"] {
        let ready = log.lines().find(|l| l.contains(" ready: ")).unwrap();
        assert!(
            ready.contains(&format!(
                "{source} at /nonexistent/{source}.sock (unreachable:"
            )),
            "{ready}"
        );
    }
    assert!(
        log.contains("following containerd at /nonexistent/containerd.sock for the pod selectors of scope(s) orders"),
        "{log}"
    );
    wait_until(Duration::from_secs(5), "a second failed attempt", || {
        d.stats().runtimes.iter().all(|r| r.failures >= 2)
    });
    let stats = d.stats();
    let containerd = stats.runtime("containerd").unwrap();
    assert!(!containerd.connected);
    assert_eq!(containerd.endpoint, "/nonexistent/containerd.sock");
    let error = containerd.last_error.as_deref().unwrap();
    assert!(error.starts_with("connecting"), "{error}");
    assert_eq!(
        stats.scope("web").unwrap().warnings,
        ["container app=web matches no container on this node"]
    );
    let text = d.metrics();
    for source in ["containerd", "docker"] {
        let labels = format!("source=\"{source}\"");
        assert_eq!(
            metric(&text, "connguard_runtime_connected", &labels),
            Some(0.0)
        );
    }
}
