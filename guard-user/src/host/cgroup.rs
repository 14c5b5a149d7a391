//! The cgroup v2 tree: ids, a walk, and the processes in a cgroup.
use std::{
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use anyhow::Context;

/// The cgroup id that bpf_get_current_cgroup_id() returns for a cgroup directory: its
/// kernfs node id, which is the directory's inode number.
pub fn cgroup_id(dir: &Path) -> anyhow::Result<u64> {
    Ok(std::fs::metadata(dir)
        .with_context(|| format!("stat {}", dir.display()))?
        .ino())
}

/// Visits `dir` and every cgroup below it, parents first. `visit` gets each cgroup's path
/// (`rel` for `dir`, then `rel/name`...), its directory, its id, and what `visit`
/// returned for its parent (`parent` for `dir`). A cgroup removed during the walk is
/// skipped.
pub fn walk<T: Copy>(
    dir: &Path,
    rel: &str,
    parent: T,
    visit: &mut impl FnMut(&str, &Path, u64, T) -> T,
) {
    let Ok(id) = cgroup_id(dir) else { return };
    let here = visit(rel, dir, id, parent);
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
            walk(&entry.path(), &child_rel, here, visit);
        }
    }
}

/// The network namespaces of the processes in these cgroups, one `/proc/PID/ns/net`
/// path per namespace.
pub fn netns_of<'a>(dirs: impl IntoIterator<Item = &'a Path>) -> Vec<PathBuf> {
    let paths = dirs.into_iter().flat_map(|dir| {
        let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
        procs
            .lines()
            .map(|pid| PathBuf::from(format!("/proc/{pid}/ns/net")))
            .collect::<Vec<_>>()
    });
    super::netns::distinct(paths)
}
