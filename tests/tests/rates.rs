//! New-connection rates (token buckets) and handshake budgets (`max_connecting`), on
//! real connects from a test cgroup: to a loopback server, and to an address inside a
//! test netns that swallows SYNs.
use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use connguard_api::{
    policy::{Limited, Mode, Per, Policy, Rule, Scope},
    stats::{DestStats, ScopeStats},
};
use connguard_tests::{Cgroup, Daemon, Netns, Outcome, Probe, Server, destination, free_port};

/// A scope `s` over `cg` with the one rule `rule`.
fn policy(cg: &Cgroup, mode: Mode, rule: Rule) -> Policy {
    Policy::new().scope(Scope::new("s", &cg.rel).mode(mode).rule(rule))
}

/// A rule `r` for `dst` (an address) and `port`, whose limits the caller sets (for each
/// endpoint unless it says otherwise).
fn rule(dst: &str, port: u16) -> Rule {
    Rule::new("r").dst([dst]).ports([port])
}

/// What a bucket of `burst` tokens refilled one per `interval_us` admits over attempts
/// that drain it as they come, starting full: the burst, and a token per interval of
/// `refill_us` (the time between the attempts, each pause counted up to the time the
/// bucket takes to fill: Probe::Paced).
fn admissible(burst: u64, interval_us: u64, refill_us: u64) -> u64 {
    burst + refill_us / interval_us
}

/// 1,000 attempts in 100 ms to `addr` against `rate = "100/s"`, `burst = 10` (as
/// `mode`).
fn thousand_in_100ms(mode: Mode, addr: SocketAddr) -> (Outcome, DestStats) {
    let cg = Cgroup::new("rate");
    let d = Daemon::builder(policy(
        &cg,
        mode,
        rule("127.0.0.1", addr.port()).rate("100/s").burst(10),
    ))
    .start();
    let out = cg.probe(Probe::Paced {
        addr,
        count: 1000,
        spread_ms: 100,
        // 10 tokens of 10 ms.
        fill_ms: 100,
    });
    let s = d.scope("s");
    (out, destination(&s, &addr.to_string()).clone())
}

/// Enforced, a rate admits its burst and then one attempt per interval, exactly (± 1 for
/// an attempt that lands on a token's edge); every other attempt fails with
/// ECONNREFUSED at once.
#[test]
fn a_rate_admits_the_burst_and_a_token_per_interval_and_refuses_the_rest_at_once() {
    let server = Server::start("127.0.0.1:0");
    let (out, dst) = thousand_in_100ms(Mode::Enforce, server.addr);
    let want = admissible(10, 10_000, out.category("refill_us"));
    assert!(
        out.ok.abs_diff(want) <= 1,
        "{} admitted, want {want}: {out:?}",
        out.ok
    );
    assert_eq!(out.ok + out.errors("ECONNREFUSED"), 1000, "{out:?}");
    // A refusal is the connect hook's answer, no packet (the kernel counts each as
    // rate-limited below): none waits as long as a SYN retransmit (1 s).
    assert!(out.max_error_us < 1_000_000, "{out:?}");
    assert_eq!(
        (
            dst.counts.admitted,
            dst.counts.shed,
            dst.counts.rate_limited
        ),
        (out.ok, 1000 - out.ok, 1000 - out.ok),
        "{dst:?}"
    );
    assert_eq!(dst.counts.handshake_limited, 0, "{dst:?}");
}

