//! Listeners and their queues: which listener is saturated, and by whom.
//!
//! A listener's accept queue holds established connections not yet accept()ed; it is
//! full once it holds more than the effective backlog, min(listen() backlog,
//! net.core.somaxconn) (sk_acceptq_is_full, include/net/sock.h), so it holds backlog + 1.
//! Then the kernel drops new SYNs and final ACKs silently (ListenOverflows and
//! ListenDrops grow, per network namespace), and clients wait on SYN retransmits.
//! sock_diag reports a listener's queue length as Recv-Q and its backlog as Send-Q
//! (net/ipv4/tcp_diag.c), and half-open connections as SYN_RECV entries.
use std::{collections::BTreeMap, fmt::Write};

use connguard_api::{
    listeners::{Listener, ListenersReport},
    stats::ListenerStats,
};
use guard_common::{addr::endpoint, linux::TCP_LISTEN};

use crate::host::{
    procfs::{socket_owners, tcp_ext_counters},
    sockdiag::{TcpSocket, syn_recv_of},
};

/// TcpExt counters of /proc/net/netstat shown with the listeners (all per namespace).
pub const COUNTERS: &[&str] = &[
    "ListenOverflows",
    "ListenDrops",
    "TCPReqQFullDrop",
    "TCPReqQFullDoCookies",
    "SyncookiesSent",
    "TCPSynRetrans",
];

/// The listeners of the calling thread's namespace.
pub fn report(
    netns: &str,
    sockets: &[TcpSocket],
    counters: BTreeMap<String, u64>,
) -> ListenersReport {
    let owners = socket_owners();
    let mut listeners: Vec<Listener> = sockets
        .iter()
        .filter(|s| s.state == TCP_LISTEN)
        .map(|l| {
            let syn_recv = syn_recv_of(sockets, l);
            let owner = owners.get(&l.inode);
            Listener {
                netns: netns.to_string(),
                addr: endpoint(l.src, l.sport),
                port: l.sport,
                inode: l.inode,
                process: owner.map(|o| format!("{}[{}]", o.comm, o.pid)),
                cgroup: owner.and_then(|o| o.cgroup.clone()),
                scope: None,
                accept_queue: l.recv_queue,
                backlog: l.send_queue,
                syn_recv,
                rst_shed: None,
                state: if l.recv_queue > l.send_queue {
                    "full"
                } else {
                    "ok"
                }
                .into(),
            }
        })
        .collect();
    listeners.sort_by(|a, b| {
        let fill = |l: &Listener| l.accept_queue as f64 / l.backlog.max(1) as f64;
        fill(b).total_cmp(&fill(a)).then(a.addr.cmp(&b.addr))
    });
    let mut r = ListenersReport {
        netns: netns.to_string(),
        listeners,
        guards: Vec::new(),
        counters,
        warnings: Vec::new(),
    };
    r.warnings = r
        .listeners
        .iter()
        .filter(|l| l.state == "full")
        .map(|l| {
            format!(
                "{} ({}) has {} connections waiting to be accepted, past its backlog of {}: new SYNs are \
                 dropped and clients wait on SYN retransmits (1 s, 3 s, 7 s). ListenOverflows is {} in this \
                 namespace. Remedies: accept faster (more workers, a shorter critical path); raise the \
                 listen() backlog and net.core.somaxconn for bursts.",
                l.addr,
                l.process.as_deref().unwrap_or("no process"),
                l.accept_queue,
                l.backlog,
                r.counters.get("ListenOverflows").copied().unwrap_or(0)
            )
        })
        .collect();
    r
}

/// Whether two names of network namespaces, as a guard and a report write them (a netns
/// file, or "self" for the daemon's and the caller's own), are the same namespace.
pub fn same_netns(a: &str, b: &str) -> bool {
    use std::os::unix::fs::MetadataExt;
    let inode = |p: &str| (p != "self").then(|| std::fs::metadata(p).ok().map(|m| m.ino()));
    a == b || matches!((inode(a), inode(b)), (Some(Some(x)), Some(Some(y))) if x == y)
}

/// The calling thread's namespace's COUNTERS.
pub fn read_counters() -> anyhow::Result<BTreeMap<String, u64>> {
    tcp_ext_counters(COUNTERS)
}

/// The readable form of `connguard listeners`.
pub fn table(r: &ListenersReport) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "netns {}", r.netns);
    let _ = writeln!(
        out,
        "\n{:<28} {:>8} {:>8} {:>9} {:>8} {:<6} {:<24} {:<16}",
        "LISTENER", "QUEUE", "BACKLOG", "SYN_RECV", "RST", "STATE", "PROCESS", "SCOPE"
    );
    for l in &r.listeners {
        let _ = writeln!(
            out,
            "{:<28} {:>8} {:>8} {:>9} {:>8} {:<6} {:<24} {:<16}",
            l.addr,
            l.accept_queue,
            l.backlog,
            l.syn_recv,
            l.rst_shed.map_or("-".into(), |n| n.to_string()),
            l.state,
            l.process.as_deref().unwrap_or("-"),
            l.scope.as_deref().unwrap_or("-")
        );
    }
    let counters: Vec<String> = r.counters.iter().map(|(k, v)| format!("{k} {v}")).collect();
    let _ = writeln!(out, "\nnamespace counters: {}", counters.join(", "));
    for g in &r.guards {
        out += &guard(g);
    }
    for w in &r.warnings {
        let _ = writeln!(out, "\nWARNING: {w}");
    }
    out
}

/// A guard's totals, and its per-caller budgets with its busiest callers.
fn guard(g: &ListenerStats) -> String {
    let mut out = String::new();
    let decided = if g.per_syn {
        "per SYN: RST above per socket"
    } else {
        "from the daemon's reading"
    };
    let _ = writeln!(
        out,
        "\nguard {} ({}, {decided}): {} RST past the queue limits, {} in observe mode",
        g.name, g.mode, g.rst_shed, g.would_rst
    );
    let Some(p) = &g.per_source else {
        return out;
    };
    let mut limits = Vec::new();
    if let Some(n) = p.max_connections {
        limits.push(format!("{n} connections"));
    }
    if let (Some(rate), Some(burst)) = (&p.rate, p.burst) {
        limits.push(format!("{rate} (burst {burst})"));
    }
    let _ = writeln!(
        out,
        "  per caller (/{} IPv4, /{} IPv6): {}, refused by {}",
        p.prefix,
        p.prefix6,
        limits.join(", "),
        p.action
    );
    let _ = writeln!(
        out,
        "  {} refused, {} in observe mode ({} over the rate); {} caller(s) refused now; \
         {} connection(s) held by {} caller(s)",
        p.refused, p.would_refuse, p.rate_limited, p.refusing, p.active, p.callers
    );
    let _ = writeln!(
        out,
        "  {:<44} {:>8} {:>8} {:>9} {:>8} {:>8} {:<8}",
        "CALLER", "ACTIVE", "PEAK", "ADMITTED", "REFUSED", "WOULD", "REFUSING"
    );
    for c in p.top.iter().chain(std::iter::once(&p.other)) {
        let _ = writeln!(
            out,
            "  {:<44} {:>8} {:>8} {:>9} {:>8} {:>8} {:<8}",
            c.caller,
            c.active,
            c.peak,
            c.admitted,
            c.refused,
            c.would_refuse,
            if c.refusing { "yes" } else { "-" }
        );
    }
    out
}
