//! The control protocol, over a Unix stream socket: one request line per connection (at
//! most MAX_REQUEST bytes, newline-terminated), answered with one JSON document, then the
//! daemon closes the connection. Every error is answered `{"error": "..."}`.
//!
//! Requests: `stats` (everything), `stats N` (at most N destinations per scope, the rest
//! summed), `reload`, `ports NETNS_COOKIE`, `scope CGROUP_ID`, `events SEQ` (the events
//! after sequence number SEQ), `stop` (detach, unpin and exit; answered
//! `{"stopping": true}` before the daemon does), `fleet` (every host's record of the
//! fleet budgets, listed from etcd), `drill start JSON` (a `DrillSpec` on the line),
//! `drill stop NAME`, `drill list`.
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::{
    drill::{DrillSpec, DrillsReply},
    events::EventRecord,
    ports::DaemonPorts,
    stats::Snapshot,
};

/// Longest request line, in bytes, newline excluded.
pub const MAX_REQUEST: usize = 4096;

#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    /// Everything `connguard stats` shows; with `top`, each scope lists at most that many
    /// destinations and sums the rest (for callers that want totals: `listeners`, `top`).
    Stats { top: Option<usize> },
    /// Re-read the policy file.
    Reload,
    /// What the daemon adds to a ports report of the network namespace with this cookie.
    Ports { netns: u64 },
    /// The scope governing the cgroup with this id.
    Scope { cgroup_id: u64 },
    /// The events kept after sequence number `since`.
    Events { since: u64 },
    /// Detach, unpin and exit.
    Stop,
    /// The fleet as etcd holds it.
    Fleet,
    /// Start a drill.
    DrillStart(Box<DrillSpec>),
    /// End the running drill of this name.
    DrillStop(String),
    /// The running drills and the last ended ones.
    DrillList,
}

impl Request {
    pub fn parse(line: &str) -> Result<Request, String> {
        if let Some(json) = line.trim().strip_prefix("drill start ") {
            return serde_json::from_str(json)
                .map(|spec| Request::DrillStart(Box::new(spec)))
                .map_err(|e| format!("drill start: not a drill: {e}"));
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        let number = |w: &str| {
            w.parse::<u64>()
                .map_err(|_| format!("{w:?} is not a number, in request {:?}", line.trim()))
        };
        match words[..] {
            ["stats"] => Ok(Request::Stats { top: None }),
            ["stats", n] => Ok(Request::Stats {
                top: Some(number(n)? as usize),
            }),
            ["reload"] => Ok(Request::Reload),
            ["stop"] => Ok(Request::Stop),
            ["fleet"] => Ok(Request::Fleet),
            ["ports", n] => Ok(Request::Ports { netns: number(n)? }),
            ["scope", n] => Ok(Request::Scope {
                cgroup_id: number(n)?,
            }),
            ["events", n] => Ok(Request::Events { since: number(n)? }),
            ["drill", "stop", name] => Ok(Request::DrillStop(name.to_string())),
            ["drill", "list"] => Ok(Request::DrillList),
            _ => Err(format!("unknown request {:?}", line.trim())),
        }
    }
}

impl fmt::Display for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Request::Stats { top: None } => write!(f, "stats"),
            Request::Stats { top: Some(n) } => write!(f, "stats {n}"),
            Request::Reload => write!(f, "reload"),
            Request::Stop => write!(f, "stop"),
            Request::Fleet => write!(f, "fleet"),
            Request::Ports { netns } => write!(f, "ports {netns}"),
            Request::Scope { cgroup_id } => write!(f, "scope {cgroup_id}"),
            Request::Events { since } => write!(f, "events {since}"),
            Request::DrillStart(spec) => write!(
                f,
                "drill start {}",
                serde_json::to_string(spec).map_err(|_| fmt::Error)?
            ),
            Request::DrillStop(name) => write!(f, "drill stop {name}"),
            Request::DrillList => write!(f, "drill list"),
        }
    }
}

