//! What the daemon does with the kernel it finds: the features it probes, the start it
//! refuses below its minimum, the paths it takes without optional features (forced with
//! CONNGUARD_WITHOUT, so that they run on every kernel), and what a clean stop leaves.
use std::{collections::BTreeSet, process::Command, time::Duration};

use connguard_api::{kernel::Features, policy::Mode};
use connguard_tests::{
    Cgroup, Daemon, Netns, Probe, Server, budget_policy, connguard_bin, destination,
    listener_guard, require_prerequisites,
};
use serde::{Deserialize, de::DeserializeOwned};

/// Every feature `connguard kernel` probes, by the name it reports.
const FEATURES: [&str; 12] = [
    "ancestor_cgroup_id",
    "atomic_fetch",
    "batch_lookup",
    "bound_inactive_diag",
    "cgroup_links",
    "cgroup_storage",
    "kernel_btf",
    "listener_per_syn",
    "ring_buffer",
    "set_retval",
    "so_netns_cookie",
    "tcx",
];

/// The programs the daemon loads.
const PROGRAMS: [&str; 7] = [
    "connect4",
    "connect6",
    "sock_create",
    "sock_release",
    "sock_state",
    "sock_set_state",
    "listener_shed",
];

fn uname_r() -> String {
    let out = Command::new("uname").arg("-r").output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// `connguard kernel --json`, with `without` treated as absent.
fn kernel_json(without: &str) -> (bool, Features) {
    let out = Command::new(connguard_bin())
        .args(["kernel", "--json"])
        .env("CONNGUARD_WITHOUT", without)
        .output()
        .unwrap();
    let v = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&out.stderr)));
    (out.status.success(), v)
}

