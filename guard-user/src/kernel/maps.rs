//! Every map of the object, taken out of it by name (guard_common::names::map) with its
//! key and value types, grouped by what they hold.
use std::{collections::HashMap, hash::Hash};

use anyhow::Context;
use aya::{
    Ebpf, Pod,
    maps::{Array, HashMap as BpfHash, LpmTrie, Map, MapData, MapError, PerCpuArray},
};
use guard_common::{
    Breaker, Candidates, CgroupKey, Counter, CounterKey, EaddrKey, IdKey, ListenerEntry,
    ListenerKey, PortUseKey, RstKey, RuleAddrKey, ScopeConf, TimeWaitKey,
    callers::{CallerCount, CallerKey, PerSourceTotals, SourceState},
    drill::{DrillConf, DrillCounts},
    names::map,
};

pub type Hashed<K, V> = BpfHash<MapData, K, V>;

/// The policy in force, in two generations, and the ids names are counted by.
pub struct PolicyMaps {
    pub ids: Hashed<IdKey, u32>,
    pub active_gen: Array<MapData, u32>,
    pub scopes: Hashed<CgroupKey, ScopeConf>,
    pub scope_levels: Array<MapData, u32>,
    pub cgroup_root: Array<MapData, u64>,
    pub rules: LpmTrie<MapData, RuleAddrKey, Candidates>,
}

/// What the programs count.
pub struct CounterMaps {
    pub counters: Hashed<CounterKey, Counter>,
    pub scope_counters: Array<MapData, Counter>,
    pub rule_counters: Array<MapData, Counter>,
    pub time_waits: Hashed<TimeWaitKey, u64>,
    pub eaddrnotavail: Hashed<EaddrKey, u64>,
    pub stats: PerCpuArray<MapData, u64>,
    pub breakers: Hashed<CounterKey, Breaker>,
}

/// Until when the daemon holds its lease (CLOCK_MONOTONIC ns).
pub type Lease = Array<MapData, u64>;

/// Listener guards' decisions and counts.
pub struct ListenerMaps {
    pub shed: Hashed<ListenerKey, ListenerEntry>,
    /// [0]: CLOCK_MONOTONIC ns of the daemon's last heartbeat.
    pub heartbeat: Array<MapData, u64>,
    pub rst_shed: Hashed<RstKey, u64>,
    pub would_rst: Hashed<RstKey, u64>,
    pub ids: Hashed<IdKey, u32>,
    /// [0]: how many LISTENERS entries set per-caller budgets.
    pub caller_guards: Array<MapData, u32>,
    pub callers: Hashed<CallerKey, CallerCount>,
    /// An LRU hash map (aya reads it as a hash map).
    pub sources: Hashed<CallerKey, SourceState>,
    pub per_source_totals: Hashed<u32, PerSourceTotals>,
}

/// Drills (guard_common::drill), by scope id: what the daemon sets, what the programs
/// count, and the lease they fault under.
pub struct DrillMaps {
    pub on: Array<MapData, u32>,
    pub conf: Hashed<u32, DrillConf>,
    pub counts: Array<MapData, DrillCounts>,
    pub lease: Array<MapData, u64>,
}

/// The maps the daemon uses. SOCKS and DRILL_SOCKS (socket storage) are the programs'
/// alone.
pub struct Maps {
    pub policy: PolicyMaps,
    pub counters: CounterMaps,
    /// Ports held toward destinations near a port watermark.
    pub port_use: Hashed<PortUseKey, u32>,
    pub listeners: ListenerMaps,
    pub lease: Lease,
    pub drills: DrillMaps,
}

