//! Seeding: at a start with no pinned state of its layout (first start, after `connguard
//! stop`, an upgrade that changes the layout), the connections that already exist in
//! governed cgroups are counted, so that a pool opened before the start holds its share
//! of the budget.
//!
//! The kernel's socket table (sock_diag, in each network namespace of the host) gives
//! each socket's cgroup (INET_DIAG_CGROUP_ID), state and addresses; /proc gives a
//! process holding it, and pidfd_getfd a copy of its fd. A setsockopt on that copy runs
//! the `seed` program, attached to the top-most governed cgroups for this moment only,
//! which admits the socket in the kernel, with the same atomic counting and socket
//! storage as connect, and no shedding: a scope over budget at start sheds new connects
//! until enough close. Each seeded socket is released when it reaches TCP_CLOSE, by the
//! state callback the program asks for (where the kernel refuses it, by the state
//! tracepoint, which the daemon then keeps attached). A socket that already has storage
//! (it connected since the programs were attached) is left alone, so none is counted
//! twice.
use std::{
    collections::{BTreeMap, BTreeSet},
    fs::File,
    net::IpAddr,
    os::fd::{AsRawFd, OwnedFd},
    path::{Path, PathBuf},
};

use anyhow::Context;
use aya::{
    Ebpf,
    maps::{Array, MapData},
    programs::{CgroupAttachMode, CgroupSockopt, cgroup_sockopt::CgroupSockoptLink},
};
use guard_common::{
    SEED_SOCKET, SOL_CONNGUARD, SeedRequest,
    addr::mapped,
    linux::TCP_LISTEN,
    names::{map::SEED_KEY, program::SEED},
};

use super::scopes::Governed;
use crate::{
    host::{netns, procfs, sockdiag},
    kernel::object::program,
};

/// What seeding counted.
#[derive(Debug, Default)]
pub struct Seeded {
    /// Connections counted, by scope index in the policy.
    pub by_scope: BTreeMap<usize, u64>,
    /// Outbound connections of governed cgroups left uncounted: held by no process (an
    /// orphan closing), or whose fd could not be copied.
    pub missed: u64,
}

/// One connection to seed.
struct Candidate {
    scope: usize,
    inode: u32,
    request: SeedRequest,
}

/// Seeds the connections of the cgroups in `governed`; `tops` are the top-most ones,
/// where the connection programs are attached.
pub fn seed(
    ebpf: &mut Ebpf,
    governed: &BTreeMap<u64, Governed>,
    tops: &BTreeMap<u64, PathBuf>,
) -> anyhow::Result<Seeded> {
    let mut seeded = Seeded::default();
    if tops.is_empty() {
        return Ok(seeded);
    }
    let selected = nearest_selected(governed);
    let candidates = candidates(governed, &selected)?;
    if candidates.is_empty() {
        return Ok(seeded);
    }
    let key = random_key()?;
    let mut keys: Array<&mut MapData, u64> = Array::try_from(
        ebpf.map_mut(SEED_KEY)
            .with_context(|| format!("map {SEED_KEY} missing"))?,
    )?;
    keys.set(0, key, 0).context("writing SEED_KEY")?;
    let _links = attach(ebpf, tops)?;
    let fds = procfs::socket_fds();
    for mut c in candidates {
        c.request.key = key;
        // The fd, copied, must still be that socket (not a number reused since).
        let copy = fds
            .get(&c.inode)
            .and_then(|(pid, fd)| procfs::fd_of(*pid, *fd).ok())
            .filter(|fd| inode_of(fd) == Some(u64::from(c.inode)));
        match copy.map(|fd| ask(&fd, &c.request)) {
            Some(Ok(true)) => *seeded.by_scope.entry(c.scope).or_default() += 1,
            // Connected or closed since the dump: not ours to count.
            Some(Ok(false)) => {}
            Some(Err(_)) | None => seeded.missed += 1,
        }
    }
    let mut keys: Array<&mut MapData, u64> = Array::try_from(
        ebpf.map_mut(SEED_KEY)
            .with_context(|| format!("map {SEED_KEY} missing"))?,
    )?;
    keys.set(0, 0, 0).context("writing SEED_KEY")?;
    Ok(seeded)
}

/// The inode of an open file (a socket's is its sock_diag inode).
fn inode_of(fd: &OwnedFd) -> Option<u64> {
    // SAFETY: fstat writes the stat it is given.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    (unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } == 0).then_some(st.st_ino)
}

