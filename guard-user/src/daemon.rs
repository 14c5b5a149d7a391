//! `connguard run`: adopt or create the pinned state, attach, apply the policy, then
//! serve stats and reloads until SIGTERM/SIGINT (exit keeping the state) or `stop`
//! (exit detaching everything). This module wires the layers and owns the daemon's life
//! cycle; each piece of state has its own lock, so the listener and port watchers never
//! wait for a snapshot being built or sent.
mod jobs;

use std::{
    os::fd::AsFd,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::{Duration, Instant},
};

use anyhow::Context;
use aya::Ebpf;
use connguard_api::{
    control::{EventsReply, ReloadReply, Reply, Request, ScopeReply, StopReply},
    kernel::Features,
    stats::{PolicyStatus, Snapshot},
};
use tokio::signal::unix::{SignalKind, signal};

use self::jobs::Jobs;
use crate::{
    control::{self, server::Handler},
    diagnose::attribution::{SAMPLE_EVERY, TimeWaitRates, daemon_ports, eaddrnotavail_counts},
    enforce::{
        audit::{Audit, Correction, Count, Key},
        breakers::BreakerRamps,
        counters::Counters,
        generations::Generations,
        lease::{self, Lease},
        port_watch::{self, PortWatch},
        scopes::{self, Tree},
        seed,
    },
    host::{cgroup, cgroup_watch::CgroupWatch, mounts},
    kernel::{
        batch, clock,
        features::{Feature, KernelFeatures},
        maps::Maps,
        object,
        state::{self, Pin, State},
        syscall,
    },
    listen::{self, ListenerGuard},
    policy::{self, ListenerPolicy, Policy},
    report::{
        events::{self, EventLog},
        prometheus::{self, METRIC_TOP_DESTINATIONS},
        snapshot,
    },
};

/// How often cgroups created or removed since the last look are picked up, TIME_WAIT
/// births sampled, and port watermarks read.
const RESCAN: Duration = Duration::from_millis(500);
/// How often listener queues are read: shedding starts and stops within this (plus the
/// read).
const LISTENER_POLL: Duration = Duration::from_millis(50);
/// How often the per-SYN listener program is told the daemon lives: it sheds nothing
/// 500 ms (LISTENER_TTL_NS) after the last time.
const LISTENER_HEARTBEAT: Duration = Duration::from_millis(100);
/// How often guarded namespaces are checked for new interfaces and for a namespace
/// file bound to a new namespace.
const LISTENER_RESCAN: Duration = Duration::from_secs(1);

pub struct Options {
    pub policy: Option<PathBuf>,
    pub metrics: Option<String>,
    pub socket: PathBuf,
    pub bpf_stats: bool,
    /// Destination entries idle this long (to twice as long) are forgotten.
    pub forget_idle: Duration,
    /// How long the programs keep shedding after the last renewal of the lease.
    pub lease: Duration,
    /// Exit detaching and unpinning everything, as `stop` does.
    pub detach_on_exit: bool,
    /// The pinned state's layout version (guard_common::STATE_LAYOUT but in tests).
    pub state_layout: u32,
    /// How often the counters are audited against the live sockets.
    pub audit: Duration,
}

/// The daemon's state, one lock per owner.
struct Daemon {
    /// Held for program costs, and to attach the connection programs and listener
    /// guards. Taken after `generations` by who takes both.
    ebpf: Mutex<Ebpf>,
    generations: Mutex<Generations>,
    /// Creations of cgroups where a new one may be selected.
    cgroup_watch: CgroupWatch,
    counters: Mutex<Counters>,
    /// What /metrics exported, so that its counters never go down. Taken before every
    /// lock a snapshot takes.
    exported: Mutex<prometheus::Exported>,
    port_watch: Mutex<PortWatch>,
    listeners: Mutex<ListenerGuard>,
    tw_rates: Mutex<TimeWaitRates>,
    /// What the kernel reported through EVENTS, named.
    events: Mutex<EventLog>,
    /// The controls (guard_common::CONTROL_* bits) the connect programs were loaded with.
    controls: u32,
    status: Mutex<PolicyStatus>,
    /// Held for a whole reload, so that reloads (SIGHUP, `connguard reload`) take turns.
    reloading: Mutex<()>,
    policy_path: Option<PathBuf>,
    jobs: Jobs,
    /// What the kernel offers, probed at start.
    features: Features,
    lease: Mutex<Lease>,
    audit: Audit,
    /// Notified by a `stop` request.
    stop: tokio::sync::Notify,
    /// The pinned state, and the tracepoint's link in it.
    state: State,
    tracepoint: Pin,
}

