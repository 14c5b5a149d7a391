//! The report as markdown: one method per section, numbers with thousands separators
//! (so that no figure reads as a hex hash), durations in µs or ms.
use std::fmt;

use super::{
    figures::{Percentiles, Summary, median},
    report::{Close, Dimension, Latency, Mode, Period, Report},
    scaling::{BASE_CGROUPS, BASE_DESTINATIONS, BASE_RULES},
    targets::{self, Figure, Target, Verdict},
};

impl Report {
    pub fn markdown(&self) -> String {
        [
            self.heading(),
            self.ebpf_targets().to_string(),
            self.other_targets().to_string(),
            self.churn_table().to_string(),
            self.program_tables(),
            self.scaling_table(),
            self.recreation_table().to_string(),
            self.refusal_tables(),
            self.listener_syn_table().to_string(),
            self.one_shot_table().to_string(),
            self.listener_period_table().to_string(),
            self.daemon_table().to_string(),
            self.listener_cpu_table().to_string(),
            self.fleet_chaos(),
        ]
        .join("\n")
    }

    /// The fleet chaos run, in a sentence (none in a run without it).
    fn fleet_chaos(&self) -> String {
        let f = &self.fleet_chaos;
        if f.seconds == 0 {
            return String::new();
        }
        format!(
            "Fleet chaos, {} s: three daemons sharing a budget of 60 through etcd, 50 clients each, \
             with {} etcd kills and restarts, {} daemon SIGKILLs and restarts and {} restarts of a \
             host's clients (seed {}): the server held at most {} connections at once.\n",
            f.seconds, f.etcd_restarts, f.daemon_kills, f.client_restarts, f.seed, f.server_peak
        )
    }

    fn heading(&self) -> String {
        let r = &self.run;
        format!(
            "#### `cargo xtask bench{}` on {}: kernel {}, {} CPUs ({}); {} rounds of {} connections, {} tracked destinations\n",
            if r.quick { " --quick" } else { "" },
            r.date,
            r.kernel,
            r.cpus,
            r.cpu_model,
            r.rounds,
            num(r.connections_per_round as f64, 0),
            num(r.tracked_destinations as f64, 0),
        )
    }

    /// The eBPF figures against their targets, for each way of closing: governed and
    /// ungoverned traffic, each governed program that ran, the controls' extra cost.
    fn ebpf_targets(&self) -> Table {
        let mut t = Table::new([
            "eBPF ns per connection (bpf_stats on)",
            Close::Orderly.name(),
            Close::Reset.name(),
            "target",
            "",
        ]);
        let governed = |program| Figure::Ebpf {
            mode: Mode::Governed,
            program,
        };
        let costs = Close::ALL.map(|c| self.programs(c, Mode::Governed));
        let mut rows = vec![(governed(None), String::new())];
        for (o, r) in costs[0].iter().zip(&costs[1]) {
            if o.runs_per_connection > 0.0 || r.runs_per_connection > 0.0 {
                let runs = format!(
                    " ({} / {} runs)",
                    num(o.runs_per_connection, 1),
                    num(r.runs_per_connection, 1)
                );
                rows.push((governed(Some(o.name)), runs));
            }
        }
        rows.push((Figure::ControlsExtra, String::new()));
        rows.push((
            Figure::Ebpf {
                mode: Mode::Ungoverned,
                program: None,
            },
            String::new(),
        ));
        for (figure, runs) in rows {
            let values = figure.values(self);
            let mut cells = vec![figure.label() + &runs];
            cells.extend(values.iter().map(|v| num(*v, figure.decimals())));
            cells.extend(self.target_cells(&figure));
            t.row(cells);
        }
        t
    }

