//! `cargo xtask bench [--quick]`: connguard's cost, measured side by side in one run on
//! a noisy shared machine: interleaved rounds, medians and spread, ratios to no guard,
//! and the kernel's own per-program statistics. Prints a markdown report (with the
//! performance targets, met or not) and writes the same as JSON to target/bench.json.
use std::{
    collections::BTreeMap,
    io::Write,
    net::SocketAddr,
    path::PathBuf,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::Context;
use connguard_api::{
    policy::{Breaker, Limited, Listener, Mode, Policy, Port, Rule, Scope},
    stats::Snapshot,
};
use connguard_tests::{
    BPF_CGROUP_INET_SOCK_RELEASE, BPF_CGROUP_INET4_CONNECT, Cgroup, Daemon, Holder, Netns, Outcome,
    Probe, ServePort, attached_programs, listener_guard, wait_attached,
};
use serde_json::{Value, json};

/// The churn's server ports. Orderly closes leave TIME_WAIT entries, which slow the port
/// search of later connects to the same destination: each mode's timed churn has a
/// port of its own (8090 + its index in MODES), the churns read for program costs
/// another (8089), so that no mode pays for another's entries. Resets leave none, and
/// go to 8082, which greets each client (see guard-probe's `serve`). 8080 serves the
/// daemon's load and `ports` measurements, 8081 the refusals.
const PORT: u16 = 8080;
const RESET_PORT: u16 = 8082;
const COSTS_PORT: u16 = 8089;
const MODE_PORTS: u16 = 8090;
/// The churn's modes, in the order the report lists them: no daemon; a daemon whose
/// policy governs the churning client; the same with a rate, a handshake budget and a
/// breaker on the matching rule (none reached); the first daemon and policy with the
/// churn from a cgroup no scope selects (ungoverned traffic); nftables.
const MODES: [&str; 5] = ["no guard", "connguard", CONTROLS, UNGOVERNED, "nftables"];
const UNGOVERNED: &str = "connguard, client ungoverned";
const CONTROLS: &str = "connguard, rate + max_connecting + breaker";
/// How the churn's client closes: after the server's FIN (leaving TIME_WAIT), or at
/// once with SO_LINGER 0 (a RST): a shorter connection, where a fixed cost shows most.
const CLOSES: [(&str, bool); 2] = [("orderly close", false), ("reset close", true)];
/// Selected cgroups removed and created again, for the window to governed.
const RECREATIONS: usize = 100;
/// Repetitions of each one-shot command (stats, scrape, ports, ss), alternated.
const ONE_SHOTS: usize = 5;

struct Setup {
    ns: Netns,
    client: Cgroup,
    /// A client cgroup no scope selects.
    other: Cgroup,
    _servers: Holder,
    _server_cg: Cgroup,
}

pub fn run(quick: bool) -> anyhow::Result<()> {
    // A multiple of the modes, so that each runs as often in each place of the order.
    let rounds = if quick { MODES.len() } else { 5 * MODES.len() };
    let churn_n = if quick { 2000 } else { 10_000 };
    let destinations = if quick { 2000 } else { 10_000 };
    // Off for every timed figure (they add two clock reads to each program run), on
    // only while program costs are read; the previous setting comes back at the end.
    let _stats_off = BpfStats::set(false)?;

    // 7: the daemon's own CPU with a listener guard, first: the churns below leave
    // TIME_WAIT entries in the kernel's established hash (shared by every namespace),
    // which each of the guard's readings walks.
    let listener_cpu = listener_cpu(quick)?;

    let ns = Netns::new("cgbench");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    // Client-first closes leave TIME_WAIT: reuse it, and give the range room.
    ns.exec("sysctl", &["-qw", "net.ipv4.tcp_tw_reuse=1"]);
    ns.exec(
        "sysctl",
        &["-qw", "net.ipv4.ip_local_port_range=10000 60999"],
    );
    let server_cg = Cgroup::new("bench-servers");
    let mut ports = vec![
        ServePort::plain(PORT),
        ServePort::plain(8081),
        ServePort::greeting(RESET_PORT),
        ServePort::plain(COSTS_PORT),
    ];
    ports.extend((0..MODES.len() as u16).map(|i| ServePort::plain(MODE_PORTS + i)));
    let servers = server_cg.hold(Probe::Serve {
        netns: ns.path(),
        ports,
    });
    let s = Setup {
        client: Cgroup::new("bench-client"),
        other: Cgroup::new("bench-other"),
        ns,
        _servers: servers,
        _server_cg: server_cg,
    };
    let policy = thousand_rules(&s.client.rel, false);
    let with_controls = thousand_rules(&s.client.rel, true);

    // 1: churn, interleaved: no guard; connguard with 1,000 rules and destinations
    // tracked, from the governed client and from an ungoverned one; nftables ct count;
    // the order rotating every round, for each way of closing. 2: a second churn with
    // the same daemon and bpf_stats on gives each program's cost and runs.
    let mut rates: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut costs: BTreeMap<String, BTreeMap<String, Vec<f64>>> = BTreeMap::new();
    let mut runs: BTreeMap<String, BTreeMap<String, Vec<f64>>> = BTreeMap::new();
    for round in 0..rounds {
        for (close, reset) in CLOSES {
            for k in 0..MODES.len() {
                let i = (round + k) % MODES.len();
                let mode = MODES[i];
                let (port, costs_port) = if reset {
                    (RESET_PORT, RESET_PORT)
                } else {
                    (MODE_PORTS + i as u16, COSTS_PORT)
                };
                // Every mode's timed churn follows the same spray of refused connects
                // (which makes the tracked destinations when a daemon runs), so that
                // none is timed on a machine warmer or colder than the others.
                let rate = match mode {
                    "no guard" => {
                        spray(&s, destinations)?;
                        churn(&s, &s.client, churn_n, port, reset)?
                    }
                    "nftables" => {
                        nft(&s.ns, Some(CHURN_NFT))?;
                        spray(&s, destinations)?;
                        let rate = churn(&s, &s.client, churn_n, port, reset);
                        nft(&s.ns, None)?;
                        rate?
                    }
                    _ => {
                        let (client, traffic, policy) = match mode {
                            UNGOVERNED => (&s.other, "ungoverned", &policy),
                            CONTROLS => (&s.client, "governed with controls", &with_controls),
                            _ => (&s.client, "governed", &policy),
                        };
                        let d = Daemon::builder(policy).start();
                        spray(&s, destinations)?;
                        let rate = churn(&s, client, churn_n, port, reset)?;
                        let _stats_on = BpfStats::set(true)?;
                        let before = program_costs(&d.stats());
                        churn(&s, client, churn_n, costs_port, reset)?;
                        let after = program_costs(&d.stats());
                        let key = format!("{traffic}, {close}");
                        for (name, (t1, n1)) in &after {
                            let (t0, n0) = before.get(name).copied().unwrap_or((0.0, 0.0));
                            if n1 > &n0 {
                                costs
                                    .entry(key.clone())
                                    .or_default()
                                    .entry(name.clone())
                                    .or_default()
                                    .push((t1 - t0) / (n1 - n0));
                            }
                            runs.entry(key.clone())
                                .or_default()
                                .entry(name.clone())
                                .or_default()
                                .push((n1 - n0) / churn_n as f64);
                        }
                        rate
                    }
                };
                rates.entry(rate_key(close, mode)).or_default().push(rate);
            }
        }
        eprintln!("bench: round {}/{rounds} done", round + 1);
    }

    // 2b: a selected cgroup removed and created again (a service restart), from mkdir
    // to connect4 attached to it (the policy entry is written just before).
    let recreation = {
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
        json!({"recreations": RECREATIONS, "window_us": percentiles(&window_us)})
    };

    // 3: connect() to ECONNREFUSED when over budget: connguard refuses in the connect
    // hook (no SYN leaves); nftables' `ct count over 1 reject with tcp reset` sends the
    // SYN through the output hook and answers it with a RST.
    let shed = {
        let _d = Daemon::builder(
            Policy::new().scope(
                Scope::new("bench", &s.client.rel).rule(
                    Rule::default()
                        .dst(["127.0.0.1"])
                        .ports([8081])
                        .max_connections(1),
                ),
            ),
        )
        .start();
        refusals(&s)?
    };
    let nft_reject = {
        // Loaded first: conntrack counts only the connections it saw start.
        nft(&s.ns, Some(SHED_NFT))?;
        let out = refusals(&s);
        nft(&s.ns, None)?;
        out?
    };

    // 3b: a SYN to a saturated listener (listen(8), never accepting, 9 queued) over a
    // veth pair, until the client's connect() returns: connguard's listener guard
    // answers with a RST, as does an nftables `reject with tcp reset` on input; with
    // neither, the SYN is dropped and the client waits on retransmits (the first after
    // the initial RTO of 1 s, then 3 s, ...), here given up after 3 s.
    let inbound = {
        let (srv, cli) = Netns::veth_pair();
        let listen_cg = Cgroup::new("bench-listen");
        let target: SocketAddr = "192.0.2.1:8080".parse()?;
        let _listener = listen_cg.hold(Probe::listen(srv.path(), target, 8));
        let _queued = hold_open(&s.client, &cli, target, 9)?;
        let shedlat = |count| Probe::Shedlat {
            netns: cli.path(),
            addr: target,
            count,
            timeout_ms: Some(3000),
        };
        let no_guard = s.client.probe(shedlat(3));
        let guard = {
            let d = Daemon::builder(connguard_tests::listener_policy(&srv, Mode::Enforce)).start();
            let started = Instant::now();
            while !d.stats().listeners.first().is_some_and(|l| l.shedding) {
                anyhow::ensure!(
                    started.elapsed() < Duration::from_secs(5),
                    "the listener guard did not engage"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            s.client.probe(shedlat(1000))
        };
        nft(&srv, Some(INPUT_NFT))?;
        let reject = s.client.probe(shedlat(1000));
        nft(&srv, None)?;
        json!({"connguard_rst": latency(&guard), "nftables_reject": latency(&reject), "no_guard": latency(&no_guard)})
    };

    // 5: `connguard stats --json` (the whole command; decoding its output is the bench's
    // own work, done after) and one GET of /metrics, with many tracked destinations.
    let stats_ms = {
        let many = if quick { 10_000 } else { 100_000 };
        // With a listener guard, so that the listener watcher reads a socket table at
        // every tick (observe mode: nothing is refused).
        let d = Daemon::builder(
            policy
                .clone()
                .listener(listener_guard(&s.ns, Mode::Observe)),
        )
        .metrics()
        .start();
        spray(&s, many)?;
        let (mut stats, mut scrape, mut listed) = (Vec::new(), Vec::new(), 0);
        for _ in 0..ONE_SHOTS {
            let t = Instant::now();
            let out = d.cli(&["stats", "--json"]);
            stats.push(ms(t));
            anyhow::ensure!(out.status.success(), "connguard stats --json failed");
            listed = serde_json::from_slice::<Snapshot>(&out.stdout)?
                .scopes
                .first()
                .map_or(0, |s| s.destinations.len());
            let t = Instant::now();
            d.metrics();
            scrape.push(ms(t));
        }
        let peak_rss = memory_mib(d.pid(), "VmHWM")?;
        // The listener watcher's period (start to start, 50 ms meant) over its last
        // 256 runs, at rest and while 4 clients pull `stats --json` in a loop.
        std::thread::sleep(PERIOD_WINDOW);
        let idle = listener_period(&d)?;
        let loaded = stats_load(&d, 4, PERIOD_WINDOW)?;
        let busy = listener_period(&d)?;
        json!({"destinations": listed, "stats": summary(&stats), "scrape": summary(&scrape), "daemon_peak_rss_mib": peak_rss,
               "listener_period_ms": {"idle": idle, "under_stats_load": busy, "stats_answered": loaded}})
    };

    // 6: `connguard ports` with many TIME_WAIT entries, next to `ss` listing them; both
    // enter the namespace themselves (setns), alternated, and the count is ss's.
    let ports_ms = {
        let tw = if quick { 10_000 } else { 60_000 };
        for port in [PORT, 8081] {
            s.client.probe(Probe::Churn {
                netns: s.ns.path(),
                addr: SocketAddr::from(([127, 0, 0, 1], port)),
                count: tw / 2,
                per_second: 0,
                reset: false,
            });
        }
        let mut ports = Command::new(connguard_tests::connguard_bin());
        ports.args(["ports", "--json", "--socket", "/nonexistent", "--netns"]);
        ports.arg(s.ns.path());
        let mut ss = Command::new("nsenter");
        ss.arg(format!("--net={}", s.ns.path()))
            .args(["ss", "-tanH", "state", "time-wait"]);
        let (mut ports_t, mut ss_t, mut counted) = (Vec::new(), Vec::new(), 0);
        for _ in 0..ONE_SHOTS {
            ports_t.push(timed(&mut ports)?.0);
            let (t, out) = timed(&mut ss)?;
            ss_t.push(t);
            counted = out
                .stdout
                .split(|&b| b == b'\n')
                .filter(|l| !l.is_empty())
                .count();
        }
        json!({"time_wait": counted, "ports": summary(&ports_t), "ss": summary(&ss_t)})
    };

    // 4: daemon memory and CPU, idle and under churn, with the destinations of 1.
    let (idle, busy) = {
        let d = Daemon::builder(&policy).start();
        spray(&s, destinations)?;
        let secs = Duration::from_secs(if quick { 2 } else { 5 });
        let idle = usage(d.pid(), secs, || {
            std::thread::sleep(Duration::from_millis(100));
            Ok(())
        })?;
        let busy = usage(d.pid(), secs, || {
            churn(&s, &s.client, churn_n, PORT, false).map(drop)
        })?;
        (idle, busy)
    };

    let per_round = |close: &str, mode: &str| -> Vec<f64> {
        rates[&rate_key(close, mode)]
            .iter()
            .zip(&rates[&rate_key(close, "no guard")])
            .map(|(r, b)| r / b)
            .collect()
    };
    let by_close = |f: &dyn Fn(&str, &str) -> Value| -> Value {
        CLOSES
            .iter()
            .map(|(close, _)| {
                let modes: serde_json::Map<String, Value> =
                    MODES.iter().map(|m| (m.to_string(), f(close, m))).collect();
                (close.to_string(), Value::Object(modes))
            })
            .collect::<serde_json::Map<_, _>>()
            .into()
    };
    let nested = |m: &BTreeMap<String, BTreeMap<String, Vec<f64>>>, f: &dyn Fn(&[f64]) -> Value| {
        m.iter()
            .map(|(k, v)| {
                let inner: BTreeMap<_, _> = v.iter().map(|(n, x)| (n.clone(), f(x))).collect();
                (k.clone(), json!(inner))
            })
            .collect::<BTreeMap<_, _>>()
    };
    let report = json!({
        "command": if quick { "cargo xtask bench --quick" } else { "cargo xtask bench" },
        "commit": output("git", &["rev-parse", "--short", "HEAD"]),
        "kernel": output("uname", &["-r"]),
        "rounds": rounds,
        "connections_per_round": churn_n,
        "tracked_destinations": destinations,
        "churn_per_s": by_close(&|c, m| summary(&rates[&rate_key(c, m)])),
        // Each round's rate over the same round's no-guard rate: steadier than the ratio
        // of medians when the machine's load drifts between rounds.
        "round_ratio_to_no_guard": by_close(&|c, m| summary(&per_round(c, m))),
        // By traffic (governed, ungoverned) and close.
        "program_ns_per_run": nested(&costs, &|v| summary(v)),
        // connect4's cost with a rate, max_connecting and a breaker on the matching rule
        // less its cost without them, round by round (the rounds run both).
        "controls_connect4_extra_ns": CLOSES
            .iter()
            .map(|(close, _)| {
                let ns = |traffic: &str| costs[&format!("{traffic}, {close}")]["connect4"].clone();
                let extra: Vec<f64> = ns("governed with controls")
                    .iter()
                    .zip(ns("governed"))
                    .map(|(with, without)| with - without)
                    .collect();
                (close.to_string(), summary(&extra))
            })
            .collect::<serde_json::Map<_, _>>(),
        "program_runs_per_connection": nested(&runs, &|v| json!(median(v))),
        "cgroup_recreation": recreation,
        "shed_latency_ns": {
            "connguard": latency(&shed),
            "nftables_reject": latency(&nft_reject),
        },
        "inbound_latency_ns": inbound,
        "stats_ms": stats_ms,
        "ports_ms": ports_ms,
        "daemon": {"idle": idle, "churn": busy},
        "listener_guard_cpu": listener_cpu,
    });
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| crate::root().join("target"), PathBuf::from);
    let path = target.join("bench.json");
    std::fs::write(&path, serde_json::to_string_pretty(&report)?)?;
    print!("{}", markdown(&report));
    eprintln!("bench: JSON in {}", path.display());
    Ok(())
}

/// The listener guard's namespace: the guarded listener (listen(128), accepting), and
/// the servers that hold the established connections, each its share of them.
const GUARDED_PORT: u16 = 9100;
const HOLDING_PORTS: u16 = 9200;
const HOLDERS: u64 = 5;
/// Rounds of the listener guard's CPU, each in a namespace and with a daemon of its own.
const LISTENER_CPU_ROUNDS: usize = 3;

/// 7: the daemon's CPU (utime + stime of the whole process, its ended threads
/// included) with one listener guard, on a namespace holding only the guarded listener
/// and then also `connections` ESTABLISHED ones (5 servers and 5 clients in it, each
/// with its share: a process may hold 20,000 fds here). The audit is put off past the
/// window (`--audit 3600`): what is left is the listener watcher (a reading every
/// 50 ms) and the daemon's other periodic jobs.
fn listener_cpu(quick: bool) -> anyhow::Result<Value> {
    let connections: u64 = if quick { 10_000 } else { 50_000 };
    let window = Duration::from_secs(if quick { 5 } else { 20 });
    let (mut alone, mut held, mut sockets) = (Vec::new(), Vec::new(), 0);
    for round in 0..LISTENER_CPU_ROUNDS {
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
        let started = Instant::now();
        while d
            .stats()
            .listeners
            .first()
            .is_none_or(|l| l.queues.is_empty())
        {
            anyhow::ensure!(
                started.elapsed() < Duration::from_secs(5),
                "the listener guard did not read its listener"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        // Past the start's own work (its audit, the first attachments).
        std::thread::sleep(Duration::from_secs(3));
        alone.push(process_cpu(d.pid(), window)?);
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
        sockets = tcp_in_use(&ns)?;
        anyhow::ensure!(
            sockets >= 2 * connections,
            "{sockets} TCP sockets in the namespace, {connections} connections meant"
        );
        std::thread::sleep(Duration::from_secs(3));
        held.push(process_cpu(d.pid(), window)?);
        eprintln!(
            "bench: listener guard CPU, round {}/{LISTENER_CPU_ROUNDS}: {:.2} % alone, {:.2} % with {connections} connections",
            round + 1,
            alone[round],
            held[round]
        );
        // The daemon stops first, then the clients and servers with their cgroup.
        drop(d);
    }
    let figures = |v: &[f64]| {
        let mut s = summary(v);
        s["rounds"] = json!(v);
        s
    };
    Ok(json!({
        "connections": connections,
        "tcp_sockets": sockets,
        "window_s": window.as_secs(),
        "cpu_percent": {"listener only": figures(&alone), "established": figures(&held)},
    }))
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

/// Long enough for the listener watcher's last 256 runs (50 ms apart) to fall in it.
const PERIOD_WINDOW: Duration = Duration::from_secs(14);

/// The listener watcher's period figures from the daemon's stats (asked for without
/// destinations, so that asking adds no load).
fn listener_period(d: &Daemon) -> anyhow::Result<Value> {
    use std::io::{Read, Write};
    let mut c = std::os::unix::net::UnixStream::connect(&d.socket)?;
    c.write_all(b"stats 0\n")?;
    let mut text = String::new();
    c.read_to_string(&mut text)?;
    let stats: Snapshot = serde_json::from_str(&text)?;
    let job = stats
        .job("listener_watch")
        .context("no listener_watch job in the daemon's stats")?;
    Ok(json!({"p50": job.period_p50_ms, "p99": job.period_p99_ms, "max": job.period_max_ms}))
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

/// The key of a churn's rates.
fn rate_key(close: &str, mode: &str) -> String {
    format!("{close}|{mode}")
}

/// Churn rate (connections/s): N connect + client-first close to the local server on
/// `port`, from `client`, closed with a RST when `reset`, timed by the probe (process
/// start and netns entry left out).
fn churn(s: &Setup, client: &Cgroup, n: usize, port: u16, reset: bool) -> anyhow::Result<f64> {
    let out = client.probe(Probe::Churn {
        netns: s.ns.path(),
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
        count: n as u64,
        per_second: 0,
        reset,
    });
    anyhow::ensure!(out.ok == n as u64, "churn lost connections: {out:?}");
    Ok(n as f64 / (out.category("elapsed_ns") as f64 / 1e9))
}

/// N refused connects to distinct loopback addresses: N new tracked destinations.
fn spray(s: &Setup, n: usize) -> anyhow::Result<()> {
    let out = s.client.probe(Probe::Spray {
        netns: s.ns.path(),
        count: n as u64,
        port: 9,
    });
    anyhow::ensure!(
        out.errors("ECONNREFUSED") == n as u64,
        "spray did not make {n} destinations: {out:?}"
    );
    Ok(())
}

/// With one connection to 127.0.0.1:8081 held, 1,000 more, each timed to its failure;
/// every one must be refused.
fn refusals(s: &Setup) -> anyhow::Result<Outcome> {
    let addr = SocketAddr::from(([127, 0, 0, 1], 8081));
    let _held = hold_open(&s.client, &s.ns, addr, 1)?;
    let out = s.client.probe(Probe::Shedlat {
        netns: s.ns.path(),
        addr,
        count: 1000,
        timeout_ms: None,
    });
    anyhow::ensure!(
        out.errors("ECONNREFUSED") == 1000,
        "not every connect was refused: {out:?}"
    );
    Ok(out)
}

/// N connections from `client` to `target` inside `ns`, held open; all must connect.
fn hold_open(client: &Cgroup, ns: &Netns, target: SocketAddr, n: u64) -> anyhow::Result<Holder> {
    let held = client.hold(Probe::Open {
        netns: ns.path(),
        addr: target,
        count: n,
        interval_ms: 0,
        timeout_ms: 500,
    });
    anyhow::ensure!(
        held.outcome.ok == n,
        "{n} connections to {target} not all open: {:?}",
        held.outcome
    );
    Ok(held)
}

/// A policy of 1,000 rules: 999 on other networks, the last one matching loopback,
/// with `controls` a rate, a handshake budget and a breaker besides its budget (none
/// reached).
fn thousand_rules(cgroup: &str, controls: bool) -> Policy {
    let mut scope = Scope::new("bench", cgroup).max_connections(1_000_000);
    for i in 0..999u16 {
        scope = scope.rule(
            Rule::new(&format!("r{i}"))
                .dst([format!("10.{}.{}.0/24", i / 250, i % 250)])
                .ports([Port::from(8000 + i % 50), Port::from(9000..=9100)])
                .max_connections(100),
        );
    }
    let mut loopback = Rule::new("loopback")
        .dst(["127.0.0.0/8"])
        .max_connections(100_000);
    if controls {
        loopback = loopback
            .rate("1000000000/s")
            .burst(1_000_000)
            .max_connecting(100_000)
            .breaker(Breaker::new().min_samples(100_000));
    }
    Policy::new().scope(scope.rule(loopback))
}

/// The nftables equivalent of the churn's budget, which is not reached.
const CHURN_NFT: &str = "chain out {\n    type filter hook output priority 0;\n    \
    tcp dport { 8082, 8089-8094 } ct count over 1000000 reject with tcp reset\n  }";

/// A budget of 1 connection to 8081, answered with a RST past it.
const SHED_NFT: &str = "chain out {\n    type filter hook output priority 0;\n    \
    tcp dport 8081 ct count over 1 reject with tcp reset\n  }";

/// Every SYN to the saturated listener answered with a RST.
const INPUT_NFT: &str = "chain in {\n    type filter hook input priority 0;\n    \
    tcp dport 8080 reject with tcp reset\n  }";

/// Loads table inet cgbench with `chain` into the namespace, or deletes it.
fn nft(ns: &Netns, chain: Option<&str>) -> anyhow::Result<()> {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &ns.name, "nft"]);
    match chain {
        Some(_) => cmd.args(["-f", "-"]).stdin(Stdio::piped()),
        None => cmd.args(["delete", "table", "inet", "cgbench"]),
    };
    let mut child = cmd
        .spawn()
        .context("nft is missing: run `cargo xtask setup`")?;
    if let Some(chain) = chain {
        let rules = format!("table inet cgbench {{\n  {chain}\n}}\n");
        child
            .stdin
            .take()
            .context("nft stdin")?
            .write_all(rules.as_bytes())?;
    }
    anyhow::ensure!(child.wait()?.success(), "nft failed");
    Ok(())
}

/// Sets the kernel's bpf_stats (sysctl kernel.bpf_stats_enabled) until dropped, then
/// restores the previous setting.
struct BpfStats(String);

const BPF_STATS: &str = "/proc/sys/kernel/bpf_stats_enabled";

impl BpfStats {
    fn set(on: bool) -> anyhow::Result<BpfStats> {
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

/// p50 and p99 of the time connect() took to fail, and how the attempts ended.
fn latency(o: &Outcome) -> Value {
    json!({"p50": o.category("p50_ns"), "p99": o.category("p99_ns"), "attempts": o.attempts, "ok": o.ok, "errors": o.errors})
}

/// (run_time_ns, run_count) per program from `stats --json`.
fn program_costs(stats: &Snapshot) -> BTreeMap<String, (f64, f64)> {
    stats
        .programs
        .iter()
        .map(|p| (p.name.clone(), (p.run_time_ns as f64, p.run_count as f64)))
        .collect()
}

/// Resident memory (MiB) and CPU share (% of one core, from the scheduler's
/// nanoseconds, summed over its threads) of a process while `work` runs again and again
/// for `secs`.
fn usage(
    pid: i32,
    secs: Duration,
    mut work: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<Value> {
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
    Ok(
        json!({"rss_mib": memory_mib(pid, "VmRSS")?, "cpu_percent": used / 1e9 / elapsed * 100.0, "seconds": elapsed}),
    )
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
fn timed(cmd: &mut Command) -> anyhow::Result<(f64, std::process::Output)> {
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

/// A command's first line of output, or "?".
fn output(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .current_dir(crate::root())
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.lines().next().map(str::to_string))
        .unwrap_or_else(|| "?".into())
}

/// The middle value; the mean of the two middle values for an even count.
fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => 0.0,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// p50, p99 and max of `v`.
fn percentiles(v: &[f64]) -> Value {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let at = |q: f64| s[((s.len() as f64 * q).ceil() as usize).clamp(1, s.len()) - 1];
    json!({"p50": at(0.5), "p99": at(0.99), "max": at(1.0), "n": s.len()})
}

fn summary(v: &[f64]) -> Value {
    let min = v.iter().copied().fold(f64::INFINITY, f64::min);
    let max = v.iter().copied().fold(0.0, f64::max);
    json!({"median": median(v), "min": min, "max": max, "n": v.len()})
}

/// "1000 ECONNREFUSED" from a latency() record: how the attempts ended.
fn ended(l: &Value) -> String {
    let mut parts: Vec<String> = l["errors"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(e, n)| format!("{n} {e}"))
        .collect();
    if l["ok"].as_u64().unwrap_or(0) > 0 {
        parts.push(format!("{} connected", l["ok"]));
    }
    parts.join(", ")
}

/// Met, missed, or not measured at the target's size (`--quick`).
fn verdict(met: Option<bool>) -> &'static str {
    match met {
        Some(true) => "met",
        Some(false) => "missed",
        None => "not measured at this size",
    }
}

/// The ns of eBPF one connection costs in a `program_runs_per_connection` entry: each
/// program's median cost times its runs.
fn connection_ns(r: &Value, key: &str) -> f64 {
    let f = |v: &Value| v.as_f64().unwrap_or(0.0);
    r["program_runs_per_connection"][key]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(name, runs)| f(&r["program_ns_per_run"][key][name]["median"]) * f(runs))
        .sum()
}

fn markdown(r: &Value) -> String {
    let f = |v: &Value| v.as_f64().unwrap_or(0.0);
    let mut out = format!(
        "\n#### `{}` at {}, kernel {}: {} rounds of {} connections, {} tracked destinations\n\n",
        r["command"].as_str().unwrap_or("?"),
        r["commit"].as_str().unwrap_or("?"),
        r["kernel"].as_str().unwrap_or("?"),
        r["rounds"],
        r["connections_per_round"],
        r["tracked_destinations"]
    );
    out += "| churn (connections/s) | median | min | max | per-round ratio to no guard: median (min–max) |\n|---|---|---|---|---|\n";
    for (close, _) in CLOSES {
        for mode in MODES {
            let s = &r["churn_per_s"][close][mode];
            let rounds = if mode == "no guard" {
                "1".to_string()
            } else {
                let q = &r["round_ratio_to_no_guard"][close][mode];
                format!(
                    "{:.3} ({:.3}–{:.3})",
                    f(&q["median"]),
                    f(&q["min"]),
                    f(&q["max"])
                )
            };
            out += &format!(
                "| {close}: {mode} | {:.0} | {:.0} | {:.0} | {rounds} |\n",
                f(&s["median"]),
                f(&s["min"]),
                f(&s["max"])
            );
        }
    }
    // Where a connection's time goes: each program's median cost times its runs per
    // connection (both ends), next to the time one connection takes without a guard.
    let per_conn =
        |close: &str, mode: &str| 1e9 / f(&r["churn_per_s"][close][mode]["median"]).max(1.0);
    for (key, programs) in r["program_runs_per_connection"]
        .as_object()
        .into_iter()
        .flatten()
    {
        let close = CLOSES
            .iter()
            .map(|(c, _)| *c)
            .find(|c| key.ends_with(c))
            .unwrap_or("orderly close");
        out += &format!(
            "\n| {key} (bpf_stats on) | median ns/run | min | max | runs per connection | ns per connection |\n|---|---|---|---|---|---|\n"
        );
        for (name, runs) in programs.as_object().into_iter().flatten() {
            let s = &r["program_ns_per_run"][key][name];
            out += &format!(
                "| {name} | {:.0} | {:.0} | {:.0} | {:.1} | {:.0} |\n",
                f(&s["median"]),
                f(&s["min"]),
                f(&s["max"]),
                f(runs),
                f(&s["median"]) * f(runs)
            );
        }
        out += &format!(
            "| all programs | | | | | {:.0} ({:.1} % of the {:.0} ns a connection takes without a guard) |\n",
            connection_ns(r, key),
            connection_ns(r, key) / per_conn(close, "no guard") * 100.0,
            per_conn(close, "no guard")
        );
    }
    out += "\nRuns per connection count every TCP socket of the host while the churn runs, \
            the bench's and any other: the tracepoint runs for all of them.\n";
    let w = &r["cgroup_recreation"]["window_us"];
    out += &format!(
        "\n| a selected cgroup removed and created again, {} times: mkdir to connect4 attached | p50 µs | p99 µs | max µs |\n|---|---|---|---|\n| inotify event, walk of the new cgroup, policy entry, attach | {:.0} | {:.0} | {:.0} |\n",
        r["cgroup_recreation"]["recreations"],
        f(&w["p50"]),
        f(&w["p99"]),
        f(&w["max"])
    );

    let us = |v: &Value| f(v) / 1000.0;
    let row = |name: &str, l: &Value| {
        format!(
            "| {name} | {:.1} | {:.1} | {} |\n",
            us(&l["p50"]),
            us(&l["p99"]),
            ended(l)
        )
    };
    let (l, i) = (&r["shed_latency_ns"], &r["inbound_latency_ns"]);
    out += "\n| refusal at connect(), loopback, over budget | p50 µs | p99 µs | ended |\n|---|---|---|---|\n";
    out += &row("connguard (no SYN sent)", &l["connguard"]);
    out += &row(
        "nftables `ct count over 1 reject with tcp reset`",
        &l["nftables_reject"],
    );
    out += "\n| SYN to a saturated listener over veth, until connect() returns | p50 µs | p99 µs | ended |\n|---|---|---|---|\n";
    out += &row("connguard listener guard (RST)", &i["connguard_rst"]);
    out += &row(
        "nftables `reject with tcp reset` on input",
        &i["nftables_reject"],
    );
    out += &row(
        "no guard: SYN dropped, retransmitted; given up after 3 s (3 attempts)",
        &i["no_guard"],
    );

    let (st, po) = (&r["stats_ms"], &r["ports_ms"]);
    out += &format!(
        "\n| one-shot, median of {ONE_SHOTS} | ms | min | max | next to |\n|---|---|---|---|---|\n"
    );
    let shot = |name: String, v: &Value, next: String| {
        format!(
            "| {name} | {:.1} | {:.1} | {:.1} | {next} |\n",
            f(&v["median"]),
            f(&v["min"]),
            f(&v["max"])
        )
    };
    out += &shot(
        format!(
            "`connguard stats --json`, {} destinations",
            st["destinations"]
        ),
        &st["stats"],
        String::new(),
    );
    out += &shot(
        "metrics scrape, same".into(),
        &st["scrape"],
        format!(
            "daemon's peak RSS: {:.1} MiB",
            f(&st["daemon_peak_rss_mib"])
        ),
    );
    let ports_ratio = f(&po["ports"]["median"]) / f(&po["ss"]["median"]).max(0.001);
    out += &shot(
        format!("`connguard ports`, {} TIME_WAIT", po["time_wait"]),
        &po["ports"],
        format!(
            "`ss -tan state time-wait`: {:.1} ms ({ports_ratio:.2}×)",
            f(&po["ss"]["median"])
        ),
    );
    let lp = &st["listener_period_ms"];
    out += &format!(
        "\n| listener watcher period (50 ms meant), last 256 runs | p50 ms | p99 ms | max ms |\n|---|---|---|---|\n\
         | at rest, {} destinations tracked | {:.1} | {:.1} | {:.1} |\n\
         | 4 clients pulling `stats --json` in a loop ({} answers in {} s) | {:.1} | {:.1} | {:.1} |\n",
        st["destinations"],
        f(&lp["idle"]["p50"]),
        f(&lp["idle"]["p99"]),
        f(&lp["idle"]["max"]),
        lp["stats_answered"],
        PERIOD_WINDOW.as_secs(),
        f(&lp["under_stats_load"]["p50"]),
        f(&lp["under_stats_load"]["p99"]),
        f(&lp["under_stats_load"]["max"]),
    );
    let d = &r["daemon"];
    out += "\n| daemon | RSS MiB | CPU % of a core |\n|---|---|---|\n";
    for phase in ["idle", "churn"] {
        out += &format!(
            "| {phase} | {:.1} | {:.2} |\n",
            f(&d[phase]["rss_mib"]),
            f(&d[phase]["cpu_percent"])
        );
    }
    let lc = &r["listener_guard_cpu"];
    out += &format!(
        "\n| daemon with a listener guard, {LISTENER_CPU_ROUNDS} rounds of {} s: CPU % of a core (utime + stime) | median | min | max | rounds |\n|---|---|---|---|---|\n",
        lc["window_s"]
    );
    for (phase, name) in [
        (
            "listener only",
            "the guarded namespace holds the listener alone".to_string(),
        ),
        (
            "established",
            format!(
                "the same with {} ESTABLISHED connections ({} TCP sockets)",
                lc["connections"], lc["tcp_sockets"]
            ),
        ),
    ] {
        let c = &lc["cpu_percent"][phase];
        let rounds: Vec<String> = c["rounds"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|v| format!("{:.2}", f(v)))
            .collect();
        out += &format!(
            "| {name} | {:.2} | {:.2} | {:.2} | {} |\n",
            f(&c["median"]),
            f(&c["min"]),
            f(&c["max"]),
            rounds.join(", ")
        );
    }

    // The performance targets.
    let ratio = |close: &str, mode: &str| f(&r["round_ratio_to_no_guard"][close][mode]["median"]);
    let controls_extra = |close: &str| f(&r["controls_connect4_extra_ns"][close]["median"]);
    let governed = "governed, orderly close";
    let cost = |p: &str| f(&r["program_ns_per_run"][governed][p]["median"]);
    let admission = cost("connect4");
    let others: Vec<(String, f64)> = r["program_ns_per_run"][governed]
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(n, _)| n.as_str() != "connect4")
        .map(|(n, s)| (n.clone(), f(&s["median"])))
        .collect();
    let worst_other = others.iter().map(|(_, v)| *v).fold(0.0, f64::max);
    let ungoverned_runs: Vec<String> =
        r["program_runs_per_connection"]["ungoverned, orderly close"]
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(_, runs)| f(runs) > 0.0)
            .map(|(n, runs)| format!("{n} {:.1}", f(runs)))
            .collect();
    let only_tracepoint = ungoverned_runs
        .iter()
        .all(|s| s.starts_with("sock_set_state "));
    let window_p99 = f(&w["p99"]);
    let shed_p99 = us(&l["connguard"]["p99"]);
    let rst_p99 = us(&i["connguard_rst"]["p99"]);
    let (rss, idle_cpu) = (f(&d["idle"]["rss_mib"]), f(&d["idle"]["cpu_percent"]));
    let peak_rss = f(&st["daemon_peak_rss_mib"]).max(rss);
    let (stats, scrape) = (f(&st["stats"]["median"]), f(&st["scrape"]["median"]));
    out += "\n| target | measured | |\n|---|---|---|\n";
    for (target, measured, met) in [
        (
            "governed: all programs ≤ 1,200 ns per connection (stretch ≤ 800)".to_string(),
            format!("{:.0} ns", connection_ns(r, governed)),
            Some(connection_ns(r, governed) <= 1200.0),
        ),
        (
            "connect4 ≤ 250 ns (1,000 rules, tracked destinations)".into(),
            format!("{admission:.0} ns"),
            Some(admission <= 250.0),
        ),
        (
            "connect4 with a rate, max_connecting and a breaker: ≤ 100 ns more (per-round median)"
                .into(),
            CLOSES
                .iter()
                .map(|(c, _)| format!("{c} {:.0} ns", controls_extra(c)))
                .collect::<Vec<_>>()
                .join("; "),
            Some(CLOSES.iter().all(|(c, _)| controls_extra(c) <= 100.0)),
        ),
        (
            "ungoverned: no connection program runs (only the host-wide tracepoint)".into(),
            format!(
                "{} per connection, {:.0} ns",
                ungoverned_runs.join(", "),
                connection_ns(r, "ungoverned, orderly close")
            ),
            Some(only_tracepoint),
        ),
        (
            "churn ratio, governed ≥ 0.98 (per-round median)".into(),
            CLOSES
                .iter()
                .map(|(c, _)| format!("{c} {:.3}", ratio(c, "connguard")))
                .collect::<Vec<_>>()
                .join("; "),
            Some(CLOSES.iter().all(|(c, _)| ratio(c, "connguard") >= 0.98)),
        ),
        (
            "churn ratio, ungoverned ≥ 0.995 (per-round median)".into(),
            CLOSES
                .iter()
                .map(|(c, _)| format!("{c} {:.3}", ratio(c, UNGOVERNED)))
                .collect::<Vec<_>>()
                .join("; "),
            Some(CLOSES.iter().all(|(c, _)| ratio(c, UNGOVERNED) >= 0.995)),
        ),
        (
            "selected cgroup created again: governed within 5 ms (p99)".into(),
            format!("{window_p99:.0} µs"),
            Some(window_p99 <= 5000.0),
        ),
        (
            "every other program ≤ 100 ns per event".into(),
            others
                .iter()
                .map(|(n, v)| format!("{n} {v:.0}"))
                .collect::<Vec<_>>()
                .join(", "),
            Some(worst_other <= 100.0),
        ),
        (
            "outbound shed p99 ≤ 50 µs".into(),
            format!("{shed_p99:.1} µs"),
            Some(shed_p99 <= 50.0),
        ),
        (
            "inbound RST p99 ≤ 2 ms over veth".into(),
            format!("{rst_p99:.1} µs"),
            Some(rst_p99 <= 2000.0),
        ),
        (
            "daemon RSS ≤ 40 MiB; CPU ≤ 2 % of a core idle".into(),
            format!("{peak_rss:.1} MiB at most; {idle_cpu:.2} %"),
            Some(peak_rss <= 40.0 && idle_cpu <= 2.0),
        ),
        (
            "stats/scrape ≤ 100 ms at 100,000 destinations".into(),
            format!(
                "{stats:.0} / {scrape:.0} ms at {} destinations",
                st["destinations"]
            ),
            (st["destinations"].as_u64() >= Some(100_000))
                .then_some(stats <= 100.0 && scrape <= 100.0),
        ),
        (
            "ports one-shot ≤ 2 × the `ss` time".into(),
            format!("{ports_ratio:.2}×"),
            Some(ports_ratio <= 2.0),
        ),
    ] {
        out += &format!("| {target} | {measured} | {} |\n", verdict(met));
    }
    out
}
