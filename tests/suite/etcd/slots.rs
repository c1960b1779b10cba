//! Elections and semaphores on etcd: the contract suite (`election_suite!`) against the shared
//! etcd (`LOCKKIT_ETCD_URL`), and what only etcd can do to a holder or an observer (an admin's
//! lease revoke, a compaction while an observer is cut off).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use lockkit::backend::LeaseBackendExt;
use lockkit::contract_election::SlotHarness;
use lockkit::etcd::{EtcdLease, EtcdLock};
use lockkit::{
    AcquireOptions, Election, LeaderEvent, LeaderInfo, LeaseState, Semaphore, Wait, async_trait,
};
use tokio::time::Instant;

use super::support::{fresh_data_dir, start_single};
use crate::common::proxy::{Direction, Framing, Proxy};
use crate::common::{ConnectUrl, SlotClients, free_port, fresh_prefix, server_url, with_prefix};

/// The slot harness: a new `EtcdLock` (its own connections) per client, all under one fresh
/// prefix.
pub type EtcdSlotHarness = SlotClients<EtcdLock>;

#[async_trait]
impl ConnectUrl for EtcdLock {
    async fn connect_url(url: &str) -> lockkit::Result<Self> {
        EtcdLock::connect(url).await
    }
}

mod contract {
    lockkit::election_suite!(super::EtcdSlotHarness::from_env("LOCKKIT_ETCD_URL"));
}

fn unique(what: &str) -> String {
    format!("{what}-{:08x}", rand::random::<u32>())
}

fn waiting(secs: u64) -> AcquireOptions {
    AcquireOptions::new()
        .ttl(Duration::from_secs(10))
        .wait(Wait::Timeout(Duration::from_secs(secs)))
}

/// What [`observer_cut_at_a_grant`] set up.
struct CutObserver {
    /// The observer's proxy: it refuses reconnects until `accept_again`.
    proxy: Proxy,
    /// Two direct clients; `la` is A's term.
    a: EtcdLock,
    b: EtcdLock,
    la: lockkit::Leadership,
    /// The observer's events after its first `NoLeader`, up to a leader of value `until`.
    pending: tokio::task::JoinHandle<Vec<LeaderEvent>>,
}

/// An observer of election `name` whose traffic goes through a proxy to `endpoint` (the
/// `host:port` in `url`, which the direct clients A and B use): it sees `NoLeader` first, then
/// collects its events in a task until a leader of value `until`. A campaigns, and the reply to
/// the observer that tells of it is dropped with its connection (every reconnect refused until
/// `proxy.accept_again()`).
async fn observer_cut_at_a_grant(
    url: &str,
    endpoint: &str,
    name: &str,
    until: &'static [u8],
) -> CutObserver {
    // The observer's traffic goes through a proxy that can cut its connection at its next
    // reply once armed, and then refuse reconnects until told otherwise.
    let armed = Arc::new(AtomicBool::new(false));
    let spot = armed.clone();
    let proxy = Proxy::start_with_spotter(endpoint.to_owned(), Framing::Chunks, move || {
        let spot = spot.clone();
        Box::new(move |dir, _| dir == Direction::ToClient && spot.load(Ordering::SeqCst))
    })
    .await;
    let watcher = EtcdLock::connect(&url.replacen(endpoint, &proxy.endpoint(), 1))
        .await
        .expect("connect via proxy");
    let (a, b) = (
        EtcdLock::connect(url).await.expect("connect"),
        EtcdLock::connect(url).await.expect("connect"),
    );
    let mut observer = watcher.observe(name).await.expect("observe");
    assert_eq!(observer.next().await.unwrap(), LeaderEvent::NoLeader);
    let pending = tokio::spawn(async move {
        let mut got = Vec::new();
        loop {
            let e = observer.next().await.expect("observer");
            got.push(e.clone());
            if matches!(e, LeaderEvent::Leader(ref l) if l.value == until) {
                return got;
            }
        }
    });
    // The next reply to the observer (A's grant event) is dropped with its connection, and
    // every reconnect is refused.
    armed.store(true, Ordering::SeqCst);
    proxy.cut_at_next_spotted(true);
    let la = a.campaign(name, b"a", once()).await.expect("campaign a");
    tokio::time::timeout(Duration::from_secs(10), proxy.wait_cuts(1))
        .await
        .expect("the observer's connection was not cut");
    CutObserver {
        proxy,
        a,
        b,
        la,
        pending,
    }
}

fn once() -> AcquireOptions {
    AcquireOptions::new()
        .ttl(Duration::from_secs(10))
        .wait(Wait::No)
}

