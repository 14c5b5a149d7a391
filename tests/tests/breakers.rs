//! Circuit breakers per destination endpoint, on real connect outcomes inside test
//! network namespaces: refusals (a closed port), timeouts (a black hole), slow
//! handshakes (SYNs dropped by nftables), a retry storm from curl; and the events that
//! report each transition.
use std::{
    process::Stdio,
    thread,
    time::{Duration, Instant},
};

use connguard_api::{
    events::EventRecord,
    policy::{Breaker, Limited, Mode, Policy, Rule, Scope},
    stats::BreakerStats,
};
use connguard_tests::{Cgroup, Daemon, Holder, Netns, Outcome, Probe, ServePort, destination};

/// A scope `s` over `cg` whose rule `r` for `dst` and `port` carries `breaker`.
fn policy(cg: &Cgroup, mode: Mode, dst: &str, port: u16, breaker: Breaker) -> Policy {
    Policy::new().scope(
        Scope::new("s", &cg.rel)
            .mode(mode)
            .rule(Rule::new("r").dst([dst]).ports([port]).breaker(breaker)),
    )
}

/// The `n`-th breaker_opened event (from 0), once the daemon has read it from the
/// kernel.
fn opened(d: &Daemon, n: usize) -> EventRecord {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let events = d.events();
        if let Some(e) = events.iter().filter(|e| e.kind == "breaker_opened").nth(n) {
            return e.clone();
        }
        assert!(
            Instant::now() < until,
            "no breaker_opened event {n}: {:?}",
            transitions(&events)
        );
        thread::sleep(Duration::from_millis(50));
    }
}

/// The kinds of the breaker events, with the step and percent of half-open ones.
fn transitions(events: &[EventRecord]) -> Vec<String> {
    events
        .iter()
        .filter(|e| e.kind.starts_with("breaker"))
        .map(|e| match (e.step, e.percent) {
            (Some(step), Some(percent)) => format!("{}({step},{percent})", e.kind),
            _ => e.kind.clone(),
        })
        .collect()
}

/// `guard-probe shedlat` in `cg`, inside `ns`: `count` connects one at a time, each
/// given up after `timeout_ms` if set.
fn connects(cg: &Cgroup, ns: &Netns, addr: &str, count: u64, timeout_ms: Option<u64>) -> Outcome {
    cg.probe(Probe::Shedlat {
        netns: ns.path(),
        addr: addr.parse().unwrap(),
        count,
        timeout_ms,
    })
}

/// Writes `policy` as the daemon's policy and reloads it; the reload must succeed.
fn reload(d: &Daemon, policy: &Policy) {
    std::fs::write(&d.policy, policy.to_toml()).unwrap();
    let r = d.reload();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
}

/// The destination's breaker in the daemon's stats, if one governs it.
fn breaker(d: &Daemon, dst: &str) -> Option<BreakerStats> {
    let s = d.scope("s");
    destination(&s, dst).breaker.as_deref().cloned()
}

/// Makes one attempt at a time until the breaker of `dst`, open, half-opens (the last
/// attempt is the first its first step judges). An attempt while it
/// is open is shed with no SYN and moves no step; its open time is measured on the
/// kernel's tick clock, which a TCG guest's can trail by seconds, so the test waits on
/// the kernel's answer, not on its own clock.
fn until_half_open(d: &Daemon, cg: &Cgroup, ns: &Netns, dst: &str) {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let out = connects(cg, ns, dst, 1, None);
        assert_eq!(out.errors("ECONNREFUSED"), 1, "{out:?}");
        if state(d, dst).as_deref() != Some("open") {
            return;
        }
        assert!(
            Instant::now() < until,
            "still open after 30 s: {:?}",
            breaker(d, dst)
        );
    }
}

/// The state of the destination's breaker.
fn state(d: &Daemon, dst: &str) -> Option<String> {
    breaker(d, dst).map(|b| b.state)
}

/// A server inside `ns` on 127.0.0.1:`port` (guard-probe serve) in a cgroup of its
/// own, which no scope selects; killed, then removed, on drop.
fn serve(ns: &Netns, port: u16) -> (Holder, Cgroup) {
    let outside = Cgroup::new("brksrv");
    (
        outside.hold(Probe::Serve {
            netns: ns.path(),
            ports: vec![ServePort::plain(port)],
        }),
        outside,
    )
}

