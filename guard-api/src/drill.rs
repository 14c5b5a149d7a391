//! Chaos drills: what `connguard drill start` sends the daemon (`DrillSpec`, validated
//! from a drill file or the command line), and what `connguard drill list`, `stats
//! --json` and `drill stop` answer (`DrillView`).
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::policy::{Containers, Pods};

/// The fault a drill injects into the connects of its target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Fault {
    /// connect() fails at once with the drill's errno; no SYN leaves the host.
    Refuse,
    /// The SYN and its retransmits never leave: the client waits its own connect
    /// timeout.
    Blackhole,
    /// The first SYN never leaves: the retransmit connects, about 1 s later.
    Delay,
    /// The connect meets a RST, as from an overloaded listener: ECONNREFUSED (after
    /// EINPROGRESS when non-blocking). Nothing leaves the host.
    Reset,
}

impl Fault {
    /// Whether `drill_egress` drops the faulted sockets' packets.
    pub fn drops_packets(self) -> bool {
        matches!(self, Fault::Blackhole | Fault::Delay)
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Fault::Refuse => "refuse",
            Fault::Blackhole => "blackhole",
            Fault::Delay => "delay",
            Fault::Reset => "reset",
        })
    }
}

/// A drill, validated: its target (a scope of the policy in force, or workloads it
/// governs, and optionally destinations and ports), its fault, and its bounds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DrillSpec {
    /// Unique among the daemon's running drills.
    pub name: String,
    /// The scope whose connects the drill faults. A request that names workloads may
    /// leave it empty: the daemon sets it to the scope that governs them.
    #[serde(default)]
    pub scope: String,
    /// Workloads of the scope the drill faults alone, selected as a scope selects them
    /// (several selectors: the workloads of any of them). None of them: the whole
    /// scope. Pods:
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<Pods>,
    /// Containers of the Docker Engine API:
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<Containers>,
    /// systemd units, a name or a glob:
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unit: Option<String>,
    /// Destination addresses or CIDRs (at most 4; none: every destination).
    pub dst: Vec<String>,
    /// Destination ports or ranges, like `8080` or `9000-9100` (at most 4; none: every
    /// port).
    pub ports: Vec<String>,
    pub fault: Fault,
    /// Refuse: the errno name connect() fails with (ECONNREFUSED when absent).
    pub errno: Option<String>,
    /// The chance that an attempt of the target is faulted, in [0, 1].
    pub probability: f64,
    /// How long the drill runs, ms: the programs fault nothing after it.
    pub duration_ms: u64,
    /// At most this many faulted attempts in all.
    pub max_faults: Option<u64>,
    /// At most this fraction of the target's attempts faulted in the sliding window
    /// of the last `window_ms` (10 s when absent).
    pub max_fraction: Option<f64>,
    pub window_ms: Option<u64>,
    pub abort: AbortSpec,
}

/// When the daemon ends a drill before its deadline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AbortSpec {
    /// Scopes watched for sheds and breaker openings (none: every scope but the
    /// target).
    pub watch: Vec<String>,
    /// Abort when a watched scope sheds a connection.
    pub on_shedding: bool,
    /// Abort when a breaker opens in a watched scope.
    pub on_breaker_open: bool,
    /// Abort when the target scope's success ratio (attempts neither shed nor given a
    /// refuse, blackhole or reset fault; the whole scope's, for a drill that names
    /// workloads) falls below this over `window_ms`, once the window holds
    /// `min_attempts` attempts.
    pub min_success_ratio: Option<f64>,
    pub window_ms: u64,
    pub min_attempts: u64,
    /// Abort when a GET of this http:// URL fails or answers other than 2xx (checked
    /// every 500 ms, 400 ms timeout).
    pub http: Option<String>,
}

/// A drill as the daemon reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DrillView {
    pub spec: DrillSpec,
    /// running, ended (deadline or `drill stop`) or aborted.
    pub state: String,
    /// Why it ended: `deadline`, `stopped`, or the abort's reason; null while running.
    pub reason: Option<String>,
    /// ms since the Unix epoch.
    pub started_unix_ms: u64,
    pub deadline_unix_ms: u64,
    pub ended_unix_ms: Option<u64>,
    /// The workloads the drill's pod, container and unit selectors resolved to when it
    /// started, with their cgroups: `pod shop/orders-1 (/kubepods/.../pod1234)`. Empty
    /// for a drill of a whole scope.
    #[serde(default)]
    pub workloads: Vec<String>,
    /// Attempts of the target while the drill ran, the faults given, and the attempts
    /// the probability chose that a cap let through (counted by the programs).
    pub attempts: u64,
    pub faulted: u64,
    pub capped: u64,
}

/// Answer of `drill list`: running drills first, then the last ended ones, newest
/// first. Answer of `drill start` and `drill stop`: the drill, in `drills`, alone.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DrillsReply {
    pub drills: Vec<DrillView>,
}
