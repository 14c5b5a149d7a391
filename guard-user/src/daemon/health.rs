//! What the HTTP listener serves: scrapes, and the checks of /healthz and /readyz.
//!
//! The listener answers from the "ready" log line on, once the first policy is applied
//! and the programs attached (a probe before that waits in the listen backlog and times
//! out, which counts as failed). Then:
//!
//! - liveness: the lease has not run out (the programs shed; the lease job renews it
//!   every second, so a daemon whose renewals stopped fails within the lease), and no
//!   periodic job has a run going for longer than jobs::STALLED (a stuck job);
//! - readiness: the policy in force (a rejected reload leaves the previous one in
//!   force, which is still governing: it is reported, not failed) and the lease.
use std::time::Duration;

use super::{Daemon, jobs::STALLED, lock};
use crate::control::metrics::{Check, Endpoint};

impl Endpoint for Daemon {
    fn scrape(&self) -> String {
        self.metrics()
    }

    fn liveness(&self) -> Vec<Check> {
        let stalled: Vec<String> = self
            .jobs
            .stats()
            .into_iter()
            .filter_map(|j| {
                let ms = j.running_ms?;
                (ms >= STALLED.as_secs_f64() * 1e3)
                    .then(|| format!("{} for {:.0} s", j.name, ms / 1e3))
            })
            .collect();
        vec![
            self.lease_check(),
            Check {
                name: "jobs",
                ok: stalled.is_empty(),
                detail: if stalled.is_empty() {
                    format!("no run going for longer than {} s", STALLED.as_secs())
                } else {
                    format!("a run has been going: {}", stalled.join(", "))
                },
            },
        ]
    }

    fn readiness(&self) -> Vec<Check> {
        let status = lock(&self.status).clone();
        let mut detail = format!(
            "generation {} of {} in force",
            status.generation, status.source
        );
        if let Some(e) = &status.last_error {
            detail += &format!("; the last reload was rejected: {e}");
        }
        vec![
            Check {
                name: "policy",
                ok: true,
                detail,
            },
            self.lease_check(),
        ]
    }
}

impl Daemon {
    fn lease_check(&self) -> Check {
        let (ok, detail) = match lock(&self.lease).remaining() {
            Ok(left) if left > Duration::ZERO => (
                true,
                format!(
                    "the programs shed for {:.1} s more without a renewal",
                    left.as_secs_f64()
                ),
            ),
            Ok(_) => (
                false,
                "the lease has run out: the programs count and shed nothing".to_string(),
            ),
            Err(e) => (false, format!("{e:#}")),
        };
        Check {
            name: "lease",
            ok,
            detail,
        }
    }
}