/// A closed port trips the breaker after `min_samples` refusals; while open, connect()
/// fails at once and no SYN leaves the namespace; after `open_for` it lets through
/// exactly one attempt in ten, whose refusal opens it again for twice as long; with a
/// server on the port, the ramp climbs 10 %, 50 % and closes. The events show each
/// transition in order, and a reload keeps the breaker's state.
#[test]
fn a_breaker_opens_on_refusals_sheds_without_a_syn_and_recovers_through_its_ramp() {
    let ns = Netns::new("cgbrk");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    let cg = Cgroup::new("brk");
    let port = 9301;
    let addr = format!("127.0.0.1:{port}");
    let tripping = Breaker::new()
        .min_samples(20)
        .failure_ratio(0.5)
        // Long enough for the shed attempts and the reload to come while it is open,
        // in a TCG guest too.
        .open_for("5s")
        .ramp([10, 50, 100])
        .step_successes(3);
    let d = Daemon::builder(policy(
        &cg,
        Mode::Enforce,
        "127.0.0.1",
        port,
        tripping.clone(),
    ))
    .start();

    // 20 refused by the kernel (a RST each), then 10 shed: no SYN for those.
    let before = ns.active_opens();
    let out = connects(&cg, &ns, &addr, 30, None);
    assert_eq!(out.errors("ECONNREFUSED"), 30, "{out:?}");
    assert_eq!(ns.active_opens() - before, 20, "SYNs sent");
    let b = breaker(&d, &addr);
    assert_eq!(
        b.as_ref().map(|b| (b.state.as_str(), b.percent)),
        Some(("open", 0)),
        "{b:?}"
    );
    let s = d.scope("s");
    let dst = destination(&s, &addr);
    assert_eq!(
        (
            dst.counts.admitted,
            dst.counts.shed,
            dst.counts.breaker_limited,
            dst.counts.breaker_opened
        ),
        (20, 10, 10, 1),
        "{dst:?}"
    );
    // Shed by the connect hook: refused with no SYN sent.
    let before = ns.active_opens();
    let shed = connects(&cg, &ns, &addr, 20, None);
    assert_eq!(shed.errors("ECONNREFUSED"), 20, "{shed:?}");
    assert_eq!(ns.active_opens() - before, 0, "SYNs sent while open");

    // A reload that keeps the names keeps the breaker open.
    reload(
        &d,
        &policy(
            &cg,
            Mode::Enforce,
            "127.0.0.1",
            port,
            tripping.errno("ECONNREFUSED"),
        ),
    );
    assert_eq!(state(&d, &addr).as_deref(), Some("open"));

    // Half-open at 10 %: of 10 attempts the 10th goes, is refused, and opens it again.
    thread::sleep(Duration::from_millis(5100));
    let before = ns.active_opens();
    until_half_open(&d, &cg, &ns, &addr);
    let out = connects(&cg, &ns, &addr, 9, None);
    assert_eq!(out.errors("ECONNREFUSED"), 9, "{out:?}");
    assert_eq!(ns.active_opens() - before, 1, "one SYN at 10 %");
    let out = connects(&cg, &ns, &addr, 1, None);
    assert_eq!(out.errors("ECONNREFUSED"), 1, "{out:?}");
    let b = breaker(&d, &addr).expect("a breaker");
    assert_eq!(b.state, "open", "{b:?}");
    // Open for twice as long this time, as the kernel's event says.
    let again = opened(&d, 1);
    assert_eq!(again.open_ms, Some(10_000), "{again:?}");

    // With a server there, the ramp climbs: 3 successes at 10 % (30 attempts), 3 at
    // 50 % (6), then closed.
    let _server = serve(&ns, port);
    thread::sleep(Duration::from_millis(10_100));
    // A deadline with room for a TCG guest, where each attempt and stats call is slow.
    let until = Instant::now() + Duration::from_secs(60);
    until_half_open(&d, &cg, &ns, &addr);
    // The attempt that half-opened it is the ramp's first.
    let mut attempts = 1;
    while state(&d, &addr).as_deref() != Some("closed") {
        assert!(
            Instant::now() < until,
            "not closed after {attempts} attempts: {:?}",
            breaker(&d, &addr)
        );
        connects(&cg, &ns, &addr, 1, None);
        attempts += 1;
    }
    assert_eq!(
        attempts,
        30 + 6 + 1,
        "attempts until closed; events: {:?}",
        transitions(&d.events())
    );
    let out = connects(&cg, &ns, &addr, 5, None);
    assert_eq!(out.ok, 5, "closed: {out:?}");
    assert_eq!(
        transitions(&d.events()),
        [
            "breaker_opened",
            "breaker_half_open(0,10)",
            "breaker_opened",
            "breaker_half_open(0,10)",
            "breaker_half_open(1,50)",
            "breaker_closed"
        ]
    );
    let opened = opened(&d, 0);
    assert_eq!(
        (
            opened.ended,
            opened.failures,
            opened.open_ms,
            opened.dst.as_deref()
        ),
        (Some(20), Some(20), Some(5000), Some(addr.as_str())),
        "{opened:?}"
    );
}

