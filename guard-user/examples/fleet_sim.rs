//! Many virtual hosts sharing one fleet budget through a real etcd, in one process:
//! how long shares take to converge, what each host writes to etcd, and what etcd
//! spends, for docs/fleet.md.
//!
//! `cargo run --release -p connguard --example fleet_sim -- [HOSTS] [TOTAL] [REFRESH_MS] [TTL_S]` (defaults 300, 3000, 2000, 10).
//! Phases: all hosts join at once with random demands; a steady stretch; a tenth of
//! the hosts double their demand; a tenth die (their leases left to expire).
use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use connguard::fleet::{
    Claimant, fair_shares,
    sim::{self, Ledger, VirtualHost},
};
use connguard_tests::etcd::Etcd;

struct Args {
    hosts: usize,
    total: u64,
    refresh: Duration,
    ttl: Duration,
}

fn args() -> Args {
    let a: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().unwrap_or_else(|_| panic!("{a}: not a number")))
        .collect();
    let at = |i: usize, default: u64| a.get(i).copied().unwrap_or(default);
    Args {
        hosts: at(0, 300) as usize,
        total: at(1, 3000),
        refresh: Duration::from_millis(at(2, 2000)),
        ttl: Duration::from_secs(at(3, 10)),
    }
}

/// A deterministic spread of demands: most hosts want little, some want much.
fn demand(i: usize, total: u64, hosts: usize) -> u64 {
    let mean = (total / hosts as u64).max(1);
    let x = (i as u64).wrapping_mul(2_654_435_761) % 100;
    match x {
        0..=49 => mean / 2,
        50..=89 => mean,
        _ => mean * 4,
    }
}

/// What etcd has done so far.
#[derive(Clone, Copy)]
struct Etcd0 {
    at: Instant,
    revision: i64,
    cpu: f64,
    sent: f64,
    received: f64,
}

fn sample(etcd: &Etcd) -> Etcd0 {
    Etcd0 {
        at: Instant::now(),
        revision: etcd.revision(),
        cpu: etcd.metric("process_cpu_seconds_total"),
        sent: etcd.metric("etcd_network_client_grpc_sent_bytes_total"),
        received: etcd.metric("etcd_network_client_grpc_received_bytes_total"),
    }
}

/// Whether every host holds the fair share of the demand of all: what each wants once
/// it is served (its clients, and a tenth of headroom).
fn converged(hosts: &[VirtualHost], total: u64) -> bool {
    let mut order: Vec<(String, usize)> = hosts
        .iter()
        .enumerate()
        .map(|(i, h)| (h.fleet.status().identity, i))
        .collect();
    order.sort();
    let claimants: Vec<Claimant> = order
        .iter()
        .map(|&(_, i)| {
            let want = hosts[i].local.want();
            Claimant {
                wants: (want + want.div_ceil(10)).min(total),
                weight: 1,
                floor: 0,
            }
        })
        .collect();
    let fair = fair_shares(total, &claimants);
    order
        .iter()
        .zip(fair)
        .all(|(&(_, i), f)| hosts[i].share() == Some(f))
}

async fn until_converged(hosts: &[VirtualHost], total: u64, within: Duration) -> Duration {
    let start = Instant::now();
    while !converged(hosts, total) {
        assert!(start.elapsed() < within, "no convergence within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    start.elapsed()
}

fn writes(hosts: &[VirtualHost]) -> u64 {
    hosts.iter().map(|h| h.fleet.status().writes).sum()
}

fn report(
    phase: &str,
    hosts: usize,
    took: Option<Duration>,
    before: Etcd0,
    after: Etcd0,
    ours: u64,
) {
    let secs = (after.at - before.at).as_secs_f64();
    let committed = after.revision - before.revision;
    println!(
        "| {phase} | {} | {:.1} s | {} | {} | {:.3} | {:.2} | {:.0} | {:.0} |",
        took.map_or("-".into(), |t| format!("{:.2} s", t.as_secs_f64())),
        secs,
        ours,
        committed,
        committed as f64 / secs / hosts as f64,
        (after.cpu - before.cpu) / secs,
        (after.sent - before.sent) / secs / 1024.0,
        (after.received - before.received) / secs / 1024.0,
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let a = args();
    let etcd = Etcd::start();
    let ledger = Arc::new(Ledger::default());
    let slow = a.ttl * 4;
    println!(
        "{} hosts, total {}, refresh {:?}, TTL {:?}",
        a.hosts, a.total, a.refresh, a.ttl
    );
    println!(
        "| phase | converged in | phase length | write attempts | committed writes | \
         writes/s/host | etcd CPU (cores) | etcd sent KiB/s | etcd received KiB/s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");

    let before = sample(&etcd);
    let mut hosts: Vec<VirtualHost> = (0..a.hosts)
        .map(|i| {
            let mut config = sim::config(
                &etcd.endpoint(),
                "/sim/",
                &format!("host-{i:05}"),
                "db",
                a.total,
            );
            config.ttl = a.ttl;
            config.refresh = a.refresh;
            VirtualHost::start(config, demand(i, a.total, a.hosts), &ledger)
        })
        .collect();
    // A host whose first session fails (etcd overloaded by the join) tries again.
    for h in &hosts {
        while let Err(e) = h.fleet.synced(slow).await {
            assert!(before.at.elapsed() < slow, "a host does not sync: {e}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let took = until_converged(&hosts, a.total, slow).await;
    let w = writes(&hosts);
    report("join", a.hosts, Some(took), before, sample(&etcd), w);

    let before = sample(&etcd);
    tokio::time::sleep(a.refresh * 5).await;
    let w2 = writes(&hosts);
    report("steady", a.hosts, None, before, sample(&etcd), w2 - w);

    let before = sample(&etcd);
    for (i, h) in hosts.iter().enumerate().filter(|(i, _)| i % 10 == 0) {
        h.local.set_want(demand(i, a.total, a.hosts) * 2);
    }
    let took = until_converged(&hosts, a.total, slow).await;
    let w3 = writes(&hosts);
    report(
        "a tenth double their demand",
        a.hosts,
        Some(took),
        before,
        sample(&etcd),
        w3 - w2,
    );

    let before = sample(&etcd);
    let mut i = 0;
    hosts.retain(|_| {
        i += 1;
        i % 10 != 1
    });
    let w3 = writes(&hosts);
    let took = until_converged(&hosts, a.total, slow).await;
    let w4 = writes(&hosts);
    report(
        "a tenth die",
        hosts.len(),
        Some(took),
        before,
        sample(&etcd),
        w4 - w3,
    );
    println!(
        "largest sum of standing shares: {} of {}; store errors the hosts saw: {}",
        ledger.max_sum(),
        a.total,
        hosts
            .iter()
            .map(|h| h.fleet.status().store_errors)
            .sum::<u64>()
    );
    assert!(ledger.max_sum() <= a.total);
}
