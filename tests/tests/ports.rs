//! Port exhaustion diagnosis on the real kernel (issue 3, CASES 1).
use std::process::Command;

use connguard_tests::{Cgroup, Daemon, Netns, connguard_bin};
use serde_json::Value;

/// A netns with a 100-port ephemeral range and tcp_tw_reuse 0.
fn small_range_netns() -> Netns {
    let ns = Netns::new("cgports");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    ns.exec(
        "sysctl",
        &["-qw", "net.ipv4.ip_local_port_range=40000 40099"],
    );
    ns.exec("sysctl", &["-qw", "net.ipv4.tcp_tw_reuse=0"]);
    ns
}

/// `connguard ports --json` for the namespace, with no daemon to ask.
fn ports_json(ns: &Netns) -> Value {
    ports_json_with(ns, "/nonexistent/connguard.sock")
}

/// `connguard ports --json` for the namespace, asking the daemon on `socket`.
fn ports_json_with(ns: &Netns, socket: &str) -> Value {
    let out = Command::new(connguard_bin())
        .args(["ports", "--json", "--netns", &ns.path(), "--socket", socket])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `ss -Htan` in the namespace: (src addr, dst addr:port, state) per socket.
fn ss(ns: &Netns) -> Vec<(String, String, String)> {
    let out = Command::new("ip")
        .args(["netns", "exec", &ns.name, "ss", "-Htan"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let src = f[3].rsplit_once(':').unwrap().0.to_string();
            (src, f[4].to_string(), f[0].to_string())
        })
        .collect()
}

fn dest<'a>(r: &'a Value, dst: &str) -> &'a Value {
    r["destinations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["dst"] == dst)
        .unwrap_or_else(|| panic!("no {dst} in {r}"))
}

/// CASES 1 without the daemon: EADDRNOTAVAIL at connection 101 toward :8080, the
/// destination shown at 100 of 100 ports with exactly the TIME_WAIT entries `ss` sees,
/// and :8081 still healthy.
#[test]
fn exhausted_destination_is_named_with_exact_counts() {
    let ns = small_range_netns();
    let cg = Cgroup::new("ports");
    let out = cg.probe(&["churn", &ns.path(), "150"]);
    assert_eq!(out.categories["first_eaddrnotavail"], 101, "{out:?}");
    assert_eq!((out.ok, out.errors("EADDRNOTAVAIL")), (100, 50), "{out:?}");
    assert_eq!(
        out.categories["other_port_ok"], 1,
        "the limit is per destination: {out:?}"
    );

    let r = ports_json(&ns);
    assert_eq!(
        (
            r["ephemeral_range"].clone(),
            r["ephemeral_ports"].clone(),
            r["tcp_tw_reuse"].clone()
        ),
        (serde_json::json!([40000, 40099]), 100.into(), 0.into())
    );
    let d = dest(&r, "127.0.0.1:8080");
    let ss = ss(&ns);
    let ss_tw = ss
        .iter()
        .filter(|(s, d, st)| s == "127.0.0.1" && d == "127.0.0.1:8080" && st == "TIME-WAIT")
        .count();
    assert_eq!(ss_tw, 100, "{ss:?}");
    assert_eq!(
        (
            d["in_use"].as_u64(),
            d["time_wait"].as_u64(),
            d["active"].as_u64(),
            d["ratio"].as_f64()
        ),
        (Some(100), Some(100), Some(0), Some(1.0)),
        "{d}"
    );
    let other = dest(&r, "127.0.0.1:8081");
    assert_eq!(
        (other["in_use"].as_u64(), other["time_wait"].as_u64()),
        (Some(1), Some(1)),
        "{other}"
    );
    let warnings = r["warnings"].as_array().unwrap();
    assert!(
        warnings.iter().any(|w| w.as_str().unwrap().starts_with(
            "127.0.0.1 -> 127.0.0.1:8080 holds 100 of 100 ephemeral ports (100%): 100 in TIME_WAIT, 0 active. \
             New connections from 127.0.0.1 to 127.0.0.1:8080 fail with EADDRNOTAVAIL."
        )),
        "{warnings:?}"
    );
    assert!(
        !warnings
            .iter()
            .any(|w| w.as_str().unwrap().contains("-> 127.0.0.1:8081")),
        "{warnings:?}"
    );

    // At rest, every destination equals what `ss -tan` shows, state by state.
    for d in r["destinations"].as_array().unwrap() {
        let mine: Vec<_> = ss
            .iter()
            .filter(|(s, dd, _)| *s == d["src"] && *dd == d["dst"])
            .collect();
        let tw = mine.iter().filter(|(_, _, st)| st == "TIME-WAIT").count() as u64;
        assert_eq!(
            (d["in_use"].as_u64(), d["time_wait"].as_u64()),
            (Some(mine.len() as u64), Some(tw)),
            "{d} vs ss {mine:?}"
        );
    }
}