/// With a panic hook that aborts, a lock is never left poisoned; this only spares the
/// callers an unwrap.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn read_policy(path: Option<&Path>) -> Result<Policy, policy::PolicyError> {
    match path {
        Some(p) => policy::load_file(p),
        None => policy::parse(policy::DEFAULT_POLICY, policy::DEFAULT_SOURCE),
    }
}

impl Daemon {
    /// Re-reads the policy file; on any error the policy in force stays, and the error
    /// is logged and kept for `stats`.
    fn reload(&self) -> ReloadReply {
        let _turn = lock(&self.reloading);
        let result = read_policy(self.policy_path.as_deref())
            .map_err(|e| e.to_string())
            .and_then(|p| {
                let missing = policy::controls(&p) & !self.controls;
                if missing != 0 {
                    return Err(format!(
                        "{}: the policy uses {}, whose code the connect programs were loaded \
                         without (the daemon loads what its first policy uses); restart the \
                         daemon to load them",
                        p.source,
                        policy::control_names(missing)
                    ));
                }
                let what = policy::describe(&p);
                let listeners = p.listeners.clone();
                // The walk, seconds on hosts with tens of thousands of cgroups, is made
                // without the lock that `stats` and the jobs need.
                let root = lock(&self.generations).cgroup_root();
                let tree = scopes::walk(&root, &p).map_err(|e| format!("{e:#}"))?;
                self.apply(p, tree).map_err(|e| format!("{e:#}"))?;
                Ok((what, listeners))
            });
        let mut status = lock(&self.status);
        match result {
            Ok((what, listeners)) => {
                status.generation += 1;
                status.last_error = None;
                log::info!("policy reloaded: generation {}, {what}", status.generation);
                drop(status);
                self.set_listeners(listeners);
                // Cgroups created while the reload walked, whose events were for the
                // policy it replaced.
                if let Err(e) = self.rescan() {
                    log::warn!("walking the cgroups after the reload: {e:#}");
                }
            }
            Err(e) => {
                log::error!("policy reload rejected, the previous policy stays in force: {e}");
                status.last_error = Some(e);
                drop(status);
            }
        }
        let status = lock(&self.status);
        ReloadReply {
            generation: status.generation,
            error: status.last_error.clone(),
        }
    }

    /// Makes `policy` the one in force, with `tree` a walk of the cgroups for it.
    fn apply(&self, policy: Policy, tree: Tree) -> anyhow::Result<()> {
        match clock::tick_ns() {
            Ok(tick_ns) => policy::coarse_controls(&policy, tick_ns)
                .iter()
                .for_each(|w| log::warn!("{w}")),
            Err(e) => log::warn!("{e:#}"),
        }
        let Tree { governed, watched } = tree;
        let (detached, policy, ids) = {
            let mut g = lock(&self.generations);
            let detached = g.apply(policy, governed, &mut lock(&self.ebpf))?;
            (detached, g.policy(), g.ids())
        };
        self.cgroup_watch.set(&watched);
        // After the switch, so that no connect decides under the old policy's breakers
        // but one that read the old generation just before it: that one can make a
        // destination's breaker entry again, closed and empty, which cannot open, is not
        // shown, and goes with its destination when it is forgotten.
        if let Some(policy) = policy {
            let ramps = BreakerRamps::new(&policy, &ids);
            let n = lock(&self.counters).forget_breakers(|key| ramps.of(key).is_some());
            if n > 0 {
                log::info!("forgot {n} breaker(s) of destinations no breaker governs now");
            }
        }
        // Detaching waits for the kernel; the locks are free meanwhile.
        drop(detached);
        Ok(())
    }

