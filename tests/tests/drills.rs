//! Chaos drills on real sockets: faults the connect hooks make on purpose (refuse,
//! blackhole, delay, reset), the blast-radius cap under 64 threads, the abort when another scope's
//! breaker opens, the deadline the programs keep with the daemon SIGKILLed, and bad
//! drills refused.
use std::{
    net::SocketAddr,
    sync::atomic::Ordering,
    time::{Duration, Instant},
};

use connguard_api::{
    drill::{DrillView, DrillsReply},
    policy::{Breaker, Limited, Policy, Rule, Scope},
};
use connguard_tests::{Cgroup, Daemon, Netns, Probe, Server, json_of};

/// Starts a drill with `connguard drill start`; it must start. `drill`: its name, scope,
/// fault, probability, duration and max_faults, in that order, separated by spaces;
/// `more`: other flags.
fn start(d: &Daemon, drill: &str, more: &[&str]) -> DrillView {
    let keys = [
        "--name",
        "--scope",
        "--fault",
        "--probability",
        "--duration",
        "--max-faults",
    ];
    let mut args = vec!["drill", "start"];
    for (k, v) in keys.into_iter().zip(drill.split_whitespace()) {
        args.extend([k, v]);
    }
    args.extend_from_slice(more);
    let out = d.cli(&args);
    assert!(
        out.status.success(),
        "drill start {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    list(d).into_iter().next().expect("the drill started")
}

fn list(d: &Daemon) -> Vec<DrillView> {
    json_of::<DrillsReply>(
        "connguard drill list --json",
        &d.cli(&["drill", "list", "--json"]),
    )
    .drills
}

/// A cgroup `prefix-*` and a daemon whose policy makes it scope "s".
fn governed(prefix: &str) -> (Cgroup, Daemon) {
    let cg = Cgroup::new(prefix);
    let d = Daemon::builder(Policy::new().scope(Scope::new("s", &cg.rel))).start();
    (cg, d)
}

/// The drill `name` as the daemon reports it.
fn drill(d: &Daemon, name: &str) -> DrillView {
    list(d)
        .into_iter()
        .find(|v| v.spec.name == name)
        .unwrap_or_else(|| panic!("no drill {name}"))
}

/// The server's accepted connections, once they reach `n` or 2 s passed (its accept
/// loop polls).
fn accepted(server: &Server, n: u64) -> u64 {
    let until = Instant::now() + Duration::from_secs(2);
    while server.accepted.load(Ordering::SeqCst) < n && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    server.accepted.load(Ordering::SeqCst)
}

/// Polls drill `name` until it is no longer running, within `within`.
fn wait_ended(d: &Daemon, name: &str, within: Duration) -> DrillView {
    let until = Instant::now() + within;
    loop {
        let v = drill(d, name);
        if v.state != "running" {
            return v;
        }
        assert!(Instant::now() < until, "drill {name} still running: {v:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// refuse at p = 0.3 over 1,000 connects: the faulted count lies within five standard
/// deviations of 300 and equals the clients' ECONNREFUSED; the same scope's other
/// destination, and another scope's connects to the target, are untouched; faults are
/// not sheds.
#[test]
fn refuse_faults_its_target_alone_at_its_probability() {
    let target = Server::start("127.0.0.1:0");
    let other = Server::start("127.0.0.1:0");
    let (a, b) = (Cgroup::new("drill-a"), Cgroup::new("drill-b"));
    let policy = Policy::new()
        .scope(Scope::new("a", &a.rel))
        .scope(Scope::new("b", &b.rel));
    let d = Daemon::builder(&policy).metrics().start();
    let port = target.addr.port().to_string();
    start(
        &d,
        "p30 a refuse 0.3 5min 1000",
        &["--dst", "127.0.0.1", "--ports", &port],
    );
    let out = a.probe(Probe::connect(target.addr, 1000, 4));
    let refused = out.errors("ECONNREFUSED");
    assert_eq!(out.ok + refused, 1000, "{out:?}");
    // 1000 × 0.3 = 300, σ = √(1000 × 0.3 × 0.7) ≈ 14.5.
    assert!((228..=372).contains(&refused), "{refused} refused: {out:?}");
    let untouched = a.probe(Probe::connect(other.addr, 200, 4));
    assert_eq!(untouched.ok, 200, "another destination: {untouched:?}");
    let untouched = b.probe(Probe::connect(target.addr, 200, 4));
    assert_eq!(untouched.ok, 200, "another scope: {untouched:?}");
    let v = drill(&d, "p30");
    assert_eq!(
        (v.state.as_str(), v.attempts, v.faulted, v.capped),
        ("running", 1000, refused, 0),
        "{v:?}"
    );
    let s = d.scope("a");
    assert_eq!(
        (s.counts.shed, s.counts.admitted),
        (0, 1000 - refused + 200),
        "faults are not sheds, nor admissions: {s:?}"
    );
    let out = d.cli(&["drill", "stop", "p30"]);
    assert!(out.status.success(), "{out:?}");
    let v = drill(&d, "p30");
    assert_eq!(
        (v.state.as_str(), v.reason.as_deref()),
        ("ended", Some("stopped"))
    );
    let after = a.probe(Probe::connect(target.addr, 100, 4));
    assert_eq!(after.ok, 100, "after the drill: {after:?}");
    let metrics = d.get("/metrics").1;
    assert!(
        metrics.lines().any(|l| l.starts_with(
            r#"connguard_drill_faults_total{drill="p30",scope="a",fault="refuse",started=""#
        ) && l.ends_with(&format!(" {refused}"))),
        "{metrics}"
    );
    let kinds: Vec<String> = d
        .events()
        .into_iter()
        .filter(|e| e.drill.is_some())
        .map(|e| e.kind)
        .collect();
    assert_eq!(kinds, ["drill_started", "drill_ended"]);
}

/// A drill that names a unit (with no scope) faults the connects of that unit's cgroup
/// and below it alone, in the scope that governs it: another unit of that scope is
/// untouched. The daemon runs in a cgroup namespace rooted at a systemd-shaped tree, so
/// the programs find the unit's cgroup below the mount's own level. A unit that does
/// not exist is refused; the drill ends once its unit's cgroup is gone.
#[test]
fn a_unit_drill_faults_that_unit_alone() {
    let server = Server::start("127.0.0.1:0");
    let root = Cgroup::new("drill-units");
    let slice = root.child("shop.slice");
    let (a, b) = (slice.child("a.service"), slice.child("b.service"));
    let below_a = a.child("worker");
    let d = Daemon::builder(Policy::new().scope(Scope::new("s", "shop.slice")))
        .in_cgroup_namespace(&root)
        .start();
    let args = |name: &str, unit: &str| {
        d.cli(&[
            "drill",
            "start",
            "--name",
            name,
            "--unit",
            unit,
            "--fault",
            "refuse",
            "--probability",
            "1",
            "--duration",
            "5min",
            "--max-faults",
            "1000",
        ])
    };
    let out = args("unit-a", "a.service");
    assert!(out.status.success(), "{out:?}");
    let v = drill(&d, "unit-a");
    assert_eq!(v.spec.scope, "s", "{v:?}");
    assert_eq!(v.workloads, ["unit a.service (/shop.slice/a.service)"]);
    let faulted = a.probe(Probe::connect(server.addr, 100, 4));
    assert_eq!(faulted.errors("ECONNREFUSED"), 100, "{faulted:?}");
    let below = below_a.probe(Probe::connect(server.addr, 50, 4));
    assert_eq!(
        below.errors("ECONNREFUSED"),
        50,
        "below the unit: {below:?}"
    );
    let other = b.probe(Probe::connect(server.addr, 100, 4));
    assert_eq!(other.ok, 100, "the scope's other unit: {other:?}");
    let v = drill(&d, "unit-a");
    assert_eq!((v.attempts, v.faulted, v.capped), (150, 150, 0), "{v:?}");
    assert_eq!(d.scope("s").counts.admitted, 100);

    let started = d.events().into_iter().find(|e| e.kind == "drill_started");
    assert_eq!(
        started.and_then(|e| e.workload).as_deref(),
        Some("unit a.service (/shop.slice/a.service)")
    );

    let out = args("missing", "none.service");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("unit none.service selects no workload on this node"),
        "{err}"
    );
    drop(below_a);
    drop(a);
    let v = wait_ended(&d, "unit-a", Duration::from_secs(2));
    assert_eq!(
        (v.state.as_str(), v.reason.as_deref()),
        ("aborted", Some("every workload it targets is gone"))
    );
}

/// blackhole: clients with a 1 s connect timeout time out, no SYN reaches the server,
/// and the faults equal the timeouts; past the cap the next connect goes through.
#[test]
fn blackhole_lets_no_syn_reach_the_server() {
    let ns = Netns::new("cgdrill");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    let addr: SocketAddr = "127.0.0.1:9411".parse().unwrap();
    let server = Server::start_in(&ns.path(), &addr.to_string());
    let (cg, d) = governed("drill-bh");
    start(&d, "bh s blackhole 1 5min 3", &[]);
    let out = cg.probe(Probe::Shedlat {
        netns: ns.path(),
        addr,
        count: 3,
        timeout_ms: Some(1000),
    });
    assert_eq!(
        out.errors("TIMEOUT"),
        3,
        "{out:?}\n{}",
        d.log.lock().unwrap()
    );
    assert_eq!(server.accepted.load(Ordering::SeqCst), 0);
    let v = drill(&d, "bh");
    assert_eq!((v.faulted, v.capped), (3, 0), "{v:?}");
    let out = cg.probe(Probe::Shedlat {
        netns: ns.path(),
        addr,
        count: 1,
        timeout_ms: Some(1000),
    });
    assert_eq!(out.ok, 1, "past the cap: {out:?}");
    assert_eq!(accepted(&server, 1), 1);
    let s = d.wait_scope("s", Duration::from_secs(5), |s| s.counts.active == 0);
    assert_eq!(s.counts.active, 0, "{s:?}");
}

/// reset: each connect fails with ECONNREFUSED after its SYN met a RST (on the
/// loopback: the server accepts nothing), is admitted and released toward the server;
/// past the cap the next connects.
#[test]
fn reset_refuses_after_a_rst_and_counts_the_admission() {
    let server = Server::start("127.0.0.1:0");
    let (cg, d) = governed("drill-reset");
    start(&d, "r s reset 1 5min 5", &[]);
    let out = cg.probe(Probe::connect(server.addr, 5, 1));
    assert_eq!(out.errors("ECONNREFUSED"), 5, "{out:?}");
    let out = cg.probe(Probe::connect(server.addr, 1, 1));
    assert_eq!(out.ok, 1, "past the cap: {out:?}");
    assert_eq!(accepted(&server, 1), 1);
    let s = d.wait_scope("s", Duration::from_secs(5), |s| s.counts.active == 0);
    assert_eq!(
        (s.counts.admitted, s.counts.shed, s.counts.active),
        (6, 0, 0),
        "{s:?}"
    );
    let v = drill(&d, "r");
    assert_eq!((v.attempts, v.faulted, v.capped), (6, 5, 1), "{v:?}");
}

/// delay: the first SYN never leaves, the retransmit (1 s later, TCP's initial RTO)
/// connects; the next connect, past the cap, is at once.
#[test]
fn delay_drops_the_first_syn_only() {
    let server = Server::start("127.0.0.1:0");
    let (cg, d) = governed("drill-delay");
    start(&d, "dl s delay 1 5min 1", &[]);
    let timed = |what: &str| {
        let t = Instant::now();
        let out = cg.probe(Probe::connect(server.addr, 1, 1));
        assert_eq!(out.ok, 1, "{what}: {out:?}");
        t.elapsed()
    };
    // Both include the probe's own start; the retransmit adds about 1 s.
    let delayed = timed("delayed");
    let at_once = timed("past the cap");
    assert!(
        delayed.saturating_sub(at_once) >= Duration::from_millis(700),
        "delayed {delayed:?}, past the cap {at_once:?}"
    );
    let v = drill(&d, "dl");
    assert_eq!((v.attempts, v.faulted, v.capped), (2, 1, 1), "{v:?}");
}

/// max_fraction 0.5 with p = 1, one connect at a time: every second attempt of the
/// sliding window is faulted, 50 of 100.
#[test]
fn max_fraction_faults_that_share_of_the_window() {
    let server = Server::start("127.0.0.1:0");
    let (cg, d) = governed("drill-frac");
    start(
        &d,
        "f s refuse 1 5min 100000",
        &["--max-fraction", "0.5", "--window", "1min"],
    );
    let out = cg.probe(Probe::connect(server.addr, 100, 1));
    assert_eq!((out.errors("ECONNREFUSED"), out.ok), (50, 50), "{out:?}");
    let v = drill(&d, "f");
    assert_eq!((v.attempts, v.faulted, v.capped), (100, 50, 50), "{v:?}");
}

/// A cap of 10 with p = 1 and 64 threads connecting at once: exactly 10 faulted.
#[test]
fn the_cap_holds_under_64_threads() {
    let server = Server::start("127.0.0.1:0");
    let (cg, d) = governed("drill-cap");
    start(&d, "k10 s refuse 1 5min 10", &[]);
    let out = cg.probe(Probe::connect(server.addr, 640, 64));
    assert_eq!((out.errors("ECONNREFUSED"), out.ok), (10, 630), "{out:?}");
    let v = drill(&d, "k10");
    assert_eq!((v.attempts, v.faulted, v.capped), (640, 10, 630), "{v:?}");
    assert!(
        d.events().iter().any(|e| e.kind == "drill_capped"),
        "{:?}",
        d.events()
    );
}

/// A second scope's breaker opens during a drill: the drill ends within 1 s of the
/// opening, aborted with the reason, and faults nothing after.
#[test]
fn a_breaker_opening_elsewhere_aborts_the_drill() {
    let ns = Netns::new("cgdrab");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    let server = Server::start("127.0.0.1:0");
    let (a, b) = (Cgroup::new("drill-ab-a"), Cgroup::new("drill-ab-b"));
    let closed = "127.0.0.1:9412";
    let policy = Policy::new().scope(Scope::new("a", &a.rel)).scope(
        Scope::new("b", &b.rel).rule(
            Rule::new("r").dst(["127.0.0.1"]).ports([9412]).breaker(
                Breaker::new()
                    .min_samples(5)
                    .failure_ratio(0.5)
                    .open_for("30s"),
            ),
        ),
    );
    let d = Daemon::builder(&policy).start();
    start(&d, "ab a refuse 1 5min 100000", &[]);
    let out = a.probe(Probe::connect(server.addr, 10, 1));
    assert_eq!(out.errors("ECONNREFUSED"), 10, "during the drill: {out:?}");
    // Refused by the closed port 5 times; the 6th attempt opens the breaker, and is
    // shed.
    let out = b.probe(Probe::Shedlat {
        netns: ns.path(),
        addr: closed.parse().unwrap(),
        count: 6,
        timeout_ms: None,
    });
    assert_eq!(out.errors("ECONNREFUSED"), 6, "{out:?}");
    let v = wait_ended(&d, "ab", Duration::from_secs(3));
    assert_eq!(
        (v.state.as_str(), v.reason.as_deref()),
        ("aborted", Some("a breaker opened in scope b")),
        "{v:?}"
    );
    let opened = d
        .events()
        .into_iter()
        .find(|e| e.kind == "breaker_opened")
        .expect("the breaker opened");
    let ended = v.ended_unix_ms.expect("ended");
    assert!(
        ended.saturating_sub(opened.unix_ms) <= 1000,
        "ended {} ms after the breaker opened",
        ended.saturating_sub(opened.unix_ms)
    );
    let out = a.probe(Probe::connect(server.addr, 100, 4));
    assert_eq!(out.ok, 100, "after the abort: {out:?}");
    assert_eq!(drill(&d, "ab").faulted, 10);
}

/// The daemon SIGKILLed mid-drill: the programs keep faulting until the drill's
/// deadline (here before the lease runs out), and nothing after it; then with a
/// deadline past the lease, until the lease runs out. A daemon stopped by SIGTERM
/// ends its drills at once.
#[test]
fn a_killed_daemons_drill_ends_at_its_deadline_or_its_lease() {
    let server = Server::start("127.0.0.1:0");
    let cg = Cgroup::new("drill-kill");
    let policy = Policy::new().scope(Scope::new("s", &cg.rel));
    // (duration, lease): the deadline comes first; then the lease does.
    for (duration, lease) in [("4s", "30"), ("5min", "4")] {
        let d = Daemon::builder(&policy).args(&["--lease", lease]).start();
        let v = start(&d, &format!("k s refuse 1 {duration} 100000"), &[]);
        let started = Instant::now();
        d.exit_keeping_state(libc::SIGKILL);
        // The last renewal was before the exit.
        let killed = Instant::now();
        let out = cg.probe(Probe::connect(server.addr, 5, 1));
        assert_eq!(
            out.errors("ECONNREFUSED"),
            5,
            "with no daemon, before the end: {out:?}"
        );
        let end = if lease == "30" {
            started + Duration::from_secs(4)
        } else {
            killed + Duration::from_secs(4)
        };
        std::thread::sleep(
            end.saturating_duration_since(Instant::now()) + Duration::from_millis(300),
        );
        let out = cg.probe(Probe::connect(server.addr, 5, 1));
        assert_eq!(
            out.ok, 5,
            "{duration} drill, {lease} s lease: {out:?} ({v:?})"
        );
        // The next daemon adopts the counts, and ends with the test (detaching all).
        drop(Daemon::builder(&policy).adopting().start());
    }
    // A daemon that exits on SIGTERM (keeping its state) ends its drills first.
    let d = Daemon::builder(&policy).start();
    start(&d, "t s refuse 1 5min 100000", &[]);
    d.exit_keeping_state(libc::SIGTERM);
    let out = cg.probe(Probe::connect(server.addr, 5, 1));
    assert_eq!(out.ok, 5, "after SIGTERM: {out:?}");
    drop(Daemon::builder(&policy).adopting().start());
}

/// An HTTP check that starts failing (503) aborts the drill, with the status; while it
/// answers 200 the drill runs.
#[test]
fn a_failing_http_check_aborts_the_drill() {
    let healthy = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/healthz", listener.local_addr().unwrap());
    let h = healthy.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let _ = std::io::Read::read(&mut conn, &mut [0u8; 1024]);
            let status = if h.load(Ordering::SeqCst) {
                "200 OK"
            } else {
                "503 Service Unavailable"
            };
            let _ = std::io::Write::write_all(
                &mut conn,
                format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                    .as_bytes(),
            );
        }
    });
    let (_cg, d) = governed("drill-http");
    start(&d, "h s refuse 0.5 5min 10", &["--abort-http", &url]);
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        drill(&d, "h").state,
        "running",
        "while the check answers 200"
    );
    healthy.store(false, Ordering::SeqCst);
    let v = wait_ended(&d, "h", Duration::from_secs(3));
    assert_eq!(
        (v.state.as_str(), v.reason.as_deref()),
        (
            "aborted",
            Some(format!("the HTTP check failed: {url}: 503 Service Unavailable").as_str())
        ),
        "{v:?}"
    );
}

