//! Writes the policy into the kernel maps, atomically, and keeps it current as cgroups
//! come and go, with the connection programs attached to the top-most selected cgroups.
//!
//! Every policy entry is keyed by a generation (0 or 1). A new policy is written into the
//! idle generation, then `ACTIVE_GEN` flips in one map update. The generation left idle
//! keeps its entries until the next reload clears it, so a program that read the old
//! generation just before the flip still finds them. Counters are keyed by scope and
//! rule ids that stay the same across reloads (by name), so active counts survive a
//! reload.
//!
//! Programs are attached to a new top-most cgroup before the policy that selects it is
//! in force, and detached from one no longer top-most after: a socket created meanwhile
//! runs them and finds its scope, or none. While a reload or a walk moves a top-most
//! cgroup to its ancestor or a descendant, both are attached for that moment, and a
//! connect() below the lower one runs the connect program twice: the second run
//! releases the first's admission and admits again, so active counts and budgets stay
//! exact, and `admitted` counts that attempt twice.
use std::{collections::BTreeMap, path::PathBuf, sync::Arc};

use anyhow::Context;
use aya::{Ebpf, maps::lpm_trie::Key};
use guard_common::{CgroupKey, MAX_CGROUP_LEVEL, RuleAddrKey, ScopeConf};

use super::{ids::Ids, scopes::Governed, seed::random_key};
use crate::{
    host::cgroup,
    kernel::{
        cgroup_links::{CgroupLinks, Detached, Removed},
        maps::PolicyMaps,
    },
    policy::{
        Policy,
        compile::{rule_entries, rule_ref, scope_conf},
        workloads::{DERIVED_SEPARATOR, same_scopes},
    },
};

/// What a walk for `rescan` is made from.
pub struct RescanInput {
    pub policy: Arc<Policy>,
    pub root: PathBuf,
    /// Creation events handled before the walk started.
    events: u64,
}

/// The policy in force and what the kernel holds of it.
pub struct Generations {
    maps: PolicyMaps,
    cgroup_root: PathBuf,
    gen_: u32,
    ids: Arc<Ids>,
    policy: Option<Arc<Policy>>,
    /// The policy's `ScopeConf::serial`, new at each apply.
    serial: u32,
    /// What the active generation holds (the selected cgroups, and the levels they are
    /// at), to diff against on rescan.
    written_scopes: BTreeMap<u64, ScopeConf>,
    written_levels: u32,
    /// Every governed cgroup, as of the last walk.
    governed: BTreeMap<u64, Governed>,
    /// Where the connection programs are attached, and where they should be.
    links: CgroupLinks,
    tops: BTreeMap<u64, PathBuf>,
    /// Cgroups added on creation events, numbered: a walk started before an event does
    /// not hold what it added, so a rescan keeps them.
    created: Vec<(u64, u64, Governed)>,
    events: u64,
    /// The events count at the start of the last walk applied.
    walked: u64,
    written_rules: Vec<Key<RuleAddrKey>>,
    /// What the idle generation still holds, deleted before it is written again.
    idle_scopes: Vec<u64>,
    idle_rules: Vec<Key<RuleAddrKey>>,
}

impl Generations {
    /// Tells the programs the cgroup id of `cgroup_root` (the daemon's cgroup2 mount),
    /// from which the levels of selected cgroups count.
    /// The links are pinned in `links_dir`, where those of a daemon before this one are
    /// adopted; so are the ids it gave names.
    pub fn new(
        mut maps: PolicyMaps,
        cgroup_root: PathBuf,
        links_dir: PathBuf,
    ) -> anyhow::Result<Self> {
        let root_id = cgroup::cgroup_id(&cgroup_root)?;
        maps.cgroup_root
            .set(0, root_id, 0)
            .context("writing CGROUP_ROOT")?;
        let ids = Arc::new(Ids::restore(&maps.ids)?);
        Ok(Generations {
            maps,
            cgroup_root,
            gen_: 0,
            ids,
            policy: None,
            serial: 0,
            written_scopes: BTreeMap::new(),
            written_levels: 0,
            governed: BTreeMap::new(),
            links: CgroupLinks::new(links_dir),
            tops: BTreeMap::new(),
            created: Vec::new(),
            events: 0,
            walked: 0,
            written_rules: Vec::new(),
            idle_scopes: Vec::new(),
            idle_rules: Vec::new(),
        })
    }

    /// How many cgroups' links were adopted from a daemon before, to be moved to this
    /// daemon's programs by the first `apply`.
    pub fn adopted_links(&self) -> usize {
        self.links.adopted()
    }

    /// The cgroup2 mount the policy's paths are below.
    pub fn cgroup_root(&self) -> PathBuf {
        self.cgroup_root.clone()
    }

