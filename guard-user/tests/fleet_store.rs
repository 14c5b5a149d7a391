//! The fleet-sharing core against a real etcd: virtual hosts (the sync loop, many in one
//! process, without a kernel) with demands the tests set. Lease TTL 3 s, refresh 500 ms.
use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use connguard::fleet::{
    Fleet, FleetConfig, FleetError,
    sim::{self, Ledger, VirtualHost},
};
use connguard_tests::{etcd::Etcd, unique};

/// The fleet settings of the tests: a short lease and refresh keep them fast.
const TEST_TTL: Duration = Duration::from_secs(3);
const TEST_REFRESH: Duration = Duration::from_millis(500);

/// A configuration of one budget on `etcd`, with the tests' lease and refresh.
fn fleet_config(
    etcd: &Etcd,
    prefix: &str,
    identity: &str,
    budget: &str,
    total: u64,
) -> FleetConfig {
    let mut config = sim::config(&etcd.endpoint(), prefix, identity, budget, total);
    config.ttl = TEST_TTL;
    config.refresh = TEST_REFRESH;
    config
}

const BUDGET: &str = "orders-db";
const TOTAL: u64 = 60;
const SYNC: Duration = Duration::from_secs(10);

struct Fleet3 {
    etcd: Etcd,
    prefix: String,
    ledger: Arc<Ledger>,
    hosts: Vec<VirtualHost>,
}

impl Fleet3 {
    /// `wants.len()` hosts on a fresh etcd, synced.
    async fn start(wants: &[u64]) -> Fleet3 {
        let etcd = Etcd::start();
        let prefix = format!("/{}/", unique("fleet"));
        let ledger = Arc::new(Ledger::default());
        let mut f = Fleet3 {
            etcd,
            prefix,
            ledger,
            hosts: Vec::new(),
        };
        for &w in wants {
            f.add(w).await;
        }
        f
    }

    async fn add(&mut self, want: u64) {
        let identity = format!("host-{}", self.hosts.len());
        let config = fleet_config(&self.etcd, &self.prefix, &identity, BUDGET, TOTAL);
        let host = VirtualHost::start(config, want, &self.ledger);
        host.fleet.synced(SYNC).await.expect("a virtual host syncs");
        self.hosts.push(host);
    }

    fn shares(&self) -> Vec<Option<u64>> {
        self.hosts.iter().map(VirtualHost::share).collect()
    }

    async fn converge(&self, want: &[Option<u64>], within: Duration) -> Duration {
        converge(&self.hosts.iter().collect::<Vec<_>>(), want, within).await
    }

    fn assert_never_above_total(&self) {
        assert!(
            self.ledger.max_sum() <= TOTAL,
            "the shares standing at once added up to {} > {TOTAL}",
            self.ledger.max_sum()
        );
    }
}

