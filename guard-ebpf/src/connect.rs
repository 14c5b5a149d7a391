//! cgroup connect4/connect6: admit or shed a TCP connection attempt.
//!
//! The kernel runs these hooks from `__inet_stream_connect` only while the socket is
//! unconnected and in TCP_CLOSE, so EINPROGRESS/EALREADY retries do not run them again
//! (net/ipv4/af_inet.c); TCP Fast Open (sendmsg with MSG_FASTOPEN) runs them too.
use aya_ebpf::{
    EbpfContext,
    helpers::generated::bpf_get_netns_cookie,
    macros::cgroup_sock_addr,
    maps::lpm_trie::Key,
    programs::SockAddrContext,
};
use guard_common::{
    CONTROL_BREAKER, CONTROL_EVENTS, CONTROL_HANDSHAKES, CONTROL_RATE, Candidates, CgroupKey,
    Counter, CounterKey, EVENT_BREAKER_HALF_OPEN, EVENT_BREAKER_OPENED, EVENT_SHEDDING_STARTED,
    EVENT_SHEDDING_STOPPED, Limits, MAX_CANDIDATES, MODE_ENFORCE, NO_RULE, PortUseKey,
    REASON_BREAKER, REASON_BUDGET, REASON_HANDSHAKES, REASON_OBSERVE, REASON_RATE,
    RULE_KEY_FIXED_BITS, RuleAddrKey, RuleRef, STAT_INTERNAL_ERRORS, STAT_LEASE_EXPIRED, SockState,
    linux::IPPROTO_TCP,
};

use crate::{
    accounting::{
        add, count_stat, counter, raise_peak, release, replace, rule_counter, scope_counter,
        take_token,
    },
    breaker, clock,
    events::{self, Detail},
    maps::{ACTIVE_GEN, PORT_USE, RULES, SCOPES, lease_held, storage},
    net::{ipv4_mapped, opaque_zero, words_addr},
    scope::{current_in_root, nearest_selected},
};

const ALLOW: i32 = 1;
const DENY: i32 = 0;
const SOCK_STREAM: u32 = 1;

/// 1 when cgroup sock_addr programs may call bpf_set_retval (Linux 6.1+), as the
/// daemon's probe found. Cleared, a shed connect() fails with EPERM; the verifier skips
/// the call on the dead branch, because .rodata is frozen.
#[unsafe(no_mangle)]
static HAS_SET_RETVAL: u8 = 1;

/// guard_common::CONTROL_* bits: the controls the daemon's policy uses. A clear bit
/// makes its code dead for the verifier (.rodata is frozen), which then skips it.
#[unsafe(no_mangle)]
static CONTROLS: u32 = CONTROL_RATE | CONTROL_HANDSHAKES | CONTROL_BREAKER | CONTROL_EVENTS;

/// Whether the daemon loaded this with `control` on.
#[inline(always)]
fn uses(control: u32) -> bool {
    let controls = unsafe { core::ptr::read_volatile(&CONTROLS) };
    controls & control != 0
}

/// The limits of a level that has none.
static NO_LIMITS: Limits = Limits {
    max_connections: 0,
    rate_interval_ns: 0,
    rate_burst: 0,
    max_connecting: 0,
};

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
    admit(
        &ctx,
        ipv4_mapped(sa.user_ip4),
        u16::from_be(sa.user_port as u16),
    )
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
    admit(&ctx, words_addr(words), u16::from_be(sa.user_port as u16))
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
        Charge::NoScope | Charge::Admitted => ALLOW,
    }
}

/// What `charge` did.
pub enum Charge {
    /// The socket's cgroup has no scope in generation `gen_`.
    NoScope,
    Admitted,
    /// Refused, with this errno.
    Shed(u32),
}

