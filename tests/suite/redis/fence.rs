//! `RedisFence` on the shared server (one test on a private one), made from leases of `lockkit::connect`, and `lease.check()`.

use std::time::Duration;

use lockkit::redis::{RedisFence, RedisLock, redis};
use lockkit::{Error, LeaseState, LockExt};
use tokio::time::Instant;

use crate::common::{
    assert_check_finds_it_freed, assert_foreign, fresh_prefix, refuses_a_memory_lease, server_url,
    with_prefix,
};

const TTL: Duration = Duration::from_secs(30);

fn url() -> String {
    with_prefix(&server_url("LOCKKIT_REDIS_URL"), &fresh_prefix())
}

/// Deletes lock `name`'s key on the server at `server`, behind its holder's back.
async fn delete_lock_key(server: &str, locks: &RedisLock, name: &str) {
    let mut raw = redis::Client::open(server)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let deleted: i64 = redis::cmd("DEL")
        .arg(locks.lock_key(name))
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(deleted, 1, "lock {name:?} was not held");
}

/// A fence made from a lease of `Arc<dyn Lock>` writes; the key is then bound to that lock: a
/// token of another lock is rejected whatever its number, all or nothing, and neither lease is
/// harmed.
#[tokio::test]
async fn fence_from_a_connected_lease_binds_keys_to_its_lock() {
    let locks = lockkit::connect(&url()).await.expect("connect");
    let key = format!("{}-data", fresh_prefix());
    let fresh = format!("{key}-fresh");
    let x = locks.try_acquire("x", TTL).await.expect("acquire x");
    let fence_x = RedisFence::from_lease(&x).expect("a redis lease");
    fence_x.set(&key, "by x").await.expect("x writes");
    assert_eq!(
        fence_x.get(&key).await.unwrap().as_deref(),
        Some(&b"by x"[..])
    );

    // Acquired later: its number is larger than x's.
    let y = locks.try_acquire("y", TTL).await.expect("acquire y");
    let fence_y = RedisFence::from_lease(&y).expect("a redis lease");
    assert_foreign(
        fence_y
            .set_all([(fresh.as_str(), "by y"), (key.as_str(), "by y")])
            .await,
        &key,
        &x.token(),
        &y.token(),
    );
    assert_eq!(
        fence_y.get(&fresh).await.unwrap(),
        None,
        "not all or nothing"
    );
    assert_eq!(
        fence_x.get(&key).await.unwrap().as_deref(),
        Some(&b"by x"[..])
    );
    // Nor can it rebind the key by writing its guard record.
    let rebind = fence_y
        .set(&fence_y.guard_key(&key), y.token().lock())
        .await;
    assert!(
        matches!(rebind, Err(Error::InvalidConfig { .. })),
        "{rebind:?}"
    );
    assert_eq!(y.state(), LeaseState::Held);
    fence_x
        .set(&key, "by x again")
        .await
        .expect("x not locked out");
    x.release().await.expect("release");
    y.release().await.expect("release");

    refuses_a_memory_lease(RedisFence::from_lease).await;
}

/// The server frees A's lock behind its back (here: its key is deleted), B gets the lock and
/// writes; A's own write is then rejected as stale, and A's lease is Lost at once, not at its
/// deadline. On a server without `CONFIG` (no keyspace notifications), so that A cannot hear
/// of the deletion before its write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_stale_write_loses_the_lease() {
    let server = super::PrivateRedis::start_with(None, &["--rename-command", "CONFIG", ""]).await;
    let url = with_prefix(&server.url(), &fresh_prefix());
    let locks = RedisLock::connect(&url).await.expect("connect");
    let (a, b) = (
        lockkit::connect(&url).await.unwrap(),
        lockkit::connect(&url).await.unwrap(),
    );
    let key = format!("{}-data", fresh_prefix());
    let lease_a = a.try_acquire("s", TTL).await.expect("A acquires");
    let fence_a = RedisFence::from_lease(&lease_a).unwrap();
    fence_a.set(&key, "A1").await.expect("A writes");

    assert_eq!(locks.loss_notice(), None);
    delete_lock_key(&server.url(), &locks, "s").await;
    let lease_b = b.try_acquire("s", TTL).await.expect("B acquires");
    assert!(lease_b.token() > lease_a.token());
    RedisFence::from_lease(&lease_b)
        .unwrap()
        .set(&key, "B1")
        .await
        .expect("B writes");

    assert_eq!(lease_a.state(), LeaseState::Held, "A cannot know yet");
    match fence_a.set(&key, "A2").await {
        Err(Error::StaleToken { token, current, .. }) => {
            assert_eq!(token, lease_a.token());
            assert_eq!(current, lease_b.token());
        }
        other => panic!("A's stale write: expected StaleToken, got {other:?}"),
    }
    assert_eq!(lease_a.state(), LeaseState::Lost);
    assert!(lease_a.valid_until() > Instant::now() + TTL / 2);
    assert_eq!(
        fence_a.get(&key).await.unwrap().as_deref(),
        Some(&b"B1"[..])
    );
    // Equal tokens pass: B writes again.
    RedisFence::from_lease(&lease_b)
        .unwrap()
        .set(&key, "B2")
        .await
        .expect("B writes again");
    lease_b.release().await.expect("release");
}

/// `check` asks the server: once the lock key is gone, the lease is NotHeld and Lost at once.
#[tokio::test]
async fn check_sees_a_lock_freed_behind_the_leases_back() {
    let url = url();
    let locks = RedisLock::connect(&url).await.expect("connect");
    let lease = locks.try_acquire("c", TTL).await.expect("acquire");
    lease.check().await.expect("held");
    delete_lock_key(&server_url("LOCKKIT_REDIS_URL"), &locks, "c").await;
    assert_check_finds_it_freed(&lease, TTL).await;
}
