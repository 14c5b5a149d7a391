//! Chaos drills (docs/drills.md): the daemon's side. A drill is set at its scope's id:
//! counts zeroed, settings written (`DRILLS`), then its fault turned on (`DRILL_ON`);
//! the programs decide and count every fault (guard_common::drill), under a lease this
//! daemon renews (`DRILL_LEASE`). Here the daemon ends drills: at their deadline (the
//! programs already fault nothing past it), on `drill stop`, when their scope leaves the
//! policy, when the daemon stops, and when the steady state breaks (`tick`): a watched
//! scope sheds or opens a breaker, the target's success ratio falls, or the HTTP check
//! fails.
use std::{collections::VecDeque, path::PathBuf, time::Duration};

use aya::maps::{Array, MapData};
use connguard_api::{
    drill::{DrillSpec, DrillView, Fault},
    events::EventRecord,
};
use guard_common::{
    Counter, PortRange,
    addr::mapped,
    drill::{
        DrillCgroup, DrillConf, DrillCounts, DrillNet, FAULT_BLACKHOLE, FAULT_DELAY, FAULT_REFUSE,
        FAULT_RESET, MAX_DRILL_CGROUPS, MAX_DRILL_NETS, MAX_DRILL_PORTS,
    },
};
use ipnet::IpNet;

use crate::{
    host::cgroup::cgroup_id,
    kernel::maps::{DrillMaps, Hashed},
    policy,
};

/// Ended drills kept for `drill list`.
const KEEP_ENDED: usize = 32;

pub struct Drills {
    on: Array<MapData, u32>,
    conf: Hashed<u32, DrillConf>,
    counts: Array<MapData, DrillCounts>,
    lease: Array<MapData, u64>,
    lease_length: Duration,
    running: Vec<Running>,
    /// Drills being started that drop packets: `drill_egress` is attached for them
    /// before they are set.
    starting_drops: usize,
    /// The daemon is exiting (`end_all`): no drill starts.
    stopping: bool,
    /// Newest first.
    ended: VecDeque<DrillView>,
    last_serial: u32,
    /// The last error attaching `drill_egress`, logged once until it changes or clears.
    egress_error: Option<String>,
}

struct Running {
    view: DrillView,
    scope_id: u32,
    deadline_ns: u64,
    /// The directories and ids of the cgroups it narrows its scope to.
    cgroups: Vec<(PathBuf, u64)>,
    /// Each watched scope's id and name, with its shed and breaker openings at the
    /// start.
    watched: Vec<(u32, String, u64, u64)>,
    /// (CLOCK_MONOTONIC ns, attempts, failures) of the target at each tick, over the
    /// abort window.
    samples: VecDeque<(u64, u64, u64)>,
    /// Set by the HTTP check when it fails.
    http_failed: Option<String>,
}

/// A cgroup a drill narrows its scope to.
pub struct TargetCgroup {
    /// Its directory, looked at each tick: a drill whose cgroups are all gone ends.
    pub dir: PathBuf,
    pub cgroup: DrillCgroup,
    /// The workload it is the cgroup of, with its path, as `DrillView::workloads`
    /// names it.
    pub name: String,
}

/// What a drill's start needs of the daemon's other state.
pub struct Target<'a> {
    pub scope_id: u32,
    /// The cgroups the drill narrows its scope to (none: the whole scope).
    pub workloads: Vec<TargetCgroup>,
    /// Every scope of the policy in force, by id.
    pub scopes: &'a [(u32, String)],
    /// The scope counters, by id.
    pub counters: &'a [Counter],
    pub now_ns: u64,
    pub unix_ms_at_boot: u64,
}

impl Drills {
    /// The drills of a daemon whose programs fault under a lease of `lease_length`,
    /// renewed with the daemon's own (`renew_lease`).
    pub fn new(maps: DrillMaps, lease_length: Duration) -> Drills {
        Drills {
            on: maps.on,
            conf: maps.conf,
            counts: maps.counts,
            lease: maps.lease,
            lease_length,
            running: Vec::new(),
            starting_drops: 0,
            stopping: false,
            ended: VecDeque::new(),
            last_serial: 0,
            egress_error: None,
        }
    }