/// A connect skips a breaker it last found closed with nothing due until an outcome
/// fails or a policy is applied again, and then looks again. A destination with 3
/// refusals and then 3 successes is short of failure_ratio 0.8; a reload, then a reload to
/// 0.5 (the kernel's two policy generations are back where they were), and its next
/// attempt is shed with no SYN. A destination first tried between the reloads opens at
/// exactly `min_samples` (5) refusals: 8 attempts, 5 SYNs.
#[test]
fn a_breaker_skipped_while_clear_is_looked_at_again_after_a_failure_or_a_reload() {
    let ns = Netns::new("cgbrkr");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    let cg = Cgroup::new("brkr");
    let (a, b) = ("127.0.0.1:9311", "127.0.0.1:9312");
    let breaker_at = |ratio: f64| {
        Breaker::new()
            .min_samples(5)
            .failure_ratio(ratio)
            .window("60s")
            .open_for("60s")
    };
    let text = |breaker: Breaker| {
        Policy::new().scope(
            Scope::new("s", &cg.rel).rule(
                Rule::new("r")
                    .dst(["127.0.0.1"])
                    .ports([9311..=9312])
                    .breaker(breaker),
            ),
        )
    };
    let d = Daemon::builder(text(breaker_at(0.8))).start();
    // Refusals first: the successes after them leave the breaker clear, and skipped.
    let out = connects(&cg, &ns, a, 3, None);
    assert_eq!(out.errors("ECONNREFUSED"), 3, "{out:?}");
    {
        let _server = serve(&ns, 9311);
        assert_eq!(connects(&cg, &ns, a, 3, None).ok, 3);
    }
    assert_eq!(
        state(&d, a).as_deref(),
        Some("closed"),
        "{:?}",
        breaker(&d, a)
    );

    reload(&d, &text(breaker_at(0.8).errno("ECONNREFUSED")));
    let before = ns.active_opens();
    let out = connects(&cg, &ns, b, 8, None);
    assert_eq!(out.errors("ECONNREFUSED"), 8, "{out:?}");
    assert_eq!(ns.active_opens() - before, 5, "SYNs to a new destination");
    assert_eq!(
        state(&d, b).as_deref(),
        Some("open"),
        "{:?}",
        breaker(&d, b)
    );

    reload(&d, &text(breaker_at(0.5)));
    let before = ns.active_opens();
    let out = connects(&cg, &ns, a, 1, None);
    assert_eq!(out.errors("ECONNREFUSED"), 1, "{out:?}");
    assert_eq!(
        ns.active_opens() - before,
        0,
        "a SYN past a breaker due to open"
    );
    assert_eq!(
        state(&d, a).as_deref(),
        Some("open"),
        "{:?}",
        breaker(&d, a)
    );
}

