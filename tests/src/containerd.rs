//! A containerd of a test's own (Debian's package): its own root, state, socket, runc
//! root and config, the CRI plugin's sandbox image built here and imported, pods run
//! through CRI as kubelet runs them (host network: no CNI), and everything it made
//! removed on drop, also after a failed test: pods, shims, cgroups in every hierarchy,
//! mounts and directories.
use std::{
    collections::BTreeMap,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::Duration,
};

use containerd_client::tonic::{Status, transport::Channel};
use k8s_cri::v1::{
    ContainerConfig, ContainerMetadata, CreateContainerRequest, ImageSpec, LinuxContainerConfig,
    LinuxContainerSecurityContext, LinuxPodSandboxConfig, LinuxSandboxSecurityContext,
    ListPodSandboxRequest, Mount, NamespaceMode, NamespaceOption, PodSandboxConfig,
    PodSandboxMetadata, RemovePodSandboxRequest, RunPodSandboxRequest, StartContainerRequest,
    StopPodSandboxRequest, VersionRequest, runtime_service_client::RuntimeServiceClient,
};

use crate::runtimes;

/// The image of every sandbox and container here.
pub const IMAGE: &str = "connguard.test/pause:1";

/// A running containerd and the pods a test made through it.
pub struct Containerd {
    pub dir: PathBuf,
    pub socket: PathBuf,
    /// Below the cgroup2 mount (and each v1 hierarchy's root): each pod's cgroup is
    /// `POD_ROOT/pod<uid>`.
    pub pod_root: String,
    child: Option<Child>,
    rt: tokio::runtime::Runtime,
}

/// What kubelet knows of a pod and hands to the runtime.
#[derive(Debug, Clone, Default)]
pub struct PodSpec {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
}

/// A pod sandbox run through CRI.
#[derive(Debug, Clone)]
pub struct Sandbox {
    pub id: String,
    /// The pod's cgroup below the cgroup2 mount (its `cgroup_parent`).
    pub cgroup: String,
    config: PodSandboxConfig,
}

impl Containerd {
    /// Starts containerd in a new directory under /tmp and imports [`IMAGE`].
    pub fn start() -> Containerd {
        crate::require_prerequisites();
        let name = crate::unique("cri");
        let dir = PathBuf::from(format!("/tmp/connguard-{name}"));
        std::fs::create_dir_all(dir.join("cni")).expect("mkdir");
        let socket = dir.join("containerd.sock");
        let d = dir.display();
        let config = format!(
            r#"version = 2
root = "{d}/root"
state = "{d}/state"
[grpc]
  address = "{d}/containerd.sock"
[ttrpc]
  address = "{d}/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{IMAGE}"
  # The sandbox's oom_score_adj (-998) is below containerd's own: lowering it takes
  # CAP_SYS_RESOURCE, which these machines do not grant.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{d}/cni"
    conf_dir = "{d}/cni"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
    Root = "{d}/runc"
"#
        );
        std::fs::write(dir.join("config.toml"), config).expect("write config");
        let mut c = Containerd {
            pod_root: format!("connguard-test/{name}"),
            dir,
            socket,
            child: None,
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("tokio runtime"),
        };
        c.resume();
        let image = c.dir.join("image.tar");
        runtimes::write_image(&image, IMAGE);
        runtimes::output(
            Command::new("ctr")
                .arg("--address")
                .arg(&c.socket)
                .args(["-n", "k8s.io", "images", "import"])
                .arg(&image),
        );
        c
    }

