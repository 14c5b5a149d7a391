//! Workloads on this node, as operators name them, and their cgroups: Kubernetes pods
//! (from containerd's CRI and its event stream), containers (from the Docker Engine API
//! of Docker or Podman, and its event stream) and systemd units (from the cgroup tree as
//! systemd lays it out). A [`Registry`] holds the pods and containers the runtimes
//! report, each with its cgroup v2 directory; [`Registry::select`] gives the cgroups a
//! [`WorkloadSelector`] selects, and [`Registry::subscribe`] wakes a caller on every
//! change, so that a pod is governed when its sandbox starts, before its app containers
//! run.
//!
//! This module names nothing else of the crate, so that the integration tests can build
//! it alone against real runtimes.
use std::collections::BTreeMap;

pub mod annotations;
pub mod containerd;
pub mod docker;
pub mod labels;
mod reconnect;
pub mod registry;
pub mod selector;
pub mod systemd;

pub use registry::Registry;
pub use selector::{Identity, WorkloadSelector};

/// A Kubernetes pod on this node: one of its sandboxes, as kubelet described it to the
/// runtime through CRI (`PodSandboxConfig`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pod {
    /// The sandbox's id in the runtime.
    pub sandbox: String,
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// The pod's labels, without those kubelet adds for the runtime (`io.kubernetes.*`).
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    /// The sandbox is running (CRI's SANDBOX_READY).
    pub ready: bool,
    /// The pod's cgroup below the cgroup2 mount (every container of the pod is below
    /// it); None while no such directory exists.
    pub cgroup: Option<String>,
}

/// A running container of a Docker Engine API (Docker or Podman).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Container {
    pub id: String,
    /// Its name, without the API's leading '/'.
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// Its cgroup below the cgroup2 mount, from its first process's /proc/PID/cgroup.
    pub cgroup: Option<String>,
}

/// The cgroup v2 path below the mount of process `pid`, from the `0::` line of
/// /proc/PID/cgroup; None when the process is gone.
fn cgroup_of_pid(pid: i64) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let line = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    Some(line.trim_start_matches('/').to_string())
}

/// A map of labels or annotations from pairs.
pub fn string_map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}
