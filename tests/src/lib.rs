//! Test harness for connguard on the real kernel: test cgroups and network namespaces
//! that clean up after themselves, a daemon per test, a counting TCP server, and the
//! guard-probe client started inside a cgroup.
//!
//! Everything here needs root and cgroup v2; a missing prerequisite panics with the
//! reason (a test never skips silently).
#[cfg(feature = "runtimes")]
pub mod containerd;
pub mod etcd;
pub mod fleet;
#[cfg(feature = "runtimes")]
pub mod podman;
#[cfg(feature = "runtimes")]
pub mod runtimes;

use std::{
    io::{BufRead, BufReader, Read},
    net::{SocketAddr, TcpListener},
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use connguard_api::{
    events::EventRecord,
    listeners::ListenersReport,
    policy::{Limited, Listener, Mode, Policy, Rule, Scope},
    stats::{DestStats, ScopeStats, Snapshot},
};
use serde::de::DeserializeOwned;

pub mod probe;

pub use guard_common::STATE_ROOT;
pub use probe::{Outcome, Probe, ServePort};

/// CLOCK_MONOTONIC in ms: one clock for a test and the probes it starts.
pub fn monotonic_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000
}

/// Panics unless we are root on a host with cgroup v2.
pub fn require_prerequisites() {
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "connguard's integration tests need root: they load eBPF programs and create cgroups"
    );
    static SWEPT: std::sync::Once = std::sync::Once::new();
    SWEPT.call_once(|| sweep(&cgroup2_mount().join("connguard-test")));
}

/// Removes the test cgroups of test processes that are gone (a run killed before its
/// cleanup), so that they cost later daemons nothing: their names carry the pid
/// (`unique`), and a gone process's are emptied (cgroup.kill) and removed, deepest
/// first.
fn sweep(dir: &Path) {
    fn remove(dir: &Path) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove(&e.path());
            }
        }
        let _ = std::fs::write(dir.join("cgroup.kill"), "1");
        let _ = std::fs::remove_dir(dir);
    }
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let pid = name.rsplit('-').nth(1).and_then(|p| p.parse::<u32>().ok());
        if pid.is_some_and(|p| !Path::new(&format!("/proc/{p}")).exists()) {
            remove(&e.path());
        }
    }
}

pub fn cgroup2_mount() -> PathBuf {
    let info = std::fs::read_to_string("/proc/self/mountinfo").expect("read mountinfo");
    info.lines()
        .find_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            (right.split_whitespace().next()? == "cgroup2")
                .then(|| PathBuf::from(left.split_whitespace().nth(4).unwrap()))
        })
        .expect("cgroup v2 is not mounted: connguard needs the unified hierarchy")
}

/// A name no other test of this run uses.
pub fn unique(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// The workspace's target/release directory (built by `cargo xtask test`).
pub fn release_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release")
}

pub fn connguard_bin() -> PathBuf {
    let bin = std::env::var_os("CONNGUARD_BIN")
        .map_or_else(|| release_dir().join("connguard"), PathBuf::from);
    assert!(
        bin.exists(),
        "{} is missing: run `cargo xtask test` (it builds it first)",
        bin.display()
    );
    bin
}

/// A cgroup v2 directory under `<mount>/connguard-test/`, removed (with whatever runs
/// in it killed) on drop.
pub struct Cgroup {
    pub path: PathBuf,
    /// Path below the cgroup2 mount, as a policy names it.
    pub rel: String,
}

impl Cgroup {
    pub fn new(prefix: &str) -> Cgroup {
        require_prerequisites();
        let rel = format!("connguard-test/{}", unique(prefix));
        let path = cgroup2_mount().join(&rel);
        std::fs::create_dir_all(&path).unwrap_or_else(|e| panic!("mkdir {}: {e}", path.display()));
        Cgroup { path, rel }
    }

    /// A cgroup below this one, named `name` (drop it before its parent).
    pub fn child(&self, name: &str) -> Cgroup {
        let rel = format!("{}/{name}", self.rel);
        let path = self.path.join(name);
        std::fs::create_dir(&path).unwrap_or_else(|e| panic!("mkdir {}: {e}", path.display()));
        Cgroup { path, rel }
    }

