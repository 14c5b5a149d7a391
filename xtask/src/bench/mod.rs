//! `cargo xtask bench`: connguard's cost, measured side by side in one run on a noisy
//! shared machine: interleaved rounds, medians and spread, ratios to no guard, and the
//! kernel's own per-program statistics. Writes what it measured to target/bench.json,
//! prints the report (with the performance targets, met or not) as markdown, and puts it
//! into docs/performance.md (a `--quick` run only when asked).
mod daemon;
mod figures;
mod fleet;
mod listener_cpu;
mod per_source;
mod plot;
mod refusal;
mod render;
mod report;
mod rounds;
mod scaling;
mod targets;
mod testbed;

use std::{path::PathBuf, process::Command, time::Duration};

use anyhow::Context;

use report::{Report, Run};
use testbed::Testbed;

pub struct Options {
    /// Fewer rounds and smaller tables.
    pub quick: bool,
    /// Put a `--quick` run's report into docs/performance.md too.
    pub write: bool,
    /// Render the last run's target/bench.json instead of measuring.
    pub render: bool,
    /// Measure the fleet chaos alone, into the last run's target/bench.json.
    pub fleet_chaos: bool,
    /// Measure the scaling points alone, into the last run's target/bench.json.
    pub scaling: bool,
}

/// The page that holds the report, between its markers.
const PAGE: &str = "docs/performance.md";
const BEGIN: &str = "<!-- bench-report: written by `cargo xtask bench` -->\n";
const END: &str = "<!-- bench-report end -->";

pub fn run(opts: &Options) -> anyhow::Result<()> {
    let path = json_path();
    let last = || -> anyhow::Result<Report> {
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str::<Report>(&text)
            .with_context(|| format!("{} is not a bench report", path.display()))
    };
    let report = match (opts.render, opts.fleet_chaos, opts.scaling) {
        (true, _, _) => last()?,
        (false, true, _) => {
            let mut report = last()?;
            report.fleet_chaos = fleet::chaos(Sizes::new(opts.quick).fleet_chaos)?;
            std::fs::write(&path, serde_json::to_string_pretty(&report)?)?;
            report
        }
        (false, false, true) => {
            let mut report = last()?;
            let _stats_off = rounds::BpfStats::set(false)?;
            report.scaling = scaling::run(&Testbed::new(), &scaling::Sizes::new(opts.quick))?;
            std::fs::write(&path, serde_json::to_string_pretty(&report)?)?;
            report
        }
        (false, false, false) => {
            let report = measure(opts.quick)?;
            std::fs::write(&path, serde_json::to_string_pretty(&report)?)?;
            eprintln!("bench: JSON in {}", path.display());
            report
        }
    };
    let markdown = report.markdown();
    print!("{markdown}");
    if opts.write || !(report.run.quick || opts.quick) {
        crate::write_between_markers(PAGE, BEGIN, END, &markdown)?;
        eprintln!("bench: report written into {PAGE}");
        if let Some(svg) = report.scaling_svg()? {
            let path = crate::root().join(PAGE).with_file_name(plot::FILE);
            std::fs::write(&path, svg).with_context(|| format!("writing {}", path.display()))?;
            eprintln!("bench: scaling plot written into {}", path.display());
        }
    }
    Ok(())
}

/// target/bench.json, or bench.json in CARGO_TARGET_DIR.
fn json_path() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| crate::root().join("target"), PathBuf::from)
        .join("bench.json")
}

/// The sizes of a run: a full one's, or `--quick`'s.
pub struct Sizes {
    /// A multiple of the modes, so that each runs as often in each place of the order.
    rounds: usize,
    /// Connections of each churn.
    connections: usize,
    /// Destinations tracked during the churns and the daemon's usage.
    destinations: usize,
    /// Destinations tracked for `stats` and the scrape.
    many_destinations: usize,
    /// Connections churned for `ports`' TIME_WAIT entries.
    time_wait: usize,
    /// ESTABLISHED connections held for the listener guard's CPU.
    held_connections: u64,
    /// Callers in the per-source table while the per-SYN cost is timed, and the SYNs
    /// timed.
    per_source_callers: u64,
    per_source_syns: u64,
    listener_cpu_window: Duration,
    usage_window: Duration,
    /// The daemon's idle CPU window: a full run's holds one audit (daemon::AUDIT_PERIOD).
    idle_window: Duration,
    /// How long the fleet chaos runs.
    fleet_chaos: Duration,
}