/// Bad drills are refused with a clear error, and nothing starts.
#[test]
fn bad_drills_are_refused() {
    let (_cg, d) = governed("drill-bad");
    let good = [
        ("--name", "x"),
        ("--scope", "s"),
        ("--fault", "refuse"),
        ("--probability", "0.5"),
        ("--duration", "1min"),
        ("--max-faults", "5"),
    ];
    let cases = [
        (
            "--scope",
            "nope",
            "no scope \"nope\" in the policy in force",
        ),
        (
            "--probability",
            "1.5",
            "probability must be in [0, 1], like 0.3 (got 1.5)",
        ),
        ("--fault", "drop", "unknown fault \"drop\""),
        (
            "--duration",
            "forever",
            "duration \"forever\" has no known unit",
        ),
    ];
    for (flag, value, want) in cases {
        let mut args = vec!["drill", "start"];
        for (f, v) in good {
            args.extend([f, if f == flag { value } else { v }]);
        }
        let out = d.cli(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(want),
            "{flag} {value}: {err}"
        );
    }
    // Without a cap.
    let dir = std::env::temp_dir().join(connguard_tests::unique("drill"));
    std::fs::write(
        &dir,
        "name = \"x\"\nscope = \"s\"\nfault = \"refuse\"\nprobability = 1.0\nduration = \"1min\"\n",
    )
    .unwrap();
    let out = d.cli(&["drill", "start", dir.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(":1:8: a drill needs a cap on its blast radius"),
        "{err}"
    );
    std::fs::remove_file(&dir).unwrap();
    assert!(list(&d).is_empty(), "{:?}", list(&d));
}