/// Sockets bound to a source address without connecting hold ports of that address's
/// pool, shown against the source address.
#[test]
fn bind_before_connect_pool_is_reported_per_source_address() {
    let ns = small_range_netns();
    let cg = Cgroup::new("bind");
    let held = cg.hold_args(&["bind", &ns.path(), "127.0.0.2:0", "85"]);
    assert_eq!(held.outcome.ok, 85);
    let r = ports_json(&ns);
    let pool = r["bound_sources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["src"] == "127.0.0.2")
        .unwrap_or_else(|| panic!("{r}"));
    assert_eq!(
        (
            pool["in_use"].as_u64(),
            pool["bound_inactive"].as_u64(),
            pool["ratio"].as_f64()
        ),
        (Some(85), Some(85), Some(0.85)),
        "{pool}"
    );
    let warnings = r["warnings"].as_array().unwrap();
    assert!(warnings.iter().any(|w| w.as_str().unwrap().starts_with("Source address 127.0.0.2 has 85 of 100 ephemeral ports in use (85%), 85 of them bound but unconnected")), "{warnings:?}");
    assert!(r["destinations"].as_array().unwrap().is_empty(), "{r}");
}

/// With the daemon: the exhausted destination is attributed to the client's scope with
/// a TIME_WAIT rate, and every EADDRNOTAVAIL is counted for the scope and process name.
#[test]
fn with_the_daemon_rates_scopes_and_eaddrnotavail_are_attributed() {
    let ns = small_range_netns();
    let cg = Cgroup::new("portsd");
    let d = Daemon::start(&format!(
        "[[scope]]\nname = \"client\"\ncgroup = \"{}\"\nmode = \"observe\"\n",
        cg.rel
    ));
    let out = cg.probe(&["churn", &ns.path(), "150"]);
    assert_eq!(
        (
            out.categories["first_eaddrnotavail"],
            out.errors("EADDRNOTAVAIL")
        ),
        (101, 50),
        "{out:?}"
    );
    // Rates come from samples every 0.5 s.
    std::thread::sleep(std::time::Duration::from_millis(1200));
    let r = ports_json_with(&ns, &d.socket.display().to_string());
    let d8080 = dest(&r, "127.0.0.1:8080");
    assert_eq!(d8080["scopes"], serde_json::json!(["client"]), "{d8080}");
    assert!(d8080["time_wait_per_s"].as_f64().unwrap() > 0.0, "{d8080}");
    assert_eq!(
        d8080["seconds_to_exhaustion"].as_f64(),
        Some(0.0),
        "{d8080}"
    );
    assert_eq!(
        r["eaddrnotavail"],
        serde_json::json!([{"scope": "client", "comm": "guard-probe", "count": 50}]),
        "{r}"
    );
    let w = r["warnings"].as_array().unwrap()[0].as_str().unwrap();
    assert!(
        w.contains("TIME_WAIT entries are created at") && w.contains("Held by scope(s) client."),
        "{w}"
    );
}
