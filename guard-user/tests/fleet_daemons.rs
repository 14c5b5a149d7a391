//! Fleet budgets in the daemon: three `connguard run` daemons on this machine ("hosts",
//! each with its own state directory, control socket and cgroup), a real etcd, and real
//! clients connecting to one loopback server. Lease TTL 3 s, refresh 500 ms.
use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use connguard_api::fleet::{BudgetStatus, FleetView, Status};
use connguard_tests::{
    Cgroup, Daemon, Server,
    etcd::Etcd,
    fleet::{Clients, REFRESH, SCOPE, TTL, clients, host_policy},
    probe::Probe,
    unique,
};

const TOTAL: u64 = 60;
const CLIENTS: u64 = 50;

/// One host: its clients' cgroup, its daemon, and its clients while they run.
struct Host {
    cgroup: Cgroup,
    daemon: Daemon,
    clients: Option<Clients>,
}

impl Host {
    fn start(etcd: &Etcd, prefix: &str, name: &str, port: u16) -> Host {
        let cgroup = Cgroup::new(&format!("fleet-{name}"));
        let daemon = Daemon::builder(host_policy(
            &etcd.endpoint(),
            prefix,
            name,
            &cgroup,
            port,
            TOTAL,
        ))
        .own_state()
        .start();
        Host {
            cgroup,
            daemon,
            clients: None,
        }
    }

    fn connect(&mut self, addr: SocketAddr) {
        self.clients = Some(clients(&self.cgroup, addr, CLIENTS));
    }

    fn fleet(&self) -> Status {
        self.daemon
            .stats()
            .fleet
            .expect("stats has no fleet: the daemon does not share")
    }

    fn budget(&self) -> BudgetStatus {
        self.fleet().budgets[0].clone()
    }

    /// The drawing rule's active connections, as the kernel counts them.
    fn active(&self) -> u64 {
        self.daemon.scope(SCOPE).rules[0].counts.active
    }
}

