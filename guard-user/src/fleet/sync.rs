//! The sync loop: one session with etcd at a time (connect, lease, list, own records,
//! watch, then refresh until an error ends it), and the watchdog that falls to the safe
//! shares when the lease could have expired in etcd.
use std::{
    collections::{BTreeMap, VecDeque},
    convert::Infallible,
    hash::{BuildHasher, RandomState},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use etcd_client::EventType;
use tokio::{sync::watch, time::MissedTickBehavior};

use super::{
    BudgetStatus, Demand, FleetConfig, FleetError, Local, Status,
    lease_file::Saved,
    record::{Key, Record},
    share::{Claimant, fair_shares},
    store::{Raised, Store},
};

/// What the loop, the watchdog and the handle share.
pub struct Shared {
    config: FleetConfig,
    local: Arc<dyn Local>,
    held: Mutex<Held>,
    /// The instant the shares stand until, for the watchdog.
    fall_at: watch::Sender<Instant>,
    state: watch::Sender<SyncState>,
    counters: Mutex<Counters>,
    budgets: Mutex<Vec<BudgetStatus>>,
    /// The lease the process holds (from the lease file, until a session checks it).
    lease: Mutex<Option<i64>>,
}

/// What the kernel enforces, under one lock with the instant it may enforce it until.
struct Held {
    fall_at: Instant,
    enforced: Vec<Option<u64>>,
    safe: Vec<bool>,
}

#[derive(Debug, Clone)]
enum SyncState {
    Pending,
    Synced,
    Failed(FleetError),
}

#[derive(Debug, Default)]
struct Counters {
    store_errors: u64,
    last_error: Option<String>,
    writes: u64,
    conflicts: u64,
    keepalives: u64,
    last_sync: Option<Instant>,
}

impl Shared {
    pub fn new(config: FleetConfig, local: Arc<dyn Local>) -> Shared {
        let saved = config
            .lease_file
            .as_deref()
            .and_then(|p| Saved::load(p, &config.identity));
        let now = Instant::now();
        // Without a lease whose shares still stand, the watchdog applies the safe
        // shares at once: nothing in etcd covers what the kernel may hold.
        let fall_at = saved.and_then(|(_, until)| until).unwrap_or(now);
        if fall_at > now {
            local.shares_stand_until(fall_at);
        }
        let n = config.budgets.len();
        let budgets = config
            .budgets
            .iter()
            .map(|b| BudgetStatus {
                name: b.name.clone(),
                total: b.total,
                share: None,
                has: 0,
                wants: 0,
                active: 0,
                hosts: 0,
                safe: false,
            })
            .collect();
        Shared {
            local,
            held: Mutex::new(Held {
                fall_at,
                enforced: vec![None; n],
                safe: vec![false; n],
            }),
            fall_at: watch::Sender::new(fall_at),
            state: watch::Sender::new(SyncState::Pending),
            counters: Mutex::default(),
            budgets: Mutex::new(budgets),
            lease: Mutex::new(saved.map(|(lease, _)| lease)),
            config,
        }
    }

    pub fn status(&self) -> Status {
        let c = self.counters.lock().unwrap();
        let held = self.held.lock().unwrap();
        let mut budgets = self.budgets.lock().unwrap().clone();
        for (i, b) in budgets.iter_mut().enumerate() {
            b.share = held.enforced[i];
            b.safe = held.safe[i];
        }
        Status {
            identity: self.config.identity.clone(),
            lease: *self.lease.lock().unwrap(),
            last_sync_ms: c.last_sync.map(|t| t.elapsed().as_millis() as u64),
            store_errors: c.store_errors,
            last_error: c.last_error.clone(),
            writes: c.writes,
            conflicts: c.conflicts,
            keepalives: c.keepalives,
            budgets,
        }
    }

    pub async fn synced(&self, within: Duration) -> Result<(), FleetError> {
        let mut rx = self.state.subscribe();
        let done = rx.wait_for(|s| !matches!(s, SyncState::Pending));
        match tokio::time::timeout(within, done).await {
            Ok(Ok(s)) => match &*s {
                SyncState::Failed(e) => Err(e.clone()),
                _ => Ok(()),
            },
            _ => Err(FleetError::Unreachable {
                endpoints: self.config.store.endpoints.join(","),
                reason: format!("no sync within {within:?}"),
            }),
        }
    }

    pub async fn leave(&self) -> Result<(), FleetError> {
        self.fall("leaving the fleet");
        let lease = self.lease.lock().unwrap().take();
        if let Some(path) = &self.config.lease_file {
            let _ = std::fs::remove_file(path);
        }
        let Some(lease) = lease else { return Ok(()) };
        let mut store = Store::connect(&self.config.store, self.config.ttl / 3).await?;
        store.revoke(lease).await
    }

    /// Makes the kernel enforce `share` for budget `i`; whether it does. A raise (or a
    /// first share) is applied only while the lease covers it; a lower always is.
    fn enforce(&self, i: usize, share: u64) -> bool {
        let mut held = self.held.lock().unwrap();
        if held.enforced[i] == Some(share) && !held.safe[i] {
            return true;
        }
        let raise = held.enforced[i].is_none_or(|e| share > e);
        if raise && Instant::now() >= held.fall_at {
            return false;
        }
        if !self.local.apply(&self.config.budgets[i].name, share) {
            return false;
        }
        held.enforced[i] = Some(share);
        held.safe[i] = false;
        true
    }

    /// The safe shares, now; the lease no longer covers anything.
    fn fall(&self, why: &str) {
        let mut held = self.held.lock().unwrap();
        held.fall_at = held.fall_at.min(Instant::now());
        self.fall_held(&mut held, why);
        drop(held);
        self.fall_at.send_replace(Instant::now());
    }

    fn fall_held(&self, held: &mut Held, why: &str) {
        for (i, b) in self.config.budgets.iter().enumerate() {
            if held.safe[i] {
                continue;
            }
            log::warn!(
                "fleet: budget {}: safe share {} ({why})",
                b.name,
                b.safe_share
            );
            if !self.local.apply(&b.name, b.safe_share) {
                log::error!(
                    "fleet: budget {}: the kernel did not take the safe share; retried at the next check",
                    b.name
                );
                continue;
            }
            held.enforced[i] = Some(b.safe_share);
            held.safe[i] = true;
        }
    }

    /// Falls to the safe shares if the lease could have expired; whether it did.
    fn fall_if_due(&self) -> bool {
        let mut held = self.held.lock().unwrap();
        if Instant::now() < held.fall_at {
            return false;
        }
        self.fall_held(&mut held, "no lease renewal acknowledged in time");
        true
    }

    /// etcd acknowledged the lease at `sent` (or later) with `ttl` seconds to live.
    fn extend(&self, lease: i64, sent: Instant, ttl: i64) {
        let ttl = Duration::from_secs(ttl.max(0) as u64);
        let until = sent + ttl.saturating_sub(self.config.ttl / 5);
        let mut held = self.held.lock().unwrap();
        if until > held.fall_at {
            held.fall_at = until;
            self.local.shares_stand_until(until);
            drop(held);
            self.fall_at.send_replace(until);
        }
        self.counters.lock().unwrap().last_sync = Some(Instant::now());
        if let Some(path) = &self.config.lease_file
            && let Err(e) = Saved::store(path, &self.config.identity, lease, until)
        {
            log::warn!("fleet: saving the lease in {}: {e}", path.display());
        }
    }

    fn failed(&self, e: &FleetError) {
        let mut c = self.counters.lock().unwrap();
        c.store_errors += 1;
        let text = e.to_string();
        if c.last_error.as_deref() != Some(text.as_str()) {
            log::warn!("fleet: {text}");
        }
        c.last_error = Some(text);
        drop(c);
        self.state.send_replace(SyncState::Failed(e.clone()));
    }

    fn count(&self, f: impl FnOnce(&mut Counters)) {
        f(&mut self.counters.lock().unwrap());
    }
}

/// Falls to the safe shares when the lease could have expired.
pub async fn watchdog(shared: Arc<Shared>) {
    let mut rx = shared.fall_at.subscribe();
    loop {
        let at = *rx.borrow_and_update();
        if !shared.fall_if_due() {
            tokio::select! {
                _ = tokio::time::sleep_until(at.into()) => continue,
                r = rx.changed() => if r.is_err() { return },
            }
        } else if rx.changed().await.is_err() {
            return;
        }
    }
}

/// Sessions, one after another, with backoff between them.
pub async fn run(shared: Arc<Shared>) {
    let refresh = shared.config.refresh;
    loop {
        let started = Instant::now();
        let Err(e) = Session::run(&shared).await;
        match e {
            FleetError::LeaseLost { .. } => {
                shared.fall("the lease is lost");
                *shared.lease.lock().unwrap() = None;
            }
            // No record of this host stands behind its shares.
            FleetError::IdentityTaken { .. } => shared.fall("the identity is taken"),
            _ => {}
        }
        shared.failed(&e);
        // A session that synced for a while retries soon; one that failed at once waits
        // a refresh.
        let pause = if started.elapsed() > refresh * 2 {
            refresh / 4
        } else {
            refresh
        };
        tokio::time::sleep(pause + jitter(refresh / 4)).await;
    }
}

/// One budget as the session sees it.
struct View {
    others: BTreeMap<String, Record>,
    mine: Option<Record>,
    /// The raise key's mod_revision (0: absent).
    raise_rev: i64,
    /// The store revision the view reflects.
    revision: i64,
    /// `shed_total` at the last refresh.
    last_shed: u64,
    /// What the host wanted over the last refresh (published or not).
    last_wants: u64,
    /// Since when the host has wanted more than its entitlement (its split were every
    /// host to want everything): it borrows above it only a refresh later.
    over_since: Option<Instant>,
    /// A raise was held to the entitlement until `over_since` is a refresh old.
    borrow_pending: bool,
    dirty: bool,
}

struct Session<'a> {
    shared: &'a Shared,
    store: Store,
    lease: i64,
    /// The lease this host held before `lease` (its previous session's, or the lease
    /// file's), found expired: a record of its under that lease is its own.
    previous: Option<i64>,
    views: Vec<View>,
}

