//! Reading the guarded namespaces' listeners: each namespace's sock_diag socket is kept
//! open (no thread and no setns per reading), and asked for LISTEN only, and for
//! SYN_RECV too where a decision needs it, else once a second (`SYN_RECV_REFRESH`).
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    fs::File,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use connguard_api::stats::QueueReading;
use guard_common::{
    ListenerEntry, ListenerKey, NO_LISTENER,
    addr::{endpoint, mapped},
    callers::PER_SOURCE_OFF,
    linux::TCP_SYN_RECV,
};

use super::netns_name;
use crate::{
    host::{
        netns,
        sockdiag::{Diag, TcpSocket, syn_recv_of},
    },
    policy::{ListenerPolicy, compile},
};

/// What one reading of the guarded namespaces found.
pub struct Reading {
    pub(super) entries: HashMap<ListenerKey, ListenerEntry>,
    pub(super) queues: Vec<QueueReading>,
    /// Listener ids with a socket past a limit.
    pub(super) shedding: BTreeSet<u32>,
    /// Namespace -> why its socket table could not be read.
    pub(super) unreadable: BTreeMap<String, String>,
}

/// How old the SYN_RECV entries of a reading may be when no decision needs them (they
/// then only feed the `syn_recv` figure of stats and metrics). Asking for them makes the
/// kernel walk its whole established hash table, shared by every namespace: a cost that
/// grows with every connection of the host, too much to pay at every 50 ms reading
/// (docs/performance.md has the figures).
const SYN_RECV_REFRESH: Duration = Duration::from_secs(1);

/// A guarded namespace's open sock_diag socket, with the inode of the namespace it
/// answers for, and its SYN_RECV entries as last read.
struct Namespace {
    inode: u64,
    diag: Diag,
    syn_recv: Vec<TcpSocket>,
    /// When `syn_recv` was read; none before the first reading.
    syn_recv_read: Option<Instant>,
}

/// The guarded namespaces, by netns file (none: the daemon's own).
#[derive(Default)]
pub struct Reader {
    namespaces: HashMap<Option<PathBuf>, Namespace>,
}

impl Reader {
    /// Reads the socket tables of the policies' namespaces. With `per_syn`, entries are
    /// keyed by the listener's namespace (the program reads the queues itself); else by
    /// namespace 0, each carrying the daemon's decision.
    pub fn read(&mut self, policies: &[(ListenerPolicy, u32)], per_syn: bool) -> Reading {
        let mut reading = Reading {
            entries: HashMap::new(),
            queues: Vec::new(),
            shedding: BTreeSet::new(),
            unreadable: BTreeMap::new(),
        };
        let namespaces: BTreeSet<Option<PathBuf>> =
            policies.iter().map(|(p, _)| p.netns.clone()).collect();
        self.namespaces.retain(|ns, _| namespaces.contains(ns));
        for ns in namespaces {
            let guards: Vec<_> = policies.iter().filter(|(p, _)| p.netns == ns).collect();
            // Only the polled program sheds on the daemon's SYN_RECV count; the per-SYN
            // one reads each listener's own.
            let decides_on_syn_recv =
                !per_syn && guards.iter().any(|(p, _)| p.max_syn_recv.is_some());
            let (inode, listeners, syn_recv) =
                match self.sockets(ns.as_deref(), decides_on_syn_recv) {
                    Ok(r) => r,
                    Err(e) => {
                        self.namespaces.remove(&ns);
                        reading
                            .unreadable
                            .insert(netns_name(ns.as_deref()), format!("{e:#}"));
                        continue;
                    }
                };
            let key_ns = if per_syn { inode as u32 } else { 0 };
            for (p, id) in guards {
                judge(p, *id, key_ns, &listeners, syn_recv, &mut reading);
            }
            if per_syn {
                unguarded_shadows(key_ns, &listeners, &mut reading.entries);
            }
        }
        reading
    }

    /// The namespace's inode, listeners and SYN_RECV entries, through its open sock_diag
    /// socket, opened anew when the path names another namespace. The SYN_RECV entries
    /// are read anew when `syn_recv_now` or they are SYN_RECV_REFRESH old, else are the
    /// last ones read.
    fn sockets(
        &mut self,
        ns: Option<&Path>,
        syn_recv_now: bool,
    ) -> anyhow::Result<(u64, Vec<TcpSocket>, &[TcpSocket])> {
        let path = ns.unwrap_or(Path::new("/proc/self/ns/net"));
        let inode = std::fs::metadata(path)?.ino();
        let key = ns.map(Path::to_path_buf);
        if self.namespaces.get(&key).is_none_or(|n| n.inode != inode) {
            let file = File::open(path)?;
            let namespace = Namespace {
                inode: file.metadata()?.ino(),
                diag: netns::within_open(&file, Diag::open)?,
                syn_recv: Vec::new(),
                syn_recv_read: None,
            };
            self.namespaces.insert(key.clone(), namespace);
        }
        let n = self.namespaces.get_mut(&key).expect("inserted above");
        let refresh = syn_recv_now
            || n.syn_recv_read
                .is_none_or(|t| t.elapsed() >= SYN_RECV_REFRESH);
        let mut listeners = n.diag.listeners(refresh)?;
        if refresh {
            // Kept for the readings until the next refresh.
            (n.syn_recv, listeners) = listeners.into_iter().partition(|s| s.state == TCP_SYN_RECV);
            n.syn_recv_read = Some(Instant::now());
        }
        Ok((n.inode, listeners, &n.syn_recv))
    }
}

