//! The performance targets, each a limit on one figure of the report, and the figures
//! themselves: what each reads of a report, in which unit.
use super::{
    figures::median,
    report::{Close, Mode, Report},
};

/// A figure of the report that the targets table shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Figure<'a> {
    /// eBPF ns per connection of `mode`'s traffic: of one program, or of all.
    Ebpf {
        mode: Mode,
        program: Option<&'a str>,
    },
    /// connect4's ns a run with a rate, max_connecting and a breaker less without them:
    /// the median of the rounds' differences.
    ControlsExtra,
    /// The daemon's highest VmHWM/VmRSS seen, MiB.
    PeakRss,
    /// The daemon idle with the tracked destinations, % of one core.
    IdleCpu,
    /// `connguard stats --json`, median ms.
    StatsJson,
    /// One GET of /metrics, median ms.
    Scrape,
    /// `connguard ports`' median time over `ss`' median time.
    PortsToSs,
    /// A selected cgroup created again, mkdir to connect4 attached: p99 µs.
    Recreation,
    /// connect() to ECONNREFUSED over budget: p99 µs.
    Refusal,
    /// A SYN to a saturated guarded listener over veth, until connect() returns: p99 µs.
    InboundRst,
    /// The per-SYN listener program's ns a SYN, median of the rounds: with `per_source`
    /// budgets and their table of recent sources full of callers, or queue limits alone.
    ListenerSyn { per_source: bool },
}

impl Figure<'_> {
    /// Whether the figure has a value for each way of closing.
    pub fn by_close(&self) -> bool {
        matches!(self, Figure::Ebpf { .. } | Figure::ControlsExtra)
    }

    pub fn label(&self) -> String {
        match self {
            Figure::Ebpf {
                mode,
                program: None,
            } => format!("{}: all programs", mode.traffic().unwrap_or(mode.name())),
            Figure::Ebpf {
                program: Some(p), ..
            } => format!("— {p}"),
            Figure::ControlsExtra => {
                "governed with controls: connect4 over governed (per-round median)".into()
            }
            Figure::PeakRss => "daemon's peak RSS".into(),
            Figure::IdleCpu => "daemon's CPU, idle".into(),
            Figure::StatsJson => "`connguard stats --json`".into(),
            Figure::Scrape => "GET /metrics".into(),
            Figure::PortsToSs => "`connguard ports` one-shot, to `ss`".into(),
            Figure::Recreation => "selected cgroup created again: governed after (p99)".into(),
            Figure::Refusal => "outbound refusal at connect() (p99)".into(),
            Figure::InboundRst => "RST from the listener guard over veth (p99)".into(),
            Figure::ListenerSyn { per_source: false } => {
                "listener guard per SYN: queue limits alone".into()
            }
            Figure::ListenerSyn { per_source: true } => {
                "listener guard per SYN: per_source, callers in its table".into()
            }
        }
    }

    pub fn unit(&self) -> &'static str {
        match self {
            Figure::Ebpf { .. } | Figure::ControlsExtra | Figure::ListenerSyn { .. } => "ns",
            Figure::PeakRss => "MiB",
            Figure::IdleCpu => "% of a core",
            Figure::StatsJson | Figure::Scrape => "ms",
            Figure::PortsToSs => "×",
            Figure::Recreation | Figure::Refusal | Figure::InboundRst => "µs",
        }
    }

    /// Decimals worth showing in its unit.
    pub fn decimals(&self) -> usize {
        match self {
            Figure::Ebpf { .. }
            | Figure::ControlsExtra
            | Figure::Recreation
            | Figure::ListenerSyn { .. } => 0,
            Figure::PeakRss | Figure::StatsJson | Figure::Scrape | Figure::Refusal => 1,
            Figure::InboundRst => 1,
            Figure::IdleCpu | Figure::PortsToSs => 2,
        }
    }

    /// Its value in `report`: one for each way of closing (`Close::ALL`'s order) when
    /// `by_close`, else one.
    pub fn values(&self, r: &Report) -> Vec<f64> {
        let closes = |f: &dyn Fn(Close) -> f64| Close::ALL.into_iter().map(f).collect();
        let p99_us = |ns: u64| vec![ns as f64 / 1000.0];
        match *self {
            Figure::Ebpf { mode, program } => closes(&|c| r.ebpf_ns(c, mode, program)),
            Figure::ControlsExtra => closes(&|c| median(&r.controls_extra_ns(c))),
            Figure::PeakRss => vec![r.peak_rss_mib()],
            Figure::IdleCpu => vec![r.daemon.idle.cpu_percent],
            Figure::StatsJson => vec![median(&r.monitoring.stats_ms)],
            Figure::Scrape => vec![median(&r.monitoring.scrape_ms)],
            Figure::PortsToSs => vec![r.ports.ratio_to_ss()],
            Figure::Recreation => vec![r.recreation().map_or(f64::NAN, |p| p.p99)],
            Figure::Refusal => p99_us(r.refusal.connguard.p99_ns),
            Figure::InboundRst => p99_us(r.inbound.connguard.p99_ns),
            Figure::ListenerSyn { per_source } => vec![median(r.per_source_syn.ns(per_source))],
        }
    }
}

