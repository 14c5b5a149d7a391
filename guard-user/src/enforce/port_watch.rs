//! Port watermarks: PORT_USE holds, for the network namespaces of the processes of
//! scopes with a watermark, the destinations whose ports held come near the lowest
//! watermark, and the connect hooks shed past it. The daemon reads the socket tables
//! every 0.5 s, so a watermark acts within that period.
use std::{collections::HashMap, path::PathBuf};

use connguard_api::stats::WatchedPort;
use guard_common::{
    PortUseKey,
    addr::{endpoint, mapped, unmapped},
};

use crate::{
    host::{
        cgroup, netns,
        ports::{PortSettings, port_use},
        sockdiag,
    },
    kernel::maps::{Hashed, Mirrored},
    policy::Policy,
};

pub struct PortWatch {
    port_use: Mirrored<PortUseKey, u32>,
}

impl PortWatch {
    pub fn new(map: Hashed<PortUseKey, u32>) -> Self {
        PortWatch {
            port_use: Mirrored::new(map),
        }
    }

    /// Makes PORT_USE hold exactly these destinations.
    pub fn sync(&mut self, entries: HashMap<PortUseKey, u32>) -> anyhow::Result<()> {
        self.port_use.sync(entries)
    }

    /// What PORT_USE holds now, fullest first.
    pub fn watched(&self) -> Vec<WatchedPort> {
        let mut out: Vec<_> = self
            .port_use
            .entries()
            .iter()
            .map(|(k, permille)| WatchedPort {
                netns: k.netns,
                dst: endpoint(unmapped(k.addr), k.port),
                ratio: *permille as f64 / 1000.0,
            })
            .collect();
        out.sort_by(|a, b| b.ratio.total_cmp(&a.ratio).then(a.dst.cmp(&b.dst)));
        out
    }
}

/// The PORT_USE entries for the network namespaces of the processes in `dirs` (the
/// cgroups of scopes with a watermark): destinations at or past the lowest watermark
/// of `policy`. A namespace that went away with its process is skipped.
pub fn read(policy: &Policy, dirs: &[PathBuf]) -> HashMap<PortUseKey, u32> {
    let lowest = policy
        .scopes
        .iter()
        .flat_map(|s| {
            s.port_watermark
                .into_iter()
                .chain(s.rules.iter().filter_map(|r| r.port_watermark))
        })
        .min();
    let mut entries = HashMap::new();
    let Some(lowest) = lowest else {
        return entries;
    };
    for ns in cgroup::netns_of(dirs.iter().map(PathBuf::as_path)) {
        let read = netns::within(Some(&ns), || {
            let settings = PortSettings::read()?;
            Ok((
                netns::cookie()?,
                port_use(&settings, &sockdiag::tcp_sockets()?),
            ))
        });
        let (cookie, used) = match read {
            Ok(r) => r,
            Err(e) => {
                log::debug!("{}: {e:#}", ns.display());
                continue;
            }
        };
        for ((addr, port), permille) in used.into_iter().filter(|(_, p)| *p >= lowest) {
            let key = PortUseKey {
                netns: cookie,
                port,
                _pad: [0; 6],
                addr: mapped(addr),
            };
            entries.insert(key, permille);
        }
    }
    entries
}