    /// Makes `policy` the one in force, atomically for the programs, with `governed` a
    /// walk of the cgroup tree for it (`scopes::walk`, made without the daemon's
    /// lock on this). On error the policy in force stays, and the idle generation holds
    /// nothing of the new one.
    pub fn apply(
        &mut self,
        policy: Policy,
        governed: BTreeMap<u64, Governed>,
        ebpf: &mut Ebpf,
    ) -> anyhow::Result<Detached> {
        let next = self.gen_ ^ 1;
        for id in std::mem::take(&mut self.idle_scopes) {
            let _ = self.maps.scopes.remove(&scope_key(next, id));
        }
        for key in std::mem::take(&mut self.idle_rules) {
            let _ = self.maps.rules.remove(&key);
        }
        // Ids are assigned on a copy: a refused policy takes none.
        let mut ids = Ids::clone(&self.ids);
        ids.assign(&policy)?;
        // Odd, so never 0 (a destination's counter made since reads as never clear);
        // random at the first apply, so that a restart's differs from the last daemon's.
        let serial = match self.serial {
            0 => random_key()? as u32 | 1,
            last => last.wrapping_add(2),
        };
        let confs = scope_confs(&ids, &policy, serial)?;
        let (scopes, levels) = selected(&governed, &confs);
        let tops = tops(&governed);
        for g in governed.values() {
            if g.selected && g.level > MAX_CGROUP_LEVEL {
                log::warn!(
                    "{} is {} levels below the cgroup2 mount; scopes are resolved {MAX_CGROUP_LEVEL} levels deep, so its sockets belong to its nearest selected ancestor above that, if any",
                    g.dir.display(),
                    g.level
                );
            }
        }
        let mut rule_keys = Vec::new();
        let mut persisted = Vec::new();
        let result = (|| -> anyhow::Result<()> {
            // Kept where the next daemon finds them before any count is keyed by them.
            persisted = ids.persist(&self.ids, &mut self.maps.ids)?;
            for (id, conf) in &scopes {
                self.maps.scopes.insert(scope_key(next, *id), conf, 0)?;
            }
            self.maps.scope_levels.set(next, levels, 0)?;
            for (scope, conf) in policy.scopes.iter().zip(&confs) {
                let refs = scope
                    .rules
                    .iter()
                    .map(|r| {
                        let id = ids.rule(&scope.name, &r.name).with_context(|| {
                            format!("rule {:?} of scope {:?} has no id", r.name, scope.name)
                        })?;
                        Ok(rule_ref(r, id))
                    })
                    .collect::<anyhow::Result<Vec<_>>>()?;
                for e in rule_entries(next, conf.scope_id, &scope.rules, &refs) {
                    let key = Key::new(e.prefix_len, e.key);
                    self.maps.rules.insert(&key, e.candidates, 0)?;
                    rule_keys.push(key);
                }
            }
            self.links.attach(ebpf, &tops, true);
            // The switch: from here the programs read the new generation.
            self.maps.active_gen.set(0, next, 0)?;
            self.links.finish_adoption(ebpf, &tops);
            Ok(())
        })();
        if let Err(e) = result {
            // Detached here, under the caller's locks: an error is rare, and links left
            // for a later detach could meet the same cgroup's next attach.
            drop(self.links.detach_others(&self.tops));
            // Leave nothing half-written in the idle generation.
            for id in scopes.keys() {
                let _ = self.maps.scopes.remove(&scope_key(next, *id));
            }
            for key in &rule_keys {
                let _ = self.maps.rules.remove(key);
            }
            for key in &persisted {
                let _ = self.maps.ids.remove(key);
            }
            return Err(e.context("writing the policy into the kernel maps"));
        }
        self.idle_scopes = std::mem::replace(&mut self.written_scopes, scopes)
            .into_keys()
            .collect();
        self.idle_rules = std::mem::replace(&mut self.written_rules, rule_keys);
        let detached = self.links.detach_others(&tops);
        self.tops = tops;
        self.written_levels = levels;
        self.gen_ = next;
        self.retire_gone(&mut ids, &policy);
        self.ids = Arc::new(ids);
        self.policy = Some(Arc::new(policy));
        self.serial = serial;
        self.governed = governed;
        Ok(detached)
    }

    /// Retires the ids of the annotated pods' scopes (their names have the separator,
    /// which no policy file's do) that `policy`, now in force, no longer has.
    fn retire_gone(&mut self, ids: &mut Ids, policy: &Policy) {
        let gone: Vec<String> = ids
            .scope_names()
            .filter(|n| {
                n.contains(DERIVED_SEPARATOR) && !policy.scopes.iter().any(|s| s.name == *n)
            })
            .map(str::to_string)
            .collect();
        for key in ids.retire(gone.iter().map(String::as_str)) {
            // Left in IDS, a name's id is retired again by the next daemon's first apply.
            if let Err(e) = self.maps.ids.remove(&key) {
                log::debug!("removing a retired name from IDS: {e}");
            }
        }
    }

