//! Elections and semaphores on ZooKeeper: the contract suite (`election_suite!`) against the
//! shared server, and what only ZooKeeper does to a holder or an observer (a session expired
//! behind a frozen connection, a session closed by someone else).

use std::time::Duration;

use lockkit::LockExt;
use lockkit::backend::LeaseBackendExt;
use lockkit::zk::ZkLock;
use lockkit::zk::zookeeper_client as zk;
use lockkit::{
    AcquireOptions, Election, LeaderEvent, LeaderInfo, LeaseState, Semaphore, Wait, async_trait,
};
use tokio::time::Instant;

use crate::common::proxy::Proxy;
use crate::common::{ConnectUrl, SlotClients, server_url};

/// Session timeout of the holders whose session is made to expire: 2 s (the shared server
/// accepts 1 s–60 s).
const TTL: Duration = Duration::from_secs(2);
/// Scheduling slack on a loaded 2-core machine.
const TOLERANCE: Duration = Duration::from_secs(2);

fn upstream() -> String {
    server_url("LOCKKIT_ZK_URL")
        .strip_prefix("zk://")
        .expect("LOCKKIT_ZK_URL is zk://host:port")
        .to_owned()
}

fn unique(name: &str) -> String {
    format!("{name}-{:08x}", rand::random::<u32>())
}

/// The slot harness: a new `ZkLock` (its own sessions) per client, all under one fresh prefix.
pub type ZkSlotHarness = SlotClients<ZkLock>;

#[async_trait]
impl ConnectUrl for ZkLock {
    async fn connect_url(url: &str) -> lockkit::Result<Self> {
        ZkLock::connect(url).await
    }
}

/// A client of `h`'s prefix whose every connection goes through `proxy`.
async fn through(h: &ZkSlotHarness, proxy: &Proxy) -> ZkLock {
    ZkLock::connect(&format!(
        "zk://127.0.0.1:{}?prefix={}",
        proxy.port, h.prefix
    ))
    .await
    .expect("connect through the proxy")
}

mod contract {
    lockkit::election_suite!(super::ZkSlotHarness::from_env("LOCKKIT_ZK_URL"));
}

fn waiting(ttl: Duration, timeout: Duration) -> AcquireOptions {
    AcquireOptions::new().ttl(ttl).wait(Wait::Timeout(timeout))
}

async fn next_event(observer: &mut lockkit::Observer, what: &str) -> LeaderEvent {
    tokio::time::timeout(Duration::from_secs(15), observer.next())
        .await
        .unwrap_or_else(|_| panic!("no observer event: {what}"))
        .expect("observer")
}

/// A leader whose connection freezes loses its session: the server deletes its candidate
/// node, the waiting candidate leads with a higher term, an observer sees the next leader
/// (it was next in line: no `Missed`), and the old leader's loss signal fires and its
/// proclaim fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_session_expires_loses_and_the_next_leads() {
    let h = ZkSlotHarness::from_env("LOCKKIT_ZK_URL");
    let proxy = Proxy::start(upstream()).await;
    let (a, b, watcher) = (
        through(&h, &proxy).await,
        h.client().await,
        h.client().await,
    );
    let name = unique("expired-leader");
    let mut la = a
        .campaign(&name, b"a", AcquireOptions::new().ttl(TTL).wait(Wait::No))
        .await
        .expect("A campaigns");
    let mut observer = watcher.observe(&name).await.expect("observe");
    assert_eq!(
        next_event(&mut observer, "first").await,
        LeaderEvent::Leader(LeaderInfo::new(la.term(), b"a".to_vec()))
    );
    let (b_name, b_client) = (name.clone(), b.clone());
    let candidate = tokio::spawn(async move {
        b_client
            .campaign(
                &b_name,
                b"b",
                waiting(Duration::from_secs(10), TTL * 4 + TOLERANCE),
            )
            .await
    });
    // B is in line (its node is there) before A's connection freezes.
    let mut lines = 0;
    while b.candidates(&name).await.expect("candidates").len() < 2 {
        lines += 1;
        assert!(lines < 200, "B never queued");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let frozen_at = Instant::now();
    proxy.freeze();
    let lb = candidate
        .await
        .expect("candidate task")
        .expect("B leads once A's session expired");
    assert!(
        frozen_at.elapsed() >= TTL / 2,
        "B led {:?} after the freeze, before A's session could expire",
        frozen_at.elapsed()
    );
    assert!(lb.term() > la.term(), "{} !> {}", lb.term(), la.term());
    assert!(lb.term().same_lock(&la.term()));
    assert_eq!(
        next_event(&mut observer, "the next leader").await,
        LeaderEvent::Leader(LeaderInfo::new(lb.term(), b"b".to_vec()))
    );
    tokio::time::timeout(TOLERANCE, la.lost())
        .await
        .expect("A's loss signal");
    assert_eq!(la.state(), LeaseState::Lost);
    proxy.thaw();
    assert!(
        la.proclaim(b"a2").await.is_err(),
        "a lost leader proclaimed"
    );
    assert!(la.resign().await.is_err(), "a lost leader resigned");
    lb.resign().await.expect("B resigns");
    assert_eq!(
        next_event(&mut observer, "no leader").await,
        LeaderEvent::NoLeader
    );
}

