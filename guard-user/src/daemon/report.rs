//! What the daemon reports: `stats` snapshots, /metrics, and the answers of the control
//! socket.
use std::time::Instant;

use super::{Daemon, lock};
use connguard_api::{
    control::{EventsReply, Reply, Request, ScopeReply, StopReply},
    stats::{DestinationTable, Snapshot},
};

use crate::{
    control::server::Handler,
    diagnose::attribution::{daemon_ports, eaddrnotavail_counts},
    kernel::object,
    report::{prometheus::METRIC_TOP_DESTINATIONS, snapshot},
};

impl Daemon {
    /// Everything `stats` reports; with `top`, each scope's destinations are cut to the
    /// busiest `top`. The maps are read under their owners' locks, the snapshot is built
    /// after.
    pub(super) fn snapshot(&self, top: Option<usize>) -> Snapshot {
        let status = lock(&self.status).clone();
        let (policy, ids, programs, members) = {
            let mut g = self.programs.generations();
            let (policy, ids) = (g.policy(), g.ids());
            let members = policy.as_ref().map_or_else(Vec::new, |p| {
                snapshot::members(p, g.governed().0, &g.cgroup_root())
            });
            (policy, ids, object::program_costs(&g.ebpf().1), members)
        };
        let dump = lock(&self.counts).counters.dump(ids.counts());
        let destination_table = DestinationTable {
            entries: dump.destinations.iter().map(|c| c.len() as u64).sum(),
            capacity: dump.destination_capacity,
        };
        let watched_ports = lock(&self.port_watch).watched();
        let (listeners, caller_tables) = self.programs.listener_stats();
        let scope_name = |id| ids.scope_name(id).unwrap_or("?").to_string();
        let eaddrnotavail = eaddrnotavail_counts(&dump.eaddrnotavail, scope_name);
        let (internal_errors, lease_expired, lost_events) =
            (dump.internal_errors, dump.lease_expired, dump.lost_events);
        let audit_corrections = self.audit.corrections();
        Snapshot {
            policy: status,
            scopes: policy
                .map_or_else(Vec::new, |p| snapshot::scopes(&p, &ids, dump, top, members)),
            internal_errors,
            lost_events,
            lease_expired,
            audit_corrections,
            programs,
            host_wide: {
                let (attached, because) = self.programs.host_wide();
                connguard_api::stats::HostWide {
                    attached: attached.into_iter().map(String::from).collect(),
                    because,
                }
            },
            eaddrnotavail,
            watched_ports,
            listeners,
            caller_tables,
            destination_table,
            jobs: self.jobs.stats(),
            kernel: Some(self.features.clone()),
            runtimes: self.workloads.runtimes(),
            fleet: self.fleet.status(),
            drills: lock(&self.drills).list(),
        }
    }

    /// The text of a scrape of /metrics.
    pub(super) fn metrics(&self) -> String {
        self.scrapes
            .render(|| self.snapshot(Some(METRIC_TOP_DESTINATIONS)))
    }
}

impl Handler for Daemon {
    fn handle(&self, request: Request) -> Reply {
        match request {
            Request::Stats { top } => Reply::Stats(Box::new(self.snapshot(top))),
            Request::Reload => Reply::Reload(self.reload()),
            Request::Ports { netns } => {
                let ids = self.programs.generations().ids();
                let (destinations, eaddrnotavail, rates) = {
                    let c = lock(&self.counts);
                    let time_waits = c.counters.time_waits();
                    (
                        c.counters.destinations(),
                        c.counters.eaddrnotavail(),
                        c.time_wait_rates.rates(Instant::now(), &time_waits),
                    )
                };
                Reply::Ports(daemon_ports(
                    netns,
                    &rates,
                    &destinations,
                    &eaddrnotavail,
                    |id| ids.scope_name(id).unwrap_or("?").to_string(),
                ))
            }
            Request::Fleet => match self.fleet_hosts() {
                Ok(view) => Reply::Fleet(view),
                Err(e) => Reply::error(e),
            },
            Request::DrillStart(spec) => self.drill_start(*spec),
            Request::DrillStop(name) => self.drill_stop(&name),
            Request::DrillList => Reply::Drills(self.drill_list()),
            Request::Stop => {
                self.stop.notify_one();
                Reply::Stop(StopReply { stopping: true })
            }
            Request::Events { since } => {
                let (events, next) = lock(&self.events).after(since);
                Reply::Events(EventsReply { events, next })
            }
            Request::Scope { cgroup_id } => {
                let g = self.programs.generations();
                let scope = g
                    .scope_of_cgroup(cgroup_id)
                    .and_then(|id| g.ids().scope_name(id).map(str::to_string));
                Reply::Scope(ScopeReply { scope })
            }
        }
    }
}
