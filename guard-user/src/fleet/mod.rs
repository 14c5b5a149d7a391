//! Fleet budgets: one destination set's connection budget shared by every host that
//! draws from it, through etcd.
//!
//! # What is counted
//! A fleet budget has a name, a total and destinations. Counted against the total are
//! the **active connections** (admitted and not yet in TCP_CLOSE, whatever their state;
//! TIME_WAIT is not active) of the rules that draw from the budget, summed over every
//! host of the fleet. Each host holds a **share** of the total and enforces it as a
//! kernel budget over those rules' connections together; the kernel admits a new
//! connection only while the host's active count is under its share, and never cuts
//! one.
//!
//! # The model
//! Each host runs one [`Fleet`] with its identity (unique in the fleet; stable across
//! restarts) and one etcd lease (TTL [`DEFAULT_TTL`]). Per budget it keeps a record
//! under that lease ([`record`] has the key layout): its lease id, `has` (its share),
//! `active`, `wants` (active plus what it shed since the last refresh, plus a tenth for
//! headroom), weight, floor, the total it is configured with, and the store revision its
//! computation was based on. A record's **claim** is `max(has, active)`: a lowered share
//! releases only what has closed. Every refresh ([`DEFAULT_REFRESH`], and at once when
//! demand jumps or another record changes) the host computes the fair split
//! ([`share::fair_shares`]: floors, then weighted max-min over wants) of the smallest
//! total any live record names, from every live record, and moves its share toward its
//! target:
//! - **lower**: at once, on its own: first the kernel budget, then the record;
//! - **raise**: the record first, through a transaction, then the kernel budget. The
//!   new share is at most `total - Σ other claims` as the host's view holds them. The
//!   transaction compares the mod_revision of the budget's one **raise key** with the
//!   one in the view, compares that the host's key still holds its lease, writes the
//!   record and bumps the raise key.
//!
//! # Why the shares never add up to more than the total (invariant 10)
//! Every write that can make a claim larger bumps the raise key in the same
//! transaction: a raise, a record created with active connections, a lower total.
//! Every other write (a lower, a drain of active connections, a new `wants`, a record
//! deleted by its lease's expiry) only shrinks claims. A host's view is a consistent
//! snapshot at some revision R (a listing, then the watch's events in revision order).
//! If its raise commits, the raise key has not moved since the view's R, so no claim
//! grew after R: the others' claims now are at most those in the view, and
//! `new share + Σ others ≤ total` holds at the commit, whatever the host's view missed
//! (stale views only overestimate). Each host is the only writer of its key (the lease
//! compare), and enforces at most its record's `has`, so the kernels together enforce at
//! most the total. One key per budget, rather than comparing every record's revision,
//! because a lower or a demand update must not fail concurrent raises, and because a
//! record created after the view (which a comparison of the records read cannot see)
//! bumps it.
//!
//! A host that cannot renew its lease keeps its shares until the lease could have
//! expired in etcd: until the instant it *sent* its last acknowledged keep-alive plus
//! the granted TTL (etcd counts from when it received it, so it expires no sooner),
//! less a fifth of the TTL. Then it falls to each budget's **safe share** (default 0),
//! logged and in [`Status`]; a record deleted by the expiry releases its claim to the
//! others only after that. A nonzero safe share is enforced without any record: it
//! trades invariant 10 for availability, by at most the safe share for each cut-off
//! host.
//!
//! # Faults
//! - etcd unreachable: shares kept until the deadline above, then safe shares; the loop
//!   reconnects with backoff, adopts its lease if it is alive (then the record and its
//!   claim are too) or grants a new one and starts again from zero.
//! - a host dies: its lease expires, etcd deletes its records, the watch tells the
//!   others, who raise into the freed claim: within TTL (plus etcd's expiry check
//!   period) plus one refresh.
//! - etcd restarted or compacted: each session lists and watches from the listing's
//!   revision, so a compaction never loses an event; etcd keeps leases across a restart
//!   (their TTL starts again).
//! - a new host at full load: it starts at 0 (or its floor where capacity is free); the
//!   others see its `wants` at once and lower toward the fair split, and it raises as
//!   their claims shrink (as their connections above their lowered shares close).
//! - a daemon restart: with a [`FleetConfig::lease_file`], the new daemon adopts the lease
//!   and its records (same identity), and keeps the kernel's shares until the saved
//!   deadline; without one it waits up to one TTL for the old lease to expire.
//! - two live hosts with one identity: the second finds a record of another live lease
//!   under its key and is refused ([`FleetError::IdentityTaken`]); it retries, and takes
//!   the identity only once the other's lease has expired.
//!
//! # Limits
//! Connections are never cut: those open on a host cut off from etcd, or opened before
//! its host joined, still count at the destination after their claim is released.
//! Hosts that disagree on a budget's total split the smallest one. Whole connections:
//! with more hosts than the total, most shares are 0 or 1.
mod lease_file;
pub mod record;
pub mod share;
pub mod sim;
mod store;
mod sync;

