//! `connguard run`: adopt or create the pinned state, attach, apply the policy, then
//! serve stats and reloads until SIGTERM/SIGINT (exit keeping the state) or `stop`
//! (exit detaching everything). This module wires the layers and owns the daemon's life
//! cycle, in phases (`run`): probe the host, load the object, adopt the pinned state,
//! apply the first policy (`start`), serve, shut down (`serve`).
//!
//! # State and locks
//!
//! What is set at start is read without a lock. Each lock guards one group of state:
//!
//! - `reloads`: a reload's turn, so that reloads (SIGHUP, `connguard reload`) take
//!   turns. Only `reload` takes it, before any other, and holds it to the end.
//! - `programs` (`Programs`): the policy in force with the cgroups it governs
//!   (`Generations`), then the loaded object (`Ebpf`), then the listener guard. The
//!   object is reached only through the generations' guard, and the listener guard
//!   through the object's guard, to attach; `Programs` also holds the listener guard
//!   alone, in methods that take no other lock, for the listener watchers, which so
//!   wait for no cgroup walk or attach and no snapshot (only for the listener
//!   program's own attach).
//! - `scrapes` (`Scrapes`): what /metrics exported, held across a scrape's snapshot (so
//!   that no destination it lists is forgotten meanwhile), before every lock the
//!   snapshot takes. Only `Scrapes`' two methods take it, first.
//! - `status` (the policy's generation and last error), `counts` (the counters, and the
//!   TIME_WAIT rates sampled from them), `port_watch`, `events`, `lease`, `drills`: each
//!   taken with no other lock taken while it is held (`drills` may be taken last, under
//!   the programs' locks, to decide `drill_egress`).
//!
//! A snapshot takes each lock in turn, copies what it needs and lets it go before the
//! next; it is built and sent with none held (but `scrapes`). The walks of the cgroup
//! tree, seconds on hosts with tens of thousands of cgroups, are made holding none of
//! the locks `stats` needs.
mod drills;
mod fleet;
mod govern;
mod health;
mod jobs;
mod policy_watch;
mod programs;
mod report;
mod scrape;
mod serve;
mod start;
mod tasks;
mod workloads;

use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::{Duration, Instant},
};

use self::{jobs::Jobs, programs::Programs, scrape::Scrapes, workloads::Workloads};
use connguard_api::{
    control::{Request, StopReply},
    kernel::Features,
    stats::PolicyStatus,
};

use crate::{
    cli::RuntimeSockets,
    control::{self},
    diagnose::attribution::TimeWaitRates,
    enforce::{
        audit::Audit, counters::Counters, drills::Drills, lease::Lease, port_watch::PortWatch,
    },
    host::cgroup_watch::CgroupWatch,
    kernel::state::{self, State},
    policy::{self, Policy},
    report::events::EventLog,
};

/// How often cgroups created or removed since the last look are picked up, TIME_WAIT
/// births sampled, and port watermarks read.
const RESCAN: Duration = Duration::from_millis(500);
/// How often listener queues are read: shedding starts and stops within this (plus the
/// read).
const LISTENER_POLL: Duration = Duration::from_millis(50);
/// How often the loaded programs are read for another sock_ops program, which needs the
/// state tracepoint (kernel::backstop): a socket whose state callback a program loaded
/// since the last read turned off, and that reaches TCP_CLOSE before this read, has no
/// release path but close() and the audit.
const FOREIGN_POLL: Duration = Duration::from_millis(100);
/// How often the per-SYN listener program is told the daemon lives, while a listener
/// guard is set: it sheds nothing 500 ms (LISTENER_TTL_NS) after the last time.
const LISTENER_HEARTBEAT: Duration = Duration::from_millis(100);
/// How often a job with nothing to watch runs (`jobs::Jobs::spawn_idling`): the
/// listener jobs without a listener guard, the port watch without a watermark, the
/// drills' job without a drill.
const IDLE_POLL: Duration = Duration::from_secs(1);
/// How often guarded namespaces are checked for new interfaces and for a namespace
/// file bound to a new namespace.
const LISTENER_RESCAN: Duration = Duration::from_secs(1);

