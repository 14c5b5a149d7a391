//! The Prometheus endpoint: GET /metrics over HTTP/1.1, each scrape rendered on the
//! blocking pool (it reads the kernel's maps), at most MAX_SCRAPES at once.
use std::sync::Arc;

use axum::{
    Router,
    http::{StatusCode, header},
    response::IntoResponse,
    routing::get,
};

use tokio::sync::Semaphore;

use super::server::release_freed_memory;

/// Scrapes rendered at once; more wait their turn.
const MAX_SCRAPES: usize = 2;

/// Renders the exposition text of one scrape.
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// Serves /metrics forever.
pub async fn serve(listener: std::net::TcpListener, render: Render) -> anyhow::Result<()> {
    listener.set_nonblocking(true)?;
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let turns = Arc::new(Semaphore::new(MAX_SCRAPES));
    let app = Router::new()
        .route(
            "/metrics",
            get(move || scrape(render.clone(), turns.clone())),
        )
        .fallback(|| async { (StatusCode::NOT_FOUND, "see /metrics\n") });
    axum::serve(listener, app).await?;
    Ok(())
}

async fn scrape(render: Render, turns: Arc<Semaphore>) -> impl IntoResponse {
    let Ok(turn) = turns.acquire_owned().await else {
        return (StatusCode::SERVICE_UNAVAILABLE, "shutting down").into_response();
    };
    let text = tokio::task::spawn_blocking(move || {
        let _turn = turn;
        let text = render();
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
