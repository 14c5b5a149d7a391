//! cgroup connect4/connect6: admit or shed a TCP connection attempt.
//!
//! The kernel runs these hooks from `__inet_stream_connect` only while the socket is
//! unconnected and in TCP_CLOSE, so EINPROGRESS/EALREADY retries do not run them again
//! (net/ipv4/af_inet.c); TCP Fast Open (sendmsg with MSG_FASTOPEN) runs them too.
use aya_ebpf::{
    EbpfContext, helpers::generated::bpf_get_netns_cookie, macros::cgroup_sock_addr,
    programs::SockAddrContext,
};
use guard_common::{STAT_INTERNAL_ERRORS, linux::IPPROTO_TCP};

use crate::{
    accounting::{count_stat, release},
    charge::{Charge, charge},
    drill,
    maps::{ACTIVE_GEN, storage},
    net::{ipv4_mapped, opaque_zero, words_addr},
    release::ask_state_callback,
    scope::{current_in_root, nearest_selected},
};

const ALLOW: i32 = 1;
const DENY: i32 = 0;
/// `admit`'s answer for an attempt a drill resets: the hook sends it to the loopback's
/// port 0 (`to_closed_port4`, `to_closed_port6`), then allows it.
const RESET: i32 = 2;
const SOCK_STREAM: u32 = 1;

/// 1 when cgroup sock_addr programs may call bpf_set_retval (Linux 6.1+), as the
/// daemon's probe found. Cleared, a shed connect() fails with EPERM; the verifier skips
/// the call on the dead branch, because .rodata is frozen.
#[unsafe(no_mangle)]
static HAS_SET_RETVAL: u8 = 1;

/// connect() on a TCP socket; UDP and every other socket pass untouched.
#[inline(always)]
fn is_tcp(ctx: &SockAddrContext) -> bool {
    let sa = unsafe { &*ctx.sock_addr };
    sa.type_ == SOCK_STREAM && sa.protocol == IPPROTO_TCP
}

#[cgroup_sock_addr(connect4)]
pub fn connect4(ctx: SockAddrContext) -> i32 {
    if !is_tcp(&ctx) {
        return ALLOW;
    }
    let sa = unsafe { &*ctx.sock_addr };
    match admit(
        &ctx,
        ipv4_mapped(sa.user_ip4),
        u16::from_be(sa.user_port as u16),
    ) {
        RESET => {
            let sa = ctx.sock_addr;
            unsafe {
                (*sa).user_ip4 = LOOPBACK4;
                (*sa).user_port = 0;
            }
            ALLOW
        }
        verdict => verdict,
    }
}

#[cgroup_sock_addr(connect6)]
pub fn connect6(ctx: SockAddrContext) -> i32 {
    if !is_tcp(&ctx) {
        return ALLOW;
    }
    let sa = unsafe { &*ctx.sock_addr };
    // One 32-bit load per element: the verifier rejects wider context reads here.
    let words = [
        sa.user_ip6[0],
        sa.user_ip6[1],
        sa.user_ip6[2],
        sa.user_ip6[3],
    ];
    // `::ffff:a.b.c.d` is already the IPv4 key (IPv4 is stored IPv4-mapped).
    match admit(&ctx, words_addr(words), u16::from_be(sa.user_port as u16)) {
        RESET => {
            // Read again from the context: `words` kept live across `admit` would take
            // stack the verifier's 512 bytes cannot spare.
            let sa = ctx.sock_addr;
            let mapped = unsafe {
                (*sa).user_ip6[0] == 0 && (*sa).user_ip6[1] == 0 && (*sa).user_ip6[2] == MAPPED_PREFIX
            };
            unsafe {
                if mapped {
                    (*sa).user_ip6[3] = LOOPBACK4;
                } else {
                    (*sa).user_ip6[0] = 0;
                    (*sa).user_ip6[1] = 0;
                    (*sa).user_ip6[2] = 0;
                    (*sa).user_ip6[3] = u32::from_ne_bytes([0, 0, 0, 1]);
                }
                (*sa).user_port = 0;
            }
            ALLOW
        }
        verdict => verdict,
    }
}

