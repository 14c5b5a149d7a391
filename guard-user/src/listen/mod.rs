//! Listener guards: the tc program attached in each guarded network namespace, and
//! LISTENERS_SHED kept current from the listeners' queues, read every 50 ms from the
//! namespaces' socket tables. A namespace that cannot be read sheds nothing
//! (fail-open), and says so in the log once, and again when it can be read again.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    path::{Path, PathBuf},
};

use anyhow::Context;
use aya::{Ebpf, programs::tc::SchedClassifierLink};
use guard_common::{
    ListenerKey, ListenerShed,
    addr::{endpoint, mapped},
    linux::TCP_LISTEN,
};
use serde::{Deserialize, Serialize};

use crate::{
    host::{
        netns,
        sockdiag::{self, TcpSocket, syn_recv_of},
    },
    kernel::{
        maps::{Hashed, ListenerMaps, Mirrored},
        object,
    },
    policy::{ListenerPolicy, mode_name},
};

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

/// The daemon's side of listener guards.
pub struct ListenerGuard {
    shed: Mirrored<ListenerKey, ListenerShed>,
    rst_shed: Hashed<u32, u64>,
    would_rst: Hashed<u32, u64>,
    policies: Vec<ListenerPolicy>,
    /// Listener name -> id of its RST_SHED and WOULD_RST counters, stable across reloads.
    ids: HashMap<String, u32>,
    readings: Vec<QueueReading>,
    /// Namespaces (as `netns_name` writes them) already attached: the namespace file and
    /// the links in it.
    attached: BTreeMap<String, (Option<PathBuf>, Vec<SchedClassifierLink>)>,
    /// Namespaces whose socket table could not be read at the last reading, with why.
    unreadable: BTreeMap<String, String>,
    /// Set for good by `stop`: a reading that finishes later writes nothing, and a
    /// reload attaches nothing.
    cleared: bool,
    /// Attach as tcx links (else clsact filters).
    tcx: bool,
}

/// What one reading of the guarded namespaces found.
pub struct Reading {
    shed: HashMap<ListenerKey, ListenerShed>,
    queues: Vec<QueueReading>,
    /// Namespace -> why its socket table could not be read.
    unreadable: BTreeMap<String, String>,
}

impl ListenerGuard {
    pub fn new(maps: ListenerMaps, tcx: bool) -> Self {
        ListenerGuard {
            shed: Mirrored::new(maps.shed),
            rst_shed: maps.rst_shed,
            would_rst: maps.would_rst,
            policies: Vec::new(),
            ids: HashMap::new(),
            readings: Vec::new(),
            attached: BTreeMap::new(),
            unreadable: BTreeMap::new(),
            cleared: false,
            tcx,
        }
    }

    /// Takes the listener policies of the policy in force, and attaches the RST program
    /// in each namespace not attached yet: to the policy's `interfaces`, or to all of
    /// them, loopback included. Links live as long as the daemon; the first policy naming
    /// a namespace chooses its interfaces. A namespace that fails is logged and tried
    /// again at the next reload; the others still get theirs.
    pub fn set_policies(&mut self, ebpf: &mut Ebpf, policies: Vec<ListenerPolicy>) {
        if self.cleared {
            return;
        }
        for p in &policies {
            let key = netns_name(p.netns.as_deref());
            if self.attached.contains_key(&key) {
                continue;
            }
            let mut links = Vec::new();
            let attached = netns::within(p.netns.as_deref(), || {
                let all = netns::interfaces()?;
                if let Some(missing) = p.interfaces.iter().find(|i| !all.contains(i)) {
                    anyhow::bail!("no interface {missing:?}");
                }
                let chosen: Vec<String> = all
                    .into_iter()
                    .filter(|i| p.interfaces.is_empty() || p.interfaces.contains(i))
                    .collect();
                for iface in &chosen {
                    let link = object::attach_listener(ebpf, iface, self.tcx)
                        .with_context(|| format!("attaching the listener guard to {iface}"))?;
                    links.push(link);
                }
                Ok(chosen)
            });
            match attached {
                Ok(ifaces) => {
                    log::info!(
                        "listener guard attached to {} in netns {key}",
                        ifaces.join(", ")
                    );
                    self.attached.insert(key, (p.netns.clone(), links));
                }
                Err(e) => {
                    log::error!("listener guard {:?} in netns {key}: {e:#}", p.name);
                    // What was attached before the failure goes: the next reload tries
                    // the namespace again from the start.
                    detach_in(p.netns.as_deref(), links);
                }
            }
        }
        for p in &policies {
            let next = self.ids.len() as u32;
            self.ids.entry(p.name.clone()).or_insert(next);
        }
        self.policies = policies;
    }

    /// The policies to read, with their counter ids: taken under the guard's lock, so
    /// that the socket tables are read without it.
    pub fn to_read(&self) -> Vec<(ListenerPolicy, u32)> {
        self.policies
            .iter()
            .map(|p| (p.clone(), self.ids[&p.name]))
            .collect()
    }

