//! Listener guards' RSTs past the queue limits (RST_SHED, and WOULD_RST in observe
//! mode), counted by the kernel per guard and deciding listening socket (its inode).
//! The entries of sockets gone for two sweeps in a row are removed, their counts kept
//! in the guard's total, so that the map holds only live sockets and no total goes
//! down.
use std::{
    collections::{HashMap, HashSet},
    time::Instant,
};

use guard_common::RstKey;

use super::SWEEP;
use crate::kernel::{batch, maps::Hashed};

pub struct Rsts {
    rst_shed: Hashed<RstKey, u64>,
    would_rst: Hashed<RstKey, u64>,
    /// By listener id: what removed entries held, RSTs and would-be RSTs.
    retired: HashMap<u32, [u64; 2]>,
    /// Entries of sockets not listed at the last sweep.
    absent: HashSet<RstKey>,
    swept: Option<Instant>,
}

/// The counts as read once, by key.
pub struct Counts {
    rst_shed: HashMap<RstKey, u64>,
    would_rst: HashMap<RstKey, u64>,
}

impl Rsts {
    pub fn new(rst_shed: Hashed<RstKey, u64>, would_rst: Hashed<RstKey, u64>) -> Self {
        Rsts {
            rst_shed,
            would_rst,
            retired: HashMap::new(),
            absent: HashSet::new(),
            swept: None,
        }
    }

    /// Removes, at most every SWEEP, the entries of sockets that `listed` (the sockets
    /// of the last reading) lacked at this sweep and the one before.
    pub fn sweep(&mut self, listed: &HashSet<RstKey>) {
        if self.swept.is_some_and(|t| t.elapsed() < SWEEP) {
            return;
        }
        self.swept = Some(Instant::now());
        let mut absent = HashSet::new();
        for (i, map) in [&mut self.rst_shed, &mut self.would_rst]
            .into_iter()
            .enumerate()
        {
            for (key, n) in batch::entries(map) {
                if key.inode == 0 || listed.contains(&key) {
                    continue;
                }
                if !self.absent.contains(&key) {
                    absent.insert(key);
                } else if map.remove(&key).is_ok() {
                    self.retired.entry(key.listener_id).or_default()[i] += n;
                }
            }
        }
        self.absent = absent;
    }

    pub fn read(&self) -> Counts {
        Counts {
            rst_shed: batch::entries(&self.rst_shed).into_iter().collect(),
            would_rst: batch::entries(&self.would_rst).into_iter().collect(),
        }
    }

    /// Guard `listener_id`'s totals, RSTs and would-be RSTs: its sockets' and its
    /// decisions for its sockets together, and what removed entries held.
    pub fn totals(&self, counts: &Counts, listener_id: u32) -> [u64; 2] {
        let retired = self.retired.get(&listener_id).copied().unwrap_or_default();
        let sum = |m: &HashMap<RstKey, u64>| -> u64 {
            m.iter()
                .filter(|(k, _)| k.listener_id == listener_id)
                .map(|(_, n)| n)
                .sum()
        };
        [
            retired[0] + sum(&counts.rst_shed),
            retired[1] + sum(&counts.would_rst),
        ]
    }
}

impl Counts {
    /// A socket's own RSTs and would-be RSTs.
    pub fn of(&self, key: &RstKey) -> [u64; 2] {
        [
            self.rst_shed.get(key).copied().unwrap_or(0),
            self.would_rst.get(key).copied().unwrap_or(0),
        ]
    }
}
