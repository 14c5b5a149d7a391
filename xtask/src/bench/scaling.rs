//! How a governed connection's cost grows with what connguard holds: the rules of its
//! scope (beside its destination), the destinations tracked, the cgroups governed. A
//! point sets one of them, the others at the base; every pass visits every point, in an
//! order rotated each pass, and each visit starts a daemon of its own (its policy, then a
//! spray of refused connects for its destinations) and reads the programs' costs
//! (bpf_stats on) over churns with reset closes.
use anyhow::Context;
use connguard_api::stats::Snapshot;
use connguard_tests::{Cgroup, Daemon};

use super::{
    report::{Dimension, ScalePoint},
    rounds::{BpfStats, program_rounds},
    testbed::{self, Others, RESET_PORT, Testbed},
};

/// The sizes of each dimension (the base's are `BASE_*`), and how often each is read.
pub struct Sizes {
    pub rules: [u64; 3],
    pub destinations: [u64; 3],
    pub cgroups: [u64; 3],
    pub passes: usize,
    /// Churns read per visit, and their connections.
    pub churns: usize,
    pub connections: usize,
}

impl Sizes {
    pub fn new(quick: bool) -> Sizes {
        match quick {
            false => Sizes {
                rules: [10, 1_000, 10_000],
                destinations: [1_000, 100_000, 1_000_000],
                cgroups: [1, 100, 10_000],
                passes: 3,
                churns: 2,
                connections: 5_000,
            },
            true => Sizes {
                rules: [10, 100, 1_000],
                destinations: [1_000, 10_000, 100_000],
                cgroups: [1, 10, 100],
                passes: 1,
                churns: 1,
                connections: 2_000,
            },
        }
    }

    /// Every point: one dimension at each of its sizes, the others at the base.
    fn points(&self) -> Vec<ScalePoint> {
        let dims = [
            (Dimension::Rules, self.rules),
            (Dimension::Destinations, self.destinations),
            (Dimension::Cgroups, self.cgroups),
        ];
        dims.into_iter()
            .flat_map(|(dimension, sizes)| {
                sizes.map(|size| ScalePoint {
                    dimension,
                    size,
                    connect4_ns: Vec::new(),
                    all_ns: Vec::new(),
                })
            })
            .collect()
    }
}

/// The sizes a point does not set.
pub const BASE_RULES: u64 = 1_000;
pub const BASE_DESTINATIONS: u64 = 10_000;
pub const BASE_CGROUPS: u64 = 1;

/// The cgroups a scope selects with one glob: `n` siblings under a parent, the client
/// in the first. The children go before the parent.
struct Governed {
    children: Vec<Cgroup>,
    parent: Cgroup,
}

impl Governed {
    fn new(n: u64) -> Governed {
        let parent = Cgroup::new("bench-governed");
        let children = (0..n).map(|i| parent.child(&format!("c{i}"))).collect();
        Governed { children, parent }
    }

    fn glob(&self) -> String {
        format!("{}/*", self.parent.rel)
    }
}

pub fn run(tb: &Testbed, sizes: &Sizes) -> anyhow::Result<Vec<ScalePoint>> {
    let mut points = sizes.points();
    let groups: Vec<(u64, Governed)> = sizes
        .cgroups
        .iter()
        .map(|&n| (n, Governed::new(n)))
        .collect();
    // Every daemon makes its map this size, so that every point looks its destination
    // up in a table of one size: room for the most sprayed and the churns' destination.
    let map_size = sizes.destinations.iter().max().copied().unwrap_or(0) + 1;
    let map_size = map_size.next_power_of_two().to_string();
    let n = points.len();
    for pass in 0..sizes.passes {
        // Each pass starts a third of the points further on.
        let first = pass * n / sizes.passes;
        for k in 0..n {
            let point = &mut points[(first + k) % n];
            let (rules, destinations, cgroups) = match point.dimension {
                Dimension::Rules => (point.size, BASE_DESTINATIONS, BASE_CGROUPS),
                Dimension::Destinations => (BASE_RULES, point.size, BASE_CGROUPS),
                Dimension::Cgroups => (BASE_RULES, BASE_DESTINATIONS, point.size),
            };
            let governed = &groups
                .iter()
                .find(|(n, _)| *n == cgroups)
                .context("a cgroup set of every size")?
                .1;
            let client = governed.children.first().context("a governed cgroup")?;
            let rules = u16::try_from(rules).context("at most 65,535 rules")?;
            let policy = testbed::rules(&governed.glob(), rules, Others::Beside, false);
            // Neither an audit nor forgetting idle destinations during the visit.
            let d = Daemon::builder(&policy)
                .args(&["--audit", "3600", "--forget-idle", "86400"])
                .args(&["--max-destinations", &map_size])
                .start();
            tb.spray_from(client, destinations as usize)?;
            let _stats_on = BpfStats::set(true)?;
            // Each churn's snapshot after it is the next one's before.
            let mut before = d.stats();
            holds(&before, destinations, cgroups)?;
            for _ in 0..sizes.churns {
                tb.churn(client, sizes.connections, RESET_PORT, true)?;
                let after = d.stats();
                holds(&after, destinations, cgroups)?;
                let programs = program_rounds(&before, &after, sizes.connections);
                let ns = |name: Option<&str>| -> f64 {
                    programs
                        .iter()
                        .filter(|(n, _)| name.is_none_or(|name| n == name))
                        .map(|(_, p)| p.ns_per_connection())
                        .sum()
                };
                point.connect4_ns.push(ns(Some("connect4")));
                point.all_ns.push(ns(None));
                before = after;
            }
        }
        eprintln!("bench: scaling pass {}/{} done", pass + 1, sizes.passes);
    }
    Ok(points)
}

/// Checks that the daemon holds what the point measures: at least `destinations`
/// tracked, `cgroups` selected, and no connection let through uncounted.
fn holds(snap: &Snapshot, destinations: u64, cgroups: u64) -> anyhow::Result<()> {
    let scope = snap
        .scopes
        .iter()
        .find(|s| s.name == "bench")
        .context("the daemon lists scope bench")?;
    anyhow::ensure!(
        scope.destinations.len() as u64 >= destinations
            && scope.member_count == cgroups
            && snap.internal_errors == 0,
        "the daemon tracks {} destinations of {destinations}, selects {} cgroups of \
         {cgroups}, and let {} connections through uncounted",
        scope.destinations.len(),
        scope.member_count,
        snap.internal_errors
    );
    Ok(())
}
