//! The daemon's side of the control socket. Every client is served in its own task, so
//! one that never sends its line, never reads, or sends too much delays nobody: the
//! request line must arrive within READ_TIMEOUT and fit in MAX_REQUEST bytes, and a reply
//! that makes no progress for WRITE_TIMEOUT, or is not sent by REPLY_DEADLINE, is
//! abandoned. At most MAX_REPLIES replies are built or sent at once.
use std::{
    io::{self, BufWriter, Write},
    os::unix::{
        fs::{DirBuilderExt, FileTypeExt},
        net::{UnixListener, UnixStream},
    },
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use connguard_api::control::{MAX_REQUEST, Reply, Request};
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, BufReader},
    sync::Semaphore,
};

const READ_TIMEOUT: Duration = Duration::from_secs(2);
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
const REPLY_DEADLINE: Duration = Duration::from_secs(60);
/// Replies built or being sent at once; more clients wait their turn. This bounds the
/// memory of snapshots in flight (each holds a copy of the counters and a row per
/// destination: docs/performance.md), and keeps the blocking pool, which the periodic
/// jobs share, from filling up.
const MAX_REPLIES: usize = 8;

/// What answers requests.
pub trait Handler: Send + Sync + 'static {
    fn handle(&self, request: Request) -> Reply;
}

/// Binds the control socket at `path`: mode 0600 from its creation, in a directory
/// created with mode 0700 when it is missing. Refuses when a daemon already answers
/// there, or when something that is not a socket is in the way; a stale socket of a
/// daemon that died is replaced.
pub fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if !meta.file_type().is_socket() => bail!(
            "{} exists and is not a socket; remove it or pass another --socket",
            path.display()
        ),
        Ok(_) if UnixStream::connect(path).is_ok() => bail!(
            "another connguard daemon is serving {}; stop it or pass --socket",
            path.display()
        ),
        Ok(_) => std::fs::remove_file(path)
            .with_context(|| format!("removing the stale socket {}", path.display()))?,
        Err(_) => {}
    }
    if let Some(dir) = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty() && !d.exists())
    {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("creating {}", dir.display()))?;
    }
    // bind() creates the socket file with 0777 less the umask: 0177 leaves 0600. This
    // runs before the daemon starts any thread, so no other file sees this umask.
    // SAFETY: umask only swaps the process's file mode mask.
    let old = unsafe { libc::umask(0o177) };
    let bound = UnixListener::bind(path);
    unsafe { libc::umask(old) };
    bound.with_context(|| format!("binding {}", path.display()))
}

/// Serves the control socket forever.
pub async fn serve(listener: UnixListener, handler: Arc<dyn Handler>) -> anyhow::Result<()> {
    listener.set_nonblocking(true)?;
    let listener = tokio::net::UnixListener::from_std(listener)?;
    let replies = Arc::new(Semaphore::new(MAX_REPLIES));
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(connection(stream, handler.clone(), replies.clone()));
            }
            // Out of file descriptors, most likely: the next accept may work.
            Err(e) => {
                log::warn!("control socket: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn connection(
    mut stream: tokio::net::UnixStream,
    handler: Arc<dyn Handler>,
    replies: Arc<Semaphore>,
) {
    let request = match tokio::time::timeout(READ_TIMEOUT, read_request(&mut stream)).await {
        Ok(Ok(request)) => request,
        Ok(Err(e)) => {
            log::debug!("control socket: reading a request: {e}");
            return;
        }
        Err(_) => Err(format!(
            "no request line within {} s",
            READ_TIMEOUT.as_secs()
        )),
    };
    // The reply is built and written on the blocking pool: a snapshot of 100,000s of
    // destinations takes tens of ms to build, and it is encoded as it is sent (no copy of
    // the whole document), which needs a blocking writer.
    let stream = match stream.into_std().and_then(|s| {
        s.set_nonblocking(false)?;
        s.set_write_timeout(Some(WRITE_TIMEOUT))?;
        Ok(s)
    }) {
        Ok(s) => s,
        Err(e) => {
            log::warn!("control socket: {e}");
            return;
        }
    };
    let Ok(turn) = replies.acquire_owned().await else {
        return;
    };
    let answered = tokio::task::spawn_blocking(move || {
        let _turn = turn;
        let mut reply = match request {
            Ok(request) => handler.handle(request),
            Err(why) => Reply::error(why),
        };
        let until = Until {
            inner: stream,
            deadline: Instant::now() + REPLY_DEADLINE,
        };
        let mut out = BufWriter::with_capacity(1 << 16, until);
        let written = match &mut reply {
            Reply::Stats(snapshot) => super::stats_json::write(&mut out, snapshot),
            reply => serde_json::to_writer(&mut out, reply).map_err(std::io::Error::from),
        }
        .and_then(|()| out.flush());
        // Closes the socket: the client has its whole answer before the memory is freed.
        drop(out);
        drop(reply);
        crate::host::memory::release_freed_memory();
        written
    })
    .await;
    if let Ok(Err(e)) = answered {
        log::debug!("control socket: writing a reply: {e}");
    }
}

/// A writer that fails once its deadline has passed.
struct Until<W> {
    inner: W,
    deadline: Instant,
}

impl<W: Write> Write for Until<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if Instant::now() > self.deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the reply was not sent in time",
            ));
        }
        self.inner.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// The request line, or why it is refused (too long, not a request).
async fn read_request(stream: &mut tokio::net::UnixStream) -> io::Result<Result<Request, String>> {
    let mut line = Vec::new();
    // One byte more than allowed tells a line that is too long.
    let mut reader = BufReader::new(stream.take(MAX_REQUEST as u64 + 2));
    reader.read_until(b'\n', &mut line).await?;
    if line.last() == Some(&b'\n') {
        line.pop();
    }
    if line.len() > MAX_REQUEST {
        return Ok(Err(format!("request line longer than {MAX_REQUEST} bytes")));
    }
    Ok(std::str::from_utf8(&line)
        .map_err(|_| "the request is not UTF-8".to_string())
        .and_then(Request::parse))
}
