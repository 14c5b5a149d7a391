//! Kubernetes pods from containerd: their identity from its CRI service (what kubelet
//! gave in each `PodSandboxConfig`), changes from containerd's own event service (CRI v1
//! `GetContainerEvents` is not served by containerd 1.6), both on containerd's socket.
//! A sandbox's `/tasks/start` event is seen when its pause process starts, before
//! RunPodSandbox returns to kubelet and so before any app container of the pod exists.
use std::{
    collections::HashMap,
    convert::Infallible,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use anyhow::{Context, bail};
use containerd_client::{
    events::{ContainerDelete, TaskExit, TaskStart},
    services::v1::{
        GetContainerRequest, SubscribeRequest, containers_client::ContainersClient,
        events_client::EventsClient,
    },
    tonic::{Code, Request, transport::Channel},
    types::Envelope,
    with_namespace,
};
use k8s_cri::v1::{
    ListPodSandboxRequest, PodSandboxState, PodSandboxStatusRequest,
    runtime_service_client::RuntimeServiceClient,
};
use prost::Message;

use super::{
    Pod, Registry, cgroup_of_pid,
    reconnect::{self, Link},
    systemd,
};

/// containerd's namespace for what its CRI plugin runs.
pub const NAMESPACE: &str = "k8s.io";
/// The label containerd's CRI plugin puts on a sandbox's container: "sandbox" (an app
/// container's is "container").
const KIND_LABEL: &str = "io.cri-containerd.kind";
/// The labels kubelet adds to a pod's own in `PodSandboxConfig.labels`
/// (`kubetypes.KubernetesPod{Name,Namespace,UID}Label`).
const KUBELET_LABELS: &[&str] = &[
    "io.kubernetes.pod.name",
    "io.kubernetes.pod.namespace",
    "io.kubernetes.pod.uid",
];
/// A sandbox's task starts before the CRI plugin files the sandbox: the longest wait for
/// it to be filed after its `/tasks/start`.
const FILING: Duration = Duration::from_secs(2);

/// Keeps `registry`'s pods those of containerd at `socket`, until the task is dropped.
pub async fn follow(registry: Arc<Registry>, socket: PathBuf) {
    reconnect::follow(registry, "containerd", socket, session).await
}

/// One connection: subscribe, list, then apply each event until the stream fails.
async fn session(link: Arc<Link>) -> anyhow::Result<Infallible> {
    let channel = containerd_client::connect(&link.endpoint)
        .await
        .context("connecting")?;
    let mut c = Client::new(channel, link.registry.mount());
    // containerd answers a subscription with its first event (no headers before it), so
    // the subscription is awaited apart while the pods are listed.
    let mut events = EventsClient::new(c.channel.clone());
    let request = SubscribeRequest {
        filters: ["/tasks/start", "/tasks/exit", "/containers/delete"]
            .iter()
            .map(|t| format!("namespace=={NAMESPACE},topic==\"{t}\""))
            .collect(),
    };
    // A JoinSet: dropped with the session, it aborts a subscription still waiting.
    let mut subscribed = tokio::task::JoinSet::new();
    subscribed.spawn(async move { events.subscribe(request).await });
    let pods = c.list().await.context("listing pod sandboxes")?;
    let listed = pods.len();
    link.registry.set_pods(pods);
    link.up(listed, "pods");
    let mut events = subscribed
        .join_next()
        .await
        .context("subscription task")??
        .context("subscribing to events")?
        .into_inner();
    // The subscription took effect before its first event: a list now holds every change
    // the stream does not bring.
    link.registry
        .set_pods(c.list().await.context("listing pod sandboxes")?);
    loop {
        let Some(envelope) = events.message().await.context("event stream")? else {
            bail!("event stream ended");
        };
        c.apply(&link.registry, &envelope).await?;
    }
}

struct Client {
    channel: Channel,
    cri: RuntimeServiceClient<Channel>,
    containers: ContainersClient<Channel>,
    mount: PathBuf,
}

impl Client {
    fn new(channel: Channel, mount: &Path) -> Client {
        Client {
            cri: RuntimeServiceClient::new(channel.clone()),
            containers: ContainersClient::new(channel.clone()),
            channel,
            mount: mount.to_path_buf(),
        }
    }

    /// Every pod sandbox the CRI plugin holds, whatever its state.
    async fn list(&mut self) -> anyhow::Result<Vec<Pod>> {
        let items = self
            .cri
            .list_pod_sandbox(ListPodSandboxRequest { filter: None })
            .await?
            .into_inner()
            .items;
        let mut pods = Vec::new();
        for sandbox in items {
            // A sandbox removed since the list is left out.
            if let Some(pod) = self.pod(&sandbox.id).await? {
                pods.push(pod);
            }
        }
        Ok(pods)
    }

    async fn apply(&mut self, registry: &Registry, envelope: &Envelope) -> anyhow::Result<()> {
        let Some(event) = &envelope.event else {
            return Ok(());
        };
        let body = event.value.as_slice();
        match envelope.topic.as_str() {
            "/tasks/start" => {
                let id = TaskStart::decode(body)?.container_id;
                if self.is_sandbox(&id).await? {
                    // Unfiled past FILING: the session ends, and the next one lists every
                    // sandbox again, so that the pod is selected once CRI files it.
                    match self.filed(&id).await? {
                        Some(pod) => registry.put_pod(pod),
                        None => bail!(
                            "sandbox {id} started but CRI has not filed it after {FILING:?}; listing the pods again"
                        ),
                    }
                }
            }
            "/tasks/exit" => {
                let exit = TaskExit::decode(body)?;
                // An exec's exit, or an app container's: not a sandbox's state.
                if exit.id == exit.container_id && registry.has_pod(&exit.container_id) {
                    match self.pod(&exit.container_id).await? {
                        Some(pod) => registry.put_pod(pod),
                        None => registry.remove_pod(&exit.container_id),
                    }
                }
            }
            "/containers/delete" => registry.remove_pod(&ContainerDelete::decode(body)?.id),
            _ => {}
        }
        Ok(())
    }

    /// Whether container `id` of the k8s.io namespace is a pod's sandbox.
    async fn is_sandbox(&mut self, id: &str) -> anyhow::Result<bool> {
        let request = with_namespace!(GetContainerRequest { id: id.to_string() }, NAMESPACE);
        match self.containers.get(request).await {
            Ok(r) => Ok(r
                .into_inner()
                .container
                .is_some_and(|c| c.labels.get(KIND_LABEL).is_some_and(|k| k == "sandbox"))),
            Err(s) if s.code() == Code::NotFound => Ok(false),
            Err(s) => Err(s.into()),
        }
    }

    /// Sandbox `id` once the CRI plugin has filed it, which it does when RunPodSandbox
    /// is about to return, after the sandbox's task has started; None after FILING.
    async fn filed(&mut self, id: &str) -> anyhow::Result<Option<Pod>> {
        let deadline = tokio::time::Instant::now() + FILING;
        let mut wait = Duration::from_millis(1);
        loop {
            if let Some(pod) = self.pod(id).await? {
                return Ok(Some(pod));
            }
            if tokio::time::Instant::now() + wait > deadline {
                return Ok(None);
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_millis(4));
        }
    }

    /// Sandbox `id` as CRI describes it; None when CRI has no such sandbox.
    async fn pod(&mut self, id: &str) -> anyhow::Result<Option<Pod>> {
        let request = PodSandboxStatusRequest {
            pod_sandbox_id: id.to_string(),
            verbose: true,
        };
        let response = match self.cri.pod_sandbox_status(request).await {
            Ok(r) => r.into_inner(),
            Err(s) if s.code() == Code::NotFound => return Ok(None),
            Err(s) => return Err(s.into()),
        };
        let Some(status) = response.status else {
            return Ok(None);
        };
        let meta = status.metadata.unwrap_or_default();
        let info = SandboxInfo::of(&response.info);
        let ready = status.state == PodSandboxState::SandboxReady as i32;
        let labels = status
            .labels
            .into_iter()
            .filter(|(k, _)| !KUBELET_LABELS.contains(&k.as_str()))
            .collect();
        Ok(Some(Pod {
            cgroup: pod_cgroup(&self.mount, &info, ready),
            sandbox: status.id,
            namespace: meta.namespace,
            name: meta.name,
            uid: meta.uid,
            labels,
            annotations: status.annotations.into_iter().collect(),
            ready,
        }))
    }
}

/// What containerd's verbose PodSandboxStatus says in `info["info"]` (JSON of its
/// `SandboxInfo`) that CRI's own fields do not: the pause process and the config's
/// `linux.cgroup_parent`.
#[derive(Debug, Default, serde::Deserialize)]
struct SandboxInfo {
    #[serde(default)]
    pid: i64,
    #[serde(default)]
    config: Config,
}

#[derive(Debug, Default, serde::Deserialize)]
struct Config {
    #[serde(default)]
    linux: Linux,
}

#[derive(Debug, Default, serde::Deserialize)]
struct Linux {
    #[serde(default)]
    cgroup_parent: String,
}

impl SandboxInfo {
    fn of(info: &HashMap<String, String>) -> SandboxInfo {
        info.get("info")
            .and_then(|j| {
                serde_json::from_str(j)
                    .inspect_err(|e| log::debug!("containerd: sandbox info: {e}"))
                    .ok()
            })
            .unwrap_or_default()
    }
}

/// The pod's cgroup below `mount`, as it exists on this host: the parent of the running
/// pause process's cgroup (as this process's cgroup namespace shows it), else kubelet's
/// `cgroup_parent` read with either cgroup driver. Never the root: a sandbox given no
/// parent has no cgroup of its pod's own.
fn pod_cgroup(mount: &Path, info: &SandboxInfo, ready: bool) -> Option<String> {
    let from_pid = (ready && info.pid > 0)
        .then(|| cgroup_of_pid(info.pid))
        .flatten()
        .and_then(|own| own.rsplit_once('/').map(|(parent, _)| parent.to_string()));
    [
        from_pid,
        systemd::cgroup_dir(&info.config.linux.cgroup_parent),
    ]
    .into_iter()
    .flatten()
    .find(|rel| !rel.is_empty() && mount.join(rel).is_dir())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sandbox_info_gives_the_cgroup_parent_and_pid() {
        let info = HashMap::from([(
            "info".to_string(),
            r#"{"pid":4242,"processStatus":"running","config":{"metadata":{"name":"orders-1"},"linux":{"cgroup_parent":"kubepods-pod1.slice","security_context":{}}},"runtimeSpec":{}}"#
                .to_string(),
        )]);
        let i = SandboxInfo::of(&info);
        assert_eq!(i.pid, 4242);
        assert_eq!(i.config.linux.cgroup_parent, "kubepods-pod1.slice");
        let none = SandboxInfo::of(&HashMap::new());
        assert_eq!(
            (none.pid, none.config.linux.cgroup_parent.as_str()),
            (0, "")
        );
    }

    #[test]
    fn the_pod_cgroup_is_one_that_exists_and_never_the_root() {
        let mount = std::env::temp_dir().join(format!("connguard-podcg-{}", std::process::id()));
        std::fs::create_dir_all(mount.join("kubepods/besteffort/pod1")).unwrap();
        let info = |parent: &str| SandboxInfo {
            pid: 0,
            config: Config {
                linux: Linux {
                    cgroup_parent: parent.into(),
                },
            },
        };
        let got = [
            pod_cgroup(&mount, &info("/kubepods/besteffort/pod1"), true),
            pod_cgroup(&mount, &info("/kubepods/besteffort/pod2"), true),
            pod_cgroup(&mount, &info(""), true),
            pod_cgroup(&mount, &info("/"), true),
        ];
        std::fs::remove_dir_all(&mount).unwrap();
        assert_eq!(
            got,
            [
                Some("kubepods/besteffort/pod1".to_string()),
                None,
                None,
                None
            ]
        );
    }
}