/// An admin revokes the leader's etcd lease (`etcdctl lease revoke`): etcd deletes its
/// candidate key, the leader turns Lost within the loss-notice bound (the key watch tells
/// it), the candidate in line leads with a higher term, and an observer sees the hand-over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_leader_is_lost_and_the_next_candidate_leads() {
    let h = EtcdSlotHarness::from_env("LOCKKIT_ETCD_URL");
    let (a, b, watcher, admin) = (
        h.client().await,
        h.client().await,
        h.client().await,
        h.client().await,
    );
    let name = unique("revoked-leader");
    // A long TTL: only the revoke can end the leadership within the test.
    let ttl = Duration::from_secs(30);
    let la = a
        .campaign(&name, b"a", AcquireOptions::new().ttl(ttl).wait(Wait::No))
        .await
        .expect("campaign");
    let mut observer = watcher.observe(&name).await.expect("observe");
    assert_eq!(
        observer.next().await.expect("first event"),
        LeaderEvent::Leader(LeaderInfo::new(la.term(), b"a".to_vec()))
    );
    let next = tokio::spawn(async move { b.campaign(&name, b"b", waiting(30)).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!next.is_finished(), "a candidate won while A led");
    let lease_id = la
        .lease()
        .ops()
        .as_any()
        .downcast_ref::<EtcdLease>()
        .expect("an etcd lease")
        .lease_id();
    let notice = a
        .election_guarantees()
        .lock
        .loss_notice
        .expect("a loss-notice bound");
    let lost = la.lost();
    let revoked = Instant::now();
    admin
        .client()
        .lease_client()
        .revoke(lease_id)
        .await
        .expect("lease revoke");
    tokio::time::timeout(notice, lost)
        .await
        .unwrap_or_else(|_| panic!("the revoked leader was not Lost within {notice:?}"));
    let lost_after = revoked.elapsed();
    assert_eq!(la.state(), LeaseState::Lost);
    let lb = tokio::time::timeout(h.tolerance(), next)
        .await
        .expect("the next candidate did not lead after the revoke")
        .expect("candidate task")
        .expect("campaign");
    let led_after = revoked.elapsed();
    assert!(lb.term() > la.term());
    let seen = tokio::time::timeout(h.tolerance(), observer.next())
        .await
        .expect("the observer saw nothing after the revoke")
        .expect("observer");
    let seen_after = revoked.elapsed();
    assert_eq!(
        seen,
        LeaderEvent::Leader(LeaderInfo::new(lb.term(), b"b".to_vec())),
        "the observer's next event is the next leader (the revoke deleted A's key and made B's the lowest in one revision)"
    );
    eprintln!(
        "revoke → leader Lost {lost_after:?}, → next leader granted {led_after:?}, → observer {seen_after:?}"
    );
    lb.resign().await.expect("resign");
}

/// An observer cut off from etcd while leaders come and go, and etcd compacts its history past
/// the revision the observer resumes at: its watch is refused as compacted, and it reports
/// `Missed`, then the state now (the current leader), and goes on with later changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observer_resumes_after_compaction_with_missed() {
    // A private etcd: the compaction must not touch other tests' history.
    let data = fresh_data_dir();
    let member = start_single(data.path(), free_port(), free_port()).await;
    let prefix = fresh_prefix();
    let direct = format!("etcd://{}?prefix={prefix}", member.endpoint());
    let name = unique("compacted");
    let CutObserver {
        proxy,
        a,
        b,
        la,
        pending,
    } = observer_cut_at_a_grant(&direct, &member.endpoint(), &name, b"c").await;
    la.resign().await.expect("resign a");
    let lb = b.campaign(&name, b"b", once()).await.expect("campaign b");
    // Compact everything up to now: A's grant and resign are gone from etcd's history.
    let mut kv = a.client().kv_client();
    let rev = kv
        .get("compact-probe", None)
        .await
        .expect("read")
        .header()
        .expect("header")
        .revision();
    kv.compact(rev, None).await.expect("compact");
    proxy.accept_again();
    let seen = tokio::time::timeout(Duration::from_secs(20), async {
        // Then C after B: the observer goes on after the Missed.
        tokio::time::sleep(Duration::from_millis(200)).await;
        lb.resign().await.expect("resign b");
        let lc = a.campaign(&name, b"c", once()).await.expect("campaign c");
        (pending.await.expect("observer task"), lc)
    })
    .await;
    let (got, lc) = seen.expect("the observer did not resume after the compaction");
    assert_eq!(
        got.first(),
        Some(&LeaderEvent::Missed),
        "resuming at a compacted revision is a Missed first: {got:?}"
    );
    assert!(
        !got.iter()
            .any(|e| matches!(e, LeaderEvent::Leader(l) if l.value == b"a")),
        "A's term, granted and resigned while the observer was cut off, cannot be seen after the compaction: {got:?}"
    );
    assert_eq!(
        got.last(),
        Some(&LeaderEvent::Leader(LeaderInfo::new(
            lc.term(),
            b"c".to_vec()
        )))
    );
    assert_eq!(got.iter().filter(|e| **e == LeaderEvent::Missed).count(), 1);
    lc.resign().await.expect("resign c");
    drop(member);
}

