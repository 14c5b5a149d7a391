//! (k) A real third-party client and server: wrk against nginx (Debian packages).
use connguard_api::policy::Mode;
use connguard_tests::{Cgroup, Daemon, Nginx, budget_policy, destination, wrk};

#[test]
fn wrk_with_300_connections_gets_50_and_the_rest_shed() {
    let nginx = Nginx::start();
    let cg = Cgroup::new("k");
    let d = Daemon::builder(budget_policy("k", &cg.rel, Mode::Enforce, &nginx.addr, 50)).start();
    let r = wrk(&cg, &nginx, 300, 3);
    let s = d.scope("k");
    let dst = destination(&s, &nginx.addr.to_string());
    assert!(
        r.server_peak <= 50,
        "nginx saw {} connections: {r:?}",
        r.server_peak
    );
    assert_eq!(dst.counts.peak, 50, "{s:?}");
    assert_eq!(
        r.connect_errors, dst.counts.shed,
        "wrk's connect errors are the sheds: {r:?} {s:?}"
    );
    // 300 connections, 50 admitted: at least 250 refused (wrk reconnects now and then,
    // and each reconnect past the budget is refused too, and counted by both).
    assert!(dst.counts.shed >= 250, "{s:?}");
    assert!(
        r.requests > 1000,
        "the 50 admitted connections carry traffic: {r:?}"
    );
    assert!(r.elapsed.as_secs_f64() < 10.0, "wrk hung: {r:?}");
}
