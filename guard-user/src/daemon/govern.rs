//! The policy in force and the cgroups it governs, kept current: reloads, walks of the
//! cgroup tree, and cgroups created in a watched one.
use std::{collections::BTreeSet, path::Path};

use super::{Daemon, lock, read_policy};
use connguard_api::control::ReloadReply;

use crate::{
    enforce::{
        breakers::BreakerRamps,
        scopes::{self, Tree},
    },
    host::cgroup,
    kernel::clock,
    policy::{self, Policy},
};

impl Daemon {
    /// Re-reads the policy file; on any error the policy in force stays, and the error
    /// is logged and kept for `stats`.
    pub(super) fn reload(&self) -> ReloadReply {
        let _turn = lock(&self.reloads);
        let result = read_policy(self.policy_path.as_deref())
            .map_err(|e| e.to_string())
            .and_then(|base| {
                let missing = policy::controls(&base) & !self.controls;
                if missing != 0 {
                    return Err(format!(
                        "{}: the policy uses {}, whose code the connect programs were loaded \
                         without (the daemon loads what its first policy uses); restart the \
                         daemon to load them",
                        base.source,
                        policy::control_names(missing)
                    ));
                }
                if let Some(why) = self.fleet.refuses(&base) {
                    return Err(why);
                }
                let what = policy::describe(&base);
                let listeners = base.listeners.clone();
                self.workloads.follow(&base);
                let p = self.workloads.resolve(&base);
                // The walk is made without the lock that `stats` and the jobs need.
                let root = self.programs.generations().cgroup_root();
                let tree = scopes::walk(&root, &p).map_err(|e| format!("{e:#}"))?;
                self.apply(p, tree).map_err(|e| format!("{e:#}"))?;
                self.workloads.set_base(base);
                Ok((what, listeners))
            });
        let mut status = lock(&self.status);
        match result {
            Ok((what, listeners)) => {
                status.generation += 1;
                status.last_error = None;
                log::info!("policy reloaded: generation {}, {what}", status.generation);
                drop(status);
                self.programs.set_listener_policies(listeners);
                self.listeners_set();
                // Cgroups created while the reload walked, whose events were for the
                // policy it replaced.
                if let Err(e) = self.rescan() {
                    log::warn!("walking the cgroups after the reload: {e:#}");
                }
            }
            Err(e) => {
                log::error!("policy reload rejected, the previous policy stays in force: {e}");
                status.last_error = Some(e);
                drop(status);
            }
        }
        let status = lock(&self.status);
        ReloadReply {
            generation: status.generation,
            error: status.last_error.clone(),
        }
    }

    /// Makes `policy` the one in force, with `tree` a walk of the cgroups for it.
    pub(super) fn apply(&self, policy: Policy, tree: Tree) -> anyhow::Result<()> {
        let policy = self.fleet.shape(policy);
        match clock::tick_ns() {
            Ok(tick_ns) => policy::coarse_controls(&policy, tick_ns)
                .iter()
                .for_each(|w| log::warn!("{w}")),
            Err(e) => log::warn!("{e:#}"),
        }
        let Tree { governed, watched } = tree;
        let (detached, policy, ids) = {
            let mut g = self.programs.generations();
            let (generations, mut ebpf) = g.ebpf();
            let detached = generations.apply(policy, governed, &mut ebpf)?;
            drop(ebpf);
            (detached, g.policy(), g.ids())
        };
        self.cgroup_watch.set(&watched);
        // After the switch, so that no connect decides under the old policy's breakers
        // but one that read the old generation just before it: that one can make a
        // destination's breaker entry again, closed and empty, which cannot open, is not
        // shown, and goes with its destination when it is forgotten.
        if let Some(policy) = policy {
            let ramps = BreakerRamps::new(&policy, &ids);
            let n = lock(&self.counts)
                .counters
                .forget_breakers(|key| ramps.of(key).is_some());
            if n > 0 {
                log::info!("forgot {n} breaker(s) of destinations no breaker governs now");
            }
        }
        // Detaching waits for the kernel; the locks are free meanwhile.
        drop(detached);
        self.policy_applied();
        Ok(())
    }

    /// Brings the policy in force up to date with the cgroups there are now.
    pub(super) fn rescan(&self) -> anyhow::Result<()> {
        let Some(input) = self.programs.generations().rescan_input() else {
            return Ok(());
        };
        let Tree { governed, watched } = scopes::walk(&input.root, &input.policy)?;
        let detached = {
            let mut g = self.programs.generations();
            let (generations, mut ebpf) = g.ebpf();
            generations.rescan(&input, governed, &mut ebpf)?
        };
        // Added to, not replaced: the event path may have watched a cgroup created since
        // the walk started. A removed directory drops its watch itself.
        self.cgroup_watch.add(&watched);
        drop(detached);
        // Removed cgroups the kernel has detached, asked about without the locks.
        let removed = self.programs.generations().take_removed();
        let (kept, done) = removed.reap();
        self.programs.generations().restore_removed(kept);
        drop(done);
        Ok(())
    }

    /// A cgroup was created at `dir`, in a watched one: govern it now, not at the next
    /// rescan.
    pub(super) fn cgroup_created(&self, dir: &Path) -> anyhow::Result<()> {
        let Some(input) = self.programs.generations().rescan_input() else {
            return Ok(());
        };
        let (Ok(rel), Some(parent)) = (dir.strip_prefix(&input.root), dir.parent()) else {
            return Ok(());
        };
        let Some(rel) = rel.to_str() else {
            return Ok(());
        };
        let inherited = self
            .programs
            .generations()
            .scope_index(cgroup::cgroup_id(parent)?);
        // Watched before the walk, so that a child created meanwhile is an event.
        if input
            .policy
            .scopes
            .iter()
            .any(|s| s.selector.may_select_below(rel))
        {
            self.cgroup_watch.add(&BTreeSet::from([dir.to_path_buf()]));
        }
        let tree = scopes::walk_below(dir, rel, inherited, &input.policy);
        self.cgroup_watch.add(&tree.watched);
        let detached = {
            let mut g = self.programs.generations();
            let (generations, mut ebpf) = g.ebpf();
            generations.add(&input, tree.governed, &mut ebpf)?
        };
        drop(detached);
        Ok(())
    }
}
