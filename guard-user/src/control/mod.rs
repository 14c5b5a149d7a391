//! How the daemon is reached: the control protocol, its server and client, and the
//! Prometheus endpoint.
pub mod client;
pub mod metrics;
pub mod protocol;
pub mod server;