/// A reload that takes a rule's breaker away forgets the breaker: an open one is neither
/// listed nor consulted (connects reach the closed port again, a SYN each), and the
/// breaker put back by the next reload starts closed, with an empty window.
#[test]
fn a_reload_that_drops_a_breaker_forgets_it() {
    let ns = Netns::new("cgbrkd");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    let cg = Cgroup::new("brkd");
    let port = 9321;
    let addr = format!("127.0.0.1:{port}");
    let with = policy(
        &cg,
        Mode::Enforce,
        "127.0.0.1",
        port,
        Breaker::new()
            .min_samples(5)
            .failure_ratio(0.5)
            .open_for("60s"),
    );
    let without = Policy::new().scope(
        Scope::new("s", &cg.rel)
            .mode(Mode::Enforce)
            .rule(Rule::new("r").dst(["127.0.0.1"]).ports([port])),
    );
    let d = Daemon::builder(&with).start();
    let open_breakers = || d.scope("s").open_breakers.len();

    // 5 refused by the kernel, then the breaker opens and sheds the 6th.
    let before = ns.active_opens();
    let out = connects(&cg, &ns, &addr, 6, None);
    assert_eq!(out.errors("ECONNREFUSED"), 6, "{out:?}");
    assert_eq!(ns.active_opens() - before, 5, "SYNs sent");
    assert_eq!(
        state(&d, &addr).as_deref(),
        Some("open"),
        "{:?}",
        breaker(&d, &addr)
    );
    assert_eq!(open_breakers(), 1);

    reload(&d, &without);
    assert_eq!(breaker(&d, &addr), None, "no breaker governs it");
    assert_eq!(open_breakers(), 0);
    let before = ns.active_opens();
    let out = connects(&cg, &ns, &addr, 3, None);
    assert_eq!(out.errors("ECONNREFUSED"), 3, "{out:?}");
    assert_eq!(ns.active_opens() - before, 3, "SYNs sent with no breaker");

    // Back within the old one's 60 s `open_for`: a fresh breaker.
    reload(&d, &with);
    let before = ns.active_opens();
    let out = connects(&cg, &ns, &addr, 1, None);
    assert_eq!(out.errors("ECONNREFUSED"), 1, "{out:?}");
    assert_eq!(ns.active_opens() - before, 1, "a SYN past a fresh breaker");
    let b = breaker(&d, &addr);
    assert_eq!(
        b.as_ref()
            .map(|b| (b.state.as_str(), b.window_ended, b.window_failures)),
        Some(("closed", 1, 1)),
        "{b:?}"
    );
}

/// Observe mode runs the same machine: every attempt goes out, what enforce mode would
/// shed is counted, and the breaker opens at the same attempt.
#[test]
fn observe_mode_counts_what_the_breaker_would_shed() {
    let ns = Netns::new("cgbrko");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    let cg = Cgroup::new("brko");
    let addr = "127.0.0.1:9302";
    let d = Daemon::builder(policy(
        &cg,
        Mode::Observe,
        "127.0.0.1",
        9302,
        Breaker::new().min_samples(20),
    ))
    .start();
    let before = ns.active_opens();
    let out = connects(&cg, &ns, addr, 30, None);
    assert_eq!(out.errors("ECONNREFUSED"), 30, "{out:?}");
    assert_eq!(ns.active_opens() - before, 30, "observe sends every SYN");
    let s = d.scope("s");
    let dst = destination(&s, addr);
    assert_eq!(
        (
            dst.counts.shed,
            dst.counts.would_shed,
            dst.counts.breaker_limited,
            dst.counts.breaker_opened
        ),
        (0, 10, 10, 1),
        "{dst:?}"
    );
    assert_eq!(transitions(&d.events()), ["breaker_opened"]);
}

/// A black hole: connects abandoned at their own 200 ms timeout are failures; after 5
/// the breaker sheds the rest at once.
#[test]
fn a_breaker_opens_on_timeouts() {
    let ns = Netns::with_blackhole("cgbrkt");
    let cg = Cgroup::new("brkt");
    let d = Daemon::builder(policy(
        &cg,
        Mode::Enforce,
        "192.0.2.2",
        80,
        Breaker::new().min_samples(5),
    ))
    .start();
    let out = connects(&cg, &ns, "192.0.2.2:80", 25, Some(200));
    assert_eq!(
        (out.errors("TIMEOUT"), out.errors("ECONNREFUSED")),
        (5, 20),
        "{out:?}"
    );
    let b = breaker(&d, "192.0.2.2:80");
    assert_eq!(b.as_ref().map(|b| b.state.as_str()), Some("open"), "{b:?}");
}

