//! Every admission is released exactly once, on every path.
use std::time::{Duration, Instant};

use connguard_api::policy::{Limited, Mode, Policy, Scope};
use connguard_tests::{
    BPF_CGROUP_INET4_CONNECT, Cgroup, Daemon, Holder, Netns, Probe, ServePort, Server,
    attached_programs,
};

/// (b) 10,000 connection attempts with every outcome, inside a test netns, then a
/// client SIGKILLed while holding connections: afterwards every count is exactly 0.
#[test]
fn ten_thousand_mixed_outcomes_leave_every_count_at_zero() {
    let ns = Netns::with_blackhole("cgmix");
    let cg = Cgroup::new("b");
    let d = Daemon::builder(Policy::new().scope(Scope::new("b", &cg.rel).max_connections(100_000)))
        .start();

    let out = cg.probe(Probe::Mixed {
        netns: ns.path(),
        count: 10000,
    });
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
            out.categories.get(c).copied().unwrap_or(0) > 0,
            "no {c} attempts: {out:?}"
        );
    }
    assert!(out.attempts >= 10_000, "{out:?}");
    assert_eq!(
        out.errors("ECONNREFUSED"),
        out.category("refused"),
        "{out:?}"
    );
    assert_eq!(out.errors("ETIMEDOUT"), 4, "{out:?}");
    assert_eq!(
        out.errors("ENETUNREACH"),
        2 * out.category("no_route_twice"),
        "{out:?}"
    );
    assert_eq!(
        out.errors("EADDRNOTAVAIL"),
        out.category("addr_taken"),
        "{out:?}"
    );

    // A client killed while holding connections (to a server in the host netns).
    let server = Server::start("127.0.0.1:0");
    let mut killed = cg.hold(Probe::hold(server.addr, 50, 5));
    assert_eq!(killed.outcome.ok, 50);
    // The mixed run's last connections finish closing within moments of its exit.
    let s = d.wait_scope("b", Duration::from_secs(10), |s| s.counts.active == 50);
    assert_eq!(s.counts.active, 50, "{s:?}");
    killed.kill();

    let s = d.wait_scope("b", Duration::from_secs(10), |s| s.counts.active == 0);
    assert_eq!(
        s.counts.admitted,
        out.attempts + 50,
        "every attempt admitted exactly once: {s:?}"
    );
    assert_eq!(s.counts.shed, 0, "{s:?}");
    let busy = connguard_tests::active_destinations(&s);
    assert!(
        busy.is_empty() && s.counts.active == 0,
        "keys still active: {busy:?}"
    );
    assert_eq!(d.stats().internal_errors, 0);
}

/// A budget of 2; connect twice, close both (one after the server reset it);
/// the third is admitted.
#[test]
fn slot_is_freed_after_a_reset() {
    use std::{io::Read, net::TcpListener};
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let cg = Cgroup::new("case5");
    let d = Daemon::builder(connguard_tests::budget_policy(
        "c5",
        &cg.rel,
        Mode::Enforce,
        &addr,
        2,
    ))
    .start();
    let held = cg.hold(Probe::hold(addr, 2, 1));
    assert_eq!(held.outcome.ok, 2);
    // The server resets the first connection (SO_LINGER 0), keeps the second.
    let (first, _) = listener.accept().unwrap();
    let (mut second, _) = listener.accept().unwrap();
    socket2::SockRef::from(&first)
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(first);
    let s = d.wait_scope("c5", Duration::from_secs(5), |s| s.counts.active == 1);
    assert_eq!(
        s.counts.active, 1,
        "the reset connection is released: {s:?}"
    );
    drop(held);
    let _ = second.read(&mut [0u8; 1]);
    drop(second);
    let s = d.wait_scope("c5", Duration::from_secs(5), |s| s.counts.active == 0);
    assert_eq!(s.counts.active, 0, "{s:?}");
    let third = cg.hold(Probe::hold(addr, 1, 1));
    assert_eq!(third.outcome.ok, 1, "{:?}", third.outcome);
}

