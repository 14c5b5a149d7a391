//! A daemon stopped and started again, killed, or gone for good: counts survive in the
//! pinned state, the programs stay attached, and a lease makes them fail open.
use std::time::{Duration, Instant};

use connguard_api::policy::{Limited, Mode, Policy, Scope};
use connguard_tests::{Cgroup, Daemon, Netns, Probe, Server, budget_policy, pinned_map_memory};
use serde::Deserialize;

const WAIT: Duration = Duration::from_secs(10);

/// Budget 5, 5 connections held, the daemon stopped by `signal` and started again: the
/// new daemon counts the 5 at once, sheds 5 more, and sees the old ones close.
fn restart_keeps_every_count(signal: i32) {
    let server = Server::start("127.0.0.1:0");
    let cg = Cgroup::new("restart");
    let policy = budget_policy("r", &cg.rel, Mode::Enforce, &server.addr, 5);
    let d = Daemon::builder(&policy).start();
    let held = cg.hold(Probe::hold(server.addr, 5, 5));
    assert_eq!(held.outcome.ok, 5, "{:?}", held.outcome);
    d.exit_keeping_state(signal);

    let d = Daemon::builder(&policy).adopting().start();
    let s = d.scope("r");
    assert_eq!((s.counts.active, s.counts.admitted), (5, 5), "{s:?}");
    assert!(d.log.lock().unwrap().contains("adopted the pinned state"));
    let out = cg.probe(Probe::connect(server.addr, 5, 5));
    assert_eq!((out.ok, out.errors("ECONNREFUSED")), (0, 5), "{out:?}");
    drop(held);
    let s = d.wait_scope("r", WAIT, |s| s.counts.active == 0);
    assert_eq!(s.counts.active, 0, "closing the 5 old connections: {s:?}");
    let again = cg.hold(Probe::hold(server.addr, 5, 5));
    assert_eq!(again.outcome.ok, 5, "{:?}", again.outcome);
    let s = d.scope("r");
    assert_eq!(
        (s.counts.active, s.counts.admitted, s.counts.shed),
        (5, 10, 5),
        "{s:?}"
    );
    drop(again);
    let s = d.wait_scope("r", WAIT, |s| s.counts.active == 0);
    assert_eq!(s.counts.active, 0, "{s:?}");
    assert_eq!(
        server.peak(),
        5,
        "the server never held more than the budget"
    );
}

#[test]
fn a_restart_on_sigterm_keeps_every_count_and_lifts_no_budget() {
    restart_keeps_every_count(libc::SIGTERM);
}

#[test]
fn a_restart_after_sigkill_within_the_lease_keeps_every_count() {
    restart_keeps_every_count(libc::SIGKILL);
}

/// Killed and not started again: the programs stay attached and shed until the lease
/// runs out, then let everything through while still counting; a daemon started later
/// adopts those counts, exactly.
#[test]
fn a_daemon_gone_for_good_fails_open_after_its_lease_and_the_next_adopts_its_counts() {
    let server = Server::start("127.0.0.1:0");
    let cg = Cgroup::new("lease");
    let policy = budget_policy("l", &cg.rel, Mode::Enforce, &server.addr, 2);
    let d = Daemon::builder(&policy).args(&["--lease", "3"]).start();
    let held = cg.hold(Probe::hold(server.addr, 2, 2));
    assert_eq!(held.outcome.ok, 2, "{:?}", held.outcome);
    d.exit_keeping_state(libc::SIGKILL);
    // The lease the killed daemon last renewed, and the clock the programs read.
    let until = lease_deadline();
    let out = cg.probe(Probe::connect(server.addr, 1, 1));
    if guard_common::monotonic_ns() < until {
        assert_eq!(out.errors("ECONNREFUSED"), 1, "within the lease: {out:?}");
    }
    // Fail-open once the lease has run out: a connect over the budget is let through,
    // and none before.
    let give_up = Instant::now() + WAIT;
    let over = loop {
        let over = cg.hold(Probe::hold(server.addr, 1, 1));
        let ended = guard_common::monotonic_ns();
        if over.outcome.ok == 1 {
            assert!(
                ended >= until,
                "admitted {} ms before the lease ran out",
                (until - ended) / 1_000_000
            );
            break over;
        }
        assert!(
            Instant::now() < give_up,
            "still shed {WAIT:?} after the kill: {:?}",
            over.outcome
        );
        std::thread::sleep(Duration::from_millis(200));
    };

    let d = Daemon::builder(&policy).adopting().start();
    let stats = d.stats();
    assert_eq!(stats.lease_expired, 1, "{stats:?}");
    let s = d.scope("l");
    assert_eq!(s.counts.active, 3, "the one let through was counted: {s:?}");
    let out = cg.probe(Probe::connect(server.addr, 1, 1));
    assert_eq!(out.errors("ECONNREFUSED"), 1, "a new lease sheds: {out:?}");
    drop((held, over));
    let s = d.wait_scope("l", WAIT, |s| s.counts.active == 0);
    assert_eq!(s.counts.active, 0, "{s:?}");
}

