//! Ephemeral-port and TIME_WAIT exhaustion, diagnosed on the real kernel.
use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    process::Command,
};

use connguard_api::{
    policy::{Limited, Mode, Policy, Scope},
    ports::{DestinationPorts, EaddrnotavailCount, PortsReport, SourcePool},
};
use connguard_tests::{Cgroup, Daemon, Netns, Probe, ServePort, connguard_bin, json_of};

/// The servers of `serve`.
const TO_8080: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 8080);
const TO_8081: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 8081);

/// A netns with a 100-port ephemeral range, tcp_tw_reuse 0 and tcp_rfc1337 1.
///
/// With tcp_rfc1337 0 a RST at the expected sequence ends a TIME_WAIT
/// (tcp_timewait_state_process in net/ipv4/tcp_minisocks.c), and a loaded machine sends
/// such RSTs: a late segment from the server that fails PAWS makes the TIME_WAIT answer
/// with an ACK, and the server, its socket closed, answers that ACK with a RST. The port
/// is then free before its time, and a count of TIME_WAIT entries is one short.
fn small_range_netns() -> Netns {
    let ns = Netns::new("cgports");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    ns.exec(
        "sysctl",
        &["-qw", "net.ipv4.ip_local_port_range=40000 40099"],
    );
    ns.exec("sysctl", &["-qw", "net.ipv4.tcp_tw_reuse=0"]);
    ns.exec("sysctl", &["-qw", "net.ipv4.tcp_rfc1337=1"]);
    ns
}

/// The namespace's non-zero TCP counters (`nstat -as`), for a failure's message.
fn tcp_counters(ns: &Netns) -> String {
    ns.output("nstat", &["-as"])
        .lines()
        .filter(|l| l.starts_with("Tcp"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `connguard ports --json` for the namespace, with no daemon to ask.
fn ports_json(ns: &Netns) -> PortsReport {
    ports_json_with(ns, "/nonexistent/connguard.sock")
}

/// `connguard ports --json` for the namespace, asking the daemon on `socket`.
fn ports_json_with(ns: &Netns, socket: &str) -> PortsReport {
    let out = Command::new(connguard_bin())
        .args(["ports", "--json", "--netns", &ns.path(), "--socket", socket])
        .output()
        .unwrap();
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The row of `dst` in a ports report of `ns`.
fn destination<'a>(r: &'a PortsReport, ns: &Netns, dst: &str) -> &'a DestinationPorts {
    r.destination(dst).unwrap_or_else(|| {
        panic!(
            "no destination {dst} in {r:#?}\nTCP counters:\n{}",
            tcp_counters(ns)
        )
    })
}

/// `ss -Htan` in the namespace: (src addr, dst addr:port, state, local port) per socket.
fn ss(ns: &Netns) -> Vec<(String, String, String, u16)> {
    ns.output("ss", &["-Htan"])
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (src, sport) = f[3].rsplit_once(':').unwrap();
            (
                src.to_string(),
                f[4].to_string(),
                f[0].to_string(),
                sport.parse().unwrap(),
            )
        })
        .collect()
}

/// Servers on 127.0.0.1:8080 and :8081 in the namespace, run from `cg`, until dropped.
fn serve(cg: &Cgroup, ns: &Netns) -> connguard_tests::Holder {
    cg.hold(Probe::Serve {
        netns: ns.path(),
        ports: vec![ServePort::plain(8080), ServePort::plain(8081)],
    })
}

