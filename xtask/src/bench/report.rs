//! What one bench run measured, as target/bench.json holds it (every sample, round by
//! round), and the figures the report derives from it: medians, per-round ratios, eBPF
//! ns per connection.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::figures::{Percentiles, Summary, median};

/// How the churn's client closes: after the server's FIN (leaving TIME_WAIT), or at once
/// with SO_LINGER 0 (a RST): a shorter connection, where a fixed cost shows most.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Close {
    Orderly,
    Reset,
}

impl Close {
    pub const ALL: [Close; 2] = [Close::Orderly, Close::Reset];

    pub fn name(self) -> &'static str {
        match self {
            Close::Orderly => "orderly close",
            Close::Reset => "reset close",
        }
    }
}

/// The churn's modes, in the order the report lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// No daemon, no nftables.
    NoGuard,
    /// A daemon whose policy of 1,000 rules governs the churning client.
    Governed,
    /// The same with a rate, a handshake budget and a breaker on the matching rule, none
    /// of them reached.
    GovernedWithControls,
    /// The daemon and policy of `Governed`, the churn from a cgroup no scope selects.
    Ungoverned,
    /// nftables' `ct count over` a budget not reached.
    Nftables,
}

impl Mode {
    pub const ALL: [Mode; 5] = [
        Mode::NoGuard,
        Mode::Governed,
        Mode::GovernedWithControls,
        Mode::Ungoverned,
        Mode::Nftables,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Mode::NoGuard => "no guard",
            Mode::Governed => "connguard",
            Mode::GovernedWithControls => "connguard, rate + max_connecting + breaker",
            Mode::Ungoverned => "connguard, client ungoverned",
            Mode::Nftables => "nftables",
        }
    }

    /// The traffic a daemon mode's program costs are of; None for the modes without a
    /// daemon.
    pub fn traffic(self) -> Option<&'static str> {
        match self {
            Mode::Governed => Some("governed"),
            Mode::GovernedWithControls => Some("governed with controls"),
            Mode::Ungoverned => Some("ungoverned"),
            Mode::NoGuard | Mode::Nftables => None,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    pub run: Run,
    /// One entry per way of closing and mode.
    pub churn: Vec<Churn>,
    pub cgroup_recreation: Recreation,
    pub refusal: Refusal,
    pub inbound: Inbound,
    /// Empty in the JSON of a run before this measurement.
    #[serde(default)]
    pub per_source_syn: PerSourceSyn,
    pub monitoring: Monitoring,
    pub ports: PortsOneShot,
    pub daemon: DaemonUsage,
    pub listener_guard_cpu: ListenerCpu,
    /// Empty in the JSON of a run before this measurement.
    #[serde(default)]
    pub fleet_chaos: FleetChaos,
    /// Empty in the JSON of a run that did not measure it.
    #[serde(default)]
    pub scaling: Vec<ScalePoint>,
}

/// What a scaling point varies (`bench::scaling`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dimension {
    /// Rules in the client's scope.
    Rules,
    /// Destinations tracked in the destination counter map.
    Destinations,
    /// Cgroups the scope selects (one glob over siblings), the client in one of them.
    Cgroups,
}

impl Dimension {
    pub const ALL: [Dimension; 3] = [
        Dimension::Rules,
        Dimension::Destinations,
        Dimension::Cgroups,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Dimension::Rules => "rules in the scope",
            Dimension::Destinations => "tracked destinations",
            Dimension::Cgroups => "governed cgroups",
        }
    }
}

/// One size of one dimension, the others at the base: each churn's eBPF ns per
/// connection (reset closes, bpf_stats on).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScalePoint {
    pub dimension: Dimension,
    pub size: u64,
    pub connect4_ns: Vec<f64>,
    /// Every program.
    pub all_ns: Vec<f64>,
}

