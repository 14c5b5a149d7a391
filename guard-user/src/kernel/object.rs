//! The embedded eBPF object: loading it, attaching its programs, and their costs.
use std::collections::BTreeMap;

use anyhow::{Context, bail};
use aya::{
    Btf, Ebpf, EbpfLoader,
    programs::{
        BtfTracePoint, CgroupAttachMode, CgroupSkb, CgroupSkbAttachType, CgroupSock,
        CgroupSockAddr, CgroupSockopt, Program, SchedClassifier, SockOps, TcAttachType,
        cgroup_skb::CgroupSkbLink,
        links::LinkOrder,
        tc::{NlOptions, SchedClassifierLink, TcAttachOptions},
    },
};
use connguard_api::{kernel::Features, stats::ProgramCost};
use guard_common::names::{map, program};

use super::{
    features::{Feature, KernelFeatures},
    state::State,
};

static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/guard-ebpf"));

/// The connection programs beside connect4 and connect6, attached to cgroups by
/// `cgroup_links`.
const CGROUP_SOCK: &[&str] = &[program::SOCK_CREATE, program::SOCK_RELEASE];
const SOCK_OPS: &[&str] = &[program::SOCK_STATE];
/// The host-wide programs: (program, BTF tracepoint), attached while `backstop` wants.
const TP_BTF: &[(&str, &str)] = &[
    (program::SOCK_SET_STATE, program::SOCK_SET_STATE_TRACEPOINT),
    (program::CALLER_DESTROY, program::CALLER_DESTROY_TRACEPOINT),
];

/// Fails with a plain message unless we run as root.
pub fn require_root() -> anyhow::Result<()> {
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "connguard must run as root: it loads eBPF programs and attaches them to \
             cgroups (CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN); try `sudo connguard run`"
        );
    }
    Ok(())
}

/// The loaded object: its programs, and how its listener guards decide.
pub struct Loaded {
    pub ebpf: Ebpf,
    /// sock_ops programs may call bpf_get_current_comm (else the state tracepoint
    /// counts a failed port search, with the caller's name).
    pub sock_ops_comm: bool,
    /// True when `listener_shed` (per SYN) loaded; else `listener_shed_polled` did.
    pub per_syn: bool,
}

/// Loads every program, with the pinned maps of `state` (adopted, or created and
/// pinned); the connection programs are attached to cgroups by `cgroup_links`, the
/// host-wide ones (TP_BTF) by `backstop`, the probe loaded by its own. `features` must have
/// passed `require`; `controls` (guard_common::CONTROL_* bits) are the connect hook's
/// controls to load; `destinations`, the size of the destination counter map where it
/// is made (a pinned one keeps its size).
pub fn load(
    features: &Features,
    state: &State,
    controls: u32,
    destinations: u32,
) -> anyhow::Result<Loaded> {
    let has_set_retval = u8::from(features.has(Feature::SetRetval));
    let offsets = if features.has(Feature::ListenerPerSyn) {
        super::btf::sock_offsets()
            .inspect_err(|e| log::warn!("listener fields in kernel BTF: {e:#}"))
            .ok()
    } else {
        None
    };
    let tick_clock = super::clock::tick_clock().context("measuring the kernel tick")?;
    // EbpfLoader::new() parses the kernel's BTF and keeps it private; the tracepoints'
    // load needs a parse of its own to find their types. The loader's is dropped before
    // that one is made, so that one is held at a time, and the loader is given it for
    // CO-RE relocations (the object has none; without BTF any would be skipped).
    let mut loader = EbpfLoader::new();
    loader.btf(None);
    let btf = Btf::from_sys_fs().context("reading kernel BTF from /sys/kernel/btf/vmlinux")?;
    loader.btf(Some(&btf));
    loader.override_global("TICK_CLOCK", &tick_clock, true);
    loader.override_global("HAS_SET_RETVAL", &has_set_retval, true);
    let sock_ops_comm = super::features::sock_ops_comm_loads()
        .inspect_err(|e| log::warn!("probing bpf_get_current_comm in sock_ops: {e:#}"))
        .unwrap_or(false);
    let comm_flag = u8::from(sock_ops_comm);
    loader.override_global("SOCK_OPS_COMM", &comm_flag, true);
    loader.override_global("CONTROLS", &controls, true);
    if let Some(o) = &offsets {
        loader.override_global("SOCK_OFFSETS", o, true);
    }
    loader.map_max_entries(map::COUNTERS, destinations);
    for name in map::PINNED {
        loader.map_pin_path(name, state.map_path(name));
    }
    let mut ebpf = loader.load(OBJECT).context("loading the eBPF object")?;
    if state.adopted {
        warn_pinned_size(state, destinations);
    }
    let mut programs: BTreeMap<&str, &mut Program> = ebpf.programs_mut().collect();
    let connect4 = take(&mut programs, program::CONNECT4)?;
    // The connect programs are most of the verifier's time (many paths each, and more
    // on some kernels): connect4 is verified on a thread of its own, beside the others.
    let per_syn = std::thread::scope(|s| {
        let connect4 = s.spawn(|| load_connect(program::CONNECT4, connect4));
        let rest = load_others(&mut programs, offsets.is_some(), &btf);
        connect4
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
        rest
    })?;
    drop(programs);
    Ok(Loaded {
        ebpf,
        sock_ops_comm,
        per_syn,
    })
}

