//! The policy's fleet budgets: this host's part in them (`crate::fleet`), with each
//! share enforced as the `max_connections` of the one rule that draws from the budget,
//! through the same generation switch as a reload.
//!
//! The fleet's settings and budgets are those of the policy the daemon started with: a
//! reload that changes them is refused (the sync loop holds a lease and records made
//! from them), and a restart takes them up.
use std::{
    collections::BTreeMap,
    path::Path,
    sync::{Arc, Mutex, OnceLock, Weak},
    time::{Duration, Instant},
};

use anyhow::Context;
use connguard_api::fleet::FleetView;

use super::{Daemon, lock};
use crate::{
    enforce::scopes,
    fleet::{self, BudgetSpec, Credentials, Demand, Fleet, FleetConfig, StoreConfig, TlsConfig},
    policy::{FleetBudget, FleetPolicy, Policy},
};

/// The fleet part of the daemon's state.
#[derive(Default)]
pub struct FleetPart {
    /// The `[fleet]` and budgets of the first policy.
    settings: OnceLock<(Option<FleetPolicy>, Vec<FleetBudget>)>,
    /// The library's configuration of them, when there are some.
    config: OnceLock<FleetConfig>,
    /// Each budget's share as the fleet last applied it. A budget with none is held at
    /// its safe share: nothing in etcd covers more.
    shares: Mutex<BTreeMap<String, u64>>,
    running: OnceLock<Fleet>,
}

impl FleetPart {
    /// Takes the first policy's fleet settings (those of later policies must be equal),
    /// reading what they name (the password file, the host name) and checking them
    /// before anything is attached. `socket` names the lease file: next to it, so that
    /// each daemon of a host has its own.
    pub fn settle(&self, policy: &Policy, socket: &Path) -> anyhow::Result<()> {
        if let Some(f) = &policy.fleet {
            let config = fleet_config(f, &policy.fleet_budgets, socket)?;
            config.check()?;
            let _ = self.config.set(config);
        }
        let _ = self
            .settings
            .set((policy.fleet.clone(), policy.fleet_budgets.clone()));
        Ok(())
    }

    /// Why `policy` cannot replace the one in force, if it cannot.
    pub fn refuses(&self, policy: &Policy) -> Option<String> {
        let (fleet, budgets) = self.settings.get()?;
        (fleet != &policy.fleet || budgets != &policy.fleet_budgets).then(|| {
            format!(
                "{}: the fleet settings ([fleet], [[fleet_budget]]) differ from those the \
                 daemon started with; restart the daemon to change them",
                policy.source
            )
        })
    }

    /// `policy` with each drawing rule's `max_connections` set to this host's share.
    pub fn shape(&self, mut policy: Policy) -> Policy {
        let shares = lock(&self.shares);
        for rule in policy.scopes.iter_mut().flat_map(|s| s.rules.iter_mut()) {
            let Some(name) = &rule.fleet else { continue };
            let safe = policy
                .fleet_budgets
                .iter()
                .find(|b| &b.name == name)
                .map_or(0, |b| b.safe_share);
            rule.limits.max_connections = Some(shares.get(name).copied().unwrap_or(safe));
        }
        policy
    }

    pub fn status(&self) -> Option<fleet::Status> {
        self.running.get().map(Fleet::status)
    }
}

impl Daemon {
    /// Starts syncing the first policy's fleet budgets, if it has any (on the current
    /// tokio runtime).
    pub(super) fn start_fleet(self: &Arc<Self>) -> anyhow::Result<()> {
        let Some(config) = self.fleet.config.get().cloned() else {
            return Ok(());
        };
        log::info!(
            "fleet: sharing {} budget(s) through etcd at {} as {:?}",
            config.budgets.len(),
            config.store.endpoints.join(","),
            config.identity
        );
        let local: Arc<dyn fleet::Local> = Arc::new(Kernel(Arc::downgrade(self)));
        let running = Fleet::start(config, local).context("fleet")?;
        let _ = self.fleet.running.set(running);
        Ok(())
    }

    /// Every host's record, listed from etcd (`connguard fleet`); called off the
    /// runtime's workers (the control socket's blocking handler).
    pub(super) fn fleet_hosts(&self) -> Result<FleetView, String> {
        let Some(config) = self.fleet.config.get() else {
            return Err("the policy has no fleet budgets ([fleet], [[fleet_budget]])".into());
        };
        tokio::runtime::Handle::current()
            .block_on(fleet::hosts(&config.store))
            .map_err(|e| e.to_string())
    }

