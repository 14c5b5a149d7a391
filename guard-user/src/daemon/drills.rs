//! Drills, wired: `drill start`, `stop` and `list` over the control socket, the job
//! that ends them (enforce::drills::Drills::tick), `drill_egress` attached while a
//! blackhole or delay drill runs, and the HTTP checks.
use std::{
    collections::BTreeSet,
    sync::{Arc, Mutex},
    time::Duration,
};

use connguard_api::{
    control::Reply,
    drill::{DrillSpec, DrillsReply},
};
use guard_common::{Counter, drill::DrillCgroup};
use http_body_util::Empty;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};

use super::{Daemon, lock};
use crate::{
    enforce::{
        drill_target,
        drills::{Drills, Target, TargetCgroup},
        scopes,
    },
    host::cgroup::cgroup_id,
    policy,
    report::events::unix_ms_at_boot,
};

/// How often the drills' steady state is read: a drill is ended within this (and the
/// read) of a broken condition.
pub const DRILL_POLL: Duration = Duration::from_millis(100);
/// How often a drill's HTTP check runs, and how long it waits for an answer.
const HTTP_EVERY: Duration = Duration::from_millis(500);
const HTTP_TIMEOUT: Duration = Duration::from_millis(400);

impl Daemon {
    pub(super) fn drill_start(&self, mut spec: DrillSpec) -> Reply {
        let workloads = match self.drill_workloads(&mut spec) {
            Ok(w) => w,
            Err(why) => return Reply::error(format!("drill {:?}: {why}", spec.name)),
        };
        let scopes = self.policy_scopes();
        let Some(scope_id) = scopes
            .iter()
            .find(|(_, n)| *n == spec.scope)
            .map(|(id, _)| *id)
        else {
            return Reply::error(format!(
                "drill {:?}: no scope {:?} in the policy in force",
                spec.name, spec.scope
            ));
        };
        let (name, http) = (spec.name.clone(), spec.abort.http.clone());
        // A drill that drops packets is set only once `drill_egress` is attached: else
        // its marked sockets' SYNs would leave.
        let drops = spec.fault.drops_packets();
        if drops {
            lock(&self.drills).starting(true);
            if let Err(e) = self.sync_drill_egress() {
                lock(&self.drills).starting(false);
                self.detach_unused_egress();
                return Reply::error(format!("drill {name:?}: attaching drill_egress: {e:#}"));
            }
        }
        let counters = self.scope_counters();
        let started = {
            let mut drills = lock(&self.drills);
            if drops {
                drills.starting(false);
            }
            drills.start(
                spec,
                Target {
                    scope_id,
                    workloads,
                    scopes: &scopes,
                    counters: &counters,
                    now_ns: guard_common::monotonic_ns(),
                    unix_ms_at_boot: unix_ms_at_boot(),
                },
            )
        };
        let (view, event) = match started {
            Ok(s) => s,
            Err(why) => {
                self.detach_unused_egress();
                return Reply::error(format!("drill {name:?}: {why}"));
            }
        };
        log::info!("{}", event.line());
        lock(&self.events).push_own(event);
        self.drill_started();
        if let Some(url) = http {
            spawn_http_check(self.drills.clone(), name, url);
        }
        Reply::Drills(DrillsReply { drills: vec![view] })
    }

    pub(super) fn drill_stop(&self, name: &str) -> Reply {
        let stopped =
            lock(&self.drills).stop(name, guard_common::monotonic_ns(), unix_ms_at_boot());
        match stopped {
            Ok((view, event)) => {
                lock(&self.events).push_own(event);
                self.detach_unused_egress();
                Reply::Drills(DrillsReply { drills: vec![view] })
            }
            Err(why) => Reply::error(why),
        }
    }

    pub(super) fn drill_list(&self) -> DrillsReply {
        DrillsReply {
            drills: lock(&self.drills).list(),
        }
    }

    /// The job: ends the drills whose time is up or whose steady state broke.
    pub(super) fn drill_tick(&self) -> anyhow::Result<()> {
        if !lock(&self.drills).any() {
            return Ok(());
        }
        let attached = self.sync_drill_egress().map_err(|e| format!("{e:#}"));
        if let Some(line) = lock(&self.drills).egress_outcome(attached) {
            log::warn!("{line}");
        }
        let scopes = self.policy_scopes();
        let counters = self.scope_counters();
        let events = lock(&self.drills).tick(
            &scopes,
            &counters,
            guard_common::monotonic_ns(),
            unix_ms_at_boot(),
        );
        if events.is_empty() {
            return Ok(());
        }
        let ended = events.iter().any(|e| e.kind != "drill_capped");
        {
            let mut log = lock(&self.events);
            for e in events {
                log.push_own(e);
            }
        }
        if ended {
            self.detach_unused_egress();
        }
        Ok(())
    }