    /// The daemon's, the monitoring's and the refusals' figures against their targets.
    fn other_targets(&self) -> Table {
        let mut t = Table::new(["the daemon, monitoring, refusals", "measured", "target", ""]);
        for target in targets::TARGETS.iter().filter(|t| !t.figure.by_close()) {
            let figure = &target.figure;
            let mut measured = with_unit(figure, figure.values(self)[0], Some(figure.decimals()));
            if target.at_destinations.is_some() {
                measured += &format!(
                    " ({} destinations)",
                    num(self.monitoring.destinations as f64, 0)
                );
            }
            let mut cells = vec![figure.label(), measured];
            cells.extend(self.target_cells(figure));
            t.row(cells);
        }
        t
    }

    /// The target on `figure` and its verdict, or two empty cells.
    fn target_cells(&self, figure: &Figure) -> [String; 2] {
        match targets::of(figure) {
            Some(target) => [limit(target), target.verdict(self).to_string()],
            None => Default::default(),
        }
    }

    fn churn_table(&self) -> Table {
        let mut t = Table::new([
            "churn (connections/s)",
            "median",
            "min",
            "max",
            "per-round ratio to no guard: median (min–max)",
        ]);
        for close in Close::ALL {
            for mode in Mode::ALL {
                let ratio = match mode {
                    Mode::NoGuard => "1".into(),
                    _ => Summary::of(&self.ratio_to_no_guard(close, mode)).map_or_else(
                        || "–".into(),
                        |q| format!("{:.3} ({:.3}–{:.3})", q.median, q.min, q.max),
                    ),
                };
                let mut cells = vec![format!("{}: {}", close.name(), mode.name())];
                cells.extend(summary_cells(
                    Summary::of(&self.churn(close, mode).per_s),
                    0,
                ));
                cells.push(ratio);
                t.row(cells);
            }
        }
        t
    }

    /// Per daemon mode, each program's cost a run, its runs per connection and their
    /// product, for both ways of closing; and all programs next to a connection's time.
    fn program_tables(&self) -> String {
        let mut out = String::new();
        for mode in Mode::ALL {
            let Some(traffic) = mode.traffic() else {
                continue;
            };
            let mut t = Table::new([format!("{traffic} (bpf_stats on)")]);
            for close in Close::ALL {
                let c = close.name();
                t.head.extend([
                    format!("{c}: ns/run, median (min–max)"),
                    "runs per connection".into(),
                    "ns per connection".into(),
                ]);
            }
            let costs = Close::ALL.map(|c| self.programs(c, mode));
            let mut idle = Vec::new();
            for (o, r) in costs[0].iter().zip(&costs[1]) {
                if o.runs_per_connection == 0.0 && r.runs_per_connection == 0.0 {
                    idle.push(o.name);
                    continue;
                }
                let mut cells = vec![o.name.to_string()];
                for p in [o, r] {
                    cells.extend([
                        p.ns_per_run.map_or_else(
                            || "–".into(),
                            |s| {
                                format!(
                                    "{} ({}–{})",
                                    num(s.median, 0),
                                    num(s.min, 0),
                                    num(s.max, 0)
                                )
                            },
                        ),
                        num(p.runs_per_connection, 1),
                        num(p.ns_per_connection(), 0),
                    ]);
                }
                t.row(cells);
            }
            let mut all = vec!["all programs".to_string()];
            for close in Close::ALL {
                let (ebpf, conn) = (
                    self.ebpf_ns(close, mode, None),
                    self.connection_ns_without_guard(close),
                );
                all.extend([
                    String::new(),
                    String::new(),
                    format!(
                        "{} ({:.1} % of {} without a guard)",
                        num(ebpf, 0),
                        ebpf / conn * 100.0,
                        num(conn, 0)
                    ),
                ]);
            }
            t.row(all);
            out += &format!("{t}\nNo runs: {}.\n\n", idle.join(", "));
        }
        out += "Runs per connection count every TCP socket of the host while the churn runs, \
                the bench's and any other: a host-wide tracepoint, where the daemon attached one \
                (`host_wide` in stats), runs for all of them. \
                A connection's time without a guard is the inverse of the median rate.\n";
        out
    }

