//! The workloads a policy's pod and container selectors name: the runtimes followed for
//! them, and the policy in force kept resolved against what they report
//! (`policy::workloads::resolve`).
//!
//! A change the runtimes report (a pod's sandbox started, a container gone), or a
//! unit's cgroup created, resolves the policy file's policy again. When its scopes stay
//! the same, the cgroups that joined a scope are governed at once, as a cgroup created
//! in a watched one is, and those that left one go with a walk. When the scope of an
//! annotated pod comes or goes, the resolved policy is applied as a reload applies one,
//! counts kept. A pod's cgroup is so governed when its sandbox starts, before its app
//! containers run below it.
use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
    sync::{Arc, Mutex},
    time::{Duration, Instant, UNIX_EPOCH},
};

use anyhow::Context;
use connguard_api::stats::RuntimeStatus;
use tokio::sync::Notify;

use super::{Daemon, lock};
use crate::{
    cli::RuntimeSockets,
    enforce::scopes,
    policy::{
        Policy,
        workloads::{resolve, same_scopes, sources},
    },
    workload::{self, Identity, Registry, WorkloadSelector, systemd},
};

/// How long the start waits for each runtime it follows to list its workloads, so that
/// the first policy governs them; one that has not answered by then is retried in the
/// background, and its workloads are governed when it lists them.
const START_WAIT: Duration = Duration::from_secs(5);
/// How long a drill's start waits for a runtime it begins following to list its
/// workloads: well within the client's wait for the answer.
const DRILL_LISTING: Duration = Duration::from_secs(2);

pub struct Workloads {
    registry: Arc<Registry>,
    sockets: RuntimeSockets,
    /// Runs the runtimes' clients and the reaction to their changes.
    runtime: tokio::runtime::Runtime,
    /// The runtimes followed so far ("containerd", "docker"): once followed, for the
    /// daemon's life.
    followed: Mutex<BTreeSet<&'static str>>,
    /// The policy file's policy in force, which `resolve` makes the one in force.
    base: Mutex<Arc<Policy>>,
    /// Wakes the reaction to changes for what the runtimes do not report: units.
    again: Arc<Notify>,
    /// Warnings of the resolution already logged (each is logged when it appears).
    logged: Mutex<BTreeSet<String>>,
}

