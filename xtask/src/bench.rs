//! `cargo xtask bench [--quick]`: connguard's cost, measured side by side in one run on
//! a noisy shared machine: interleaved rounds, medians and spread, ratios to no guard,
//! and the kernel's own per-program statistics. Prints a markdown table and writes the
//! same as JSON to target/bench.json.
use std::{
    collections::BTreeMap,
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::Context;
use connguard_tests::{Cgroup, Daemon, Netns, Outcome};
use serde_json::{Value, json};

const PORT: u16 = 8080;

struct Setup {
    ns: Netns,
    client: Cgroup,
    _servers: connguard_tests::Holder,
    _server_cg: Cgroup,
}

pub fn run(quick: bool) -> anyhow::Result<()> {
    let rounds = if quick { 3 } else { 20 };
    let churn_n = if quick { 2000 } else { 5000 };
    let destinations = if quick { 2000 } else { 10_000 };

    let ns = Netns::new("cgbench");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    // Client-first closes leave TIME_WAIT: reuse it, and give the range room.
    ns.exec("sysctl", &["-qw", "net.ipv4.tcp_tw_reuse=1"]);
    ns.exec(
        "sysctl",
        &["-qw", "net.ipv4.ip_local_port_range=10000 60999"],
    );
    let server_cg = Cgroup::new("bench-servers");
    let servers = server_cg.hold_args(&["serve", &ns.path(), "8080", "8081"]);
    let s = Setup {
        client: Cgroup::new("bench-client"),
        ns,
        _servers: servers,
        _server_cg: server_cg,
    };
    let policy = thousand_rules(&s.client.rel);

    // 1: churn, interleaved A (no guard), B (connguard, 1,000 rules, destinations
    // tracked), C (nftables ct count), rotating the order every round. The timed churn
    // runs with bpf_stats off (they add two clock reads to every program run); 2: a
    // second churn with the same daemon and bpf_stats on gives each program's cost.
    let mut rates: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut costs: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut runs: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let modes = ["no guard", "connguard", "nftables"];
    for round in 0..rounds {
        for k in 0..3 {
            let mode = modes[(round + k) % 3];
            let rate = match mode {
                "no guard" => churn(&s, churn_n)?,
                "connguard" => {
                    let d = Daemon::start(&policy);
                    s.client
                        .probe(&["spray", &s.ns.path(), &destinations.to_string(), "9"]);
                    let rate = churn(&s, churn_n)?;
                    let _stats = BpfStats::enable()?;
                    let before = program_costs(&d.stats());
                    churn(&s, churn_n)?;
                    let after = program_costs(&d.stats());
                    for (name, (t1, n1)) in &after {
                        let (t0, n0) = before.get(name).copied().unwrap_or((0.0, 0.0));
                        if n1 > &n0 {
                            costs
                                .entry(name.clone())
                                .or_default()
                                .push((t1 - t0) / (n1 - n0));
                            runs.entry(name.clone())
                                .or_default()
                                .push((n1 - n0) / churn_n as f64);
                        }
                    }
                    rate
                }
                _ => {
                    nft(&s.ns, Some(CHURN_NFT))?;
                    let rate = churn(&s, churn_n);
                    nft(&s.ns, None)?;
                    rate?
                }
            };
            rates.entry(mode).or_default().push(rate);
        }
        eprintln!("bench: round {}/{rounds} done", round + 1);
    }

    // 3: shed latency, connect() to ECONNREFUSED: connguard over budget vs an nftables
    // reject with tcp reset (a SYN out, a RST back); without either, a dropped SYN waits
    // for its retransmit (1 s, net.ipv4.tcp_syn_retries).
    let shed = {
        let d = Daemon::start(&format!(
            "[[scope]]\nname = \"bench\"\ncgroup = \"{}\"\n[[scope.rule]]\ndst = [\"127.0.0.1\"]\nports = [\"8081\"]\nmax_connections = 1\n",
            s.client.rel
        ));
        let _held = s
            .client
            .hold_args(&["open", &s.ns.path(), "127.0.0.1:8081", "1"]);
        let out = s
            .client
            .probe(&["shedlat", &s.ns.path(), "127.0.0.1:8081", "1000"]);
        drop(d);
        out
    };
    nft(&s.ns, Some(CHURN_NFT))?;
    let nft_reject = s
        .client
        .probe(&["shedlat", &s.ns.path(), "127.0.0.1:8082", "1000"]);
    nft(&s.ns, None)?;

    // 3b: a SYN to a saturated listener (listen(8), never accepting, 9 queued) over a
    // veth pair, until the client's connect() returns: connguard's listener guard
    // answers with a RST, as does an nftables `reject with tcp reset` on input; with
    // neither, the SYN is dropped and the client waits on retransmits (1 s, 3 s, ...).
    let inbound = {
        let (srv, cli) = Netns::veth_pair();
        let listen_cg = Cgroup::new("bench-listen");
        let target = "192.0.2.1:8080";
        let _listener = listen_cg.hold_args(&["listen", &srv.path(), target, "8"]);
        let queued = s.client.hold_args(&["open", &cli.path(), target, "9"]);
        anyhow::ensure!(
            queued.outcome.ok == 9,
            "queue not filled: {:?}",
            queued.outcome
        );
        let no_guard = s
            .client
            .probe(&["shedlat", &cli.path(), target, "3", "3000"]);
        let guard = {
            let d = Daemon::start(&connguard_tests::listener_policy(&srv, "enforce"));
            let started = Instant::now();
            while d.stats()["listeners"][0]["shedding"] != true {
                anyhow::ensure!(
                    started.elapsed() < Duration::from_secs(5),
                    "the listener guard did not engage"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            s.client
                .probe(&["shedlat", &cli.path(), target, "1000", "3000"])
        };
        nft(&srv, Some(INPUT_NFT))?;
        let reject = s
            .client
            .probe(&["shedlat", &cli.path(), target, "1000", "3000"]);
        nft(&srv, None)?;
        json!({"connguard_rst": latency(&guard), "nftables_reject": latency(&reject), "no_guard": latency(&no_guard)})
    };

    // 5: stats and a metrics scrape with many tracked destinations.
    let stats_ms = {
        let many = if quick { 10_000 } else { 100_000 };
        let d = Daemon::with_metrics(&policy);
        s.client
            .probe(&["spray", &s.ns.path(), &many.to_string(), "9"]);
        // The command's wall time; decoding its JSON here is the bench's own work.
        let t = Instant::now();
        let out = d.cli(&["stats", "--json"]);
        let stats = t.elapsed().as_secs_f64() * 1000.0;
        anyhow::ensure!(out.status.success(), "connguard stats --json failed");
        let n = serde_json::from_slice::<Value>(&out.stdout)?["scopes"][0]["destinations"]
            .as_array()
            .map_or(0, Vec::len);
        let t = Instant::now();
        d.metrics();
        let scrape = t.elapsed().as_secs_f64() * 1000.0;
        json!({"destinations": n, "stats": stats, "scrape": scrape, "daemon_peak_rss_mib": memory_mib(d.pid(), "VmHWM")?})
    };

    // 6: `connguard ports` with many TIME_WAIT entries, next to ss counting them.
    let ports_ms = {
        let tw = if quick { 10_000 } else { 60_000 };
        for port in ["8080", "8081"] {
            s.client.probe(&[
                "churn",
                &s.ns.path(),
                &format!("127.0.0.1:{port}"),
                &(tw / 2).to_string(),
                "0",
            ]);
        }
        let time = |cmd: &mut Command| -> anyhow::Result<f64> {
            let t = Instant::now();
            anyhow::ensure!(cmd.output()?.status.success(), "{cmd:?} failed");
            Ok(t.elapsed().as_secs_f64() * 1000.0)
        };
        let connguard = connguard_tests::connguard_bin();
        let ports = time(Command::new(&connguard).args([
            "ports",
            "--json",
            "--socket",
            "/nonexistent",
            "--netns",
            &s.ns.path(),
        ]))?;
        let ss = time(Command::new("ip").args([
            "netns",
            "exec",
            &s.ns.name,
            "ss",
            "-tan",
            "state",
            "time-wait",
        ]))?;
        json!({"time_wait": tw, "ports": ports, "ss": ss})
    };

    // 4: daemon memory and CPU, idle and under churn.
    let (idle, busy) = {
        let d = Daemon::start_with(&policy, &[]);
        let secs = Duration::from_secs(if quick { 2 } else { 5 });
        let idle = usage(d.pid(), secs, || {
            std::thread::sleep(Duration::from_millis(100));
            Ok(())
        })?;
        let busy = usage(d.pid(), secs, || churn(&s, churn_n).map(drop))?;
        (idle, busy)
    };

    let report = json!({
        "rounds": rounds,
        "connections_per_round": churn_n,
        "tracked_destinations": destinations,
        "churn_per_s": rates.iter().map(|(m, v)| (m.to_string(), summary(v))).collect::<BTreeMap<_, _>>(),
        "ratio_to_no_guard": {
            "connguard": median(&rates["connguard"]) / median(&rates["no guard"]),
            "nftables": median(&rates["nftables"]) / median(&rates["no guard"]),
        },
        // Each round's rate over the same round's no-guard rate: steadier than the ratio
        // of medians when the machine's load drifts between rounds.
        "round_ratio_to_no_guard": {
            "connguard": summary(&round_ratios(&rates["connguard"], &rates["no guard"])),
            "nftables": summary(&round_ratios(&rates["nftables"], &rates["no guard"])),
        },
        "program_ns_per_run": costs.iter().map(|(n, v)| (n.clone(), summary(v))).collect::<BTreeMap<_, _>>(),
        "program_runs_per_connection": runs.iter().map(|(n, v)| (n.clone(), median(v))).collect::<BTreeMap<_, _>>(),
        "shed_latency_ns": {
            "connguard": latency(&shed),
            "nftables_reject": latency(&nft_reject),
        },
        "inbound_latency_ns": inbound,
        "stats_ms": stats_ms,
        "ports_ms": ports_ms,
        "daemon": {"idle": idle, "churn": busy},
    });
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench.json");
    std::fs::write(&path, serde_json::to_string_pretty(&report)?)?;
    print!("{}", markdown(&report));
    eprintln!("bench: JSON in {}", path.display());
    Ok(())
}

/// Churn rate (connections/s): N connect + client-first close to the local server, from
/// the client cgroup, timed by the probe (process start and netns entry left out).
fn churn(s: &Setup, n: usize) -> anyhow::Result<f64> {
    let out: Outcome = s.client.probe(&[
        "churn",
        &s.ns.path(),
        &format!("127.0.0.1:{PORT}"),
        &n.to_string(),
        "0",
    ]);
    let secs = out.categories["elapsed_ns"] as f64 / 1e9;
    anyhow::ensure!(out.ok == n as u64, "churn lost connections: {out:?}");
    Ok(n as f64 / secs)
}

/// A policy of 1,000 rules: 999 on other networks, the last one matching loopback.
fn thousand_rules(cgroup: &str) -> String {
    let mut p =
        format!("[[scope]]\nname = \"bench\"\ncgroup = \"{cgroup}\"\nmax_connections = 1000000\n");
    for i in 0..999 {
        p += &format!(
            "[[scope.rule]]\nname = \"r{i}\"\ndst = [\"10.{}.{}.0/24\"]\nports = [\"{}\", \"9000-9100\"]\nmax_connections = 100\n",
            i / 250,
            i % 250,
            8000 + i % 50
        );
    }
    p + "[[scope.rule]]\nname = \"loopback\"\ndst = [\"127.0.0.0/8\"]\nmax_connections = 100000\n"
}

/// The nftables equivalent of a budget that is not reached, and a reject for 8082.
const CHURN_NFT: &str = "chain out {\n    type filter hook output priority 0;\n    \
    tcp dport 8080 ct count over 1000000 reject with tcp reset\n    \
    tcp dport 8082 reject with tcp reset\n  }";

/// Every SYN to the saturated listener answered with a RST.
const INPUT_NFT: &str = "chain in {\n    type filter hook input priority 0;\n    \
    tcp dport 8080 reject with tcp reset\n  }";

/// Loads table inet cgbench with `chain` into the namespace, or deletes it.
fn nft(ns: &Netns, chain: Option<&str>) -> anyhow::Result<()> {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &ns.name, "nft"]);
    if let Some(chain) = chain {
        let file = std::env::temp_dir().join(format!("connguard-bench-{}.nft", std::process::id()));
        std::fs::write(&file, format!("table inet cgbench {{\n  {chain}\n}}\n"))?;
        cmd.arg("-f").arg(&file);
    } else {
        cmd.args(["delete", "table", "inet", "cgbench"]);
    }
    let status = cmd
        .status()
        .context("nft is missing: run `cargo xtask setup`")?;
    anyhow::ensure!(status.success(), "nft failed");
    Ok(())
}

/// Turns the kernel's bpf_stats on (sysctl kernel.bpf_stats_enabled) until dropped,
/// then restores the previous setting.
struct BpfStats(String);

const BPF_STATS: &str = "/proc/sys/kernel/bpf_stats_enabled";

impl BpfStats {
    fn enable() -> anyhow::Result<BpfStats> {
        let before = std::fs::read_to_string(BPF_STATS).context(BPF_STATS)?;
        std::fs::write(BPF_STATS, "1").context(BPF_STATS)?;
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
    json!({"p50": o.categories["p50_ns"], "p99": o.categories["p99_ns"], "attempts": o.attempts, "ok": o.ok, "errors": o.errors})
}

/// (run_time_ns, run_count) per program from `stats --json`.
fn program_costs(stats: &Value) -> BTreeMap<String, (f64, f64)> {
    stats["programs"]
        .as_array()
        .map(|ps| {
            ps.iter()
                .map(|p| {
                    let f = |k: &str| p[k].as_f64().unwrap_or(0.0);
                    (
                        p["name"].as_str().unwrap_or("?").to_string(),
                        (f("run_time_ns"), f("run_count")),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Resident memory (MiB) and CPU share (% of one core) of a process while `work` runs
/// again and again for `secs`.
fn usage(
    pid: i32,
    secs: Duration,
    mut work: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<Value> {
    let cpu = || -> anyhow::Result<f64> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .context("stat")?
            .1
            .split_whitespace()
            .collect();
        let ticks: f64 = fields[11].parse::<f64>()? + fields[12].parse::<f64>()?;
        Ok(ticks / 100.0)
    };
    let (c0, t0) = (cpu()?, Instant::now());
    while t0.elapsed() < secs {
        work()?;
    }
    let (c1, secs) = (cpu()?, t0.elapsed().as_secs_f64());
    Ok(
        json!({"rss_mib": memory_mib(pid, "VmRSS")?, "cpu_percent": (c1 - c0) / secs * 100.0, "seconds": secs}),
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

fn round_ratios(rates: &[f64], baseline: &[f64]) -> Vec<f64> {
    rates.iter().zip(baseline).map(|(r, b)| r / b).collect()
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(s.len() / 2).copied().unwrap_or(0.0)
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

fn markdown(r: &Value) -> String {
    let f = |v: &Value| v.as_f64().unwrap_or(0.0);
    let mut out = format!(
        "\n### connguard bench: {} rounds of {} connections, {} tracked destinations\n\n",
        r["rounds"], r["connections_per_round"], r["tracked_destinations"]
    );
    out += "| churn (connections/s) | median | min | max | ratio of medians to no guard | per-round ratio: median (min–max) |\n|---|---|---|---|---|---|\n";
    for (mode, s) in r["churn_per_s"].as_object().into_iter().flatten() {
        let (ratio, rounds) = if mode == "no guard" {
            (1.0, String::new())
        } else {
            let q = &r["round_ratio_to_no_guard"][mode];
            (
                f(&r["ratio_to_no_guard"][mode]),
                format!(
                    "{:.3} ({:.3}–{:.3})",
                    f(&q["median"]),
                    f(&q["min"]),
                    f(&q["max"])
                ),
            )
        };
        out += &format!(
            "| {mode} | {:.0} | {:.0} | {:.0} | {ratio:.3} | {rounds} |\n",
            f(&s["median"]),
            f(&s["min"]),
            f(&s["max"])
        );
    }
    // Where a connection's time goes: each program's median cost times its runs per
    // connection (both ends: the server's sockets run the host-wide hooks too), next
    // to the time one connection takes without a guard.
    out += "\n| program (bpf_stats) | median ns/run | min | max | runs per connection | ns per connection |\n|---|---|---|---|---|---|\n";
    let mut total = 0.0;
    for (name, s) in r["program_ns_per_run"].as_object().into_iter().flatten() {
        let runs = f(&r["program_runs_per_connection"][name]);
        total += f(&s["median"]) * runs;
        out += &format!(
            "| {name} | {:.0} | {:.0} | {:.0} | {runs:.1} | {:.0} |\n",
            f(&s["median"]),
            f(&s["min"]),
            f(&s["max"]),
            f(&s["median"]) * runs
        );
    }
    let per_conn = 1e9 / f(&r["churn_per_s"]["no guard"]["median"]).max(1.0);
    out += &format!(
        "| all programs | | | | | {total:.0} ({:.1} % of the {:.0} ns a connection takes without a guard) |\n",
        total / per_conn * 100.0,
        per_conn
    );
    let l = &r["shed_latency_ns"];
    let us = |v: &Value| f(v) / 1000.0;
    out += "\n| refusal at connect(), loopback | p50 µs | p99 µs | ended |\n|---|---|---|---|\n";
    for (name, key) in [
        ("connguard over budget (no SYN sent)", "connguard"),
        ("nftables reject with tcp reset", "nftables_reject"),
    ] {
        out += &format!(
            "| {name} | {:.1} | {:.1} | {} |\n",
            us(&l[key]["p50"]),
            us(&l[key]["p99"]),
            ended(&l[key])
        );
    }
    let i = &r["inbound_latency_ns"];
    out += "\n| SYN to a saturated listener, over veth, until connect() returns | p50 µs | p99 µs | ended |\n|---|---|---|---|\n";
    for (name, key) in [
        ("connguard listener guard (RST)", "connguard_rst"),
        ("nftables reject with tcp reset (input)", "nftables_reject"),
        (
            "no guard (SYN dropped, retransmits; 3 s timeout)",
            "no_guard",
        ),
    ] {
        out += &format!(
            "| {name} | {:.1} | {:.1} | {} |\n",
            us(&i[key]["p50"]),
            us(&i[key]["p99"]),
            ended(&i[key])
        );
    }
    let (st, po) = (&r["stats_ms"], &r["ports_ms"]);
    out += "\n| one-shot | ms | next to |\n|---|---|---|\n";
    out += &format!(
        "| `connguard stats --json`, {} destinations | {:.1} | |\n",
        st["destinations"],
        f(&st["stats"])
    );
    out += &format!(
        "| metrics scrape, same | {:.1} | daemon's peak RSS after both: {:.1} MiB |\n",
        f(&st["scrape"]),
        f(&st["daemon_peak_rss_mib"])
    );
    out += &format!(
        "| `connguard ports`, {} TIME_WAIT | {:.1} | `ss -tan state time-wait`: {:.1} ms ({:.2}×) |\n",
        po["time_wait"],
        f(&po["ports"]),
        f(&po["ss"]),
        f(&po["ports"]) / f(&po["ss"]).max(0.001)
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
    out
}
