//! tc ingress on a listener guard's interfaces: a SYN for a guarded listener (LISTENERS,
//! renewed by the daemon) whose accept queue is past its watermark, or whose half-open
//! requests reach their limit, is turned into a RST+ACK and sent back out of the
//! interface it came in on, so the client's connect() fails at once with ECONNREFUSED
//! instead of waiting on SYN retransmits. Everything else passes.
//!
//! The listener is the one the kernel itself would pick: bpf_skc_lookup_tcp() on the
//! SYN's 4-tuple in the interface's namespace, which applies the SO_REUSEPORT hash of
//! the SYN's own path (inet_lhash2_lookup, net/ipv4/inet_hashtables.c). So forwarded
//! traffic and a specific listener shadowing a wildcard one are told apart, and per SYN
//! a reuseport group's SYNs are shed only for the member past its watermark.
//!
//! `listener_shed` decides per SYN from that socket's own queues (sk_ack_backlog,
//! sk_max_ack_backlog, icsk_accept_queue.qlen and .young), read through
//! bpf_skc_to_tcp_sock() at the offsets of SOCK_OFFSETS; `listener_shed_polled`, for
//! kernels that refuse it,
//! applies the daemon's decision from its reading. Both shed nothing LISTENER_TTL_NS
//! after the daemon stops renewing them: the per-SYN one after its last heartbeat
//! (LISTENER_HEARTBEAT, every 100 ms), the polled one after the reading of its entry.
//!
//! The reply: RST+ACK with seq 0 and ack = SYN's seq + 1 + its data (RFC 9293 3.10.7.1,
//! segment without ACK). It keeps the SYN's IP and TCP options, TTL and hop limit.
//! Swapping addresses and ports leaves the checksums unchanged; the rewritten seq, ack,
//! flags and window are folded in with l4_csum_replace. Expects Ethernet framing (as on
//! veth, physical NICs and loopback); VLAN-tagged, fragmented and extension-header SYNs
//! pass.
use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_F_CURRENT_NETNS, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT, bpf_sock},
    helpers::generated::{
        bpf_ktime_get_ns, bpf_redirect, bpf_sk_release, bpf_skc_lookup_tcp, bpf_skc_to_tcp_sock,
    },
    macros::classifier,
    programs::TcContext,
};
use guard_common::{
    LISTENER_TTL_NS, ListenerEntry, ListenerKey, MODE_ENFORCE, SockOffsets,
    linux::{AF_INET, IPPROTO_TCP, TCP_LISTEN},
};

use crate::{
    accounting::bump,
    maps::{LISTENER_HEARTBEAT, LISTENERS, RST_SHED, WOULD_RST},
    net::{ipv4_mapped, words_addr},
};

/// Set by the daemon from kernel BTF before the object is loaded (read-only data: the
/// verifier sees the values, and checks each read against the kernel's BTF).
#[unsafe(no_mangle)]
static SOCK_OFFSETS: SockOffsets = SockOffsets {
    ack_backlog: 0,
    max_ack_backlog: 0,
    syn_queue: 0,
    young: 0,
    net: 0,
    net_inum: 0,
};

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;

#[classifier]
pub fn listener_shed(ctx: TcContext) -> i32 {
    shed::<true>(&ctx).unwrap_or(TC_ACT_OK)
}

#[classifier]
pub fn listener_shed_polled(ctx: TcContext) -> i32 {
    shed::<false>(&ctx).unwrap_or(TC_ACT_OK)
}

/// Where the TCP header is, and the SYN's addresses and length.
struct Syn {
    l4: usize,
    /// Offset of the source address; the destination follows.
    src_off: usize,
    addr_len: usize,
    /// TCP header and data, bytes.
    tcp_len: usize,
}