    /// Brings the policy in force up to date with the cgroups there are now.
    fn rescan(&self) -> anyhow::Result<()> {
        let Some(input) = lock(&self.generations).rescan_input() else {
            return Ok(());
        };
        let Tree { governed, watched } = scopes::walk(&input.root, &input.policy)?;
        let detached = lock(&self.generations).rescan(&input, governed, &mut lock(&self.ebpf))?;
        // Added to, not replaced: the event path may have watched a cgroup created since
        // the walk started. A removed directory drops its watch itself.
        self.cgroup_watch.add(&watched);
        drop(detached);
        // Removed cgroups the kernel has detached, asked about without the locks.
        let removed = lock(&self.generations).take_removed();
        let (kept, done) = removed.reap();
        lock(&self.generations).restore_removed(kept);
        drop(done);
        Ok(())
    }

    /// A cgroup was created at `dir`, in a watched one: govern it now, not at the next
    /// rescan.
    fn cgroup_created(&self, dir: &Path) -> anyhow::Result<()> {
        let Some(input) = lock(&self.generations).rescan_input() else {
            return Ok(());
        };
        let (Ok(rel), Some(parent)) = (dir.strip_prefix(&input.root), dir.parent()) else {
            return Ok(());
        };
        let Some(rel) = rel.to_str() else {
            return Ok(());
        };
        let inherited = lock(&self.generations).scope_index(cgroup::cgroup_id(parent)?);
        // Watched before the walk, so that a child created meanwhile is an event.
        if input
            .policy
            .scopes
            .iter()
            .any(|s| s.selector.may_select_below(rel))
        {
            self.cgroup_watch
                .add(&std::collections::BTreeSet::from([dir.to_path_buf()]));
        }
        let tree = scopes::walk_below(dir, rel, inherited, &input.policy);
        self.cgroup_watch.add(&tree.watched);
        let detached = lock(&self.generations).add(&input, tree.governed, &mut lock(&self.ebpf))?;
        drop(detached);
        Ok(())
    }

    fn set_listeners(&self, policies: Vec<ListenerPolicy>) {
        let mut ebpf = lock(&self.ebpf);
        lock(&self.listeners).set_policies(&mut ebpf, policies);
    }

    /// Everything `stats` reports; with `top`, each scope's destinations are cut to the
    /// busiest `top`. The maps are read under their owners' locks, the snapshot is built
    /// after.
    fn snapshot(&self, top: Option<usize>) -> Snapshot {
        let status = lock(&self.status).clone();
        let (policy, ids) = {
            let g = lock(&self.generations);
            (g.policy(), g.ids())
        };
        let dump = lock(&self.counters).dump(ids.counts());
        let programs = object::program_costs(&lock(&self.ebpf));
        let watched_ports = lock(&self.port_watch).watched();
        let listeners = lock(&self.listeners).stats();
        let scope_name = |id| ids.scope_name(id).unwrap_or("?").to_string();
        let eaddrnotavail = eaddrnotavail_counts(&dump.eaddrnotavail, scope_name);
        let (internal_errors, lease_expired, lost_events) =
            (dump.internal_errors, dump.lease_expired, dump.lost_events);
        let audit_corrections = self.audit.corrections();
        Snapshot {
            policy: status,
            scopes: policy.map_or_else(Vec::new, |p| snapshot::scopes(&p, &ids, dump, top)),
            internal_errors,
            lost_events,
            lease_expired,
            audit_corrections,
            programs,
            eaddrnotavail,
            watched_ports,
            listeners,
            jobs: self.jobs.stats(),
            kernel: Some(self.features.clone()),
        }
    }

    /// The text of a scrape of /metrics.
    fn metrics(&self) -> String {
        // Held across the snapshot: the destinations it lists are kept from forget_idle
        // from the moment they are read.
        let mut exported = lock(&self.exported);
        prometheus::render(&self.snapshot(Some(METRIC_TOP_DESTINATIONS)), &mut exported)
    }

