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
//! bpf_skc_to_tcp_sock() at the offsets of SOCK_OFFSETS (sock_fields), and counts its
//! RSTs per listening socket (by inode); a SYN the queues let through then meets the
//! guard's per-caller budgets (callers). `listener_shed_polled`, for kernels that refuse
//! it, applies the daemon's decision from its reading, and has no per-caller budgets.
//! Both shed nothing LISTENER_TTL_NS
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
    LISTENER_TTL_NS, ListenerEntry, ListenerKey, MODE_ENFORCE, NO_LISTENER, RstKey,
    callers::{PER_SOURCE_DROP, PER_SOURCE_RST},
    linux::{AF_INET, IPPROTO_TCP, TCP_LISTEN},
};

use crate::{
    accounting::bump,
    callers,
    maps::{LISTENER_HEARTBEAT, LISTENERS, RST_SHED, WOULD_RST},
    net::{ipv4_mapped, words_addr},
    sock_fields::{self, Queues, mapped_words},
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
    let (key, queues, inode) = listener_of::<PER_SYN>(ctx, &syn)?;
    let entry = *unsafe { LISTENERS.get(&key) }?;
    if entry.listener_id == NO_LISTENER {
        return None;
    }
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
    if over {
        let rst = RstKey {
            listener_id: entry.listener_id,
            inode,
        };
        if entry.mode != MODE_ENFORCE {
            bump(&WOULD_RST, &rst);
            return None;
        }
        let (action, sent) = refuse(ctx, &syn, PER_SOURCE_RST);
        if sent {
            bump(&RST_SHED, &rst);
        }
        return Some(action);
    }
    if !PER_SYN {
        return None;
    }
    let action = callers::check(source(ctx, &syn)?, &entry);
    if action == 0 {
        return None;
    }
    Some(refuse(ctx, &syn, action).0)
}

/// Refuses the SYN by `action`: answered with a RST+ACK sent back out of the interface
/// it came in on (PER_SOURCE_RST), or dropped (PER_SOURCE_DROP). The tc action, and
/// whether a RST was made. From the rewrite on, a step that fails drops the packet
/// rather than let a half-rewritten segment through.
#[inline(always)]
fn refuse(ctx: &TcContext, syn: &Syn, action: u32) -> (i32, bool) {
    if action == PER_SOURCE_DROP || reply_rst(ctx, syn).is_none() {
        return (TC_ACT_SHOT, false);
    }
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    let redirected = unsafe { bpf_redirect(ifindex, 0) } == TC_ACT_REDIRECT as i64;
    (
        if redirected {
            TC_ACT_REDIRECT
        } else {
            TC_ACT_SHOT
        },
        true,
    )
}

/// The SYN's source address as words of the maps' form (IPv4 IPv4-mapped).
#[inline(always)]
fn source(ctx: &TcContext, syn: &Syn) -> Option<[u32; 4]> {
    if syn.addr_len == 4 {
        return Some(mapped_words(ctx.load::<u32>(syn.src_off).ok()?));
    }
    Some([
        ctx.load::<u32>(syn.src_off).ok()?,
        ctx.load::<u32>(syn.src_off + 4).ok()?,
        ctx.load::<u32>(syn.src_off + 8).ok()?,
        ctx.load::<u32>(syn.src_off + 12).ok()?,
    ])
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
/// (per SYN) its queues and inode.
#[inline(always)]
fn listener_of<const PER_SYN: bool>(
    ctx: &TcContext,
    syn: &Syn,
) -> Option<(ListenerKey, Queues, u32)> {
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
    let (netns, queues, inode) = if PER_SYN && state == TCP_LISTEN {
        own_queues(sk.cast())
    } else {
        (0, Queues::default(), 0)
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
        inode,
    ))
}

/// A listening socket's network namespace (inode number; 0 when it cannot be read),
/// queues and inode, read from its struct tcp_sock.
#[inline(always)]
fn own_queues(sk: *mut core::ffi::c_void) -> (u32, Queues, u32) {
    let tp = unsafe { bpf_skc_to_tcp_sock(sk) } as *const u8;
    if tp.is_null() {
        return (0, Queues::default(), 0);
    }
    (
        sock_fields::netns(tp),
        sock_fields::queues(tp),
        sock_fields::inode(tp),
    )
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
