//! Which cgroups each scope governs: a socket belongs to the nearest cgroup a scope
//! selects among the cgroup it was created in and that cgroup's ancestors. The kernel
//! resolves that itself from the selected cgroups (sock_create); the daemon keeps the
//! whole picture for reports (which scope a process's cgroup is in).
use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use anyhow::bail;

use crate::{host::cgroup, policy::Policy};

/// A cgroup a scope governs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Governed {
    /// Index of the scope in the policy.
    pub scope: usize,
    pub dir: PathBuf,
    /// Levels below the cgroup2 root (the root is 0).
    pub level: u32,
    /// Selected by the scope itself (else governed through its nearest selected
    /// ancestor).
    pub selected: bool,
}

/// Every cgroup below `root` (itself included) governed by a scope, by cgroup id. A
/// cgroup that a scope selects is governed by it (the first such scope in the file);
/// any other cgroup by its nearest selected ancestor.
pub fn governed(root: &Path, policy: &Policy) -> anyhow::Result<BTreeMap<u64, Governed>> {
    if !root.is_dir() {
        bail!("{} is not a directory", root.display());
    }
    let mut out = BTreeMap::new();
    cgroup::walk(root, None, &mut |rel, dir, id, inherited| {
        let selected = policy.scopes.iter().position(|s| {
            if s.cgroup.is_empty() {
                rel.is_empty()
            } else {
                s.matcher.is_match(rel)
            }
        });
        let scope = selected.or(inherited);
        if let Some(scope) = scope {
            let level = if rel.is_empty() {
                0
            } else {
                rel.split('/').count() as u32
            };
            out.insert(
                id,
                Governed {
                    scope,
                    dir: dir.to_path_buf(),
                    level,
                    selected: selected.is_some(),
                },
            );
        }
        scope
    });
    Ok(out)
}
