//! The daemon's side of listener guards' per-caller budgets (guard_common::callers):
//! how many guards set them (CALLER_GUARDS, for the state tracepoint), the sweep of
//! idle callers out of CALLERS, and what stats show of the callers.
use std::{collections::HashMap, net::IpAddr, time::Instant};

use anyhow::Context;
use aya::maps::{Array, MapData};
use connguard_api::stats::{CallerStats, CallerTables, PerSourceStats, TOP_CALLERS};
use guard_common::{
    addr::unmapped,
    callers::{CallerCount, CallerKey, MAX_CALLERS, MAX_SOURCES, PerSourceTotals, SourceState},
};

use super::SWEEP;
use crate::{
    kernel::{batch, maps::Hashed},
    policy::PerSourcePolicy,
};

pub struct Callers {
    guards: Array<MapData, u32>,
    callers: Hashed<CallerKey, CallerCount>,
    sources: Hashed<CallerKey, SourceState>,
    totals: Hashed<u32, PerSourceTotals>,
    /// Callers at 0 active at the last sweep, with their `admitted` then.
    idle: HashMap<CallerKey, u64>,
    swept: Option<Instant>,
}

/// The callers' tables as read once for a snapshot.
pub struct Tables {
    callers: Vec<(CallerKey, CallerCount)>,
    sources: HashMap<CallerKey, SourceState>,
}

impl Callers {
    pub fn new(
        guards: Array<MapData, u32>,
        callers: Hashed<CallerKey, CallerCount>,
        sources: Hashed<CallerKey, SourceState>,
        totals: Hashed<u32, PerSourceTotals>,
    ) -> Self {
        Callers {
            guards,
            callers,
            sources,
            totals,
            idle: HashMap::new(),
            swept: None,
        }
    }

    /// Tells the state tracepoint how many LISTENERS entries set per-caller budgets
    /// (while 0 it counts no caller).
    pub fn set_guards(&mut self, n: u32) -> anyhow::Result<()> {
        if self.guards.get(&0, 0).ok() != Some(n) {
            self.guards.set(0, n, 0).context("writing CALLER_GUARDS")?;
        }
        Ok(())
    }

    /// Forgets every caller's count (no guard has per-caller budgets, and the programs
    /// that release the counts are detached). A socket's hold then finds no entry of its
    /// epoch, and skips.
    pub fn forget_all(&mut self) {
        for (key, _) in batch::entries(&self.callers) {
            let _ = self.callers.remove(&key);
        }
        self.idle.clear();
    }

    /// Removes callers idle since the last sweep, at most every SWEEP: one at 0 active
    /// whose count of completed handshakes is what it was at the sweep before. So a
    /// caller is forgotten one to two sweeps after its last connection closed. One that
    /// a completion takes between the reading and the removal goes uncounted: its
    /// socket's release then finds no entry of its epoch, and skips.
    pub fn sweep(&mut self) {
        if self.swept.is_some_and(|t| t.elapsed() < SWEEP) {
            return;
        }
        self.swept = Some(Instant::now());
        let mut idle = HashMap::new();
        for (key, c) in batch::entries(&self.callers) {
            if c.active != 0 {
                continue;
            }
            if self.idle.get(&key) == Some(&c.admitted) {
                let _ = self.callers.remove(&key);
            } else {
                idle.insert(key, c.admitted);
            }
        }
        self.idle = idle;
    }

    /// Both tables, read whole.
    pub fn read(&self) -> Tables {
        Tables {
            callers: batch::entries(&self.callers),
            sources: batch::entries(&self.sources).into_iter().collect(),
        }
    }

