//! Listener accept-queue exhaustion: detected, and shed with RSTs by listener guards.
use std::process::Command;

use connguard_tests::{Cgroup, Daemon, Netns, connguard_bin, listener_policy};
use serde_json::Value;

/// `nstat -asz NAME` in the namespace: the counter's absolute value.
fn nstat(ns: &Netns, name: &str) -> u64 {
    let out = Command::new("ip")
        .args(["netns", "exec", &ns.name, "nstat", "-asz", name])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in nstat output {text:?}"))
}

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
    let d = Daemon::start(&format!(
        "[[scope]]\nname = \"api\"\ncgroup = \"{}\"\nmode = \"observe\"\n",
        server.rel
    ));
    let listener = server.hold_args(&["listen", &ns.path(), "127.0.0.1:8090", "1000"]);
    let before = nstat(&ns, "TcpExtListenOverflows");
    let clients = client.hold_args(&["open", &ns.path(), "127.0.0.1:8090", "3"]);
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
    let out = Command::new(connguard_bin())
        .args(["listeners", "--json", "--netns", &ns.path(), "--socket"])
        .arg(&d.socket)
        .output()
        .unwrap();
    let (overflows_after, drops_after) = (
        nstat(&ns, "TcpExtListenOverflows"),
        nstat(&ns, "TcpExtListenDrops"),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    let l = &r["listeners"][0];
    assert_eq!(l["addr"], "127.0.0.1:8090", "{r}");
    assert_eq!(
        (
            l["accept_queue"].as_u64(),
            l["backlog"].as_u64(),
            l["state"].as_str()
        ),
        (Some(2), Some(1), Some("full")),
        "{l}"
    );
    assert_eq!(
        l["process"],
        format!("guard-probe[{}]", listener.child.id()),
        "{l}"
    );
    assert_eq!(
        (l["cgroup"].as_str(), l["scope"].as_str()),
        (Some(server.rel.as_str()), Some("api")),
        "{l}"
    );
    // The 3rd client's SYNs were dropped: the counters grew, and equal nstat's.
    let overflows = r["counters"]["ListenOverflows"].as_u64().unwrap();
    let drops = r["counters"]["ListenDrops"].as_u64().unwrap();
    assert!(overflows > before, "{r}");
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
    let w = r["warnings"][0].as_str().unwrap();
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
    let _listener = server_cg.hold_args(&["listen", &server.path(), "192.0.2.1:8080", "8"]);
    let burst = client_cg.hold_args(&["open", &client.path(), "192.0.2.1:8080", "11", "0", "1500"]);
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
        let d = Daemon::start(&listener_policy(&ns, "enforce"));
        let _listener = cg.hold_args(&["listen", &ns.path(), addr, "8"]);
        let burst = cg.hold_args(&["open", &ns.path(), addr, "20", "200", "3000"]);
        let o = &burst.outcome;
        assert_eq!(
            (o.ok, o.errors("ECONNREFUSED")),
            (7, 13),
            "{addr} syncookies={syncookies}: {o:?}"
        );
        assert!(o.max_error_us < 50_000, "{o:?}");
        assert_eq!(d.stats()["listeners"][0]["rst_shed"], 13);
    }
}

