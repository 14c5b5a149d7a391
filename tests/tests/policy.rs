//! Policy files on the command line and on reload: a reload is atomic and keeps the
//! counts; a bad policy changes nothing.
use std::{process::Command, time::Duration};

use connguard_api::{
    policy::{Limited, Mode, Policy, Scope},
    stats::{ScopeStats, Snapshot},
};
use connguard_tests::{
    Cgroup, Daemon, Probe, Server, budget_policy, budget_scope, connguard_bin, destination,
};

fn check(text: &str) -> (i32, String) {
    let file = std::env::temp_dir().join(format!("connguard-check-{}.toml", std::process::id()));
    std::fs::write(&file, text).unwrap();
    let out = Command::new(connguard_bin())
        .arg("check")
        .arg(&file)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&file);
    let msg = String::from_utf8_lossy(&out.stderr).replace(&file.display().to_string(), "FILE");
    (out.status.code().unwrap(), msg.trim().to_string())
}

/// (h) `check` exits 1 naming line and column for each kind of bad file.
#[test]
fn check_rejects_bad_files_with_line_and_column() {
    let head = "[[scope]]\nname = \"a\"\ncgroup = \"x\"\n";
    let cases = [
        ("[[scope]\n", "FILE:1:8: invalid table header"),
        (
            &format!("{head}budget = 3\n") as &str,
            "FILE:4:1: unknown field `budget`",
        ),
        (
            &format!("{head}[[scope.rule]]\ndst = [\"10.0.0.0/33\"]\n"),
            "FILE:5:8: \"10.0.0.0/33\" is not an IP address or CIDR",
        ),
        (
            &format!("{head}[[scope.rule]]\nports = [\"0\"]\n"),
            "FILE:5:10: port 0 is out of range 1-65535",
        ),
        (
            &format!("{head}[[scope]]\nname = \"a\"\ncgroup = \"y\"\n"),
            "FILE:5:8: duplicate scope name \"a\"",
        ),
        (
            &format!("{head}[[scope.rule]]\nmax_connections = 0\n"),
            "FILE:5:19: max_connections must be at least 1",
        ),
    ];
    for (text, want) in cases {
        let (code, msg) = check(text);
        assert_eq!(code, 1, "{text}");
        assert!(
            msg.starts_with(want),
            "for {text:?}\nwant {want:?}\n got {msg:?}"
        );
    }
    let (code, msg) = check(head);
    assert_eq!((code, msg.as_str()), (0, ""));
}

/// Reloads keep the counts; a bad reload changes nothing.
#[test]
fn reload_keeps_counts_and_a_bad_file_changes_nothing() {
    let server = Server::start("127.0.0.1:0");
    let cg = Cgroup::new("h");
    let policy = budget_policy("h", &cg.rel, Mode::Enforce, &server.addr, 5);
    let d = Daemon::builder(&policy).metrics().start();
    let held = cg.hold(Probe::hold(server.addr, 5, 5));
    assert_eq!(held.outcome.ok, 5);

    // A good reload that changes an unrelated scope (SIGHUP and `connguard reload`).
    std::fs::write(
        &d.policy,
        policy
            .clone()
            .scope(Scope::new("other", "nowhere"))
            .to_toml(),
    )
    .unwrap();
    unsafe { libc::kill(d.pid(), libc::SIGHUP) };
    let stats = wait_generation(&d, 2);
    assert_eq!(stats.policy.last_error, None);
    assert_eq!(d.scope("h").counts.active, 5, "counts survive a reload");
    let more = cg.probe(Probe::connect(server.addr, 5, 1));
    assert_eq!(
        more.errors("ECONNREFUSED"),
        5,
        "still at budget after reload: {more:?}"
    );
    let out = d.reload();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "reloaded: policy generation 3"
    );

    // A bad file: rejected with file:line:column, the old policy and counts stay.
    let bad =
        format!("{policy}\n[[scope]]\nname = \"bad\"\ncgroup = \"x\"\nmax_connections = -1\n");
    std::fs::write(&d.policy, &bad).unwrap();
    let out = d.reload();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    let line = bad.lines().count();
    let want = format!(
        "{}:{line}:19: max_connections must be at least 1",
        d.policy.display()
    );
    assert!(err.contains(&want), "{err}");
    let stats = d.stats();
    assert_eq!(stats.policy.generation, 3);
    assert!(
        stats
            .policy
            .last_error
            .as_deref()
            .is_some_and(|e| e.starts_with(&want)),
        "{stats:?}"
    );
    assert!(
        d.log.lock().unwrap().contains(&want),
        "the rejection is logged"
    );
    let s = d.scope("h");
    assert_eq!((s.counts.active, s.counts.shed), (5, 5), "{s:?}");
    let more = cg.probe(Probe::connect(server.addr, 5, 1));
    assert_eq!(
        more.errors("ECONNREFUSED"),
        5,
        "old policy still enforced: {more:?}"
    );
    drop(held);
    let s = d.wait_scope("h", Duration::from_secs(5), |s| s.counts.active == 0);
    assert_eq!(s.counts.active, 0);
}

