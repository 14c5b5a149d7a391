//! The kernel's TCP socket table, through sock_diag netlink (NETLINK_SOCK_DIAG,
//! linux/inet_diag.h): what `ss -tan` shows, for the current network namespace.
use std::net::IpAddr;

use anyhow::{Context, bail};
use netlink_packet_core::{
    NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_sock_diag::{
    AF_INET, AF_INET6, IPPROTO_TCP, SockDiagMessage,
    inet::{ExtensionFlags, InetRequest, SocketId, StateFlags},
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_SOCK_DIAG};

/// Pseudo-state that asks for sockets bound to a port but neither listening nor
/// connected (TCP_BOUND_INACTIVE, include/net/tcp_states.h; checked on 6.18, older
/// kernels ignore the bit). The kernel reports them in state TCP_CLOSE.
pub const TCP_BOUND_INACTIVE: u8 = 13;
pub const TCP_CLOSE: u8 = 7;
pub const TCP_SYN_RECV: u8 = 3;
pub const TCP_TIME_WAIT: u8 = 6;
pub const TCP_LISTEN: u8 = 10;

/// One TCP socket. Addresses are as the kernel reports them, IPv4-mapped IPv6 turned
/// into IPv4; ports in host byte order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpSocket {
    /// TCP state number (include/net/tcp_states.h).
    pub state: u8,
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
}

/// Every TCP socket of the current network namespace, IPv4 and IPv6, in every state
/// (TIME_WAIT and bound-inactive included).
pub fn tcp_sockets() -> anyhow::Result<Vec<TcpSocket>> {
    let mut out = Vec::new();
    for family in [AF_INET, AF_INET6] {
        dump(family, &mut out)?;
    }
    Ok(out)
}

fn dump(family: u8, out: &mut Vec<TcpSocket>) -> anyhow::Result<()> {
    let mut socket =
        Socket::new(NETLINK_SOCK_DIAG).context("opening a sock_diag netlink socket")?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | NLM_F_DUMP;
    let states = StateFlags::all() | StateFlags::from_bits_retain(1 << TCP_BOUND_INACTIVE);
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
            let message = NetlinkMessage::<SockDiagMessage>::deserialize(&receive[offset..size])
                .context("parsing a sock_diag message")?;
            match message.payload {
                NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(r)) => {
                    let id = &r.header.socket_id;
                    out.push(TcpSocket {
                        state: r.header.state,
                        src: plain(id.source_address),
                        sport: id.source_port,
                        dst: plain(id.destination_address),
                        dport: id.destination_port,
                        recv_queue: r.header.recv_queue,
                        send_queue: r.header.send_queue,
                        inode: r.header.inode,
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

/// IPv4-mapped IPv6 as IPv4.
fn plain(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(addr, IpAddr::V4),
        v4 => v4,
    }
}

/// The name `ss` uses for a TCP state.
pub fn state_name(state: u8) -> &'static str {
    match state {
        1 => "ESTAB",
        2 => "SYN-SENT",
        3 => "SYN-RECV",
        4 => "FIN-WAIT-1",
        5 => "FIN-WAIT-2",
        6 => "TIME-WAIT",
        7 => "UNCONN",
        8 => "CLOSE-WAIT",
        9 => "LAST-ACK",
        10 => "LISTEN",
        11 => "CLOSING",
        _ => "UNKNOWN",
    }
}
