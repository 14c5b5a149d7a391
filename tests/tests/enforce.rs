//! Budgets enforced on real sockets: a budget of N is never exceeded, an attempt is
//! admitted once however it is made, non-TCP sockets pass uncounted, and internal
//! problems fail open.
use std::{net::SocketAddr, time::Duration};

use connguard_api::policy::{Limited, Mode, Per, Policy, Rule, Scope};
use connguard_tests::{Cgroup, Daemon, Probe, Server, budget_policy, destination};

/// (a) Budget 5, 20 concurrent clients: exactly 5 connect, 15 get ECONNREFUSED at once.
#[test]
fn budget_of_five_sheds_fifteen_of_twenty_at_once() {
    let server = Server::start("127.0.0.1:0");
    let cg = Cgroup::new("a");
    let d = Daemon::builder(budget_policy("a", &cg.rel, Mode::Enforce, &server.addr, 5))
        .metrics()
        .start();
    let mut held = cg.hold(Probe::hold(server.addr, 20, 20));
    let out = &held.outcome;
    assert_eq!(
        (out.attempts, out.ok, out.errors("ECONNREFUSED")),
        (20, 5, 15),
        "{out:?}"
    );
    // Each refusal is the connect hook's answer, no SYN sent (the kernel counts the 15
    // shed below): none waits as long as a SYN retransmit (1 s, TCP_TIMEOUT_INIT).
    assert!(
        out.max_error_us < 1_000_000,
        "slowest refusal took {} µs",
        out.max_error_us
    );
    let s = d.scope("a");
    let dst = destination(&s, &server.addr.to_string());
    assert_eq!(
        (
            dst.counts.active,
            dst.counts.shed,
            dst.counts.admitted,
            dst.counts.peak
        ),
        (5, 15, 5, 5),
        "{s:?}"
    );
    assert_eq!((s.counts.active, s.counts.shed), (5, 15));
    assert_eq!(server.peak(), 5);
    // The same counts in Prometheus text.
    let metrics = d.metrics();
    let dst = format!("scope=\"a\",rule=\"server\",dst=\"{}\"", server.addr);
    for line in [
        "connguard_scope_active_connections{scope=\"a\"} 5".to_string(),
        "connguard_scope_shed_connections_total{scope=\"a\"} 15".to_string(),
        format!("connguard_destination_admitted_connections_total{{{dst}}} 5"),
        "connguard_internal_errors_total 0".to_string(),
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "no line {line:?} in\n{metrics}"
        );
    }
    // Ending the client returns every count to 0.
    held.kill();
    let s = d.wait_scope("a", Duration::from_secs(5), |s| s.counts.active == 0);
    assert_eq!(s.counts.active, 0, "{s:?}");
}

/// (c) 64 threads storm a budget of 10: the server never sees more than 10 at once.
#[test]
fn storm_of_64_threads_never_exceeds_budget_of_10() {
    let server = Server::start("127.0.0.1:0");
    let cg = Cgroup::new("c");
    let d = Daemon::builder(budget_policy("c", &cg.rel, Mode::Enforce, &server.addr, 10)).start();
    let out = cg.probe(Probe::Storm {
        addr: server.addr,
        threads: 64,
        seconds: 4,
    });
    assert!(
        out.ok > 100,
        "too few connections to mean anything: {out:?}"
    );
    assert_eq!(
        out.attempts,
        out.ok + out.errors("ECONNREFUSED"),
        "only sheds may fail: {out:?}"
    );
    assert!(
        server.peak() <= 10,
        "server saw {} concurrent connections",
        server.peak()
    );
    let s = d.wait_scope("c", Duration::from_secs(5), |s| s.counts.active == 0);
    let dst = destination(&s, &server.addr.to_string());
    assert_eq!(
        dst.counts.peak, 10,
        "the storm should reach the budget, never pass it: {s:?}"
    );
    assert_eq!(
        (dst.counts.admitted, dst.counts.shed, s.counts.active),
        (out.ok, out.errors("ECONNREFUSED"), 0),
        "{s:?}"
    );
}

/// (d) Observe mode sheds nothing and counts as would_shed what enforce sheds.
#[test]
fn observe_mode_counts_would_shed_equal_to_enforce_shed() {
    let server = Server::start("127.0.0.1:0");
    let mut seen = Vec::new();
    for (mode, name) in [(Mode::Enforce, "enforce"), (Mode::Observe, "observe")] {
        let cg = Cgroup::new("d");
        let d = Daemon::builder(budget_policy("d", &cg.rel, mode, &server.addr, 5)).start();
        let held = cg.hold(Probe::hold(server.addr, 20, 20));
        let s = d.scope("d");
        seen.push((
            name,
            held.outcome.ok,
            s.counts.active,
            s.counts.shed,
            s.counts.would_shed,
            s.counts.admitted,
        ));
    }
    assert_eq!(
        seen,
        [("enforce", 5, 5, 15, 0, 5), ("observe", 20, 20, 0, 15, 20)]
    );
}

