//! Command-line interface. Its doc comments and `after_long_help` texts are also the man
//! pages (`manual` writes them): a text's "Heading:" lines start the page's sections.
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

pub mod manual;

pub const DEFAULT_SOCKET: &str = "/run/connguard/connguard.sock";

/// Where `connguard run` reaches the container runtimes, which it follows only for a
/// policy that selects pods or containers.
#[derive(Args, Debug, Clone)]
pub struct RuntimeSockets {
    /// containerd's socket: followed (CRI and containerd's events) when a scope selects
    /// pods (`pod = {...}`).
    #[arg(
        long,
        value_name = "PATH",
        default_value = "/run/containerd/containerd.sock"
    )]
    pub containerd_socket: PathBuf,
    /// The Docker Engine API's socket (Docker's, or Podman's `podman system service`):
    /// followed when a scope selects containers (`container = {...}`).
    #[arg(long, value_name = "PATH", default_value = "/run/docker.sock")]
    pub docker_socket: PathBuf,
}

/// The FILES entry of the control socket, for the commands that ask the daemon.
macro_rules! socket_file {
    () => {
        "  /run/connguard/connguard.sock
      The running daemon's control socket (mode 0600: root only), or the one --socket
      names.
"
    };
}

/// The EXIT STATUS of the commands that only ask the daemon.
macro_rules! asking_exit_status {
    () => {
        "Exit status:
  0 on success; 1 when no daemon answers on the control socket, or it refuses the
  request, with the reason on standard error; 2 on a usage error.
"
    };
}

/// connguard's pinned state, for the commands that keep it or remove it.
macro_rules! bpffs_file {
    () => {
        "  /sys/fs/bpf/connguard
      The daemon's state in bpffs, which outlives it: its lock (one daemon a host), and
      under v<layout>/ the pinned maps (maps/: counters, socket storage, the ids of
      scope and rule names, the lease) and links (links/: every program attachment).
"
    };
}

/// TCP connection budgets per cgroup, enforced in the kernel.
///
/// connguard counts every outbound TCP connection per cgroup v2 scope and per
/// destination with eBPF programs on the cgroup connect hooks, and makes connect() fail
/// at once (ECONNREFUSED by default, no SYN sent) when a budget is spent: a slow
/// dependency cannot fill a connection pool, multiply retries and take its callers
/// down. One daemon, `connguard run`, does this for every workload on the host,
/// whatever its language; it can also guard listeners' accept queues.
///
/// The other commands validate a policy, ask the running daemon for its counters and
/// events, reload or stop it, and diagnose ephemeral-port, TIME_WAIT and accept-queue
/// exhaustion (those work without the daemon). Each command has its own page,
/// connguard-COMMAND(8), and `connguard COMMAND --help` prints the same.
#[derive(Parser)]
#[command(
    version,
    after_long_help = concat!(
        "\
Exit status:
  0 on success, 1 on a failure with the reason on standard error, 2 on a usage error;
  each command's page says what its failures are.

Environment:
  RUST_LOG
      What is logged to standard error, as env_logger reads it (default: info).

Files:
  /etc/connguard/policy.toml
      The policy the packaged systemd unit runs the daemon with (a conffile).
  /lib/systemd/system/connguard.service
      The systemd unit: systemctl enable --now connguard starts the daemon, reload
      reloads the policy, stop stops the daemon and keeps its state.
", socket_file!(), bpffs_file!(), "
Examples:
  connguard run
      Observe the whole host with the embedded default policy (sheds nothing).
  connguard check /etc/connguard/policy.toml
      Validate a policy file before a reload.
  connguard run --policy /etc/connguard/policy.toml
      Enforce the budgets of a policy file.
  connguard stats --json
      The running daemon's counters, as JSON.
  connguard reload
      Re-read the policy file (as SIGHUP does).
  connguard ports --netns /run/netns/NAME
      Ephemeral ports and TIME_WAIT per destination in a network namespace.

See also:
  systemctl(1), bpftool(8), ss(8), cgroups(7)
"
    )
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Run the daemon in the foreground.
    ///
    /// Applies the policy, with the eBPF programs attached to the top-most cgroups it
    /// selects (and host-wide tracepoints only where a socket needs them), and serves the other commands on its
    /// control socket and Prometheus metrics on --metrics. It logs to standard error
    /// (the journal, under systemd), first one line `kernel RELEASE: using ...;
    /// degraded: ...` and then a line containing "ready" once the programs are attached
    /// and the policy applied; under systemd's Type=notify it sends READY=1 at that
    /// moment. It needs root; it refuses to start, naming what is missing, on a kernel
    /// without the features it needs (`connguard kernel` says the same), when another
    /// daemon holds the lock on /sys/fs/bpf/connguard, or when a daemon answers on
    /// --socket. It mounts bpffs on /sys/fs/bpf when none is there.
    ///
    /// State outlives the daemon: its maps and links are pinned in
    /// /sys/fs/bpf/connguard/v<layout>/, and SIGTERM/SIGINT exit leaving the programs
    /// attached, so that the next start (a restart, an upgrade) adopts them with every
    /// count and no moment unguarded. The daemon renews a lease every second; once it
    /// has run out (--lease seconds after the last renewal), the programs shed nothing
    /// and only count (fail-open), until a daemon starts again. `connguard stop`, or
    /// --detach-on-exit, detaches and unpins everything.
    #[command(after_long_help = concat!(
        "\
Exit status:
  0 after SIGTERM, SIGINT or `connguard stop`; 1 when the daemon cannot start or stops
  on an error, with the reason on standard error; 2 on a usage error. A panic aborts
  the process (SIGABRT): the programs stay attached and the next start adopts them.