/// Admits the socket whose storage is `state` (its `cgroup_id` set, nothing admitted)
/// toward `addr` (the maps' form) and `port` (host order), in network namespace
/// `netns`, or sheds it when a budget is spent, `may_shed` and the daemon's lease
/// holds.
#[inline(always)]
pub fn charge(
    state: *mut SockState,
    gen_: u32,
    addr: [u8; 16],
    port: u16,
    netns: u64,
    may_shed: bool,
) -> Charge {
    let cgroup_id = unsafe { (*state).cgroup_id };
    let Some(scope) = (unsafe {
        SCOPES.get(&CgroupKey {
            gen_,
            _pad: 0,
            cgroup_id,
        })
    }) else {
        return Charge::NoScope;
    };

    // The rule as an index laundered before it is used: each candidate's own pointer
    // would be a path of its own through the rest of this function for the verifier.
    let rule = if scope.has_rules != 0 {
        match_rule(gen_, scope.scope_id, addr, port).and_then(|(cands, i)| {
            let i = launder(state, i as u64) as usize;
            if i < MAX_CANDIDATES {
                cands.rules.get(i)
            } else {
                None
            }
        })
    } else {
        None
    };
    // References into the maps' values throughout: copies of these would not fit the
    // 512-byte stack.
    let none = &NO_LIMITS;
    let (rule_id, per_endpoint, rule_limits, rule_watermark) = match rule {
        Some(r) => (r.rule_id, r.per_endpoint != 0, &r.limits, r.port_watermark),
        None => (NO_RULE, false, none, 0),
    };
    // The rule's breaker, else the scope's.
    let breaker = match rule {
        Some(r) if r.breaker.window_ns != 0 => &r.breaker,
        _ => &scope.breaker,
    };
    let watermark = if rule_watermark != 0 {
        rule_watermark
    } else {
        scope.port_watermark
    };
    // Ports held toward the destination past the watermark (the daemon keeps PORT_USE
    // current): shed like a spent budget, keeping the rest of the range for others.
    let ports_over = watermark != 0 && {
        let key = PortUseKey {
            netns,
            port,
            _pad: [0; 6],
            addr,
        };
        unsafe { PORT_USE.get(&key) }.is_some_and(|used| *used >= watermark)
    };
    let dst = CounterKey {
        scope_id: scope.scope_id,
        rule_id,
        port,
        _pad: 0,
        addr,
    };
    // The clock only for a rate or a breaker: most scopes have neither. (Scalars of the
    // breaker taken now: a pointer that lives on is a path of its own for the verifier.)
    let has_breaker = uses(CONTROL_BREAKER) && breaker.window_ns != 0 && may_shed;
    let breaker_errno = breaker.errno;
    let has_rate = uses(CONTROL_RATE)
        && (rule_limits.rate_interval_ns != 0 || scope.limits.rate_interval_ns != 0);
    let now = if (has_rate && may_shed) || has_breaker {
        clock::now_ns()
    } else {
        0
    };
    // The destination's counter, which also says when its breaker is clear. A level
    // whose counter cannot be created (full map) is skipped, and counted as an internal
    // error: fail-open for that level, the others still hold. A level not counted holds
    // null (not None: LLVM may fill the payload of a None from any register, and the
    // verifier refuses to read one never set).
    let dc = match counter(&dst) {
        Some(c) => c,
        None => core::ptr::null_mut(),
    };
    // The breaker before the other levels' counters, while the verifier has few paths
    // to walk it on. Why the attempt is over a limit: REASON_* bits.
    let mut reasons = if ports_over { REASON_BUDGET } else { 0 };
    let (mut breaker_phase, mut owed, mut moved) = (0, false, 0);
    if has_breaker {
        let word = breaker::decide_unless_clear(dc, scope.serial, &dst, breaker, now);
        // One path on from here, whichever way the word came.
        match breaker::Decision::unpack(launder(state, word)) {
            Some(d) => {
                if d.shed {
                    reasons |= REASON_BREAKER;
                }
                breaker_phase = d.phase;
                owed = !d.shed;
                moved = d.moved;
            }
            None => count_stat(STAT_INTERNAL_ERRORS),
        }
    }

    // Limits by level: destination, rule, scope.
    let limits = [
        if per_endpoint { rule_limits } else { none },
        if per_endpoint { none } else { rule_limits },
        &scope.limits,
    ];
    // Rule and scope counters are array entries, present for every id the daemon hands
    // out.
    let counters = [dc, rule_counter(rule_id), scope_counter(scope.scope_id)];
    let mut charged = 0u32;
    for i in 0..3 {
        if !counters[i].is_null() {
            charged |= 1 << i;
        } else if i != 1 || rule_id != NO_RULE {
            count_stat(STAT_INTERNAL_ERRORS);
        }
    }
    // Reserve at every level first, then look: concurrent connects each see a distinct
    // previous value, so a budget of N admits at most N. A seeded connection (not
    // `may_shed`) is established already: no handshake, no token.
    // Zeros the compiler cannot see: a literal [0; 3] becomes a call to a byte-by-byte
    // memset subprogram.
    let z = opaque_zero() as u64;
    let mut olds = [z; 3];
    let mut tokens = 0u32;
    // Bit i: level i counts this attempt in `connecting` (it sets max_connecting).
    let mut handshakes = 0u32;
    // Bit i: level i is over one of its limits (the watermark is the destination's; the
    // breaker reports its own).
    let mut over_levels = (reasons & REASON_BUDGET != 0) as u32;
    for i in 0..3 {
        let c = counters[i];
        if c.is_null() {
            continue;
        }
        let l = limits[i];
        if moved != 0 {
            let transitions = match moved {
                EVENT_BREAKER_OPENED => unsafe { &raw mut (*c).breaker_opened },
                EVENT_BREAKER_HALF_OPEN => unsafe { &raw mut (*c).breaker_half_opened },
                _ => unsafe { &raw mut (*c).breaker_closed },
            };
            add(transitions, 1);
        }
        olds[i] = add(unsafe { &raw mut (*c).active }, 1);
        // Signed: a count below 0 (see guard_common::Counter) spends no budget.
        if l.max_connections != 0 && olds[i] as i64 >= l.max_connections as i64 {
            reasons |= REASON_BUDGET;
            over_levels |= 1 << i;
        }
        if !may_shed {
            continue;
        }
        if uses(CONTROL_HANDSHAKES) && l.max_connecting != 0 {
            handshakes |= 1 << i;
            let connecting = add(unsafe { &raw mut (*c).connecting }, 1);
            if connecting as i64 >= l.max_connecting as i64 {
                reasons |= REASON_HANDSHAKES;
                over_levels |= 1 << i;
            }
        }
        if uses(CONTROL_RATE) && l.rate_interval_ns != 0 {
            if take_token(c, l.rate_interval_ns, l.rate_burst, now) {
                tokens |= 1 << i;
            } else {
                reasons |= REASON_RATE;
                over_levels |= 1 << i;
            }
        }
    }
    // The paths of the levels' branches meet here as one.
    let flags = launder(
        state,
        reasons as u64
            | (tokens as u64) << 8
            | (over_levels as u64) << 16
            | (handshakes as u64) << 24,
    );
    let reasons = (flags & 0xff) as u32;
    let tokens = (flags >> 8) as u32 & 0xff;
    let over_levels = (flags >> 16) as u32 & 0xff;
    let handshakes = (flags >> 24) as u32 & 0xff;
    let over = reasons != 0;
    if over && may_shed {
        // Shed in enforce mode while the daemon's lease holds; else admitted, counted as
        // would-be shed. The tokens go back either way, so that observe mode sees the
        // bucket enforce mode would.
        let shed = scope.mode == MODE_ENFORCE && lease_held();
        if scope.mode == MODE_ENFORCE && !shed {
            count_stat(STAT_LEASE_EXPIRED);
        }
        for i in 0..3 {
            let c = counters[i];
            if c.is_null() {
                continue;
            }
            if uses(CONTROL_RATE) && tokens & (1 << i) != 0 {
                add(
                    unsafe { &raw mut (*c).rate_tat },
                    limits[i].rate_interval_ns.wrapping_neg(),
                );
            }
            if reasons & REASON_RATE != 0 {
                add(unsafe { &raw mut (*c).rate_limited }, 1);
            }
            if reasons & REASON_HANDSHAKES != 0 {
                add(unsafe { &raw mut (*c).handshake_limited }, 1);
            }
            if reasons & REASON_BREAKER != 0 {
                add(unsafe { &raw mut (*c).breaker_limited }, 1);
            }
            if shed {
                add(unsafe { &raw mut (*c).active }, u64::MAX);
                if uses(CONTROL_HANDSHAKES) && handshakes & (1 << i) != 0 {
                    add(unsafe { &raw mut (*c).connecting }, u64::MAX);
                }
                add(unsafe { &raw mut (*c).shed }, 1);
            } else {
                add(unsafe { &raw mut (*c).would_shed }, 1);
            }
        }
        // A breaker reports its own transitions: these are the other limits'.
        if uses(CONTROL_EVENTS) && reasons & !REASON_BREAKER != 0 {
            let observe = if shed { 0 } else { REASON_OBSERVE };
            shedding_started(&counters, &dst, over_levels, reasons | observe);
        }
        if shed {
            let errno = if reasons & REASON_BREAKER != 0 && breaker_errno != 0 {
                breaker_errno
            } else {
                scope.errno
            };
            return Charge::Shed(errno);
        }
    }
    unsafe {
        (*state).dst = dst;
        (*state).dst_epoch = if counters[0].is_null() {
            0
        } else {
            (*counters[0]).epoch
        };
        (*state).charged = charged;
        (*state).connecting = handshakes;
        // An attempt that would have been shed (observe mode) owes its breaker nothing:
        // in enforce mode it would not have been made.
        (*state).breaker_owed = (owed && !over) as u32;
        (*state).breaker_phase = breaker_phase;
        (*state).connect_ns = now;
        (*state).netns = netns;
        (*state).armed = 0;
        (*state).admitted = 1;
    }
    for i in 0..3 {
        let c = counters[i];
        if !c.is_null() {
            add(unsafe { &raw mut (*c).admitted }, 1);
            if (olds[i] as i64) >= 0 {
                raise_peak(unsafe { &raw mut (*c).peak }, olds[i] + 1);
            }
        }
    }
    // Read here, so that the common case (nothing was shedding) makes no call.
    if uses(CONTROL_EVENTS)
        && may_shed
        && !over
        && counters.iter().any(|&c| {
            !c.is_null()
                && unsafe { core::ptr::read_volatile(&raw const (*c).shedding_since) } != 0
        })
    {
        shedding_stopped(&counters, &dst);
    }
    Charge::Admitted
}

