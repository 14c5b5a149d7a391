//! Where the connection programs run: attached to the top-most selected cgroups only,
//! so the kernel runs them for sockets of those cgroups and their descendants (created
//! at any time) and for nothing else. Nested selected cgroups are not attached again:
//! a program attached to a cgroup and to its ancestor would run twice for one socket.
//!
//! Each attachment is a bpf_link, which the kernel adds in BPF_F_ALLOW_MULTI mode, so
//! programs of systemd or a CNI on the same cgroups keep working. A link takes no
//! attach flags (CgroupAttachMode::AllowMultiple makes bpf_link_create fail with EINVAL
//! on 6.18), so the default mode, Single, is passed. Each link is pinned in the state
//! directory as `cg<cgroup id>-<program>` (bpffs refuses a dot in a name, EPERM), so
//! that it outlives the daemon; a daemon started again adopts the pins and moves them
//! to its own programs.
use std::{
    collections::{BTreeMap, BTreeSet},
    fs::File,
    os::{fd::AsFd, unix::fs::MetadataExt},
    path::{Path, PathBuf},
};

use anyhow::Context;
use aya::{
    Ebpf,
    programs::{CgroupAttachMode, CgroupSock, CgroupSockAddr, SockOps, links::FdLink},
};
use guard_common::names::program::{CONNECT4, CONNECT6, SOCK_CREATE, SOCK_RELEASE, SOCK_STATE};

use super::{
    object::program,
    state::{Detaching, Pin},
    syscall::link_cgroup_id,
};

/// The admitting programs, in the order they are attached, and the releasing ones.
const ADMITTING: [&str; 3] = [CONNECT4, CONNECT6, SOCK_CREATE];
const RELEASING: [&str; 2] = [SOCK_STATE, SOCK_RELEASE];

/// A cgroup's links, in two parts: the admitting programs (connect4, connect6,
/// sock_create) and the releasing ones (sock_ops, sock_release). sock_ops is attached
/// first, so that every socket connect admits has the state callback it asks for: the
/// state tracepoint, which would release it otherwise, is attached only where a socket
/// needs it (kernel::backstop); then connect, so that a cgroup just created is governed
/// after two attaches (each waits for the kernel's cgroup_mutex, which a service
/// restart's rmdir, mkdir and move of its first process contend for); sock_release
/// last. The releasing programs stay as long as the cgroup lives: a socket admitted here
/// may need them to its end, long after a reload stopped selecting the cgroup. A link is
/// detached when the `Detaching` holding its pin is dropped.
struct Attachment {
    dir: PathBuf,
    /// Empty once the cgroup is no longer wanted; else one per `ADMITTING`.
    admit: Vec<Pin>,
    /// One per `RELEASING`.
    release: Vec<Pin>,
    /// The kernel's id of a releasing link, to ask whether the kernel detached it.
    release_id: u32,
}

/// Links taken out, detached on drop.
pub type Detached = Detaching;

impl Attachment {
    /// Every link of the attachment, to be detached.
    fn into_pins(self) -> impl Iterator<Item = Pin> {
        self.admit.into_iter().chain(self.release)
    }
}

/// The cgroups the connection programs are attached to.
pub struct CgroupLinks {
    /// Where the links are pinned.
    dir: PathBuf,
    /// Links pinned by a daemon before this one, by cgroup id, until the first policy
    /// is in force (`finish_adoption`).
    adopted: BTreeMap<u64, Attachment>,
    /// By cgroup id: wanted ones with all their links; existing ones no longer wanted
    /// with their releasing links only.
    attached: BTreeMap<u64, Attachment>,
    /// Attachments of removed cgroups, kept until the kernel detaches them itself: a
    /// removed cgroup lives on while a socket created in it does (each holds a
    /// reference to its cgroup's programs, taken in cgroup_sk_alloc()), and those
    /// sockets keep every release path until then. Detaching them ourselves would also
    /// take cgroup_mutex, which the attach of a cgroup just created waits for.
    removed: BTreeMap<u64, Attachment>,
    /// Cgroups whose attach failed, warned about once; tried again at each walk.
    failed: BTreeSet<u64>,
    /// Links `finish_adoption` takes off, detached with what the `detach_others` that
    /// follows it hands out: detaching waits for the kernel's cgroup_mutex, not to be
    /// done under the caller's locks.
    pending: Vec<Pin>,
}

