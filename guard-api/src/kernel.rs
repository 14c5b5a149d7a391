//! `connguard kernel --json`, and the `kernel` of `stats --json`: what the running
//! kernel offers, as the daemon's probes found it at start.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The probes' results for the running kernel.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Features {
    /// `uname -r`.
    pub release: String,
    /// Feature name -> present. A feature named in CONNGUARD_WITHOUT reads false, and so
    /// does one whose probe could not tell (logged).
    pub features: BTreeMap<String, bool>,
    /// The features the daemon cannot run without.
    pub required: Vec<String>,
}
