//! Which cgroups each scope governs: a socket belongs to the nearest cgroup a scope
//! selects among the cgroup it was created in and that cgroup's ancestors. The kernel
//! resolves that itself from the selected cgroups (sock_create); the daemon keeps the
//! whole picture for reports (which scope a process's cgroup is in), for where the
//! programs are attached, and for where a new cgroup must be watched for.
use std::{
    collections::{BTreeMap, BTreeSet},
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
    /// Selected, with no governed ancestor: the programs are attached here, and run for
    /// the sockets of this cgroup and its descendants only.
    pub top: bool,
}

/// A walk of (part of) the cgroup tree for a policy.
#[derive(Debug, Default)]
pub struct Tree {
    /// Every cgroup walked that a scope governs, by cgroup id.
    pub governed: BTreeMap<u64, Governed>,
    /// The cgroups in which a new child may be selected by a scope other than the one
    /// already governing them, or lead to one that is: their creations are watched
    /// for, so that a selected cgroup created again (a service restart) is governed at
    /// once.
    pub watched: BTreeSet<PathBuf>,
}

/// The whole tree below `root` (itself included).
pub fn walk(root: &Path, policy: &Policy) -> anyhow::Result<Tree> {
    if !root.is_dir() {
        bail!("{} is not a directory", root.display());
    }
    Ok(walk_below(root, "", None, policy))
}

/// The scope (its index in `policy`) that governs the cgroup at `rel` (below the
/// mount, "" for the root), as `walk_below` decides: the first that selects it, else
/// its nearest selected ancestor's.
pub fn governing(policy: &Policy, rel: &str) -> Option<usize> {
    let mut at = rel;
    loop {
        if let Some(i) = policy.scopes.iter().position(|s| s.selector.selects(at)) {
            return Some(i);
        }
        if at.is_empty() {
            return None;
        }
        at = at.rsplit_once('/').map_or("", |(parent, _)| parent);
    }
}

/// The subtree at `dir` (path `rel` below the mount), whose parent is governed by
/// scope `inherited`. A cgroup that a scope selects is governed by it (the first such
/// scope in the file); any other cgroup by its nearest selected ancestor.
pub fn walk_below(dir: &Path, rel: &str, inherited: Option<usize>, policy: &Policy) -> Tree {
    let mut tree = Tree::default();
    cgroup::walk(dir, rel, inherited, &mut |rel, dir, id, inherited| {
        let selected = policy.scopes.iter().position(|s| s.selector.selects(rel));
        let scope = selected.or(inherited);
        if let Some(scope) = scope {
            let level = if rel.is_empty() {
                0
            } else {
                rel.split('/').count() as u32
            };
            tree.governed.insert(
                id,
                Governed {
                    scope,
                    dir: dir.to_path_buf(),
                    level,
                    selected: selected.is_some(),
                    top: selected.is_some() && inherited.is_none(),
                },
            );
        }
        let watch = policy
            .scopes
            .iter()
            .enumerate()
            .any(|(i, s)| Some(i) != scope && s.selector.may_select_below(rel));
        if watch {
            tree.watched.insert(dir.to_path_buf());
        }
        scope
    });
    tree
}
