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

    /// Holds the lease for its length from now.
    pub fn renew(&mut self) -> anyhow::Result<()> {
        let until = monotonic_ns().saturating_add(self.length.as_nanos() as u64);
        self.map
            .set(0, until, 0)
            .context("renewing the lease (LEASE)")
    }
}

/// CLOCK_MONOTONIC in ns: the clock of the programs' bpf_ktime_get_ns.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
