//! How fast a refusal comes: connect() over budget on loopback, and a SYN to a
//! saturated listener over veth, next to nftables and to no guard.
use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use connguard_api::policy::{Limited, Mode, Policy, Rule, Scope};
use connguard_tests::{Cgroup, Daemon, Netns, Outcome, Probe};

use super::{
    report::{Inbound, Latency, Refusal},
    testbed::{Nft, REFUSAL_PORT, Testbed, hold_open},
};

/// A budget of 1 connection to 8081, answered with a RST past it.
const SHED_NFT: &str = "chain out {\n    type filter hook output priority 0;\n    \
    tcp dport 8081 ct count over 1 reject with tcp reset\n  }";

/// Every SYN to the saturated listener answered with a RST.
const INPUT_NFT: &str = "chain in {\n    type filter hook input priority 0;\n    \
    tcp dport 8080 reject with tcp reset\n  }";

/// Attempts timed in each refusal.
const ATTEMPTS: u64 = 1000;

/// connect() to ECONNREFUSED when over budget: connguard refuses in the connect hook (no
/// SYN leaves); nftables' `ct count over 1 reject with tcp reset` sends the SYN through
/// the output hook and answers it with a RST.
pub fn at_connect(tb: &Testbed) -> anyhow::Result<Refusal> {
    let connguard = {
        let budget = Rule::default()
            .dst(["127.0.0.1"])
            .ports([REFUSAL_PORT])
            .max_connections(1);
        let _d =
            Daemon::builder(Policy::new().scope(Scope::new("bench", &tb.client.rel).rule(budget)))
                .start();
        over_budget(tb)?
    };
    // Loaded first: conntrack counts only the connections it saw start.
    let nftables = {
        let _nft = Nft::load(&tb.ns, SHED_NFT)?;
        over_budget(tb)?
    };
    Ok(Refusal {
        connguard,
        nftables,
    })
}

/// With one connection to 127.0.0.1:8081 held, `ATTEMPTS` more, each timed to its
/// failure; every one must be refused.
fn over_budget(tb: &Testbed) -> anyhow::Result<Latency> {
    let addr = SocketAddr::from(([127, 0, 0, 1], REFUSAL_PORT));
    let _held = hold_open(&tb.client, &tb.ns, addr, 1)?;
    let out = tb.client.probe(Probe::Shedlat {
        netns: tb.ns.path(),
        addr,
        count: ATTEMPTS,
        timeout_ms: None,
    });
    anyhow::ensure!(
        out.errors("ECONNREFUSED") == ATTEMPTS,
        "not every connect was refused: {out:?}"
    );
    Ok(latency(out))
}

/// A SYN to a saturated listener (listen(8), never accepting, 9 queued) over a veth
/// pair, until the client's connect() returns: connguard's listener guard answers with a
/// RST, as does an nftables `reject with tcp reset` on input; with neither, the SYN is
/// dropped and the client waits on retransmits (the first after the initial RTO of 1 s,
/// then 3 s, ...), here given up after 3 s.
pub fn inbound(tb: &Testbed) -> anyhow::Result<Inbound> {
    let (srv, cli) = Netns::veth_pair();
    let listen_cg = Cgroup::new("bench-listen");
    let target: SocketAddr = "192.0.2.1:8080".parse()?;
    let _listener = listen_cg.hold(Probe::listen(srv.path(), target, 8));
    let _queued = hold_open(&tb.client, &cli, target, 9)?;
    let shedlat = |count| {
        latency(tb.client.probe(Probe::Shedlat {
            netns: cli.path(),
            addr: target,
            count,
            timeout_ms: Some(3000),
        }))
    };
    let no_guard = shedlat(3);
    let connguard = {
        let d = Daemon::builder(connguard_tests::listener_policy(&srv, Mode::Enforce)).start();
        let started = Instant::now();
        while !d.stats().listeners.first().is_some_and(|l| l.shedding) {
            anyhow::ensure!(
                started.elapsed() < Duration::from_secs(5),
                "the listener guard did not engage"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        shedlat(ATTEMPTS)
    };
    let nftables = {
        let _nft = Nft::load(&srv, INPUT_NFT)?;
        shedlat(ATTEMPTS)
    };
    Ok(Inbound {
        connguard,
        nftables,
        no_guard,
    })
}

/// p50 and p99 of the time connect() took to fail, and how the attempts ended.
fn latency(o: Outcome) -> Latency {
    Latency {
        p50_ns: o.category("p50_ns"),
        p99_ns: o.category("p99_ns"),
        attempts: o.attempts,
        ok: o.ok,
        errors: o.errors,
    }
}