use std::{
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use tokio::task::JoinHandle;

pub use connguard_api::fleet::{BudgetStatus, Status};
pub use share::{Claimant, fair_shares};

/// How long a host's records outlive its last keep-alive.
pub const DEFAULT_TTL: Duration = Duration::from_secs(10);
/// How often a host renews its lease and recomputes its shares.
pub const DEFAULT_REFRESH: Duration = Duration::from_secs(2);
/// Where the fleet's keys live in etcd.
pub const DEFAULT_PREFIX: &str = "/connguard/fleet/";

/// Where the fleet's records are kept.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// etcd v3 client URLs: `http://host:port`, or `https://...` with [`Self::tls`].
    pub endpoints: Vec<String>,
    pub prefix: String,
    pub credentials: Option<Credentials>,
    pub tls: Option<TlsConfig>,
}

impl StoreConfig {
    pub fn new(endpoints: Vec<String>) -> StoreConfig {
        StoreConfig {
            endpoints,
            prefix: DEFAULT_PREFIX.to_string(),
            credentials: None,
            tls: None,
        }
    }
}

/// An etcd user and its password.
#[derive(Clone)]
pub struct Credentials {
    pub user: String,
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credentials {{ user: {:?}, password: ... }}", self.user)
    }
}

/// TLS toward etcd: the CA that signed its certificate, a client certificate and key
/// (both or neither), and the name to check in its certificate.
#[derive(Debug, Clone, Default)]
pub struct TlsConfig {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub domain: Option<String>,
}

/// One fleet budget as this host takes part in it.
#[derive(Debug, Clone)]
pub struct BudgetSpec {
    pub name: String,
    pub total: u64,
    /// The destinations counted, as the policy writes them (published for `connguard
    /// fleet`).
    pub destinations: Vec<String>,
    pub weight: u32,
    pub floor: u64,
    /// What the host enforces once it cannot show a live lease.
    pub safe_share: u64,
}

impl BudgetSpec {
    pub fn new(name: &str, total: u64) -> BudgetSpec {
        BudgetSpec {
            name: name.to_string(),
            total,
            destinations: Vec::new(),
            weight: 1,
            floor: 0,
            safe_share: 0,
        }
    }
}

#[derive(Debug, Clone)]
pub struct FleetConfig {
    pub store: StoreConfig,
    /// This host's name in the fleet: unique, stable across restarts, one key segment.
    pub identity: String,
    pub ttl: Duration,
    /// At most a third of the TTL.
    pub refresh: Duration,
    /// Where the lease is left for the next daemon (in the daemon's state directory).
    pub lease_file: Option<PathBuf>,
    pub budgets: Vec<BudgetSpec>,
}

impl FleetConfig {
    pub fn new(store: StoreConfig, identity: &str, budgets: Vec<BudgetSpec>) -> FleetConfig {
        FleetConfig {
            store,
            identity: identity.to_string(),
            ttl: DEFAULT_TTL,
            refresh: DEFAULT_REFRESH,
            lease_file: None,
            budgets,
        }
    }

    /// Whether `Fleet::start` takes it.
    pub fn check(&self) -> Result<(), FleetError> {
        let bad = |m: String| Err(FleetError::Config(m));
        if self.store.endpoints.is_empty() {
            return bad("no etcd endpoint".into());
        }
        for e in &self.store.endpoints {
            let scheme = e.split_once("://").map(|(s, _)| s);
            if !matches!(scheme, Some("http" | "https")) {
                return bad(format!(
                    "etcd endpoint {e:?}: not an http:// or https:// URL"
                ));
            }
            if e.starts_with("https://") && self.store.tls.is_none() {
                return bad(format!(
                    "etcd endpoint {e}: https needs a TLS configuration"
                ));
            }
        }
        if !record::valid_segment(&self.identity) {
            return bad(format!(
                "fleet identity {:?}: must be one non-empty key segment (no '/')",
                self.identity
            ));
        }
        if self.ttl < Duration::from_secs(2) || self.ttl.subsec_nanos() != 0 {
            return bad(format!(
                "fleet lease TTL {:?}: whole seconds, at least 2 (etcd's lease granularity)",
                self.ttl
            ));
        }
        if self.refresh.is_zero() || self.refresh * 3 > self.ttl {
            return bad(format!(
                "fleet refresh {:?}: must be above 0 and at most a third of the TTL {:?}",
                self.refresh, self.ttl
            ));
        }
        for (i, b) in self.budgets.iter().enumerate() {
            if !record::valid_segment(&b.name) {
                return bad(format!("fleet budget {:?}: not a valid name", b.name));
            }
            if self.budgets[..i].iter().any(|o| o.name == b.name) {
                return bad(format!("fleet budget {:?}: named twice", b.name));
            }
            if b.weight == 0 {
                return bad(format!(
                    "fleet budget {:?}: weight must be at least 1",
                    b.name
                ));
            }
        }
        Ok(())
    }
}