    fn recreation_table(&self) -> Table {
        let mut t = Table::new([
            format!(
                "a selected cgroup removed and created again, {} times: mkdir to connect4 attached",
                self.cgroup_recreation.window_us.len()
            ),
            "p50".into(),
            "p99".into(),
            "max".into(),
        ]);
        let cells = match self.recreation() {
            Some(Percentiles { p50, p99, max, .. }) => [p50, p99, max].map(|us| duration(us * 1e3)),
            None => Default::default(),
        };
        let mut row =
            vec!["inotify event, walk of the new cgroup, policy entry, attach".to_string()];
        row.extend(cells);
        t.row(row);
        t
    }

    fn refusal_tables(&self) -> String {
        let table = |title: &str, rows: [(&str, &Latency); 2]| {
            let mut t = Table::new([title, "p50", "p99", "ended"]);
            for (name, l) in rows {
                t.row([
                    name.to_string(),
                    duration(l.p50_ns as f64),
                    duration(l.p99_ns as f64),
                    l.ended(),
                ]);
            }
            t
        };
        let (out, inbound) = (&self.refusal, &self.inbound);
        let mut syn = table(
            "SYN to a saturated listener over veth, until connect() returns",
            [
                ("connguard listener guard (RST)", &inbound.connguard),
                (
                    "nftables `reject with tcp reset` on input",
                    &inbound.nftables,
                ),
            ],
        );
        syn.row([
            "no guard: SYN dropped, retransmitted; given up after 3 s".to_string(),
            duration(inbound.no_guard.p50_ns as f64),
            duration(inbound.no_guard.p99_ns as f64),
            inbound.no_guard.ended(),
        ]);
        format!(
            "{}\n{syn}",
            table(
                "refusal at connect(), loopback, over budget",
                [
                    ("connguard (no SYN sent)", &out.connguard),
                    (
                        "nftables `ct count over 1 reject with tcp reset`",
                        &out.nftables
                    ),
                ],
            )
        )
    }

    /// The per-SYN program's cost with and without per-caller budgets, and the target
    /// where one is set.
    fn listener_syn_table(&self) -> Table {
        let p = &self.per_source_syn;
        let mut t = Table::new([
            format!(
                "listener guard's per-SYN program, ns a SYN (bpf_stats on): {} SYNs a round from spoofed callers, {} callers in the per-source table",
                num(p.syns as f64, 0),
                num(p.sources as f64, 0)
            ),
            "median".into(),
            "min".into(),
            "max".into(),
            "rounds".into(),
            "target".into(),
            "".into(),
        ]);
        for per_source in [false, true] {
            let figure = Figure::ListenerSyn { per_source };
            let rounds = p.ns(per_source);
            let mut cells = vec![figure.label()];
            cells.extend(round_cells(rounds, figure.decimals()));
            cells.extend(self.target_cells(&figure));
            t.row(cells);
        }
        t
    }

    fn one_shot_table(&self) -> Table {
        let (m, p) = (&self.monitoring, &self.ports);
        let mut t = Table::new([
            format!("one-shot, median of {}", m.stats_ms.len()),
            "ms".into(),
            "min".into(),
            "max".into(),
            "next to".into(),
        ]);
        let destinations = num(m.destinations as f64, 0);
        for (name, samples, next) in [
            (
                format!("`connguard stats --json`, {destinations} destinations"),
                &m.stats_ms,
                String::new(),
            ),
            ("GET /metrics, same".into(), &m.scrape_ms, String::new()),
            (
                format!(
                    "`connguard ports`, {} TIME_WAIT",
                    num(p.time_wait as f64, 0)
                ),
                &p.ports_ms,
                format!(
                    "`ss -tan state time-wait`: {} ms ({:.2}×)",
                    num(median(&p.ss_ms), 1),
                    p.ratio_to_ss()
                ),
            ),
        ] {
            let mut cells = vec![name];
            cells.extend(summary_cells(Summary::of(samples), 1));
            cells.push(next);
            t.row(cells);
        }
        t
    }

