//! Circuit breakers per destination endpoint, on real connect outcomes inside test
//! network namespaces: refusals (a closed port), timeouts (a black hole), slow
//! handshakes (netem delay on a veth), a retry storm from curl; and the events that
//! report each transition.
use std::{
    process::Stdio,
    thread,
    time::{Duration, Instant},
};

use connguard_tests::{Cgroup, Daemon, Holder, Netns, Outcome, destination, n};
use serde_json::Value;

/// A scope over `cg` whose rule for `dst` carries `[scope.rule.breaker]` with `breaker`
/// (TOML lines).
fn policy(cg: &Cgroup, mode: &str, dst: &str, port: u16, breaker: &str) -> String {
    format!(
        "[[scope]]\nname = \"s\"\ncgroup = \"{}\"\nmode = \"{mode}\"\n\n\
         [[scope.rule]]\nname = \"r\"\ndst = [\"{dst}\"]\nports = [\"{port}\"]\n\
         [scope.rule.breaker]\n{breaker}\n",
        cg.rel
    )
}

/// `connguard events --json --once`: the kinds of the daemon's events, in order, with
/// each event.
fn events(d: &Daemon) -> Vec<Value> {
    let out = d.cli(&["events", "--json", "--once"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The daemon's first breaker_opened event.
fn first_opened(d: &Daemon) -> Value {
    events(d)
        .into_iter()
        .find(|e| e["kind"] == "breaker_opened")
        .expect("a breaker_opened event")
}

/// The kinds of the breaker events, with the step of half-open ones.
fn transitions(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .filter(|e| e["kind"].as_str().unwrap().starts_with("breaker"))
        .map(|e| match e["step"].as_u64() {
            Some(step) => format!("{}({step},{})", e["kind"].as_str().unwrap(), e["percent"]),
            None => e["kind"].as_str().unwrap().to_string(),
        })
        .collect()
}

/// `guard-probe shedlat` in `cg`, inside `ns`: `count` connects one at a time, each
/// given up after `timeout_ms` if set.
fn connects(cg: &Cgroup, ns: &Netns, addr: &str, count: u64, timeout_ms: Option<u64>) -> Outcome {
    let (path, count) = (ns.path(), count.to_string());
    let timeout = timeout_ms.map(|t| t.to_string());
    let mut args = vec!["shedlat", path.as_str(), addr, count.as_str()];
    args.extend(timeout.as_deref());
    cg.probe(&args)
}

/// Writes `text` as the daemon's policy and reloads it; the reload must succeed.
fn reload(d: &Daemon, text: &str) {
    std::fs::write(&d.policy, text).unwrap();
    let r = d.cli(&["reload"]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
}

/// The destination's breaker in the daemon's stats.
fn breaker(d: &Daemon, dst: &str) -> Value {
    let s = d.scope("s");
    destination(&s, dst)["breaker"].clone()
}

/// A server inside `ns` on 127.0.0.1:`port` (guard-probe serve) in a cgroup of its
/// own, which no scope selects; killed, then removed, on drop.
fn serve(ns: &Netns, port: u16) -> (Holder, Cgroup) {
    let outside = Cgroup::new("brksrv");
    (
        outside.hold_args(&["serve", &ns.path(), &port.to_string()]),
        outside,
    )
}

/// A closed port trips the breaker after `min_samples` refusals; while open, connect()
/// fails at once and no SYN leaves the namespace; after `open_for` it lets through
/// exactly one attempt in ten, whose refusal opens it again for twice as long; with a
/// server on the port, the ramp climbs 10 %, 50 % and closes. The events show each
/// transition in order, and a reload keeps the breaker's state.
#[test]
fn a_breaker_opens_on_refusals_sheds_without_a_syn_and_recovers_through_its_ramp() {
    let ns = Netns::new("cgbrk");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    let cg = Cgroup::new("brk");
    let port = 9301;
    let addr = format!("127.0.0.1:{port}");
    let text = policy(
        &cg,
        "enforce",
        "127.0.0.1",
        port,
        "min_samples = 20\nfailure_ratio = 0.5\nopen_for = \"1s\"\nramp = [10, 50, 100]\nstep_successes = 3",
    );
    let d = Daemon::start(&text);

    // 20 refused by the kernel (a RST each), then 10 shed: no SYN for those.
    let before = ns.active_opens();
    let out = connects(&cg, &ns, &addr, 30, None);
    assert_eq!(out.errors("ECONNREFUSED"), 30, "{out:?}");
    assert_eq!(ns.active_opens() - before, 20, "SYNs sent");
    let b = breaker(&d, &addr);
    assert_eq!(
        (b["state"].as_str(), b["percent"].as_u64()),
        (Some("open"), Some(0)),
        "{b}"
    );
    let s = d.scope("s");
    let dst = destination(&s, &addr);
    assert_eq!(
        (
            n(dst, "admitted"),
            n(dst, "shed"),
            n(dst, "breaker_limited"),
            n(dst, "breaker_opened")
        ),
        (20, 10, 10, 1),
        "{dst}"
    );
    // Shed in microseconds on the host: the connect hook's answer (the bound leaves
    // room for a TCG guest, far from a SYN's 1 s retransmit).
    let shed = connects(&cg, &ns, &addr, 20, None);
    assert!(shed.categories["p99_ns"] < 100_000_000, "{shed:?}");

    // A reload that keeps the names keeps the breaker open.
    reload(&d, &format!("{text}errno = \"ECONNREFUSED\"\n"));
    assert_eq!(breaker(&d, &addr)["state"], "open");

    // Half-open at 10 %: of 10 attempts the 10th goes, is refused, and opens it again.
    thread::sleep(Duration::from_millis(1100));
    let before = ns.active_opens();
    let out = connects(&cg, &ns, &addr, 10, None);
    assert_eq!(out.errors("ECONNREFUSED"), 10, "{out:?}");
    assert_eq!(ns.active_opens() - before, 1, "one SYN at 10 %");
    let out = connects(&cg, &ns, &addr, 1, None);
    assert_eq!(out.errors("ECONNREFUSED"), 1, "{out:?}");
    let b = breaker(&d, &addr);
    assert_eq!(b["state"], "open", "{b}");
    // Open for 2 s this time.
    assert!(b["open_remaining_ms"].as_u64().unwrap() > 1000, "{b}");

    // With a server there, the ramp climbs: 3 successes at 10 % (30 attempts), 3 at
    // 50 % (6), then closed.
    let _server = serve(&ns, port);
    thread::sleep(Duration::from_millis(2100));
    // A deadline for a TCG guest, where an attempt and a stats call take 0.4 s.
    let until = Instant::now() + Duration::from_secs(60);
    let mut attempts = 0;
    while breaker(&d, &addr)["state"] != "closed" {
        assert!(
            Instant::now() < until,
            "not closed after {attempts} attempts: {}",
            breaker(&d, &addr)
        );
        connects(&cg, &ns, &addr, 1, None);
        attempts += 1;
    }
    assert_eq!(attempts, 30 + 6 + 1, "attempts until closed");
    let out = connects(&cg, &ns, &addr, 5, None);
    assert_eq!(out.ok, 5, "closed: {out:?}");
    assert_eq!(
        transitions(&events(&d)),
        [
            "breaker_opened",
            "breaker_half_open(0,10)",
            "breaker_opened",
            "breaker_half_open(0,10)",
            "breaker_half_open(1,50)",
            "breaker_closed"
        ]
    );
    let opened = first_opened(&d);
    assert_eq!(
        (
            &opened["ended"],
            &opened["failures"],
            &opened["open_ms"],
            &opened["dst"]
        ),
        (
            &Value::from(20),
            &Value::from(20),
            &Value::from(1000),
            &Value::from(addr.clone())
        ),
        "{opened}"
    );
}

/// A connect skips a breaker it last found closed with nothing due until an outcome
/// fails or a policy is applied again, and then looks again. A destination with 3
/// refusals and then 3 successes is short of failure_ratio 0.8; a reload, then a reload to
/// 0.5 (the kernel's two policy generations are back where they were), and its next
/// attempt is shed with no SYN. A destination first tried between the reloads opens at
/// exactly `min_samples` (5) refusals: 8 attempts, 5 SYNs.
#[test]
fn a_breaker_skipped_while_clear_is_looked_at_again_after_a_failure_or_a_reload() {
    let ns = Netns::new("cgbrkr");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    let cg = Cgroup::new("brkr");
    let (a, b) = ("127.0.0.1:9311", "127.0.0.1:9312");
    let text = |ratio: &str| {
        format!(
            "[[scope]]\nname = \"s\"\ncgroup = \"{}\"\n\n[[scope.rule]]\nname = \"r\"\n\
             dst = [\"127.0.0.1\"]\nports = [\"9311-9312\"]\n[scope.rule.breaker]\n\
             min_samples = 5\nfailure_ratio = {ratio}\nwindow = \"60s\"\nopen_for = \"60s\"\n",
            cg.rel
        )
    };
    let d = Daemon::start(&text("0.8"));
    // Refusals first: the successes after them leave the breaker clear, and skipped.
    let out = connects(&cg, &ns, a, 3, None);
    assert_eq!(out.errors("ECONNREFUSED"), 3, "{out:?}");
    {
        let _server = serve(&ns, 9311);
        assert_eq!(connects(&cg, &ns, a, 3, None).ok, 3);
    }
    assert_eq!(breaker(&d, a)["state"], "closed", "{}", breaker(&d, a));

    reload(&d, &(text("0.8") + "errno = \"ECONNREFUSED\"\n"));
    let before = ns.active_opens();
    let out = connects(&cg, &ns, b, 8, None);
    assert_eq!(out.errors("ECONNREFUSED"), 8, "{out:?}");
    assert_eq!(ns.active_opens() - before, 5, "SYNs to a new destination");
    assert_eq!(breaker(&d, b)["state"], "open", "{}", breaker(&d, b));

    reload(&d, &text("0.5"));
    let before = ns.active_opens();
    let out = connects(&cg, &ns, a, 1, None);
    assert_eq!(out.errors("ECONNREFUSED"), 1, "{out:?}");
    assert_eq!(
        ns.active_opens() - before,
        0,
        "a SYN past a breaker due to open"
    );
    assert_eq!(breaker(&d, a)["state"], "open", "{}", breaker(&d, a));
}

/// A reload that takes a rule's breaker away forgets the breaker: an open one is neither
/// listed nor consulted (connects reach the closed port again, a SYN each), and the
/// breaker put back by the next reload starts closed, with an empty window.
#[test]
fn a_reload_that_drops_a_breaker_forgets_it() {
    let ns = Netns::new("cgbrkd");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    let cg = Cgroup::new("brkd");
    let port = 9321;
    let addr = format!("127.0.0.1:{port}");
    let with = policy(
        &cg,
        "enforce",
        "127.0.0.1",
        port,
        "min_samples = 5\nfailure_ratio = 0.5\nopen_for = \"60s\"",
    );
    let without = format!(
        "[[scope]]\nname = \"s\"\ncgroup = \"{}\"\nmode = \"enforce\"\n\n\
         [[scope.rule]]\nname = \"r\"\ndst = [\"127.0.0.1\"]\nports = [\"{port}\"]\n",
        cg.rel
    );
    let d = Daemon::start(&with);
    let open_breakers = || d.scope("s")["open_breakers"].as_array().map_or(0, Vec::len);

    // 5 refused by the kernel, then the breaker opens and sheds the 6th.
    let before = ns.active_opens();
    let out = connects(&cg, &ns, &addr, 6, None);
    assert_eq!(out.errors("ECONNREFUSED"), 6, "{out:?}");
    assert_eq!(ns.active_opens() - before, 5, "SYNs sent");
    assert_eq!(
        breaker(&d, &addr)["state"],
        "open",
        "{}",
        breaker(&d, &addr)
    );
    assert_eq!(open_breakers(), 1);

    reload(&d, &without);
    assert_eq!(breaker(&d, &addr), Value::Null, "no breaker governs it");
    assert_eq!(open_breakers(), 0);
    let before = ns.active_opens();
    let out = connects(&cg, &ns, &addr, 3, None);
    assert_eq!(out.errors("ECONNREFUSED"), 3, "{out:?}");
    assert_eq!(ns.active_opens() - before, 3, "SYNs sent with no breaker");

    // Back within the old one's 60 s `open_for`: a fresh breaker.
    reload(&d, &with);
    let before = ns.active_opens();
    let out = connects(&cg, &ns, &addr, 1, None);
    assert_eq!(out.errors("ECONNREFUSED"), 1, "{out:?}");
    assert_eq!(ns.active_opens() - before, 1, "a SYN past a fresh breaker");
    let b = breaker(&d, &addr);
    assert_eq!(
        (
            b["state"].as_str(),
            b["window_ended"].as_u64(),
            b["window_failures"].as_u64()
        ),
        (Some("closed"), Some(1), Some(1)),
        "{b}"
    );
}

/// Observe mode runs the same machine: every attempt goes out, what enforce mode would
/// shed is counted, and the breaker opens at the same attempt.
#[test]
fn observe_mode_counts_what_the_breaker_would_shed() {
    let ns = Netns::new("cgbrko");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    let cg = Cgroup::new("brko");
    let addr = "127.0.0.1:9302";
    let d = Daemon::start(&policy(
        &cg,
        "observe",
        "127.0.0.1",
        9302,
        "min_samples = 20",
    ));
    let before = ns.active_opens();
    let out = connects(&cg, &ns, addr, 30, None);
    assert_eq!(out.errors("ECONNREFUSED"), 30, "{out:?}");
    assert_eq!(ns.active_opens() - before, 30, "observe sends every SYN");
    let s = d.scope("s");
    let dst = destination(&s, addr);
    assert_eq!(
        (
            n(dst, "shed"),
            n(dst, "would_shed"),
            n(dst, "breaker_limited"),
            n(dst, "breaker_opened")
        ),
        (0, 10, 10, 1),
        "{dst}"
    );
    assert_eq!(transitions(&events(&d)), ["breaker_opened"]);
}

/// A black hole: connects abandoned at their own 200 ms timeout are failures; after 5
/// the breaker sheds the rest at once.
#[test]
fn a_breaker_opens_on_timeouts() {
    let ns = Netns::with_blackhole("cgbrkt");
    let cg = Cgroup::new("brkt");
    let d = Daemon::start(&policy(&cg, "enforce", "192.0.2.2", 80, "min_samples = 5"));
    let out = connects(&cg, &ns, "192.0.2.2:80", 25, Some(200));
    assert_eq!(
        (out.errors("TIMEOUT"), out.errors("ECONNREFUSED")),
        (5, 20),
        "{out:?}"
    );
    let b = breaker(&d, "192.0.2.2:80");
    assert_eq!(b["state"], "open", "{b}");
}

/// Handshakes slower than `slow_connect_ms`: nftables in the namespace drops every
/// other SYN to the port, so each connect's first SYN is lost and its retransmission,
/// a second later (TCP_TIMEOUT_INIT), connects, as on a lossy path or past a full SYN
/// queue. (The host kernels here have no netem qdisc to delay packets with.) After 5
/// slow ones the breaker opens on `slow_ratio`, though every one connected.
#[test]
fn a_breaker_opens_on_slow_handshakes() {
    let ns = Netns::new("cgbrks");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    ns.exec("nft", &["add", "table", "inet", "cgslow"]);
    ns.exec(
        "nft",
        &[
            "add",
            "chain",
            "inet",
            "cgslow",
            "input",
            "{ type filter hook input priority 0; }",
        ],
    );
    ns.exec(
        "nft",
        &[
            "add",
            "rule",
            "inet",
            "cgslow",
            "input",
            "tcp",
            "dport",
            "9303",
            "tcp",
            "flags",
            "&",
            "(syn|ack)",
            "==",
            "syn",
            "numgen",
            "inc",
            "mod",
            "2",
            "==",
            "0",
            "drop",
        ],
    );
    let outside = Cgroup::new("brksl");
    let _listener = outside.hold_args(&["listen", &ns.path(), "127.0.0.1:9303", "1024"]);
    let cg = Cgroup::new("brks");
    let d = Daemon::start(&policy(
        &cg,
        "enforce",
        "127.0.0.1",
        9303,
        "min_samples = 5\nslow_connect_ms = 500\nslow_ratio = 0.5",
    ));
    let out = connects(&cg, &ns, "127.0.0.1:9303", 10, None);
    assert_eq!((out.ok, out.errors("ECONNREFUSED")), (5, 5), "{out:?}");
    let b = breaker(&d, "127.0.0.1:9303");
    assert_eq!(b["state"], "open", "{b}");
    let opened = first_opened(&d);
    assert_eq!(
        (&opened["ended"], &opened["slow"], &opened["failures"]),
        (&Value::from(5), &Value::from(5), &Value::from(0)),
        "{opened}"
    );
}

/// A retry storm from a client not written here: 20 curl processes at once, each
/// retrying a refused connection 5 times a second apart, against a closed port. Without
/// a breaker all 120 attempts would send a SYN; with one (10 samples, open 60 s), those
/// admitted before the 10th refusal do (10, and at most one more for each other curl
/// then connecting), and every later one fails at once.
#[test]
fn a_curl_retry_storm_stays_under_the_breaker() {
    let ns = Netns::new("cgbrkc");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    let cg = Cgroup::new("brkc");
    let d = Daemon::start(&policy(
        &cg,
        "enforce",
        "127.0.0.1",
        9304,
        "min_samples = 10\nopen_for = \"60s\"",
    ));
    let before = ns.active_opens();
    let curls: Vec<_> = (0..20)
        .map(|_| {
            cg.command("ip")
                .args(["netns", "exec", &ns.name, "curl", "-s", "-o", "/dev/null"])
                .args(["--retry", "5", "--retry-connrefused", "--retry-delay", "1"])
                .arg("http://127.0.0.1:9304/")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("run curl (cargo xtask setup installs it)")
        })
        .collect();
    for mut c in curls {
        let status = c.wait().unwrap();
        assert!(!status.success(), "curl reached a closed port");
    }
    let syns = ns.active_opens() - before;
    assert!(
        (10..=29).contains(&syns),
        "{syns} SYNs sent by 120 attempts"
    );
    let s = d.scope("s");
    let dst = destination(&s, "127.0.0.1:9304");
    assert_eq!(
        (n(dst, "admitted"), n(dst, "shed")),
        (syns, 120 - syns),
        "{dst}"
    );
}
