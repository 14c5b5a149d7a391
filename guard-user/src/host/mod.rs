//! What the daemon and the tools read of the host, with no knowledge of policies: mounts,
//! the cgroup v2 tree, network namespaces, /proc, the kernel's socket table, its rules
//! for local ports, and the daemon's own memory.
pub mod cgroup;
pub mod cgroup_watch;
pub mod memory;
pub mod mounts;
pub mod netns;
pub mod ports;
pub mod procfs;
pub mod sockdiag;
