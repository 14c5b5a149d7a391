//! State that outlives the daemon: maps and links pinned in bpffs, one directory per
//! state layout, `/sys/fs/bpf/connguard/v<layout>/` with `maps/` and `links/`.
//!
//! The counting maps (`names::map::PINNED`) are pinned by name and adopted by the next
//! daemon of the same layout, with the sockets' storage in them: a socket admitted
//! before a restart is released into the same counters when it closes. The links are
//! pinned too, so the programs stay attached while no daemon runs; the next daemon
//! moves each to its own programs (BPF_LINK_UPDATE), with no moment unattached. A pin,
//! not a file descriptor, holds each link; a link is detached, then its pin removed
//! (`detach_pinned`).
use std::{
    fs::File,
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd},
    path::{Path, PathBuf},
};

use anyhow::{Context, bail};
use aya::programs::links::FdLink;

use super::syscall::{link_update, obj_get};

/// Where every layout's state directory is, by default: one daemon's state. Daemons
/// that govern disjoint cgroup trees of one host each take a root of their own
/// (`connguard run --state-dir`).
pub const ROOT: &str = guard_common::STATE_ROOT;

/// This daemon's state directory, locked for its life.
pub struct State {
    root: PathBuf,
    dir: PathBuf,
    /// flock(LOCK_EX) on the root, so that one daemon at a time owns its pins.
    _lock: File,
    /// Whether the maps were pinned already, by a daemon before this one.
    pub adopted: bool,
}

impl State {
    /// Opens (creating) the directory of state `layout` and takes its lock: an error
    /// when another daemon holds it. bpffs must be mounted.
    pub fn open(root: &Path, layout: u32) -> anyhow::Result<State> {
        let dir = root.join(format!("v{layout}"));
        for d in [dir.join("maps"), dir.join("links")] {
            std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
        }
        let lock = File::open(root).with_context(|| format!("opening {}", root.display()))?;
        // SAFETY: flock on an fd we own.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            bail!(
                "another connguard daemon holds {} ({}); one daemon runs per state \
                 directory (--state-dir)",
                root.display(),
                io::Error::last_os_error()
            );
        }
        let adopted = std::fs::read_dir(dir.join("maps"))?.next().is_some();
        Ok(State {
            root: root.to_path_buf(),
            dir,
            _lock: lock,
            adopted,
        })
    }

    pub fn map_path(&self, name: &str) -> PathBuf {
        self.dir.join("maps").join(name)
    }

    pub fn links_dir(&self) -> PathBuf {
        self.dir.join("links")
    }

    /// The state directories of other layouts (left by a daemon of another version):
    /// `v<layout>`, not this one's.
    pub fn other_layouts(&self) -> Vec<PathBuf> {
        self.entries(|p| *p != self.dir && is_layout(p))
    }

    /// The root's entries that are no layout's: marks every layout shares (that a
    /// foreign sock_ops program was seen, kernel::backstop).
    fn marks(&self) -> Vec<PathBuf> {
        self.entries(|p| !is_layout(p))
    }

    fn entries(&self, keep: impl Fn(&PathBuf) -> bool) -> Vec<PathBuf> {
        std::fs::read_dir(&self.root)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(keep)
            .collect()
    }

    /// Removes this layout's pins (its links detach, its maps go when their last
    /// program does) and the root's marks.
    pub fn remove(&self) -> io::Result<usize> {
        let n = remove_pins(&self.dir)?;
        for mark in self.marks() {
            remove_pins(&mark)?;
        }
        remove_root(&self.root)?;
        Ok(n)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }
}

/// Whether `p` is a layout's state directory: `v<layout>`.
fn is_layout(p: &Path) -> bool {
    p.file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix('v'))
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Removes the root once nothing is pinned below it, so that a clean stop leaves
/// nothing in bpffs; a daemon that started meanwhile keeps it (it is not empty then).
fn remove_root(root: &Path) -> io::Result<()> {
    match std::fs::remove_dir(root) {
        Err(e)
            if !matches!(
                e.kind(),
                io::ErrorKind::NotFound | io::ErrorKind::DirectoryNotEmpty
            ) =>
        {
            Err(e)
        }
        _ => Ok(()),
    }
}

