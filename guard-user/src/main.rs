//! connguard: the daemon and its command-line tools.
mod accounting;
mod batch;
mod cgroup;
mod cli;
mod daemon;
mod listeners;
mod loader;
mod netns;
mod policy;
mod ports;
mod sockdiag;
mod stats;
mod top;

use std::process::ExitCode;

use clap::Parser;

use crate::cli::{Cli, Command};

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    match run(Cli::parse().command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("connguard: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Enters the namespace the arguments name, if any; returns its name for reports.
fn enter_netns(args: &cli::NetnsArgs) -> anyhow::Result<String> {
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

fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Run {
            policy,
            metrics,
            socket,
            bpf_stats,
            forget_idle,
        } => {
            let metrics = (metrics != "off").then_some(metrics);
            let forget_idle = std::time::Duration::from_secs(forget_idle.max(1));
            daemon::run(daemon::Options {
                policy,
                metrics,
                socket,
                bpf_stats,
                forget_idle,
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
            daemon::copy_stats(&socket, &mut std::io::stdout().lock())?;
        }
        Command::Stats {
            json: false,
            socket,
        } => {
            let mut text = Vec::new();
            daemon::copy_stats(&socket, &mut text)?;
            print!("{}", stats::table(&serde_json::from_slice(&text)?));
        }
        Command::Ports { json, netns } => {
            let name = enter_netns(&netns)?;
            let report = ports::collect(&name, &netns.socket)?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                print!("{}", ports::table(&report));
            }
        }
        Command::Listeners { json, netns } => {
            let name = enter_netns(&netns)?;
            let mut report = listeners::report(
                &name,
                &sockdiag::tcp_sockets()?,
                listeners::read_counters()?,
            );
            // The scope of each owning process's cgroup, when a daemon answers.
            if let Ok(root) = cgroup::cgroup2_mount() {
                for l in &mut report.listeners {
                    let Some(cg) = &l.cgroup else { continue };
                    let Ok(id) = cgroup::cgroup_id(&root.join(cg)) else {
                        continue;
                    };
                    if let Ok(text) = daemon::request(&netns.socket, &format!("scope {id}"))
                        && let Ok(v) = serde_json::from_str::<serde_json::Value>(&text)
                    {
                        l.scope = v["scope"].as_str().map(str::to_string);
                    }
                }
            }
            // RSTs sent by the daemon's guards, per port.
            if let Ok(text) = daemon::request(&netns.socket, "stats 0")
                && let Ok(snap) = serde_json::from_str::<stats::Snapshot>(&text)
            {
                for l in &mut report.listeners {
                    l.rst_shed = snap
                        .listeners
                        .iter()
                        .filter(|g| g.ports.iter().any(|[a, b]| (*a..=*b).contains(&l.port)))
                        .map(|g| g.rst_shed)
                        .sum();
                }
            }
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                print!("{}", listeners::table(&report));
            }
        }
        Command::Top { netns } => {
            let name = enter_netns(&netns)?;
            top::run(&name, &netns.socket)?;
        }
        Command::Reload { socket } => {
            let reply: daemon::ReloadReply =
                serde_json::from_str(&daemon::request(&socket, "reload")?)?;
            match reply.error {
                None => println!("reloaded: policy generation {}", reply.generation),
                Some(e) => {
                    eprintln!("reload rejected, the previous policy stays in force: {e}");
                    return Ok(ExitCode::FAILURE);
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
