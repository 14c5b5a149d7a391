//! The controls' clock for the programs (guard_common::TickClock): the tick, and the
//! offset that turns jiffies into CLOCK_MONOTONIC ns.
//!
//! User space cannot read jiffies, but times(2) returns them in clock ticks
//! (jiffies_64_to_clock_t, kernel/time/time.c: floor(jiffies × tick / (1 s / USER_HZ)),
//! whatever HZ is). Spinning on it until it moves finds the moment a jiffy began: the
//! jiffies then are the least whose ticks are that value, and CLOCK_MONOTONIC read at
//! once gives the offset, to within the time between the two reads.
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use guard_common::TickClock;

/// The kernel tick (TICK_NSEC), ns: the resolution of CLOCK_MONOTONIC_COARSE
/// (posix_get_coarse_res, kernel/time/posix-timers.c).
pub fn tick_ns() -> anyhow::Result<u64> {
    let mut res = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_getres writes the timespec it is given.
    if unsafe { libc::clock_getres(libc::CLOCK_MONOTONIC_COARSE, &mut res) } != 0 {
        return Err(std::io::Error::last_os_error())
            .context("clock_getres(CLOCK_MONOTONIC_COARSE)");
    }
    Ok(res.tv_sec as u64 * 1_000_000_000 + res.tv_nsec as u64)
}

/// Measures the clock; takes up to SAMPLES clock ticks (10 ms each at USER_HZ 100).
pub fn tick_clock() -> anyhow::Result<TickClock> {
    let tick_ns = tick_ns()?;
    // SAFETY: sysconf has no preconditions.
    let user_hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if tick_ns == 0 || user_hz <= 0 {
        bail!("no kernel tick: CLOCK_MONOTONIC_COARSE resolution {tick_ns} ns, USER_HZ {user_hz}");
    }
    // SAFETY: times(NULL) only returns the count; its return is never an error on
    // Linux (a value that looks negative is a large count).
    let clock_ticks = || unsafe { libc::times(std::ptr::null_mut()) } as u64;
    // A thread preempted between the two reads sees CLOCK_MONOTONIC late, which makes
    // the offset smaller: the largest of a few is the truest.
    let deadline = Instant::now() + Duration::from_secs(1);
    let mut offset_ns = None::<u64>;
    let mut last = clock_ticks();
    for _ in 0..SAMPLES {
        loop {
            let ticks = clock_ticks();
            let mono = guard_common::monotonic_ns();
            if ticks != last {
                let jiffies = jiffies_at(ticks, tick_ns, 1_000_000_000 / user_hz as u64);
                let offset = jiffies.wrapping_mul(tick_ns).wrapping_sub(mono);
                offset_ns = Some(offset_ns.map_or(offset, |o| o.max(offset)));
                last = ticks;
                break;
            }
            if Instant::now() > deadline {
                bail!("times(2) did not move in 1 s");
            }
        }
    }
    Ok(TickClock {
        tick_ns,
        offset_ns: offset_ns.unwrap_or_default(),
    })
}

/// Moments a clock tick began that the offset is taken from.
const SAMPLES: usize = 3;

/// The least jiffies count whose clock ticks (of `per_tick_ns` each) are `ticks`, with
/// jiffies of `tick_ns`: the jiffies at the moment the tick count became `ticks`.
fn jiffies_at(ticks: u64, tick_ns: u64, per_tick_ns: u64) -> u64 {
    (ticks as u128 * per_tick_ns as u128).div_ceil(tick_ns as u128) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// HZ 250, 100 and 1000 against USER_HZ 100: the inverse of jiffies_64_to_clock_t.
    #[test]
    fn jiffies_at_inverts_the_kernels_conversion() {
        for tick_ns in [4_000_000u64, 10_000_000, 1_000_000] {
            let to_ticks = |j: u64| j * tick_ns / 10_000_000;
            for j in 4_294_892_296u64..4_294_892_296 + 1000 {
                let t = to_ticks(j);
                if to_ticks(j - 1) != t {
                    assert_eq!(jiffies_at(t, tick_ns, 10_000_000), j, "tick {tick_ns}");
                }
            }
        }
    }

    /// The offset holds: two measurements on this kernel agree within a millisecond.
    #[test]
    fn two_measurements_agree_within_a_millisecond() {
        let c = tick_clock().unwrap();
        let mono = guard_common::monotonic_ns();
        let again = tick_clock().unwrap();
        assert!(
            c.offset_ns.abs_diff(again.offset_ns) < 1_000_000,
            "{c:?} then {again:?} (monotonic {mono})"
        );
    }
}