Signals:
  SIGHUP
      Re-read the policy file, as `connguard reload` does: a bad file is logged and
      the policy in force stays, with its counts.
  SIGTERM, SIGINT
      Exit, leaving the programs attached and the state pinned for the next start
      (with --detach-on-exit: detach and unpin everything first, as `connguard stop`).

Environment:
  RUST_LOG
      What is logged, as env_logger reads it (default: info).
  NOTIFY_SOCKET
      Set by systemd for Type=notify: READY=1 is sent once the daemon is ready, and
      STOPPING=1 when it stops.
  CONNGUARD_WITHOUT
      A comma-separated list of kernel features (named as `connguard kernel` names
      them) that the probes report absent, so that a degraded path can be run on any
      kernel.

Files:
", socket_file!(), bpffs_file!(), "  /etc/connguard/policy.toml
      The policy file of the packaged systemd unit.

Examples:
  connguard run --policy /etc/connguard/policy.toml --metrics off
      Enforce a policy file, with no Prometheus endpoint.
  systemctl enable --now connguard
      Start the packaged unit now and at every boot.

See also:
  connguard(8), connguard-check(8), connguard-reload(8), connguard-stats(8),
  connguard-stop(8), connguard-kernel(8), systemd.service(5), bpftool(8)
"))]
    Run {
        /// Policy file (TOML: [[scope]] tables with name, cgroup, mode, errno,
        /// max_connections and [[scope.rule]]s; `connguard check` validates one);
        /// default: the embedded policy that observes the whole host and sheds nothing.
        /// The daemon reloads it by itself when its bytes change (see
        /// --no-watch-policy).
        #[arg(long, value_name = "FILE")]
        policy: Option<PathBuf>,
        /// Do not watch the policy file: reload it only on SIGHUP and `connguard
        /// reload`. By default the daemon watches the file's directory (inotify) and
        /// reloads, as `connguard reload` does, once per burst of changes that leaves
        /// the file's bytes different: a write in place, a rename over it, or the
        /// symlink swap of a Kubernetes ConfigMap volume.
        #[arg(long)]
        no_watch_policy: bool,
        /// Address for Prometheus metrics at /metrics and the probes /healthz and
        /// /readyz, or "off".
        #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9877")]
        metrics: String,
        /// Control socket, which the other commands ask.
        #[arg(long, value_name = "PATH", default_value = DEFAULT_SOCKET)]
        socket: PathBuf,
        /// Directory in bpffs of the pinned state, locked for the daemon's life. Two
        /// daemons on one host, each with its own directory, control socket, metrics
        /// address and policy, govern disjoint cgroup trees side by side (a fleet's
        /// hosts on one machine, or separate instances).
        #[arg(long, value_name = "DIR", default_value = crate::kernel::state::ROOT)]
        state_dir: PathBuf,
        /// Enable the kernel's bpf_stats (run_time_ns / run_cnt per program) while the
        /// daemon runs, so `stats` shows each program's average cost. Costs a few ns per
        /// program run, for every eBPF program on the host.
        #[arg(long)]
        bpf_stats: bool,
        /// Forget a destination's counters once it has had no connection for this many
        /// seconds (up to twice as long); its scope and rule keep their totals.
        #[arg(long, value_name = "SECS", default_value_t = 300)]
        forget_idle: u64,
        /// Seconds the programs keep shedding after the daemon's last lease renewal
        /// (renewed every second): how long a restart may take with no budget lifted.
        #[arg(long, value_name = "SECS", default_value_t = 5, value_parser = clap::value_parser!(u64).range(2..))]
        lease: u64,
        /// How many destinations the kernel's destination counter map (COUNTERS) holds:
        /// each tracked one takes kernel memory, and time at every audit and `stats`
        /// (docs/commands.md). When it is full, a connection to a destination not tracked
        /// is admitted without a counter of its own (`internal_errors`); its scope and
        /// rule budgets still hold. It applies when the map is made: a restart on pinned
        /// state keeps the size pinned (`connguard stop` removes the state).
        #[arg(long, value_name = "N", default_value_t = guard_common::DEFAULT_DESTINATIONS, value_parser = clap::value_parser!(u32).range(1024..=1_048_576))]
        max_destinations: u32,
        /// Seconds between audits of the counters against the live sockets.
        #[arg(long, value_name = "SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
        audit: u64,
        /// On SIGTERM/SIGINT, detach the programs and unpin the state, as `connguard
        /// stop` does.
        #[arg(long)]
        detach_on_exit: bool,
        /// Layout version of the pinned state, for tests of an upgrade that changes it.
        #[arg(long, hide = true, default_value_t = guard_common::STATE_LAYOUT)]
        state_layout: u32,
        #[command(flatten)]
        runtimes: RuntimeSockets,
    },
    /// Validate a policy file.
    ///
    /// Reads FILE as `connguard run` and `connguard reload` read a policy, and prints
    /// `FILE: ok` with how many scopes, rules and listener guards it has. Needs neither
    /// root nor a running daemon: run it before a reload.
    #[command(after_long_help = "\