/// listen(fd, 8), never accepting, 50 clients over a veth pair, one every 200 ms: the
/// queue fills to the watermark (7 of 8), every later client gets ECONNREFUSED at once
/// from a RST, the RST count equals the refusals, and once the server accepts, new
/// connections succeed again within 1 s.
#[test]
fn saturated_listener_answers_syns_with_rst_until_it_drains() {
    let (server, client) = Netns::veth_pair();
    let server_cg = Cgroup::new("rst-server");
    let client_cg = Cgroup::new("rst-client");
    let d = Daemon::with_metrics(&listener_policy(&server, "enforce"));
    // Accepts everything after 11 s (the burst takes 10 s).
    let started = std::time::Instant::now();
    let _listener =
        server_cg.hold_args(&["listen", &server.path(), "192.0.2.1:8080", "8", "11000"]);
    let burst = client_cg.hold_args(&[
        "open",
        &client.path(),
        "192.0.2.1:8080",
        "50",
        "200",
        "5000",
    ]);
    let o = &burst.outcome;
    assert_eq!(
        (o.ok, o.errors("ECONNREFUSED"), o.attempts),
        (7, 43, 50),
        "{o:?}"
    );
    assert!(
        o.max_error_us < 50_000,
        "slowest refusal took {} µs",
        o.max_error_us
    );
    let stats = d.stats();
    assert_eq!(stats["listeners"][0]["rst_shed"], 43, "{stats}");
    let q = &stats["listeners"][0]["queues"][0];
    assert_eq!(
        (
            q["addr"].as_str(),
            q["accept_queue"].as_u64(),
            q["backlog"].as_u64()
        ),
        (Some("192.0.2.1:8080"), Some(7), Some(8)),
        "{stats}"
    );
    let metrics = d.metrics();
    for line in [
        "connguard_listener_rst_shed_total{listener=\"api\"} 43",
        "connguard_listener_accept_queue{listener=\"api\",addr=\"192.0.2.1:8080\"} 7",
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "no {line:?} in\n{metrics}"
        );
    }
    let out = Command::new(connguard_bin())
        .args(["listeners", "--json", "--netns", &server.path(), "--socket"])
        .arg(&d.socket)
        .output()
        .unwrap();
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    let l = &r["listeners"][0];
    assert_eq!(
        (
            l["accept_queue"].as_u64(),
            l["backlog"].as_u64(),
            l["rst_shed"].as_u64()
        ),
        (Some(7), Some(8), Some(43)),
        "{l}"
    );
    // The server starts accepting at 11 s: 1 s later, connections succeed.
    std::thread::sleep(std::time::Duration::from_secs(12).saturating_sub(started.elapsed()));
    let after = client_cg.hold_args(&["open", &client.path(), "192.0.2.1:8080", "5", "0", "1000"]);
    assert_eq!(after.outcome.ok, 5, "{:?}", after.outcome);
}

/// Observe mode sends no RST: clients past the queue wait, and would-be RSTs are counted.
#[test]
fn observe_mode_sends_no_rst_and_counts_them() {
    let (server, client) = Netns::veth_pair();
    let server_cg = Cgroup::new("obs-server");
    let client_cg = Cgroup::new("obs-client");
    let d = Daemon::start(&listener_policy(&server, "observe"));
    let _listener = server_cg.hold_args(&["listen", &server.path(), "192.0.2.1:8080", "8"]);
    let burst =
        client_cg.hold_args(&["open", &client.path(), "192.0.2.1:8080", "12", "200", "300"]);
    let o = &burst.outcome;
    assert_eq!(o.errors("ECONNREFUSED"), 0, "{o:?}");
    assert_eq!(o.ok, 9, "the queue holds backlog + 1: {o:?}");
    let stats = d.stats();
    let g = &stats["listeners"][0];
    assert_eq!(g["rst_shed"], 0, "{stats}");
    // Clients 8 to 12 came while the queue was past the watermark (7 of 8); SYN
    // retransmits of those left waiting count again.
    assert!(g["would_rst"].as_u64().unwrap() >= 5, "{stats}");
}

/// An established connection to the listener exchanges data all through the shedding.
#[test]
fn established_connections_exchange_data_while_new_ones_are_shed() {
    let (server, client) = Netns::veth_pair();
    let server_cg = Cgroup::new("talk-server");
    let client_cg = Cgroup::new("talk-client");
    let d = Daemon::start(&listener_policy(&server, "enforce"));
    let _listener = server_cg.hold_args(&["echo1", &server.path(), "192.0.2.1:8080", "8"]);
    let (path, probe) = (
        client.path(),
        client_cg.command(connguard_tests::probe_bin()),
    );
    let talker = std::thread::spawn(move || {
        let mut probe = probe;
        probe
            .args(["talk", &path, "192.0.2.1:8080", "50", "100"])
            .output()
            .unwrap()
    });
    // Let the talker's connection be the one accepted.
    std::thread::sleep(std::time::Duration::from_millis(300));
    let burst = client_cg.hold_args(&[
        "open",
        &client.path(),
        "192.0.2.1:8080",
        "20",
        "200",
        "3000",
    ]);
    assert_eq!(
        (burst.outcome.ok, burst.outcome.errors("ECONNREFUSED")),
        (7, 13),
        "{:?}",
        burst.outcome
    );
    let talk = talker.join().unwrap();
    let talk: connguard_tests::Outcome = serde_json::from_slice(&talk.stdout).unwrap();
    assert_eq!((talk.ok, talk.attempts), (50, 50), "{talk:?}");
    assert_eq!(d.stats()["listeners"][0]["rst_shed"], 13);
}
