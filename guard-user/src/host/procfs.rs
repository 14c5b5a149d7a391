//! /proc: which process holds a socket, a process's cgroup, and a namespace's TcpExt
//! counters.
use std::{collections::BTreeMap, path::Path};

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
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return out;
    };
    for entry in procs.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            let Ok(link) = std::fs::read_link(fd.path()) else {
                continue;
            };
            let link = link.to_string_lossy();
            let Some(inode) = link
                .strip_prefix("socket:[")
                .and_then(|s| s.strip_suffix(']'))
            else {
                continue;
            };
            let Ok(inode) = inode.parse::<u32>() else {
                continue;
            };
            out.entry(inode).or_insert_with(|| Owner {
                pid,
                comm: std::fs::read_to_string(entry.path().join("comm"))
                    .map(|c| c.trim().to_string())
                    .unwrap_or_default(),
                cgroup: cgroup_of(&entry.path()),
            });
        }
    }
    out
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