/// Fleet chaos (`bench::fleet`): three daemons sharing a budget of 60 through etcd, with
/// 50 clients each, while etcd and the daemons are killed and restarted at random.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FleetChaos {
    pub seconds: u64,
    /// The seed of the run's random choices.
    pub seed: u64,
    pub etcd_restarts: u64,
    pub daemon_kills: u64,
    pub client_restarts: u64,
    /// The server's highest count of connections at once.
    pub server_peak: u64,
}

/// Where and at what size the bench ran.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Run {
    pub quick: bool,
    /// UTC, YYYY-MM-DD.
    pub date: String,
    /// `uname -r`.
    pub kernel: String,
    pub cpus: usize,
    /// /proc/cpuinfo's first `model name`.
    pub cpu_model: String,
    pub rounds: usize,
    pub connections_per_round: usize,
    pub tracked_destinations: usize,
}

/// One mode's churns in one way of closing, round by round.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Churn {
    pub close: Close,
    pub mode: Mode,
    /// Connections a second, timed inside the client with bpf_stats off.
    pub per_s: Vec<f64>,
    /// Each program's bpf_stats over the round's second churn, with bpf_stats on (the
    /// modes with a daemon; empty for the others).
    pub programs: BTreeMap<String, Vec<ProgramRound>>,
}

/// One program over one churn.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct ProgramRound {
    /// run_time_ns / run_cnt over the churn; None when it did not run.
    pub ns_per_run: Option<f64>,
    /// run_cnt over the churn's connections.
    pub runs_per_connection: f64,
}

impl ProgramRound {
    /// Its ns a run times its runs per connection; 0 when it did not run.
    pub fn ns_per_connection(&self) -> f64 {
        self.ns_per_run.unwrap_or(0.0) * self.runs_per_connection
    }
}

/// A program's cost in one mode and way of closing, over the rounds.
pub struct ProgramCost<'a> {
    pub name: &'a str,
    /// Over the rounds it ran in.
    pub ns_per_run: Option<Summary>,
    /// Median over every round.
    pub runs_per_connection: f64,
}

impl ProgramCost<'_> {
    /// Its median cost a run times its median runs per connection.
    pub fn ns_per_connection(&self) -> f64 {
        self.ns_per_run.map_or(0.0, |s| s.median) * self.runs_per_connection
    }
}

/// A selected cgroup removed and created again: from mkdir to connect4 attached to it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Recreation {
    pub window_us: Vec<f64>,
}

/// connect() to ECONNREFUSED on loopback when over budget.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Refusal {
    pub connguard: Latency,
    /// `ct count over 1 reject with tcp reset`.
    pub nftables: Latency,
}

/// A SYN to a saturated listener over veth, until the client's connect() returns.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Inbound {
    /// The listener guard answering with a RST.
    pub connguard: Latency,
    /// `reject with tcp reset` on input.
    pub nftables: Latency,
    /// The SYN dropped; attempts given up after 3 s.
    pub no_guard: Latency,
}

/// The per-SYN listener program's cost (bpf_stats), round by round: a guard with queue
/// limits alone, and the same guard with `per_source` budgets whose table of recent
/// sources holds `sources` callers; SYNs from spoofed sources, none refused.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PerSourceSyn {
    /// Callers put into `SOURCES` before the timed SYNs.
    pub sources: u64,
    /// SYNs timed in each round, from callers already in `SOURCES`.
    pub syns: u64,
    /// `SOURCES` entries before the timed SYNs, per round with `per_source`.
    pub sources_held: Vec<u64>,
    /// ns per SYN.
    pub queue_limits_ns: Vec<f64>,
    pub per_source_ns: Vec<f64>,
}

/// How long connect() took to fail, and how the attempts ended (guard-probe's shedlat).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Latency {
    pub p50_ns: u64,
    pub p99_ns: u64,
    pub attempts: u64,
    pub ok: u64,
    /// Failures by errno name.
    pub errors: BTreeMap<String, u64>,
}

