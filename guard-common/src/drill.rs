//! Chaos drills: a fault injected on purpose into the connects of one scope (or of
//! some of its workloads' cgroups), decided in the connect hooks within bounds the
//! programs check themselves (a deadline, the daemon's lease, a cap on faults), and
//! counted apart from sheds.
//!
//! A scope has at most one drill at a time, keyed by its scope id: `DRILL_ON` (an array,
//! read inlined on every governed connect) holds its FAULT_*, 0 for none; `DRILLS` (a
//! hash map without preallocation: an update replaces the element rather than writing
//! into the one a connect may be reading, though a removed element's memory may be
//! given to the next) its settings; `DRILL_COUNTS` (written by the programs) its counts.
//! `DRILL_LEASE` is the lease of the daemon that owns these maps (none of them pinned):
//! the next daemon's programs have maps of their own, and renew no drill of the one
//! before. `DRILL_SOCKS` marks a socket a blackhole or delay fault was given to, for
//! `drill_egress`.
use crate::PortRange;

/// connect() fails at once with the drill's errno; no SYN leaves.
pub const FAULT_REFUSE: u32 = 1;
/// The connection's SYNs are dropped on their way out (its packets while it is in
/// SYN_SENT): the client waits its own connect timeout.
pub const FAULT_BLACKHOLE: u32 = 2;
/// The first SYN is dropped on its way out: the retransmit (about 1 s later, TCP's
/// initial RTO) connects.
pub const FAULT_DELAY: u32 = 3;
/// The connect is sent to port 0 of the loopback address instead, where no socket can
/// listen: the loopback stack answers the SYN with a RST, and the client sees what an
/// overloaded listener's RST gives it (ECONNREFUSED, after EINPROGRESS when
/// non-blocking). Nothing leaves the host.
pub const FAULT_RESET: u32 = 4;

/// Most destination prefixes and port ranges of one drill.
pub const MAX_DRILL_NETS: usize = 4;
pub const MAX_DRILL_PORTS: usize = 4;
/// Most cgroups (pods, containers, units) one drill narrows its scope to.
pub const MAX_DRILL_CGROUPS: usize = 16;

/// A destination prefix: `addr`, its 16 bytes in the maps' form (network byte order)
/// read as two native-endian words, and `mask`, the prefix's bits set, in the same form.
/// An address is in it when it equals `addr` under `mask`: no loop over its bytes for
/// the verifier to walk at each call.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DrillNet {
    pub addr: [u64; 2],
    pub mask: [u64; 2],
}

impl DrillNet {
    /// The prefix of `addr` (the maps' form) and its first `prefix_len` bits (0 to 128).
    pub fn new(addr: [u8; 16], prefix_len: u32) -> DrillNet {
        let mask = u128::MAX
            .checked_shl(128 - prefix_len.min(128))
            .unwrap_or(0)
            .to_be_bytes();
        DrillNet {
            addr: words(&addr),
            mask: words(&mask),
        }
    }

    /// Whether `addr` (16 bytes in the maps' form, as `words` gives them) is in it.
    #[inline(always)]
    pub fn contains(&self, addr: &[u64; 2]) -> bool {
        ((addr[0] ^ self.addr[0]) & self.mask[0]) | ((addr[1] ^ self.addr[1]) & self.mask[1]) == 0
    }
}

/// 16 bytes as two native-endian words, in their order.
pub fn words(bytes: &[u8; 16]) -> [u64; 2] {
    let (a, b) = bytes.split_at(8);
    let word = |s: &[u8]| {
        let mut w = [0u8; 8];
        w.copy_from_slice(s);
        u64::from_ne_bytes(w)
    };
    [word(a), word(b)]
}

/// A cgroup a drill narrows its scope to: the connects of tasks in it or below it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DrillCgroup {
    /// Its cgroup id (the directory's inode number).
    pub id: u64,
    /// Its depth below the daemon's cgroup2 mount (0: the mount's root); the programs
    /// add the mount's own level to compare it with bpf_get_current_ancestor_cgroup_id.
    pub level: u32,
    pub _pad: u32,
}

