//! Ephemeral-port and TIME_WAIT exhaustion: how many local ports each (source address,
//! destination) pair holds against the namespace's ephemeral range (host::ports has the
//! kernel's rules), in numbers and in plain sentences.
use std::fmt::Write;

use connguard_api::ports::{DestinationPorts, PortsReport, SourcePool};
use guard_common::addr::endpoint;

use crate::host::{
    ports::{PortSettings, available, census},
    sockdiag::TcpSocket,
};

/// A destination is flagged once it holds this fraction of the ephemeral range.
pub const WARN_RATIO: f64 = 0.8;

/// Whether the pool is at or past WARN_RATIO of the range (then diagnosed).
pub fn near_exhaustion(p: &SourcePool) -> bool {
    p.ratio >= WARN_RATIO
}

/// The report for one namespace from its socket table and settings.
/// The report of `sockets`; `bound_inactive_listed` says whether they include sockets
/// only bound (see `sockdiag::lists_bound_inactive`).
pub fn report(
    netns: &str,
    settings: &PortSettings,
    sockets: &[TcpSocket],
    bound_inactive_listed: Option<bool>,
) -> PortsReport {
    let total = settings.ephemeral_ports().max(1);
    let ratio = |n: u32| n as f64 / total as f64;
    let c = census(settings, sockets);
    let bound = c.bound.len() as u32;
    let mut destinations: Vec<DestinationPorts> = c
        .destinations
        .iter()
        .map(|((src, dst, dport), t)| DestinationPorts {
            src: src.to_string(),
            dst: endpoint(*dst, *dport),
            in_use: t.time_wait + t.active,
            time_wait: t.time_wait,
            active: t.active,
            states: t.states.clone(),
            ratio: ratio(t.time_wait + t.active),
            available: available(settings, bound, *src, *dst, t),
            time_wait_per_s: None,
            seconds_to_exhaustion: None,
            scopes: Vec::new(),
        })
        .collect();
    destinations.sort_by(|a, b| b.in_use.cmp(&a.in_use).then(a.dst.cmp(&b.dst)));
    let mut bound_sources: Vec<SourcePool> = c
        .pools
        .into_iter()
        .map(|(src, (ports, bound_inactive))| SourcePool {
            src: src.to_string(),
            in_use: ports.len() as u32,
            bound_inactive,
            ratio: ratio(ports.len() as u32),
        })
        .collect();
    bound_sources.sort_by(|a, b| b.in_use.cmp(&a.in_use).then(a.src.cmp(&b.src)));
    let mut r = PortsReport {
        netns: netns.to_string(),
        ephemeral_range: [settings.range.0, settings.range.1],
        ephemeral_ports: settings.ephemeral_ports(),
        tcp_tw_reuse: settings.tcp_tw_reuse,
        bound_ports: bound,
        destinations,
        bound_sources,
        bound_inactive_listed,
        eaddrnotavail: Vec::new(),
        warnings: Vec::new(),
    };
    r.warnings = diagnose(&r);
    r
}

