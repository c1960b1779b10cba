//! Lock-delay ([`AcquireOptions::lock_delay`]) on the shared server: a holder that lapses keeps
//! the lock from everyone until the delay after its key expired (renewals move that end along),
//! a release frees it at once, and the FIFO hand-off carries each waiter's delay.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockkit::redis::RedisLock;
use lockkit::redis::redis;
use lockkit::{AcquireOptions, Error, Lease, LeaseState, Lock, Wait, drift_margin};
use tokio::time::Instant;

use super::raw;
use crate::common::{fresh_prefix, server_url, with_prefix};

async fn connect() -> (RedisLock, String) {
    let url = with_prefix(&server_url("LOCKKIT_REDIS_URL"), &fresh_prefix());
    (RedisLock::connect(&url).await.expect("connect"), url)
}

/// A lease with `delay` that nobody renews and that is not released when dropped.
fn lapsing(ttl: Duration, delay: Duration) -> AcquireOptions {
    AcquireOptions::new()
        .ttl(ttl)
        .lock_delay(delay)
        .keepalive(false)
        .release_on_drop(false)
        .wait(Wait::Timeout(Duration::from_secs(20)))
}

fn waiting() -> AcquireOptions {
    AcquireOptions::new()
        .ttl(Duration::from_secs(30))
        .wait(Wait::Timeout(Duration::from_secs(20)))
}

/// The least the client's monotonic clock can see pass while the Redis server's wall clock runs
/// `d`: `d` less the drift margin the library allows between the two clocks (a VM's wall clock
/// is slewed or stepped: CI saw a 2 s key expiry 3.2 ms early by the client's clock).
fn on_the_servers_clock(d: Duration) -> Duration {
    d.saturating_sub(drift_margin(d))
}

/// Drops `lease` without releasing it: it lapses at its TTL.
fn lapse(lease: Lease) {
    assert_eq!(lease.state(), LeaseState::Held);
    drop(lease);
}

/// Waits (bounded, 10 s) until the queue at `key` has `n` entries.
async fn await_queue(conn: &mut redis::aio::MultiplexedConnection, key: &str, n: u64) {
    let start = Instant::now();
    loop {
        let len: u64 = redis::cmd("ZCARD")
            .arg(key)
            .query_async(conn)
            .await
            .expect("ZCARD");
        if len == n {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "queue {key:?} never reached {n} entries"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A holder that lapses: the next grant comes no sooner than TTL + delay after the holder's
/// grant was asked for (its key expired at the earliest TTL after that).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lapsed_holder_keeps_the_lock_from_everyone_for_the_delay() {
    let (locks, _) = connect().await;
    let (ttl, delay) = (Duration::from_millis(300), Duration::from_secs(1));
    let sent = Instant::now();
    lapse(
        locks
            .acquire("lapse", lapsing(ttl, delay))
            .await
            .expect("acquire"),
    );
    let next = locks.acquire("lapse", waiting()).await.expect("next");
    let after = sent.elapsed();
    assert!(
        after >= on_the_servers_clock(ttl + delay),
        "granted {after:?} after the lapsed holder's grant, before TTL + delay"
    );
    next.release().await.expect("release");
}

/// During the delay the lock key is gone, a try-once acquire gets `Held` and a waiter whose
/// timeout ends before the delay does times out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn during_the_delay_try_once_is_held_and_waiters_wait() {
    let (locks, _) = connect().await;
    let (ttl, delay) = (Duration::from_millis(200), Duration::from_secs(3));
    let sent = Instant::now();
    lapse(
        locks
            .acquire("during", lapsing(ttl, delay))
            .await
            .expect("acquire"),
    );
    let short = AcquireOptions::new().wait(Wait::Timeout(ttl + Duration::from_secs(1)));
    match locks.acquire("during", short).await {
        Err(Error::Timeout { .. }) => {}
        other => panic!("expected Timeout during the delay, got {other:?}"),
    }
    assert!(
        locks.holder("during").await.expect("holder").is_none(),
        "the lapsed holder's key has expired"
    );
    match locks
        .acquire("during", AcquireOptions::new().wait(Wait::No))
        .await
    {
        Err(Error::Held { .. }) => {}
        other => panic!("expected Held during the delay, got {other:?}"),
    }
    let next = locks.acquire("during", waiting()).await.expect("next");
    assert!(sent.elapsed() >= on_the_servers_clock(ttl + delay));
    next.release().await.expect("release");
}

/// A release frees the lock at once, delay or not: a try-once acquire right after it is
/// granted, and so is a waiter queued behind the holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_frees_at_once() {
    let (locks, url) = connect().await;
    let delay = Duration::from_secs(30);
    let opts = AcquireOptions::new()
        .lock_delay(delay)
        .wait(Wait::Timeout(Duration::from_secs(20)));
    let first = locks.acquire("rel", opts.clone()).await.expect("acquire");
    first.release().await.expect("release");
    let second = locks
        .acquire("rel", opts.clone().wait(Wait::No))
        .await
        .expect("free at once after a release");

    // A waiter queued behind a holder with a delay is handed the lock by the release.
    let other = RedisLock::connect(&url).await.expect("connect");
    let mut conn = raw(&server_url("LOCKKIT_REDIS_URL")).await;
    let waiter = tokio::spawn(async move { other.acquire("rel", waiting()).await });
    await_queue(&mut conn, &locks.queue_key("rel"), 1).await;
    second.release().await.expect("release");
    let third = waiter.await.expect("waiter").expect("handed over");
    third.release().await.expect("release");
    // The hand-off took the delay key with it: free at once again.
    locks
        .acquire("rel", opts.wait(Wait::No))
        .await
        .expect("free after the waiter's release")
        .release()
        .await
        .expect("release");
}

