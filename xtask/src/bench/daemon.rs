//! The daemon's own figures: how soon a recreated cgroup is governed, what `stats` and a
//! scrape cost with many destinations, the listener watcher's period meanwhile, `ports`
//! next to `ss`, and its memory and CPU idle and under churn.
use std::{
    collections::BTreeMap,
    io::{Read, Write},
    net::SocketAddr,
    process::{Command, Output},
    time::{Duration, Instant},
};

use anyhow::Context;
use connguard_api::{
    control::Request,
    policy::{Mode, Policy, Scope},
    stats::Snapshot,
};
use connguard_tests::{
    BPF_CGROUP_INET_SOCK_RELEASE, BPF_CGROUP_INET4_CONNECT, Cgroup, Daemon, Probe,
    attached_programs, listener_guard, wait_attached,
};

use super::{
    Sizes,
    report::{DaemonUsage, Monitoring, Period, PortsOneShot, Recreation, Usage},
    testbed::{PORT, REFUSAL_PORT, Testbed},
};

/// The audit period of `connguard run` as shipped (its default, `--audit`): the tests'
/// daemons audit every second, which would be measured as the daemon's own idle CPU.
/// The daemons measured here audit as shipped, and the figures wait for an audit of
/// their destinations: the peak memory after one, the idle CPU over a window that
/// holds one.
pub const AUDIT_PERIOD: Duration = Duration::from_secs(30);
const SHIPPED_AUDIT: &[&str] = &["--audit", "30"];

/// Selected cgroups removed and created again, for the window to governed.
const RECREATIONS: usize = 100;
/// Repetitions of each one-shot command (stats, scrape, ports, ss), alternated.
const ONE_SHOTS: usize = 5;
/// Long enough for the listener watcher's last 256 runs (50 ms apart) to fall in it.
const PERIOD_WINDOW: Duration = Duration::from_secs(14);
/// Clients pulling `stats --json` in a loop while the listener watcher's period is read.
const STATS_CLIENTS: usize = 4;

/// A selected cgroup removed and created again (a service restart), from mkdir to
/// connect4 attached to it (the policy entry is written just before).
pub fn recreation() -> anyhow::Result<Recreation> {
    let parent = Cgroup::new("bench-recreate");
    let _d =
        Daemon::builder(Policy::new().scope(Scope::new("svc", &format!("{}/svc", parent.rel))))
            .start();
    let mut window_us = Vec::new();
    for _ in 0..RECREATIONS {
        let t = Instant::now();
        let svc = parent.child("svc");
        while attached_programs(&svc.path, BPF_CGROUP_INET4_CONNECT) != Some(1) {
            anyhow::ensure!(
                t.elapsed() < Duration::from_secs(5),
                "{} was not attached within 5 s",
                svc.path.display()
            );
        }
        window_us.push(t.elapsed().as_secs_f64() * 1e6);
        // As a service that runs a while: every program attached before it stops.
        wait_attached(&svc, BPF_CGROUP_INET_SOCK_RELEASE);
    }
    Ok(Recreation { window_us })
}

/// `connguard stats --json` (the whole command; decoding its output is the bench's own
/// work, done after) and one GET of /metrics, with many tracked destinations, alternated;
/// the daemon's peak RSS after them; then the listener watcher's period (start to start,
/// 50 ms meant) over its last 256 runs, at rest and while clients pull `stats --json` in
/// a loop.
pub fn monitoring(tb: &Testbed, sizes: &Sizes) -> anyhow::Result<Monitoring> {
    // With a listener guard, so that the listener watcher reads a socket table at every
    // tick (observe mode: nothing is refused).
    let d = Daemon::builder(
        tb.policy
            .clone()
            .listener(listener_guard(&tb.ns, Mode::Observe)),
    )
    .metrics()
    .args(SHIPPED_AUDIT)
    .start();
    // The daemon audits at its start, then every AUDIT_PERIOD.
    let started = Instant::now();
    tb.spray(sizes.many_destinations)?;
    let (mut stats_ms, mut scrape_ms, mut destinations) = (Vec::new(), Vec::new(), 0);
    for _ in 0..ONE_SHOTS {
        let t = Instant::now();
        let out = d.cli(&["stats", "--json"]);
        stats_ms.push(ms(t));
        anyhow::ensure!(out.status.success(), "connguard stats --json failed");
        destinations = serde_json::from_slice::<Snapshot>(&out.stdout)?
            .scopes
            .first()
            .map_or(0, |s| s.destinations.len());
        let t = Instant::now();
        d.metrics();
        scrape_ms.push(ms(t));
    }
    std::thread::sleep((AUDIT_PERIOD + Duration::from_secs(1)).saturating_sub(started.elapsed()));
    let peak_rss_mib = memory_mib(d.pid(), "VmHWM")?;
    std::thread::sleep(PERIOD_WINDOW);
    let period_at_rest = listener_period(&d)?;
    let stats_answered = stats_load(&d, STATS_CLIENTS, PERIOD_WINDOW)?;
    let period_under_load = listener_period(&d)?;
    Ok(Monitoring {
        destinations,
        stats_ms,
        scrape_ms,
        peak_rss_mib,
        period_at_rest,
        period_under_load,
        stats_answered,
        load_clients: STATS_CLIENTS,
        load_window_s: PERIOD_WINDOW.as_secs(),
    })
}