    /// Sets `spec`'s drill; refused when its name or its scope has one running.
    pub fn start(
        &mut self,
        spec: DrillSpec,
        t: Target,
    ) -> Result<(DrillView, EventRecord), String> {
        if self.stopping {
            return Err("the daemon is stopping".into());
        }
        if self.running.iter().any(|r| r.view.spec.name == spec.name) {
            return Err(format!("a drill named {:?} is running", spec.name));
        }
        if let Some(r) = self.running.iter().find(|r| r.scope_id == t.scope_id) {
            return Err(format!(
                "scope {:?} has a drill running ({:?}): one drill a scope at a time",
                spec.scope, r.view.spec.name
            ));
        }
        if t.workloads.len() > MAX_DRILL_CGROUPS {
            return Err(format!(
                "a drill takes at most {MAX_DRILL_CGROUPS} workloads"
            ));
        }
        self.last_serial = self.last_serial.wrapping_add(1).max(1);
        let mut conf = conf(&spec, self.last_serial, t.now_ns)?;
        for (i, w) in t.workloads.iter().enumerate() {
            conf.cgroups[i] = w.cgroup;
        }
        conf.n_cgroups = t.workloads.len() as u32;
        let watched = t
            .scopes
            .iter()
            .filter(|(id, name)| {
                *id != t.scope_id
                    && (spec.abort.watch.is_empty() || spec.abort.watch.contains(name))
            })
            .map(|(id, name)| {
                let c = t.counters.get(*id as usize).copied().unwrap_or_default();
                (*id, name.clone(), c.shed, c.breaker_opened)
            })
            .collect();
        if let Some(w) = spec
            .abort
            .watch
            .iter()
            .find(|w| !t.scopes.iter().any(|(_, n)| n == *w))
        {
            return Err(format!(
                "abort.watch: no scope {w:?} in the policy in force"
            ));
        }
        self.counts
            .set(t.scope_id, DrillCounts::default(), 0)
            .map_err(|e| format!("zeroing DRILL_COUNTS: {e}"))?;
        self.conf
            .insert(t.scope_id, conf, 0)
            .map_err(|e| format!("writing DRILLS: {e}"))?;
        if let Err(e) = self.on.set(t.scope_id, conf.fault, 0) {
            let _ = self.conf.remove(&t.scope_id);
            return Err(format!("writing DRILL_ON: {e}"));
        }
        let view = DrillView {
            state: "running".into(),
            reason: None,
            started_unix_ms: t.unix_ms_at_boot + t.now_ns / 1_000_000,
            deadline_unix_ms: t.unix_ms_at_boot + conf.deadline_ns / 1_000_000,
            ended_unix_ms: None,
            attempts: 0,
            faulted: 0,
            capped: 0,
            workloads: t.workloads.iter().map(|w| w.name.clone()).collect(),
            spec,
        };
        let event = event(&view, "drill_started", None, view.started_unix_ms);
        self.running.push(Running {
            view: view.clone(),
            scope_id: t.scope_id,
            deadline_ns: conf.deadline_ns,
            cgroups: t
                .workloads
                .iter()
                .map(|w| (w.dir.clone(), w.cgroup.id))
                .collect(),
            watched,
            samples: VecDeque::new(),
            http_failed: None,
        });
        Ok((view, event))
    }

    /// Ends the running drill `name`, as stopped.
    pub fn stop(
        &mut self,
        name: &str,
        now_ns: u64,
        unix_ms_at_boot: u64,
    ) -> Result<(DrillView, EventRecord), String> {
        let i = self
            .running
            .iter()
            .position(|r| r.view.spec.name == name)
            .ok_or_else(|| format!("no drill named {name:?} is running"))?;
        Ok(self.end(i, "ended", "stopped".into(), now_ns, unix_ms_at_boot))
    }

