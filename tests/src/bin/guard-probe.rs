//! guard-probe: the client side of connguard's integration tests. The tests start it
//! inside a test cgroup (and sometimes a test netns); it drives real sockets and prints
//! one JSON object with what the kernel answered.
use std::{
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    sync::{Arc, Barrier, Mutex},
    thread,
    time::{Duration, Instant},
};

use anyhow::Context;
use clap::Parser;
use connguard_tests::{Outcome, Probe, monotonic_ms};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

fn main() -> anyhow::Result<()> {
    let out = match Probe::parse() {
        Probe::Connect {
            addr,
            count,
            concurrency,
        } => connect(addr, count, concurrency).0,
        Probe::Hold {
            addr,
            count,
            concurrency,
        } => {
            let (out, held) = connect(addr, count, concurrency);
            hold(&out, held)
        }
        Probe::Storm {
            addr,
            threads,
            seconds,
        } => storm(addr, threads, seconds),
        Probe::Udp { addr, cycles } => udp(addr, cycles)?,
        Probe::Migrate { addr, cgroup_dir } => migrate(addr, &cgroup_dir)?,
        Probe::Tfo { netns, addr } => tfo(&netns, addr)?,
        Probe::Mptcp { addr, count } => mptcp(addr, count)?,
        Probe::FailHold {
            netns,
            addr,
            listen,
        } => {
            enter_netns(&netns)?;
            let out = Mutex::new(Outcome::default());
            let s = tcp_socket(&addr);
            let started = Instant::now();
            record(&out, &s.connect(&addr.into()), started);
            if listen {
                s.listen(1).expect("listen() after the failed connect");
            }
            hold(&out.into_inner().unwrap(), vec![s])
        }
        Probe::Serve { netns, ports } => {
            enter_netns(&netns)?;
            for p in ports {
                serve(p.port, p.greet)?;
            }
            hold(&Outcome::default(), Vec::new())
        }
        Probe::Churn {
            netns,
            addr,
            count,
            per_second,
            reset,
        } => churn(&netns, addr, count, per_second, reset)?,
        Probe::Spray { netns, count, port } => {
            enter_netns(&netns)?;
            let out = Mutex::new(Outcome::default());
            for i in 0..count {
                let ip = Ipv4Addr::new(
                    127,
                    1 + (i / 65025) as u8,
                    ((i / 255) % 255) as u8,
                    (i % 255) as u8 + 1,
                );
                let addr = SocketAddr::from((ip, port));
                let s = tcp_socket(&addr);
                let started = Instant::now();
                record(&out, &s.connect(&addr.into()), started);
            }
            out.into_inner().unwrap()
        }
        // A timeout counts as failing at TIMEOUT_MS.
        Probe::Shedlat {
            netns,
            addr,
            count,
            timeout_ms,
        } => {
            enter_netns(&netns)?;
            let out = Mutex::new(Outcome::default());
            let mut us = Vec::new();
            for _ in 0..count {
                let s = tcp_socket(&addr);
                let started = Instant::now();
                let r = match timeout_ms {
                    Some(ms) => s.connect_timeout(&addr.into(), Duration::from_millis(ms)),
                    None => s.connect(&addr.into()),
                };
                if r.is_err() {
                    us.push(started.elapsed().as_nanos() as u64);
                }
                record(&out, &r, started);
            }
            us.sort_unstable();
            let mut out = out.into_inner().unwrap();
            let pct = |p: usize| {
                us.get((us.len() * p / 100).min(us.len().saturating_sub(1)))
                    .copied()
                    .unwrap_or(0)
            };
            out.categories.insert("p50_ns".into(), pct(50));
            out.categories.insert("p99_ns".into(), pct(99));
            out
        }
        // --on-usr1 is a test's cue where a timer would race a slow guest.
        Probe::Listen {
            netns,
            addr,
            backlog,
            accept_after_ms,
            on_usr1,
        } => {
            let usr1 = on_usr1.then(blocked_usr1);
            let after = accept_after_ms.map(Duration::from_millis);
            let (s, l) = listener(&netns, addr, backlog)?;
            if usr1.is_some() || after.is_some() {
                thread::spawn(move || {
                    if let Some(set) = usr1 {
                        let mut signal = 0;
                        // SAFETY: set is initialised, signal a valid out-pointer.
                        unsafe { libc::sigwait(&set, &mut signal) };
                    }
                    thread::sleep(after.unwrap_or_default());
                    for c in l.incoming().flatten() {
                        std::mem::forget(c);
                    }
                });
            }
            hold(&Outcome::default(), vec![s])
        }
        Probe::Open {
            netns,
            addr,
            count,
            interval_ms,
            timeout_ms,
        } => {
            enter_netns(&netns)?;
            let (interval, timeout) = (
                Duration::from_millis(interval_ms),
                Duration::from_millis(timeout_ms),
            );
            let out = Mutex::new(Outcome::default());
            let mut held = Vec::new();
            for _ in 0..count {
                let s = tcp_socket(&addr);
                let started = Instant::now();
                record(&out, &s.connect_timeout(&addr.into(), timeout), started);
                held.push(s);
                thread::sleep(interval);
            }
            hold(&out.into_inner().unwrap(), held)
        }
        Probe::Burst {
            netns,
            addr,
            count,
            timeout_ms,
            retries,
            pause_ms,
        } => {
            enter_netns(&netns)?;
            let pause = Duration::from_millis(pause_ms);
            let (out, held) = burst(addr, count, timeout_ms, retries, pause);
            hold(&out, held)
        }
        Probe::Reuseport {
            netns,
            addr,
            backlog,
            members,
        } => {
            enter_netns(&netns)?;
            let mut held = Vec::new();
            for i in 0..members {
                let s = tcp_socket(&addr);
                s.set_reuse_port(true)?;
                s.bind(&addr.into())?;
                s.listen(if i == 0 { backlog as i32 } else { 1024 })?;
                if i > 0 {
                    let l: TcpListener = s.try_clone()?.into();
                    thread::spawn(move || l.incoming().flatten().for_each(std::mem::forget));
                }
                held.push(s);
            }
            hold(&Outcome::default(), held)
        }
        Probe::Echo1 {
            netns,
            addr,
            backlog,
        } => {
            let (s, l) = listener(&netns, addr, backlog)?;
            thread::spawn(move || {
                if let Ok((mut c, _)) = l.accept() {
                    let mut buf = [0u8; 64];
                    while let Ok(n) = c.read(&mut buf) {
                        if n == 0 || c.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                }
            });
            hold(&Outcome::default(), vec![s])
        }
        Probe::Talk {
            netns,
            addr,
            rounds,
            interval_ms,
        } => {
            enter_netns(&netns)?;
            let mut out = Outcome::default();
            let mut c = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
            c.set_read_timeout(Some(Duration::from_secs(1)))?;
            for _ in 0..rounds {
                out.attempts += 1;
                let mut buf = [0u8; 1];
                match c.write_all(b"x").and_then(|()| c.read_exact(&mut buf)) {
                    Ok(()) if buf == *b"x" => out.ok += 1,
                    Ok(()) => *out.errors.entry("wrong echo".into()).or_default() += 1,
                    Err(e) => *out.errors.entry(errno_name(&e)).or_default() += 1,
                }
                thread::sleep(Duration::from_millis(interval_ms));
            }
            out
        }
        // A proxy that binds its source address first, as Envoy binds 127.0.0.6.
        Probe::Bind {
            netns,
            addr,
            count,
            destinations,
        } => {
            enter_netns(&netns)?;
            let out = Mutex::new(Outcome::default());
            let mut held = Vec::new();
            for i in 0..count as usize {
                let s = tcp_socket(&addr);
                let started = Instant::now();
                let mut r = s.bind(&addr.into());
                if let (Ok(()), Some(dst)) = (&r, destinations.get(i % destinations.len().max(1))) {
                    r = s.connect(&(*dst).into());
                }
                record(&out, &r, started);
                if r.is_ok() {
                    held.push(s);
                }
            }
            hold(&out.into_inner().unwrap(), held)
        }
        Probe::Mixed { netns, count } => mixed(&netns, count)?,
        Probe::Paced {
            addr,
            count,
            spread_ms,
            fill_ms,
        } => paced(addr, count, spread_ms, fill_ms),
        Probe::Handshakes {
            netns,
            addr,
            count,
            timeout_ms,
        } => {
            enter_netns(&netns)?;
            handshakes(addr, count, timeout_ms)
        }
        Probe::Segments {
            netns,
            from,
            addr,
            count,
            sport,
            seq,
            rst,
        } => {
            enter_netns(&netns)?;
            segments(&from, addr, count, sport, seq, rst)?
        }
    };
    println!("{}", serde_json::to_string(&out)?);
    Ok(())
}

fn errno_name(e: &std::io::Error) -> String {
    let names = [
        (libc::ECONNREFUSED, "ECONNREFUSED"),
        (libc::EPERM, "EPERM"),
        (libc::ETIMEDOUT, "ETIMEDOUT"),
        (libc::ENETUNREACH, "ENETUNREACH"),
        (libc::EHOSTUNREACH, "EHOSTUNREACH"),
        (libc::EADDRNOTAVAIL, "EADDRNOTAVAIL"),
        (libc::EADDRINUSE, "EADDRINUSE"),
        (libc::EINPROGRESS, "EINPROGRESS"),
        (libc::ECONNRESET, "ECONNRESET"),
    ];
    if e.raw_os_error().is_none() && e.kind() == std::io::ErrorKind::TimedOut {
        // connect_timeout() ran out: the kernel had not answered yet.
        return "TIMEOUT".into();
    }
    let code = e.raw_os_error().unwrap_or(0);
    names
        .iter()
        .find(|(c, _)| *c == code)
        .map_or(format!("errno{code}"), |(_, n)| n.to_string())
}

/// COUNT MPTCP connects to ADDR in turn, each held until all are made; closed at exit.
fn mptcp(addr: SocketAddr, count: u64) -> anyhow::Result<Outcome> {
    const IPPROTO_MPTCP: i32 = 262;
    let out = Mutex::new(Outcome::default());
    let mut held = Vec::new();
    for _ in 0..count {
        let s = Socket::new(
            Domain::for_address(addr),
            Type::STREAM,
            Some(Protocol::from(IPPROTO_MPTCP)),
        )
        .context("socket(IPPROTO_MPTCP): is MPTCP built in and net.mptcp.enabled 1?")?;
        let started = Instant::now();
        record(&out, &s.connect(&addr.into()), started);
        held.push(s);
    }
    Ok(out.into_inner().unwrap())
}

fn record(out: &Mutex<Outcome>, result: &std::io::Result<()>, started: Instant) {
    let mut o = out.lock().unwrap();
    o.attempts += 1;
    match result {
        Ok(()) => o.ok += 1,
        Err(e) => {
            *o.errors.entry(errno_name(e)).or_default() += 1;
            o.max_error_us = o.max_error_us.max(started.elapsed().as_micros() as u64);
        }
    }
}

/// setsockopt(IPPROTO_TCP, option, n).
fn set_int(s: &Socket, option: libc::c_int, n: libc::c_int) {
    let fd = std::os::fd::AsRawFd::as_raw_fd(s);
    let size = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    let rc =
        unsafe { libc::setsockopt(fd, libc::IPPROTO_TCP, option, (&raw const n).cast(), size) };
    assert_eq!(
        rc,
        0,
        "setsockopt {option}: {}",
        std::io::Error::last_os_error()
    );
}

fn tcp_socket(addr: &SocketAddr) -> Socket {
    Socket::new(
        Domain::for_address(*addr),
        Type::STREAM,
        Some(Protocol::TCP),
    )
    .expect("socket()")
}

/// COUNT clients on threads started together, each connecting with TIMEOUT_MS until it
/// succeeds, trying again PAUSE after ECONNREFUSED, at most RETRIES times. `ok`
/// counts clients connected, `attempts` and `errors` every connect(); `categories`:
/// first_refused (clients whose first connect was refused), max_ok_us (the slowest
/// successful connect: a SYN retransmit makes it over 1 s), ok_at_ms (CLOCK_MONOTONIC
/// of the last success). Returns the connections.
fn burst(
    addr: SocketAddr,
    count: u64,
    timeout_ms: u64,
    retries: u64,
    pause: Duration,
) -> (Outcome, Vec<Socket>) {
    let out = Mutex::new(Outcome::default());
    let held = Mutex::new(Vec::new());
    let barrier = Barrier::new(count as usize);
    let timeout = Duration::from_millis(timeout_ms);
    thread::scope(|scope| {
        for _ in 0..count {
            scope.spawn(|| {
                barrier.wait();
                for attempt in 0..=retries {
                    let s = tcp_socket(&addr);
                    let started = Instant::now();
                    let r = s.connect_timeout(&addr.into(), timeout);
                    let took = started.elapsed().as_micros() as u64;
                    record(&out, &r, started);
                    let mut o = out.lock().unwrap();
                    match r {
                        Ok(()) => {
                            let max = o.categories.entry("max_ok_us".into()).or_default();
                            *max = (*max).max(took);
                            o.categories.insert("ok_at_ms".into(), monotonic_ms());
                            held.lock().unwrap().push(s);
                            return;
                        }
                        Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => {
                            if attempt == 0 {
                                *o.categories.entry("first_refused".into()).or_default() += 1;
                            }
                            drop(o);
                            thread::sleep(pause);
                        }
                        Err(_) => return,
                    }
                }
            });
        }
    });
    // A client succeeds once at most: `ok` counts clients.
    (out.into_inner().unwrap(), held.into_inner().unwrap())
}

/// COUNT connects to ADDR from one thread, the i-th started SPREAD_MS × i / COUNT after
/// the first; each connection is closed at once. `categories`: refill_us, the time from
/// the start of the first connect() to the start of the last, each pause between two
/// counted up to FILL_MS.
fn paced(addr: SocketAddr, count: u64, spread_ms: u64, fill_ms: u64) -> Outcome {
    let out = Mutex::new(Outcome::default());
    let start = Instant::now();
    let fill = Duration::from_millis(fill_ms);
    // From the first connect() on, not from the start: a first attempt in a slow guest
    // can come milliseconds late (the first socket of a new process and cgroup).
    let mut last: Option<Instant> = None;
    let mut refill = Duration::ZERO;
    for i in 0..count {
        let due = start + Duration::from_micros(spread_ms * 1000 * i / count);
        while Instant::now() < due {
            std::hint::spin_loop();
        }
        let s = tcp_socket(&addr);
        let now = Instant::now();
        if let Some(last) = last {
            refill += (now - last).min(fill);
        }
        last = Some(now);
        record(&out, &s.connect(&addr.into()), now);
    }
    let mut out = out.into_inner().unwrap();
    out.categories
        .insert("refill_us".into(), refill.as_micros() as u64);
    out
}

/// COUNT connects to ADDR from threads started together, each given up after
/// TIMEOUT_MS (TIMEOUT in `errors`). `categories`: refused_max_us, the longest a
/// refused connect() took.
fn handshakes(addr: SocketAddr, count: u64, timeout_ms: u64) -> Outcome {
    let out = Arc::new(Mutex::new(Outcome::default()));
    let refused_max = Arc::new(Mutex::new(0u64));
    let barrier = Arc::new(Barrier::new(count as usize));
    let threads: Vec<_> = (0..count)
        .map(|_| {
            let (out, refused_max, barrier) = (out.clone(), refused_max.clone(), barrier.clone());
            thread::spawn(move || {
                let s = tcp_socket(&addr);
                barrier.wait();
                let started = Instant::now();
                let r = s.connect_timeout(&addr.into(), Duration::from_millis(timeout_ms));
                if r.as_ref()
                    .is_err_and(|e| e.raw_os_error() == Some(libc::ECONNREFUSED))
                {
                    let mut m = refused_max.lock().unwrap();
                    *m = (*m).max(started.elapsed().as_micros() as u64);
                }
                record(&out, &r, started);
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    let mut out = Arc::try_unwrap(out).unwrap().into_inner().unwrap();
    let refused_max = *refused_max.lock().unwrap();
    out.categories.insert("refused_max_us".into(), refused_max);
    out
}

/// COUNT blocking connects from CONCURRENCY threads started together; returns the
/// outcome and the connected sockets.
fn connect(addr: SocketAddr, count: u64, concurrency: u64) -> (Outcome, Vec<Socket>) {
    let out = Arc::new(Mutex::new(Outcome::default()));
    let held = Arc::new(Mutex::new(Vec::new()));
    let barrier = Arc::new(Barrier::new(concurrency as usize));
    let threads: Vec<_> = (0..concurrency)
        .map(|t| {
            let (out, held, barrier) = (out.clone(), held.clone(), barrier.clone());
            thread::spawn(move || {
                barrier.wait();
                for _ in (t..count).step_by(concurrency as usize) {
                    let s = tcp_socket(&addr);
                    let started = Instant::now();
                    let r = s.connect(&addr.into());
                    record(&out, &r, started);
                    if r.is_ok() {
                        held.lock().unwrap().push(s);
                    }
                }
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    let held = std::mem::take(&mut *held.lock().unwrap());
    (Arc::try_unwrap(out).unwrap().into_inner().unwrap(), held)
}

/// THREADS threads connect, hold each connection 2 ms, close, for SECONDS.
fn storm(addr: SocketAddr, threads: u64, seconds: u64) -> Outcome {
    let out = Arc::new(Mutex::new(Outcome::default()));
    let until = Instant::now() + Duration::from_secs(seconds);
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let out = out.clone();
            thread::spawn(move || {
                while Instant::now() < until {
                    let s = tcp_socket(&addr);
                    let started = Instant::now();
                    let r = s.connect(&addr.into());
                    record(&out, &r, started);
                    if r.is_ok() {
                        thread::sleep(Duration::from_millis(2));
                        // Close gracefully: FIN, then wait for the server's FIN, so that
                        // both ends agree when the connection is over. (A plain close()
                        // orphans the socket, which the kernel moves to TCP_CLOSE as soon
                        // as its FIN is acked, while the server may still hold its half.)
                        let _ = s.shutdown(std::net::Shutdown::Write);
                        let _ = std::io::Read::read(&mut &s, &mut [0u8; 1]);
                    }
                }
            })
        })
        .collect();
    handles.into_iter().for_each(|t| t.join().unwrap());
    Arc::try_unwrap(out).unwrap().into_inner().unwrap()
}

/// Blocks SIGUSR1 in this thread (and the threads it starts after), so that it waits
/// for `sigwait` rather than ending the process; the set holding it.
fn blocked_usr1() -> libc::sigset_t {
    // SAFETY: the set is initialised by sigemptyset before any other use.
    unsafe {
        let mut set = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGUSR1);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// Prints the outcome, then keeps the connections open until killed.
fn hold(out: &Outcome, held: Vec<Socket>) -> ! {
    println!("{}", serde_json::to_string(out).unwrap());
    std::io::stdout().flush().unwrap();
    let _held = held;
    loop {
        thread::sleep(Duration::from_secs(3600));
    }
}

/// Creates a TCP socket here, moves this process into the cgroup at CGROUP_DIR, then
/// connects: the connection belongs to the cgroup the socket was created in.
fn migrate(addr: SocketAddr, cgroup_dir: &str) -> anyhow::Result<Outcome> {
    let s = tcp_socket(&addr);
    let procs = format!("{cgroup_dir}/cgroup.procs");
    std::fs::write(&procs, std::process::id().to_string())
        .with_context(|| format!("write {procs}"))?;
    let out = Mutex::new(Outcome::default());
    let started = Instant::now();
    record(&out, &s.connect(&addr.into()), started);
    Ok(out.into_inner().unwrap())
}

/// TCP_FASTOPEN_CONNECT, in a netns whose net.ipv4.tcp_fastopen lets clients go
/// without a cookie (5): connect() returns at once, in SYN_SENT, and defers the SYN to
/// the first send; the socket is closed without sending, so tcp_connect() never runs.
fn tfo(netns: &str, addr: SocketAddr) -> anyhow::Result<Outcome> {
    enter_netns(netns)?;
    let s = tcp_socket(&addr);
    set_int(&s, libc::TCP_FASTOPEN_CONNECT, 1);
    let out = Mutex::new(Outcome::default());
    let started = Instant::now();
    record(&out, &s.connect(&addr.into()), started);
    drop(s);
    Ok(out.into_inner().unwrap())
}

/// A server on 127.0.0.1:PORT that waits for each client's FIN, then closes: TIME_WAIT
/// lands on the client side. With `greet`, it sends each client one byte as it accepts
/// it and closes: a client that resets at once waits for that byte (without it, such a
/// client outruns the accept loop, the accept queue overflows, and connects stall 1 s
/// on a SYN retransmit), and its RST leaves no TIME_WAIT on either side.
fn serve(port: u16, greet: bool) -> anyhow::Result<()> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, port))?;
    thread::spawn(move || {
        for mut c in l.incoming().flatten() {
            if greet {
                let _ = c.write_all(b"g");
                continue;
            }
            thread::spawn(move || {
                let _ = c.read(&mut [0u8; 1]);
            });
        }
    });
    Ok(())
}

/// Inside NETNS_PATH, COUNT connections to ADDR, each closed by the client first and
/// after the server's FIN (leaving TIME_WAIT on the client side), PER_SECOND at most
/// (0: as fast as possible). `categories` has the 1-based attempt number of the first
/// EADDRNOTAVAIL and of the first ECONNREFUSED (0 if none), and the run's elapsed_ns.
/// With `reset`, each is closed once the server's greeting byte (`serve greet:PORT`) is
/// read, with SO_LINGER 0: a RST, no TIME_WAIT.
fn churn(
    netns: &str,
    target: SocketAddr,
    count: u64,
    per_second: u64,
    reset: bool,
) -> anyhow::Result<Outcome> {
    enter_netns(netns)?;
    let out = Mutex::new(Outcome::default());
    let (mut first_eaddrnotavail, mut first_refused) = (0, 0);
    let started_all = Instant::now();
    for i in 1..=count {
        if per_second > 0 {
            let due = started_all + Duration::from_secs_f64((i - 1) as f64 / per_second as f64);
            thread::sleep(due.saturating_duration_since(Instant::now()));
        }
        let s = tcp_socket(&target);
        let started = Instant::now();
        let r = s.connect(&target.into());
        match r.as_ref().map_err(|e| e.raw_os_error()) {
            Err(Some(libc::EADDRNOTAVAIL)) if first_eaddrnotavail == 0 => first_eaddrnotavail = i,
            Err(Some(libc::ECONNREFUSED)) if first_refused == 0 => first_refused = i,
            _ => {}
        }
        record(&out, &r, started);
        if r.is_ok() && reset {
            let _ = std::io::Read::read(&mut &s, &mut [0u8; 1]);
            let _ = s.set_linger(Some(Duration::ZERO));
        } else if r.is_ok() {
            let _ = s.shutdown(std::net::Shutdown::Write);
            let _ = std::io::Read::read(&mut &s, &mut [0u8; 1]);
        }
    }
    let mut out = out.into_inner().unwrap();
    out.categories
        .insert("elapsed_ns".into(), started_all.elapsed().as_nanos() as u64);
    out.categories
        .insert("first_eaddrnotavail".into(), first_eaddrnotavail);
    out.categories.insert("first_refused".into(), first_refused);
    Ok(out)
}

/// Inside NETNS_PATH, a socket listening on ADDR with BACKLOG, and the same socket as a
/// std listener for accepting.
fn listener(netns: &str, addr: SocketAddr, backlog: u64) -> anyhow::Result<(Socket, TcpListener)> {
    enter_netns(netns)?;
    let s = tcp_socket(&addr);
    s.set_reuse_address(true)?;
    s.bind(&addr.into())?;
    s.listen(backlog as i32)?;
    let l = s.try_clone()?.into();
    Ok((s, l))
}

/// Moves this (still single-threaded) process into the network namespace at `path`.
fn enter_netns(path: &str) -> anyhow::Result<()> {
    let ns = std::fs::File::open(path).with_context(|| format!("open {path}"))?;
    if unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&ns), libc::CLONE_NEWNET) } != 0 {
        anyhow::bail!("setns {path}: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// UDP sockets connected to ADDR (which runs the connect hooks), sending one datagram
/// each, plus as many unconnected sendto()s.
fn udp(addr: SocketAddr, cycles: u64) -> anyhow::Result<Outcome> {
    let mut out = Outcome::default();
    for _ in 0..cycles {
        let s = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
        let r = s
            .connect(&addr.into())
            .and_then(|()| s.send(b"x").map(|_| ()));
        out.attempts += 1;
        match r {
            Ok(()) => out.ok += 1,
            Err(e) => *out.errors.entry(errno_name(&e)).or_default() += 1,
        }
        s.send_to(b"y", &addr.into())?;
    }
    Ok(out)
}

/// COUNT connection attempts with every outcome a connection can have, inside the
/// network namespace at NETNS_PATH (which has lo, and a route to 192.0.2.0/24 on an
/// interface that swallows whatever is sent to 192.0.2.2). Category counts are reported
/// under `errors` (errnos) and `categories`, which also gives the loopback servers' ports
/// (`port_server_closed`; `port_client_closed`, which `addr_taken` connects to too;
/// `port_refused`).
fn mixed(netns: &str, count: u64) -> anyhow::Result<Outcome> {
    enter_netns(netns)?;
    // Server A closes first; server B waits for the client to close.
    let server_close = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let client_close = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let a = server_close.local_addr()?;
    let b = client_close.local_addr()?;
    thread::spawn(move || {
        for c in server_close.incoming().flatten() {
            drop(c);
        }
    });
    thread::spawn(move || {
        for mut c in client_close.incoming().flatten() {
            thread::spawn(move || {
                let _ = c.read(&mut [0u8; 1]);
            });
        }
    });
    let closed_port: SocketAddr = {
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        l.local_addr()?
    };
    let black_hole: SocketAddr = "192.0.2.2:80".parse()?;
    let no_route: SocketAddr = "198.51.100.1:80".parse()?;

    let out = Arc::new(Mutex::new(Outcome::default()));
    // The loopback ports, so that a count left on one names its outcomes.
    for (name, port) in [
        ("port_server_closed", a.port()),
        ("port_client_closed", b.port()),
        ("port_refused", closed_port.port()),
    ] {
        out.lock()
            .unwrap()
            .categories
            .insert(name.into(), port.into());
    }
    let cat = |out: &Mutex<Outcome>, name: &str| {
        *out.lock()
            .unwrap()
            .categories
            .entry(name.into())
            .or_default() += 1
    };

    // Four attempts that time out in the kernel: one SYN retransmit (TCP_SYNCNT 1), ~3 s.
    let timeouts: Vec<_> = (0..4)
        .map(|_| {
            let out = out.clone();
            thread::spawn(move || {
                let s = tcp_socket(&black_hole);
                set_int(&s, libc::TCP_SYNCNT, 1);
                let started = Instant::now();
                let r = s.connect(&black_hole.into());
                record(&out, &r, started);
                cat(&out, "timed_out");
            })
        })
        .collect();

    let workers = 8u64;
    let handles: Vec<_> = (0..workers)
        .map(|w| {
            let out = out.clone();
            thread::spawn(move || {
                let mut reuse_port = None;
                for i in (w..count - 4).step_by(workers as usize) {
                    let started = Instant::now();
                    match i % 50 {
                        // Accepted, then closed by the server.
                        0..=29 => {
                            let r = TcpStream::connect(a).map(|mut s| {
                                let _ = s.read(&mut [0u8; 1]);
                            });
                            record(&out, &r, started);
                            cat(&out, "server_closed");
                        }
                        // Accepted, then closed by the client.
                        30..=39 => {
                            let r = TcpStream::connect(b).map(drop);
                            record(&out, &r, started);
                            cat(&out, "client_closed");
                        }
                        // Refused by RST from a closed port.
                        40..=44 => {
                            record(&out, &TcpStream::connect(closed_port).map(drop), started);
                            cat(&out, "refused");
                        }
                        // Non-blocking connect (EINPROGRESS), asked again (EALREADY: the
                        // same attempt, not a new one), then abandoned in SYN_SENT.
                        45..=46 => {
                            let s = tcp_socket(&black_hole);
                            s.set_nonblocking(true).unwrap();
                            let r = match s.connect(&black_hole.into()) {
                                Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => Ok(()),
                                other => other,
                            };
                            record(&out, &r, started);
                            let again = s.connect(&black_hole.into()).map_err(|e| e.raw_os_error());
                            assert_eq!(
                                again,
                                Err(Some(libc::EALREADY)),
                                "second connect on a pending socket"
                            );
                            cat(&out, "abandoned");
                        }
                        // Failed before the SYN: no route (the socket stays in TCP_CLOSE)...
                        47 => {
                            let s = tcp_socket(&no_route);
                            record(&out, &s.connect(&no_route.into()), started);
                            // ...and a reconnect on the same socket after the failure.
                            record(&out, &s.connect(&no_route.into()), started);
                            cat(&out, "no_route_twice");
                        }
                        // Failed after SYN_SENT: 4-tuple taken (EADDRNOTAVAIL), using two
                        // sockets bound to the same local port.
                        _ => {
                            let bind = |port: u16| {
                                let s = tcp_socket(&b);
                                s.set_reuse_address(true).unwrap();
                                s.bind(&SockAddr::from(SocketAddr::from((
                                    Ipv4Addr::LOCALHOST,
                                    port,
                                ))))
                                .map(|()| s)
                            };
                            let first = bind(reuse_port.unwrap_or(0)).unwrap();
                            reuse_port = first
                                .local_addr()
                                .ok()
                                .and_then(|a| a.as_socket())
                                .map(|a| a.port());
                            record(&out, &first.connect(&b.into()), started);
                            let second = bind(reuse_port.unwrap()).unwrap();
                            record(&out, &second.connect(&b.into()), started);
                            reuse_port = None;
                            cat(&out, "addr_taken");
                        }
                    }
                }
            })
        })
        .collect();
    handles
        .into_iter()
        .chain(timeouts)
        .for_each(|t| t.join().unwrap());
    Ok(Arc::try_unwrap(out).unwrap().into_inner().unwrap())
}

/// COUNT raw TCP segments to ADDR (see `Probe::Segments`), built by etherparse and sent
/// through an IPPROTO_RAW socket (IP_HDRINCL): the kernel sends them as they are, with
/// whatever source address they carry.
fn segments(
    from: &str,
    addr: SocketAddr,
    count: u64,
    sport: u16,
    seq: u32,
    rst: bool,
) -> anyhow::Result<Outcome> {
    let SocketAddr::V4(dst) = addr else {
        anyhow::bail!("segments: {addr} is not IPv4");
    };
    let (first, len) = match from.split_once('/') {
        Some((a, len)) => (a.parse::<Ipv4Addr>()?, len.parse::<u32>()?),
        None => (from.parse::<Ipv4Addr>()?, 32),
    };
    // Addresses of the network after its first (all of a /32, its one).
    let size = 1u64 << (32 - len);
    let source = |i: u64| {
        let offset = if size == 1 { 0 } else { 1 + i % (size - 1) };
        Ipv4Addr::from(u32::from(first) + offset as u32)
    };
    let s = Socket::new(
        Domain::IPV4,
        Type::RAW,
        Some(Protocol::from(libc::IPPROTO_RAW)),
    )?;
    let to = SockAddr::from(addr);
    let mut out = Outcome::default();
    let mut packet = Vec::with_capacity(64);
    for i in 0..count {
        let port = if sport == 0 {
            1024 + (i % 64_000) as u16
        } else {
            sport
        };
        let tcp = etherparse::PacketBuilder::ipv4(source(i).octets(), dst.ip().octets(), 64).tcp(
            port,
            dst.port(),
            seq,
            64_240,
        );
        let tcp = if rst { tcp.rst() } else { tcp.syn() };
        packet.clear();
        tcp.write(&mut packet, &[])?;
        out.attempts += 1;
        match s.send_to(&packet, &to) {
            Ok(_) => out.ok += 1,
            Err(e) => *out.errors.entry(errno_name(&e)).or_default() += 1,
        }
    }
    Ok(out)
}
