//! Lock-delay on PostgreSQL: the delay row in `{schema}.delay` outlives a holder whose session
//! ended without a release, and the next grant waits it out (counted from when the lock was
//! first seen free, on the server's clock); a release deletes it with the unlock.

use std::time::Duration;

use lockkit::postgres::PgLock;
use lockkit::postgres::sqlx;
use lockkit::{AcquireOptions, Error, Lease, Lock, LockExt, Wait};
use tokio::time::Instant;

use super::server::admin;
use super::{base_url, pid_of};
use crate::common::{fresh_prefix, with_prefix};

const DELAY: Duration = Duration::from_millis(1500);
const TTL: Duration = Duration::from_secs(20);

fn with_delay(wait: Wait) -> AcquireOptions {
    AcquireOptions::new().ttl(TTL).wait(wait).lock_delay(DELAY)
}

/// Kills the holder's session (`pg_terminate_backend` on an admin connection) and waits for
/// the holder to hear of it. Returns when the kill was sent.
async fn kill(lease: &Lease) -> Instant {
    let pid = pid_of(lease);
    let mut db = admin(&base_url()).await;
    let sent = Instant::now();
    let ok: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&mut db)
        .await
        .unwrap();
    assert!(ok, "no session {pid}");
    tokio::time::timeout(Duration::from_secs(2), lease.lost())
        .await
        .expect("the holder was not told");
    sent
}

async fn delay_rows(key: i64) -> i64 {
    let mut db = admin(&base_url()).await;
    sqlx::query_scalar("SELECT count(*) FROM lockkit.delay WHERE key = $1")
        .bind(key)
        .fetch_one(&mut db)
        .await
        .unwrap()
}

/// A holder with a lock-delay whose session is terminated: a waiting acquire (without a delay
/// of its own) is granted no earlier than the delay after the kill, with a larger token; the
/// row is gone after that grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_holder_delays_the_next_grant() {
    let url = with_prefix(&base_url(), &fresh_prefix());
    let (a, b) = (
        PgLock::connect(&url).await.unwrap(),
        PgLock::connect(&url).await.unwrap(),
    );
    let lease = a.acquire("d", with_delay(Wait::No)).await.unwrap();
    assert_eq!(delay_rows(a.key("d")).await, 1);
    let killed = kill(&lease).await;
    let next = b
        .acquire(
            "d",
            AcquireOptions::new()
                .ttl(TTL)
                .wait(Wait::Timeout(Duration::from_secs(10))),
        )
        .await
        .expect("granted after the delay");
    let took = killed.elapsed();
    eprintln!("kill -> next grant: {took:?} (lock-delay {DELAY:?})");
    assert!(
        took >= DELAY,
        "granted {took:?} after the kill, delay {DELAY:?}"
    );
    assert!(took < DELAY + Duration::from_secs(5), "{took:?}");
    assert!(next.token() > lease.token());
    assert_eq!(delay_rows(a.key("d")).await, 0);
    next.release().await.unwrap();
    // No delay left: granted at once.
    let again = b
        .try_acquire("d", TTL)
        .await
        .expect("no delay after a release");
    again.release().await.unwrap();
}

/// After a release the lock is free at once, delay or not, and the row is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_frees_at_once() {
    let url = with_prefix(&base_url(), &fresh_prefix());
    let locks = PgLock::connect(&url).await.unwrap();
    for _ in 0..3 {
        let lease = locks.acquire("r", with_delay(Wait::No)).await.unwrap();
        lease.release().await.unwrap();
        assert_eq!(delay_rows(locks.key("r")).await, 0);
        let next = locks
            .acquire("r", with_delay(Wait::No))
            .await
            .expect("try-once right after a release");
        next.release().await.unwrap();
    }
}

/// During the delay a try-once acquire gets Held (and leaves the advisory lock free: another
/// try-once gets Held too, not a hang); once the delay has passed since the lock was first seen
/// free, a try-once is granted. The delay counts from the first sighting, not from each try.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_once_during_the_delay_is_held() {
    let url = with_prefix(&base_url(), &fresh_prefix());
    let (a, b) = (
        PgLock::connect(&url).await.unwrap(),
        PgLock::connect(&url).await.unwrap(),
    );
    let lease = a.acquire("t", with_delay(Wait::No)).await.unwrap();
    let killed = kill(&lease).await;
    let first_try = Instant::now();
    for _ in 0..2 {
        match b.try_acquire("t", TTL).await {
            Err(Error::Held { .. }) => {}
            other => panic!("try-once during the lock-delay: {other:?}"),
        }
    }
    assert!(
        killed.elapsed() < DELAY,
        "too slow to test during the delay"
    );
    // Sleep past the delay, counted from the first try (the server has no signal for its
    // end): a try-once is granted.
    tokio::time::sleep_until(first_try + DELAY + Duration::from_millis(200)).await;
    let next = b
        .try_acquire("t", TTL)
        .await
        .expect("granted after the delay");
    assert!(next.token() > lease.token());
    next.release().await.unwrap();
}

/// A lease dropped with release-on-drop (the default) is released, not abandoned: no
/// lock-delay, the row is gone, and the next try-once is granted as soon as the background
/// release is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_on_drop_is_a_release() {
    let url = with_prefix(&base_url(), &fresh_prefix());
    let (a, b) = (
        PgLock::connect(&url).await.unwrap(),
        PgLock::connect(&url).await.unwrap(),
    );
    let key = a.key("dropped");
    drop(a.acquire("dropped", with_delay(Wait::No)).await.unwrap());
    super::wait_no_advisory_lock(&base_url(), key, Duration::from_secs(2)).await;
    assert_eq!(
        delay_rows(key).await,
        0,
        "the release on drop left the delay row"
    );
    let next = b
        .acquire("dropped", AcquireOptions::new().ttl(TTL).wait(Wait::No))
        .await
        .expect("a lock released on drop is free at once");
    next.release().await.unwrap();
}