/// The listener watcher's period figures from the daemon's stats (asked for without
/// destinations, so that asking adds no load).
fn listener_period(d: &Daemon) -> anyhow::Result<Period> {
    let mut c = std::os::unix::net::UnixStream::connect(&d.socket)?;
    c.write_all(format!("{}\n", Request::Stats { top: Some(0) }).as_bytes())?;
    let mut text = String::new();
    c.read_to_string(&mut text)?;
    let stats: Snapshot = serde_json::from_str(&text)?;
    let job = stats
        .job("listener_watch")
        .context("no listener_watch job in the daemon's stats")?;
    Ok(Period {
        p50_ms: job.period_p50_ms,
        p99_ms: job.period_p99_ms,
        max_ms: job.period_max_ms,
    })
}

/// `clients` threads running `connguard stats --json` back to back for `window`; how
/// many answers came, every one a whole document.
fn stats_load(d: &Daemon, clients: usize, window: Duration) -> anyhow::Result<u64> {
    let until = Instant::now() + window;
    std::thread::scope(|s| {
        let threads: Vec<_> = (0..clients)
            .map(|_| {
                s.spawn(|| -> anyhow::Result<u64> {
                    let mut n = 0;
                    while Instant::now() < until {
                        let out = d.cli(&["stats", "--json"]);
                        anyhow::ensure!(
                            out.status.success() && out.stdout.trim_ascii_end().ends_with(b"}"),
                            "connguard stats --json failed under load"
                        );
                        n += 1;
                    }
                    Ok(n)
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("stats client"))
            .sum()
    })
}

/// `connguard ports` with many TIME_WAIT entries, next to `ss` listing them; both enter
/// the namespace themselves (setns), alternated, and the count is ss's.
pub fn ports(tb: &Testbed, sizes: &Sizes) -> anyhow::Result<PortsOneShot> {
    for port in [PORT, REFUSAL_PORT] {
        tb.client.probe(Probe::Churn {
            netns: tb.ns.path(),
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            count: sizes.time_wait as u64 / 2,
            per_second: 0,
            reset: false,
        });
    }
    let mut ports = Command::new(connguard_tests::connguard_bin());
    ports.args(["ports", "--json", "--socket", "/nonexistent", "--netns"]);
    ports.arg(tb.ns.path());
    let mut ss = Command::new("nsenter");
    ss.arg(format!("--net={}", tb.ns.path()))
        .args(["ss", "-tanH", "state", "time-wait"]);
    let mut report = PortsOneShot {
        time_wait: 0,
        ports_ms: Vec::new(),
        ss_ms: Vec::new(),
    };
    for _ in 0..ONE_SHOTS {
        report.ports_ms.push(timed(&mut ports)?.0);
        let (t, out) = timed(&mut ss)?;
        report.ss_ms.push(t);
        report.time_wait = out
            .stdout
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .count();
    }
    Ok(report)
}

/// The daemon's memory and CPU, idle and under churn, with the churns' destinations
/// tracked.
pub fn usage(tb: &Testbed, sizes: &Sizes) -> anyhow::Result<DaemonUsage> {
    let d = Daemon::builder(&tb.policy).args(SHIPPED_AUDIT).start();
    tb.spray(sizes.destinations)?;
    let idle = measure_usage(d.pid(), sizes.idle_window, || {
        std::thread::sleep(Duration::from_millis(100));
        Ok(())
    })?;
    let churn = measure_usage(d.pid(), sizes.usage_window, || {
        tb.churn(&tb.client, sizes.connections, PORT, false)
            .map(drop)
    })?;
    Ok(DaemonUsage { idle, churn })
}

/// Resident memory (MiB) and CPU share (% of one core, from the scheduler's
/// nanoseconds, summed over its threads) of a process while `work` runs again and again
/// for `secs`.
fn measure_usage(
    pid: i32,
    secs: Duration,
    mut work: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<Usage> {
    // Each thread's run time in ns (/proc/PID/task/TID/schedstat): the daemon works on
    // tokio's threads. A thread that ends within the window loses its share.
    let cpu_ns = || -> anyhow::Result<BTreeMap<String, f64>> {
        let mut out = BTreeMap::new();
        for task in std::fs::read_dir(format!("/proc/{pid}/task"))?.flatten() {
            let path = task.path().join("schedstat");
            if let Some(ns) = std::fs::read_to_string(&path)
                .ok()
                .and_then(|t| t.split_whitespace().next()?.parse().ok())
            {
                out.insert(task.file_name().to_string_lossy().into_owned(), ns);
            }
        }
        anyhow::ensure!(!out.is_empty(), "no threads of {pid}");
        Ok(out)
    };
    let (c0, t0) = (cpu_ns()?, Instant::now());
    while t0.elapsed() < secs {
        work()?;
    }
    let (c1, elapsed) = (cpu_ns()?, t0.elapsed().as_secs_f64());
    let used: f64 = c1
        .iter()
        .map(|(tid, ns)| ns - c0.get(tid).copied().unwrap_or(0.0))
        .sum();
    Ok(Usage {
        rss_mib: memory_mib(pid, "VmRSS")?,
        cpu_percent: used / 1e9 / elapsed * 100.0,
        seconds: elapsed,
    })
}

/// A memory figure of /proc/PID/status (VmRSS: resident now, VmHWM: resident at most),
/// in MiB.
fn memory_mib(pid: i32, field: &str) -> anyhow::Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("no {field} in /proc/{pid}/status"))?;
    Ok(kib / 1024.0)
}

/// Runs `cmd` to success; its wall time in ms and its output.
fn timed(cmd: &mut Command) -> anyhow::Result<(f64, Output)> {
    let t = Instant::now();
    let out = cmd.output().with_context(|| format!("{cmd:?}"))?;
    let elapsed = ms(t);
    anyhow::ensure!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok((elapsed, out))
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1000.0
}
