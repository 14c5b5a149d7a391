//! A real etcd (Debian's etcd-server, v3 API) for the fleet tests: one member on
//! 127.0.0.1 with ports of its own (never the defaults) and a fresh data directory;
//! killed, stopped, restarted on the same data, compacted, given users; killed and its
//! directory removed on drop. And virtual hosts that share fleet budgets through it,
//! many in one process, with a ledger of what they enforce.
use std::{
    collections::BTreeMap,
    io::{Read, Write},
    net::TcpStream,
    os::unix::process::CommandExt,
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use connguard_fleet::{BudgetSpec, Demand, Fleet, FleetConfig, Local, StoreConfig};

use crate::{free_port, unique};

/// How long etcd may take to serve after it starts.
const READY: Duration = Duration::from_secs(20);

pub struct Etcd {
    child: Option<Child>,
    /// Holds `data/` and `etcd.log`.
    pub dir: PathBuf,
    client_port: u16,
    peer_port: u16,
    /// The root user's credentials, once auth is enabled.
    root: Option<(String, String)>,
}

impl Etcd {
    /// Starts a new etcd and waits until it serves.
    pub fn start() -> Etcd {
        assert!(
            Command::new("etcd").arg("--version").output().is_ok(),
            "etcd is missing: `cargo xtask setup` installs Debian's etcd-server and etcd-client"
        );
        let dir = std::env::temp_dir().join(unique("connguard-etcd"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut etcd = Etcd {
            child: None,
            dir,
            client_port: free_port(),
            peer_port: free_port(),
            root: None,
        };
        etcd.restart();
        etcd
    }

    /// The client URL.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// Starts etcd again on the same data directory and ports (after a kill or stop).
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "etcd is already running");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("etcd.log"))
            .unwrap();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut command = Command::new("etcd");
        command
            .arg("--name=connguard-test")
            .arg(format!("--data-dir={}", self.dir.join("data").display()))
            .arg(format!("--listen-client-urls={}", self.endpoint()))
            .arg(format!("--advertise-client-urls={}", self.endpoint()))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=connguard-test={peer}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        // SAFETY: prctl is async-signal-safe; etcd dies with the test process.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        self.child = Some(command.spawn().expect("starting etcd"));
        let deadline = Instant::now() + READY;
        while !self.healthy() {
            assert!(
                Instant::now() < deadline,
                "etcd did not serve within {READY:?}; its log: {}",
                self.dir.join("etcd.log").display()
            );
            thread::sleep(Duration::from_millis(100));
        }
    }

    fn healthy(&self) -> bool {
        TcpStream::connect(("127.0.0.1", self.client_port)).is_ok()
            && self.try_etcdctl(&["endpoint", "health"]).is_ok()
    }

    /// SIGKILL, as a crash.
    pub fn kill(&mut self) {
        self.signal(libc::SIGKILL);
    }

    /// SIGTERM, an orderly stop.
    pub fn stop(&mut self) {
        self.signal(libc::SIGTERM);
    }

    fn signal(&mut self, signal: i32) {
        let mut child = self.child.take().expect("etcd is not running");
        // SAFETY: a signal to our own child, which we then reap.
        unsafe { libc::kill(child.id() as i32, signal) };
        child.wait().unwrap();
    }

    /// etcdctl's output, or its error output.
    fn try_etcdctl(&self, args: &[&str]) -> Result<String, String> {
        let mut command = Command::new("etcdctl");
        command
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={}", self.endpoint()))
            .arg("--command-timeout=5s");
        if let Some((user, password)) = &self.root {
            command.arg(format!("--user={user}:{password}"));
        }
        let out = command.args(args).output().expect("running etcdctl");
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    pub fn etcdctl(&self, args: &[&str]) -> String {
        self.try_etcdctl(args)
            .unwrap_or_else(|e| panic!("etcdctl {args:?}: {e}"))
    }

    /// The store's current revision.
    pub fn revision(&self) -> i64 {
        let out = self.etcdctl(&["endpoint", "status", "--write-out=json"]);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        v[0]["Status"]["header"]["revision"]
            .as_i64()
            .unwrap_or_else(|| panic!("no revision in {out}"))
    }

    /// Compacts the history up to the current revision.
    pub fn compact(&self) {
        let revision = self.revision();
        self.etcdctl(&["compact", &revision.to_string(), "--physical"]);
    }

    /// Enables authentication, with `root` (password `root_password`) and `user`
    /// (`password`) granted read and write on `prefix`.
    pub fn enable_auth(&mut self, root_password: &str, user: &str, password: &str, prefix: &str) {
        self.etcdctl(&["user", "add", &format!("root:{root_password}")]);
        self.etcdctl(&["user", "add", &format!("{user}:{password}")]);
        self.etcdctl(&["role", "add", "fleet"]);
        self.etcdctl(&[
            "role",
            "grant-permission",
            "fleet",
            "--prefix=true",
            "readwrite",
            prefix,
        ]);
        self.etcdctl(&["user", "grant-role", user, "fleet"]);
        self.etcdctl(&["auth", "enable"]);
        self.root = Some(("root".into(), root_password.into()));
    }

    /// The sum of every series of one of etcd's Prometheus metrics.
    pub fn metric(&self, name: &str) -> f64 {
        let mut s = TcpStream::connect(("127.0.0.1", self.client_port)).unwrap();
        write!(
            s,
            "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1:{}\r\n\r\n",
            self.client_port
        )
        .unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).unwrap();
        text.lines()
            .filter(|l| {
                l.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with([' ', '{']))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        if self.child.is_some() {
            self.kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The fleet settings of the tests: a short lease and refresh keep them fast.
pub const TEST_TTL: Duration = Duration::from_secs(3);
pub const TEST_REFRESH: Duration = Duration::from_millis(500);

/// A fleet configuration of one budget `budget` of `total` on `etcd`, under `prefix`.
pub fn fleet_config(
    etcd: &Etcd,
    prefix: &str,
    identity: &str,
    budget: &str,
    total: u64,
) -> FleetConfig {
    let mut store = StoreConfig::new(vec![etcd.endpoint()]);
    store.prefix = prefix.to_string();
    let mut config = FleetConfig::new(store, identity, vec![BudgetSpec::new(budget, total)]);
    config.ttl = TEST_TTL;
    config.refresh = TEST_REFRESH;
    config
}

/// What every virtual host of a test enforces, checked at each change: the largest sum
/// of the shares standing at once, and every raise.
#[derive(Default)]
pub struct Ledger {
    hosts: Mutex<BTreeMap<String, Held>>,
    max_sum: AtomicU64,
}

#[derive(Clone, Copy)]
struct Held {
    share: u64,
    /// When the kernel falls to the safe share (0) by itself.
    until: Option<Instant>,
}

/// A raise as the ledger saw it.
#[derive(Debug, Clone, Copy)]
pub struct Raise {
    pub at: Instant,
    pub from: u64,
    pub to: u64,
}

impl Ledger {
    /// The largest sum of standing shares seen.
    pub fn max_sum(&self) -> u64 {
        self.max_sum.load(Ordering::SeqCst)
    }

    /// The shares standing now, with the kernel's own expiry.
    pub fn sum_now(&self) -> u64 {
        let now = Instant::now();
        self.hosts
            .lock()
            .unwrap()
            .values()
            .map(|h| h.standing(now))
            .sum()
    }

    fn apply(&self, identity: &str, share: u64) -> Option<Raise> {
        let now = Instant::now();
        let mut hosts = self.hosts.lock().unwrap();
        let held = hosts.entry(identity.to_string()).or_insert(Held {
            share: 0,
            until: None,
        });
        let from = held.standing(now);
        held.share = share;
        let sum = hosts.values().map(|h| h.standing(now)).sum();
        self.max_sum.fetch_max(sum, Ordering::SeqCst);
        (share > from).then_some(Raise {
            at: now,
            from,
            to: share,
        })
    }

    fn stand_until(&self, identity: &str, until: Instant) {
        if let Some(h) = self.hosts.lock().unwrap().get_mut(identity) {
            h.until = Some(until);
        }
    }
}

impl Held {
    fn standing(&self, now: Instant) -> u64 {
        match self.until {
            Some(until) if now >= until => 0,
            _ => self.share,
        }
    }
}

/// How often a client that a virtual host cannot admit tries again.
const RETRY: Duration = Duration::from_millis(100);

/// A host of a fleet budget without a kernel: the test sets how many clients want a
/// connection; its active connections follow its share at once (those over a lowered
/// share close), and each client it cannot admit retries every [`RETRY`], shed each
/// time; its kernel falls to a share of 0 when its shares stop standing, as the
/// daemon's kernel budget must.
pub struct VirtualLocal {
    identity: String,
    want: AtomicU64,
    state: Mutex<Kernel>,
    ledger: Arc<Ledger>,
    raises: Mutex<Vec<Raise>>,
}

impl VirtualLocal {
    pub fn new(identity: &str, want: u64, ledger: Arc<Ledger>) -> Arc<VirtualLocal> {
        Arc::new(VirtualLocal {
            identity: identity.to_string(),
            want: AtomicU64::new(want),
            state: Mutex::new(Kernel {
                share: None,
                shed: 0.0,
                at: Instant::now(),
            }),
            ledger,
            raises: Mutex::new(Vec::new()),
        })
    }

    pub fn want(&self) -> u64 {
        self.want.load(Ordering::SeqCst)
    }

    pub fn set_want(&self, want: u64) {
        self.want.store(want, Ordering::SeqCst);
    }

    /// Every raise of this host's share.
    pub fn raises(&self) -> Vec<Raise> {
        self.raises.lock().unwrap().clone()
    }
}

impl Local for VirtualLocal {
    fn apply(&self, _budget: &str, share: u64) {
        let mut state = self.state.lock().unwrap();
        state.shed_until_now(self.want.load(Ordering::SeqCst));
        state.share = Some(share);
        drop(state);
        if let Some(r) = self.ledger.apply(&self.identity, share) {
            self.raises.lock().unwrap().push(r);
        }
    }

    fn shares_stand_until(&self, until: Instant) {
        self.ledger.stand_until(&self.identity, until);
    }

    fn demand(&self, _budget: &str) -> Demand {
        let want = self.want.load(Ordering::SeqCst);
        let mut state = self.state.lock().unwrap();
        state.shed_until_now(want);
        Demand {
            active: state.active(want),
            shed_total: state.shed as u64,
        }
    }
}

/// A virtual host's kernel budget.
struct Kernel {
    /// The enforced share (None: none applied yet).
    share: Option<u64>,
    /// Sheds so far, counted up to `at`.
    shed: f64,
    at: Instant,
}

impl Kernel {
    fn active(&self, want: u64) -> u64 {
        self.share.unwrap_or(0).min(want)
    }

    fn shed_until_now(&mut self, want: u64) {
        let now = Instant::now();
        let blocked = (want - self.active(want)) as f64;
        self.shed += blocked * (now - self.at).as_secs_f64() / RETRY.as_secs_f64();
        self.at = now;
    }
}

/// A virtual host and its fleet.
pub struct VirtualHost {
    pub fleet: Fleet,
    pub local: Arc<VirtualLocal>,
}

impl VirtualHost {
    pub fn start(config: FleetConfig, want: u64, ledger: &Arc<Ledger>) -> VirtualHost {
        let local = VirtualLocal::new(&config.identity, want, ledger.clone());
        let fleet = Fleet::start(config, local.clone()).expect("starting a virtual host");
        VirtualHost { fleet, local }
    }

    /// The share its kernel enforces (None: none yet).
    pub fn share(&self) -> Option<u64> {
        self.fleet.status().budgets[0].share
    }
}
