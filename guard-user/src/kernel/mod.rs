//! The kernel's BPF side: the features it offers (probed), the eBPF object (loading and
//! attaching its programs), typed access to its maps, and whole-map reads. Knows the ABI
//! (guard-common) and the host, not the policy.
pub mod backstop;
pub mod batch;
pub mod btf;
pub mod cgroup_links;
pub mod clock;
pub mod features;
pub mod maps;
pub mod object;
pub mod state;
pub mod syscall;