/// Until when (CLOCK_MONOTONIC ns) the programs may shed: `LEASE[0]` of the pinned state.
fn lease_deadline() -> u64 {
    let map = connguard_tests::pinned_map_path(guard_common::names::map::LEASE);
    let out = std::process::Command::new("bpftool")
        .args([
            "-j", "map", "lookup", "pinned", &map, "key", "0", "0", "0", "0",
        ])
        .output()
        .expect("run bpftool");
    /// What `bpftool -j map lookup` prints: the value's bytes, as "0x.." strings.
    #[derive(Deserialize)]
    struct Lookup {
        value: Vec<String>,
    }
    let lookup: Lookup = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "bpftool printed {:?}: {e}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    let bytes: Vec<u8> = lookup
        .value
        .iter()
        .map(|b| u8::from_str_radix(b.trim_start_matches("0x"), 16).unwrap())
        .collect();
    u64::from_le_bytes(bytes.try_into().expect("8 bytes"))
}

/// Connections opened and closed while no daemon ran are counted by the programs it
/// left attached: nothing drifts.
#[test]
fn connections_opened_and_closed_with_no_daemon_leave_no_drift() {
    let server = Server::start("127.0.0.1:0");
    let cg = Cgroup::new("gap");
    let policy = budget_policy("g", &cg.rel, Mode::Enforce, &server.addr, 100);
    let d = Daemon::builder(&policy).start();
    d.exit_keeping_state(libc::SIGTERM);
    let churn = cg.probe(Probe::connect(server.addr, 50, 5));
    assert_eq!(churn.ok, 50, "{churn:?}");
    let held = cg.hold(Probe::hold(server.addr, 3, 3));
    assert_eq!(held.outcome.ok, 3, "{:?}", held.outcome);

    let d = Daemon::builder(&policy).adopting().start();
    let s = d.wait_scope("g", WAIT, |s| s.counts.active == 3);
    assert_eq!((s.counts.active, s.counts.admitted), (3, 53), "{s:?}");
    drop(held);
    let s = d.wait_scope("g", WAIT, |s| s.counts.active == 0);
    assert_eq!(s.counts.active, 0, "{s:?}");
}

