//! connguard: the daemon and its command-line tools.
mod accounting;
mod cgroup;
mod cli;
mod daemon;
mod loader;
mod netns;
mod policy;
mod ports;
mod sockdiag;
mod stats;

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
        Command::Stats { json, socket } => {
            let text = daemon::request(&socket, "stats")?;
            let value: serde_json::Value = serde_json::from_str(&text)?;
            if let Some(e) = value.get("error") {
                anyhow::bail!("the daemon answered: {e}");
            }
            if json {
                println!("{text}");
            } else {
                print!("{}", stats::table(&serde_json::from_value(value)?));
            }
        }
        Command::Ports {
            json,
            netns,
            pid,
            socket,
        } => {
            let path = netns.or_else(|| pid.map(|p| format!("/proc/{p}/ns/net").into()));
            if let Some(path) = &path {
                netns::enter(path)?;
            }
            let name = path.map_or("self".to_string(), |p| p.display().to_string());
            let mut report = ports::report(
                &name,
                &ports::PortSettings::read()?,
                &sockdiag::tcp_sockets()?,
            );
            // Rates and attribution come from a running daemon; without one they stay null.
            if let Ok(text) = daemon::request(&socket, &format!("ports {}", netns::cookie()?)) {
                ports::merge(&mut report, serde_json::from_str(&text)?);
            }
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                print!("{}", ports::table(&report));
            }
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
