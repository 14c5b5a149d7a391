//! `connguard run`: attach, apply the policy, then serve stats and reloads until
//! SIGTERM/SIGINT. The control socket speaks one request line per connection (`stats`,
//! `stats N` for at most N destinations per scope, `reload`, `ports NETNS_COOKIE` or
//! `scope CGROUP_ID`) and answers with one JSON document.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    io::{BufRead, BufReader, BufWriter, Write},
    os::unix::{
        fs::PermissionsExt,
        net::{UnixListener, UnixStream},
    },
    path::{Path, PathBuf},
    sync::{Arc, Mutex, mpsc},
    thread,
    time::Duration,
};

use anyhow::{Context, bail, ensure};
use serde::{Deserialize, Serialize};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};

use guard_common::PortUseKey;

use crate::{
    accounting::{self, Accounting},
    cgroup, listeners, loader, netns,
    policy::{self, ListenerPolicy, Policy},
    ports, sockdiag,
    stats::{self, PolicyStatus, Snapshot},
};

/// How often cgroups created or removed since the last look are picked up.
const RESCAN: Duration = Duration::from_millis(500);

pub struct Options {
    pub policy: Option<PathBuf>,
    pub metrics: Option<String>,
    pub socket: PathBuf,
    pub bpf_stats: bool,
    /// Destination entries idle this long (to twice as long) are forgotten.
    pub forget_idle: Duration,
}

/// Answer of the `reload` request.
#[derive(Debug, Serialize, Deserialize)]
pub struct ReloadReply {
    pub ok: bool,
    pub generation: u64,
    pub error: Option<String>,
}

struct Daemon {
    acct: Accounting,
    guard: listeners::ListenerGuard,
    tw_rates: ports::TimeWaitRates,
    ebpf: aya::Ebpf,
    status: PolicyStatus,
    policy_path: Option<PathBuf>,
}

impl Daemon {
    fn read_policy(path: Option<&Path>) -> Result<Policy, policy::PolicyError> {
        match path {
            Some(p) => policy::load_file(p),
            None => policy::parse(policy::DEFAULT_POLICY, policy::DEFAULT_SOURCE),
        }
    }

    /// Re-reads the policy file; on any error the policy in force stays, and the error
    /// is logged and kept for `stats`.
    fn reload(&mut self) -> ReloadReply {
        let result = Self::read_policy(self.policy_path.as_deref())
            .map_err(|e| e.to_string())
            .and_then(|p| {
                let what = policy::describe(&p);
                self.acct
                    .apply(p)
                    .map_err(|e| format!("{e:#}"))
                    .map(|()| what)
            });
        match result {
            Ok(what) => {
                self.attach_listeners();
                self.status.generation += 1;
                self.status.last_error = None;
                log::info!(
                    "policy reloaded: generation {}, {what}",
                    self.status.generation
                );
            }
            Err(e) => {
                log::error!("policy reload rejected, the previous policy stays in force: {e}");
                self.status.last_error = Some(e);
            }
        }
        ReloadReply {
            ok: self.status.last_error.is_none(),
            generation: self.status.generation,
            error: self.status.last_error.clone(),
        }
    }

    fn scope_name(&self, id: u32) -> String {
        self.acct.ids.scope_name(id).unwrap_or("?").to_string()
    }

    fn eaddrnotavail(&self) -> Vec<ports::EaddrnotavailCount> {
        self.acct
            .eaddrnotavail()
            .into_iter()
            .map(|(k, count)| ports::EaddrnotavailCount {
                scope: self.scope_name(k.scope_id),
                comm: String::from_utf8_lossy(&k.comm)
                    .trim_end_matches('\0')
                    .to_string(),
                count,
            })
            .collect()
    }

    /// Rates and attribution for the network namespace with this cookie.
    fn ports(&self, netns: u64) -> ports::DaemonPorts {
        let mut active: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (k, c) in self.acct.counters() {
            if c.active > 0 {
                let dst = ports::endpoint(accounting::unmapped(k.addr), k.port);
                active
                    .entry(dst)
                    .or_default()
                    .insert(self.scope_name(k.scope_id));
            }
        }
        let active = active
            .into_iter()
            .map(|(dst, scopes)| ports::ActiveScopes {
                dst,
                scopes: scopes.into_iter().collect(),
            })
            .collect();
        ports::daemon_ports(
            netns,
            &self.tw_rates.rates(),
            |id| self.scope_name(id),
            active,
            self.eaddrnotavail(),
        )
    }

    /// Everything `stats` reports; with `top`, each scope's destinations are cut to the
    /// busiest `top` (see stats::scopes).
    fn snapshot(&mut self, top: Option<usize>) -> Snapshot {
        Snapshot {
            policy: self.status.clone(),
            scopes: stats::scopes(&self.acct, top),
            internal_errors: self.acct.internal_errors(),
            programs: loader::program_costs(&self.ebpf),
            eaddrnotavail: self.eaddrnotavail(),
            watched_ports: self.acct.watched_ports(),
            listeners: self.guard.stats(&self.listener_policies()),
        }
    }