/// Handshakes slower than `slow_connect_ms`: nftables in the namespace drops every
/// other SYN to the port, so each connect's first SYN is lost and its retransmission,
/// a second later (TCP_TIMEOUT_INIT), connects, as on a lossy path or past a full SYN
/// queue. (The host kernels here have no netem qdisc to delay packets with.) After 5
/// slow ones the breaker opens on `slow_ratio`, though every one connected.
#[test]
fn a_breaker_opens_on_slow_handshakes() {
    let ns = Netns::new("cgbrks");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    ns.exec("nft", &["add", "table", "inet", "cgslow"]);
    ns.exec(
        "nft",
        &[
            "add",
            "chain",
            "inet",
            "cgslow",
            "input",
            "{ type filter hook input priority 0; }",
        ],
    );
    ns.exec(
        "nft",
        &[
            "add",
            "rule",
            "inet",
            "cgslow",
            "input",
            "tcp",
            "dport",
            "9303",
            "tcp",
            "flags",
            "&",
            "(syn|ack)",
            "==",
            "syn",
            "numgen",
            "inc",
            "mod",
            "2",
            "==",
            "0",
            "drop",
        ],
    );
    let outside = Cgroup::new("brksl");
    let _listener = outside.hold(Probe::listen(
        ns.path(),
        "127.0.0.1:9303".parse().unwrap(),
        1024,
    ));
    let cg = Cgroup::new("brks");
    let d = Daemon::builder(policy(
        &cg,
        Mode::Enforce,
        "127.0.0.1",
        9303,
        Breaker::new()
            .min_samples(5)
            .slow_connect_ms(500)
            .slow_ratio(0.5),
    ))
    .start();
    let out = connects(&cg, &ns, "127.0.0.1:9303", 10, None);
    assert_eq!((out.ok, out.errors("ECONNREFUSED")), (5, 5), "{out:?}");
    let b = breaker(&d, "127.0.0.1:9303");
    assert_eq!(b.as_ref().map(|b| b.state.as_str()), Some("open"), "{b:?}");
    let opened = opened(&d, 0);
    assert_eq!(
        (opened.ended, opened.slow, opened.failures),
        (Some(5), Some(5), Some(0)),
        "{opened:?}"
    );
}

/// A retry storm from a client not written here: 20 curl processes at once, each
/// retrying a refused connection 5 times a second apart, against a closed port. Without
/// a breaker all 120 attempts would send a SYN; with one (10 samples, open 60 s), those
/// admitted before the 10th refusal do (10, and at most one more for each other curl
/// then connecting), and every later one fails at once.
#[test]
fn a_curl_retry_storm_stays_under_the_breaker() {
    let ns = Netns::new("cgbrkc");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    let cg = Cgroup::new("brkc");
    let d = Daemon::builder(policy(
        &cg,
        Mode::Enforce,
        "127.0.0.1",
        9304,
        Breaker::new().min_samples(10).open_for("60s"),
    ))
    .start();
    let before = ns.active_opens();
    let curls: Vec<_> = (0..20)
        .map(|_| {
            cg.command("ip")
                .args(["netns", "exec", &ns.name, "curl", "-s", "-o", "/dev/null"])
                .args(["--retry", "5", "--retry-connrefused", "--retry-delay", "1"])
                .arg("http://127.0.0.1:9304/")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("run curl (cargo xtask setup installs it)")
        })
        .collect();
    for mut c in curls {
        let status = c.wait().unwrap();
        assert!(!status.success(), "curl reached a closed port");
    }
    let syns = ns.active_opens() - before;
    assert!(
        (10..=29).contains(&syns),
        "{syns} SYNs sent by 120 attempts"
    );
    let s = d.scope("s");
    let dst = destination(&s, "127.0.0.1:9304");
    assert_eq!(
        (dst.counts.admitted, dst.counts.shed),
        (syns, 120 - syns),
        "{dst:?}"
    );
}
