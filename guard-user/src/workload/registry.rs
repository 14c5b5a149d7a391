//! The workloads the runtimes report, the state of each runtime's connection, and a
//! generation that moves on every change.
use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::{Mutex, MutexGuard, PoisonError},
    time::SystemTime,
};

use tokio::sync::watch;

use super::{Container, Identity, Pod, WorkloadSelector, selector};

/// The pods and containers on this node, kept by the runtimes' event streams. Shared as
/// an `Arc` between the sources that fill it and the readers.
pub struct Registry {
    mount: PathBuf,
    state: Mutex<State>,
    generation: watch::Sender<u64>,
}

#[derive(Default)]
struct State {
    /// By sandbox id.
    pods: BTreeMap<String, Pod>,
    /// By container id.
    containers: BTreeMap<String, Container>,
    /// By source name.
    sources: BTreeMap<&'static str, SourceStatus>,
}

/// A runtime's connection, for logs, stats and metrics. While it is down, the workloads
/// it last reported are kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceStatus {
    /// "containerd" or "docker".
    pub source: &'static str,
    /// The socket it is reached on.
    pub endpoint: PathBuf,
    /// Subscribed to its events and listed its workloads.
    pub connected: bool,
    /// When `connected` last changed (or the source was started).
    pub since: SystemTime,
    /// Why the last connection failed or ended.
    pub last_error: Option<String>,
    /// Failed attempts since it was last connected.
    pub failures: u32,
}

impl Registry {
    /// `mount`: the cgroup2 mount, which workloads' cgroups are relative to.
    pub fn new(mount: PathBuf) -> Registry {
        Registry {
            mount,
            state: Mutex::new(State::default()),
            generation: watch::Sender::new(0),
        }
    }

    pub fn mount(&self) -> &Path {
        &self.mount
    }

    /// Receives the registry's generation, which moves on every change of its workloads
    /// or of a source's status.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    pub fn pods(&self) -> Vec<Pod> {
        self.lock().pods.values().cloned().collect()
    }

    pub(super) fn has_pod(&self, sandbox: &str) -> bool {
        self.lock().pods.contains_key(sandbox)
    }

    pub fn containers(&self) -> Vec<Container> {
        self.lock().containers.values().cloned().collect()
    }

    pub fn sources(&self) -> Vec<SourceStatus> {
        self.lock().sources.values().cloned().collect()
    }

    /// The cgroups `selector` selects, each with the workload it is the cgroup of. Units
    /// are looked up in the cgroup tree at each call.
    pub fn select(&self, selector: &WorkloadSelector) -> BTreeMap<String, Identity> {
        match selector {
            WorkloadSelector::Unit(unit) => selector::units(unit, &self.mount),
            _ => {
                let s = self.lock();
                selector::workloads(selector, s.pods.values(), s.containers.values())
            }
        }
    }

    /// Every pod, replacing those held (a source's full list after a (re)connection; a
    /// test's pods).
    pub fn set_pods(&self, pods: Vec<Pod>) {
        let pods = pods.into_iter().map(|p| (p.sandbox.clone(), p)).collect();
        self.change(|s| std::mem::replace(&mut s.pods, pods) != s.pods);
    }

    pub(super) fn put_pod(&self, pod: Pod) {
        self.change(|s| s.pods.insert(pod.sandbox.clone(), pod.clone()) != Some(pod));
    }

    pub(super) fn remove_pod(&self, sandbox: &str) {
        self.change(|s| s.pods.remove(sandbox).is_some());
    }

    pub(super) fn set_containers(&self, containers: Vec<Container>) {
        let containers = containers.into_iter().map(|c| (c.id.clone(), c)).collect();
        self.change(|s| std::mem::replace(&mut s.containers, containers) != s.containers);
    }

    pub(super) fn put_container(&self, container: Container) {
        self.change(|s| {
            s.containers.insert(container.id.clone(), container.clone()) != Some(container)
        });
    }

    pub(super) fn remove_container(&self, id: &str) {
        self.change(|s| s.containers.remove(id).is_some());
    }

    /// Records `source` as reached at `endpoint` (`error` None) or not.
    pub(super) fn source_state(
        &self,
        source: &'static str,
        endpoint: &Path,
        error: Option<String>,
    ) {
        self.change(|s| {
            let now = SystemTime::now();
            let entry = s.sources.entry(source).or_insert_with(|| SourceStatus {
                source,
                endpoint: endpoint.to_path_buf(),
                connected: false,
                since: now,
                last_error: None,
                failures: 0,
            });
            let connected = error.is_none();
            if entry.connected != connected {
                entry.since = now;
            }
            entry.connected = connected;
            match error {
                None => entry.failures = 0,
                Some(e) => {
                    entry.failures += 1;
                    entry.last_error = Some(e);
                }
            }
            true
        });
    }

    /// Applies `f` and moves the generation if it says something changed.
    fn change(&self, f: impl FnOnce(&mut State) -> bool) {
        let mut s = self.lock();
        if f(&mut s) {
            drop(s);
            self.generation.send_modify(|g| *g += 1);
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