    /// A command that starts inside this cgroup.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        command_in(&self.path, program)
    }

    /// guard-probe running `probe` inside this cgroup, to its end; its outcome.
    pub fn probe(&self, probe: Probe) -> Outcome {
        probe_in(&self.path, probe)
    }

    /// guard-probe running a mode that prints its outcome, then holds its sockets
    /// (`Probe::Hold`, `Listen`, `Serve`, ...), inside this cgroup: they stay open until
    /// the returned Holder is dropped (which SIGKILLs the probe).
    pub fn hold(&self, probe: Probe) -> Holder {
        hold_in(&self.path, probe)
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let _ = std::fs::write(self.path.join("cgroup.kill"), "1");
        for _ in 0..50 {
            if std::fs::remove_dir(&self.path).is_ok() || !self.path.exists() {
                return;
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A command that starts inside the cgroup at `dir` (one a runtime made, say).
pub fn command_in(dir: &Path, program: impl AsRef<std::ffi::OsStr>) -> Command {
    let procs = dir.join("cgroup.procs");
    let mut cmd = Command::new(program);
    unsafe {
        cmd.pre_exec(move || std::fs::write(&procs, std::process::id().to_string()));
    }
    cmd
}

/// guard-probe running `probe` inside the cgroup at `dir`, to its end; its outcome.
pub fn probe_in(dir: &Path, probe: Probe) -> Outcome {
    let out = command_in(dir, probe_bin())
        .args(probe.args())
        .output()
        .expect("run guard-probe");
    parse_probe(&out, &probe)
}

/// guard-probe running a mode that holds its sockets (see `Cgroup::hold`) inside the
/// cgroup at `dir`.
pub fn hold_in(dir: &Path, probe: Probe) -> Holder {
    let mut child = command_in(dir, probe_bin())
        .args(probe.args())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run guard-probe");
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    let outcome = serde_json::from_str(&line)
        .unwrap_or_else(|e| panic!("guard-probe hold printed {line:?}: {e}"));
    Holder { child, outcome }
}

/// guard-probe: beside the test binaries (target/*/deps/..), or the release build that
/// `cargo xtask build` makes (for xtask's demo and bench).
pub fn probe_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let beside_tests = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join("guard-probe"));
    let bin = beside_tests
        .filter(|b| b.exists())
        .unwrap_or_else(|| release_dir().join("guard-probe"));
    assert!(
        bin.exists(),
        "{} is missing: run `cargo xtask build`",
        bin.display()
    );
    bin
}

fn parse_probe(out: &Output, probe: &Probe) -> Outcome {
    assert!(
        out.status.success(),
        "guard-probe {probe:?} failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "guard-probe output {:?}: {e}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// A guard-probe holding connections; killed on drop.
pub struct Holder {
    pub child: Child,
    pub outcome: Outcome,
}

impl Holder {
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A running `connguard run` with its own policy file and control socket; stopped with
/// SIGTERM on drop, and the state it pinned removed (`connguard stop`), unless it was
/// stopped with `exit_keeping_state`. Each daemon starts from no pinned state but one
/// started `adopting`. Started by `Daemon::builder(policy)...start()`.
pub struct Daemon {
    /// `--state-dir`, when not the default.
    state_dir: Option<PathBuf>,
    keep_state: bool,
    /// Audit corrections the test makes happen; any other is a failure, checked on drop
    /// (every daemon audits every second).
    pub expected_corrections: u64,
    child: Child,
    pub policy: PathBuf,
    pub socket: PathBuf,
    dir: PathBuf,
    pub log: Arc<std::sync::Mutex<String>>,
    /// Where Prometheus metrics are served, when started with `metrics`.
    metrics: Option<SocketAddr>,
}

/// How a `Daemon` is started: `Daemon::builder(policy)`, its options, then `start`.
pub struct DaemonBuilder<'a> {
    policy: String,
    metrics: bool,
    args: Vec<String>,
    env: Vec<(String, std::ffi::OsString)>,
    without: Vec<String>,
    socket: Option<PathBuf>,
    adopt: bool,
    cgroup_namespace: Option<&'a Cgroup>,
    watch_policy: bool,
    policy_at: Option<PathBuf>,
    state_dir: Option<PathBuf>,
}

impl<'a> DaemonBuilder<'a> {
    /// A state directory in bpffs of its own (`--state-dir`), so that it runs beside
    /// other daemons (each on its own cgroups); it starts from none there.
    pub fn own_state(self) -> Self {
        self.state_dir(Path::new("/sys/fs/bpf").join(unique("connguard-test")))
    }

    /// The state directory `dir` (`--state-dir`): with `adopting`, the one a daemon
    /// before it left with `exit_keeping_state`.
    pub fn state_dir(mut self, dir: PathBuf) -> Self {
        self.state_dir = Some(dir);
        self
    }

    /// Lets the daemon reload by itself when its policy file changes; others run with
    /// --no-watch-policy, so that a test's rewrite and reload is one reload.
    pub fn watching_policy(mut self) -> Self {
        self.watch_policy = true;
        self
    }

    /// The policy file at `path`, which the caller has written (the policy given to
    /// `builder` is then unused): a symlink, a ConfigMap volume's layout.
    pub fn policy_at(mut self, path: PathBuf) -> Self {
        self.policy_at = Some(path);
        self
    }

    /// Serves Prometheus metrics on a free loopback port (`Daemon::metrics`).
    pub fn metrics(mut self) -> Self {
        self.metrics = true;
        self
    }

    /// More arguments for `connguard run`.
    pub fn args(mut self, args: &[&str]) -> Self {
        self.args.extend(args.iter().map(|a| a.to_string()));
        self
    }

    /// `name=value` in the daemon's environment.
    pub fn env(mut self, name: &str, value: impl AsRef<std::ffi::OsStr>) -> Self {
        self.env
            .push((name.to_string(), value.as_ref().to_os_string()));
        self
    }

    /// The kernel feature `feature` (a name of `connguard kernel`) treated as absent, as
    /// on a kernel without it (CONNGUARD_WITHOUT).
    pub fn without(mut self, feature: &str) -> Self {
        self.without.push(feature.to_string());
        self
    }

    /// The control socket at `path` (default: in a directory of the daemon's own).
    pub fn socket(mut self, path: PathBuf) -> Self {
        self.socket = Some(path);
        self
    }

    /// Adopts the state pinned by a daemon before it (`exit_keeping_state`), where
    /// others start from none.
    pub fn adopting(mut self) -> Self {
        self.adopt = true;
        self
    }

    /// In a cgroup namespace rooted at `cgroup`, as in a container: in a mount namespace
    /// of its own, cgroup2 is mounted again (the namespace's view, rooted at `cgroup`)
    /// at the host's cgroup2 mount point, on a tmpfs that hides the host's (the same
    /// file system twice on one mount point is refused); its policy's paths are below
    /// `cgroup`.
    pub fn in_cgroup_namespace(mut self, cgroup: &'a Cgroup) -> Self {
        self.cgroup_namespace = Some(cgroup);
        self
    }

    /// Starts the daemon and waits until it says it is ready.
    pub fn start(self) -> Daemon {
        require_prerequisites();
        if !self.adopt {
            remove_state(self.state_dir.as_deref());
        }
        let mut command = match self.cgroup_namespace {
            None => Command::new(connguard_bin()),
            Some(cgroup) => {
                let mut unshare = cgroup.command("unshare");
                unshare.args([
                    "--cgroup",
                    "--mount",
                    "--propagation",
                    "private",
                    "sh",
                    "-c",
                ]);
                unshare.arg(format!(
                    "mount -t tmpfs none {at} && mount -t cgroup2 none {at} && exec \"$0\" \"$@\"",
                    at = cgroup2_mount().display()
                ));
                unshare.arg(connguard_bin());
                unshare
            }
        };
        let dir = std::env::temp_dir().join(unique("connguard-test"));
        std::fs::create_dir_all(&dir).unwrap();
        let policy_path = match self.policy_at {
            Some(path) => path,
            None => {
                let path = dir.join("policy.toml");
                std::fs::write(&path, &self.policy).unwrap();
                path
            }
        };
        let socket = self.socket.unwrap_or_else(|| dir.join("connguard.sock"));
        let metrics = self
            .metrics
            .then(|| SocketAddr::from(([127, 0, 0, 1], free_port())));
        let given = |flag: &str| self.args.iter().any(|a| a == flag);
        let mut defaults = Vec::new();
        match metrics {
            Some(addr) => defaults.extend(["--metrics".to_string(), addr.to_string()]),
            None if !given("--metrics") => defaults.extend(["--metrics".into(), "off".into()]),
            None => {}
        }
        if !given("--audit") {
            defaults.extend(["--audit".into(), "1".into()]);
        }
        if !self.watch_policy {
            defaults.push("--no-watch-policy".into());
        }
        if let Some(dir) = &self.state_dir {
            defaults.extend(["--state-dir".into(), dir.display().to_string()]);
        }
        let mut child = command
            .arg("run")
            .arg("--policy")
            .arg(&policy_path)
            .arg("--socket")
            .arg(&socket)
            .args(defaults)
            .args(&self.args)
            .envs(self.env)
            .env("CONNGUARD_WITHOUT", self.without.join(","))
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("start connguard");
        let log = Arc::new(std::sync::Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        let log2 = log.clone();
        thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                // The daemon's line, not any word that ends in "ready" ("already"); in
                // the log before `start` returns.
                let ready = line.contains(" ready: ");
                log2.lock().unwrap().push_str(&(line + "\n"));
                if ready {
                    let _ = tx.send(());
                }
            }
        });
        let mut d = Daemon {
            state_dir: self.state_dir,
            keep_state: false,
            expected_corrections: 0,
            child,
            policy: policy_path,
            socket,
            dir,
            log,
            metrics,
        };
        // Generous: a policy on `/` walks every cgroup of the host before the daemon is
        // ready, which takes a slow guest tens of seconds with tens of thousands of them.
        if rx.recv_timeout(Duration::from_secs(60)).is_err() {
            let status = d.child.try_wait();
            panic!(
                "connguard did not get ready ({status:?}):\n{}",
                d.log.lock().unwrap()
            );
        }
        d
    }
}

impl Daemon {
    /// A daemon on `policy` (a `connguard_api::policy::Policy`, or policy text), to be
    /// configured, then started.
    pub fn builder<'a>(policy: impl ToString) -> DaemonBuilder<'a> {
        DaemonBuilder {
            policy: policy.to_string(),
            metrics: false,
            args: Vec::new(),
            env: Vec::new(),
            without: Vec::new(),
            socket: None,
            adopt: false,
            cgroup_namespace: None,
            watch_policy: false,
            policy_at: None,
            state_dir: None,
        }
    }

    /// The body of GET /metrics.
    pub fn metrics(&self) -> String {
        let (status, body) = self.get("/metrics");
        assert_eq!(status, 200, "{body}");
        body
    }

    /// GET `path` of the metrics listener: the status code and the body.
    pub fn get(&self, path: &str) -> (u16, String) {
        use std::io::Write;
        let mut conn =
            std::net::TcpStream::connect(self.metrics.expect("started with metrics")).unwrap();
        write!(conn, "GET {path} HTTP/1.0\r\n\r\n").unwrap();
        let mut text = String::new();
        conn.read_to_string(&mut text).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no status line: {text}"));
        (status, body.to_string())
    }

    /// Sends `signal` and waits for the daemon to exit, leaving its pinned state for
    /// the next daemon (`adopting`).
    pub fn exit_keeping_state(mut self, signal: i32) {
        if let Some(e) = self.audit_error() {
            panic!("{e}");
        }
        self.keep_state = true;
        unsafe { libc::kill(self.pid(), signal) };
        let until = Instant::now() + Duration::from_secs(10);
        while !matches!(self.child.try_wait(), Ok(Some(_))) {
            assert!(
                Instant::now() < until,
                "connguard did not exit on signal {signal}:\n{}",
                self.log.lock().unwrap()
            );
            thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// `connguard stats --json`.
    pub fn stats(&self) -> Snapshot {
        json_of("connguard stats --json", &self.cli(&["stats", "--json"]))
    }

    /// The scope named `name` from `stats --json`.
    pub fn scope(&self, name: &str) -> ScopeStats {
        let stats = self.stats();
        stats
            .scope(name)
            .cloned()
            .unwrap_or_else(|| panic!("no scope {name} in {stats:#?}"))
    }

    /// `connguard events --json --once`: the events the daemon keeps.
    pub fn events(&self) -> Vec<EventRecord> {
        let out = self.cli(&["events", "--json", "--once"]);
        assert!(
            out.status.success(),
            "connguard events: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("event {l:?}: {e}")))
            .collect()
    }

    /// `connguard listeners --json` for the network namespace of the file `netns`, with
    /// what this daemon adds (scopes, RSTs).
    pub fn listeners(&self, netns: &str) -> ListenersReport {
        json_of(
            "connguard listeners --json",
            &self.cli(&["listeners", "--json", "--netns", netns]),
        )
    }

    /// `connguard reload`.
    pub fn reload(&self) -> Output {
        self.cli(&["reload"])
    }

    /// Runs a connguard subcommand against this daemon's socket.
    pub fn cli(&self, args: &[&str]) -> Output {
        Command::new(connguard_bin())
            .args(args)
            .arg("--socket")
            .arg(&self.socket)
            .output()
            .expect("run connguard")
    }

    /// Polls the scope until `pred` holds or `timeout` passes; returns the last value.
    pub fn wait_scope(
        &self,
        name: &str,
        timeout: Duration,
        pred: impl Fn(&ScopeStats) -> bool,
    ) -> ScopeStats {
        let until = Instant::now() + timeout;
        loop {
            let s = self.scope(name);
            if pred(&s) || Instant::now() > until {
                return s;
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Daemon {
    /// Unless the audit corrected exactly what the test expected (at rest: nothing),
    /// what it did; asked of a running daemon.
    fn audit_error(&mut self) -> Option<String> {
        if thread::panicking() || !matches!(self.child.try_wait(), Ok(None)) {
            return None;
        }
        let out = self.cli(&["stats", "--json"]);
        let corrections = serde_json::from_slice::<Snapshot>(&out.stdout)
            .ok()?
            .audit_corrections;
        (corrections != self.expected_corrections).then(|| {
            format!(
                "the audit made {corrections} correction(s), {} expected: a count drifted\n{}",
                self.expected_corrections,
                self.log.lock().unwrap()
            )
        })
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let audit = self.audit_error();
        // Signal only a child not yet reaped (a reaped pid may belong to someone else).
        if let Ok(None) = self.child.try_wait() {
            unsafe { libc::kill(self.pid(), libc::SIGTERM) };
        }
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            thread::sleep(Duration::from_millis(20));
        }
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
        if !self.keep_state {
            remove_state(self.state_dir.as_deref());
        }
        if let Some(e) = audit {
            panic!("{e}");
        }
    }
}

/// `connguard stop` with no daemon: removes the programs and state a daemon pinned.
pub fn remove_pinned_state() {
    remove_state(None)
}

/// `remove_pinned_state` when dropped, a test's panic included: for the state a daemon
/// left in the default state directory when it exited keeping it
/// (`Daemon::exit_keeping_state`). While a daemon still holds the state, `connguard stop`
/// refuses, and the drop panics (or, during a panic, prints why).
pub struct PinnedState(());

impl PinnedState {
    /// The guard: the state is removed when it drops.
    #[must_use = "the state is removed when the guard drops"]
    pub fn removed_on_drop() -> PinnedState {
        PinnedState(())
    }
}

impl Drop for PinnedState {
    fn drop(&mut self) {
        remove_state(None);
    }
}

/// `remove_pinned_state` for the state directory `dir` (None: the default one). A
/// failure panics, or is printed while the thread already panics (a panic in a drop
/// during a panic aborts the test binary).
fn remove_state(dir: Option<&Path>) {
    match stop_without_daemon(dir) {
        Err(e) if thread::panicking() => eprintln!("{e}"),
        r => r.unwrap_or_else(|e| panic!("{e}")),
    }
}

/// Runs `connguard stop` with no daemon to ask, on the state directory `dir` (None: the
/// default one).
fn stop_without_daemon(dir: Option<&Path>) -> Result<(), String> {
    let mut stop = Command::new(connguard_bin());
    stop.args(["stop", "--socket", "/nonexistent/connguard.sock"]);
    if let Some(dir) = dir {
        stop.arg("--state-dir").arg(dir);
    }
    let out = stop
        .output()
        .map_err(|e| format!("run connguard stop: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "connguard stop: {}",
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// A TCP server in the test process (outside every test cgroup) that accepts, holds each
/// connection until the peer closes, and tracks current and highest concurrency.
pub struct Server {
    pub addr: SocketAddr,
    pub current: Arc<AtomicU64>,
    pub peak: Arc<AtomicU64>,
    pub accepted: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl Server {
    pub fn start(bind: &str) -> Server {
        let listener = TcpListener::bind(bind).unwrap_or_else(|e| panic!("bind {bind}: {e}"));
        let addr = listener.local_addr().unwrap();
        listener.set_nonblocking(true).unwrap();
        let (current, peak, accepted) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
        );
        let stop = Arc::new(AtomicBool::new(false));
        let (c, p, a, s) = (
            current.clone(),
            peak.clone(),
            accepted.clone(),
            stop.clone(),
        );
        thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((mut conn, _)) => {
                        conn.set_nonblocking(false).unwrap();
                        a.fetch_add(1, Ordering::SeqCst);
                        let now = c.fetch_add(1, Ordering::SeqCst) + 1;
                        p.fetch_max(now, Ordering::SeqCst);
                        let c = c.clone();
                        thread::spawn(move || {
                            let _ = conn.read(&mut [0u8; 64]);
                            // Count the close before our FIN can release the client.
                            c.fetch_sub(1, Ordering::SeqCst);
                            drop(conn);
                        });
                    }
                    Err(_) => thread::sleep(Duration::from_millis(1)),
                }
            }
        });
        Server {
            addr,
            current,
            peak,
            accepted,
            stop,
        }
    }

    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::SeqCst)
    }

    /// `start` inside the network namespace at `netns` (a namespace file): the listener
    /// is made there, by a thread that entered it.
    pub fn start_in(netns: &str, bind: &str) -> Server {
        let (netns, bind) = (netns.to_string(), bind.to_string());
        thread::spawn(move || {
            let ns = std::fs::File::open(&netns).unwrap_or_else(|e| panic!("{netns}: {e}"));
            // SAFETY: setns on this thread only, with a namespace file we opened.
            let r =
                unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&ns), libc::CLONE_NEWNET) };
            assert_eq!(r, 0, "setns {netns}: {}", std::io::Error::last_os_error());
            Server::start(&bind)
        })
        .join()
        .unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// A network namespace made for one test (`ip netns add`), deleted on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn new(prefix: &str) -> Netns {
        let name = unique(prefix);
        run("ip", &["netns", "add", &name]);
        Netns { name }
    }

    pub fn path(&self) -> String {
        format!("/run/netns/{}", self.name)
    }

    /// A namespace with `lo` up, and a veth pair that swallows whatever is sent to
    /// 192.0.2.2: bh0 has the address and a static neighbour entry, its peer bh1 has
    /// no address and forwarding is off, so SYNs there are dropped and never answered
    /// (what `guard-probe mixed` times out against).
    pub fn with_blackhole(prefix: &str) -> Netns {
        let ns = Netns::new(prefix);
        ns.exec("ip", &["link", "set", "lo", "up"]);
        ns.exec(
            "ip",
            &["link", "add", "bh0", "type", "veth", "peer", "name", "bh1"],
        );
        ns.exec("ip", &["addr", "add", "192.0.2.1/24", "dev", "bh0"]);
        ns.exec("ip", &["link", "set", "bh0", "up"]);
        ns.exec("ip", &["link", "set", "bh1", "up"]);
        let neigh = ["neigh", "add", "192.0.2.2", "lladdr", "02:00:00:00:00:02"];
        ns.exec(
            "ip",
            &[&neigh[..], &["dev", "bh0", "nud", "permanent"]].concat(),
        );
        ns
    }

    /// `Tcp: ActiveOpens` of the namespace (/proc/net/snmp): connections that sent a SYN.
    pub fn active_opens(&self) -> u64 {
        let text = self.output("cat", &["/proc/net/snmp"]);
        let mut tcp = text.lines().filter(|l| l.starts_with("Tcp:"));
        let (names, values) = (
            tcp.next().expect("Tcp: names"),
            tcp.next().expect("Tcp: values"),
        );
        let i = names
            .split_whitespace()
            .position(|w| w == "ActiveOpens")
            .expect("ActiveOpens in /proc/net/snmp");
        values
            .split_whitespace()
            .nth(i)
            .expect("ActiveOpens value")
            .parse()
            .expect("a number")
    }

    /// Runs `cmd args` inside the namespace; panics on failure.
    pub fn exec(&self, cmd: &str, args: &[&str]) {
        run("ip", &self.exec_args(cmd, args));
    }

    /// The standard output of `cmd args` run inside the namespace; its standard error
    /// goes to the test's, and a failure is printed there, not raised (the output may
    /// be a failure's message).
    pub fn output(&self, cmd: &str, args: &[&str]) -> String {
        let all = self.exec_args(cmd, args);
        let out = Command::new("ip")
            .args(&all)
            .stderr(std::process::Stdio::inherit())
            .output()
            .unwrap_or_else(|e| panic!("ip {}: {e}", all.join(" ")));
        if !out.status.success() {
            eprintln!("ip {}: {}", all.join(" "), out.status);
        }
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `ip` arguments that run `cmd args` inside the namespace.
    fn exec_args<'a>(&'a self, cmd: &'a str, args: &[&'a str]) -> Vec<&'a str> {
        let mut all = vec!["netns", "exec", &self.name, cmd];
        all.extend_from_slice(args);
        all
    }

    /// A server netns and a client netns joined by a veth pair: 192.0.2.1 (server, dev
    /// vs) and 192.0.2.2 (client, dev vc), both with loopback up.
    pub fn veth_pair() -> (Netns, Netns) {
        let (server, client) = (Netns::new("cgsrv"), Netns::new("cgcli"));
        Netns::join(&server, &client);
        (server, client)
    }

    /// Joins two namespaces by a veth pair as `veth_pair` does, loopback up in both.
    pub fn join(server: &Netns, client: &Netns) {
        Netns::link(
            server,
            client,
            ("vs", "192.0.2.1/24"),
            ("vc", "192.0.2.2/24"),
        );
    }

    /// Joins two namespaces by a veth pair: device and address (a CIDR) in `server`,
    /// then in `client`; loopback up in both.
    pub fn link(
        server: &Netns,
        client: &Netns,
        (sdev, saddr): (&str, &str),
        (cdev, caddr): (&str, &str),
    ) {
        server.exec(
            "ip",
            &["link", "add", sdev, "type", "veth", "peer", "name", cdev],
        );
        server.exec("ip", &["link", "set", cdev, "netns", &client.name]);
        server.exec("ip", &["addr", "add", saddr, "dev", sdev]);
        client.exec("ip", &["addr", "add", caddr, "dev", cdev]);
        for (ns, dev) in [(server, sdev), (client, cdev)] {
            ns.exec("ip", &["link", "set", "lo", "up"]);
            ns.exec("ip", &["link", "set", dev, "up"]);
        }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Quiet: a test may have deleted it already.
        let _ = Command::new("ip")
            .args(["netns", "delete", &self.name])
            .stderr(Stdio::null())
            .status();
    }
}