    fn listener_policies(&self) -> Vec<ListenerPolicy> {
        self.acct
            .policy
            .as_ref()
            .map(|p| p.listeners.clone())
            .unwrap_or_default()
    }

    /// Attaches the listener guard in namespaces the policy names for the first time.
    fn attach_listeners(&mut self) {
        let policies = self.listener_policies();
        if let Err(e) = self.guard.attach(&mut self.ebpf, &policies) {
            log::error!("listener guard: {e:#}");
        }
    }
}

pub fn run(opts: Options) -> anyhow::Result<()> {
    loader::require_root()?;
    // A bad policy stops the start before anything is attached.
    let policy = Daemon::read_policy(opts.policy.as_deref())?;
    loader::ensure_mounts()?;
    let root = cgroup::cgroup2_mount()?;
    let metrics = match &opts.metrics {
        Some(addr) => Some(
            tiny_http::Server::http(addr.as_str())
                .map_err(|e| anyhow::anyhow!("serving metrics on {addr}: {e}"))?,
        ),
        None => None,
    };
    let listener = bind_control(&opts.socket)?;
    let _stats_fd = if opts.bpf_stats {
        Some(
            aya::sys::enable_stats(aya::sys::Stats::RunTime)
                .context("enabling kernel bpf_stats")?,
        )
    } else {
        None
    };
    let mut ebpf = loader::load_and_attach(&root)?;
    let mut acct = Accounting::new(&mut ebpf, root.clone())?;
    let guard = listeners::ListenerGuard::new(&mut ebpf)?;
    let what = policy::describe(&policy);
    let source = policy.source.clone();
    acct.apply(policy)?;
    let governed = acct.governed_cgroups();
    // The first sample, taken before "ready", is the baseline of the first rates.
    let mut tw_rates = ports::TimeWaitRates::default();
    tw_rates.sample(std::time::Instant::now(), acct.time_waits());
    let daemon = Arc::new(Mutex::new(Daemon {
        acct,
        guard,
        tw_rates,
        ebpf,
        status: PolicyStatus {
            source: source.clone(),
            generation: 1,
            last_error: None,
        },
        policy_path: opts.policy.clone(),
    }));

    daemon.lock().expect("daemon lock").attach_listeners();
    {
        let daemon = daemon.clone();
        thread::spawn(move || watch_listeners(&daemon));
    }
    let (tx, rx) = mpsc::channel::<i32>();
    let mut signals = signal_hook::iterator::Signals::new([SIGHUP, SIGTERM, SIGINT])?;
    thread::spawn(move || {
        for sig in signals.forever() {
            if tx.send(sig).is_err() {
                break;
            }
        }
    });
    {
        let daemon = daemon.clone();
        thread::spawn(move || serve_control(listener, daemon));
    }
    if let Some(server) = metrics {
        log::info!("metrics on http://{}/metrics", server.server_addr());
        let daemon = daemon.clone();
        thread::spawn(move || serve_metrics(server, daemon));
    }
    log::info!(
        "ready: programs attached to {}, policy {source} ({what}) governs {governed} cgroup(s), control socket {}",
        root.display(),
        opts.socket.display()
    );

    let mut last_forget = std::time::Instant::now();
    loop {
        if last_forget.elapsed() >= opts.forget_idle {
            last_forget = std::time::Instant::now();
            let n = daemon.lock().expect("daemon lock").acct.forget_idle();
            if n > 0 {
                log::info!("forgot {n} idle destination(s)");
            }
        }
        match rx.recv_timeout(RESCAN) {
            Ok(SIGHUP) => {
                daemon.lock().expect("daemon lock").reload();
            }
            Ok(sig) => {
                log::info!("signal {sig}: detaching and exiting");
                break;
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let mut d = daemon.lock().expect("daemon lock");
                if let Err(e) = d.acct.rescan() {
                    log::warn!("cgroup rescan failed: {e:#}");
                }
                let counts = d.acct.time_waits();
                d.tw_rates.sample(std::time::Instant::now(), counts);
                drop(d);
                if let Err(e) = watch_ports(&daemon) {
                    // Fail-open: without a fresh reading, no destination stays shed.
                    log::warn!("port watermarks: {e:#}; not watching until the next reading");
                    let _ = daemon
                        .lock()
                        .expect("daemon lock")
                        .acct
                        .set_port_use(HashMap::new());
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    let _ = std::fs::remove_file(&opts.socket);
    // Links detach when the process exits; clsact filters (kernels before 6.6) stay, so
    // leave them nothing to shed.
    let _ = daemon
        .lock()
        .expect("daemon lock")
        .guard
        .set(Default::default());
    Ok(())
}

/// How often listener queues are read: shedding starts and stops within this (plus
/// the read).
const LISTENER_POLL: Duration = Duration::from_millis(50);

/// Keeps LISTENERS_SHED current from the listeners' socket tables, forever. The tables
/// are read without holding the daemon lock.
fn watch_listeners(daemon: &Mutex<Daemon>) {
    loop {
        thread::sleep(LISTENER_POLL);
        let (policies, ids) = {
            let mut d = daemon.lock().expect("daemon lock");
            let policies = d.listener_policies();
            let ids = d.guard.ids_of(&policies);
            (policies, ids)
        };
        let entries = if policies.is_empty() {
            Default::default()
        } else {
            listeners::over_watermark(&policies, |name| ids[name])
        };
        if let Err(e) = daemon.lock().expect("daemon lock").guard.set(entries) {
            log::warn!("listener guard: {e:#}");
        }
    }
}

/// Keeps PORT_USE current for the network namespaces of the processes of scopes with a
/// port watermark: the kernel sheds from it, so a watermark acts within one RESCAN.
/// The socket tables are read without holding the daemon lock.
fn watch_ports(daemon: &Mutex<Daemon>) -> anyhow::Result<()> {
    let (dirs, policy) = {
        let d = daemon.lock().expect("daemon lock");
        let dirs: Vec<PathBuf> = d
            .acct
            .port_watched_dirs()
            .into_iter()
            .map(Path::to_path_buf)
            .collect();
        (dirs, d.acct.policy.clone())
    };
    let Some(policy) = policy else { return Ok(()) };
    let lowest = policy
        .scopes
        .iter()
        .flat_map(|s| {
            s.port_watermark
                .into_iter()
                .chain(s.rules.iter().filter_map(|r| r.port_watermark))
        })
        .min();
    let mut entries = HashMap::new();
    if let Some(lowest) = lowest {
        for ns in cgroup::netns_of(dirs.iter().map(PathBuf::as_path)) {
            let read = netns::within(Some(&ns), || {
                let settings = ports::PortSettings::read()?;
                Ok((
                    netns::cookie()?,
                    ports::port_use(&settings, &sockdiag::tcp_sockets()?),
                ))
            });
            let (cookie, used) = match read {
                Ok(r) => r,
                // The namespace went away with its process.
                Err(e) => {
                    log::debug!("{}: {e:#}", ns.display());
                    continue;
                }
            };
            for ((addr, port), permille) in used.into_iter().filter(|(_, p)| *p >= lowest) {
                let key = PortUseKey {
                    netns: cookie,
                    port,
                    _pad: [0; 6],
                    addr: accounting::mapped_addr(addr),
                };
                entries.insert(key, permille);
            }
        }
    }
    daemon
        .lock()
        .expect("daemon lock")
        .acct
        .set_port_use(entries)
}

fn bind_control(path: &Path) -> anyhow::Result<UnixListener> {
    if UnixStream::connect(path).is_ok() {
        bail!(
            "another connguard daemon is serving {}; stop it or pass --socket",
            path.display()
        );
    }
    let _ = std::fs::remove_file(path);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let listener =
        UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

fn serve_control(listener: UnixListener, daemon: Arc<Mutex<Daemon>>) {
    for stream in listener.incoming().flatten() {
        // A client that connects and says nothing must not hold up the others.
        let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
        let mut line = String::new();
        if BufReader::new(&stream).read_line(&mut line).is_err() {
            continue;
        }
        let reply = {
            let mut d = daemon.lock().expect("daemon lock");
            let mut words = line.split_whitespace();
            match (
                words.next().unwrap_or(""),
                words.next().map(str::parse::<u64>),
            ) {
                ("stats", None) => Ok(Reply::Snapshot(Box::new(d.snapshot(None)))),
                // At most N destinations per scope, the rest summed: for callers that
                // want the totals (`listeners`, `top`) without 100,000s of entries.
                ("stats", Some(Ok(top))) => {
                    Ok(Reply::Snapshot(Box::new(d.snapshot(Some(top as usize)))))
                }
                ("reload", None) => serde_json::to_string(&d.reload()).map(Reply::Text),
                ("ports", Some(Ok(netns))) => {
                    serde_json::to_string(&d.ports(netns)).map(Reply::Text)
                }
                ("scope", Some(Ok(cgroup_id))) => {
                    let scope = d.acct.scope_of_cgroup(cgroup_id).map(|id| d.scope_name(id));
                    Ok(Reply::Text(
                        serde_json::json!({ "scope": scope }).to_string(),
                    ))
                }
                _ => Ok(Reply::Text(
                    serde_json::json!({ "error": format!("unknown request {:?}", line.trim()) })
                        .to_string(),
                )),
            }
        };
        let mut out = BufWriter::with_capacity(1 << 16, &stream);
        let _ = match reply {
            Ok(Reply::Text(text)) => out.write_all(text.as_bytes()),
            Ok(Reply::Snapshot(snap)) => serde_json::to_writer(&mut out, &snap).map_err(Into::into),
            Err(_) => continue,
        }
        .and_then(|()| out.flush());
        drop(out);
        release_freed_memory();
    }
}

/// Gives the memory freed after a request back to the kernel. A snapshot of 100,000
/// destinations takes about 25 MiB while it is built, and glibc keeps freed memory in
/// each thread's arena: without this, the control and metrics threads each held on to
/// theirs, and after three `stats` and three scrapes the daemon stayed at 39 MiB
/// resident (54 at most), against 12 to 20 (38 at most) with it.
fn release_freed_memory() {
    // SAFETY: malloc_trim only walks and shrinks glibc's own heaps.
    unsafe { libc::malloc_trim(0) };
}

/// The answer to a control request. A snapshot is encoded while it is sent, after the
/// daemon lock is released: with 100,000s of destinations the client reads the first
/// bytes while the rest is encoded.
enum Reply {
    Text(String),
    Snapshot(Box<Snapshot>),
}

fn serve_metrics(server: tiny_http::Server, daemon: Arc<Mutex<Daemon>>) {
    for req in server.incoming_requests() {
        let response = if req.url() == "/metrics" {
            let snap = daemon
                .lock()
                .expect("daemon lock")
                .snapshot(Some(stats::METRIC_TOP_DESTINATIONS));
            let text = stats::prometheus(&snap);
            let header = "Content-Type: text/plain; version=0.0.4; charset=utf-8"
                .parse::<tiny_http::Header>()
                .expect("valid header");
            tiny_http::Response::from_string(text).with_header(header)
        } else {
            tiny_http::Response::from_string("see /metrics\n").with_status_code(404)
        };
        let _ = req.respond(response);
        release_freed_memory();
    }
}

/// Sends one request to a running daemon and returns its JSON answer.
pub fn request(socket: &Path, what: &str) -> anyhow::Result<String> {
    let mut out = String::new();
    std::io::Read::read_to_string(&mut send_request(socket, what)?, &mut out)?;
    Ok(out)
}

/// Sends one request to a running daemon; its JSON answer is on the returned stream.
pub fn send_request(socket: &Path, what: &str) -> anyhow::Result<UnixStream> {
    let mut stream = UnixStream::connect(socket).with_context(|| {
        format!("no connguard daemon answers on {} (is `connguard run` running? pass --socket if it uses another path)", socket.display())
    })?;
    // A stalled daemon must not freeze the caller (`top` polls every second).
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(format!("{what}\n").as_bytes())?;
    stream.shutdown(std::net::Shutdown::Write)?;
    Ok(stream)
}

/// Copies the daemon's answer to `stats` to `out` as it arrives, without decoding it,
/// then a newline; fails with the daemon's error when it answers with one.
pub fn copy_stats(socket: &Path, out: &mut impl Write) -> anyhow::Result<()> {
    let mut answer = std::io::BufReader::with_capacity(1 << 16, send_request(socket, "stats")?);
    // An error answer is a small {"error": ...} object; a snapshot starts {"policy":.
    let mut head = Vec::new();
    while head.len() < ERROR_HEAD.len() {
        let chunk = answer.fill_buf()?;
        if chunk.is_empty() {
            break;
        }
        let n = chunk.len();
        head.extend_from_slice(chunk);
        answer.consume(n);
    }
    if head.starts_with(ERROR_HEAD) {
        std::io::Read::read_to_end(&mut answer, &mut head)?;
        let reply: serde_json::Value = serde_json::from_slice(&head)?;
        bail!("the daemon answered: {}", reply["error"]);
    }
    // Copied as it comes; a snapshot the daemon failed to finish (it logs why) ends
    // before its closing brace, which must not pass for a whole one.
    let last_byte = |b: &[u8]| b.iter().rev().copied().find(|b| !b.is_ascii_whitespace());
    out.write_all(&head)?;
    let mut last = last_byte(&head);
    loop {
        let chunk = answer.fill_buf()?;
        if chunk.is_empty() {
            break;
        }
        last = last_byte(chunk).or(last);
        out.write_all(chunk)?;
        let n = chunk.len();
        answer.consume(n);
    }
    ensure!(
        last == Some(b'}'),
        "the daemon's answer ended before the end of its JSON (see the daemon's log)"
    );
    writeln!(out)?;
    Ok(())
}

/// How the daemon's error answers begin (`serde_json::json!` writes them compact).
const ERROR_HEAD: &[u8] = b"{\"error\"";
