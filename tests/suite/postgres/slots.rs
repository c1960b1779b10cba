//! Elections and semaphores on PostgreSQL: the contract suite (`election_suite!`) against the
//! shared server, and what only PostgreSQL can do to a holder (a terminated backend).

use std::time::Duration;

use lockkit::postgres::PgLock;
use lockkit::{
    AcquireOptions, Election, LeaderEvent, LeaderInfo, LeaseState, Semaphore, Wait, async_trait,
};

use super::server::admin;
use super::{base_url, pid_of};
use crate::common::{ConnectUrl, SlotClients};

/// The slot harness: a new `PgLock` (its own connections) per client, all under one fresh
/// prefix.
pub type PgSlotHarness = SlotClients<PgLock>;

#[async_trait]
impl ConnectUrl for PgLock {
    async fn connect_url(url: &str) -> lockkit::Result<Self> {
        PgLock::connect(url).await
    }
}

mod contract {
    lockkit::election_suite!(super::PgSlotHarness::from_env("LOCKKIT_POSTGRES_URL"));
}

/// A permit holder whose backend an administrator terminates loses its permit: the server
/// frees the slot at once (session end), a waiter that has been waiting for it gets it (no
/// NOTIFY tells of a terminated session: the waiter's re-check finds it), with a higher token
/// of the same slot, and the old holder's loss signal fires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_permit_holder_is_reclaimed_by_a_waiter() {
    let h = PgSlotHarness::from_env("LOCKKIT_POSTGRES_URL");
    let (a, b) = (h.client().await, h.client().await);
    let name = format!("terminated-{:08x}", rand::random::<u32>());
    // A long TTL: only the termination can free the permit within the test.
    let ttl = Duration::from_secs(60);
    let held = a
        .acquire_permit(&name, 1, AcquireOptions::new().ttl(ttl).wait(Wait::No))
        .await
        .expect("permit");
    let pid = pid_of(held.lease());
    let waiter = tokio::spawn(async move {
        b.acquire_permit(
            &name,
            1,
            AcquireOptions::new()
                .ttl(ttl)
                .wait(Wait::Timeout(Duration::from_secs(30))),
        )
        .await
    });
    // Let the waiter queue (it cannot be granted while A holds).
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiter.is_finished(), "a waiter got a permit that was held");
    let mut db = admin(&base_url()).await;
    let ok: bool = lockkit::postgres::sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&mut db)
        .await
        .expect("pg_terminate_backend");
    assert!(ok, "pg_terminate_backend({pid})");
    // The waiter re-checks at least every 3 s (no NOTIFY comes from a terminated session);
    // 15 s is well below the 60 s TTL and its 20 s keepalive-paced re-checks.
    let p = tokio::time::timeout(Duration::from_secs(15), waiter)
        .await
        .expect("the terminated holder's permit was not reclaimed")
        .expect("waiter task");
    let p = p.expect("the waiter's acquire");
    assert_eq!(p.slot(), held.slot());
    assert!(p.token().same_lock(&held.token()));
    assert!(p.token() > held.token());
    tokio::time::timeout(Duration::from_secs(10), held.lost())
        .await
        .expect("the terminated holder's loss signal did not fire");
    assert_eq!(held.state(), LeaseState::Lost);
    p.release().await.expect("release");
}

/// A terminated leader's session sends no `NOTIFY`: an observer still sees the leadership end
/// (its re-read, at least every 3 s), long before the leader's 60 s TTL, and then the next
/// leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observer_sees_a_terminated_leader_go() {
    let h = PgSlotHarness::from_env("LOCKKIT_POSTGRES_URL");
    let (a, b, watcher) = (h.client().await, h.client().await, h.client().await);
    let name = format!("terminated-leader-{:08x}", rand::random::<u32>());
    let ttl = Duration::from_secs(60);
    let leader = a
        .campaign(&name, b"a", AcquireOptions::new().ttl(ttl).wait(Wait::No))
        .await
        .expect("campaign");
    let mut observer = watcher.observe(&name).await.expect("observe");
    assert_eq!(
        observer.next().await.expect("first event"),
        LeaderEvent::Leader(LeaderInfo::new(leader.term(), b"a".to_vec()))
    );
    let pid = pid_of(leader.lease());
    let mut db = admin(&base_url()).await;
    let ok: bool = lockkit::postgres::sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&mut db)
        .await
        .expect("pg_terminate_backend");
    assert!(ok, "pg_terminate_backend({pid})");
    // Well below the 60 s TTL (and the 20 s re-reads it would pace without the 3 s cap).
    let next = tokio::time::timeout(Duration::from_secs(15), observer.next())
        .await
        .expect("the observer did not see the terminated leader go")
        .expect("observer");
    assert_eq!(next, LeaderEvent::NoLeader);
    let lb = b
        .campaign(&name, b"b", AcquireOptions::new().ttl(ttl).wait(Wait::No))
        .await
        .expect("campaign after the leader was terminated");
    assert!(lb.term() > leader.term());
    let next = tokio::time::timeout(Duration::from_secs(15), observer.next())
        .await
        .expect("the observer did not see the next leader")
        .expect("observer");
    assert_eq!(
        next,
        LeaderEvent::Leader(LeaderInfo::new(lb.term(), b"b".to_vec()))
    );
    lb.resign().await.expect("resign");
}
