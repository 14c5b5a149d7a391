//! Ephemeral-port and TIME_WAIT exhaustion: how many local ports each (source address,
//! destination) pair holds, against the namespace's ephemeral range.
//!
//! connect() without a prior bind() picks a local port from net.ipv4.ip_local_port_range
//! (minus net.ipv4.ip_local_reserved_ports) such that the 4-tuple is unique, so the
//! ports run out per (source address, destination address:port); a TIME_WAIT entry
//! holds its port for 60 s (TCP_TIMEWAIT_LEN). bind(addr, 0) without
//! IP_BIND_ADDRESS_NO_PORT picks a port unused by any socket on that address: that pool
//! is per source address. Sources: net/ipv4/inet_hashtables.c (__inet_hash_connect),
//! net/ipv4/inet_connection_sock.c (inet_csk_find_open_port), Documentation/networking/
//! ip-sysctl.rst.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap, VecDeque},
    fmt::Write,
    net::IpAddr,
    time::{Duration, Instant},
};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use guard_common::TimeWaitKey;

use crate::{
    accounting::unmapped,
    sockdiag::{TCP_CLOSE, TCP_LISTEN, TCP_TIME_WAIT, TcpSocket, state_name},
};

/// A destination is flagged once it holds this fraction of the ephemeral range.
pub const WARN_RATIO: f64 = 0.8;

/// The namespace's port settings (/proc/sys/net/ipv4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortSettings {
    /// ip_local_port_range, inclusive.
    pub range: (u16, u16),
    /// ip_local_reserved_ports, as inclusive ranges.
    pub reserved: Vec<(u16, u16)>,
    /// tcp_tw_reuse: 0 off, 1 on, 2 on for loopback only (the default).
    pub tcp_tw_reuse: u8,
}

impl PortSettings {
    /// Reads the settings of the calling thread's network namespace.
    pub fn read() -> anyhow::Result<PortSettings> {
        let read = |name: &str| {
            let path = format!("/proc/sys/net/ipv4/{name}");
            std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))
        };
        Self::parse(
            &read("ip_local_port_range")?,
            &read("ip_local_reserved_ports")?,
            &read("tcp_tw_reuse")?,
        )
    }

    pub fn parse(range: &str, reserved: &str, tw_reuse: &str) -> anyhow::Result<PortSettings> {
        let mut it = range.split_whitespace().map(str::parse::<u16>);
        let (Some(Ok(lo)), Some(Ok(hi))) = (it.next(), it.next()) else {
            anyhow::bail!("ip_local_port_range: cannot parse {range:?}");
        };
        let mut ranges = Vec::new();
        for part in reserved.trim().split(',').filter(|p| !p.is_empty()) {
            let (a, b) = part.split_once('-').unwrap_or((part, part));
            ranges.push((a.trim().parse()?, b.trim().parse()?));
        }
        Ok(PortSettings {
            range: (lo, hi),
            reserved: ranges,
            tcp_tw_reuse: tw_reuse.trim().parse()?,
        })
    }

    /// Whether connect() may pick this port.
    pub fn ephemeral(&self, port: u16) -> bool {
        (self.range.0..=self.range.1).contains(&port)
            && !self.reserved.iter().any(|&(a, b)| (a..=b).contains(&port))
    }

    /// How many ports connect() can pick from (units: ports). __inet_hash_connect walks
    /// an even number of ports from the low end (`remaining &= ~1`), so the last port of
    /// an odd-sized range is never picked.
    pub fn ephemeral_ports(&self) -> u32 {
        let span = self.range.1 as u32 + 1 - self.range.0 as u32;
        let span = if span > 1 { span & !1 } else { span };
        (0..span)
            .filter(|i| self.ephemeral((self.range.0 as u32 + i) as u16))
            .count() as u32
    }
}

