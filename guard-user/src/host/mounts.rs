//! Where cgroup2 and bpffs are mounted.
use std::{ffi::CString, path::PathBuf};

use anyhow::{Context, bail};

/// The cgroup2 mount point, from /proc/self/mountinfo (/sys/fs/cgroup on most hosts,
/// /sys/fs/cgroup/unified on hybrid ones).
pub fn cgroup2_mount() -> anyhow::Result<PathBuf> {
    mount_of(&mountinfo()?, "cgroup2").context(
        "no cgroup v2 file system is mounted; connguard needs cgroup v2 (the unified hierarchy)",
    )
}

/// Mounts bpffs at /sys/fs/bpf when no bpffs is mounted (some hosts do not mount it at
/// boot): aya and bpftool look for it there.
pub fn ensure_bpffs() -> anyhow::Result<()> {
    if mount_of(&mountinfo()?, "bpf").is_some() {
        return Ok(());
    }
    let target = "/sys/fs/bpf";
    std::fs::create_dir_all(target).ok();
    let c = |s: &str| CString::new(s).expect("no NUL");
    // SAFETY: plain C strings that outlive the call.
    let rc = unsafe {
        libc::mount(
            c("bpf").as_ptr(),
            c(target).as_ptr(),
            c("bpf").as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        bail!(
            "mounting bpffs at {target}: {}",
            std::io::Error::last_os_error()
        );
    }
    log::info!("mounted bpffs at {target}");
    Ok(())
}

fn mountinfo() -> anyhow::Result<String> {
    std::fs::read_to_string("/proc/self/mountinfo").context("reading /proc/self/mountinfo")
}

/// The mount point of the first mount of file-system type `fstype` in a mountinfo text.
fn mount_of(mountinfo: &str, fstype: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let ty = right.split_whitespace().next()?;
        let point = left.split_whitespace().nth(4)?;
        (ty == fstype).then(|| PathBuf::from(point.replace("\\040", " ")))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_points_are_found_by_type_with_spaces_unescaped() {
        let info = "22 1 0:21 / /sys/fs/bpf rw - bpf bpf rw\n\
                    30 1 0:26 / /sys/fs/my\\040cgroup rw - cgroup2 cgroup2 rw\n";
        assert_eq!(mount_of(info, "bpf"), Some(PathBuf::from("/sys/fs/bpf")));
        assert_eq!(
            mount_of(info, "cgroup2"),
            Some(PathBuf::from("/sys/fs/my cgroup"))
        );
        assert_eq!(mount_of(info, "tracefs"), None);
    }
}