    /// Marks the running drill `name`'s HTTP check failed, for the next tick.
    pub fn http_failed(&mut self, name: &str, why: String) {
        if let Some(r) = self.running.iter_mut().find(|r| r.view.spec.name == name) {
            r.http_failed.get_or_insert(why);
        }
    }

    /// Whether a drill that drops packets (blackhole, delay) runs or is being started:
    /// `drill_egress` must be attached.
    pub fn drop_packets(&self) -> bool {
        self.starting_drops > 0
            || self
                .running
                .iter()
                .any(|r| r.view.spec.fault.drops_packets())
    }

    /// A drill that drops packets is about to start (`drops`), or has started or failed
    /// to (`!drops`): `drill_egress` stays attached meanwhile.
    pub fn starting(&mut self, drops: bool) {
        if drops {
            self.starting_drops += 1;
        } else {
            self.starting_drops = self.starting_drops.saturating_sub(1);
        }
    }

    /// Notes the outcome of the last attach of `drill_egress` (`Err`: why it failed);
    /// returns what to log, once for each new error and once when it clears.
    pub fn egress_outcome(&mut self, outcome: Result<(), String>) -> Option<String> {
        match outcome {
            Err(why) if self.egress_error.as_ref() != Some(&why) => {
                self.egress_error = Some(why.clone());
                Some(format!("drills: attaching drill_egress: {why}"))
            }
            Ok(()) if self.egress_error.take().is_some() => {
                Some("drills: drill_egress attached".into())
            }
            _ => None,
        }
    }

    /// Holds the drills' lease for its length from now.
    pub fn renew_lease(&mut self) -> anyhow::Result<()> {
        let until =
            guard_common::monotonic_ns().saturating_add(self.lease_length.as_nanos() as u64);
        Ok(self.lease.set(0, until, 0)?)
    }

    /// Ends every running drill, for `why` (the daemon stops).
    pub fn end_all(&mut self, why: &str, unix_ms_at_boot: u64) -> Vec<EventRecord> {
        self.stopping = true;
        let now = guard_common::monotonic_ns();
        (0..self.running.len())
            .map(|_| {
                self.end(0, "ended", why.to_string(), now, unix_ms_at_boot)
                    .1
            })
            .collect()
    }

    /// Whether a drill runs.
    pub fn any(&self) -> bool {
        !self.running.is_empty()
    }

