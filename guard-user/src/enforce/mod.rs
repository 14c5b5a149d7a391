//! Enforcement: which cgroups each scope governs, the policy generations in the kernel
//! and their atomic switch, the counters the programs keep, port watermarks, and the
//! lease the programs shed under, and the chaos drills they fault by.
pub mod audit;
pub mod breakers;
pub mod counters;
pub mod drill_target;
pub mod drills;
pub mod generations;
pub mod ids;
pub mod lease;
pub mod port_watch;
pub mod scopes;
pub mod seed;
