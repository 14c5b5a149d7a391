//! What the programs counted: per destination, rule and scope; TIME_WAIT births,
//! EADDRNOTAVAIL failures, internal errors and lost events. Idle destinations are
//! forgotten so that the map of a long-running daemon holds the destinations in use.
use std::collections::HashMap;

use aya::maps::IterableMap;
use guard_common::{
    BREAKER_CLOSED, Breaker, Counter, CounterKey, EaddrKey, STAT_INTERNAL_ERRORS,
    STAT_LEASE_EXPIRED, STAT_LOST_EVENTS, TimeWaitKey,
};

use crate::kernel::{batch, maps::CounterMaps};

pub struct Counters {
    maps: CounterMaps,
    /// Destination entries that had no active connection at the last `forget_idle`,
    /// with their totals (admitted + shed + would_shed) then.
    idle_seen: HashMap<CounterKey, u64>,
    /// TIME_WAITS entries as seen at the last `forget_idle`.
    tw_seen: HashMap<TimeWaitKey, u64>,
    /// Counts of forgotten TIME_WAITS entries per scope, so that totals never go down.
    tw_forgotten: HashMap<u32, u64>,
    /// The most entries the destination counter map holds (fixed when it was made); 0
    /// where the kernel could not say.
    destination_capacity: u64,
}

/// Everything the counters hold at one moment, for a snapshot built elsewhere.
pub struct CounterDump {
    /// In the chunks the kernel gave them (`batch::chunks`), for a consumer to free as
    /// it goes.
    pub destinations: Vec<Vec<(CounterKey, Counter)>>,
    /// The most entries the destination counter map holds; 0 where unknown.
    pub destination_capacity: u64,
    /// Indexed by scope id and by rule id.
    pub scopes: Vec<Counter>,
    pub rules: Vec<Counter>,
    /// TIME_WAIT entries born on each scope's connections since the daemon started.
    pub time_wait_created: HashMap<u32, u64>,
    pub eaddrnotavail: Vec<(EaddrKey, u64)>,
    /// The breakers, by destination.
    pub breakers: HashMap<CounterKey, Breaker>,
    pub internal_errors: u64,
    pub lease_expired: u64,
    pub lost_events: u64,
}

impl Counters {
    pub fn new(maps: CounterMaps) -> Self {
        let destination_capacity = maps
            .counters
            .map()
            .info()
            .map_or(0, |i| u64::from(i.max_entries()));
        Counters {
            maps,
            idle_seen: HashMap::new(),
            tw_seen: HashMap::new(),
            tw_forgotten: HashMap::new(),
            destination_capacity,
        }
    }

    /// Reads every counter; `(scopes, rules)`: how many scope and rule ids are assigned.
    pub fn dump(&self, (scopes, rules): (u32, u32)) -> CounterDump {
        CounterDump {
            destinations: self.destinations(),
            destination_capacity: self.destination_capacity,
            scopes: self.scope_counters(scopes),
            rules: batch::array_prefix(&self.maps.rule_counters, rules),
            time_wait_created: self.time_wait_created(),
            eaddrnotavail: self.eaddrnotavail(),
            breakers: batch::entries(&self.maps.breakers).into_iter().collect(),
            internal_errors: self.stat(STAT_INTERNAL_ERRORS),
            lease_expired: self.stat(STAT_LEASE_EXPIRED),
            lost_events: self.stat(STAT_LOST_EVENTS),
        }
    }

    /// The counters of the scope ids below `scopes`, by id.
    pub fn scope_counters(&self, scopes: u32) -> Vec<Counter> {
        batch::array_prefix(&self.maps.scope_counters, scopes)
    }

    /// The counter of rule `id`, all its connections together.
    pub fn rule_counter(&self, id: u32) -> Option<Counter> {
        self.maps.rule_counters.get(&id, 0).ok()
    }

    /// Every destination counter in the kernel, in chunks (`batch::chunks`).
    pub fn destinations(&self) -> Vec<Vec<(CounterKey, Counter)>> {
        batch::chunks(&self.maps.counters)
    }

