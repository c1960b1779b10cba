//! Attempts to break the Redis performance changes of issue #11 (per-key keyspace subscriptions
//! after `WATCH_AFTER`, the batched renewal, the FIFO queue) against private `redis-server`s:
//! lock keys replaced by another type, subscriptions left behind by fast grants and releases,
//! the pub/sub connection killed while grants are young, a server that sleeps.

use std::time::Duration;

use lockkit::redis::redis;
use lockkit::redis::{LOSS_NOTICE, RedisLock};
use lockkit::{AcquireOptions, Lease, LeaseState, Lock, LossReason, Wait};
use tokio::time::Instant;

use super::{PrivateRedis, kill_pubsub_connections, until_subscribers};
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

/// Options for a lease renewed only by hand: a 60 s TTL, no keepalive, no waiting.
fn by_hand() -> AcquireOptions {
    AcquireOptions::new()
        .ttl(Duration::from_secs(60))
        .keepalive(false)
        .wait(Wait::No)
}

/// A private server, a client on it under a fresh prefix, and an admin connection to it.
async fn private() -> (PrivateRedis, RedisLock, redis::aio::MultiplexedConnection) {
    let server = PrivateRedis::start(None).await;
    let locks = RedisLock::connect(&with_prefix(&server.url(), &fresh_prefix()))
        .await
        .expect("connect");
    let admin = server.raw().await;
    (server, locks, admin)
}

/// `TYPE key`.
async fn key_type(admin: &mut redis::aio::MultiplexedConnection, key: &str) -> String {
    redis::cmd("TYPE")
        .arg(key)
        .query_async(admin)
        .await
        .expect("TYPE")
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
    let (_server, locks, mut admin) = private().await;
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
    assert_eq!(
        key_type(&mut admin, &locks.lock_key("typed1")).await,
        "hash"
    );
}

/// A lock's queue key replaced by a hash holds up neither the release nor the cleanup: the
/// release script's hand-over fails before it writes, and the lock key is deleted as if nobody
/// waited (it stayed, held by nobody, until its TTL). An acquire meanwhile is a typed backend
/// error that leaves no lock key behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_key_of_another_type_does_not_hold_up_the_release() {
    let (_server, locks, mut admin) = private().await;
    let lease = locks.acquire("typed-q", by_hand()).await.expect("acquire");
    replace_by_hash(&mut admin, &locks.queue_key("typed-q")).await;
    lease.release().await.expect("release");
    assert_eq!(
        key_type(&mut admin, &locks.lock_key("typed-q")).await,
        "none"
    );
    match locks.acquire("typed-q", by_hand()).await {
        Err(lockkit::Error::Backend { .. }) => {}
        other => panic!("acquire with a queue key that is a hash: {other:?}"),
    }
    assert_eq!(
        key_type(&mut admin, &locks.lock_key("typed-q")).await,
        "none"
    );
    assert_eq!(
        key_type(&mut admin, &locks.queue_key("typed-q")).await,
        "hash"
    );
}

/// A lock key replaced by a hash is not the holder's any more: a renewal by hand says
/// `NotHeld` and the lease is lost, and the release leaves the hash alone — as for a key that
/// is gone, not a `WRONGTYPE` backend error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_key_of_another_type_is_not_held_by_hand() {
    let (_server, locks, mut admin) = private().await;
    let by_hand = by_hand();
    let lease = locks.acquire("typed", by_hand).await.expect("acquire");
    replace_by_hash(&mut admin, &locks.lock_key("typed")).await;
    match lease.renew().await {
        Err(lockkit::Error::NotHeld { .. }) => {}
        other => panic!("renew of a key that is a hash now: {other:?}"),
    }
    assert_eq!(lease.state(), LeaseState::Lost);
    let _ = lease.release().await;
    assert_eq!(key_type(&mut admin, &locks.lock_key("typed")).await, "hash");
}

/// A subscribed lock key replaced by a hash is heard at once (its `del` event, then a check
/// that finds another type), within [`LOSS_NOTICE`], long before the renewal (20 s away).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscribed_key_replaced_by_another_type_is_heard_within_the_loss_notice() {
    let (_server, locks, mut admin) = private().await;
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

/// The keyspace channels of `prefix`'s lock keys that some client subscribes to, without the
/// probe channel every client subscribes to at connect (`__keyspace@0__:P:lock:`).
async fn lock_channels(admin: &mut redis::aio::MultiplexedConnection, prefix: &str) -> Vec<String> {
    let probe = format!("__keyspace@0__:{prefix}:lock:");
    let mut all: Vec<String> = redis::cmd("PUBSUB")
        .arg("CHANNELS")
        .arg(format!("{probe}*"))
        .query_async(admin)
        .await
        .expect("PUBSUB CHANNELS");
    all.retain(|c| *c != probe);
    all
}

