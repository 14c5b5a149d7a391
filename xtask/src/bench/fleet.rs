//! Fleet chaos: three daemons ("hosts") on this machine share a budget of 60 through a
//! real etcd, each with 50 clients that keep connecting to one loopback server, while
//! etcd and the daemons are killed and restarted at random. The server's highest count
//! of connections at once must never pass the budget.
use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::ensure;
use connguard_tests::{
    Cgroup, Daemon, Server,
    etcd::Etcd,
    fleet::{Clients, SCOPE, TTL, clients, host_policy},
    unique,
};

use super::report::FleetChaos;

const TOTAL: u64 = 60;
const CLIENTS: u64 = 50;

/// One host: its clients' cgroup, its daemon (restarted on the same state directory
/// and control socket, so that it adopts its pinned state and its fleet lease), and its
/// clients.
struct Host {
    cgroup: Cgroup,
    policy: String,
    state_dir: PathBuf,
    socket: PathBuf,
    daemon: Option<Daemon>,
    clients: Option<Clients>,
}

impl Host {
    fn start_daemon(&mut self, adopting: bool) {
        // A lease longer than a restart here takes: the programs keep shedding while no
        // daemon runs (see docs/fleet.md).
        let mut b = Daemon::builder(&self.policy)
            .state_dir(self.state_dir.clone())
            .socket(self.socket.clone())
            .args(&["--lease", "10"]);
        if adopting {
            b = b.adopting();
        }
        self.daemon = Some(b.start());
    }
}

/// A small xorshift generator: the run's choices, reproducible from its seed.
struct Dice(u64);

impl Dice {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }

    fn millis(&mut self, from: u64, to: u64) -> Duration {
        Duration::from_millis(from + self.below(to - from))
    }
}

pub fn chaos(length: Duration) -> anyhow::Result<FleetChaos> {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos() as u64
        | 1;
    let mut dice = Dice(seed);
    let mut etcd = Etcd::start();
    let server = Server::start("127.0.0.1:0");
    let prefix = format!("/{}/", unique("bench-fleet"));
    let dir = std::env::temp_dir().join(unique("bench-fleet"));
    std::fs::create_dir_all(&dir)?;
    let mut hosts: Vec<Host> = (1..=3)
        .map(|i| {
            let cgroup = Cgroup::new(&format!("bench-fleet-host{i}"));
            let policy = host_policy(
                &etcd.endpoint(),
                &prefix,
                &format!("host{i}"),
                &cgroup,
                server.addr.port(),
                TOTAL,
            )
            .to_toml();
            Host {
                cgroup,
                policy,
                state_dir: PathBuf::from("/sys/fs/bpf").join(unique("bench-fleet")),
                socket: dir.join(format!("host{i}.sock")),
                daemon: None,
                clients: None,
            }
        })
        .collect();
    for h in &mut hosts {
        h.start_daemon(false);
    }
    for h in &mut hosts {
        h.clients = Some(clients(&h.cgroup, server.addr, CLIENTS));
    }
    let mut report = FleetChaos {
        seconds: length.as_secs(),
        seed,
        ..FleetChaos::default()
    };
    let start = Instant::now();
    let say = |what: String| {
        eprintln!(
            "bench: fleet chaos, {:>6.1} s: {what}",
            start.elapsed().as_secs_f64()
        )
    };
    while start.elapsed() < length {
        match dice.below(4) {
            // etcd down for up to twice the lease's TTL: the hosts fall to their safe
            // shares, then take their shares up again.
            0 => {
                let down = dice.millis(500, 2 * TTL.as_millis() as u64);
                say(format!("etcd killed for {} ms", down.as_millis()));
                etcd.kill();
                std::thread::sleep(down);
                etcd.restart();
                report.etcd_restarts += 1;
            }
            // A daemon SIGKILLed and started again on its pinned state and fleet lease,
            // within its `--lease` and the fleet's TTL: its clients stay governed, and
            // its record claims their connections throughout.
            1 => {
                let i = dice.below(3) as usize;
                let h = &mut hosts[i];
                let down = dice.millis(100, 1000);
                say(format!(
                    "host{} daemon killed for {} ms",
                    i + 1,
                    down.as_millis()
                ));
                if let Some(d) = h.daemon.take() {
                    d.exit_keeping_state(libc::SIGKILL);
                }
                std::thread::sleep(down);
                h.start_daemon(true);
                report.daemon_kills += 1;
            }
            // A host's clients all close, and come back: demand falls and jumps.
            2 => {
                let i = dice.below(3) as usize;
                let h = &mut hosts[i];
                let down = dice.millis(500, 3000);
                say(format!(
                    "host{} clients closed for {} ms",
                    i + 1,
                    down.as_millis()
                ));
                h.clients = None;
                std::thread::sleep(down);
                h.clients = Some(clients(&h.cgroup, server.addr, CLIENTS));
                report.client_restarts += 1;
            }
            // Nothing: the fleet settles.
            _ => {}
        }
        std::thread::sleep(dice.millis(1000, 4000));
        report.server_peak = server.peak();
        let seen: Vec<String> = hosts
            .iter()
            .filter_map(|h| h.daemon.as_ref())
            .map(|d| {
                let s = d.stats();
                let active = s.scope(SCOPE).map_or(0, |s| s.rules[0].counts.active);
                let f = s
                    .fleet
                    .map(|f| (f.budgets[0].share, f.budgets[0].safe, f.last_error));
                format!("active {active} fleet {f:?}")
            })
            .collect();
        say(format!(
            "server now {} peak {}; {seen:?}",
            server.current.load(std::sync::atomic::Ordering::SeqCst),
            report.server_peak
        ));
        ensure!(
            report.server_peak <= TOTAL,
            "the server saw {} connections at once, over the fleet budget of {TOTAL} (seed {seed})",
            report.server_peak
        );
    }
    // Settled at the end: the hosts hold the whole budget again. (Not 20/20/20: a share
    // lent out while a host's clients were closed comes back only as connections close,
    // and these clients hold theirs.)
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let active: Vec<u64> = hosts
            .iter()
            .filter_map(|h| h.daemon.as_ref())
            .map(|d| d.scope(SCOPE).rules[0].counts.active)
            .collect();
        if active.iter().sum::<u64>() == TOTAL {
            break;
        }
        ensure!(
            Instant::now() < until,
            "the hosts did not take the whole budget again after the faults: {active:?} (seed {seed})"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    report.server_peak = server.peak();
    ensure!(
        report.server_peak <= TOTAL,
        "the server saw {} connections",
        report.server_peak
    );
    drop(hosts);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(report)
}