    fn listener_period_table(&self) -> Table {
        let m = &self.monitoring;
        let mut t = Table::new([
            "listener watcher period (50 ms meant), last 256 runs",
            "p50 ms",
            "p99 ms",
            "max ms",
        ]);
        let row = |name: String, p: &Period| {
            let mut cells = vec![name];
            cells.extend(
                [p.p50_ms, p.p99_ms, p.max_ms].map(|v| v.map_or("–".into(), |v| num(v, 1))),
            );
            cells
        };
        t.row(row(
            format!(
                "at rest, {} destinations tracked",
                num(m.destinations as f64, 0)
            ),
            &m.period_at_rest,
        ));
        t.row(row(
            format!(
                "{} clients pulling `stats --json` in a loop ({} answers in {} s)",
                m.load_clients, m.stats_answered, m.load_window_s
            ),
            &m.period_under_load,
        ));
        t
    }

    fn daemon_table(&self) -> Table {
        let d = &self.daemon;
        let mut t = Table::new(["daemon", "RSS MiB", "CPU % of a core"]);
        let destinations = num(self.run.tracked_destinations as f64, 0);
        for (phase, u) in [("idle", &d.idle), ("churn", &d.churn)] {
            t.row([
                format!("{phase}, {destinations} destinations, {:.0} s", u.seconds),
                num(u.rss_mib, 1),
                num(u.cpu_percent, 2),
            ]);
        }
        t.row([
            format!(
                "peak (VmHWM) after the one-shots and an audit with {} destinations",
                num(self.monitoring.destinations as f64, 0)
            ),
            num(self.monitoring.peak_rss_mib, 1),
            String::new(),
        ]);
        t
    }

    fn listener_cpu_table(&self) -> Table {
        let l = &self.listener_guard_cpu;
        let mut t = Table::new([
            format!(
                "daemon with a listener guard, {} rounds of {} s: CPU % of a core (utime + stime)",
                l.alone.len(),
                l.window_s
            ),
            "median".into(),
            "min".into(),
            "max".into(),
            "rounds".into(),
        ]);
        for (name, rounds) in [
            (
                "the guarded namespace holds the listener alone".to_string(),
                &l.alone,
            ),
            (
                format!(
                    "the same with {} ESTABLISHED connections ({} TCP sockets)",
                    num(l.connections as f64, 0),
                    num(l.tcp_sockets as f64, 0)
                ),
                &l.established,
            ),
        ] {
            let mut cells = vec![name];
            cells.extend(round_cells(rounds, 2));
            t.row(cells);
        }
        t
    }
}

impl Report {
    /// The scaling points, a row each, and their plot (none in a run without them).
    fn scaling_table(&self) -> String {
        if self.scaling.is_empty() {
            return String::new();
        }
        let churns = self.scaling.first().map_or(0, |p| p.connect4_ns.len());
        let mut t = Table::new([
            format!(
                "governed, reset close, as connguard holds more: eBPF ns per connection \
                 (bpf_stats on), churns a point: {churns}"
            ),
            "size".into(),
            "connect4: median (min–max)".into(),
            "all programs: median (min–max)".into(),
        ]);
        let spread = |v: &[f64]| match Summary::of(v) {
            Some(s) => format!("{} ({}–{})", num(s.median, 0), num(s.min, 0), num(s.max, 0)),
            None => "–".into(),
        };
        for dimension in Dimension::ALL {
            for p in self.scaling.iter().filter(|p| p.dimension == dimension) {
                t.row([
                    dimension.name().to_string(),
                    num(p.size as f64, 0),
                    spread(&p.connect4_ns),
                    spread(&p.all_ns),
                ]);
            }
        }
        format!(
            "{t}\nThe sizes a point does not set: {} rules, {} tracked destinations, {} \
             governed cgroup; every daemon's destination counter map sized for the largest.\n\n\
             ![connect4 and all programs, ns per connection, by size]({})\n",
            num(BASE_RULES as f64, 0),
            num(BASE_DESTINATIONS as f64, 0),
            num(BASE_CGROUPS as f64, 0),
            super::plot::FILE
        )
    }
}

