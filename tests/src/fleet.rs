//! A fleet's hosts on one machine, for the fleet tests and the demo: each host's policy
//! (one fleet budget toward a loopback server, drawn from by one rule of the host's
//! client cgroup), and its clients.
use std::{net::SocketAddr, process::Child, time::Duration};

use connguard_api::policy::{Fleet, FleetBudget, Mode, Policy, Rule, Scope};

use crate::{Cgroup, Probe, probe_bin};

/// The fleet settings of the tests and the demo: a short lease and refresh keep them
/// quick.
pub const TTL: Duration = Duration::from_secs(3);
pub const REFRESH: Duration = Duration::from_millis(500);
/// The budget's name, and the rule and scope that draw from it.
pub const BUDGET: &str = "orders-db";
pub const SCOPE: &str = "clients";

/// Host `identity`'s policy: a budget of `total` connections toward 127.0.0.1:`port`,
/// shared through the etcd at `endpoint` under `prefix`, drawn from by the scope of
/// `cgroup` (enforcing).
pub fn host_policy(
    endpoint: &str,
    prefix: &str,
    identity: &str,
    cgroup: &Cgroup,
    port: u16,
    total: u64,
) -> Policy {
    Policy::new()
        .fleet(
            Fleet::new([endpoint])
                .identity(identity)
                .prefix(prefix)
                .ttl(&format!("{}s", TTL.as_secs()))
                .refresh(&format!("{}ms", REFRESH.as_millis())),
        )
        .fleet_budget(FleetBudget::new(BUDGET, ["127.0.0.1/32"], total).ports([port]))
        .scope(
            Scope::new(SCOPE, &cgroup.rel)
                .mode(Mode::Enforce)
                .rule(Rule::new("db").fleet(BUDGET)),
        )
}

/// Clients that `clients` started: guard-probe, killed (its connections closed) on drop.
pub struct Clients(Child);

impl Drop for Clients {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `count` clients in `cgroup`, started together, each connecting to `addr` until
/// admitted (every 100 ms, for minutes), then holding its connection: guard-probe
/// `burst`.
pub fn clients(cgroup: &Cgroup, addr: SocketAddr, count: u64) -> Clients {
    let probe = Probe::Burst {
        netns: "/proc/self/ns/net".into(),
        addr,
        count,
        timeout_ms: 1000,
        retries: 3000,
        pause_ms: 100,
    };
    Clients(
        cgroup
            .command(probe_bin())
            .args(probe.args())
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("run guard-probe"),
    )
}
