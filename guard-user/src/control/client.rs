//! The tools' side of the control socket.
use std::{
    io::{BufRead, BufReader, Read, Write},
    os::unix::net::UnixStream,
    path::Path,
    time::Duration,
};

use anyhow::{Context, bail, ensure};
use connguard_api::control::{ErrorReply, Request};
use serde::de::DeserializeOwned;

/// Asks a running daemon; fails with the daemon's error when it answers with one.
pub fn ask<T: DeserializeOwned>(socket: &Path, request: Request) -> anyhow::Result<T> {
    answer(send(connect(socket)?, &request)?, &request)
}

/// Asks the daemon if one listens on `socket`: None when none does, for tools that work
/// without it; an error when one answers but not with a `T` (another version of
/// connguard, or an error).
pub fn ask_if_running<T: DeserializeOwned>(
    socket: &Path,
    request: Request,
) -> anyhow::Result<Option<T>> {
    match connect(socket) {
        Ok(stream) => answer(send(stream, &request)?, &request).map(Some),
        Err(_) => Ok(None),
    }
}

/// The daemon's answer on `stream`, decoded.
fn answer<T: DeserializeOwned>(mut stream: UnixStream, request: &Request) -> anyhow::Result<T> {
    let mut text = String::new();
    stream
        .read_to_string(&mut text)
        .map_err(|e| in_time(e, request))?;
    if text.starts_with(ERROR_HEAD_STR) {
        let reply: ErrorReply = serde_json::from_str(&text)?;
        bail!("the daemon answered: {}", reply.error);
    }
    serde_json::from_str(&text).with_context(|| format!("reading the daemon's answer to {request}"))
}

/// A read error, said plainly when it is the wait of `send` running out.
fn in_time(e: std::io::Error, request: &Request) -> anyhow::Error {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            anyhow::anyhow!("the daemon did not answer `{request}` in time")
        }
        _ => e.into(),
    }
}

/// A connection to the daemon on `socket`.
fn connect(socket: &Path) -> anyhow::Result<UnixStream> {
    UnixStream::connect(socket).with_context(|| {
        format!("no connguard daemon answers on {} (is `connguard run` running? pass --socket if it uses another path)", socket.display())
    })
}

/// Sends one request to the daemon on `stream`; its JSON answer is on the returned stream.
fn send(stream: UnixStream, request: &Request) -> anyhow::Result<UnixStream> {
    // A stalled daemon must not freeze the caller (`top` polls every second); a reload
    // walks the cgroup tree, which takes seconds on hosts with tens of thousands of
    // cgroups and far longer on a slow machine (docs/performance.md), and gets as long
    // as the daemon gives any reply; so does a whole snapshot, of up to the 1,048,576
    // destinations the counter map can be made to hold (`run --max-destinations`). A
    // drill that names pods or containers may first wait for a runtime to list them
    // (DRILL_LISTING, 2 s), then attach drill_egress to every governed cgroup.
    let wait = match request {
        Request::Reload => Duration::from_secs(180),
        Request::Stats { top: None } => Duration::from_secs(30),
        Request::DrillStart(_) => Duration::from_secs(30),
        _ => Duration::from_secs(5),
    };
    stream.set_read_timeout(Some(wait))?;
    send_all(&stream, format!("{request}\n").as_bytes())?;
    stream.shutdown(std::net::Shutdown::Write)?;
    Ok(stream)
}

/// Writes `bytes` to the daemon with MSG_NOSIGNAL: a daemon gone before the request is
/// written fails the command with EPIPE, where a write would end it by SIGPIPE (the
/// commands take SIGPIPE's default, for their own output).
fn send_all(stream: &UnixStream, mut bytes: &[u8]) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    while !bytes.is_empty() {
        // SAFETY: `bytes` is valid for its length for the call.
        let n = unsafe {
            libc::send(
                stream.as_raw_fd(),
                bytes.as_ptr().cast(),
                bytes.len(),
                libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        bytes = &bytes[n as usize..];
    }
    Ok(())
}

/// Copies the daemon's answer to `stats` to `out` as it arrives, without decoding it,
/// then a newline; fails with the daemon's error when it answers with one.
pub fn copy_stats(socket: &Path, out: &mut impl Write) -> anyhow::Result<()> {
    let request = Request::Stats { top: None };
    let mut answer = BufReader::with_capacity(1 << 16, send(connect(socket)?, &request)?);
    // An error answer is a small {"error": ...} object; a snapshot starts {"policy":.
    let mut head = Vec::new();
    while head.len() < ERROR_HEAD.len() {
        let chunk = answer.fill_buf().map_err(|e| in_time(e, &request))?;
        if chunk.is_empty() {
            break;
        }
        let n = chunk.len();
        head.extend_from_slice(chunk);
        answer.consume(n);
    }
    if head.starts_with(ERROR_HEAD) {
        answer.read_to_end(&mut head)?;
        let reply: ErrorReply = serde_json::from_slice(&head)?;
        bail!("the daemon answered: {}", reply.error);
    }
    // Copied as it comes; a snapshot the daemon failed to finish (it logs why) ends
    // before its closing brace, which must not pass for a whole one.
    let last_byte = |b: &[u8]| b.iter().rev().copied().find(|b| !b.is_ascii_whitespace());
    out.write_all(&head)?;
    let mut last = last_byte(&head);
    loop {
        let chunk = answer.fill_buf().map_err(|e| in_time(e, &request))?;
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

/// How the daemon's error answers begin (serde_json writes them compact).
const ERROR_HEAD_STR: &str = "{\"error\"";
const ERROR_HEAD: &[u8] = ERROR_HEAD_STR.as_bytes();
