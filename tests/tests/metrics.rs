//! Metrics Prometheus can trust: `_total` series that never go down, internal errors
//! apart from lost diagnostic events, and the alert rules and dashboard shipped in
//! packaging/, checked against a real scrape.
use std::{
    collections::BTreeSet,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use aya::maps::{HashMap, Map, MapData, MapError};
use connguard_api::policy::{Limited, Mode, Policy, Scope};
use connguard_tests::{Cgroup, Daemon, Probe, Server};
use guard_common::{Counter, CounterKey, MAX_SCOPE_IDS, TimeWaitKey};
use serde::Deserialize;

/// The value of the series `name{labels}` in a scrape.
fn value(metrics: &str, name: &str, labels: &str) -> Option<u64> {
    let prefix = format!("{name}{{{labels}}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map(|v| v.parse().unwrap())
}

/// The totals of a destination series: admitted, shed, would_shed.
fn totals(metrics: &str, labels: &str) -> [u64; 3] {
    ["admitted", "shed", "would_shed"].map(|what| {
        let name = format!("connguard_destination_{what}_connections_total");
        value(metrics, &name, labels).unwrap_or_else(|| panic!("no {name}{{{labels}}}:\n{metrics}"))
    })
}

/// 20 destinations held busy, then one in `dst="other"` whose entry is forgotten, and
/// one that enters the 20 busiest and pushes another out: across every scrape, the
/// `other` series never go down, and they count exactly the scope's connections that
/// no listed series has counted.
#[test]
fn other_never_goes_down_as_destinations_enter_the_top_and_are_forgotten() {
    let server = Server::start("0.0.0.0:0");
    let port = server.addr.port();
    let at = |host: u8| -> SocketAddr { format!("127.0.0.{host}:{port}").parse().unwrap() };
    let cg = Cgroup::new("other");
    let d = Daemon::builder(Policy::new().scope(Scope::new("m", &cg.rel).mode(Mode::Observe)))
        .metrics()
        .args(&["--forget-idle", "1"])
        .start();
    // 127.0.0.2 to .21: 2 held each (active 2), the 20 busiest. .30: 9 opened and
    // closed, 1 held (active 1, 10 admitted). .31: 1 opened and closed, then idle.
    let _busy: Vec<_> = (2..22).map(|h| cg.hold(Probe::hold(at(h), 2, 2))).collect();
    assert_eq!(cg.probe(Probe::connect(at(30), 9, 9)).ok, 9);
    let _entering = cg.hold(Probe::hold(at(30), 1, 1));
    assert_eq!(cg.probe(Probe::connect(at(31), 1, 1)).ok, 1);
    let s = d.wait_scope("m", Duration::from_secs(5), |s| s.counts.active == 41);
    assert_eq!((s.counts.active, s.counts.admitted), (41, 51), "{s:?}");

    let other = "scope=\"m\",rule=\"\",dst=\"other\"";
    let mut last = [0; 3];
    let mut scrape = |expected_admitted: u64| -> String {
        let metrics = d.metrics();
        let now = totals(&metrics, other);
        for i in 0..3 {
            assert!(
                now[i] >= last[i],
                "other went down from {last:?} to {now:?}:\n{metrics}"
            );
        }
        assert_eq!(now, [expected_admitted, 0, 0], "{metrics}");
        last = now;
        metrics
    };
    let listed = |metrics: &str| {
        metrics
            .lines()
            .filter(|l| {
                l.starts_with("connguard_destination_admitted_connections_total{scope=\"m\"")
                    && !l.contains("dst=\"other\"")
            })
            .count()
    };
    // .30 (10) and .31 (1) are the rest.
    let metrics = scrape(11);
    assert_eq!(listed(&metrics), 20, "{metrics}");
    assert_eq!(
        value(&metrics, "connguard_destination_active_connections", other),
        Some(1)
    );

    // .31 is forgotten (idle for 1 to 2 s): its connection stays in `other`.
    let gone = at(31).to_string();
    let s = d.wait_scope("m", Duration::from_secs(10), |s| {
        s.destination(&gone).is_none()
    });
    assert!(
        s.destination(&gone).is_none(),
        "{gone} not forgotten: {s:?}"
    );
    scrape(11);

    // .30 holds 2 more (active 3): it enters the 20 busiest with its 12, and the last
    // of the others (by address text, .9) leaves them. `other` keeps .30's past and
    // gains its 2 new connections.
    let _more = cg.hold(Probe::hold(at(30), 2, 2));
    let metrics = scrape(13);
    assert_eq!(listed(&metrics), 20, "{metrics}");
    let entered = format!("scope=\"m\",rule=\"\",dst=\"{}\"", at(30));
    assert_eq!(totals(&metrics, &entered), [12, 0, 0], "{metrics}");
    let left = format!("scope=\"m\",rule=\"\",dst=\"{}\"", at(9));
    assert_eq!(
        value(
            &metrics,
            "connguard_destination_admitted_connections_total",
            &left
        ),
        None,
        "{metrics}"
    );
    // The connections of .9, now in `other`, are its active ones.
    assert_eq!(
        value(&metrics, "connguard_destination_active_connections", other),
        Some(2)
    );
    // New connections of a listed destination are its series', not `other`'s.
    assert_eq!(cg.probe(Probe::connect(at(30), 1, 1)).ok, 1);
    let metrics = scrape(13);
    assert_eq!(totals(&metrics, &entered), [13, 0, 0], "{metrics}");
}

/// A pinned map of the daemon's state, opened by its path.
fn pinned<K: aya::Pod, V: aya::Pod>(name: &str) -> HashMap<MapData, K, V> {
    let path = connguard_tests::pinned_map_path(name);
    let data = MapData::from_pin(&path).unwrap_or_else(|e| panic!("opening {path}: {e}"));
    HashMap::try_from(Map::from_map_data(data).unwrap()).unwrap()
}

/// Inserts `key(0)`, `key(1)`, ... into `map` until the kernel says it is full
/// (E2BIG); how many.
fn fill<K: aya::Pod, V: aya::Pod + Default>(
    map: &mut HashMap<MapData, K, V>,
    key: impl Fn(u64) -> K,
) -> u64 {
    for i in 0.. {
        match map.insert(key(i), V::default(), 0) {
            Ok(()) => {}
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::E2BIG) => {
                return i;
            }
            Err(e) => panic!("inserting entry {i}: {e}"),
        }
    }
    unreachable!()
}

/// A scope id no scope of a test policy gets (ids are given from 0).
const NO_SCOPE: u32 = MAX_SCOPE_IDS - 1;

/// With TIME_WAITS full, every TIME_WAIT birth is a lost event and no internal error;
/// with the destination counters full too, every admission is also an internal error
/// (let through uncounted at that level), and still no connection is refused.
#[test]
fn full_maps_lose_diagnostic_events_apart_from_fail_open_admissions() {
    // Two servers: the second one's destination has no counter yet when COUNTERS is full.
    let (first, second) = (Server::start("127.0.0.1:0"), Server::start("127.0.0.1:0"));
    let cg = Cgroup::new("lost");
    // A destination map of 4,096 entries, full after as many inserts where the default
    // size takes 262,144 system calls.
    let d = Daemon::builder(Policy::new().scope(Scope::new("lost", &cg.rel).max_connections(100)))
        .metrics()
        .args(&["--max-destinations", "4096"])
        .start();
    let entries = fill(&mut pinned::<TimeWaitKey, u64>("TIME_WAITS"), |i| {
        TimeWaitKey {
            netns: i,
            scope_id: NO_SCOPE,
            ..Default::default()
        }
    });
    assert!(entries > 0);
    let expect = |internal_errors: u64, lost_events: u64| {
        // A TIME_WAIT birth is counted just after its connection's release.
        let mut stats = d.stats();
        for _ in 0..100 {
            if stats.lost_events >= lost_events {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
            stats = d.stats();
        }
        assert_eq!(
            (stats.internal_errors, stats.lost_events),
            (internal_errors, lost_events),
            "{stats:?}"
        );
        let metrics = d.metrics();
        for line in [
            format!("connguard_internal_errors_total {internal_errors}"),
            format!("connguard_lost_events_total {lost_events}"),
        ] {
            assert!(
                metrics.lines().any(|l| l == line),
                "no {line:?} in\n{metrics}"
            );
        }
        let table = d.cli(&["stats"]);
        let table = String::from_utf8_lossy(&table.stdout);
        assert!(
            table.contains(&format!("internal errors (fail-open): {internal_errors}\n")),
            "{table}"
        );
    };
    // The client closes first: each connection leaves a TIME_WAIT entry, counted when
    // its socket reaches TCP_CLOSE.
    let out = cg.probe(Probe::connect(first.addr, 20, 20));
    assert_eq!(out.ok, 20, "{out:?}");
    let s = d.wait_scope("lost", Duration::from_secs(5), |s| s.counts.active == 0);
    assert_eq!((s.counts.admitted, s.time_wait_created), (20, 0), "{s:?}");
    expect(0, 20);

    fill(&mut pinned::<CounterKey, Counter>("COUNTERS"), |i| {
        CounterKey {
            scope_id: NO_SCOPE,
            port: i as u16,
            addr: (i >> 16).to_be_bytes().repeat(2).try_into().unwrap(),
            ..Default::default()
        }
    });
    let out = cg.probe(Probe::connect(second.addr, 5, 5));
    assert_eq!(out.ok, 5, "{out:?}");
    let s = d.wait_scope("lost", Duration::from_secs(5), |s| s.counts.active == 0);
    assert_eq!(s.counts.admitted, 25, "{s:?}");
    expect(5, 25);
}

/// The workspace's root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs promtool, which must succeed; its output.
fn promtool(args: &[&str], stdin: Option<&str>) -> String {
    use std::io::Write;
    let mut child = Command::new("promtool")
        .args(args)
        .current_dir(root().join("packaging/prometheus"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool is missing: run `cargo xtask setup` (installs Debian's prometheus)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.unwrap_or_default().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?}:\n{text}");
    text
}

/// The `connguard_` metric names in `text`, as Prometheus stores them.
fn metric_names(text: &str) -> BTreeSet<String> {
    text.match_indices("connguard_")
        .filter(|(i, _)| !text[..*i].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_'))
        .map(|(i, _)| {
            text[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        })
        .collect()
}

/// Every name a scrape exports: the samples' names, and each family's even when it has
/// no sample yet (its `# TYPE` line).
fn exported(metrics: &str) -> BTreeSet<String> {
    metrics
        .lines()
        .filter_map(|l| {
            l.strip_prefix("# TYPE ")
                .unwrap_or(l)
                .split(['{', ' '])
                .next()
        })
        .filter(|name| name.starts_with("connguard_"))
        .map(str::to_string)
        .collect()
}

/// What a Grafana dashboard needs to load: a title and uid, and panels each with a type,
/// a title and a place, whose queries each have a refId and an expression. Reading a
/// file into it checks them; the fields not read afterwards are there to be required.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
#[expect(dead_code, reason = "required by reading, not read")]
struct Dashboard {
    title: String,
    uid: String,
    schema_version: u64,
    panels: Vec<Panel>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
#[expect(dead_code, reason = "required by reading, not read")]
struct Panel {
    title: String,
    #[serde(rename = "type")]
    kind: String,
    grid_pos: GridPos,
    targets: Option<Vec<Target>>,
}

#[derive(Deserialize)]
#[expect(dead_code, reason = "required by reading, not read")]
struct GridPos {
    h: u64,
    w: u64,
    x: u64,
    y: u64,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
#[expect(dead_code, reason = "required by reading, not read")]
struct Target {
    ref_id: String,
    expr: String,
}

/// The PromQL expressions of a Grafana dashboard's panels (rows hold none).
fn dashboard_exprs(dashboard: &Dashboard) -> Vec<String> {
    assert!(!dashboard.panels.is_empty());
    let mut exprs = Vec::new();
    for p in dashboard.panels.iter().filter(|p| p.kind != "row") {
        let targets = p.targets.as_deref().unwrap_or_default();
        assert!(!targets.is_empty(), "panel {}: no targets", p.title);
        exprs.extend(targets.iter().map(|t| t.expr.clone()));
    }
    exprs
}

/// packaging/prometheus/alerts.yml passes `promtool check rules` and its unit tests, a
/// real scrape passes `promtool check metrics`, and the alerts and the Grafana
/// dashboard name only metrics the daemon exports, the dashboard every one of them.
#[test]
fn shipped_alerts_and_dashboard_use_the_exported_metrics() {
    let cg = Cgroup::new("shipped");
    let d = Daemon::builder(Policy::new().scope(Scope::new("s", &cg.rel)))
        .metrics()
        .start();
    let metrics = &d.metrics();
    let exported = exported(metrics);
    assert!(
        exported.contains("connguard_lost_events_total"),
        "{metrics}"
    );

    promtool(&["check", "rules", "alerts.yml"], None);
    promtool(&["test", "rules", "alerts_test.yml"], None);
    let lint = promtool(&["check", "metrics"], Some(metrics));
    assert!(lint.trim().is_empty(), "promtool check metrics:\n{lint}");

    let alerts = std::fs::read_to_string(root().join("packaging/prometheus/alerts.yml")).unwrap();
    let unknown: Vec<_> = metric_names(&alerts)
        .difference(&exported)
        .cloned()
        .collect();
    assert!(
        unknown.is_empty(),
        "alerts.yml names metrics the daemon does not export: {unknown:?}"
    );

    let path = root().join("packaging/grafana/connguard.json");
    let dashboard: Dashboard = serde_json::from_slice(&std::fs::read(&path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let used = metric_names(&dashboard_exprs(&dashboard).join("\n"));
    let unknown: Vec<_> = used.difference(&exported).collect();
    assert!(
        unknown.is_empty(),
        "the dashboard names metrics the daemon does not export: {unknown:?}"
    );
    let unshown: Vec<_> = exported.difference(&used).collect();
    assert!(
        unshown.is_empty(),
        "metrics the dashboard does not show: {unshown:?}"
    );
}