impl<'a> Session<'a> {
    async fn run(shared: &'a Shared) -> Result<Infallible, FleetError> {
        let config = &shared.config;
        let timeout = config.ttl / 3;
        let mut store = Store::connect(&config.store, timeout).await?;
        let (lease, previous) = Self::lease(shared, &mut store).await?;
        let (mut keeper, mut acks) = store.keep_alive(lease).await?;
        let (revision, listed) = store.list().await?;
        let mut session = Session {
            shared,
            store,
            lease,
            previous,
            views: config
                .budgets
                .iter()
                .map(|_| View {
                    others: BTreeMap::new(),
                    mine: None,
                    raise_rev: 0,
                    revision,
                    last_shed: 0,
                    last_wants: 0,
                    over_since: None,
                    borrow_pending: false,
                    dirty: false,
                })
                .collect(),
        };
        for l in listed {
            session.apply(&l.key, Some(&l.value), l.mod_revision, revision)?;
        }
        for i in 0..config.budgets.len() {
            session.own_record(i).await?;
        }
        shared.state.send_replace(SyncState::Synced);
        let mut watch = session.store.watch(revision).await?;
        let mut tick = tokio::time::interval(config.refresh);
        let mut sample = tokio::time::interval(config.refresh / 4);
        // A refresh delayed by slow requests is not made up by a burst of them: each
        // one's demand window is a whole refresh.
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        sample.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut sent: VecDeque<Instant> = VecDeque::new();
        let mut soon: Option<Instant> = None;
        loop {
            let overdue = sent.front().map(|s| *s + timeout);
            tokio::select! {
                _ = tick.tick() => {
                    keeper
                        .keep_alive()
                        .await
                        .map_err(|e| session.store.error("keeping the lease alive", e))?;
                    sent.push_back(Instant::now());
                    shared.count(|c| c.keepalives += 1);
                    for i in 0..session.views.len() {
                        session.recompute(i, true).await?;
                    }
                }
                _ = sample.tick() => {
                    for i in 0..session.views.len() {
                        if session.jumped(i) || session.may_borrow(i) {
                            session.recompute(i, false).await?;
                        }
                    }
                }
                ack = acks.message() => {
                    let ack = ack
                        .map_err(|e| session.store.error("keeping the lease alive", e))?
                        .ok_or_else(|| closed("the lease's keep-alive stream", config))?;
                    let at = sent.pop_front().unwrap_or_else(Instant::now);
                    if ack.ttl() <= 0 {
                        return Err(FleetError::LeaseLost { lease });
                    }
                    shared.extend(lease, at, ack.ttl());
                }
                _ = sleep_until(overdue), if overdue.is_some() => {
                    return Err(FleetError::Unreachable {
                        endpoints: config.store.endpoints.join(","),
                        reason: format!("no answer to a lease keep-alive within {timeout:?}"),
                    });
                }
                w = watch.message() => {
                    let w = w
                        .map_err(|e| session.store.error("watching the fleet", e))?
                        .ok_or_else(|| closed("the watch", config))?;
                    if w.canceled() {
                        return Err(FleetError::Store(format!(
                            "the watch was canceled ({}; compacted at {}): listing again",
                            w.cancel_reason(),
                            w.compact_revision()
                        )));
                    }
                    let revision = w.header().map_or(0, |h| h.revision());
                    for e in w.events() {
                        let Some(kv) = e.kv() else { continue };
                        let key = String::from_utf8_lossy(kv.key());
                        let value = (e.event_type() == EventType::Put).then(|| kv.value());
                        session.apply(&key, value, kv.mod_revision(), revision)?;
                    }
                    if soon.is_none() && session.views.iter().any(|v| v.dirty) {
                        let debounce = config.refresh / 10;
                        soon = Some(Instant::now() + debounce + jitter(debounce));
                    }
                }
                _ = sleep_until(soon), if soon.is_some() => {
                    soon = None;
                    for i in 0..session.views.len() {
                        if std::mem::take(&mut session.views[i].dirty) {
                            session.recompute(i, false).await?;
                        }
                    }
                }
            }
        }
    }

