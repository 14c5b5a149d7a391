//! What running as a Kubernetes DaemonSet relies on: the policy file reloaded by the
//! daemon itself when it changes (a ConfigMap volume's update among the ways), with
//! reload's semantics, and the probes /healthz and /readyz on the metrics listener.
use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use aya::maps::{Array, Map, MapData};
use connguard_api::{
    policy::{Mode, Policy, Scope},
    stats::Snapshot,
};
use connguard_tests::{Cgroup, Daemon, Holder, Probe, Server, budget_policy, unique};

/// How long a change of the file may take to be reloaded: the end of its burst
/// (200 ms of quiet) and the reload, in a slow guest.
const DEADLINE: Duration = Duration::from_secs(5);
/// How long after a reload a second one, which must not come, is waited for.
const SETTLE: Duration = Duration::from_secs(1);

/// Waits until the daemon's policy generation is `generation` (within DEADLINE), then
/// SETTLE more, and checks it is still `generation`: one reload, not two.
fn one_reload_to(d: &Daemon, generation: u64) -> Snapshot {
    let until = Instant::now() + DEADLINE;
    while d.stats().policy.generation < generation {
        assert!(
            Instant::now() < until,
            "generation {generation} not reached within {DEADLINE:?}: {:?}\n{}",
            d.stats().policy,
            d.log.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(SETTLE);
    let stats = d.stats();
    assert_eq!(
        stats.policy.generation,
        generation,
        "{:?}\n{}",
        stats.policy,
        d.log.lock().unwrap()
    );
    stats
}

/// Waits until the daemon reports a rejected reload (within DEADLINE); its error.
fn rejected(d: &Daemon) -> (Snapshot, String) {
    let until = Instant::now() + DEADLINE;
    loop {
        let stats = d.stats();
        if let Some(e) = stats.policy.last_error.clone() {
            return (stats, e);
        }
        assert!(
            Instant::now() < until,
            "no rejected reload within {DEADLINE:?}: {:?}",
            stats.policy
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The policy with one more scope, on no cgroup: a change that leaves `h` as it was.
fn with_other(policy: &Policy, other: &str) -> String {
    policy.clone().scope(Scope::new(other, "nowhere")).to_toml()
}

/// A policy the parser refuses at line (last), column 19.
fn bad(policy: &Policy) -> String {
    format!("{policy}\n[[scope]]\nname = \"bad\"\ncgroup = \"x\"\nmax_connections = -1\n")
}

/// The budget of 5 toward `server` is still spent: 5 more connects are all refused.
fn still_enforced(cg: &Cgroup, server: &Server) {
    let more = cg.probe(Probe::connect(server.addr, 5, 1));
    assert_eq!(
        more.errors("ECONNREFUSED"),
        5,
        "the policy in force still sheds: {more:?}"
    );
}

/// A scope `h` with a budget of 5 toward a server, its 5 connections held.
fn held_budget(prefix: &str) -> (Server, Cgroup, Policy) {
    let server = Server::start("127.0.0.1:0");
    let cg = Cgroup::new(prefix);
    let policy = budget_policy("h", &cg.rel, Mode::Enforce, &server.addr, 5);
    (server, cg, policy)
}

fn hold_five(cg: &Cgroup, server: &Server) -> Holder {
    let held = cg.hold(Probe::hold(server.addr, 5, 5));
    assert_eq!(held.outcome.ok, 5);
    held
}

/// A write in place and an editor's rename over the file each reload once; a write of
/// the same bytes reloads nothing; a bad file changes nothing and is reported (stats,
/// log, metric), and the budgets in force stay enforced with their counts.
#[test]
fn a_changed_policy_file_is_reloaded_once_by_the_daemon_itself() {
    let (server, cg, policy) = held_budget("watch");
    let d = Daemon::builder(&policy).metrics().watching_policy().start();
    let held = hold_five(&cg, &server);

    std::fs::write(&d.policy, with_other(&policy, "a")).unwrap();
    let stats = one_reload_to(&d, 2);
    assert_eq!(stats.policy.last_error, None);
    assert!(
        d.log.lock().unwrap().contains(&format!(
            "policy file {} changed: reloading",
            d.policy.display()
        )),
        "{}",
        d.log.lock().unwrap()
    );
    std::fs::write(&d.policy, with_other(&policy, "a")).unwrap();
    one_reload_to(&d, 2);

    let tmp = d.policy.with_extension("toml.swp");
    std::fs::write(&tmp, with_other(&policy, "b")).unwrap();
    std::fs::rename(&tmp, &d.policy).unwrap();
    let stats = one_reload_to(&d, 3);
    assert!(stats.scope("b").is_some(), "{:?}", stats.scopes);
    assert_eq!(d.scope("h").counts.active, 5, "counts survive a reload");

    let text = bad(&policy);
    std::fs::write(&d.policy, &text).unwrap();
    let (stats, error) = rejected(&d);
    let want = format!(
        "{}:{}:19: max_connections must be at least 1",
        d.policy.display(),
        text.lines().count()
    );
    assert!(error.starts_with(&want), "{error}");
    assert_eq!(stats.policy.generation, 3);
    assert!(
        d.log.lock().unwrap().contains(&want),
        "the rejection is logged"
    );
    assert!(
        d.metrics()
            .lines()
            .any(|l| l == "connguard_policy_last_reload_failed 1"),
        "{}",
        d.metrics()
    );
    still_enforced(&cg, &server);
    let s = d.scope("h");
    assert_eq!((s.counts.active, s.counts.shed), (5, 5), "{s:?}");
    drop(held);
}

/// A ConfigMap volume as kubelet lays it out in `dir` and updates it: the key's file
/// `policy.toml` a symlink to `..data/policy.toml`, `..data` a symlink to a timestamped
/// directory holding the data; an update writes a new timestamped directory, renames a
/// new `..data` over the old one and removes the old directory.
struct ConfigMap {
    dir: PathBuf,
    generation: u32,
}

impl ConfigMap {
    fn new(text: &str) -> ConfigMap {
        let dir = std::env::temp_dir().join(unique("connguard-configmap"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut map = ConfigMap { dir, generation: 0 };
        map.update(text);
        std::os::unix::fs::symlink("..data/policy.toml", map.path()).unwrap();
        map
    }

    fn path(&self) -> PathBuf {
        self.dir.join("policy.toml")
    }

    fn stamp(generation: u32) -> String {
        format!("..2026_12_01_00_00_{generation:02}.{generation}")
    }

    fn update(&mut self, text: &str) {
        self.generation += 1;
        let stamp = Self::stamp(self.generation);
        std::fs::create_dir(self.dir.join(&stamp)).unwrap();
        std::fs::write(self.dir.join(&stamp).join("policy.toml"), text).unwrap();
        let tmp = self.dir.join("..data_tmp");
        std::os::unix::fs::symlink(&stamp, &tmp).unwrap();
        std::fs::rename(&tmp, self.dir.join("..data")).unwrap();
        let old = self.dir.join(Self::stamp(self.generation - 1));
        if Path::new(&old).exists() {
            std::fs::remove_dir_all(old).unwrap();
        }
    }
}

impl Drop for ConfigMap {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Each update of a ConfigMap volume reloads once; a bad policy in it changes nothing
/// and is reported, and the next good one is applied.
#[test]
fn a_config_map_update_is_reloaded_once() {
    let (server, cg, policy) = held_budget("configmap");
    let mut map = ConfigMap::new(&policy.to_toml());
    let d = Daemon::builder("")
        .policy_at(map.path())
        .watching_policy()
        .start();
    let held = hold_five(&cg, &server);

    map.update(&with_other(&policy, "a"));
    let stats = one_reload_to(&d, 2);
    assert!(stats.scope("a").is_some(), "{:?}", stats.scopes);

    map.update(&bad(&policy));
    let (stats, error) = rejected(&d);
    assert!(
        error.starts_with(&format!("{}:", map.path().display()))
            && error.contains("max_connections must be at least 1"),
        "{error}"
    );
    assert_eq!(stats.policy.generation, 2);
    still_enforced(&cg, &server);

    map.update(&with_other(&policy, "b"));
    let stats = one_reload_to(&d, 3);
    assert_eq!(stats.policy.last_error, None);
    assert!(stats.scope("b").is_some(), "{:?}", stats.scopes);
    assert_eq!(d.scope("h").counts.active, 5);
    drop(held);
}

/// `--no-watch-policy`: a changed file waits for a reload.
#[test]
fn without_the_watch_a_changed_file_waits_for_a_reload() {
    let cg = Cgroup::new("nowatch");
    let policy = Policy::new().scope(Scope::new("h", &cg.rel));
    let d = Daemon::builder(&policy).start();
    std::fs::write(&d.policy, with_other(&policy, "a")).unwrap();
    std::thread::sleep(SETTLE * 2);
    assert_eq!(d.stats().policy.generation, 1);
    assert!(d.reload().status.success());
    assert_eq!(d.stats().policy.generation, 2);
}

/// The start of the lease's check when it passes, before the seconds left.
const LEASE_OK: &str = "[+]lease ok: the programs shed for";

/// The status of GET `path` and the lines of its body, the lease's check cut to
/// LEASE_OK once its seconds left are checked (more than 0, at most the lease's 5).
fn probe(d: &Daemon, path: &str) -> (u16, Vec<String>) {
    let (status, body) = d.get(path);
    let lines = body
        .lines()
        .map(|l| match l.strip_prefix(LEASE_OK) {
            Some(rest) => {
                let left: f64 = rest
                    .trim_start()
                    .strip_suffix(" s more without a renewal")
                    .and_then(|s| s.parse().ok())
                    .unwrap_or_else(|| panic!("{l}"));
                assert!(left > 0.0 && left <= 5.0, "{l}");
                LEASE_OK.to_string()
            }
            None => l.to_string(),
        })
        .collect();
    (status, lines)
}

/// /healthz and /readyz answer 200 with their checks; a rejected reload is named in
/// /readyz, which stays 200 (the previous policy governs); with the lease run out
/// both answer 503 naming it, until the next renewal.
#[test]
fn the_probes_answer_with_their_checks() {
    let cg = Cgroup::new("probes");
    let policy = Policy::new().scope(Scope::new("h", &cg.rel));
    let d = Daemon::builder(&policy).metrics().start();
    let lease_ok = LEASE_OK;
    let jobs_ok = "[+]jobs ok: no run going for longer than 10 s";
    let healthy = (
        200,
        vec![
            lease_ok.to_string(),
            jobs_ok.to_string(),
            "healthz check passed".to_string(),
        ],
    );
    assert_eq!(probe(&d, "/healthz"), healthy);
    let policy_ok = format!(
        "[+]policy ok: generation 1 of {} in force",
        d.policy.display()
    );
    assert_eq!(
        probe(&d, "/readyz"),
        (
            200,
            vec![
                policy_ok,
                lease_ok.to_string(),
                "readyz check passed".to_string()
            ]
        )
    );

    std::fs::write(&d.policy, bad(&policy)).unwrap();
    assert_eq!(d.reload().status.code(), Some(1));
    let (status, body) = d.get("/readyz");
    assert_eq!(status, 200, "{body}");
    let line = body.lines().next().unwrap_or_default();
    assert!(
        line.starts_with(&format!(
            "[+]policy ok: generation 1 of {} in force; the last reload was rejected: {}:",
            d.policy.display(),
            d.policy.display()
        )) && line.contains(":19: max_connections must be at least 1"),
        "{body}"
    );

    // The lease run out: LEASE[0], until when the programs shed, set to 0. The lease
    // job renews it within a second, so a probe may come after the renewal: tried again.
    let lease = format!(
        "/sys/fs/bpf/connguard/v{}/maps/LEASE",
        guard_common::STATE_LAYOUT
    );
    let mut map: Array<MapData, u64> =
        Array::try_from(Map::from_map_data(MapData::from_pin(&lease).unwrap()).unwrap()).unwrap();
    let lease_failed =
        "[-]lease failed: the lease has run out: the programs count and shed nothing";
    let mut seen = None;
    for _ in 0..20 {
        map.set(0, 0, 0).unwrap();
        let (live, ready) = (probe(&d, "/healthz"), probe(&d, "/readyz"));
        if live.0 == 503 && ready.0 == 503 {
            seen = Some((live, ready));
            break;
        }
    }
    let (live, ready) = seen.expect("no probe saw the lease run out in 20 tries");
    assert_eq!(
        live.1,
        [lease_failed, jobs_ok, "healthz check failed"],
        "{live:?}"
    );
    assert_eq!(
        (ready.1.len(), ready.1[1].as_str(), ready.1[2].as_str()),
        (3, lease_failed, "readyz check failed"),
        "{ready:?}"
    );
    // Renewed by the lease job.
    let until = Instant::now() + Duration::from_secs(3);
    while probe(&d, "/healthz") != healthy {
        assert!(Instant::now() < until, "{:?}", probe(&d, "/healthz"));
        std::thread::sleep(Duration::from_millis(50));
    }

    assert_eq!(d.get("/nothing").0, 404);
}