/// Adds the listeners of one policy among one namespace's `listeners` to `reading`: one
/// entry per (address, port), shared by a SO_REUSEPORT group's members. Its decision
/// (for the polled program) sheds only when every member is past a limit, each member
/// taken to hold an equal share of the port's SYN_RECV (among `half_open`, the
/// namespace's SYN_RECV entries): SYNs are never refused while a member the kernel may
/// hand them to has room.
fn judge(
    p: &ListenerPolicy,
    id: u32,
    netns: u32,
    listeners: &[TcpSocket],
    half_open: &[TcpSocket],
    reading: &mut Reading,
) {
    let mut groups: BTreeMap<ListenerKey, Vec<&TcpSocket>> = BTreeMap::new();
    for l in listeners.iter().filter(|l| {
        p.ports
            .iter()
            .any(|r| (r.first..=r.last).contains(&l.sport))
            && p.addr.is_none_or(|a| a == l.src)
    }) {
        // A wildcard listener (0.0.0.0 or ::) is keyed all zeros.
        let addr = if l.src.is_unspecified() {
            [0; 16]
        } else {
            mapped(l.src)
        };
        let key = ListenerKey {
            netns,
            port: l.sport,
            _pad: 0,
            addr,
        };
        groups.entry(key).or_default().push(l);
    }
    for (key, members) in groups {
        let syn_recv = syn_recv_of(half_open, members[0]);
        let share = syn_recv.div_ceil(members.len() as u32);
        let mut all_over = true;
        for l in &members {
            reading.queues.push(QueueReading {
                listener_id: id,
                addr: endpoint(l.src, l.sport),
                inode: l.inode,
                accept_queue: l.recv_queue,
                backlog: l.send_queue,
                syn_recv,
                rst_shed: 0,
                would_rst: 0,
            });
            // A backlog of 0 still queues one connection: compare against 1.
            let backlog = l.send_queue.max(1) as u64;
            let queue_over = p
                .accept_queue_watermark
                .is_some_and(|w| l.recv_queue as u64 * 1000 >= w as u64 * backlog);
            let syn_over = p.max_syn_recv.is_some_and(|m| share >= m);
            if queue_over || syn_over {
                reading.shedding.insert(id);
            } else {
                all_over = false;
            }
        }
        let entry = ListenerEntry {
            listener_id: id,
            mode: p.mode,
            accept_queue_permille: p.accept_queue_watermark.unwrap_or(0),
            max_syn_recv: p.max_syn_recv.unwrap_or(0),
            shed: u32::from(all_over),
            _pad: 0,
            renewed_ns: 0,
            per_source: compile::per_source(p.per_source.as_ref()),
        };
        // Polled, namespaces share the key (0): shed only when every one is past.
        reading
            .entries
            .entry(key)
            .and_modify(|e| e.shed &= entry.shed)
            .or_insert(entry);
    }
}

/// Entries that guard nothing for the listeners of a namespace (`netns`) on a specific
/// address that no guard selected, where the wildcard listener of their port has
/// per-caller budgets: the state tracepoint finds a connection's listener by its local
/// address, then the wildcard, and would count these listeners' connections against the
/// wildcard guard's callers (guard_common::NO_LISTENER).
fn unguarded_shadows(
    netns: u32,
    listeners: &[TcpSocket],
    entries: &mut HashMap<ListenerKey, ListenerEntry>,
) {
    for l in listeners.iter().filter(|l| !l.src.is_unspecified()) {
        let key = |addr| ListenerKey {
            netns,
            port: l.sport,
            _pad: 0,
            addr,
        };
        let budgets = entries
            .get(&key([0; 16]))
            .is_some_and(|w| w.per_source.action != PER_SOURCE_OFF);
        if budgets {
            entries.entry(key(mapped(l.src))).or_insert(ListenerEntry {
                listener_id: NO_LISTENER,
                ..ListenerEntry::default()
            });
        }
    }
}