    /// The lease: the one the process holds if etcd still has it, else a new one (and
    /// the safe shares, since what the old one covered is gone), with the expired one.
    async fn lease(shared: &Shared, store: &mut Store) -> Result<(i64, Option<i64>), FleetError> {
        let held = *shared.lease.lock().unwrap();
        let sent = Instant::now();
        if let Some(lease) = held {
            if let Some(ttl) = store.lease_ttl(lease).await? {
                shared.extend(lease, sent, ttl);
                return Ok((lease, None));
            }
            shared.fall("the lease expired in etcd");
        }
        let (lease, ttl) = store.grant(shared.config.ttl).await?;
        *shared.lease.lock().unwrap() = Some(lease);
        shared.extend(lease, sent, ttl);
        Ok((lease, held))
    }

    /// Adopts the host's record of budget `i` (same lease), or creates it at zero.
    async fn own_record(&mut self, i: usize) -> Result<(), FleetError> {
        let shared = self.shared;
        let spec = &shared.config.budgets[i];
        let view = &mut self.views[i];
        let demand = self.shared.local.demand(&spec.name);
        view.last_shed = demand.shed_total;
        let there = match view.mine.take() {
            Some(r) => r,
            None => {
                let record = Record {
                    identity: self.shared.config.identity.clone(),
                    lease: self.lease,
                    has: 0,
                    active: demand.active,
                    wants: wants(demand.active, 0, spec.total),
                    weight: spec.weight,
                    floor: spec.floor,
                    total: spec.total,
                    destinations: spec.destinations.clone(),
                    based_on: view.revision,
                };
                let bump = record.takes_more_than(None);
                let there = self.store.create(&spec.name, &record, bump).await?;
                self.shared.count(|c| c.writes += 1);
                there.unwrap_or(record)
            }
        };
        if there.lease != self.lease && Some(there.lease) == self.previous {
            // The host's own record, under its expired lease that etcd has not revoked
            // yet: taken over under the new lease with its claim, so that what it claims
            // (the connections this host still holds) is never free for the others.
            let record = Record {
                lease: self.lease,
                active: demand.active,
                based_on: view.revision,
                ..there.clone()
            };
            let bump = record.takes_more_than(Some(&there));
            self.shared.count(|c| c.writes += 1);
            if self
                .store
                .take_over(&spec.name, &record, there.lease, bump)
                .await?
            {
                log::info!(
                    "fleet budget {:?}: took over this host's record from its expired lease {:x}",
                    spec.name,
                    there.lease
                );
                view.mine = Some(record);
                return Ok(());
            }
            // etcd revoked the old lease meanwhile: its record is gone, and the next
            // session creates this host's anew.
            return Err(FleetError::LeaseLost { lease: there.lease });
        }
        if there.lease != self.lease {
            return Err(FleetError::IdentityTaken {
                identity: there.identity,
                budget: spec.name.clone(),
                lease: there.lease,
            });
        }
        view.mine = Some(there);
        Ok(())
    }