/// `connguard kernel --json` names every feature with a yes or no, for this kernel's
/// release; a feature named in CONNGUARD_WITHOUT reads false and the rest stay as probed.
#[test]
fn kernel_reports_every_feature_and_honours_without() {
    require_prerequisites();
    let (_, probed) = kernel_json("");
    assert_eq!(probed.release, uname_r(), "{probed:?}");
    let expected: BTreeSet<&str> = FEATURES.into_iter().collect();
    let names: BTreeSet<&str> = probed.features.keys().map(String::as_str).collect();
    assert_eq!(names, expected, "{probed:?}");
    assert_eq!(
        probed.required,
        [
            "atomic_fetch",
            "cgroup_links",
            "kernel_btf",
            "ring_buffer",
            "ancestor_cgroup_id"
        ],
        "{probed:?}"
    );
    let (_, without) = kernel_json("set_retval,tcx");
    for f in FEATURES {
        let want = if f == "set_retval" || f == "tcx" {
            Some(&false)
        } else {
            probed.features.get(f)
        };
        assert_eq!(without.features.get(f), want, "{f}: {without:?}");
    }
    let out = Command::new(connguard_bin())
        .args(["kernel", "--json"])
        .env("CONNGUARD_WITHOUT", "no_such_feature")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("CONNGUARD_WITHOUT: no feature \"no_such_feature\"; known: atomic_fetch"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `bpftool -j ARGS`, which must succeed, read as `T`.
fn bpftool<T: DeserializeOwned>(args: &[&str]) -> T {
    let out = Command::new("bpftool")
        .arg("-j")
        .args(args)
        .output()
        .expect("run bpftool");
    assert!(
        out.status.success(),
        "bpftool {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("bpftool {args:?} printed no list it names: {e}"))
}

/// What `bpftool -j prog show` tells of a program.
#[derive(Deserialize)]
struct BpfProgram {
    id: u64,
    name: Option<String>,
}

/// What `bpftool -j link show` tells of a link.
#[derive(Deserialize)]
struct BpfLink {
    id: u64,
    prog_id: Option<u64>,
}

/// Held by every test here that loads connguard's programs: those that compare the set
/// of loaded programs before and after would otherwise see each other's (when the
/// tests of this file run in parallel, as a plain `cargo test` runs them).
static LOADS: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn loads() -> std::sync::MutexGuard<'static, ()> {
    LOADS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The IDs of the loaded programs named in PROGRAMS (`bpftool prog show name X` fails
/// when there is none, so all are listed and picked here).
fn our_programs() -> BTreeSet<u64> {
    bpftool::<Vec<BpfProgram>>(&["prog", "show"])
        .into_iter()
        .filter(|p| PROGRAMS.iter().any(|n| p.name.as_deref() == Some(n)))
        .map(|p| p.id)
        .collect()
}

/// (link id, program id) of every BPF link.
fn links() -> BTreeSet<(u64, u64)> {
    bpftool::<Vec<BpfLink>>(&["link", "show"])
        .into_iter()
        .filter_map(|l| Some((l.id, l.prog_id?)))
        .collect()
}

/// Everything under /sys/fs/bpf.
fn pins() -> BTreeSet<String> {
    fn walk(dir: &std::path::Path, out: &mut BTreeSet<String>) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            out.insert(e.path().display().to_string());
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                walk(&e.path(), out);
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(std::path::Path::new("/sys/fs/bpf"), &mut out);
    out
}

/// `tc filter show dev lo ingress` in `ns`.
fn tc_filters(ns: &Netns) -> String {
    let out = Command::new("tc")
        .args(["-n", &ns.name, "filter", "show", "dev", "lo", "ingress"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "tc: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A daemon with a listener guard, stopped with `connguard stop`, leaves none of the
/// programs it loaded, no link, no pin, and no tc filter on the guarded interface (the
/// clsact qdisc it added stays, empty, as `tc` leaves one). The guard is a tcx link when
/// `tcx`, else a clsact filter (which outlives a process that does not remove it).
fn clean_stop_leaves_nothing(tcx: bool) {
    let _turn = loads();
    let ns = Netns::new("cgstop");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    let cg = Cgroup::new("stop");
    let (programs_before, links_before, pins_before) = (our_programs(), links(), pins());
    let addr = "127.0.0.1:9".parse().unwrap();
    let mut daemon = Daemon::builder(
        budget_policy("stop", &cg.rel, Mode::Enforce, &addr, 1)
            .listener(listener_guard(&ns, Mode::Enforce)),
    );
    if !tcx {
        daemon = daemon.without("tcx");
    }
    let d = daemon.start();
    assert_eq!(
        d.stats()
            .kernel
            .and_then(|k| k.features.get("tcx").copied()),
        Some(tcx)
    );
    let ours: BTreeSet<u64> = our_programs()
        .difference(&programs_before)
        .copied()
        .collect();
    assert_eq!(
        ours.len(),
        PROGRAMS.len(),
        "one program of each name loaded"
    );
    // Links of our programs: 5 on the scope's cgroup, one per host-wide program `stats`
    // says is attached, and the guard's on lo when it is a tcx link.
    let host_wide = d.stats().host_wide;
    let our_links: BTreeSet<(u64, u64)> = links()
        .difference(&links_before)
        .filter(|(_, prog)| ours.contains(prog))
        .copied()
        .collect();
    assert_eq!(
        our_links.len(),
        5 + host_wide.attached.len() + usize::from(tcx),
        "links: {our_links:?}, {host_wide:?}"
    );
    let filters = tc_filters(&ns);
    assert_eq!(
        filters.contains("listener_shed"),
        !tcx,
        "tc filters while running: {filters}"
    );
    let out = d.cli(&["stop"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    drop(d);
    // The kernel frees a program after its last reference goes, from deferred work (a
    // cgroup's programs once the cgroup's bpf state is released): wait for it.
    let left = || -> Vec<u64> {
        our_programs()
            .into_iter()
            .filter(|id| ours.contains(id))
            .collect()
    };
    let until = std::time::Instant::now() + Duration::from_secs(5);
    while !left().is_empty() && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(left(), Vec::<u64>::new(), "programs left loaded after 5 s");
    let links_left: Vec<(u64, u64)> = links()
        .into_iter()
        .filter(|l| our_links.contains(l))
        .collect();
    assert_eq!(links_left, Vec::new(), "links left");
    assert_eq!(pins(), pins_before, "pins under /sys/fs/bpf");
    assert_eq!(tc_filters(&ns), "", "tc filters left on lo");
}

/// As the kernel offers: a tcx link where the kernel has tcx, a clsact filter elsewhere.
#[test]
fn a_clean_stop_leaves_no_program_link_pin_or_filter_behind() {
    require_prerequisites();
    let (_, probed) = kernel_json("");
    clean_stop_leaves_nothing(probed.features.get("tcx") == Some(&true));
}

/// Without tcx, on any kernel: the clsact path, and its filter removed at stop.
#[test]
fn without_tcx_a_clean_stop_removes_the_clsact_filter() {
    clean_stop_leaves_nothing(false);
}

/// Without a required feature the daemon does not start: it names what is missing,
/// exits non-zero, and has loaded and attached nothing.
#[test]
fn without_atomic_fetch_the_daemon_refuses_to_start_and_attaches_nothing() {
    require_prerequisites();
    let _turn = loads();
    let before = our_programs();
    let dir = std::env::temp_dir().join(connguard_tests::unique("connguard-refuse"));
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("connguard.sock");
    let mut child = Command::new(connguard_bin())
        .args(["run", "--metrics", "off", "--socket"])
        .arg(&socket)
        .env("CONNGUARD_WITHOUT", "atomic_fetch")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // A daemon that starts after all is stopped after 10 s, and the test fails.
    let until = std::time::Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if std::time::Instant::now() > until {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    let socket_left = socket.exists();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(status.is_some_and(|s| !s.success()), "{status:?}: {stderr}");
    let release = uname_r();
    assert!(
        stderr.contains(&format!(
            "kernel {release} lacks what connguard needs: BPF atomic fetch instructions (fetch-add, cmpxchg; Linux 5.12)"
        )) && stderr.contains("nothing was attached"),
        "{stderr}"
    );
    assert!(!socket_left, "control socket left behind");
    assert_eq!(our_programs(), before, "programs loaded by a refused start");
}

/// Without bpf_set_retval, batch lookups and SO_NETNS_COOKIE, the daemon still counts
/// exactly: a shed connect() fails with EPERM (the cgroup hook's refusal) instead of the
/// policy's ECONNREFUSED, maps are read entry by entry, and no port watch runs (the
/// programs' namespace key cannot be named), which the start line and `stats` say.
#[test]
fn without_optional_features_counts_stay_exact_and_sheds_fail_with_eperm() {
    let _turn = loads();
    let server = Server::start("127.0.0.1:0");
    let cg = Cgroup::new("degraded");
    let d = Daemon::builder(budget_policy(
        "degraded",
        &cg.rel,
        Mode::Enforce,
        &server.addr,
        3,
    ))
    .without("set_retval")
    .without("batch_lookup")
    .without("so_netns_cookie")
    .start();
    let held = cg.hold(Probe::hold(server.addr, 10, 10));
    let out = &held.outcome;
    assert_eq!(
        (out.attempts, out.ok, out.errors("EPERM")),
        (10, 3, 7),
        "{out:?}"
    );
    let stats = d.stats();
    let s = d.scope("degraded");
    let dst = destination(&s, &server.addr.to_string());
    assert_eq!(
        (dst.counts.active, dst.counts.shed, dst.counts.admitted),
        (3, 7, 3),
        "{s:?}"
    );
    let kernel = stats.kernel.as_ref().expect("stats carry the kernel");
    assert_eq!(kernel.release, uname_r());
    for f in ["set_retval", "batch_lookup", "so_netns_cookie"] {
        assert_eq!(kernel.features.get(f), Some(&false), "{f}: {kernel:?}");
    }
    let jobs: Vec<&str> = stats.jobs.iter().map(|j| j.name.as_str()).collect();
    assert_eq!(
        jobs,
        [
            "audit",
            "lease",
            "cgroup_rescan",
            "drills",
            "time_wait_rates",
            "listener_watch",
            "listener_heartbeat",
            "listener_attach",
            "foreign_sock_ops",
            "forget_idle"
        ],
        "{stats:?}"
    );
    let log = d.log.lock().unwrap().clone();
    assert!(
        log.contains(
            "degraded: no set_retval: a shed connect() fails with EPERM, not the policy's errno; \
             no so_netns_cookie: port watermarks are not enforced"
        ) && log.contains("no batch_lookup: maps are read entry by entry"),
        "{log}"
    );
    drop(held);
    let s = d.wait_scope("degraded", Duration::from_secs(5), |s| s.counts.active == 0);
    assert_eq!(s.counts.active, 0, "{s:?}");
}