/// UDP connect/send toward a budgeted destination is untouched.
#[test]
fn udp_is_untouched_and_uncounted() {
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = udp.local_addr().unwrap();
    let cg = Cgroup::new("e");
    let d = Daemon::builder(budget_policy("e", &cg.rel, Mode::Enforce, &addr, 1)).start();
    let out = cg.probe(Probe::Udp {
        addr,
        cycles: 10000,
    });
    assert_eq!((out.attempts, out.ok), (10000, 10000), "{out:?}");
    let s = d.scope("e");
    assert_eq!(
        (s.counts.admitted, s.counts.shed, s.counts.active),
        (0, 0, 0),
        "{s:?}"
    );
    assert_eq!(s.destinations.len(), 0, "{s:?}");
}

/// (f) IPv6 destinations have their own keys, written [addr]:port.
#[test]
fn ipv6_destination_budget() {
    let server = Server::start("[::1]:0");
    let cg = Cgroup::new("f6");
    let d = Daemon::builder(budget_policy("f6", &cg.rel, Mode::Enforce, &server.addr, 3)).start();
    let held = cg.hold(Probe::hold(server.addr, 5, 1));
    assert_eq!(
        (held.outcome.ok, held.outcome.errors("ECONNREFUSED")),
        (3, 2),
        "{:?}",
        held.outcome
    );
    let s = d.scope("f6");
    let dst = destination(&s, &format!("[::1]:{}", server.addr.port()));
    assert_eq!((dst.counts.active, dst.counts.shed), (3, 2), "{s:?}");
}

/// `::ffff:127.0.0.1` through an AF_INET6 socket shares the IPv4 key.
#[test]
fn ipv4_mapped_ipv6_shares_the_ipv4_budget() {
    let server = Server::start("127.0.0.1:0");
    let cg = Cgroup::new("f4");
    let d = Daemon::builder(budget_policy("f4", &cg.rel, Mode::Enforce, &server.addr, 3)).start();
    let v4 = cg.hold(Probe::hold(server.addr, 3, 1));
    assert_eq!(v4.outcome.ok, 3, "{:?}", v4.outcome);
    let mapped: SocketAddr = format!("[::ffff:127.0.0.1]:{}", server.addr.port())
        .parse()
        .unwrap();
    let out = cg.probe(Probe::connect(mapped, 3, 1));
    assert_eq!((out.ok, out.errors("ECONNREFUSED")), (0, 3), "{out:?}");
    let s = d.scope("f4");
    assert_eq!(s.destinations.len(), 1, "one key for both families: {s:?}");
    let dst = destination(&s, &server.addr.to_string());
    assert_eq!((dst.counts.active, dst.counts.shed), (3, 3), "{s:?}");
}

/// (g) A process in a cgroup outside every scope is unaffected and uncounted.
#[test]
fn cgroup_outside_every_scope_is_unaffected() {
    let server = Server::start("127.0.0.1:0");
    let guarded = Cgroup::new("g-guarded");
    let outside = Cgroup::new("g-outside");
    let d = Daemon::builder(budget_policy(
        "g",
        &guarded.rel,
        Mode::Enforce,
        &server.addr,
        1,
    ))
    .start();
    let out = outside.probe(Probe::connect(server.addr, 20, 20));
    assert_eq!((out.ok, out.attempts), (20, 20), "{out:?}");
    let s = d.scope("g");
    assert_eq!((s.counts.admitted, s.counts.shed), (0, 0), "{s:?}");
    // Control: the same connects from the guarded cgroup are shed past 1.
    let inside = guarded.probe(Probe::connect(server.addr, 20, 20));
    assert_eq!(
        (inside.ok, inside.errors("ECONNREFUSED")),
        (1, 19),
        "{inside:?}"
    );
}

/// (j) A cgroup created after the daemon started, that a glob selects, is governed from
/// its first connect: the daemon attaches on the creation event.
#[test]
fn cgroup_created_after_start_is_governed_from_its_first_connect() {
    let server = Server::start("127.0.0.1:0");
    let tag = format!("j{}", std::process::id());
    let policy = budget_policy(
        "j",
        &format!("connguard-test/{tag}-*"),
        Mode::Enforce,
        &server.addr,
        1,
    );
    let d = Daemon::builder(policy).start();
    let cg = Cgroup::new(&tag);
    let out = cg.probe(Probe::connect(server.addr, 3, 1));
    // Sequential connects, each closed only at the end: 1 admitted, 2 shed.
    assert_eq!((out.ok, out.errors("ECONNREFUSED")), (1, 2), "{out:?}");
    assert_eq!(d.scope("j").counts.shed, 2);
}