    /// Applies one key's new value (None: deleted) at store revision `revision`.
    fn apply(
        &mut self,
        key: &str,
        value: Option<&[u8]>,
        mod_revision: i64,
        revision: i64,
    ) -> Result<(), FleetError> {
        let config = &self.shared.config;
        let lease = self.lease;
        let (budget, identity) = match self.store.keys.parse(key) {
            Some(Key::Host { budget, identity }) => (budget, Some(identity)),
            Some(Key::Raise { budget }) => (budget, None),
            None => return Ok(()),
        };
        let Some(i) = config.budgets.iter().position(|b| b.name == budget) else {
            return Ok(());
        };
        let view = &mut self.views[i];
        view.revision = view.revision.max(revision);
        let Some(identity) = identity else {
            view.raise_rev = if value.is_some() { mod_revision } else { 0 };
            view.dirty = true;
            return Ok(());
        };
        let record = value.map(|v| parse(identity, v, config.budgets[i].total));
        if identity == config.identity {
            return match record {
                // Before the session adopted or created it, a record is taken as is.
                Some(r) if view.mine.is_none() => {
                    view.mine = Some(r);
                    Ok(())
                }
                // The echo of one of the host's own writes: its view already holds the
                // newest (an echo of an older write must not replace it).
                Some(r) if r.lease == lease => Ok(()),
                Some(r) => Err(FleetError::IdentityTaken {
                    identity: r.identity,
                    budget: budget.to_string(),
                    lease: r.lease,
                }),
                None => Err(FleetError::LeaseLost { lease }),
            };
        }
        match record {
            Some(r) => view.others.insert(identity.to_string(), r),
            None => view.others.remove(identity),
        };
        view.dirty = true;
        Ok(())
    }

