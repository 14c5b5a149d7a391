//! The audit: every `--audit` seconds the active and connecting counts are recounted
//! from the live sockets and compared with the counters; a difference that holds still
//! over two audits is corrected, logged with its key, and counted (`audit_corrections`).
//! At rest it finds nothing: a correction is a bug report.
//!
//! The recount reads every TCP connection's and listener's storage through sock_diag
//! (INET_DIAG_REQ_SK_BPF_STORAGES; a listener holds an admission when its socket's
//! connect() failed before the SYN), in every network namespace of the host: a socket
//! holding an admission counts as active at each level it charged, and as connecting at
//! each level its handshake is still counted at (`SockState::connecting`); at
//! destination level only while the entry it charged is the one there (same epoch). A
//! key whose counter moved while the sockets were read is left for the next audit, and
//! so is one whose difference is new: a connect between its reservation and the storage
//! write, or a release between the two, differs for an instant, never for two audits. A
//! namespace whose table cannot be read ends the audit, with nothing corrected. The
//! correction is applied by the `adjust` program (BPF_PROG_TEST_RUN) as a
//! compare-and-swap from the count the audit saw, so a concurrent update is never lost:
//! the correction waits instead.
use std::{
    collections::HashMap,
    os::fd::{AsFd, OwnedFd},
    sync::{
        Mutex, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
};

use anyhow::Context;
use guard_common::{
    ADJUST_ACTIVE, ADJUST_CONNECTING, Adjustment, Counter, CounterKey, NO_RULE, SockState,
};

use super::counters::CounterDump;
use crate::{
    host::{netns, sockdiag},
    kernel::syscall::prog_test_run,
};

/// A counter, by level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Key {
    Destination(CounterKey),
    Rule(u32),
    Scope(u32),
}

/// A count the audit checks; its value is the `Adjustment::count` that names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
pub enum Count {
    /// `Counter::active`: admitted and not yet closed.
    Active = ADJUST_ACTIVE,
    /// `Counter::connecting`: admitted and in the handshake.
    Connecting = ADJUST_CONNECTING,
}

impl Count {
    const ALL: [Count; 2] = [Count::Active, Count::Connecting];

    fn of(self, c: &Brief) -> u64 {
        match self {
            Count::Active => c.active,
            Count::Connecting => c.connecting,
        }
    }
}

/// What an audit compares of one counter, read at one moment: a fraction of a
/// `Counter`, so that two readings of every counter stay small beside the map.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Brief {
    active: u64,
    connecting: u64,
    admitted: u64,
    shed: u64,
    would_shed: u64,
    /// A destination entry's `epoch`.
    epoch: u64,
}

impl From<&Counter> for Brief {
    fn from(c: &Counter) -> Brief {
        Brief {
            active: c.active,
            connecting: c.connecting,
            admitted: c.admitted,
            shed: c.shed,
            would_shed: c.would_shed,
            epoch: c.epoch,
        }
    }
}

/// Every counter of a dump, by key, as an audit compares them (`reading`).
pub struct Reading(HashMap<Key, Brief>);

/// The counters of `dump`, kept as an audit compares them; the dump's destination
/// chunks are freed as they are read.
pub fn reading(dump: CounterDump) -> Reading {
    let rules = (0u32..)
        .zip(&dump.rules)
        .map(|(id, c)| (Key::Rule(id), c.into()));
    let scopes = (0u32..)
        .zip(&dump.scopes)
        .map(|(id, c)| (Key::Scope(id), c.into()));
    // Sized at once: growing it while the chunks are held would briefly hold two tables.
    let n = dump.rules.len()
        + dump.scopes.len()
        + dump.destinations.iter().map(Vec::len).sum::<usize>();
    let mut all: HashMap<Key, Brief> = HashMap::with_capacity(n);
    all.extend(rules.chain(scopes));
    for (k, c) in dump.destinations.into_iter().flatten() {
        all.insert(Key::Destination(k), (&c).into());
    }
    Reading(all)
}

/// Live sockets, by counter and count.
pub type Live = HashMap<(Key, Count), u64>;

/// A difference: the counter's count and admitted, and the live count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Seen {
    counted: u64,
    admitted: u64,
    live: u64,
}

/// A correction made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Correction {
    pub key: Key,
    pub count: Count,
    pub counted: u64,
    pub live: u64,
}

/// The audit's state; its recount takes no lock, so `stats` never waits for one.
pub struct Audit {
    /// The socket storage map (SOCKS) and the adjust program.
    socks: OwnedFd,
    adjust: OwnedFd,
    /// Differences found by the last audit.
    seen: Mutex<HashMap<(Key, Count), Seen>>,
    /// Corrections made since the daemon started.
    corrections: AtomicU64,
}

impl Audit {
    pub fn new(socks: OwnedFd, adjust: OwnedFd) -> Audit {
        Audit {
            socks,
            adjust,
            seen: Mutex::default(),
            corrections: AtomicU64::new(0),
        }
    }

    /// Corrections made since the daemon started.
    pub fn corrections(&self) -> u64 {
        self.corrections.load(Ordering::Relaxed)
    }

