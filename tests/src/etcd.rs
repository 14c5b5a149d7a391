//! A real etcd (Debian's etcd-server, v3 API) for the fleet tests: one member on
//! 127.0.0.1 with ports of its own (never the defaults) and a fresh data directory;
//! killed, stopped, restarted on the same data, compacted, given users; killed and its
//! directory removed on drop.
use std::{
    io::{Read, Write},
    net::TcpStream,
    os::unix::process::CommandExt,
    path::PathBuf,
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

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