/// Plain sentences for every destination, every source address's pool, and the ports
/// taken by bind(), at or past WARN_RATIO of the range.
pub fn diagnose(r: &PortsReport) -> Vec<String> {
    let [lo, hi] = r.ephemeral_range;
    let total = r.ephemeral_ports.max(1);
    let taken = |available: u32| (total - available.min(total)) as f64 / total as f64;
    let mut out = Vec::new();
    for d in r
        .destinations
        .iter()
        .filter(|d| taken(d.available) >= WARN_RATIO)
    {
        let mut w = format!(
            "{} -> {} holds {} of {} ephemeral ports ({:.0}%): {} in TIME_WAIT, {} active.",
            d.src,
            d.dst,
            d.in_use,
            r.ephemeral_ports,
            d.ratio * 100.0,
            d.time_wait,
            d.active
        );
        if r.bound_ports > 0 {
            let _ = write!(
                w,
                " {} more are taken by bind() or listen().",
                r.bound_ports
            );
        }
        if d.available == 0 {
            let _ = write!(
                w,
                " New connections from {} to {} fail with EADDRNOTAVAIL.",
                d.src, d.dst
            );
        } else {
            let _ = write!(w, " {} ports are left for new connections.", d.available);
        }
        match (d.time_wait_per_s, d.seconds_to_exhaustion) {
            (Some(rate), Some(secs)) if secs > 0.0 => {
                let _ = write!(
                    w,
                    " TIME_WAIT entries are created at {rate:.1}/s: at that rate no port is left in {secs:.1} s."
                );
            }
            (Some(rate), _) => {
                let _ = write!(w, " TIME_WAIT entries are created at {rate:.1}/s.");
            }
            _ => {}
        }
        if !d.scopes.is_empty() {
            let _ = write!(w, " Held by scope(s) {}.", d.scopes.join(", "));
        }
        let _ = write!(
            w,
            " Remedies: reuse connections (keep-alive, a connection pool) instead of one per request; \
             widen net.ipv4.ip_local_port_range (now {lo}-{hi})"
        );
        if d.time_wait > 0 && r.tcp_tw_reuse != 1 {
            let _ = write!(
                w,
                "; set net.ipv4.tcp_tw_reuse=1 (now {}) so new connections may take ports in TIME_WAIT",
                r.tcp_tw_reuse
            );
        }
        w.push('.');
        out.push(w);
    }
    // bind(addr, 0) picks a port no socket on addr holds, whatever the destination: a
    // pool spent that way leaves every destination's own count with ports left.
    for p in r.bound_sources.iter().filter(|p| near_exhaustion(p)) {
        let destinations = r.destinations.iter().filter(|d| d.src == p.src).count();
        let mut w = format!(
            "Source address {} holds {} of {} ephemeral ports ({:.0}%): connections to {destinations} \
             destination(s), and {} socket(s) bound but unconnected.",
            p.src,
            p.in_use,
            r.ephemeral_ports,
            p.ratio * 100.0,
            p.bound_inactive
        );
        match r.ephemeral_ports.saturating_sub(p.in_use) {
            0 => {
                let _ = write!(w, " bind() to {} with port 0 fails with EADDRINUSE.", p.src);
            }
            left => {
                let _ = write!(w, " {left} are left for bind() to {} with port 0.", p.src);
            }
        }
        let _ = write!(
            w,
            " Sockets bound to {} before connect() without IP_BIND_ADDRESS_NO_PORT (as Envoy and \
             Istio bind 127.0.0.6) take their ports from this pool whatever their destination, \
             and connect() without bind() skips every port bind() took, toward any destination: \
             fewer ports may be left per destination than shown. Remedies: set \
             IP_BIND_ADDRESS_NO_PORT before bind() so that connect() picks the port per \
             destination; bind to more source addresses; reuse connections (keep-alive, a \
             connection pool) instead of one per request.",
            p.src
        );
        out.push(w);
    }
    if taken(total - r.bound_ports.min(total)) >= WARN_RATIO {
        let bound_only: u32 = r.bound_sources.iter().map(|p| p.bound_inactive).sum();
        out.push(format!(
            "{} of {} ephemeral ports ({:.0}%) are taken by bind() or listen(), {bound_only} of them bound \
             but unconnected: connect() skips them for every destination, and bind() to an address \
             without a port runs out. Remedies: set IP_BIND_ADDRESS_NO_PORT before bind() so that \
             connect() picks the port per destination; close sockets bound and never used.",
            r.bound_ports,
            r.ephemeral_ports,
            r.bound_ports as f64 / total as f64 * 100.0
        ));
    }
    let unseen = "ports held by bind() alone are not counted here, though connect() cannot \
                  pick them.";
    match r.bound_inactive_listed {
        Some(true) => {}
        Some(false) => out.push(format!(
            "This kernel's sock_diag does not list sockets that are bound but neither connected \
             nor listening (Linux 6.7 and later do): {unseen}"
        )),
        None => out.push(format!(
            "Whether this kernel's sock_diag lists sockets that are bound but neither connected \
             nor listening could not be told (no port near the ephemeral range was free to \
             bind): if it does not, {unseen}"
        )),
    }
    out
}

