//! What the container runtime harnesses share: an OCI image built here from the static
//! busybox (no registry is reachable), and the clean-up of what a runtime leaves on the
//! host: processes, cgroups in every hierarchy (these hosts are hybrid: cgroup v1
//! controllers and cgroup2), and mounts.
use std::{
    io::Write,
    os::unix::ffi::OsStrExt,
    path::{Path, PathBuf},
    process::Command,
    thread,
    time::{Duration, Instant},
};

use serde_json::json;
use sha2::{Digest, Sha256};

/// The static busybox (Debian's busybox-static), the only file of the test image.
pub const BUSYBOX: &str = "/bin/busybox";

/// Writes to `path` an OCI image archive (an OCI layout in a tar) named `name` (for
/// containerd's `ctr images import` and `podman load` alike) holding /bin/busybox, whose
/// entrypoint sleeps until killed: a pause image.
pub fn write_image(path: &Path, name: &str) {
    assert!(
        Path::new(BUSYBOX).exists(),
        "{BUSYBOX} is missing: `cargo xtask setup` installs busybox-static"
    );
    let mut layer = tar::Builder::new(Vec::new());
    let mut bin = tar::Header::new_gnu();
    bin.set_entry_type(tar::EntryType::Directory);
    bin.set_mode(0o755);
    bin.set_size(0);
    layer
        .append_data(&mut bin, "bin/", std::io::empty())
        .expect("tar bin/");
    layer
        .append_path_with_name(BUSYBOX, "bin/busybox")
        .expect("tar busybox");
    let layer = layer.into_inner().expect("tar");
    let layer_digest = digest(&layer);
    let config = json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": [BUSYBOX, "sleep", "2147483647"]},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    })
    .to_string();
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": digest(config.as_bytes()),
            "size": config.len(),
        },
        "layers": [{
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": layer_digest,
            "size": layer.len(),
        }],
    })
    .to_string();
    let index = json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": digest(manifest.as_bytes()),
            "size": manifest.len(),
            "annotations": {
                "io.containerd.image.name": name,
                "org.opencontainers.image.ref.name": name,
            },
        }],
    })
    .to_string();
    let mut archive = tar::Builder::new(std::fs::File::create(path).expect("create image"));
    let mut add = |name: &str, data: &[u8]| {
        let mut header = tar::Header::new_gnu();
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        archive.append_data(&mut header, name, data).expect("tar");
    };
    add("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#);
    add("index.json", index.as_bytes());
    for blob in [&layer[..], config.as_bytes(), manifest.as_bytes()] {
        let hex = digest(blob).trim_start_matches("sha256:").to_string();
        add(&format!("blobs/sha256/{hex}"), blob);
    }
    archive
        .into_inner()
        .expect("tar")
        .flush()
        .expect("write image");
}

fn digest(data: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(data))
}

/// The mount points of every cgroup hierarchy (v1 and cgroup2).
fn hierarchies() -> Vec<PathBuf> {
    mounts()
        .into_iter()
        .filter(|(_, ty)| ty == "cgroup" || ty == "cgroup2")
        .map(|(point, _)| point)
        .collect()
}

/// (mount point, file-system type) of every mount of this process's namespace.
fn mounts() -> Vec<(PathBuf, String)> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").expect("read mountinfo");
    info.lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let point = left.split_whitespace().nth(4)?.replace("\\040", " ");
            Some((
                PathBuf::from(point),
                right.split_whitespace().next()?.to_string(),
            ))
        })
        .collect()
}

/// Kills every process in cgroup `rel` and below, in every hierarchy, and removes those
/// cgroups, deepest first. Panics if one is left after 5 s.
pub fn remove_cgroups(rel: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    for root in hierarchies() {
        let top = root.join(rel);
        loop {
            let mut dirs = Vec::new();
            collect_dirs(&top, &mut dirs);
            if dirs.is_empty() {
                break;
            }
            // Deepest first: a cgroup with children cannot be removed.
            dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
            for d in &dirs {
                kill_procs(d);
                let _ = std::fs::remove_dir(d);
            }
            assert!(
                Instant::now() < deadline,
                "cgroups left below {}: {dirs:?}",
                top.display()
            );
            thread::sleep(Duration::from_millis(20));
        }
    }
}

fn collect_dirs(dir: &Path, out: &mut Vec<PathBuf>) {
    if !dir.is_dir() {
        return;
    }
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            collect_dirs(&e.path(), out);
        }
    }
    out.push(dir.to_path_buf());
}

fn kill_procs(dir: &Path) {
    let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
    for pid in procs.lines().filter_map(|p| p.parse::<i32>().ok()) {
        // SAFETY: a plain syscall.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}

/// SIGKILLs every process whose command line contains `needle` (a runtime's shims,
/// which reparent themselves away from the runtime), and waits until they are gone.
pub fn kill_matching(needle: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let pids = matching(needle);
        if pids.is_empty() {
            return;
        }
        for pid in &pids {
            // SAFETY: a plain syscall.
            unsafe { libc::kill(*pid, libc::SIGKILL) };
        }
        assert!(
            Instant::now() < deadline,
            "processes {pids:?} ({needle}) survive SIGKILL"
        );
        thread::sleep(Duration::from_millis(20));
    }
}

fn matching(needle: &str) -> Vec<i32> {
    let me = std::process::id() as i32;
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<i32>().ok())
        .filter(|pid| *pid != me)
        .filter(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            // A zombie has an empty command line and goes with its parent.
            cmdline
                .split(|b| *b == 0)
                .any(|arg| arg.windows(needle.len()).any(|w| w == needle.as_bytes()))
        })
        .collect()
}

/// Unmounts (lazily) everything mounted below `dir`, deepest first, then removes `dir`.
pub fn remove_tree(dir: &Path) {
    let mut below: Vec<PathBuf> = mounts()
        .into_iter()
        .map(|(p, _)| p)
        .filter(|p| p.starts_with(dir))
        .collect();
    below.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for point in below {
        let c = std::ffi::CString::new(point.as_os_str().as_bytes()).expect("no NUL");
        // SAFETY: a C string that outlives the call.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
    if dir.exists() {
        std::fs::remove_dir_all(dir).unwrap_or_else(|e| panic!("rm -r {}: {e}", dir.display()));
    }
}

/// Runs `cmd`, panicking with its stderr if it fails; its stdout.
pub fn output(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{:?}: {e}", cmd.get_program()));
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Waits until `path` exists (a socket a daemon creates), panicking after `limit`.
pub fn wait_for(path: &Path, limit: Duration, what: &str) {
    let deadline = Instant::now() + limit;
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "{what}: no {} after {limit:?}",
            path.display()
        );
        thread::sleep(Duration::from_millis(10));
    }
}
