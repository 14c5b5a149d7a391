//! Listener guards: the tc program attached to the interfaces of each guarded network
//! namespace (followed as interfaces and namespaces come and go), and LISTENERS, the
//! guarded listener sockets with their policies, rewritten from the namespaces' socket
//! tables every 50 ms. The program decides per SYN from the listener's own queues where
//! the kernel lets it (`per_syn`), else from the daemon's decision in the entry. It
//! sheds nothing LISTENER_TTL_NS after the daemon's last heartbeat (per SYN) or the
//! entry's reading (polled); heartbeats stop when readings do, so a killed daemon, a
//! hung one or a stuck watcher sheds nothing (fail-open); a namespace that cannot be
//! read loses its entries, and is logged once, and again when it can be read again.
//!
//! Guards with per-caller budgets (`per_source`, callers.rs) need the per-SYN program:
//! with the polled one they are not enforced, and a warning says so.
mod attach;
mod callers;
mod ids;
mod reading;
mod rsts;

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    time::Duration,
};

use anyhow::Context;
use aya::Ebpf;
use connguard_api::stats::{CallerTables, ListenerStats, QueueReading};
use guard_common::{
    LISTENER_TTL_NS, ListenerEntry, ListenerKey, NO_LISTENER, RstKey, callers::PER_SOURCE_OFF,
    monotonic_ns,
};

pub use callers::caller_name;
pub use reading::{Reader, Reading};

use crate::{
    kernel::maps::{ListenerMaps, Mirrored},
    policy::{ListenerPolicy, mode_name},
};

/// How often the kernel's entries of gone sockets and idle callers are swept.
const SWEEP: Duration = Duration::from_secs(10);

/// The daemon's side of listener guards.
pub struct ListenerGuard {
    entries: Mirrored<ListenerKey, ListenerEntry>,
    heartbeat: aya::maps::Array<aya::maps::MapData, u64>,
    rsts: rsts::Rsts,
    /// The policies in force that have an id.
    policies: Vec<ListenerPolicy>,
    /// Guard names' ids, which key their counts in the kernel.
    ids: ids::GuardIds,
    callers: callers::Callers,
    readings: Vec<QueueReading>,
    /// Listener ids past a limit at the last reading.
    shedding: BTreeSet<u32>,
    /// When the last reading was applied.
    applied: Option<std::time::Instant>,
    attached: attach::Attachments,
    /// Namespaces whose socket table could not be read at the last reading, with why.
    unreadable: BTreeMap<String, String>,
    /// Set for good by `stop`: a reading that finishes later writes nothing, and a
    /// rescan attaches nothing.
    cleared: bool,
    /// The loaded program decides per SYN (LISTENERS keyed by namespace).
    per_syn: bool,
}

impl ListenerGuard {
    pub fn new(maps: ListenerMaps, tcx: bool, per_syn: bool) -> anyhow::Result<Self> {
        Ok(ListenerGuard {
            entries: Mirrored::new(maps.shed),
            heartbeat: maps.heartbeat,
            rsts: rsts::Rsts::new(maps.rst_shed, maps.would_rst),
            policies: Vec::new(),
            ids: ids::GuardIds::restore(maps.ids)?,
            callers: callers::Callers::new(
                maps.caller_guards,
                maps.callers,
                maps.sources,
                maps.per_source_totals,
            ),
            readings: Vec::new(),
            shedding: BTreeSet::new(),
            applied: None,
            attached: attach::Attachments::new(tcx),
            unreadable: BTreeMap::new(),
            cleared: false,
            per_syn,
        })
    }

    /// Takes the listener policies of the policy in force, and attaches the program
    /// where they need it (`rescan`). A guard whose name cannot be given an id is left
    /// out, and logged.
    pub fn set_policies(&mut self, ebpf: &mut Ebpf, policies: Vec<ListenerPolicy>) {
        self.policies = policies
            .into_iter()
            .filter(|p| match self.ids.assign(&p.name) {
                Ok(_) => true,
                Err(e) => {
                    log::error!("listener guard {:?} is not applied: {e:#}", p.name);
                    false
                }
            })
            .collect();
        if !self.per_syn
            && let Some(p) = self.policies.iter().find(|p| p.per_source.is_some())
        {
            log::warn!(
                "listener guard {:?}: per_source budgets need the per-SYN listener program \
                 (kernel feature listener_per_syn), and are not enforced",
                p.name
            );
        }
        self.rescan(ebpf);
    }

    /// Attaches the program to the interfaces of each guarded namespace not attached
    /// yet: the policy's `interfaces`, or all of them, loopback included; the first
    /// policy naming a namespace chooses. Run every second, it follows interfaces
    /// created later (a new pod's veth) and a namespace file bound to a new namespace.
    pub fn rescan(&mut self, ebpf: &mut Ebpf) {
        if !self.cleared {
            self.attached.rescan(ebpf, &self.policies);
        }
    }

