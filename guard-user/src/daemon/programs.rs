//! The loaded programs and where they are attached, under three locks taken in one
//! order: the policy in force with the cgroups it governs (`Generations`), then the
//! loaded object (`Ebpf`), then the listener guard, then the host-wide programs
//! (`Backstop`, also held alone to read); the drills' egress links come between the
//! generations' lock and the object's (`sync_drill_egress`). The object is reached only through
//! the generations' guard (`GenerationsGuard::ebpf`), and the listener guard through
//! the object's (`EbpfGuard::listeners`), to attach; the listener guard is also held
//! alone, by the methods here that take no other lock, for the listener watchers, which
//! so wait for no cgroup walk or attach and no snapshot (only for the listener program's
//! own attach).
use std::{
    collections::HashMap,
    ops::{Deref, DerefMut},
    path::PathBuf,
    sync::{Mutex, MutexGuard},
};

use aya::{Ebpf, programs::cgroup_skb::CgroupSkbLink};

use super::lock;
use connguard_api::stats::{CallerTables, ListenerStats};

use crate::{
    enforce::generations::Generations,
    kernel::{backstop::Backstop, object},
    listen::{ListenerGuard, Reading},
    policy::ListenerPolicy,
};

pub struct Programs {
    generations: Mutex<Generations>,
    ebpf: Mutex<Ebpf>,
    listeners: Mutex<ListenerGuard>,
    backstop: Mutex<Backstop>,
    /// `drill_egress`'s links, by cgroup directory: taken after the generations' lock,
    /// before the object's (and, inside it, the daemon's drills).
    drill_egress: Mutex<Vec<(PathBuf, CgroupSkbLink)>>,
}

/// The generations' lock, held; hands out the object's.
pub struct GenerationsGuard<'a> {
    generations: MutexGuard<'a, Generations>,
    ebpf: &'a Mutex<Ebpf>,
    listeners: &'a Mutex<ListenerGuard>,
}

/// The object's lock, held after the generations'; hands out the listener guard's.
pub struct EbpfGuard<'a> {
    ebpf: MutexGuard<'a, Ebpf>,
    listeners: &'a Mutex<ListenerGuard>,
}

impl Programs {
    pub fn new(
        generations: Generations,
        ebpf: Ebpf,
        listeners: ListenerGuard,
        backstop: Backstop,
    ) -> Self {
        Programs {
            generations: Mutex::new(generations),
            ebpf: Mutex::new(ebpf),
            listeners: Mutex::new(listeners),
            backstop: Mutex::new(backstop),
            drill_egress: Mutex::new(Vec::new()),
        }
    }

