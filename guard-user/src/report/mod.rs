//! What connguard shows: the stats snapshot, its table, Prometheus text, and `top`.
pub mod prometheus;
pub mod snapshot;
pub mod table;
pub mod top;
