//! Network namespaces: entering one, working inside one, its cookie and interfaces.
use std::{
    fs::File,
    os::fd::AsRawFd,
    path::{Path, PathBuf},
};

use anyhow::Context;

/// Moves the calling thread into the network namespace at `path` (a bind mount such as
/// /run/netns/NAME, or /proc/PID/ns/net). Sockets created afterwards, netlink included,
/// and /proc/sys/net reads belong to that namespace.
pub fn enter(path: &Path) -> anyhow::Result<()> {
    let ns = File::open(path)
        .with_context(|| format!("opening network namespace {}", path.display()))?;
    enter_open(&ns).with_context(|| format!("entering network namespace {}", path.display()))
}

/// Moves the calling thread into the network namespace open as `ns`.
fn enter_open(ns: &File) -> std::io::Result<()> {
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Runs `f` in the network namespace open as `ns`, on a thread of its own (see
/// `within`). The file keeps naming that namespace when its path is bound to another.
pub fn within_open<T: Send>(
    ns: &File,
    f: impl FnOnce() -> anyhow::Result<T> + Send,
) -> anyhow::Result<T> {
    std::thread::scope(|s| {
        s.spawn(|| {
            enter_open(ns).context("entering a network namespace")?;
            f()
        })
        .join()
        .map_err(|_| anyhow::anyhow!("work in a network namespace panicked"))?
    })
}

/// Runs `f` in the network namespace at `path` (None: the caller's own), on a thread of
/// its own: setns() moves only the calling thread, and the caller stays where it is.
pub fn within<T: Send>(
    path: Option<&Path>,
    f: impl FnOnce() -> anyhow::Result<T> + Send,
) -> anyhow::Result<T> {
    std::thread::scope(|s| {
        s.spawn(|| {
            if let Some(path) = path {
                enter(path)?;
            }
            f()
        })
        .join()
        .map_err(|_| anyhow::anyhow!("work in network namespace {path:?} panicked"))?
    })
}

/// The cookie of the calling thread's network namespace (SO_NETNS_COOKIE, Linux 5.14+;
/// ENOPROTOOPT before), which eBPF programs see as bpf_get_netns_cookie().
pub fn cookie() -> std::io::Result<u64> {
    const SO_NETNS_COOKIE: libc::c_int = 71;
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut cookie = 0u64;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            (&raw mut cookie).cast(),
            &mut len,
        )
    };
    let err = std::io::Error::last_os_error();
    unsafe { libc::close(fd) };
    if rc != 0 {
        return Err(err);
    }
    Ok(cookie)
}

/// `paths` (of network namespaces: /proc/PID/ns/net, bind mounts) with one per
/// namespace, in order; a path that cannot be read (a process that exited) is skipped.
pub fn distinct(paths: impl IntoIterator<Item = PathBuf>) -> Vec<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let mut seen = std::collections::BTreeSet::new();
    paths
        .into_iter()
        .filter(|p| std::fs::metadata(p).is_ok_and(|m| seen.insert((m.dev(), m.ino()))))
        .collect()
}

/// Every network namespace of the host that a thread is in or that is bind-mounted in
/// /run/netns, opened (an open namespace stays, whoever leaves it), one per namespace,
/// the daemon's own first. A thread that exits meanwhile is skipped.
pub fn all() -> Vec<File> {
    use std::os::unix::fs::MetadataExt;
    let numbered = |path: &Path| -> Vec<PathBuf> {
        std::fs::read_dir(path)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .bytes()
                    .all(|b| b.is_ascii_digit())
            })
            .map(|e| e.path())
            .collect()
    };
    let threads = numbered(Path::new("/proc"))
        .into_iter()
        .flat_map(|p| numbered(&p.join("task")))
        .map(|t| t.join("ns/net"));
    let mounted = std::fs::read_dir("/run/netns")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path());
    let mut seen = std::collections::BTreeSet::new();
    std::iter::once(PathBuf::from("/proc/self/ns/net"))
        .chain(threads)
        .chain(mounted)
        .filter_map(|p| File::open(p).ok())
        .filter(|f| f.metadata().is_ok_and(|m| seen.insert((m.dev(), m.ino()))))
        .collect()
}

/// The interfaces of the calling thread's network namespace, with their indexes (an
/// interface deleted and created again under its name gets a new one). One deleted
/// between the two reads is left out.
pub fn interfaces() -> anyhow::Result<Vec<(String, u32)>> {
    let dev = std::fs::read_to_string("/proc/thread-self/net/dev")
        .context("reading /proc/thread-self/net/dev")?;
    Ok(dev
        .lines()
        .skip(2)
        .filter_map(|l| l.split_once(':').map(|(n, _)| n.trim().to_string()))
        .filter_map(|name| {
            let c = std::ffi::CString::new(name.as_str()).ok()?;
            // SAFETY: a NUL-terminated name; if_nametoindex asks the calling thread's
            // namespace.
            let index = unsafe { libc::if_nametoindex(c.as_ptr()) };
            (index != 0).then_some((name, index))
        })
        .collect())
}
