//! Names of the eBPF object's maps and programs. The eBPF crate declares each with the
//! identifier spelled here (aya's macros take the name from the identifier); the daemon
//! looks them up by these constants, and a unit test of the daemon checks that the
//! object holds exactly these.

/// Maps, by the static that declares each in guard-ebpf's `maps` module.
pub mod map {
    pub const ACTIVE_GEN: &str = "ACTIVE_GEN";
    pub const SCOPES: &str = "SCOPES";
    pub const SCOPE_LEVELS: &str = "SCOPE_LEVELS";
    pub const CGROUP_ROOT: &str = "CGROUP_ROOT";
    pub const RULES: &str = "RULES";
    pub const COUNTERS: &str = "COUNTERS";
    pub const SCOPE_COUNTERS: &str = "SCOPE_COUNTERS";
    pub const RULE_COUNTERS: &str = "RULE_COUNTERS";
    pub const TIME_WAITS: &str = "TIME_WAITS";
    pub const EADDRNOTAVAIL: &str = "EADDRNOTAVAIL";
    pub const PORT_USE: &str = "PORT_USE";
    pub const LISTENERS: &str = "LISTENERS";
    pub const LISTENER_HEARTBEAT: &str = "LISTENER_HEARTBEAT";
    pub const RST_SHED: &str = "RST_SHED";
    pub const WOULD_RST: &str = "WOULD_RST";
    pub const SOCKS: &str = "SOCKS";
    pub const STATS: &str = "STATS";
    pub const IDS: &str = "IDS";
    pub const LEASE: &str = "LEASE";
    pub const SEED_KEY: &str = "SEED_KEY";
    pub const BREAKERS: &str = "BREAKERS";
    pub const EVENTS: &str = "EVENTS";
    pub const CALLERS: &str = "CALLERS";
    pub const SOURCES: &str = "SOURCES";
    pub const CALLER_SOCKS: &str = "CALLER_SOCKS";
    pub const PER_SOURCE_TOTALS: &str = "PER_SOURCE_TOTALS";
    pub const LISTENER_IDS: &str = "LISTENER_IDS";
    pub const CALLER_GUARDS: &str = "CALLER_GUARDS";
    pub const DRILL_ON: &str = "DRILL_ON";
    pub const DRILLS: &str = "DRILLS";
    pub const DRILL_LEASE: &str = "DRILL_LEASE";
    pub const DRILL_COUNTS: &str = "DRILL_COUNTS";
    pub const DRILL_SOCKS: &str = "DRILL_SOCKS";
    /// The maps pinned in the state directory, which outlive the daemon: what the
    /// programs count, the sockets' own state, and the names the counts are kept by.
    /// The policy maps are not: a daemon writes its own, and programs of the daemon
    /// before it keep theirs until their links are moved to the new programs.
    pub const PINNED: &[&str] = &[
        COUNTERS,
        SCOPE_COUNTERS,
        RULE_COUNTERS,
        TIME_WAITS,
        EADDRNOTAVAIL,
        SOCKS,
        STATS,
        IDS,
        LEASE,
        BREAKERS,
        CALLERS,
        SOURCES,
        CALLER_SOCKS,
        PER_SOURCE_TOTALS,
        LISTENER_IDS,
    ];
    /// Every map of the object.
    pub const ALL: &[&str] = &[
        ACTIVE_GEN,
        SCOPES,
        SCOPE_LEVELS,
        CGROUP_ROOT,
        RULES,
        COUNTERS,
        SCOPE_COUNTERS,
        RULE_COUNTERS,
        TIME_WAITS,
        EADDRNOTAVAIL,
        PORT_USE,
        LISTENERS,
        LISTENER_HEARTBEAT,
        RST_SHED,
        WOULD_RST,
        SOCKS,
        STATS,
        IDS,
        LEASE,
        SEED_KEY,
        BREAKERS,
        EVENTS,
        CALLERS,
        SOURCES,
        CALLER_SOCKS,
        PER_SOURCE_TOTALS,
        LISTENER_IDS,
        CALLER_GUARDS,
        DRILL_ON,
        DRILLS,
        DRILL_LEASE,
        DRILL_COUNTS,
        DRILL_SOCKS,
    ];
}

/// Programs, by the function that defines each in guard-ebpf.
pub mod program {
    /// cgroup sock_addr connect4 / connect6: admit or shed.
    pub const CONNECT4: &str = "connect4";
    pub const CONNECT6: &str = "connect6";
    /// cgroup sock_create / sock_release.
    pub const SOCK_CREATE: &str = "sock_create";
    pub const SOCK_RELEASE: &str = "sock_release";
    /// sock_ops: arms and takes the state callbacks that release admissions.
    pub const SOCK_STATE: &str = "sock_state";
    /// tp_btf on [`SOCK_SET_STATE_TRACEPOINT`]: releases admissions, counts
    /// EADDRNOTAVAIL, counts and releases listener guards' callers.
    pub const SOCK_SET_STATE: &str = "sock_set_state";
    pub const SOCK_SET_STATE_TRACEPOINT: &str = "inet_sock_set_state";
    /// tp_btf on [`CALLER_DESTROY_TRACEPOINT`]: releases a caller's count held by a
    /// socket that reached its destruction unreleased.
    pub const CALLER_DESTROY: &str = "caller_destroy";
    pub const CALLER_DESTROY_TRACEPOINT: &str = "tcp_destroy_sock";
    /// tc ingress of listener guards, deciding per SYN from the listener's queues.
    pub const LISTENER_SHED: &str = "listener_shed";
    /// The same, deciding from the daemon's reading (where the kernel refuses the first).
    pub const LISTENER_SHED_POLLED: &str = "listener_shed_polled";
    /// cgroup setsockopt: counts a connection that existed before the first start.
    pub const SEED: &str = "seed";
    /// cgroup setsockopt: the daemon's probe at start (crate::PROBE_STATE_CB).
    pub const STATE_CB_PROBE: &str = "state_cb_probe";
    /// cgroup_skb egress, attached while a blackhole or delay drill runs: drops the
    /// packets of the sockets given those faults.
    pub const DRILL_EGRESS: &str = "drill_egress";
    /// tc, never attached: run by BPF_PROG_TEST_RUN to apply an audit's correction.
    pub const ADJUST: &str = "adjust";
    /// Every program of the object.
    pub const ALL: &[&str] = &[
        CONNECT4,
        CONNECT6,
        SOCK_CREATE,
        SOCK_RELEASE,
        SOCK_STATE,
        SOCK_SET_STATE,
        CALLER_DESTROY,
        LISTENER_SHED,
        LISTENER_SHED_POLLED,
        SEED,
        STATE_CB_PROBE,
        DRILL_EGRESS,
        ADJUST,
    ];
}