/// Scope and rule counts follow names: a scope removed by a reload and added again by a
/// later one finds its counts (and its spent budget) again, and rules of the same name in
/// two scopes count apart.
#[test]
fn a_scope_removed_and_added_again_keeps_its_counts() {
    let server = Server::start("127.0.0.1:0");
    let (a, b) = (Cgroup::new("ra"), Cgroup::new("rb"));
    let policy = Policy::new()
        .scope(budget_scope("a", &a.rel, Mode::Enforce, &server.addr, 3))
        .scope(budget_scope("b", &b.rel, Mode::Enforce, &server.addr, 3));
    let d = Daemon::builder(&policy).start();
    let held_a = a.hold(Probe::hold(server.addr, 3, 3));
    let held_b = b.hold(Probe::hold(server.addr, 1, 1));
    assert_eq!((held_a.outcome.ok, held_b.outcome.ok), (3, 1));
    let rule = |s: &ScopeStats| s.rules[0].clone();

    std::fs::write(
        &d.policy,
        budget_policy("b", &b.rel, Mode::Enforce, &server.addr, 3).to_toml(),
    )
    .unwrap();
    assert!(d.reload().status.success());
    let scopes = d.stats().scopes;
    assert_eq!(scopes.len(), 1, "{scopes:?}");
    std::fs::write(&d.policy, policy.to_toml()).unwrap();
    assert!(d.reload().status.success());
    let (sa, sb) = (d.scope("a"), d.scope("b"));
    assert_eq!(
        (sa.counts.active, rule(&sa).counts.active),
        (3, 3),
        "{sa:?}"
    );
    assert_eq!(
        (sb.counts.active, rule(&sb).counts.active),
        (1, 1),
        "{sb:?}"
    );
    let more = a.probe(Probe::connect(server.addr, 2, 1));
    assert_eq!(
        more.errors("ECONNREFUSED"),
        2,
        "budget still spent: {more:?}"
    );
    let more = b.probe(Probe::connect(server.addr, 1, 1));
    assert_eq!(more.ok, 1, "the other scope's rule has room: {more:?}");
    let sa = d.scope("a");
    assert_eq!((sa.counts.shed, rule(&sa).counts.shed), (2, 2), "{sa:?}");
    drop(held_a);
    drop(held_b);
    for name in ["a", "b"] {
        let s = d.wait_scope(name, Duration::from_secs(5), |s| {
            s.counts.active == 0 && rule(s).counts.active == 0
        });
        assert_eq!((s.counts.active, rule(&s).counts.active), (0, 0), "{s:?}");
    }
}

fn wait_generation(d: &Daemon, generation: u64) -> Snapshot {
    for _ in 0..100 {
        let stats = d.stats();
        if stats.policy.generation == generation {
            return stats;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!(
        "policy generation never reached {generation}: {:?}",
        d.stats()
    );
}

/// `connguard run` without root says so plainly and exits 1.
#[test]
fn run_without_root_says_so() {
    connguard_tests::require_prerequisites();
    let out = Command::new("runuser")
        .args(["-u", "nobody", "--"])
        .arg(connguard_bin())
        .args([
            "run",
            "--metrics",
            "off",
            "--socket",
            "/tmp/connguard-nobody.sock",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("connguard must run as root"), "{err}");
}

/// A policy selecting `/` on a host with 50,000 more cgroups applies and reloads: the
/// kernel holds the one selected cgroup, not one entry per cgroup (two generations of
/// 65,536 entries would not hold 50,000 each), and a connection from the last of them
/// is counted. The guests make fewer (CONNGUARD_WHOLE_HOST_CGROUPS): the scale is the
/// daemon's walk, the paths of a scope on the root cgroup are the kernel's.
#[test]
fn the_whole_host_with_50000_cgroups_applies_and_reloads() {
    let parent = Cgroup::new("many");
    let children: Vec<Cgroup> = (0..connguard_tests::whole_host_cgroups())
        .map(|i| parent.child(&format!("c{i}")))
        .collect();
    let server = Server::start("127.0.0.1:0");
    let host = Scope::new("host", "/").mode(Mode::Observe);
    let d = Daemon::builder(Policy::new().scope(host.clone())).start();
    std::fs::write(
        &d.policy,
        Policy::new().scope(host.max_connections(100_000)).to_toml(),
    )
    .unwrap();
    let out = d.reload();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(d.stats().policy.generation, 2);
    let last = children.last().unwrap();
    let probe = last.probe(Probe::connect(server.addr, 1, 1));
    assert_eq!(probe.ok, 1, "{probe:?}");
    // The scope holds the whole host's connections; this destination only ours.
    let s = d.scope("host");
    let dst = destination(&s, &server.addr.to_string());
    assert_eq!((dst.counts.admitted, dst.counts.shed), (1, 0), "{dst:?}");
    drop(d);
    drop(children);
}