/// Attachments of removed cgroups, taken out to be asked about without the caller's
/// locks (`CgroupLinks::take_removed`).
pub struct Removed(BTreeMap<u64, Attachment>);

impl Removed {
    /// Splits off the attachments the kernel has detached, to be dropped. Asking takes
    /// the kernel's cgroup_mutex, which the attach of a cgroup just created waits for:
    /// this is for the periodic walk, outside the locks an event needs. An attachment
    /// that cannot be asked about is kept.
    pub fn reap(self) -> (Removed, Detached) {
        let (kept, done): (BTreeMap<_, _>, BTreeMap<_, _>) = self
            .0
            .into_iter()
            .partition(|(_, a)| link_cgroup_id(a.release_id).map_or(true, |id| id != 0));
        (
            Removed(kept),
            Detaching(done.into_values().flat_map(Attachment::into_pins).collect()),
        )
    }
}

impl CgroupLinks {
    /// Links pinned in `dir`; those a daemon before this one left there are adopted: a
    /// cgroup's releasing links, with its admitting ones or (a cgroup it no longer
    /// wanted) without. A set missing a releasing link (a daemon that died attaching)
    /// is removed, and attached again if wanted.
    pub fn new(dir: PathBuf) -> CgroupLinks {
        let mut pins: BTreeMap<u64, Vec<(String, Pin)>> = BTreeMap::new();
        for path in std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
        {
            let Some((id, prog)) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_prefix("cg"))
                .and_then(|n| n.split_once('-'))
                .and_then(|(id, prog)| Some((id.parse::<u64>().ok()?, prog.to_string())))
            else {
                continue;
            };
            match Pin::adopt(path.clone()) {
                Ok(pin) => pins.entry(id).or_default().push((prog, pin)),
                Err(e) => log::warn!("adopting the link pinned at {}: {e}", path.display()),
            }
        }
        let mut adopted = BTreeMap::new();
        for (id, mut found) in pins {
            let mut take = |name: &str| {
                let i = found.iter().position(|(p, _)| p == name)?;
                Some(found.swap_remove(i).1)
            };
            let admit: Vec<Option<Pin>> = ADMITTING.iter().map(|n| take(n)).collect();
            let release: Vec<Option<Pin>> = RELEASING.iter().map(|n| take(n)).collect();
            // Pins of no program this daemon knows, and incomplete sets, are detached.
            let mut detach = Detaching(found.into_iter().map(|(_, p)| p).collect());
            let complete = |set: &[Option<Pin>]| set.iter().all(Option::is_some);
            let all = |set: Vec<Option<Pin>>| set.into_iter().flatten().collect::<Vec<_>>();
            if !complete(&release) {
                detach.0.extend(all(release).into_iter().chain(all(admit)));
                continue;
            }
            let admit = if complete(&admit) {
                all(admit)
            } else {
                detach.0.extend(all(admit));
                Vec::new()
            };
            let release = all(release);
            let release_id = release[0].id;
            let attachment = Attachment {
                dir: PathBuf::new(),
                admit,
                release,
                release_id,
            };
            adopted.insert(id, attachment);
        }
        CgroupLinks {
            dir,
            adopted,
            attached: BTreeMap::new(),
            removed: BTreeMap::new(),
            failed: BTreeSet::new(),
            pending: Vec::new(),
        }
    }

    /// How many cgroups' links were adopted and wait for `finish_adoption`.
    pub fn adopted(&self) -> usize {
        self.adopted.len()
    }

    /// Moves the adopted links to this daemon's programs, once its policy is in force
    /// (until then they run the programs of the daemon before, with its policy). Those
    /// of cgroups not in `wanted` lose their admitting links and keep their releasing
    /// ones, as for a cgroup a reload stops selecting; a wanted cgroup adopted without
    /// admitting links gets them. A cgroup whose link cannot be moved is detached and
    /// attached again at the next walk, rather than left running the old policy.
    pub fn finish_adoption(&mut self, ebpf: &mut Ebpf, wanted: &BTreeMap<u64, PathBuf>) {
        for (id, mut a) in std::mem::take(&mut self.adopted) {
            let names = ADMITTING.iter().take(a.admit.len()).chain(&RELEASING);
            let pins = a.admit.iter().chain(&a.release);
            let moved = names.zip(pins).try_for_each(|(name, pin)| {
                let fd = program(ebpf, name)?.fd()?.as_fd().try_clone_to_owned()?;
                pin.update(fd.as_fd())
                    .with_context(|| format!("moving the {name} link"))
            });
            if let Err(e) = moved {
                log::warn!("cgroup {id}: {e:#}; its links are detached, attached again if wanted");
                self.pending.extend(a.into_pins());
                self.failed.insert(id);
                continue;
            }
            let Some(dir) = wanted.get(&id) else {
                self.pending.append(&mut a.admit);
                self.removed.insert(id, a);
                continue;
            };
            a.dir = dir.clone();
            if a.admit.is_empty() {
                match open(id, dir).and_then(|cgroup| admitting(ebpf, &self.dir, id, &cgroup)) {
                    Ok(links) => a.admit = links,
                    Err(e) => {
                        log::warn!("{}: attaching the admitting programs: {e:#}", dir.display());
                        self.failed.insert(id);
                    }
                }
            }
            self.attached.insert(id, a);
        }
    }

    /// Attaches the programs to every cgroup of `wanted` (id -> directory) that lacks
    /// them. A cgroup that cannot be attached (removed meanwhile, or refused: a program
    /// attached without BPF_F_ALLOW_MULTI above it forbids any below) is left unguarded,
    /// fail-open, with a warning, and tried again when `retry` (at each walk; not for
    /// an event, which would wait behind every such failure).
    pub fn attach(&mut self, ebpf: &mut Ebpf, wanted: &BTreeMap<u64, PathBuf>, retry: bool) {
        self.failed.retain(|id| wanted.contains_key(id));
        for (id, dir) in wanted {
            if (!retry && self.failed.contains(id)) || self.adopted.contains_key(id) {
                continue;
            }
            // A cgroup renamed was taken for removed, with its links.
            if let Some(mut a) = self.removed.remove(id) {
                a.dir = dir.clone();
                self.attached.insert(*id, a);
            }
            let result = match self.attached.get_mut(id) {
                Some(a) if !a.admit.is_empty() => continue,
                Some(a) => open(*id, dir)
                    .and_then(|cgroup| admitting(ebpf, &self.dir, *id, &cgroup))
                    .map(|links| a.admit = links),
                None => attach(ebpf, &self.dir, *id, dir).map(|a| {
                    self.attached.insert(*id, a);
                }),
            };
            match result {
                Ok(()) => {
                    self.failed.remove(id);
                }
                // Removed since the walk (or since replaced): nothing to govern.
                Err(_) if !holds(dir, *id) => {}
                Err(e) => {
                    if self.failed.insert(*id) {
                        log::warn!(
                            "{} is not governed: attaching the connection programs failed: {e:#}; tried again at each walk",
                            dir.display()
                        );
                    }
                }
            }
        }
    }

    /// Detaches the admitting programs from every attached cgroup not in `wanted`, and
    /// the links `finish_adoption` took off, when the result is dropped: drop it outside the
    /// caller's locks, as detaching takes the kernel's cgroup_mutex. The releasing
    /// programs stay while the cgroup lives. The attachments of a removed cgroup are
    /// kept until the kernel detaches them (a cgroup renamed is taken for removed, and
    /// keeps them while it lives).
    pub fn detach_others(&mut self, wanted: &BTreeMap<u64, PathBuf>) -> Detached {
        let mut links = std::mem::take(&mut self.pending);
        let gone: Vec<u64> = self
            .attached
            .iter()
            .filter(|(id, _)| !wanted.contains_key(id))
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            if let Some(a) = self.attached.get_mut(&id) {
                if holds(&a.dir, id) {
                    links.append(&mut a.admit);
                } else if let Some(a) = self.attached.remove(&id) {
                    self.removed.insert(id, a);
                }
            }
        }
        Detaching(links)
    }

    /// The attachments of removed cgroups, taken out (see `Removed::reap`).
    pub fn take_removed(&mut self) -> Removed {
        Removed(std::mem::take(&mut self.removed))
    }

    /// Puts back what `Removed::reap` kept.
    pub fn restore_removed(&mut self, kept: Removed) {
        self.removed.extend(kept.0);
    }

    /// The directories the admitting programs are attached to.
    pub fn dirs(&self) -> Vec<PathBuf> {
        self.attached
            .values()
            .filter(|a| !a.admit.is_empty())
            .map(|a| a.dir.clone())
            .collect()
    }
}

