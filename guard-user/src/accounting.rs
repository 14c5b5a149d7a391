//! Writes the policy into the kernel maps and reads the counters back.
//!
//! Atomic reload: every policy entry is keyed by a generation (0 or 1). A new policy is
//! written into the idle generation, then `ACTIVE_GEN` flips in one map update. The
//! generation left idle keeps its entries until the next reload clears it, so a program
//! that read the old generation just before the flip still finds them. Counters are
//! keyed by scope and rule ids that stay the same across reloads (by name), so active
//! counts survive a reload.
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::{IpAddr, Ipv6Addr},
    path::{Path, PathBuf},
};

use anyhow::{Context, bail};
use aya::maps::{Array, HashMap as BpfHashMap, LpmTrie, MapData, PerCpuArray, lpm_trie::Key};
use guard_common::{
    Candidates, CgroupKey, Counter, CounterKey, EaddrKey, MAX_RULE_IDS, MAX_SCOPE_IDS, PortUseKey,
    RULE_KEY_FIXED_BITS, RuleAddrKey, RuleRef, STAT_INTERNAL_ERRORS, ScopeConf, TimeWaitKey,
};
use ipnet::{IpNet, Ipv6Net};

use crate::{
    cgroup,
    policy::{Policy, Rule},
};

/// Stable numeric ids for scope and rule names, for the daemon's life: a scope or rule
/// removed by a reload and added again by a later one gets its id, and so its counts,
/// back. Ids index the kernel's SCOPE_COUNTERS and RULE_COUNTERS arrays, so there are
/// at most MAX_SCOPE_IDS scope ids and MAX_RULE_IDS rule ids (unique across scopes);
/// a policy that needs more is refused.
#[derive(Default)]
pub struct Ids {
    scopes: HashMap<String, u32>,
    rules: HashMap<(String, String), u32>,
}

impl Ids {
    /// Gives every scope and rule of `policy` an id, or, when that would take more
    /// ids than the arrays hold, none (and says so).
    pub fn assign(&mut self, policy: &Policy) -> anyhow::Result<()> {
        let new_scopes: HashSet<&str> = policy
            .scopes
            .iter()
            .map(|s| s.name.as_str())
            .filter(|name| !self.scopes.contains_key(*name))
            .collect();
        let new_rules: HashSet<(&str, &str)> = policy
            .scopes
            .iter()
            .flat_map(|s| s.rules.iter().map(|r| (s.name.as_str(), r.name.as_str())))
            .filter(|(s, r)| !self.rules.contains_key(&(s.to_string(), r.to_string())))
            .collect();
        if self.scopes.len() + new_scopes.len() > MAX_SCOPE_IDS as usize {
            bail!(
                "too many scope names: {} used since the daemon started and {} new, at most \
                 {MAX_SCOPE_IDS} (counts are kept by name for the daemon's life; restart it to \
                 start over)",
                self.scopes.len(),
                new_scopes.len()
            );
        }
        if self.rules.len() + new_rules.len() > MAX_RULE_IDS as usize {
            bail!(
                "too many rule names: {} (scope, rule) pairs used since the daemon started and \
                 {} new, at most {MAX_RULE_IDS} (counts are kept by name for the daemon's life; \
                 restart it to start over)",
                self.rules.len(),
                new_rules.len()
            );
        }
        // In policy order, so ids follow the file on a first start.
        for s in &policy.scopes {
            let next = self.scopes.len() as u32;
            self.scopes.entry(s.name.clone()).or_insert(next);
            for r in &s.rules {
                let next = self.rules.len() as u32;
                self.rules
                    .entry((s.name.clone(), r.name.clone()))
                    .or_insert(next);
            }
        }
        Ok(())
    }

    /// The id of a scope name, once assigned.
    pub fn scope(&self, name: &str) -> Option<u32> {
        self.scopes.get(name).copied()
    }

    /// The id of a rule of a scope, once assigned.
    pub fn rule(&self, scope: &str, rule: &str) -> Option<u32> {
        self.rules
            .get(&(scope.to_string(), rule.to_string()))
            .copied()
    }