/// `v`, stored in the socket's scratch word and loaded back: an unknown to the verifier.
#[inline(always)]
fn launder(state: *mut SockState, v: u64) -> u64 {
    unsafe {
        core::ptr::write_volatile(&raw mut (*state).scratch, v);
        core::ptr::read_volatile(&raw const (*state).scratch)
    }
}

/// The levels of `over_levels` that were not shedding start to, for `reasons`: one
/// event per change, by the attempt that swaps the counter's `shedding_since`. A BPF
/// subprogram, like `shedding_stopped`, so that the verifier's paths through it end at
/// its return.
#[inline(never)]
fn shedding_started(
    counters: &[*mut Counter; 3],
    dst: &CounterKey,
    over_levels: u32,
    reasons: u32,
) {
    for (i, &c) in counters.iter().enumerate() {
        if over_levels & (1 << i) != 0
            && !c.is_null()
            && unsafe { core::ptr::read_volatile(&raw const (*c).shedding_since) } == 0
        {
            report_shedding(c, dst, i as u32, reasons);
        }
    }
}

/// Every level that was shedding stops: an attempt was admitted within every limit.
#[inline(never)]
fn shedding_stopped(counters: &[*mut Counter; 3], dst: &CounterKey) {
    for (i, &c) in counters.iter().enumerate() {
        if !c.is_null() {
            report_shedding(c, dst, i as u32, 0);
        }
    }
}

