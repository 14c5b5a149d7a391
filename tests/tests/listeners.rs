//! Listener accept-queue exhaustion: detected, and shed with RSTs by listener guards.
use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    time::{Duration, Instant},
};

use connguard_api::policy::{Listener, Mode, Policy, Scope};
use connguard_tests::{
    Cgroup, Daemon, Netns, Outcome, Probe, listener_policy, monotonic_ms, nstat,
};

/// The listener's address on a `Netns::veth_pair`'s server side.
const SERVER: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1)), 8080);

/// somaxconn 1 and listen(1000), never accepting: the queue holds backlog + 1,
/// so 2 connects complete and the 3rd waits; the listener is shown 2 of 1, full, with
/// its process and scope, and the overflow counters equal nstat's.
#[test]
fn full_accept_queue_is_named_with_backlog_process_and_scope() {
    let ns = Netns::new("cglisten");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    ns.exec("sysctl", &["-qw", "net.core.somaxconn=1"]);
    let server = Cgroup::new("listen-server");
    let client = Cgroup::new("listen-client");
    let d =
        Daemon::builder(Policy::new().scope(Scope::new("api", &server.rel).mode(Mode::Observe)))
            .start();
    let listener = server.hold(Probe::listen(
        ns.path(),
        "127.0.0.1:8090".parse().unwrap(),
        1000,
    ));
    let before = nstat(&ns, "TcpExtListenOverflows");
    let clients = client.hold(Probe::Open {
        netns: ns.path(),
        addr: "127.0.0.1:8090".parse().unwrap(),
        count: 3,
        interval_ms: 0,
        timeout_ms: 500,
    });
    assert_eq!(
        (clients.outcome.ok, clients.outcome.attempts),
        (2, 3),
        "{:?}",
        clients.outcome
    );

    // SYN retransmits may land while we read: bracket the reading with nstat's.
    let (overflows_before, drops_before) = (
        nstat(&ns, "TcpExtListenOverflows"),
        nstat(&ns, "TcpExtListenDrops"),
    );
    let r = d.listeners(&ns.path());
    let (overflows_after, drops_after) = (
        nstat(&ns, "TcpExtListenOverflows"),
        nstat(&ns, "TcpExtListenDrops"),
    );
    let l = &r.listeners[0];
    assert_eq!(l.addr, "127.0.0.1:8090", "{r:?}");
    assert_eq!(
        (l.accept_queue, l.backlog, l.state.as_str()),
        (2, 1, "full"),
        "{l:?}"
    );
    assert_eq!(
        l.process,
        Some(format!("guard-probe[{}]", listener.child.id())),
        "{l:?}"
    );
    assert_eq!(
        (l.cgroup.as_deref(), l.scope.as_deref()),
        (Some(server.rel.as_str()), Some("api")),
        "{l:?}"
    );
    // The 3rd client's SYNs were dropped: the counters grew, and equal nstat's.
    let overflows = r.counters["ListenOverflows"];
    let drops = r.counters["ListenDrops"];
    assert!(overflows > before, "{r:?}");
    for (ours, lo, hi) in [
        (overflows, overflows_before, overflows_after),
        (drops, drops_before, drops_after),
    ] {
        assert!(
            (lo..=hi).contains(&ours),
            "{ours} outside nstat's {lo}..={hi}"
        );
        if lo == hi {
            assert_eq!(ours, lo);
        }
    }
    let w = &r.warnings[0];
    assert!(w.starts_with("127.0.0.1:8090 (guard-probe["), "{w}");
    assert!(
        w.contains("has 2 connections waiting to be accepted, past its backlog of 1"),
        "{w}"
    );
}

/// Without a guard, clients past a full queue wait on SYN retransmits (1 s and more).
#[test]
fn without_the_guard_clients_past_the_queue_wait_over_a_second() {
    let (server, client) = Netns::veth_pair();
    let server_cg = Cgroup::new("noguard-server");
    let client_cg = Cgroup::new("noguard-client");
    let _listener = server_cg.hold(Probe::listen(server.path(), SERVER, 8));
    let burst = client_cg.hold(Probe::Open {
        netns: client.path(),
        addr: SERVER,
        count: 11,
        interval_ms: 0,
        timeout_ms: 1500,
    });
    let o = &burst.outcome;
    assert_eq!(
        (o.ok, o.errors("TIMEOUT")),
        (9, 2),
        "the queue holds backlog + 1: {o:?}"
    );
}

