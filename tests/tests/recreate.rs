//! A selected cgroup created again is governed on its creation event. Alone in its test
//! binary: the race it checks (the daemon's attach against a service's first connect)
//! is the daemon's to win on a host at rest, not against tests running beside it.
use std::time::Duration;

use connguard_tests::{
    BPF_CGROUP_INET_SOCK_RELEASE, Cgroup, Daemon, Server, budget_policy, n, wait_attached,
};

/// A selected cgroup removed and created again, 100 times, as systemd does on a service
/// restart (a new cgroup, with a new id, and the service's first process moved in at
/// once): each time, that process's first connect is governed. The daemon attaches on
/// the inotify creation event, with no walk of the tree.
#[test]
fn a_selected_cgroup_created_again_is_governed_from_its_first_connect() {
    let server = Server::start("127.0.0.1:0");
    let parent = Cgroup::new("r-parent");
    // The budget is held by a connection from a sibling the same scope selects, so
    // every governed connect from the recreated cgroup is shed.
    let selected = format!("{}/{{svc,hold}}", parent.rel);
    let policy = budget_policy("r", &selected, "enforce", &server.addr, 1);
    let d = Daemon::start(&policy);
    let hold = parent.child("hold");
    wait_attached(&hold, BPF_CGROUP_INET_SOCK_RELEASE);
    let _held = hold.hold(&server.addr, 1, 1);
    assert_eq!(n(&d.scope("r"), "active"), 1);
    for i in 0..100 {
        let svc = parent.child("svc");
        let out = svc.probe(&["connect", &server.addr.to_string(), "1", "1"]);
        assert_eq!(
            (out.ok, out.errors("ECONNREFUSED")),
            (0, 1),
            "recreation {i}: the first connect was not governed: {out:?}"
        );
        // The service runs until every program is attached, then stops.
        wait_attached(&svc, BPF_CGROUP_INET_SOCK_RELEASE);
        drop(svc);
    }
    let s = d.wait_scope("r", Duration::from_secs(5), |s| n(s, "shed") == 100);
    assert_eq!((n(&s, "active"), n(&s, "shed")), (1, 100), "{s}");
}