/// A namespace whose range holds 100 ports, without the daemon: EADDRNOTAVAIL at
/// connection 101 toward :8080, the destination shown at 100 of 100 ports with exactly
/// the TIME_WAIT entries `ss` sees, and :8081 still healthy.
#[test]
fn exhausted_destination_is_named_with_exact_counts() {
    let ns = small_range_netns();
    let cg = Cgroup::new("ports");
    let servers = serve(&cg, &ns);
    let out = cg.probe(Probe::churn(ns.path(), TO_8080, 150));
    assert_eq!(
        (
            out.ok,
            out.errors("EADDRNOTAVAIL"),
            out.category("first_eaddrnotavail")
        ),
        (100, 50, 101),
        "{out:?}\n{}",
        tcp_counters(&ns)
    );
    let other = cg.probe(Probe::churn(ns.path(), TO_8081, 1));
    assert_eq!(other.ok, 1, "the limit is per destination: {other:?}");
    // --pid names the same namespace as --netns.
    let by_pid = Command::new(connguard_bin())
        .args([
            "ports",
            "--json",
            "--socket",
            "/nonexistent/connguard.sock",
            "--pid",
        ])
        .arg(servers.child.id().to_string())
        .output()
        .unwrap();
    let by_pid: PortsReport = json_of("connguard ports --json --pid", &by_pid);
    assert_eq!(by_pid.destinations, ports_json(&ns).destinations);

    let r = ports_json(&ns);
    assert_eq!(
        (r.ephemeral_range, r.ephemeral_ports, r.tcp_tw_reuse),
        ([40000, 40099], 100, 0)
    );
    let d = destination(&r, &ns, "127.0.0.1:8080");
    let ss = ss(&ns);
    let ss_tw = ss
        .iter()
        .filter(|(s, d, st, _)| s == "127.0.0.1" && d == "127.0.0.1:8080" && st == "TIME-WAIT")
        .count();
    assert_eq!(ss_tw, 100, "{ss:?}");
    assert_eq!(
        (d.in_use, d.time_wait, d.active, d.ratio),
        (100, 100, 0, 1.0),
        "{d:?}"
    );
    let other = destination(&r, &ns, "127.0.0.1:8081");
    assert_eq!((other.in_use, other.time_wait), (1, 1), "{other:?}");
    let warnings = &r.warnings;
    assert!(
        warnings.iter().any(|w| w.starts_with(
            "127.0.0.1 -> 127.0.0.1:8080 holds 100 of 100 ephemeral ports (100%): 100 in TIME_WAIT, 0 active. \
             New connections from 127.0.0.1 to 127.0.0.1:8080 fail with EADDRNOTAVAIL."
        )),
        "{warnings:?}"
    );
    assert!(
        !warnings.iter().any(|w| w.contains("-> 127.0.0.1:8081")),
        "{warnings:?}"
    );

    // At rest, the destinations equal what `ss -tan` shows, both ways, state by state
    // (sockets on an ephemeral local port, listeners aside).
    let mut from_ss: BTreeMap<(String, String), BTreeMap<String, u64>> = BTreeMap::new();
    for (src, dst, state, sport) in ss {
        if state != "LISTEN" && (40000..=40099).contains(&sport) {
            *from_ss
                .entry((src, dst))
                .or_default()
                .entry(state)
                .or_default() += 1;
        }
    }
    let mut from_report: BTreeMap<(String, String), BTreeMap<String, u64>> = BTreeMap::new();
    for d in &r.destinations {
        let mut states: BTreeMap<String, u64> = d
            .states
            .iter()
            .map(|(k, v)| (k.clone(), u64::from(*v)))
            .collect();
        if d.time_wait > 0 {
            states.insert("TIME-WAIT".into(), d.time_wait.into());
        }
        assert_eq!(u64::from(d.in_use), states.values().sum::<u64>(), "{d:?}");
        from_report.insert((d.src.clone(), d.dst.clone()), states);
    }
    assert_eq!(from_report, from_ss);
}