Exit status:
  0 when the file is a valid policy; 1 when it is not, with the first error on standard
  error as FILE:LINE:COLUMN: REASON; 2 on a usage error.

Examples:
  connguard check /etc/connguard/policy.toml && systemctl reload connguard
      Reload the daemon only with a valid policy.

See also:
  connguard-run(8), connguard-reload(8)
")]
    Check {
        /// The policy file (TOML).
        #[arg(value_name = "FILE")]
        file: PathBuf,
    },
    /// Show the running daemon's counters per scope, rule and destination.
    ///
    /// Prints the policy in force (its file and generation, and the error of a rejected
    /// reload), then each scope with its mode, limits and counts (active, peak, admitted,
    /// shed, would_shed, rate_limited, handshake_limited), its rules and its busiest
    /// destinations with their breakers; then the internal counters, the programs' costs
    /// (with --bpf-stats), the daemon's periodic jobs and the kernel's features.
    #[command(after_long_help = concat!(asking_exit_status!(), "
Files:
", socket_file!(), "
See also:
  connguard(8), connguard-top(8), connguard-events(8), connguard-run(8)
"))]
    Stats {
        /// Print JSON instead of a table (its fields are in docs/operations.md, under
        /// /usr/share/doc/connguard).
        #[arg(long)]
        json: bool,
        /// The daemon's control socket.
        #[arg(long, value_name = "PATH", default_value = DEFAULT_SOCKET)]
        socket: PathBuf,
    },
    /// Show the local ports held per destination: TIME_WAIT and port exhaustion.
    ///
    /// Counts the local ports held per destination against the ephemeral range, with a
    /// diagnosis; works without the daemon. Reads the kernel's socket table (sock_diag)
    /// of one network namespace: the caller's, or the one given. `in_use` counts active
    /// connections and TIME_WAIT entries toward each destination from each source
    /// address; connect() fails with EADDRNOTAVAIL once it reaches the range. With a
    /// daemon answering on --socket it adds the TIME_WAIT creation rate per destination,
    /// the seconds left at that rate, the scopes holding the ports and the EADDRNOTAVAIL
    /// counts per scope and process; an answer it cannot use is left out, with a warning
    /// on standard error.
    #[command(after_long_help = concat!("\
