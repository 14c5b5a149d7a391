//! The kernel's TCP socket table, through sock_diag netlink (NETLINK_SOCK_DIAG,
//! linux/inet_diag.h): what `ss -tan` shows, for the current network namespace.
use std::{
    net::IpAddr,
    os::fd::{FromRawFd, OwnedFd},
};

use anyhow::{Context, bail};
use netlink_packet_core::Nla as _;
use netlink_packet_core::{
    NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_sock_diag::{
    AF_INET, AF_INET6, IPPROTO_TCP, SockDiagMessage,
    inet::{ExtensionFlags, InetRequest, SocketId, StateFlags, nlas::Nla},
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_SOCK_DIAG};

use guard_common::linux::{
    TCP_BOUND_INACTIVE, TCP_CLOSE, TCP_CLOSE_WAIT, TCP_CLOSING, TCP_ESTABLISHED, TCP_FIN_WAIT1,
    TCP_FIN_WAIT2, TCP_LAST_ACK, TCP_LISTEN, TCP_SYN_RECV, TCP_SYN_SENT, TCP_TIME_WAIT,
};

/// One TCP socket. Addresses are as the kernel reports them, IPv4-mapped IPv6 turned
/// into IPv4; ports in host byte order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpSocket {
    /// TCP state number (guard_common::linux, include/net/tcp_states.h).
    pub state: u32,
    pub src: IpAddr,
    pub sport: u16,
    pub dst: IpAddr,
    pub dport: u16,
    /// For a listener: connections waiting in the accept queue; otherwise bytes queued
    /// to read.
    pub recv_queue: u32,
    /// For a listener: the effective backlog, min(listen() backlog, net.core.somaxconn);
    /// otherwise bytes queued to send.
    pub send_queue: u32,
    /// Inode of the socket (0 for TIME_WAIT and SYN_RECV entries).
    pub inode: u32,
    /// cgroup v2 id of the cgroup the socket was created in (INET_DIAG_CGROUP_ID); 0 when
    /// the kernel does not say.
    pub cgroup_id: u64,
    /// The socket's value in the socket storage map asked for (`tcp_storages`); empty
    /// when it has none, or none was asked for.
    pub storage: Vec<u8>,
}

/// linux/inet_diag.h and linux/sock_diag.h: the request attribute asking for socket
/// storage values, its map fd, and the reply's attributes holding them.
const INET_DIAG_REQ_SK_BPF_STORAGES: u16 = 2;
const SK_DIAG_BPF_STORAGE_REQ_MAP_FD: u16 = 1;
const INET_DIAG_SK_BPF_STORAGES: u16 = 20;
const SK_DIAG_BPF_STORAGE: u16 = 1;
const SK_DIAG_BPF_STORAGE_MAP_VALUE: u16 = 3;
const NLA_F_NESTED: u16 = 0x8000;
/// The type bits of nla_type (NLA_TYPE_MASK).
const NLA_TYPE_MASK: u16 = 0x3fff;

/// The states of a connection that can hold an admission (connguard's "active"): from
/// SYN_SENT to CLOSING. A listener can hold one too (`tcp_storages`). TCP_CLOSE sockets
/// are in no table sock_diag walks.
pub const CONNECTION_STATES: [u32; 7] = [
    TCP_SYN_SENT,
    TCP_ESTABLISHED,
    TCP_FIN_WAIT1,
    TCP_FIN_WAIT2,
    TCP_CLOSE_WAIT,
    TCP_LAST_ACK,
    TCP_CLOSING,
];

fn state_flags(states: &[u32]) -> StateFlags {
    StateFlags::from_bits_retain(states.iter().fold(0, |bits, s| bits | 1 << s))
}

/// The connections (`CONNECTION_STATES`) and listeners of the current network
/// namespace.
pub fn connections_and_listeners() -> anyhow::Result<Vec<TcpSocket>> {
    tcp_sockets_in(connection_and_listener_states())
}

fn connection_and_listener_states() -> StateFlags {
    state_flags(&CONNECTION_STATES) | state_flags(&[TCP_LISTEN])
}