/// Sockets bound to a source address without connecting hold ports of that address's
/// pool, shown against the source address. A kernel whose sock_diag does not list
/// bound-only sockets (before 6.7) shows none of them, and says so.
#[test]
fn bind_before_connect_pool_is_reported_per_source_address() {
    let ns = small_range_netns();
    let cg = Cgroup::new("bind");
    let held = cg.hold(Probe::Bind {
        netns: ns.path(),
        addr: "127.0.0.2:0".parse().unwrap(),
        count: 85,
        destinations: Vec::new(),
    });
    assert_eq!(held.outcome.ok, 85);
    let r = ports_json(&ns);
    let warnings = &r.warnings;
    assert!(r.destinations.is_empty(), "{r:?}");
    if r.bound_inactive_listed == Some(false) {
        assert_eq!(r.bound_ports, 0, "{r:?}");
        assert_eq!(r.bound_sources, [], "{r:?}");
        assert_eq!(
            r.warnings,
            [
                "This kernel's sock_diag does not list sockets that are bound but neither \
              connected nor listening (Linux 6.7 and later do): ports held by bind() alone \
              are not counted here, though connect() cannot pick them."
            ],
        );
        return;
    }
    assert_eq!(r.bound_inactive_listed, Some(true), "{r:?}");
    let pool = r.source("127.0.0.2").unwrap_or_else(|| panic!("{r:?}"));
    assert_eq!(
        (pool.in_use, pool.bound_inactive, pool.ratio),
        (85, 85, 0.85),
        "{pool:?}"
    );
    assert_eq!(r.bound_ports, 85, "{r:?}");
    assert!(
        warnings.iter().any(|w| w.starts_with(
            "85 of 100 ephemeral ports (85%) are taken by bind() or listen(), 85 of them bound but unconnected"
        )),
        "{warnings:?}"
    );
}

/// A proxy that binds 127.0.0.6 before each connect() (Envoy, Istio) to two
/// destinations: the source address's pool is spent at exactly the range (bind() fails
/// with EADDRINUSE from the 101st socket) while each destination holds half of it, and
/// connect() without bind() cannot take those ports either. The warning names the
/// address and the remedies, in `ports --json`, its table and `top`.
#[test]
fn a_source_pool_spent_by_bind_before_connect_is_warned_about() {
    let ns = small_range_netns();
    let cg = Cgroup::new("proxy");
    let _servers = serve(&cg, &ns);
    let proxy = cg.hold(Probe::Bind {
        netns: ns.path(),
        addr: "127.0.0.6:0".parse().unwrap(),
        count: 105,
        destinations: vec![TO_8080, TO_8081],
    });
    assert_eq!(
        (proxy.outcome.ok, proxy.outcome.errors("EADDRINUSE")),
        (100, 5),
        "{:?}",
        proxy.outcome
    );
    let plain = cg.probe(Probe::churn(ns.path(), TO_8081, 1));
    assert_eq!(plain.errors("EADDRNOTAVAIL"), 1, "{plain:?}");

    let r = ports_json(&ns);
    for dst in ["127.0.0.1:8080", "127.0.0.1:8081"] {
        let d = destination(&r, &ns, dst);
        assert_eq!(
            (d.src.as_str(), d.in_use, d.available),
            ("127.0.0.6", 50, 50),
            "{d:?}"
        );
    }
    assert_eq!(
        r.bound_sources[0],
        SourcePool {
            src: "127.0.0.6".into(),
            in_use: 100,
            bound_inactive: 0,
            ratio: 1.0
        },
        "{r:?}"
    );
    let warning = "Source address 127.0.0.6 holds 100 of 100 ephemeral ports (100%): connections \
                   to 2 destination(s), and 0 socket(s) bound but unconnected. bind() to \
                   127.0.0.6 with port 0 fails with EADDRINUSE.";
    let remedies = "Remedies: set IP_BIND_ADDRESS_NO_PORT before bind() so that connect() picks \
                    the port per destination; bind to more source addresses; reuse connections";
    let warnings = &r.warnings;
    // Past the first, only the note of a kernel whose sock_diag lists no bound-only socket.
    assert_eq!(
        warnings.len(),
        1 + usize::from(r.bound_inactive_listed != Some(true)),
        "{warnings:?}"
    );
    let first = &warnings[0];
    assert!(
        first.starts_with(warning) && first.contains(remedies),
        "{first}"
    );

    let table = Command::new(connguard_bin())
        .args(["ports", "--netns", &ns.path()])
        .args(["--socket", "/nonexistent/connguard.sock"])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(table.contains(&format!("\nWARNING: {warning}")), "{table}");

    let top = Top::start(&ns);
    let screen = top.screen_with("any (bind() pool)");
    let row = screen
        .lines()
        .find(|l| l.contains("127.0.0.6") && l.contains("any (bind() pool)"))
        .unwrap_or_else(|| panic!("{screen}"));
    assert!(row.contains("████████████████████ 100/100"), "{row}");
    assert!(
        screen.contains("Source address 127.0.0.6 holds 100 of 100 ephemeral ports"),
        "{screen}"
    );
}