/// Removes the pins of every layout, when no daemon holds them (`connguard stop` with
/// no daemon running); returns how many.
pub fn remove_left(root: &Path) -> anyhow::Result<usize> {
    if !root.exists() {
        return Ok(0);
    }
    let lock = File::open(root).with_context(|| format!("opening {}", root.display()))?;
    // SAFETY: flock on an fd we own.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        bail!(
            "a connguard daemon holds {} but did not answer: stop it with its --socket",
            root.display()
        );
    }
    let mut n = 0;
    for dir in std::fs::read_dir(root)? {
        n += remove_pins(&dir?.path())?;
    }
    remove_root(root)?;
    Ok(n)
}

/// Removes every pin below `dir`, and the directories; returns how many pins. A pin
/// removed meanwhile (a link the kernel detached, reaped) is not an error.
pub fn remove_pins(dir: &Path) -> io::Result<usize> {
    let gone = |r: io::Result<()>| match r {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    };
    let mut n = 0;
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            n += remove_pins(&path)?;
        } else {
            detach_pinned(&path);
            gone(std::fs::remove_file(&path))?;
            n += 1;
        }
    }
    gone(std::fs::remove_dir(dir))?;
    Ok(n)
}

/// Detaches the link pinned at `path`, if a link is, so that it is gone from its hook
/// before its pin is removed: removing the pin alone detaches it some time after
/// (`syscall::link_detach`). Not a link (a map's pin), gone, or of a type that cannot
/// be detached so (it goes with its pin): nothing to do.
fn detach_pinned(path: &Path) {
    match obj_get(path).and_then(|fd| super::syscall::link_detach(fd.as_fd())) {
        Ok(()) => {}
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EINVAL | libc::EOPNOTSUPP | libc::ENOENT)
            ) => {}
        Err(e) => log::warn!("detaching the link pinned at {}: {e}", path.display()),
    }
}

/// A bpf_link held by its pin. Dropping it keeps the pin, so that a daemon that exits
/// or fails, however it does, leaves its programs attached; only `unpin` (or dropping a
/// `Detaching` holding it) detaches it.
pub struct Pin {
    path: PathBuf,
    /// The kernel's id of the link.
    pub id: u32,
}

impl Pin {
    /// Pins `link` at `path`; the link's fd is closed, the pin holds it.
    pub fn new(link: FdLink, path: PathBuf) -> anyhow::Result<Pin> {
        let id = link.info()?.id();
        link.pin(&path)
            .with_context(|| format!("pinning a link at {}", path.display()))?;
        Ok(Pin { path, id })
    }

    /// The link pinned at `path`, by a daemon before this one.
    pub fn adopt(path: PathBuf) -> io::Result<Pin> {
        let fd = obj_get(&path)?;
        let id = super::syscall::link_id(fd.as_fd())?;
        Ok(Pin { path, id })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Moves the link to program `prog`, atomically: the kernel runs the old program
    /// or the new one, never neither.
    pub fn update(&self, prog: BorrowedFd<'_>) -> io::Result<()> {
        let fd = obj_get(&self.path)?;
        link_update(fd.as_fd(), prog)
    }

    /// Detaches the link and removes its pin (`detach_pinned`).
    pub fn unpin(self) {
        detach_pinned(&self.path);
        if let Err(e) = std::fs::remove_file(&self.path)
            && e.kind() != io::ErrorKind::NotFound
        {
            log::warn!("removing the pin {}: {e}", self.path.display());
        }
    }
}

/// Links to detach: their pins are removed when this is dropped.
#[derive(Default)]
#[must_use]
pub struct Detaching(pub Vec<Pin>);

impl Drop for Detaching {
    fn drop(&mut self) {
        for pin in self.0.drain(..) {
            pin.unpin();
        }
    }
}

#[cfg(test)]
mod tests {
    /// Other layouts are the `v<digits>` directories of the root but this one's; every
    /// other entry (the foreign sock_ops mark, a `vx1`) is a mark, removed at a stop.
    #[test]
    fn other_layouts_are_the_v_directories_only() {
        let root = std::env::temp_dir().join(format!("connguard-layouts-{}", std::process::id()));
        for d in ["v7", "v8", "foreign-sock-ops-seen", "vx1"] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        let state = super::State::open(&root, 8).unwrap();
        let others = state.other_layouts();
        let mut marks = state.marks();
        marks.sort();
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!(others, vec![root.join("v7")]);
        assert_eq!(
            marks,
            [root.join("foreign-sock-ops-seen"), root.join("vx1")]
        );
    }
}