/// Idle destinations are forgotten (their scope keeps its totals); a destination in use
/// is kept, and one forgotten comes back with exact counts.
#[test]
fn idle_destinations_are_forgotten_and_scope_totals_stay() {
    let server = Server::start("127.0.0.1:0");
    let cg = Cgroup::new("forget");
    let d = Daemon::builder(connguard_tests::budget_policy(
        "f",
        &cg.rel,
        Mode::Enforce,
        &server.addr,
        100,
    ))
    .args(&["--forget-idle", "1"])
    .start();
    let out = cg.probe(Probe::connect(server.addr, 3, 1));
    assert_eq!(out.ok, 3);
    let s = d.wait_scope("f", Duration::from_secs(5), |s| s.destinations.is_empty());
    assert!(
        s.destinations.is_empty(),
        "idle destination still listed: {s:?}"
    );
    assert_eq!((s.counts.admitted, s.counts.active), (3, 0), "{s:?}");
    // A held connection keeps its destination; the entry comes back with exact counts.
    let held = cg.hold(Probe::hold(server.addr, 2, 1));
    assert_eq!(held.outcome.ok, 2);
    std::thread::sleep(Duration::from_millis(2500));
    let s = d.scope("f");
    let dst = connguard_tests::destination(&s, &server.addr.to_string());
    assert_eq!((dst.counts.active, dst.counts.admitted), (2, 2), "{s:?}");
    drop(held);
    let s = d.wait_scope("f", Duration::from_secs(5), |s| s.counts.active == 0);
    assert_eq!((s.counts.admitted, s.counts.active), (5, 0), "{s:?}");
}