/// Observe mode runs the same bucket: it admits every attempt and counts as would-be
/// shed what enforce mode refuses for the same timing. To a closed port, which the
/// kernel refuses in microseconds: 1,000 connections to a server would come unevenly
/// (an accept queue that overflows stalls a connect for a SYN retransmit, and a bucket
/// holds no more than its burst over a stall).
#[test]
fn observe_mode_counts_what_the_rate_would_refuse() {
    let closed = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let (out, dst) = thousand_in_100ms(Mode::Observe, closed);
    assert_eq!(out.errors("ECONNREFUSED"), 1000, "{out:?}");
    let want = 1000u64.saturating_sub(admissible(10, 10_000, out.category("refill_us")));
    let would = dst.counts.would_shed;
    assert!(
        would.abs_diff(want) <= 1,
        "{would} would_shed, want {want}: {dst:?}"
    );
    assert_eq!(
        (
            dst.counts.shed,
            dst.counts.rate_limited,
            dst.counts.admitted
        ),
        (0, would, 1000),
        "{dst:?}"
    );
}

/// A reload keeps the bucket of a rule that keeps its name: an empty bucket stays empty.
/// A reload to a faster rate leaves it empty, not in debt: the next token comes one new
/// interval later, not after the old rate's.
#[test]
fn a_reload_keeps_the_bucket_and_a_faster_rate_starts_from_empty() {
    let server = Server::start("127.0.0.1:0");
    let addr = server.addr;
    let cg = Cgroup::new("ratereload");
    let slow = rule("127.0.0.1", addr.port()).rate("1/min").burst(2);
    let d = Daemon::builder(policy(&cg, Mode::Enforce, slow.clone())).start();
    let out = cg.probe(Probe::connect(addr, 3, 1));
    assert_eq!((out.ok, out.errors("ECONNREFUSED")), (2, 1), "{out:?}");
    let reload = |rule: Rule, generation: u64| {
        std::fs::write(&d.policy, policy(&cg, Mode::Enforce, rule).to_toml()).unwrap();
        let r = d.reload();
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        assert_eq!(d.stats().policy.generation, generation);
    };
    reload(slow.max_connections(100), 2);
    let out = cg.probe(Probe::connect(addr, 1, 1));
    assert_eq!(
        out.errors("ECONNREFUSED"),
        1,
        "the bucket was refilled: {out:?}"
    );
    reload(rule("127.0.0.1", addr.port()).rate("100/s").burst(1), 3);
    // The first attempt finds the old debt and empties the bucket; 10 ms later a token.
    let until = Instant::now() + Duration::from_secs(2);
    let mut tries = 0;
    loop {
        tries += 1;
        let out = cg.probe(Probe::connect(addr, 1, 1));
        if out.ok == 1 {
            break;
        }
        assert!(
            Instant::now() < until,
            "no token 2 s after a reload to 100/s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(tries <= 3, "{tries} tries");
    let s = d.scope("s");
    let dst = destination(&s, &addr.to_string());
    assert_eq!(dst.counts.admitted, 3, "{dst:?}");
}

/// `max_connecting = 5` against a destination that never answers: of 50 connects at
/// once, exactly 5 wait in SYN_SENT and 45 fail with ECONNREFUSED at once. While they
/// wait, the level with the limit counts 5 `connecting` and the others none: the
/// destination (`per = "endpoint"`, the default), or the rule (`per = "rule"`). When the
/// 5 give up, their handshakes end, and 5 new ones may start.
#[test]
fn max_connecting_lets_five_handshakes_wait_and_refuses_the_rest_at_once() {
    let ns = Netns::with_blackhole("cghs");
    // `connecting` of the destination, the rule and the scope (0 for a destination not
    // listed yet).
    let levels = |s: &ScopeStats| {
        let dst = s
            .destination("192.0.2.2:80")
            .map_or(0, |d| d.counts.connecting);
        (dst, s.rules[0].counts.connecting, s.counts.connecting)
    };
    for (per, waiting_at) in [(Per::Endpoint, (5, 0, 0)), (Per::Rule, (0, 5, 0))] {
        let cg = Cgroup::new("handshakes");
        let d = Daemon::builder(policy(
            &cg,
            Mode::Enforce,
            rule("192.0.2.2", 80).max_connecting(5).per(per),
        ))
        .start();
        for round in 1..=2u64 {
            // The 5 wait 3 s: time to see them counted, in a slow guest too.
            let (out, waiting) = std::thread::scope(|t| {
                let probe = t.spawn(|| {
                    cg.probe(Probe::Handshakes {
                        netns: ns.path(),
                        addr: "192.0.2.2:80".parse().unwrap(),
                        count: 50,
                        timeout_ms: 3000,
                    })
                });
                let waiting =
                    d.wait_scope("s", Duration::from_secs(3), |s| levels(s) == waiting_at);
                (probe.join().unwrap(), waiting)
            });
            assert_eq!(
                levels(&waiting),
                waiting_at,
                "per {per:?}, round {round}: `connecting` of destination, rule and scope \
                 while 5 wait: {waiting:?}"
            );
            assert_eq!(
                (out.errors("TIMEOUT"), out.errors("ECONNREFUSED"), out.ok),
                (5, 45, 0),
                "per {per:?}, round {round}: {out:?}"
            );
            // Each refusal is the connect hook's answer, no SYN sent (the kernel counts
            // them shed below): none waits as long as a SYN retransmit (1 s).
            assert!(out.category("refused_max_us") < 1_000_000, "{out:?}");
            let s = d.wait_scope("s", Duration::from_secs(5), |s| s.counts.active == 0);
            assert_eq!(levels(&s), (0, 0, 0), "per {per:?}, round {round}: {s:?}");
            let dst = destination(&s, "192.0.2.2:80");
            assert_eq!(
                (
                    dst.counts.admitted,
                    dst.counts.shed,
                    dst.counts.handshake_limited,
                    dst.counts.rate_limited
                ),
                (5 * round, 45 * round, 45 * round, 0),
                "per {per:?}, round {round}: {dst:?}"
            );
        }
    }
}

/// A handshake ends when the connection is established: 20 connections held open to a
/// server, one at a time, all admitted under `max_connecting = 1`, none connecting.
#[test]
fn an_established_connection_leaves_the_handshake_budget() {
    let server = Server::start("127.0.0.1:0");
    let cg = Cgroup::new("hsdone");
    let d = Daemon::builder(policy(
        &cg,
        Mode::Enforce,
        rule("127.0.0.1", server.addr.port()).max_connecting(1),
    ))
    .start();
    let held = cg.hold(Probe::hold(server.addr, 20, 1));
    assert_eq!(held.outcome.ok, 20, "{:?}", held.outcome);
    let s = d.scope("s");
    let dst = destination(&s, &server.addr.to_string());
    assert_eq!(
        (dst.counts.active, dst.counts.connecting, dst.counts.shed),
        (20, 0, 0),
        "{dst:?}"
    );
    drop(held);
    let s = d.wait_scope("s", Duration::from_secs(5), |s| s.counts.active == 0);
    let dst = destination(&s, &server.addr.to_string());
    assert_eq!((s.counts.active, dst.counts.connecting), (0, 0), "{s:?}");
}

/// The connect programs carry the code of the controls the first policy uses: a reload
/// that adds a rate to a daemon started without one is rejected, saying to restart, and
/// the policy in force stays.
#[test]
fn a_reload_that_adds_a_control_the_programs_lack_is_rejected() {
    let cg = Cgroup::new("ratelate");
    let budget = rule("127.0.0.1", 9).max_connections(5);
    let d = Daemon::builder(policy(&cg, Mode::Enforce, budget.clone())).start();
    std::fs::write(
        &d.policy,
        policy(&cg, Mode::Enforce, budget.rate("10/s")).to_toml(),
    )
    .unwrap();
    let r = d.reload();
    assert!(!r.status.success());
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(
        err.contains("the policy uses rate, whose code the connect programs were loaded without")
            && err.contains("restart the daemon"),
        "{err}"
    );
    let stats = d.stats();
    assert_eq!(stats.policy.generation, 1, "{stats:?}");
    assert!(
        stats
            .policy
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("restart the daemon")),
        "{stats:?}"
    );
}