/// Value of `DRILLS`, by the drill's scope id.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DrillConf {
    /// Nonzero while the drill is set; names it in `DRILL_SOCKS` marks.
    pub serial: u32,
    /// FAULT_*.
    pub fault: u32,
    /// FAULT_REFUSE: the positive errno connect() returns.
    pub errno: u32,
    /// The destinations the drill targets: `n_nets` prefixes (0: every destination)
    /// and `n_ports` port ranges (0: every port).
    pub n_nets: u32,
    pub nets: [DrillNet; MAX_DRILL_NETS],
    pub n_ports: u32,
    pub ports: [PortRange; MAX_DRILL_PORTS],
    /// An attempt of the target is faulted with probability threshold / 2^32
    /// (2^32: every one).
    pub threshold: u64,
    /// CLOCK_MONOTONIC ns (bpf_ktime_get_ns) after which nothing is faulted.
    pub deadline_ns: u64,
    /// At most this many faults in all; 0: no such cap.
    pub max_faults: u64,
    /// At most `max_permille` thousandths of the target's attempts faulted in the
    /// sliding window of the last `window_ns`; `window_ns` 0: no such cap.
    pub window_ns: u64,
    pub max_permille: u32,
    /// The workloads the drill narrows its scope to: `n_cgroups` cgroups (0: the whole
    /// scope). An attempt is the drill's when the connecting task is in one of them or
    /// below it.
    pub n_cgroups: u32,
    pub cgroups: [DrillCgroup; MAX_DRILL_CGROUPS],
}

/// Value of `DRILL_COUNTS`, at the index of the drill's scope; every field updated
/// with atomic instructions. Zeroed by the daemon before it sets a drill.
/// Units: connection attempts.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DrillCounts {
    /// Attempts of the target made while the drill ran (its scope, destinations and
    /// ports, before the deadline, under the lease).
    pub attempts: u64,
    /// Places taken under `max_faults`: reserved before the cap is looked at, and given
    /// back by an attempt over it, so concurrent attempts never fault more than the cap.
    /// Read as signed (two's complement).
    pub reserved: u64,
    /// Attempts given the fault (counted once given: it never goes down).
    pub faulted: u64,
    /// Attempts the probability chose but a cap let through.
    pub capped: u64,
    /// The fraction cap's sliding window, estimated from two fixed windows: the
    /// current one's start (CLOCK_MONOTONIC ns), attempts and faults, and the one
    /// before's attempts and faults. Looked at, then added to: attempts racing each
    /// other may pass the fraction by a few (`max_faults` is the exact cap).
    pub window_start: u64,
    pub window_attempts: u64,
    pub window_faulted: u64,
    pub prev_attempts: u64,
    pub prev_faulted: u64,
}

/// Value of `DRILL_SOCKS`: the blackhole or delay fault a socket was given.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DrillMark {
    /// The scope id of the drill (its key in `DRILLS`), and its serial: the mark holds
    /// only while that drill is set, before its deadline.
    pub scope_id: u32,
    pub serial: u32,
    /// FAULT_BLACKHOLE or FAULT_DELAY.
    pub fault: u32,
    /// FAULT_DELAY: 1 once the first SYN was dropped.
    pub dropped: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `addr` (an IPv4 address mapped to IPv6, or an IPv6 one) in the maps' form.
    fn mapped(addr: &str) -> [u8; 16] {
        match addr.parse::<core::net::IpAddr>().unwrap() {
            core::net::IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
            core::net::IpAddr::V6(a) => a.octets(),
        }
    }

    fn contains(net: &DrillNet, addr: &str) -> bool {
        net.contains(&words(&mapped(addr)))
    }

    #[test]
    fn a_prefix_holds_the_addresses_that_share_its_bits() {
        // 10.0.0.0/8: 96 bits of the mapped prefix and 8.
        let ten = DrillNet::new(mapped("10.0.0.0"), 104);
        assert!(contains(&ten, "10.255.1.2"));
        assert!(!contains(&ten, "11.0.0.1"));
        assert!(!contains(&ten, "::a00:1"), "not mapped: another address");
        // 127.0.0.0/31: the boundary inside a byte.
        let pair = DrillNet::new(mapped("127.0.0.0"), 127);
        assert!(contains(&pair, "127.0.0.0") && contains(&pair, "127.0.0.1"));
        assert!(!contains(&pair, "127.0.0.2"));
        let one = DrillNet::new(mapped("::1"), 128);
        assert!(contains(&one, "::1") && !contains(&one, "::2"));
        let every = DrillNet::new(mapped("::"), 0);
        assert!(contains(&every, "192.0.2.1") && contains(&every, "2001:db8::1"));
    }
}