    /// Whether budget `i`'s demand grew past what the host last published.
    fn jumped(&self, i: usize) -> bool {
        let (spec, view) = (&self.shared.config.budgets[i], &self.views[i]);
        let Some(mine) = &view.mine else { return false };
        let d = self.shared.local.demand(&spec.name);
        let now = wants(
            d.active,
            d.shed_total.saturating_sub(view.last_shed),
            spec.total,
        );
        now > mine.wants + (mine.wants / 10).max(1)
    }

    /// Whether budget `i` holds a raise back that it may now make (see `View::over_since`).
    fn may_borrow(&self, i: usize) -> bool {
        let view = &self.views[i];
        view.borrow_pending
            && view
                .over_since
                .is_some_and(|t| t.elapsed() >= self.shared.config.refresh)
    }

    /// Moves budget `i`'s share toward its fair target: lowers at once, raises through
    /// the raise transaction, publishes a changed demand. Above its entitlement (its
    /// split were every host to want everything) a host raises only once it has wanted
    /// more for a whole refresh: hosts whose demand rises together all publish it
    /// before one of them borrows what the others want, and connections are never cut,
    /// so a share lent out comes back only as they close.
    async fn recompute(&mut self, i: usize, at_refresh: bool) -> Result<(), FleetError> {
        let shared = self.shared;
        let spec = &shared.config.budgets[i];
        let view = &mut self.views[i];
        let Some(mine) = view.mine.clone() else {
            return Ok(());
        };
        let d: Demand = self.shared.local.demand(&spec.name);
        let shed = d.shed_total.saturating_sub(view.last_shed);
        let mut wants = wants(d.active, shed, spec.total);
        if at_refresh {
            view.last_shed = d.shed_total;
            view.last_wants = wants;
        } else {
            // Between refreshes the window is partial: demand may rise, not fall.
            wants = wants.max(view.last_wants);
        }
        let total = view
            .others
            .values()
            .map(|r| r.total)
            .fold(spec.total, u64::min);
        let me = Claimant {
            wants,
            weight: spec.weight,
            floor: spec.floor,
        };
        let at = view.others.range(..mine.identity.clone()).count();
        let mut claimants: Vec<Claimant> = view
            .others
            .values()
            .map(|r| Claimant {
                wants: r.wants,
                weight: r.weight,
                floor: r.floor,
            })
            .collect();
        claimants.insert(at, me);
        let fair = fair_shares(total, &claimants)[at];
        // What the host would get wanting everything: the others' shares depend on its
        // wants only up to that level.
        claimants[at].wants = total;
        let level = fair_shares(total, &claimants)[at];
        let everyone: Vec<Claimant> = claimants
            .iter()
            .map(|c| Claimant { wants: total, ..*c })
            .collect();
        let entitled = fair_shares(total, &everyone)[at];
        if wants <= entitled {
            view.over_since = None;
        } else if view.over_since.is_none() {
            view.over_since = Some(Instant::now());
        }
        let patient = view
            .over_since
            .is_some_and(|t| t.elapsed() >= shared.config.refresh);
        let held_to = entitled.max(mine.has);
        let target = if patient { fair } else { fair.min(held_to) };
        view.borrow_pending = target < fair;
        let mut next = Record {
            active: d.active,
            wants,
            weight: spec.weight,
            floor: spec.floor,
            total: spec.total,
            destinations: spec.destinations.clone(),
            based_on: view.revision,
            ..mine.clone()
        };
        if target < mine.has {
            // Lower: the kernel first, then the record, with the active count the
            // lowered kernel budget leaves; a kernel that did not take it keeps the
            // record as it is, and the next refresh tries again.
            if !self.shared.enforce(i, target) {
                self.report(i, total);
                return Ok(());
            }
            next.has = target;
            next.active = self.shared.local.demand(&spec.name).active;
            self.publish(i, next, &mine).await?;
        } else {
            let _ = self.shared.enforce(i, mine.has);
            let others: u64 = view.others.values().map(Record::claim).sum();
            let raised = target.min(total.saturating_sub(others));
            if raised > mine.has {
                next.has = raised;
                let seen = view.raise_rev;
                self.shared.count(|c| c.writes += 1);
                match self.store.raise(&spec.name, &next, seen).await? {
                    Raised::Yes => {
                        self.views[i].mine = Some(next);
                        // A kernel that does not take it enforces less than the record
                        // claims: the safe side.
                        let _ = self.shared.enforce(i, raised);
                    }
                    Raised::Conflict => {
                        self.shared.count(|c| c.conflicts += 1);
                        self.views[i].dirty = true;
                    }
                }
            } else if changed(&mine, &next, level) {
                self.publish(i, next, &mine).await?;
            }
        }
        self.report(i, total);
        Ok(())
    }