/// The connections (`CONNECTION_STATES`) and listeners of the current network namespace
/// that have a value in the socket storage map `map` (BPF_MAP_TYPE_SK_STORAGE), with it:
/// sock_diag dumps it (bpf_sk_storage_diag_put(), net/core/bpf_sk_storage.c;
/// CAP_SYS_ADMIN). A listener holds an admission when its socket's connect() failed
/// before the SYN (or another cgroup program refused it) and it then listened.
pub fn tcp_storages(map: std::os::fd::BorrowedFd<'_>) -> anyhow::Result<Vec<TcpSocket>> {
    use std::os::fd::AsRawFd;
    let mut attr = Vec::with_capacity(12);
    attr.extend_from_slice(&12u16.to_ne_bytes());
    attr.extend_from_slice(&(INET_DIAG_REQ_SK_BPF_STORAGES | NLA_F_NESTED).to_ne_bytes());
    attr.extend_from_slice(&8u16.to_ne_bytes());
    attr.extend_from_slice(&SK_DIAG_BPF_STORAGE_REQ_MAP_FD.to_ne_bytes());
    attr.extend_from_slice(&(map.as_raw_fd() as u32).to_ne_bytes());
    let mut out = Vec::new();
    for family in [AF_INET, AF_INET6] {
        dump_with(family, connection_and_listener_states(), &attr, &mut out)?;
    }
    out.retain(|s| !s.storage.is_empty());
    Ok(out)
}

/// The first map value in an INET_DIAG_SK_BPF_STORAGES attribute's payload.
fn storage_value(nested: &[u8]) -> Option<Vec<u8>> {
    let storage = attributes(nested)
        .find(|(kind, _)| *kind == SK_DIAG_BPF_STORAGE)?
        .1;
    attributes(storage)
        .find(|(kind, _)| *kind == SK_DIAG_BPF_STORAGE_MAP_VALUE)
        .map(|(_, value)| value.to_vec())
}

