//! Command-line interface.
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

pub const DEFAULT_SOCKET: &str = "/run/connguard/connguard.sock";

/// connguard guards TCP connections in the kernel: it counts every outbound connection
/// per cgroup v2 scope and per destination, and makes connect() fail at once
/// (ECONNREFUSED by default, no SYN sent) when a budget is spent.
#[derive(Parser)]
#[command(
    version,
    after_help = "\
Examples:
  connguard run                               observe the whole host (embedded default policy)
  connguard run --policy /etc/connguard.toml  enforce budgets from a policy file
  connguard check /etc/connguard.toml         validate a policy file before a reload
  connguard stats                             show counters of the running daemon
  connguard stats --json                      the same as JSON (shape in the README)
  connguard reload                            re-read the policy file (same as SIGHUP)"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Run the daemon in the foreground.
    ///
    /// Attaches the eBPF programs to the cgroup v2 root, applies the policy and serves
    /// stats. Logs a line containing "ready" once the programs are attached and the
    /// policy applied. SIGHUP re-reads the policy.
    ///
    /// State outlives the daemon: its maps and links are pinned in
    /// /sys/fs/bpf/connguard/v<layout>/, and SIGTERM/SIGINT exit leaving the programs
    /// attached, so that the next start (a restart, an upgrade) adopts them with every
    /// count and no moment unguarded. The daemon renews a lease every second; once it
    /// has run out (`--lease` seconds after the last renewal), the programs shed
    /// nothing and only count (fail-open), until a daemon starts again. `connguard
    /// stop`, or `--detach-on-exit`, detaches and unpins everything.
    Run {
        /// Policy file (TOML: [[scope]] tables with name, cgroup, mode, errno,
        /// max_connections and [[scope.rule]]s; see `connguard check` and the README);
        /// default: the embedded policy that observes the whole host and sheds nothing.
        #[arg(long, value_name = "FILE")]
        policy: Option<PathBuf>,
        /// Address for Prometheus metrics at /metrics, or "off".
        #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9877")]
        metrics: String,
        /// Control socket used by `stats` and `reload`.
        #[arg(long, value_name = "PATH", default_value = DEFAULT_SOCKET)]
        socket: PathBuf,
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
    },
    /// Validate a policy file: exit 0, or 1 with the error as FILE:LINE:COLUMN: REASON.
    Check {
        #[arg(value_name = "FILE")]
        file: PathBuf,
    },
    /// Show the running daemon's counters: per scope, rule and destination.
    Stats {
        /// Print JSON (the shape documented in README.md) instead of a table.
        #[arg(long)]
        json: bool,
        #[arg(long, value_name = "PATH", default_value = DEFAULT_SOCKET)]
        socket: PathBuf,
    },
    /// Show the local ports held per destination against the ephemeral range: TIME_WAIT
    /// and port exhaustion, with a diagnosis. Works without the daemon.
    ///
    /// Reads the kernel's socket table (sock_diag) of one network namespace: the
    /// caller's, or the one given. `in_use` counts active connections and TIME_WAIT
    /// entries toward each destination from each source address; connect() fails with
    /// EADDRNOTAVAIL once it reaches the range.
    Ports {
        /// Print JSON (the shape documented in README.md) instead of a table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        netns: NetnsArgs,
    },
    /// Show listeners: accept queue against the effective backlog, SYN_RECV entries,
    /// owning process and scope, and the namespace's overflow counters.
    Listeners {
        /// Print JSON (the shape documented in README.md) instead of a table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        netns: NetnsArgs,
    },
    /// A live view, refreshed every second: ports held per destination and listeners'
    /// accept queues with bars, the daemon's scopes, and the diagnosis. Quit with q.
    Top {
        #[command(flatten)]
        netns: NetnsArgs,
    },
    /// Probe the running kernel's features, as the daemon does at start: which it uses,
    /// which are missing and what that degrades, and whether the daemon can run here.
    Kernel {
        /// Print JSON: {"release": "...", "features": {"NAME": true|false, ...}}.
        #[arg(long)]
        json: bool,
    },
    /// A live stream of what changed and why, as the kernel reported it: a breaker
    /// opening (with the outcomes that tripped it), its half-open steps, closing; a key
    /// (destination, rule, scope) starting to shed and stopping. One line (or JSON
    /// object) an event, the daemon's newest 4,096 first; until interrupted.
    Events {
        /// Print one JSON object a line (fields in the README).
        #[arg(long)]
        json: bool,
        /// Print the events the daemon holds and exit.
        #[arg(long)]
        once: bool,
        #[arg(long, value_name = "PATH", default_value = DEFAULT_SOCKET)]
        socket: PathBuf,
    },
    /// Ask the running daemon to re-read its policy file.
    ///
    /// A bad file is rejected (exit 1) and the policy in force stays, with its counts.
    Reload {
        #[arg(long, value_name = "PATH", default_value = DEFAULT_SOCKET)]
        socket: PathBuf,
    },
    /// Stop for good: the running daemon detaches its programs, unpins its state and
    /// exits; with no daemon running, the programs and state one left are removed.
    /// Counts start from the kernel's socket table at the next start.
    Stop {
        #[arg(long, value_name = "PATH", default_value = DEFAULT_SOCKET)]
        socket: PathBuf,
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