    async fn publish(&mut self, i: usize, next: Record, old: &Record) -> Result<(), FleetError> {
        let bump = next.takes_more_than(Some(old));
        let name = &self.shared.config.budgets[i].name;
        self.shared.count(|c| c.writes += 1);
        self.store.publish(name, &next, bump).await?;
        self.views[i].mine = Some(next);
        Ok(())
    }

    fn report(&self, i: usize, total: u64) {
        let view = &self.views[i];
        let mut budgets = self.shared.budgets.lock().unwrap();
        let b = &mut budgets[i];
        b.total = total;
        b.hosts = view.others.len() + usize::from(view.mine.is_some());
        if let Some(m) = &view.mine {
            (b.has, b.wants, b.active) = (m.has, m.wants, m.active);
        }
    }
}

/// What a host wants: its active connections and those it shed in the last refresh,
/// with a tenth more as headroom (so that a host at its share asks for more before it
/// sheds), and never more than the total.
fn wants(active: u64, shed: u64, total: u64) -> u64 {
    let w = active.saturating_add(shed);
    w.saturating_add(w.div_ceil(10)).min(total)
}

/// Whether a record differs enough from the published one to be written: its claim,
/// its settings, or its demand by more than a tenth where the split can see it (up to
/// `level`, the host's share were it to want everything: above it, no host's share
/// depends on the host's wants).
fn changed(old: &Record, new: &Record, level: u64) -> bool {
    let (was, is) = (old.wants.min(level), new.wants.min(level));
    old.claim() != new.claim()
        || old.total != new.total
        || old.weight != new.weight
        || old.floor != new.floor
        || old.destinations != new.destinations
        || was.abs_diff(is) > (was / 10).max(1)
}

