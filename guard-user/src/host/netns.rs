//! Network namespaces: entering one, working inside one, its cookie and interfaces.
use std::{fs::File, os::fd::AsRawFd, path::Path};

use anyhow::{Context, bail};

/// Moves the calling thread into the network namespace at `path` (a bind mount such as
/// /run/netns/NAME, or /proc/PID/ns/net). Sockets created afterwards, netlink included,
/// and /proc/sys/net reads belong to that namespace.
pub fn enter(path: &Path) -> anyhow::Result<()> {
    let ns = File::open(path)
        .with_context(|| format!("opening network namespace {}", path.display()))?;
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        bail!(
            "entering network namespace {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        );
    }
    Ok(())
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

/// The interfaces of the calling thread's network namespace.
pub fn interfaces() -> anyhow::Result<Vec<String>> {
    let dev = std::fs::read_to_string("/proc/thread-self/net/dev")
        .context("reading /proc/thread-self/net/dev")?;
    Ok(dev
        .lines()
        .skip(2)
        .filter_map(|l| l.split_once(':').map(|(n, _)| n.trim().to_string()))
        .collect())
}