    /// Says what the start took over: the pinned state of a daemon before this one
    /// (`adopted_links` cgroups' links), or none.
    fn log_adoption(&self, adopted_links: usize) {
        let snap = self.snapshot(Some(0));
        let active: Vec<String> = snap
            .scopes
            .iter()
            .filter(|s| s.counts.active > 0)
            .map(|s| format!("{} {}", s.name, s.counts.active))
            .collect();
        if self.state.adopted {
            log::info!(
                "adopted the pinned state of the daemon before: links of {adopted_links} cgroup(s) moved to this daemon's programs; active connections kept: {}",
                if active.is_empty() {
                    "none".into()
                } else {
                    active.join(", ")
                }
            );
            if snap.lease_expired > 0 {
                log::warn!(
                    "{} connection(s) were let through over a budget since the pinned state was created, while no daemon held the lease",
                    snap.lease_expired
                );
            }
        } else {
            log::info!(
                "no pinned state of this layout: new state pinned in {}",
                state::ROOT
            );
        }
    }

    /// Removes the state of other layouts, once this daemon's programs are attached and
    /// its counts seeded.
    fn remove_other_layouts(&self) {
        for dir in self.state.other_layouts() {
            match state::remove_pins(&dir) {
                Ok(n) => log::info!(
                    "removed the state of another layout, {} ({n} pin(s)): its programs are detached, its counts are not carried over",
                    dir.display()
                ),
                Err(e) => log::warn!("removing the state in {}: {e}", dir.display()),
            }
        }
    }

    /// Counts the connections that existed before this start, with no pinned state to
    /// adopt; logs how many per scope. A failure leaves them uncounted (fail-open), and
    /// the next start seeds again (false).
    fn seed(&self) -> bool {
        let g = lock(&self.generations);
        let (governed, tops) = g.governed();
        let result = seed::seed(&mut lock(&self.ebpf), governed, tops);
        let names: Vec<String> = g
            .policy()
            .map(|p| p.scopes.iter().map(|s| s.name.clone()).collect())
            .unwrap_or_default();
        drop(g);
        match result {
            Ok(s) => {
                let per_scope: Vec<String> = s
                    .by_scope
                    .iter()
                    .map(|(i, n)| format!("{} {n}", names.get(*i).map_or("?", |s| s.as_str())))
                    .collect();
                log::info!(
                    "seeded the connections that existed before the start, from the socket table: {}{}",
                    if per_scope.is_empty() {
                        "none".into()
                    } else {
                        per_scope.join(", ")
                    },
                    if s.missed > 0 {
                        format!(
                            "; {} left uncounted (held by no process, or their fd could not be copied)",
                            s.missed
                        )
                    } else {
                        String::new()
                    }
                );
                true
            }
            Err(e) => {
                log::warn!(
                    "seeding from the socket table failed, connections of before the start are not counted (the next start tries again): {e:#}"
                );
                false
            }
        }
    }

    /// Recounts the active and connecting counts from the live sockets, and corrects a
    /// count that differs for two audits in a row (see `enforce::audit`).
    fn audit(&self) -> anyhow::Result<()> {
        let ids = lock(&self.generations).ids();
        let before = lock(&self.counters).dump(ids.counts());
        let live = self.audit.recount(&before)?;
        let after = lock(&self.counters).dump(ids.counts());
        let made = self.audit.compare(&before, &live, &after);
        let rules = ids.rule_names();
        let scope = |id| ids.scope_name(id).unwrap_or("?").to_string();
        let rule = |id| rules.get(&id).copied().unwrap_or("(no rule)").to_string();
        for Correction {
            key,
            count,
            counted,
            live,
        } in made
        {
            let what = match key {
                Key::Scope(id) => format!("scope {}", scope(id)),
                Key::Rule(id) => format!("rule {}", rule(id)),
                Key::Destination(k) => format!(
                    "scope {} rule {} destination {}",
                    scope(k.scope_id),
                    rule(k.rule_id),
                    guard_common::addr::endpoint(guard_common::addr::unmapped(k.addr), k.port)
                ),
            };
            let counts = match count {
                Count::Active => "active connection(s)",
                Count::Connecting => "connection(s) in the handshake",
            };
            log::warn!(
                "audit: {what} counted {} {counts}, the sockets hold {live}: corrected (a bug: please report it)",
                counted as i64
            );
        }
        Ok(())
    }