    /// Makes `policy` the one in force in place of the one in force, which has the same
    /// scopes (`workloads::same_scopes`) but for the cgroups they select: no new
    /// generation. The cgroups governed stay as they are until `add` or `rescan`.
    pub fn reselect(&mut self, policy: Policy) -> anyhow::Result<()> {
        let current = self.policy.as_ref().context("no policy in force")?;
        if !same_scopes(current, &policy) {
            anyhow::bail!("the policy's scopes changed: a new generation is needed");
        }
        self.policy = Some(Arc::new(policy));
        Ok(())
    }

    /// The ids, to change in place (retired ones reused).
    pub fn ids_mut(&mut self) -> &mut Ids {
        Arc::make_mut(&mut self.ids)
    }

    /// What a rescan walks: the policy in force and the cgroup2 root. The walk (a stat
    /// and a directory read per cgroup: seconds for 50,000 cgroups on a slow machine)
    /// runs without the daemon's lock on this; `rescan` then applies it.
    pub fn rescan_input(&self) -> Option<RescanInput> {
        Some(RescanInput {
            policy: self.policy.clone()?,
            root: self.cgroup_root.clone(),
            events: self.events,
        })
    }

    /// Brings the active generation up to date with cgroups created or removed since
    /// the policy was applied, from a walk of the whole tree (`scopes::walk`) made for
    /// `input`; a walk made for a policy since replaced is dropped (the next one is made
    /// for the new policy). What creation events added since the walk started is kept.
    pub fn rescan(
        &mut self,
        input: &RescanInput,
        mut governed: BTreeMap<u64, Governed>,
        ebpf: &mut Ebpf,
    ) -> anyhow::Result<Option<Detached>> {
        // A walk started before one already applied (a reload's, beside the periodic
        // one) knows less than it.
        if !self.in_force(&input.policy) || input.events < self.walked {
            return Ok(None);
        }
        self.walked = input.events;
        self.created.retain(|(n, _, _)| *n > input.events);
        for (_, id, g) in &self.created {
            if g.dir.exists() {
                governed.entry(*id).or_insert_with(|| g.clone());
            }
        }
        self.update(governed, ebpf, true).map(Some)
    }

    /// The attachments of removed cgroups, to be reaped without the lock on this.
    pub fn take_removed(&mut self) -> Removed {
        self.links.take_removed()
    }

    pub fn restore_removed(&mut self, kept: Removed) {
        self.links.restore_removed(kept);
    }

    /// Adds cgroups just created (a walk of their subtree, `scopes::walk_below`) to the
    /// active generation.
    pub fn add(
        &mut self,
        input: &RescanInput,
        created: BTreeMap<u64, Governed>,
        ebpf: &mut Ebpf,
    ) -> anyhow::Result<Option<Detached>> {
        if created.is_empty() || !self.in_force(&input.policy) {
            return Ok(None);
        }
        self.events += 1;
        let n = self.events;
        self.created
            .extend(created.iter().map(|(id, g)| (n, *id, g.clone())));
        let mut governed = std::mem::take(&mut self.governed);
        governed.extend(created);
        self.update(governed, ebpf, false).map(Some)
    }

    fn in_force(&self, policy: &Arc<Policy>) -> bool {
        self.policy.as_ref().is_some_and(|p| Arc::ptr_eq(p, policy))
    }

    /// Writes `governed` (every governed cgroup) into the active generation and
    /// attaches where it says (`retry`: failed attaches too); `governed` is the picture
    /// kept, even on an error.
    fn update(
        &mut self,
        governed: BTreeMap<u64, Governed>,
        ebpf: &mut Ebpf,
        retry: bool,
    ) -> anyhow::Result<Detached> {
        let result = self.write(&governed, ebpf, retry);
        self.governed = governed;
        result
    }

