//! What the running kernel offers, found by probing it (loading a tiny program, asking
//! for a map type, a socket option or a query), never by its version number: distros
//! backport (RHEL 9's 5.14 has much of 6.x's BPF) and custom kernels turn things off.
//!
//! A feature is required (the daemon refuses to start without it, naming it), degrades
//! one behaviour (logged at start, carried in `stats --json`), or is only reported
//! (what later controls will use). `CONNGUARD_WITHOUT=a,b` makes the probes report
//! features as absent, so every degraded path can be run on any kernel.
use std::{
    collections::BTreeMap,
    os::fd::{FromRawFd, OwnedFd},
};

use anyhow::bail;
use aya::{
    maps::MapType,
    programs::ProgramType,
    sys::{BpfHelper, is_helper_supported, is_map_supported},
};
use serde::{Deserialize, Serialize};

use super::syscall::{BPF_LINK_CREATE, BPF_MAP_LOOKUP_BATCH, BPF_PROG_LOAD, BPF_PROG_QUERY, bpf};
use crate::host::{netns, ports::PortSettings, sockdiag};

/// The environment variable naming features to treat as absent (comma-separated).
pub const WITHOUT_ENV: &str = "CONNGUARD_WITHOUT";

/// What the daemon does without a feature.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Without {
    /// It refuses to start.
    Refuses,
    /// It runs, with this behaviour lost or replaced.
    Degrades(&'static str),
    /// Nothing uses it yet.
    Unused,
}

/// A probed feature: its name in `stats --json`, what it is and since when upstream
/// Linux has it (for messages; the probe decides), and what is lost without it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Feature {
    AtomicFetch,
    CgroupLinks,
    KernelBtf,
    SetRetval,
    NetnsCookieSockopt,
    Tcx,
    BoundInactiveDiag,
    BatchLookup,
    RingBuffer,
    AncestorCgroupId,
    CgroupStorage,
}

impl Feature {
    pub const ALL: [Feature; 11] = [
        Feature::AtomicFetch,
        Feature::CgroupLinks,
        Feature::KernelBtf,
        Feature::SetRetval,
        Feature::NetnsCookieSockopt,
        Feature::Tcx,
        Feature::BoundInactiveDiag,
        Feature::BatchLookup,
        Feature::RingBuffer,
        Feature::AncestorCgroupId,
        Feature::CgroupStorage,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Feature::AtomicFetch => "atomic_fetch",
            Feature::CgroupLinks => "cgroup_links",
            Feature::KernelBtf => "kernel_btf",
            Feature::SetRetval => "set_retval",
            Feature::NetnsCookieSockopt => "so_netns_cookie",
            Feature::Tcx => "tcx",
            Feature::BoundInactiveDiag => "bound_inactive_diag",
            Feature::BatchLookup => "batch_lookup",
            Feature::RingBuffer => "ring_buffer",
            Feature::AncestorCgroupId => "ancestor_cgroup_id",
            Feature::CgroupStorage => "cgroup_storage",
        }
    }

    /// What it is, and the upstream Linux release that brought it.
    pub fn what(self) -> &'static str {
        match self {
            Feature::AtomicFetch => {
                "BPF atomic fetch instructions (fetch-add, cmpxchg; Linux 5.12)"
            }
            Feature::CgroupLinks => "BPF links for cgroup programs (Linux 5.7)",
            Feature::KernelBtf => "kernel BTF at /sys/kernel/btf/vmlinux (CONFIG_DEBUG_INFO_BTF)",
            Feature::SetRetval => "bpf_set_retval in cgroup sock_addr programs (Linux 6.1)",
            Feature::NetnsCookieSockopt => "the SO_NETNS_COOKIE socket option (Linux 5.14)",
            Feature::Tcx => "tcx links (Linux 6.6)",
            Feature::BoundInactiveDiag => "sock_diag dumps of bound-only sockets (Linux 6.7)",
            Feature::BatchLookup => "BPF_MAP_LOOKUP_BATCH (Linux 5.6)",
            Feature::RingBuffer => "BPF ring buffers (Linux 5.8)",
            Feature::AncestorCgroupId => {
                "bpf_get_current_ancestor_cgroup_id in cgroup sock_addr programs (Linux 5.7)"
            }
            Feature::CgroupStorage => "cgroup local storage, BPF_MAP_TYPE_CGRP_STORAGE (Linux 6.2)",
        }
    }

    pub fn without(self) -> Without {
        match self {
            // Exact budgets rest on fetch-add's old value; fail-open on the links, which
            // the kernel drops with the process; the TIME_WAIT tracepoint on BTF.
            Feature::AtomicFetch | Feature::CgroupLinks | Feature::KernelBtf => Without::Refuses,
            Feature::SetRetval => {
                Without::Degrades("a shed connect() fails with EPERM, not the policy's errno")
            }
            Feature::NetnsCookieSockopt => Without::Degrades(
                "port watermarks are not enforced, and `connguard ports` shows no daemon attribution",
            ),
            Feature::Tcx => Without::Degrades(
                "listener guards are clsact filters, which outlive a killed daemon (a clean stop removes them)",
            ),
            Feature::BoundInactiveDiag => Without::Degrades(
                "ports held by bind() alone (bound, not connected) are not seen by `connguard ports`",
            ),
            Feature::BatchLookup => Without::Degrades("maps are read entry by entry"),
            Feature::RingBuffer | Feature::AncestorCgroupId | Feature::CgroupStorage => {
                Without::Unused
            }
        }
    }

    fn probe(self) -> anyhow::Result<bool> {
        Ok(match self {
            Feature::AtomicFetch => atomic_fetch_loads()?,
            // link_create.prog_fd is the attribute's first word.
            Feature::CgroupLinks => bpf_command_known(BPF_LINK_CREATE, 0)?,
            Feature::KernelBtf => std::path::Path::new("/sys/kernel/btf/vmlinux").exists(),
            Feature::SetRetval => {
                is_helper_supported(ProgramType::CgroupSockAddr, BpfHelper::BPF_FUNC_set_retval)?
            }
            Feature::NetnsCookieSockopt => netns::cookie().is_ok(),
            Feature::Tcx => tcx_query_known()?,
            Feature::BoundInactiveDiag => {
                sockdiag::lists_bound_inactive(PortSettings::read()?.range)?
            }
            // batch.map_fd follows in_batch, out_batch, keys, values and count.
            Feature::BatchLookup => bpf_command_known(BPF_MAP_LOOKUP_BATCH, 9)?,
            Feature::RingBuffer => is_map_supported(MapType::RingBuf)?,
            Feature::AncestorCgroupId => is_helper_supported(
                ProgramType::CgroupSockAddr,
                BpfHelper::BPF_FUNC_get_current_ancestor_cgroup_id,
            )?,
            Feature::CgroupStorage => is_map_supported(MapType::CgrpStorage)?,
        })
    }
}