/// The change found: started for `reasons`, or stopped for 0.
#[inline(always)]
fn report_shedding(c: *mut Counter, dst: &CounterKey, level: u32, reasons: u32) {
    let since = unsafe { &raw mut (*c).shedding_since };
    let seen = unsafe { core::ptr::read_volatile(since) };
    let now = clock::now_ns();
    let (kind, next) = if reasons != 0 {
        (EVENT_SHEDDING_STARTED, now)
    } else {
        (EVENT_SHEDDING_STOPPED, 0)
    };
    if (seen == 0) == (next == 0) || !replace(since, seen, next) {
        return;
    }
    let z = opaque_zero();
    let key = match level {
        0 => *dst,
        _ => CounterKey {
            scope_id: dst.scope_id,
            rule_id: if level == 1 { dst.rule_id } else { NO_RULE },
            port: 0,
            _pad: 0,
            addr: words_addr([z, z, z, z]),
        },
    };
    events::emit(
        kind,
        &key,
        now,
        &Detail {
            level,
            reasons,
            step: z,
            percent: z,
            counts: [z; 3],
            open_ns: z as u64,
        },
    );
}

/// Makes the refused connect() fail with `errno` (bpf_set_retval(-errno)). The verifier
/// checks that the argument lies in [-4095, 0] as a 64-bit value (seen on 7.2; 6.18 does
/// not), which `-(errno as i32)` of a map value is not: the errno is bounded with a mask
/// (errnos are below 4096, MAX_ERRNO), made negative by a 64-bit subtraction from a zero
/// the compiler cannot fold into a negation (which the verifier does not bound), and
/// passed as 64 bits (the helper's C prototype takes an int, which would be 32).
#[inline(always)]
fn set_errno(errno: u32) {
    let retval = opaque_zero() as i64 - (errno & 0xfff) as i64;
    // SAFETY: BPF_FUNC_set_retval (187), as aya's binding calls it.
    let set_retval: unsafe extern "C" fn(i64) -> i64 = unsafe { core::mem::transmute(187usize) };
    unsafe { set_retval(retval) };
}

/// The candidates for the destination, and the index of the first rule of the scope
/// whose destination and ports match, if any.
#[inline(always)]
fn match_rule(
    gen_: u32,
    scope_id: u32,
    addr: [u8; 16],
    port: u16,
) -> Option<(&'static Candidates, usize)> {
    let key = Key::new(
        RULE_KEY_FIXED_BITS + 128,
        RuleAddrKey {
            gen_,
            scope_id,
            addr,
        },
    );
    let cands = RULES.get(&key)?;
    for i in 0..MAX_CANDIDATES {
        if i as u32 >= cands.n {
            break;
        }
        let r = cands.rules.get(i)?;
        if ports_match(r, port) {
            return Some((cands, i));
        }
    }
    None
}

#[inline(always)]
fn ports_match(r: &RuleRef, port: u16) -> bool {
    if r.n_ports == 0 {
        return true;
    }
    for j in 0..r.ports.len() {
        if j as u32 >= r.n_ports {
            break;
        }
        if let Some(p) = r.ports.get(j)
            && p.first <= port
            && port <= p.last
        {
            return true;
        }
    }
    false
}
