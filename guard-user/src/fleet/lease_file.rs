//! The lease a daemon leaves to the next one on the same machine: its id, the identity
//! it holds, and until when (CLOCK_BOOTTIME, which counts across process restarts and
//! suspend) the shares it enforced are covered by it. A restarted daemon adopts its own
//! records through it, and keeps the shares the kernel holds until that time.
use std::{
    path::Path,
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Saved {
    pub identity: String,
    pub lease: i64,
    /// CLOCK_BOOTTIME in ms until which the shares stand.
    pub until_ms: u64,
}

impl Saved {
    /// The saved lease of `identity`, and the instant its shares stand until (None
    /// when that has passed); a missing or unreadable file is no lease.
    pub fn load(path: &Path, identity: &str) -> Option<(i64, Option<Instant>)> {
        let text = std::fs::read(path).ok()?;
        let saved: Saved = match serde_json::from_slice(&text) {
            Ok(s) => s,
            Err(e) => {
                log::warn!("fleet: ignoring {}: {e}", path.display());
                return None;
            }
        };
        if saved.identity != identity {
            return None;
        }
        let left = saved.until_ms.checked_sub(boottime_ms()).filter(|l| *l > 0);
        Some((
            saved.lease,
            left.map(|l| Instant::now() + Duration::from_millis(l)),
        ))
    }

    /// Replaces the file (written aside, then renamed: a reader sees the old or the new).
    pub fn store(path: &Path, identity: &str, lease: i64, until: Instant) -> std::io::Result<()> {
        let left = until.saturating_duration_since(Instant::now()).as_millis() as u64;
        let saved = Saved {
            identity: identity.to_string(),
            lease,
            until_ms: boottime_ms() + left,
        };
        let aside = path.with_extension("new");
        std::fs::write(&aside, serde_json::to_vec(&saved)?)?;
        std::fs::rename(aside, path)
    }
}

fn boottime_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_saved_lease_comes_back_for_its_identity_only_with_its_time_left() {
        let dir = std::env::temp_dir().join(format!("connguard-lease-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("fleet-lease");
        assert_eq!(Saved::load(&path, "h1"), None);
        Saved::store(&path, "h1", 42, Instant::now() + Duration::from_secs(5)).unwrap();
        let (lease, until) = Saved::load(&path, "h1").unwrap();
        assert_eq!(lease, 42);
        let left = until.unwrap().saturating_duration_since(Instant::now());
        assert!(
            left > Duration::from_secs(4) && left <= Duration::from_secs(5),
            "{left:?}"
        );
        assert_eq!(Saved::load(&path, "h2"), None);
        Saved::store(&path, "h1", 43, Instant::now()).unwrap();
        assert_eq!(Saved::load(&path, "h1"), Some((43, None)));
        std::fs::write(&path, "not json").unwrap();
        assert_eq!(Saved::load(&path, "h1"), None);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