/// Whether `dir` is cgroup `id` (a cgroup id is its directory's inode number): not when
/// the cgroup was removed, or removed and created again.
fn holds(dir: &Path, id: u64) -> bool {
    std::fs::metadata(dir).is_ok_and(|m| m.ino() == id)
}

/// The cgroup at `dir`, opened, if it is cgroup `id`.
fn open(id: u64, dir: &Path) -> anyhow::Result<File> {
    let cgroup = File::open(dir).with_context(|| format!("opening {}", dir.display()))?;
    if cgroup.metadata()?.ino() != id {
        anyhow::bail!("{} was replaced", dir.display());
    }
    Ok(cgroup)
}

/// All of the connection programs' links to cgroup `id` at `dir`, pinned in `pins`, or
/// none.
fn attach(ebpf: &mut Ebpf, pins: &Path, id: u64, dir: &Path) -> anyhow::Result<Attachment> {
    let cgroup = open(id, dir)?;
    // On an error, what was attached is detached (dropped).
    let mut release = Detaching::default();
    let mode = CgroupAttachMode::Single;
    let prog: &mut SockOps = program(ebpf, SOCK_STATE)?.try_into()?;
    let link = prog.attach(&cgroup, mode).context(SOCK_STATE)?;
    let link = prog.take_link(link)?.try_into()?;
    release.0.push(pin(link, pins, id, SOCK_STATE)?);
    let mut admit = Detaching(admitting(ebpf, pins, id, &cgroup)?);
    let prog: &mut CgroupSock = program(ebpf, SOCK_RELEASE)?.try_into()?;
    let link = prog.attach(&cgroup, mode).context(SOCK_RELEASE)?;
    let link = prog.take_link(link)?.try_into()?;
    release.0.push(pin(link, pins, id, SOCK_RELEASE)?);
    let release_id = release.0[0].id;
    Ok(Attachment {
        dir: dir.to_path_buf(),
        admit: std::mem::take(&mut admit.0),
        release: std::mem::take(&mut release.0),
        release_id,
    })
}