    /// Starts the periodic jobs.
    fn spawn_jobs(self: &Arc<Self>, forget_idle: Duration, audit: Duration) {
        let d = self.clone();
        self.jobs.spawn("audit", audit, Arc::new(move || d.audit()));
        let d = self.clone();
        self.jobs.spawn(
            "lease",
            lease::RENEW,
            Arc::new(move || lock(&d.lease).renew()),
        );
        let d = self.clone();
        self.jobs
            .spawn("cgroup_rescan", RESCAN, Arc::new(move || d.rescan()));
        let d = self.clone();
        let events = std::thread::Builder::new()
            .name("cgroup_events".into())
            .spawn(move || {
                let result = d.cgroup_watch.run(|dir| {
                    if let Err(e) = d.cgroup_created(&dir) {
                        log::warn!("new cgroup {}: {e:#}", dir.display());
                    }
                });
                if let Err(e) = result {
                    log::error!(
                        "reading cgroup creations: {e}; new cgroups are governed from the next walk"
                    );
                }
            });
        if let Err(e) = events {
            log::error!("starting the cgroup event thread: {e}");
        }
        let d = self.clone();
        self.jobs.spawn(
            "time_wait_rates",
            SAMPLE_EVERY,
            Arc::new(move || {
                let counts = lock(&d.counters).time_waits();
                lock(&d.tw_rates).sample(Instant::now(), counts);
                Ok(())
            }),
        );
        // PORT_USE is keyed by the namespace cookie the programs see; without
        // SO_NETNS_COOKIE the daemon cannot name it, and watermarks stay unenforced.
        let d = self.clone();
        if self.features.has(Feature::SoNetnsCookie) {
            self.jobs.spawn(
                "port_watch",
                RESCAN,
                Arc::new(move || {
                    let (policy, dirs) = {
                        let g = lock(&d.generations);
                        (g.policy(), g.port_watched_dirs())
                    };
                    let entries = policy
                        .map(|p| port_watch::read(&p, &dirs))
                        .unwrap_or_default();
                    lock(&d.port_watch).sync(entries)
                }),
            );
        }
        let d = self.clone();
        let reader = Mutex::new(listen::Reader::default());
        self.jobs.spawn(
            "listener_watch",
            LISTENER_POLL,
            Arc::new(move || {
                let (policies, per_syn) = lock(&d.listeners).to_read();
                let reading = lock(&reader).read(&policies, per_syn);
                lock(&d.listeners).apply(reading)
            }),
        );
        let d = self.clone();
        self.jobs.spawn(
            "listener_heartbeat",
            LISTENER_HEARTBEAT,
            Arc::new(move || lock(&d.listeners).heartbeat()),
        );
        let d = self.clone();
        self.jobs.spawn(
            "listener_attach",
            LISTENER_RESCAN,
            Arc::new(move || {
                let mut ebpf = lock(&d.ebpf);
                lock(&d.listeners).rescan(&mut ebpf);
                Ok(())
            }),
        );
        let d = self.clone();
        self.jobs.spawn(
            "forget_idle",
            forget_idle,
            Arc::new(move || {
                let exported = lock(&d.exported);
                let n = lock(&d.counters).forget_idle(|key| exported.lists(key));
                if n > 0 {
                    log::info!("forgot {n} idle destination(s)");
                }
                Ok(())
            }),
        );
    }
}