/// `connguard ports --json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PortsReport {
    /// The network namespace looked at ("self" for the caller's own).
    pub netns: String,
    /// net.ipv4.ip_local_port_range, inclusive.
    pub ephemeral_range: [u16; 2],
    /// Ports in that range that are not reserved (net.ipv4.ip_local_reserved_ports).
    pub ephemeral_ports: u32,
    /// net.ipv4.tcp_tw_reuse.
    pub tcp_tw_reuse: u8,
    /// Ephemeral ports taken by bind() or listen() (on any address): connect() skips
    /// them for every destination.
    pub bound_ports: u32,
    /// Busiest first.
    pub destinations: Vec<DestinationPorts>,
    pub bound_sources: Vec<SourcePool>,
    /// EADDRNOTAVAIL returned by connect(), per scope and process (needs the daemon).
    pub eaddrnotavail: Vec<EaddrnotavailCount>,
    /// The diagnosis, one sentence block per problem.
    pub warnings: Vec<String>,
}

/// Local ports held toward one destination from one source address.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DestinationPorts {
    /// Source address.
    pub src: String,
    /// `a.b.c.d:port` or `[v6]:port`.
    pub dst: String,
    /// Ports held: active connections plus TIME_WAIT entries (units: ports).
    pub in_use: u32,
    pub time_wait: u32,
    pub active: u32,
    /// Active connections by state, as `ss` names them.
    pub states: BTreeMap<String, u32>,
    /// in_use / ephemeral_ports.
    pub ratio: f64,
    /// Ports connect() can still pick toward this destination from this source:
    /// ephemeral_ports less bound_ports, active connections, and TIME_WAIT entries unless
    /// tcp_tw_reuse lets connect() take them (1, or 2 between loopback addresses).
    pub available: u32,
    /// TIME_WAIT entries created per second by admitted connections, over the last 5 s
    /// (null without the daemon, or when it saw none).
    pub time_wait_per_s: Option<f64>,
    /// At that rate, seconds until `available` reaches 0; null when the rate is unknown,
    /// or when TIME_WAIT entries expire (after 60 s) faster than they fill the range.
    pub seconds_to_exhaustion: Option<f64>,
    /// Scopes whose admitted connections hold these ports (needs the daemon).
    pub scopes: Vec<String>,
}

/// The pool that bind(addr, 0) draws from: ports in use on one source address.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SourcePool {
    pub src: String,
    /// Distinct ephemeral ports held on this address by any socket (units: ports).
    pub in_use: u32,
    /// Of those, sockets bound but neither connected nor listening (bind() first).
    pub bound_inactive: u32,
    /// in_use / ephemeral_ports.
    pub ratio: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EaddrnotavailCount {
    pub scope: String,
    pub comm: String,
    pub count: u64,
}