/// A markdown table.
struct Table {
    head: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn new<S: Into<String>>(head: impl IntoIterator<Item = S>) -> Table {
        Table {
            head: head.into_iter().map(Into::into).collect(),
            rows: Vec::new(),
        }
    }

    fn row<S: Into<String>>(&mut self, cells: impl IntoIterator<Item = S>) {
        self.rows.push(cells.into_iter().map(Into::into).collect());
    }
}

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let line = |cells: &[String]| format!("| {} |\n", cells.join(" | "));
        f.write_str(&line(&self.head))?;
        f.write_str(&line(&vec!["---".into(); self.head.len()]).replace(' ', ""))?;
        for row in &self.rows {
            f.write_str(&line(row))?;
        }
        Ok(())
    }
}

/// Median, min and max cells, or dashes for no samples.
fn summary_cells(s: Option<Summary>, decimals: usize) -> [String; 3] {
    match s {
        Some(s) => [s.median, s.min, s.max].map(|v| num(v, decimals)),
        None => ["–", "–", "–"].map(String::from),
    }
}

/// Median, lowest and highest of a figure's rounds, then every round.
fn round_cells(rounds: &[f64], decimals: usize) -> [String; 4] {
    let [median, min, max] = summary_cells(Summary::of(rounds), decimals);
    let each = rounds.iter().map(|v| num(*v, decimals)).collect::<Vec<_>>();
    [median, min, max, each.join(", ")]
}

/// A target's limit in its figure's unit, without trailing zeros: "≤ 1,200 ns (stretch
/// 800)", "≤ 0.5 % of a core".
fn limit(t: &Target) -> String {
    let mut s = format!("≤ {}", with_unit(&t.figure, t.at_most, None));
    if let Some(stretch) = t.stretch {
        s += &format!(" (stretch {})", num(stretch, shortest(stretch)));
    }
    if let Some(n) = t.at_destinations {
        s += &format!(" at {} destinations", num(n as f64, 0));
    }
    s
}

/// A value of `figure` with its unit: "4,624 ns", "0.95×"; without `decimals`, as few
/// as it needs.
fn with_unit(figure: &Figure, v: f64, decimals: Option<usize>) -> String {
    let v = num(v, decimals.unwrap_or_else(|| shortest(v)));
    match figure.unit() {
        "×" => format!("{v}×"),
        unit => format!("{v} {unit}"),
    }
}

/// The fewest decimals (up to 3) that show `v` whole.
fn shortest(v: f64) -> usize {
    (0..3)
        .find(|&d| (v * 10f64.powi(d as i32)).fract() == 0.0)
        .unwrap_or(3)
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Met { stretch: None } => f.write_str("met"),
            Verdict::Met {
                stretch: Some(true),
            } => f.write_str("met, stretch too"),
            Verdict::Met {
                stretch: Some(false),
            } => f.write_str("met (stretch missed)"),
            Verdict::Missed => f.write_str("missed"),
            Verdict::NotAtSize(n) => {
                write!(f, "not measured at {} destinations", num(*n as f64, 0))
            }
        }
    }
}

/// A duration of `ns`, in µs below a millisecond, else in ms: "1.6 µs", "3,002.2 ms".
fn duration(ns: f64) -> String {
    match ns < 1e6 {
        true => format!("{} µs", num(ns / 1e3, 1)),
        false => format!("{} ms", num(ns / 1e6, 1)),
    }
}