/// A daemon whose answer `ports` cannot read (another version of connguard): the report
/// is the one without a daemon, and one line on stderr says why.
#[test]
fn an_answer_it_cannot_read_leaves_the_daemon_free_report_and_one_warning() {
    let ns = small_range_netns();
    let cg = Cgroup::new("other-version");
    let _servers = serve(&cg, &ns);
    let churned = cg.probe(Probe::churn(ns.path(), TO_8080, 3));
    assert_eq!(churned.ok, 3, "{churned:?}");
    let dir = std::env::temp_dir().join(connguard_tests::unique("connguard-other-version"));
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("connguard.sock");
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    std::thread::spawn(move || {
        use std::io::{BufRead, Write};
        for mut conn in listener.incoming().flatten() {
            let mut request = String::new();
            let _ = std::io::BufReader::new(&conn).read_line(&mut request);
            let _ = conn.write_all(br#"{"destinations": "written by another version"}"#);
        }
    });
    let out = Command::new(connguard_bin())
        .args(["ports", "--json", "--netns", &ns.path(), "--socket"])
        .arg(&socket)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let r: PortsReport = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r, ports_json(&ns));
    assert_eq!(destination(&r, &ns, "127.0.0.1:8080").time_wait, 3, "{r:?}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    let head = format!(
        "connguard: warning: the daemon on {} gave no answer this connguard can use (reading \
         the daemon's answer to ports ",
        socket.display()
    );
    assert!(
        lines[0].starts_with(&head)
            && lines[0].ends_with(
                "); this report leaves out what the daemon adds (TIME_WAIT rates, scopes, \
                 EADDRNOTAVAIL counts)"
            ),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// With the daemon: the exhausted destination is attributed to the client's scope with
/// a TIME_WAIT rate, and every EADDRNOTAVAIL is counted for the scope and process name.
#[test]
fn with_the_daemon_rates_scopes_and_eaddrnotavail_are_attributed() {
    let ns = small_range_netns();
    let cg = Cgroup::new("portsd");
    let server_cg = Cgroup::new("portsd-servers");
    let _servers = serve(&server_cg, &ns);
    let d = Daemon::builder(Policy::new().scope(Scope::new("client", &cg.rel).mode(Mode::Observe)))
        .metrics()
        .start();
    let out = cg.probe(Probe::churn(ns.path(), TO_8080, 150));
    let failed = out.errors("EADDRNOTAVAIL");
    assert!((49..=50).contains(&failed), "{out:?}");
    // Rates come from samples every 0.5 s.
    std::thread::sleep(std::time::Duration::from_millis(1200));
    let r = ports_json_with(&ns, &d.socket.display().to_string());
    let d8080 = destination(&r, &ns, "127.0.0.1:8080");
    assert_eq!(d8080.scopes, ["client"], "{d8080:?}");
    assert!(
        d8080.time_wait_per_s.is_some_and(|rate| rate > 0.0),
        "{d8080:?}"
    );
    assert_eq!(d8080.seconds_to_exhaustion, Some(0.0), "{d8080:?}");
    assert_eq!(
        r.eaddrnotavail,
        [EaddrnotavailCount {
            scope: "client".into(),
            comm: "guard-probe".into(),
            count: failed
        }],
        "{r:?}"
    );
    // Every connection left one TIME_WAIT entry, counted for its scope.
    let s = d.scope("client");
    assert_eq!(s.time_wait_created, out.ok, "{s:?}");
    let metrics = d.metrics();
    for line in [
        format!(
            "connguard_scope_time_wait_created_total{{scope=\"client\"}} {}",
            out.ok
        ),
        format!("connguard_eaddrnotavail_total{{scope=\"client\",comm=\"guard-probe\"}} {failed}"),
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "no line {line:?} in\n{metrics}"
        );
    }
    let w = &r.warnings[0];
    assert!(
        w.contains("TIME_WAIT entries are created at") && w.contains("Held by scope(s) client."),
        "{w}"
    );
}

/// With its TIME_WAITS map full (65,536 entries, written with bpftool), the daemon keeps
/// a few copies of it for the TIME_WAIT rates, not one per 0.5 s of the 5 s window: its
/// resident memory grows by less than 64 MiB, which a sample kept every 0.5 s would
/// pass (docs/performance.md has the figures).
#[test]
fn a_full_time_wait_map_costs_the_daemon_a_few_copies_of_it() {
    const ENTRIES: u32 = 65_536;
    let cg = Cgroup::new("twmem");
    let d =
        Daemon::builder(Policy::new().scope(Scope::new("s", &cg.rel).mode(Mode::Observe))).start();
    let rss_kib = || {
        let status = std::fs::read_to_string(format!("/proc/{}/status", d.pid())).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
        line.split_whitespace()
            .nth(1)
            .unwrap()
            .parse::<u64>()
            .unwrap()
    };
    std::thread::sleep(std::time::Duration::from_secs(2));
    let empty = rss_kib();
    let map = connguard_tests::pinned_map_path(guard_common::names::map::TIME_WAITS);
    // Keys as guard_common::TimeWaitKey lays them out: netns, scope id, port, padding,
    // then the IPv4-mapped source and destination; each a destination of its own.
    let hex = |bytes: &[u8]| {
        bytes
            .iter()
            .map(|b| format!("{b:02x} "))
            .collect::<String>()
    };
    let mapped = |ip: [u8; 4]| [&[0u8; 10][..], &[0xff, 0xff], &ip].concat();
    let batch: String = (0..ENTRIES)
        .map(|i| {
            let [_, _, hi, lo] = i.to_be_bytes();
            let key = [
                &4096u64.to_le_bytes()[..],
                &0u32.to_le_bytes(),
                &8080u16.to_le_bytes(),
                &[0, 0],
                &mapped([10, 0, 0, 1]),
                &mapped([10, 1, hi, lo]),
            ]
            .concat();
            format!(
                "map update pinned {map} key hex {}value hex {}\n",
                hex(&key),
                hex(&1u64.to_le_bytes())
            )
        })
        .collect();
    let file = std::env::temp_dir().join(connguard_tests::unique("time-waits.batch"));
    std::fs::write(&file, batch).unwrap();
    connguard_tests::run("bpftool", &["batch", "file", &file.display().to_string()]);
    std::fs::remove_file(&file).unwrap();
    // Two windows' worth of samples.
    std::thread::sleep(std::time::Duration::from_secs(12));
    let full = rss_kib();
    assert!(
        full - empty < 64 * 1024,
        "VmRSS {empty} KiB with the map empty, {full} KiB with it full"
    );
}

/// A port watermark of 0.8 in enforce mode: the churning scope is shed with its errno
/// once 80 of 100 ports toward the destination are held, before the kernel runs out,
/// and another scope still connects to the same destination.
#[test]
fn port_watermark_sheds_one_scope_and_keeps_headroom_for_others() {
    let ns = small_range_netns();
    let churner = Cgroup::new("wm-churner");
    let other = Cgroup::new("wm-other");
    let servers = Cgroup::new("wm-servers");
    let _servers = serve(&servers, &ns);
    // The daemon watches the namespaces of the scope's processes: one that stays (a
    // listener outside the ephemeral range, as a service would have) keeps the
    // namespace watched after the churn's process has exited.
    let _resident = churner.hold(Probe::listen(
        ns.path(),
        "127.0.0.1:9000".parse().unwrap(),
        1,
    ));
    let d = Daemon::builder(
        Policy::new()
            .scope(Scope::new("churner", &churner.rel).port_watermark(0.8))
            .scope(Scope::new("other", &other.rel)),
    )
    .start();
    // 20 connections a second: the daemon re-reads the socket table every 0.5 s.
    let out = churner.probe(Probe::Churn {
        netns: ns.path(),
        addr: TO_8080,
        count: 120,
        per_second: 20,
        reset: false,
    });
    let first = out.category("first_refused");
    assert!(
        (81..=97).contains(&first),
        "shed should start just past 80 held ports: {out:?}"
    );
    assert_eq!(
        out.errors("EADDRNOTAVAIL"),
        0,
        "the watermark must act before the kernel runs out: {out:?}"
    );
    assert_eq!(out.ok + out.errors("ECONNREFUSED"), 120, "{out:?}");
    let r = ports_json(&ns);
    let held = u64::from(destination(&r, &ns, "127.0.0.1:8080").in_use);
    // One TIME_WAIT entry per admitted connection, the rest is headroom.
    assert_eq!(
        held,
        out.ok,
        "ports held after {} admitted connections: {out:?}\n{}",
        out.ok,
        tcp_counters(&ns)
    );
    let o = other.probe(Probe::churn(ns.path(), TO_8080, 3));
    assert_eq!(o.ok, 3, "another scope still connects: {o:?}");
    let stats = d.stats();
    assert!(
        stats
            .watched_ports
            .iter()
            .any(|w| w.dst == "127.0.0.1:8080" && w.ratio >= 0.8),
        "{stats:?}"
    );
    let s = d.scope("churner");
    assert_eq!(s.counts.shed, out.errors("ECONNREFUSED"), "{s:?}");
}

/// `connguard top` for a namespace, without a daemon, in a detached tmux session of
/// 160x40 (a real terminal); the session is killed on drop.
struct Top(String);

impl Top {
    fn start(ns: &Netns) -> Top {
        let top = Top(format!("connguard-top-{}-{}", std::process::id(), ns.name));
        let command = format!(
            "{} top --netns {} --socket /nonexistent/connguard.sock",
            connguard_bin().display(),
            ns.path()
        );
        let started = Command::new("tmux")
            .args(["new-session", "-d", "-s", &top.0, "-x", "160", "-y", "40"])
            .arg(&command)
            .status()
            .expect("tmux is missing: run `cargo xtask setup`");
        assert!(started.success());
        top
    }

    fn screen(&self) -> String {
        let out = Command::new("tmux")
            .args(["capture-pane", "-p", "-t", &self.0])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The screen once it shows `text`, or after 5 s.
    fn screen_with(&self, text: &str) -> String {
        let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let mut screen = self.screen();
        while !screen.contains(text) && std::time::Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_millis(100));
            screen = self.screen();
        }
        screen
    }
}

