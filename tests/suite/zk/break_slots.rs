//! Attacks on ZooKeeper elections and semaphores (breakslots): many contending clients, a cut-off
//! permit holder, a server killed and restarted under leaders, waiters and an observer.

use std::sync::Arc;
use std::time::Duration;

use lockkit::zk::ZkLock;
use lockkit::{AcquireOptions, Election, LeaderEvent, LeaderInfo, LeaseState, Semaphore, Wait};

use super::server::PrivateZk;
use crate::common::slot_stress::{
    cut_off_through_a_proxy, election_stress, nothing_left, permit_stress,
    the_other_n_is_taken_once_idle,
};
use crate::common::{fresh_prefix, server_url, with_prefix};

fn url() -> String {
    with_prefix(&server_url("LOCKKIT_ZK_URL"), &fresh_prefix())
}

/// Twelve clients contend for a semaphore of 3 permits with waits, cancels (dropped after
/// 1–60 ms) and try-onces (no lapses: ZooKeeper has no `keepalive(false)`): never more than 3
/// permits Held at once, never one slot twice, every fenced write accepted; afterwards nothing
/// (no queue node of a cancelled waiter) is left blocking and the idle semaphore takes
/// another N.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_hold_under_cancels() {
    let url = url();
    let name = format!("stress-{:08x}", rand::random::<u32>());
    let mut clients: Vec<Arc<dyn Semaphore>> = Vec::new();
    for _ in 0..12 {
        clients.push(Arc::new(ZkLock::connect(&url).await.expect("connect")));
    }
    let report = permit_stress(clients, &name, &[3], 12, None).await;
    println!("zk stress: {report:?}");
    let fresh = ZkLock::connect(&url).await.expect("connect");
    let left = nothing_left(&fresh, &name, 3, Duration::from_secs(8)).await;
    assert!(
        report.violations.is_empty() && left.is_empty(),
        "{report:?} {left:?}"
    );
}

/// Ten candidates campaign with waits, cancels and try-onces: never two leaders Held at once,
/// every term's fenced write accepted; afterwards a fresh candidate leads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_leader_under_cancels() {
    let url = url();
    let name = format!("estress-{:08x}", rand::random::<u32>());
    let mut clients: Vec<Arc<dyn Election>> = Vec::new();
    for _ in 0..10 {
        clients.push(Arc::new(ZkLock::connect(&url).await.expect("connect")));
    }
    let report = election_stress(clients, &name, 10, None).await;
    println!("zk election stress: {report:?}");
    let fresh = ZkLock::connect(&url).await.expect("connect");
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

/// Five clients contend with N = 2 or N = 3 at random (plus cancels and try-onces): a permit is
/// never granted while one of the other N is Held, never more than N at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_of_two_ns_never_mix() {
    let url = url();
    let name = format!("mixed-{:08x}", rand::random::<u32>());
    let mut clients: Vec<Arc<dyn Semaphore>> = Vec::new();
    for _ in 0..5 {
        clients.push(Arc::new(ZkLock::connect(&url).await.expect("connect")));
    }
    let report = permit_stress(clients, &name, &[2, 3], 30, None).await;
    println!("zk mixed-N stress: {report:?}");
    assert!(report.violations.is_empty(), "{report:?}");
    let idle = ZkLock::connect(&url).await.expect("connect");
    the_other_n_is_taken_once_idle(&idle, &name, &report, &[2, 3]).await;
}

/// A permit holder whose connection is frozen (its session expires on the server) loses its
/// slot to a waiter only after its own state left `Held`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_permit_holder_is_not_held_when_reclaimed() {
    cut_off_through_a_proxy("LOCKKIT_ZK_URL", "zk", |url| async move {
        ZkLock::connect(&url).await.expect("connect")
    })
    .await;
}

/// The server killed (SIGKILL) and restarted on its data while a leader leads, a candidate
/// waits, an observer watches and a permit is held (session timeout 20 s, so the sessions
/// outlive the restart): the leader and the permit are still Held (the sessions and their
/// ephemeral nodes came back), the resign hands over to the waiting candidate with a higher
/// term, a third term is higher still, and the observer never reports a term going back and
/// reaches the third term (with `Missed` allowed: it does not claim to see every change).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terms_permits_and_observers_survive_a_restart() {
    let mut server = PrivateZk::start("").await;
    let url = format!("{}?prefix={}", server.url(), fresh_prefix());
    let (a, b, c, w) = (
        ZkLock::connect(&url).await.expect("connect"),
        ZkLock::connect(&url).await.expect("connect"),
        ZkLock::connect(&url).await.expect("connect"),
        ZkLock::connect(&url).await.expect("connect"),
    );
    let name = "restart";
    let ttl = Duration::from_secs(20);
    let la = a
        .campaign(name, b"a", AcquireOptions::new().ttl(ttl).wait(Wait::No))
        .await
        .expect("campaign a");
    let permit = c
        .acquire_permit(name, 1, AcquireOptions::new().ttl(ttl).wait(Wait::No))
        .await
        .expect("permit");
    let mut obs = w.observe(name).await.expect("observe");
    assert_eq!(
        obs.next().await.expect("first"),
        LeaderEvent::Leader(LeaderInfo::new(la.term(), b"a".to_vec()))
    );
    let bb = b.clone();
    let waiter = tokio::spawn(async move {
        bb.campaign(
            name,
            b"b",
            AcquireOptions::new()
                .ttl(ttl)
                .wait(Wait::Timeout(Duration::from_secs(60))),
        )
        .await
    });
    // The candidate is in line before the kill.
    let start = tokio::time::Instant::now();
    while b.candidates(name).await.expect("candidates").len() < 2 {
        assert!(start.elapsed() < Duration::from_secs(10), "never queued");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.kill_and_restart().await;
    let t1 = la.term();
    // Held through the restart (the sessions resumed): wait for them to be Held again.
    let start = tokio::time::Instant::now();
    while la.state() != LeaseState::Held || permit.state() != LeaseState::Held {
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "after the restart: leader {:?}, permit {:?}",
            la.state(),
            permit.state()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        !waiter.is_finished(),
        "a second leader while the first is Held"
    );
    la.resign().await.expect("resign after the restart");
    let lb = tokio::time::timeout(Duration::from_secs(30), waiter)
        .await
        .expect("the waiting candidate was not elected after the restart")
        .expect("task")
        .expect("campaign b");
    assert!(lb.term() > t1, "{:?} after {t1:?}", lb.term());
    let t2 = lb.term();
    lb.resign().await.expect("resign b");
    let lc = c
        .campaign(name, b"c", AcquireOptions::new().ttl(ttl).wait(Wait::No))
        .await
        .expect("campaign c");
    assert!(lc.term() > t2);
    let mut seen = Vec::new();
    let mut last = t1.clone();
    loop {
        let e = tokio::time::timeout(Duration::from_secs(20), obs.next())
            .await
            .unwrap_or_else(|_| panic!("the observer did not report the third term: {seen:?}"))
            .expect("observer");
        seen.push(e.clone());
        if let LeaderEvent::Leader(l) = &e {
            assert!(l.term >= last, "term went back: {seen:?}");
            last = l.term.clone();
            if l.term == lc.term() {
                break;
            }
        }
    }
    println!("observer after the restart: {seen:?}");
    lc.resign().await.expect("resign c");
    permit.release().await.expect("release the permit");
}