/// The readable form of `connguard ports`.
pub fn table(r: &PortsReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "netns {}: ephemeral range {}-{} ({} ports), tcp_tw_reuse {}, {} taken by bind()/listen()",
        r.netns,
        r.ephemeral_range[0],
        r.ephemeral_range[1],
        r.ephemeral_ports,
        r.tcp_tw_reuse,
        r.bound_ports
    );
    let _ = writeln!(
        out,
        "\n{:<24} {:<32} {:>7} {:>7} {:>10} {:>7} {:>6} {:>8}",
        "SOURCE", "DESTINATION", "IN_USE", "RATIO", "TIME_WAIT", "ACTIVE", "LEFT", "TW/S"
    );
    for d in &r.destinations {
        let rate = d
            .time_wait_per_s
            .map_or("-".to_string(), |v| format!("{v:.1}"));
        let _ = writeln!(
            out,
            "{:<24} {:<32} {:>7} {:>6.0}% {:>10} {:>7} {:>6} {:>8}",
            d.src,
            d.dst,
            d.in_use,
            d.ratio * 100.0,
            d.time_wait,
            d.active,
            d.available,
            rate
        );
    }
    let _ = writeln!(
        out,
        "\nsource pools (bind() before connect() draws from these):"
    );
    let _ = writeln!(
        out,
        "{:<40} {:>7} {:>7} {:>15}",
        "SOURCE", "IN_USE", "RATIO", "BOUND_INACTIVE"
    );
    for p in &r.bound_sources {
        let _ = writeln!(
            out,
            "{:<40} {:>7} {:>6.0}% {:>15}",
            p.src,
            p.in_use,
            p.ratio * 100.0,
            p.bound_inactive
        );
    }
    for w in &r.warnings {
        let _ = writeln!(out, "\nWARNING: {w}");
    }
    out
}

#[cfg(test)]
mod tests {
    use connguard_api::ports::{DaemonDestination, DaemonPorts};
    use guard_common::linux::{TCP_CLOSE, TCP_ESTABLISHED, TCP_LISTEN, TCP_TIME_WAIT};

    use super::*;
    use crate::{diagnose::attribution::merge, host::ports::port_use};

    fn sock(state: u32, src: &str, sport: u16, dst: &str, dport: u16) -> TcpSocket {
        TcpSocket {
            state,
            src: src.parse().unwrap(),
            sport,
            dst: dst.parse().unwrap(),
            dport,
            recv_queue: 0,
            send_queue: 0,
            inode: 0,
            cgroup_id: 0,
            storage: Vec::new(),
        }
    }