/// The guard in one namespace over loopback (RST sent back through lo), IPv4 and IPv6,
/// with SYN cookies off and always on: 20 clients against listen(8), 7 admitted.
#[test]
fn loopback_ipv4_and_ipv6_with_and_without_syncookies() {
    for (addr, syncookies) in [("127.0.0.1:8080", "0"), ("[::1]:8080", "2")] {
        let ns = Netns::new("cglo");
        ns.exec("ip", &["link", "set", "lo", "up"]);
        ns.exec(
            "sysctl",
            &["-qw", &format!("net.ipv4.tcp_syncookies={syncookies}")],
        );
        let cg = Cgroup::new("lo-guard");
        let d = Daemon::builder(listener_policy(&ns, Mode::Enforce)).start();
        let addr: SocketAddr = addr.parse().unwrap();
        let _listener = cg.hold(Probe::listen(ns.path(), addr, 8));
        let retransmitted = nstat(&ns, "TcpExtTCPSynRetrans");
        let burst = cg.hold(Probe::Open {
            netns: ns.path(),
            addr,
            count: 20,
            interval_ms: 200,
            timeout_ms: 3000,
        });
        let o = &burst.outcome;
        assert_eq!(
            (o.ok, o.errors("ECONNREFUSED")),
            (7, 13),
            "{addr} syncookies={syncookies}: {o:?}"
        );
        // Each refusal is the RST that answers the first SYN: none is sent again.
        assert_eq!(
            nstat(&ns, "TcpExtTCPSynRetrans") - retransmitted,
            0,
            "{addr} syncookies={syncookies}: SYNs retransmitted: {o:?}"
        );
        assert!(o.max_error_us < 1_000_000, "{o:?}");
        assert_eq!(d.stats().listeners[0].rst_shed, 13);
    }
}

