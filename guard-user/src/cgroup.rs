//! cgroup v2: where it is mounted, and which cgroup each scope governs.
use std::{
    collections::BTreeMap,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use anyhow::{Context, bail};

use crate::policy::Policy;

/// The cgroup2 mount point, from /proc/self/mountinfo (/sys/fs/cgroup on most hosts,
/// /sys/fs/cgroup/unified on hybrid ones).
pub fn cgroup2_mount() -> anyhow::Result<PathBuf> {
    let info =
        std::fs::read_to_string("/proc/self/mountinfo").context("reading /proc/self/mountinfo")?;
    mount_of(&info, "cgroup2").context(
        "no cgroup v2 file system is mounted; connguard needs cgroup v2 (the unified hierarchy)",
    )
}

/// The mount point of the first mount of file-system type `fstype` in a mountinfo text.
pub fn mount_of(mountinfo: &str, fstype: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let ty = right.split_whitespace().next()?;
        let point = left.split_whitespace().nth(4)?;
        (ty == fstype).then(|| PathBuf::from(point.replace("\\040", " ")))
    })
}

/// The cgroup id that bpf_get_current_cgroup_id() returns for a cgroup directory: its
/// kernfs node id, which is the directory's inode number.
pub fn cgroup_id(dir: &Path) -> anyhow::Result<u64> {
    Ok(std::fs::metadata(dir)
        .with_context(|| format!("stat {}", dir.display()))?
        .ino())
}

/// Every cgroup below `root` (itself included) governed by a scope: cgroup id -> (index
/// of the scope, directory). A cgroup that a scope selects is governed by it (the first
/// such scope in the file); any other cgroup by its nearest selected ancestor.
pub fn governed(root: &Path, policy: &Policy) -> anyhow::Result<BTreeMap<u64, (usize, PathBuf)>> {
    if !root.is_dir() {
        bail!("{} is not a directory", root.display());
    }
    let mut out = BTreeMap::new();
    walk(root, "", None, policy, &mut out);
    Ok(out)
}

/// The network namespaces of the processes in these cgroups, one `/proc/PID/ns/net`
/// path per namespace.
pub fn netns_of<'a>(dirs: impl IntoIterator<Item = &'a Path>) -> Vec<PathBuf> {
    let mut seen = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    for dir in dirs {
        let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) else {
            continue;
        };
        for pid in procs.lines() {
            let path = PathBuf::from(format!("/proc/{pid}/ns/net"));
            // A process that exited meanwhile is skipped.
            if let Ok(meta) = std::fs::metadata(&path)
                && seen.insert((meta.dev(), meta.ino()))
            {
                out.push(path);
            }
        }
    }
    out
}

fn walk(
    dir: &Path,
    rel: &str,
    inherited: Option<usize>,
    policy: &Policy,
    out: &mut BTreeMap<u64, (usize, PathBuf)>,
) {
    let selected = policy.scopes.iter().position(|s| {
        if s.cgroup.is_empty() {
            rel.is_empty()
        } else {
            s.matcher.is_match(rel)
        }
    });
    let scope = selected.or(inherited);
    // A cgroup removed while we walk is simply skipped.
    if let Some(index) = scope
        && let Ok(id) = cgroup_id(dir)
    {
        out.insert(id, (index, dir.to_path_buf()));
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            let name = entry.file_name().to_string_lossy().into_owned();
            let child_rel = if rel.is_empty() {
                name
            } else {
                format!("{rel}/{name}")
            };
            walk(&entry.path(), &child_rel, scope, policy, out);
        }
    }
}
