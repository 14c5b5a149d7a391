//! What connguard shows: the stats snapshot, its table, Prometheus text, `top`, and the
//! events.
pub mod events;
pub mod listener_metrics;
pub mod prometheus;
pub mod rollup;
pub mod snapshot;
pub mod table;
pub mod top;