impl Daemon {
    /// Keeps, named, every event the kernel writes to `ring`.
    async fn read_events(
        &self,
        ring: aya::maps::RingBuf<aya::maps::MapData>,
    ) -> anyhow::Result<()> {
        // SAFETY: the ring buffer owns its map's fd, open for as long as it lives.
        let mut ring = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(ring, tokio::io::Interest::READABLE)
        }
        .map_err(|e| anyhow::anyhow!("watching EVENTS: {e}"))?;
        let at_boot = events::unix_ms_at_boot();
        loop {
            let mut ready = ring.readable_mut().await?;
            let ids = lock(&self.generations).ids();
            let mut log = lock(&self.events);
            while let Some(item) = ready.get_inner_mut().next() {
                if item.len() >= std::mem::size_of::<guard_common::Event>() {
                    // SAFETY: the kernel wrote an Event there; read unaligned.
                    let ev = unsafe {
                        std::ptr::read_unaligned(item.as_ptr().cast::<guard_common::Event>())
                    };
                    log.push(&ev, &ids, at_boot);
                }
            }
            ready.clear_ready();
        }
    }
}

impl Handler for Daemon {
    fn handle(&self, request: Request) -> Reply {
        match request {
            Request::Stats { top } => Reply::Stats(Box::new(self.snapshot(top))),
            Request::Reload => Reply::Reload(self.reload()),
            Request::Ports { netns } => {
                let ids = lock(&self.generations).ids();
                let (destinations, eaddrnotavail, time_waits) = {
                    let c = lock(&self.counters);
                    (c.destinations(), c.eaddrnotavail(), c.time_waits())
                };
                let rates = lock(&self.tw_rates).rates(Instant::now(), &time_waits);
                Reply::Ports(daemon_ports(
                    netns,
                    &rates,
                    &destinations,
                    &eaddrnotavail,
                    |id| ids.scope_name(id).unwrap_or("?").to_string(),
                ))
            }
            Request::Stop => {
                self.stop.notify_one();
                Reply::Stop(StopReply { stopping: true })
            }
            Request::Events { since } => {
                let (events, next) = lock(&self.events).after(since);
                Reply::Events(EventsReply { events, next })
            }
            Request::Scope { cgroup_id } => {
                let g = lock(&self.generations);
                let scope = g
                    .scope_of_cgroup(cgroup_id)
                    .and_then(|id| g.ids().scope_name(id).map(str::to_string));
                Reply::Scope(ScopeReply { scope })
            }
        }
    }
}

/// The attached cgroups for a log line: the first few, and how many.
fn attached_list(dirs: &[PathBuf]) -> String {
    const SHOWN: usize = 3;
    if dirs.is_empty() {
        return "no cgroup".into();
    }
    let mut s: Vec<String> = dirs
        .iter()
        .take(SHOWN)
        .map(|d| d.display().to_string())
        .collect();
    if dirs.len() > SHOWN {
        s.push(format!("and {} more", dirs.len() - SHOWN));
    }
    format!("{} cgroup(s): {}", dirs.len(), s.join(", "))
}

/// A file removed when this is dropped.
struct RemovedOnDrop(PathBuf);

impl Drop for RemovedOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

