//! Enforcement: which cgroups each scope governs, the policy generations in the kernel
//! and their atomic switch, the counters the programs keep, and port watermarks.
pub mod counters;
pub mod generations;
pub mod ids;
pub mod port_watch;
pub mod scopes;
