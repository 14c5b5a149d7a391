//! `connguard events --json` (one object a line) and the control request `events SEQ`:
//! what the kernel reported through its EVENTS ring buffer (breaker transitions; keys
//! that start and stop shedding), named and numbered by the daemon.
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

/// One event.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct EventRecord {
    /// 1 for the daemon's first event, +1 for each.
    pub seq: u64,
    /// When the kernel reported it: ms since the Unix epoch.
    pub unix_ms: u64,
    /// breaker_opened, breaker_half_open, breaker_closed, shedding_started,
    /// shedding_stopped, caller_refused, caller_admitted; drill_started, drill_capped
    /// (its first attempt a cap let through), drill_ended, drill_aborted (reported by
    /// the daemon, not the kernel).
    pub kind: String,
    /// The scope; empty for a listener guard's event.
    pub scope: String,
    /// The workload the scope governs, when it governs one alone: an annotated pod's
    /// scope (`pod shop/orders-7d9f`), or a scope whose selectors select one workload
    /// (absent from the answers of older daemons); null for a listener guard's event.
    #[serde(default)]
    pub workload: Option<String>,
    /// caller_refused and caller_admitted: the listener guard, and its caller (source
    /// address prefix) that started to be refused (`reasons`: budget, rate), or had a
    /// SYN admitted again; null otherwise.
    #[serde(default)]
    pub listener: Option<String>,
    #[serde(default)]
    pub caller: Option<String>,
    /// The rule of the destination, or of a rule-level key; null for none.
    pub rule: Option<String>,
    /// The endpoint (`a.b.c.d:port`, `[v6]:port`); null for a rule or scope key.
    pub dst: Option<String>,
    /// shedding_started and caller_refused: why the first attempt was shed (budget, rate,
    /// max_connecting, breaker); empty otherwise.
    pub reasons: Vec<String>,
    /// shedding_started or caller_refused in observe mode: counted, not shed.
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
    /// drill_*: the drill, and (drill_ended, drill_aborted) why it ended.
    #[serde(default)]
    pub drill: Option<String>,
    #[serde(default)]
    pub reason: Option<String>,
}

impl EventRecord {
    /// One line for people, the time of day in UTC first.
    pub fn line(&self) -> String {
        let (secs, ms) = (self.unix_ms / 1000, self.unix_ms % 1000);
        let (h, m, sec) = (secs / 3600 % 24, secs / 60 % 60, secs % 60);
        let mut s = format!("{h:02}:{m:02}:{sec:02}.{ms:03} {}", self.kind);
        if let Some(d) = &self.drill {
            let _ = write!(s, " drill {d} scope {}", self.scope);
            if let Some(r) = &self.reason {
                let _ = write!(s, ": {r}");
            }
            return s;
        }
        if let (Some(l), Some(c)) = (&self.listener, &self.caller) {
            let _ = write!(s, " listener {l} caller {c}");
        } else {
            let _ = write!(s, " scope {}", self.scope);
            if let Some(w) = &self.workload {
                let _ = write!(s, " ({w})");
            }
        }
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