impl Workloads {
    /// Follows the runtimes `base` needs, and waits (START_WAIT at most) until each
    /// has listed its workloads or failed once.
    pub fn start(sockets: RuntimeSockets, mount: &Path, base: Policy) -> anyhow::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("workloads")
            .enable_all()
            .build()
            .context("starting the workloads' tokio runtime")?;
        let w = Workloads {
            registry: Arc::new(Registry::new(mount.to_path_buf())),
            sockets,
            runtime,
            followed: Mutex::default(),
            base: Mutex::new(Arc::new(base)),
            again: Arc::default(),
            logged: Mutex::default(),
        };
        let base = w.base();
        let started = w.follow(&base);
        w.wait_listed(&started, START_WAIT);
        Ok(w)
    }

    /// Starts following the runtimes `policy` needs that are not followed yet; returns
    /// those it started.
    pub fn follow(&self, policy: &Policy) -> Vec<&'static str> {
        let (pods, containers) = sources(policy);
        let named = |kind: &str| {
            let scopes: Vec<&str> = policy
                .scopes
                .iter()
                .filter(|s| s.workloads.iter().any(|w| w.kind() == kind))
                .map(|s| s.name.as_str())
                .collect();
            format!("the {kind} selectors of scope(s) {}", scopes.join(", "))
        };
        self.follow_sources(pods, containers, named)
    }

    /// Starts following containerd (`pods`) and the Docker Engine API (`containers`)
    /// when not followed yet, saying in the log why (`why`, given "pod" or
    /// "container"); returns those it started.
    fn follow_sources(
        &self,
        pods: bool,
        containers: bool,
        why: impl Fn(&str) -> String,
    ) -> Vec<&'static str> {
        let mut followed = lock(&self.followed);
        let mut started = Vec::new();
        for (needed, source, kind) in [
            (pods, "containerd", "pod"),
            (containers, "docker", "container"),
        ] {
            if !needed || !followed.insert(source) {
                continue;
            }
            let (registry, socket) = (self.registry.clone(), self.socket(source).to_path_buf());
            log::info!(
                "following {source} at {} for {}",
                socket.display(),
                why(kind)
            );
            match source {
                "containerd" => self
                    .runtime
                    .spawn(workload::containerd::follow(registry, socket)),
                _ => self
                    .runtime
                    .spawn(workload::docker::follow(registry, socket)),
            };
            started.push(source);
        }
        started
    }

    /// Waits (`limit` at most) until each of `sources` has listed its workloads or
    /// failed once.
    fn wait_listed(&self, sources: &[&str], limit: Duration) {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline
            && !sources.iter().all(|source| {
                self.registry
                    .sources()
                    .iter()
                    .any(|s| s.source == *source && (s.connected || s.failures > 0))
            })
        {
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The cgroups each of `selectors` selects on this node now, each with its
    /// workload (a drill's target). The runtimes pod and container selectors need are
    /// followed first when they are not yet (for the daemon's life, as for a policy);
    /// one that cannot be reached is an error.
    pub fn select(
        &self,
        selectors: &[WorkloadSelector],
    ) -> Result<Vec<BTreeMap<String, Identity>>, String> {
        let needs = |kind: &str| selectors.iter().any(|s| s.kind() == kind);
        let started = self.follow_sources(needs("pod"), needs("container"), |kind| {
            format!("a drill's {kind} selector")
        });
        self.wait_listed(&started, DRILL_LISTING);
        for (kind, source) in [("pod", "containerd"), ("container", "docker")] {
            let status = self
                .registry
                .sources()
                .into_iter()
                .find(|s| s.source == source);
            if needs(kind) && !status.as_ref().is_some_and(|s| s.connected) {
                let why = status
                    .and_then(|s| s.last_error)
                    .unwrap_or_else(|| "not connected".into());
                return Err(format!(
                    "{kind} selectors need {source} at {}: {why}",
                    self.socket(source).display()
                ));
            }
        }
        Ok(selectors.iter().map(|s| self.registry.select(s)).collect())
    }

    fn socket(&self, source: &str) -> &Path {
        match source {
            "containerd" => &self.sockets.containerd_socket,
            _ => &self.sockets.docker_socket,
        }
    }

    /// The cgroup2 mount the workloads' cgroups are named below.
    pub fn mount(&self) -> &Path {
        self.registry.mount()
    }

    pub fn base(&self) -> Arc<Policy> {
        lock(&self.base).clone()
    }

    /// Makes `base` the policy file's policy in force (a reload applied it).
    pub fn set_base(&self, base: Policy) {
        *lock(&self.base) = Arc::new(base);
    }

    /// `base` resolved against the workloads on the node now; the resolution's new
    /// warnings are logged.
    pub fn resolve(&self, base: &Policy) -> Policy {
        let policy = resolve(base, &self.registry);
        let now: BTreeSet<String> = policy
            .scopes
            .iter()
            .flat_map(|s| {
                s.warnings
                    .iter()
                    .map(move |w| format!("scope {}: {w}", s.name))
            })
            .collect();
        let mut logged = lock(&self.logged);
        for w in now.difference(&logged) {
            log::warn!("{w}");
        }
        *logged = now;
        policy
    }

    /// The runtimes followed, for `stats`.
    pub fn runtimes(&self) -> Vec<RuntimeStatus> {
        self.registry
            .sources()
            .into_iter()
            .map(|s| RuntimeStatus {
                source: s.source.to_string(),
                endpoint: s.endpoint.display().to_string(),
                connected: s.connected,
                since_unix_ms: s
                    .since
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64),
                last_error: s.last_error,
                failures: s.failures,
            })
            .collect()
    }

    /// The runtimes followed and their state, for the daemon's "ready" line: "" for
    /// none.
    pub fn describe(&self) -> String {
        let runtimes: Vec<String> = self
            .runtimes()
            .iter()
            .map(|r| match (&r.last_error, r.connected) {
                (_, true) => format!("{} at {} (connected)", r.source, r.endpoint),
                (Some(e), false) => format!("{} at {} (unreachable: {e})", r.source, r.endpoint),
                (None, false) => format!("{} at {} (connecting)", r.source, r.endpoint),
            })
            .collect();
        if runtimes.is_empty() {
            String::new()
        } else {
            format!(", runtimes: {}", runtimes.join(", "))
        }
    }

    /// Runs `changed` (blocking) after each change of the workloads, one run at a
    /// time: changes made while it runs make one more run.
    pub fn on_change(&self, changed: impl Fn() + Send + Sync + 'static) {
        let mut events = self.registry.subscribe();
        let again = self.again.clone();
        let changed = Arc::new(changed);
        self.runtime.spawn(async move {
            loop {
                tokio::select! {
                    r = events.changed() => if r.is_err() { return },
                    _ = again.notified() => {}
                }
                let c = changed.clone();
                if let Err(e) = tokio::task::spawn_blocking(move || c()).await {
                    log::error!("reacting to the workloads' changes: {e}");
                }
            }
        });
    }

    /// A cgroup was created at `dir`: when the policy names units and it may be one,
    /// the policy is resolved again (the walk that governs it decides from its path
    /// alone; the resolution names it in stats and warnings).
    pub fn cgroup_created(&self, dir: &Path) {
        let unit_like = dir
            .file_name()
            .is_some_and(|n| systemd::is_cgroup_unit(&n.to_string_lossy()));
        let names_units = self.base().scopes.iter().any(|s| {
            s.workloads
                .iter()
                .any(|w| matches!(w, WorkloadSelector::Unit(_)))
        });
        if unit_like && names_units {
            self.again.notify_one();
        }
    }
}