    /// Forgets destination entries that stayed idle (no active connection, no new
    /// admission or shed, a full token bucket, a closed breaker, forgotten with it)
    /// since the previous call, but those `listed` keeps: the
    /// destinations that /metrics lists, whose series would start again from 0 if their
    /// entry were made again. Scope and rule totals (in their own arrays) keep counting.
    /// Returns how many entries were forgotten.
    pub fn forget_idle(&mut self, listed: impl Fn(&CounterKey) -> bool) -> usize {
        let mut idle = HashMap::new();
        let mut forgotten = 0;
        let now_ns = guard_common::monotonic_ns();
        let breakers: HashMap<CounterKey, Breaker> =
            batch::entries(&self.maps.breakers).into_iter().collect();
        for (key, c) in self.destinations().into_iter().flatten() {
            if breakers
                .get(&key)
                .is_some_and(|b| b.status & 0xff != BREAKER_CLOSED as u64)
            {
                continue;
            }
            // A bucket not yet full again would start full if made anew.
            if c.active != 0 || c.connecting != 0 || c.rate_tat > now_ns || listed(&key) {
                continue;
            }
            let total = c.admitted + c.shed + c.would_shed;
            if self.idle_seen.get(&key) == Some(&total) {
                // A connect racing this removal charges an entry that is going away;
                // its release then skips the entry created again (epoch differs).
                if self.maps.counters.remove(&key).is_ok() {
                    forgotten += 1;
                    if breakers.contains_key(&key) {
                        let _ = self.maps.breakers.remove(&key);
                    }
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
            if self.tw_seen.get(key) == Some(n) && self.maps.time_waits.remove(key).is_ok() {
                *self.tw_forgotten.entry(key.scope_id).or_default() += n;
                forgotten += 1;
            }
        }
        self.tw_seen = now;
        forgotten
    }

    /// Removes the breaker entries of destinations that no breaker governs now
    /// (`governs` false): a reload took their breaker away, or renamed its rule. Kept,
    /// an open one would stay open, listed, and keep its destination from being
    /// forgotten; and a breaker put back later would start where the old one stopped.
    /// Returns how many were removed.
    pub fn forget_breakers(&mut self, governs: impl Fn(&CounterKey) -> bool) -> usize {
        batch::entries(&self.maps.breakers)
            .into_iter()
            .filter(|(key, _)| !governs(key) && self.maps.breakers.remove(key).is_ok())
            .count()
    }

    /// Clears the counters of the retired `scopes` and `rules` ids (`Ids::retire`) that
    /// count no connection (none active, none in the handshake), so that the ids can be
    /// given to new names: their array entries, and for a scope the entries keyed by it
    /// (destinations, breakers, TIME_WAIT births, EADDRNOTAVAIL failures). Returns the
    /// ids cleared.
    pub fn clear_retired(&mut self, scopes: &[u32], rules: &[u32]) -> (Vec<u32>, Vec<u32>) {
        let idle = |c: &Counter| c.active as i64 <= 0 && c.connecting as i64 <= 0;
        let clear = |array: &mut aya::maps::Array<aya::maps::MapData, Counter>, ids: &[u32]| {
            ids.iter()
                .copied()
                .filter(|id| {
                    array.get(id, 0).is_ok_and(|c| idle(&c))
                        && array.set(*id, Counter::default(), 0).is_ok()
                })
                .collect::<Vec<u32>>()
        };
        let scopes = clear(&mut self.maps.scope_counters, scopes);
        let rules = clear(&mut self.maps.rule_counters, rules);
        if !scopes.is_empty() {
            for (key, _) in self.destinations().into_iter().flatten() {
                if scopes.contains(&key.scope_id) {
                    let _ = self.maps.counters.remove(&key);
                    let _ = self.maps.breakers.remove(&key);
                    self.idle_seen.remove(&key);
                }
            }
            for key in self.time_waits().into_keys() {
                if scopes.contains(&key.scope_id) {
                    let _ = self.maps.time_waits.remove(&key);
                    self.tw_seen.remove(&key);
                }
            }
            for (key, _) in self.eaddrnotavail() {
                if scopes.contains(&key.scope_id) {
                    let _ = self.maps.eaddrnotavail.remove(&key);
                }
            }
            for id in &scopes {
                self.tw_forgotten.remove(id);
            }
        }
        (scopes, rules)
    }

    /// TIME_WAIT entries born on admitted connections, by key (totals).
    pub fn time_waits(&self) -> HashMap<TimeWaitKey, u64> {
        batch::entries(&self.maps.time_waits).into_iter().collect()
    }

    /// TIME_WAIT entries born on each scope's connections since the daemon started, by
    /// scope id.
    fn time_wait_created(&self) -> HashMap<u32, u64> {
        let mut out = self.tw_forgotten.clone();
        for (k, n) in self.time_waits() {
            *out.entry(k.scope_id).or_default() += n;
        }
        out
    }

    /// connect() failures with EADDRNOTAVAIL by scope and process name (totals).
    pub fn eaddrnotavail(&self) -> Vec<(EaddrKey, u64)> {
        batch::entries(&self.maps.eaddrnotavail)
    }

    /// An internal counter (`guard_common::STAT_*`) summed over CPUs.
    fn stat(&self, index: u32) -> u64 {
        self.maps
            .stats
            .get(&index, 0)
            .map(|v| v.iter().sum())
            .unwrap_or(0)
    }
}
