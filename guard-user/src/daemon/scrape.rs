//! What /metrics exported (`prometheus::Exported`), kept from one scrape to the next.
//! Its lock is taken only by the two methods here, before any other: across a scrape's
//! snapshot, so that no destination the scrape lists is forgotten between the snapshot
//! and the record of what it exported; and by the forgetting of idle destinations,
//! which keeps those the last scrape listed.
use std::sync::Mutex;

use super::{Counts, lock};
use connguard_api::stats::Snapshot;

use crate::report::prometheus::{self, Exported};

#[derive(Default)]
pub struct Scrapes {
    exported: Mutex<Exported>,
}

impl Scrapes {
    /// The text of a scrape of the snapshot `snapshot` takes.
    pub fn render(&self, snapshot: impl FnOnce() -> Snapshot) -> String {
        let mut exported = lock(&self.exported);
        prometheus::render(&snapshot(), &mut exported)
    }

    /// Forgets the destinations of `counts` idle since the last call
    /// (Counters::forget_idle), but those the last scrape listed; returns how many.
    pub fn forget_idle(&self, counts: &Mutex<Counts>) -> usize {
        let exported = lock(&self.exported);
        lock(counts).counters.forget_idle(|key| exported.lists(key))
    }
}
