//! The maps shared by the programs. Each static is named as in
//! guard_common::names::map, by which the daemon finds it.
use core::ffi::c_void;

use aya_ebpf::{
    bindings::{BPF_F_NO_PREALLOC, BPF_SK_STORAGE_GET_F_CREATE, bpf_sock},
    btf_maps::SkStorage,
    helpers::generated::bpf_sk_storage_get,
    macros::{btf_map, map},
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, RingBuf},
};
use guard_common::{
    Breaker, Candidates, CgroupKey, Counter, CounterKey, DEFAULT_DESTINATIONS, EaddrKey, IdKey,
    ListenerEntry, ListenerKey, MAX_RULE_IDS, MAX_SCOPE_IDS, PortUseKey, RstKey, RuleAddrKey,
    STAT_COUNT, ScopeConf, SockState, TimeWaitKey,
    callers::{
        CallerCount, CallerHold, CallerKey, MAX_CALLERS, MAX_SOURCES, PerSourceTotals, SourceState,
    },
    drill::{DrillConf, DrillCounts, DrillMark},
};

/// Element 0: the policy generation (0 or 1) that the programs read.
#[map]
pub static ACTIVE_GEN: Array<u32> = Array::with_max_entries(1, 0);

/// (generation, cgroup id) -> scope, for the cgroups a scope selects (not their
/// descendants: scope::nearest_selected finds a task's nearest selected ancestor).
#[map]
pub static SCOPES: HashMap<CgroupKey, ScopeConf> =
    HashMap::with_max_entries(65536, BPF_F_NO_PREALLOC);

/// Per generation: bit L set when SCOPES holds a cgroup L levels below the daemon's
/// cgroup2 mount, so that scope::nearest_selected looks only at those levels.
#[map]
pub static SCOPE_LEVELS: Array<u32> = Array::with_max_entries(2, 0);

/// Element 0: the cgroup id of the daemon's cgroup2 mount, the kernel's root cgroup or,
/// in a cgroup namespace, the namespace's root (levels count from it).
#[map]
pub static CGROUP_ROOT: Array<u64> = Array::with_max_entries(1, 0);

/// (generation, scope, destination prefix) -> the rules that can match it.
#[map]
pub static RULES: LpmTrie<RuleAddrKey, Candidates> = LpmTrie::with_max_entries(65536, 0);

/// Connection counters at destination level (created on first use, forgotten by the
/// daemon when idle).
#[map]
pub static COUNTERS: HashMap<CounterKey, Counter> =
    HashMap::with_max_entries(DEFAULT_DESTINATIONS, BPF_F_NO_PREALLOC);

/// Connection counters at scope level, indexed by scope id (an array: the verifier
/// inlines its lookups, and every entry exists, zeroed, from the start).
#[map]
pub static SCOPE_COUNTERS: Array<Counter> = Array::with_max_entries(MAX_SCOPE_IDS, 0);

/// Connection counters at rule level, indexed by rule id (unique across scopes).
#[map]
pub static RULE_COUNTERS: Array<Counter> = Array::with_max_entries(MAX_RULE_IDS, 0);

/// TIME_WAIT entries born on admitted connections (see guard_common::TimeWaitKey).
#[map]
pub static TIME_WAITS: HashMap<TimeWaitKey, u64> =
    HashMap::with_max_entries(65536, BPF_F_NO_PREALLOC);

/// connect() failures with EADDRNOTAVAIL per scope and process name.
#[map]
pub static EADDRNOTAVAIL: HashMap<EaddrKey, u64> =
    HashMap::with_max_entries(4096, BPF_F_NO_PREALLOC);

/// Thousandths of the ephemeral range held toward a destination, for port watermarks.
#[map]
pub static PORT_USE: HashMap<PortUseKey, u32> = HashMap::with_max_entries(65536, BPF_F_NO_PREALLOC);

/// CLOCK_MONOTONIC (ns) of the daemon's last heartbeat, every 100 ms: the per-SYN
/// listener program sheds nothing LISTENER_TTL_NS after it.
#[map]
pub static LISTENER_HEARTBEAT: Array<u64> = Array::with_max_entries(1, 0);

/// Guarded listeners and their policies, renewed by the daemon.
#[map]
pub static LISTENERS: HashMap<ListenerKey, ListenerEntry> =
    HashMap::with_max_entries(4096, BPF_F_NO_PREALLOC);

/// SYNs answered with RST past a guard's queue limits, and SYNs observe mode would have
/// answered, per guard and deciding listener socket.
#[map]
pub static RST_SHED: HashMap<RstKey, u64> = HashMap::with_max_entries(4096, BPF_F_NO_PREALLOC);
#[map]
pub static WOULD_RST: HashMap<RstKey, u64> = HashMap::with_max_entries(4096, BPF_F_NO_PREALLOC);

/// Guards' ids by name (an IdKey of kind 0), kept with the per-caller counts they key.
/// Written and read by the daemon only.
#[map]
pub static LISTENER_IDS: HashMap<IdKey, u32> = HashMap::with_max_entries(4096, BPF_F_NO_PREALLOC);

/// Element 0: how many LISTENERS entries set per-caller budgets; while 0, the state
/// tracepoint counts no caller.
#[map]
pub static CALLER_GUARDS: Array<u32> = Array::with_max_entries(1, 0);