/// The program `name`, taken out of `programs`.
fn take<'a>(
    programs: &mut BTreeMap<&str, &'a mut Program>,
    name: &str,
) -> anyhow::Result<&'a mut Program> {
    programs
        .remove(name)
        .with_context(|| format!("program {name} missing from the eBPF object"))
}

/// Loads connect program `name`.
fn load_connect(name: &str, prog: &mut Program) -> anyhow::Result<()> {
    let prog: &mut CgroupSockAddr = prog.try_into()?;
    let started = std::time::Instant::now();
    prog.load().with_context(|| format!("loading {name}"))?;
    // The verifier's work, which grows with the paths through the program: the figure
    // to watch when the connect hooks grow (1,000,000 is the limit).
    log::debug!(
        "{name}: verified {:?} instructions in {:?}",
        prog.info()
            .ok()
            .and_then(|i| i.verified_instruction_count()),
        started.elapsed()
    );
    Ok(())
}

/// Loads every program but connect4 (the tracepoints against `btf`, the kernel's);
/// returns whether the per-SYN listener program loaded (`per_syn_offsets`: the kernel's
/// BTF gave its socket offsets), else the polled one did.
fn load_others(
    programs: &mut BTreeMap<&str, &mut Program>,
    per_syn_offsets: bool,
    btf: &Btf,
) -> anyhow::Result<bool> {
    load_connect(program::CONNECT6, take(programs, program::CONNECT6)?)?;
    for name in CGROUP_SOCK {
        let prog: &mut CgroupSock = take(programs, name)?.try_into()?;
        prog.load().with_context(|| format!("loading {name}"))?;
    }
    for name in SOCK_OPS {
        let prog: &mut SockOps = take(programs, name)?.try_into()?;
        prog.load().with_context(|| format!("loading {name}"))?;
    }
    let per_syn = per_syn_offsets
        && load_listener(
            take(programs, program::LISTENER_SHED)?,
            program::LISTENER_SHED,
        )
        .is_ok();
    if !per_syn {
        load_listener(
            take(programs, program::LISTENER_SHED_POLLED)?,
            program::LISTENER_SHED_POLLED,
        )?;
    }
    let name = program::ADJUST;
    let prog: &mut SchedClassifier = take(programs, name)?.try_into()?;
    prog.load().with_context(|| format!("loading {name}"))?;
    let name = program::DRILL_EGRESS;
    let prog: &mut CgroupSkb = take(programs, name)?.try_into()?;
    prog.load().with_context(|| format!("loading {name}"))?;
    let name = program::SEED;
    let prog: &mut CgroupSockopt = take(programs, name)?.try_into()?;
    prog.load().with_context(|| format!("loading {name}"))?;
    for (name, tracepoint) in TP_BTF {
        let prog: &mut BtfTracePoint = take(programs, name)?.try_into()?;
        prog.load(tracepoint, btf)
            .with_context(|| format!("loading {name}"))?;
    }
    Ok(per_syn)
}

/// Loads the listener program `name`; a per-SYN one the verifier refuses is logged, and
/// the caller loads the polled one.
fn load_listener(prog: &mut Program, name: &str) -> anyhow::Result<()> {
    let prog: &mut SchedClassifier = prog.try_into()?;
    prog.load()
        .with_context(|| format!("loading {name}"))
        .inspect_err(|e| log::warn!("{e:#}"))
}

