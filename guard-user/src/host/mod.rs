//! What the daemon and the tools read of the host, with no knowledge of policies: mounts,
//! the cgroup v2 tree, network namespaces, /proc, the kernel's socket table, and its
//! rules for local ports.
pub mod cgroup;
pub mod cgroup_watch;
pub mod mounts;
pub mod netns;
pub mod ports;
pub mod procfs;
pub mod sockdiag;