    /// How many scope ids and rule ids are assigned (ids are below these).
    pub fn counts(&self) -> (u32, u32) {
        (self.scopes.len() as u32, self.rules.len() as u32)
    }

    pub fn scope_name(&self, id: u32) -> Option<&str> {
        self.scopes
            .iter()
            .find(|(_, v)| **v == id)
            .map(|(name, _)| name.as_str())
    }

    /// Rule id -> rule name, for every rule named so far.
    pub fn rule_names(&self) -> HashMap<u32, &str> {
        self.rules
            .iter()
            .map(|((_, r), id)| (*id, r.as_str()))
            .collect()
    }
}

pub struct Accounting {
    scopes: BpfHashMap<MapData, CgroupKey, ScopeConf>,
    rules: LpmTrie<MapData, RuleAddrKey, Candidates>,
    active_gen: Array<MapData, u32>,
    counters: BpfHashMap<MapData, CounterKey, Counter>,
    scope_counters: Array<MapData, Counter>,
    rule_counters: Array<MapData, Counter>,
    stats: PerCpuArray<MapData, u64>,
    time_waits: BpfHashMap<MapData, TimeWaitKey, u64>,
    eaddrnotavail: BpfHashMap<MapData, EaddrKey, u64>,
    port_use: BpfHashMap<MapData, PortUseKey, u32>,
    written_port_use: HashMap<PortUseKey, u32>,
    pub cgroup_root: PathBuf,
    gen_: u32,
    pub ids: Ids,
    pub policy: Option<Policy>,
    /// What the active generation holds, to diff against on rescan.
    written_scopes: BTreeMap<u64, ScopeConf>,
    /// Every governed cgroup: id -> (scope index, directory), as of the last walk.
    governed: BTreeMap<u64, (usize, PathBuf)>,
    written_rules: Vec<Key<RuleAddrKey>>,
    /// What the idle generation still holds, deleted before it is written again.
    idle_scopes: Vec<u64>,
    idle_rules: Vec<Key<RuleAddrKey>>,
    /// Destination entries that had no active connection at the last `forget_idle`,
    /// with their totals (admitted + shed + would_shed) then.
    idle_seen: HashMap<CounterKey, u64>,
    /// TIME_WAITS entries as seen at the last `forget_idle`.
    tw_seen: HashMap<TimeWaitKey, u64>,
    /// Counts of forgotten TIME_WAITS entries per scope, so that totals never go down.
    tw_forgotten: HashMap<u32, u64>,
}

impl Accounting {
    pub fn new(ebpf: &mut aya::Ebpf, cgroup_root: PathBuf) -> anyhow::Result<Self> {
        let mut take = |name: &str| {
            ebpf.take_map(name)
                .with_context(|| format!("map {name} missing from the eBPF object"))
        };
        Ok(Accounting {
            scopes: BpfHashMap::try_from(take("SCOPES")?)?,
            rules: LpmTrie::try_from(take("RULES")?)?,
            active_gen: Array::try_from(take("ACTIVE_GEN")?)?,
            counters: BpfHashMap::try_from(take("COUNTERS")?)?,
            scope_counters: Array::try_from(take("SCOPE_COUNTERS")?)?,
            rule_counters: Array::try_from(take("RULE_COUNTERS")?)?,
            stats: PerCpuArray::try_from(take("STATS")?)?,
            time_waits: BpfHashMap::try_from(take("TIME_WAITS")?)?,
            eaddrnotavail: BpfHashMap::try_from(take("EADDRNOTAVAIL")?)?,
            port_use: BpfHashMap::try_from(take("PORT_USE")?)?,
            written_port_use: Default::default(),
            cgroup_root,
            gen_: 0,
            ids: Ids::default(),
            policy: None,
            written_scopes: BTreeMap::new(),
            governed: BTreeMap::new(),
            written_rules: Vec::new(),
            idle_scopes: Vec::new(),
            idle_rules: Vec::new(),
            idle_seen: HashMap::new(),
            tw_seen: HashMap::new(),
            tw_forgotten: HashMap::new(),
        })
    }