impl Latency {
    /// "1000 ECONNREFUSED": how the attempts ended.
    pub fn ended(&self) -> String {
        let mut parts: Vec<String> = self
            .errors
            .iter()
            .map(|(e, n)| format!("{n} {e}"))
            .collect();
        if self.ok > 0 {
            parts.push(format!("{} connected", self.ok));
        }
        parts.join(", ")
    }
}

/// `connguard stats --json` and a scrape of /metrics with many tracked destinations,
/// and the listener watcher's period meanwhile.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Monitoring {
    /// As `stats --json` listed them.
    pub destinations: usize,
    /// The whole command, its output not decoded.
    pub stats_ms: Vec<f64>,
    pub scrape_ms: Vec<f64>,
    /// VmHWM after them.
    pub peak_rss_mib: f64,
    pub period_at_rest: Period,
    pub period_under_load: Period,
    /// `stats --json` answers to the clients pulling them over `load_window_s`.
    pub stats_answered: u64,
    pub load_clients: usize,
    pub load_window_s: u64,
}

/// The listener watcher's period (start to start) over its last runs, from `stats`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Period {
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub max_ms: Option<f64>,
}

/// `connguard ports` one-shot with many TIME_WAIT entries, next to `ss` listing them.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PortsOneShot {
    /// As `ss` counted them.
    pub time_wait: usize,
    pub ports_ms: Vec<f64>,
    pub ss_ms: Vec<f64>,
}

impl PortsOneShot {
    /// `ports`' median time over `ss`' median time.
    pub fn ratio_to_ss(&self) -> f64 {
        median(&self.ports_ms) / median(&self.ss_ms).max(0.001)
    }
}

/// The daemon's memory and CPU, idle and under churn.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DaemonUsage {
    pub idle: Usage,
    pub churn: Usage,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Usage {
    /// VmRSS at the end.
    pub rss_mib: f64,
    /// Summed over its threads (/proc/PID/task/TID/schedstat), % of one core.
    pub cpu_percent: f64,
    pub seconds: f64,
}

/// The daemon's CPU (utime + stime) with one listener guard, round by round.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ListenerCpu {
    pub connections: u64,
    /// In the guarded namespace with the connections open.
    pub tcp_sockets: u64,
    pub window_s: u64,
    /// % of one core, the guarded namespace holding the listener alone.
    pub alone: Vec<f64>,
    /// % of one core, with the ESTABLISHED connections too.
    pub established: Vec<f64>,
}

impl PerSourceSyn {
    /// ns per SYN of each round, with `per_source` or with queue limits alone.
    pub fn ns(&self, per_source: bool) -> &[f64] {
        match per_source {
            true => &self.per_source_ns,
            false => &self.queue_limits_ns,
        }
    }
}

impl Report {
    /// The churns of `mode` in `close`.
    pub fn churn(&self, close: Close, mode: Mode) -> &Churn {
        self.churn
            .iter()
            .find(|c| c.close == close && c.mode == mode)
            .unwrap_or_else(|| panic!("the report has no {} {} churn", close.name(), mode.name()))
    }

    /// Each round's rate over the same round's rate without a guard: steadier than the
    /// ratio of medians when the machine's load drifts between rounds.
    pub fn ratio_to_no_guard(&self, close: Close, mode: Mode) -> Vec<f64> {
        let base = &self.churn(close, Mode::NoGuard).per_s;
        self.churn(close, mode)
            .per_s
            .iter()
            .zip(base)
            .map(|(r, b)| r / b)
            .collect()
    }

    /// The time one connection takes without a guard, ns: from the median rate.
    pub fn connection_ns_without_guard(&self, close: Close) -> f64 {
        1e9 / median(&self.churn(close, Mode::NoGuard).per_s).max(1.0)
    }

