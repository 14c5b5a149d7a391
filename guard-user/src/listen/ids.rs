//! Stable ids of listener guards' names, the keys of their counts in the kernel
//! (RST_SHED, CALLERS, SOURCES, PER_SOURCE_TOTALS): kept in the pinned LISTENER_IDS,
//! so that a guard removed by a reload and added again, or met again by the next
//! daemon, keys the counts it left, as scope ids do.
use std::collections::HashMap;

use anyhow::{Context, bail};
use guard_common::{IdKey, MAX_ID_NAME, NO_LISTENER};

use crate::kernel::maps::Hashed;

/// Most guard names the pinned state keeps (the size of LISTENER_IDS).
const MAX_GUARD_IDS: usize = 4096;

pub struct GuardIds {
    map: Hashed<IdKey, u32>,
    ids: HashMap<String, u32>,
}

impl GuardIds {
    /// The ids kept in `map` (none on a first start).
    pub fn restore(map: Hashed<IdKey, u32>) -> anyhow::Result<GuardIds> {
        let mut ids = HashMap::new();
        for entry in map.iter() {
            let (key, id) = entry.context("reading LISTENER_IDS")?;
            let end = key.name.iter().position(|b| *b == 0).unwrap_or(MAX_ID_NAME);
            ids.insert(String::from_utf8_lossy(&key.name[..end]).into_owned(), id);
        }
        Ok(GuardIds { map, ids })
    }

    /// The id of guard `name`, given (and kept in the map) at its first sight.
    pub fn assign(&mut self, name: &str) -> anyhow::Result<u32> {
        if let Some(id) = self.ids.get(name) {
            return Ok(*id);
        }
        if self.ids.len() >= MAX_GUARD_IDS {
            bail!(
                "too many listener guard names since the pinned state was created (at most \
                 {MAX_GUARD_IDS}; `connguard stop`, then a start, starts over)"
            );
        }
        let id = self.ids.values().max().map_or(0, |m| m + 1);
        debug_assert!(id != NO_LISTENER);
        let mut key = IdKey {
            kind: 0,
            name: [0; MAX_ID_NAME],
        };
        // Policy names are at most MAX_NAME bytes.
        key.name[..name.len()].copy_from_slice(name.as_bytes());
        self.map
            .insert(key, id, 0)
            .context("writing LISTENER_IDS")?;
        self.ids.insert(name.to_string(), id);
        Ok(id)
    }

    /// The id of guard `name`, once assigned.
    pub fn get(&self, name: &str) -> Option<u32> {
        self.ids.get(name).copied()
    }

    /// Every id given, by name.
    pub fn names(&self) -> HashMap<u32, String> {
        self.ids.iter().map(|(n, id)| (*id, n.clone())).collect()
    }
}
