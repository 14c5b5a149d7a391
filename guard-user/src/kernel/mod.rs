//! The eBPF object: loading and attaching its programs, typed access to its maps, and
//! whole-map reads. Knows the ABI (guard-common), not the policy.
pub mod batch;
pub mod maps;
pub mod object;
