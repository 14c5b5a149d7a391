//! Every admission is released exactly once, on every path.
use std::time::Duration;

use connguard_tests::{
    BPF_CGROUP_INET4_CONNECT, Cgroup, Daemon, Netns, Server, attached_programs, n,
};

/// (b) 10,000 connection attempts with every outcome, inside a test netns, then a
/// client SIGKILLed while holding connections: afterwards every count is exactly 0.
#[test]
fn ten_thousand_mixed_outcomes_leave_every_count_at_zero() {
    let ns = Netns::with_blackhole("cgmix");
    let cg = Cgroup::new("b");
    let d = Daemon::start(&format!(
        "[[scope]]\nname = \"b\"\ncgroup = \"{}\"\nmax_connections = 100000\n",
        cg.rel
    ));

    let out = cg.probe(&["mixed", &ns.path(), "10000"]);
    let cats = &out.categories;
    for c in [
        "server_closed",
        "client_closed",
        "refused",
        "abandoned",
        "no_route_twice",
        "addr_taken",
        "timed_out",
    ] {
        assert!(
            cats.get(c).copied().unwrap_or(0) > 0,
            "no {c} attempts: {out:?}"
        );
    }
    assert!(out.attempts >= 10_000, "{out:?}");
    assert_eq!(out.errors("ECONNREFUSED"), cats["refused"], "{out:?}");
    assert_eq!(out.errors("ETIMEDOUT"), 4, "{out:?}");
    assert_eq!(
        out.errors("ENETUNREACH"),
        2 * cats["no_route_twice"],
        "{out:?}"
    );
    assert_eq!(out.errors("EADDRNOTAVAIL"), cats["addr_taken"], "{out:?}");

    // A client killed while holding connections (to a server in the host netns).
    let server = Server::start("127.0.0.1:0");
    let mut killed = cg.hold(&server.addr, 50, 5);
    assert_eq!(killed.outcome.ok, 50);
    // The mixed run's last connections finish closing within moments of its exit.
    let s = d.wait_scope("b", Duration::from_secs(10), |s| n(s, "active") == 50);
    assert_eq!(n(&s, "active"), 50, "{s}");
    killed.kill();

    let s = d.wait_scope("b", Duration::from_secs(10), |s| n(s, "active") == 0);
    assert_eq!(
        n(&s, "admitted"),
        out.attempts + 50,
        "every attempt admitted exactly once: {s}"
    );
    assert_eq!(n(&s, "shed"), 0, "{s}");
    let busy = connguard_tests::active_destinations(&s);
    assert!(
        busy.is_empty() && n(&s, "active") == 0,
        "keys still active: {busy:?}"
    );
    assert_eq!(n(&d.stats(), "internal_errors"), 0);
}

/// A budget of 2; connect twice, close both (one after the server reset it);
/// the third is admitted.
#[test]
fn slot_is_freed_after_a_reset() {
    use std::{io::Read, net::TcpListener};
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let cg = Cgroup::new("case5");
    let d = Daemon::start(&connguard_tests::budget_policy(
        "c5", &cg.rel, "enforce", &addr, 2,
    ));
    let held = cg.hold(&addr, 2, 1);
    assert_eq!(held.outcome.ok, 2);
    // The server resets the first connection (SO_LINGER 0), keeps the second.
    let (first, _) = listener.accept().unwrap();
    let (mut second, _) = listener.accept().unwrap();
    socket2::SockRef::from(&first)
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(first);
    let s = d.wait_scope("c5", Duration::from_secs(5), |s| n(s, "active") == 1);
    assert_eq!(n(&s, "active"), 1, "the reset connection is released: {s}");
    drop(held);
    let _ = second.read(&mut [0u8; 1]);
    drop(second);
    let s = d.wait_scope("c5", Duration::from_secs(5), |s| n(s, "active") == 0);
    assert_eq!(n(&s, "active"), 0, "{s}");
    let third = cg.hold(&addr, 1, 1);
    assert_eq!(third.outcome.ok, 1, "{:?}", third.outcome);
}