pub fn run(cmd: &str, args: &[&str]) {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The JSON a successful connguard command printed, as `T`; `what` names the command
/// in a failure.
pub fn json_of<T: DeserializeOwned>(what: &str, out: &Output) -> T {
    assert!(
        out.status.success(),
        "{what}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{what} printed {:?}: {e}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// The destinations of a scope (from `stats --json`) with connections still active.
pub fn active_destinations(scope: &ScopeStats) -> Vec<&DestStats> {
    scope
        .destinations
        .iter()
        .filter(|d| d.counts.active != 0)
        .collect()
}

/// The row of `dst` in the `destinations` of a scope from `stats --json`.
pub fn destination<'a>(scope: &'a ScopeStats, dst: &str) -> &'a DestStats {
    scope
        .destination(dst)
        .unwrap_or_else(|| panic!("no destination {dst} in {scope:#?}"))
}

/// A scope named `scope` on `cgroup` in `mode`, with one rule `server` toward `dst` with
/// an endpoint budget of `max`.
pub fn budget_scope(scope: &str, cgroup: &str, mode: Mode, dst: &SocketAddr, max: u64) -> Scope {
    Scope::new(scope, cgroup).mode(mode).rule(
        Rule::new("server")
            .dst([dst.ip().to_string()])
            .ports([dst.port()])
            .max_connections(max),
    )
}

/// A policy of `budget_scope` alone.
pub fn budget_policy(scope: &str, cgroup: &str, mode: Mode, dst: &SocketAddr, max: u64) -> Policy {
    Policy::new().scope(budget_scope(scope, cgroup, mode, dst, max))
}

/// A listener guard `api` on port 8080 in `ns`, shedding past 80 % of the accept queue.
pub fn listener_guard(ns: &Netns, mode: Mode) -> Listener {
    Listener::new("api", [8080])
        .netns(&ns.path())
        .accept_queue_watermark(0.8)
        .mode(mode)
}

/// A policy of `listener_guard` alone.
pub fn listener_policy(ns: &Netns, mode: Mode) -> Policy {
    Policy::new().listener(listener_guard(ns, mode))
}

/// The variable that sets the restart churn test's length in seconds (default 120), which
/// the kernel matrix's runner sets in each guest.
pub const CHURN_SECONDS_VAR: &str = "CONNGUARD_CHURN_SECONDS";

/// The restart churn test's length: CHURN_SECONDS_VAR, else 2 minutes.
pub fn churn_length() -> Duration {
    Duration::from_secs(number_from_env(CHURN_SECONDS_VAR, 120))
}

/// The variable that sets how many cgroups the whole-host policy test makes (default
/// 50,000), which the kernel matrix's runner sets in each guest.
pub const WHOLE_HOST_CGROUPS_VAR: &str = "CONNGUARD_WHOLE_HOST_CGROUPS";

/// How many cgroups the whole-host policy test makes: WHOLE_HOST_CGROUPS_VAR, else 50,000.
pub fn whole_host_cgroups() -> u64 {
    number_from_env(WHOLE_HOST_CGROUPS_VAR, 50_000)
}

/// The number in the environment variable `var`, else `default`; a test's setting, so
/// anything else in it ends the test.
fn number_from_env(var: &str, default: u64) -> u64 {
    std::env::var(var).map_or(default, |s| {
        s.parse()
            .unwrap_or_else(|_| panic!("{var}={s}: not a whole number"))
    })
}

/// A free TCP port on 127.0.0.1 (bound, then released for a server to take).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// nginx (Debian's nginx-light) serving "ok" on 127.0.0.1, in the foreground, with its
/// files in a temporary directory; stopped on drop.
pub struct Nginx {
    child: Child,
    pub addr: SocketAddr,
    dir: PathBuf,
}

impl Nginx {
    pub fn start() -> Nginx {
        let dir = std::env::temp_dir().join(unique("connguard-nginx"));
        std::fs::create_dir_all(&dir).unwrap();
        let port = free_port();
        let d = dir.display();
        let conf = format!(
            "worker_processes 1; daemon off; master_process off; pid {d}/nginx.pid; error_log {d}/error.log;\n\
             events {{ worker_connections 4096; }}\n\
             http {{ access_log off; keepalive_requests 1000000; keepalive_timeout 60s;\n\
               client_body_temp_path {d}/body; proxy_temp_path {d}/proxy; fastcgi_temp_path {d}/fastcgi;\n\
               uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;\n\
               server {{ listen 127.0.0.1:{port} backlog=4096; location / {{ return 200 \"ok\\n\"; }} }} }}\n"
        );
        std::fs::write(dir.join("nginx.conf"), conf).unwrap();
        let child = Command::new("nginx")
            .arg("-c")
            .arg(dir.join("nginx.conf"))
            .stderr(Stdio::null())
            .spawn()
            .expect("nginx is missing: run `cargo xtask setup` (installs nginx-light)");
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let until = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(addr).is_err() {
            assert!(
                Instant::now() < until,
                "nginx did not start; see {d}/error.log"
            );
            thread::sleep(Duration::from_millis(20));
        }
        Nginx { child, addr, dir }
    }

    /// Samples, until `stop`, how many established connections the server side of
    /// `addr` has (from `ss`), and returns the highest count seen.
    pub fn watch_connections(&self, stop: Arc<AtomicBool>) -> thread::JoinHandle<u64> {
        let filter = format!("( sport = :{} )", self.addr.port());
        thread::spawn(move || {
            let mut peak = 0;
            while !stop.load(Ordering::Relaxed) {
                let out = Command::new("ss")
                    .args(["-Htn", "state", "established", &filter])
                    .output()
                    .unwrap();
                peak = peak.max(String::from_utf8_lossy(&out.stdout).lines().count() as u64);
                thread::sleep(Duration::from_millis(10));
            }
            peak
        })
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What wrk reported.
#[derive(Debug, Default)]
pub struct WrkResult {
    pub requests: u64,
    pub requests_per_s: f64,
    pub connect_errors: u64,
    /// Highest count of established connections nginx had during the run.
    pub server_peak: u64,
    pub elapsed: Duration,
}

/// Runs `wrk -t2 -cCONNECTIONS -dSECONDSs` against nginx from inside `cgroup`.
pub fn wrk(cgroup: &Cgroup, nginx: &Nginx, connections: u64, seconds: u64) -> WrkResult {
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = nginx.watch_connections(stop.clone());
    let started = Instant::now();
    let out = cgroup
        .command("wrk")
        .args([
            "-t2",
            &format!("-c{connections}"),
            &format!("-d{seconds}s"),
            &format!("http://{}/", nginx.addr),
        ])
        .output()
        .expect("wrk is missing: run `cargo xtask setup` (installs wrk)");
    let elapsed = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let server_peak = watcher.join().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "wrk failed: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let field = |line_start: &str, word: usize| -> Option<String> {
        text.lines()
            .find(|l| l.trim_start().starts_with(line_start))
            .and_then(|l| l.split_whitespace().nth(word).map(str::to_string))
    };
    WrkResult {
        requests: text
            .lines()
            .find(|l| l.contains("requests in"))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no request count in wrk output:\n{text}")),
        requests_per_s: field("Requests/sec:", 1)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0),
        // "Socket errors: connect 250, read 0, write 0, timeout 0" (absent when none).
        connect_errors: field("Socket errors:", 3)
            .map_or(0, |v| v.trim_end_matches(',').parse().unwrap()),
        server_peak,
        elapsed,
    }
}

/// A sock_ops program of the test's own on a cgroup, which sets only its own flag
/// (BPF_SOCK_OPS_RTT_CB_FLAG) on every socket at every callback. bpf_sock_ops_cb_flags_set()
/// replaces a socket's flags, so this turns connguard's state callback off (at the
/// first callback after connguard's TCP_CONNECT_CB, ACTIVE_ESTABLISHED_CB), as a careless
/// program of another tool would. Detached when dropped (its link's fd closes, also
/// when the test process dies).
pub struct ForeignSockOps {
    _link: std::os::fd::OwnedFd,
}

impl ForeignSockOps {
    pub fn attach(cgroup: &Cgroup) -> ForeignSockOps {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        require_prerequisites();
        /// struct bpf_insn: opcode, dst_reg | src_reg << 4, offset, immediate.
        #[repr(C)]
        struct Insn(u8, u8, i16, i32);
        // r2 = BPF_SOCK_OPS_RTT_CB_FLAG; call bpf_sock_ops_cb_flags_set (59) with the
        // context in r1; r0 = 1; exit.
        let insns = [
            Insn(0xb7, 2, 0, 8),
            Insn(0x85, 0, 0, 59),
            Insn(0xb7, 0, 0, 1),
            Insn(0x95, 0, 0, 0),
        ];
        #[repr(C)]
        struct ProgLoad {
            prog_type: u32,
            insn_cnt: u32,
            insns: u64,
            license: u64,
            log: [u32; 4],
            kern_version: u32,
            prog_flags: u32,
            prog_name: [u8; 16],
        }
        let mut name = [0u8; 16];
        name[..11].copy_from_slice(b"foreign_ops");
        let mut load = ProgLoad {
            // BPF_PROG_TYPE_SOCK_OPS
            prog_type: 13,
            insn_cnt: insns.len() as u32,
            insns: insns.as_ptr() as u64,
            license: c"GPL".as_ptr() as u64,
            log: [0; 4],
            kern_version: 0,
            prog_flags: 0,
            prog_name: name,
        };
        let bpf = |cmd: libc::c_long, attr: *mut libc::c_void, size: usize| {
            let fd = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr, size as u32) };
            assert!(
                fd >= 0,
                "bpf({cmd}) for the foreign sock_ops program: {}",
                std::io::Error::last_os_error()
            );
            unsafe { OwnedFd::from_raw_fd(fd as i32) }
        };
        // BPF_PROG_LOAD
        let prog = bpf(5, (&raw mut load).cast(), std::mem::size_of::<ProgLoad>());
        let root = std::fs::File::open(&cgroup.path).unwrap();
        // BPF_LINK_CREATE: prog_fd, target_fd, attach_type BPF_CGROUP_SOCK_OPS, flags.
        let mut link = [prog.as_raw_fd() as u32, root.as_raw_fd() as u32, 3, 0];
        let link = bpf(28, link.as_mut_ptr().cast(), std::mem::size_of_val(&link));
        ForeignSockOps { _link: link }
    }
}