/// An upper limit on a figure.
#[derive(Debug)]
pub struct Target {
    pub figure: Figure<'static>,
    pub at_most: f64,
    /// A lower limit worth reaching beyond the target.
    pub stretch: Option<f64>,
    /// The figure counts only when the monitoring daemon tracked at least this many
    /// destinations (a `--quick` run tracks fewer).
    pub at_destinations: Option<usize>,
}

const fn target(figure: Figure<'static>, at_most: f64) -> Target {
    Target {
        figure,
        at_most,
        stretch: None,
        at_destinations: None,
    }
}

const fn governed(program: &'static str) -> Figure<'static> {
    Figure::Ebpf {
        mode: Mode::Governed,
        program: Some(program),
    }
}

/// Where the figures are meant to be. eBPF figures hold for both ways of closing.
pub const TARGETS: &[Target] = &[
    Target {
        stretch: Some(800.0),
        ..target(
            Figure::Ebpf {
                mode: Mode::Governed,
                program: None,
            },
            1200.0,
        )
    },
    target(governed("sock_create"), 300.0),
    // With 1,000 rules and the tracked destinations.
    target(governed("connect4"), 400.0),
    target(Figure::ControlsExtra, 100.0),
    target(
        Figure::Ebpf {
            mode: Mode::Ungoverned,
            program: None,
        },
        100.0,
    ),
    Target {
        at_destinations: Some(100_000),
        ..target(Figure::PeakRss, 64.0)
    },
    target(Figure::IdleCpu, 0.5),
    Target {
        at_destinations: Some(100_000),
        ..target(Figure::StatsJson, 100.0)
    },
    Target {
        at_destinations: Some(100_000),
        ..target(Figure::Scrape, 100.0)
    },
    target(Figure::PortsToSs, 2.0),
    target(Figure::Recreation, 5000.0),
    target(Figure::Refusal, 50.0),
    target(Figure::InboundRst, 2000.0),
];

/// The target on `figure`, if it has one.
pub fn of(figure: &Figure) -> Option<&'static Target> {
    TARGETS.iter().find(|t| t.figure == *figure)
}

/// A target's outcome in one report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Met; with a stretch limit, whether that is met too.
    Met {
        stretch: Option<bool>,
    },
    Missed,
    /// The report's run was smaller than the target's size (`--quick`).
    NotAtSize(usize),
}

impl Target {
    pub fn verdict(&self, r: &Report) -> Verdict {
        if let Some(n) = self.at_destinations
            && r.monitoring.destinations < n
        {
            return Verdict::NotAtSize(n);
        }
        let values = self.figure.values(r);
        let within = |limit: f64| values.iter().all(|v| *v <= limit);
        match within(self.at_most) {
            true => Verdict::Met {
                stretch: self.stretch.map(within),
            },
            false => Verdict::Missed,
        }
    }
}