#[inline(always)]
fn parse(ctx: &TcContext) -> Option<Syn> {
    let syn = match u16::from_be(ctx.load::<u16>(12).ok()?) {
        ETH_P_IP => {
            let vihl: u8 = ctx.load(ETH_HLEN).ok()?;
            let ihl = ((vihl & 0x0f) as usize) * 4;
            let frag = u16::from_be(ctx.load::<u16>(ETH_HLEN + 6).ok()?);
            if vihl >> 4 != 4
                || ihl < 20
                || frag & 0x3fff != 0
                || ctx.load::<u8>(ETH_HLEN + 9).ok()? as u32 != IPPROTO_TCP
            {
                return None;
            }
            let total = u16::from_be(ctx.load::<u16>(ETH_HLEN + 2).ok()?) as usize;
            Syn {
                l4: ETH_HLEN + ihl,
                src_off: ETH_HLEN + 12,
                addr_len: 4,
                tcp_len: total.checked_sub(ihl)?,
            }
        }
        ETH_P_IPV6 => {
            let version: u8 = ctx.load(ETH_HLEN).ok()?;
            if version >> 4 != 6 || ctx.load::<u8>(ETH_HLEN + 6).ok()? as u32 != IPPROTO_TCP {
                return None;
            }
            let payload = u16::from_be(ctx.load::<u16>(ETH_HLEN + 4).ok()?) as usize;
            Syn {
                l4: ETH_HLEN + 40,
                src_off: ETH_HLEN + 8,
                addr_len: 16,
                tcp_len: payload,
            }
        }
        _ => return None,
    };
    let flags: u8 = ctx.load(syn.l4 + 13).ok()?;
    (flags & (TCP_SYN | TCP_ACK | TCP_RST) == TCP_SYN).then_some(syn)
}

#[inline(always)]
fn shed<const PER_SYN: bool>(ctx: &TcContext) -> Option<i32> {
    let syn = parse(ctx)?;
    let (key, queues) = listener_of::<PER_SYN>(ctx, &syn)?;
    let entry = *unsafe { LISTENERS.get(&key) }?;
    // Per SYN, the decision is the socket's own and the entry only says it is guarded:
    // it holds while the daemon lives. The polled decision is as old as its reading.
    let renewed = if PER_SYN {
        LISTENER_HEARTBEAT.get(0).copied().unwrap_or(0)
    } else {
        entry.renewed_ns
    };
    if unsafe { bpf_ktime_get_ns() }.saturating_sub(renewed) > LISTENER_TTL_NS {
        return None;
    }
    let over = if PER_SYN {
        past_limits(&entry, &queues)
    } else {
        entry.shed != 0
    };
    if !over {
        return None;
    }
    if entry.mode != MODE_ENFORCE {
        bump(&WOULD_RST, &entry.listener_id);
        return None;
    }
    // From here the packet is being rewritten: if a step fails, drop it rather than let
    // a half-rewritten segment through.
    if reply_rst(ctx, &syn).is_none() {
        return Some(TC_ACT_SHOT);
    }
    bump(&RST_SHED, &entry.listener_id);
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    let action = unsafe { bpf_redirect(ifindex, 0) };
    Some(if action == TC_ACT_REDIRECT as i64 {
        TC_ACT_REDIRECT
    } else {
        TC_ACT_SHOT
    })
}

/// A listener's queues, units: connections.
#[derive(Default)]
struct Queues {
    accept_queue: u32,
    backlog: u32,
    syn_recv: u32,
    /// Half-open requests under their first SYN-ACK retransmit.
    young: u32,
}