/// Why the fleet cannot sync.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FleetError {
    Config(String),
    Unreachable {
        endpoints: String,
        reason: String,
    },
    Credentials {
        user: String,
        reason: String,
    },
    IdentityTaken {
        identity: String,
        budget: String,
        lease: i64,
    },
    LeaseLost {
        lease: i64,
    },
    Store(String),
}

impl std::fmt::Display for FleetError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FleetError::Config(m) => write!(f, "fleet configuration: {m}"),
            FleetError::Unreachable { endpoints, reason } => {
                write!(f, "etcd unreachable at {endpoints}: {reason}")
            }
            FleetError::Credentials { user, reason } => {
                write!(f, "etcd refused the credentials of user {user}: {reason}")
            }
            FleetError::IdentityTaken {
                identity,
                budget,
                lease,
            } => write!(
                f,
                "fleet identity {identity:?} is held by another live host (its record for \
                 budget {budget:?} is under lease {lease:x}); refusing to share under it \
                 until that lease expires: give each host its own identity"
            ),
            FleetError::LeaseLost { lease } => write!(
                f,
                "etcd lost this host's lease {lease:x} (expired, revoked or its records \
                 deleted): shares fall to safe shares, and start again from zero"
            ),
            FleetError::Store(m) => write!(f, "etcd: {m}"),
        }
    }
}

impl std::error::Error for FleetError {}

/// A host's demand on a budget, as its kernel counts it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Demand {
    /// Active connections of the rules that draw from the budget.
    pub active: u64,
    /// Connections those rules shed (or would have, in observe mode) since the daemon
    /// started: a counter, never decreasing.
    pub shed_total: u64,
}

/// What the fleet needs of the host it runs on.
pub trait Local: Send + Sync + 'static {
    /// Makes the kernel enforce `share` as the budget's maximum of active connections,
    /// and returns once it does: true, or false when it could not (the share before
    /// stays in force, and a lowered record is not published). Called with the fleet's
    /// lock held, from the runtime: as quick as it can be.
    fn apply(&self, budget: &str, share: u64) -> bool;
    /// The shares applied stand until `until`, when the lease could expire in etcd and
    /// the others take what it covered: from then on the kernel must enforce the safe
    /// shares by itself, with or without a daemon to tell it. Called each time `until`
    /// moves later.
    fn shares_stand_until(&self, until: Instant);
    /// The host's demand on the budget now.
    fn demand(&self, budget: &str) -> Demand;
}

/// Every host's record of every budget under `store`'s prefix, as etcd holds them.
pub async fn hosts(store: &StoreConfig) -> Result<connguard_api::fleet::FleetView, FleetError> {
    // Within the 5 s `connguard fleet` waits for the daemon's answer.
    let mut s = store::Store::connect(store, Duration::from_secs(3)).await?;
    let (revision, listed) = s.list().await?;
    let mut budgets: std::collections::BTreeMap<String, Vec<record::Record>> = Default::default();
    for l in listed {
        if let Some(record::Key::Host { budget, identity }) = s.keys.parse(&l.key) {
            let r = serde_json::from_slice(&l.value).map_err(|e| {
                FleetError::Store(format!(
                    "the record of host {identity:?} cannot be read: {e}"
                ))
            })?;
            budgets.entry(budget.to_string()).or_default().push(r);
        }
    }
    Ok(connguard_api::fleet::FleetView {
        revision,
        budgets: budgets
            .into_iter()
            .map(|(name, hosts)| connguard_api::fleet::BudgetView { name, hosts })
            .collect(),
    })
}

/// This host's part in the fleet: a task that keeps its records and shares.
pub struct Fleet {
    shared: Arc<sync::Shared>,
    tasks: Vec<JoinHandle<()>>,
}

impl Fleet {
    /// Checks the configuration and starts syncing (on the current tokio runtime).
    pub fn start(config: FleetConfig, local: Arc<dyn Local>) -> Result<Fleet, FleetError> {
        config.check()?;
        let shared = Arc::new(sync::Shared::new(config, local));
        let tasks = vec![
            tokio::spawn(sync::watchdog(shared.clone())),
            tokio::spawn(sync::run(shared.clone())),
        ];
        Ok(Fleet { shared, tasks })
    }

    pub fn status(&self) -> Status {
        self.shared.status()
    }

    /// Waits for the first sync: Ok once the host's records are in etcd, or the error
    /// that stands in its way (the loop keeps trying).
    pub async fn synced(&self, within: Duration) -> Result<(), FleetError> {
        self.shared.synced(within).await
    }

    /// Leaves the fleet at once: safe shares in the kernel, then the lease revoked, so
    /// that the others take the claims without waiting for the TTL.
    pub async fn leave(mut self) -> Result<(), FleetError> {
        for t in self.tasks.drain(..) {
            t.abort();
        }
        self.shared.leave().await
    }
}

impl Drop for Fleet {
    /// Stops syncing and leaves the lease to expire (or to the next daemon).
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}