/// Another tool's sock_ops program, on the client's cgroup, that replaces every
/// socket's callback flags with its own (connguard's state callback off): the daemon
/// sees it loaded within its poll and attaches the state tracepoint, and 1,000
/// connections still end with every admission released and every TIME_WAIT counted,
/// exactly (the tracepoint releases them). Once it is unloaded the tracepoint stays, for
/// the sockets it saw, and so it does after two restarts, until `connguard stop`.
#[test]
fn a_foreign_sock_ops_program_that_rewrites_callback_flags_loses_no_release() {
    let ns = Netns::new("cgforeign");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    let cg = Cgroup::new("foreign");
    let servers = Cgroup::new("foreign-servers");
    let _serve = servers.hold(Probe::Serve {
        netns: ns.path(),
        ports: vec![ServePort::plain(8080), ServePort::plain(8081)],
    });
    let policy = Policy::new().scope(Scope::new("foreign", &cg.rel).mode(Mode::Observe));
    let mut d = Daemon::builder(&policy).start();
    let foreign = connguard_tests::ForeignSockOps::attach(&cg);
    let seen = |d: &Daemon| {
        let hw = d.stats().host_wide;
        let named = hw.because.iter().any(|w| w.contains("\"foreign_ops\""));
        (
            named && hw.attached.iter().any(|p| p == "sock_set_state"),
            hw,
        )
    };
    let deadline = Instant::now() + Duration::from_secs(2);
    while !seen(&d).0 {
        assert!(
            Instant::now() < deadline,
            "not attached for it: {:?}",
            seen(&d).1
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = cg.probe(Probe::churn(
        ns.path(),
        "127.0.0.1:8080".parse().unwrap(),
        1000,
    ));
    assert_eq!((out.attempts, out.ok), (1000, 1000), "{out:?}");
    let s = d.wait_scope("foreign", Duration::from_secs(10), |s| s.counts.active == 0);
    assert_eq!(
        (s.counts.active, s.counts.admitted, s.time_wait_created),
        (0, 1000, 1000),
        "{s:?}"
    );
    // Unloaded, it is no longer named, and the tracepoint stays for the sockets it saw.
    drop(foreign);
    let deadline = Instant::now() + Duration::from_secs(2);
    while seen(&d).1.because.iter().any(|w| w.contains("foreign_ops")) {
        assert!(Instant::now() < deadline, "still named: {:?}", seen(&d).1);
        std::thread::sleep(Duration::from_millis(20));
    }
    // So does every daemon after it on the same state: the second restart finds the
    // mark the first one found.
    for restart in 0..3 {
        let hw = d.stats().host_wide;
        assert!(
            hw.attached.iter().any(|p| p == "sock_set_state")
                && hw
                    .because
                    .iter()
                    .any(|w| w.contains("was loaded since the state was created")),
            "after {restart} restart(s): {hw:?}"
        );
        if restart < 2 {
            d.exit_keeping_state(libc::SIGTERM);
            d = Daemon::builder(&policy).adopting().start();
        }
    }
    // A stop takes the mark with the rest of the state: nothing is left in bpffs.
    let out = d.cli(&["stop"]);
    assert!(out.status.success(), "{out:?}");
    let root = std::path::Path::new(guard_common::STATE_ROOT);
    assert!(
        !root.exists(),
        "{} is left: {:?}",
        root.display(),
        std::fs::read_dir(root).map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>())
    );
    d.exit_keeping_state(libc::SIGTERM);
}

/// A connect that fails before leaving TCP_CLOSE (no route) holds its admission until
/// the socket is closed, which only sock_release sees. A reload that no longer selects
/// the socket's cgroup keeps the release programs there: the close still releases it.
#[test]
fn a_reload_away_from_a_cgroup_keeps_releasing_what_it_admitted() {
    let ns = Netns::new("cgaway");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    let (first, second) = (Cgroup::new("away-1"), Cgroup::new("away-2"));
    let scope = |cg: &Cgroup| Policy::new().scope(Scope::new("away", &cg.rel).max_connections(10));
    // No audit: the held socket is in no table sock_diag walks, and an audit would take
    // its admission for a leak (a limit docs/architecture.md states).
    let d = Daemon::builder(scope(&first))
        .args(&["--audit", "3600"])
        .start();
    let mut held = hold_failed_connect(&first, &ns, false);
    assert_eq!(d.scope("away").counts.active, 1);
    // The scope, by name (and so its counts), now selects another cgroup.
    std::fs::write(&d.policy, scope(&second).to_toml()).unwrap();
    let r = d.reload();
    assert!(r.status.success(), "{r:?}");
    let connect4 = |cg: &Cgroup| attached_programs(&cg.path, BPF_CGROUP_INET4_CONNECT);
    assert_eq!((connect4(&first), connect4(&second)), (Some(0), Some(1)));
    held.kill();
    let s = d.wait_scope("away", Duration::from_secs(5), |s| s.counts.active == 0);
    assert_eq!((s.counts.admitted, s.counts.active), (1, 0), "{s:?}");
}

/// A socket whose connect failed before leaving TCP_CLOSE, and which then listens, is
/// released once at close (by sock_release, or at its move from LISTEN to TCP_CLOSE).
/// The audit, every second, finds it among the listeners: held across three audits, it
/// is not corrected away.
#[test]
fn a_socket_that_listens_after_its_connect_failed_is_released_at_close() {
    let ns = Netns::new("cgfaillisten");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    let cg = Cgroup::new("fail-listen");
    let d =
        Daemon::builder(Policy::new().scope(Scope::new("faillisten", &cg.rel).max_connections(10)))
            .start();
    let mut held = hold_failed_connect(&cg, &ns, true);
    // A correction takes two audits that find the same difference: four more runs, the
    // first of which may have begun before the socket listened.
    let audits = || d.stats().job("audit").map_or(0, |j| j.runs);
    let (from, until) = (audits(), Instant::now() + Duration::from_secs(10));
    while audits() < from + 4 {
        assert!(
            Instant::now() < until,
            "the audit ran {} times in 10 s",
            audits() - from
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(d.scope("faillisten").counts.active, 1);
    assert_eq!(d.stats().audit_corrections, 0);
    held.kill();
    let s = d.wait_scope("faillisten", Duration::from_secs(5), |s| {
        s.counts.active == 0
    });
    assert_eq!((s.counts.admitted, s.counts.active), (1, 0), "{s:?}");
    assert_eq!(d.stats().audit_corrections, 0);
}

/// A socket in `cg` whose connect() to an address `ns` has no route to failed before the
/// SYN (ENETUNREACH), held open; listening if `listen`.
fn hold_failed_connect(cg: &Cgroup, ns: &Netns, listen: bool) -> Holder {
    let held = cg.hold(Probe::FailHold {
        netns: ns.path(),
        addr: "198.51.100.1:80".parse().unwrap(),
        listen,
    });
    assert_eq!(held.outcome.errors("ENETUNREACH"), 1, "{:?}", held.outcome);
    held
}