    /// Starts containerd again after [`Containerd::stop`], with the same state, and waits
    /// until CRI answers.
    pub fn resume(&mut self) {
        assert!(self.child.is_none(), "containerd is running");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("containerd.log"))
            .expect("log");
        let child = Command::new("containerd")
            .arg("--config")
            .arg(self.dir.join("config.toml"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("containerd (apt-get install containerd runc)");
        self.child = Some(child);
        runtimes::wait_for(&self.socket, Duration::from_secs(20), "containerd");
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let version = self.rt.block_on(async {
                self.cri_client()
                    .await?
                    .version(VersionRequest::default())
                    .await
                    .map_err(anyhow::Error::from)
            });
            match version {
                Ok(_) => return,
                Err(e) if std::time::Instant::now() > deadline => {
                    panic!("containerd's CRI does not answer: {e:#}")
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// Stops containerd (SIGTERM) and waits for it to exit; its shims and pods run on.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: a plain syscall on our own child.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            child.wait().expect("wait containerd");
        }
        let _ = std::fs::remove_file(&self.socket);
    }

    async fn cri_client(&self) -> anyhow::Result<RuntimeServiceClient<Channel>> {
        Ok(RuntimeServiceClient::new(
            containerd_client::connect(&self.socket).await?,
        ))
    }

    fn cri<T>(
        &self,
        what: &str,
        call: impl AsyncFnOnce(RuntimeServiceClient<Channel>) -> Result<T, Status>,
    ) -> T {
        self.rt
            .block_on(async {
                let client = self.cri_client().await?;
                call(client).await.map_err(anyhow::Error::from)
            })
            .unwrap_or_else(|e| panic!("CRI {what}: {e:#}"))
    }

    /// RunPodSandbox as kubelet calls it: the pod's labels with kubelet's own added, its
    /// annotations, the host's network, and a cgroup parent of its own below
    /// `pod_root`.
    pub fn run_pod(&self, pod: &PodSpec) -> Sandbox {
        let mut labels = pod.labels.clone();
        labels.insert("io.kubernetes.pod.name".into(), pod.name.clone());
        labels.insert("io.kubernetes.pod.namespace".into(), pod.namespace.clone());
        labels.insert("io.kubernetes.pod.uid".into(), pod.uid.clone());
        let cgroup = format!("{}/pod{}", self.pod_root, pod.uid);
        let config = PodSandboxConfig {
            metadata: Some(PodSandboxMetadata {
                name: pod.name.clone(),
                uid: pod.uid.clone(),
                namespace: pod.namespace.clone(),
                attempt: 0,
            }),
            // No hostname: kubelet sets none for a pod on the host's network (no UTS
            // namespace of its own).
            labels: labels.into_iter().collect(),
            annotations: pod.annotations.clone().into_iter().collect(),
            linux: Some(LinuxPodSandboxConfig {
                cgroup_parent: format!("/{cgroup}"),
                security_context: Some(LinuxSandboxSecurityContext {
                    namespace_options: Some(namespaces()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let request = RunPodSandboxRequest {
            config: Some(config.clone()),
            runtime_handler: String::new(),
        };
        let id = self.cri("RunPodSandbox", async |mut c| {
            Ok(c.run_pod_sandbox(request)
                .await?
                .into_inner()
                .pod_sandbox_id)
        });
        Sandbox { id, cgroup, config }
    }

    /// CreateContainer and StartContainer of container `name` in `pod`, running
    /// `command` (from the image's busybox) with `mounts` (host path, container path,
    /// read-only); its id.
    pub fn run_container(
        &self,
        pod: &Sandbox,
        name: &str,
        command: &[&str],
        mounts: &[(&str, &str)],
    ) -> String {
        let mounts: Vec<(&str, &str, bool)> = mounts.iter().map(|(h, c)| (*h, *c, false)).collect();
        self.run_container_with(pod, name, command, &mounts)
    }

    /// `run_container` with `mounts` (host path, container path, writable).
    pub fn run_container_with(
        &self,
        pod: &Sandbox,
        name: &str,
        command: &[&str],
        mounts: &[(&str, &str, bool)],
    ) -> String {
        let config = ContainerConfig {
            metadata: Some(ContainerMetadata {
                name: name.into(),
                attempt: 0,
            }),
            image: Some(ImageSpec {
                image: IMAGE.into(),
                ..Default::default()
            }),
            command: command.iter().map(|s| s.to_string()).collect(),
            mounts: mounts
                .iter()
                .map(|(host, inside, writable)| Mount {
                    container_path: inside.to_string(),
                    host_path: host.to_string(),
                    readonly: !writable,
                    ..Default::default()
                })
                .collect(),
            linux: Some(LinuxContainerConfig {
                security_context: Some(LinuxContainerSecurityContext {
                    namespace_options: Some(namespaces()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let request = CreateContainerRequest {
            pod_sandbox_id: pod.id.clone(),
            config: Some(config),
            sandbox_config: Some(pod.config.clone()),
        };
        let id = self.cri("CreateContainer", async |mut c| {
            Ok(c.create_container(request).await?.into_inner().container_id)
        });
        let start = StartContainerRequest {
            container_id: id.clone(),
        };
        self.cri("StartContainer", async |mut c| {
            c.start_container(start).await.map(|_| ())
        });
        id
    }

    /// StopPodSandbox then RemovePodSandbox, as kubelet does when a pod is deleted.
    pub fn remove_pod(&self, id: &str) {
        let stop = StopPodSandboxRequest {
            pod_sandbox_id: id.into(),
        };
        self.cri("StopPodSandbox", async |mut c| {
            c.stop_pod_sandbox(stop).await.map(|_| ())
        });
        let remove = RemovePodSandboxRequest {
            pod_sandbox_id: id.into(),
        };
        self.cri("RemovePodSandbox", async |mut c| {
            c.remove_pod_sandbox(remove).await.map(|_| ())
        });
    }

    /// The ids of every pod sandbox containerd holds.
    pub fn pod_ids(&self) -> Vec<String> {
        self.cri("ListPodSandbox", async |mut c| {
            let items = c
                .list_pod_sandbox(ListPodSandboxRequest { filter: None })
                .await?
                .into_inner()
                .items;
            Ok(items.into_iter().map(|s| s.id).collect())
        })
    }
}

/// The host's network (no CNI here), the pod's own pid and ipc namespaces.
fn namespaces() -> NamespaceOption {
    NamespaceOption {
        network: NamespaceMode::Node as i32,
        pid: NamespaceMode::Pod as i32,
        ipc: NamespaceMode::Pod as i32,
        ..Default::default()
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        // Pods through CRI while containerd runs, so that it forgets them; then whatever
        // is left (a test that failed midway, a containerd stopped) the hard way.
        if self.child.is_some() && !std::thread::panicking() {
            for id in self.pod_ids() {
                self.remove_pod(&id);
            }
        }
        if std::thread::panicking() {
            let log = std::fs::read_to_string(self.dir.join("containerd.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            eprintln!("containerd's last log lines:");
            for line in tail.iter().rev() {
                eprintln!("  {line}");
            }
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        runtimes::kill_matching(&self.socket.to_string_lossy());
        runtimes::remove_cgroups(&self.pod_root);
        runtimes::remove_tree(&self.dir);
    }
}