    #[test]
    fn ports_are_counted_per_source_and_destination() {
        let s = PortSettings::parse("40000 40003", "", "0").unwrap();
        let socks = [
            sock(TCP_TIME_WAIT, "127.0.0.1", 40000, "127.0.0.1", 8080),
            sock(TCP_TIME_WAIT, "127.0.0.1", 40001, "127.0.0.1", 8080),
            sock(TCP_TIME_WAIT, "127.0.0.1", 40002, "127.0.0.1", 8080),
            sock(TCP_ESTABLISHED, "127.0.0.1", 40003, "127.0.0.1", 8080),
            sock(TCP_ESTABLISHED, "127.0.0.1", 40000, "127.0.0.1", 8081),
            // The server side of those connections and the listener: not ephemeral.
            sock(TCP_ESTABLISHED, "127.0.0.1", 8080, "127.0.0.1", 40003),
            sock(TCP_LISTEN, "0.0.0.0", 8080, "0.0.0.0", 0),
            sock(TCP_CLOSE, "10.0.0.1", 40002, "0.0.0.0", 0),
        ];
        let r = report("self", &s, &socks, Some(true));
        let d: Vec<_> = r
            .destinations
            .iter()
            .map(|d| (d.dst.as_str(), d.in_use, d.time_wait, d.active))
            .collect();
        assert_eq!(
            d,
            [("127.0.0.1:8080", 4, 3, 1), ("127.0.0.1:8081", 1, 0, 1)]
        );
        assert_eq!(r.destinations[0].ratio, 1.0);
        let pools: Vec<_> = r
            .bound_sources
            .iter()
            .map(|p| (p.src.as_str(), p.in_use, p.bound_inactive))
            .collect();
        assert_eq!(pools, [("127.0.0.1", 4, 0), ("10.0.0.1", 1, 1)]);
        // The port bound on 10.0.0.1 is lost to every connect().
        assert_eq!(r.bound_ports, 1);
        let avail: Vec<_> = r.destinations.iter().map(|d| d.available).collect();
        assert_eq!(avail, [0, 2]);
        assert_eq!(r.warnings.len(), 2, "{:?}", r.warnings);
        assert!(r.warnings[1].starts_with(
            "Source address 127.0.0.1 holds 4 of 4 ephemeral ports (100%): connections to 2 \
             destination(s), and 0 socket(s) bound but unconnected. bind() to 127.0.0.1 with \
             port 0 fails with EADDRINUSE."
        ));
        assert!(r.warnings[0].starts_with(
            "127.0.0.1 -> 127.0.0.1:8080 holds 4 of 4 ephemeral ports (100%): 3 in TIME_WAIT, 1 active. \
             1 more are taken by bind() or listen(). \
             New connections from 127.0.0.1 to 127.0.0.1:8080 fail with EADDRNOTAVAIL."
        ));
        assert!(r.warnings[0].contains("set net.ipv4.tcp_tw_reuse=1 (now 0)"));
    }

    /// bind(127.0.0.6, 0) before each connect(), as Envoy and Istio do: every destination
    /// has ports left, the source address none, and that is what the warning says.
    #[test]
    fn a_source_pool_spent_by_bind_before_connect_is_diagnosed() {
        let s = PortSettings::parse("40000 40007", "", "0").unwrap();
        let socks: Vec<_> = (0..8)
            .map(|i| {
                sock(
                    TCP_ESTABLISHED,
                    "127.0.0.6",
                    40000 + i,
                    "127.0.0.1",
                    8080 + i % 4,
                )
            })
            .collect();
        let r = report("self", &s, &socks, Some(true));
        let left: Vec<_> = r.destinations.iter().map(|d| d.available).collect();
        assert_eq!(left, [6, 6, 6, 6]);
        assert_eq!(
            r.warnings,
            [
                "Source address 127.0.0.6 holds 8 of 8 ephemeral ports (100%): connections to 4 \
                 destination(s), and 0 socket(s) bound but unconnected. bind() to 127.0.0.6 with \
                 port 0 fails with EADDRINUSE. Sockets bound to 127.0.0.6 before connect() without \
                 IP_BIND_ADDRESS_NO_PORT (as Envoy and Istio bind 127.0.0.6) take their ports from \
                 this pool whatever their destination, and connect() without bind() skips every \
                 port bind() took, toward any destination: fewer ports may be left per \
                 destination than shown. Remedies: set IP_BIND_ADDRESS_NO_PORT before bind() so \
                 that connect() picks the port per destination; bind to more source addresses; \
                 reuse connections (keep-alive, a connection pool) instead of one per request."
            ]
        );
        // Below WARN_RATIO (6 of 8 ports), nothing to say.
        let r = report("self", &s, &socks[..6], Some(true));
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
    }

