//! Writes the policy into the kernel maps, atomically, and keeps it current as cgroups
//! come and go.
//!
//! Every policy entry is keyed by a generation (0 or 1). A new policy is written into the
//! idle generation, then `ACTIVE_GEN` flips in one map update. The generation left idle
//! keeps its entries until the next reload clears it, so a program that read the old
//! generation just before the flip still finds them. Counters are keyed by scope and
//! rule ids that stay the same across reloads (by name), so active counts survive a
//! reload.
use std::{collections::BTreeMap, path::PathBuf, sync::Arc};

use anyhow::Context;
use aya::maps::lpm_trie::Key;
use guard_common::{CgroupKey, RuleAddrKey, ScopeConf};

use super::{ids::Ids, scopes};
use crate::{
    kernel::maps::PolicyMaps,
    policy::{
        Policy,
        compile::{rule_entries, rule_ref, scope_conf},
    },
};

/// The policy in force and what the kernel holds of it.
pub struct Generations {
    maps: PolicyMaps,
    cgroup_root: PathBuf,
    gen_: u32,
    ids: Arc<Ids>,
    policy: Option<Arc<Policy>>,
    /// What the active generation holds, to diff against on rescan.
    written_scopes: BTreeMap<u64, ScopeConf>,
    /// Every governed cgroup: id -> (scope index, directory), as of the last walk.
    governed: BTreeMap<u64, (usize, PathBuf)>,
    written_rules: Vec<Key<RuleAddrKey>>,
    /// What the idle generation still holds, deleted before it is written again.
    idle_scopes: Vec<u64>,
    idle_rules: Vec<Key<RuleAddrKey>>,
}

impl Generations {
    pub fn new(maps: PolicyMaps, cgroup_root: PathBuf) -> Self {
        Generations {
            maps,
            cgroup_root,
            gen_: 0,
            ids: Arc::default(),
            policy: None,
            written_scopes: BTreeMap::new(),
            governed: BTreeMap::new(),
            written_rules: Vec::new(),
            idle_scopes: Vec::new(),
            idle_rules: Vec::new(),
        }
    }

    /// Makes `policy` the one in force, atomically for the programs. On error the policy
    /// in force stays, and the idle generation holds nothing of the new one.
    pub fn apply(&mut self, policy: Policy) -> anyhow::Result<()> {
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
        let governed = scopes::governed(&self.cgroup_root, &policy)?;
        let confs = scope_confs(&ids, &policy)?;
        let scopes: BTreeMap<u64, ScopeConf> = governed
            .iter()
            .map(|(id, (index, _))| (*id, confs[*index]))
            .collect();
        let mut rule_keys = Vec::new();
        let result = (|| -> anyhow::Result<()> {
            for (id, conf) in &scopes {
                self.maps.scopes.insert(scope_key(next, *id), conf, 0)?;
            }
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
            // The switch: from here the programs read the new generation.
            self.maps.active_gen.set(0, next, 0)?;
            Ok(())
        })();
        if let Err(e) = result {
            // Leave nothing half-written in the idle generation.
            for id in scopes.keys() {
                let _ = self.maps.scopes.remove(&scope_key(next, *id));
            }
            for key in &rule_keys {
                let _ = self.maps.rules.remove(key);
            }
            return Err(e.context("writing the policy into the kernel maps"));
        }
        self.idle_scopes = std::mem::replace(&mut self.written_scopes, scopes)
            .into_keys()
            .collect();
        self.idle_rules = std::mem::replace(&mut self.written_rules, rule_keys);
        self.gen_ = next;
        self.ids = Arc::new(ids);
        self.policy = Some(Arc::new(policy));
        self.governed = governed;
        Ok(())
    }

    /// Brings the active generation up to date with cgroups created or removed since
    /// the policy was applied.
    pub fn rescan(&mut self) -> anyhow::Result<()> {
        let Some(policy) = self.policy.clone() else {
            return Ok(());
        };
        let confs = scope_confs(&self.ids, &policy)?;
        let governed = scopes::governed(&self.cgroup_root, &policy)?;
        let gen_ = self.gen_;
        for (id, (index, _)) in &governed {
            if self.written_scopes.get(id) != Some(&confs[*index]) {
                self.maps
                    .scopes
                    .insert(scope_key(gen_, *id), confs[*index], 0)?;
                self.written_scopes.insert(*id, confs[*index]);
            }
        }
        let gone: Vec<u64> = self
            .written_scopes
            .keys()
            .filter(|id| !governed.contains_key(id))
            .copied()
            .collect();
        for id in gone {
            let _ = self.maps.scopes.remove(&scope_key(gen_, id));
            self.written_scopes.remove(&id);
        }
        self.governed = governed;
        Ok(())
    }

    /// The policy in force, once one is applied.
    pub fn policy(&self) -> Option<Arc<Policy>> {
        self.policy.clone()
    }

    /// The ids of every scope and rule name seen so far.
    pub fn ids(&self) -> Arc<Ids> {
        self.ids.clone()
    }

    /// The scope id governing a cgroup now, if any.
    pub fn scope_of_cgroup(&self, cgroup_id: u64) -> Option<u32> {
        self.written_scopes.get(&cgroup_id).map(|c| c.scope_id)
    }

    /// The cgroups of scopes with a port watermark, as of the last rescan.
    pub fn port_watched_dirs(&self) -> Vec<PathBuf> {
        let Some(policy) = &self.policy else {
            return Vec::new();
        };
        self.governed
            .values()
            .filter(|(i, _)| policy.scopes[*i].watches_ports())
            .map(|(_, dir)| dir.clone())
            .collect()
    }

    /// Number of cgroups the policy governs now.
    pub fn governed_cgroups(&self) -> usize {
        self.written_scopes.len()
    }
}

fn scope_key(gen_: u32, cgroup_id: u64) -> CgroupKey {
    CgroupKey {
        gen_,
        _pad: 0,
        cgroup_id,
    }
}

/// The scopes as the kernel sees them; `ids.assign(policy)` must have run.
fn scope_confs(ids: &Ids, policy: &Policy) -> anyhow::Result<Vec<ScopeConf>> {
    policy
        .scopes
        .iter()
        .map(|s| {
            let id = ids
                .scope(&s.name)
                .with_context(|| format!("scope {:?} has no id", s.name))?;
            Ok(scope_conf(s, id))
        })
        .collect()
}