/// A cgroup created under a selected one while the daemon runs is governed from its
/// first connect, with no wait: the kernel finds the selected ancestor itself.
#[test]
fn a_cgroup_created_under_a_selected_one_is_governed_from_its_first_connect() {
    let server = Server::start("127.0.0.1:0");
    let parent = Cgroup::new("k-parent");
    let d = Daemon::builder(budget_policy(
        "k",
        &parent.rel,
        Mode::Enforce,
        &server.addr,
        1,
    ))
    .start();
    for i in 0..20 {
        let child = parent.child(&format!("new{i}"));
        let out = child.probe(Probe::connect(server.addr, 3, 1));
        assert_eq!(
            (out.ok, out.errors("ECONNREFUSED")),
            (1, 2),
            "child {i}: {out:?}"
        );
        // The connection ends with the probe; the next child starts from a free slot.
        let s = d.wait_scope("k", Duration::from_secs(5), |s| s.counts.active == 0);
        assert_eq!(s.counts.active, 0, "{s:?}");
    }
    let s = d.scope("k");
    assert_eq!((s.counts.admitted, s.counts.shed), (20, 40), "{s:?}");
}

/// A daemon in a cgroup namespace (as in a container): its cgroup2 root is a cgroup
/// two levels below the kernel's, which the kernel counts ancestors from; a scope on a
/// cgroup below its root governs that cgroup's sockets.
#[test]
fn a_daemon_in_a_cgroup_namespace_governs_below_its_root() {
    let server = Server::start("127.0.0.1:0");
    let root = Cgroup::new("cgns");
    let app = root.child("app");
    let d = Daemon::builder(budget_policy("app", "app", Mode::Enforce, &server.addr, 1))
        .in_cgroup_namespace(&root)
        .start();
    let out = app.probe(Probe::connect(server.addr, 3, 1));
    assert_eq!(
        (out.ok, out.errors("ECONNREFUSED")),
        (1, 2),
        "{out:?}\n{}",
        d.log.lock().unwrap(),
    );
    let s = d.scope("app");
    assert_eq!((s.counts.admitted, s.counts.shed), (1, 2), "{s:?}");
    drop(d);
    drop(app);
}

/// Nested scopes: a cgroup selected by A, its child selected by B; a grandchild created
/// while the daemon runs belongs to B, the nearest, from its first connect.
#[test]
fn nested_scopes_the_nearest_selected_cgroup_wins() {
    let server = Server::start("127.0.0.1:0");
    let a = Cgroup::new("nest-a");
    let b = a.child("b");
    let d = Daemon::builder(
        Policy::new()
            .scope(Scope::new("a", &a.rel).mode(Mode::Observe))
            .scope(Scope::new("b", &b.rel).max_connections(1)),
    )
    .start();
    let grandchild = b.child("late");
    let out = grandchild.probe(Probe::connect(server.addr, 3, 1));
    assert_eq!((out.ok, out.errors("ECONNREFUSED")), (1, 2), "{out:?}");
    let (sa, sb) = (d.scope("a"), d.scope("b"));
    assert_eq!((sb.counts.admitted, sb.counts.shed), (1, 2), "{sb:?}");
    assert_eq!((sa.counts.admitted, sa.counts.shed), (0, 0), "{sa:?}");
    drop(grandchild);
}

/// A socket belongs to the scope of the cgroup it was created in, not to the cgroup of
/// the task that calls connect().
#[test]
fn socket_counts_for_the_cgroup_it_was_created_in() {
    let server = Server::start("127.0.0.1:0");
    let guarded = Cgroup::new("s-guarded");
    let outside = Cgroup::new("s-outside");
    let d = Daemon::builder(budget_policy(
        "s",
        &guarded.rel,
        Mode::Enforce,
        &server.addr,
        1,
    ))
    .start();
    let _held = guarded.hold(Probe::hold(server.addr, 1, 1));
    // Created in the guarded cgroup (budget spent), connecting from outside: shed.
    let to_outside = guarded.probe(Probe::Migrate {
        addr: server.addr,
        cgroup_dir: outside.path.display().to_string(),
    });
    assert_eq!(to_outside.errors("ECONNREFUSED"), 1, "{to_outside:?}");
    // Created outside, connecting from the guarded cgroup: unguarded.
    let to_guarded = outside.probe(Probe::Migrate {
        addr: server.addr,
        cgroup_dir: guarded.path.display().to_string(),
    });
    assert_eq!(to_guarded.ok, 1, "{to_guarded:?}");
    let s = d.scope("s");
    assert_eq!((s.counts.admitted, s.counts.shed), (1, 1), "{s:?}");
}

