//! The kernel's rules for picking a local port, and a census of a namespace's socket
//! table against them.
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
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
};

use anyhow::Context;
use guard_common::linux::{TCP_CLOSE, TCP_LISTEN, TCP_TIME_WAIT};

use super::sockdiag::{TcpSocket, state_name};

/// The namespace's port settings (/proc/sys/net/ipv4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortSettings {
    /// ip_local_port_range, inclusive.
    pub range: (u16, u16),
    /// ip_local_reserved_ports, as inclusive ranges.
    pub reserved: Vec<(u16, u16)>,
    /// tcp_tw_reuse: 0 off, 1 on, 2 on for loopback only (the default).
    pub tcp_tw_reuse: u8,
    /// What `ephemeral_ports` returns, walked once here: a reading asks it for every
    /// destination, and the default range is 28,232 ports.
    ephemeral_ports: u32,
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
        let mut s = PortSettings {
            range: (lo, hi),
            reserved: ranges,
            tcp_tw_reuse: tw_reuse.trim().parse()?,
            ephemeral_ports: 0,
        };
        s.ephemeral_ports = s.walk();
        Ok(s)
    }

    /// Whether connect() may pick this port.
    pub fn ephemeral(&self, port: u16) -> bool {
        (self.range.0..=self.range.1).contains(&port)
            && !self.reserved.iter().any(|&(a, b)| (a..=b).contains(&port))
    }

    /// How many ports connect() can pick from (units: ports).
    pub fn ephemeral_ports(&self) -> u32 {
        self.ephemeral_ports
    }

    /// Counts the ports connect() can pick from. __inet_hash_connect walks an even
    /// number of ports from the low end (`remaining &= ~1`), so the last port of an
    /// odd-sized range is never picked.
    fn walk(&self) -> u32 {
        let span = self.range.1 as u32 + 1 - self.range.0 as u32;
        let span = if span > 1 { span & !1 } else { span };
        (0..span)
            .filter(|i| self.ephemeral((self.range.0 as u32 + i) as u16))
            .count() as u32
    }
}

/// Sockets toward one destination from one source address.
#[derive(Default)]
pub struct Tally {
    pub time_wait: u32,
    pub active: u32,
    /// Active sockets by state, as `ss` names them.
    pub states: BTreeMap<String, u32>,
}

/// What a namespace's socket table says about its ephemeral ports.
pub struct Census {
    /// (source, destination, destination port) -> sockets.
    pub destinations: BTreeMap<(IpAddr, IpAddr, u16), Tally>,
    /// Ports taken by bind() or listen(), on any address.
    pub bound: BTreeSet<u16>,
    /// Source address -> (ephemeral ports held by any socket, sockets bound only).
    pub pools: BTreeMap<IpAddr, (BTreeSet<u16>, u32)>,
}

pub fn census(settings: &PortSettings, sockets: &[TcpSocket]) -> Census {
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
pub fn available(settings: &PortSettings, bound: u32, src: IpAddr, dst: IpAddr, t: &Tally) -> u32 {
    let tw = if tw_reusable(settings.tcp_tw_reuse, src, dst) {
        0
    } else {
        t.time_wait
    };
    settings
        .ephemeral_ports()
        .saturating_sub(bound + t.active + tw)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_parse_and_count_reserved_ports() {
        let s = PortSettings::parse("40000\t40099\n", "40010-40019,40050\n", "0\n").unwrap();
        assert_eq!(s.range, (40000, 40099));
        assert_eq!(s.ephemeral_ports(), 89);
        assert!(!s.ephemeral(40015) && s.ephemeral(40020));
    }
}