/// A random key, never 0 (getrandom(2)).
pub(super) fn random_key() -> anyhow::Result<u64> {
    let mut key = 0u64;
    while key == 0 {
        // SAFETY: getrandom writes at most 8 bytes into `key`.
        let n = unsafe { libc::getrandom((&raw mut key).cast(), 8, 0) };
        if n != 8 {
            anyhow::bail!("getrandom: {}", std::io::Error::last_os_error());
        }
    }
    Ok(key)
}

/// The selected cgroup whose scope governs each governed cgroup: itself, or its nearest
/// selected ancestor.
fn nearest_selected(governed: &BTreeMap<u64, Governed>) -> BTreeMap<u64, u64> {
    let by_dir: BTreeMap<&Path, u64> = governed
        .iter()
        .filter(|(_, g)| g.selected)
        .map(|(id, g)| (g.dir.as_path(), *id))
        .collect();
    governed
        .iter()
        .filter_map(|(id, g)| {
            let sel = g.dir.ancestors().find_map(|d| by_dir.get(d))?;
            Some((*id, *sel))
        })
        .collect()
}

/// The outbound connections of governed cgroups, from the socket table of each network
/// namespace of the host.
fn candidates(
    governed: &BTreeMap<u64, Governed>,
    selected: &BTreeMap<u64, u64>,
) -> anyhow::Result<Vec<Candidate>> {
    let mut out = Vec::new();
    // Every namespace of the host, from one pass over /proc: reading cgroup.procs of
    // each governed cgroup instead takes seconds with a policy on `/` and 50,000 cgroups.
    for ns in netns::all() {
        let (sockets, cookie) = netns::within_open(&ns, || {
            Ok((
                sockdiag::connections_and_listeners()?,
                netns::cookie().unwrap_or(0),
            ))
        })
        .context("reading a socket table")?;
        // An accepted connection shares its local port with a listener: the server side
        // of a connection is not counted.
        let listening: BTreeSet<(IpAddr, u16)> = sockets
            .iter()
            .filter(|s| s.state == TCP_LISTEN)
            .map(|s| (s.src, s.sport))
            .collect();
        for s in &sockets {
            let Some(sel) = selected.get(&s.cgroup_id) else {
                continue;
            };
            let unspecified = if s.src.is_ipv4() {
                IpAddr::from([0u8; 4])
            } else {
                IpAddr::from([0u8; 16])
            };
            if !sockdiag::CONNECTION_STATES.contains(&s.state)
                || listening.contains(&(s.src, s.sport))
                || listening.contains(&(unspecified, s.sport))
            {
                continue;
            }
            out.push(Candidate {
                scope: governed[&s.cgroup_id].scope,
                inode: s.inode,
                request: SeedRequest {
                    key: 0,
                    cgroup_id: *sel,
                    netns: cookie,
                    src: mapped(s.src),
                    dst: mapped(s.dst),
                    dport: s.dport,
                    _pad: [0; 6],
                },
            });
        }
    }
    Ok(out)
}

/// The seed program, attached to every top-most governed cgroup; detached on drop.
fn attach(
    ebpf: &mut Ebpf,
    tops: &BTreeMap<u64, PathBuf>,
) -> anyhow::Result<Vec<CgroupSockoptLink>> {
    let prog: &mut CgroupSockopt = program(ebpf, SEED)?.try_into()?;
    let mut links = Vec::new();
    for dir in tops.values() {
        let cgroup = File::open(dir).with_context(|| format!("opening {}", dir.display()))?;
        let link = prog
            .attach(&cgroup, CgroupAttachMode::Single)
            .with_context(|| format!("attaching {SEED} to {}", dir.display()))?;
        links.push(prog.take_link(link)?);
    }
    Ok(links)
}

/// Asks the seed program to count the socket `fd`: Ok(false) when it refused (EPERM:
/// the socket has storage, or is closed).
fn ask(fd: &OwnedFd, request: &SeedRequest) -> std::io::Result<bool> {
    // SAFETY: `request` is valid for its size for the call.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            SOL_CONNGUARD,
            SEED_SOCKET,
            (request as *const SeedRequest).cast(),
            std::mem::size_of::<SeedRequest>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EPERM) {
        Ok(false)
    } else {
        Err(e)
    }
}