/// Callers' completed connections (guard_common::callers), made at a handshake's
/// completion only.
#[map]
pub static CALLERS: HashMap<CallerKey, CallerCount> =
    HashMap::with_max_entries(MAX_CALLERS, BPF_F_NO_PREALLOC);

/// Callers' token buckets, handshakes in flight and refusals, made at their first SYN;
/// the least recently used goes when it is full.
#[map]
pub static SOURCES: LruHashMap<CallerKey, SourceState> =
    LruHashMap::with_max_entries(MAX_SOURCES, 0);

/// Per guard: its per-caller refusals.
#[map]
pub static PER_SOURCE_TOTALS: HashMap<u32, PerSourceTotals> =
    HashMap::with_max_entries(4096, BPF_F_NO_PREALLOC);

/// On a server socket, the caller's count it holds.
#[btf_map]
pub static CALLER_SOCKS: SkStorage<CallerHold> = SkStorage::new();

/// Per-socket state, in the socket itself: no size limit and nothing to clean up.
#[btf_map]
pub static SOCKS: SkStorage<SockState> = SkStorage::new();

/// Internal counters (see guard_common::STAT_*), summed over CPUs by the daemon.
/// Drills, by scope id (guard_common::drill).
#[map]
pub static DRILL_ON: Array<u32> = Array::with_max_entries(MAX_SCOPE_IDS, 0);

#[map]
pub static DRILLS: HashMap<u32, DrillConf> =
    HashMap::with_max_entries(MAX_SCOPE_IDS, BPF_F_NO_PREALLOC);

#[map]
pub static DRILL_LEASE: Array<u64> = Array::with_max_entries(1, 0);

#[map]
pub static DRILL_COUNTS: Array<DrillCounts> = Array::with_max_entries(MAX_SCOPE_IDS, 0);

#[btf_map]
pub static DRILL_SOCKS: SkStorage<DrillMark> = SkStorage::new();

#[map]
pub static STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(STAT_COUNT, 0);

/// The ids the daemon gave scope and rule names, which key SCOPE_COUNTERS,
/// RULE_COUNTERS and the rest: pinned with them, so that a daemon started again keeps
/// each name's counts. Written and read by the daemon only.
#[map]
pub static IDS: HashMap<IdKey, u32> =
    HashMap::with_max_entries(MAX_SCOPE_IDS + MAX_RULE_IDS, BPF_F_NO_PREALLOC);

/// Element 0: until when (bpf_ktime_get_ns, CLOCK_MONOTONIC ns) the daemon holds its
/// lease, renewed every second. Past it, nothing is shed (fail-open): the daemon is
/// gone or stuck, and the programs it left attached only count. Element 1: 1 once the
/// connections that existed before this state was created were seeded into it.
#[map]
pub static LEASE: Array<u64> = Array::with_max_entries(2, 0);

/// Element 0: the key of the seeding under way (guard_common::SeedRequest), 0 when none.
#[map]
pub static SEED_KEY: Array<u64> = Array::with_max_entries(1, 0);

/// The circuit breakers, per destination (the key of its COUNTERS entry), created at
/// the first attempt a breaker governs.
#[map]
pub static BREAKERS: HashMap<CounterKey, Breaker> =
    HashMap::with_max_entries(65536, BPF_F_NO_PREALLOC);

/// What changed and why (guard_common::Event), for `connguard events`.
#[map]
pub static EVENTS: RingBuf = RingBuf::with_byte_size(256 * 1024, 0);

/// Whether the daemon's lease holds (see `LEASE`).
#[inline(always)]
pub fn lease_held() -> bool {
    lease_held_at(unsafe { aya_ebpf::helpers::generated::bpf_ktime_get_ns() })
}

/// Whether the lease holds at `now` (bpf_ktime_get_ns).
#[inline(always)]
pub fn lease_held_at(now: u64) -> bool {
    now < LEASE.get(0).copied().unwrap_or(0)
}

/// The storage of a full socket, created zeroed when `create` is set and the socket has
/// none. Null when absent (or when creation failed). (The kernel zeroes new storage when
/// given no initial value; an initial value built on the stack costs a byte-by-byte
/// memset loop.)
#[inline(always)]
pub fn storage(sk: *mut bpf_sock, create: bool) -> *mut SockState {
    sk_storage_of(&raw const SOCKS, sk, create)
}

/// The caller's count a server socket holds (`CALLER_SOCKS`), as `storage` finds a
/// socket's state.
#[inline(always)]
pub fn caller_hold(sk: *mut bpf_sock, create: bool) -> *mut CallerHold {
    sk_storage_of(&raw const CALLER_SOCKS, sk, create)
}

/// The socket's value in the socket storage map `map`, created zeroed with `create`;
/// null when there is none (or it could not be made).
#[inline(always)]
pub fn sk_storage_of<T>(map: *const SkStorage<T>, sk: *mut bpf_sock, create: bool) -> *mut T {
    let map: *const c_void = map.cast();
    let flags = if create {
        BPF_SK_STORAGE_GET_F_CREATE as u64
    } else {
        0
    };
    unsafe { bpf_sk_storage_get(map.cast_mut(), sk.cast(), core::ptr::null_mut(), flags) }.cast()
}
