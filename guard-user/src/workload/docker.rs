//! Containers from a Docker Engine API (Docker's, or Podman's `podman system service`):
//! the running ones listed, then kept by the API's event stream, each event of a
//! container followed by a look at its state. A container's cgroup is its first
//! process's, as /proc shows it.
use std::{
    collections::HashMap,
    convert::Infallible,
    path::PathBuf,
    sync::Arc,
    time::{SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, bail};
use bollard::{
    API_DEFAULT_VERSION, Docker,
    errors::Error,
    query_parameters::{EventsOptions, ListContainersOptions},
};
use futures_util::StreamExt;

use super::{
    Container, Registry, cgroup_of_pid,
    reconnect::{self, Link},
};

/// Seconds a request may take before an answer begins (the event stream then runs on).
const REQUEST_TIMEOUT: u64 = 30;

/// Keeps `registry`'s containers those running under the Docker Engine API at `socket`,
/// until the task is dropped.
pub async fn follow(registry: Arc<Registry>, socket: PathBuf) {
    reconnect::follow(registry, "docker", socket, session).await
}

/// One connection: list, then apply the events since just before the list (the API
/// replays them), until the stream fails.
async fn session(link: Arc<Link>) -> anyhow::Result<Infallible> {
    let docker = Docker::connect_with_unix(
        &link.endpoint.to_string_lossy(),
        REQUEST_TIMEOUT,
        API_DEFAULT_VERSION,
    )?
    .negotiate_version()
    .await
    .context("connecting")?;
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let listed = docker
        .list_containers(Some(ListContainersOptions::default()))
        .await
        .context("listing containers")?;
    let mut containers = Vec::new();
    for summary in listed {
        if let Some(c) = inspect(&docker, summary.id.as_deref().unwrap_or_default()).await? {
            containers.push(c);
        }
    }
    let count = containers.len();
    link.registry.set_containers(containers);
    let filters = HashMap::from([("type".to_string(), vec!["container".to_string()])]);
    let mut events = docker.events(Some(EventsOptions {
        since: Some(since.to_string()),
        until: None,
        filters: Some(filters),
    }));
    link.up(count, "containers");
    while let Some(event) = events.next().await {
        let event = event.context("event stream")?;
        // Docker's and Podman's APIs name the actions differently: whatever the action,
        // the container's state now decides.
        let Some(id) = event.actor.and_then(|a| a.id) else {
            continue;
        };
        match inspect(&docker, &id).await? {
            Some(c) => link.registry.put_container(c),
            None => link.registry.remove_container(&id),
        }
    }
    bail!("event stream ended")
}

/// Container `id` while it runs; None once it is gone or stopped.
async fn inspect(docker: &Docker, id: &str) -> anyhow::Result<Option<Container>> {
    let c = match docker.inspect_container(id, None).await {
        Ok(c) => c,
        Err(Error::DockerResponseServerError {
            status_code: 404, ..
        }) => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("inspecting container {id}")),
    };
    let state = c.state.unwrap_or_default();
    let pid = state.pid.unwrap_or(0);
    if state.running != Some(true) || pid <= 0 {
        return Ok(None);
    }
    Ok(Some(Container {
        id: c.id.unwrap_or_else(|| id.to_string()),
        name: c
            .name
            .unwrap_or_default()
            .trim_start_matches('/')
            .to_string(),
        labels: c
            .config
            .and_then(|c| c.labels)
            .unwrap_or_default()
            .into_iter()
            .collect(),
        cgroup: cgroup_of_pid(pid),
    }))
}