    /// Ends every running drill: the daemon stops (its programs would fault on until
    /// the drills' lease ran out).
    pub(super) fn end_drills(&self) {
        let events = lock(&self.drills).end_all("the daemon stopped", unix_ms_at_boot());
        let mut log = lock(&self.events);
        for e in events {
            log.push_own(e);
        }
    }

    /// The cgroups a drill that names workloads narrows its scope to, and their
    /// workloads with their paths (none for a drill of a whole scope); `spec`'s scope
    /// is set to the one that governs them. Resolved once, at the start: a workload
    /// that starts later is not the drill's.
    fn drill_workloads(&self, spec: &mut DrillSpec) -> Result<Vec<TargetCgroup>, String> {
        let selectors = policy::drill::workload_selectors(spec)?;
        if selectors.is_empty() {
            return Ok(Vec::new());
        }
        let found: Vec<_> = selectors
            .iter()
            .map(ToString::to_string)
            .zip(self.workloads.select(&selectors)?)
            .collect();
        let policy = self
            .programs
            .generations()
            .policy()
            .ok_or("no policy is in force")?;
        let mount = self.workloads.mount();
        // The scopes of a workload's cgroup and of those below it, as a walk governs
        // them (the walk includes the cgroup itself).
        let scopes_of = |rel: &str| -> BTreeSet<usize> {
            let own = scopes::governing(&policy, rel);
            let tree = scopes::walk_below(&mount.join(rel), rel, own, &policy);
            tree.governed.values().map(|g| g.scope).collect()
        };
        let narrowed = drill_target::narrow(&policy, &spec.scope, &found, scopes_of)?;
        spec.scope = narrowed.scope;
        narrowed
            .cgroups
            .iter()
            .map(|(rel, who)| {
                let dir = mount.join(rel);
                let id = cgroup_id(&dir).map_err(|e| format!("{who}: {e:#}"))?;
                let level = rel.split('/').filter(|s| !s.is_empty()).count() as u32;
                Ok(TargetCgroup {
                    dir,
                    cgroup: DrillCgroup { id, level, _pad: 0 },
                    name: format!("{who} (/{rel})"),
                })
            })
            .collect()
    }

    /// Attaches `drill_egress` to the governed cgroups while a drill drops packets, and
    /// detaches it when none does.
    fn sync_drill_egress(&self) -> anyhow::Result<()> {
        self.programs
            .sync_drill_egress(|| lock(&self.drills).drop_packets())
    }

    /// `sync_drill_egress` after a drill ended or failed to start.
    fn detach_unused_egress(&self) {
        if let Err(e) = self.sync_drill_egress() {
            log::warn!("drills: drill_egress: {e:#}");
        }
    }

    /// The scopes of the policy in force: (id, name).
    fn policy_scopes(&self) -> Vec<(u32, String)> {
        let g = self.programs.generations();
        let (Some(policy), ids) = (g.policy(), g.ids()) else {
            return Vec::new();
        };
        policy
            .scopes
            .iter()
            .filter_map(|s| Some((ids.scope(&s.name)?, s.name.clone())))
            .collect()
    }

    /// The scope counters, by id.
    fn scope_counters(&self) -> Vec<Counter> {
        let (scopes, _) = self.programs.generations().ids().counts();
        lock(&self.counts).counters.scope_counters(scopes)
    }
}

/// GETs `url` every HTTP_EVERY while drill `name` runs; a failure marks it for the
/// next tick.
fn spawn_http_check(drills: Arc<Mutex<Drills>>, name: String, url: String) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        log::error!("drill {name:?}: no runtime for its HTTP check");
        return;
    };
    runtime.spawn(async move {
        let client = Client::builder(TokioExecutor::new()).build_http::<Empty<bytes::Bytes>>();
        let uri: hyper::Uri = match url.parse() {
            Ok(u) => u,
            Err(e) => {
                lock(&drills).http_failed(&name, format!("{url}: {e}"));
                return;
            }
        };
        loop {
            let running = lock(&drills)
                .http_checks()
                .iter()
                .any(|(n, u)| *n == name && *u == url);
            if !running {
                return;
            }
            let answer = tokio::time::timeout(HTTP_TIMEOUT, client.get(uri.clone())).await;
            let failed = match answer {
                Err(_) => Some(format!(
                    "{url}: no answer within {} ms",
                    HTTP_TIMEOUT.as_millis()
                )),
                Ok(Err(e)) => Some(format!("{url}: {e}")),
                Ok(Ok(r)) if !r.status().is_success() => Some(format!("{url}: {}", r.status())),
                Ok(Ok(_)) => None,
            };
            if let Some(why) = failed {
                lock(&drills).http_failed(&name, why);
                return;
            }
            tokio::time::sleep(HTTP_EVERY).await;
        }
    });
}
