//! The demo's third part: one database's budget shared by three hosts through etcd.
//! The hosts are three daemons on this machine, each with its own state directory,
//! control socket and client cgroup; the database is a loopback server that counts its
//! connections.
use std::{
    path::{Path, PathBuf},
    process::{Child, Command},
    time::{Duration, Instant},
};

use anyhow::bail;
use connguard_api::stats::Snapshot;
use connguard_tests::{
    Cgroup, Server,
    etcd::Etcd,
    fleet::{Clients, clients, host_policy},
};

use super::{indent, start_with, stop_with};

const TOTAL: u64 = 60;
const CLIENTS: u64 = 50;

struct Host {
    name: &'static str,
    connguard: PathBuf,
    cgroup: Cgroup,
    socket: PathBuf,
    state_dir: PathBuf,
    daemon: Option<Child>,
    clients: Option<Clients>,
}

impl Host {
    fn kill_daemon(&mut self) {
        if let Some(mut d) = self.daemon.take() {
            let _ = d.kill();
            let _ = d.wait();
        }
    }
}

impl Drop for Host {
    /// Kills what is left (the clients go with their field), and removes the state a
    /// killed daemon left pinned.
    fn drop(&mut self) {
        self.kill_daemon();
        let _ = Command::new(&self.connguard)
            .args(["stop", "--socket", "/nonexistent", "--state-dir"])
            .arg(&self.state_dir)
            .output();
    }
}

pub fn run(connguard: &Path) -> anyhow::Result<()> {
    let etcd = Etcd::start();
    let db = Server::start("127.0.0.1:0");
    let dir = std::env::temp_dir().join(format!("connguard-demo-fleet-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    println!(
        "11. A fleet: one database ({}) allows {TOTAL} connections in all, and three hosts each run 50 clients of \
         it. Every host's pool is bounded; their sum is not. etcd runs at {}.\n",
        db.addr,
        etcd.endpoint()
    );
    let mut hosts = Vec::new();
    for name in ["host1", "host2", "host3"] {
        let cgroup = Cgroup::new(&format!("demo-fleet-{name}"));
        let text = host_policy(
            &etcd.endpoint(),
            "/connguard/fleet/",
            name,
            &cgroup,
            db.addr.port(),
            TOTAL,
        )
        .to_toml();
        let file = dir.join(format!("{name}.toml"));
        std::fs::write(&file, &text)?;
        if name == "host1" {
            println!(
                "12. Each host's connguard gets the same fleet budget, its own identity and its own cgroup (host1's \
                 policy):\n\n{}",
                indent(&text)
            );
        }
        let socket = dir.join(format!("{name}.sock"));
        let state_dir = PathBuf::from(format!("/sys/fs/bpf/connguard-demo-{name}"));
        let daemon = start_with(
            connguard,
            &file,
            &socket,
            &["--state-dir", &state_dir.display().to_string()],
        )?;
        hosts.push(Host {
            name,
            connguard: connguard.to_path_buf(),
            cgroup,
            socket,
            state_dir,
            daemon: Some(daemon),
            clients: None,
        });
    }
    let started = Instant::now();
    for h in &mut hosts {
        h.clients = Some(clients(&h.cgroup, db.addr, CLIENTS));
    }
    wait(connguard, &hosts, |s| s == [20, 20, 20])?;
    println!(
        "13. The 150 clients start together. {} ms later each host holds a share of 20 and 20 connections; the \
         other 30 clients of each are refused at connect(), ECONNREFUSED, no SYN sent, and retry. The database \
         has seen at most {} connections. `connguard fleet` on host1:\n\n{}",
        started.elapsed().as_millis(),
        db.peak(),
        indent(&cli(connguard, &hosts[0].socket, &["fleet"])?)
    );
    let idle = Instant::now();
    hosts[2].clients = None;
    wait(connguard, &hosts[..2], |s| s == [30, 30])?;
    println!(
        "14. host3's clients finish. {} ms later host1 and host2 hold 30 each: what host3 released went to those \
         who wanted more. The database: at most {} connections.\n",
        idle.elapsed().as_millis(),
        db.peak()
    );
    let dead = Instant::now();
    hosts[1].clients = None;
    hosts[1].kill_daemon();
    wait(connguard, &hosts[..1], |s| s[0] == CLIENTS)?;
    println!(
        "15. host2 dies (its daemon and clients SIGKILLed). Its lease expires in etcd, and {} ms after its death \
         host1 holds all {CLIENTS} of its clients' connections. The database never saw more than {} at once.\n",
        dead.elapsed().as_millis(),
        db.peak()
    );
    for h in &mut hosts {
        h.clients = None;
        if let Some(d) = h.daemon.take() {
            stop_with(
                connguard,
                &h.socket,
                d,
                &["--state-dir", &h.state_dir.display().to_string()],
            )?;
            println!("    {}: `connguard stop`", h.name);
        }
    }
    drop(hosts);
    let _ = std::fs::remove_dir_all(&dir);
    drop(etcd);
    Ok(())
}

/// Waits (20 s at most) until the hosts' rule counts (active connections) satisfy `done`.
fn wait(connguard: &Path, hosts: &[Host], done: impl Fn(&[u64]) -> bool) -> anyhow::Result<()> {
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let mut active = Vec::new();
        for h in hosts {
            let out = cli(connguard, &h.socket, &["stats", "--json"])?;
            let snap: Snapshot = serde_json::from_str(&out)?;
            active.push(snap.scopes[0].rules[0].counts.active);
        }
        if done(&active) {
            return Ok(());
        }
        if Instant::now() > until {
            bail!("the fleet did not settle: active connections per host {active:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn cli(connguard: &Path, socket: &Path, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(connguard)
        .args(args)
        .arg("--socket")
        .arg(socket)
        .output()?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