/// `connguard stop` detaches everything and unpins the state: the next daemon starts
/// from nothing.
#[test]
fn stop_detaches_and_unpins_everything() {
    let server = Server::start("127.0.0.1:0");
    let cg = Cgroup::new("stop");
    let policy = budget_policy("s", &cg.rel, Mode::Enforce, &server.addr, 1);
    let d = Daemon::builder(&policy).start();
    let held = cg.hold(Probe::hold(server.addr, 1, 1));
    let out = d.cli(&["stop"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dir = connguard_tests::state_dir();
    assert!(!std::path::Path::new(&dir).exists());
    assert_eq!(
        connguard_tests::attached_programs(&cg.path, connguard_tests::BPF_CGROUP_INET4_CONNECT),
        Some(0)
    );
    // Nothing is governed: a second connection passes.
    let out = cg.probe(Probe::connect(server.addr, 1, 1));
    assert_eq!(out.ok, 1, "{out:?}");
    drop(held);
    d.exit_keeping_state(libc::SIGTERM);
}

/// An upgrade to a daemon of another state layout: it seeds its counts from the socket
/// table instead of adopting, and the old layout's programs are detached and its state
/// unpinned once the new daemon's programs are attached.
#[test]
fn a_daemon_of_another_state_layout_seeds_and_replaces_the_old_state() {
    let server = Server::start("127.0.0.1:0");
    let cg = Cgroup::new("layout");
    let policy = budget_policy("u", &cg.rel, Mode::Enforce, &server.addr, 3);
    let d = Daemon::builder(&policy).start();
    let held = cg.hold(Probe::hold(server.addr, 2, 2));
    assert_eq!(held.outcome.ok, 2, "{:?}", held.outcome);
    d.exit_keeping_state(libc::SIGTERM);
    let old = connguard_tests::state_dir();
    assert!(std::path::Path::new(&old).exists());

    let layout = (guard_common::STATE_LAYOUT + 1).to_string();
    let d = Daemon::builder(&policy)
        .adopting()
        .args(&["--state-layout", &layout])
        .start();
    assert!(
        !std::path::Path::new(&old).exists(),
        "{old} was not removed"
    );
    let log = d.log.lock().unwrap().clone();
    assert!(log.contains("removed the state of another layout"), "{log}");
    assert!(log.contains("from the socket table: u 2"), "{log}");
    // One program of each kind on the cgroup: the old layout's are detached.
    assert_eq!(
        connguard_tests::attached_programs(&cg.path, connguard_tests::BPF_CGROUP_INET4_CONNECT),
        Some(1)
    );
    let s = d.scope("u");
    assert_eq!(
        (s.counts.active, s.counts.admitted),
        (2, 2),
        "seeded: {s:?}"
    );
    let more = cg.hold(Probe::hold(server.addr, 3, 3));
    assert_eq!(more.outcome.ok, 1, "the budget holds: {:?}", more.outcome);
    drop((held, more));
    let s = d.wait_scope("u", WAIT, |s| s.counts.active == 0);
    assert_eq!(s.counts.active, 0, "{s:?}");
}

/// Connections opened before the daemon's first start (no pinned state) are counted
/// from the socket table, hold their budget, and are released exactly once; an
/// accepted connection in the governed cgroup (the server side) is not counted.
#[test]
fn connections_opened_before_the_first_start_are_seeded_and_released_once() {
    let server = Server::start("127.0.0.1:0");
    let cg = Cgroup::new("seed");
    connguard_tests::remove_pinned_state();
    let held = cg.hold(Probe::hold(server.addr, 5, 5));
    assert_eq!(held.outcome.ok, 5, "{:?}", held.outcome);
    // A listener in the cgroup with a connection accepted from outside it: its server
    // side is not seeded.
    let listen = std::net::SocketAddr::from(([127, 0, 0, 1], connguard_tests::free_port()));
    let inner = cg.hold(Probe::Listen {
        netns: "/proc/self/ns/net".into(),
        addr: listen,
        backlog: 16,
        accept_after_ms: Some(0),
        on_usr1: false,
    });
    let _accepted = std::net::TcpStream::connect(listen).expect("connect to the listener");
    let policy = budget_policy("s", &cg.rel, Mode::Enforce, &server.addr, 5);
    let d = Daemon::builder(&policy).start();
    let log = d.log.lock().unwrap().clone();
    assert!(log.contains("from the socket table: s 5"), "{log}");
    let s = d.scope("s");
    assert_eq!((s.counts.active, s.counts.admitted), (5, 5), "{s:?}");
    let out = cg.probe(Probe::connect(server.addr, 3, 3));
    assert_eq!((out.ok, out.errors("ECONNREFUSED")), (0, 3), "{out:?}");
    drop(held);
    let s = d.wait_scope("s", WAIT, |s| s.counts.active == 0);
    assert_eq!(s.counts.active, 0, "released once: {s:?}");
    let again = cg.hold(Probe::hold(server.addr, 5, 5));
    assert_eq!(again.outcome.ok, 5, "{:?}", again.outcome);
    let s = d.scope("s");
    assert_eq!((s.counts.active, s.counts.admitted), (5, 10), "{s:?}");
    drop((again, inner));
    let s = d.wait_scope("s", WAIT, |s| s.counts.active == 0);
    assert_eq!(s.counts.active, 0, "{s:?}");
}

/// Writes `counter` as scope 0's entry of the pinned SCOPE_COUNTERS, with bpftool:
/// behind the daemon's back, as a bug would.
fn set_scope_counter(counter: guard_common::Counter) {
    // SAFETY: Counter is repr(C), all u64: its bytes are plain data.
    let bytes = unsafe {
        std::slice::from_raw_parts(
            (&raw const counter).cast::<u8>(),
            std::mem::size_of::<guard_common::Counter>(),
        )
    };
    let value: Vec<String> = bytes.iter().map(|b| b.to_string()).collect();
    let map = connguard_tests::pinned_map_path(guard_common::names::map::SCOPE_COUNTERS);
    let mut args = vec![
        "map", "update", "pinned", &map, "key", "0", "0", "0", "0", "value",
    ];
    args.extend(value.iter().map(String::as_str));
    connguard_tests::run("bpftool", &args);
}

/// `--max-destinations` sizes the destination counter map where a daemon makes it: 4,100
/// destinations in a map of 4,096 leave exactly 4 uncounted (`internal_errors`); a
/// daemon that adopts the pinned map keeps its size, and says so; `stats` shows both.
#[test]
fn the_destination_map_is_made_at_the_size_asked_and_a_restart_keeps_it() {
    let cg = Cgroup::new("restart-size");
    let ns = Netns::new("cgsize");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    let policy = Policy::new().scope(Scope::new("sized", &cg.rel).mode(Mode::Observe));
    let d = Daemon::builder(&policy)
        .args(&["--max-destinations", "4096"])
        .start();
    assert_eq!(pinned_map_memory("COUNTERS").1, 4096);
    let spray = cg.probe(Probe::Spray {
        netns: ns.path(),
        count: 4100,
        port: 9,
    });
    assert_eq!(spray.errors("ECONNREFUSED"), 4100, "{spray:?}");
    let s = d.stats();
    let t = &s.destination_table;
    assert_eq!((s.internal_errors, t.entries, t.capacity), (4, 4096, 4096));
    let table = String::from_utf8_lossy(&d.cli(&["stats"]).stdout).into_owned();
    assert!(
        table.contains("destination counter map: 4096 of 4096 entries; FULL"),
        "{table}"
    );
    d.exit_keeping_state(libc::SIGTERM);

    let d = Daemon::builder(&policy)
        .adopting()
        .args(&["--max-destinations", "8192"])
        .start();
    assert_eq!(pinned_map_memory("COUNTERS").1, 4096);
    wait_log(
        &d,
        "hold 4096 destinations, not the 8192 asked (--max-destinations)",
    );
    let t = d.stats().destination_table;
    assert_eq!((t.entries, t.capacity), (4096, 4096));
}

/// Waits for `line` in the daemon's log: the audit logs a correction after making it.
fn wait_log(d: &Daemon, line: &str) {
    let until = Instant::now() + WAIT;
    while !d.log.lock().unwrap().contains(line) {
        assert!(
            Instant::now() < until,
            "no \"{line}\" in {WAIT:?}:\n{}",
            d.log.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The audit recounts the live sockets every second (`--audit 1`, the tests' default):
/// a counter set wrong behind the daemon's back (with bpftool, in the pinned map) is
/// corrected after two audits agree, logged with its key, and counted.
#[test]
fn the_audit_corrects_a_count_set_wrong_behind_its_back() {
    let server = Server::start("127.0.0.1:0");
    let cg = Cgroup::new("audit");
    let policy = budget_policy("a", &cg.rel, Mode::Enforce, &server.addr, 10);
    let mut d = Daemon::builder(&policy).start();
    let held = cg.hold(Probe::hold(server.addr, 3, 3));
    assert_eq!(held.outcome.ok, 3, "{:?}", held.outcome);
    // Scope "a" has id 0: active 7 instead of 3 (a leak of 4).
    set_scope_counter(guard_common::Counter {
        active: 7,
        peak: 3,
        admitted: 3,
        ..Default::default()
    });
    d.expected_corrections = 1;
    let s = d.wait_scope("a", WAIT, |s| s.counts.active == 3);
    assert_eq!(s.counts.active, 3, "corrected: {s:?}");
    wait_log(
        &d,
        "audit: scope a counted 7 active connection(s), the sockets hold 3",
    );
    assert_eq!(d.stats().audit_corrections, 1);
    drop(held);
    let s = d.wait_scope("a", WAIT, |s| s.counts.active == 0);
    assert_eq!(s.counts.active, 0, "{s:?}");
}

/// A handshake count set wrong (4 in the handshake where the 3 connections are
/// established) is corrected too: left alone, a leak of `connecting` would shed every
/// attempt once it reached `max_connecting`. With `max_connecting = 4`, the scope sheds
/// until the audit corrects it, then admits. Audits every 3 s: the shed is tried
/// before the second audit sees the difference.
#[test]
fn the_audit_corrects_a_handshake_count_set_wrong_behind_its_back() {
    let server = Server::start("127.0.0.1:0");
    let cg = Cgroup::new("audit-hs");
    let policy = Policy::new().scope(Scope::new("a", &cg.rel).max_connecting(4));
    let mut d = Daemon::builder(&policy).args(&["--audit", "3"]).start();
    let held = cg.hold(Probe::hold(server.addr, 3, 3));
    assert_eq!(held.outcome.ok, 3, "{:?}", held.outcome);
    let s = d.scope("a");
    assert_eq!((s.counts.active, s.counts.connecting), (3, 0), "{s:?}");
    set_scope_counter(guard_common::Counter {
        active: 3,
        peak: 3,
        admitted: 3,
        connecting: 4,
        ..Default::default()
    });
    let out = cg.probe(Probe::connect(server.addr, 1, 1));
    assert_eq!(
        out.errors("ECONNREFUSED"),
        1,
        "4 counted in the handshake: {out:?}"
    );
    d.expected_corrections = 1;
    let s = d.wait_scope("a", WAIT, |s| s.counts.connecting == 0);
    assert_eq!(
        (s.counts.active, s.counts.connecting),
        (3, 0),
        "corrected: {s:?}"
    );
    wait_log(
        &d,
        "audit: scope a counted 4 connection(s) in the handshake, the sockets hold 0",
    );
    assert_eq!(d.stats().audit_corrections, 1);
    let out = cg.probe(Probe::connect(server.addr, 1, 1));
    assert_eq!(out.ok, 1, "after the correction: {out:?}");
    drop(held);
    let s = d.wait_scope("a", WAIT, |s| s.counts.active == 0);
    assert_eq!((s.counts.active, s.counts.connecting), (0, 0), "{s:?}");
}

/// Two minutes (CONNGUARD_CHURN_SECONDS: the kernel matrix's guests run one) of
/// `guard-probe mixed` (10,000 attempts a run, every outcome), with the daemon
/// restarted three times while it runs (SIGTERM, SIGKILL, SIGTERM): every attempt
/// admitted exactly once across the restarts, every count back to exactly 0, and no
/// audit correction.
#[test]
fn minutes_of_mixed_churn_with_three_restarts_leave_every_count_at_zero() {
    let run = connguard_tests::churn_length();
    let ns = connguard_tests::Netns::with_blackhole("cgchurn");
    let cg = Cgroup::new("churn");
    let policy = Policy::new().scope(Scope::new("m", &cg.rel).max_connections(100_000));
    let mut d = Some(Daemon::builder(&policy).start());
    let start = Instant::now();
    let attempts = std::thread::scope(|s| {
        let churn = s.spawn(|| {
            let mut attempts = 0;
            while start.elapsed() < run {
                let out = cg.probe(Probe::Mixed {
                    netns: ns.path(),
                    count: 10000,
                });
                assert!(out.attempts >= 10_000, "{out:?}");
                // Shown if the test fails: which outcomes a destination port served.
                eprintln!("{:.1} s: {out:?}", start.elapsed().as_secs_f64());
                attempts += out.attempts;
            }
            attempts
        });
        for (k, signal) in [libc::SIGTERM, libc::SIGKILL, libc::SIGTERM]
            .into_iter()
            .enumerate()
        {
            let at = run * (k as u32 + 1) / 4;
            std::thread::sleep(at.saturating_sub(start.elapsed()));
            d.take().unwrap().exit_keeping_state(signal);
            d = Some(Daemon::builder(&policy).adopting().start());
        }
        churn.join().unwrap()
    });
    let d = d.unwrap();
    let s = d.wait_scope("m", WAIT, |s| s.counts.active == 0);
    assert_eq!(s.counts.active, 0, "{s:?}");
    assert_eq!(
        s.counts.admitted, attempts,
        "each attempt admitted once: {s:?}"
    );
    let busy = connguard_tests::active_destinations(&s);
    assert!(busy.is_empty(), "keys still active: {busy:?}");
    let stats = d.stats();
    assert_eq!(
        (stats.internal_errors, stats.audit_corrections),
        (0, 0),
        "{stats:?}"
    );
}
