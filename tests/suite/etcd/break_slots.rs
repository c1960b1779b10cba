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
    let report = permit_stress(clients, &name, &[3], 12, Some(Duration::from_secs(2))).await;
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
    let report = election_stress(clients, &name, 10, Some(Duration::from_secs(2))).await;
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
    let report = permit_stress(clients, &name, &[2, 3], 30, Some(Duration::from_secs(2))).await;
    println!("etcd mixed-N stress: {report:?}");
    assert!(report.violations.is_empty(), "{report:?}");
    assert!(report.switches > 0, "N never changed: {report:?}");
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
    use crate::common::proxy::Proxy;
    use crate::common::slot_stress::cut_off_holder_is_not_held_when_reclaimed;
    let prefix = fresh_prefix();
    let direct = server_url("LOCKKIT_ETCD_URL");
    let hostport = direct.trim_start_matches("etcd://").to_owned();
    let proxy = Proxy::start(hostport.clone()).await;
    let via = with_prefix(&format!("etcd://{}", proxy.endpoint()), &prefix);
    let a = EtcdLock::connect(&via).await.expect("connect via proxy");
    let b = EtcdLock::connect(&with_prefix(&direct, &prefix))
        .await
        .expect("connect");
    let name = format!("cut-{:08x}", rand::random::<u32>());
    cut_off_holder_is_not_held_when_reclaimed(&a, Arc::new(b), &name, || proxy.freeze()).await;
}