Exit status:
  0 on success; 1 when the namespace cannot be entered or its socket table read, with
  the reason on standard error; 2 on a usage error.

Files:
  /proc/sys/net/ipv4/ip_local_port_range, ip_local_reserved_ports, tcp_tw_reuse
      The namespace's ephemeral range and its reuse of TIME_WAIT ports.
  /run/netns/NAME
      A named network namespace (ip netns), for --netns.
", socket_file!(), "
See also:
  connguard-top(8), connguard-listeners(8), ss(8), ip-netns(8)
"))]
    Ports {
        /// Print JSON instead of a table (its fields are in docs/diagnosing.md, under
        /// /usr/share/doc/connguard).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        netns: NetnsArgs,
    },
    /// Show listeners' accept queues against their backlog.
    ///
    /// Lists each listener of one network namespace with its accept queue against the
    /// effective backlog, SYN_RECV entries, owning process, cgroup and scope, and the
    /// namespace's overflow counters, read from the kernel's socket table (sock_diag). A
    /// listener whose queue holds more than its backlog, min(listen() backlog,
    /// net.core.somaxconn), is full and its new SYNs are dropped; each such listener gets
    /// a warning with remedies. The counters (ListenOverflows, ListenDrops, ...) are the
    /// namespace's, as `nstat -az` shows them. Works without the daemon; with one, each
    /// listener's scope is named.
    #[command(after_long_help = concat!("\
Exit status:
  0 on success; 1 when the namespace cannot be entered or its socket table read, with
  the reason on standard error; 2 on a usage error.

Files:
", socket_file!(), "
See also:
  connguard-top(8), connguard-ports(8), ss(8), nstat(8), listen(2)
"))]
    Listeners {
        /// Print JSON instead of a table (its fields are in docs/diagnosing.md, under
        /// /usr/share/doc/connguard).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        netns: NetnsArgs,
    },
    /// A live view of ports, listeners and the daemon's scopes; q quits.
    ///
    /// Refreshed every second on one screen of the terminal: the ports held per
    /// destination and the listeners' accept queues with bars (what `connguard ports`
    /// and `connguard listeners` show), the busiest scopes and open breakers of a daemon
    /// answering on --socket, and the diagnosis. Quit with q or Ctrl-C.
    #[command(after_long_help = concat!("\
Exit status:
  0 when quit; 1 when the namespace cannot be entered or the terminal cannot be
  used, with the reason on standard error; 2 on a usage error.

Files:
", socket_file!(), "
See also:
  connguard-ports(8), connguard-listeners(8), connguard-stats(8)