/// Hand-over and observer latencies on the shared etcd, printed (not asserted): a resign to
/// the next candidate's grant, and a grant to an observer's event, over 20 rounds. Asserts
/// only what must hold: terms increase and the observer sees every leader in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handover_and_observer_latency() {
    let h = EtcdSlotHarness::from_env("LOCKKIT_ETCD_URL");
    let (a, b, watcher) = (h.client().await, h.client().await, h.client().await);
    let name = unique("latency");
    let mut observer = watcher.observe(&name).await.expect("observe");
    assert_eq!(observer.next().await.unwrap(), LeaderEvent::NoLeader);
    let clients = [a, b];
    let mut leader = clients[0]
        .campaign(&name, b"0", waiting(10))
        .await
        .expect("campaign");
    let mut handover = Vec::new();
    let mut seen_lag = Vec::new();
    assert_eq!(
        observer.next().await.unwrap(),
        LeaderEvent::Leader(LeaderInfo::new(leader.term(), b"0".to_vec()))
    );
    for round in 1..=20usize {
        let c = clients[round % 2].clone();
        let value = round.to_string().into_bytes();
        let v2 = value.clone();
        let name2 = name.clone();
        let next = tokio::spawn(async move {
            let l = c.campaign(&name2, &v2, waiting(10)).await;
            (l, Instant::now())
        });
        // The candidate is in line once its key exists (two candidates: the leader and it).
        loop {
            let n = watcher
                .client()
                .kv_client()
                .get(
                    format!("{}/./elect/{name}/", watcher.config().get_prefix()),
                    Some(
                        lockkit::etcd::etcd_client::GetOptions::new()
                            .with_prefix()
                            .with_count_only(),
                    ),
                )
                .await
                .expect("count")
                .count();
            if n == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let before = leader.term();
        let resigned = Instant::now();
        leader.resign().await.expect("resign");
        let (l, granted) = next.await.unwrap();
        leader = l.expect("campaign");
        handover.push(granted - resigned);
        let e = observer.next().await.expect("observer");
        seen_lag.push(Instant::now().saturating_duration_since(resigned));
        assert!(leader.term() > before);
        assert_eq!(
            e,
            LeaderEvent::Leader(LeaderInfo::new(leader.term(), value))
        );
    }
    leader.resign().await.expect("resign");
    handover.sort();
    seen_lag.sort();
    eprintln!(
        "resign → next leader granted: median {:?}, max {:?}; resign → observer event: median {:?}, max {:?}",
        handover[handover.len() / 2],
        handover[handover.len() - 1],
        seen_lag[seen_lag.len() / 2],
        seen_lag[seen_lag.len() - 1]
    );
}

/// Permit waiters queue FIFO on the semaphore's gate, and one release admits one waiter: with
/// N = 1 and waiters B, C, D, E queued in that order, each release grants the next in line
/// only. While anyone waits the N stays in force (another N is `PermitsMismatch`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permit_waiters_are_served_in_order() {
    let h = EtcdSlotHarness::from_env("LOCKKIT_ETCD_URL");
    let (a, other) = (h.client().await, h.client().await);
    let name = unique("permit-fifo");
    let once = AcquireOptions::new()
        .ttl(Duration::from_secs(10))
        .wait(Wait::No);
    let pa = a
        .acquire_permit(&name, 1, once.clone())
        .await
        .expect("permit");
    let (won_tx, mut won) = tokio::sync::mpsc::unbounded_channel();
    let mut release = std::collections::HashMap::new();
    let labels = ["b", "c", "d", "e"];
    for label in labels {
        let c = h.client().await;
        let (name, won_tx) = (name.clone(), won_tx.clone());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        release.insert(label, tx);
        tokio::spawn(async move {
            let p = c
                .acquire_permit(&name, 1, waiting(30))
                .await
                .expect("permit");
            let _ = won_tx.send((label, p.token()));
            let _ = rx.await;
            p.release().await.expect("release");
        });
        // Let each waiter join the line before the next one.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    match other.acquire_permit(&name, 2, once.clone()).await {
        Err(lockkit::Error::PermitsMismatch { ours, theirs, .. }) => {
            assert_eq!((ours, theirs), (2, 1))
        }
        other => panic!("another N while the semaphore has waiters: {other:?}"),
    }
    assert!(won.try_recv().is_err(), "a waiter got a held permit");
    let mut last = pa.token();
    pa.release().await.expect("release");
    let mut order = Vec::new();
    for _ in labels {
        let (label, token) = tokio::time::timeout(h.tolerance(), won.recv())
            .await
            .expect("no waiter got the released permit")
            .unwrap();
        assert!(token > last && token.same_lock(&last));
        last = token;
        order.push(label);
        assert!(
            tokio::time::timeout(Duration::from_millis(100), won.recv())
                .await
                .is_err(),
            "one release admitted two waiters"
        );
        let _ = release
            .remove(label)
            .expect("one grant per waiter")
            .send(());
    }
    assert_eq!(
        order, labels,
        "FIFO: waiters get the permit in the order they queued"
    );
    // Idle again: a new N is taken.
    let deadline = Instant::now() + h.tolerance();
    let wider = loop {
        match other.acquire_permit(&name, 2, once.clone()).await {
            Ok(p) => break p,
            Err(lockkit::Error::PermitsMismatch { .. } | lockkit::Error::Held { .. })
                if Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => panic!("an idle semaphore refused a new N: {other:?}"),
        }
    };
    assert_eq!(wider.permits(), 2);
    wider.release().await.expect("release");
}