    /// Makes `policy` the one in force, atomically for the programs.
    pub fn apply(&mut self, policy: Policy) -> anyhow::Result<()> {
        let next = self.gen_ ^ 1;
        for id in std::mem::take(&mut self.idle_scopes) {
            let _ = self.scopes.remove(&CgroupKey {
                gen_: next,
                _pad: 0,
                cgroup_id: id,
            });
        }
        for key in std::mem::take(&mut self.idle_rules) {
            let _ = self.rules.remove(&key);
        }
        self.ids.assign(&policy)?;
        let governed = cgroup::governed(&self.cgroup_root, &policy)?;
        let confs = self.scope_confs(&policy)?;
        let mut scopes = BTreeMap::new();
        for (cgroup_id, (index, _)) in &governed {
            scopes.insert(*cgroup_id, confs[*index]);
        }
        let mut rule_keys = Vec::new();
        let result = (|| -> anyhow::Result<()> {
            for (id, conf) in &scopes {
                self.scopes.insert(
                    CgroupKey {
                        gen_: next,
                        _pad: 0,
                        cgroup_id: *id,
                    },
                    conf,
                    0,
                )?;
            }
            for (scope, conf) in policy.scopes.iter().zip(&confs) {
                for (key, cands) in
                    self.rule_entries(next, conf.scope_id, &scope.name, &scope.rules)?
                {
                    self.rules.insert(&key, cands, 0)?;
                    rule_keys.push(key);
                }
            }
            Ok(())
        })();
        if let Err(e) = result {
            // Leave nothing half-written in the idle generation.
            for id in scopes.keys() {
                let _ = self.scopes.remove(&CgroupKey {
                    gen_: next,
                    _pad: 0,
                    cgroup_id: *id,
                });
            }
            for key in &rule_keys {
                let _ = self.rules.remove(key);
            }
            return Err(e.context("writing the policy into the kernel maps"));
        }
        self.active_gen.set(0, next, 0)?;
        self.idle_scopes = std::mem::replace(&mut self.written_scopes, scopes)
            .into_keys()
            .collect();
        self.idle_rules = std::mem::replace(&mut self.written_rules, rule_keys);
        self.gen_ = next;
        self.policy = Some(policy);
        self.governed = governed;
        Ok(())
    }

