//! The daemon's last two phases: `serve` until a signal or a `stop` request, then
//! `shut_down`, detaching everything or keeping the pinned state for the next start.
use std::{path::PathBuf, sync::Arc, time::Duration};

use anyhow::Context;
use aya::maps::{MapData, RingBuf};
use tokio::signal::unix::{SignalKind, signal};

use super::{
    Daemon, Options,
    policy_watch::PolicyWatch,
    start::{Listeners, Ready},
};
use crate::control::{self, server::Handler};

/// Serves the control socket and the HTTP listener, runs the jobs and reads the kernel's
/// events from `events`; reloads on SIGHUP and, with `watch`, when the policy file
/// changes. Returns, once SIGTERM, SIGINT or a `stop` request
/// came, whether to detach everything (`stop`, or `--detach-on-exit`), with the
/// runtime shut down and the listener guards stopped.
pub fn serve(
    daemon: &Arc<Daemon>,
    listeners: Listeners,
    events: RingBuf<MapData>,
    watch: Option<PolicyWatch>,
    ready: Ready,
    opts: &Options,
) -> anyhow::Result<bool> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let served = runtime.block_on(async {
        let Listeners { control, metrics } = listeners;
        let handler: Arc<dyn Handler> = daemon.clone();
        tokio::spawn(async move {
            if let Err(e) = control::server::serve(control, handler).await {
                log::error!("control socket: {e:#}; `connguard stats` and `reload` no longer answer");
            }
        });
        if let Some(listener) = metrics {
            let at = listener.local_addr()?;
            log::info!("metrics on http://{at}/metrics, probes on http://{at}/healthz and /readyz");
            let endpoint: Arc<dyn control::metrics::Endpoint> = daemon.clone();
            tokio::spawn(async move {
                if let Err(e) = control::metrics::serve(listener, endpoint).await {
                    log::error!("metrics: {e:#}; /metrics, /healthz and /readyz no longer answer");
                }
            });
        }
        daemon.spawn_jobs(opts.forget_idle, opts.audit);
        daemon.start_fleet()?;
        if let Some(watch) = watch {
            let d = daemon.clone();
            tokio::spawn(async move {
                let reload = Arc::new(move || {
                    d.reload();
                });
                if let Err(e) = watch.run(reload).await {
                    log::error!(
                        "watching the policy file: {e}; it is reloaded on SIGHUP and `connguard reload` only"
                    );
                }
            });
        }
        let d = daemon.clone();
        tokio::spawn(async move {
            if let Err(e) = d.read_events(events).await {
                log::error!("reading EVENTS: {e:#}; `connguard events` shows no new event");
            }
        });
        let mut hup = signal(SignalKind::hangup())?;
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let Ready {
            source,
            what,
            governed,
            attached,
            runtimes,
        } = ready;
        log::info!(
            "ready: programs attached to {}, policy {source} ({what}) governs {governed} cgroup(s), control socket {}{runtimes}",
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
        daemon.end_drills();
        anyhow::Ok(detach)
    });
    // tcx links detach when the process exits; clsact filters (kernels before 6.6) do
    // not.
    if let Err(e) = daemon.programs.stop_listeners() {
        log::warn!("emptying LISTENERS: {e:#}");
    }
    // Tasks still running (a client being served) end with the runtime.
    runtime.shutdown_timeout(Duration::from_secs(1));
    served
}

/// Detaches the programs and removes the pinned state (`detach`), or exits keeping
/// them for the next start to adopt.
pub fn shut_down(
    daemon: Arc<Daemon>,
    detach: anyhow::Result<bool>,
    opts: &Options,
) -> anyhow::Result<()> {
    if detach? {
        // Held to the end: no walk or event attaches (and pins) meanwhile.
        let generations = daemon.programs.generations();
        let n = daemon.state.remove()?;
        std::mem::forget(generations);
        log::info!("stopping: programs detached, {n} pin(s) removed; exiting");
    } else {
        log::info!(
            "exiting with the programs attached and the state pinned in {}: the next start adopts them, with their counts; they shed nothing once the lease runs out, {} s after its last renewal (`connguard stop` removes them)",
            daemon.state.root().display(),
            opts.lease.as_secs()
        );
        // Dropping the daemon would remove its pins, which must outlive it.
        std::mem::forget(daemon);
    }
    Ok(())
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
