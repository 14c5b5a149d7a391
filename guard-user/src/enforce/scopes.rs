//! Which cgroups each scope governs: a socket belongs to the nearest cgroup a scope
//! selects among the cgroup it was created in and that cgroup's ancestors.
use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use anyhow::bail;

use crate::{host::cgroup, policy::Policy};

/// Every cgroup below `root` (itself included) governed by a scope: cgroup id -> (index
/// of the scope, directory). A cgroup that a scope selects is governed by it (the first
/// such scope in the file); any other cgroup by its nearest selected ancestor.
pub fn governed(root: &Path, policy: &Policy) -> anyhow::Result<BTreeMap<u64, (usize, PathBuf)>> {
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
        if let Some(index) = scope {
            out.insert(id, (index, dir.to_path_buf()));
        }
        scope
    });
    Ok(out)
}
