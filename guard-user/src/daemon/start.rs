//! The daemon's start, in the phases `run` calls in turn: `probe` the host and bind the
//! daemon's sockets, `load` the object, `adopt` the pinned state into a `Daemon`, and
//! `apply` the first policy. A phase that fails stops the start; nothing before `load`
//! touches the kernel's programs, and a bad policy stops it before anything is
//! attached.
use std::{
    os::fd::{AsFd, OwnedFd},
    os::unix::net::UnixListener,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Instant,
};

use anyhow::Context;
use aya::{
    Ebpf,
    maps::{MapData, RingBuf},
};
use guard_common::PortUseKey;

use super::{
    Counts, Daemon, LISTENER_POLL, Options, fleet::FleetPart, jobs::Jobs, lock, programs::Programs,
    read_policy, scrape::Scrapes, workloads::Workloads,
};
use connguard_api::{kernel::Features, stats::PolicyStatus};

use crate::{
    control,
    diagnose::attribution::TimeWaitRates,
    enforce::{
        audit::Audit,
        counters::Counters,
        drills::Drills,
        generations::Generations,
        lease::Lease,
        port_watch::PortWatch,
        scopes::{self, Tree},
        seed,
    },
    host::{cgroup_watch::CgroupWatch, mounts},
    kernel::{
        backstop::{self, Backstop, Tracepoints},
        batch,
        features::{Feature, KernelFeatures},
        maps::{CounterMaps, DrillMaps, Hashed, ListenerMaps, Maps, PolicyMaps},
        object,
        state::{self, State},
        syscall,
    },
    listen::ListenerGuard,
    policy::{self, Policy},
};

/// Sets what the whole process runs with, before any thread starts. A panic anywhere
/// ends the process, instead of one task dying while the daemon looks alive: the pinned
/// programs then shed until the lease runs out, and only count after it (fail-open),
/// until the next start adopts them. One malloc arena serves every thread: requests are
/// served on whichever thread of the blocking pool is free, and each thread's arena
/// would keep the memory of the snapshots built on it.
pub fn set_up_process() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        std::process::abort();
    }));
    // SAFETY: mallopt only sets a glibc parameter; no thread has started yet.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) };
}

/// What `probe` found: a host fit to run the daemon, and its sockets bound.
pub struct Probed {
    pub host: Host,
    pub endpoints: Endpoints,
}

/// The host as the daemon found it, and the first policy.
pub struct Host {
    pub policy: Policy,
    pub features: Features,
    /// The pinned state of this layout, adopted or new.
    pub state: State,
    /// The cgroup2 mount.
    pub root: PathBuf,
}

/// What the daemon holds open while it runs: the sockets it serves on, the control
/// socket's file (removed when this drops) and, with `--bpf-stats`, the kernel's
/// bpf_stats (on while this lives).
pub struct Endpoints {
    pub listeners: Listeners,
    _socket_file: RemovedOnDrop,
    _bpf_stats: Option<OwnedFd>,
}

/// The sockets the daemon serves on.
pub struct Listeners {
    /// The control socket (`stats`, `reload`, `stop` ...).
    pub control: UnixListener,
    /// /metrics, unless turned off.
    pub metrics: Option<std::net::TcpListener>,
}

/// A file removed when this is dropped.
struct RemovedOnDrop(PathBuf);

