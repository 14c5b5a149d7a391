//! `cargo xtask demo`: wrk with 300 connections against nginx, without and with a
//! connguard budget of 50; then a retry storm against a failing dependency, without and
//! with a circuit breaker, and its recovery through the ramp; then three hosts sharing
//! one database's budget through etcd (`fleet`): told as a short story.
mod fleet;

use std::{
    io::{BufRead, BufReader},
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::Path,
    process::{Child, Command, Stdio},
    time::Duration,
};

use anyhow::{Context, bail};
use connguard_api::{
    policy::{Breaker, Limited, Mode, Policy, Rule, Scope},
    stats::Snapshot,
};
use connguard_tests::{Cgroup, Netns, Nginx, Probe, ServePort, wrk};

const CONNECTIONS: u64 = 300;
const BUDGET: u64 = 50;
const SECONDS: u64 = 3;

pub fn run(connguard: &Path) -> anyhow::Result<()> {
    let nginx = Nginx::start();
    let client = Cgroup::new("demo-client");
    println!(
        "1. nginx listens on {}. A client cgroup, {}, runs wrk with {CONNECTIONS} connections for {SECONDS} s.\n",
        nginx.addr, client.rel
    );

    let before = wrk(&client, &nginx, CONNECTIONS, SECONDS);
    println!(
        "2. Without connguard: nginx held up to {} connections from the client; {:.0} requests/s.\n",
        before.server_peak, before.requests_per_s
    );

    let dir = std::env::temp_dir().join(format!("connguard-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let policy = dir.join("demo.toml");
    let text = Policy::new()
        .scope(
            Scope::new("client", &client.rel).mode(Mode::Enforce).rule(
                Rule::new("nginx")
                    .dst(["127.0.0.1"])
                    .ports([nginx.addr.port()])
                    .max_connections(BUDGET),
            ),
        )
        .to_toml();
    std::fs::write(&policy, &text)?;
    let socket = dir.join("connguard.sock");
    println!(
        "3. Start connguard with this policy ({}):\n\n{}",
        policy.display(),
        indent(&text)
    );
    let daemon = start(connguard, &policy, &socket)?;

    let after = wrk(&client, &nginx, CONNECTIONS, SECONDS);
    println!(
        "4. With connguard: nginx held up to {} connections from the client (budget {BUDGET}). wrk reported {} connect errors: \
         each was connect() failing at once with ECONNREFUSED, no SYN sent. The {BUDGET} admitted connections carried {:.0} requests/s.\n",
        after.server_peak, after.connect_errors, after.requests_per_s
    );
    let stats = Command::new(connguard)
        .arg("stats")
        .arg("--socket")
        .arg(&socket)
        .output()?;
    println!(
        "5. `connguard stats` now says:\n\n{}",
        indent(&String::from_utf8_lossy(&stats.stdout))
    );

    stop(connguard, &socket, daemon)?;
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "6. `connguard stop`: its programs are detached and its state unpinned; the client is unguarded again.\n"
    );
    retry_storm(connguard, &client)
}

/// The dependency of the retry storm: a port in a namespace of its own.
const DEPENDENCY: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 9400);

