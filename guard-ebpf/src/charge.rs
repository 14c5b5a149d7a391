//! The admission of one connection attempt, for the connect hooks and for the seeding of
//! connections that existed before the daemon (`charge`): the scope and rule it falls
//! under, a reservation at each level (destination, rule, scope), then a shed, or an
//! admission kept in the socket's storage.
//!
//! Each step is `#[inline(always)]`: `charge` stays one function for the verifier, whose
//! paths through it are made to meet (`launder`) where they would multiply, and whose
//! frame counts toward the 512 bytes of stack of the hook's chain of calls.
use aya_ebpf::maps::lpm_trie::Key;
use guard_common::{
    BreakerConf, CONTROL_BREAKER, CONTROL_EVENTS, CONTROL_HANDSHAKES, CONTROL_RATE, Candidates,
    CgroupKey, Counter, CounterKey, EVENT_BREAKER_HALF_OPEN, EVENT_BREAKER_OPENED, Limits,
    MAX_CANDIDATES, MODE_ENFORCE, NO_RULE, PortUseKey, REASON_BREAKER, REASON_BUDGET,
    REASON_HANDSHAKES, REASON_OBSERVE, REASON_RATE, RULE_KEY_FIXED_BITS, RuleAddrKey, RuleRef,
    STAT_INTERNAL_ERRORS, STAT_LEASE_EXPIRED, ScopeConf, SockState, drill::FAULT_REFUSE,
};

use crate::{
    accounting::{add, count_stat, counter, raise_peak, rule_counter, scope_counter, take_token},
    breaker, clock, drill,
    maps::{PORT_USE, RULES, SCOPES, lease_held},
    net::opaque_zero,
    shedding,
};

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

/// What `charge` did.
pub enum Charge {
    /// The socket's cgroup has no scope in generation `gen_`.
    NoScope,
    Admitted,
    /// Refused, with this errno: shed, or given a drill's refuse fault.
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
    let Some(scope) = scope(state, gen_) else {
        return Charge::NoScope;
    };
    // A drill's refuse fault first: a refused attempt is neither admitted nor shed (the
    // other faults are given to admitted sockets, by the connect hook). Seeded
    // connections exist already, and are never faulted.
    if may_shed && drill::fault_of(scope.scope_id) == FAULT_REFUSE {
        let refused = drill::decide(scope.scope_id, &addr, port, FAULT_REFUSE);
        if refused != 0 {
            return Charge::Shed((refused >> 8) as u32 & 0xffff);
        }
    }
    let rule = if scope.has_rules != 0 {
        rule(state, match_rule(gen_, scope.scope_id, addr, port))
    } else {
        None
    };
    let target = Target::new(scope, rule);
    let ports_over = ports_over(
        target.watermark,
        &PortUseKey {
            netns,
            port,
            _pad: [0; 6],
            addr,
        },
    );
    let dst = CounterKey {
        scope_id: scope.scope_id,
        rule_id: target.rule_id,
        port,
        _pad: 0,
        addr,
    };
    // The clock only for a rate or a breaker: most scopes have neither. (Scalars of the
    // breaker taken now: a pointer that lives on is a path of its own for the verifier.)
    let has_breaker = uses(CONTROL_BREAKER) && target.breaker.window_ns != 0 && may_shed;
    let breaker_errno = target.breaker.errno;
    let has_rate = uses(CONTROL_RATE)
        && (target.rule_limits.rate_interval_ns != 0 || scope.limits.rate_interval_ns != 0);
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
    let mut turn = BreakerTurn::default();
    if has_breaker {
        turn = breaker_turn(state, dc, scope.serial, &dst, target.breaker, now);
        if turn.shed {
            reasons |= REASON_BREAKER;
        }
    }
    let levels = levels(dc, &target);
    let reserved = reserve(state, &levels, reasons, turn.moved, now, may_shed);
    let over = reserved.reasons != 0;
    if over && may_shed && shed_or_observe(scope, &levels, &reserved, &dst) {
        let errno = if reserved.reasons & REASON_BREAKER != 0 && breaker_errno != 0 {
            breaker_errno
        } else {
            scope.errno
        };
        return Charge::Shed(errno);
    }
    keep_admission(state, &dst, &levels, &reserved, &turn, over, now, netns);
    count_admitted(&levels, &reserved.olds);
    // Read here, so that the common case (nothing was shedding) makes no call.
    if uses(CONTROL_EVENTS) && may_shed && !over {
        shedding::stopped_if_shedding(&levels.counters, &dst);
    }
    Charge::Admitted
}

/// What an attempt is charged to: its scope, the rule that matched, and what they set.
/// References into the maps' values throughout: copies of these would not fit the
/// 512-byte stack.
struct Target {
    scope: &'static ScopeConf,
    /// NO_RULE when no rule matched.
    rule_id: u32,
    /// The rule's limits are each endpoint's (else the rule's, shared).
    per_endpoint: bool,
    /// The rule's limits; NO_LIMITS without a rule.
    rule_limits: &'static Limits,
    /// The rule's breaker, else the scope's.
    breaker: &'static BreakerConf,
    /// The rule's port watermark, else the scope's; 0 for none.
    watermark: u32,
}

