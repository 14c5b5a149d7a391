//! The control plane: clients that stall or flood delay nobody, concurrent clients each
//! get a whole answer, the control socket is private from its creation, and a watcher
//! that fails for one guard leaves the others working.
use std::{
    io::{Read, Write},
    os::unix::{fs::PermissionsExt, net::UnixStream},
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use connguard_api::{
    policy::{Listener, Mode, Policy, Scope},
    stats::Snapshot,
};
use connguard_tests::{Cgroup, Daemon, Netns, Probe, connguard_bin, json_of, run, unique};

/// A policy that observes one test cgroup.
fn observe(cg: &Cgroup) -> Policy {
    Policy::new().scope(Scope::new("ctl", &cg.rel).mode(Mode::Observe))
}

/// A daemon observing a test cgroup that has made `destinations` tracked destinations
/// (refused connects to distinct loopback addresses in a namespace of its own).
fn daemon_with_destinations(prefix: &str, destinations: u64) -> (Cgroup, Netns, Daemon) {
    let cg = Cgroup::new(prefix);
    let ns = Netns::new("cgctl");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    let d = Daemon::builder(observe(&cg)).start();
    let spray = cg.probe(Probe::Spray {
        netns: ns.path(),
        count: destinations,
        port: 9,
    });
    assert_eq!(spray.errors("ECONNREFUSED"), destinations, "{spray:?}");
    (cg, ns, d)
}

/// `connguard ARGS` against the daemon, timed.
fn timed(d: &Daemon, args: &[&str]) -> (Duration, std::process::Output) {
    let started = Instant::now();
    let out = d.cli(args);
    (started.elapsed(), out)
}

/// A client that connects and sends nothing, one that asks for stats and never reads,
/// and one that sends 1 MiB without a newline: `stats` and `reload` from another client
/// still answer within 1 s of what they take with no such client (a daemon serving one
/// client at a time waits 2 s for the silent one alone; timed against the same command
/// alone, because a qemu TCG guest is slow to build a stats table of these
/// destinations), and the flood is refused after 4 KiB with an error.
#[test]
fn stalled_and_flooding_clients_delay_nobody() {
    // Enough destinations that a stats answer overflows the socket buffers of the
    // client that never reads.
    let (_cg, _ns, d) = daemon_with_destinations("ctl-stall", 3000);
    let commands = [&["stats", "--json"][..], &["stats"], &["reload"]];
    let alone: Vec<Duration> = commands.iter().map(|args| timed(&d, args).0).collect();

    let _silent = UnixStream::connect(&d.socket).unwrap();
    let mut not_reading = UnixStream::connect(&d.socket).unwrap();
    not_reading.write_all(b"stats\n").unwrap();
    let flood = UnixStream::connect(&d.socket).unwrap();
    let mut writer = flood.try_clone().unwrap();
    let flooding = thread::spawn(move || {
        let chunk = vec![b'x'; 1 << 16];
        (0..16)
            .take_while(|_| writer.write_all(&chunk).is_ok())
            .count()
    });
    // Give the daemon the three connections first.
    thread::sleep(Duration::from_millis(200));

    for (args, alone) in commands.iter().zip(alone) {
        let (took, out) = timed(&d, args);
        assert!(
            out.status.success(),
            "connguard {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            took < alone + Duration::from_secs(1),
            "connguard {args:?} took {took:?} with stalled clients, {alone:?} alone"
        );
    }

    let mut answer = String::new();
    flood
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let _ = (&flood).read_to_string(&mut answer);
    assert_eq!(
        answer, "{\"error\":\"request line longer than 4096 bytes\"}",
        "the flooding client's answer"
    );
    let chunks = flooding.join().unwrap();
    assert!(chunks < 16, "the daemon read all of the 1 MiB flood");
}

/// 4 clients asking for `stats --json` at once, 5 times each, each get a complete
/// document with the same 2,000 destinations.
#[test]
fn concurrent_stats_clients_each_get_a_whole_document() {
    let (_cg, _ns, d) = daemon_with_destinations("ctl-concurrent", 2000);
    let counts: Vec<Vec<(u64, usize)>> = thread::scope(|s| {
        let clients: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| {
                    (0..5)
                        .map(|_| {
                            let v: Snapshot =
                                json_of("connguard stats --json", &d.cli(&["stats", "--json"]));
                            let scope = &v.scopes[0];
                            (
                                scope.counts.would_shed + scope.counts.admitted,
                                scope.destinations.len(),
                            )
                        })
                        .collect()
                })
            })
            .collect();
        clients.into_iter().map(|c| c.join().unwrap()).collect()
    });
    for client in counts {
        assert_eq!(client, vec![(2000, 2000); 5]);
    }
}