fn some(shares: &[u64]) -> Vec<Option<u64>> {
    shares.iter().copied().map(Some).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hosts_split_equally_then_an_idle_one_releases_its_share() {
    let f = Fleet3::start(&[50, 50, 50]).await;
    let took = f.converge(&some(&[20, 20, 20]), TEST_REFRESH * 3).await;
    eprintln!("20/20/20 after {took:?}");
    // The records as etcd holds them: three hosts under their lease, and the raise key.
    let keys = f
        .etcd
        .etcdctl(&["get", "--prefix", "--keys-only", &f.prefix]);
    let keys: Vec<&str> = keys.lines().filter(|l| !l.is_empty()).collect();
    let p = &f.prefix;
    assert_eq!(
        keys,
        [
            format!("{p}{BUDGET}/hosts/host-0"),
            format!("{p}{BUDGET}/hosts/host-1"),
            format!("{p}{BUDGET}/hosts/host-2"),
            format!("{p}{BUDGET}/raise"),
        ]
    );
    let status = f.hosts[0].fleet.status();
    assert_eq!(
        (status.budgets[0].total, status.budgets[0].hosts),
        (TOTAL, 3)
    );

    f.hosts[1].local.set_want(0);
    let took = f.converge(&some(&[30, 0, 30]), TEST_REFRESH * 3).await;
    eprintln!("30/0/30 after {took:?}");
    f.assert_never_above_total();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_host_at_full_load_gets_its_share_as_the_others_lower() {
    let mut f = Fleet3::start(&[50, 50]).await;
    f.converge(&some(&[30, 30]), TEST_REFRESH * 3).await;
    let joined = Instant::now();
    f.add(50).await;
    assert_eq!(f.hosts[2].share(), Some(0), "a new host starts at 0");
    f.converge(&some(&[20, 20, 20]), TEST_REFRESH * 4).await;
    eprintln!(
        "20/20/20 {:?} after the third host joined",
        joined.elapsed()
    );
    f.assert_never_above_total();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_hosts_share_returns_to_the_others_within_ttl_and_a_refresh() {
    let mut f = Fleet3::start(&[50, 50, 50]).await;
    f.converge(&some(&[20, 20, 20]), TEST_REFRESH * 3).await;
    // As a SIGKILL: no cleanup, its lease left to expire.
    let dead = f.hosts.remove(2);
    drop(dead);
    let died = Instant::now();
    // Its claim stands while its lease may live.
    tokio::time::sleep(TEST_TTL / 2).await;
    assert_eq!(f.shares(), some(&[20, 20]));
    // etcd checks lease expiry every 500 ms: that is the slack.
    let took = f
        .converge(
            &some(&[30, 30]),
            TEST_TTL + TEST_REFRESH + Duration::from_millis(500) - TEST_TTL / 2,
        )
        .await;
    eprintln!("30/30 {:?} after the host died", died.elapsed());
    assert!(took > Duration::ZERO);
    f.assert_never_above_total();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_that_leaves_releases_its_share_at_once() {
    let mut f = Fleet3::start(&[50, 50, 50]).await;
    f.converge(&some(&[20, 20, 20]), TEST_REFRESH * 3).await;
    let leaving = f.hosts.remove(2);
    let local = leaving.local.clone();
    leaving.fleet.leave().await.expect("leaving");
    assert_eq!(f.ledger.sum_now(), 40, "the leaving host's kernel is at 0");
    drop(local);
    let took = f.converge(&some(&[30, 30]), TEST_REFRESH * 2).await;
    eprintln!("30/30 {took:?} after the host left");
    f.assert_never_above_total();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_down_keeps_shares_for_the_lease_then_safe_shares_and_sharing_resumes() {
    let mut f = Fleet3::start(&[50, 50, 50]).await;
    f.converge(&some(&[20, 20, 20]), TEST_REFRESH * 3).await;
    let down = Instant::now();
    f.etcd.kill();
    // Shares kept while the lease may live...
    tokio::time::sleep(TEST_TTL / 2).await;
    assert_eq!(f.shares(), some(&[20, 20, 20]));
    // ...then the safe share (0), before the lease could have expired in etcd.
    let fell = f.converge(&some(&[0, 0, 0]), TEST_TTL).await + TEST_TTL / 2;
    assert!(
        fell < TEST_TTL,
        "fell to safe shares {fell:?} after etcd went down"
    );
    for h in &f.hosts {
        let s = h.fleet.status();
        assert!(s.budgets[0].safe, "{s:?}");
        assert!(s.store_errors > 0 && s.last_error.is_some(), "{s:?}");
        assert!(
            s.last_error.as_ref().unwrap().contains(&f.etcd.endpoint()),
            "{s:?}"
        );
    }
    tokio::time::sleep(TEST_TTL * 2).await;
    let up = Instant::now();
    f.etcd.restart();
    // etcd kept the leases: the records, and their claims, are still there.
    f.converge(&some(&[20, 20, 20]), TEST_TTL).await;
    eprintln!("20/20/20 {:?} after etcd came back", up.elapsed());
    for h in &f.hosts {
        assert!(
            h.local.raises().iter().all(|r| r.at < down || r.at >= up),
            "a share rose while etcd was down: {:?}",
            h.local.raises()
        );
    }
    // A compacted history changes nothing: sessions list, then watch from the listing.
    f.etcd.compact();
    f.hosts[0].local.set_want(0);
    f.converge(&some(&[0, 30, 30]), TEST_REFRESH * 3).await;
    f.assert_never_above_total();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_host_adopts_its_record_and_a_second_live_host_with_its_identity_is_refused() {
    let f = Fleet3::start(&[50, 50]).await;
    f.converge(&some(&[30, 30]), TEST_REFRESH * 3).await;
    let lease_file = f.etcd.dir.join("host-x.lease");
    let mut config = fleet_config(&f.etcd, &f.prefix, "host-x", BUDGET, TOTAL);
    config.lease_file = Some(lease_file.clone());
    let first = VirtualHost::start(config.clone(), 50, &f.ledger);
    first.fleet.synced(SYNC).await.unwrap();
    let mut all = f.hosts.iter().collect::<Vec<_>>();
    all.push(&first);
    converge(&all, &some(&[20, 20, 20]), TEST_REFRESH * 4).await;
    let lease = first.fleet.status().lease;
    let local = first.local.clone();
    let raises = local.raises().len();
    // A daemon killed and restarted: the next one finds the lease in the file, adopts
    // its record and keeps the share its kernel holds (no fall to 0 and raise back).
    drop(first);
    let restarted = Fleet::start(config.clone(), local.clone()).unwrap();
    restarted
        .synced(SYNC)
        .await
        .expect("the restarted host adopts its record");
    tokio::time::sleep(TEST_REFRESH * 2).await;
    let status = restarted.status();
    assert_eq!(status.lease, lease);
    assert_eq!(
        (status.budgets[0].has, status.budgets[0].share),
        (20, Some(20)),
        "{status:?}"
    );
    assert_eq!(local.raises().len(), raises, "{:?}", local.raises());

    // Another live host with the same identity (no lease file): refused.
    config.lease_file = None;
    let twin = VirtualHost::start(config, 50, &f.ledger);
    match twin.fleet.synced(SYNC).await {
        Err(FleetError::IdentityTaken {
            identity, lease: l, ..
        }) => assert_eq!((identity.as_str(), Some(l)), ("host-x", lease)),
        other => panic!("the twin was not refused: {other:?}"),
    }
    let error = twin.fleet.status().last_error.unwrap();
    assert!(error.contains("held by another live host"), "{error}");
    assert_eq!(twin.share(), Some(0), "the twin holds nothing");
    f.assert_never_above_total();
}

/// Waits until the hosts' shares are `want` (None: that host's is not checked);
/// returns how long it took.
async fn converge(hosts: &[&VirtualHost], want: &[Option<u64>], within: Duration) -> Duration {
    let start = Instant::now();
    loop {
        let shares: Vec<_> = hosts.iter().map(|h| h.share()).collect();
        if shares.iter().zip(want).all(|(s, w)| w.is_none() || s == w) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < within,
            "shares {shares:?}, not {want:?}, after {within:?}; statuses: {:#?}",
            hosts.iter().map(|h| h.fleet.status()).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_endpoints_and_bad_credentials_are_clear_errors() {
    let ledger = Arc::new(Ledger::default());
    let mut etcd = Etcd::start();
    let prefix = format!("/{}/", unique("fleet"));

    let mut config = fleet_config(&etcd, &prefix, "h", BUDGET, TOTAL);
    config.store.endpoints = vec!["127.0.0.1:2379".into()];
    match Fleet::start(
        config.clone(),
        sim::VirtualLocal::new("h", 1, ledger.clone()),
    ) {
        Err(FleetError::Config(m)) => assert!(m.contains("not an http"), "{m}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("an endpoint without a scheme was accepted"),
    }

    let closed = format!("http://127.0.0.1:{}", connguard_tests::free_port());
    config.store.endpoints = vec![closed.clone()];
    let host = VirtualHost::start(config, 50, &ledger);
    match host.fleet.synced(SYNC).await {
        Err(e @ FleetError::Unreachable { .. }) => {
            assert!(e.to_string().contains(&closed), "{e}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(host.share(), Some(0));

    etcd.enable_auth("rootpw", "fleet", "right", &prefix);
    for (user, password) in [(Some("fleet"), "wrong"), (None, "")] {
        let mut config = fleet_config(&etcd, &prefix, "h", BUDGET, TOTAL);
        config.store.credentials = user.map(|u| connguard::fleet::Credentials {
            user: u.into(),
            password: password.into(),
        });
        let host = VirtualHost::start(config, 50, &ledger);
        match host.fleet.synced(SYNC).await {
            Err(e @ FleetError::Credentials { .. }) => {
                eprintln!("{e}");
                assert!(e.to_string().contains(user.unwrap_or("(none)")), "{e}");
            }
            other => panic!("{user:?}/{password}: {other:?}"),
        }
    }
    let mut config = fleet_config(&etcd, &prefix, "h", BUDGET, TOTAL);
    config.store.credentials = Some(connguard::fleet::Credentials {
        user: "fleet".into(),
        password: "right".into(),
    });
    let host = VirtualHost::start(config, 50, &ledger);
    host.fleet
        .synced(SYNC)
        .await
        .expect("the right password syncs");
    let start = Instant::now();
    while host.share() != Some(55) {
        assert!(
            start.elapsed() < TEST_REFRESH * 3,
            "{:?}",
            host.fleet.status()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
