//! `EtcdFence` on the shared server, made from leases of `lockkit::connect`, and `lease.check()`.

use std::time::Duration;

use lockkit::etcd::etcd_client::GetOptions;
use lockkit::etcd::{EtcdFence, EtcdLock};
use lockkit::{Error, LeaseState, LockExt};
use tokio::time::Instant;

use crate::common::{
    assert_check_finds_it_freed, assert_foreign, fresh_prefix, refuses_a_memory_lease, server_url,
    with_prefix,
};

const TTL: Duration = Duration::from_secs(30);

/// A fence made from a lease of `Arc<dyn Lock>` writes; the key is then bound to that lock (its
/// guard record names it): another lock's holder is rejected, all or nothing, and neither lease
/// is harmed.
#[tokio::test]
async fn fence_from_a_connected_lease_binds_keys_to_its_lock() {
    let prefix = fresh_prefix();
    let url = with_prefix(&server_url("LOCKKIT_ETCD_URL"), &prefix);
    let locks = lockkit::connect(&url).await.expect("connect");
    let raw = EtcdLock::connect(&url).await.expect("connect");
    let mut kv = raw.client().kv_client();
    let key = format!("{prefix}-data/report");
    let fresh = format!("{prefix}-data/fresh");

    let x = locks.try_acquire("x", TTL).await.expect("acquire x");
    let fence_x = EtcdFence::from_lease(&x).expect("an etcd lease");
    fence_x.put(key.clone(), "by x").await.expect("x writes");
    let guard = kv
        .get(fence_x.guard_key(key.as_bytes()), None)
        .await
        .unwrap();
    assert_eq!(guard.kvs()[0].value(), x.token().lock().as_bytes());

    let y = locks.try_acquire("y", TTL).await.expect("acquire y");
    let fence_y = EtcdFence::from_lease(&y).expect("an etcd lease");
    assert_foreign(
        fence_y
            .put_all([(fresh.clone(), "by y"), (key.clone(), "by y")])
            .await,
        &key,
        &x.token(),
        &y.token(),
    );
    match fence_y.delete(key.clone()).await {
        Err(Error::ForeignToken { .. }) => {}
        other => panic!("a fenced delete under another lock: {other:?}"),
    }
    let fresh_now = kv
        .get(fresh.clone(), Some(GetOptions::new().with_count_only()))
        .await
        .unwrap();
    assert_eq!(fresh_now.count(), 0, "not all or nothing");
    let now = kv.get(key.clone(), None).await.unwrap();
    assert_eq!(now.kvs()[0].value(), b"by x");
    // Nor can it rebind the key by writing its guard record.
    let rebind = fence_y
        .put(fence_y.guard_key(key.as_bytes()), y.token().lock())
        .await;
    assert!(
        matches!(rebind, Err(Error::InvalidConfig { .. })),
        "{rebind:?}"
    );
    assert_eq!(y.state(), LeaseState::Held);
    fence_x
        .put(key.clone(), "by x again")
        .await
        .expect("x not locked out");
    fence_y
        .put(fresh, "by y")
        .await
        .expect("y writes its own key");
    x.release().await.expect("release");
    y.release().await.expect("release");

    refuses_a_memory_lease(EtcdFence::from_lease).await;
}

/// A's key is deleted behind its back (as a revoke would): A's next fenced write is rejected as
/// stale and its lease is Lost at once, not at its deadline.
#[tokio::test]
async fn own_stale_write_loses_the_lease() {
    let prefix = fresh_prefix();
    let url = with_prefix(&server_url("LOCKKIT_ETCD_URL"), &prefix);
    let locks = lockkit::connect(&url).await.expect("connect");
    let raw = EtcdLock::connect(&url).await.expect("connect");
    let key = format!("{prefix}-data/report");
    let lease = locks.try_acquire("s", TTL).await.expect("acquire");
    let fence = EtcdFence::from_lease(&lease).unwrap();
    fence.put(key.clone(), "1").await.expect("write");

    let mut kv = raw.client().kv_client();
    kv.delete(
        raw.name_prefix("s"),
        Some(lockkit::etcd::etcd_client::DeleteOptions::new().with_prefix()),
    )
    .await
    .unwrap();
    // The watch on the lease's own key may tell it first; either way the write is refused.
    let told = lease.state() == LeaseState::Lost;
    match fence.put(key.clone(), "2").await {
        Err(Error::StaleToken { token, .. }) => assert_eq!(token, lease.token()),
        Err(Error::LeaseLost { .. }) if told => {}
        other => panic!("a write of a lease whose key is gone: {other:?}"),
    }
    assert_eq!(lease.state(), LeaseState::Lost);
    assert!(lease.valid_until() > Instant::now() + TTL / 2);
    let now = kv.get(key, None).await.unwrap();
    assert_eq!(now.kvs()[0].value(), b"1");
    let _ = lease.release().await;
}

/// `check` asks the server: once the lease's key is gone, the lease is NotHeld and Lost at once.
#[tokio::test]
async fn check_sees_a_lock_freed_behind_the_leases_back() {
    let url = with_prefix(&server_url("LOCKKIT_ETCD_URL"), &fresh_prefix());
    let locks = EtcdLock::connect(&url).await.expect("connect");
    let lease = locks.try_acquire("c", TTL).await.expect("acquire");
    lease.check().await.expect("held");
    locks
        .client()
        .kv_client()
        .delete(
            locks.name_prefix("c"),
            Some(lockkit::etcd::etcd_client::DeleteOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    assert_check_finds_it_freed(&lease, TTL).await;
}
