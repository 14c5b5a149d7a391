//! Where the connection programs run: attached to the top-most selected cgroups only,
//! so the kernel runs them for sockets of those cgroups and their descendants (created
//! at any time) and for nothing else. Nested selected cgroups are not attached again:
//! a program attached to a cgroup and to its ancestor would run twice for one socket.
//!
//! Each attachment is a bpf_link, which the kernel adds in BPF_F_ALLOW_MULTI mode, so
//! programs of systemd or a CNI on the same cgroups keep working. A link takes no attach
//! flags (CgroupAttachMode::AllowMultiple makes bpf_link_create fail with EINVAL on
//! 6.18), so the default mode, Single, is passed.
use std::{
    collections::{BTreeMap, BTreeSet},
    fs::File,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use anyhow::Context;
use aya::{
    Ebpf,
    programs::{CgroupAttachMode, CgroupSock, CgroupSockAddr, SockOps, links::FdLink},
};
use guard_common::names::program::{CONNECT4, CONNECT6, SOCK_CREATE, SOCK_RELEASE, SOCK_STATE};

use super::{object::program, syscall::link_cgroup_id};

/// A cgroup's links, in attach order: connect first, so that a cgroup just created is
/// governed after one attach (each waits for the kernel's cgroup_mutex, which a service
/// restart's rmdir, mkdir and move of its first process contend for); then sock_create,
/// sock_ops and sock_release. Until those are there, connect creates the storage of a
/// socket created before, and the state tracepoint releases what it admits. They are
/// detached in the same order (dropping a link closes its fd, which detaches it), so
/// that admissions stop first.
struct Attachment {
    dir: PathBuf,
    /// Held to be dropped.
    _links: Vec<FdLink>,
    /// The kernel's id of the first link, to ask whether the kernel detached it.
    first_id: u32,
}

/// Attachments taken out by `detach_others`, detached on drop.
#[must_use]
pub struct Detached {
    _attachments: Vec<Attachment>,
}

/// The cgroups the connection programs are attached to.
#[derive(Default)]
pub struct CgroupLinks {
    attached: BTreeMap<u64, Attachment>,
    /// Attachments of removed cgroups, kept until the kernel detaches them itself: a
    /// removed cgroup lives on while a socket created in it does (each holds a
    /// reference to its cgroup's programs, taken in cgroup_sk_alloc()), and those
    /// sockets keep every release path until then. Detaching them ourselves would also
    /// take cgroup_mutex, which the attach of a cgroup just created waits for.
    removed: Vec<Attachment>,
    /// Cgroups whose attach failed, not tried again while they stay wanted.
    failed: BTreeSet<u64>,
}

impl CgroupLinks {
    /// Attaches the programs to every cgroup of `wanted` (id -> directory) not yet
    /// attached. A cgroup that cannot be attached (removed meanwhile, or refused: a
    /// program attached without BPF_F_ALLOW_MULTI above it forbids any below) is left
    /// unguarded, fail-open, with a warning.
    pub fn attach(&mut self, ebpf: &mut Ebpf, wanted: &BTreeMap<u64, PathBuf>) {
        self.failed.retain(|id| wanted.contains_key(id));
        for (id, dir) in wanted {
            if self.attached.contains_key(id) || self.failed.contains(id) {
                continue;
            }
            match attach(ebpf, *id, dir) {
                Ok(attachment) => {
                    self.attached.insert(*id, attachment);
                }
                // Removed since the walk (or since replaced): nothing to govern.
                Err(_) if !holds(dir, *id) => {}
                Err(e) => {
                    log::warn!(
                        "{} is not governed: attaching the connection programs failed: {e:#}",
                        dir.display()
                    );
                    self.failed.insert(*id);
                }
            }
        }
    }

    /// Takes out every attached cgroup not in `wanted`. For one that still exists (a
    /// reload no longer selects it), the programs are detached when the result is
    /// dropped: drop it outside the caller's locks, as detaching takes the kernel's
    /// cgroup_mutex. Its sockets that hold an admission are then released by the state
    /// tracepoint, which sees every socket of the host. One removed is kept until the
    /// kernel detaches it. Attachments the kernel has detached are let go.
    pub fn detach_others(&mut self, wanted: &BTreeMap<u64, PathBuf>) -> Detached {
        let gone: Vec<u64> = self
            .attached
            .keys()
            .filter(|id| !wanted.contains_key(id))
            .copied()
            .collect();
        let mut detached = Vec::new();
        for id in gone {
            let Some(a) = self.attached.remove(&id) else {
                continue;
            };
            if holds(&a.dir, id) {
                detached.push(a);
            } else {
                self.removed.push(a);
            }
        }
        // Let go of what the kernel detached (or what cannot be asked about).
        let (kept, done): (Vec<_>, Vec<_>) = std::mem::take(&mut self.removed)
            .into_iter()
            .partition(|a| link_cgroup_id(a.first_id).is_ok_and(|id| id != 0));
        self.removed = kept;
        detached.extend(done);
        Detached {
            _attachments: detached,
        }
    }

    /// The directories the programs are attached to.
    pub fn dirs(&self) -> Vec<PathBuf> {
        self.attached.values().map(|a| a.dir.clone()).collect()
    }
}

/// Whether `dir` is cgroup `id` (a cgroup id is its directory's inode number): not when
/// the cgroup was removed, or removed and created again.
fn holds(dir: &Path, id: u64) -> bool {
    std::fs::metadata(dir).is_ok_and(|m| m.ino() == id)
}

/// All of the connection programs' links to cgroup `id` at `dir`, or none.
fn attach(ebpf: &mut Ebpf, id: u64, dir: &Path) -> anyhow::Result<Attachment> {
    let cgroup = File::open(dir).with_context(|| format!("opening {}", dir.display()))?;
    if cgroup.metadata()?.ino() != id {
        anyhow::bail!("{} was replaced", dir.display());
    }
    let mode = CgroupAttachMode::Single;
    // On an error, `links` is dropped: what was attached is detached.
    let mut links: Vec<FdLink> = Vec::new();
    for name in [CONNECT4, CONNECT6] {
        let prog: &mut CgroupSockAddr = program(ebpf, name)?.try_into()?;
        let link = prog.attach(&cgroup, mode).context(name)?;
        links.push(prog.take_link(link)?.try_into()?);
    }
    let prog: &mut CgroupSock = program(ebpf, SOCK_CREATE)?.try_into()?;
    let link = prog.attach(&cgroup, mode).context(SOCK_CREATE)?;
    links.push(prog.take_link(link)?.try_into()?);
    let prog: &mut SockOps = program(ebpf, SOCK_STATE)?.try_into()?;
    let link = prog.attach(&cgroup, mode).context(SOCK_STATE)?;
    links.push(prog.take_link(link)?.try_into()?);
    let prog: &mut CgroupSock = program(ebpf, SOCK_RELEASE)?.try_into()?;
    let link = prog.attach(&cgroup, mode).context(SOCK_RELEASE)?;
    links.push(prog.take_link(link)?.try_into()?);
    let first_id = links[0].info()?.id();
    Ok(Attachment {
        dir: dir.to_path_buf(),
        _links: links,
        first_id,
    })
}