/// Another host's record; one that cannot be read claims the whole total (nobody can
/// raise into capacity it may hold), and names no total of its own.
fn parse(identity: &str, value: &[u8], total: u64) -> Record {
    serde_json::from_slice(value).unwrap_or_else(|e| {
        log::warn!(
            "fleet: the record of host {identity:?} cannot be read ({e}): it claims the whole total"
        );
        Record {
            identity: identity.to_string(),
            lease: 0,
            has: total,
            active: 0,
            wants: 0,
            weight: 1,
            floor: 0,
            total: u64::MAX,
            destinations: Vec::new(),
            based_on: 0,
        }
    })
}

fn closed(what: &str, config: &FleetConfig) -> FleetError {
    FleetError::Unreachable {
        endpoints: config.store.endpoints.join(","),
        reason: format!("etcd closed {what}"),
    }
}

async fn sleep_until(at: Option<Instant>) {
    if let Some(at) = at {
        tokio::time::sleep_until(at.into()).await;
    }
}

/// A random pause up to `max`, so that many hosts do not act in step.
fn jitter(max: Duration) -> Duration {
    let r = RandomState::new().hash_one(Instant::now());
    max.mul_f64((r % 1_000) as f64 / 1_000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wants_add_a_tenth_of_headroom_up_to_the_total() {
        assert_eq!(wants(0, 0, 60), 0);
        assert_eq!(wants(50, 0, 60), 55);
        assert_eq!(wants(1, 0, 60), 2);
        assert_eq!(wants(20, 40, 60), 60);
    }

    #[test]
    fn demand_changes_are_written_when_the_split_can_see_them() {
        let r = parse(
            "h",
            br#"{"identity":"h","lease":1,"has":20,"active":20,"wants":50,"weight":1,
                 "floor":0,"total":60,"destinations":[],"based_on":3}"#,
            60,
        );
        assert_eq!(r.lease, 1);
        let with = |f: fn(&mut Record)| {
            let mut n = r.clone();
            f(&mut n);
            n
        };
        assert!(!changed(&r, &with(|n| n.wants = 54), 60));
        assert!(changed(&r, &with(|n| n.wants = 56), 60));
        assert!(changed(&r, &with(|n| n.active = 25), 60));
        assert!(!changed(&r, &with(|n| n.active = 15), 60));
        // Above the level the split cannot see a change of demand; below it, it can.
        assert!(!changed(&r, &with(|n| n.wants = 300), 30));
        assert!(!changed(&r, &with(|n| n.wants = 31), 30));
        assert!(changed(&r, &with(|n| n.wants = 25), 30));
        let bad = parse("x", b"{", 60);
        assert_eq!((bad.claim(), bad.total), (60, u64::MAX));
    }
}
