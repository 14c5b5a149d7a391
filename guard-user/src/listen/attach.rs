//! Where the listener program is attached: each guarded namespace, held open, and its
//! interfaces by index, brought up to date by `rescan`.
use std::{
    collections::{BTreeMap, BTreeSet},
    fs::File,
    os::unix::fs::MetadataExt,
    path::Path,
};

use anyhow::Context;
use aya::{Ebpf, programs::tc::SchedClassifierLink};

use super::netns_name;
use crate::{host::netns, kernel::object, policy::ListenerPolicy};

/// The program's attachments in every guarded namespace, by `netns_name`.
pub struct Attachments {
    namespaces: BTreeMap<String, Namespace>,
    /// Why a namespace could not be opened or attached to at the last rescan (logged
    /// when it changes).
    failing: BTreeMap<String, String>,
    /// Attach as tcx links (else clsact filters).
    tcx: bool,
}

struct Namespace {
    /// Open, so that detaching happens in this namespace even once its path names
    /// another.
    file: File,
    inode: u64,
    /// Interface name -> its index when attached, and the link.
    links: BTreeMap<String, (u32, SchedClassifierLink)>,
}

impl Attachments {
    pub fn new(tcx: bool) -> Self {
        Attachments {
            namespaces: BTreeMap::new(),
            failing: BTreeMap::new(),
            tcx,
        }
    }

    pub fn rescan(&mut self, ebpf: &mut Ebpf, policies: &[ListenerPolicy]) {
        let mut seen = BTreeSet::new();
        for p in policies {
            let name = netns_name(p.netns.as_deref());
            if !seen.insert(name.clone()) {
                continue;
            }
            let result = self.rescan_one(ebpf, &name, p);
            match (result, self.failing.contains_key(&name)) {
                (Ok(()), true) => {
                    log::info!("listener guard: netns {name} attached again");
                    self.failing.remove(&name);
                }
                (Err(e), _) => {
                    let why = format!("{e:#}");
                    if self.failing.get(&name) != Some(&why) {
                        log::error!("listener guard {:?} in netns {name}: {why}", p.name);
                        self.failing.insert(name, why);
                    }
                }
                (Ok(()), false) => {}
            }
        }
    }

    /// Brings namespace `name` (of policy `p`) up to date: attached to each chosen
    /// interface, at its current index.
    fn rescan_one(
        &mut self,
        ebpf: &mut Ebpf,
        name: &str,
        p: &ListenerPolicy,
    ) -> anyhow::Result<()> {
        let path = p.netns.as_deref().unwrap_or(Path::new("/proc/self/ns/net"));
        let opened = File::open(path);
        let inode = match &opened {
            Ok(file) => Some(file.metadata()?.ino()),
            Err(_) => None,
        };
        if let Some(old) = self.namespaces.remove(name) {
            if Some(old.inode) == inode {
                self.namespaces.insert(name.to_string(), old);
            } else {
                // The path is gone or names a new namespace: the old one is detached
                // in place and let go, not kept alive by our open file.
                detach(name, old);
                log::info!("listener guard: netns {name} is gone or a new namespace");
            }
        }
        let file =
            opened.with_context(|| format!("opening network namespace {}", path.display()))?;
        let inode = inode.expect("set when opened");
        let ns = self
            .namespaces
            .entry(name.to_string())
            .or_insert(Namespace {
                file,
                inode,
                links: BTreeMap::new(),
            });
        let tcx = self.tcx;
        let links = &mut ns.links;
        let (gone, added) = netns::within_open(&ns.file, || {
            let now: BTreeMap<String, u32> = netns::interfaces()?.into_iter().collect();
            let gone: Vec<String> = links
                .iter()
                .filter(|(iface, (index, _))| now.get(*iface) != Some(index))
                .map(|(iface, _)| iface.clone())
                .collect();
            let gone: Vec<SchedClassifierLink> = gone
                .iter()
                .filter_map(|iface| links.remove(iface).map(|(_, l)| l))
                .collect();
            let mut added = Vec::new();
            let mut missing = Vec::new();
            for iface in &p.interfaces {
                if !now.contains_key(iface) {
                    missing.push(iface.as_str());
                }
            }
            for (iface, index) in &now {
                if links.contains_key(iface)
                    || !(p.interfaces.is_empty() || p.interfaces.contains(iface))
                {
                    continue;
                }
                let link = object::attach_listener(ebpf, iface, tcx)
                    .with_context(|| format!("attaching the listener guard to {iface}"))?;
                links.insert(iface.clone(), (*index, link));
                added.push(iface.clone());
            }
            if !missing.is_empty() {
                anyhow::bail!("no interface {}", missing.join(", "));
            }
            Ok((gone, added))
        })?;
        gone.into_iter().for_each(|l| self.let_go(l));
        if !added.is_empty() {
            log::info!(
                "listener guard attached to {} in netns {name}",
                added.join(", ")
            );
        }
        Ok(())
    }

    /// A link whose interface or namespace is gone (its filter went with it; a renamed
    /// interface keeps its filter, which then stays until the namespace goes): a tcx
    /// link's fd is closed; a clsact filter's link is forgotten, as its drop would send
    /// a delete, by interface index, to the daemon's own namespace.
    fn let_go(&self, link: SchedClassifierLink) {
        if !self.tcx {
            std::mem::forget(link);
        }
    }

    /// Detaches every link, in its namespace, logging failures.
    pub fn detach_all(&mut self) {
        for (name, ns) in std::mem::take(&mut self.namespaces) {
            detach(&name, ns);
        }
    }
}

/// Detaches the links of `ns` inside it, logging failures, and closes it.
fn detach(name: &str, ns: Namespace) {
    let mut links: Vec<SchedClassifierLink> = ns.links.into_values().map(|(_, l)| l).collect();
    if links.is_empty() {
        return;
    }
    let entered = netns::within_open(&ns.file, || {
        for link in links.drain(..) {
            if let Err(e) = object::detach_listener(link) {
                log::warn!("listener guard: detaching in netns {name}: {e:#}");
            }
        }
        Ok(())
    });
    if let Err(e) = entered {
        log::warn!("listener guard: cannot enter netns {name} to detach: {e:#}");
    }
    links.into_iter().for_each(std::mem::forget);
}
