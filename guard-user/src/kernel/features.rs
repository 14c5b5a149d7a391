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

use anyhow::{Context, bail};
use aya::{
    maps::MapType,
    programs::ProgramType,
    sys::{BpfHelper, is_helper_supported, is_map_supported},
};
use connguard_api::kernel::Features;
use guard_common::linux::ProgQuery;

use super::{
    batch, btf,
    syscall::{
        BPF_LINK_CREATE, BPF_PROG_LOAD, BPF_PROG_QUERY, BPF_PROG_TYPE_SOCK_OPS,
        BPF_PROG_TYPE_SOCKET_FILTER, bpf,
    },
};
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feature {
    AtomicFetch,
    CgroupLinks,
    KernelBtf,
    SetRetval,
    SoNetnsCookie,
    Tcx,
    BoundInactiveDiag,
    BatchLookup,
    RingBuffer,
    AncestorCgroupId,
    CgroupStorage,
    ListenerPerSyn,
}

impl Feature {
    pub const ALL: [Feature; 12] = [
        Feature::AtomicFetch,
        Feature::CgroupLinks,
        Feature::KernelBtf,
        Feature::SetRetval,
        Feature::SoNetnsCookie,
        Feature::Tcx,
        Feature::BoundInactiveDiag,
        Feature::BatchLookup,
        Feature::RingBuffer,
        Feature::AncestorCgroupId,
        Feature::CgroupStorage,
        Feature::ListenerPerSyn,
    ];

    /// What the daemon probes at start: every feature but `BoundInactiveDiag`, which
    /// only `connguard ports` uses (its probe binds a port for a moment).
    pub fn for_daemon() -> Vec<Feature> {
        Feature::ALL
            .into_iter()
            .filter(|f| *f != Feature::BoundInactiveDiag)
            .collect()
    }

    pub fn name(self) -> &'static str {
        match self {
            Feature::AtomicFetch => "atomic_fetch",
            Feature::CgroupLinks => "cgroup_links",
            Feature::KernelBtf => "kernel_btf",
            Feature::SetRetval => "set_retval",
            Feature::SoNetnsCookie => "so_netns_cookie",
            Feature::Tcx => "tcx",
            Feature::BoundInactiveDiag => "bound_inactive_diag",
            Feature::BatchLookup => "batch_lookup",
            Feature::RingBuffer => "ring_buffer",
            Feature::AncestorCgroupId => "ancestor_cgroup_id",
            Feature::CgroupStorage => "cgroup_storage",
            Feature::ListenerPerSyn => "listener_per_syn",
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
            Feature::SoNetnsCookie => "the SO_NETNS_COOKIE socket option (Linux 5.14)",
            Feature::Tcx => "tcx links (Linux 6.6)",
            Feature::BoundInactiveDiag => "sock_diag dumps of bound-only sockets (Linux 6.7)",
            Feature::BatchLookup => "BPF_MAP_LOOKUP_BATCH (Linux 5.6)",
            Feature::RingBuffer => "BPF ring buffers (Linux 5.8)",
            Feature::AncestorCgroupId => {
                "bpf_get_current_ancestor_cgroup_id in cgroup sock programs (Linux 5.7)"
            }
            Feature::CgroupStorage => "cgroup local storage, BPF_MAP_TYPE_CGRP_STORAGE (Linux 6.2)",
            Feature::ListenerPerSyn => {
                "a listener's queues read per SYN in tc: bpf_skc_to_tcp_sock in tc (Linux 5.10) and \
                 the fields' offsets in kernel BTF"
            }
        }
    }

    pub fn without(self) -> Without {
        match self {
            // Exact budgets rest on fetch-add's old value; fail-open on the links, which
            // the kernel drops with the process; the tp_btf program (a release path, and
            // the EADDRNOTAVAIL count) on BTF; a socket's scope, found by sock_create,
            // on its creator's ancestor cgroup ids.
            Feature::AtomicFetch
            | Feature::CgroupLinks
            | Feature::KernelBtf
            | Feature::AncestorCgroupId
            // EVENTS, a ring buffer map, is part of the object.
            | Feature::RingBuffer => Without::Refuses,
            Feature::SetRetval => {
                Without::Degrades("a shed connect() fails with EPERM, not the policy's errno")
            }
            Feature::SoNetnsCookie => Without::Degrades(
                "port watermarks are not enforced, and `connguard ports` shows no daemon attribution",
            ),
            Feature::Tcx => Without::Degrades(
                "listener guards are clsact filters, which outlive a killed daemon (a clean stop removes them)",
            ),
            Feature::BoundInactiveDiag => Without::Degrades(
                "ports held by bind() alone (bound, not connected) are not seen by `connguard ports`",
            ),
            Feature::BatchLookup => Without::Degrades("maps are read entry by entry"),
            Feature::ListenerPerSyn => Without::Degrades(
                "listener guards decide from the daemon's 50 ms reading: a burst can pass the \
                 watermark, a SO_REUSEPORT port is shed only once every member is past it, and \
                 guarded namespaces share decisions",
            ),
            Feature::CgroupStorage => Without::Unused,
        }
    }

    /// Whether the kernel has it; an error when the probe cannot tell.
    fn probe(self) -> anyhow::Result<bool> {
        Ok(match self {
            Feature::AtomicFetch => atomic_fetch_loads()?,
            Feature::CgroupLinks => link_create_known()?,
            Feature::KernelBtf => std::path::Path::new("/sys/kernel/btf/vmlinux").exists(),
            Feature::SetRetval => {
                is_helper_supported(ProgramType::CgroupSockAddr, BpfHelper::BPF_FUNC_set_retval)?
            }
            Feature::SoNetnsCookie => match netns::cookie() {
                Ok(_) => true,
                Err(e) if e.raw_os_error() == Some(libc::ENOPROTOOPT) => false,
                Err(e) => bail!("getsockopt(SO_NETNS_COOKIE): {e}"),
            },
            Feature::Tcx => tcx_query_known()?,
            Feature::BoundInactiveDiag => {
                sockdiag::lists_bound_inactive(PortSettings::read()?.range)
                    .context("no port near the ephemeral range to bind")?
            }
            Feature::BatchLookup => batch::lookup_batch_known()?,
            Feature::RingBuffer => is_map_supported(MapType::RingBuf)?,
            Feature::AncestorCgroupId => is_helper_supported(
                ProgramType::CgroupSock,
                BpfHelper::BPF_FUNC_get_current_ancestor_cgroup_id,
            )?,
            Feature::CgroupStorage => is_map_supported(MapType::CgrpStorage)?,
            Feature::ListenerPerSyn => {
                is_helper_supported(
                    ProgramType::SchedClassifier,
                    BpfHelper::BPF_FUNC_skc_to_tcp_sock,
                )? && match btf::sock_offsets() {
                    Ok(_) => true,
                    Err(e) => {
                        log::warn!("listener fields in kernel BTF: {e:#}");
                        false
                    }
                }
            }
        })
    }
}

