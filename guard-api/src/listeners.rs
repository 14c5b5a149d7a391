//! `connguard listeners --json`: the listening sockets of one network namespace with
//! their queues (units: connections), and the namespace's TcpExt counters.
//!
//! A listener's accept queue holds established connections not yet accept()ed; it is
//! full once it holds more than the effective backlog, min(listen() backlog,
//! net.core.somaxconn), so it holds backlog + 1. The kernel counts overflows per
//! namespace, not per listener: they are in the report's `counters`.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::stats::ListenerStats;

/// `connguard listeners --json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ListenersReport {
    pub netns: String,
    /// Fullest first.
    pub listeners: Vec<Listener>,
    /// The daemon's `[[listener]]` guards of this namespace (as `stats` shows them):
    /// their totals and per-caller budgets; empty without a daemon.
    #[serde(default)]
    pub guards: Vec<ListenerStats>,
    /// The namespace's TcpExt counters (totals since the namespace was created), as
    /// `nstat -az` shows them.
    pub counters: BTreeMap<String, u64>,
    pub warnings: Vec<String>,
}

/// One listening socket.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Listener {
    pub netns: String,
    /// `a.b.c.d:port` or `[v6]:port` (0.0.0.0 or :: for every address).
    pub addr: String,
    /// The port alone, host order.
    pub port: u16,
    /// The socket's inode (as `ss -e` and /proc/PID/fd show it).
    #[serde(default)]
    pub inode: u32,
    /// Owning process as `comm[pid]`, when one holds the socket.
    pub process: Option<String>,
    /// Its cgroup, below the cgroup2 mount.
    pub cgroup: Option<String>,
    /// Its scope (asked from the daemon; null without one or outside every scope).
    pub scope: Option<String>,
    /// Connections waiting to be accept()ed.
    pub accept_queue: u32,
    /// Effective backlog: min(listen() backlog, net.core.somaxconn).
    pub backlog: u32,
    /// Half-open connections (SYN received, SYN-ACK sent).
    pub syn_recv: u32,
    /// SYNs answered with RST by connguard's guard because this socket's own queues were
    /// past a limit (from the daemon); null where no guard decides for this socket on
    /// its own (no guard, or one deciding from the daemon's reading: see `guards`).
    pub rst_shed: Option<u64>,
    /// "full" when the queue holds more than the backlog (new SYNs are dropped), else "ok".
    pub state: String,
}
