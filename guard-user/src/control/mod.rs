//! How the daemon is reached: the control protocol's server and client (its requests
//! and replies are connguard_api::control), and the Prometheus endpoint.
pub mod client;
pub mod metrics;
pub mod server;
mod stats_json;
