//! The daemon's lease: the time until which the programs it leaves attached may shed.
//! Renewed every second; a daemon gone (or stuck) for longer than the lease leaves
//! programs that only count, and shed nothing (fail-open), until a daemon starts again.
use std::time::Duration;

use anyhow::Context;

use crate::kernel::maps::Lease as LeaseMap;

/// How often the lease is renewed.
pub const RENEW: Duration = Duration::from_secs(1);

pub struct Lease {
    map: LeaseMap,
    length: Duration,
}

impl Lease {
    pub fn new(map: LeaseMap, length: Duration) -> Lease {
        Lease { map, length }
    }

    /// Whether the connections that existed before the pinned state was created have
    /// been seeded into it (element 1 of LEASE; 0 when a first start died first).
    pub fn seeded(&self) -> anyhow::Result<bool> {
        Ok(self.map.get(&1, 0).context("reading LEASE")? != 0)
    }

    pub fn mark_seeded(&mut self) -> anyhow::Result<()> {
        self.map.set(1, 1, 0).context("writing LEASE")
    }

    /// How long the programs shed from now on without another renewal: zero once the
    /// lease has run out.
    pub fn remaining(&self) -> anyhow::Result<Duration> {
        let until = self.map.get(&0, 0).context("reading LEASE")?;
        Ok(Duration::from_nanos(
            until.saturating_sub(guard_common::monotonic_ns()),
        ))
    }

    /// Holds the lease for its length from now.
    pub fn renew(&mut self) -> anyhow::Result<()> {
        let until = guard_common::monotonic_ns().saturating_add(self.length.as_nanos() as u64);
        self.map
            .set(0, until, 0)
            .context("renewing the lease (LEASE)")
    }
}