"))]
    Top {
        #[command(flatten)]
        netns: NetnsArgs,
    },
    /// Probe the kernel's features as the daemon does at start.
    ///
    /// Says which features the daemon uses, which are missing and what that degrades,
    /// and whether the daemon can run here. Loads and runs small eBPF probes (it needs
    /// root) and prints one line: `kernel
    /// RELEASE: using FEATURE, ...; degraded: no FEATURE: WHAT IT DEGRADES; ...`, the
    /// line the daemon logs at start.
    #[command(after_long_help = "\
Exit status:
  0 when the daemon can run on this kernel; 1 when it cannot (what is missing, on
  standard error) or when not run as root; 2 on a usage error.

Environment:
  CONNGUARD_WITHOUT
      A comma-separated list of features that the probes report absent.

See also:
  connguard-run(8), bpftool-feature(8)
")]
    Kernel {
        /// Print JSON: {"release": "...", "features": {"NAME": true|false, ...}, "required": ["NAME", ...]}.
        #[arg(long)]
        json: bool,
    },
    /// Stream the daemon's events: breakers, and keys starting or stopping to shed.
    ///
    /// A live stream of what changed and why, as the kernel reported it: a breaker
    /// opening (with the outcomes that tripped it), its half-open steps, closing; a key
    /// (destination, rule, scope) starting to shed and stopping. One line (or JSON
    /// object) an event, the daemon's newest 4,096 first; until interrupted.
    #[command(after_long_help = concat!(asking_exit_status!(), "  With no --once it runs until interrupted (SIGINT).

Files:
", socket_file!(), "
See also:
  connguard-stats(8), connguard-top(8)
"))]
    Events {
        /// Print one JSON object a line (its fields are in docs/operations.md, under
        /// /usr/share/doc/connguard).
        #[arg(long)]
        json: bool,
        /// Print the events the daemon holds and exit.
        #[arg(long)]
        once: bool,
        /// The daemon's control socket.
        #[arg(long, value_name = "PATH", default_value = DEFAULT_SOCKET)]
        socket: PathBuf,
    },
    /// Show the fleet budgets as etcd holds them: every host's share and demand.
    ///
    /// The daemon lists the records under its policy's fleet prefix in etcd (with the
    /// policy's endpoints and credentials) and prints, per budget, each host's share
    /// (`has`), active connections, demand (`wants`), weight and floor, as those hosts
    /// last wrote them, with the etcd revision of the listing.
    #[command(after_long_help = concat!(asking_exit_status!(), "  A daemon whose policy has no fleet budgets, or that cannot reach etcd, refuses the request.

Files:
", socket_file!(), "
See also:
  connguard-stats(8), connguard-run(8)
"))]
    Fleet {
        /// Print JSON: {"revision": N, "budgets": [{"name": "...", "hosts": [RECORD, ...]}]}.
        #[arg(long)]
        json: bool,
        /// The daemon's control socket.
        #[arg(long, value_name = "PATH", default_value = DEFAULT_SOCKET)]
        socket: PathBuf,
    },
    /// Run chaos drills: connect faults injected on purpose, bounded by the kernel.
    ///
    /// A drill faults the connects of one scope, or of some of its pods, containers or
    /// units (optionally to some destinations and ports): refuse (connect() fails at
    /// once with an errno, no SYN sent), blackhole (the SYN never leaves; the client
    /// waits its own timeout), delay (the first SYN never leaves; the retransmit
    /// connects about 1 s later) or reset (the connect meets a RST, as from an
    /// overloaded listener), each attempt with a probability. The programs cap its
    /// faults (max_faults in all, max_fraction of the target's attempts a window),
    /// fault nothing past its deadline or once the daemon's lease lapses, and count the
    /// faults apart from sheds. The daemon aborts it when a watched scope sheds or opens
    /// a breaker, when the target's success ratio falls below a threshold, or when an
    /// HTTP check fails. The file format is in
    /// docs/drills.md, under /usr/share/doc/connguard.
    #[command(after_long_help = concat!(asking_exit_status!(), "  A bad drill file is named with its line, column and reason.

Files:
", socket_file!(), "
See also:
  connguard-stats(8), connguard-events(8)