/// Probing the running kernel into connguard_api's `Features`, and what the daemon
/// makes of them.
pub trait KernelFeatures: Sized {
    /// Probes `which` (as root: loading programs needs CAP_BPF). A required feature
    /// whose probe cannot tell fails the call; any other reads absent, with a warning.
    fn probe(which: &[Feature]) -> anyhow::Result<Self>;

    fn has(&self, f: Feature) -> bool;

    /// Fails naming every missing feature the daemon cannot run without.
    fn require(&self) -> anyhow::Result<()>;

    /// The start line: what is used, what is degraded and how.
    fn summary(&self) -> String;
}

impl KernelFeatures for Features {
    fn probe(which: &[Feature]) -> anyhow::Result<Features> {
        let without = without_from_env()?;
        raise_memlock_limit();
        let mut features = BTreeMap::new();
        for &f in which {
            let present = !without.contains(&f)
                && match (f.probe(), f.without()) {
                    (Ok(present), _) => present,
                    (Err(e), Without::Refuses) => {
                        return Err(e.context(format!("probing for {}", f.what())));
                    }
                    (Err(e), _) => {
                        log::warn!("probing for {} failed, taken as absent: {e:#}", f.what());
                        false
                    }
                };
            features.insert(f.name().to_string(), present);
        }
        let required = Feature::ALL
            .iter()
            .filter(|f| f.without() == Without::Refuses)
            .map(|f| f.name().to_string())
            .collect();
        Ok(Features {
            release: release(),
            features,
            required,
        })
    }

    fn has(&self, f: Feature) -> bool {
        self.features.get(f.name()).copied().unwrap_or(false)
    }

