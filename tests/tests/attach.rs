//! Where connguard's programs run: attached to the top-most selected cgroups only, so
//! traffic of no scope runs none of the connection programs, and a selected cgroup
//! created again (a service restart) is attached on its creation event.
use connguard_api::{
    policy::{Mode, Policy},
    stats::Snapshot,
};
use connguard_tests::{
    BPF_CGROUP_INET4_CONNECT, Cgroup, Daemon, Probe, Server, attached_programs, budget_policy,
    budget_scope,
};

/// run_count per program from `stats --json` (bpf_stats on).
fn run_counts(stats: &Snapshot) -> Vec<(String, u64)> {
    stats
        .programs
        .iter()
        .map(|p| (p.name.clone(), p.run_count))
        .collect()
}

/// 1,000 connections between two cgroups that no scope selects, while a policy governs
/// another: none of connguard's programs runs, but for a host-wide one that `stats`
/// says is attached and why. With no listener guard, `caller_destroy` never is; the
/// state tracepoint is only where the kernel refuses the state callback option or
/// another sock_ops program is loaded, and then runs for every socket.
#[test]
fn ungoverned_connections_run_no_connection_program() {
    let server = Server::start("127.0.0.1:0");
    let governed = Cgroup::new("u-governed");
    let other = Cgroup::new("u-other");
    let d = Daemon::builder(budget_policy(
        "u",
        &governed.rel,
        Mode::Enforce,
        &server.addr,
        5,
    ))
    .args(&["--bpf-stats"])
    .start();
    // A governed connection first: the counts can move.
    let out = governed.probe(Probe::connect(server.addr, 1, 1));
    assert_eq!(out.ok, 1, "{out:?}");
    let stats = d.stats();
    let hw = &stats.host_wide;
    assert!(
        !hw.attached.iter().any(|p| p == "caller_destroy"),
        "no listener guard, no caller_destroy: {hw:?}"
    );
    assert_eq!(
        hw.attached.is_empty(),
        hw.because.is_empty(),
        "attached with a reason, or not at all: {hw:?}"
    );
    let before = run_counts(&stats);
    assert!(
        before.iter().any(|(p, c)| p == "connect4" && *c == 1),
        "one governed connect ran connect4 once: {before:?}"
    );
    let out = other.probe(Probe::churn("/proc/self/ns/net".into(), server.addr, 1000));
    assert_eq!(out.ok, 1000, "{out:?}");
    let after = run_counts(&d.stats());
    for ((name, b), (_, a)) in before.iter().zip(&after) {
        if hw.attached.contains(name) {
            assert!(
                a > b,
                "{name} is attached and runs for every socket: {before:?} {after:?}"
            );
        } else {
            assert_eq!(
                a, b,
                "{name} ran for ungoverned traffic ({hw:?}): {before:?} {after:?}"
            );
        }
    }
}

/// Programs are attached to a selected cgroup with no selected ancestor, never to a
/// selected cgroup below one, nor to a cgroup no scope selects; a reload moves them, and
/// when it returns they are gone from where they were (the links are detached, not only
/// unpinned: the kernel releases an unpinned link after an RCU grace period and a
/// workqueue run). Moved down and up five times, each asserted at once.
#[test]
fn programs_are_attached_to_the_top_most_selected_cgroups_only() {
    let server = Server::start("127.0.0.1:0");
    let parent = Cgroup::new("t-parent");
    let child = parent.child("child");
    let other = Cgroup::new("t-other");
    let both = Policy::new()
        .scope(budget_scope(
            "outer",
            &parent.rel,
            Mode::Enforce,
            &server.addr,
            5,
        ))
        .scope(budget_scope(
            "inner",
            &child.rel,
            Mode::Enforce,
            &server.addr,
            5,
        ));
    let inner = budget_policy("inner", &child.rel, Mode::Enforce, &server.addr, 5);
    let d = Daemon::builder(&both).start();
    // (parent, child, other): how many connect4 programs each has.
    let attached = || {
        let on = |cg: &Cgroup| attached_programs(&cg.path, BPF_CGROUP_INET4_CONNECT);
        (on(&parent), on(&child), on(&other))
    };
    let reload = |policy: &Policy| {
        std::fs::write(&d.policy, policy.to_toml()).unwrap();
        let r = d.reload();
        assert!(r.status.success(), "{r:?}");
        attached()
    };
    assert_eq!(attached(), (Some(1), Some(0), Some(0)));
    for round in 0..5 {
        // The inner scope alone: the programs move down to the child.
        let moved = reload(&inner);
        assert_eq!(moved, (Some(0), Some(1), Some(0)), "round {round}, down");
        let out = child.probe(Probe::connect(server.addr, 1, 1));
        assert_eq!(out.ok, 1, "{out:?}");
        assert_eq!(d.scope("inner").counts.admitted, round + 1);
        // Both again: up to the parent.
        let moved = reload(&both);
        assert_eq!(moved, (Some(1), Some(0), Some(0)), "round {round}, up");
    }
}