    /// Reads the programs' counts and ends the drills past their deadline, whose scope
    /// left the policy (`scopes`, the policy's scope ids), or whose steady state broke
    /// (`counters`: the scope counters, by id). Returns what happened, as events.
    pub fn tick(
        &mut self,
        scopes: &[(u32, String)],
        counters: &[Counter],
        now_ns: u64,
        unix_ms_at_boot: u64,
    ) -> Vec<EventRecord> {
        let mut events = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            let counts = self
                .counts
                .get(&self.running[i].scope_id, 0)
                .unwrap_or_default();
            let r = &mut self.running[i];
            let first_capped = r.view.capped == 0 && counts.capped != 0;
            counted(&mut r.view, &counts);
            if first_capped {
                let at = unix_ms_at_boot + now_ns / 1_000_000;
                let why = format!("cap reached after {} fault(s)", counts.faulted);
                events.push(event(&r.view, "drill_capped", Some(why), at));
            }
            let ending = if now_ns >= r.deadline_ns {
                Some(("ended", "deadline".to_string()))
            } else if !scopes
                .iter()
                .any(|(id, name)| *id == r.scope_id && *name == r.view.spec.scope)
            {
                Some(("aborted", "its scope left the policy".to_string()))
            } else if !r.cgroups.is_empty()
                && !r
                    .cgroups
                    .iter()
                    .any(|(dir, id)| cgroup_id(dir).is_ok_and(|now| now == *id))
            {
                Some(("aborted", "every workload it targets is gone".to_string()))
            } else {
                r.broken(counters, &counts, now_ns)
                    .map(|why| ("aborted", why))
            };
            match ending {
                Some((state, why)) => {
                    let (_, ev) = self.end(i, state, why, now_ns, unix_ms_at_boot);
                    events.push(ev);
                }
                None => i += 1,
            }
        }
        events
    }

    /// The running drills (their counts read now), then the ended ones, newest first.
    pub fn list(&self) -> Vec<DrillView> {
        self.running
            .iter()
            .map(|r| {
                let mut v = r.view.clone();
                if let Ok(c) = self.counts.get(&r.scope_id, 0) {
                    counted(&mut v, &c);
                }
                v
            })
            .chain(self.ended.iter().cloned())
            .collect()
    }

    /// The running drills with an HTTP check: name and URL.
    pub fn http_checks(&self) -> Vec<(String, String)> {
        self.running
            .iter()
            .filter_map(|r| Some((r.view.spec.name.clone(), r.view.spec.abort.http.clone()?)))
            .collect()
    }

    fn end(
        &mut self,
        i: usize,
        state: &str,
        why: String,
        now_ns: u64,
        unix_ms_at_boot: u64,
    ) -> (DrillView, EventRecord) {
        let r = self.running.remove(i);
        // Turned off, then removed, then counted. A connect that read the drill before
        // the removal may still be faulted within its cap; none after.
        if let Err(e) = self.on.set(r.scope_id, 0, 0) {
            // The programs still check the deadline and the lease.
            log::error!("turning drill {:?} off in DRILL_ON: {e}", r.view.spec.name);
        }
        if let Err(e) = self.conf.remove(&r.scope_id) {
            log::error!("removing drill {:?} from DRILLS: {e}", r.view.spec.name);
        }
        let counts = self.counts.get(&r.scope_id, 0).unwrap_or_default();
        let mut view = r.view;
        counted(&mut view, &counts);
        view.state = state.into();
        view.reason = Some(why.clone());
        let at = unix_ms_at_boot + now_ns / 1_000_000;
        view.ended_unix_ms = Some(at.min(view.deadline_unix_ms));
        let kind = if state == "aborted" {
            "drill_aborted"
        } else {
            "drill_ended"
        };
        let ev = event(&view, kind, Some(why), at);
        log::info!("{}", ev.line());
        self.ended.push_front(view.clone());
        self.ended.truncate(KEEP_ENDED);
        (view, ev)
    }
}

impl Running {
    /// Why the steady state broke, if it did.
    fn broken(
        &mut self,
        counters: &[Counter],
        counts: &DrillCounts,
        now_ns: u64,
    ) -> Option<String> {
        if let Some(why) = self.http_failed.take() {
            return Some(format!("the HTTP check failed: {why}"));
        }
        let abort = &self.view.spec.abort;
        for (id, name, shed, opened) in &self.watched {
            let c = counters.get(*id as usize).copied().unwrap_or_default();
            if abort.on_breaker_open && c.breaker_opened > *opened {
                return Some(format!("a breaker opened in scope {name}"));
            }
            if abort.on_shedding && c.shed > *shed {
                return Some(format!("scope {name} shed {} connection(s)", c.shed - shed));
            }
        }
        let min = abort.min_success_ratio?;
        let target = counters
            .get(self.scope_id as usize)
            .copied()
            .unwrap_or_default();
        // Refused attempts are neither admitted nor shed; blackholed and reset ones are
        // admitted; delayed ones connect.
        let (refused, failed) = match self.view.spec.fault {
            Fault::Refuse => (counts.faulted, counts.faulted),
            Fault::Blackhole => (0, counts.faulted),
            Fault::Delay => (0, 0),
            Fault::Reset => (0, counts.faulted),
        };
        let attempts = target.admitted + target.shed + refused;
        let failures = failed + target.shed;
        self.samples.push_back((now_ns, attempts, failures));
        let window_ns = abort.window_ms * 1_000_000;
        while self.samples.len() > 2 && now_ns.saturating_sub(self.samples[1].0) >= window_ns {
            self.samples.pop_front();
        }
        let (_, a0, f0) = *self.samples.front()?;
        let (da, df) = (attempts - a0.min(attempts), failures - f0.min(failures));
        if da < abort.min_attempts {
            return None;
        }
        let ratio = 1.0 - df as f64 / da as f64;
        (ratio < min).then(|| {
            format!(
                "the target's success ratio fell to {ratio:.2} ({df} of {da} attempts failed), below {min}"
            )
        })
    }
}