/// What the daemon adds to a namespace's report: rates and attribution from the eBPF
/// side (the `ports COOKIE` control request).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DaemonPorts {
    /// Destinations with TIME_WAIT entries born within RATE_WINDOW.
    pub destinations: Vec<DaemonDestination>,
    /// Destinations (any namespace, any source) with active admitted connections.
    pub active: Vec<ActiveScopes>,
    pub eaddrnotavail: Vec<EaddrnotavailCount>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ActiveScopes {
    pub dst: String,
    pub scopes: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DaemonDestination {
    pub src: String,
    pub dst: String,
    /// TIME_WAIT entries born per second over the last RATE_WINDOW.
    pub time_wait_per_s: f64,
    pub scopes: Vec<String>,
}

/// Rates are TIME_WAIT births over this window.
pub const RATE_WINDOW: Duration = Duration::from_secs(5);

/// Samples of the TIME_WAITS map, RATE_WINDOW long, for per-second rates.
#[derive(Default)]
pub struct TimeWaitRates {
    samples: VecDeque<(Instant, HashMap<TimeWaitKey, u64>)>,
}

impl TimeWaitRates {
    pub fn sample(&mut self, now: Instant, counts: HashMap<TimeWaitKey, u64>) {
        self.samples.push_back((now, counts));
        while self.samples.len() > 2 && now - self.samples[1].0 >= RATE_WINDOW {
            self.samples.pop_front();
        }
    }

    /// Births per second per key, between the oldest and newest sample. A key absent
    /// from the oldest sample was born within the window and counts from zero.
    pub fn rates(&self) -> HashMap<TimeWaitKey, f64> {
        let (Some((t0, old)), Some((t1, new))) = (self.samples.front(), self.samples.back()) else {
            return HashMap::new();
        };
        let secs = (*t1 - *t0).as_secs_f64();
        if secs <= 0.0 {
            return HashMap::new();
        }
        new.iter()
            .map(|(k, n)| {
                (
                    *k,
                    n.saturating_sub(old.get(k).copied().unwrap_or(0)) as f64 / secs,
                )
            })
            .collect()
    }
}

/// The daemon's view of one namespace: rates summed over scopes per (source,
/// destination), with the scopes named.
pub fn daemon_ports(
    netns: u64,
    rates: &HashMap<TimeWaitKey, f64>,
    scope_name: impl Fn(u32) -> String,
    active: Vec<ActiveScopes>,
    eaddrnotavail: Vec<EaddrnotavailCount>,
) -> DaemonPorts {
    let mut by_dest: BTreeMap<(String, String), (f64, BTreeSet<String>)> = BTreeMap::new();
    for (k, rate) in rates
        .iter()
        .filter(|(k, rate)| k.netns == netns && **rate > 0.0)
    {
        let e = by_dest
            .entry((
                unmapped(k.src).to_string(),
                endpoint(unmapped(k.dst), k.dport),
            ))
            .or_default();
        e.0 += rate;
        e.1.insert(scope_name(k.scope_id));
    }
    DaemonPorts {
        destinations: by_dest
            .into_iter()
            .map(|((src, dst), (rate, scopes))| DaemonDestination {
                src,
                dst,
                time_wait_per_s: rate,
                scopes: scopes.into_iter().collect(),
            })
            .collect(),
        active,
        eaddrnotavail,
    }
}

/// The report for the calling thread's network namespace (named `netns`), with the
/// rates and attribution of the daemon on `socket` when one answers.
pub fn collect(netns: &str, socket: &std::path::Path) -> anyhow::Result<PortsReport> {
    let mut r = report(
        netns,
        &PortSettings::read()?,
        &crate::sockdiag::tcp_sockets()?,
    );
    if let Ok(text) = crate::daemon::request(socket, &format!("ports {}", crate::netns::cookie()?))
    {
        merge(&mut r, serde_json::from_str(&text)?);
    }
    Ok(r)
}

/// Adds the daemon's rates and attribution to a report, and diagnoses again.
pub fn merge(r: &mut PortsReport, from: DaemonPorts) {
    for d in &mut r.destinations {
        if let Some(a) = from.active.iter().find(|a| a.dst == d.dst) {
            d.scopes = a.scopes.clone();
        }
        let Some(m) = from
            .destinations
            .iter()
            .find(|m| m.src == d.src && m.dst == d.dst)
        else {
            continue;
        };
        for s in &m.scopes {
            if !d.scopes.contains(s) {
                d.scopes.push(s.clone());
            }
        }
        d.time_wait_per_s = Some(m.time_wait_per_s);
        // TIME_WAIT entries live TCP_TIMEWAIT_LEN (60 s): at this rate the range fills
        // only if the entries alive at once outnumber the ports left for them.
        let room = r.ephemeral_ports.saturating_sub(r.bound_ports + d.active);
        if m.time_wait_per_s * 60.0 >= room as f64 {
            d.seconds_to_exhaustion = Some(d.available as f64 / m.time_wait_per_s);
        }
    }
    r.eaddrnotavail = from.eaddrnotavail;
    r.warnings = diagnose(r);
}

/// `a.b.c.d:port`, or `[v6]:port`, as stats and reports write a destination. IPv4 goes
/// through itoa: `stats` writes one per tracked destination (100,000s), and `format!`
/// costs several times more.
pub fn endpoint(addr: IpAddr, port: u16) -> String {
    match addr {
        IpAddr::V4(a) => {
            let mut s = String::with_capacity("255.255.255.255:65535".len());
            let mut digits = itoa::Buffer::new();
            for (i, octet) in a.octets().into_iter().enumerate() {
                if i > 0 {
                    s.push('.');
                }
                s.push_str(digits.format(octet));
            }
            s.push(':');
            s.push_str(digits.format(port));
            s
        }
        IpAddr::V6(a) => format!("[{a}]:{port}"),
    }
}

/// Sockets toward one destination from one source address.
#[derive(Default)]
struct Tally {
    time_wait: u32,
    active: u32,
    states: BTreeMap<String, u32>,
}

/// What a namespace's socket table says about its ephemeral ports.
struct Census {
    /// (source, destination, destination port) -> sockets.
    destinations: BTreeMap<(IpAddr, IpAddr, u16), Tally>,
    /// Ports taken by bind() or listen(), on any address.
    bound: BTreeSet<u16>,
    /// Source address -> (ephemeral ports held by any socket, sockets bound only).
    pools: BTreeMap<IpAddr, (BTreeSet<u16>, u32)>,
}

fn census(settings: &PortSettings, sockets: &[TcpSocket]) -> Census {
    let mut c = Census {
        destinations: BTreeMap::new(),
        bound: BTreeSet::new(),
        pools: BTreeMap::new(),
    };
    for s in sockets.iter().filter(|s| settings.ephemeral(s.sport)) {
        let pool = c.pools.entry(s.src).or_default();
        pool.0.insert(s.sport);
        if s.state == TCP_LISTEN || s.state == TCP_CLOSE {
            // A bind bucket that connect() will not share (fastreuse >= 0).
            c.bound.insert(s.sport);
            pool.1 += (s.state == TCP_CLOSE) as u32;
            continue;
        }
        let t = c.destinations.entry((s.src, s.dst, s.dport)).or_default();
        if s.state == TCP_TIME_WAIT {
            t.time_wait += 1;
        } else {
            t.active += 1;
            *t.states.entry(state_name(s.state).to_string()).or_default() += 1;
        }
    }
    c
}

/// Whether connect() from `src` to `dst` may take a port held in TIME_WAIT
/// (net.ipv4.tcp_tw_reuse: 1 always, 2 between loopback addresses).
fn tw_reusable(tw_reuse: u8, src: IpAddr, dst: IpAddr) -> bool {
    tw_reuse == 1 || (tw_reuse == 2 && src.is_loopback() && dst.is_loopback())
}

/// Ports connect() can still pick toward a destination.
fn available(settings: &PortSettings, bound: u32, src: IpAddr, dst: IpAddr, t: &Tally) -> u32 {
    let tw = if tw_reusable(settings.tcp_tw_reuse, src, dst) {
        0
    } else {
        t.time_wait
    };
    settings
        .ephemeral_ports()
        .saturating_sub(bound + t.active + tw)
}

/// The report for one namespace from its socket table and settings.
pub fn report(netns: &str, settings: &PortSettings, sockets: &[TcpSocket]) -> PortsReport {
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
        eaddrnotavail: Vec::new(),
        warnings: Vec::new(),
    };
    r.warnings = diagnose(&r);
    r
}