    /// A reading walks the ephemeral range once, not once per destination: with 100
    /// reserved ports in the default range, 200 destinations cost about what 1 does.
    #[test]
    fn a_reading_walks_the_range_once_whatever_its_destinations() {
        let reserved: Vec<String> = (0..100).map(|i| (41001 + i * 150).to_string()).collect();
        let reserved = reserved.join(",");
        let reading = |destinations: u16| {
            let socks: Vec<_> = (0..destinations)
                .map(|i| sock(TCP_TIME_WAIT, "10.0.0.1", 40000 + i, "10.0.0.2", 1 + i))
                .collect();
            (0..3)
                .map(|_| {
                    let started = std::time::Instant::now();
                    let s = PortSettings::parse("32768 60999", &reserved, "0").unwrap();
                    assert_eq!(port_use(&s, &socks).len(), destinations as usize);
                    started.elapsed()
                })
                .min()
                .unwrap()
        };
        let (one, many) = (reading(1), reading(200));
        assert!(many < one * 10, "1 destination: {one:?}, 200: {many:?}");
    }

    #[test]
    fn tw_reuse_frees_time_wait_ports_and_odd_ranges_lose_their_last_port() {
        // 40000-40004 is 5 ports, of which connect() walks 4.
        let s = PortSettings::parse("40000 40004", "", "2").unwrap();
        assert_eq!(s.ephemeral_ports(), 4);
        let socks: Vec<_> = (0..4)
            .map(|i| sock(TCP_TIME_WAIT, "127.0.0.1", 40000 + i, "127.0.0.1", 8080))
            .collect();
        let loopback = report("self", &s, &socks, Some(true));
        assert_eq!(
            (
                loopback.destinations[0].in_use,
                loopback.destinations[0].available
            ),
            (4, 4)
        );
        // tcp_tw_reuse=2 lets connect() reuse loopback TIME_WAIT ports, not bind().
        assert_eq!(loopback.warnings.len(), 1, "{:?}", loopback.warnings);
        assert!(
            loopback.warnings[0].starts_with("Source address 127.0.0.1 holds 4 of 4"),
            "{:?}",
            loopback.warnings
        );
        let socks: Vec<_> = (0..4)
            .map(|i| sock(TCP_TIME_WAIT, "10.0.0.1", 40000 + i, "10.0.0.2", 8080))
            .collect();
        let remote = report("self", &s, &socks, Some(true));
        assert_eq!(
            remote.destinations[0].available, 0,
            "2 does not cover other addresses"
        );
        assert_eq!(
            port_use(&s, &socks)[&("10.0.0.2".parse().unwrap(), 8080)],
            1000
        );
    }

    #[test]
    fn forecast_only_when_time_wait_outlives_the_room() {
        let s = PortSettings::parse("40000 40099", "", "0").unwrap();
        let socks: Vec<_> = (0..50)
            .map(|i| sock(TCP_TIME_WAIT, "10.0.0.1", 40000 + i, "10.0.0.2", 80))
            .collect();
        let with_rate = |rate: f64| {
            let mut r = report("self", &s, &socks, Some(true));
            let from = DaemonPorts {
                destinations: vec![DaemonDestination {
                    src: "10.0.0.1".into(),
                    dst: "10.0.0.2:80".into(),
                    time_wait_per_s: rate,
                    scopes: vec!["web".into()],
                }],
                ..Default::default()
            };
            merge(&mut r, from);
            r.destinations.remove(0)
        };
        // 1/s keeps 60 entries alive at most: the 100 ports never run out.
        assert_eq!(with_rate(1.0).seconds_to_exhaustion, None);
        // 10/s fills the 50 ports left in 5 s.
        let d = with_rate(10.0);
        assert_eq!(
            (d.seconds_to_exhaustion, d.scopes.as_slice()),
            (Some(5.0), &["web".to_string()][..])
        );
    }
}
