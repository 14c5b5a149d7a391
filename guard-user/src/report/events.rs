//! `connguard events`: what the kernel reported through its EVENTS ring buffer (breaker
//! transitions; keys that start and stop shedding), named and kept by the daemon, the
//! newest EVENT_LOG of them, for clients that ask for those after a sequence number.
use std::{
    collections::VecDeque,
    fmt::Write as _,
    time::{SystemTime, UNIX_EPOCH},
};

use guard_common::{
    EVENT_BREAKER_CLOSED, EVENT_BREAKER_HALF_OPEN, EVENT_BREAKER_OPENED, EVENT_SHEDDING_STARTED,
    Event, NO_RULE, REASON_BREAKER, REASON_BUDGET, REASON_HANDSHAKES, REASON_OBSERVE, REASON_RATE,
    addr::{endpoint, unmapped},
};
use serde::{Deserialize, Serialize};

use crate::enforce::ids::Ids;

/// Events the daemon keeps.
pub const EVENT_LOG: usize = 4096;

/// One event, as `connguard events --json` prints it (one JSON object a line).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct EventRecord {
    /// 1 for the daemon's first event, +1 for each.
    pub seq: u64,
    /// When the kernel reported it: ms since the Unix epoch.
    pub unix_ms: u64,
    /// breaker_opened, breaker_half_open, breaker_closed, shedding_started,
    /// shedding_stopped.
    pub kind: String,
    pub scope: String,
    /// The rule of the destination, or of a rule-level key; null for none.
    pub rule: Option<String>,
    /// The endpoint (`a.b.c.d:port`, `[v6]:port`); null for a rule or scope key.
    pub dst: Option<String>,
    /// shedding_started: why the first attempt was shed (budget, rate, max_connecting,
    /// breaker); empty otherwise.
    pub reasons: Vec<String>,
    /// shedding_started in observe mode: counted, not shed.
    pub observe: bool,
    /// breaker_half_open: the step (0-based) and the percent of attempts it lets through.
    pub step: Option<u32>,
    pub percent: Option<u32>,
    /// breaker_opened: the outcomes that tripped it (the window's, or half-open the
    /// phase's), and how long it stays open, ms.
    pub ended: Option<u32>,
    pub failures: Option<u32>,
    pub slow: Option<u32>,
    pub open_ms: Option<u64>,
}

impl EventRecord {
    /// `ev` named by `ids`; `seq` and the clocks' difference (`unix_ms_at_boot`: the wall
    /// clock less CLOCK_MONOTONIC, ms) make the rest.
    pub fn new(ev: &Event, ids: &Ids, seq: u64, unix_ms_at_boot: u64) -> EventRecord {
        let kind = match ev.kind {
            EVENT_BREAKER_OPENED => "breaker_opened",
            EVENT_BREAKER_HALF_OPEN => "breaker_half_open",
            EVENT_BREAKER_CLOSED => "breaker_closed",
            EVENT_SHEDDING_STARTED => "shedding_started",
            _ => "shedding_stopped",
        };
        let k = &ev.key;
        let rule = (k.rule_id != NO_RULE)
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
        EventRecord {
            seq,
            unix_ms: unix_ms_at_boot + ev.time_ns / 1_000_000,
            kind: kind.into(),
            scope: ids.scope_name(k.scope_id).unwrap_or("?").to_string(),
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
        }
    }

    /// One line for people, the time of day in UTC first.
    pub fn line(&self) -> String {
        let (secs, ms) = (self.unix_ms / 1000, self.unix_ms % 1000);
        let (h, m, sec) = (secs / 3600 % 24, secs / 60 % 60, secs % 60);
        let mut s = format!("{h:02}:{m:02}:{sec:02}.{ms:03} {}", self.kind);
        let _ = write!(s, " scope {}", self.scope);
        if let Some(r) = &self.rule {
            let _ = write!(s, " rule {r}");
        }
        if let Some(d) = &self.dst {
            let _ = write!(s, " dst {d}");
        }
        if !self.reasons.is_empty() {
            let _ = write!(s, " over {}", self.reasons.join(","));
        }
        if self.observe {
            s += " (observe: counted, not shed)";
        }
        if let (Some(e), Some(f), Some(w), Some(o)) =
            (self.ended, self.failures, self.slow, self.open_ms)
        {
            let _ = write!(s, ": {f} of {e} failed, {w} slow; open {o} ms");
        }
        if let (Some(step), Some(p)) = (self.step, self.percent) {
            let _ = write!(s, ": step {step}, {p}% let through");
        }
        s
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
    /// Adds the kernel's `ev`, named by `ids`.
    pub fn push(&mut self, ev: &Event, ids: &Ids, unix_ms_at_boot: u64) {
        self.last_seq += 1;
        if self.events.len() == EVENT_LOG {
            self.events.pop_front();
        }
        self.events
            .push_back(EventRecord::new(ev, ids, self.last_seq, unix_ms_at_boot));
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
