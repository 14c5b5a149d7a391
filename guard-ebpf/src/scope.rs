//! The scope of the current task's cgroup: the nearest cgroup a scope selects among it
//! and its ancestors, looked up from the deepest level that holds a selected cgroup
//! (`SCOPE_LEVELS`) to the daemon's cgroup2 mount. So a cgroup created under a selected
//! one is governed from its first socket, with nothing for the daemon to learn first.
use aya_ebpf::helpers::generated::{bpf_get_current_ancestor_cgroup_id, bpf_get_current_cgroup_id};
use guard_common::{CgroupKey, MAX_CGROUP_LEVEL};

use crate::maps::{CGROUP_ROOT, SCOPE_LEVELS, SCOPES};

/// The id of the nearest selected cgroup of generation `gen_` among the current task's
/// cgroup and its ancestors; 0 for none.
#[inline(always)]
pub fn nearest_selected(gen_: u32) -> u64 {
    let levels = SCOPE_LEVELS.get(gen_).copied().unwrap_or(0);
    if levels == 0 {
        return 0;
    }
    let Some(base) = mount_level() else {
        return 0;
    };
    // Nearest first. An ancestor level deeper than the task's cgroup reads 0.
    for level in (0..=MAX_CGROUP_LEVEL).rev() {
        if levels & (1 << level) == 0 {
            continue;
        }
        let id = unsafe { bpf_get_current_ancestor_cgroup_id((base + level) as i32) };
        if id != 0
            && unsafe {
                SCOPES.get(&CgroupKey {
                    gen_,
                    _pad: 0,
                    cgroup_id: id,
                })
            }
            .is_some()
        {
            return id;
        }
    }
    0
}

/// Whether the current task is in the cgroup2 mount's root cgroup, as kernel threads
/// are.
#[inline(always)]
pub fn current_in_root() -> bool {
    let root = CGROUP_ROOT.get(0).copied().unwrap_or(0);
    (unsafe { bpf_get_current_cgroup_id() }) == root
}

/// The kernel's level of the daemon's cgroup2 mount among the task's ancestors: 0 on a
/// host, deeper in a cgroup namespace (the ancestor ids bpf_get_current_ancestor_cgroup_id
/// returns count from the kernel's root). None for a task outside that mount's tree.
#[inline(always)]
pub fn mount_level() -> Option<u32> {
    let root = CGROUP_ROOT.get(0).copied().unwrap_or(0);
    for level in 0..=MAX_CGROUP_LEVEL {
        let id = unsafe { bpf_get_current_ancestor_cgroup_id(level as i32) };
        if id == root {
            return Some(level);
        }
        if id == 0 {
            return None;
        }
    }
    None
}
