//! Kernel constants both sides use, with the header each comes from.

/// include/uapi/linux/in.h
pub const IPPROTO_TCP: u32 = 6;
/// include/linux/socket.h
pub const AF_INET: u32 = 2;

/// include/linux/socket.h
pub const SOL_TCP: i32 = 6;
/// bpf_setsockopt()/bpf_getsockopt() option at SOL_TCP: a TCP socket's sock_ops callback
/// flags (include/uapi/linux/bpf.h; net/core/filter.c, sol_tcp_sockopt; Linux 6.12).
pub const TCP_BPF_SOCK_OPS_CB_FLAGS: i32 = 1008;
/// BPF_SOCK_OPS_STATE_CB_FLAG, include/uapi/linux/bpf.h.
pub const BPF_SOCK_OPS_STATE_CB_FLAG: i32 = 1 << 2;

/// TCP states, include/net/tcp_states.h.
pub const TCP_ESTABLISHED: u32 = 1;
pub const TCP_SYN_SENT: u32 = 2;
pub const TCP_SYN_RECV: u32 = 3;
pub const TCP_FIN_WAIT1: u32 = 4;
pub const TCP_FIN_WAIT2: u32 = 5;
pub const TCP_TIME_WAIT: u32 = 6;
pub const TCP_CLOSE: u32 = 7;
pub const TCP_CLOSE_WAIT: u32 = 8;
pub const TCP_LAST_ACK: u32 = 9;
pub const TCP_LISTEN: u32 = 10;
pub const TCP_CLOSING: u32 = 11;
/// Bound to a port, neither listening nor connected (Linux 6.9+; sock_diag reports such
/// sockets in TCP_CLOSE, and older kernels ignore the bit that asks for them).
pub const TCP_BOUND_INACTIVE: u32 = 13;

/// The `BPF_PROG_QUERY` member of `union bpf_attr` (include/uapi/linux/bpf.h), whole:
/// the kernel writes its answer (count, attach_flags, revision) at these offsets
/// whatever size it is given. `target` is a cgroup's fd or an interface's index.
#[repr(C)]
#[derive(Default)]
pub struct ProgQuery {
    pub target: u32,
    pub attach_type: u32,
    pub query_flags: u32,
    pub attach_flags: u32,
    pub prog_ids: u64,
    pub prog_cnt: u32,
    pub _pad: u32,
    pub prog_attach_flags: u64,
    pub link_ids: u64,
    pub link_attach_flags: u64,
    pub revision: u64,
}

const _: () = assert!(core::mem::size_of::<ProgQuery>() == 64);
