//! The controls' clock: CLOCK_MONOTONIC ns at the kernel tick's resolution, from jiffies
//! (see guard_common::TickClock). A rate bucket, a breaker's window and open time, a
//! handshake's duration and shedding events read it; the lease and the listener guard's
//! expiry keep bpf_ktime_get_ns, read off the connect path or per SYN.
use aya_ebpf::helpers::generated::bpf_jiffies64;
use guard_common::TickClock;

/// Set by the daemon before the object is loaded (read-only data).
#[unsafe(no_mangle)]
static TICK_CLOCK: TickClock = TickClock {
    tick_ns: 0,
    offset_ns: 0,
};

/// CLOCK_MONOTONIC ns, up to one tick behind.
#[inline(always)]
pub fn now_ns() -> u64 {
    let c = &raw const TICK_CLOCK;
    let (tick, offset) = unsafe {
        (
            core::ptr::read_volatile(&raw const (*c).tick_ns),
            core::ptr::read_volatile(&raw const (*c).offset_ns),
        )
    };
    unsafe { bpf_jiffies64() }
        .wrapping_mul(tick)
        .wrapping_sub(offset)
}