    /// The guard's per-caller budgets `p`, what they refused, and its busiest callers.
    pub fn stats(&self, tables: &Tables, listener_id: u32, p: &PerSourcePolicy) -> PerSourceStats {
        let totals = self.totals.get(&listener_id, 0).unwrap_or_default();
        let mut callers: HashMap<CallerKey, CallerStats> = HashMap::new();
        let name = |key: &CallerKey| {
            let addr = unmapped(key.addr);
            caller_name(addr, if addr.is_ipv4() { p.prefix } else { p.prefix6 })
        };
        for (key, c) in tables
            .callers
            .iter()
            .filter(|(k, _)| k.listener_id == listener_id)
        {
            let row = callers.entry(*key).or_default();
            // Signed: a release into an entry made again after a sweep is skipped.
            row.active = (c.active as i64).max(0) as u64;
            (row.peak, row.admitted) = (c.peak, c.admitted);
        }
        for (key, s) in tables
            .sources
            .iter()
            .filter(|(k, _)| k.listener_id == listener_id)
        {
            let row = callers.entry(*key).or_default();
            (row.refused, row.would_refuse, row.rate_limited) =
                (s.refused, s.would_refuse, s.rate_limited);
            row.refusing = s.refusing_since != 0;
        }
        let mut stats = PerSourceStats {
            prefix: p.prefix,
            prefix6: p.prefix6,
            max_connections: p.max_connections,
            rate: p.rate.as_ref().map(ToString::to_string),
            burst: p.rate.as_ref().map(|r| r.burst),
            action: p.action_name().into(),
            refused: totals.refused,
            would_refuse: totals.would_refuse,
            rate_limited: totals.rate_limited,
            active: callers.values().map(|c| c.active).sum(),
            callers: callers.values().filter(|c| c.active > 0).count() as u64,
            refusing: callers.values().filter(|c| c.refusing).count() as u64,
            top: Vec::new(),
            other: CallerStats {
                caller: "other".into(),
                ..CallerStats::default()
            },
        };
        let mut by_active: Vec<(&CallerKey, &CallerStats)> =
            callers.iter().filter(|(_, c)| c.active > 0).collect();
        by_active.sort_by(|a, b| b.1.active.cmp(&a.1.active).then(a.0.cmp(b.0)));
        let mut by_refused: Vec<(&CallerKey, &CallerStats)> = callers
            .iter()
            .filter(|(_, c)| c.refused + c.would_refuse > 0)
            .collect();
        by_refused.sort_by(|a, b| {
            let n = |c: &CallerStats| c.refused + c.would_refuse;
            n(b.1).cmp(&n(a.1)).then(a.0.cmp(b.0))
        });
        let mut listed: Vec<CallerKey> = by_active
            .iter()
            .take(TOP_CALLERS)
            .chain(by_refused.iter().take(TOP_CALLERS))
            .map(|(k, _)| **k)
            .collect();
        listed.sort();
        listed.dedup();
        for key in &listed {
            let mut c = callers[key].clone();
            c.caller = name(key);
            stats.top.push(c);
        }
        stats.top.sort_by(|a, b| {
            b.active
                .cmp(&a.active)
                .then((b.refused + b.would_refuse).cmp(&(a.refused + a.would_refuse)))
                .then(a.caller.cmp(&b.caller))
        });
        let o = &mut stats.other;
        for (_, c) in callers.iter().filter(|(k, _)| !listed.contains(k)) {
            o.active += c.active;
            o.peak = o.peak.max(c.peak);
            o.admitted += c.admitted;
            o.refusing |= c.refusing;
        }
        // Refusals of callers the SOURCES table no longer holds count here too.
        let listed_sum = |f: fn(&CallerStats) -> u64| stats.top.iter().map(f).sum::<u64>();
        o.refused = totals.refused.saturating_sub(listed_sum(|c| c.refused));
        o.would_refuse = totals
            .would_refuse
            .saturating_sub(listed_sum(|c| c.would_refuse));
        o.rate_limited = totals
            .rate_limited
            .saturating_sub(listed_sum(|c| c.rate_limited));
        stats
    }
}

impl Tables {
    /// Entries of each table, and their sizes.
    pub fn use_of(&self) -> CallerTables {
        CallerTables {
            callers: self.callers.len() as u64,
            callers_capacity: MAX_CALLERS as u64,
            sources: self.sources.len() as u64,
            sources_capacity: MAX_SOURCES as u64,
        }
    }
}

/// `addr/bits`, as stats name a caller.
pub fn caller_name(addr: IpAddr, bits: u8) -> String {
    format!("{addr}/{bits}")
}