/// Attach types (enum bpf_attach_type, include/uapi/linux/bpf.h) of connguard's
/// connect4, the first program attached to a cgroup, and sock_release, the last.
pub const BPF_CGROUP_INET4_CONNECT: u32 = 10;
pub const BPF_CGROUP_INET_SOCK_RELEASE: u32 = 34;

/// How many programs of `attach_type` are attached to the cgroup at `dir` itself (not
/// inherited), by BPF_PROG_QUERY; None when the cgroup cannot be opened (removed).
pub fn attached_programs(dir: &Path, attach_type: u32) -> Option<u32> {
    use std::os::fd::AsRawFd;
    const BPF_PROG_QUERY: libc::c_long = 16;
    let cgroup = std::fs::File::open(dir).ok()?;
    let mut q = guard_common::linux::ProgQuery {
        target: cgroup.as_raw_fd() as u32,
        attach_type,
        ..Default::default()
    };
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_QUERY,
            &raw mut q,
            std::mem::size_of_val(&q) as u32,
        )
    };
    assert!(
        r == 0,
        "BPF_PROG_QUERY on {}: {}",
        dir.display(),
        std::io::Error::last_os_error()
    );
    Some(q.prog_cnt)
}

/// Waits (5 s at most) until a program of `attach_type` is attached to `cg` itself.
pub fn wait_attached(cg: &Cgroup, attach_type: u32) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while attached_programs(&cg.path, attach_type) != Some(1) {
        assert!(
            Instant::now() < deadline,
            "no program of attach type {attach_type} on {} after 5 s",
            cg.path.display()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The state directory of this build's layout under the default root:
/// `/sys/fs/bpf/connguard/v<STATE_LAYOUT>`.
pub fn state_dir() -> String {
    format!(
        "{}/v{}",
        guard_common::STATE_ROOT,
        guard_common::STATE_LAYOUT
    )
}

/// The pin of the map NAME of the daemon's state: `state_dir()/maps/NAME`.
pub fn pinned_map_path(name: &str) -> String {
    format!("{}/maps/{name}", state_dir())
}

/// The kernel memory a map of the daemon's pinned state holds, and its size: `memlock`
/// and `max_entries` of its fdinfo (`pinned_map_path`).
pub fn pinned_map_memory(name: &str) -> (u64, u64) {
    use std::os::fd::{FromRawFd, OwnedFd};
    const BPF_OBJ_GET: libc::c_long = 7;
    let path = format!("{}\0", pinned_map_path(name));
    // union bpf_attr's obj member: pathname, bpf_fd, file_flags.
    let mut attr = [0u64; 2];
    attr[0] = path.as_ptr() as u64;
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_GET, attr.as_mut_ptr(), 16u32) };
    assert!(
        fd >= 0,
        "BPF_OBJ_GET {}: {}",
        path.trim_end_matches('\0'),
        std::io::Error::last_os_error()
    );
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let info = std::fs::read_to_string(format!(
        "/proc/self/fdinfo/{}",
        std::os::fd::AsRawFd::as_raw_fd(&fd)
    ))
    .unwrap();
    let field = |key: &str| -> u64 {
        info.lines()
            .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {key} in the fdinfo of {name}: {info}"))
    };
    (field("memlock:"), field("max_entries:"))
}

/// `nstat -asz NAME` in the namespace `ns`: the counter's absolute value (its TcpExt,
/// Tcp, Ip... counters, as nstat names them).
pub fn nstat(ns: &Netns, name: &str) -> u64 {
    let text = ns.output("nstat", &["-asz", name]);
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in nstat output {text:?}"))
}
