//! Listeners and their queues: which listener is saturated, and by whom.
//!
//! A listener's accept queue holds established connections not yet accept()ed; it is
//! full once it holds more than the effective backlog, min(listen() backlog,
//! net.core.somaxconn) (sk_acceptq_is_full, include/net/sock.h), so it holds backlog + 1.
//! Then the kernel drops new SYNs and final ACKs silently (ListenOverflows and
//! ListenDrops grow, per network namespace), and clients wait on SYN retransmits.
//! sock_diag reports a listener's queue length as Recv-Q and its backlog as Send-Q
//! (net/ipv4/tcp_diag.c), and half-open connections as SYN_RECV entries.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    fmt::Write,
    path::Path,
};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use guard_common::{ListenerKey, ListenerShed, MODE_ENFORCE};

use crate::{
    policy::ListenerPolicy,
    ports::endpoint,
    sockdiag::{TCP_LISTEN, TCP_SYN_RECV, TcpSocket},
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

/// `connguard listeners --json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ListenersReport {
    pub netns: String,
    /// Fullest first.
    pub listeners: Vec<Listener>,
    /// The namespace's TcpExt counters (totals since the namespace was created), as
    /// `nstat -az` shows them.
    pub counters: BTreeMap<String, u64>,
    pub warnings: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Listener {
    pub netns: String,
    /// `a.b.c.d:port` or `[v6]:port` (0.0.0.0 or :: for every address).
    pub addr: String,
    /// The port alone, host order.
    pub port: u16,
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
    /// Overflows of this listener; null: the kernel counts them per namespace only
    /// (`counters.ListenOverflows`).
    pub overflows: Option<u64>,
    /// SYNs answered with RST by connguard's guard for this port (from the daemon).
    pub rst_shed: u64,
    /// "full" when the queue holds more than the backlog (new SYNs are dropped), else "ok".
    pub state: String,
}

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
                process: owner.map(|o| format!("{}[{}]", o.comm, o.pid)),
                cgroup: owner.and_then(|o| o.cgroup.clone()),
                scope: None,
                accept_queue: l.recv_queue,
                backlog: l.send_queue,
                syn_recv,
                overflows: None,
                rst_shed: 0,
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

/// The namespace's TcpExt counters from /proc/thread-self/net/netstat (the calling
/// thread's namespace).
pub fn read_counters() -> anyhow::Result<BTreeMap<String, u64>> {
    let text = std::fs::read_to_string("/proc/thread-self/net/netstat")
        .context("reading /proc/thread-self/net/netstat")?;
    Ok(parse_netstat(&text))
}

/// The COUNTERS of the TcpExt lines of a /proc/net/netstat text (a line of names, then
/// a line of values).
pub fn parse_netstat(text: &str) -> BTreeMap<String, u64> {
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with("TcpExt:")).collect();
    let mut out = BTreeMap::new();
    if let [names, values] = lines[..] {
        for (name, value) in names
            .split_whitespace()
            .zip(values.split_whitespace())
            .skip(1)
        {
            if COUNTERS.contains(&name) {
                out.insert(name.to_string(), value.parse().unwrap_or(0));
            }
        }
    }
    out
}

struct Owner {
    pid: u32,
    comm: String,
    cgroup: Option<String>,
}

/// Socket inode -> the first process holding it (from /proc/PID/fd, as `ss -p` does).
fn socket_owners() -> BTreeMap<u32, Owner> {
    let mut out = BTreeMap::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return out;
    };
    for entry in procs.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            let Ok(link) = std::fs::read_link(fd.path()) else {
                continue;
            };
            let link = link.to_string_lossy();
            let Some(inode) = link
                .strip_prefix("socket:[")
                .and_then(|s| s.strip_suffix(']'))
            else {
                continue;
            };
            let Ok(inode) = inode.parse::<u32>() else {
                continue;
            };
            out.entry(inode).or_insert_with(|| Owner {
                pid,
                comm: std::fs::read_to_string(entry.path().join("comm"))
                    .map(|c| c.trim().to_string())
                    .unwrap_or_default(),
                cgroup: cgroup_of(&entry.path()),
            });
        }
    }
    out
}

/// The cgroup v2 path of a process, from /proc/PID/cgroup ("0::/path").
fn cgroup_of(proc_dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(proc_dir.join("cgroup")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(|p| p.trim_start_matches('/').to_string())
}

/// The readable form of `connguard listeners`.
pub fn table(r: &ListenersReport) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "netns {}", r.netns);
    let _ = writeln!(
        out,
        "\n{:<28} {:>8} {:>8} {:>9} {:<6} {:<24} {:<16}",
        "LISTENER", "QUEUE", "BACKLOG", "SYN_RECV", "STATE", "PROCESS", "SCOPE"
    );
    for l in &r.listeners {
        let _ = writeln!(
            out,
            "{:<28} {:>8} {:>8} {:>9} {:<6} {:<24} {:<16}",
            l.addr,
            l.accept_queue,
            l.backlog,
            l.syn_recv,
            l.state,
            l.process.as_deref().unwrap_or("-"),
            l.scope.as_deref().unwrap_or("-")
        );
    }
    let counters: Vec<String> = r.counters.iter().map(|(k, v)| format!("{k} {v}")).collect();
    let _ = writeln!(out, "\nnamespace counters: {}", counters.join(", "));
    for w in &r.warnings {
        let _ = writeln!(out, "\nWARNING: {w}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn netstat_counters_are_read_by_name() {
        let text = "TcpExt: SyncookiesSent ListenOverflows ListenDrops Other\nTcpExt: 4 7 9 1\nIpExt: A\nIpExt: 2\n";
        let c = parse_netstat(text);
        assert_eq!(c.get("ListenOverflows"), Some(&7));
        assert_eq!(c.get("ListenDrops"), Some(&9));
        assert_eq!(c.get("SyncookiesSent"), Some(&4));
        assert_eq!(c.get("Other"), None);
    }
}