/// The listener program that `load` loaded.
fn loaded_listener(ebpf: &mut Ebpf) -> anyhow::Result<&mut SchedClassifier> {
    for name in [program::LISTENER_SHED, program::LISTENER_SHED_POLLED] {
        let prog: &mut SchedClassifier = program(ebpf, name)?.try_into()?;
        if prog.fd().is_ok() {
            return Ok(program(ebpf, name)?.try_into()?);
        }
    }
    bail!("no listener program loaded")
}

/// Attaches the loaded listener program to an interface's ingress, in the calling
/// thread's network namespace: a tcx link when `tcx`, else a filter on a clsact qdisc.
/// The link is handed to the caller, out of aya's table of the program's links: aya
/// knows a clsact filter by interface index, priority and handle, and `lo` has index 1
/// in every namespace, so in that table a second namespace's `lo` would be refused as
/// "already attached". Detach it with `detach_listener`, in the same namespace.
pub fn attach_listener(
    ebpf: &mut Ebpf,
    iface: &str,
    tcx: bool,
) -> anyhow::Result<SchedClassifierLink> {
    let prog = loaded_listener(ebpf)?;
    let options = if tcx {
        TcAttachOptions::TcxOrder(LinkOrder::default())
    } else {
        // Already there is fine.
        let _ = aya::programs::tc::qdisc_add_clsact(iface);
        TcAttachOptions::Netlink(NlOptions::default())
    };
    let id = prog.attach_with_options(iface, TcAttachType::Ingress, options)?;
    Ok(prog.take_link(id)?)
}

/// Detaches a link of `attach_listener`, in the calling thread's network namespace (a
/// clsact filter is removed by netlink there; it would outlive the process).
pub fn detach_listener(link: SchedClassifierLink) -> anyhow::Result<()> {
    Ok(aya::programs::links::Link::detach(link)?)
}

/// Attaches `drill_egress` to the egress of the cgroup at `dir`, for as long as the
/// caller keeps the link (it is not pinned: a daemon that exits takes it along).
pub fn attach_drill_egress(
    ebpf: &mut Ebpf,
    dir: &std::path::Path,
) -> anyhow::Result<CgroupSkbLink> {
    let cgroup = std::fs::File::open(dir).with_context(|| format!("opening {}", dir.display()))?;
    let prog: &mut CgroupSkb = program(ebpf, program::DRILL_EGRESS)?.try_into()?;
    let id = prog.attach(
        &cgroup,
        CgroupSkbAttachType::Egress,
        CgroupAttachMode::Single,
    )?;
    Ok(prog.take_link(id)?)
}

pub fn program<'a>(
    ebpf: &'a mut Ebpf,
    name: &str,
) -> anyhow::Result<&'a mut aya::programs::Program> {
    ebpf.program_mut(name)
        .with_context(|| format!("program {name} missing from the eBPF object"))
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

/// Says so when the adopted destination counter map's size is not the one asked for:
/// aya adopts a pinned map as it is, whatever size the loader asks.
fn warn_pinned_size(state: &State, destinations: u32) {
    let path = state.map_path(map::COUNTERS);
    match aya::maps::MapInfo::from_pin(&path).map(|i| i.max_entries()) {
        Ok(held) if held != destinations => log::warn!(
            "the pinned destination counters ({}) hold {held} destinations, not the \
             {destinations} asked (--max-destinations): a pinned map keeps its size until \
             `connguard stop` removes the state",
            path.display()
        ),
        Ok(_) => {}
        Err(e) => log::warn!("reading {}: {e}", path.display()),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use guard_common::names;

    use super::OBJECT;

    /// The names the daemon looks up are exactly those the eBPF crate declares.
    #[test]
    fn the_object_holds_exactly_the_named_maps_and_programs() {
        let obj = aya_obj::Object::parse(OBJECT).expect("parse the embedded object");
        let maps: BTreeSet<&str> = obj
            .maps
            .keys()
            .map(String::as_str)
            .filter(|n| !n.starts_with('.'))
            .collect();
        assert_eq!(maps, names::map::ALL.iter().copied().collect());
        let programs: BTreeSet<&str> = obj.programs.keys().map(String::as_str).collect();
        assert_eq!(programs, names::program::ALL.iter().copied().collect());
    }
}