/// Keepalive renewals move the delay along with the lock key: a kept-alive holder that lapses
/// (dropped without release after its first delay would have ended) still delays the next grant
/// until `delay` after its lease's deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_extend_the_delay() {
    let (locks, _) = connect().await;
    let (ttl, delay) = (Duration::from_millis(300), Duration::from_secs(1));
    let kept = AcquireOptions::new()
        .ttl(ttl)
        .lock_delay(delay)
        .release_on_drop(false);
    let lease = locks.acquire("renew", kept).await.expect("acquire");
    // Held for longer than TTL + delay: only renewals keep it.
    tokio::time::sleep(ttl + delay + Duration::from_millis(200)).await;
    let valid_until = lease.valid_until();
    lapse(lease);
    let next = locks.acquire("renew", waiting()).await.expect("next");
    let now = Instant::now();
    assert!(
        now >= valid_until + on_the_servers_clock(delay),
        "granted {:?} after the kept-alive holder's deadline, before its delay",
        now - valid_until
    );
    next.release().await.expect("release");

    // The same with a renewal by hand.
    let (ttl, delay) = (Duration::from_secs(2), Duration::from_millis(500));
    let lease = locks
        .acquire("renew", lapsing(ttl, delay))
        .await
        .expect("acquire");
    tokio::time::sleep(delay + Duration::from_millis(200)).await;
    lease.renew().await.expect("renew");
    let valid_until = lease.valid_until();
    lapse(lease);
    let next = locks.acquire("renew", waiting()).await.expect("next");
    let now = Instant::now();
    assert!(
        now >= valid_until + on_the_servers_clock(delay),
        "granted {:?} after the renewed holder's deadline, before its delay",
        now - valid_until
    );
    next.release().await.expect("release");
}

/// The FIFO hand-off with delays: waiters are served in queue order, a release hands over at
/// once, and a waiter that was handed the lock and lapses delays the next waiter by its own TTL
/// + delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_hand_off_carries_each_waiters_delay() {
    let (locks, url) = connect().await;
    let name = "fifo";
    let delay = Duration::from_secs(1);
    let w1_ttl = Duration::from_secs(1);
    let mut conn = raw(&server_url("LOCKKIT_REDIS_URL")).await;
    let holder = locks
        .acquire(
            name,
            AcquireOptions::new()
                .ttl(Duration::from_secs(30))
                .lock_delay(delay),
        )
        .await
        .expect("acquire");
    let order = Arc::new(Mutex::new(Vec::new()));

    let c1 = RedisLock::connect(&url).await.expect("connect");
    let o1 = order.clone();
    let w1 = tokio::spawn(async move {
        let lease = c1
            .acquire(name, lapsing(w1_ttl, delay))
            .await
            .expect("first waiter");
        o1.lock().unwrap().push(1);
        lapse(lease);
    });
    await_queue(&mut conn, &locks.queue_key(name), 1).await;

    let c2 = RedisLock::connect(&url).await.expect("connect");
    let o2 = order.clone();
    let w2 = tokio::spawn(async move {
        let lease = c2
            .acquire(name, waiting().lock_delay(delay))
            .await
            .expect("second waiter");
        o2.lock().unwrap().push(2);
        let at = Instant::now();
        lease.release().await.expect("release");
        at
    });
    await_queue(&mut conn, &locks.queue_key(name), 2).await;

    let released = Instant::now();
    holder.release().await.expect("release");
    w1.await.expect("first waiter");
    let second_at = w2.await.expect("second waiter");
    assert_eq!(*order.lock().unwrap(), vec![1, 2]);
    // The first waiter's key was set by the release at the earliest, with its TTL; its delay
    // runs from that key's expiry.
    assert!(
        second_at >= released + on_the_servers_clock(w1_ttl + delay),
        "second waiter granted {:?} after the release, before the first waiter's TTL + delay",
        second_at - released
    );
}
