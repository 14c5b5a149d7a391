//! Fields of kernel sockets read at the offsets of SOCK_OFFSETS (from kernel BTF: Rust
//! eBPF has no CO-RE): a listener's queues, namespace and inode in tc, a completed
//! connection's addresses in the state tracepoint. The loads are BTF-checked
//! (PTR_TO_BTF_ID) and fault-safe.
use guard_common::{SockOffsets, linux::AF_INET};

use crate::net::opaque_zero;

/// Set by the daemon from kernel BTF before the object is loaded (read-only data: the
/// verifier sees the values, and checks each read against the kernel's BTF). All zeros
/// when the kernel's BTF lacks a field: then nothing here is loaded by a program the
/// daemon loads, and the state tracepoint's code that reads them is dead code to the
/// verifier (`known`).
#[unsafe(no_mangle)]
static SOCK_OFFSETS: SockOffsets = SockOffsets {
    ack_backlog: 0,
    max_ack_backlog: 0,
    syn_queue: 0,
    young: 0,
    net: 0,
    net_inum: 0,
    sk_socket: 0,
    socket_file: 0,
    file_inode: 0,
    inode_ino: 0,
    family: 0,
    num: 0,
    daddr: 0,
    rcv_saddr: 0,
    v6_daddr: 0,
    v6_rcv_saddr: 0,
};

/// The offset of `$field` in SOCK_OFFSETS.
macro_rules! off {
    ($field:ident) => {
        unsafe { core::ptr::read_volatile(&raw const SOCK_OFFSETS.$field) as usize }
    };
}

#[inline(always)]
fn u32_at(p: *const u8) -> u32 {
    unsafe { core::ptr::read_volatile(p.cast::<u32>()) }
}

#[inline(always)]
fn u16_at(p: *const u8) -> u16 {
    unsafe { core::ptr::read_volatile(p.cast::<u16>()) }
}

#[inline(always)]
fn ptr_at(p: *const u8) -> *const u8 {
    unsafe { core::ptr::read_volatile(p.cast::<*const u8>()) }
}

/// Whether the daemon found the offsets (a socket's namespace is never at offset 0).
#[inline(always)]
pub fn known() -> bool {
    off!(net) != 0
}

/// A listening socket's queues, units: connections.
#[derive(Default)]
pub struct Queues {
    pub accept_queue: u32,
    pub backlog: u32,
    pub syn_recv: u32,
    /// Half-open requests under their first SYN-ACK retransmit.
    pub young: u32,
}

/// A listening socket's queues, read from its struct tcp_sock `tp`.
#[inline(always)]
pub fn queues(tp: *const u8) -> Queues {
    let at = |off: usize| unsafe { tp.add(off) };
    Queues {
        accept_queue: u32_at(at(off!(ack_backlog))),
        backlog: u32_at(at(off!(max_ack_backlog))),
        syn_recv: u32_at(at(off!(syn_queue))),
        young: u32_at(at(off!(young))),
    }
}

/// The inode number of a socket's network namespace (as `stat` of /proc/PID/ns/net
/// shows it), read from its struct sock `sk`; 0 when it cannot be read.
#[inline(always)]
pub fn netns(sk: *const u8) -> u32 {
    let net = ptr_at(unsafe { sk.add(off!(net)) });
    if net.is_null() {
        return 0;
    }
    u32_at(unsafe { net.add(off!(net_inum)) })
}

/// The inode number of a socket (as sock_diag and /proc name it), read from its
/// struct sock `sk`; 0 when it has no file (not a user's socket).
#[inline(always)]
pub fn inode(sk: *const u8) -> u32 {
    let socket = ptr_at(unsafe { sk.add(off!(sk_socket)) });
    if socket.is_null() {
        return 0;
    }
    let file = ptr_at(unsafe { socket.add(off!(socket_file)) });
    if file.is_null() {
        return 0;
    }
    let inode = ptr_at(unsafe { file.add(off!(file_inode)) });
    if inode.is_null() {
        return 0;
    }
    // i_ino is an unsigned long; socket inodes are numbered in 32 bits (get_next_ino).
    u32_at(unsafe { inode.add(off!(inode_ino)) })
}

/// A connection as the server socket `sk` holds it: its namespace, local port (host
/// order), and local and remote addresses as words of the maps' form (IPv4
/// IPv4-mapped).
pub struct Connection {
    pub netns: u32,
    pub port: u16,
    pub local: [u32; 4],
    pub remote: [u32; 4],
}

#[inline(always)]
pub fn connection(sk: *const u8) -> Connection {
    let at = |off: usize| unsafe { sk.add(off) };
    let family = u16_at(at(off!(family))) as u32;
    let port = u16_at(at(off!(num)));
    let (local, remote) = if family == AF_INET {
        (
            mapped_words(u32_at(at(off!(rcv_saddr)))),
            mapped_words(u32_at(at(off!(daddr)))),
        )
    } else {
        (in6_addr(at(off!(v6_rcv_saddr))), in6_addr(at(off!(v6_daddr))))
    };
    Connection {
        netns: netns(sk),
        port,
        local,
        remote,
    }
}

/// `::ffff:a.b.c.d` as words, for an IPv4 address given as the word holding it.
#[inline(always)]
pub fn mapped_words(ip4: u32) -> [u32; 4] {
    let z = opaque_zero();
    [z, z, u32::from_ne_bytes([0, 0, 0xff, 0xff]), ip4]
}

/// A struct in6_addr at `p` as words, loaded byte by byte: its first member is a byte
/// array, and the verifier checks each load against the member it falls in.
#[inline(always)]
fn in6_addr(p: *const u8) -> [u32; 4] {
    let byte = |i: usize| unsafe { core::ptr::read_volatile(p.add(i)) };
    let word = |w: usize| u32::from_ne_bytes([byte(w), byte(w + 1), byte(w + 2), byte(w + 3)]);
    [word(0), word(4), word(8), word(12)]
}