pub struct Options {
    pub policy: Option<PathBuf>,
    pub metrics: Option<String>,
    pub socket: PathBuf,
    /// The bpffs directory of the pinned state (state::ROOT by default).
    pub state_dir: PathBuf,
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
    /// The destination counter map's size, where this daemon makes it.
    pub max_destinations: u32,
    /// Where the runtimes are, for pod and container selectors.
    pub runtimes: RuntimeSockets,
    /// Reload when the policy file changes (policy_watch).
    pub watch_policy: bool,
}

/// The daemon's state: first what is set at start, then the locks (see the module's
/// doc for what each guards).
struct Daemon {
    /// What the kernel offers, probed at start.
    features: Features,
    /// The controls (guard_common::CONTROL_* bits) the connect programs were loaded with.
    controls: u32,
    policy_path: Option<PathBuf>,
    /// The pinned state.
    state: State,
    audit: Audit,
    /// Creations of cgroups where a new one may be selected.
    cgroup_watch: CgroupWatch,
    /// The runtimes followed for the policy's workload selectors, and the policy file's
    /// policy in force, which they resolve.
    workloads: Workloads,
    jobs: Jobs,
    /// Notified by a `stop` request.
    stop: tokio::sync::Notify,

    reloads: Mutex<()>,
    status: Mutex<PolicyStatus>,
    programs: Programs,
    counts: Mutex<Counts>,
    port_watch: Mutex<PortWatch>,
    /// What the kernel reported through EVENTS, named.
    events: Mutex<EventLog>,
    lease: Mutex<Lease>,
    /// The drills; shared with their HTTP checks' tasks.
    drills: Arc<Mutex<Drills>>,
    scrapes: Scrapes,
    /// The policy's fleet budgets: this host's shares, and the sync with etcd.
    fleet: fleet::FleetPart,
}

/// The counters, and the TIME_WAIT rates sampled from their TIME_WAIT births.
struct Counts {
    counters: Counters,
    time_wait_rates: TimeWaitRates,
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

/// `connguard run`, phase by phase; each phase hands the next what it made.
pub fn run(opts: Options) -> anyhow::Result<()> {
    start::set_up_process();
    let watch = policy_watch(&opts);
    // What is left of `probed.endpoints` lives to the end of `run`: the control
    // socket's file is removed, and bpf_stats turned off, when the daemon stops and when
    // it fails to start.
    let probed = start::probe(&opts)?;
    let (loaded, events) = start::load(&opts, &probed.host)?;
    let (daemon, first) = start::adopt(&opts, probed.host, loaded)?;
    let ready = start::apply(&daemon, first)?;
    let detach = serve::serve(
        &daemon,
        probed.endpoints.listeners,
        events,
        watch,
        ready,
        &opts,
    );
    serve::shut_down(daemon, detach, &opts)
}

/// The watch of the policy file, made before the first read of the policy (see
/// policy_watch); none without a file, with `--no-watch-policy`, or without inotify
/// (said in the log: reloads then come from SIGHUP and `connguard reload` only).
fn policy_watch(opts: &Options) -> Option<policy_watch::PolicyWatch> {
    let path = opts.policy.as_deref().filter(|_| opts.watch_policy)?;
    policy_watch::PolicyWatch::new(path)
        .inspect_err(|e| {
            log::warn!(
                "watching {}: {e}; the policy is reloaded on SIGHUP and `connguard reload` only",
                path.display()
            )
        })
        .ok()
}

/// `connguard stop`: asks the daemon at `socket` to detach, unpin and exit, and waits
/// for it; with no daemon there, removes the pins one left.
pub fn stop(socket: &Path, state_dir: &Path) -> anyhow::Result<()> {
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
    match state::remove_left(state_dir)? {
        0 => println!("no daemon at {} and nothing pinned", socket.display()),
        n => println!(
            "no daemon at {}: removed the {n} pin(s) one left in {} (its programs are detached)",
            socket.display(),
            state_dir.display()
        ),
    }
    Ok(())
}
