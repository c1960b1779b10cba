//! Attacks on etcd elections and semaphores (breakslots).

use std::sync::Arc;
use std::time::Duration;

use lockkit::Semaphore;
use lockkit::etcd::EtcdLock;

use crate::common::slot_stress::{nothing_left, permit_stress};
use crate::common::{fresh_prefix, server_url, with_prefix};

/// Twelve clients contend for a semaphore of 3 permits with waits, cancels (dropped after
/// 1–60 ms), try-onces and lapses (keepalive off, 2 s TTL): never more than 3 permits Held at
/// once, never one slot twice, every fenced write accepted; afterwards nothing is left blocking
/// and the idle semaphore takes another N.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_hold_under_cancels_and_lapses() {
    let url = with_prefix(&server_url("LOCKKIT_ETCD_URL"), &fresh_prefix());
    let name = format!("stress-{:08x}", rand::random::<u32>());
    let mut clients: Vec<Arc<dyn Semaphore>> = Vec::new();
    for _ in 0..12 {
        clients.push(Arc::new(EtcdLock::connect(&url).await.expect("connect")));
    }
    let report = permit_stress(clients, &name, &[3], 12, Duration::from_secs(2)).await;
    println!("etcd stress: {report:?}");
    let fresh = EtcdLock::connect(&url).await.expect("connect");
    let left = nothing_left(&fresh, &name, 3, Duration::from_secs(8)).await;
    assert!(
        report.violations.is_empty() && left.is_empty(),
        "{report:?} {left:?}"
    );
}

/// Ten candidates campaign with waits, cancels, try-onces and lapses (keepalive off, 2 s TTL):
/// never two leaders Held at once, every term's fenced write accepted, a lapsed leader's
/// proclaim refused; afterwards a fresh candidate leads at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_leader_under_cancels_and_lapses() {
    use crate::common::slot_stress::election_stress;
    use lockkit::{AcquireOptions, Election, Wait};
    let url = with_prefix(&server_url("LOCKKIT_ETCD_URL"), &fresh_prefix());
    let name = format!("estress-{:08x}", rand::random::<u32>());
    let mut clients: Vec<Arc<dyn Election>> = Vec::new();
    for _ in 0..10 {
        clients.push(Arc::new(EtcdLock::connect(&url).await.expect("connect")));
    }
    let report = election_stress(clients, &name, 10, Duration::from_secs(2)).await;
    println!("etcd election stress: {report:?}");
    let fresh = EtcdLock::connect(&url).await.expect("connect");
    let l = fresh
        .campaign(
            &name,
            b"last",
            AcquireOptions::new().wait(Wait::Timeout(Duration::from_secs(8))),
        )
        .await;
    assert!(report.violations.is_empty(), "{report:?}");
    l.expect("a fresh candidate after the run")
        .resign()
        .await
        .expect("resign");
}

/// Five clients contend with N = 2 or N = 3 at random (plus cancels and try-onces; no lapses, which would keep it busy):
/// a permit is never granted while a permit of the other N is Held, never more than N at once;
/// the losers get `PermitsMismatch`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_of_two_ns_never_mix() {
    let url = with_prefix(&server_url("LOCKKIT_ETCD_URL"), &fresh_prefix());
    let name = format!("mixed-{:08x}", rand::random::<u32>());
    let mut clients: Vec<Arc<dyn Semaphore>> = Vec::new();
    for _ in 0..5 {
        clients.push(Arc::new(EtcdLock::connect(&url).await.expect("connect")));
    }
    let report = permit_stress(clients, &name, &[2, 3], 30, Duration::from_secs(2)).await;
    println!("etcd mixed-N stress: {report:?}");
    assert!(report.violations.is_empty(), "{report:?}");
    assert!(report.switches > 0, "N never changed: {report:?}");
}