/// The (type, payload) of each netlink attribute in `buf` (struct nlattr, 4-aligned).
fn attributes(mut buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if buf.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([buf[0], buf[1]]) as usize;
        let kind = u16::from_ne_bytes([buf[2], buf[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > buf.len() {
            return None;
        }
        let payload = &buf[4..len];
        buf = &buf[((len + 3) & !3).min(buf.len())..];
        Some((kind, payload))
    })
}

/// `INET_DIAG_CGROUP_ID` (linux/inet_diag.h): a u64, host byte order.
const INET_DIAG_CGROUP_ID: u16 = 21;

/// The socket storage value of a response (INET_DIAG_SK_BPF_STORAGES), or none.
fn storage(nlas: &[Nla]) -> Vec<u8> {
    nlas.iter()
        .find_map(|nla| match nla {
            Nla::Other(o) if o.kind() & NLA_TYPE_MASK == INET_DIAG_SK_BPF_STORAGES => {
                let mut value = vec![0u8; o.value_len()];
                o.emit_value(&mut value);
                storage_value(&value)
            }
            _ => None,
        })
        .unwrap_or_default()
}

/// The INET_DIAG_CGROUP_ID attribute of a response, or 0.
fn cgroup_id(nlas: &[Nla]) -> u64 {
    nlas.iter()
        .find_map(|nla| match nla {
            Nla::Other(o) if o.kind() == INET_DIAG_CGROUP_ID && o.value_len() == 8 => {
                let mut value = [0u8; 8];
                o.emit_value(&mut value);
                Some(u64::from_ne_bytes(value))
            }
            _ => None,
        })
        .unwrap_or(0)
}

/// Every TCP socket of the current network namespace, IPv4 and IPv6, in every state
/// (TIME_WAIT and bound-inactive included).
pub fn tcp_sockets() -> anyhow::Result<Vec<TcpSocket>> {
    tcp_sockets_in(StateFlags::all() | StateFlags::from_bits_retain(1 << TCP_BOUND_INACTIVE))
}

/// The listeners and SYN_RECV entries of the current network namespace: the kernel
/// sends no other socket, so the answer does not grow with TIME_WAIT entries (asking
/// for SYN_RECV includes request sockets, TCP_NEW_SYN_RECV, inet_diag_dump_icsk in
/// net/ipv4/inet_diag.c).
pub fn listeners_and_syn_recv() -> anyhow::Result<Vec<TcpSocket>> {
    Diag::open()?.listeners(true)
}

/// A sock_diag netlink socket, kept open: it answers for the network namespace it was
/// opened in, whichever thread uses it later (netlink_kernel_create() per namespace,
/// net/core/sock_diag.c). After a failed dump, open a new one: the old one may hold
/// the rest of that dump.
pub struct Diag(Socket);

impl Diag {
    /// One for the calling thread's network namespace.
    pub fn open() -> anyhow::Result<Diag> {
        let mut socket =
            Socket::new(NETLINK_SOCK_DIAG).context("opening a sock_diag netlink socket")?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        Ok(Diag(socket))
    }

    /// The listeners of its namespace, and with `syn_recv` its half-open connections
    /// (SYN_RECV) too: the kernel skips every other state (inet_diag_dump_icsk(),
    /// net/ipv4/inet_diag.c). Listeners alone cost a walk of the listening hash;
    /// SYN_RECV entries sit in the established hash, shared by every namespace, which
    /// the kernel then walks whole: the cost grows with every connection of the host.
    pub fn listeners(&mut self, syn_recv: bool) -> anyhow::Result<Vec<TcpSocket>> {
        let mut states = 1 << TCP_LISTEN;
        if syn_recv {
            states |= 1 << TCP_SYN_RECV;
        }
        let states = StateFlags::from_bits_retain(states);
        let mut out = Vec::new();
        for family in [AF_INET, AF_INET6] {
            self.dump(family, states.clone(), &[], &mut out)?;
        }
        Ok(out)
    }
}

/// Whether this kernel's sock_diag lists sockets bound but neither connected nor
/// listening (TCP_BOUND_INACTIVE): it binds one and asks for those. Older kernels skip
/// them (they sit only in the bind hash, which inet_diag did not walk). The port is one
/// just outside `ephemeral` (ip_local_port_range), which may be exhausted, the moment
/// `connguard ports` is run for: above it first, then below it down to 1024 (lower ones
/// need root). None when it cannot tell (no port free there, or the dump failed). Known
/// once per process: it is the kernel's property.
pub fn lists_bound_inactive(ephemeral: (u16, u16)) -> Option<bool> {
    static KNOWN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if let Some(k) = KNOWN.get() {
        return Some(*k);
    }
    let above = ephemeral.1.checked_add(1).map_or(0..=0, |p| p..=u16::MAX);
    let below = (1024..ephemeral.0).rev();
    let (_socket, port) = above
        .filter(|p| *p != 0)
        .chain(below)
        .take(256)
        .find_map(bound_socket)?;
    let mut found = Vec::new();
    dump(
        AF_INET,
        StateFlags::from_bits_retain(1 << TCP_BOUND_INACTIVE),
        &mut found,
    )
    .ok()?;
    Some(*KNOWN.get_or_init(|| found.iter().any(|s| s.sport == port)))
}

/// A TCP socket bound to 0.0.0.0:`port`, unless that fails.
fn bound_socket(port: u16) -> Option<(OwnedFd, u16)> {
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: a new fd, owned from here.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut addr: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    addr.sin_family = libc::AF_INET as libc::sa_family_t;
    addr.sin_port = port.to_be();
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    (unsafe { libc::bind(fd, (&raw const addr).cast(), len) } == 0).then_some((socket, port))
}

fn tcp_sockets_in(states: StateFlags) -> anyhow::Result<Vec<TcpSocket>> {
    let mut out = Vec::new();
    for family in [AF_INET, AF_INET6] {
        dump(family, states.clone(), &mut out)?;
    }
    Ok(out)
}

fn dump(family: u8, states: StateFlags, out: &mut Vec<TcpSocket>) -> anyhow::Result<()> {
    dump_with(family, states, &[], out)
}

/// `dump`, with `attrs` (netlink attributes) after the request.
fn dump_with(
    family: u8,
    states: StateFlags,
    attrs: &[u8],
    out: &mut Vec<TcpSocket>,
) -> anyhow::Result<()> {
    Diag::open()?.dump(family, states, attrs, out)
}

impl Diag {
    /// Appends the TCP sockets of `family` in `states` to `out`, with `attrs` (netlink
    /// attributes) after the request.
    fn dump(
        &mut self,
        family: u8,
        states: StateFlags,
        attrs: &[u8],
        out: &mut Vec<TcpSocket>,
    ) -> anyhow::Result<()> {
        let socket = &mut self.0;
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_DUMP;
        let mut request = NetlinkMessage::new(
            header,
            SockDiagMessage::InetRequest(InetRequest {
                family,
                protocol: IPPROTO_TCP,
                extensions: ExtensionFlags::empty(),
                states,
                socket_id: if family == AF_INET {
                    SocketId::new_v4()
                } else {
                    SocketId::new_v6()
                },
            })
            .into(),
        );
        request.finalize();
        let mut buf = vec![0; request.buffer_len()];
        request.serialize(&mut buf);
        buf.extend_from_slice(attrs);
        // nlmsg_len, the header's first field, covers the attributes.
        let len = buf.len() as u32;
        buf[..4].copy_from_slice(&len.to_ne_bytes());
        socket
            .send(&buf, 0)
            .context("sending the sock_diag request")?;

        let mut receive = vec![0u8; 1 << 16];
        loop {
            let size = socket
                .recv(&mut &mut receive[..], 0)
                .context("reading sock_diag")?;
            let mut offset = 0;
            while offset < size {
                let message =
                    NetlinkMessage::<SockDiagMessage>::deserialize(&receive[offset..size])
                        .context("parsing a sock_diag message")?;
                match message.payload {
                    NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(r)) => {
                        let id = &r.header.socket_id;
                        out.push(TcpSocket {
                            state: r.header.state as u32,
                            src: plain(id.source_address),
                            sport: id.source_port,
                            dst: plain(id.destination_address),
                            dport: id.destination_port,
                            recv_queue: r.header.recv_queue,
                            send_queue: r.header.send_queue,
                            inode: r.header.inode,
                            cgroup_id: cgroup_id(&r.nlas),
                            storage: storage(&r.nlas),
                        });
                    }
                    NetlinkPayload::Done(_) => return Ok(()),
                    NetlinkPayload::Error(e) => bail!("sock_diag: {e:?}"),
                    _ => {}
                }
                if message.header.length == 0 {
                    break;
                }
                // Messages start on 4-byte boundaries (NLMSG_ALIGN).
                offset += (message.header.length as usize + 3) & !3;
            }
        }
    }
}