impl Maps {
    pub fn take(ebpf: &mut Ebpf) -> anyhow::Result<Maps> {
        Ok(Maps {
            policy: PolicyMaps {
                ids: take(ebpf, map::IDS)?,
                active_gen: take(ebpf, map::ACTIVE_GEN)?,
                scopes: take(ebpf, map::SCOPES)?,
                scope_levels: take(ebpf, map::SCOPE_LEVELS)?,
                cgroup_root: take(ebpf, map::CGROUP_ROOT)?,
                rules: take(ebpf, map::RULES)?,
            },
            counters: CounterMaps {
                counters: take(ebpf, map::COUNTERS)?,
                scope_counters: take(ebpf, map::SCOPE_COUNTERS)?,
                rule_counters: take(ebpf, map::RULE_COUNTERS)?,
                time_waits: take(ebpf, map::TIME_WAITS)?,
                eaddrnotavail: take(ebpf, map::EADDRNOTAVAIL)?,
                stats: take(ebpf, map::STATS)?,
                breakers: take(ebpf, map::BREAKERS)?,
            },
            port_use: take(ebpf, map::PORT_USE)?,
            listeners: ListenerMaps {
                shed: take(ebpf, map::LISTENERS)?,
                heartbeat: take(ebpf, map::LISTENER_HEARTBEAT)?,
                rst_shed: take(ebpf, map::RST_SHED)?,
                would_rst: take(ebpf, map::WOULD_RST)?,
                ids: take(ebpf, map::LISTENER_IDS)?,
                caller_guards: take(ebpf, map::CALLER_GUARDS)?,
                callers: take(ebpf, map::CALLERS)?,
                sources: take(ebpf, map::SOURCES)?,
                per_source_totals: take(ebpf, map::PER_SOURCE_TOTALS)?,
            },
            lease: take(ebpf, map::LEASE)?,
            drills: DrillMaps {
                on: take(ebpf, map::DRILL_ON)?,
                conf: take(ebpf, map::DRILLS)?,
                counts: take(ebpf, map::DRILL_COUNTS)?,
                lease: take(ebpf, map::DRILL_LEASE)?,
            },
        })
    }
}

/// The map `name`, taken out of the object as `T` (which checks key and value sizes).
fn take<T: TryFrom<Map, Error = MapError>>(ebpf: &mut Ebpf, name: &str) -> anyhow::Result<T> {
    let m = ebpf
        .take_map(name)
        .with_context(|| format!("map {name} missing from the eBPF object"))?;
    T::try_from(m).with_context(|| format!("map {name} is not of the type the daemon expects"))
}

/// A hash map whose whole contents the daemon decides from its own readings, with a copy
/// of what it wrote.
pub struct Mirrored<K, V> {
    map: Hashed<K, V>,
    written: HashMap<K, V>,
}

impl<K: Pod + Eq + Hash, V: Pod> Mirrored<K, V> {
    pub fn new(map: Hashed<K, V>) -> Self {
        Mirrored {
            map,
            written: HashMap::new(),
        }
    }

    /// Makes the map hold exactly `entries`. Stale entries go first, and an entry that
    /// cannot be written is removed (an update that fails leaves the old value in place),
    /// so a failure never keeps a stale decision in force (fail-open); the first error is
    /// returned after every entry was tried.
    pub fn sync(&mut self, entries: HashMap<K, V>) -> anyhow::Result<()> {
        // A stale entry that could not be removed stays known, to be removed next time.
        let mut kept = HashMap::new();
        for (stale, value) in self
            .written
            .iter()
            .filter(|(k, _)| !entries.contains_key(k))
        {
            if self.map.remove(stale).is_err() {
                kept.insert(*stale, *value);
            }
        }
        self.written = kept;
        let mut failed = None;
        for (key, value) in entries {
            match self.map.insert(key, value, 0) {
                Ok(()) => {
                    self.written.insert(key, value);
                }
                Err(e) => {
                    let _ = self.map.remove(&key);
                    failed = failed.or(Some(e));
                }
            }
        }
        match failed {
            Some(e) => Err(anyhow::Error::new(e).context("some entries were left out")),
            None => Ok(()),
        }
    }

    /// What the map holds, as last written.
    pub fn entries(&self) -> &HashMap<K, V> {
        &self.written
    }
}