    /// Each program's cost in `mode`'s traffic, by name.
    pub fn programs(&self, close: Close, mode: Mode) -> Vec<ProgramCost<'_>> {
        self.churn(close, mode)
            .programs
            .iter()
            .map(|(name, rounds)| {
                let ns: Vec<f64> = rounds.iter().filter_map(|r| r.ns_per_run).collect();
                let runs: Vec<f64> = rounds.iter().map(|r| r.runs_per_connection).collect();
                ProgramCost {
                    name,
                    ns_per_run: Summary::of(&ns),
                    runs_per_connection: median(&runs),
                }
            })
            .collect()
    }

    /// eBPF ns per connection in `mode`'s traffic: of `program`, or of all programs.
    pub fn ebpf_ns(&self, close: Close, mode: Mode, program: Option<&str>) -> f64 {
        self.programs(close, mode)
            .iter()
            .filter(|p| program.is_none_or(|name| p.name == name))
            .map(ProgramCost::ns_per_connection)
            .sum()
    }

    /// connect4's ns a run with a rate, max_connecting and a breaker on the matching
    /// rule less its ns a run without them, round by round (each round runs both).
    pub fn controls_extra_ns(&self, close: Close) -> Vec<f64> {
        let connect4 = |mode| -> Vec<Option<f64>> {
            self.churn(close, mode)
                .programs
                .get("connect4")
                .map(|rounds| rounds.iter().map(|r| r.ns_per_run).collect())
                .unwrap_or_default()
        };
        connect4(Mode::GovernedWithControls)
            .into_iter()
            .zip(connect4(Mode::Governed))
            .filter_map(|(with, without)| Some(with? - without?))
            .collect()
    }

    /// p99 of the recreated cgroup's window to governed, µs.
    pub fn recreation(&self) -> Option<Percentiles> {
        Percentiles::of(&self.cgroup_recreation.window_us)
    }

    /// The daemon's highest resident memory: its peak with many destinations, or its
    /// idle RSS if that is higher.
    pub fn peak_rss_mib(&self) -> f64 {
        self.monitoring.peak_rss_mib.max(self.daemon.idle.rss_mib)
    }
}

#[cfg(test)]
pub mod sample {
    use super::*;

    fn latency(p50_ns: u64, p99_ns: u64, error: &str, n: u64) -> Latency {
        Latency {
            p50_ns,
            p99_ns,
            attempts: n,
            ok: 0,
            errors: [(error.to_string(), n)].into(),
        }
    }