/// Whether `q` is at or past a limit of `entry`. A backlog of 0 still queues one
/// connection: compare against 1.
///
/// The watermark is compared with the accept queue plus the handshakes in flight that
/// will join it: a burst of SYNs comes in before any of its handshakes completes, and
/// the accept queue alone would let the whole burst pass. In flight is `young`: a
/// request leaves it at its first SYN-ACK retransmit (reqsk_timer_handler,
/// net/ipv4/inet_connection_sock.c), so a client that stopped answering a second ago
/// holds no capacity. Once qlen reaches the backlog the kernel answers SYNs with cookies
/// or drops them itself (inet_csk_reqsk_queue_is_full, tcp_conn_request in
/// net/ipv4/tcp_input.c): a SYN flood. Then the accept queue alone counts, so that the
/// flood does not turn into a RST for every client that cookies would have served.
#[inline(always)]
fn past_limits(entry: &ListenerEntry, q: &Queues) -> bool {
    let backlog = if q.backlog == 0 { 1 } else { q.backlog as u64 };
    let in_flight = if (q.syn_recv as u64) < backlog {
        q.young as u64
    } else {
        0
    };
    (entry.accept_queue_permille != 0
        && (q.accept_queue as u64 + in_flight) * 1000
            >= entry.accept_queue_permille as u64 * backlog)
        || (entry.max_syn_recv != 0 && q.syn_recv >= entry.max_syn_recv)
}

/// The listening socket the kernel would give this SYN to, as a LISTENERS key, and
/// (per SYN) its queues.
#[inline(always)]
fn listener_of<const PER_SYN: bool>(ctx: &TcContext, syn: &Syn) -> Option<(ListenerKey, Queues)> {
    // struct bpf_sock_tuple: saddr, daddr, sport, dport, all network order.
    let mut tuple = [0u8; 36];
    let size = if syn.addr_len == 4 {
        tuple[..8].copy_from_slice(&ctx.load::<[u8; 8]>(syn.src_off).ok()?);
        tuple[8..12].copy_from_slice(&ctx.load::<[u8; 4]>(syn.l4).ok()?);
        12
    } else {
        tuple[..32].copy_from_slice(&ctx.load::<[u8; 32]>(syn.src_off).ok()?);
        tuple[32..36].copy_from_slice(&ctx.load::<[u8; 4]>(syn.l4).ok()?);
        36
    };
    let sk = unsafe {
        bpf_skc_lookup_tcp(
            ctx.as_ptr(),
            tuple.as_mut_ptr().cast(),
            size,
            BPF_F_CURRENT_NETNS as u64,
            0,
        )
    };
    if sk.is_null() {
        return None;
    }
    let read = |f: *const u32| unsafe { core::ptr::read_volatile(f) };
    let s: *const bpf_sock = sk;
    let (state, family, port) = unsafe {
        (
            read(&raw const (*s).state),
            read(&raw const (*s).family),
            read(&raw const (*s).src_port),
        )
    };
    let v4 = unsafe { read(&raw const (*s).src_ip4) };
    let v6 = unsafe {
        [
            read(&raw const (*s).src_ip6[0]),
            read(&raw const (*s).src_ip6[1]),
            read(&raw const (*s).src_ip6[2]),
            read(&raw const (*s).src_ip6[3]),
        ]
    };
    let (netns, queues) = if PER_SYN && state == TCP_LISTEN {
        own_queues(sk.cast())
    } else {
        (0, Queues::default())
    };
    unsafe { bpf_sk_release(sk.cast()) };
    if state != TCP_LISTEN || (PER_SYN && netns == 0) {
        return None;
    }
    // A wildcard listener (0.0.0.0 or ::) is keyed all zeros.
    let addr = if family != AF_INET {
        words_addr(v6)
    } else if v4 == 0 {
        [0; 16]
    } else {
        ipv4_mapped(v4)
    };
    Some((
        ListenerKey {
            netns,
            port: port as u16,
            _pad: 0,
            addr,
        },
        queues,
    ))
}