/// Waits (bounded by [`SOON`]) until no client subscribes to a lock key channel of `prefix`.
async fn until_no_lock_channels(admin: &mut redis::aio::MultiplexedConnection, prefix: &str) {
    let start = Instant::now();
    loop {
        let left = lock_channels(admin, prefix).await;
        if left.is_empty() {
            return;
        }
        assert!(
            start.elapsed() < SOON,
            "{} keyspace channels still subscribed {SOON:?} after the last release: {:?}",
            left.len(),
            &left[..left.len().min(5)]
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Two clients, eight tasks each, take and give back four names for a few seconds, holding
/// each lease for 0 to 60 ms (around `WATCH_AFTER`, so grants are released before, during and
/// after their subscription, and a name is often granted again to the same client while its
/// channel is being subscribed or unsubscribed). Never two holders at once, tokens increase
/// per name, no lease is lost (no event of an earlier lease is taken for a loss of a later
/// one), and once all is released no lock key channel is left subscribed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_grants_and_releases_around_the_subscription_leave_no_channel_and_no_loss() {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};
    let server = PrivateRedis::start(None).await;
    let prefix = fresh_prefix();
    let url = with_prefix(&server.url(), &prefix);
    let mut admin = server.raw().await;
    let clients = [
        Arc::new(RedisLock::connect(&url).await.expect("connect")),
        Arc::new(RedisLock::connect(&url).await.expect("connect")),
    ];
    // Per name: who holds it now, and the last token granted.
    let held: Arc<Mutex<HashMap<String, (bool, u64)>>> = Arc::default();
    let until = Instant::now() + Duration::from_secs(4);
    let mut tasks = Vec::new();
    for (c, locks) in clients.iter().enumerate() {
        for t in 0..8u64 {
            let locks = locks.clone();
            let held = held.clone();
            tasks.push(tokio::spawn(async move {
                let mut grants = 0u64;
                let mut i = t;
                while Instant::now() < until {
                    i += 1;
                    let name = format!("churn{}", (i + c as u64) % 4);
                    let opts = AcquireOptions::new()
                        .ttl(Duration::from_secs(30))
                        .wait(Wait::Timeout(Duration::from_secs(10)));
                    let lease = locks.acquire(&name, opts).await.expect("acquire");
                    let token = lease.token().get();
                    {
                        let mut h = held.lock().unwrap();
                        let e = h.entry(name.clone()).or_insert((false, 0));
                        assert!(!e.0, "{name}: two holders at once");
                        assert!(token > e.1, "{name}: token {token} not above {}", e.1);
                        *e = (true, token);
                    }
                    tokio::time::sleep(Duration::from_millis((i * 7919) % 61)).await;
                    assert_eq!(
                        lease.state(),
                        LeaseState::Held,
                        "{name}: lost ({:?}) while held",
                        lease.loss_reason()
                    );
                    held.lock().unwrap().get_mut(&name).expect("held").0 = false;
                    lease.release().await.expect("release");
                    grants += 1;
                }
                grants
            }));
        }
    }
    let mut grants = 0;
    for t in tasks {
        grants += t.await.expect("task");
    }
    eprintln!("{grants} grants");
    until_no_lock_channels(&mut admin, &prefix).await;
}

/// The pub/sub connection killed (`CLIENT KILL TYPE pubsub`) while twenty leases are younger
/// than `WATCH_AFTER` (not subscribed yet): once it is back, every key is subscribed and
/// checked, so keys deleted while it was down and keys deleted after it came back are heard
/// long before a renewal (20 s away), the other leases stay held, and releasing them all
/// leaves no channel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pubsub_killed_while_grants_are_young_loses_no_notice() {
    let server = PrivateRedis::start(None).await;
    let prefix = fresh_prefix();
    let locks = RedisLock::connect(&with_prefix(&server.url(), &prefix))
        .await
        .expect("connect");
    let mut admin = server.raw().await;
    let opts = AcquireOptions::new()
        .ttl(Duration::from_secs(60))
        .wait(Wait::No);
    for round in 0..3 {
        let mut leases = Vec::new();
        for i in 0..20 {
            leases.push(
                locks
                    .acquire(&format!("young{round}-{i}"), opts.clone())
                    .await
                    .expect("acquire"),
            );
        }
        let killed = kill_pubsub_connections(&mut admin).await;
        assert_eq!(
            killed, 1,
            "expected to kill the client's pub/sub connection"
        );
        // Deleted while the connection is down (or coming back).
        for l in leases.iter().step_by(4) {
            let _: i64 = redis::cmd("DEL")
                .arg(locks.lock_key(l.name()))
                .query_async(&mut admin)
                .await
                .expect("DEL");
        }
        for l in leases.iter().step_by(4) {
            until_lost(l, "deleted while the pub/sub connection was down").await;
        }
        // Subscribed again (every key still held): a deletion now is heard by its event.
        for l in leases.iter().skip(2).step_by(4) {
            until_subscribers(&mut admin, &locks.lock_key(l.name()), 1).await;
            let _: i64 = redis::cmd("DEL")
                .arg(locks.lock_key(l.name()))
                .query_async(&mut admin)
                .await
                .expect("DEL");
        }
        for l in leases.iter().skip(2).step_by(4) {
            until_lost(l, "deleted after the pub/sub connection came back").await;
        }
        for (i, l) in leases.iter().enumerate() {
            if i % 2 == 0 {
                assert_eq!(l.loss_reason(), Some(LossReason::NotHeldOnServer), "{i}");
            } else {
                assert_eq!(l.state(), LeaseState::Held, "{i}");
                l.check().await.expect("still held");
            }
        }
        for l in leases {
            let _ = l.release().await;
        }
        until_no_lock_channels(&mut admin, &prefix).await;
    }
}

/// The server stops answering (`DEBUG SLEEP`) while a young lease's channel is being
/// subscribed: the `SUBSCRIBE` times out on the client (response timeout 200 ms), and the
/// lease is released while the server still sleeps. When the server wakes it carries out the
/// `SUBSCRIBE`s it was sent; the channel must still be unsubscribed (a timed-out `SUBSCRIBE`
/// may have been carried out, so the release must not take the channel for unsubscribed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscribe_that_timed_out_during_a_server_sleep_leaves_no_channel() {
    let server = PrivateRedis::start_with(None, &["--enable-debug-command", "yes"]).await;
    let prefix = fresh_prefix();
    let url = format!(
        "{}&response_timeout_ms=200",
        with_prefix(&server.url(), &prefix)
    );
    let locks = RedisLock::connect(&url).await.expect("connect");
    let mut admin = server.raw().await;
    let opts = AcquireOptions::new()
        .ttl(Duration::from_secs(60))
        .wait(Wait::No);
    for round in 0..3 {
        let lease = locks
            .acquire(&format!("asleep{round}"), opts.clone())
            .await
            .expect("acquire");
        // redis-cli waits out the sleep (the redis crate's connection would time out).
        let port = server.port.to_string();
        let sleep = tokio::task::spawn_blocking(move || {
            std::process::Command::new("redis-cli")
                .args(["-p", &port, "DEBUG", "SLEEP", "1.5"])
                .output()
                .expect("redis-cli DEBUG SLEEP")
        });
        // Inside the sleep, after the lease's first SUBSCRIBE (25-50 ms after the grant) timed
        // out (200 ms): a fault's timing, nothing is measured.
        tokio::time::sleep(Duration::from_millis(600)).await;
        // Times out (200 ms) unless the sleep ended first; a timed-out release may or may not
        // run (its connection is replaced), and then the key is left to its TTL.
        let released = lease.release().await;
        let out = sleep.await.expect("sleep task");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            "OK",
            "DEBUG SLEEP"
        );
        until_no_lock_channels(&mut admin, &prefix).await;
        let key: Option<String> = redis::cmd("GET")
            .arg(locks.lock_key(&format!("asleep{round}")))
            .query_async(&mut admin)
            .await
            .expect("GET");
        if released.is_ok() {
            assert_eq!(key, None, "the released lock key is still there");
        }
    }
}