/// The daemon's side of listener guards: attaches the tc program in the listeners'
/// namespaces and keeps LISTENERS_SHED current.
pub struct ListenerGuard {
    shed: aya::maps::HashMap<aya::maps::MapData, ListenerKey, ListenerShed>,
    rst: aya::maps::HashMap<aya::maps::MapData, u32, u64>,
    would: aya::maps::HashMap<aya::maps::MapData, u32, u64>,
    written: HashMap<ListenerKey, ListenerShed>,
    readings: Vec<QueueReading>,
    /// Namespaces (policy netns paths, "" for the daemon's own) already attached.
    attached: BTreeSet<String>,
    /// Listener name -> id of its RST_SHED and WOULD_RST counters, stable across reloads.
    ids: HashMap<String, u32>,
}

/// One guarded listener socket's queues at the last reading (units: connections).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QueueReading {
    #[serde(skip)]
    pub listener_id: u32,
    pub addr: String,
    pub accept_queue: u32,
    pub backlog: u32,
    pub syn_recv: u32,
}

/// Live state of one `[[listener]]` policy, for `stats`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ListenerStats {
    pub name: String,
    /// The policy's netns file, or "self".
    pub netns: String,
    /// The policy's ports, as inclusive [first, last] ranges.
    pub ports: Vec<[u16; 2]>,
    pub mode: String,
    /// True while its accept queue is past the watermark.
    pub shedding: bool,
    /// SYNs answered with RST (enforce mode).
    pub rst_shed: u64,
    /// SYNs observe mode would have answered with RST.
    pub would_rst: u64,
    /// The matching listener sockets at the last reading (every 50 ms).
    pub queues: Vec<QueueReading>,
}

impl ListenerGuard {
    pub fn new(ebpf: &mut aya::Ebpf) -> anyhow::Result<Self> {
        let mut take = |name: &str| {
            ebpf.take_map(name)
                .with_context(|| format!("map {name} missing from the eBPF object"))
        };
        Ok(ListenerGuard {
            shed: aya::maps::HashMap::try_from(take("LISTENERS_SHED")?)?,
            rst: aya::maps::HashMap::try_from(take("RST_SHED")?)?,
            would: aya::maps::HashMap::try_from(take("WOULD_RST")?)?,
            written: HashMap::new(),
            readings: Vec::new(),
            attached: BTreeSet::new(),
            ids: HashMap::new(),
        })
    }

    /// Attaches the RST program to the interfaces of each listener namespace not attached
    /// yet (the policy's `interfaces`, or all, loopback included). Links live as long as
    /// the daemon; the first policy naming a namespace chooses its interfaces.
    pub fn attach(
        &mut self,
        ebpf: &mut aya::Ebpf,
        policies: &[ListenerPolicy],
    ) -> anyhow::Result<()> {
        for p in policies {
            let key = p
                .netns
                .as_ref()
                .map_or(String::new(), |n| n.display().to_string());
            if self.attached.contains(&key) {
                continue;
            }
            let prog: &mut aya::programs::SchedClassifier = ebpf
                .program_mut(crate::loader::LISTENER_PROGRAM)
                .context("listener program missing")?
                .try_into()?;
            let attached = crate::netns::within(p.netns.as_deref(), || {
                let all = interfaces()?;
                if let Some(missing) = p.interfaces.iter().find(|i| !all.contains(i)) {
                    anyhow::bail!("no interface {missing:?}");
                }
                let chosen: Vec<String> = all
                    .into_iter()
                    .filter(|i| p.interfaces.is_empty() || p.interfaces.contains(i))
                    .collect();
                for iface in &chosen {
                    crate::loader::attach_tc_ingress(prog, iface)
                        .with_context(|| format!("attaching the listener guard to {iface}"))?;
                }
                Ok(chosen)
            });
            let shown = if key.is_empty() { "self" } else { key.as_str() };
            match attached {
                Ok(ifaces) => {
                    log::info!(
                        "listener guard attached to {} in netns {shown}",
                        ifaces.join(", ")
                    );
                    self.attached.insert(key);
                }
                // The other namespaces still get theirs; this one is tried again at the
                // next reload.
                Err(e) => log::error!("listener guard {:?} in netns {shown}: {e:#}", p.name),
            }
        }
        Ok(())
    }