/// Half-open connections toward a listener.
pub fn syn_recv_of(sockets: &[TcpSocket], l: &TcpSocket) -> u32 {
    sockets
        .iter()
        .filter(|s| {
            s.state == TCP_SYN_RECV
                && s.sport == l.sport
                && (l.src.is_unspecified() || s.src == l.src)
        })
        .count() as u32
}

/// IPv4-mapped IPv6 as IPv4.
fn plain(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(addr, IpAddr::V4),
        v4 => v4,
    }
}

/// The name `ss` uses for a TCP state.
pub fn state_name(state: u32) -> &'static str {
    match state {
        TCP_ESTABLISHED => "ESTAB",
        TCP_SYN_SENT => "SYN-SENT",
        TCP_SYN_RECV => "SYN-RECV",
        TCP_FIN_WAIT1 => "FIN-WAIT-1",
        TCP_FIN_WAIT2 => "FIN-WAIT-2",
        TCP_TIME_WAIT => "TIME-WAIT",
        TCP_CLOSE => "UNCONN",
        TCP_CLOSE_WAIT => "CLOSE-WAIT",
        TCP_LAST_ACK => "LAST-ACK",
        TCP_LISTEN => "LISTEN",
        TCP_CLOSING => "CLOSING",
        _ => "UNKNOWN",
    }
}
