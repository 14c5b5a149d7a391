//! The policy file, watched: the daemon reloads by itself when the file's bytes change.
//!
//! inotify watches directories, not the file: a file replaced by a rename (an editor's
//! save, `mv`) or reached through a symlink that is swapped is a new inode, which a
//! watch on the old one never reports. A Kubernetes ConfigMap volume is such a chain:
//! `policy.toml` is a symlink to `..data/policy.toml`, `..data` a symlink to a
//! timestamped directory, and kubelet updates the volume by writing a new timestamped
//! directory and renaming a new `..data` over the old one. So the watch is on the
//! directory of the path given and on that of the file it resolves to, and an event
//! counts when it names the file, the first step of its symlink (`..data`), or the file
//! it resolves to; the watched directories follow the resolution after every burst.
//!
//! Events come in bursts (a save is several; kubelet's swap is a create, a rename and a
//! removal): a burst ends once no event that counts came for QUIET, or after BURST. The
//! file is then read; when its bytes differ from those of the last burst (or from those
//! read when the watch started), the caller reloads, once. A write that leaves the bytes
//! as they were reloads nothing.
use std::{
    collections::{BTreeMap, BTreeSet},
    ffi::OsString,
    io,
    path::{Component, Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use inotify::{EventMask, Inotify, WatchDescriptor, WatchMask, Watches};
use tokio::io::{Interest, unix::AsyncFd};

/// A burst ends once no event that counts has come for this long...
const QUIET: Duration = Duration::from_millis(200);
/// ... or this long after its first event, for a directory that is never quiet.
const BURST: Duration = Duration::from_secs(2);

/// What a directory's events say of a file in it: written and closed, renamed in or
/// out, created, removed.
fn mask() -> WatchMask {
    WatchMask::CLOSE_WRITE
        | WatchMask::MOVED_TO
        | WatchMask::MOVED_FROM
        | WatchMask::CREATE
        | WatchMask::DELETE
        | WatchMask::ONLYDIR
}

/// The policy file's directories, watched from `new` on.
pub struct PolicyWatch {
    inotify: Inotify,
    files: Files,
}

/// The file, the directories watched for it and the names in them that count.
struct Files {
    path: PathBuf,
    watches: Watches,
    dirs: BTreeMap<PathBuf, WatchDescriptor>,
    by_wd: BTreeMap<WatchDescriptor, PathBuf>,
    names: BTreeSet<(PathBuf, OsString)>,
    /// The file's bytes at the end of the last burst (None: it could not be read).
    last: Option<Vec<u8>>,
}

impl PolicyWatch {
    /// Watches the directories of `path` and reads its bytes, the ones a change is told
    /// from. Made before the daemon reads its first policy, so that a change made
    /// between that read and the serving of the watch is an event waiting for it.
    pub fn new(path: &Path) -> io::Result<PolicyWatch> {
        let inotify = Inotify::init()?;
        let mut files = Files {
            path: path.to_path_buf(),
            watches: inotify.watches(),
            dirs: BTreeMap::new(),
            by_wd: BTreeMap::new(),
            names: BTreeSet::new(),
            last: std::fs::read(path).ok(),
        };
        files.rewatch()?;
        Ok(PolicyWatch { inotify, files })
    }

    /// Calls `changed` (on the blocking pool, waiting for it) once per burst of events
    /// after which the file's bytes differ, until reading the events fails. Runs on a
    /// tokio runtime.
    pub async fn run(self, changed: Arc<dyn Fn() + Send + Sync>) -> io::Result<()> {
        let PolicyWatch { inotify, mut files } = self;
        // SAFETY: the Inotify owns its fd, open for as long as it lives.
        let mut fd = unsafe { AsyncFd::register_with_interest(inotify, Interest::READABLE) }?;
        let mut buffer = vec![0u8; 16 * 1024];
        loop {
            files.next_event(&mut fd, &mut buffer).await?;
            let end = tokio::time::Instant::now() + BURST;
            while let Ok(read) = tokio::time::timeout_at(
                end.min(tokio::time::Instant::now() + QUIET),
                files.next_event(&mut fd, &mut buffer),
            )
            .await
            {
                read?;
            }
            if let Err(e) = files.rewatch() {
                log::warn!(
                    "watching the directories of {}: {e}; changes there are not seen until the next change in the file's own directory",
                    files.path.display()
                );
            }
            let now = std::fs::read(&files.path).ok();
            if now == files.last {
                continue;
            }
            files.last = now;
            log::info!("policy file {} changed: reloading", files.path.display());
            let changed = changed.clone();
            if let Err(e) = tokio::task::spawn_blocking(move || changed()).await {
                return Err(io::Error::other(e));
            }
        }
    }
}

impl Files {
    /// Waits for the next event that counts (an overflowed queue counts: what it lost
    /// is unknown).
    async fn next_event(&mut self, fd: &mut AsyncFd<Inotify>, buffer: &mut [u8]) -> io::Result<()> {
        loop {
            let mut ready = fd.readable_mut().await?;
            let counted = ready.try_io(|inotify| {
                let mut counted = false;
                for event in inotify.get_mut().read_events(buffer)? {
                    if event.mask.contains(EventMask::Q_OVERFLOW) {
                        counted = true;
                    } else if event.mask.contains(EventMask::IGNORED) {
                        // The directory is gone, and its watch with it.
                        if let Some(dir) = self.by_wd.remove(&event.wd) {
                            self.dirs.remove(&dir);
                        }
                    } else if let (Some(dir), Some(name)) = (self.by_wd.get(&event.wd), event.name)
                    {
                        counted |= self.names.contains(&(dir.clone(), name.to_os_string()));
                    }
                }
                Ok(counted)
            });
            if let Ok(counted) = counted
                && counted?
            {
                return Ok(());
            }
        }
    }

    /// Watches the directories the file resolves through now, and no other.
    fn rewatch(&mut self) -> io::Result<()> {
        self.names = names(&self.path);
        let dirs: BTreeSet<PathBuf> = self.names.iter().map(|(d, _)| d.clone()).collect();
        let gone: Vec<PathBuf> = self
            .dirs
            .keys()
            .filter(|d| !dirs.contains(*d))
            .cloned()
            .collect();
        for dir in gone {
            if let Some(wd) = self.dirs.remove(&dir) {
                self.by_wd.remove(&wd);
                // Fails when the directory is gone, which removed the watch already.
                let _ = self.watches.remove(wd);
            }
        }
        let mut first_error = None;
        for dir in dirs {
            if self.dirs.contains_key(&dir) {
                continue;
            }
            match self.watches.add(&dir, mask()) {
                Ok(wd) => {
                    self.by_wd.insert(wd.clone(), dir.clone());
                    self.dirs.insert(dir, wd);
                }
                Err(e) => {
                    first_error
                        .get_or_insert(io::Error::new(e.kind(), format!("{}: {e}", dir.display())));
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

/// The (directory, name) pairs whose events tell of a change of the file at `path`: its
/// own name, the first step of the symlink it is (`..data` of a ConfigMap's
/// `..data/policy.toml`), and the file it resolves to.
fn names(path: &Path) -> BTreeSet<(PathBuf, OsString)> {
    let split = |p: &Path| {
        let dir = match p.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        p.file_name().map(|n| (dir, n.to_os_string()))
    };
    let mut names = BTreeSet::new();
    let Some((dir, name)) = split(path) else {
        return names;
    };
    if let Ok(target) = std::fs::read_link(path)
        && let Some(Component::Normal(first)) = target.components().next()
    {
        names.insert((dir.clone(), first.to_os_string()));
    }
    names.insert((dir, name));
    if let Some(resolved) = std::fs::canonicalize(path).ok().as_deref().and_then(split) {
        names.insert(resolved);
    }
    names
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// A directory of the test's own, removed at the end.
    struct Dir(PathBuf);

    impl Dir {
        fn new(name: &str) -> Dir {
            let dir = std::env::temp_dir().join(format!(
                "connguard-policy-watch-{name}-{}",
                std::process::id()
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Dir(dir)
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// The layout kubelet gives a ConfigMap volume with one key, `policy.toml`, holding
    /// `text`, in a timestamped directory named `stamp`.
    fn config_map(dir: &Path, stamp: &str, text: &str) {
        let data = dir.join(stamp);
        std::fs::create_dir(&data).unwrap();
        std::fs::write(data.join("policy.toml"), text).unwrap();
        std::os::unix::fs::symlink(stamp, dir.join("..data_tmp")).unwrap();
        std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
        if !dir.join("policy.toml").exists() {
            std::os::unix::fs::symlink("..data/policy.toml", dir.join("policy.toml")).unwrap();
        }
    }

    /// Runs a watch of `path`, makes each change of `changes` in turn, and returns how
    /// many times the watch said the file changed after each (waiting for the burst to
    /// end each time).
    fn changes_seen(path: &Path, changes: Vec<Box<dyn FnOnce()>>) -> Vec<usize> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let count = Arc::new(AtomicUsize::new(0));
        let c = count.clone();
        let watch = PolicyWatch::new(path).unwrap();
        let _guard = runtime.enter();
        let task = runtime.spawn(watch.run(Arc::new(move || {
            c.fetch_add(1, Ordering::SeqCst);
        })));
        let mut seen = Vec::new();
        for change in changes {
            change();
            // Past the end of a burst and its read, with room for a second reload that
            // must not come.
            runtime.block_on(tokio::time::sleep(QUIET * 4));
            seen.push(count.load(Ordering::SeqCst));
        }
        task.abort();
        seen
    }

    #[test]
    fn a_rewrite_in_place_a_rename_over_and_an_unchanged_write_are_told_apart() {
        let dir = Dir::new("file");
        let path = dir.0.join("policy.toml");
        std::fs::write(&path, "one").unwrap();
        let (p1, p2, p3, p4) = (path.clone(), path.clone(), path.clone(), dir.0.clone());
        let seen = changes_seen(
            &path,
            vec![
                Box::new(move || std::fs::write(&p1, "two").unwrap()),
                // The same bytes again: no change.
                Box::new(move || std::fs::write(&p2, "two").unwrap()),
                // An editor's save: a new file renamed over the old one.
                Box::new(move || {
                    std::fs::write(p3.with_extension("swp"), "three").unwrap();
                    std::fs::rename(p3.with_extension("swp"), &p3).unwrap();
                }),
                // Another file of the directory.
                Box::new(move || std::fs::write(p4.join("other.toml"), "x").unwrap()),
            ],
        );
        assert_eq!(seen, [1, 1, 2, 2]);
    }

    #[test]
    fn a_config_map_update_is_one_change() {
        let dir = Dir::new("configmap");
        config_map(&dir.0, "..2026_12_01_00_00_00.1", "one");
        let path = dir.0.join("policy.toml");
        let d = dir.0.clone();
        let d2 = dir.0.clone();
        let seen = changes_seen(
            &path,
            vec![
                Box::new(move || {
                    config_map(&d, "..2026_12_01_00_01_00.2", "two");
                    // kubelet removes the old directory after the swap.
                    std::fs::remove_dir_all(d.join("..2026_12_01_00_00_00.1")).unwrap();
                }),
                Box::new(move || {
                    config_map(&d2, "..2026_12_01_00_02_00.3", "three");
                    std::fs::remove_dir_all(d2.join("..2026_12_01_00_01_00.2")).unwrap();
                }),
            ],
        );
        assert_eq!(seen, [1, 2]);
    }

    #[test]
    fn the_names_that_count_follow_the_symlinks() {
        let dir = Dir::new("names");
        config_map(&dir.0, "..a", "one");
        let names = names(&dir.0.join("policy.toml"));
        let real = std::fs::canonicalize(&dir.0).unwrap();
        let want: BTreeSet<(PathBuf, OsString)> = [
            (dir.0.clone(), "..data".into()),
            (dir.0.clone(), "policy.toml".into()),
            (real.join("..a"), "policy.toml".into()),
        ]
        .into();
        assert_eq!(names, want);
        assert_eq!(
            super::names(Path::new("policy.toml")),
            [(PathBuf::from("."), "policy.toml".into())].into()
        );
    }
}