    /// The stable counter id of a listener policy.
    pub fn id(&mut self, name: &str) -> u32 {
        let next = self.ids.len() as u32;
        *self.ids.entry(name.to_string()).or_insert(next)
    }

    /// Ids for every policy, for over_watermark().
    pub fn ids_of(&mut self, policies: &[ListenerPolicy]) -> HashMap<String, u32> {
        policies
            .iter()
            .map(|p| (p.name.clone(), self.id(&p.name)))
            .collect()
    }

    /// Makes LISTENERS_SHED hold exactly these listeners; stale entries go first.
    pub fn set(
        &mut self,
        (entries, readings): (HashMap<ListenerKey, ListenerShed>, Vec<QueueReading>),
    ) -> anyhow::Result<()> {
        self.readings = readings;
        for stale in self.written.keys().filter(|k| !entries.contains_key(k)) {
            let _ = self.shed.remove(stale);
        }
        self.written.clear();
        for (k, v) in entries {
            self.shed.insert(k, v, 0)?;
            self.written.insert(k, v);
        }
        Ok(())
    }

    pub fn stats(&mut self, policies: &[ListenerPolicy]) -> Vec<ListenerStats> {
        policies
            .iter()
            .map(|p| {
                let id = self.id(&p.name);
                ListenerStats {
                    name: p.name.clone(),
                    netns: p
                        .netns
                        .as_ref()
                        .map_or("self".into(), |n| n.display().to_string()),
                    ports: p.ports.iter().map(|r| [r.first, r.last]).collect(),
                    mode: if p.mode == MODE_ENFORCE {
                        "enforce"
                    } else {
                        "observe"
                    }
                    .into(),
                    shedding: self.written.values().any(|v| v.listener_id == id),
                    rst_shed: self.rst.get(&id, 0).unwrap_or(0),
                    would_rst: self.would.get(&id, 0).unwrap_or(0),
                    queues: self
                        .readings
                        .iter()
                        .filter(|r| r.listener_id == id)
                        .cloned()
                        .collect(),
                }
            })
            .collect()
    }
}

/// The interfaces of the calling thread's network namespace.
fn interfaces() -> anyhow::Result<Vec<String>> {
    let dev = std::fs::read_to_string("/proc/thread-self/net/dev")
        .context("reading /proc/thread-self/net/dev")?;
    Ok(dev
        .lines()
        .skip(2)
        .filter_map(|l| l.split_once(':').map(|(n, _)| n.trim().to_string()))
        .collect())
}

/// The listeners past their watermark, read from the socket tables of the policies'
/// namespaces. A namespace that cannot be read leaves its listeners out (fail-open).
pub fn over_watermark(
    policies: &[ListenerPolicy],
    ids: impl Fn(&str) -> u32,
) -> (HashMap<ListenerKey, ListenerShed>, Vec<QueueReading>) {
    let mut out = HashMap::new();
    let mut readings = Vec::new();
    let namespaces: BTreeSet<Option<&Path>> = policies.iter().map(|p| p.netns.as_deref()).collect();
    for ns in namespaces {
        let Ok(sockets) = crate::netns::within(ns, crate::sockdiag::tcp_sockets) else {
            log::debug!("listener guard: cannot read the socket table of {ns:?}");
            continue;
        };
        for p in policies.iter().filter(|p| p.netns.as_deref() == ns) {
            let id = ids(&p.name);
            for l in sockets.iter().filter(|l| {
                l.state == TCP_LISTEN
                    && p.ports
                        .iter()
                        .any(|r| (r.first..=r.last).contains(&l.sport))
                    && p.addr.is_none_or(|a| a == l.src)
            }) {
                let syn_recv = syn_recv_of(&sockets, l);
                readings.push(QueueReading {
                    listener_id: id,
                    addr: endpoint(l.src, l.sport),
                    accept_queue: l.recv_queue,
                    backlog: l.send_queue,
                    syn_recv,
                });
                // A backlog of 0 still queues one connection: compare against 1.
                let backlog = l.send_queue.max(1) as u64;
                let queue_over = p
                    .accept_queue_watermark
                    .is_some_and(|w| l.recv_queue as u64 * 1000 >= w as u64 * backlog);
                let syn_over = p.max_syn_recv.is_some_and(|m| syn_recv >= m);
                if queue_over || syn_over {
                    let addr = if l.src.is_unspecified() {
                        [0; 16]
                    } else {
                        crate::accounting::mapped_addr(l.src)
                    };
                    let key = ListenerKey {
                        port: l.sport,
                        _pad: 0,
                        addr,
                    };
                    out.insert(
                        key,
                        ListenerShed {
                            listener_id: id,
                            mode: p.mode,
                        },
                    );
                }
            }
        }
    }
    (out, readings)
}

/// Half-open connections toward a listener.
fn syn_recv_of(sockets: &[TcpSocket], l: &TcpSocket) -> u32 {
    sockets
        .iter()
        .filter(|s| {
            s.state == TCP_SYN_RECV
                && s.sport == l.sport
                && (l.src.is_unspecified() || s.src == l.src)
        })
        .count() as u32
}