/// The backend's watch of a semaphore's slots (no user API observes semaphores yet, the CLI
/// may): the first state, then every grant and release, each with its slot and token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphore_watch_sees_every_permit() {
    use lockkit::backend::{SlotBackend, SlotKind, WatchEvent};
    let h = EtcdSlotHarness::from_env("LOCKKIT_ETCD_URL");
    let (a, watcher) = (h.client().await, h.client().await);
    let name = unique("sem-watch");
    let mut w = watcher
        .watch_slots(SlotKind::Semaphore, &name)
        .await
        .expect("watch");
    assert_eq!(w.next().await.unwrap(), WatchEvent::Holders(vec![]));
    let once = AcquireOptions::new()
        .ttl(Duration::from_secs(10))
        .wait(Wait::No);
    let p0 = a.acquire_permit(&name, 2, once.clone()).await.unwrap();
    let p1 = a.acquire_permit(&name, 2, once).await.unwrap();
    let slots = |e: WatchEvent| match e {
        WatchEvent::Holders(hs) => hs
            .into_iter()
            .map(|h| (h.slot, h.token))
            .collect::<Vec<_>>(),
        other => panic!("expected holders, got {other:?}"),
    };
    assert_eq!(slots(next(&mut w).await), vec![(p0.slot(), p0.token())]);
    assert_eq!(
        slots(next(&mut w).await),
        vec![(p0.slot(), p0.token()), (p1.slot(), p1.token())]
    );
    let (s1, t1) = (p1.slot(), p1.token());
    p0.release().await.unwrap();
    assert_eq!(slots(next(&mut w).await), vec![(s1, t1)]);
    p1.release().await.unwrap();
    assert_eq!(slots(next(&mut w).await), vec![]);
}

async fn next(w: &mut Box<dyn lockkit::backend::SlotWatch>) -> lockkit::backend::WatchEvent {
    tokio::time::timeout(Duration::from_secs(5), w.next())
        .await
        .expect("no watch event")
        .expect("watch")
}

/// An observer cut off from etcd while a term comes and goes (no compaction) resumes its watch
/// at the next revision it had not seen: it reports that term, its end and the next leader,
/// in order and without `Missed` (`every_change_observed`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnecting_observer_misses_nothing() {
    let url = with_prefix(&server_url("LOCKKIT_ETCD_URL"), &fresh_prefix());
    let endpoint = url
        .trim_start_matches("etcd://")
        .split('?')
        .next()
        .unwrap()
        .to_owned();
    let name = unique("reconnect");
    let CutObserver {
        proxy,
        a: _a,
        b,
        la,
        pending,
    } = observer_cut_at_a_grant(&url, &endpoint, &name, b"b").await;
    let term_a = la.term();
    la.resign().await.expect("resign a");
    let lb = b.campaign(&name, b"b", once()).await.expect("campaign b");
    proxy.accept_again();
    let got = tokio::time::timeout(Duration::from_secs(20), pending)
        .await
        .expect("the observer did not resume")
        .expect("observer task");
    assert_eq!(
        got,
        vec![
            LeaderEvent::Leader(LeaderInfo::new(term_a, b"a".to_vec())),
            LeaderEvent::NoLeader,
            LeaderEvent::Leader(LeaderInfo::new(lb.term(), b"b".to_vec())),
        ],
        "every change after the reconnect, in order, no Missed"
    );
    lb.resign().await.expect("resign b");
}
