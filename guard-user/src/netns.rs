//! Network namespaces: which one a command looks at.
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