/// A permit holder whose connection freezes loses its session; the waiter, first in line and
/// watching the semaphore's slots, takes the freed slot with a higher token of that slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_permit_is_taken_by_the_waiter() {
    let h = ZkSlotHarness::from_env("LOCKKIT_ZK_URL");
    let proxy = Proxy::start(upstream()).await;
    let (a, b) = (through(&h, &proxy).await, h.client().await);
    let name = unique("expired-permit");
    let pa = a
        .acquire_permit(&name, 1, AcquireOptions::new().ttl(TTL).wait(Wait::No))
        .await
        .expect("A's permit");
    let waiter = tokio::spawn(async move {
        b.acquire_permit(
            &name,
            1,
            waiting(Duration::from_secs(10), TTL * 4 + TOLERANCE),
        )
        .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished(), "a waiter got a held permit");
    proxy.freeze();
    let pb = waiter
        .await
        .expect("waiter task")
        .expect("B's permit once A's session expired");
    assert_eq!(pb.slot(), pa.slot());
    assert!(pb.token().same_lock(&pa.token()));
    assert!(pb.token() > pa.token());
    tokio::time::timeout(TOLERANCE, pa.lost())
        .await
        .expect("A's loss signal");
    proxy.thaw();
    pb.release().await.expect("release");
}

/// A semaphore whose last holder released is idle even while its (container) node still
/// stands with the old N: the next acquire sets its own N.
#[tokio::test]
async fn an_idle_semaphore_node_takes_a_new_n() {
    let h = ZkSlotHarness::from_env("LOCKKIT_ZK_URL");
    let s = h.client().await;
    let name = unique("idle-n");
    let once = AcquireOptions::new()
        .ttl(Duration::from_secs(10))
        .wait(Wait::No);
    let p = s
        .acquire_permit(&name, 2, once.clone())
        .await
        .expect("N = 2");
    p.release().await.expect("release");
    let p = s
        .acquire_permit(&name, 3, once.clone())
        .await
        .expect("the idle semaphore takes N = 3");
    assert_eq!(p.permits(), 3);
    match s.acquire_permit(&name, 2, once).await {
        Err(lockkit::Error::PermitsMismatch { ours, theirs, .. }) => {
            assert_eq!((ours, theirs), (2, 3));
        }
        other => panic!("N = 2 while N = 3 is held: {other:?}"),
    }
    p.release().await.expect("release");
}