"))]
    Drill {
        #[command(subcommand)]
        action: DrillAction,
    },
    /// Ask the running daemon to re-read its policy file.
    ///
    /// The daemon reads the whole file first: a bad file is rejected and the policy in
    /// force stays, with its counts. A good one replaces it at once (programs see the
    /// old policy or the new one, never a mix), and counts are kept by scope and rule
    /// name. Prints the new policy generation. `systemctl reload connguard` runs it;
    /// SIGHUP to the daemon does the same.
    #[command(after_long_help = concat!("\
Exit status:
  0 when the policy was reloaded; 1 when it was rejected (the reason on standard error;
  the previous policy stays in force) or no daemon answers; 2 on a usage error.

Files:
", socket_file!(), "
See also:
  connguard-check(8), connguard-run(8), connguard-stats(8)
"))]
    Reload {
        /// The daemon's control socket.
        #[arg(long, value_name = "PATH", default_value = DEFAULT_SOCKET)]
        socket: PathBuf,
    },
    /// Stop for good: detach the programs and unpin the state.
    ///
    /// The running daemon detaches its programs, unpins its state and exits; with no
    /// daemon running, the programs and state one left are removed. Counts start from
    /// the kernel's socket table at the next start. Unlike SIGTERM (`systemctl stop`),
    /// which leaves the programs attached and the state pinned for the next start,
    /// nothing of connguard stays in the kernel.
    /// Removing the Debian package runs it.
    #[command(after_long_help = concat!("\
Exit status:
  0 when the daemon stopped, or with no daemon, when what one left was removed (or
  nothing was there); 1 when the daemon did not exit within 30 s or the pins could not
  be removed (another daemon holds the lock), with the reason on standard error; 2 on
  a usage error.

Files:
", socket_file!(), bpffs_file!(), "
See also:
  connguard-run(8), systemctl(1)
"))]
    Stop {
        /// The daemon's control socket.
        #[arg(long, value_name = "PATH", default_value = DEFAULT_SOCKET)]
        socket: PathBuf,
        /// The daemon's state directory in bpffs (as given to `connguard run`).
        #[arg(long, value_name = "DIR", default_value = crate::kernel::state::ROOT)]
        state_dir: PathBuf,
    },
    /// Print the shell completion script for SHELL.
    ///
    /// The script completes connguard's commands and options. The Debian package
    /// installs it for bash, zsh and fish where those shells find it; elsewhere, write
    /// it where your shell loads completions (see the examples).
    #[command(after_long_help = "\
Exit status:
  0 on success; 2 on a usage error (an unknown SHELL).

Files:
  /usr/share/bash-completion/completions/connguard
      The script for bash, installed by the package.
  /usr/share/zsh/vendor-completions/_connguard
      The script for zsh, installed by the package.
  /usr/share/fish/vendor_completions.d/connguard.fish
      The script for fish, installed by the package.

Examples:
  connguard completions bash > ~/.local/share/bash-completion/completions/connguard
      Complete connguard in bash for this user (bash-completion loads it at first use).
  connguard completions zsh > ~/.zfunc/_connguard
      The same for zsh, with fpath=(~/.zfunc $fpath) before compinit in ~/.zshrc.
  connguard completions fish > ~/.config/fish/completions/connguard.fish
      The same for fish.

See also:
  bash(1), zshcompsys(1), fish(1)
")]
    Completions {
        /// The shell to print the script for.
        #[arg(value_name = "SHELL")]
        shell: clap_complete::Shell,
    },
    /// Write the man pages, connguard.8 and connguard-COMMAND.8, into DIR.
    #[command(hide = true)]
    Man {
        /// The directory to write them into (created if missing).
        #[arg(long, value_name = "DIR")]
        dir: PathBuf,
    },
}

