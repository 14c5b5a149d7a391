//! `connguard ports --json` (ephemeral ports and TIME_WAIT per source address and
//! destination, in one network namespace), and what the daemon adds to it (the control
//! request `ports NETNS_COOKIE`). Counts of ports are ports; ratios are fractions of the
//! namespace's ephemeral ports (0 to 1); rates are per second.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `connguard ports --json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    /// Whether the kernel's sock_diag lists sockets bound but neither connected nor
    /// listening (Linux 6.7+); null when that could not be told. Unless true, ports held
    /// by bind() alone may be missing from `bound_ports` and `bound_sources`, and a
    /// warning says so.
    pub bound_inactive_listed: Option<bool>,
    /// EADDRNOTAVAIL returned by connect(), per scope and process (needs the daemon).
    pub eaddrnotavail: Vec<EaddrnotavailCount>,
    /// The diagnosis, one sentence block per problem.
    pub warnings: Vec<String>,
}

impl PortsReport {
    /// The first row of `destinations` toward `dst` (`a.b.c.d:port`, `[v6]:port`).
    pub fn destination(&self, dst: &str) -> Option<&DestinationPorts> {
        self.destinations.iter().find(|d| d.dst == dst)
    }

    /// The pool of source address `src`.
    pub fn source(&self, src: &str) -> Option<&SourcePool> {
        self.bound_sources.iter().find(|p| p.src == src)
    }
}

/// Local ports held toward one destination from one source address.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    /// TIME_WAIT entries created per second by admitted connections, over the last 5 to
    /// 7.5 s (null without the daemon, or when it saw none).
    pub time_wait_per_s: Option<f64>,
    /// At that rate, seconds until `available` reaches 0; null when the rate is unknown,
    /// or when TIME_WAIT entries expire (after 60 s) faster than they fill the range.
    pub seconds_to_exhaustion: Option<f64>,
    /// Scopes whose admitted connections hold these ports (needs the daemon).
    pub scopes: Vec<String>,
}

/// The pool that bind(addr, 0) draws from: ports in use on one source address.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SourcePool {
    pub src: String,
    /// Distinct ephemeral ports held on this address by any socket (units: ports).
    pub in_use: u32,
    /// Of those, sockets bound but neither connected nor listening (bind() first).
    pub bound_inactive: u32,
    /// in_use / ephemeral_ports.
    pub ratio: f64,
}

/// connect() failures with EADDRNOTAVAIL of one process name in one scope (total).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct EaddrnotavailCount {
    pub scope: String,
    /// The process name (`comm`).
    pub comm: String,
    pub count: u64,
}

/// What the daemon adds to a namespace's report: rates and attribution from the eBPF
/// side (the answer to the control request `ports NETNS_COOKIE`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DaemonPorts {
    /// Destinations with TIME_WAIT entries born within the rates' window.
    pub destinations: Vec<DaemonDestination>,
    /// Destinations (any namespace, any source) with active admitted connections.
    pub active: Vec<ActiveScopes>,
    pub eaddrnotavail: Vec<EaddrnotavailCount>,
}

/// The scopes with active admitted connections to one destination.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ActiveScopes {
    /// `a.b.c.d:port` or `[v6]:port`.
    pub dst: String,
    pub scopes: Vec<String>,
}

/// TIME_WAIT births toward one destination from one source address.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DaemonDestination {
    pub src: String,
    pub dst: String,
    /// TIME_WAIT entries born per second over the last 5 to 7.5 s.
    pub time_wait_per_s: f64,
    /// The scopes whose connections they were born on.
    pub scopes: Vec<String>,
}
