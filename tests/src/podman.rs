//! Podman's Docker Engine API (`podman system service`) on a socket of a test's own, with
//! its own storage, run directories, events log and config (cgroupfs, runc, the host's
//! network), the image built here and loaded; containers run with the podman command on
//! the same storage, and everything removed on drop: containers, conmon processes,
//! cgroups in every hierarchy, mounts and directories.
use std::{
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::Duration,
};

use crate::runtimes;

/// The image of every container here.
pub const IMAGE: &str = "connguard.test/pause:1";

pub struct Podman {
    pub dir: PathBuf,
    /// The Docker Engine API's socket.
    pub socket: PathBuf,
    /// Below the cgroup2 mount (and each v1 hierarchy's root): every container's cgroup
    /// is below it.
    pub cgroup_root: String,
    service: Child,
}

impl Podman {
    /// Writes the config, loads [`IMAGE`] and starts the service.
    pub fn start() -> Podman {
        crate::require_prerequisites();
        let name = crate::unique("podman");
        let dir = PathBuf::from(format!("/tmp/connguard-{name}"));
        std::fs::create_dir_all(dir.join("tmp")).expect("mkdir");
        let d = dir.display();
        std::fs::write(
            dir.join("containers.conf"),
            format!(
                r#"[containers]
netns = "host"
[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "{d}/events.log"
runtime = "runc"
tmp_dir = "{d}/tmp"
[network]
network_config_dir = "{d}/net"
"#
            ),
        )
        .expect("write containers.conf");
        std::fs::write(
            dir.join("storage.conf"),
            format!(
                "[storage]\ndriver = \"overlay\"\ngraphroot = \"{d}/storage\"\nrunroot = \"{d}/run\"\n"
            ),
        )
        .expect("write storage.conf");
        let socket = dir.join("podman.sock");
        let image = dir.join("image.tar");
        runtimes::write_image(&image, IMAGE);
        let mut load = podman(&dir);
        runtimes::output(load.arg("load").arg("-i").arg(&image));
        let service = podman(&dir)
            .args(["system", "service", "--time=0"])
            .arg(format!("unix://{}", socket.display()))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("service.log")).expect("create service.log"))
            .spawn()
            .expect("podman (apt-get install podman)");
        runtimes::wait_for(&socket, Duration::from_secs(20), "podman system service");
        Podman {
            cgroup_root: format!("connguard-test/{name}"),
            dir,
            socket,
            service,
        }
    }

    /// `podman run -d` of container `name` with `labels`, running the image's entrypoint
    /// (a sleep); its id.
    pub fn run(&self, name: &str, labels: &[(&str, &str)]) -> String {
        let mut cmd = podman(&self.dir);
        // podman raises RLIMIT_NOFILE and RLIMIT_NPROC to defaults of its own, which takes
        // CAP_SYS_RESOURCE (these machines do not grant it): lower ones instead.
        cmd.args(["run", "-d", "--name", name])
            .args(["--ulimit=nofile=1024:1024", "--ulimit=nproc=1024:1024"]);
        cmd.arg(format!("--cgroup-parent=/{}", self.cgroup_root));
        for (k, v) in labels {
            cmd.arg(format!("--label={k}={v}"));
        }
        cmd.arg(IMAGE);
        runtimes::output(&mut cmd).trim().to_string()
    }

    /// `podman rm -f` of container `name`.
    pub fn remove(&self, name: &str) {
        runtimes::output(podman(&self.dir).args(["rm", "-f", "-t", "0", name]));
    }
}

/// The podman command on this harness's config and storage.
fn podman(dir: &std::path::Path) -> Command {
    let mut cmd = Command::new("podman");
    cmd.env("CONTAINERS_CONF", dir.join("containers.conf"))
        .env("CONTAINERS_STORAGE_CONF", dir.join("storage.conf"));
    cmd
}

impl Drop for Podman {
    fn drop(&mut self) {
        let _ = podman(&self.dir)
            .args(["rm", "-a", "-f", "-t", "0"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = self.service.kill();
        let _ = self.service.wait();
        // conmon and what else of podman names a path of this harness.
        runtimes::kill_matching(&self.dir.to_string_lossy());
        runtimes::remove_cgroups(&self.cgroup_root);
        runtimes::remove_tree(&self.dir);
    }
}