/// The scope of the socket's cgroup in generation `gen_`, if it has one.
#[inline(always)]
fn scope(state: *mut SockState, gen_: u32) -> Option<&'static ScopeConf> {
    let cgroup_id = unsafe { (*state).cgroup_id };
    unsafe {
        SCOPES.get(&CgroupKey {
            gen_,
            _pad: 0,
            cgroup_id,
        })
    }
}

/// The rule `matched` found (`match_rule`), as an index laundered before it is used:
/// each candidate's own pointer would be a path of its own through the rest of
/// `charge` for the verifier.
#[inline(always)]
fn rule(
    state: *mut SockState,
    matched: Option<(&'static Candidates, usize)>,
) -> Option<&'static RuleRef> {
    matched.and_then(|(cands, i)| {
        let i = launder(state, i as u64) as usize;
        if i < MAX_CANDIDATES {
            cands.rules.get(i)
        } else {
            None
        }
    })
}

impl Target {
    /// What `scope` and its matching `rule` (if any) set.
    #[inline(always)]
    fn new(scope: &'static ScopeConf, rule: Option<&'static RuleRef>) -> Target {
        let none = &NO_LIMITS;
        let (rule_id, per_endpoint, rule_limits, rule_watermark) = match rule {
            Some(r) => (r.rule_id, r.per_endpoint != 0, &r.limits, r.port_watermark),
            None => (NO_RULE, false, none, 0),
        };
        let breaker = match rule {
            Some(r) if r.breaker.window_ns != 0 => &r.breaker,
            _ => &scope.breaker,
        };
        let watermark = if rule_watermark != 0 {
            rule_watermark
        } else {
            scope.port_watermark
        };
        Target {
            scope,
            rule_id,
            per_endpoint,
            rule_limits,
            breaker,
            watermark,
        }
    }
}

/// Whether the ports held toward the destination `key` reach `watermark` (the daemon
/// keeps PORT_USE current): shed like a spent budget, keeping the rest of the range for
/// others.
#[inline(always)]
fn ports_over(watermark: u32, key: &PortUseKey) -> bool {
    watermark != 0 && unsafe { PORT_USE.get(key) }.is_some_and(|used| *used >= watermark)
}

/// What the destination's breaker decided for an attempt.
#[derive(Default)]
struct BreakerTurn {
    shed: bool,
    /// The phase the attempt's outcome counts in.
    phase: u32,
    /// An admitted attempt's outcome is owed to the breaker.
    owed: bool,
    /// The transition the attempt made (an EVENT_BREAKER_* kind), or 0.
    moved: u32,
}

/// The breaker's decision for the destination `dst`, whose counter is `dc`; none (and an
/// internal error counted) when its entry could not be made.
#[inline(always)]
fn breaker_turn(
    state: *mut SockState,
    dc: *mut Counter,
    serial: u32,
    dst: &CounterKey,
    conf: &BreakerConf,
    now: u64,
) -> BreakerTurn {
    let word = breaker::decide_unless_clear(dc, serial, dst, conf, now);
    // One path on from here, whichever way the word came.
    match breaker::Decision::unpack(launder(state, word)) {
        Some(d) => BreakerTurn {
            shed: d.shed,
            phase: d.phase,
            owed: !d.shed,
            moved: d.moved,
        },
        None => {
            count_stat(STAT_INTERNAL_ERRORS);
            BreakerTurn::default()
        }
    }
}

