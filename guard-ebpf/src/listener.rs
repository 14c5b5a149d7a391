//! tc ingress on a listener guard's interfaces: a SYN for a listener whose accept queue
//! is past its watermark (LISTENERS_SHED, kept by the daemon) is turned into a RST+ACK
//! and sent back out of the interface it came in on, so the client's connect() fails at
//! once with ECONNREFUSED instead of waiting on SYN retransmits. Everything else passes.
//!
//! The listener is the one the kernel itself would pick: bpf_skc_lookup_tcp() on the
//! SYN's 4-tuple in the interface's namespace. So forwarded traffic and a specific
//! listener shadowing a wildcard one are told apart.
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
    helpers::generated::{bpf_redirect, bpf_sk_release, bpf_skc_lookup_tcp},
    macros::classifier,
    programs::TcContext,
};
use guard_common::{
    ListenerKey, MODE_ENFORCE,
    linux::{AF_INET, IPPROTO_TCP, TCP_LISTEN},
};

use crate::{
    accounting::bump,
    maps::{LISTENERS_SHED, RST_SHED, WOULD_RST},
    net::{ipv4_mapped, words_addr},
};

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;

#[classifier]
pub fn listener_shed(ctx: TcContext) -> i32 {
    shed(&ctx).unwrap_or(TC_ACT_OK)
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
fn shed(ctx: &TcContext) -> Option<i32> {
    let syn = parse(ctx)?;
    let key = listener_of(ctx, &syn)?;
    let found = *unsafe { LISTENERS_SHED.get(&key) }?;
    if found.mode != MODE_ENFORCE {
        bump(&WOULD_RST, &found.listener_id);
        return None;
    }
    // From here the packet is being rewritten: if a step fails, drop it rather than let
    // a half-rewritten segment through.
    if reply_rst(ctx, &syn).is_none() {
        return Some(TC_ACT_SHOT);
    }
    bump(&RST_SHED, &found.listener_id);
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    let action = unsafe { bpf_redirect(ifindex, 0) };
    Some(if action == TC_ACT_REDIRECT as i64 {
        TC_ACT_REDIRECT
    } else {
        TC_ACT_SHOT
    })
}

/// The listening socket the kernel would give this SYN to, as a LISTENERS_SHED key.
#[inline(always)]
fn listener_of(ctx: &TcContext, syn: &Syn) -> Option<ListenerKey> {
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
    unsafe { bpf_sk_release(sk.cast()) };
    if state != TCP_LISTEN {
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
    Some(ListenerKey {
        port: port as u16,
        _pad: 0,
        addr,
    })
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