/// The admitting programs' links to `cgroup` (cgroup `id`), in `ADMITTING` order.
fn admitting(ebpf: &mut Ebpf, pins: &Path, id: u64, cgroup: &File) -> anyhow::Result<Vec<Pin>> {
    let mode = CgroupAttachMode::Single;
    // On an error, what was attached is detached (dropped).
    let mut links = Detaching::default();
    for name in [CONNECT4, CONNECT6] {
        let prog: &mut CgroupSockAddr = program(ebpf, name)?.try_into()?;
        let link = prog.attach(cgroup, mode).context(name)?;
        let link = prog.take_link(link)?.try_into()?;
        links.0.push(pin(link, pins, id, name)?);
    }
    let prog: &mut CgroupSock = program(ebpf, SOCK_CREATE)?.try_into()?;
    let link = prog.attach(cgroup, mode).context(SOCK_CREATE)?;
    let link = prog.take_link(link)?.try_into()?;
    links.0.push(pin(link, pins, id, SOCK_CREATE)?);
    Ok(std::mem::take(&mut links.0))
}

/// Pins program `name`'s link to cgroup `id` in `pins`.
fn pin(link: FdLink, pins: &Path, id: u64, name: &str) -> anyhow::Result<Pin> {
    Pin::new(link, pins.join(format!("cg{id}-{name}")))
}
