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

/// The sockets that the rest of the machine may destroy while a test runs.
const HOST_SLACK: u64 = 100;

/// 1,000 connections between two cgroups that no scope selects, while a policy governs
/// another: none of the cgroup programs runs; only the two tracepoints, host-wide by
/// nature, do: the state tracepoint and the socket's destruction (`caller_destroy`, once
/// per socket: 2 per loopback connection, and once per socket the rest of the host
/// destroys meanwhile).
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
    let before = run_counts(&d.stats());
    assert!(
        before.iter().any(|(p, c)| p == "connect4" && *c == 1),
        "one governed connect ran connect4 once: {before:?}"
    );
    let out = other.probe(Probe::churn("/proc/self/ns/net".into(), server.addr, 1000));
    assert_eq!(out.ok, 1000, "{out:?}");
    let after = run_counts(&d.stats());
    for ((name, b), (_, a)) in before.iter().zip(&after) {
        if name == "sock_set_state" {
            assert!(
                a > b,
                "the tracepoint runs for every socket: {before:?} {after:?}"
            );
        } else if name == "caller_destroy" {
            assert!(
                (2 * 1000..2 * 1000 + HOST_SLACK).contains(&(a - b)),
                "the destruction tracepoint runs once per socket: {before:?} {after:?}"
            );
        } else {
            assert_eq!(
                a, b,
                "{name} ran for ungoverned traffic: {before:?} {after:?}"
            );
        }
    }
}

/// Programs are attached to a selected cgroup with no selected ancestor, never to a
/// selected cgroup below one, nor to a cgroup no scope selects; a reload moves them.
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
    let d = Daemon::builder(both).start();
    let attached = |cg: &Cgroup| attached_programs(&cg.path, BPF_CGROUP_INET4_CONNECT);
    assert_eq!(
        (attached(&parent), attached(&child), attached(&other)),
        (Some(1), Some(0), Some(0))
    );
    // The inner scope alone: the programs move down to the child.
    std::fs::write(
        &d.policy,
        budget_policy("inner", &child.rel, Mode::Enforce, &server.addr, 5).to_toml(),
    )
    .unwrap();
    let r = d.reload();
    assert!(r.status.success(), "{r:?}");
    assert_eq!(
        (attached(&parent), attached(&child), attached(&other)),
        (Some(0), Some(1), Some(0))
    );
    let out = child.probe(Probe::connect(server.addr, 1, 1));
    assert_eq!(out.ok, 1, "{out:?}");
    assert_eq!(d.scope("inner").counts.admitted, 1);
}