/// Which network namespace to look at, and the daemon to ask.
#[derive(Args)]
pub struct NetnsArgs {
    /// A network namespace file, e.g. /run/netns/NAME (default: this process's).
    #[arg(long, value_name = "PATH", conflicts_with = "pid")]
    pub netns: Option<PathBuf>,
    /// The network namespace of this process.
    #[arg(long, value_name = "PID")]
    pub pid: Option<u32>,
    /// Control socket of a running daemon, which adds TIME_WAIT rates, the scopes
    /// holding the ports, EADDRNOTAVAIL counts and scope counters (skipped when none
    /// answers).
    #[arg(long, value_name = "PATH", default_value = DEFAULT_SOCKET)]
    pub socket: PathBuf,
}

/// `connguard drill` actions.
#[derive(Subcommand)]
pub enum DrillAction {
    /// Start a drill from a file, from flags, or from a file with flags over its keys.
    Start(Box<DrillStart>),
    /// End a running drill.
    Stop {
        name: String,
        #[arg(long, value_name = "PATH", default_value = DEFAULT_SOCKET)]
        socket: PathBuf,
    },
    /// List the running drills and the last ended ones, with their counts.
    List {
        /// Print JSON: {"drills": [DRILL, ...]} (docs/drills.md).
        #[arg(long)]
        json: bool,
        #[arg(long, value_name = "PATH", default_value = DEFAULT_SOCKET)]
        socket: PathBuf,
    },
}

/// `connguard drill start`'s arguments.
#[derive(Args)]
pub struct DrillStart {
    /// A drill file (TOML; docs/drills.md).
    pub file: Option<PathBuf>,
    #[arg(long)]
    pub name: Option<String>,
    /// The scope whose connects are faulted (with a workload flag: the scope of the
    /// workloads to fault, when they are in several).
    #[arg(long)]
    pub scope: Option<String>,
    /// Fault the systemd units so named (a glob) alone, within their scope.
    #[arg(long, value_name = "UNIT")]
    pub unit: Option<String>,
    /// Fault the pods of this namespace (a glob) alone; with --pod-label, those
    /// labelled so.
    #[arg(long, value_name = "NAMESPACE")]
    pub pod_namespace: Option<String>,
    /// Fault the pods with this label alone (repeat for more; all must match).
    #[arg(long, value_name = "KEY=VALUE")]
    pub pod_label: Vec<String>,
    /// Fault the containers so named (a glob) alone; with --container-label, those
    /// labelled so.
    #[arg(long, value_name = "NAME")]
    pub container: Option<String>,
    /// Fault the containers with this label alone (repeat for more; all must match).
    #[arg(long, value_name = "KEY=VALUE")]
    pub container_label: Vec<String>,
    /// refuse, blackhole, delay or reset.
    #[arg(long)]
    pub fault: Option<String>,
    /// The chance an attempt of the target is faulted, in [0, 1].
    #[arg(long)]
    pub probability: Option<f64>,
    /// How long it runs, like 30s or 5min.
    #[arg(long)]
    pub duration: Option<String>,
    /// At most this many faults.
    #[arg(long)]
    pub max_faults: Option<i64>,
    /// At most this fraction of the target's attempts faulted per window.
    #[arg(long)]
    pub max_fraction: Option<f64>,
    /// The window of --max-fraction, like 10s.
    #[arg(long)]
    pub window: Option<String>,
    /// Destination address or CIDR (repeat for more).
    #[arg(long)]
    pub dst: Vec<String>,
    /// Destination port or range (repeat for more).
    #[arg(long)]
    pub ports: Vec<String>,
    /// Refuse: the errno connect() fails with.
    #[arg(long)]
    pub errno: Option<String>,
    /// Abort when the target's success ratio falls below this.
    #[arg(long)]
    pub abort_min_success_ratio: Option<f64>,
    /// Abort when a GET of this http:// URL fails.
    #[arg(long)]
    pub abort_http: Option<String>,
    /// The daemon's control socket.
    #[arg(long, value_name = "PATH", default_value = DEFAULT_SOCKET)]
    pub socket: PathBuf,
}