/// A listening socket's network namespace (inode number; 0 when it cannot be read) and
/// queues, read from its struct tcp_sock at SOCK_OFFSETS. The loads are BTF-checked
/// (PTR_TO_BTF_ID) and fault-safe.
#[inline(always)]
fn own_queues(sk: *mut core::ffi::c_void) -> (u32, Queues) {
    let tp = unsafe { bpf_skc_to_tcp_sock(sk) } as *const u8;
    if tp.is_null() {
        return (0, Queues::default());
    }
    let o = &raw const SOCK_OFFSETS;
    let at = |off: u32| unsafe { tp.add(off as usize) };
    unsafe {
        let u32_at = |p: *const u8| core::ptr::read_volatile(p.cast::<u32>());
        let queues = Queues {
            accept_queue: u32_at(at(core::ptr::read_volatile(&raw const (*o).ack_backlog))),
            backlog: u32_at(at(core::ptr::read_volatile(
                &raw const (*o).max_ack_backlog,
            ))),
            syn_recv: u32_at(at(core::ptr::read_volatile(&raw const (*o).syn_queue))),
            young: u32_at(at(core::ptr::read_volatile(&raw const (*o).young))),
        };
        let net: *const u8 =
            core::ptr::read_volatile(at(core::ptr::read_volatile(&raw const (*o).net)).cast());
        if net.is_null() {
            return (0, queues);
        }
        let inum = u32_at(net.add(core::ptr::read_volatile(&raw const (*o).net_inum) as usize));
        (inum, queues)
    }
}

/// Rewrites the SYN in place into its RST+ACK answer.
#[inline(always)]
fn reply_rst(ctx: &TcContext, syn: &Syn) -> Option<()> {
    // Ethernet and IP: swap source and destination.
    let macs: [u8; 12] = ctx.load(0).ok()?;
    let mut swapped = [0u8; 12];
    swapped[..6].copy_from_slice(&macs[6..]);
    swapped[6..].copy_from_slice(&macs[..6]);
    ctx.store(0, &swapped, 0).ok()?;
    if syn.addr_len == 4 {
        let ips: [u8; 8] = ctx.load(syn.src_off).ok()?;
        let mut sw = [0u8; 8];
        sw[..4].copy_from_slice(&ips[4..]);
        sw[4..].copy_from_slice(&ips[..4]);
        ctx.store(syn.src_off, &sw, 0).ok()?;
    } else {
        let ips: [u8; 32] = ctx.load(syn.src_off).ok()?;
        let mut sw = [0u8; 32];
        sw[..16].copy_from_slice(&ips[16..]);
        sw[16..].copy_from_slice(&ips[..16]);
        ctx.store(syn.src_off, &sw, 0).ok()?;
    }
    // TCP: swap ports; seq 0, ack = seq + 1 + data, RST|ACK, window 0.
    let l4 = syn.l4;
    let ports: [u8; 4] = ctx.load(l4).ok()?;
    ctx.store(l4, &[ports[2], ports[3], ports[0], ports[1]], 0)
        .ok()?;
    let check = l4 + 16;
    let old_seq: u32 = ctx.load(l4 + 4).ok()?;
    let old_ack: u32 = ctx.load(l4 + 8).ok()?;
    let old_flags: u16 = ctx.load(l4 + 12).ok()?;
    // Raw values in memory order, as the checksum helpers take them. Keep the data
    // offset (high 4 bits of the first byte); set the flag byte.
    let [offset_byte, _] = old_flags.to_ne_bytes();
    let data = syn.tcp_len.saturating_sub((offset_byte >> 4) as usize * 4) as u32;
    let new_ack = u32::from_be(old_seq).wrapping_add(1 + data).to_be();
    let new_flags = u16::from_ne_bytes([offset_byte & 0xf0, TCP_RST | TCP_ACK]);
    let old_window: u16 = ctx.load(l4 + 14).ok()?;
    ctx.l4_csum_replace(check, old_seq as u64, 0, 4).ok()?;
    ctx.l4_csum_replace(check, old_ack as u64, new_ack as u64, 4)
        .ok()?;
    ctx.l4_csum_replace(check, old_flags as u64, new_flags as u64, 2)
        .ok()?;
    ctx.l4_csum_replace(check, old_window as u64, 0, 2).ok()?;
    ctx.store(l4 + 4, &0u32, 0).ok()?;
    ctx.store(l4 + 8, &new_ack, 0).ok()?;
    ctx.store(l4 + 12, &new_flags, 0).ok()?;
    ctx.store(l4 + 14, &0u16, 0).ok()?;
    Some(())
}