impl Daemon {
    /// Resolves the policy file's policy against the workloads now, and governs what it
    /// selects; an error is logged, and the next change or reload tries again.
    pub(super) fn workloads_changed(&self) {
        let _turn = lock(&self.reloads);
        let policy = self.workloads.resolve(&self.workloads.base());
        if let Err(e) = self.govern_resolved(policy) {
            log::warn!("governing the workloads' cgroups: {e:#}; the next change tries again");
        }
    }

    fn govern_resolved(&self, policy: Policy) -> anyhow::Result<()> {
        let (Some(old), root) = ({
            let g = self.programs.generations();
            (g.policy(), g.cgroup_root())
        }) else {
            return Ok(());
        };
        if !same_scopes(&old, &policy) {
            let came: Vec<&str> = scope_names(&policy)
                .difference(&scope_names(&old))
                .copied()
                .collect();
            let went: Vec<&str> = scope_names(&old)
                .difference(&scope_names(&policy))
                .copied()
                .collect();
            log::info!(
                "the workloads' scopes changed (new: {}; gone: {}): applying the policy again, counts kept",
                list(&came),
                list(&went)
            );
            let tree = scopes::walk(&root, &policy)?;
            self.apply(policy, tree)?;
            return self.rescan();
        }
        let (joined, left) = {
            let (before, after) = (members(&old), members(&policy));
            let joined: Vec<(String, String)> = after.difference(&before).cloned().collect();
            let left: Vec<(String, String)> = before.difference(&after).cloned().collect();
            (joined, left)
        };
        for (scope, rel) in &left {
            log::info!("scope {scope}: no longer selects {rel}");
        }
        for (scope, rel) in &joined {
            let who = policy
                .scopes
                .iter()
                .find(|s| &s.name == scope)
                .and_then(|s| s.selector.identity(rel))
                .map_or_else(String::new, |w| format!("{w} at "));
            log::info!("scope {scope}: selects {who}{rel}");
        }
        self.programs.generations().reselect(policy)?;
        for (_, rel) in &joined {
            self.cgroup_created(&root.join(rel))?;
        }
        if !left.is_empty() {
            self.rescan()?;
        }
        Ok(())
    }

    /// Gives the ids of annotated pods' scopes that are gone back for new names, once
    /// their counters count no connection.
    pub(super) fn reclaim_ids(&self) {
        let (scopes, rules) = self.programs.generations().ids().retired();
        if scopes.is_empty() && rules.is_empty() {
            return;
        }
        let (scopes, rules) = lock(&self.counts).counters.clear_retired(&scopes, &rules);
        if !scopes.is_empty() || !rules.is_empty() {
            self.programs.generations().ids_mut().reuse(&scopes, &rules);
        }
    }
}

fn scope_names(p: &Policy) -> BTreeSet<&str> {
    p.scopes.iter().map(|s| s.name.as_str()).collect()
}

fn list(names: &[&str]) -> String {
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

/// (scope, cgroup) of every cgroup a workload selector of `p` resolved to.
fn members(p: &Policy) -> BTreeSet<(String, String)> {
    p.scopes
        .iter()
        .flat_map(|s| {
            s.selector
                .resolved()
                .keys()
                .map(|rel| (s.name.clone(), rel.clone()))
        })
        .collect()
}