    /// An entry that cannot be written (a full map) fails the call, after the rest is
    /// done: what went is removed, and the attachments follow.
    fn write(
        &mut self,
        governed: &BTreeMap<u64, Governed>,
        ebpf: &mut Ebpf,
        retry: bool,
    ) -> anyhow::Result<Detached> {
        let policy = self.policy.clone().context("no policy in force")?;
        let confs = scope_confs(&self.ids, &policy, self.serial)?;
        let (scopes, levels) = selected(governed, &confs);
        let gen_ = self.gen_;
        // New entries first, then the levels to look at, then what went: a socket
        // created meanwhile finds its scope or, for a cgroup being removed, none.
        let mut failed = None;
        for (id, conf) in &scopes {
            if self.written_scopes.get(id) != Some(conf) {
                match self.maps.scopes.insert(scope_key(gen_, *id), conf, 0) {
                    Ok(()) => {
                        self.written_scopes.insert(*id, *conf);
                    }
                    Err(e) => {
                        failed.get_or_insert(anyhow::Error::from(e).context("writing SCOPES"));
                    }
                }
            }
        }
        if levels != self.written_levels {
            self.maps.scope_levels.set(gen_, levels, 0)?;
            self.written_levels = levels;
        }
        let tops = tops(governed);
        self.links.attach(ebpf, &tops, retry);
        let gone: Vec<u64> = self
            .written_scopes
            .keys()
            .filter(|id| !scopes.contains_key(id))
            .copied()
            .collect();
        for id in gone {
            let _ = self.maps.scopes.remove(&scope_key(gen_, id));
            self.written_scopes.remove(&id);
        }
        let detached = self.links.detach_others(&tops);
        self.tops = tops;
        match failed {
            Some(e) => {
                // As in `apply`'s error path.
                drop(detached);
                Err(e)
            }
            None => Ok(detached),
        }
    }

    /// The scope governing a cgroup, by its index in the policy, as of the last walk.
    pub fn scope_index(&self, cgroup_id: u64) -> Option<usize> {
        self.governed.get(&cgroup_id).map(|g| g.scope)
    }

    /// The cgroups the connection programs are attached to.
    pub fn attached_dirs(&self) -> Vec<PathBuf> {
        self.links.dirs()
    }

    /// The policy in force, once one is applied.
    pub fn policy(&self) -> Option<Arc<Policy>> {
        self.policy.clone()
    }

    /// The ids of every scope and rule name seen so far.
    pub fn ids(&self) -> Arc<Ids> {
        self.ids.clone()
    }

    /// The scope id governing a cgroup, as of the last walk, if any.
    pub fn scope_of_cgroup(&self, cgroup_id: u64) -> Option<u32> {
        let policy = self.policy.as_ref()?;
        let g = self.governed.get(&cgroup_id)?;
        self.ids.scope(&policy.scopes[g.scope].name)
    }

    /// The cgroups of scopes with a port watermark, as of the last rescan.
    pub fn port_watched_dirs(&self) -> Vec<PathBuf> {
        let Some(policy) = &self.policy else {
            return Vec::new();
        };
        self.governed
            .values()
            .filter(|g| policy.scopes[g.scope].watches_ports())
            .map(|g| g.dir.clone())
            .collect()
    }

    /// Number of cgroups the policy governs, as of the last walk.
    pub fn governed_cgroups(&self) -> usize {
        self.governed.len()
    }

    /// Every governed cgroup, as of the last walk, and the top-most ones.
    pub fn governed(&self) -> (&BTreeMap<u64, Governed>, &BTreeMap<u64, PathBuf>) {
        (&self.governed, &self.tops)
    }
}

fn scope_key(gen_: u32, cgroup_id: u64) -> CgroupKey {
    CgroupKey {
        gen_,
        _pad: 0,
        cgroup_id,
    }
}

/// The SCOPES entries for `governed`: its selected cgroups at levels the programs look
/// at; and those levels, a bit each.
fn selected(
    governed: &BTreeMap<u64, Governed>,
    confs: &[ScopeConf],
) -> (BTreeMap<u64, ScopeConf>, u32) {
    let mut levels = 0u32;
    let mut out = BTreeMap::new();
    for (id, g) in governed {
        if g.selected && g.level <= MAX_CGROUP_LEVEL {
            levels |= 1 << g.level;
            out.insert(*id, confs[g.scope]);
        }
    }
    (out, levels)
}

/// The cgroups to attach the programs to: the top-most selected ones at levels the
/// programs look at.
fn tops(governed: &BTreeMap<u64, Governed>) -> BTreeMap<u64, PathBuf> {
    governed
        .iter()
        .filter(|(_, g)| g.top && g.level <= MAX_CGROUP_LEVEL)
        .map(|(id, g)| (*id, g.dir.clone()))
        .collect()
}

/// The scopes as the kernel sees them, with the apply's `serial`; `ids.assign(policy)`
/// must have run.
fn scope_confs(ids: &Ids, policy: &Policy, serial: u32) -> anyhow::Result<Vec<ScopeConf>> {
    policy
        .scopes
        .iter()
        .map(|s| {
            let id = ids
                .scope(&s.name)
                .with_context(|| format!("scope {:?} has no id", s.name))?;
            Ok(scope_conf(s, id, serial))
        })
        .collect()
}