    /// A full run's report with made-up figures: 3 rounds, every mode; the governed
    /// programs cost `governed_ns` a run each.
    pub fn report(governed_ns: f64) -> Report {
        let programs = |mode: Mode, close: Close| -> BTreeMap<String, Vec<ProgramRound>> {
            let runs = |name: &str| match (mode, name) {
                (Mode::NoGuard | Mode::Nftables, _) => None,
                (_, "sock_set_state") => Some(if close == Close::Reset { 7.6 } else { 10.0 }),
                (Mode::Ungoverned, _) | (_, "connect6") => Some(0.0),
                _ => Some(1.0),
            };
            ["connect4", "connect6", "sock_create", "sock_set_state"]
                .into_iter()
                .filter_map(|name| {
                    let runs = runs(name)?;
                    let extra = if mode == Mode::GovernedWithControls {
                        40.0
                    } else {
                        0.0
                    };
                    let round = |i: u32| ProgramRound {
                        ns_per_run: (runs > 0.0).then_some(governed_ns + extra + f64::from(i)),
                        runs_per_connection: runs,
                    };
                    Some((name.to_string(), (0..3).map(round).collect()))
                })
                .collect()
        };
        let churn = Close::ALL
            .into_iter()
            .flat_map(|close| {
                Mode::ALL.map(|mode| Churn {
                    close,
                    mode,
                    per_s: vec![11_048.0, 9_348.5, 10_197.0],
                    programs: programs(mode, close),
                })
            })
            .collect();
        let usage = |rss_mib, cpu_percent| Usage {
            rss_mib,
            cpu_percent,
            seconds: 5.0,
        };
        let period = Period {
            p50_ms: Some(49.9),
            p99_ms: Some(51.5),
            max_ms: None,
        };
        Report {
            run: Run {
                quick: false,
                date: "2026-05-01".into(),
                kernel: "6.18.44".into(),
                cpus: 2,
                cpu_model: "Intel(R) Xeon(R) Processor".into(),
                rounds: 3,
                connections_per_round: 10_000,
                tracked_destinations: 10_000,
            },
            churn,
            cgroup_recreation: Recreation {
                window_us: vec![182.0, 4155.0, 5708.0],
            },
            refusal: Refusal {
                connguard: latency(1_600, 2_000, "ECONNREFUSED", 1000),
                nftables: latency(11_300, 32_700, "ECONNREFUSED", 1000),
            },
            inbound: Inbound {
                connguard: latency(16_900, 48_100, "ECONNREFUSED", 1000),
                nftables: latency(18_000, 46_100, "ECONNREFUSED", 1000),
                no_guard: latency(3_002_159_900, 3_002_208_300, "TIMEOUT", 3),
            },
            fleet_chaos: FleetChaos {
                seconds: 300,
                seed: 7,
                etcd_restarts: 20,
                daemon_kills: 19,
                client_restarts: 21,
                server_peak: 60,
            },
            scaling: Dimension::ALL
                .into_iter()
                .flat_map(|dimension| {
                    [10, 1_000, 100_000].map(|size| ScalePoint {
                        dimension,
                        size,
                        connect4_ns: vec![300.0, 310.0, 290.0],
                        all_ns: vec![1_500.0, 1_520.0, 1_480.0],
                    })
                })
                .collect(),
            per_source_syn: PerSourceSyn {
                sources: 100_000,
                syns: 20_000,
                sources_held: vec![100_000; 3],
                queue_limits_ns: vec![310.6, 295.0, 330.2],
                per_source_ns: vec![702.4, 688.9, 741.0],
            },
            monitoring: Monitoring {
                destinations: 100_000,
                stats_ms: vec![217.8, 176.0, 239.5],
                scrape_ms: vec![88.0, 79.5, 141.7],
                peak_rss_mib: 169.0,
                period_at_rest: period,
                period_under_load: period,
                stats_answered: 96,
                load_clients: 4,
                load_window_s: 14,
            },
            ports: PortsOneShot {
                time_wait: 45_375,
                ports_ms: vec![84.6, 81.5, 90.9],
                ss_ms: vec![89.5, 88.0, 91.0],
            },
            daemon: DaemonUsage {
                idle: usage(26.7, 0.4),
                churn: usage(26.7, 2.95),
            },
            listener_guard_cpu: ListenerCpu {
                connections: 50_000,
                tcp_sockets: 100_006,
                window_s: 20,
                alone: vec![1.2, 1.3, 1.25],
                established: vec![4.45, 4.9, 4.9],
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_figures() {
        let r = sample::report(100.0);
        // connect4 and sock_create once, sock_set_state 10 times, at the rounds'
        // median of 101 ns a run.
        assert_eq!(
            r.ebpf_ns(Close::Orderly, Mode::Governed, None),
            101.0 * 12.0
        );
        assert_eq!(
            r.ebpf_ns(Close::Reset, Mode::Governed, Some("connect4")),
            101.0
        );
        assert_eq!(r.ebpf_ns(Close::Orderly, Mode::Ungoverned, None), 1010.0);
        assert_eq!(r.controls_extra_ns(Close::Reset), vec![40.0; 3]);
        assert_eq!(
            r.ratio_to_no_guard(Close::Orderly, Mode::Governed),
            vec![1.0; 3]
        );
        let connect6 = r.programs(Close::Orderly, Mode::Governed);
        let connect6 = connect6.iter().find(|p| p.name == "connect6").unwrap();
        assert_eq!(
            (connect6.ns_per_run, connect6.ns_per_connection()),
            (None, 0.0)
        );
    }

    #[test]
    fn the_json_reads_back() {
        let r = sample::report(100.0);
        let text = serde_json::to_string(&r).unwrap();
        let back: Report = serde_json::from_str(&text).unwrap();
        assert_eq!(back.markdown(), r.markdown());
    }
}