pub fn run(opts: Options) -> anyhow::Result<()> {
    // A panic anywhere ends the process, instead of one task dying while the daemon
    // looks alive: the pinned programs then shed until the lease runs out, and only
    // count after it (fail-open), until the next start adopts them.
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        std::process::abort();
    }));
    // One malloc arena for every thread: requests are served on whichever thread of the
    // blocking pool is free, and a snapshot of 100,000 destinations (about 25 MiB while
    // it is built) left each of their arenas holding memory. Measured with 3 `stats` and
    // 3 scrapes at 100,000 destinations: 59 MiB at the peak and 49 MiB after, against
    // 30 and 8 with one arena.
    // SAFETY: mallopt only sets a glibc parameter; no thread has started yet.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) };
    object::require_root()?;
    // A bad policy stops the start before anything is attached.
    let policy = read_policy(opts.policy.as_deref())?;
    let features = Features::probe(&Feature::for_daemon())?;
    features.require()?;
    log::info!("{}", features.summary());
    batch::use_batch_lookups(features.has(Feature::BatchLookup));
    mounts::ensure_bpffs()?;
    let state = State::open(opts.state_layout)?;
    let root = mounts::cgroup2_mount()?;
    let metrics = match &opts.metrics {
        Some(addr) => Some(
            std::net::TcpListener::bind(addr.as_str())
                .with_context(|| format!("serving metrics on {addr}"))?,
        ),
        None => None,
    };
    // Bound before any thread starts (see server::bind); removed when `run` returns,
    // whether the daemon stops or fails to start.
    let control = control::server::bind(&opts.socket)?;
    let _socket_file = RemovedOnDrop(opts.socket.clone());
    let _stats_fd = if opts.bpf_stats {
        Some(
            aya::sys::enable_stats(aya::sys::Stats::RunTime)
                .context("enabling kernel bpf_stats")?,
        )
    } else {
        None
    };
    let object::Loaded {
        mut ebpf,
        tracepoint,
        per_syn,
    } = object::load(&features, &state, policy::controls(&policy))?;
    if per_syn {
        log::info!("listener guards decide per SYN from the listener's own queues");
    } else {
        log::warn!(
            "listener guards decide from the daemon's reading of the socket tables, every {} ms",
            LISTENER_POLL.as_millis()
        );
    }
    let maps = Maps::take(&mut ebpf)?;
    let ring = aya::maps::RingBuf::try_from(
        ebpf.take_map(guard_common::names::map::EVENTS)
            .context("the object has no EVENTS map")?,
    )?;
    // Held from before the first attach or adoption, so that programs shed from the
    // first connect they see.
    let mut lease = Lease::new(maps.lease, opts.lease);
    lease.renew()?;
    let audit = Audit::new(
        syscall::obj_get(&state.map_path(guard_common::names::map::SOCKS))
            .context("opening the pinned SOCKS map")?,
        object::program(&mut ebpf, guard_common::names::program::ADJUST)?
            .fd()?
            .as_fd()
            .try_clone_to_owned()?,
    );
    let generations = Generations::new(maps.policy, root.clone(), state.links_dir())?;
    let adopted_links = generations.adopted_links();
    let what = policy::describe(&policy);
    let source = policy.source.clone();
    let listeners = policy.listeners.clone();
    let tree = scopes::walk(&root, &policy)?;
    let counters = Counters::new(maps.counters);
    // The first sample, taken before "ready", is the baseline of the first rates.
    let mut tw_rates = TimeWaitRates::default();
    tw_rates.sample(Instant::now(), counters.time_waits());
    let daemon = Arc::new(Daemon {
        ebpf: Mutex::new(ebpf),
        generations: Mutex::new(generations),
        cgroup_watch: CgroupWatch::new(),
        counters: Mutex::new(counters),
        exported: Mutex::default(),
        port_watch: Mutex::new(PortWatch::new(maps.port_use)),
        listeners: Mutex::new(ListenerGuard::new(
            maps.listeners,
            features.has(Feature::Tcx),
            per_syn,
        )),
        tw_rates: Mutex::new(tw_rates),
        events: Mutex::default(),
        controls: policy::controls(&policy),
        status: Mutex::new(PolicyStatus {
            source: source.clone(),
            generation: 1,
            last_error: None,
        }),
        reloading: Mutex::new(()),
        policy_path: opts.policy.clone(),
        jobs: Jobs::default(),
        features,
        lease: Mutex::new(lease),
        audit,
        stop: tokio::sync::Notify::new(),
        state,
        tracepoint,
    });
    daemon.apply(policy, tree)?;
    object::remove_old_tracepoints(&daemon.state, &daemon.tracepoint)?;
    daemon.log_adoption(adopted_links);
    if !lock(&daemon.lease).seeded()? && daemon.seed() {
        lock(&daemon.lease).mark_seeded()?;
    }
    daemon.remove_other_layouts();
    let (governed, attached) = {
        let g = lock(&daemon.generations);
        (g.governed_cgroups(), g.attached_dirs())
    };
    daemon.set_listeners(listeners);

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let served = runtime.block_on(async {
        let handler: Arc<dyn Handler> = daemon.clone();
        tokio::spawn(async move {
            if let Err(e) = control::server::serve(control, handler).await {
                log::error!("control socket: {e:#}; `connguard stats` and `reload` no longer answer");
            }
        });
        if let Some(listener) = metrics {
            log::info!("metrics on http://{}/metrics", listener.local_addr()?);
            let d = daemon.clone();
            let render: control::metrics::Render = Arc::new(move || d.metrics());
            tokio::spawn(async move {
                if let Err(e) = control::metrics::serve(listener, render).await {
                    log::error!("metrics: {e:#}; /metrics no longer answers");
                }
            });
        }
        daemon.spawn_jobs(opts.forget_idle, opts.audit);
        let d = daemon.clone();
        tokio::spawn(async move {
            if let Err(e) = d.read_events(ring).await {
                log::error!("reading EVENTS: {e:#}; `connguard events` shows no new event");
            }
        });
        let mut hup = signal(SignalKind::hangup())?;
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        log::info!(
            "ready: programs attached to {}, policy {source} ({what}) governs {governed} cgroup(s), control socket {}",
            attached_list(&attached),
            opts.socket.display()
        );
        // systemd's Type=notify: a no-op without NOTIFY_SOCKET.
        if let Err(e) = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]) {
            log::warn!("telling systemd the daemon is ready: {e}");
        }
        let detach = loop {
            tokio::select! {
                _ = hup.recv() => {
                    let d = daemon.clone();
                    tokio::task::spawn_blocking(move || d.reload()).await?;
                }
                _ = term.recv() => break opts.detach_on_exit,
                _ = int.recv() => break opts.detach_on_exit,
                _ = daemon.stop.notified() => break true,
            }
        };
        let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
        anyhow::Ok(detach)
    });
    // tcx links detach when the process exits; clsact filters (kernels before 6.6) do
    // not. A reload still under way holds the guard's lock until it is done; one after this
    // attaches nothing.
    if let Err(e) = lock(&daemon.listeners).stop() {
        log::warn!("emptying LISTENERS_SHED: {e:#}");
    }
    // Tasks still running (a client being served) end with the runtime.
    runtime.shutdown_timeout(Duration::from_secs(1));
    if served? {
        // Held to the end: no walk or event attaches (and pins) meanwhile.
        let generations = lock(&daemon.generations);
        let n = daemon.state.remove()?;
        std::mem::forget(generations);
        log::info!("stopping: programs detached, {n} pin(s) removed; exiting");
    } else {
        log::info!(
            "exiting with the programs attached and the state pinned in {}: the next start adopts them, with their counts; they shed nothing once the lease runs out, {} s after its last renewal (`connguard stop` removes them)",
            state::ROOT,
            opts.lease.as_secs()
        );
        // Dropping the daemon would remove its pins, which must outlive it.
        std::mem::forget(daemon);
    }
    Ok(())
}

/// `connguard stop`: asks the daemon at `socket` to detach, unpin and exit, and waits
/// for it; with no daemon there, removes the pins one left.
pub fn stop(socket: &Path) -> anyhow::Result<()> {
    if socket.exists()
        && let Ok(StopReply { stopping: true }) = control::client::ask(socket, Request::Stop)
    {
        let deadline = Instant::now() + Duration::from_secs(30);
        while socket.exists() {
            if Instant::now() > deadline {
                anyhow::bail!(
                    "the daemon at {} did not exit within 30 s",
                    socket.display()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        println!("stopped: the daemon detached its programs, unpinned its state and exited");
        return Ok(());
    }
    match state::remove_left()? {
        0 => println!("no daemon at {} and nothing pinned", socket.display()),
        n => println!(
            "no daemon at {}: removed the {n} pin(s) one left in {} (its programs are detached)",
            socket.display(),
            state::ROOT
        ),
    }
    Ok(())
}
