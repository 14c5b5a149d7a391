//! This host's part in the fleet budgets (`connguard stats --json`, field `fleet`):
//! the etcd session and each budget's total, share and demand; and every host's record
//! as etcd holds it (`connguard fleet`). Counts are connections.
use serde::{Deserialize, Serialize};

/// The fleet as this host sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    pub identity: String,
    pub lease: Option<i64>,
    /// Since the last acknowledged keep-alive (none yet: null).
    pub last_sync_ms: Option<u64>,
    pub store_errors: u64,
    pub last_error: Option<String>,
    /// Transactions that wrote (creates, publishes, raises).
    pub writes: u64,
    /// Raises refused because another claim grew meanwhile.
    pub conflicts: u64,
    pub keepalives: u64,
    pub budgets: Vec<BudgetStatus>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetStatus {
    pub name: String,
    /// The total split (the smallest a live record names).
    pub total: u64,
    /// What the kernel enforces (null until the fleet first applied one).
    pub share: Option<u64>,
    /// This host's record: its share and what it wants.
    pub has: u64,
    pub wants: u64,
    pub active: u64,
    /// Live records, this host's included.
    pub hosts: usize,
    /// The safe share is in force: no live lease to show.
    pub safe: bool,
}

/// One host's record for one budget.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub identity: String,
    /// The etcd lease the record is attached to: two live hosts with one identity hold
    /// two leases, and each one sees the other's.
    pub lease: i64,
    /// The share the host holds: it never enforces more.
    pub has: u64,
    /// Its active connections when it wrote the record.
    pub active: u64,
    /// Its demand: active plus recently shed, with headroom.
    pub wants: u64,
    pub weight: u32,
    pub floor: u64,
    /// The total this host is configured with: every host splits the smallest total any
    /// live record names.
    pub total: u64,
    /// The destinations the host counts against the budget, as its policy writes them.
    pub destinations: Vec<String>,
    /// The store revision of the view the record was computed from.
    pub based_on: i64,
}

impl Record {
    /// What the record takes from the total: its share, or its active connections
    /// where they are above it (a lowered share releases only what has closed).
    pub fn claim(&self) -> u64 {
        self.has.max(self.active)
    }

    /// Whether writing `self` over `old` may take capacity that another host's raise
    /// computed as free, so that the write must invalidate raises in flight.
    pub fn takes_more_than(&self, old: Option<&Record>) -> bool {
        match old {
            None => self.claim() > 0,
            Some(old) => self.claim() > old.claim() || self.total < old.total,
        }
    }
}

/// `connguard fleet --json`: every host's record of every budget under the fleet's
/// prefix, as etcd holds them at `revision`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FleetView {
    /// The etcd revision of the listing.
    pub revision: i64,
    /// By budget name, then identity.
    pub budgets: Vec<BudgetView>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetView {
    pub name: String,
    pub hosts: Vec<Record>,
}

/// Whether `name` can be a budget name or a host identity: one non-empty key segment.
pub fn valid_segment(name: &str) -> bool {
    !name.is_empty() && !name.contains('/') && !name.chars().any(char::is_control)
}