impl Drop for Top {
    fn drop(&mut self) {
        // Usually gone already (top quit): tmux's "no server running" is expected.
        let _ = Command::new("tmux")
            .args(["kill-session", "-t", &self.0])
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// `connguard top` in a real terminal (tmux): it shows the exhausted destination with
/// its bar and the diagnosis, and quits on q.
#[test]
fn top_shows_the_exhausted_destination_in_a_terminal_and_quits_on_q() {
    let ns = small_range_netns();
    let cg = Cgroup::new("top");
    let _servers = serve(&cg, &ns);
    // Past the range: all 100 ports end up held.
    let out = cg.probe(Probe::churn(ns.path(), TO_8080, 110));
    assert!(out.errors("EADDRNOTAVAIL") > 0, "{out:?}");
    let top = Top::start(&ns);
    let text = top.screen_with("100/100");
    assert!(
        text.contains("ephemeral range 40000-40099 (100 ports), tcp_tw_reuse 0"),
        "{text}"
    );
    let row = text
        .lines()
        .find(|l| l.contains("127.0.0.1:8080"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        row.contains("████████████████████ 100/100") && row.contains(" 100 "),
        "{row}"
    );
    assert!(text.contains("scopes (no daemon answers)"), "{text}");
    // The servers' listeners, with their accept queues (nothing waiting).
    let listener = text
        .lines()
        .find(|l| l.contains("127.0.0.1:8081"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        listener.contains(" ok ") && listener.contains("guard-probe["),
        "{listener}"
    );
    assert!(text.contains("holds 100 of 100 ephemeral ports"), "{text}");
    Command::new("tmux")
        .args(["send-keys", "-t", &top.0, "q"])
        .status()
        .unwrap();
    let until = std::time::Instant::now() + std::time::Duration::from_secs(3);
    while Command::new("tmux")
        .args(["has-session", "-t", &top.0])
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap()
        .success()
    {
        assert!(
            std::time::Instant::now() < until,
            "top did not quit on q:\n{}",
            top.screen()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}
