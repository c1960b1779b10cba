//! Attacks on etcd elections and semaphores (breakslots).

use std::time::Duration;

use lockkit::etcd::EtcdLock;

use super::slots::EtcdSlotHarness;
use crate::common::fresh_prefix;
use crate::common::slot_stress;

fn harness() -> EtcdSlotHarness {
    EtcdSlotHarness::from_env("LOCKKIT_ETCD_URL")
}

/// [`slot_stress::permits_hold_under_cancels_and_lapses`] on etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_hold_under_cancels_and_lapses() {
    slot_stress::permits_hold_under_cancels_and_lapses(&harness(), "etcd").await;
}

/// [`slot_stress::one_leader_under_cancels_and_lapses`] on etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_leader_under_cancels_and_lapses() {
    slot_stress::one_leader_under_cancels_and_lapses(&harness(), "etcd").await;
}

/// [`slot_stress::permits_of_two_ns_never_mix`] on etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_of_two_ns_never_mix() {
    slot_stress::permits_of_two_ns_never_mix(&harness(), "etcd").await;
}

/// A single-member etcd killed (SIGKILL) and restarted on its data while a leader leads, a
/// candidate waits and an observer watches: the leader's resign hands over to the waiting
/// candidate with a higher term, a third term is higher still, and the observer (which
/// reconnects at the next revision) reports every term in order, without `Missed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terms_and_observers_survive_an_etcd_restart() {
    use super::support::{fresh_data_dir, start_single};
    use crate::common::free_port;
    use lockkit::{AcquireOptions, Election, LeaderEvent, LeaderInfo, Wait};
    let data = fresh_data_dir();
    let (cp, pp) = (free_port(), free_port());
    let mut member = start_single(data.path(), cp, pp).await;
    let url = format!("etcd://{}?prefix={}", member.endpoint(), fresh_prefix());
    let (a, b, c, w) = (
        EtcdLock::connect(&url).await.expect("connect"),
        EtcdLock::connect(&url).await.expect("connect"),
        EtcdLock::connect(&url).await.expect("connect"),
        EtcdLock::connect(&url).await.expect("connect"),
    );
    let name = format!("restart-{:08x}", rand::random::<u32>());
    let ttl = Duration::from_secs(10);
    let la = a
        .campaign(&name, b"a", AcquireOptions::new().ttl(ttl).wait(Wait::No))
        .await
        .expect("campaign a");
    let mut obs = w.observe(&name).await.expect("observe");
    assert_eq!(
        obs.next().await.expect("first"),
        LeaderEvent::Leader(LeaderInfo::new(la.term(), b"a".to_vec()))
    );
    let nb = name.clone();
    let waiter = tokio::spawn(async move {
        b.campaign(
            &nb,
            b"b",
            AcquireOptions::new()
                .ttl(ttl)
                .wait(Wait::Timeout(Duration::from_secs(60))),
        )
        .await
    });
    // The candidate is queued (its key is under the election's prefix) before the kill.
    let mut kv = a.client().kv_client();
    let prefix = format!("{}/./elect/{name}/", a.config().get_prefix());
    loop {
        let n = kv
            .get(
                prefix.clone(),
                Some(
                    lockkit::etcd::etcd_client::GetOptions::new()
                        .with_prefix()
                        .with_count_only(),
                ),
            )
            .await
            .expect("count")
            .count();
        if n >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    member.proc.kill();
    drop(member);
    let _member = start_single(data.path(), cp, pp).await;
    let t1 = la.term();
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
        .campaign(&name, b"c", AcquireOptions::new().ttl(ttl).wait(Wait::No))
        .await
        .expect("campaign c");
    assert!(lc.term() > t2);
    let mut seen = Vec::new();
    loop {
        let e = tokio::time::timeout(Duration::from_secs(20), obs.next())
            .await
            .expect("the observer did not report the third term")
            .expect("observer");
        seen.push(e.clone());
        if e == LeaderEvent::Leader(LeaderInfo::new(lc.term(), b"c".to_vec())) {
            break;
        }
    }
    assert_eq!(
        seen,
        vec![
            LeaderEvent::Leader(LeaderInfo::new(t2, b"b".to_vec())),
            LeaderEvent::NoLeader,
            LeaderEvent::Leader(LeaderInfo::new(lc.term(), b"c".to_vec())),
        ]
    );
    lc.resign().await.expect("resign c");
}

/// A permit holder whose network is cut (proxy frozen) loses its slot to a waiter only after
/// its own state left `Held`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_permit_holder_is_not_held_when_reclaimed() {
    crate::common::slot_stress::cut_off_through_a_proxy(
        "LOCKKIT_ETCD_URL",
        "etcd",
        |url| async move { EtcdLock::connect(&url).await.expect("connect") },
    )
    .await;
}
