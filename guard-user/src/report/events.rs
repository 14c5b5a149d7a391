//! `connguard events`: what the kernel reported through its EVENTS ring buffer (breaker
//! transitions; keys that start and stop shedding; listener guards' callers that start
//! and stop being refused), named and kept by the daemon, the
//! newest EVENT_LOG of them, for clients that ask for those after a sequence number.
use std::{
    collections::{HashMap, VecDeque},
    time::{SystemTime, UNIX_EPOCH},
};

use connguard_api::events::EventRecord;
use guard_common::{
    EVENT_BREAKER_CLOSED, EVENT_BREAKER_HALF_OPEN, EVENT_BREAKER_OPENED, EVENT_CALLER_ADMITTED,
    EVENT_CALLER_REFUSED, EVENT_SHEDDING_STARTED, Event, NO_RULE, REASON_BREAKER, REASON_BUDGET,
    REASON_HANDSHAKES, REASON_OBSERVE, REASON_RATE,
    addr::{endpoint, unmapped},
    callers::LEVEL_CALLER,
};

use crate::{enforce::ids::Ids, listen::caller_name};

/// Events the daemon keeps.
pub const EVENT_LOG: usize = 4096;

/// The kernel's event `ev` named by `ids` (a listener guard's caller's, by `guards`);
/// `seq` and the clocks' difference (`unix_ms_at_boot`: the wall clock less
/// CLOCK_MONOTONIC, ms) make the rest. `workload` names the workload of a scope that
/// governs one alone.
pub fn record(
    ev: &Event,
    ids: &Ids,
    guards: &HashMap<u32, String>,
    seq: u64,
    unix_ms_at_boot: u64,
    workload: impl Fn(&str) -> Option<String>,
) -> EventRecord {
    let kind = match ev.kind {
        EVENT_BREAKER_OPENED => "breaker_opened",
        EVENT_BREAKER_HALF_OPEN => "breaker_half_open",
        EVENT_BREAKER_CLOSED => "breaker_closed",
        EVENT_SHEDDING_STARTED => "shedding_started",
        EVENT_CALLER_REFUSED => "caller_refused",
        EVENT_CALLER_ADMITTED => "caller_admitted",
        _ => "shedding_stopped",
    };
    let k = &ev.key;
    let caller = ev.level == LEVEL_CALLER;
    let rule = (!caller && k.rule_id != NO_RULE)
        .then(|| ids.rule_names().get(&k.rule_id).map(|n| n.to_string()))
        .flatten();
    let reasons = [
        (REASON_BUDGET, "budget"),
        (REASON_RATE, "rate"),
        (REASON_HANDSHAKES, "max_connecting"),
        (REASON_BREAKER, "breaker"),
    ]
    .iter()
    .filter(|(bit, _)| ev.reasons & bit != 0)
    .map(|(_, name)| name.to_string())
    .collect();
    let breaker = kind.starts_with("breaker");
    let opened = ev.kind == EVENT_BREAKER_OPENED;
    if caller {
        let addr = unmapped(k.addr);
        // The prefix counts bits of the IPv4-mapped form.
        let bits = if addr.is_ipv4() {
            k.rule_id.saturating_sub(96)
        } else {
            k.rule_id
        };
        return EventRecord {
            seq,
            unix_ms: unix_ms_at_boot + ev.time_ns / 1_000_000,
            kind: kind.into(),
            listener: Some(guards.get(&k.scope_id).cloned().unwrap_or("?".into())),
            caller: Some(caller_name(addr, bits as u8)),
            reasons,
            observe: ev.reasons & REASON_OBSERVE != 0,
            ..EventRecord::default()
        };
    }
    let scope = ids.scope_name(k.scope_id).unwrap_or("?").to_string();
    EventRecord {
        seq,
        unix_ms: unix_ms_at_boot + ev.time_ns / 1_000_000,
        kind: kind.into(),
        workload: workload(&scope),
        scope,
        listener: None,
        caller: None,
        rule,
        dst: (ev.level == 0).then(|| endpoint(unmapped(k.addr), k.port)),
        reasons,
        observe: ev.reasons & REASON_OBSERVE != 0,
        step: (ev.kind == EVENT_BREAKER_HALF_OPEN).then_some(ev.step),
        percent: breaker.then_some(ev.percent),
        ended: opened.then_some(ev.ended),
        failures: opened.then_some(ev.failures),
        slow: opened.then_some(ev.slow),
        open_ms: opened.then_some(ev.open_ns / 1_000_000),
        drill: None,
        reason: None,
    }
}

/// The wall clock less CLOCK_MONOTONIC, ms.
pub fn unix_ms_at_boot() -> u64 {
    let wall = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64;
    wall.saturating_sub(guard_common::monotonic_ns() / 1_000_000)
}

/// The newest events, by sequence number.
#[derive(Default)]
pub struct EventLog {
    events: VecDeque<EventRecord>,
    last_seq: u64,
}

impl EventLog {
    /// Adds the kernel's `ev`, named by `ids`, `guards` and `workload` (see `record`).
    pub fn push(
        &mut self,
        ev: &Event,
        ids: &Ids,
        guards: &HashMap<u32, String>,
        unix_ms_at_boot: u64,
        workload: impl Fn(&str) -> Option<String>,
    ) {
        self.push_own(record(ev, ids, guards, 0, unix_ms_at_boot, workload));
    }

    /// Adds an event the daemon itself reports (a drill's), numbered here.
    pub fn push_own(&mut self, mut record: EventRecord) {
        self.last_seq += 1;
        record.seq = self.last_seq;
        if self.events.len() == EVENT_LOG {
            self.events.pop_front();
        }
        self.events.push_back(record);
    }

    /// The events after `since`, and the sequence number to ask after next.
    pub fn after(&self, since: u64) -> (Vec<EventRecord>, u64) {
        let events = self
            .events
            .iter()
            .filter(|e| e.seq > since)
            .cloned()
            .collect();
        (events, self.last_seq)
    }
}