/// Idle destinations are forgotten (their scope keeps its totals); a destination in use
/// is kept, and one forgotten comes back with exact counts.
#[test]
fn idle_destinations_are_forgotten_and_scope_totals_stay() {
    let server = Server::start("127.0.0.1:0");
    let cg = Cgroup::new("forget");
    let d = Daemon::start_with(
        &connguard_tests::budget_policy("f", &cg.rel, "enforce", &server.addr, 100),
        &["--forget-idle", "1"],
    );
    let out = cg.probe(&["connect", &server.addr.to_string(), "3", "1"]);
    assert_eq!(out.ok, 3);
    let s = d.wait_scope("f", Duration::from_secs(5), |s| {
        s["destinations"].as_array().unwrap().is_empty()
    });
    assert!(
        s["destinations"].as_array().unwrap().is_empty(),
        "idle destination still listed: {s}"
    );
    assert_eq!((n(&s, "admitted"), n(&s, "active")), (3, 0), "{s}");
    // A held connection keeps its destination; the entry comes back with exact counts.
    let held = cg.hold(&server.addr, 2, 1);
    assert_eq!(held.outcome.ok, 2);
    std::thread::sleep(Duration::from_millis(2500));
    let s = d.scope("f");
    let dst = connguard_tests::destination(&s, &server.addr.to_string());
    assert_eq!((n(dst, "active"), n(dst, "admitted")), (2, 2), "{s}");
    drop(held);
    let s = d.wait_scope("f", Duration::from_secs(5), |s| n(s, "active") == 0);
    assert_eq!((n(&s, "admitted"), n(&s, "active")), (5, 0), "{s}");
}

/// Another tool's sock_ops program, on the client's cgroup, that replaces every
/// socket's callback flags with its own (connguard's state callback off): 1,000
/// connections still end with every admission released and every TIME_WAIT counted,
/// exactly (the tracepoint releases them).
#[test]
fn a_foreign_sock_ops_program_that_rewrites_callback_flags_loses_no_release() {
    let ns = Netns::new("cgforeign");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    let cg = Cgroup::new("foreign");
    let servers = Cgroup::new("foreign-servers");
    let _serve = servers.hold_args(&["serve", &ns.path(), "8080", "8081"]);
    let d = Daemon::start(&format!(
        "[[scope]]\nname = \"foreign\"\ncgroup = \"{}\"\nmode = \"observe\"\n",
        cg.rel
    ));
    let _foreign = connguard_tests::ForeignSockOps::attach(&cg);
    let out = cg.probe(&["churn", &ns.path(), "127.0.0.1:8080", "1000", "0"]);
    assert_eq!((out.attempts, out.ok), (1000, 1000), "{out:?}");
    let s = d.wait_scope("foreign", Duration::from_secs(10), |s| n(s, "active") == 0);
    assert_eq!(
        (
            n(&s, "active"),
            n(&s, "admitted"),
            n(&s, "time_wait_created")
        ),
        (0, 1000, 1000),
        "{s}"
    );
}

/// A connect that fails before leaving TCP_CLOSE (no route) holds its admission until
/// the socket is closed, which only sock_release sees. A reload that no longer selects
/// the socket's cgroup keeps the release programs there: the close still releases it.
#[test]
fn a_reload_away_from_a_cgroup_keeps_releasing_what_it_admitted() {
    let ns = Netns::new("cgaway");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    let (first, second) = (Cgroup::new("away-1"), Cgroup::new("away-2"));
    let scope = |cg: &Cgroup| {
        format!(
            "[[scope]]\nname = \"away\"\ncgroup = \"{}\"\nmax_connections = 10\n",
            cg.rel
        )
    };
    // No audit: the held socket is in no table sock_diag walks, and an audit would take
    // its admission for a leak (a limit the README states).
    let d = Daemon::start_with(&scope(&first), &["--audit", "3600"]);
    let mut held = first.hold_args(&["fail-hold", &ns.path(), "198.51.100.1:80"]);
    assert_eq!(held.outcome.errors("ENETUNREACH"), 1, "{:?}", held.outcome);
    assert_eq!(n(&d.scope("away"), "active"), 1);
    // The scope, by name (and so its counts), now selects another cgroup.
    std::fs::write(&d.policy, scope(&second)).unwrap();
    let r = d.cli(&["reload"]);
    assert!(r.status.success(), "{r:?}");
    let connect4 = |cg: &Cgroup| attached_programs(&cg.path, BPF_CGROUP_INET4_CONNECT);
    assert_eq!((connect4(&first), connect4(&second)), (Some(0), Some(1)));
    held.kill();
    let s = d.wait_scope("away", Duration::from_secs(5), |s| n(s, "active") == 0);
    assert_eq!((n(&s, "admitted"), n(&s, "active")), (1, 0), "{s}");
}