    /// Attaches `drill_egress` to every cgroup the connection programs are attached to
    /// while `wanted()` says so, or detaches it from all. The program drops only packets
    /// of sockets a drill marked; descendants of these cgroups run it too. `wanted` is
    /// asked holding this lock, so that concurrent calls apply the last answer.
    pub fn sync_drill_egress(&self, wanted: impl Fn() -> bool) -> anyhow::Result<()> {
        let mut g = self.generations();
        let dirs = g.attached_dirs();
        let mut links = lock(&self.drill_egress);
        let dirs = if wanted() { dirs } else { Vec::new() };
        if dirs.len() == links.len() && links.iter().all(|(d, _)| dirs.contains(d)) {
            return Ok(());
        }
        let (_, mut ebpf) = g.ebpf();
        // A dropped link detaches (it is not pinned).
        links.retain(|(dir, _)| dirs.contains(dir));
        let mut first_error = None;
        for dir in dirs {
            if links.iter().any(|(d, _)| *d == dir) {
                continue;
            }
            match object::attach_drill_egress(&mut ebpf, &dir) {
                Ok(link) => links.push((dir, link)),
                Err(e) => {
                    first_error.get_or_insert(e.context(format!("{}", dir.display())));
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Takes the generations' lock, the first.
    pub fn generations(&self) -> GenerationsGuard<'_> {
        GenerationsGuard {
            generations: lock(&self.generations),
            ebpf: &self.ebpf,
            listeners: &self.listeners,
        }
    }

    /// Gives the listener guard the listener policies of the policy in force, and
    /// attaches its program where they need it.
    /// With per-caller budgets, the host-wide programs that count them are attached
    /// before, and detached after the last guard with them is gone, its callers'
    /// counts forgotten.
    pub fn set_listener_policies(&self, policies: Vec<ListenerPolicy>) {
        let per_source = policies.iter().any(|p| p.per_source.is_some());
        let mut g = self.generations();
        let (_, mut ebpf) = g.ebpf();
        if per_source {
            self.set_per_source(&mut ebpf, true);
        }
        let (ebpf, mut listeners) = ebpf.listeners();
        listeners.set_policies(ebpf, policies);
        if !per_source {
            self.set_per_source(ebpf, false);
            // With the programs that release callers' counts detached, a count kept
            // would be wrong when a guard sets `per_source` again.
            listeners.forget_callers();
        }
    }

    fn set_per_source(&self, ebpf: &mut Ebpf, per_source: bool) {
        let mut b = lock(&self.backstop);
        b.set_per_source(per_source);
        if let Err(e) = b.apply(ebpf) {
            log::error!("attaching the host-wide tracepoint programs: {e:#}");
        }
    }

    /// Reads which other sock_ops programs are loaded, and attaches or detaches the
    /// state tracepoint when that changed (`Backstop`). The read takes the host-wide
    /// programs' lock alone; the attach, the object's first.
    pub fn poll_foreign_sock_ops(&self) -> anyhow::Result<()> {
        if !lock(&self.backstop).poll_foreign()? {
            return Ok(());
        }
        let mut g = self.generations();
        let (_, mut ebpf) = g.ebpf();
        lock(&self.backstop).apply(&mut ebpf)
    }

    /// At start, before the first policy: attaches the host-wide programs the start
    /// needs (`per_source`: the first policy's listener guards have per-caller budgets).
    pub fn start_backstop(&self, per_source: bool) -> anyhow::Result<()> {
        let mut g = self.generations();
        let (_, mut ebpf) = g.ebpf();
        let mut b = lock(&self.backstop);
        b.poll_foreign()?;
        b.set_per_source(per_source);
        b.apply(&mut ebpf)
    }

    /// Detaches the host-wide programs' links of daemons before this one, once this
    /// one's are attached and its policy is in force.
    pub fn remove_old_tracepoints(&self) -> anyhow::Result<()> {
        lock(&self.backstop).tracepoints().remove_old()
    }

    /// The host-wide programs attached, and why.
    pub fn host_wide(&self) -> (Vec<&'static str>, Vec<String>) {
        let b = lock(&self.backstop);
        (b.tracepoints().attached(), b.reasons())
    }

    /// Attaches the listener program to the guarded namespaces' new interfaces.
    pub fn rescan_listeners(&self) {
        let mut g = self.generations();
        let (_, mut ebpf) = g.ebpf();
        let (ebpf, mut listeners) = ebpf.listeners();
        listeners.rescan(ebpf);
    }

    /// The listener policies to read, with their counter ids, and whether the program
    /// decides per SYN (ListenerGuard::to_read).
    pub fn listeners_to_read(&self) -> (Vec<(ListenerPolicy, u32)>, bool) {
        lock(&self.listeners).to_read()
    }

    /// Whether a listener guard is in force.
    pub fn guarding_listeners(&self) -> bool {
        lock(&self.listeners).guarding()
    }

    /// Makes LISTENERS hold what `reading` found (ListenerGuard::apply).
    pub fn apply_listener_reading(&self, reading: Reading) -> anyhow::Result<()> {
        lock(&self.listeners).apply(reading)
    }

    /// Tells the per-SYN listener program the daemon lives (ListenerGuard::heartbeat).
    pub fn listener_heartbeat(&self) -> anyhow::Result<()> {
        lock(&self.listeners).heartbeat()
    }

    /// The listener guards' stats, and the use of their callers' tables.
    pub fn listener_stats(&self) -> (Vec<ListenerStats>, CallerTables) {
        lock(&self.listeners).stats()
    }

    /// Listener guards' names by id, for events.
    pub fn listener_names(&self) -> HashMap<u32, String> {
        lock(&self.listeners).names()
    }

    /// Empties LISTENERS for good and detaches the listener program
    /// (ListenerGuard::stop). A reload still under way holds the guard's lock until it
    /// is done; one after this attaches nothing.
    pub fn stop_listeners(&self) -> anyhow::Result<()> {
        lock(&self.listeners).stop()
    }
}

impl GenerationsGuard<'_> {
    /// Takes the object's lock, after the generations' (still held).
    pub fn ebpf(&mut self) -> (&mut Generations, EbpfGuard<'_>) {
        let ebpf = EbpfGuard {
            ebpf: lock(self.ebpf),
            listeners: self.listeners,
        };
        (&mut self.generations, ebpf)
    }
}

impl Deref for GenerationsGuard<'_> {
    type Target = Generations;

    fn deref(&self) -> &Generations {
        &self.generations
    }
}

impl DerefMut for GenerationsGuard<'_> {
    fn deref_mut(&mut self) -> &mut Generations {
        &mut self.generations
    }
}

impl EbpfGuard<'_> {
    /// Takes the listener guard's lock, after the object's (still held).
    fn listeners(&mut self) -> (&mut Ebpf, MutexGuard<'_, ListenerGuard>) {
        let listeners = lock(self.listeners);
        (&mut self.ebpf, listeners)
    }
}

impl Deref for EbpfGuard<'_> {
    type Target = Ebpf;

    fn deref(&self) -> &Ebpf {
        &self.ebpf
    }
}

impl DerefMut for EbpfGuard<'_> {
    fn deref_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }
}
