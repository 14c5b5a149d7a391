//! tc ingress on a listener's interfaces: a SYN to a listener whose accept queue is past
//! its watermark (LISTENERS_SHED, kept by the daemon) is turned into a RST+ACK and sent
//! back out of the interface it came in on, so the client's connect() fails at once with
//! ECONNREFUSED instead of waiting on SYN retransmits. Everything else passes.
//!
//! The reply follows RFC 9293 3.10.7.1 for a segment without ACK: seq 0, ack = SYN's seq
//! + 1, RST|ACK. Swapping addresses and ports leaves the checksums unchanged; the
//! rewritten seq, ack, flags and window are folded in with l4_csum_replace.
use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_REDIRECT},
    helpers::generated::bpf_redirect,
    macros::classifier,
    programs::TcContext,
};
use guard_common::{ListenerKey, MODE_ENFORCE};

use crate::{
    accounting::bump,
    maps::{LISTENERS_SHED, RST_SHED, WOULD_RST},
};

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const IPPROTO_TCP: u8 = 6;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;

#[classifier]
pub fn listener_shed(ctx: TcContext) -> i32 {
    shed(&ctx).unwrap_or(TC_ACT_OK)
}

#[inline(always)]
fn shed(ctx: &TcContext) -> Option<i32> {
    let proto = u16::from_be(ctx.load::<u16>(12).ok()?);
    let mut addr = [0u8; 16];
    let (l3_len, src_off, addr_len) = match proto {
        ETH_P_IP => {
            let vihl: u8 = ctx.load(ETH_HLEN).ok()?;
            if ctx.load::<u8>(ETH_HLEN + 9).ok()? != IPPROTO_TCP {
                return None;
            }
            addr[10] = 0xff;
            addr[11] = 0xff;
            addr[12..].copy_from_slice(&ctx.load::<[u8; 4]>(ETH_HLEN + 16).ok()?);
            (((vihl & 0x0f) as usize) * 4, ETH_HLEN + 12, 4)
        }
        ETH_P_IPV6 => {
            // Extension headers are not followed: such SYNs pass.
            if ctx.load::<u8>(ETH_HLEN + 6).ok()? != IPPROTO_TCP {
                return None;
            }
            addr = ctx.load::<[u8; 16]>(ETH_HLEN + 24).ok()?;
            (40, ETH_HLEN + 8, 16)
        }
        _ => return None,
    };
    let l4 = ETH_HLEN + l3_len;
    let flags: u8 = ctx.load(l4 + 13).ok()?;
    if flags & (TCP_SYN | TCP_ACK | TCP_RST) != TCP_SYN {
        return None;
    }
    let port = u16::from_be(ctx.load::<u16>(l4 + 2).ok()?);
    let mut key = ListenerKey {
        port,
        _pad: 0,
        addr,
    };
    let found = match unsafe { LISTENERS_SHED.get(&key) } {
        Some(s) => *s,
        None => {
            key.addr = [0; 16];
            *unsafe { LISTENERS_SHED.get(&key) }?
        }
    };
    if found.mode != MODE_ENFORCE {
        bump(&WOULD_RST, &found.listener_id);
        return None;
    }
    reply_rst(ctx, l4, src_off, addr_len)?;
    bump(&RST_SHED, &found.listener_id);
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    let action = unsafe { bpf_redirect(ifindex, 0) };
    (action == TC_ACT_REDIRECT as i64).then_some(TC_ACT_REDIRECT)
}

/// Rewrites the SYN in place into its RST+ACK answer.
#[inline(always)]
fn reply_rst(ctx: &TcContext, l4: usize, src_off: usize, addr_len: usize) -> Option<()> {
    // Ethernet and IP: swap source and destination.
    let macs: [u8; 12] = ctx.load(0).ok()?;
    let mut swapped = [0u8; 12];
    swapped[..6].copy_from_slice(&macs[6..]);
    swapped[6..].copy_from_slice(&macs[..6]);
    ctx.store(0, &swapped, 0).ok()?;
    if addr_len == 4 {
        let ips: [u8; 8] = ctx.load(src_off).ok()?;
        let mut sw = [0u8; 8];
        sw[..4].copy_from_slice(&ips[4..]);
        sw[4..].copy_from_slice(&ips[..4]);
        ctx.store(src_off, &sw, 0).ok()?;
    } else {
        let ips: [u8; 32] = ctx.load(src_off).ok()?;
        let mut sw = [0u8; 32];
        sw[..16].copy_from_slice(&ips[16..]);
        sw[16..].copy_from_slice(&ips[..16]);
        ctx.store(src_off, &sw, 0).ok()?;
    }
    // TCP: swap ports; seq 0, ack = seq + 1, RST|ACK, window 0.
    let ports: [u8; 4] = ctx.load(l4).ok()?;
    ctx.store(l4, &[ports[2], ports[3], ports[0], ports[1]], 0)
        .ok()?;
    let check = l4 + 16;
    let old_seq: u32 = ctx.load(l4 + 4).ok()?;
    let old_ack: u32 = ctx.load(l4 + 8).ok()?;
    let new_ack = u32::from_be(old_seq).wrapping_add(1).to_be();
    let old_flags: u16 = ctx.load(l4 + 12).ok()?;
    // Raw values in memory order, as the checksum helpers take them. Keep the data
    // offset (high 4 bits of the first byte); set the flag byte.
    let [offset_byte, _] = old_flags.to_ne_bytes();
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