impl Drop for RemovedOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Checks the daemon can run here (root, the kernel's features, bpffs, cgroup2),
/// reads the first policy, opens the pinned state's directory, and binds the metrics
/// address and the control socket (before any thread starts: see server::bind).
pub fn probe(opts: &Options) -> anyhow::Result<Probed> {
    object::require_root()?;
    // A bad policy stops the start before anything is attached.
    let policy = read_policy(opts.policy.as_deref())?;
    let features = Features::probe(&Feature::for_daemon())?;
    features.require()?;
    log::info!("{}", features.summary());
    batch::use_batch_lookups(features.has(Feature::BatchLookup));
    mounts::ensure_bpffs()?;
    let state = State::open(&opts.state_dir, opts.state_layout)?;
    let root = mounts::cgroup2_mount()?;
    let metrics = match &opts.metrics {
        Some(addr) => Some(
            std::net::TcpListener::bind(addr.as_str())
                .with_context(|| format!("serving metrics on {addr}"))?,
        ),
        None => None,
    };
    let control = control::server::bind(&opts.socket)?;
    let socket_file = RemovedOnDrop(opts.socket.clone());
    let bpf_stats = if opts.bpf_stats {
        Some(
            aya::sys::enable_stats(aya::sys::Stats::RunTime)
                .context("enabling kernel bpf_stats")?,
        )
    } else {
        None
    };
    Ok(Probed {
        host: Host {
            policy,
            features,
            state,
            root,
        },
        endpoints: Endpoints {
            listeners: Listeners { control, metrics },
            _socket_file: socket_file,
            _bpf_stats: bpf_stats,
        },
    })
}

/// What `load` made: the object with its programs loaded, and the maps taken out of
/// it.
pub struct Loaded {
    ebpf: Ebpf,
    /// The host-wide programs, attached where wanted once the daemon starts.
    backstop: Backstop,
    /// The listener program decides per SYN (else from the daemon's readings).
    per_syn: bool,
    policy_maps: PolicyMaps,
    counter_maps: CounterMaps,
    port_use: Hashed<PortUseKey, u32>,
    listener_maps: ListenerMaps,
    /// Renewed: the programs shed from the first connect they see.
    lease: Lease,
    audit: Audit,
    drill_maps: DrillMaps,
}

/// Loads the object with the code of the controls the first policy uses, with the
/// pinned maps of the state (adopted, or created and pinned); takes its maps and
/// renews the lease. Hands the ring buffer the kernel writes its events to apart, for
/// `serve`.
pub fn load(opts: &Options, host: &Host) -> anyhow::Result<(Loaded, RingBuf<MapData>)> {
    let Host {
        policy,
        features,
        state,
        ..
    } = host;
    let object::Loaded {
        mut ebpf,
        sock_ops_comm,
        per_syn,
    } = object::load(
        features,
        state,
        policy::controls(policy),
        opts.max_destinations,
    )?;
    let state_cb = backstop::probe_state_cb(&mut ebpf, &host.root);
    let backstop = Backstop::new(
        Tracepoints::new(state.links_dir()),
        state.root(),
        state_cb,
        sock_ops_comm,
    );
    if per_syn {
        log::info!("listener guards decide per SYN from the listener's own queues");
    } else {
        log::warn!(
            "listener guards decide from the daemon's reading of the socket tables, every {} ms",
            LISTENER_POLL.as_millis()
        );
    }
    let Maps {
        policy: policy_maps,
        counters: counter_maps,
        port_use,
        listeners: listener_maps,
        lease: lease_map,
        drills: drill_maps,
    } = Maps::take(&mut ebpf)?;
    let ring = RingBuf::try_from(
        ebpf.take_map(guard_common::names::map::EVENTS)
            .context("the object has no EVENTS map")?,
    )?;
    // Held from before the first attach or adoption, so that programs shed from the
    // first connect they see.
    let mut lease = Lease::new(lease_map, opts.lease);
    lease.renew()?;
    let audit = Audit::new(
        syscall::obj_get(&state.map_path(guard_common::names::map::SOCKS))
            .context("opening the pinned SOCKS map")?,
        object::program(&mut ebpf, guard_common::names::program::ADJUST)?
            .fd()?
            .as_fd()
            .try_clone_to_owned()?,
    );
    let loaded = Loaded {
        ebpf,
        backstop,
        per_syn,
        policy_maps,
        counter_maps,
        port_use,
        listener_maps,
        lease,
        audit,
        drill_maps,
    };
    Ok((loaded, ring))
}

/// The first policy, with the walk of the cgroups for it, for `apply`.
pub struct First {
    policy: Policy,
    tree: Tree,
    /// Cgroups whose pinned links the start moved to this daemon's programs.
    adopted_links: usize,
}

/// Adopts the pinned links of a daemon before this one (if any), follows the runtimes
/// the first policy's workload selectors need, walks the cgroups for the first policy
/// resolved against them, and takes the baseline of the TIME_WAIT rates: the daemon's
/// state, with nothing of the first policy applied yet.
pub fn adopt(opts: &Options, host: Host, loaded: Loaded) -> anyhow::Result<(Arc<Daemon>, First)> {
    let Host {
        policy: base,
        features,
        state,
        root,
    } = host;
    let generations = Generations::new(loaded.policy_maps, root.clone(), state.links_dir())?;
    let adopted_links = generations.adopted_links();
    let controls = policy::controls(&base);
    let workloads = Workloads::start(opts.runtimes.clone(), &root, base)?;
    let policy = workloads.resolve(&workloads.base());
    let tree = scopes::walk(&root, &policy)?;
    let fleet = FleetPart::default();
    fleet.settle(&policy, &opts.socket)?;
    let counters = Counters::new(loaded.counter_maps);
    // The first sample, taken before "ready", is the baseline of the first rates.
    let mut time_wait_rates = TimeWaitRates::default();
    time_wait_rates.sample(Instant::now(), counters.time_waits());
    let listeners = ListenerGuard::new(
        loaded.listener_maps,
        features.has(Feature::Tcx),
        loaded.per_syn,
    )?;
    let mut drills = Drills::new(loaded.drill_maps, opts.lease);
    drills
        .renew_lease()
        .context("holding the drills' lease (DRILL_LEASE)")?;
    let daemon = Arc::new(Daemon {
        controls,
        policy_path: opts.policy.clone(),
        features,
        state,
        audit: loaded.audit,
        cgroup_watch: CgroupWatch::new(),
        workloads,
        jobs: Jobs::default(),
        stop: tokio::sync::Notify::new(),
        reloads: Mutex::new(()),
        status: Mutex::new(PolicyStatus {
            source: policy.source.clone(),
            generation: 1,
            last_error: None,
        }),
        programs: Programs::new(generations, loaded.ebpf, listeners, loaded.backstop),
        counts: Mutex::new(Counts {
            counters,
            time_wait_rates,
        }),
        port_watch: Mutex::new(PortWatch::new(loaded.port_use)),
        events: Mutex::default(),
        lease: Mutex::new(loaded.lease),
        drills: Arc::new(Mutex::new(drills)),
        scrapes: Scrapes::default(),
        fleet,
    });
    Ok((
        daemon,
        First {
            policy,
            tree,
            adopted_links,
        },
    ))
}

/// What the daemon is ready with, for its "ready" line.
pub struct Ready {
    /// The first policy's source and what it holds.
    pub source: String,
    pub what: String,
    /// How many cgroups it governs, and those the programs are attached to.
    pub governed: usize,
    pub attached: Vec<PathBuf>,
    /// The runtimes followed, for the "ready" line ("" for none).
    pub runtimes: String,
}

/// Applies the first policy: its entries and attachments; then the old tracepoints'
/// links and the state of other layouts are removed, the connections that existed
/// before the start counted (with no pinned state to adopt them from), and the
/// listener guards attached.
pub fn apply(daemon: &Daemon, first: First) -> anyhow::Result<Ready> {
    let First {
        policy,
        tree,
        adopted_links,
    } = first;
    let source = policy.source.clone();
    let what = policy::describe(&policy);
    let listeners = policy.listeners.clone();
    daemon
        .programs
        .start_backstop(listeners.iter().any(|l| l.per_source.is_some()))?;
    daemon.apply(policy, tree)?;
    daemon.programs.remove_old_tracepoints()?;
    daemon.log_adoption(adopted_links);
    if !lock(&daemon.lease).seeded()? && daemon.seed() {
        lock(&daemon.lease).mark_seeded()?;
    }
    daemon.remove_other_layouts();
    let (governed, attached) = {
        let g = daemon.programs.generations();
        (g.governed_cgroups(), g.attached_dirs())
    };
    daemon.programs.set_listener_policies(listeners);
    Ok(Ready {
        source,
        what,
        governed,
        attached,
        runtimes: daemon.workloads.describe(),
    })
}

impl Daemon {
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
                self.state.root().display()
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
        let mut g = self.programs.generations();
        let (generations, mut ebpf) = g.ebpf();
        let (governed, tops) = generations.governed();
        let result = seed::seed(&mut ebpf, governed, tops);
        drop(ebpf);
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
}