/// `addr`: the destination in the maps' form; `port`: host order.
#[inline(always)]
fn admit(ctx: &SockAddrContext, addr: [u8; 16], port: u16) -> i32 {
    // The socket's scope comes from the cgroup it was created in, which sock_create
    // stored. A socket without storage was created before these programs ran for its
    // cgroup (just created, or before the daemon started), or by the kernel (an MPTCP
    // subflow); it was created in this cgroup's subtree, the one these programs are
    // attached to, and takes the scope of the connecting task's cgroup, which created
    // it in the common case. Not for a task of the root cgroup, as kernel threads are:
    // their kernel sockets never run sock_release, which a failure before the SYN
    // needs. With no scope there, it passes untouched.
    let sk = unsafe { (*ctx.sock_addr).__bindgen_anon_1.sk };
    let gen_ = ACTIVE_GEN.get(0).copied().unwrap_or(0);
    let mut state = storage(sk, false);
    if state.is_null() {
        if current_in_root() {
            return ALLOW;
        }
        let selected = nearest_selected(gen_);
        if selected == 0 {
            return ALLOW;
        }
        state = storage(sk, true);
        if state.is_null() {
            count_stat(STAT_INTERNAL_ERRORS);
            return ALLOW;
        }
        unsafe { (*state).cgroup_id = selected };
    }
    // A reconnect after a failure that no release path saw (the route lookup failed, or
    // another cgroup program refused the first attempt): release the old admission.
    let _ = release(state);
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    match charge(state, gen_, addr, port, netns, true) {
        Charge::Shed(errno) => {
            if unsafe { core::ptr::read_volatile(&HAS_SET_RETVAL) } != 0 {
                set_errno(errno);
            }
            DENY
        }
        Charge::Admitted => {
            let reset = drill::fault_admitted(sk, state);
            // Before the port search, whose failure only a state callback asked for here
            // sees. Where the kernel refuses the option, TCP_CONNECT_CB asks, and the
            // tracepoint sees what comes before.
            let _ = ask_state_callback(ctx.as_ptr());
            if reset { RESET } else { ALLOW }
        }
        Charge::NoScope => ALLOW,
    }
}

/// A drill's reset sends the connect to port 0 of the loopback address (127.0.0.1,
/// `::ffff:127.0.0.1` for an IPv4 destination of an IPv6 socket, else `::1`), where no
/// socket can listen, so the loopback stack answers the SYN with a RST
/// (tcp_v4_send_reset). The admission stays charged to the destination asked for, which
/// the socket's storage holds.
const LOOPBACK4: u32 = u32::from_ne_bytes([127, 0, 0, 1]);
/// The third word of an IPv4-mapped IPv6 address, in memory order.
const MAPPED_PREFIX: u32 = u32::from_ne_bytes([0, 0, 0xff, 0xff]);

/// Makes the refused connect() fail with `errno` (bpf_set_retval(-errno)). The verifier
/// checks that the argument lies in [-4095, 0] as a 64-bit value (7.2's verifier does;
/// 6.18's does not), which `-(errno as i32)` of a map value is not: the errno is
/// bounded with a mask (errnos are below 4096, MAX_ERRNO), made negative by a 64-bit
/// subtraction from a zero the compiler cannot fold into a negation (which the verifier
/// does not bound), and passed as 64 bits (the helper's C prototype takes an int, which
/// would be 32).
#[inline(always)]
fn set_errno(errno: u32) {
    let retval = opaque_zero() as i64 - (errno & 0xfff) as i64;
    // SAFETY: BPF_FUNC_set_retval (187), as aya's binding calls it.
    let set_retval: unsafe extern "C" fn(i64) -> i64 = unsafe { core::mem::transmute(187usize) };
    unsafe { set_retval(retval) };
}