    /// Applies the policy in force again with the shares as they are now.
    fn reshare(&self) -> anyhow::Result<()> {
        let _turn = lock(&self.reloads);
        let Some(input) = self.programs.generations().rescan_input() else {
            anyhow::bail!("no policy is in force yet");
        };
        let policy = Policy::clone(&input.policy);
        let tree = scopes::walk(&input.root, &policy)?;
        self.apply(policy, tree)
    }

    /// The active connections and sheds of the rule that draws from `budget`.
    fn fleet_demand(&self, budget: &str) -> Demand {
        let (policy, ids) = {
            let g = self.programs.generations();
            (g.policy(), g.ids())
        };
        let id = policy.as_ref().and_then(|p| {
            p.scopes.iter().find_map(|s| {
                let r = s
                    .rules
                    .iter()
                    .find(|r| r.fleet.as_deref() == Some(budget))?;
                ids.rule(&s.name, &r.name)
            })
        });
        let Some(c) = id.and_then(|id| lock(&self.counts).counters.rule_counter(id)) else {
            return Demand::default();
        };
        Demand {
            active: (c.active as i64).max(0) as u64,
            shed_total: c.shed + c.would_shed,
        }
    }
}

/// The fleet's view of this host's kernel.
struct Kernel(Weak<Daemon>);

impl fleet::Local for Kernel {
    fn apply(&self, budget: &str, share: u64) -> bool {
        let Some(d) = self.0.upgrade() else {
            return false;
        };
        let before = lock(&d.fleet.shares).insert(budget.to_string(), share);
        // A cgroup walk and a generation switch: the runtime's other tasks (keep-alives,
        // the control socket) move to other workers meanwhile.
        match tokio::task::block_in_place(|| d.reshare()) {
            Ok(()) => {
                log::info!("fleet budget {budget:?}: this host's share is {share}");
                true
            }
            Err(e) => {
                let mut shares = lock(&d.fleet.shares);
                match before {
                    Some(b) => shares.insert(budget.to_string(), b),
                    None => shares.remove(budget),
                };
                log::error!(
                    "fleet budget {budget:?}: applying the share {share}: {e:#}; the kernel \
                     keeps the one before"
                );
                false
            }
        }
    }

    /// The programs hold no deadline of their own: a share stands in the kernel until
    /// the daemon applies another, or (daemon gone) until the daemon's lease runs out.
    fn shares_stand_until(&self, _until: Instant) {}

    fn demand(&self, budget: &str) -> Demand {
        self.0
            .upgrade()
            .map_or_else(Demand::default, |d| d.fleet_demand(budget))
    }
}

/// The library's configuration of the policy's `[fleet]` and budgets.
fn fleet_config(
    f: &FleetPolicy,
    budgets: &[FleetBudget],
    socket: &Path,
) -> anyhow::Result<FleetConfig> {
    let identity = match &f.identity {
        Some(id) => id.clone(),
        None => host_name()?,
    };
    let credentials = match (&f.user, &f.password_file) {
        (Some(user), Some(file)) => {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("fleet password_file {}", file.display()))?;
            Some(Credentials {
                user: user.clone(),
                password: text.lines().next().unwrap_or("").to_string(),
            })
        }
        _ => None,
    };
    let tls = (f.ca.is_some() || f.cert.is_some()).then(|| TlsConfig {
        ca: f.ca.clone(),
        cert: f.cert.clone(),
        key: f.key.clone(),
        domain: None,
    });
    let mut store = StoreConfig::new(f.endpoints.clone());
    if let Some(p) = &f.prefix {
        store.prefix = p.clone();
    }
    store.credentials = credentials;
    store.tls = tls;
    let specs = budgets
        .iter()
        .map(|b| BudgetSpec {
            destinations: b.dst.iter().map(ToString::to_string).collect(),
            weight: b.weight,
            floor: b.floor,
            safe_share: b.safe_share,
            ..BudgetSpec::new(&b.name, b.total)
        })
        .collect();
    let mut config = FleetConfig::new(store, &identity, specs);
    if let Some(ttl) = f.ttl_secs {
        config.ttl = Duration::from_secs(ttl);
    }
    if let Some(ms) = f.refresh_ms {
        config.refresh = Duration::from_millis(ms);
    }
    config.lease_file = Some(socket.with_extension("fleet-lease"));
    Ok(config)
}

/// The host's name, the default identity.
fn host_name() -> anyhow::Result<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .context("reading the host name for the fleet identity")?;
    Ok(name.trim().to_string())
}
