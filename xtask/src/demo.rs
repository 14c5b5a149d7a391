//! `cargo xtask demo`: wrk with 300 connections against nginx, without and with a
//! connguard budget of 50, told as a short story.
use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{Context, bail};
use connguard_tests::{Cgroup, Nginx, wrk};

const CONNECTIONS: u64 = 300;
const BUDGET: u64 = 50;
const SECONDS: u64 = 3;

pub fn run(connguard: &Path) -> anyhow::Result<()> {
    let nginx = Nginx::start();
    let client = Cgroup::new("demo-client");
    println!(
        "1. nginx listens on {}. A client cgroup, {}, runs wrk with {CONNECTIONS} connections for {SECONDS} s.\n",
        nginx.addr, client.rel
    );

    let before = wrk(&client, &nginx, CONNECTIONS, SECONDS);
    println!(
        "2. Without connguard: nginx held up to {} connections from the client; {:.0} requests/s.\n",
        before.server_peak, before.requests_per_s
    );

    let dir = std::env::temp_dir().join(format!("connguard-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let policy = dir.join("demo.toml");
    let text = format!(
        "[[scope]]\nname = \"client\"\ncgroup = \"{}\"\nmode = \"enforce\"\n\n[[scope.rule]]\nname = \"nginx\"\ndst = [\"127.0.0.1\"]\nports = [\"{}\"]\nmax_connections = {BUDGET}\n",
        client.rel,
        nginx.addr.port()
    );
    std::fs::write(&policy, &text)?;
    let socket = dir.join("connguard.sock");
    println!(
        "3. Start connguard with this policy ({}):\n\n{}",
        policy.display(),
        indent(&text)
    );
    let mut daemon = Command::new(connguard)
        .arg("run")
        .arg("--policy")
        .arg(&policy)
        .arg("--socket")
        .arg(&socket)
        .args(["--metrics", "off"])
        .stderr(Stdio::piped())
        .spawn()
        .context("starting connguard")?;
    let mut lines = BufReader::new(daemon.stderr.take().context("stderr")?).lines();
    loop {
        match lines.next() {
            Some(Ok(line)) if line.contains("ready") => break,
            Some(Ok(_)) => continue,
            _ => bail!("connguard exited before it was ready"),
        }
    }
    std::thread::spawn(move || lines.for_each(drop));

    let after = wrk(&client, &nginx, CONNECTIONS, SECONDS);
    println!(
        "4. With connguard: nginx held up to {} connections from the client (budget {BUDGET}). wrk reported {} connect errors: \
         each was connect() failing at once with ECONNREFUSED, no SYN sent. The {BUDGET} admitted connections carried {:.0} requests/s.\n",
        after.server_peak, after.connect_errors, after.requests_per_s
    );
    let stats = Command::new(connguard)
        .arg("stats")
        .arg("--socket")
        .arg(&socket)
        .output()?;
    println!(
        "5. `connguard stats` now says:\n\n{}",
        indent(&String::from_utf8_lossy(&stats.stdout))
    );

    terminate(daemon.id());
    let _ = daemon.wait();
    std::thread::sleep(Duration::from_millis(100));
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "6. connguard stopped: its programs are detached and the client is unguarded again (fail-open)."
    );
    Ok(())
}

fn indent(text: &str) -> String {
    text.lines().map(|l| format!("    {l}\n")).collect()
}

fn terminate(pid: u32) {
    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(pid.to_string())
        .status();
}
