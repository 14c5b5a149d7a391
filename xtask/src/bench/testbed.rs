//! The bench's network namespace with its servers, the client cgroups, the policies, and
//! the probes run in them: churns, sprays of refused connects, held connections,
//! nftables tables.
use std::{
    io::Write,
    net::SocketAddr,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::Context;
use connguard_api::policy::{Breaker, Limited, Policy, Port, Rule, Scope};
use connguard_tests::{Cgroup, Daemon, Holder, Netns, Probe, ServePort};

use super::report::Mode;

/// The churn's server ports. Orderly closes leave TIME_WAIT entries, which slow the port
/// search of later connects to the same destination: each mode's timed churn has a
/// port of its own (8090 + its index in `Mode::ALL`), the churns read for program costs
/// another (8089), so that no mode pays for another's entries. Resets leave none, and
/// go to 8082, which greets each client (see guard-probe's `serve`). 8080 serves the
/// daemon's load and `ports` measurements, 8081 the refusals.
pub const PORT: u16 = 8080;
pub const REFUSAL_PORT: u16 = 8081;
pub const RESET_PORT: u16 = 8082;
pub const COSTS_PORT: u16 = 8089;
const MODE_PORTS: u16 = 8090;

/// The nftables equivalent of the churn's budget, which is not reached.
pub const CHURN_NFT: &str = "chain out {\n    type filter hook output priority 0;\n    \
    tcp dport { 8082, 8089-8094 } ct count over 1000000 reject with tcp reset\n  }";

pub struct Testbed {
    pub ns: Netns,
    /// The client cgroup the policies' scope selects.
    pub client: Cgroup,
    /// A client cgroup no scope selects.
    pub other: Cgroup,
    /// 1,000 rules governing `client`, budgets not reached.
    pub policy: Policy,
    /// The same with a rate, a handshake budget and a breaker on the matching rule.
    pub with_controls: Policy,
    _servers: Holder,
    _server_cg: Cgroup,
}

impl Testbed {
    pub fn new() -> Testbed {
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
            ServePort::plain(REFUSAL_PORT),
            ServePort::greeting(RESET_PORT),
            ServePort::plain(COSTS_PORT),
        ];
        ports.extend(Mode::ALL.map(|m| ServePort::plain(mode_port(m))));
        let servers = server_cg.hold(Probe::Serve {
            netns: ns.path(),
            ports,
        });
        let client = Cgroup::new("bench-client");
        Testbed {
            policy: rules(&client.rel, POLICY_RULES, Others::Elsewhere, false),
            with_controls: rules(&client.rel, POLICY_RULES, Others::Elsewhere, true),
            client,
            other: Cgroup::new("bench-other"),
            ns,
            _servers: servers,
            _server_cg: server_cg,
        }
    }

    /// Churn rate (connections/s): `n` connects + client-first closes to the local server
    /// on `port`, from `client`, closed with a RST when `reset`, timed by the probe
    /// (process start and netns entry left out).
    pub fn churn(&self, client: &Cgroup, n: usize, port: u16, reset: bool) -> anyhow::Result<f64> {
        let out = client.probe(Probe::Churn {
            netns: self.ns.path(),
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            count: n as u64,
            per_second: 0,
            reset,
        });
        anyhow::ensure!(out.ok == n as u64, "churn lost connections: {out:?}");
        Ok(n as f64 / (out.category("elapsed_ns") as f64 / 1e9))
    }

    /// `n` refused connects to distinct loopback addresses: `n` new tracked destinations.
    pub fn spray(&self, n: usize) -> anyhow::Result<()> {
        self.spray_from(&self.client, n)
    }

    /// The same from `client`.
    pub fn spray_from(&self, client: &Cgroup, n: usize) -> anyhow::Result<()> {
        let out = client.probe(Probe::Spray {
            netns: self.ns.path(),
            count: n as u64,
            port: 9,
        });
        anyhow::ensure!(
            out.errors("ECONNREFUSED") == n as u64,
            "spray did not make {n} destinations: {out:?}"
        );
        Ok(())
    }
}

/// The port of `mode`'s timed churns with orderly closes.
pub fn mode_port(mode: Mode) -> u16 {
    let i = Mode::ALL.iter().position(|m| *m == mode).unwrap_or(0);
    MODE_PORTS + i as u16
}

/// `n` connections from `client` to `target` inside `ns`, held open; all must connect.
pub fn hold_open(
    client: &Cgroup,
    ns: &Netns,
    target: SocketAddr,
    n: u64,
) -> anyhow::Result<Holder> {
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

/// How many rules the testbed's policies have.
pub const POLICY_RULES: u16 = 1000;

/// Where a policy's rules but the last are, from the churns' destination (127.0.0.1).
pub enum Others {
    /// A /24 each in 10.0.0.0/8: the `RULES` lookup of a loopback destination leaves
    /// them at the trie's first split.
    Elsewhere,
    /// A /32 each from 127.0.0.2 on, beside the destination: its lookup descends the
    /// trie among them, one level per bit where they split.
    Beside,
}

/// A policy of `n` rules for the cgroups `cgroup` selects: `n - 1` where `others` says
/// (none matching a churn's or spray's destination), the last one matching loopback,
/// with `controls` a rate, a handshake budget and a breaker besides its budget (none
/// reached).
pub fn rules(cgroup: &str, n: u16, others: Others, controls: bool) -> Policy {
    let mut scope = Scope::new("bench", cgroup).max_connections(1_000_000);
    for i in 0..n.saturating_sub(1) {
        let dst = match others {
            Others::Elsewhere => format!("10.{}.{}.0/24", i / 250, i % 250),
            Others::Beside => {
                let [hi, lo] = (i + 2).to_be_bytes();
                format!("127.0.{hi}.{lo}/32")
            }
        };
        scope = scope.rule(
            Rule::new(&format!("r{i}"))
                .dst([dst])
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

/// An nftables table inet cgbench with one chain in a namespace, deleted on drop.
pub struct Nft<'a>(&'a Netns);

impl<'a> Nft<'a> {
    pub fn load(ns: &'a Netns, chain: &str) -> anyhow::Result<Nft<'a>> {
        let rules = format!("table inet cgbench {{\n  {chain}\n}}\n");
        nft(ns, &["-f", "-"], Some(&rules))?;
        Ok(Nft(ns))
    }
}

impl Drop for Nft<'_> {
    fn drop(&mut self) {
        if let Err(e) = nft(self.0, &["delete", "table", "inet", "cgbench"], None) {
            eprintln!("bench: {e:#}");
        }
    }
}

/// `nft ARGS` in `ns`, with `stdin` written to it.
fn nft(ns: &Netns, args: &[&str], stdin: Option<&str>) -> anyhow::Result<()> {
    let mut child = Command::new("ip")
        .args(["netns", "exec", &ns.name, "nft"])
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .spawn()
        .context("nft is missing: run `cargo xtask setup`")?;
    if let Some(text) = stdin {
        child
            .stdin
            .take()
            .context("nft stdin")?
            .write_all(text.as_bytes())?;
    }
    anyhow::ensure!(child.wait()?.success(), "nft {} failed", args.join(" "));
    Ok(())
}

/// Waits (deadline 5 s) until the daemon's first listener guard has read its listener:
/// its entry is in the kernel.
pub fn wait_guarded(d: &Daemon) -> anyhow::Result<()> {
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
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}