/// The levels an attempt is counted at: 0 the destination, 1 the rule, 2 the scope.
struct Levels {
    /// Each level's counter; null where it has none.
    counters: [*mut Counter; 3],
    limits: [&'static Limits; 3],
    /// Bit i: level i has a counter (SockState::charged).
    charged: u32,
}

/// The levels of `target`, `dc` the destination's counter. A missing counter but the
/// rule's without a rule is an internal error.
#[inline(always)]
fn levels(dc: *mut Counter, target: &Target) -> Levels {
    let none = &NO_LIMITS;
    let limits = [
        if target.per_endpoint {
            target.rule_limits
        } else {
            none
        },
        if target.per_endpoint {
            none
        } else {
            target.rule_limits
        },
        &target.scope.limits,
    ];
    // Rule and scope counters are array entries, present for every id the daemon hands
    // out.
    let counters = [
        dc,
        rule_counter(target.rule_id),
        scope_counter(target.scope.scope_id),
    ];
    let mut charged = 0u32;
    for i in 0..3 {
        if !counters[i].is_null() {
            charged |= 1 << i;
        } else if i != 1 || target.rule_id != NO_RULE {
            count_stat(STAT_INTERNAL_ERRORS);
        }
    }
    Levels {
        counters,
        limits,
        charged,
    }
}

/// What the reservation at every level found.
struct Reserved {
    /// Each level's active count before this attempt.
    olds: [u64; 3],
    /// Why the attempt is over a limit: REASON_* bits; 0 within every limit.
    reasons: u32,
    /// Bit i: level i gave the attempt a rate token.
    tokens: u32,
    /// Bit i: level i is over one of its limits (the watermark is the destination's;
    /// the breaker reports its own).
    over_levels: u32,
    /// Bit i: level i counts the attempt in `connecting` (it sets max_connecting).
    handshakes: u32,
}

/// Reserves at every level first, then looks: concurrent connects each see a distinct
/// previous value, so a budget of N admits at most N. `reasons`: what the watermark and
/// the breaker found; `moved`: the breaker's transition, counted at every level. A
/// seeded connection (not `may_shed`) is established already: no handshake, no token.
#[inline(always)]
fn reserve(
    state: *mut SockState,
    levels: &Levels,
    mut reasons: u32,
    moved: u32,
    now: u64,
    may_shed: bool,
) -> Reserved {
    // Zeros the compiler cannot see: a literal [0; 3] becomes a call to a byte-by-byte
    // memset subprogram.
    let z = opaque_zero() as u64;
    let mut olds = [z; 3];
    let mut tokens = 0u32;
    let mut handshakes = 0u32;
    let mut over_levels = (reasons & REASON_BUDGET != 0) as u32;
    for i in 0..3 {
        let c = levels.counters[i];
        if c.is_null() {
            continue;
        }
        let l = levels.limits[i];
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
    Reserved {
        olds,
        reasons: (flags & 0xff) as u32,
        tokens: (flags >> 8) as u32 & 0xff,
        over_levels: (flags >> 16) as u32 & 0xff,
        handshakes: (flags >> 24) as u32 & 0xff,
    }
}

/// An attempt over a limit: shed in enforce mode while the daemon's lease holds; else
/// admitted, counted as would-be shed. The tokens go back either way, so that observe
/// mode sees the bucket enforce mode would. Returns whether it was shed.
#[inline(always)]
fn shed_or_observe(scope: &ScopeConf, levels: &Levels, r: &Reserved, dst: &CounterKey) -> bool {
    let reasons = r.reasons;
    let shed = scope.mode == MODE_ENFORCE && lease_held();
    if scope.mode == MODE_ENFORCE && !shed {
        count_stat(STAT_LEASE_EXPIRED);
    }
    for i in 0..3 {
        let c = levels.counters[i];
        if c.is_null() {
            continue;
        }
        if uses(CONTROL_RATE) && r.tokens & (1 << i) != 0 {
            add(
                unsafe { &raw mut (*c).rate_tat },
                levels.limits[i].rate_interval_ns.wrapping_neg(),
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
            if uses(CONTROL_HANDSHAKES) && r.handshakes & (1 << i) != 0 {
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
        shedding::started(&levels.counters, dst, r.over_levels, reasons | observe);
    }
    shed
}

/// Keeps the admission toward `dst` in the socket's storage, for its release and its
/// breaker's outcome.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn keep_admission(
    state: *mut SockState,
    dst: &CounterKey,
    levels: &Levels,
    r: &Reserved,
    turn: &BreakerTurn,
    over: bool,
    now: u64,
    netns: u64,
) {
    let dc = levels.counters[0];
    unsafe {
        (*state).dst = *dst;
        (*state).dst_epoch = if dc.is_null() { 0 } else { (*dc).epoch };
        (*state).charged = levels.charged;
        (*state).connecting = r.handshakes;
        // An attempt that would have been shed (observe mode) owes its breaker nothing:
        // in enforce mode it would not have been made.
        (*state).breaker_owed = (turn.owed && !over) as u32;
        (*state).breaker_phase = turn.phase;
        (*state).connect_ns = now;
        (*state).netns = netns;
        (*state).armed = 0;
        (*state).admitted = 1;
    }
}

/// Counts the admission at every level, and raises the levels' peaks.
#[inline(always)]
fn count_admitted(levels: &Levels, olds: &[u64; 3]) {
    for i in 0..3 {
        let c = levels.counters[i];
        if !c.is_null() {
            add(unsafe { &raw mut (*c).admitted }, 1);
            if (olds[i] as i64) >= 0 {
                raise_peak(unsafe { &raw mut (*c).peak }, olds[i] + 1);
            }
        }
    }
}

/// `v`, stored in the socket's scratch word and loaded back: an unknown to the verifier.
#[inline(always)]
fn launder(state: *mut SockState, v: u64) -> u64 {
    unsafe {
        core::ptr::write_volatile(&raw mut (*state).scratch, v);
        core::ptr::read_volatile(&raw const (*state).scratch)
    }
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
