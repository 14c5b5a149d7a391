//! The `connguard` binary: parses the command line and runs the command, the daemon
//! (`connguard run`, in the library's `daemon`) or one of the tools that read the kernel's
//! tables and ask the running daemon.
use std::{path::Path, process::ExitCode};

use clap::Parser;
use connguard::{
    cli::{self, Cli, Command, DrillAction, NetnsArgs},
    control::client,
    daemon,
    diagnose::{attribution, listeners, ports},
    host::{cgroup, mounts, netns, ports::PortSettings, sockdiag},
    kernel::{
        features::{Feature, KernelFeatures},
        object,
    },
    policy,
    report::{table, top},
};
use connguard_api::{
    control::{EventsReply, ReloadReply, Request, ScopeReply},
    drill::DrillsReply,
    fleet::FleetView,
    kernel::Features,
    listeners::ListenersReport,
    ports::PortsReport,
    stats::Snapshot,
};

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let command = Cli::parse().command;
    // A command whose output a pipe stops reading (`connguard stats | head`) ends
    // quietly, as other tools do; the daemon keeps Rust's default (a write to a gone
    // client fails with EPIPE, and serving goes on).
    if !matches!(command, Command::Run { .. }) {
        // SAFETY: restoring a signal's default disposition, before any thread starts.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    match run(command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("connguard: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Run {
            policy,
            no_watch_policy,
            metrics,
            socket,
            state_dir,
            bpf_stats,
            forget_idle,
            lease,
            detach_on_exit,
            state_layout,
            audit,
            max_destinations,
            runtimes,
        } => {
            let metrics = (metrics != "off").then_some(metrics);
            let forget_idle = std::time::Duration::from_secs(forget_idle.max(1));
            daemon::run(daemon::Options {
                policy,
                metrics,
                socket,
                state_dir,
                bpf_stats,
                forget_idle,
                lease: std::time::Duration::from_secs(lease),
                detach_on_exit,
                state_layout,
                audit: std::time::Duration::from_secs(audit),
                max_destinations,
                runtimes,
                watch_policy: !no_watch_policy,
            })?;
        }
        Command::Check { file } => match policy::load_file(&file) {
            Ok(p) => println!("{}: ok, {}", file.display(), policy::describe(&p)),
            Err(e) => {
                eprintln!("{e}");
                return Ok(ExitCode::FAILURE);
            }
        },
        // The JSON is passed through as the daemon wrote it (it can be megabytes).
        Command::Stats { json: true, socket } => {
            client::copy_stats(&socket, &mut std::io::stdout().lock())?;
        }
        Command::Stats {
            json: false,
            socket,
        } => {
            let snap: Snapshot = client::ask(&socket, Request::Stats { top: None })?;
            print!("{}", table::stats(&snap));
        }
        Command::Ports { json, netns } => {
            let name = enter_netns(&netns)?;
            let (report, unused) = ports_report(&name, &netns.socket)?;
            if let Some(why) = unused {
                eprintln!("connguard: warning: {why}");
            }
            print_report(&report, json, ports::table)?;
        }
        Command::Listeners { json, netns } => {
            let name = enter_netns(&netns)?;
            print_report(
                &listeners_report(&name, &netns.socket)?,
                json,
                listeners::table,
            )?;
        }
        Command::Fleet { json, socket } => {
            let view: FleetView = client::ask(&socket, Request::Fleet)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&view)?);
            } else {
                print!("{}", table::fleet(&view));
            }
        }
        Command::Events { json, once, socket } => {
            let mut since = 0;
            loop {
                let reply: EventsReply = client::ask(&socket, Request::Events { since })?;
                for e in &reply.events {
                    if json {
                        println!("{}", serde_json::to_string(e)?);
                    } else {
                        println!("{}", e.line());
                    }
                }
                if once {
                    return Ok(ExitCode::SUCCESS);
                }
                since = reply.next;
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
        }
        Command::Top { netns } => {
            let name = enter_netns(&netns)?;
            top::run(&name, || top::View {
                // The screen is top's: why the daemon's answer went unused is diagnosed.
                ports: ports_report(&name, &netns.socket)
                    .map(|(mut r, unused)| {
                        r.warnings.extend(unused);
                        r
                    })
                    .map_err(|e| format!("{e:#}")),
                listeners: sockdiag::listeners_and_syn_recv()
                    .map(|socks| {
                        let counters = listeners::read_counters().unwrap_or_default();
                        listeners::report(&name, &socks, counters).listeners
                    })
                    .unwrap_or_default(),
                stats: client::ask(&netns.socket, Request::Stats { top: Some(0) }).ok(),
            })?;
        }
        Command::Kernel { json } => {
            object::require_root()?;
            let features = Features::probe(&Feature::ALL)?;
            if json {
                println!("{}", serde_json::to_string(&features)?);
            } else {
                println!("{}", features.summary());
            }
            // Exit 1 when the daemon cannot run here, saying why.
            if let Err(e) = features.require() {
                eprintln!("{e:#}");
                return Ok(ExitCode::FAILURE);
            }
        }
        Command::Reload { socket } => {
            let reply: ReloadReply = client::ask(&socket, Request::Reload)?;
            match reply.error {
                None => println!("reloaded: policy generation {}", reply.generation),
                Some(e) => {
                    eprintln!("reload rejected, the previous policy stays in force: {e}");
                    return Ok(ExitCode::FAILURE);
                }
            }
        }
        Command::Drill { action } => return drill(action),
        Command::Stop { socket, state_dir } => daemon::stop(&socket, &state_dir)?,
        Command::Completions { shell } => cli::manual::print_completions(shell),
        Command::Man { dir } => {
            for page in cli::manual::write_pages(&dir)? {
                println!("{}", page.display());
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Prints a report as JSON, or as its table.
fn print_report<T: serde::Serialize>(
    report: &T,
    json: bool,
    table: impl Fn(&T) -> String,
) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        print!("{}", table(report));
    }
    Ok(())
}

/// Enters the namespace the arguments name, if any; returns its name for reports.
fn enter_netns(args: &NetnsArgs) -> anyhow::Result<String> {
    let path = args
        .netns
        .clone()
        .or_else(|| args.pid.map(|p| format!("/proc/{p}/ns/net").into()));
    match path {
        Some(path) => {
            netns::enter(&path)?;
            Ok(path.display().to_string())
        }
        None => Ok("self".to_string()),
    }
}

/// The ports report of the calling thread's namespace (named `name`), with the rates and
/// attribution of the daemon on `socket` when one answers; and why a daemon's answer
/// was left out, when one answered with something else (another version, an error).
fn ports_report(name: &str, socket: &Path) -> anyhow::Result<(PortsReport, Option<String>)> {
    let settings = PortSettings::read()?;
    let mut r = ports::report(
        name,
        &settings,
        &sockdiag::tcp_sockets()?,
        sockdiag::lists_bound_inactive(settings.range),
    );
    // The daemon keys what it knows by the namespace's cookie; without SO_NETNS_COOKIE
    // there is no key to ask with.
    let Ok(cookie) = netns::cookie() else {
        return Ok((r, None));
    };
    match client::ask_if_running(socket, Request::Ports { netns: cookie }) {
        Ok(Some(from)) => attribution::merge(&mut r, from),
        Ok(None) => {}
        Err(e) => {
            let why = format!(
                "the daemon on {} gave no answer this connguard can use ({e:#}); this report \
                 leaves out what the daemon adds (TIME_WAIT rates, scopes, EADDRNOTAVAIL counts)",
                socket.display()
            );
            return Ok((r, Some(why)));
        }
    }
    Ok((r, None))
}

/// The listeners report of the calling thread's namespace, with each listener's scope
/// and the RSTs its guard sent, when a daemon answers on `socket`.
fn listeners_report(name: &str, socket: &Path) -> anyhow::Result<ListenersReport> {
    let mut report = listeners::report(
        name,
        &sockdiag::listeners_and_syn_recv()?,
        listeners::read_counters()?,
    );
    // The scope of each owning process's cgroup.
    if let Ok(root) = mounts::cgroup2_mount() {
        for l in &mut report.listeners {
            let Some(cg) = &l.cgroup else { continue };
            let Ok(cgroup_id) = cgroup::cgroup_id(&root.join(cg)) else {
                continue;
            };
            if let Ok(reply) = client::ask::<ScopeReply>(socket, Request::Scope { cgroup_id }) {
                l.scope = reply.scope;
            }
        }
    }
    // The daemon's guards of this namespace, and each socket's own RSTs where the kernel
    // decides per socket.
    if let Ok(snap) = client::ask::<Snapshot>(socket, Request::Stats { top: Some(0) }) {
        report.guards = snap
            .listeners
            .into_iter()
            .filter(|g| listeners::same_netns(&g.netns, name))
            .collect();
        for l in &mut report.listeners {
            l.rst_shed = report
                .guards
                .iter()
                .filter(|g| g.per_syn)
                .flat_map(|g| &g.queues)
                .find(|q| q.inode != 0 && q.inode == l.inode)
                .map(|q| q.rst_shed);
        }
    }
    Ok(report)
}

/// `connguard drill start|stop|list`.
fn drill(action: DrillAction) -> anyhow::Result<ExitCode> {
    let (socket, request, json) = match action {
        DrillAction::Start(args) => {
            let cli::DrillStart {
                file,
                name,
                scope,
                unit,
                pod_namespace,
                pod_label,
                container,
                container_label,
                fault,
                probability,
                duration,
                max_faults,
                max_fraction,
                window,
                dst,
                ports,
                errno,
                abort_min_success_ratio,
                abort_http,
                socket,
            } = *args;
            use anyhow::Context;
            use toml::Value;
            let text = |v: Option<String>| v.map(Value::String);
            let list = |v: Vec<String>| {
                (!v.is_empty()).then(|| Value::Array(v.into_iter().map(Value::String).collect()))
            };
            let labels = |flag: &str, v: Vec<String>| -> anyhow::Result<Option<Value>> {
                let mut t = toml::Table::new();
                for l in v {
                    let (k, val) = l
                        .split_once('=')
                        .with_context(|| format!("{flag} {l:?}: write it KEY=VALUE"))?;
                    t.insert(k.to_string(), Value::String(val.to_string()));
                }
                Ok((!t.is_empty()).then_some(Value::Table(t)))
            };
            let flags: Vec<(&str, Value)> = [
                ("name", text(name)),
                ("scope", text(scope)),
                ("unit", text(unit)),
                ("pod.namespace", text(pod_namespace)),
                ("pod.labels", labels("--pod-label", pod_label)?),
                ("container.name", text(container)),
                (
                    "container.labels",
                    labels("--container-label", container_label)?,
                ),
                ("fault", text(fault)),
                ("probability", probability.map(Value::Float)),
                ("duration", text(duration)),
                ("max_faults", max_faults.map(Value::Integer)),
                ("max_fraction", max_fraction.map(Value::Float)),
                ("window", text(window)),
                ("dst", list(dst)),
                ("ports", list(ports)),
                ("errno", text(errno)),
                (
                    "abort.min_success_ratio",
                    abort_min_success_ratio.map(Value::Float),
                ),
                ("abort.http", text(abort_http)),
            ]
            .into_iter()
            .filter_map(|(k, v)| Some((k, v?)))
            .collect();
            let spec = policy::drill::load(file.as_deref(), &flags);
            let spec = match spec {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("{e}");
                    return Ok(ExitCode::FAILURE);
                }
            };
            (socket, Request::DrillStart(Box::new(spec)), false)
        }
        DrillAction::Stop { name, socket } => (socket, Request::DrillStop(name), false),
        DrillAction::List { json, socket } => (socket, Request::DrillList, json),
    };
    let names_workloads = match &request {
        Request::DrillStart(spec) => {
            spec.pod.is_some() || spec.container.is_some() || spec.unit.is_some()
        }
        _ => false,
    };
    let reply: DrillsReply = client::ask(&socket, request)?;
    // A daemon that knows no workload selectors would run the drill on its whole scope.
    if names_workloads && let Some(d) = reply.drills.first().filter(|d| d.workloads.is_empty()) {
        let _: DrillsReply = client::ask(&socket, Request::DrillStop(d.spec.name.clone()))?;
        eprintln!(
            "drill {:?}: the daemon ran it on its whole scope, not on the workloads named \
             (a daemon older than this command?); stopped it",
            d.spec.name
        );
        return Ok(ExitCode::FAILURE);
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&reply)?);
    } else {
        print!("{}", table::drills(&reply));
    }
    Ok(ExitCode::SUCCESS)
}
