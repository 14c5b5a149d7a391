//! The daemon's HTTP listener: GET /metrics for Prometheus, each scrape rendered on the
//! blocking pool (it reads the kernel's maps), at most MAX_SCRAPES at once; and the
//! probes GET /healthz (liveness) and GET /readyz (readiness), which never wait for a
//! scrape.
//!
//! A probe answers 200 when every one of its checks passes and 503 when one fails,
//! with one line a check, `[+]NAME ok: WHAT` or `[-]NAME failed: WHY`, then
//! `healthz check passed` (or `readyz check failed`, ...), in the form of
//! Kubernetes' own components.
use std::sync::Arc;

use axum::{
    Router,
    http::{StatusCode, header},
    response::{IntoResponse, Response},
    routing::get,
};

use tokio::sync::Semaphore;

use crate::host::memory::release_freed_memory;

/// Scrapes rendered at once; more wait their turn.
const MAX_SCRAPES: usize = 2;

const TEXT: &str = "text/plain; charset=utf-8";

/// One check of a probe: what it looked at, whether it passed, and what it found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    pub name: &'static str,
    pub ok: bool,
    pub detail: String,
}

/// What the listener serves. Each method is called on the blocking pool.
pub trait Endpoint: Send + Sync + 'static {
    /// The exposition text of one scrape.
    fn scrape(&self) -> String;
    /// The checks of /healthz: the daemon does its work.
    fn liveness(&self) -> Vec<Check>;
    /// The checks of /readyz: the daemon governs as its policy says.
    fn readiness(&self) -> Vec<Check>;
}

/// Serves /metrics, /healthz and /readyz forever.
pub async fn serve(
    listener: std::net::TcpListener,
    endpoint: Arc<dyn Endpoint>,
) -> anyhow::Result<()> {
    listener.set_nonblocking(true)?;
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let turns = Arc::new(Semaphore::new(MAX_SCRAPES));
    let (e1, e2, e3) = (endpoint.clone(), endpoint.clone(), endpoint);
    let app = Router::new()
        .route("/metrics", get(move || scrape(e1.clone(), turns.clone())))
        .route(
            "/healthz",
            get(move || probe("healthz", e2.clone(), |e| e.liveness())),
        )
        .route(
            "/readyz",
            get(move || probe("readyz", e3.clone(), |e| e.readiness())),
        )
        .fallback(|| async { (StatusCode::NOT_FOUND, "see /metrics, /healthz, /readyz\n") });
    axum::serve(listener, app).await?;
    Ok(())
}

async fn scrape(endpoint: Arc<dyn Endpoint>, turns: Arc<Semaphore>) -> Response {
    let Ok(turn) = turns.acquire_owned().await else {
        return (StatusCode::SERVICE_UNAVAILABLE, "shutting down").into_response();
    };
    let text = tokio::task::spawn_blocking(move || {
        let _turn = turn;
        let text = endpoint.scrape();
        release_freed_memory();
        text
    })
    .await;
    match text {
        Ok(text) => (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

async fn probe(
    name: &'static str,
    endpoint: Arc<dyn Endpoint>,
    checks: fn(&dyn Endpoint) -> Vec<Check>,
) -> Response {
    match tokio::task::spawn_blocking(move || checks(endpoint.as_ref())).await {
        Ok(checks) => {
            let (status, body) = verdict(name, &checks);
            (status, [(header::CONTENT_TYPE, TEXT)], body).into_response()
        }
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, TEXT)],
            format!("{name} check failed: {e}\n"),
        )
            .into_response(),
    }
}

/// The status and body of probe `name` with `checks`.
fn verdict(name: &str, checks: &[Check]) -> (StatusCode, String) {
    let mut body = String::new();
    for c in checks {
        let (mark, word) = if c.ok { ('+', "ok") } else { ('-', "failed") };
        body += &format!("[{mark}]{} {word}: {}\n", c.name, c.detail);
    }
    if checks.iter().all(|c| c.ok) {
        body += &format!("{name} check passed\n");
        (StatusCode::OK, body)
    } else {
        body += &format!("{name} check failed\n");
        (StatusCode::SERVICE_UNAVAILABLE, body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_fails_with_any_check_and_names_each() {
        let check = |name, ok, detail: &str| Check {
            name,
            ok,
            detail: detail.into(),
        };
        assert_eq!(
            verdict("healthz", &[check("lease", true, "held 4.9 s more")]),
            (
                StatusCode::OK,
                "[+]lease ok: held 4.9 s more\nhealthz check passed\n".into()
            )
        );
        assert_eq!(
            verdict(
                "readyz",
                &[
                    check("policy", true, "generation 1"),
                    check("lease", false, "ran out"),
                ]
            ),
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "[+]policy ok: generation 1\n[-]lease failed: ran out\nreadyz check failed\n"
                    .into()
            )
        );
    }
}