impl Sizes {
    fn new(quick: bool) -> Sizes {
        let modes = report::Mode::ALL.len();
        match quick {
            false => Sizes {
                rounds: 5 * modes,
                connections: 10_000,
                destinations: 10_000,
                many_destinations: 100_000,
                time_wait: 60_000,
                held_connections: 50_000,
                per_source_callers: 100_000,
                per_source_syns: 20_000,
                listener_cpu_window: Duration::from_secs(20),
                usage_window: Duration::from_secs(5),
                idle_window: daemon::AUDIT_PERIOD + Duration::from_secs(2),
                fleet_chaos: Duration::from_secs(300),
            },
            true => Sizes {
                rounds: modes,
                connections: 2000,
                destinations: 2000,
                many_destinations: 10_000,
                time_wait: 10_000,
                held_connections: 10_000,
                per_source_callers: 10_000,
                per_source_syns: 5_000,
                listener_cpu_window: Duration::from_secs(5),
                usage_window: Duration::from_secs(2),
                idle_window: Duration::from_secs(2),
                fleet_chaos: Duration::from_secs(30),
            },
        }
    }
}

/// Every measurement, in an order that keeps each clear of the others' leftovers.
fn measure(quick: bool) -> anyhow::Result<Report> {
    let sizes = Sizes::new(quick);
    let run = Run::here(quick, &sizes)?;
    // Off for every timed figure (it adds two clock reads to each program run), on only
    // while program costs are read; the previous setting comes back at the end.
    let _stats_off = rounds::BpfStats::set(false)?;
    // First: the churns leave TIME_WAIT entries in the kernel's established hash (shared
    // by every namespace), which each of the listener guard's readings walks.
    let listener_guard_cpu = listener_cpu::run(&sizes)?;
    let tb = Testbed::new();
    let churn = rounds::run(&tb, &sizes)?;
    let scaling = scaling::run(&tb, &scaling::Sizes::new(quick))?;
    let cgroup_recreation = daemon::recreation()?;
    let refusal = refusal::at_connect(&tb)?;
    let inbound = refusal::inbound(&tb)?;
    let per_source_syn = per_source::run(&sizes)?;
    let monitoring = daemon::monitoring(&tb, &sizes)?;
    let ports = daemon::ports(&tb, &sizes)?;
    let daemon = daemon::usage(&tb, &sizes)?;
    let fleet_chaos = fleet::chaos(sizes.fleet_chaos)?;
    Ok(Report {
        run,
        churn,
        cgroup_recreation,
        refusal,
        inbound,
        per_source_syn,
        monitoring,
        ports,
        daemon,
        listener_guard_cpu,
        fleet_chaos,
        scaling,
    })
}

impl Run {
    /// This machine, today, at `sizes`.
    fn here(quick: bool, sizes: &Sizes) -> anyhow::Result<Run> {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").context("/proc/cpuinfo")?;
        let field = |name: &str| -> Vec<String> {
            cpuinfo
                .lines()
                .filter_map(|l| {
                    let (key, value) = l.split_once(':')?;
                    (key.trim() == name).then(|| value.trim().to_string())
                })
                .collect()
        };
        Ok(Run {
            quick,
            date: output("date", &["-u", "+%F"]),
            kernel: output("uname", &["-r"]),
            cpus: field("processor").len(),
            cpu_model: field("model name")
                .into_iter()
                .next()
                .unwrap_or_else(|| "?".into()),
            rounds: sizes.rounds,
            connections_per_round: sizes.connections,
            tracked_destinations: sizes.destinations,
        })
    }
}

/// A command's first line of output, or "?".
fn output(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.lines().next().map(str::to_string))
        .unwrap_or_else(|| "?".into())
}
