//! The maps shared by the programs; the daemon finds them by these names.
use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    macros::map,
    maps::{Array, HashMap, LpmTrie, PerCpuArray},
};
use guard_common::{
    Admission, Candidates, CgroupKey, Counter, CounterKey, RuleAddrKey, STAT_COUNT, ScopeConf,
};

/// Element 0: the policy generation (0 or 1) that the programs read.
#[map]
pub static ACTIVE_GEN: Array<u32> = Array::with_max_entries(1, 0);

/// (generation, cgroup id) -> scope; the daemon lists every cgroup of every scope.
#[map]
pub static SCOPES: HashMap<CgroupKey, ScopeConf> =
    HashMap::with_max_entries(65536, BPF_F_NO_PREALLOC);

/// (generation, scope, destination prefix) -> the rules that can match it.
#[map]
pub static RULES: LpmTrie<RuleAddrKey, Candidates> = LpmTrie::with_max_entries(65536, 0);

/// Connection counters at scope, rule and destination level.
#[map]
pub static COUNTERS: HashMap<CounterKey, Counter> =
    HashMap::with_max_entries(262144, BPF_F_NO_PREALLOC);

/// Socket cookie -> what its admission charged; removed on release. Preallocated, like
/// SOCK_CGROUP: inserts on the connect path then take a free element instead of
/// allocating (measured ~20% cheaper per connect than BPF_F_NO_PREALLOC).
#[map]
pub static ADMITTED: HashMap<u64, Admission> = HashMap::with_max_entries(131072, 0);

/// Socket cookie -> cgroup id the TCP socket was created in; removed on socket release.
#[map]
pub static SOCK_CGROUP: HashMap<u64, u64> = HashMap::with_max_entries(262144, 0);

/// Internal counters (see guard_common::STAT_*), summed over CPUs by the daemon.
#[map]
pub static STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(STAT_COUNT, 0);