/// The kernel's form of `spec`, drill `serial`, started at `now_ns`.
fn conf(spec: &DrillSpec, serial: u32, now_ns: u64) -> Result<DrillConf, String> {
    if !(0.0..=1.0).contains(&spec.probability) {
        return Err(format!(
            "probability must be in [0, 1] (got {})",
            spec.probability
        ));
    }
    if spec.max_faults.is_none() && spec.max_fraction.is_none() {
        return Err("a drill needs max_faults, max_fraction, or both".into());
    }
    if spec.duration_ms == 0 {
        return Err("a drill needs a duration".into());
    }
    if spec.dst.len() > MAX_DRILL_NETS || spec.ports.len() > MAX_DRILL_PORTS {
        return Err(format!(
            "a drill takes at most {MAX_DRILL_NETS} dst and {MAX_DRILL_PORTS} ports"
        ));
    }
    let mut c = DrillConf {
        serial,
        fault: match spec.fault {
            Fault::Refuse => FAULT_REFUSE,
            Fault::Blackhole => FAULT_BLACKHOLE,
            Fault::Delay => FAULT_DELAY,
            Fault::Reset => FAULT_RESET,
        },
        errno: errno(spec.errno.as_deref())?,
        threshold: (spec.probability * 4_294_967_296.0).round() as u64,
        deadline_ns: now_ns + spec.duration_ms * 1_000_000,
        max_faults: spec.max_faults.unwrap_or(0),
        ..DrillConf::default()
    };
    if let Some(f) = spec.max_fraction {
        if !(f > 0.0 && f <= 1.0) {
            return Err(format!("max_fraction must be in (0, 1] (got {f})"));
        }
        c.max_permille = (f * 1000.0).round().max(1.0) as u32;
        c.window_ns = spec.window_ms.unwrap_or(10_000) * 1_000_000;
    }
    for (i, d) in spec.dst.iter().enumerate() {
        let net: IpNet = d.parse().map_err(|_| format!("dst {d:?} is not a CIDR"))?;
        let net = policy::compile::mapped(&net);
        c.nets[i] = DrillNet::new(
            mapped(std::net::IpAddr::V6(net.addr())),
            net.prefix_len() as u32,
        );
    }
    c.n_nets = spec.dst.len() as u32;
    for (i, p) in spec.ports.iter().enumerate() {
        let bad = || format!("ports: {p:?} is not a port or range");
        let (a, b) = p.split_once('-').unwrap_or((p, p));
        let (first, last) = (
            a.parse::<u16>().map_err(|_| bad())?,
            b.parse::<u16>().map_err(|_| bad())?,
        );
        c.ports[i] = PortRange { first, last };
    }
    c.n_ports = spec.ports.len() as u32;
    Ok(c)
}

/// The errno value of a refuse fault (ECONNREFUSED when none is named).
fn errno(name: Option<&str>) -> Result<u32, String> {
    let name = name.unwrap_or("ECONNREFUSED");
    policy::errno(name)
        .map(|v| v as u32)
        .ok_or_else(|| format!("unknown errno {name:?}"))
}

/// `view` with the programs' counts `c`.
fn counted(view: &mut DrillView, c: &DrillCounts) {
    (view.attempts, view.faulted, view.capped) = (c.attempts, c.faulted, c.capped);
}

fn event(view: &DrillView, kind: &str, reason: Option<String>, unix_ms: u64) -> EventRecord {
    EventRecord {
        unix_ms,
        kind: kind.into(),
        scope: view.spec.scope.clone(),
        workload: (!view.workloads.is_empty()).then(|| view.workloads.join(", ")),
        drill: Some(view.spec.name.clone()),
        reason,
        ..EventRecord::default()
    }
}