/// Rule order, a budget shared by a rule (`per = "rule"`), a scope budget, and a
/// non-default errno.
#[test]
fn shared_rule_budget_scope_budget_and_errno() {
    let (p1, p2, p3) = (
        Server::start("127.0.0.1:0"),
        Server::start("127.0.0.1:0"),
        Server::start("127.0.0.1:0"),
    );
    let cg = Cgroup::new("rules");
    let (a, b) = (p1.addr.port(), p2.addr.port());
    let d = Daemon::builder(
        Policy::new().scope(
            Scope::new("r", &cg.rel)
                .errno("ETIMEDOUT")
                .max_connections(6)
                .rule(
                    Rule::new("pair")
                        .dst(["127.0.0.1"])
                        .ports([a, b])
                        .max_connections(3)
                        .per(Per::Rule),
                )
                .rule(
                    Rule::new("shadowed")
                        .dst(["127.0.0.0/8"])
                        .ports([a])
                        .max_connections(100),
                )
                .rule(Rule::new("rest").dst(["127.0.0.0/8"])),
        ),
    )
    .start();
    let h1 = cg.hold(Probe::hold(p1.addr, 2, 1));
    let h2 = cg.hold(Probe::hold(p2.addr, 2, 1));
    // The pair shares 3: the 4th connection is shed, with the scope's errno.
    assert_eq!(
        (
            h1.outcome.ok + h2.outcome.ok,
            h2.outcome.errors("ETIMEDOUT")
        ),
        (3, 1),
        "{:?} {:?}",
        h1.outcome,
        h2.outcome
    );
    // Another port falls to "rest" (no budget of its own) and meets the scope's 6.
    let h3 = cg.hold(Probe::hold(p3.addr, 4, 1));
    assert_eq!(
        (h3.outcome.ok, h3.outcome.errors("ETIMEDOUT")),
        (3, 1),
        "{:?}",
        h3.outcome
    );
    let s = d.scope("r");
    let rule = |name: &str| s.rule(name).unwrap().clone();
    assert_eq!(
        (rule("pair").counts.active, rule("pair").counts.shed),
        (3, 1),
        "{s:?}"
    );
    assert_eq!(
        rule("shadowed").counts.admitted,
        0,
        "first matching rule wins: {s:?}"
    );
    assert_eq!(
        (rule("rest").counts.active, rule("rest").counts.shed),
        (3, 1),
        "{s:?}"
    );
    assert_eq!((s.counts.active, s.counts.shed), (6, 2), "{s:?}");
    assert_eq!(
        destination(&s, &p1.addr.to_string()).rule.as_deref(),
        Some("pair")
    );
}

/// MPTCP connections are counted like TCP: the first subflow's connect() runs the
/// connect hook in the caller's syscall, with the caller's cgroup (the MPTCP socket
/// itself, of protocol IPPROTO_MPTCP, passes; its subflows are TCP sockets). Budget 2:
/// of 3 held, 2 connect and 1 is shed; all are released once closed.
#[test]
fn mptcp_connections_are_counted_like_tcp() {
    let server = Server::start("127.0.0.1:0");
    let cg = Cgroup::new("mptcp");
    let d = Daemon::builder(budget_policy(
        "mptcp",
        &cg.rel,
        Mode::Enforce,
        &server.addr,
        2,
    ))
    .start();
    let out = cg.probe(Probe::Mptcp {
        addr: server.addr,
        count: 3,
    });
    assert_eq!((out.ok, out.errors("ECONNREFUSED")), (2, 1), "{out:?}");
    let s = d.wait_scope("mptcp", Duration::from_secs(5), |s| s.counts.active == 0);
    assert_eq!(
        (s.counts.admitted, s.counts.shed, s.counts.active),
        (2, 1, 0),
        "{s:?}"
    );
}

/// A TCP Fast Open connect deferred to a first send that never comes is released
/// when the socket is closed (tcp_connect() never ran, so no state callback will).
#[test]
fn deferred_fast_open_connect_is_released_on_close() {
    let ns = connguard_tests::Netns::new("cgtfo");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    ns.exec("sysctl", &["-qw", "net.ipv4.tcp_fastopen=5"]);
    let addr: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let cg = Cgroup::new("tfo");
    let d = Daemon::builder(budget_policy("tfo", &cg.rel, Mode::Enforce, &addr, 1)).start();
    // Nothing listens on the port: only a deferred connect() can succeed.
    let out = cg.probe(Probe::Tfo {
        netns: ns.path(),
        addr,
    });
    assert_eq!(out.ok, 1, "{out:?}");
    let s = d.wait_scope("tfo", Duration::from_secs(2), |s| s.counts.active == 0);
    assert_eq!((s.counts.admitted, s.counts.active), (1, 0), "{s:?}");
}