    /// Makes LISTENERS_SHED hold what `reading` found, and logs namespaces that became
    /// unreadable or readable again.
    pub fn apply(&mut self, reading: Reading) -> anyhow::Result<()> {
        if self.cleared {
            return Ok(());
        }
        for (ns, why) in &reading.unreadable {
            if !self.unreadable.contains_key(ns) {
                log::warn!(
                    "listener guard: cannot read the socket table of netns {ns}: {why}; its \
                     listeners are not shed until it can be read again"
                );
            }
        }
        for ns in self.unreadable.keys() {
            if !reading.unreadable.contains_key(ns) {
                log::info!("listener guard: netns {ns} can be read again");
            }
        }
        self.unreadable = reading.unreadable;
        self.readings = reading.queues;
        self.shed
            .sync(reading.shed)
            .context("writing LISTENERS_SHED")
    }

    /// For a daemon that stops: leaves LISTENERS_SHED empty for good (a reading still
    /// under way writes nothing), then detaches the program from every namespace (a
    /// clsact filter, on kernels before 6.6, would outlive the process). If a detach
    /// fails, the empty map still sheds nothing.
    pub fn stop(&mut self) -> anyhow::Result<()> {
        self.cleared = true;
        let emptied = self.shed.sync(HashMap::new());
        for (_, (ns, links)) in std::mem::take(&mut self.attached) {
            detach_in(ns.as_deref(), links);
        }
        emptied
    }

    pub fn stats(&self) -> Vec<ListenerStats> {
        self.policies
            .iter()
            .map(|p| {
                let id = self.ids[&p.name];
                ListenerStats {
                    name: p.name.clone(),
                    netns: netns_name(p.netns.as_deref()),
                    ports: p.ports.iter().map(|r| [r.first, r.last]).collect(),
                    mode: mode_name(p.mode).into(),
                    shedding: self.shed.entries().values().any(|v| v.listener_id == id),
                    rst_shed: self.rst_shed.get(&id, 0).unwrap_or(0),
                    would_rst: self.would_rst.get(&id, 0).unwrap_or(0),
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

/// Detaches `links` in the namespace at `ns` (None: the daemon's own), each one, logging
/// failures. A link that cannot be detached there is let go without a detach (dropped
/// elsewhere, a clsact filter's link would send its delete to the wrong namespace).
fn detach_in(ns: Option<&Path>, links: Vec<SchedClassifierLink>) {
    if links.is_empty() {
        return;
    }
    let name = netns_name(ns);
    let mut links = Some(links);
    let entered = netns::within(ns, || {
        for link in links.take().into_iter().flatten() {
            if let Err(e) = object::detach_listener(link) {
                log::warn!("listener guard: detaching in netns {name}: {e:#}");
            }
        }
        Ok(())
    });
    if let Err(e) = entered {
        log::warn!("listener guard: cannot enter netns {name} to detach: {e:#}");
    }
    links.into_iter().flatten().for_each(std::mem::forget);
}

/// A policy's netns as logs and stats name it: its file, or "self".
fn netns_name(netns: Option<&Path>) -> String {
    netns.map_or("self".into(), |n| n.display().to_string())
}

/// Reads the socket tables of the policies' namespaces: the listeners past their
/// watermark, and every guarded listener's queues.
pub fn read(policies: &[(ListenerPolicy, u32)]) -> Reading {
    let mut reading = Reading {
        shed: HashMap::new(),
        queues: Vec::new(),
        unreadable: BTreeMap::new(),
    };
    let namespaces: BTreeSet<Option<PathBuf>> =
        policies.iter().map(|(p, _)| p.netns.clone()).collect();
    for ns in namespaces {
        let sockets = match netns::within(ns.as_deref(), sockdiag::listeners_and_syn_recv) {
            Ok(s) => s,
            Err(e) => {
                reading
                    .unreadable
                    .insert(netns_name(ns.as_deref()), format!("{e:#}"));
                continue;
            }
        };
        for (p, id) in policies.iter().filter(|(p, _)| p.netns == ns) {
            judge(p, *id, &sockets, &mut reading);
        }
    }
    reading
}

/// Adds the listeners of one policy in one namespace's socket table to `reading`.
fn judge(p: &ListenerPolicy, id: u32, sockets: &[TcpSocket], reading: &mut Reading) {
    for l in sockets.iter().filter(|l| {
        l.state == TCP_LISTEN
            && p.ports
                .iter()
                .any(|r| (r.first..=r.last).contains(&l.sport))
            && p.addr.is_none_or(|a| a == l.src)
    }) {
        let syn_recv = syn_recv_of(sockets, l);
        reading.queues.push(QueueReading {
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
            // A wildcard listener (0.0.0.0 or ::) is keyed all zeros.
            let addr = if l.src.is_unspecified() {
                [0; 16]
            } else {
                mapped(l.src)
            };
            reading.shed.insert(
                ListenerKey {
                    port: l.sport,
                    _pad: 0,
                    addr,
                },
                ListenerShed {
                    listener_id: id,
                    mode: p.mode,
                },
            );
        }
    }
}
