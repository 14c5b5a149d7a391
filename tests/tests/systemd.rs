//! The systemd unit in packaging/: it passes `systemd-analyze verify`, and the daemon
//! it starts tells systemd it is ready (Type=notify) once it is.
use std::{
    os::unix::net::UnixDatagram,
    process::Command,
    time::{Duration, Instant},
};

use connguard_api::policy::Mode;
use connguard_tests::{Cgroup, Daemon, Probe, Server, budget_policy, connguard_bin, unique};

const UNIT: &str = include_str!("../../packaging/connguard.service");

/// The unit as shipped, with the binary it runs pointed at this build (verify checks
/// that the program exists, and that the man pages its Documentation= names do).
#[test]
fn the_unit_passes_systemd_analyze_verify() {
    let dir = std::env::temp_dir().join(unique("connguard-unit"));
    std::fs::create_dir_all(&dir).unwrap();
    let unit = dir.join("connguard.service");
    let bin = connguard_bin();
    std::fs::write(
        &unit,
        UNIT.replace("/usr/bin/connguard", bin.to_str().unwrap()),
    )
    .unwrap();
    // The pages as the package installs them, in a man8/ of MANPATH.
    let man = Command::new(&bin)
        .args(["man", "--dir"])
        .arg(dir.join("man8"))
        .output()
        .unwrap();
    assert!(man.status.success(), "connguard man: {man:?}");
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&unit)
        .env("MANPATH", &dir)
        .output()
        .expect("systemd-analyze is missing: install systemd (cargo xtask setup does)");
    let _ = std::fs::remove_dir_all(&dir);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Warnings about other units of this host are not the unit's.
    let ours: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("connguard.service"))
        .collect();
    assert!(
        out.status.success() && ours.is_empty(),
        "systemd-analyze verify: {}\n{stderr}",
        out.status
    );
}

/// READY=1 reaches NOTIFY_SOCKET once the daemon governs (a connect from the scope's
/// cgroup is counted as soon as it arrives), and STOPPING=1 when it is told to stop.
#[test]
fn readiness_is_sent_once_the_policy_is_applied() {
    let server = Server::start("127.0.0.1:0");
    let cg = Cgroup::new("notify");
    let dir = std::env::temp_dir().join(unique("connguard-notify"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("notify.sock");
    let notify = UnixDatagram::bind(&path).unwrap();
    notify
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let d = Daemon::builder(budget_policy(
        "notify",
        &cg.rel,
        Mode::Enforce,
        &server.addr,
        5,
    ))
    .env("NOTIFY_SOCKET", &path)
    .start();
    let message = receive(&notify);
    assert!(message.lines().any(|l| l == "READY=1"), "{message:?}");
    let out = cg.probe(Probe::connect(server.addr, 1, 1));
    assert_eq!(out.ok, 1, "{out:?}");
    assert_eq!(d.scope("notify").counts.admitted, 1);
    // Dropped: SIGTERM, and a wait for the exit.
    drop(d);
    let message = receive(&notify);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(message.lines().any(|l| l == "STOPPING=1"), "{message:?}");
}

fn receive(socket: &UnixDatagram) -> String {
    let started = Instant::now();
    let mut buf = [0u8; 4096];
    let n = socket
        .recv(&mut buf)
        .unwrap_or_else(|e| panic!("no notification after {:?}: {e}", started.elapsed()));
    String::from_utf8_lossy(&buf[..n]).into_owned()
}