/// The probes' results for the running kernel.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Features {
    /// `uname -r`.
    pub release: String,
    /// Feature name -> present. A feature named in CONNGUARD_WITHOUT reads false.
    pub features: BTreeMap<String, bool>,
}

impl Features {
    /// Probes every feature (as root: loading programs needs CAP_BPF). A probe that
    /// cannot decide (an unexpected error) fails the whole call.
    pub fn probe() -> anyhow::Result<Features> {
        let without = without_from_env()?;
        let mut features = BTreeMap::new();
        for f in Feature::ALL {
            let present = !without.contains(&f)
                && f.probe()
                    .map_err(|e| e.context(format!("probing {}", f.what())))?;
            features.insert(f.name().to_string(), present);
        }
        Ok(Features {
            release: release(),
            features,
        })
    }

    pub fn has(&self, f: Feature) -> bool {
        self.features.get(f.name()).copied().unwrap_or(false)
    }

    /// Fails naming every missing feature the daemon cannot run without.
    pub fn require(&self) -> anyhow::Result<()> {
        let missing: Vec<&str> = Feature::ALL
            .iter()
            .filter(|f| f.without() == Without::Refuses && !self.has(**f))
            .map(|f| f.what())
            .collect();
        if !missing.is_empty() {
            bail!(
                "kernel {} lacks what connguard needs: {}; nothing was attached",
                self.release,
                missing.join("; ")
            );
        }
        Ok(())
    }

    /// The start line: what is used, what is degraded and how.
    pub fn summary(&self) -> String {
        let used: Vec<&str> = Feature::ALL
            .iter()
            .filter(|f| f.without() != Without::Unused && self.has(**f))
            .map(|f| f.name())
            .collect();
        let degraded: Vec<String> = Feature::ALL
            .iter()
            .filter(|f| !self.has(**f))
            .filter_map(|f| match f.without() {
                Without::Degrades(how) => Some(format!("no {}: {how}", f.name())),
                _ => None,
            })
            .collect();
        let degraded = if degraded.is_empty() {
            "nothing degraded".to_string()
        } else {
            format!("degraded: {}", degraded.join("; "))
        };
        format!(
            "kernel {}: using {}; {degraded}",
            self.release,
            used.join(", ")
        )
    }
}

