//! The data of connguard's interfaces, as Rust types: what `connguard ... --json` prints
//! and the control socket answers (`stats`, `kernel`, `ports`, `listeners`, `events`),
//! the control protocol's requests, and policy files (`policy`, a builder that writes
//! them). The daemon serializes these very types, so a program that reads connguard's
//! JSON with them reads every field the daemon writes, under its name.
//!
//! This crate holds data and its text forms only (serde, toml): it builds without the
//! eBPF toolchain, on any machine.
pub mod control;
pub mod drill;
pub mod events;
pub mod fleet;
pub mod kernel;
pub mod listeners;
pub mod policy;
pub mod ports;
pub mod stats;
