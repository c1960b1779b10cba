//! Attempts to break session 8's Redis performance changes (per-key keyspace subscriptions
//! after `WATCH_AFTER`, the batched renewal, the FIFO queue) against private `redis-server`s:
//! lock keys replaced by another type, subscriptions left behind by fast grants and releases,
//! the pub/sub connection killed while grants are young, a server that sleeps.

use std::time::Duration;

use lockkit::redis::redis;
use lockkit::redis::{LOSS_NOTICE, RedisLock};
use lockkit::{AcquireOptions, Lease, LeaseState, Lock, LossReason, Wait};
use tokio::time::Instant;

use super::PrivateRedis;
use crate::common::{fresh_prefix, with_prefix};

/// Bounds every wait for something the client must do soon (a loss notice, a subscription):
/// far below the long TTL used where renewals must not be what tells.
const SOON: Duration = Duration::from_secs(5);

/// Replaces `key` by a hash in one transaction (`DEL` + `HSET`): an application that found
/// the name free and used it for something else.
async fn replace_by_hash(admin: &mut redis::aio::MultiplexedConnection, key: &str) {
    redis::pipe()
        .atomic()
        .cmd("DEL")
        .arg(key)
        .ignore()
        .cmd("HSET")
        .arg(key)
        .arg("field")
        .arg("value")
        .ignore()
        .query_async::<()>(admin)
        .await
        .expect("DEL + HSET");
}

/// Waits (bounded by [`SOON`]) until `lease` is lost.
async fn until_lost(lease: &Lease, what: &str) {
    if tokio::time::timeout(SOON, lease.lost()).await.is_err() {
        panic!(
            "{what}: not lost within {SOON:?} (state {:?})",
            lease.state()
        );
    }
}

/// A kept-alive, subscribed lock key replaced by a hash loses that lease alone, soon: the
/// batched renewal of the connection's other leases goes on. (The batch script's `GET` of the hash failed with
/// `WRONGTYPE`, which aborted the whole script: every lease of the batch turned suspect at
/// each tick, and all of them were lost at their deadline.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_key_of_another_type_loses_only_its_own_lease_in_a_batch() {
    let server = PrivateRedis::start(None).await;
    let locks = RedisLock::connect(&with_prefix(&server.url(), &fresh_prefix()))
        .await
        .expect("connect");
    let mut admin = server.raw().await;
    let ttl = Duration::from_millis(1_500);
    let kept = AcquireOptions::new().ttl(ttl).wait(Wait::No);
    let mut leases = Vec::new();
    for i in 0..3 {
        leases.push(
            locks
                .acquire(&format!("typed{i}"), kept.clone())
                .await
                .expect("acquire"),
        );
    }
    // Subscribed first: the check that follows a subscription (an `MGET`, which answers nil
    // for a hash) is not what tells.
    until_subscribers(&mut admin, &locks.lock_key("typed1"), 1).await;
    replace_by_hash(&mut admin, &locks.lock_key("typed1")).await;
    until_lost(&leases[1], "the lease whose key is a hash now").await;
    assert_eq!(leases[1].loss_reason(), Some(LossReason::NotHeldOnServer));
    // The others are renewed through several ticks (TTL/3 each) and past their first deadline.
    tokio::select! {
        s = leases[0].at_risk() => panic!("typed0 turned {s:?}"),
        s = leases[2].at_risk() => panic!("typed2 turned {s:?}"),
        () = tokio::time::sleep(ttl * 2) => {}
    }
    assert_eq!(leases[0].state(), LeaseState::Held);
    assert_eq!(leases[2].state(), LeaseState::Held);
    for l in leases {
        let _ = l.release().await;
    }
    // The hash is not ours: the release of the lost lease left it alone.
    let kind: String = redis::cmd("TYPE")
        .arg(locks.lock_key("typed1"))
        .query_async(&mut admin)
        .await
        .expect("TYPE");
    assert_eq!(kind, "hash");
}

/// A lock key replaced by a hash is not the holder's any more: a renewal by hand says
/// `NotHeld` and the lease is lost, and the release leaves the hash alone — as for a key that
/// is gone, not a `WRONGTYPE` backend error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_key_of_another_type_is_not_held_by_hand() {
    let server = PrivateRedis::start(None).await;
    let locks = RedisLock::connect(&with_prefix(&server.url(), &fresh_prefix()))
        .await
        .expect("connect");
    let mut admin = server.raw().await;
    let by_hand = AcquireOptions::new()
        .ttl(Duration::from_secs(60))
        .keepalive(false)
        .wait(Wait::No);
    let lease = locks.acquire("typed", by_hand).await.expect("acquire");
    replace_by_hash(&mut admin, &locks.lock_key("typed")).await;
    match lease.renew().await {
        Err(lockkit::Error::NotHeld { .. }) => {}
        other => panic!("renew of a key that is a hash now: {other:?}"),
    }
    assert_eq!(lease.state(), LeaseState::Lost);
    let _ = lease.release().await;
    let kind: String = redis::cmd("TYPE")
        .arg(locks.lock_key("typed"))
        .query_async(&mut admin)
        .await
        .expect("TYPE");
    assert_eq!(kind, "hash");
}

/// A subscribed lock key replaced by a hash is heard at once (its `del` event, then a check
/// that finds another type), within [`LOSS_NOTICE`], long before the renewal (20 s away).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscribed_key_replaced_by_another_type_is_heard_within_the_loss_notice() {
    let server = PrivateRedis::start(None).await;
    let locks = RedisLock::connect(&with_prefix(&server.url(), &fresh_prefix()))
        .await
        .expect("connect");
    let mut admin = server.raw().await;
    let opts = AcquireOptions::new()
        .ttl(Duration::from_secs(60))
        .wait(Wait::No);
    let lease = locks.acquire("typed", opts).await.expect("acquire");
    let key = locks.lock_key("typed");
    until_subscribers(&mut admin, &key, 1).await;
    let lost = lease.lost();
    let lost_at = tokio::spawn(async move {
        lost.await;
        Instant::now()
    });
    let sent = Instant::now();
    replace_by_hash(&mut admin, &key).await;
    let at = tokio::time::timeout(SOON, lost_at)
        .await
        .unwrap_or_else(|_| panic!("not lost within {SOON:?} (state {:?})", lease.state()))
        .expect("lost task");
    let took = at.saturating_duration_since(sent);
    assert!(took < LOSS_NOTICE, "heard after {took:?}");
    assert_eq!(lease.loss_reason(), Some(LossReason::NotHeldOnServer));
}

/// How many clients are subscribed to `key`'s keyspace channel (database 0).
async fn keyspace_subscribers(admin: &mut redis::aio::MultiplexedConnection, key: &str) -> i64 {
    let (_, n): (String, i64) = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg(format!("__keyspace@0__:{key}"))
        .query_async(admin)
        .await
        .expect("PUBSUB NUMSUB");
    n
}

/// Waits (bounded by [`SOON`]) until `n` clients are subscribed to `key`'s keyspace channel.
async fn until_subscribers(admin: &mut redis::aio::MultiplexedConnection, key: &str, n: i64) {
    let start = Instant::now();
    while keyspace_subscribers(admin, key).await != n {
        assert!(
            start.elapsed() < SOON,
            "{key}: its keyspace channel never had {n} subscribers"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