/// Ports connect() can no longer pick toward each destination (the most over source
/// addresses), in thousandths of the ephemeral range: what port watermarks compare
/// against.
pub fn port_use(settings: &PortSettings, sockets: &[TcpSocket]) -> HashMap<(IpAddr, u16), u32> {
    let c = census(settings, sockets);
    let total = settings.ephemeral_ports().max(1) as u64;
    let mut out: HashMap<(IpAddr, u16), u32> = HashMap::new();
    for ((src, dst, dport), t) in &c.destinations {
        let taken = total - available(settings, c.bound.len() as u32, *src, *dst, t) as u64;
        let e = out.entry((*dst, *dport)).or_default();
        *e = (*e).max((taken * 1000 / total) as u32);
    }
    out
}

/// Plain sentences for every destination, and for the ports taken by bind(), past
/// WARN_RATIO of the range.
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
    use super::*;

    #[test]
    fn endpoints_are_written_as_display_writes_them() {
        for (addr, port) in [
            ("0.0.0.0", 0),
            ("127.1.10.255", 9),
            ("10.20.0.7", 8080),
            ("255.255.255.255", 65535),
            ("1.22.103.4", 100),
            ("fd00::1", 443),
            ("::ffff:10.0.0.1", 80),
        ] {
            let ip: IpAddr = addr.parse().unwrap();
            let expected = match ip {
                IpAddr::V4(a) => format!("{a}:{port}"),
                IpAddr::V6(a) => format!("[{a}]:{port}"),
            };
            assert_eq!(endpoint(ip, port), expected);
        }
    }

    fn sock(state: u8, src: &str, sport: u16, dst: &str, dport: u16) -> TcpSocket {
        TcpSocket {
            state,
            src: src.parse().unwrap(),
            sport,
            dst: dst.parse().unwrap(),
            dport,
            recv_queue: 0,
            send_queue: 0,
            inode: 0,
        }
    }

    #[test]
    fn settings_parse_and_count_reserved_ports() {
        let s = PortSettings::parse("40000\t40099\n", "40010-40019,40050\n", "0\n").unwrap();
        assert_eq!(s.range, (40000, 40099));
        assert_eq!(s.ephemeral_ports(), 89);
        assert!(!s.ephemeral(40015) && s.ephemeral(40020));
    }

    #[test]
    fn ports_are_counted_per_source_and_destination() {
        let s = PortSettings::parse("40000 40003", "", "0").unwrap();
        let socks = [
            sock(TCP_TIME_WAIT, "127.0.0.1", 40000, "127.0.0.1", 8080),
            sock(TCP_TIME_WAIT, "127.0.0.1", 40001, "127.0.0.1", 8080),
            sock(TCP_TIME_WAIT, "127.0.0.1", 40002, "127.0.0.1", 8080),
            sock(1, "127.0.0.1", 40003, "127.0.0.1", 8080),
            sock(1, "127.0.0.1", 40000, "127.0.0.1", 8081),
            // The server side of those connections and the listener: not ephemeral.
            sock(1, "127.0.0.1", 8080, "127.0.0.1", 40003),
            sock(TCP_LISTEN, "0.0.0.0", 8080, "0.0.0.0", 0),
            sock(TCP_CLOSE, "10.0.0.1", 40002, "0.0.0.0", 0),
        ];
        let r = report("self", &s, &socks);
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
        assert_eq!(r.warnings.len(), 1, "{:?}", r.warnings);
        assert!(r.warnings[0].starts_with(
            "127.0.0.1 -> 127.0.0.1:8080 holds 4 of 4 ephemeral ports (100%): 3 in TIME_WAIT, 1 active. \
             1 more are taken by bind() or listen(). \
             New connections from 127.0.0.1 to 127.0.0.1:8080 fail with EADDRNOTAVAIL."
        ));
        assert!(r.warnings[0].contains("set net.ipv4.tcp_tw_reuse=1 (now 0)"));
    }

    #[test]
    fn tw_reuse_frees_time_wait_ports_and_odd_ranges_lose_their_last_port() {
        // 40000-40004 is 5 ports, of which connect() walks 4.
        let s = PortSettings::parse("40000 40004", "", "2").unwrap();
        assert_eq!(s.ephemeral_ports(), 4);
        let socks: Vec<_> = (0..4)
            .map(|i| sock(TCP_TIME_WAIT, "127.0.0.1", 40000 + i, "127.0.0.1", 8080))
            .collect();
        let loopback = report("self", &s, &socks);
        assert_eq!(
            (
                loopback.destinations[0].in_use,
                loopback.destinations[0].available
            ),
            (4, 4)
        );
        assert!(
            loopback.warnings.is_empty(),
            "tcp_tw_reuse=2 reuses loopback TIME_WAIT: {:?}",
            loopback.warnings
        );
        let socks: Vec<_> = (0..4)
            .map(|i| sock(TCP_TIME_WAIT, "10.0.0.1", 40000 + i, "10.0.0.2", 8080))
            .collect();
        let remote = report("self", &s, &socks);
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
            let mut r = report("self", &s, &socks);
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
