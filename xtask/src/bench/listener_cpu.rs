//! The daemon's CPU with one listener guard, on a namespace holding only the guarded
//! listener and then also many ESTABLISHED connections, whose sockets each of the guard's
//! readings may walk.
use std::{
    net::SocketAddr,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::Context;
use connguard_api::policy::{Listener, Mode, Policy};
use connguard_tests::{Cgroup, Daemon, Holder, Netns, Probe};

use super::{Sizes, output, report::ListenerCpu, testbed::wait_guarded};

/// The listener guard's namespace: the guarded listener (listen(128), accepting), and
/// the servers that hold the established connections, each its share of them.
const GUARDED_PORT: u16 = 9100;
const HOLDING_PORTS: u16 = 9200;
const HOLDERS: u64 = 5;
/// Rounds, each in a namespace and with a daemon of its own.
const ROUNDS: usize = 3;

/// The daemon's CPU (utime + stime of the whole process, its ended threads included)
/// with one listener guard, on a namespace holding only the guarded listener and then
/// also `sizes.held_connections` ESTABLISHED ones (5 servers and 5 clients in it, each
/// with its share: a process may hold 20,000 fds here). The audit is put off past the
/// window (`--audit 3600`): what is left is the listener watcher (a reading every 50 ms)
/// and the daemon's other periodic jobs.
pub fn run(sizes: &Sizes) -> anyhow::Result<ListenerCpu> {
    let connections = sizes.held_connections;
    let window = sizes.listener_cpu_window;
    let mut report = ListenerCpu {
        connections,
        tcp_sockets: 0,
        window_s: window.as_secs(),
        alone: Vec::new(),
        established: Vec::new(),
    };
    for round in 0..ROUNDS {
        let ns = Netns::new("cglcpu");
        ns.exec("ip", &["link", "set", "lo", "up"]);
        // Each client's share from 127.0.0.1 to one server: ports enough, clear of the
        // listeners'.
        ns.exec(
            "sysctl",
            &["-qw", "net.ipv4.ip_local_port_range=10000 65000"],
        );
        let cg = Cgroup::new("bench-listen-cpu");
        let listen = |port: u16, backlog| Probe::Listen {
            netns: ns.path(),
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            backlog,
            accept_after_ms: Some(0),
            on_usr1: false,
        };
        let servers: Vec<SocketAddr> = (0..HOLDERS)
            .map(|i| SocketAddr::from(([127, 0, 0, 1], HOLDING_PORTS + i as u16)))
            .collect();
        let mut listening = vec![listen(GUARDED_PORT, 128)];
        listening.extend(servers.iter().map(|s| listen(s.port(), 4096)));
        let _servers = holders(&cg, &listening, Duration::from_secs(10))?;
        let guard = Listener::new("api", [GUARDED_PORT])
            .netns(&ns.path())
            .accept_queue_watermark(0.8)
            .mode(Mode::Enforce);
        let d = Daemon::builder(Policy::new().listener(guard))
            .args(&["--audit", "3600"])
            .start();
        wait_guarded(&d)?;
        // Past the start's own work (its audit, the first attachments).
        std::thread::sleep(Duration::from_secs(3));
        let alone = process_cpu(d.pid(), window)?;
        let opening: Vec<Probe> = servers
            .iter()
            .map(|&addr| Probe::Open {
                netns: ns.path(),
                addr,
                count: connections / HOLDERS,
                interval_ms: 0,
                timeout_ms: 2000,
            })
            .collect();
        let clients = holders(&cg, &opening, Duration::from_secs(120))?;
        for (c, s) in clients.iter().zip(&servers) {
            anyhow::ensure!(
                c.outcome.ok == connections / HOLDERS,
                "not every connection to {s} opened: {:?}",
                c.outcome
            );
        }
        report.tcp_sockets = tcp_in_use(&ns)?;
        anyhow::ensure!(
            report.tcp_sockets >= 2 * connections,
            "{} TCP sockets in the namespace, {connections} connections meant",
            report.tcp_sockets
        );
        std::thread::sleep(Duration::from_secs(3));
        let established = process_cpu(d.pid(), window)?;
        eprintln!(
            "bench: listener guard CPU, round {}/{ROUNDS}: {alone:.2} % alone, {established:.2} % with {connections} connections",
            round + 1,
        );
        report.alone.push(alone);
        report.established.push(established);
        // The daemon stops first, then the clients and servers with their cgroup.
        drop(d);
    }
    Ok(report)
}

/// guard-probe in `cg` once for each of `runs`, started together, each a mode that prints
/// its outcome and then holds its sockets; every outcome within `within`, or the probes
/// are killed.
fn holders(cg: &Cgroup, runs: &[Probe], within: Duration) -> anyhow::Result<Vec<Holder>> {
    use std::io::BufRead;
    let deadline = Instant::now() + within;
    let mut started = Vec::new();
    for probe in runs {
        let args = probe.args();
        let mut child = cg
            .command(connguard_tests::probe_bin())
            .args(&args)
            .stdout(Stdio::piped())
            .spawn()
            .context("start guard-probe")?;
        let stdout = child.stdout.take().context("guard-probe stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = std::io::BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        started.push((child, rx, args.join(" ")));
    }
    let (mut held, mut failed) = (Vec::new(), None);
    for (mut child, rx, args) in started {
        let wait = match failed {
            Some(_) => Duration::ZERO,
            None => deadline.saturating_duration_since(Instant::now()),
        };
        let outcome = match rx.recv_timeout(wait) {
            Ok(line) => serde_json::from_str(&line)
                .map_err(|e| format!("guard-probe {args} printed {line:?}: {e}")),
            Err(_) => Err(format!(
                "guard-probe {args} gave no outcome within {within:?}"
            )),
        };
        match outcome {
            Ok(outcome) => held.push(Holder { child, outcome }),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                failed.get_or_insert(e);
            }
        }
    }
    match failed {
        Some(e) => anyhow::bail!(e),
        None => Ok(held),
    }
}

/// The TCP sockets of `ns` in its socket tables (`TCP: inuse` of /proc/net/sockstat).
fn tcp_in_use(ns: &Netns) -> anyhow::Result<u64> {
    let out = Command::new("ip")
        .args(["netns", "exec", &ns.name, "cat", "/proc/net/sockstat"])
        .output()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| {
            let mut w = l.strip_prefix("TCP: inuse ")?.split_whitespace();
            w.next()?.parse().ok()
        })
        .context("no TCP line in the namespace's /proc/net/sockstat")
}

/// The CPU a process used over `window` (utime + stime of /proc/PID/stat, in clock
/// ticks: its threads', those that ended included), in % of one core.
fn process_cpu(pid: i32, window: Duration) -> anyhow::Result<f64> {
    let tick: f64 = output("getconf", &["CLK_TCK"])
        .parse()
        .context("getconf CLK_TCK")?;
    let ticks = || -> anyhow::Result<f64> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
        // Fields 14 and 15, counted after the command name, which may hold spaces.
        let mut fields = stat
            .rsplit_once(')')
            .context("/proc/PID/stat")?
            .1
            .split_whitespace()
            .skip(11);
        let mut next = || -> anyhow::Result<f64> { Ok(fields.next().context("utime")?.parse()?) };
        Ok(next()? + next()?)
    };
    let (c0, t0) = (ticks()?, Instant::now());
    std::thread::sleep(window);
    let (c1, elapsed) = (ticks()?, t0.elapsed().as_secs_f64());
    Ok((c1 - c0) / tick / elapsed * 100.0)
}
