//! cgroup sock_create: find the scope of a new TCP socket, because the socket belongs to
//! the scope of the cgroup it is created in, whichever task later calls connect(). That
//! is the nearest cgroup a scope selects among the creating task's cgroup and its
//! ancestors, looked up here from the deepest level that holds a selected cgroup
//! (`SCOPE_LEVELS`) to the daemon's cgroup2 mount: so a cgroup created under a selected
//! one is governed from its first socket, with nothing for the daemon to learn first.
//! Only sockets with a scope get storage; the others cost these lookups and pass
//! connect() untouched.
use aya_ebpf::{
    helpers::generated::bpf_get_current_ancestor_cgroup_id, macros::cgroup_sock,
    programs::SockContext,
};
use guard_common::{
    CgroupKey, MAX_CGROUP_LEVEL, STAT_INTERNAL_ERRORS, SockState, linux::IPPROTO_TCP,
};

use crate::{
    accounting::internal_error,
    maps::{ACTIVE_GEN, CGROUP_ROOT, SCOPE_LEVELS, SCOPES, storage},
};

#[cgroup_sock(sock_create)]
pub fn sock_create(ctx: SockContext) -> i32 {
    if unsafe { (*ctx.sock).protocol } != IPPROTO_TCP {
        return 1;
    }
    let gen_ = ACTIVE_GEN.get(0).copied().unwrap_or(0);
    let levels = SCOPE_LEVELS.get(gen_).copied().unwrap_or(0);
    if levels == 0 {
        return 1;
    }
    let Some(base) = mount_level() else {
        return 1;
    };
    let mut selected = 0u64;
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
            selected = id;
            break;
        }
    }
    if selected == 0 {
        return 1;
    }
    // The socket is new: its storage is created here, zeroed (nothing admitted).
    let state: *mut SockState = storage(ctx.sock, true);
    if state.is_null() {
        // Fail-open: without storage the socket passes connect() unguarded.
        internal_error(STAT_INTERNAL_ERRORS);
    } else {
        unsafe { (*state).cgroup_id = selected };
    }
    1
}

/// The kernel's level of the daemon's cgroup2 mount among the task's ancestors: 0 on a
/// host, deeper in a cgroup namespace (the ancestor ids bpf_get_current_ancestor_cgroup_id
/// returns count from the kernel's root). None for a task outside that mount's tree.
#[inline(always)]
fn mount_level() -> Option<u32> {
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
