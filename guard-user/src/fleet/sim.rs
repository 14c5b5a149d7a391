//! Virtual hosts of a fleet budget without a kernel, many in one process, and a ledger
//! of what they enforce: for the tests of the fleet against a real etcd and for the
//! simulation of a large fleet (examples/fleet_sim.rs).
use std::{
    collections::BTreeMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use super::{BudgetSpec, Demand, Fleet, FleetConfig, Local, StoreConfig};

/// A fleet configuration of one budget `budget` of `total` on the etcd at `endpoint`,
/// under `prefix`, with the default lease and refresh.
pub fn config(
    endpoint: &str,
    prefix: &str,
    identity: &str,
    budget: &str,
    total: u64,
) -> FleetConfig {
    let mut store = StoreConfig::new(vec![endpoint.to_string()]);
    store.prefix = prefix.to_string();
    FleetConfig::new(store, identity, vec![BudgetSpec::new(budget, total)])
}

/// What every virtual host of a test enforces, checked at each change: the largest sum
/// of the shares standing at once, and every raise.
#[derive(Default)]
pub struct Ledger {
    hosts: Mutex<BTreeMap<String, Held>>,
    max_sum: AtomicU64,
}

#[derive(Clone, Copy)]
struct Held {
    share: u64,
    /// When the kernel falls to the safe share (0) by itself.
    until: Option<Instant>,
}

/// A raise as the ledger saw it.
#[derive(Debug, Clone, Copy)]
pub struct Raise {
    pub at: Instant,
    pub from: u64,
    pub to: u64,
}

impl Ledger {
    /// The largest sum of standing shares seen.
    pub fn max_sum(&self) -> u64 {
        self.max_sum.load(Ordering::SeqCst)
    }

    /// The shares standing now, with the kernel's own expiry.
    pub fn sum_now(&self) -> u64 {
        let now = Instant::now();
        self.hosts
            .lock()
            .unwrap()
            .values()
            .map(|h| h.standing(now))
            .sum()
    }

    fn apply(&self, identity: &str, share: u64) -> Option<Raise> {
        let now = Instant::now();
        let mut hosts = self.hosts.lock().unwrap();
        let held = hosts.entry(identity.to_string()).or_insert(Held {
            share: 0,
            until: None,
        });
        let from = held.standing(now);
        held.share = share;
        let sum = hosts.values().map(|h| h.standing(now)).sum();
        self.max_sum.fetch_max(sum, Ordering::SeqCst);
        (share > from).then_some(Raise {
            at: now,
            from,
            to: share,
        })
    }

    fn stand_until(&self, identity: &str, until: Instant) {
        if let Some(h) = self.hosts.lock().unwrap().get_mut(identity) {
            h.until = Some(until);
        }
    }
}

impl Held {
    fn standing(&self, now: Instant) -> u64 {
        match self.until {
            Some(until) if now >= until => 0,
            _ => self.share,
        }
    }
}

/// How often a client that a virtual host cannot admit tries again.
const RETRY: Duration = Duration::from_millis(100);

/// A host of a fleet budget without a kernel: the test sets how many clients want a
/// connection; its active connections follow its share at once (those over a lowered
/// share close), and each client it cannot admit retries every [`RETRY`], shed each
/// time; its kernel falls to a share of 0 when its shares stop standing, as the
/// daemon's kernel budget must.
pub struct VirtualLocal {
    identity: String,
    want: AtomicU64,
    state: Mutex<Kernel>,
    ledger: Arc<Ledger>,
    raises: Mutex<Vec<Raise>>,
}

impl VirtualLocal {
    pub fn new(identity: &str, want: u64, ledger: Arc<Ledger>) -> Arc<VirtualLocal> {
        Arc::new(VirtualLocal {
            identity: identity.to_string(),
            want: AtomicU64::new(want),
            state: Mutex::new(Kernel {
                share: None,
                shed: 0.0,
                at: Instant::now(),
            }),
            ledger,
            raises: Mutex::new(Vec::new()),
        })
    }

    pub fn want(&self) -> u64 {
        self.want.load(Ordering::SeqCst)
    }

    pub fn set_want(&self, want: u64) {
        self.want.store(want, Ordering::SeqCst);
    }

    /// Every raise of this host's share.
    pub fn raises(&self) -> Vec<Raise> {
        self.raises.lock().unwrap().clone()
    }
}

impl Local for VirtualLocal {
    fn apply(&self, _budget: &str, share: u64) -> bool {
        let mut state = self.state.lock().unwrap();
        state.shed_until_now(self.want.load(Ordering::SeqCst));
        state.share = Some(share);
        drop(state);
        if let Some(r) = self.ledger.apply(&self.identity, share) {
            self.raises.lock().unwrap().push(r);
        }
        true
    }

    fn shares_stand_until(&self, until: Instant) {
        self.ledger.stand_until(&self.identity, until);
    }

    fn demand(&self, _budget: &str) -> Demand {
        let want = self.want.load(Ordering::SeqCst);
        let mut state = self.state.lock().unwrap();
        state.shed_until_now(want);
        Demand {
            active: state.active(want),
            shed_total: state.shed as u64,
        }
    }
}

/// A virtual host's kernel budget.
struct Kernel {
    /// The enforced share (None: none applied yet).
    share: Option<u64>,
    /// Sheds so far, counted up to `at`.
    shed: f64,
    at: Instant,
}

impl Kernel {
    fn active(&self, want: u64) -> u64 {
        self.share.unwrap_or(0).min(want)
    }

    fn shed_until_now(&mut self, want: u64) {
        let now = Instant::now();
        let blocked = (want - self.active(want)) as f64;
        self.shed += blocked * (now - self.at).as_secs_f64() / RETRY.as_secs_f64();
        self.at = now;
    }
}

/// A virtual host and its fleet.
pub struct VirtualHost {
    pub fleet: Fleet,
    pub local: Arc<VirtualLocal>,
}

impl VirtualHost {
    pub fn start(config: FleetConfig, want: u64, ledger: &Arc<Ledger>) -> VirtualHost {
        let local = VirtualLocal::new(&config.identity, want, ledger.clone());
        let fleet = Fleet::start(config, local.clone()).expect("starting a virtual host");
        VirtualHost { fleet, local }
    }

    /// The share its kernel enforces (None: none yet).
    pub fn share(&self) -> Option<u64> {
        self.fleet.status().budgets[0].share
    }
}