    /// Whether any listener policy is set.
    pub fn guarding(&self) -> bool {
        !self.policies.is_empty()
    }

    /// The policies to read, with their counter ids, and whether the program decides
    /// per SYN: taken under the guard's lock, so that the socket tables are read
    /// without it.
    pub fn to_read(&self) -> (Vec<(ListenerPolicy, u32)>, bool) {
        let policies = self
            .policies
            .iter()
            .filter_map(|p| Some((p.clone(), self.ids.get(&p.name)?)))
            .collect();
        (policies, self.per_syn)
    }

    /// Makes LISTENERS hold what `reading` found, renewed now, and logs namespaces that
    /// became unreadable or readable again.
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
        self.shedding = reading.shedding;
        self.applied = Some(std::time::Instant::now());
        let now = monotonic_ns();
        let entries: HashMap<ListenerKey, ListenerEntry> = reading
            .entries
            .into_iter()
            .map(|(k, v)| {
                (
                    k,
                    ListenerEntry {
                        renewed_ns: now,
                        ..v
                    },
                )
            })
            .collect();
        let guards = if self.per_syn {
            entries
                .values()
                .filter(|e| e.listener_id != NO_LISTENER && e.per_source.action != PER_SOURCE_OFF)
                .count() as u32
        } else {
            0
        };
        let synced = self.entries.sync(entries).context("writing LISTENERS");
        // The entries hold from the moment they are written, not from the next beat.
        self.heartbeat()?;
        self.callers.set_guards(guards)?;
        self.callers.sweep();
        let listed: HashSet<RstKey> = self
            .readings
            .iter()
            .map(|q| RstKey {
                listener_id: q.listener_id,
                inode: q.inode,
            })
            .collect();
        self.rsts.sweep(&listed);
        synced
    }

    /// Forgets every caller's count (Callers::forget_all).
    pub fn forget_callers(&mut self) {
        self.callers.forget_all();
    }

    /// Tells the per-SYN program the daemon lives (every 100 ms while a guard is set):
    /// only while its readings keep LISTENERS current (one within LISTENER_TTL_NS), so a
    /// watcher stuck on a namespace lets every guard lapse. A stopped guard sends none.
    pub fn heartbeat(&mut self) -> anyhow::Result<()> {
        let fresh = self
            .applied
            .is_some_and(|t| t.elapsed().as_nanos() <= u128::from(LISTENER_TTL_NS));
        if self.cleared || !fresh {
            return Ok(());
        }
        self.heartbeat
            .set(0, monotonic_ns(), 0)
            .context("writing LISTENER_HEARTBEAT")
    }

    /// For a daemon that stops: leaves LISTENERS empty for good (a reading still under
    /// way writes nothing), then detaches the program from every namespace (a clsact
    /// filter, on kernels before 6.6, would outlive the process). If a detach fails,
    /// the empty map still sheds nothing.
    pub fn stop(&mut self) -> anyhow::Result<()> {
        self.cleared = true;
        let emptied = self.entries.sync(HashMap::new());
        self.attached.detach_all();
        emptied
    }

    /// The guards' stats, and the use of the callers' tables.
    pub fn stats(&self) -> (Vec<ListenerStats>, CallerTables) {
        let rsts = self.rsts.read();
        let tables = self
            .policies
            .iter()
            .any(|p| p.per_source.is_some())
            .then(|| self.callers.read());
        let stats = self
            .policies
            .iter()
            .filter_map(|p| {
                let id = self.ids.get(&p.name)?;
                let [rst_shed, would_rst] = self.rsts.totals(&rsts, id);
                Some(ListenerStats {
                    name: p.name.clone(),
                    netns: netns_name(p.netns.as_deref()),
                    ports: p.ports.iter().map(|r| [r.first, r.last]).collect(),
                    mode: mode_name(p.mode).into(),
                    per_syn: self.per_syn,
                    shedding: self.shedding.contains(&id),
                    rst_shed,
                    would_rst,
                    queues: self
                        .readings
                        .iter()
                        .filter(|r| r.listener_id == id)
                        .map(|r| {
                            let [rst_shed, would_rst] = rsts.of(&RstKey {
                                listener_id: id,
                                inode: r.inode,
                            });
                            QueueReading {
                                rst_shed,
                                would_rst,
                                ..r.clone()
                            }
                        })
                        .collect(),
                    per_source: p
                        .per_source
                        .as_ref()
                        .zip(tables.as_ref())
                        .map(|(ps, t)| self.callers.stats(t, id, ps)),
                })
            })
            .collect();
        (stats, tables.map(|t| t.use_of()).unwrap_or_default())
    }

    /// Guard ids by name, for events.
    pub fn names(&self) -> HashMap<u32, String> {
        self.ids.names()
    }
}

/// A policy's netns as logs and stats name it: its file, or "self".
fn netns_name(netns: Option<&std::path::Path>) -> String {
    netns.map_or("self".into(), |n| n.display().to_string())
}