    /// Live admissions and handshakes by counter, from every socket's storage in every
    /// network namespace; `before` gives the destination entries' epochs.
    pub fn recount(&self, before: &Reading) -> anyhow::Result<Live> {
        let mut live = HashMap::new();
        for ns in netns::all() {
            let sockets = netns::within_open(&ns, || sockdiag::tcp_storages(self.socks.as_fd()))
                .inspect_err(|_| self.forget())?;
            for s in sockets {
                let Some(state) = sock_state(&s.storage) else {
                    continue;
                };
                for (key, connecting) in charged(&state, before) {
                    *live.entry((key, Count::Active)).or_default() += 1;
                    if connecting {
                        *live.entry((key, Count::Connecting)).or_default() += 1;
                    }
                }
            }
        }
        Ok(live)
    }

    /// Compares `live` with the counters read `before` and `after` it, and corrects the
    /// differences this audit and the one before found alike.
    pub fn compare(&self, before: &Reading, live: &Live, after: &Reading) -> Vec<Correction> {
        let mut last = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        let (b, a) = (&before.0, &after.0);
        let zero = Brief::default();
        // Only the counts that differ from the live ones (the rest need nothing), in
        // order.
        let mut keys: Vec<(Key, Count)> = b
            .iter()
            .flat_map(|(&k, c)| Count::ALL.map(|n| (k, n, n.of(c))))
            .filter(|&(k, n, counted)| live.get(&(k, n)).copied().unwrap_or(0) != counted)
            .map(|(k, n, _)| (k, n))
            .chain(live.keys().filter(|(k, _)| !b.contains_key(k)).copied())
            .collect();
        keys.sort();
        keys.dedup();
        let mut seen = HashMap::new();
        let mut made = Vec::new();
        for (key, count) in keys {
            let (cb, ca) = (b.get(&key).unwrap_or(&zero), a.get(&key).unwrap_or(&zero));
            let now = Seen {
                counted: count.of(cb),
                admitted: cb.admitted,
                live: live.get(&(key, count)).copied().unwrap_or(0),
            };
            // Moved while the sockets were read: `admitted` for every admission, the shed
            // counts for an attempt's reservation taken back (not in `Seen`, so that a
            // difference that keeps shedding is still corrected).
            let moved = (now.counted, cb.admitted, cb.shed, cb.would_shed)
                != (count.of(ca), ca.admitted, ca.shed, ca.would_shed);
            if moved {
                continue;
            }
            if last.get(&(key, count)) != Some(&now) {
                seen.insert((key, count), now);
                continue;
            }
            match self.apply(key, count, now.counted, now.live) {
                Ok(true) => {
                    self.corrections.fetch_add(1, Ordering::Relaxed);
                    made.push(Correction {
                        key,
                        count,
                        counted: now.counted,
                        live: now.live,
                    });
                }
                // Moved since read: the next audits look again.
                Ok(false) => {}
                Err(e) => log::warn!("audit: correcting {key:?}: {e:#}"),
            }
        }
        *last = seen;
        made
    }

    /// Forgets the differences seen, after an audit that could not read everything.
    fn forget(&self) {
        self.seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }

    /// Sets `count` of `key` from `expected` to `target`, in the kernel; false when it
    /// no longer held `expected`.
    fn apply(&self, key: Key, count: Count, expected: u64, target: u64) -> anyhow::Result<bool> {
        let (key, level) = match key {
            Key::Destination(k) => (k, 0),
            Key::Rule(id) => (
                CounterKey {
                    rule_id: id,
                    ..Default::default()
                },
                1,
            ),
            Key::Scope(id) => (
                CounterKey {
                    scope_id: id,
                    ..Default::default()
                },
                2,
            ),
        };
        let adjustment = Adjustment {
            key,
            level,
            count: count as u32,
            _pad: 0,
            expected,
            target,
        };
        // A 14-byte Ethernet header, then the correction (see the adjust program).
        let mut data = vec![0u8; 14];
        // SAFETY: Adjustment is repr(C) with no padding; its bytes are plain data.
        data.extend_from_slice(unsafe {
            std::slice::from_raw_parts(
                (&raw const adjustment).cast::<u8>(),
                std::mem::size_of::<Adjustment>(),
            )
        });
        match prog_test_run(self.adjust.as_fd(), &data).context("running adjust")? {
            0 => Ok(true),
            2 => Ok(false),
            _ => anyhow::bail!("no such counter"),
        }
    }
}

/// The socket's state from its storage value, when it holds an admission.
fn sock_state(value: &[u8]) -> Option<SockState> {
    if value.len() != std::mem::size_of::<SockState>() {
        return None;
    }
    // SAFETY: the length is checked; SockState is repr(C) plain data, read unaligned.
    let state: SockState = unsafe { std::ptr::read_unaligned(value.as_ptr().cast()) };
    (state.admitted == 1).then_some(state)
}

/// The counters an admission holds (connect's charged bits: 0 destination, 1 rule, 2
/// scope), each with whether its handshake is still counted there (the same bits of
/// `connecting`); the destination only while its entry is the one it charged.
fn charged(state: &SockState, before: &Reading) -> Vec<(Key, bool)> {
    let dst = state.dst;
    let epoch = before.0.get(&Key::Destination(dst)).map(|c| c.epoch);
    let levels = [
        (epoch == Some(state.dst_epoch)).then_some(Key::Destination(dst)),
        (dst.rule_id != NO_RULE).then_some(Key::Rule(dst.rule_id)),
        Some(Key::Scope(dst.scope_id)),
    ];
    (0..3)
        .filter(|i| state.charged & (1 << i) != 0)
        .filter_map(|i| Some((levels[i]?, state.connecting & (1 << i) != 0)))
        .collect()
}
