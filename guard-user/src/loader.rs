//! Loads the embedded eBPF object and attaches every program.
use std::{ffi::CString, fs::File, path::Path};

use anyhow::{Context, bail};
use aya::{
    Btf, Ebpf, EbpfLoader,
    programs::{
        BtfTracePoint, CgroupAttachMode, CgroupSock, CgroupSockAddr, SchedClassifier, SockOps,
        TcAttachType,
    },
    util::KernelVersion,
};
use serde::{Deserialize, Serialize};

use crate::cgroup;

static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/guard-ebpf"));

/// Programs on the cgroup2 root, inherited by every cgroup, including those created
/// later. They are attached as bpf_links, which the kernel always adds in
/// BPF_F_ALLOW_MULTI mode, so programs of systemd or a CNI on the same cgroups keep
/// working. (A link refuses attach flags: CgroupAttachMode::Single makes
/// bpf_link_create fail with EINVAL on 6.18, so the mode passed is the default.)
const CGROUP_SOCK_ADDR: &[&str] = &["connect4", "connect6"];
const CGROUP_SOCK: &[&str] = &["sock_create", "sock_release"];
const SOCK_OPS: &[&str] = &["sock_state"];
/// tc ingress program of listener guards, attached per namespace by listeners.rs.
pub const LISTENER_PROGRAM: &str = "listener_shed";
/// (program, BTF tracepoint)
const TP_BTF: &[(&str, &str)] = &[("sock_set_state", "inet_sock_set_state")];

/// Fails with a plain message unless we run as root.
pub fn require_root() -> anyhow::Result<()> {
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "connguard must run as root: it loads eBPF programs and attaches them to the \
             cgroup v2 root (CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN); try `sudo connguard run`"
        );
    }
    Ok(())
}

/// Mounts bpffs and tracefs where they are missing (neither is mounted at boot on some
/// hosts); later features pin maps in bpffs and read tracepoint formats from tracefs.
pub fn ensure_mounts() -> anyhow::Result<()> {
    let info = std::fs::read_to_string("/proc/self/mountinfo")?;
    for (fstype, target) in [("bpf", "/sys/fs/bpf"), ("tracefs", "/sys/kernel/tracing")] {
        if cgroup::mount_of(&info, fstype).is_some() {
            continue;
        }
        std::fs::create_dir_all(target).ok();
        let c = |s: &str| CString::new(s).expect("no NUL");
        let rc = unsafe {
            libc::mount(
                c(fstype).as_ptr(),
                c(target).as_ptr(),
                c(fstype).as_ptr(),
                0,
                std::ptr::null(),
            )
        };
        if rc != 0 {
            bail!(
                "mounting {fstype} at {target}: {}",
                std::io::Error::last_os_error()
            );
        }
        log::info!("mounted {fstype} at {target}");
    }
    Ok(())
}

/// Loads and attaches everything. The attachments are bpf_links, which the kernel drops
/// when the process exits, stopped or killed: that is what makes connguard fail open.
/// (Listener guards on kernels before 6.6 use clsact filters, which outlive the process;
/// a stopping daemon empties their map.)
pub fn load_and_attach(cgroup_root: &Path) -> anyhow::Result<Ebpf> {
    let has_set_retval =
        KernelVersion::current().map_or(true, |v| v >= KernelVersion::new(5, 18, 0));
    if !has_set_retval {
        log::warn!(
            "this kernel lacks bpf_set_retval (Linux 5.18+): shed connects fail with EPERM, not the policy's errno"
        );
    }
    let mut ebpf = EbpfLoader::new()
        .override_global("HAS_SET_RETVAL", &u8::from(has_set_retval), true)
        .load(OBJECT)
        .context("loading the eBPF object")?;
    let cgroup =
        File::open(cgroup_root).with_context(|| format!("opening {}", cgroup_root.display()))?;
    for name in CGROUP_SOCK_ADDR {
        let prog: &mut CgroupSockAddr = program(&mut ebpf, name)?.try_into()?;
        prog.load().with_context(|| format!("loading {name}"))?;
        prog.attach(&cgroup, CgroupAttachMode::Single)
            .with_context(|| format!("attaching {name} to {}", cgroup_root.display()))?;
    }
    for name in CGROUP_SOCK {
        let prog: &mut CgroupSock = program(&mut ebpf, name)?.try_into()?;
        prog.load().with_context(|| format!("loading {name}"))?;
        prog.attach(&cgroup, CgroupAttachMode::Single)
            .with_context(|| format!("attaching {name} to {}", cgroup_root.display()))?;
    }
    for name in SOCK_OPS {
        let prog: &mut SockOps = program(&mut ebpf, name)?.try_into()?;
        prog.load().with_context(|| format!("loading {name}"))?;
        prog.attach(&cgroup, CgroupAttachMode::Single)
            .with_context(|| format!("attaching {name} to {}", cgroup_root.display()))?;
    }
    let prog: &mut SchedClassifier = program(&mut ebpf, LISTENER_PROGRAM)?.try_into()?;
    prog.load()
        .with_context(|| format!("loading {LISTENER_PROGRAM}"))?;
    let btf = Btf::from_sys_fs().context("reading kernel BTF from /sys/kernel/btf/vmlinux")?;
    for (name, tracepoint) in TP_BTF {
        let prog: &mut BtfTracePoint = program(&mut ebpf, name)?.try_into()?;
        prog.load(tracepoint, &btf)
            .with_context(|| format!("loading {name}"))?;
        prog.attach()
            .with_context(|| format!("attaching {name} to {tracepoint}"))?;
    }
    Ok(ebpf)
}

/// Attaches a loaded tc program to an interface's ingress: tcx on Linux 6.6+, a clsact
/// qdisc before.
pub fn attach_tc_ingress(prog: &mut SchedClassifier, iface: &str) -> anyhow::Result<()> {
    if !KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(6, 6, 0)) {
        // Already there is fine.
        let _ = aya::programs::tc::qdisc_add_clsact(iface);
    }
    prog.attach(iface, TcAttachType::Ingress)?;
    Ok(())
}

fn program<'a>(ebpf: &'a mut Ebpf, name: &str) -> anyhow::Result<&'a mut aya::programs::Program> {
    ebpf.program_mut(name)
        .with_context(|| format!("program {name} missing from the eBPF object"))
}

/// One program's cost from the kernel's bpf_stats (zero unless stats are enabled).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProgramCost {
    pub name: String,
    pub run_count: u64,
    pub run_time_ns: u64,
    /// run_time_ns / run_count, in ns; null before the first run.
    pub avg_ns: Option<f64>,
}

pub fn program_costs(ebpf: &Ebpf) -> Vec<ProgramCost> {
    ebpf.programs()
        .filter_map(|(name, prog)| {
            let info = prog.info().ok()?;
            let (count, time) = (info.run_count(), info.run_time().as_nanos() as u64);
            Some(ProgramCost {
                name: name.to_string(),
                run_count: count,
                run_time_ns: time,
                avg_ns: (count > 0).then(|| time as f64 / count as f64),
            })
        })
        .collect()
}