    /// Brings the active generation up to date with cgroups created or removed since
    /// the policy was applied.
    pub fn rescan(&mut self) -> anyhow::Result<()> {
        let Some(policy) = self.policy.clone() else {
            return Ok(());
        };
        let confs = self.scope_confs(&policy)?;
        let governed = cgroup::governed(&self.cgroup_root, &policy)?;
        let gen_ = self.gen_;
        for (id, (index, _)) in &governed {
            if self.written_scopes.get(id) != Some(&confs[*index]) {
                self.scopes.insert(
                    CgroupKey {
                        gen_,
                        _pad: 0,
                        cgroup_id: *id,
                    },
                    confs[*index],
                    0,
                )?;
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
            let _ = self.scopes.remove(&CgroupKey {
                gen_,
                _pad: 0,
                cgroup_id: id,
            });
            self.written_scopes.remove(&id);
        }
        self.governed = governed;
        Ok(())
    }

    /// The scope id governing a cgroup now, if any.
    pub fn scope_of_cgroup(&self, cgroup_id: u64) -> Option<u32> {
        self.written_scopes.get(&cgroup_id).map(|c| c.scope_id)
    }

    /// The cgroups of scopes with a port watermark, as of the last rescan.
    pub fn port_watched_dirs(&self) -> Vec<&Path> {
        let Some(policy) = &self.policy else {
            return Vec::new();
        };
        self.governed
            .values()
            .filter(|(i, _)| policy.scopes[*i].watches_ports())
            .map(|(_, dir)| dir.as_path())
            .collect()
    }

    /// Number of cgroups the policy governs now.
    pub fn governed_cgroups(&self) -> usize {
        self.written_scopes.len()
    }

    /// The scopes as the kernel sees them; `ids.assign(policy)` must have run.
    fn scope_confs(&self, policy: &Policy) -> anyhow::Result<Vec<ScopeConf>> {
        policy
            .scopes
            .iter()
            .map(|s| {
                Ok(ScopeConf {
                    scope_id: self
                        .ids
                        .scope(&s.name)
                        .with_context(|| format!("scope {:?} has no id", s.name))?,
                    mode: s.mode,
                    errno: s.errno as u32,
                    has_rules: !s.rules.is_empty() as u32,
                    max_connections: s.max_connections.unwrap_or(0),
                    port_watermark: s.port_watermark.unwrap_or(0),
                    _pad: 0,
                })
            })
            .collect()
    }

    fn rule_entries(
        &self,
        gen_: u32,
        scope_id: u32,
        scope_name: &str,
        rules: &[Rule],
    ) -> anyhow::Result<Vec<(Key<RuleAddrKey>, Candidates)>> {
        let refs = rules
            .iter()
            .map(|r| {
                let mut rr = RuleRef {
                    rule_id: self.ids.rule(scope_name, &r.name).with_context(|| {
                        format!("rule {:?} of scope {scope_name:?} has no id", r.name)
                    })?,
                    per_endpoint: r.per_endpoint as u32,
                    max_connections: r.max_connections.unwrap_or(0),
                    n_ports: r.ports.len() as u32,
                    port_watermark: r.port_watermark.unwrap_or(0),
                    ..Default::default()
                };
                rr.ports[..r.ports.len()].copy_from_slice(&r.ports);
                Ok(rr)
            })
            .collect::<anyhow::Result<Vec<RuleRef>>>()?;
        Ok(rule_prefixes(rules)
            .into_iter()
            .map(|prefix| {
                let mut cands = Candidates::default();
                let matching = candidates_of(rules, &prefix);
                cands.n = matching.len() as u32;
                for (slot, i) in cands.rules.iter_mut().zip(matching) {
                    *slot = refs[i];
                }
                let key = Key::new(
                    RULE_KEY_FIXED_BITS + prefix.prefix_len() as u32,
                    RuleAddrKey {
                        gen_,
                        scope_id,
                        addr: prefix.addr().octets(),
                    },
                );
                (key, cands)
            })
            .collect())
    }

    /// Every destination counter in the kernel.
    pub fn counters(&self) -> Vec<(CounterKey, Counter)> {
        crate::batch::entries(&self.counters)
    }

    /// Scope counters by scope id, for every id assigned so far.
    pub fn scope_counters(&self) -> Vec<Counter> {
        crate::batch::array_prefix(&self.scope_counters, self.ids.counts().0)
    }

    /// Rule counters by rule id, for every id assigned so far.
    pub fn rule_counters(&self) -> Vec<Counter> {
        crate::batch::array_prefix(&self.rule_counters, self.ids.counts().1)
    }

    /// Forgets destination entries that stayed idle (no active connection, no new
    /// admission or shed) since the previous call, so that the map of a long-running
    /// daemon holds the destinations in use, not every one ever seen. Scope and rule
    /// totals (in their own arrays) keep counting. Returns how many were forgotten.
    pub fn forget_idle(&mut self) -> usize {
        let mut idle = HashMap::new();
        let mut forgotten = 0;
        for (key, c) in self.counters() {
            if c.active != 0 {
                continue;
            }
            let total = c.admitted + c.shed + c.would_shed;
            if self.idle_seen.get(&key) == Some(&total) {
                // A connect racing this removal charges an entry that is going away;
                // its release then skips the entry created again (epoch differs).
                if self.counters.remove(&key).is_ok() {
                    forgotten += 1;
                }
            } else {
                idle.insert(key, total);
            }
        }
        self.idle_seen = idle;
        // TIME_WAIT birth counts that did not move: their rate is 0 and their scope
        // no longer creates entries there.
        let now = self.time_waits();
        for (key, n) in &now {
            if self.tw_seen.get(key) == Some(n) && self.time_waits.remove(key).is_ok() {
                *self.tw_forgotten.entry(key.scope_id).or_default() += n;
                forgotten += 1;
            }
        }
        self.tw_seen = now;
        forgotten
    }

    /// TIME_WAIT entries born on admitted connections, by key (totals).
    pub fn time_waits(&self) -> HashMap<TimeWaitKey, u64> {
        crate::batch::entries(&self.time_waits)
            .into_iter()
            .collect()
    }

    /// TIME_WAIT entries born on each scope's connections since the daemon started, by
    /// scope id.
    pub fn time_wait_created(&self) -> HashMap<u32, u64> {
        let mut out = self.tw_forgotten.clone();
        for (k, n) in self.time_waits() {
            *out.entry(k.scope_id).or_default() += n;
        }
        out
    }

    /// connect() failures with EADDRNOTAVAIL by scope and process name (totals).
    pub fn eaddrnotavail(&self) -> Vec<(EaddrKey, u64)> {
        crate::batch::entries(&self.eaddrnotavail)
    }

    /// Makes PORT_USE hold exactly these destinations (what the watermarks need).
    /// Stale entries go first, so a failed insert can only leave one out (fail-open).
    pub fn set_port_use(&mut self, entries: HashMap<PortUseKey, u32>) -> anyhow::Result<()> {
        for stale in self
            .written_port_use
            .keys()
            .filter(|k| !entries.contains_key(k))
        {
            let _ = self.port_use.remove(stale);
        }
        self.written_port_use.clear();
        let mut failed = None;
        for (key, permille) in entries {
            match self.port_use.insert(key, permille, 0) {
                Ok(()) => {
                    self.written_port_use.insert(key, permille);
                }
                Err(e) => failed = Some(e),
            }
        }
        match failed {
            Some(e) => Err(anyhow::Error::new(e)
                .context("writing PORT_USE (the destinations left out are not watched)")),
            None => Ok(()),
        }
    }

    /// What PORT_USE holds now, for stats.
    pub fn watched_ports(&self) -> Vec<crate::stats::WatchedPort> {
        let mut out: Vec<_> = self
            .written_port_use
            .iter()
            .map(|(k, permille)| crate::stats::WatchedPort {
                netns: k.netns,
                dst: crate::ports::endpoint(unmapped(k.addr), k.port),
                ratio: *permille as f64 / 1000.0,
            })
            .collect();
        out.sort_by(|a, b| b.ratio.total_cmp(&a.ratio).then(a.dst.cmp(&b.dst)));
        out
    }

    /// Internal errors summed over CPUs (fail-open events).
    pub fn internal_errors(&self) -> u64 {
        self.stats
            .get(&STAT_INTERNAL_ERRORS, 0)
            .map(|v| v.iter().sum())
            .unwrap_or(0)
    }
}

/// A network as the kernel keys it: IPv6, with IPv4 IPv4-mapped.
pub fn mapped(net: &IpNet) -> Ipv6Net {
    match net {
        IpNet::V4(n) => {
            Ipv6Net::new(n.addr().to_ipv6_mapped(), 96 + n.prefix_len()).expect("valid prefix")
        }
        IpNet::V6(n) => *n,
    }
}

fn rule_nets(rule: &Rule) -> Vec<Ipv6Net> {
    if rule.dst.is_empty() {
        vec![Ipv6Net::new(Ipv6Addr::UNSPECIFIED, 0).expect("valid prefix")]
    } else {
        rule.dst.iter().map(mapped).collect()
    }
}

/// The distinct destination prefixes of a scope's rules, as the kernel keys them.
pub fn rule_prefixes(rules: &[Rule]) -> Vec<Ipv6Net> {
    let mut out: Vec<Ipv6Net> = rules.iter().flat_map(rule_nets).collect();
    out.sort();
    out.dedup();
    out
}

/// Indices of the rules that match every address in `prefix`, in policy order. For the
/// longest rule prefix containing an address, these are exactly the rules whose `dst`
/// contains the address.
pub fn candidates_of(rules: &[Rule], prefix: &Ipv6Net) -> Vec<usize> {
    (0..rules.len())
        .filter(|&i| rule_nets(&rules[i]).iter().any(|n| n.contains(prefix)))
        .collect()
}

/// A network in the kernel's form, back as a user writes it (IPv4 when it lies within
/// the IPv4-mapped range).
pub fn unmapped_net(net: &Ipv6Net) -> IpNet {
    match net.addr().to_ipv4_mapped() {
        Some(v4) if net.prefix_len() >= 96 => {
            IpNet::V4(ipnet::Ipv4Net::new(v4, net.prefix_len() - 96).expect("valid prefix"))
        }
        _ => IpNet::V6(*net),
    }
}

/// An address in the kernel's form: IPv6, with IPv4 IPv4-mapped.
pub fn mapped_addr(addr: IpAddr) -> [u8; 16] {
    match addr {
        IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
        IpAddr::V6(a) => a.octets(),
    }
}

/// An address in the kernel's form, back as the address a user wrote.
pub fn unmapped(addr: [u8; 16]) -> IpAddr {
    let v6 = Ipv6Addr::from(addr);
    match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::parse;

    fn rules(text: &str) -> Vec<Rule> {
        let head = "[[scope]]\nname = \"s\"\ncgroup = \"x\"\n";
        parse(&format!("{head}{text}"), "t")
            .unwrap()
            .scopes
            .remove(0)
            .rules
    }

    #[test]
    fn each_prefix_carries_exactly_the_rules_that_contain_it_in_order() {
        let r = rules(
            "[[scope.rule]]\nname = \"wide\"\ndst = [\"10.0.0.0/8\"]\n\
             [[scope.rule]]\nname = \"host\"\ndst = [\"10.1.2.3\"]\n\
             [[scope.rule]]\nname = \"any\"\n\
             [[scope.rule]]\nname = \"v6\"\ndst = [\"fd00::/64\"]\n",
        );
        let shown: Vec<(String, Vec<usize>)> = rule_prefixes(&r)
            .iter()
            .map(|p| (unmapped_net(p).to_string(), candidates_of(&r, p)))
            .collect();
        assert_eq!(
            shown,
            [
                ("::/0".to_string(), vec![2]),
                ("10.0.0.0/8".to_string(), vec![0, 2]),
                ("10.1.2.3/32".to_string(), vec![0, 1, 2]),
                ("fd00::/64".to_string(), vec![2, 3]),
            ]
        );
    }

    #[test]
    fn ipv4_is_keyed_ipv4_mapped() {
        let net: IpNet = "192.0.2.0/24".parse().unwrap();
        assert_eq!(mapped(&net).to_string(), "::ffff:192.0.2.0/120");
        assert_eq!(unmapped_net(&mapped(&net)), net);
        assert_eq!(
            unmapped(mapped(&net).addr().octets()).to_string(),
            "192.0.2.0"
        );
    }

    #[test]
    fn ids_follow_names_and_stop_at_the_array_sizes() {
        let policy = |names: &[&str]| {
            let text: String = names
                .iter()
                .map(|n| {
                    format!(
                        "[[scope]]\nname = \"{n}\"\ncgroup = \"x\"\n[[scope.rule]]\nname = \"r\"\n"
                    )
                })
                .collect();
            parse(&text, "t").unwrap()
        };
        let mut ids = Ids::default();
        ids.assign(&policy(&["a", "b"])).unwrap();
        ids.assign(&policy(&["b"])).unwrap();
        ids.assign(&policy(&["c", "a"])).unwrap();
        assert_eq!(
            (ids.scope("a"), ids.scope("b"), ids.scope("c")),
            (Some(0), Some(1), Some(2))
        );
        // Rule ids are unique across scopes.
        assert_eq!(
            (ids.rule("a", "r"), ids.rule("b", "r"), ids.rule("c", "r")),
            (Some(0), Some(1), Some(2))
        );
        assert_eq!(ids.counts(), (3, 3));

        let names: Vec<String> = (0..MAX_SCOPE_IDS - 3).map(|i| format!("s{i}")).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        ids.assign(&policy(&names)).unwrap();
        assert_eq!(ids.counts().0, MAX_SCOPE_IDS);
        let err = ids.assign(&policy(&["a", "new"])).unwrap_err().to_string();
        assert!(err.starts_with("too many scope names"), "{err}");
        assert_eq!(ids.scope("new"), None, "nothing assigned");
        assert_eq!(ids.counts().0, MAX_SCOPE_IDS);
        ids.assign(&policy(&["a", "s7"])).unwrap();
    }
}
