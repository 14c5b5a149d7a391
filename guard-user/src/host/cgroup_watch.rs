//! Creations of cgroups, as events: inotify on cgroup2 directories reports a mkdir
//! (IN_CREATE with IN_ISDIR, from vfs_mkdir's fsnotify_mkdir) as it returns, so a
//! cgroup that systemd creates again on a service restart is seen before the service's
//! first process runs in it.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    io,
    path::PathBuf,
    sync::{Arc, Mutex, PoisonError},
};

use inotify::{EventMask, Inotify, WatchDescriptor, WatchMask, Watches};

/// The watched directories. `set` may be called from any thread while `run` reads.
pub struct CgroupWatch {
    inotify: Mutex<Option<Inotify>>,
    state: Arc<Mutex<State>>,
}

struct State {
    /// None when inotify could not be had: nothing is watched.
    watches: Option<Watches>,
    dirs: BTreeMap<PathBuf, WatchDescriptor>,
    by_wd: HashMap<i32, PathBuf>,
    /// The watch limit (fs.inotify.max_user_watches) was met; logged once.
    full: bool,
}

impl Default for CgroupWatch {
    fn default() -> CgroupWatch {
        CgroupWatch::new()
    }
}

impl CgroupWatch {
    /// Without inotify (fs.inotify.max_user_instances reached, say), a watch that sees
    /// nothing, with a warning: the caller's periodic walk still finds every cgroup.
    pub fn new() -> CgroupWatch {
        let inotify = Inotify::init()
            .inspect_err(|e| {
                log::warn!("inotify: {e}; cgroups created are picked up by the periodic walk only")
            })
            .ok();
        let state = State {
            watches: inotify.as_ref().map(Inotify::watches),
            dirs: BTreeMap::new(),
            by_wd: HashMap::new(),
            full: false,
        };
        CgroupWatch {
            inotify: Mutex::new(inotify),
            state: Arc::new(Mutex::new(state)),
        }
    }

    /// Watches exactly `dirs` for creations from now on. A directory that cannot be
    /// watched (removed meanwhile, or past the watch limit) is left to the caller's
    /// periodic walk.
    pub fn set(&self, dirs: &BTreeSet<PathBuf>) {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let gone: Vec<PathBuf> = s
            .dirs
            .keys()
            .filter(|d| !dirs.contains(*d))
            .cloned()
            .collect();
        for dir in gone {
            if let Some(wd) = s.dirs.remove(&dir) {
                s.by_wd.remove(&wd.get_watch_descriptor_id());
                if let Some(w) = &mut s.watches {
                    let _ = w.remove(wd);
                }
            }
        }
        s.add(dirs);
    }

    /// Watches `dirs` too.
    pub fn add(&self, dirs: &BTreeSet<PathBuf>) {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        s.add(dirs);
    }

    /// Calls `created` with each directory created in a watched one, in order, until
    /// reading fails. Only the first caller reads.
    pub fn run(&self, mut created: impl FnMut(PathBuf)) -> io::Result<()> {
        let Some(mut inotify) = self
            .inotify
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        else {
            return Ok(());
        };
        let mut buffer = vec![0u8; 64 * 1024];
        loop {
            let events = inotify.read_events_blocking(&mut buffer)?;
            let mut new = Vec::new();
            {
                let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
                for event in events {
                    if event.mask.contains(EventMask::Q_OVERFLOW) {
                        log::warn!(
                            "inotify queue overflow: cgroups created meanwhile are picked up by the periodic walk"
                        );
                        continue;
                    }
                    if event.mask.contains(EventMask::IGNORED) {
                        // The kernel dropped the watch: the directory is gone.
                        let wd = event.wd.get_watch_descriptor_id();
                        if let Some(dir) = s.by_wd.remove(&wd) {
                            s.dirs.remove(&dir);
                        }
                        continue;
                    }
                    if !event.mask.contains(EventMask::CREATE | EventMask::ISDIR) {
                        continue;
                    }
                    let wd = event.wd.get_watch_descriptor_id();
                    if let (Some(dir), Some(name)) = (s.by_wd.get(&wd), event.name) {
                        new.push(dir.join(name));
                    }
                }
            }
            for dir in new {
                created(dir);
            }
        }
    }
}

impl State {
    fn add(&mut self, dirs: &BTreeSet<PathBuf>) {
        let Some(watches) = &mut self.watches else {
            return;
        };
        for dir in dirs {
            if self.dirs.contains_key(dir) {
                continue;
            }
            match watches.add(dir, WatchMask::CREATE | WatchMask::ONLYDIR) {
                Ok(wd) => {
                    self.by_wd.insert(wd.get_watch_descriptor_id(), dir.clone());
                    self.dirs.insert(dir.clone(), wd);
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                    if !self.full {
                        log::warn!(
                            "inotify watch limit reached (fs.inotify.max_user_watches) at {} cgroups: cgroups created below the others are picked up by the periodic walk",
                            self.dirs.len()
                        );
                        self.full = true;
                    }
                    return;
                }
                // Removed meanwhile.
                Err(_) => {}
            }
        }
    }
}