/// listen(fd, 8), never accepting, 50 clients over a veth pair, one every 200 ms: the
/// queue fills to the watermark (7 of 8), every later client gets ECONNREFUSED at once
/// from a RST, the RST count equals the refusals, and once the server accepts and its
/// queue drains, new connections succeed again.
#[test]
fn saturated_listener_answers_syns_with_rst_until_it_drains() {
    let (server, client) = Netns::veth_pair();
    let server_cg = Cgroup::new("rst-server");
    let client_cg = Cgroup::new("rst-client");
    let d = Daemon::builder(listener_policy(&server, Mode::Enforce))
        .metrics()
        .start();
    let listener = server_cg.hold(Probe::Listen {
        netns: server.path(),
        addr: SERVER,
        backlog: 8,
        accept_after_ms: None,
        on_usr1: true,
    });
    let retransmitted = nstat(&client, "TcpExtTCPSynRetrans");
    let burst = client_cg.hold(Probe::Open {
        netns: client.path(),
        addr: SERVER,
        count: 50,
        interval_ms: 200,
        timeout_ms: 5000,
    });
    let o = &burst.outcome;
    assert_eq!(
        (o.ok, o.errors("ECONNREFUSED"), o.attempts),
        (7, 43, 50),
        "{o:?}"
    );
    // Each refusal is the RST that answers the first SYN: none is sent again (the first
    // retransmit comes after 1 s, TCP_TIMEOUT_INIT).
    assert_eq!(
        nstat(&client, "TcpExtTCPSynRetrans") - retransmitted,
        0,
        "SYNs retransmitted: {o:?}"
    );
    assert!(
        o.max_error_us < 1_000_000,
        "slowest refusal took {} µs",
        o.max_error_us
    );
    let stats = d.stats();
    assert_eq!(stats.listeners[0].rst_shed, 43, "{stats:?}");
    let q = &stats.listeners[0].queues[0];
    assert_eq!(
        (q.addr.as_str(), q.accept_queue, q.backlog),
        ("192.0.2.1:8080", 7, 8),
        "{stats:?}"
    );
    let metrics = d.metrics();
    for line in [
        "connguard_listener_rst_shed_total{listener=\"api\"} 43".to_string(),
        format!(
            "connguard_listener_accept_queue{{listener=\"api\",addr=\"192.0.2.1:8080\",inode=\"{}\"}} 7",
            q.inode
        ),
        format!(
            "connguard_listener_socket_rst_shed_total{{listener=\"api\",addr=\"192.0.2.1:8080\",inode=\"{}\"}} 43",
            q.inode
        ),
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "no {line:?} in\n{metrics}"
        );
    }
    let listeners = || d.listeners(&server.path()).listeners[0].clone();
    let l = listeners();
    assert_eq!(
        (l.accept_queue, l.backlog, l.rst_shed),
        (7, 8, Some(43)),
        "{l:?}"
    );
    // Once the server accepts (cued by SIGUSR1) and its queue has drained, every new
    // connection succeeds: the RST is decided per SYN on the queue as it is then.
    // SAFETY: kill(2) on the listener's own pid.
    assert_eq!(
        unsafe { libc::kill(listener.child.id() as i32, libc::SIGUSR1) },
        0
    );
    let until = Instant::now() + Duration::from_secs(5);
    while listeners().accept_queue != 0 {
        assert!(
            Instant::now() < until,
            "the queue did not drain: {:?}",
            listeners()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let after = client_cg.hold(Probe::Open {
        netns: client.path(),
        addr: SERVER,
        count: 5,
        interval_ms: 0,
        timeout_ms: 1000,
    });
    assert_eq!(after.outcome.ok, 5, "{:?}", after.outcome);
}

/// Observe mode sends no RST: clients past the queue wait, and would-be RSTs are counted.
#[test]
fn observe_mode_sends_no_rst_and_counts_them() {
    let (server, client) = Netns::veth_pair();
    let server_cg = Cgroup::new("obs-server");
    let client_cg = Cgroup::new("obs-client");
    let d = Daemon::builder(listener_policy(&server, Mode::Observe)).start();
    let _listener = server_cg.hold(Probe::listen(server.path(), SERVER, 8));
    let burst = client_cg.hold(Probe::Open {
        netns: client.path(),
        addr: SERVER,
        count: 12,
        interval_ms: 200,
        timeout_ms: 300,
    });
    let o = &burst.outcome;
    assert_eq!(o.errors("ECONNREFUSED"), 0, "{o:?}");
    assert_eq!(o.ok, 9, "the queue holds backlog + 1: {o:?}");
    let stats = d.stats();
    let g = &stats.listeners[0];
    assert_eq!(g.rst_shed, 0, "{stats:?}");
    // Clients 8 to 12 came while the queue was past the watermark (7 of 8); SYN
    // retransmits of those left waiting count again.
    assert!(g.would_rst >= 5, "{stats:?}");
}

/// An established connection to the listener exchanges data all through the shedding.
#[test]
fn established_connections_exchange_data_while_new_ones_are_shed() {
    let (server, client) = Netns::veth_pair();
    let server_cg = Cgroup::new("talk-server");
    let client_cg = Cgroup::new("talk-client");
    let d = Daemon::builder(listener_policy(&server, Mode::Enforce)).start();
    let _listener = server_cg.hold(Probe::Echo1 {
        netns: server.path(),
        addr: SERVER,
        backlog: 8,
    });
    let (path, probe) = (
        client.path(),
        client_cg.command(connguard_tests::probe_bin()),
    );
    let talker = std::thread::spawn(move || {
        let mut probe = probe;
        let talk = Probe::Talk {
            netns: path,
            addr: SERVER,
            rounds: 50,
            interval_ms: 100,
        };
        probe.args(talk.args()).output().unwrap()
    });
    // Let the talker's connection be the one accepted.
    std::thread::sleep(std::time::Duration::from_millis(300));
    let burst = client_cg.hold(Probe::Open {
        netns: client.path(),
        addr: SERVER,
        count: 20,
        interval_ms: 200,
        timeout_ms: 3000,
    });
    assert_eq!(
        (burst.outcome.ok, burst.outcome.errors("ECONNREFUSED")),
        (7, 13),
        "{:?}",
        burst.outcome
    );
    let talk = talker.join().unwrap();
    let talk: connguard_tests::Outcome = serde_json::from_slice(&talk.stdout).unwrap();
    assert_eq!((talk.ok, talk.attempts), (50, 50), "{talk:?}");
    assert_eq!(d.stats().listeners[0].rst_shed, 13);
}

/// A `[[listener]]` for port 8080 in `ns` with an accept-queue watermark of 0.5.
fn half_full(name: &str, ns: &Netns) -> Listener {
    Listener::new(name, [8080])
        .netns(&ns.path())
        .accept_queue_watermark(0.5)
        .mode(Mode::Enforce)
}

/// Waits (deadline 5 s) until the daemon's reading lists `n` sockets of listener guard
/// `index`: its entry is in the kernel.
fn wait_listed(d: &Daemon, index: usize, n: usize) {
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let stats = d.stats();
        let listed = stats.listeners.get(index).map_or(0, |l| l.queues.len());
        if listed == n {
            return;
        }
        assert!(
            Instant::now() < until,
            "{n} sockets never listed: {stats:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// 50 clients at once, no pacing, against listen(8) with a watermark of 0.5, across a
/// veth pair: the decision is made per SYN from the listener's own queues, so 4
/// complete (one more per other CPU checking SYNs at the same moment), the others are
/// refused by a RST at once, and none waits a SYN retransmit; with SYN cookies off, on
/// and always on.
#[test]
fn a_burst_stops_at_the_watermark_per_syn() {
    for syncookies in ["0", "1", "2"] {
        let (server, client) = Netns::veth_pair();
        server.exec(
            "sysctl",
            &["-qw", &format!("net.ipv4.tcp_syncookies={syncookies}")],
        );
        let cg = Cgroup::new("burst");
        let d = Daemon::builder(Policy::new().listener(half_full("api", &server))).start();
        let _listener = cg.hold(Probe::listen(server.path(), SERVER, 8));
        wait_listed(&d, 0, 1);
        let retransmitted = nstat(&client, "TcpExtTCPSynRetrans");
        let b = cg.hold(Probe::Burst {
            netns: client.path(),
            addr: SERVER,
            count: 50,
            timeout_ms: 3000,
            retries: 0,
            pause_ms: 0,
        });
        let o = &b.outcome;
        // The guard counts the accept queue and the handshakes in flight, so a batch of
        // SYNs (a qemu TCG guest's veth hands over several before any handshake
        // completes) stops at the watermark too. SYNs checked at the same moment on
        // several CPUs each see the others' as not yet made: one more per other CPU can
        // get in. With cookies always on the kernel keeps no request for a handshake in
        // flight, so a batch can pass the watermark (never a retransmit: asserted below).
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
        if syncookies == "2" {
            assert!(o.ok >= 4, "syncookies={syncookies}: {o:?}");
        } else {
            assert!(
                (4..=3 + cpus).contains(&o.ok),
                "syncookies={syncookies}: {o:?}"
            );
        }
        assert_eq!(
            (o.errors("ECONNREFUSED"), o.errors("TIMEOUT")),
            (50 - o.ok, 0),
            "syncookies={syncookies}: {o:?}"
        );
        // Each refusal is the RST that answers the first SYN: none is sent again (the
        // first retransmit comes after 1 s, TCP_TIMEOUT_INIT), and no client waits as
        // long as one.
        assert_eq!(
            nstat(&client, "TcpExtTCPSynRetrans") - retransmitted,
            0,
            "syncookies={syncookies}: SYNs retransmitted: {o:?}"
        );
        assert!(
            o.max_error_us < 1_000_000 && o.category("max_ok_us") < 1_000_000,
            "syncookies={syncookies}: a client waited as long as a SYN retransmit: {o:?}"
        );
        assert_eq!(d.stats().listeners[0].rst_shed, 50 - o.ok);
    }
}

/// 4 SO_REUSEPORT listeners on one port, watermark 0.5; the first, listen(64), never
/// accepts, the three others, listen(1024), accept everything (so 200 client threads
/// on 2 CPUs never fill them). 200 clients at once, each trying
/// again 5 ms after a refusal (up to 50 times): only SYNs the kernel hands to the
/// stalled member are refused. Its share of the hash is a quarter: about 50 of the 200
/// first SYNs (standard deviation 6), of which it queues 32, and a quarter of each
/// round of retries. Bound: at most 100 refusals in all (a per-port decision refuses
/// every SYN once the stalled member is full). Every client connects, none waits a
/// retransmit. Each refusal is counted once, on the stalled member: its row in `stats`,
/// `listeners --json` and /metrics has them all, the other members' none, and the
/// guard's total is their sum, not repeated on every member.
#[test]
fn reuseport_sheds_only_for_the_stalled_member() {
    let (server, client) = Netns::veth_pair();
    let cg = Cgroup::new("reuseport");
    let d = Daemon::builder(Policy::new().listener(half_full("api", &server)))
        .metrics()
        .start();
    let _group = cg.hold(Probe::Reuseport {
        netns: server.path(),
        addr: SERVER,
        backlog: 64,
        members: 4,
    });
    wait_listed(&d, 0, 4);
    let b = cg.hold(Probe::Burst {
        netns: client.path(),
        addr: SERVER,
        count: 200,
        timeout_ms: 3000,
        retries: 50,
        pause_ms: 5,
    });
    let o = &b.outcome;
    let refused = o.errors("ECONNREFUSED");
    assert_eq!((o.ok, o.errors("TIMEOUT")), (200, 0), "{o:?}");
    assert!((1..=100).contains(&refused), "{refused} refusals: {o:?}");
    assert!(o.category("max_ok_us") < 1_000_000, "{o:?}");
    let stats = d.stats();
    let guard = &stats.listeners[0];
    assert!(guard.per_syn, "{guard:?}");
    assert_eq!(guard.rst_shed, refused);
    // The stalled member is the one with listen(64).
    let stalled = guard
        .queues
        .iter()
        .find(|q| q.backlog == 64)
        .expect("listen(64)");
    let mut per_member: Vec<(bool, u64)> = guard
        .queues
        .iter()
        .map(|q| (q.inode == stalled.inode, q.rst_shed))
        .collect();
    per_member.sort();
    assert_eq!(
        per_member,
        [(false, 0), (false, 0), (false, 0), (true, refused)],
        "{guard:?}"
    );

    let report = d.listeners(&server.path());
    let rows: Vec<(u32, Option<u64>)> = report
        .listeners
        .iter()
        .filter(|l| l.port == 8080)
        .map(|l| (l.inode, l.rst_shed))
        .collect();
    assert_eq!(rows.len(), 4, "{report:?}");
    for (inode, rst) in &rows {
        let own = if *inode == stalled.inode { refused } else { 0 };
        assert_eq!(*rst, Some(own), "{report:?}");
    }
    assert_eq!(
        report.guards.iter().map(|g| g.rst_shed).collect::<Vec<_>>(),
        [refused],
        "{report:?}"
    );

    let metrics = d.metrics();
    let series: Vec<(u32, u64)> = metrics
        .lines()
        .filter_map(|l| l.strip_prefix("connguard_listener_socket_rst_shed_total{"))
        .map(|l| {
            let inode = l.split("inode=\"").nth(1).and_then(|r| r.split('"').next());
            let value = l.rsplit(' ').next();
            match (inode.map(str::parse), value.map(str::parse)) {
                (Some(Ok(i)), Some(Ok(v))) => (i, v),
                _ => panic!("no inode and value in {l:?}"),
            }
        })
        .collect();
    assert_eq!(series.len(), 4, "{metrics}");
    for (inode, n) in series {
        let own = if inode == stalled.inode { refused } else { 0 };
        assert_eq!(n, own, "{metrics}");
    }
    assert!(
        metrics.lines().any(
            |l| l == format!("connguard_listener_rst_shed_total{{listener=\"api\"}} {refused}")
        ),
        "{metrics}"
    );
}

/// Shedding stops within 1 s of the daemon no longer renewing its decisions: stopped
/// (SIGSTOP: its links stay, as a hung daemon's would) and killed (SIGKILL: before
/// Linux 6.6 the clsact filter outlives it). The listener, never accepting, holds 4 of
/// its 8 and has room for 5 more. A client tries every 10 ms from before the signal,
/// refused until the decisions expire.
#[test]
fn decisions_expire_when_the_daemon_stops_renewing_them() {
    let (server, client) = Netns::veth_pair();
    let cg = Cgroup::new("expire");
    let d = Daemon::builder(Policy::new().listener(half_full("api", &server))).start();
    let _listener = cg.hold(Probe::listen(server.path(), SERVER, 8));
    wait_listed(&d, 0, 1);
    let fill = cg.hold(Probe::Open {
        netns: client.path(),
        addr: SERVER,
        count: 6,
        interval_ms: 0,
        timeout_ms: 3000,
    });
    assert_eq!(
        (fill.outcome.ok, fill.outcome.errors("ECONNREFUSED")),
        (4, 2)
    );
    let rst_shed = |d: &Daemon| d.stats().listeners[0].rst_shed;
    // Starts the client, waits until it is being refused, then signals the daemon:
    // returns the client's outcome and how long after the daemon could renew no more
    // (stopped, or dead and reaped) it connected (ms). The killed daemon's state is
    // removed once the client is through, or has failed: `connguard stop` empties the
    // map and removes the filters, which would let the client in with no decision
    // expiring, and takes CPU from it meanwhile (a TCG guest's two vCPUs share one host
    // thread).
    let signal_while_refused = |d: Daemon, signal: i32| -> (Outcome, u64, Option<Daemon>) {
        let (path, probe) = (client.path(), cg.command(connguard_tests::probe_bin()));
        // The probe prints its outcome, then holds its connection until killed.
        let trying = std::thread::spawn(move || {
            let mut probe = probe;
            let burst = Probe::Burst {
                netns: path,
                addr: SERVER,
                count: 1,
                timeout_ms: 3000,
                retries: 400,
                pause_ms: 10,
            };
            let mut child = probe
                .args(burst.args())
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            let mut line = String::new();
            std::io::BufRead::read_line(
                &mut std::io::BufReader::new(child.stdout.take().unwrap()),
                &mut line,
            )
            .unwrap();
            let _ = child.kill();
            let _ = child.wait();
            serde_json::from_str::<Outcome>(&line).unwrap()
        });
        let before = rst_shed(&d);
        let until = Instant::now() + Duration::from_secs(10);
        while rst_shed(&d) < before + 2 {
            assert!(Instant::now() < until, "the client was never refused");
            std::thread::sleep(Duration::from_millis(10));
        }
        let signalled = monotonic_ms();
        let state = (signal == libc::SIGKILL).then(connguard_tests::PinnedState::removed_on_drop);
        let d = if signal == libc::SIGKILL {
            d.exit_keeping_state(libc::SIGKILL);
            None
        } else {
            unsafe { libc::kill(d.pid(), signal) };
            Some(d)
        };
        let stopped = monotonic_ms();
        let o = trying.join().unwrap();
        drop(state);
        let ok_at = o.categories.get("ok_at_ms").copied().unwrap_or(u64::MAX);
        assert!(ok_at >= signalled, "admitted before the signal: {o:?}");
        let after = ok_at.saturating_sub(stopped);
        (o, after, d)
    };
    let (o, after, d) = signal_while_refused(d, libc::SIGSTOP);
    let d = d.unwrap();
    unsafe { libc::kill(d.pid(), libc::SIGCONT) };
    assert_eq!(
        (o.ok, o.categories.get("first_refused")),
        (1, Some(&1)),
        "{o:?}"
    );
    assert!(after < 1000, "admitted {after} ms after SIGSTOP: {o:?}");
    // Its connection makes 5 of 8: still past the watermark, so refused again.
    let (o, after, _) = signal_while_refused(d, libc::SIGKILL);
    assert_eq!(
        (o.ok, o.categories.get("first_refused")),
        (1, Some(&1)),
        "{o:?}"
    );
    assert!(after < 1000, "admitted {after} ms after SIGKILL: {o:?}");
}

/// Two namespaces, each with its own guard and a listener on 127.0.0.1:8080: the one
/// never accepting, listen(8), sheds past its watermark; the other's (listen(128),
/// accepting) 20 clients all connect.
#[test]
fn a_saturated_namespace_does_not_shed_another() {
    let (full, fine) = (Netns::new("cgfull"), Netns::new("cgfine"));
    for ns in [&full, &fine] {
        ns.exec("ip", &["link", "set", "lo", "up"]);
    }
    let cg = Cgroup::new("twons");
    let d = Daemon::builder(
        Policy::new()
            .listener(half_full("full", &full))
            .listener(half_full("fine", &fine)),
    )
    .start();
    let _stalled = cg.hold(Probe::listen(
        full.path(),
        "127.0.0.1:8080".parse().unwrap(),
        8,
    ));
    let _accepting = cg.hold(Probe::Listen {
        netns: fine.path(),
        addr: "127.0.0.1:8080".parse().unwrap(),
        backlog: 128,
        accept_after_ms: Some(0),
        on_usr1: false,
    });
    wait_listed(&d, 0, 1);
    wait_listed(&d, 1, 1);
    let saturate = cg.hold(Probe::Open {
        netns: full.path(),
        addr: "127.0.0.1:8080".parse().unwrap(),
        count: 10,
        interval_ms: 0,
        timeout_ms: 3000,
    });
    assert_eq!(
        (saturate.outcome.ok, saturate.outcome.errors("ECONNREFUSED")),
        (4, 6),
        "{:?}",
        saturate.outcome
    );
    let other = cg.hold(Probe::Burst {
        netns: fine.path(),
        addr: "127.0.0.1:8080".parse().unwrap(),
        count: 20,
        timeout_ms: 3000,
        retries: 0,
        pause_ms: 0,
    });
    assert_eq!(
        (other.outcome.ok, other.outcome.attempts),
        (20, 20),
        "{:?}",
        other.outcome
    );
    let stats = d.stats();
    assert_eq!(
        (stats.listeners[0].rst_shed, stats.listeners[1].rst_shed),
        (6, 0),
        "{stats:?}"
    );
}

/// Whether the daemon's log says a listener guard was attached to `iface`: its line
/// names every interface of one rescan ("attached to vc, vs in netns ..."), as a veth
/// pair's two ends when the rescan comes before one end moves to its namespace.
fn attached_to(log: &str, iface: &str) -> bool {
    log.lines()
        .filter_map(|l| l.split_once("listener guard attached to "))
        .filter_map(|(_, rest)| rest.split_once(" in netns "))
        .any(|(ifaces, _)| ifaces.split(", ").any(|i| i == iface))
}

/// A veth created in a guarded namespace after the daemon started (a new pod's) is
/// guarded within the rescan (every second).
#[test]
fn a_veth_added_after_start_is_guarded() {
    let server = Netns::new("cglate");
    server.exec("ip", &["link", "set", "lo", "up"]);
    let cg = Cgroup::new("late");
    let d = Daemon::builder(Policy::new().listener(half_full("api", &server))).start();
    let client = Netns::new("cglatec");
    Netns::join(&server, &client);
    let _listener = cg.hold(Probe::listen(server.path(), SERVER, 8));
    wait_listed(&d, 0, 1);
    // Room for a TCG guest, slow to rescan the namespace's interfaces.
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let log = d.log.lock().unwrap().clone();
        if attached_to(&log, "vs") {
            break;
        }
        assert!(Instant::now() < until, "vs never attached:\n{log}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let b = cg.hold(Probe::Open {
        netns: client.path(),
        addr: SERVER,
        count: 10,
        interval_ms: 0,
        timeout_ms: 1500,
    });
    assert_eq!(
        (b.outcome.ok, b.outcome.errors("ECONNREFUSED")),
        (4, 6),
        "{:?}",
        b.outcome
    );
}

/// Where the kernel refuses the per-SYN program (here: told to treat it as absent),
/// the polled one applies the daemon's reading: clients 200 ms apart against listen(8)
/// and a watermark of 0.5 get 4 connections, then RSTs.
#[test]
fn without_per_syn_decisions_the_daemon_reading_sheds() {
    let (server, client) = Netns::veth_pair();
    let cg = Cgroup::new("polled");
    let d = Daemon::builder(Policy::new().listener(half_full("api", &server)))
        .without("listener_per_syn")
        .start();
    assert!(
        d.log
            .lock()
            .unwrap()
            .contains("listener guards decide from the daemon's reading"),
        "{}",
        d.log.lock().unwrap()
    );
    let _listener = cg.hold(Probe::listen(server.path(), SERVER, 8));
    wait_listed(&d, 0, 1);
    let b = cg.hold(Probe::Open {
        netns: client.path(),
        addr: SERVER,
        count: 10,
        interval_ms: 200,
        timeout_ms: 3000,
    });
    assert_eq!(
        (b.outcome.ok, b.outcome.errors("ECONNREFUSED")),
        (4, 6),
        "{:?}",
        b.outcome
    );
}
