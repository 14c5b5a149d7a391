//! /proc: which process holds a socket (and a copy of it), a process's cgroup, and a
//! namespace's TcpExt counters.
use std::{
    collections::BTreeMap,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::Path,
};

use anyhow::Context;

/// The process holding a socket.
pub struct Owner {
    pub pid: u32,
    pub comm: String,
    /// Its cgroup v2 path below the cgroup2 mount.
    pub cgroup: Option<String>,
}

/// Socket inode -> the first process holding it (from /proc/PID/fd, as `ss -p` does).
pub fn socket_owners() -> BTreeMap<u32, Owner> {
    let mut out = BTreeMap::new();
    each_socket_fd(|proc_dir, pid, _fd, inode| {
        out.entry(inode).or_insert_with(|| Owner {
            pid,
            comm: std::fs::read_to_string(proc_dir.join("comm"))
                .map(|c| c.trim().to_string())
                .unwrap_or_default(),
            cgroup: cgroup_of(proc_dir),
        });
    });
    out
}

/// Socket inode -> a process holding it and the number of its fd there.
pub fn socket_fds() -> BTreeMap<u32, (u32, i32)> {
    let mut out = BTreeMap::new();
    each_socket_fd(|_, pid, fd, inode| {
        out.entry(inode).or_insert((pid, fd));
    });
    out
}

/// A copy of process `pid`'s file descriptor `fd` (pidfd_open and pidfd_getfd, Linux
/// 5.6; needs CAP_SYS_PTRACE over the process).
pub fn fd_of(pid: u32, fd: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: plain syscalls; each returns a new fd or -1.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if pidfd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new fd, owned from here.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as i32) };
    let copy = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if copy < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above.
    Ok(unsafe { OwnedFd::from_raw_fd(copy as i32) })
}

/// Calls `f(/proc/PID, PID, fd, socket inode)` for every socket fd of every process.
fn each_socket_fd(mut f: impl FnMut(&Path, u32, i32, u32)) {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return;
    };
    for entry in procs.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            let Ok(n) = fd.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let Ok(link) = std::fs::read_link(fd.path()) else {
                continue;
            };
            let link = link.to_string_lossy();
            let Some(Ok(inode)) = link
                .strip_prefix("socket:[")
                .and_then(|s| s.strip_suffix(']'))
                .map(str::parse::<u32>)
            else {
                continue;
            };
            f(&entry.path(), pid, n, inode);
        }
    }
}

/// The cgroup v2 path of a process, from /proc/PID/cgroup ("0::/path").
fn cgroup_of(proc_dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(proc_dir.join("cgroup")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(|p| p.trim_start_matches('/').to_string())
}

/// The TcpExt counters named in `names` of the calling thread's network namespace
/// (/proc/thread-self/net/netstat), as `nstat -az` shows them: totals since the
/// namespace was created.
pub fn tcp_ext_counters(names: &[&str]) -> anyhow::Result<BTreeMap<String, u64>> {
    let text = std::fs::read_to_string("/proc/thread-self/net/netstat")
        .context("reading /proc/thread-self/net/netstat")?;
    Ok(parse_tcp_ext(&text, names))
}

/// The counters named in `names` of the TcpExt lines of a /proc/net/netstat text (a
/// line of names, then a line of values).
fn parse_tcp_ext(text: &str, names: &[&str]) -> BTreeMap<String, u64> {
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with("TcpExt:")).collect();
    let mut out = BTreeMap::new();
    if let [keys, values] = lines[..] {
        for (name, value) in keys
            .split_whitespace()
            .zip(values.split_whitespace())
            .skip(1)
        {
            if names.contains(&name) {
                out.insert(name.to_string(), value.parse().unwrap_or(0));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_ext_counters_are_read_by_name() {
        let text = "TcpExt: SyncookiesSent ListenOverflows ListenDrops Other\nTcpExt: 4 7 9 1\nIpExt: A\nIpExt: 2\n";
        let c = parse_tcp_ext(text, &["ListenOverflows", "ListenDrops", "SyncookiesSent"]);
        assert_eq!(c.get("ListenOverflows"), Some(&7));
        assert_eq!(c.get("ListenDrops"), Some(&9));
        assert_eq!(c.get("SyncookiesSent"), Some(&4));
        assert_eq!(c.get("Other"), None);
    }
}
