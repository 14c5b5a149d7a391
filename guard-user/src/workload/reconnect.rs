//! Following a runtime: connect, subscribe to its events, list its workloads, then apply
//! each event. When the connection fails or ends, the workloads last listed are kept, the
//! failure is recorded in the registry's source status, and the next attempt comes after
//! an exponential backoff.
use std::{
    convert::Infallible,
    future::Future,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use super::Registry;

/// The first retry's delay; each failed attempt doubles it, up to LAST_RETRY.
const FIRST_RETRY: Duration = Duration::from_millis(100);
const LAST_RETRY: Duration = Duration::from_secs(30);

/// One runtime's connection, as its sessions report it.
pub(super) struct Link {
    pub registry: Arc<Registry>,
    pub source: &'static str,
    pub endpoint: PathBuf,
    up: AtomicBool,
}

impl Link {
    /// The session has subscribed and listed: the registry holds the runtime's current
    /// workloads and will follow its events.
    pub fn up(&self, listed: usize, what: &str) {
        self.up.store(true, Ordering::Relaxed);
        self.registry
            .source_state(self.source, &self.endpoint, None);
        log::info!(
            "{} at {}: connected, {listed} {what}, following its events",
            self.source,
            self.endpoint.display()
        );
    }
}

/// Runs `session` again and again: it ends only with an error.
pub(super) async fn follow<F, Fut>(
    registry: Arc<Registry>,
    source: &'static str,
    endpoint: PathBuf,
    mut session: F,
) where
    F: FnMut(Arc<Link>) -> Fut,
    Fut: Future<Output = anyhow::Result<Infallible>>,
{
    let link = Arc::new(Link {
        registry,
        source,
        endpoint,
        up: AtomicBool::new(false),
    });
    let mut delay = FIRST_RETRY;
    let mut reported = false;
    loop {
        let Err(error) = session(link.clone()).await;
        let was_up = link.up.swap(false, Ordering::Relaxed);
        if was_up {
            delay = FIRST_RETRY;
            reported = false;
        }
        let error = format!("{error:#}");
        link.registry
            .source_state(source, &link.endpoint, Some(error.clone()));
        // One warning per outage; the status keeps the latest error.
        if !reported {
            log::warn!(
                "{source} at {}: {error}; keeping the workloads last listed, retrying with backoff",
                link.endpoint.display()
            );
            reported = true;
        } else {
            log::debug!("{source} at {}: {error}", link.endpoint.display());
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(LAST_RETRY);
    }
}
