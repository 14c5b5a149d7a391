//! The listener guard's cost per SYN, with per-caller budgets and a table of recent
//! sources (`SOURCES`) holding many callers, next to the same guard without them.
//!
//! SYNs come from spoofed sources (raw segments from the client's namespace), so that
//! each is a caller of its own; the server's namespace routes their SYN-ACKs back to the
//! client's, which drops them: no handshake completes, and every SYN is a new one.
use std::net::{Ipv4Addr, SocketAddr};

use anyhow::Context;
use connguard_api::{
    policy::{Listener, Mode, PerSource, Policy},
    stats::Snapshot,
};
use connguard_tests::{Cgroup, Daemon, Netns, Probe};

use super::{Sizes, report::PerSourceSyn, rounds::BpfStats, testbed::wait_guarded};

/// Rounds, each with both guards, their order alternated.
const ROUNDS: usize = 3;
/// The spoofed sources: a /15 of addresses (131,071 after the first).
const SPOOFED: &str = "10.200.0.0/15";
const SPOOFED_BASE: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 0);
const SPOOFED_SIZE: u64 = (1 << 17) - 1;
/// The per-SYN program whose cost is read.
const PROGRAM: &str = "listener_shed";

/// Per round: the guard with queue limits alone (`max_syn_recv`, never reached), then
/// the same guard with `per_source` budgets (never reached) after spoofed callers
/// filled `SOURCES` to at least `sizes.per_source_callers` (an LRU table evicts before
/// it is full: distinct callers are added a tenth at a time until it holds as many);
/// each timed over `sizes.per_source_syns` SYNs from the callers added last, which it
/// holds, with bpf_stats on.
pub fn run(sizes: &Sizes) -> anyhow::Result<PerSourceSyn> {
    let mut report = PerSourceSyn {
        sources: sizes.per_source_callers,
        syns: sizes.per_source_syns,
        sources_held: Vec::new(),
        queue_limits_ns: Vec::new(),
        per_source_ns: Vec::new(),
    };
    let (server, client) = Netns::veth_pair();
    server.exec("ip", &["route", "add", SPOOFED, "via", "192.0.2.2"]);
    let cg = Cgroup::new("bench-per-source");
    let target: SocketAddr = "192.0.2.1:8080".parse()?;
    let _listener = cg.hold(Probe::listen(server.path(), target, 4096));
    // `count` SYNs from the callers after the first `skip` of SPOOFED.
    let spoof = |skip: u64, count| {
        let first = Ipv4Addr::from(u32::from(SPOOFED_BASE) + skip as u32);
        let out = cg.probe(Probe::Segments {
            netns: client.path(),
            from: format!("{first}/15"),
            addr: target,
            count,
            sport: 0,
            seq: 1,
            rst: false,
        });
        anyhow::ensure!(out.ok == count, "not every SYN was sent: {out:?}");
        Ok(())
    };
    for round in 0..ROUNDS {
        for per_source in [round % 2 == 1, round % 2 == 0] {
            let mut guard = Listener::new("api", [target.port()])
                .netns(&server.path())
                .max_syn_recv(1_000_000)
                .mode(Mode::Enforce);
            if per_source {
                guard = guard.per_source(
                    PerSource::new()
                        .max_connections(100)
                        .rate("50/s")
                        .burst(100),
                );
            }
            let d = Daemon::builder(Policy::new().listener(guard)).start();
            wait_guarded(&d)?;
            // Callers sent so far: the timed SYNs come from the last of them.
            let mut sent = sizes.per_source_syns;
            if per_source {
                sent = sizes.per_source_callers;
                spoof(0, sent)?;
                loop {
                    let held = d.stats().caller_tables.sources;
                    if held >= sizes.per_source_callers {
                        report.sources_held.push(held);
                        break;
                    }
                    let more = (sizes.per_source_callers / 10).min(SPOOFED_SIZE - sent);
                    anyhow::ensure!(
                        more > 0,
                        "SOURCES holds {held} callers after {sent} distinct ones, {} meant",
                        sizes.per_source_callers
                    );
                    spoof(sent, more)?;
                    sent += more;
                }
            }
            let ns = {
                let _stats_on = BpfStats::set(true)?;
                let before = d.stats();
                spoof(sent - sizes.per_source_syns, sizes.per_source_syns)?;
                ns_per_run(&before, &d.stats())?
            };
            eprintln!(
                "bench: per-SYN cost, round {}/{ROUNDS}, {}: {ns:.0} ns",
                round + 1,
                if per_source {
                    "per_source"
                } else {
                    "queue limits alone"
                }
            );
            match per_source {
                true => report.per_source_ns.push(ns),
                false => report.queue_limits_ns.push(ns),
            }
        }
    }
    Ok(report)
}

/// The per-SYN program's ns a run between two snapshots of one daemon.
fn ns_per_run(before: &Snapshot, after: &Snapshot) -> anyhow::Result<f64> {
    let cost = |s: &Snapshot| {
        s.programs
            .iter()
            .find(|p| p.name == PROGRAM)
            .map(|p| (p.run_time_ns, p.run_count))
            .with_context(|| format!("{PROGRAM} is not loaded (the polled program is?)"))
    };
    let ((t0, n0), (t1, n1)) = (cost(before)?, cost(after)?);
    anyhow::ensure!(n1 > n0, "{PROGRAM} did not run");
    Ok((t1 - t0) as f64 / (n1 - n0) as f64)
}