/// `x` with `decimals` decimals and its thousands separated by commas: "11,048",
/// "3,002.2"; a dash when it is not a number.
pub fn num(x: f64, decimals: usize) -> String {
    if !x.is_finite() {
        return "–".into();
    }
    let digits = format!("{:.*}", decimals, x.abs());
    let (int, frac) = match digits.split_once('.') {
        Some((i, f)) => (i, format!(".{f}")),
        None => (digits.as_str(), String::new()),
    };
    let mut out = String::new();
    if x < 0.0 && digits.bytes().any(|b| (b'1'..=b'9').contains(&b)) {
        out.push('-');
    }
    for (i, c) in int.chars().enumerate() {
        if i > 0 && (int.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out + &frac
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::report::sample;

    #[test]
    fn numbers_have_separators_and_no_minus_zero() {
        assert_eq!(num(3_002_159.94, 1), "3,002,159.9");
        assert_eq!(num(999.0, 0), "999");
        assert_eq!(num(1000.0, 0), "1,000");
        assert_eq!(num(-40.0, 0), "-40");
        assert_eq!(num(-0.4, 0), "0");
        assert_eq!(num(f64::NAN, 1), "–");
        assert_eq!(duration(1_600.0), "1.6 µs");
        assert_eq!(duration(3_002_159_900.0), "3,002.2 ms");
    }

    #[test]
    fn no_figure_reads_as_a_hash() {
        let hash = regex::Regex::new(r"\b[0-9a-f]{7,12}\b").unwrap();
        let text = sample::report(123_456.0).markdown();
        let found: Vec<&str> = hash.find_iter(&text).map(|m| m.as_str()).collect();
        assert!(found.is_empty(), "{found:?} in\n{text}");
    }

    #[test]
    fn every_target_shows_on_its_row_with_its_verdict() {
        let text = sample::report(100.0).markdown();
        for t in targets::TARGETS {
            let (label, limit) = (t.figure.label(), limit(t));
            assert!(
                text.lines()
                    .any(|l| l.starts_with(&format!("| {label}")) && l.contains(&limit)),
                "no row {label:?} with {limit:?} in\n{text}"
            );
        }
        // 101 ns a run, 12 runs (9.6 with resets): 1,212 ns (970).
        assert!(
            text.contains(
                "| governed: all programs | 1,212 | 970 | ≤ 1,200 ns (stretch 800) | missed |"
            ),
            "{text}"
        );
        assert!(text.contains("| `connguard stats --json` | 217.8 ms (100,000 destinations) | ≤ 100 ms at 100,000 destinations | missed |"), "{text}");
        assert!(
            text.contains("| daemon's CPU, idle | 0.40 % of a core | ≤ 0.5 % of a core | met |"),
            "{text}"
        );
        let cheap = sample::report(50.0).markdown();
        assert!(cheap.contains("| governed: all programs | 612 | 490 | ≤ 1,200 ns (stretch 800) | met, stretch too |"), "{cheap}");
    }

    #[test]
    fn the_per_syn_cost_has_its_rows_with_and_without_per_source() {
        let text = sample::report(100.0).markdown();
        for row in [
            "| listener guard per SYN: queue limits alone | 311 | 295 | 330 | 311, 295, 330 |  |  |",
            "| listener guard per SYN: per_source, callers in its table | 702 | 689 | 741 | 702, 689, 741 |  |  |",
        ] {
            assert!(text.contains(row), "no {row:?} in\n{text}");
        }
        assert!(
            text.contains(
                "20,000 SYNs a round from spoofed callers, 100,000 callers in the per-source table"
            ),
            "{text}"
        );
    }

    #[test]
    fn a_smaller_run_leaves_the_sized_targets_unjudged() {
        let mut r = sample::report(100.0);
        r.monitoring.destinations = 10_000;
        let text = r.markdown();
        assert!(text.contains("| daemon's peak RSS | 169.0 MiB (10,000 destinations) | ≤ 64 MiB at 100,000 destinations | not measured at 100,000 destinations |"), "{text}");
    }
}