/// A permit's slot key replaced by a hash is not the holder's any more: its release says
/// `NotHeld`, as for a slot key that is gone, not a `WRONGTYPE` backend error, and leaves the
/// hash alone. (The cancel and proclaim scripts read slot keys the same way.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_slot_key_of_another_type_is_released_as_not_ours() {
    use lockkit::Semaphore;
    use lockkit::backend::SlotKind;
    let (_server, locks, mut admin) = private().await;
    let by_hand = by_hand();
    let permit = locks
        .acquire_permit("typed-pool", 1, by_hand)
        .await
        .expect("acquire");
    let key = locks.slot_key(SlotKind::Semaphore, "typed-pool", 0);
    replace_by_hash(&mut admin, &key).await;
    match permit.release().await {
        Err(lockkit::Error::NotHeld { .. }) => {}
        other => panic!("release of a slot key that is a hash now: {other:?}"),
    }
    assert_eq!(key_type(&mut admin, &key).await, "hash");
}

/// A leader's slot key replaced by a hash is not the leader's any more: proclaim and resign say
/// `NotHeld` (their scripts `pcall` the GET), not a `WRONGTYPE` backend error, and leave the
/// hash alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_slot_key_of_another_type_is_not_held_for_proclaim_or_resign() {
    use lockkit::Election;
    use lockkit::backend::SlotKind;
    let (_server, locks, mut admin) = private().await;
    let by_hand = by_hand();
    let mut leader = locks
        .campaign("typed-elect", b"a", by_hand)
        .await
        .expect("campaign");
    let key = locks.slot_key(SlotKind::Election, "typed-elect", 0);
    replace_by_hash(&mut admin, &key).await;
    match leader.proclaim(b"b").await {
        Err(lockkit::Error::NotHeld { .. }) => {}
        other => panic!("proclaim on a slot key that is a hash now: {other:?}"),
    }
    match leader.resign().await {
        Err(lockkit::Error::NotHeld { .. }) => {}
        other => panic!("resign on a slot key that is a hash now: {other:?}"),
    }
    assert_eq!(key_type(&mut admin, &key).await, "hash");
}
