//! What the daemon does while it serves, beside answering requests: its periodic jobs
//! (`jobs::Jobs`), the thread that reads cgroup creations, and the reader of the
//! kernel's events.
use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use aya::maps::{MapData, RingBuf};

use super::{
    Daemon, FOREIGN_POLL, IDLE_POLL, LISTENER_HEARTBEAT, LISTENER_POLL, LISTENER_RESCAN, RESCAN,
    jobs::Busy, lock,
};
use crate::{
    diagnose::attribution::SAMPLE_EVERY,
    enforce::{
        audit::{self, Correction, Count, Key},
        lease, port_watch,
    },
    kernel::features::{Feature, KernelFeatures},
    listen,
    report::events,
};

/// The names of the jobs that other work wakes (`Jobs::wake`).
const LISTENER_WATCH: &str = "listener_watch";
const LISTENER_HEARTBEAT_JOB: &str = "listener_heartbeat";
const DRILLS: &str = "drills";
const PORT_WATCH: &str = "port_watch";

impl Daemon {
    /// Starts the periodic jobs, their watchdog and the cgroup event thread.
    pub(super) fn spawn_jobs(self: &Arc<Self>, forget_idle: Duration, audit: Duration) {
        let d = self.clone();
        let watchdog = std::thread::Builder::new()
            .name("job-watchdog".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(super::jobs::STALLED);
                    d.jobs.warn_stalled();
                }
            });
        if let Err(e) = watchdog {
            log::error!("starting the jobs' watchdog: {e}; a stuck job is shown by `stats` only");
        }
        let d = self.clone();
        self.jobs.spawn("audit", audit, Arc::new(move || d.audit()));
        let d = self.clone();
        self.jobs.spawn(
            "lease",
            lease::RENEW,
            Arc::new(move || {
                lock(&d.lease).renew()?;
                lock(&d.drills).renew_lease()
            }),
        );
        let d = self.clone();
        self.jobs.spawn(
            "cgroup_rescan",
            RESCAN,
            Arc::new(move || {
                d.rescan()?;
                d.reclaim_ids();
                Ok(())
            }),
        );
        self.spawn_cgroup_events();
        let d = self.clone();
        self.workloads.on_change(move || d.workloads_changed());
        let d = self.clone();
        let drilling = self.clone();
        self.jobs.spawn_idling(
            DRILLS,
            super::drills::DRILL_POLL,
            IDLE_POLL,
            Box::new(move || lock(&drilling.drills).any()),
            Arc::new(move || d.drill_tick()),
        );
        let d = self.clone();
        self.jobs.spawn(
            "time_wait_rates",
            SAMPLE_EVERY,
            Arc::new(move || {
                let mut c = lock(&d.counts);
                let counts = c.counters.time_waits();
                c.time_wait_rates.sample(Instant::now(), counts);
                Ok(())
            }),
        );
        // PORT_USE is keyed by the namespace cookie the programs see; without
        // SO_NETNS_COOKIE the daemon cannot name it, and watermarks stay unenforced.
        let d = self.clone();
        if self.features.has(Feature::SoNetnsCookie) {
            let watching = self.clone();
            // Idle while no scope sets a watermark; a policy applied wakes it, to watch
            // or to clear what the last one left.
            self.jobs.spawn_idling(
                PORT_WATCH,
                RESCAN,
                IDLE_POLL,
                Box::new(move || {
                    watching
                        .programs
                        .generations()
                        .policy()
                        .is_some_and(|p| p.scopes.iter().any(|s| s.watches_ports()))
                }),
                Arc::new(move || {
                    let (policy, dirs) = {
                        let g = d.programs.generations();
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
        // With no listener guard a reading finds nothing: once a second clears what the
        // last guard left.
        self.jobs.spawn_idling(
            LISTENER_WATCH,
            LISTENER_POLL,
            IDLE_POLL,
            self.guarding_listeners(),
            Arc::new(move || {
                let (policies, per_syn) = d.programs.listeners_to_read();
                let reading = lock(&reader).read(&policies, per_syn);
                d.programs.apply_listener_reading(reading)
            }),
        );
        let d = self.clone();
        self.jobs.spawn_idling(
            LISTENER_HEARTBEAT_JOB,
            LISTENER_HEARTBEAT,
            IDLE_POLL,
            self.guarding_listeners(),
            Arc::new(move || d.programs.listener_heartbeat()),
        );
        let d = self.clone();
        self.jobs.spawn(
            "listener_attach",
            LISTENER_RESCAN,
            Arc::new(move || {
                d.programs.rescan_listeners();
                Ok(())
            }),
        );
        let d = self.clone();
        self.jobs.spawn(
            "foreign_sock_ops",
            FOREIGN_POLL,
            Arc::new(move || d.programs.poll_foreign_sock_ops()),
        );
        let d = self.clone();
        self.jobs.spawn(
            "forget_idle",
            forget_idle,
            Arc::new(move || {
                let n = d.scrapes.forget_idle(&d.counts);
                if n > 0 {
                    log::info!("forgot {n} idle destination(s)");
                }
                Ok(())
            }),
        );
    }

    /// Whether a listener guard is in force, for the listener jobs' pace.
    fn guarding_listeners(self: &Arc<Self>) -> Busy {
        let d = self.clone();
        Box::new(move || d.programs.guarding_listeners())
    }

    /// Wakes the listener jobs, for listener guards just set.
    pub(super) fn listeners_set(&self) {
        self.jobs.wake(LISTENER_WATCH);
        self.jobs.wake(LISTENER_HEARTBEAT_JOB);
    }

    /// Wakes the port watermarks' job, for a policy just applied.
    pub(super) fn policy_applied(&self) {
        self.jobs.wake(PORT_WATCH);
    }

    /// Wakes the drills' job, for a drill just started.
    pub(super) fn drill_started(&self) {
        self.jobs.wake(DRILLS);
    }

    /// Starts the thread that governs cgroups created in watched ones as they are made.
    fn spawn_cgroup_events(self: &Arc<Self>) {
        let d = self.clone();
        let events = std::thread::Builder::new()
            .name("cgroup_events".into())
            .spawn(move || {
                let result = d.cgroup_watch.run(|dir| {
                    if let Err(e) = d.cgroup_created(&dir) {
                        log::warn!("new cgroup {}: {e:#}", dir.display());
                    }
                    d.workloads.cgroup_created(&dir);
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
    }

    /// Recounts the active and connecting counts from the live sockets, and corrects a
    /// count that differs for two audits in a row (see `enforce::audit`).
    fn audit(&self) -> anyhow::Result<()> {
        let ids = self.programs.generations().ids();
        let before = audit::reading(lock(&self.counts).counters.dump(ids.counts()));
        let live = self.audit.recount(&before)?;
        let after = audit::reading(lock(&self.counts).counters.dump(ids.counts()));
        let made = self.audit.compare(&before, &live, &after);
        // The readings grow with the destinations, and glibc keeps freed memory unless
        // trimmed.
        drop((before, live, after));
        crate::host::memory::release_freed_memory();
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

    /// Keeps, named, every event the kernel writes to `ring`.
    pub(super) async fn read_events(&self, ring: RingBuf<MapData>) -> anyhow::Result<()> {
        // SAFETY: the ring buffer owns its map's fd, open for as long as it lives.
        let mut ring = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(ring, tokio::io::Interest::READABLE)
        }
        .map_err(|e| anyhow::anyhow!("watching EVENTS: {e}"))?;
        let at_boot = events::unix_ms_at_boot();
        loop {
            let mut ready = ring.readable_mut().await?;
            let (ids, policy) = {
                let g = self.programs.generations();
                (g.ids(), g.policy())
            };
            let guards = self.programs.listener_names();
            let workload = |scope: &str| {
                let s = policy.as_ref()?.scopes.iter().find(|s| s.name == scope)?;
                s.workload().map(ToString::to_string)
            };
            let mut log = lock(&self.events);
            while let Some(item) = ready.get_inner_mut().next() {
                if item.len() >= std::mem::size_of::<guard_common::Event>() {
                    // SAFETY: the kernel wrote an Event there; read unaligned.
                    let ev = unsafe {
                        std::ptr::read_unaligned(item.as_ptr().cast::<guard_common::Event>())
                    };
                    log.push(&ev, &ids, &guards, at_boot, workload);
                }
            }
            ready.clear_ready();
        }
    }
}