/// The answer to a request, written as the JSON of its content.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum Reply {
    Stats(Box<Snapshot>),
    Reload(ReloadReply),
    Ports(DaemonPorts),
    Scope(ScopeReply),
    Events(EventsReply),
    Stop(StopReply),
    Fleet(crate::fleet::FleetView),
    Drills(DrillsReply),
    Error(ErrorReply),
}

/// Answer of `stop`.
#[derive(Debug, Serialize, Deserialize)]
pub struct StopReply {
    pub stopping: bool,
}

impl Reply {
    pub fn error(why: impl Into<String>) -> Reply {
        Reply::Error(ErrorReply { error: why.into() })
    }
}

/// Answer of `reload`: the generation in force, and why a new policy was rejected.
#[derive(Debug, Serialize, Deserialize)]
pub struct ReloadReply {
    pub generation: u64,
    pub error: Option<String>,
}

/// Answer of `events`: the events kept after the sequence number asked for, oldest
/// first, and the sequence number to ask after next.
#[derive(Debug, Serialize, Deserialize)]
pub struct EventsReply {
    pub events: Vec<EventRecord>,
    pub next: u64,
}

/// Answer of `scope`: the scope's name, null when none governs the cgroup.
#[derive(Debug, Serialize, Deserialize)]
pub struct ScopeReply {
    pub scope: Option<String>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct ErrorReply {
    pub error: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Labelled;

    #[test]
    fn requests_read_back_as_written() {
        for r in [
            Request::Stats { top: None },
            Request::Stats { top: Some(0) },
            Request::Reload,
            Request::Ports { netns: 4097 },
            Request::Scope { cgroup_id: 1 },
            Request::Events { since: 7 },
            Request::Stop,
            Request::Fleet,
            Request::DrillStop("db".into()),
            Request::DrillList,
            Request::DrillStart(Box::new(crate::drill::DrillSpec {
                name: "db".into(),
                scope: "orders".into(),
                pod: Some(
                    crate::policy::Pods::new()
                        .namespace("shop")
                        .label("app", "orders"),
                ),
                container: None,
                unit: Some("orders.service".into()),
                dst: vec!["10.0.0.0/8".into()],
                ports: vec!["5432".into()],
                fault: crate::drill::Fault::Refuse,
                errno: None,
                probability: 0.25,
                duration_ms: 60_000,
                max_faults: Some(10),
                max_fraction: None,
                window_ms: None,
                abort: crate::drill::AbortSpec {
                    watch: vec![],
                    on_shedding: true,
                    on_breaker_open: true,
                    min_success_ratio: None,
                    window_ms: 10_000,
                    min_attempts: 20,
                    http: None,
                },
            })),
        ] {
            assert_eq!(Request::parse(&format!("{r}\n")), Ok(r));
        }
        // A drill of a client that names no workloads, nor they a scope.
        let old = r#"drill start {"name":"db","scope":"orders","dst":[],"ports":[],"fault":"refuse","errno":null,"probability":1.0,"duration_ms":1000,"max_faults":1,"max_fraction":null,"window_ms":null,"abort":{"watch":[],"on_shedding":true,"on_breaker_open":true,"min_success_ratio":null,"window_ms":1000,"min_attempts":1,"http":null}}"#;
        let Ok(Request::DrillStart(spec)) = Request::parse(old) else {
            panic!("{old}");
        };
        assert_eq!(
            (spec.scope.as_str(), spec.pod, spec.unit),
            ("orders", None, None)
        );
        let unit_only = old.replace(r#""scope":"orders""#, r#""unit":"orders.service""#);
        let Ok(Request::DrillStart(spec)) = Request::parse(&unit_only) else {
            panic!("{unit_only}");
        };
        assert_eq!(
            (spec.scope.as_str(), spec.unit.as_deref()),
            ("", Some("orders.service"))
        );
        assert_eq!(
            Request::parse("stats x"),
            Err("\"x\" is not a number, in request \"stats x\"".into())
        );
        assert_eq!(
            Request::parse("halt"),
            Err("unknown request \"halt\"".into())
        );
    }
}