/// The daemon refuses to start when a file that is not a socket is at --socket, and
/// leaves it as it was; a socket it creates is 0600, in a directory it creates 0700.
#[test]
fn control_socket_is_private_and_never_replaces_a_file() {
    let cg = Cgroup::new("ctl-socket");
    let dir = std::env::temp_dir().join(unique("connguard-ctl"));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("not-a-socket");
    std::fs::write(&file, "keep me").unwrap();
    let policy = dir.join("policy.toml");
    std::fs::write(&policy, observe(&cg).to_toml()).unwrap();
    let mut child = Command::new(connguard_bin())
        .args(["run", "--metrics", "off", "--policy"])
        .arg(&policy)
        .arg("--socket")
        .arg(&file)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > until {
            let _ = child.kill();
            panic!("the daemon started over a regular file at --socket");
        }
        thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(!status.success());
    assert!(stderr.contains("exists and is not a socket"), "{stderr}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me");

    let socket = dir.join("private/connguard.sock");
    let d = Daemon::builder(observe(&cg)).socket(socket.clone()).start();
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!((mode(&dir.join("private")), mode(&socket)), (0o700, 0o600));
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two listener guards in two namespaces; one namespace is deleted under the daemon.
/// The listener watcher logs that it cannot read it (once), and the other guard keeps
/// shedding: 20 clients against listen(8) with a watermark of 0.8, 7 admitted, 13 RSTs.
#[test]
fn a_guard_whose_namespace_is_deleted_leaves_the_others_working() {
    let gone = Netns::new("cggone");
    let kept = Netns::new("cgkept");
    for ns in [&gone, &kept] {
        ns.exec("ip", &["link", "set", "lo", "up"]);
    }
    let guard = |name: &str, port: u16, ns: &Netns| {
        Listener::new(name, [port])
            .netns(&ns.path())
            .accept_queue_watermark(0.8)
    };
    let d = Daemon::builder(
        Policy::new()
            .listener(guard("gone", 8080, &gone))
            .listener(guard("kept", 8081, &kept)),
    )
    .start();
    run("ip", &["netns", "delete", &gone.name]);
    let warning = format!("cannot read the socket table of netns {}", gone.path());
    let until = Instant::now() + Duration::from_secs(5);
    while !d.log.lock().unwrap().contains(&warning) {
        assert!(
            Instant::now() < until,
            "no warning about the deleted namespace in:\n{}",
            d.log.lock().unwrap()
        );
        thread::sleep(Duration::from_millis(20));
    }

    let cg = Cgroup::new("ctl-kept");
    let addr = "127.0.0.1:8081".parse().unwrap();
    let _listener = cg.hold(Probe::listen(kept.path(), addr, 8));
    let burst = cg.hold(Probe::Open {
        netns: kept.path(),
        addr,
        count: 20,
        interval_ms: 200,
        timeout_ms: 3000,
    });
    let o = &burst.outcome;
    assert_eq!((o.ok, o.errors("ECONNREFUSED")), (7, 13), "{o:?}");
    let stats = d.stats();
    let kept_stats = stats.listener("kept").unwrap();
    assert_eq!(kept_stats.rst_shed, 13, "{stats:?}");
    let log = d.log.lock().unwrap().clone();
    assert_eq!(log.matches(&warning).count(), 1, "logged once:\n{log}");
    let watcher = stats.job("listener_watch").unwrap();
    assert!(watcher.runs > 50, "{watcher:?}");
}