/// Waits until `pred` holds for every host's budget; the time it took, or a failure
/// with what each host last showed.
fn wait_all(
    hosts: &[&Host],
    within: Duration,
    what: &str,
    pred: impl Fn(&BudgetStatus, u64) -> bool,
) -> Duration {
    let start = Instant::now();
    loop {
        let seen: Vec<(BudgetStatus, u64)> =
            hosts.iter().map(|h| (h.budget(), h.active())).collect();
        if seen.iter().all(|(b, active)| pred(b, *active)) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < within,
            "{what}: not within {within:?}; each host (budget, active): {seen:#?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn share_is(n: u64) -> impl Fn(&BudgetStatus, u64) -> bool {
    move |b, active| b.share == Some(n) && active == n
}

/// Three hosts on one etcd and one server, each with 50 clients connecting, at
/// 20/20/20.
struct Fleet3 {
    etcd: Etcd,
    server: Server,
    hosts: Vec<Host>,
}

impl Fleet3 {
    fn start() -> Fleet3 {
        let etcd = Etcd::start();
        let prefix = format!("/{}/", unique("fleet"));
        let server = Server::start("127.0.0.1:0");
        let port = server.addr.port();
        let mut hosts: Vec<Host> = ["host1", "host2", "host3"]
            .iter()
            .map(|n| Host::start(&etcd, &prefix, n, port))
            .collect();
        for h in &hosts {
            let f = h.fleet();
            assert_eq!(f.budgets.len(), 1, "{f:?}");
            assert_eq!(f.budgets[0].total, TOTAL);
        }
        // 150 clients for a budget of 60: 20 each, within three refreshes of the demand.
        for h in &mut hosts {
            h.connect(server.addr);
        }
        let took = wait_all(
            &hosts.iter().collect::<Vec<_>>(),
            REFRESH * 3,
            "20/20/20",
            share_is(20),
        );
        println!(
            "20/20/20 (shares and connections) {} ms after the clients started",
            took.as_millis()
        );
        let fleet = Fleet3 {
            etcd,
            server,
            hosts,
        };
        fleet.assert_within_total();
        fleet
    }

    fn assert_within_total(&self) {
        let peak = self.server.peak();
        assert!(peak <= TOTAL, "the server saw {peak} connections at once");
    }
}

#[test]
fn three_hosts_share_one_budget_and_the_server_never_sees_more() {
    let mut f = Fleet3::start();
    // A connect over the share is refused at once, with ECONNREFUSED.
    let out = f.hosts[0].cgroup.probe(Probe::Connect {
        addr: f.server.addr,
        count: 1,
        concurrency: 1,
    });
    assert_eq!((out.ok, out.errors("ECONNREFUSED")), (0, 1), "{out:?}");
    let status = f.hosts[0].fleet();
    assert_eq!(
        (status.budgets[0].hosts, status.store_errors),
        (3, 0),
        "{status:?}"
    );
    let listed = f.hosts[0].daemon.cli(&["fleet", "--json"]);
    let view: FleetView = connguard_tests::json_of("connguard fleet --json", &listed);
    let has: Vec<(String, u64)> = view.budgets[0]
        .hosts
        .iter()
        .map(|h| (h.identity.clone(), h.has))
        .collect();
    assert_eq!(
        has,
        [
            ("host1".into(), 20),
            ("host2".into(), 20),
            ("host3".into(), 20)
        ]
    );

    // host3 goes idle: the two others reach 30/30.
    f.hosts[2].clients = None;
    let took = wait_all(
        &[&f.hosts[0], &f.hosts[1]],
        REFRESH * 3,
        "30/30 after host3 went idle",
        share_is(30),
    );
    println!("30/30 {} ms after host3's clients closed", took.as_millis());
    f.assert_within_total();

    // host2 dies, its clients with it (SIGKILL): its share is host1's within TTL plus a
    // refresh, plus etcd's check for expired leases (every 500 ms). host1 wants all of
    // its 50.
    f.hosts[1].clients = None;
    f.hosts[1].daemon.kill();
    let took = wait_all(
        &[&f.hosts[0]],
        TTL + REFRESH + Duration::from_millis(500),
        "host1 at 50 after host2 died",
        |b, active| b.share.is_some_and(|s| s >= CLIENTS) && active == CLIENTS,
    );
    println!("host1 took its 50 {} ms after host2 died", took.as_millis());
    f.assert_within_total();
}

#[test]
fn etcd_down_for_30_s_keeps_every_host_within_its_share_then_sharing_resumes() {
    let mut f = Fleet3::start();
    f.etcd.stop();
    let down = Instant::now();
    // Past the lease, each host falls to its safe share (0): it keeps its 20
    // connections and admits nothing, while its 30 other clients keep trying.
    let hosts: Vec<&Host> = f.hosts.iter().collect();
    let took = wait_all(&hosts, TTL + REFRESH, "safe shares", |b, active| {
        b.safe && b.share == Some(0) && active == 20
    });
    println!("safe shares {} ms after etcd stopped", took.as_millis());
    while down.elapsed() < Duration::from_secs(30) {
        for h in &f.hosts {
            assert_eq!(h.active(), 20, "a host admitted more while etcd was down");
        }
        f.assert_within_total();
        std::thread::sleep(Duration::from_millis(500));
    }
    let status = f.hosts[0].fleet();
    assert!(
        status.store_errors > 0 && status.last_error.is_some(),
        "etcd down, yet no store error: {status:?}"
    );
    f.etcd.restart();
    let took = wait_all(
        &hosts,
        Duration::from_secs(10),
        "20/20/20 again",
        share_is(20),
    );
    println!(
        "20/20/20 again {} ms after etcd restarted",
        took.as_millis()
    );
    f.assert_within_total();
}

#[test]
fn an_unreachable_etcd_and_a_taken_identity_are_clear_errors_and_admit_nothing() {
    let etcd = Etcd::start();
    let server = Server::start("127.0.0.1:0");
    let port = server.addr.port();
    let prefix = format!("/{}/", unique("fleet"));
    // No etcd listens on a free port.
    let nowhere = connguard_tests::free_port();
    let cgroup = Cgroup::new("fleet-nowhere");
    let text = host_policy(
        &format!("http://127.0.0.1:{nowhere}"),
        &prefix,
        "lonely",
        &cgroup,
        port,
        TOTAL,
    );
    let lonely = Daemon::builder(text).own_state().start();
    let status = wait_status(&lonely, "etcd unreachable");
    assert_eq!(status.budgets[0].share, Some(0), "{status:?}");
    let out = cgroup.probe(Probe::Connect {
        addr: server.addr,
        count: 1,
        concurrency: 1,
    });
    assert_eq!((out.ok, out.errors("ECONNREFUSED")), (0, 1), "{out:?}");

    // A second live host under host1's identity is refused while the first lives.
    let first = Host::start(&etcd, &prefix, "host1", port);
    assert_eq!(first.fleet().store_errors, 0);
    let twin = Host::start(&etcd, &prefix, "host1", port);
    let status = wait_status(&twin.daemon, "is held by another live host");
    assert_eq!(status.budgets[0].share, Some(0), "{status:?}");
    assert_eq!(first.fleet().last_error, None);
}

/// Waits (10 s at most) until the daemon's fleet reports an error containing `what`.
fn wait_status(daemon: &Daemon, what: &str) -> Status {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let status = daemon.stats().fleet.expect("stats has no fleet");
        if status
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains(what))
        {
            return status;
        }
        assert!(
            Instant::now() < until,
            "no fleet error with {what:?}: {status:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