/// The observer's session is taken over and closed by another client (as an administrator
/// could) while the observer's connection is frozen (so that its client cannot take the
/// session back): its watches are gone with it. The observer says `Missed`, then goes on with
/// a new session and sees the leader that came meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observer_whose_session_is_lost_gets_missed() {
    let h = ZkSlotHarness::from_env("LOCKKIT_ZK_URL");
    let proxy = Proxy::start(upstream()).await;
    let (a, watcher) = (h.client().await, through(&h, &proxy).await);
    let name = unique("observer-session");
    let mut observer = watcher.observe(&name).await.expect("observe");
    assert_eq!(
        next_event(&mut observer, "first").await,
        LeaderEvent::NoLeader
    );
    // A lease of the control session's TTL lives on the observer's session: its node goes
    // when the server closes the session.
    let canary = watcher
        .try_acquire(&unique("canary"), lockkit::zk::CONTROL_SESSION_TTL)
        .await
        .expect("canary lease");
    let info = watcher.control_session_info().await.expect("session info");
    let node = canary
        .ops()
        .as_any()
        .downcast_ref::<lockkit::zk::ZkLease>()
        .expect("a ZooKeeper lease")
        .node_path()
        .to_owned();
    let raw = zk::Client::connect(&upstream()).await.expect("raw client");
    let (stat, gone) = raw.check_and_watch_stat(&node).await.expect("exists");
    assert!(stat.is_some(), "the canary's node {node} is not there");
    proxy.freeze();
    let thief = zk::Client::connector()
        .with_session(info)
        .connect(&upstream())
        .await
        .expect("take the observer's session over");
    drop(thief); // closes the session on the server, in the background
    let event = tokio::time::timeout(Duration::from_secs(15), gone.changed())
        .await
        .expect("the taken-over session was not closed");
    assert_eq!(event.event_type, zk::EventType::NodeDeleted);
    proxy.thaw();
    let la = a
        .campaign(&name, b"a", AcquireOptions::new().ttl(TTL).wait(Wait::No))
        .await
        .expect("campaign");
    assert_eq!(
        next_event(&mut observer, "after the session loss").await,
        LeaderEvent::Missed
    );
    assert_eq!(
        next_event(&mut observer, "the state after Missed").await,
        LeaderEvent::Leader(LeaderInfo::new(la.term(), b"a".to_vec()))
    );
    la.resign().await.expect("resign");
    assert_eq!(
        next_event(&mut observer, "no leader").await,
        LeaderEvent::NoLeader
    );
    drop(canary);
}

/// Two proclaims between two reads of an observer: it cannot see the first value, and says
/// `Missed` before the second (the data version moved by two).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proclaims_the_observer_cannot_see_are_missed() {
    let h = ZkSlotHarness::from_env("LOCKKIT_ZK_URL");
    let (a, watcher) = (h.client().await, h.client().await);
    let name = unique("proclaims");
    let mut la = a
        .campaign(&name, b"v0", AcquireOptions::new().ttl(TTL).wait(Wait::No))
        .await
        .expect("campaign");
    let mut observer = watcher.observe(&name).await.expect("observe");
    assert_eq!(
        next_event(&mut observer, "first").await,
        LeaderEvent::Leader(LeaderInfo::new(la.term(), b"v0".to_vec()))
    );
    // The observer's watch fires at v1; it reads only in `next`, after both.
    la.proclaim(b"v1").await.expect("proclaim v1");
    la.proclaim(b"v2").await.expect("proclaim v2");
    assert_eq!(
        next_event(&mut observer, "after two proclaims").await,
        LeaderEvent::Missed
    );
    assert_eq!(
        next_event(&mut observer, "the last value").await,
        LeaderEvent::Leader(LeaderInfo::new(la.term(), b"v2".to_vec()))
    );
    la.resign().await.expect("resign");
}