/// Part two: a failing dependency, retries multiplying, the breaker opening, the
/// dependency recovering through the ramp.
fn retry_storm(connguard: &Path, client: &Cgroup) -> anyhow::Result<()> {
    let ns = Netns::new("demo-dep");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    println!(
        "7. A dependency fails: nothing listens on {DEPENDENCY} in namespace {}. 20 clients call it, each retrying 5 times \
         (curl --retry 5 --retry-connrefused): 120 connection attempts.",
        ns.name
    );
    let syns = storm(client, &ns)?;
    println!("   Without connguard, {syns} SYNs reached the failing dependency.\n");

    let dir = std::env::temp_dir().join(format!("connguard-demo-storm-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let policy = dir.join("storm.toml");
    let text = Policy::new()
        .scope(
            Scope::new("client", &client.rel).rule(
                Rule::new("dependency")
                    .dst(["127.0.0.1"])
                    .ports([DEPENDENCY.port()])
                    .breaker(
                        Breaker::new()
                            .min_samples(10)
                            .failure_ratio(0.5)
                            .open_for("2s")
                            .ramp([10, 50, 100])
                            .step_successes(3),
                    ),
            ),
        )
        .to_toml();
    std::fs::write(&policy, &text)?;
    let socket = dir.join("connguard.sock");
    println!(
        "8. Start connguard with a circuit breaker on the dependency:\n\n{}",
        indent(&text)
    );
    let daemon = start(connguard, &policy, &socket)?;
    let syns = storm(client, &ns)?;
    println!(
        "   The same storm: {syns} SYNs reached the dependency; the breaker opened after 10 refusals and every later \
         attempt failed at once, no SYN sent.\n"
    );
    println!(
        "9. The dependency recovers (a server on {DEPENDENCY}). Once its open time is over (2 s, doubled at each opening \
         in a row: a retry let through half-open may have met the dependency still down), the breaker half-opens and lets \
         through 10 %, then 50 %, then everything, each step after 3 successes in a row. 40 connects, one at a time:"
    );
    let server = Cgroup::new("demo-dep-server");
    let _serving = server.hold(Probe::Serve {
        netns: ns.path(),
        ports: vec![ServePort::plain(DEPENDENCY.port())],
    });
    wait_half_open(connguard, &socket)?;
    let out = client.probe(Probe::Shedlat {
        netns: ns.path(),
        addr: DEPENDENCY,
        count: 40,
        timeout_ms: None,
    });
    println!(
        "   {} connected, {} refused at once by the breaker.\n",
        out.ok,
        out.errors("ECONNREFUSED")
    );
    let events = Command::new(connguard)
        .args(["events", "--once", "--socket"])
        .arg(&socket)
        .output()?;
    println!(
        "10. `connguard events` told it as it happened:\n\n{}",
        indent(&String::from_utf8_lossy(&events.stdout))
    );
    stop(connguard, &socket, daemon)?;
    let _ = std::fs::remove_dir_all(&dir);
    fleet::run(connguard)
}

/// Waits (10 s at most) until the dependency's breaker is past its open time: the
/// kernel half-opens it at the next attempt, and shows it open until then.
fn wait_half_open(connguard: &Path, socket: &Path) -> anyhow::Result<()> {
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while std::time::Instant::now() < until {
        let out = Command::new(connguard)
            .args(["stats", "--json", "--socket"])
            .arg(socket)
            .output()?;
        let stats: Snapshot = serde_json::from_slice(&out.stdout)?;
        let open = stats
            .scopes
            .first()
            .into_iter()
            .flat_map(|s| &s.destinations)
            .filter_map(|d| d.breaker.as_ref())
            .any(|b| b.state == "open" && b.open_remaining_ms != Some(0));
        if !open {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    bail!("the breaker stayed open")
}

/// 20 curl processes in `client`, each trying `DEPENDENCY` in `ns` once and retrying 5
/// times a second apart; the SYNs the namespace sent (its Tcp ActiveOpens).
fn storm(client: &Cgroup, ns: &Netns) -> anyhow::Result<u64> {
    let before = ns.active_opens();
    let curls = (0..20)
        .map(|_| {
            client
                .command("ip")
                .args(["netns", "exec", &ns.name, "curl", "-s", "-o", "/dev/null"])
                .args(["--retry", "5", "--retry-connrefused", "--retry-delay", "1"])
                .arg(format!("http://{DEPENDENCY}/"))
                .spawn()
                .context("running curl")
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    for mut c in curls {
        c.wait()?;
    }
    Ok(ns.active_opens() - before)
}

/// `connguard run` on `policy`, once it says it is ready.
fn start(connguard: &Path, policy: &Path, socket: &Path) -> anyhow::Result<Child> {
    start_with(connguard, policy, socket, &[])
}

/// `start` with more arguments for `connguard run`.
fn start_with(
    connguard: &Path,
    policy: &Path,
    socket: &Path,
    args: &[&str],
) -> anyhow::Result<Child> {
    let mut daemon = Command::new(connguard)
        .arg("run")
        .arg("--policy")
        .arg(policy)
        .arg("--socket")
        .arg(socket)
        .args(["--metrics", "off"])
        .args(args)
        .stderr(Stdio::piped())
        .spawn()
        .context("starting connguard")?;
    let mut lines = BufReader::new(daemon.stderr.take().context("stderr")?).lines();
    loop {
        match lines.next() {
            Some(Ok(line)) if line.contains("ready") => break,
            Some(Ok(_)) => continue,
            _ => bail!("connguard exited before it was ready"),
        }
    }
    std::thread::spawn(move || lines.for_each(drop));
    Ok(daemon)
}

fn indent(text: &str) -> String {
    text.lines().map(|l| format!("    {l}\n")).collect()
}

/// `connguard stop` of the daemon on `socket`: it detaches its programs, unpins its
/// state and exits, and leaves nothing of connguard in the kernel (SIGTERM would leave
/// its programs attached for the next start).
fn stop(connguard: &Path, socket: &Path, daemon: Child) -> anyhow::Result<()> {
    stop_with(connguard, socket, daemon, &[])
}

/// `stop` with more arguments for `connguard stop`.
fn stop_with(
    connguard: &Path,
    socket: &Path,
    mut daemon: Child,
    args: &[&str],
) -> anyhow::Result<()> {
    // Its own line is left out: the story says what it did.
    let out = Command::new(connguard)
        .arg("stop")
        .arg("--socket")
        .arg(socket)
        .args(args)
        .output()
        .context("running connguard stop")?;
    if !out.status.success() {
        bail!(
            "connguard stop: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    daemon.wait()?;
    Ok(())
}