fn without_from_env() -> anyhow::Result<Vec<Feature>> {
    let Ok(list) = std::env::var(WITHOUT_ENV) else {
        return Ok(Vec::new());
    };
    list.split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(|n| {
            Feature::ALL
                .into_iter()
                .find(|f| f.name() == n)
                .ok_or_else(|| {
                    let known: Vec<&str> = Feature::ALL.iter().map(|f| f.name()).collect();
                    anyhow::anyhow!(
                        "{WITHOUT_ENV}: no feature {n:?}; known: {}",
                        known.join(", ")
                    )
                })
        })
        .collect()
}

fn release() -> String {
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    if unsafe { libc::uname(&mut u) } != 0 {
        return "unknown".to_string();
    }
    unsafe { std::ffi::CStr::from_ptr(u.release.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

// enum bpf_prog_type and enum bpf_attach_type (include/uapi/linux/bpf.h).
const BPF_PROG_TYPE_SOCKET_FILTER: u32 = 1;
const BPF_TCX_INGRESS: u32 = 46;

/// One BPF instruction: opcode, dst and src registers (low and high nibble), offset,
/// immediate.
#[repr(C)]
struct Insn(u8, u8, i16, i32);

/// `BPF_PROG_LOAD` fields of `union bpf_attr`, up to the license.
#[repr(C)]
struct ProgLoad {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
}

/// Whether a socket filter with an atomic fetch-add on its stack loads: kernels before
/// them refuse the instruction's encoding ("BPF_STX uses reserved fields").
fn atomic_fetch_loads() -> anyhow::Result<bool> {
    let insns = [
        // *(u64 *)(r10 - 8) = 0
        Insn(0x7a, 10, -8, 0),
        // r1 = 1
        Insn(0xb7, 1, 0, 1),
        // r1 = atomic_fetch_add((u64 *)(r10 - 8), r1): BPF_STX|BPF_DW|BPF_ATOMIC,
        // imm BPF_ADD|BPF_FETCH
        Insn(0xdb, 10 | (1 << 4), -8, 1),
        // r0 = 0; exit
        Insn(0xb7, 0, 0, 0),
        Insn(0x95, 0, 0, 0),
    ];
    let mut attr = ProgLoad {
        prog_type: BPF_PROG_TYPE_SOCKET_FILTER,
        insn_cnt: insns.len() as u32,
        insns: insns.as_ptr() as u64,
        license: c"GPL".as_ptr() as u64,
    };
    // SAFETY: a BPF_PROG_LOAD prefix; `insns` and the license outlive the call.
    match unsafe { bpf(BPF_PROG_LOAD, &mut attr) } {
        Ok(fd) => {
            // SAFETY: a new fd the kernel handed us, closed here.
            drop(unsafe { OwnedFd::from_raw_fd(fd as i32) });
            Ok(true)
        }
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(e) => bail!("BPF_PROG_LOAD of a 5-instruction socket filter: {e}"),
    }
}

/// Whether the kernel knows `cmd`: given a zeroed attribute but for -1 in the u32 at
/// `fd_word` (the command's first fd), it fails with EBADF; an unknown command fails
/// with EINVAL.
fn bpf_command_known(cmd: libc::c_long, fd_word: usize) -> anyhow::Result<bool> {
    let mut attr = [0u32; 16];
    attr[fd_word] = u32::MAX;
    // SAFETY: no pointer in the attribute; the fd -1 fails the command early.
    match unsafe { bpf(cmd, &mut attr) } {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(e) if e.raw_os_error() == Some(libc::EBADF) => Ok(true),
        Err(e) => bail!("bpf(2) command {cmd} with fd -1: {e}"),
        Ok(_) => bail!("bpf(2) command {cmd} with fd -1 succeeded"),
    }
}

/// `BPF_PROG_QUERY` fields of `union bpf_attr`, all of them: the kernel writes its
/// answer (count, attach_flags, revision) at their offsets whatever size it is given.
#[repr(C)]
#[derive(Default)]
struct ProgQuery {
    target: u32,
    attach_type: u32,
    query_flags: u32,
    attach_flags: u32,
    prog_ids: u64,
    prog_cnt: u32,
    _pad: u32,
    prog_attach_flags: u64,
    link_ids: u64,
    link_attach_flags: u64,
    revision: u64,
}

/// BPF_PROG_QUERY for tcx ingress programs on loopback (ifindex 1 in every network
/// namespace): a kernel with tcx answers (zero or more programs), one without refuses
/// the attach type with EINVAL. Nothing is attached.
fn tcx_query_known() -> anyhow::Result<bool> {
    let mut attr = ProgQuery {
        target: 1,
        attach_type: BPF_TCX_INGRESS,
        ..Default::default()
    };
    // SAFETY: the whole BPF_PROG_QUERY member; no buffer (prog_ids is null).
    match unsafe { bpf(BPF_PROG_QUERY, &mut attr) } {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(e) => bail!("BPF_PROG_QUERY of tcx ingress on lo: {e}"),
    }
}
