//! The host-wide tracepoint programs, attached only while some socket may need them
//! (guard-ebpf/src/release.rs and callers.rs say why each): `sock_set_state` backs the
//! sock_ops state callback up where the kernel refuses the state callback option from
//! cgroup programs (probed at start, `probe_state_cb`), and once another sock_ops program
//! has been loaded on the host (`ForeignSockOps`, polled) for as long as the pinned state
//! lives: the flags it replaced stay replaced on the sockets it saw, after it is gone
//! and across restarts; and while a listener guard has per-caller budgets, which it
//! counts with `caller_destroy`. Traffic connguard does not govern otherwise runs none
//! of connguard's programs.
use std::{
    collections::BTreeMap,
    fs::File,
    io,
    os::fd::{AsFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
};

use anyhow::Context;
use aya::{
    Ebpf,
    programs::{BtfTracePoint, CgroupAttachMode, CgroupSockopt, links::FdLink},
};
use guard_common::{
    PROBE_STATE_CB, SOL_CONNGUARD,
    names::program::{CALLER_DESTROY, SOCK_SET_STATE, SOCK_STATE, STATE_CB_PROBE},
};

use super::{
    object::program,
    state::Pin,
    syscall::{BPF_PROG_TYPE_SOCK_OPS, prog_fd, prog_next_id, prog_type_and_name},
};

/// The host-wide programs' links this daemon attached, pinned in the links directory as
/// `PROGRAM-LINKID`.
pub struct Tracepoints {
    dir: PathBuf,
    pins: Vec<(&'static str, Pin)>,
}

impl Tracepoints {
    pub fn new(dir: PathBuf) -> Self {
        Tracepoints {
            dir,
            pins: Vec::new(),
        }
    }

    /// Attaches the programs of `wanted` not attached, and detaches the others.
    fn set(&mut self, ebpf: &mut Ebpf, wanted: &[&'static str]) -> anyhow::Result<()> {
        let (keep, gone): (Vec<_>, Vec<_>) = std::mem::take(&mut self.pins)
            .into_iter()
            .partition(|(name, _)| wanted.contains(name));
        self.pins = keep;
        for (_, pin) in gone {
            pin.unpin();
        }
        for name in wanted {
            if self.pins.iter().any(|(n, _)| n == name) {
                continue;
            }
            let prog: &mut BtfTracePoint = program(ebpf, name)?.try_into()?;
            let link = prog.attach().with_context(|| format!("attaching {name}"))?;
            let link: FdLink = prog.take_link(link)?.into();
            let id = link.info()?.id();
            let pin = Pin::new(link, self.dir.join(format!("{name}-{id}")))?;
            self.pins.push((name, pin));
        }
        Ok(())
    }

    /// The programs attached, by name.
    pub fn attached(&self) -> Vec<&'static str> {
        self.pins.iter().map(|(n, _)| *n).collect()
    }

    /// Detaches the host-wide programs' links pinned by daemons before this one: once
    /// this daemon's policy is in force and its own are attached. Until then both run,
    /// and the release each makes is a swap only one wins.
    pub fn remove_old(&self) -> anyhow::Result<()> {
        for old in std::fs::read_dir(&self.dir)?.flatten() {
            let path = old.path();
            let name = old.file_name().to_string_lossy().into_owned();
            let host_wide = [SOCK_SET_STATE, CALLER_DESTROY]
                .iter()
                .any(|prog| name.starts_with(&format!("{prog}-")));
            if host_wide && !self.pins.iter().any(|(_, p)| p.path() == path) {
                std::fs::remove_file(&path).with_context(|| {
                    format!("removing the old tracepoint link {}", path.display())
                })?;
            }
        }
        Ok(())
    }
}

/// The directory (bpffs holds directories and pins, no files) in the state's root that
/// says another sock_ops program has been seen since the state was created.
const FOREIGN_SEEN: &str = "foreign-sock-ops-seen";

/// What the host-wide programs are attached for.
pub struct Backstop {
    tracepoints: Tracepoints,
    /// `FOREIGN_SEEN` in the state's root.
    seen_mark: PathBuf,
    /// The kernel takes TCP_BPF_SOCK_OPS_CB_FLAGS from connect4 (`probe_state_cb`); None
    /// when the probe could not run.
    state_cb: Option<bool>,
    /// sock_ops programs may call bpf_get_current_comm (else `sock_state` leaves a failed
    /// port search to the tracepoint, which names the caller).
    sock_ops_comm: bool,
    /// A listener guard of the policy in force has per-caller budgets.
    per_source: bool,
    /// Other sock_ops programs loaded on the host.
    foreign: ForeignSockOps,
    /// One has been seen since the state was created (`FOREIGN_SEEN` exists).
    foreign_seen: bool,
    /// What was attached has been logged once.
    logged: bool,
}

impl Backstop {
    /// `root`: the state's root directory.
    pub fn new(
        tracepoints: Tracepoints,
        root: &Path,
        state_cb: Option<bool>,
        sock_ops_comm: bool,
    ) -> Self {
        let seen_mark = root.join(FOREIGN_SEEN);
        Backstop {
            tracepoints,
            foreign_seen: seen_mark.is_dir(),
            seen_mark,
            state_cb,
            sock_ops_comm,
            per_source: false,
            foreign: ForeignSockOps::default(),
            logged: false,
        }
    }

    /// Why `sock_set_state` is attached (empty: it is not), for the log and `stats`.
    pub fn reasons(&self) -> Vec<String> {
        let mut why = Vec::new();
        match self.state_cb {
            Some(true) => {}
            Some(false) => why.push(
                "the kernel refuses TCP_BPF_SOCK_OPS_CB_FLAGS from cgroup programs (Linux 6.12 takes it)"
                    .into(),
            ),
            None => why.push("the probe of TCP_BPF_SOCK_OPS_CB_FLAGS failed (see the log)".into()),
        }
        if !self.sock_ops_comm {
            why.push(
                "sock_ops programs cannot call bpf_get_current_comm on this kernel: the \
                 tracepoint counts a failed port search with the caller's name"
                    .into(),
            );
        }
        for (id, name) in &self.foreign.programs {
            why.push(format!(
                "another sock_ops program is loaded (id {id}, {name:?})"
            ));
        }
        if self.foreign.programs.is_empty() && self.foreign_seen {
            why.push(
                "another sock_ops program was loaded since the state was created: sockets whose \
                 state callback it turned off may still be open (until `connguard stop`)"
                    .into(),
            );
        }
        if self.per_source {
            why.push("a listener guard has per-caller budgets".into());
        }
        why
    }

    /// Reads which other sock_ops programs are loaded (`ForeignSockOps::poll`), and
    /// marks the state the first time one is; true when `apply` has work: the reasons
    /// changed, or an attach failed before.
    pub fn poll_foreign(&mut self) -> anyhow::Result<bool> {
        let before = self.reasons();
        self.foreign.poll()?;
        if !self.foreign.programs.is_empty() && !self.foreign_seen {
            std::fs::create_dir(&self.seen_mark)
                .or_else(|e| match e.kind() {
                    io::ErrorKind::AlreadyExists => Ok(()),
                    _ => Err(e),
                })
                .with_context(|| format!("creating {}", self.seen_mark.display()))?;
            self.foreign_seen = true;
        }
        Ok(self.reasons() != before || self.tracepoints.attached() != self.wanted())
    }

    /// Whether a listener guard of the policy in force has per-caller budgets; `apply`
    /// attaches or detaches to match.
    pub fn set_per_source(&mut self, per_source: bool) {
        self.per_source = per_source;
    }

    /// Attaches or detaches the programs to match the reasons; logs a change.
    pub fn apply(&mut self, ebpf: &mut Ebpf) -> anyhow::Result<()> {
        let wanted = self.wanted();
        let before = self.tracepoints.attached();
        self.tracepoints.set(ebpf, &wanted)?;
        if before != wanted || !self.logged {
            self.logged = true;
            if wanted.is_empty() {
                log::info!(
                    "host-wide tracepoint programs: none attached (the state callback alone releases)"
                );
            } else {
                log::info!(
                    "host-wide tracepoint programs: {} attached, because {}",
                    wanted.join(", "),
                    self.reasons().join("; ")
                );
            }
        }
        Ok(())
    }

    /// The programs the reasons want attached.
    fn wanted(&self) -> Vec<&'static str> {
        let mut wanted = Vec::new();
        if !self.reasons().is_empty() {
            wanted.push(SOCK_SET_STATE);
        }
        if self.per_source {
            wanted.push(CALLER_DESTROY);
        }
        wanted
    }

    pub fn tracepoints(&self) -> &Tracepoints {
        &self.tracepoints
    }
}

/// Whether the kernel takes TCP_BPF_SOCK_OPS_CB_FLAGS from a cgroup program, as connect4
/// asks for a socket's state callback: the `state_cb_probe` program, attached to the
/// daemon's own cgroup (under the cgroup2 mount `root`) for the moment of one
/// setsockopt on a socket of its own. None, logged, when the probe cannot run.
pub fn probe_state_cb(ebpf: &mut Ebpf, root: &Path) -> Option<bool> {
    try_probe_state_cb(ebpf, root)
        .inspect_err(|e| log::warn!("probing the state callback option: {e:#}"))
        .ok()
}

fn try_probe_state_cb(ebpf: &mut Ebpf, root: &Path) -> anyhow::Result<bool> {
    let own = std::fs::read_to_string("/proc/self/cgroup").context("reading /proc/self/cgroup")?;
    let rel = own
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .context("no cgroup v2 line in /proc/self/cgroup")?;
    let dir = root.join(rel.trim_start_matches('/'));
    let cgroup = File::open(&dir).with_context(|| format!("opening {}", dir.display()))?;
    let prog: &mut CgroupSockopt = program(ebpf, STATE_CB_PROBE)?.try_into()?;
    prog.load().context("loading the probe")?;
    let link = prog
        // A cgroup link takes no flags: it runs beside the cgroup's other programs.
        .attach(&cgroup, CgroupAttachMode::Single)
        .with_context(|| format!("attaching the probe to {}", dir.display()))?;
    let link = prog.take_link(link)?;
    let answer = ask_probe();
    drop(link);
    let _ = prog.unload();
    match answer {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => Ok(false),
        Err(e) => Err(e).context("the probe's setsockopt"),
    }
}

/// setsockopt(SOL_CONNGUARD, PROBE_STATE_CB) on a new TCP socket.
fn ask_probe() -> io::Result<()> {
    // SAFETY: plain socket(2); the fd is ours.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, libc::IPPROTO_TCP) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new fd, ours to close.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let value: i32 = 0;
    // SAFETY: `value` is valid for its size for the call.
    let rc = unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            SOL_CONNGUARD,
            PROBE_STATE_CB,
            (&raw const value).cast(),
            std::mem::size_of::<i32>() as u32,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The sock_ops programs loaded on the host other than connguard's (named `sock_state`,
/// of this daemon or one before it), by id. Program ids grow as programs load, so a poll
/// asks the kernel only for ids after the last it saw, and whether the foreign ones it
/// knows are still loaded; every `FULL_EVERY` polls it reads every id again (ids wrap
/// at 2^31).
#[derive(Default)]
struct ForeignSockOps {
    last_id: u32,
    /// By id, with their names.
    programs: BTreeMap<u32, String>,
    polls: u32,
}

const FULL_EVERY: u32 = 100;

impl ForeignSockOps {
    /// Reads what loaded or unloaded since the last poll.
    fn poll(&mut self) -> io::Result<()> {
        self.polls = self.polls.wrapping_add(1);
        if self.polls % FULL_EVERY == 1 {
            self.last_id = 0;
            self.programs.clear();
        }
        // Gone only when the kernel says so (ENOENT); any other error keeps it.
        self.programs.retain(
            |id, _| !matches!(prog_fd(*id), Err(e) if e.raw_os_error() == Some(libc::ENOENT)),
        );
        while let Some(id) = prog_next_id(self.last_id)? {
            self.last_id = id;
            let Ok(fd) = prog_fd(id) else {
                continue;
            };
            let Ok((kind, name)) = prog_type_and_name(fd.as_fd()) else {
                continue;
            };
            if kind == BPF_PROG_TYPE_SOCK_OPS && name != SOCK_STATE {
                self.programs.insert(id, name);
            }
        }
        Ok(())
    }
}
