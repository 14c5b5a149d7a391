//! The churn rounds: every mode in both ways of closing, interleaved with the order
//! rotated each round; in the modes with a daemon, a second churn with bpf_stats on
//! gives each program's cost and runs.
use std::collections::BTreeMap;

use anyhow::Context;
use connguard_api::stats::Snapshot;
use connguard_tests::Daemon;

use super::{
    Sizes,
    report::{Churn, Close, Mode, ProgramRound},
    testbed::{self, CHURN_NFT, COSTS_PORT, Nft, RESET_PORT, Testbed},
};

pub fn run(tb: &Testbed, sizes: &Sizes) -> anyhow::Result<Vec<Churn>> {
    let mut churns: Vec<Churn> = Close::ALL
        .into_iter()
        .flat_map(|close| {
            Mode::ALL.map(|mode| Churn {
                close,
                mode,
                per_s: Vec::new(),
                programs: BTreeMap::new(),
            })
        })
        .collect();
    for round in 0..sizes.rounds {
        for close in Close::ALL {
            // Rotated, so that each mode runs as often in each place of the order.
            for k in 0..Mode::ALL.len() {
                let mode = Mode::ALL[(round + k) % Mode::ALL.len()];
                let churn = churns
                    .iter_mut()
                    .find(|c| c.close == close && c.mode == mode)
                    .context("every close and mode has its churn")?;
                one(tb, sizes, churn)?;
            }
        }
        eprintln!("bench: round {}/{} done", round + 1, sizes.rounds);
    }
    Ok(churns)
}

/// One round of `churn`'s mode and close: its timed churn, and with a daemon, the churn
/// read for program costs.
fn one(tb: &Testbed, sizes: &Sizes, churn: &mut Churn) -> anyhow::Result<()> {
    let reset = churn.close == Close::Reset;
    let (port, costs_port) = match reset {
        true => (RESET_PORT, RESET_PORT),
        false => (testbed::mode_port(churn.mode), COSTS_PORT),
    };
    let n = sizes.connections;
    // Every mode's timed churn follows the same spray of refused connects (which makes
    // the tracked destinations when a daemon runs), so that none is timed on a machine
    // warmer or colder than the others.
    let rate = match churn.mode {
        Mode::NoGuard => {
            tb.spray(sizes.destinations)?;
            tb.churn(&tb.client, n, port, reset)?
        }
        Mode::Nftables => {
            let _nft = Nft::load(&tb.ns, CHURN_NFT)?;
            tb.spray(sizes.destinations)?;
            tb.churn(&tb.client, n, port, reset)?
        }
        mode @ (Mode::Governed | Mode::GovernedWithControls | Mode::Ungoverned) => {
            let (client, policy) = match mode {
                Mode::Ungoverned => (&tb.other, &tb.policy),
                Mode::GovernedWithControls => (&tb.client, &tb.with_controls),
                _ => (&tb.client, &tb.policy),
            };
            let d = Daemon::builder(policy).start();
            tb.spray(sizes.destinations)?;
            let rate = tb.churn(client, n, port, reset)?;
            let _stats_on = BpfStats::set(true)?;
            let before = d.stats();
            tb.churn(client, n, costs_port, reset)?;
            for (name, program) in program_rounds(&before, &d.stats(), n) {
                churn.programs.entry(name).or_default().push(program);
            }
            rate
        }
    };
    churn.per_s.push(rate);
    Ok(())
}

/// Each program's bpf_stats between two snapshots of one daemon, over `connections`.
pub fn program_rounds(
    before: &Snapshot,
    after: &Snapshot,
    connections: usize,
) -> Vec<(String, ProgramRound)> {
    after
        .programs
        .iter()
        .map(|p| {
            let (t0, n0) = before
                .programs
                .iter()
                .find(|b| b.name == p.name)
                .map_or((0, 0), |b| (b.run_time_ns, b.run_count));
            let runs = p.run_count.saturating_sub(n0);
            let round = ProgramRound {
                ns_per_run: (runs > 0)
                    .then(|| p.run_time_ns.saturating_sub(t0) as f64 / runs as f64),
                runs_per_connection: runs as f64 / connections as f64,
            };
            (p.name.clone(), round)
        })
        .collect()
}

/// Sets the kernel's bpf_stats (sysctl kernel.bpf_stats_enabled) until dropped, then
/// restores the previous setting.
pub struct BpfStats(String);

const BPF_STATS: &str = "/proc/sys/kernel/bpf_stats_enabled";

impl BpfStats {
    pub fn set(on: bool) -> anyhow::Result<BpfStats> {
        let before = std::fs::read_to_string(BPF_STATS).context(BPF_STATS)?;
        std::fs::write(BPF_STATS, if on { "1" } else { "0" }).context(BPF_STATS)?;
        Ok(BpfStats(before))
    }
}

impl Drop for BpfStats {
    fn drop(&mut self) {
        let _ = std::fs::write(BPF_STATS, self.0.trim());
    }
}