/// Measures (and prints; no assertion on speed) resign → next leader and resign → observer
/// event latencies over 20 hand-overs, and checks each hand-over's terms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resign_hand_over_latency() {
    let h = ZkSlotHarness::from_env("LOCKKIT_ZK_URL");
    let (a, b, watcher) = (h.client().await, h.client().await, h.client().await);
    let name = unique("latency");
    let opts = || waiting(Duration::from_secs(10), Duration::from_secs(10));
    let mut observer = watcher.observe(&name).await.expect("observe");
    assert_eq!(
        next_event(&mut observer, "first").await,
        LeaderEvent::NoLeader
    );
    let mut leader = a.campaign(&name, b"0", opts()).await.expect("campaign");
    next_event(&mut observer, "first leader").await;
    let (mut handover, mut seen) = (Vec::new(), Vec::new());
    let clients = [a, b];
    for round in 1..=20usize {
        let next_client = clients[round % 2].clone();
        let (n, value) = (name.clone(), round.to_string().into_bytes());
        let candidate = tokio::spawn(async move { next_client.campaign(&n, &value, opts()).await });
        while clients[0]
            .candidates(&name)
            .await
            .expect("candidates")
            .len()
            < 2
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let old = leader.term();
        let t0 = Instant::now();
        leader.resign().await.expect("resign");
        // Both clocks run from the resign's start, each stopped by its own event.
        let ((next, led), (ev, observed)) =
            tokio::join!(async { (candidate.await, t0.elapsed()) }, async {
                (next_event(&mut observer, "next leader").await, t0.elapsed())
            });
        leader = next.expect("task").expect("next leader");
        handover.push(led);
        seen.push(observed);
        assert!(leader.term() > old);
        assert!(
            matches!(&ev, LeaderEvent::Leader(l) if l.term == leader.term()),
            "{ev:?}"
        );
    }
    leader.resign().await.expect("resign");
    handover.sort();
    seen.sort();
    eprintln!(
        "zk election hand-over (resign -> next leader's campaign returns): median {:?}, max {:?}; \
         resign -> observer event: median {:?}, max {:?}",
        handover[handover.len() / 2],
        handover[handover.len() - 1],
        seen[seen.len() / 2],
        seen[seen.len() - 1]
    );
}

/// The server removes an idle election's (empty container) node: an observer that saw
/// `NoLeader` reads again and reports nothing (no `Missed`: the removal was the first change,
/// nothing came and went before it), and then sees the next leader, in a new election node,
/// without a gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_election_node_removed_by_the_server_is_no_gap() {
    let server = super::server::PrivateZk::start("-Dznode.container.checkIntervalMs=1000").await;
    let url = format!("{}?prefix=slots", server.url());
    let a = ZkLock::connect(&url).await.expect("connect");
    let watcher = ZkLock::connect(&url).await.expect("connect");
    let raw = zk::Client::connect(&format!("127.0.0.1:{}", server.port))
        .await
        .expect("raw client");
    let name = "reaped";
    let dir = format!("/slots/%elect/{name}");
    let once = || {
        AcquireOptions::new()
            .ttl(Duration::from_secs(10))
            .wait(Wait::No)
    };
    let la = a.campaign(name, b"a", once()).await.expect("campaign");
    let mut observer = watcher.observe(name).await.expect("observe");
    assert_eq!(
        next_event(&mut observer, "first").await,
        LeaderEvent::Leader(LeaderInfo::new(la.term(), b"a".to_vec()))
    );
    let la_term = la.term();
    la.resign().await.expect("resign");
    // (`Missed` first only if the server removed the node before the observer read again:
    // then nothing tells whether a candidate came and went meanwhile.)
    let mut after = next_event(&mut observer, "resigned").await;
    if after == LeaderEvent::Missed {
        after = next_event(&mut observer, "resigned, after Missed").await;
    }
    assert_eq!(after, LeaderEvent::NoLeader);
    // Await the server's removal of the empty election node (a watch, not polling).
    let (stat, removed) = raw.check_and_watch_stat(&dir).await.expect("exists");
    if stat.is_some() {
        let event = tokio::time::timeout(Duration::from_secs(30), removed.changed())
            .await
            .expect("the empty election node was never removed");
        assert_eq!(event.event_type, zk::EventType::NodeDeleted);
    }
    // The observer reads after the removal; it must report nothing (its NoLeader is not
    // repeated). There is no signal for "nothing": give it a second (a Missed comes within
    // milliseconds of the removal).
    if let Ok(event) = tokio::time::timeout(Duration::from_secs(1), observer.next()).await {
        panic!("the removal of an idle election node gave {event:?}");
    }
    let first_term = la_term;
    let lb = a
        .campaign(name, b"b", once())
        .await
        .expect("campaign again");
    assert!(lb.term() > first_term, "{} !> {first_term}", lb.term());
    assert_eq!(
        next_event(&mut observer, "the next leader").await,
        LeaderEvent::Leader(LeaderInfo::new(lb.term(), b"b".to_vec()))
    );
    lb.resign().await.expect("resign");
}