    fn require(&self) -> anyhow::Result<()> {
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

    fn summary(&self) -> String {
        // Only what was probed (the daemon leaves out what it has no use for).
        let probed = || {
            Feature::ALL
                .into_iter()
                .filter(|f| self.features.contains_key(f.name()))
        };
        let used: Vec<&str> = probed()
            .filter(|f| f.without() != Without::Unused && self.has(*f))
            .map(|f| f.name())
            .collect();
        let degraded: Vec<String> = probed()
            .filter(|f| !self.has(*f))
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

// enum bpf_attach_type (include/uapi/linux/bpf.h).
const BPF_TCX_INGRESS: u32 = 46;

/// One BPF instruction (struct bpf_insn): `regs` holds dst_reg in its low nibble and
/// src_reg in its high one (the bitfields' order on little-endian machines).
#[repr(C)]
struct Insn {
    code: u8,
    regs: u8,
    off: i16,
    imm: i32,
}

const fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn {
        code,
        regs: dst | (src << 4),
        off,
        imm,
    }
}

/// `BPF_PROG_LOAD` fields of `union bpf_attr`, up to the verifier log.
#[repr(C)]
struct ProgLoad {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
}

/// Whether a socket filter with an atomic fetch-add on its stack loads. Kernels before
/// these instructions refuse their encoding, saying so in the verifier log ("BPF_STX
/// uses reserved fields").
fn atomic_fetch_loads() -> anyhow::Result<bool> {
    let insns = [
        // *(u64 *)(r10 - 8) = 0
        insn(0x7a, 10, 0, -8, 0),
        // r1 = 1
        insn(0xb7, 1, 0, 0, 1),
        // r1 = atomic_fetch_add((u64 *)(r10 - 8), r1): BPF_STX|BPF_DW|BPF_ATOMIC,
        // imm BPF_ADD|BPF_FETCH
        insn(0xdb, 10, 1, -8, 1),
        // r0 = 0; exit
        insn(0xb7, 0, 0, 0, 0),
        insn(0x95, 0, 0, 0, 0),
    ];
    prog_loads(BPF_PROG_TYPE_SOCKET_FILTER, &insns, "reserved fields")
        .context("BPF_PROG_LOAD of a 5-instruction socket filter")
}

/// Whether a sock_ops program may call bpf_get_current_comm: a 6-instruction one that
/// does loads. Kernels without it refuse the call ("unknown func").
pub fn sock_ops_comm_loads() -> anyhow::Result<bool> {
    let insns = [
        // r1 = r10; r1 += -16; r2 = 16; call bpf_get_current_comm (16)
        insn(0xbf, 1, 10, 0, 0),
        insn(0x07, 1, 0, 0, -16),
        insn(0xb7, 2, 0, 0, 16),
        insn(0x85, 0, 0, 0, 16),
        // r0 = 1; exit
        insn(0xb7, 0, 0, 0, 1),
        insn(0x95, 0, 0, 0, 0),
    ];
    prog_loads(BPF_PROG_TYPE_SOCK_OPS, &insns, "unknown func")
        .context("BPF_PROG_LOAD of a 6-instruction sock_ops program")
}

/// Whether a program of `prog_type` made of `insns` loads: false when the kernel
/// refuses it with EINVAL and a verifier log containing `refusal`; any other refusal is
/// an error, not an answer.
fn prog_loads(prog_type: u32, insns: &[Insn], refusal: &str) -> anyhow::Result<bool> {
    let mut log = [0u8; 4096];
    let mut attr = ProgLoad {
        prog_type,
        insn_cnt: insns.len() as u32,
        insns: insns.as_ptr() as u64,
        license: c"GPL".as_ptr() as u64,
        log_level: 1,
        log_size: log.len() as u32,
        log_buf: log.as_mut_ptr() as u64,
    };
    // SAFETY: a BPF_PROG_LOAD prefix; the instructions, license and log outlive the call.
    match unsafe { bpf(BPF_PROG_LOAD, &mut attr) } {
        Ok(fd) => {
            // SAFETY: a new fd the kernel handed us, closed here.
            drop(unsafe { OwnedFd::from_raw_fd(fd as i32) });
            Ok(true)
        }
        Err(e) => {
            let log = std::ffi::CStr::from_bytes_until_nul(&log)
                .map(|c| c.to_string_lossy().into_owned())
                .unwrap_or_default();
            if e.raw_os_error() == Some(libc::EINVAL) && log.contains(refusal) {
                return Ok(false);
            }
            bail!("{e}; verifier: {log:?}")
        }
    }
}

/// Whether the kernel knows BPF_LINK_CREATE: given prog_fd -1 (and attach type 0, not
/// BPF_STRUCT_OPS, which takes no program), it fails with EBADF; an unknown command
/// fails with EINVAL.
fn link_create_known() -> anyhow::Result<bool> {
    // prog_fd, target_fd, attach_type, flags.
    let mut attr = [u32::MAX, 0, 0, 0];
    // SAFETY: no pointer in the attribute; the fd -1 fails the command early.
    match unsafe { bpf(BPF_LINK_CREATE, &mut attr) } {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(e) if e.raw_os_error() == Some(libc::EBADF) => Ok(true),
        Err(e) => bail!("BPF_LINK_CREATE with fd -1: {e}"),
        Ok(_) => bail!("BPF_LINK_CREATE with fd -1 succeeded"),
    }
}

/// Kernels before 5.11 charge BPF programs and maps to RLIMIT_MEMLOCK, whose default
/// (64 KiB or 8 MiB) systemd's own programs may already use up: the probes and the
/// object would then fail with EPERM. Later kernels charge the memory cgroup instead.
fn raise_memlock_limit() {
    let unlimited = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) } != 0 {
        log::debug!(
            "raising RLIMIT_MEMLOCK: {}",
            std::io::Error::last_os_error()
        );
    }
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
