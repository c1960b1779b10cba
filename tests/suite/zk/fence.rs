//! `ZkFence` on the shared server, made from leases of `lockkit::connect`, and `lease.check()`.

use std::time::Duration;

use lockkit::zk::zookeeper_client as zk;
use lockkit::zk::{ZkFence, ZkLock};
use lockkit::{Error, LeaseState, LockExt};
use tokio::time::Instant;

use crate::common::{
    assert_check_finds_it_freed, assert_foreign, fresh_prefix, refuses_a_memory_lease, server_url,
    with_prefix,
};

const TTL: Duration = Duration::from_secs(20);

async fn raw() -> zk::Client {
    let url = server_url("LOCKKIT_ZK_URL");
    let hostport = url.strip_prefix("zk://").expect("zk://host:port");
    zk::Client::connect(hostport).await.expect("raw connect")
}

/// Deletes the node of lock `name`'s holder, behind the holder's back.
async fn delete_holder_node(locks: &ZkLock, name: &str) {
    let holder = locks.contenders(name).await.unwrap();
    let node = format!("{}/{}", locks.lock_dir(name).unwrap(), holder[0]);
    raw()
        .await
        .delete(&node, None)
        .await
        .expect("delete the lock node");
}

/// A fence made from a lease of `Arc<dyn Lock>` writes (creating the node); the node is then
/// bound to that lock (its guard record names it): another lock's holder is rejected and
/// neither lease is harmed.
#[tokio::test]
async fn fence_from_a_connected_lease_binds_nodes_to_its_lock() {
    let prefix = fresh_prefix();
    let url = with_prefix(&server_url("LOCKKIT_ZK_URL"), &prefix);
    let locks = lockkit::connect(&url).await.expect("connect");
    let data = format!("/{prefix}-data");

    let x = locks.try_acquire("x", TTL).await.expect("acquire x");
    let fence_x = ZkFence::from_lease(&x).expect("a zk lease");
    fence_x.write(&data, b"by x").await.expect("x creates");
    fence_x.write(&data, b"by x, 2").await.expect("x writes");
    let (guard, _) = raw()
        .await
        .get_data(&fence_x.guard_path(&data))
        .await
        .unwrap();
    assert_eq!(guard, x.token().lock().as_bytes());

    let y = locks.try_acquire("y", TTL).await.expect("acquire y");
    let fence_y = ZkFence::from_lease(&y).expect("a zk lease");
    assert_foreign(
        fence_y.write(&data, b"by y").await,
        &data,
        &x.token(),
        &y.token(),
    );
    assert_eq!(
        fence_y.read(&data).await.unwrap().as_deref(),
        Some(&b"by x, 2"[..])
    );
    // Nor can it rebind the node by writing its guard record.
    let rebind = fence_y
        .write(&fence_y.guard_path(&data), y.token().lock().as_bytes())
        .await;
    assert!(
        matches!(rebind, Err(Error::InvalidConfig { .. })),
        "{rebind:?}"
    );
    assert_eq!(y.state(), LeaseState::Held);
    fence_x
        .write(&data, b"by x, 3")
        .await
        .expect("x not locked out");
    x.release().await.expect("release");
    y.release().await.expect("release");

    refuses_a_memory_lease(ZkFence::from_lease).await;
}

/// A's lock node is deleted behind its back: A's next fenced write is rejected as stale and its
/// lease is Lost at once, not at its deadline.
#[tokio::test]
async fn own_stale_write_loses_the_lease() {
    let prefix = fresh_prefix();
    let url = with_prefix(&server_url("LOCKKIT_ZK_URL"), &prefix);
    let locks = lockkit::connect(&url).await.expect("connect");
    let inspect = ZkLock::connect(&url).await.expect("connect");
    let data = format!("/{prefix}-data");
    let lease = locks.try_acquire("s", TTL).await.expect("acquire");
    let fence = ZkFence::from_lease(&lease).unwrap();
    fence.write(&data, b"1").await.expect("write");

    delete_holder_node(&inspect, "s").await;
    // The watch on the lease's own node may tell it first; either way the write is refused.
    let told = lease.state() == LeaseState::Lost;
    match fence.write(&data, b"2").await {
        Err(Error::StaleToken { token, .. }) => assert_eq!(token, lease.token()),
        Err(Error::LeaseLost { .. }) if told => {}
        other => panic!("a write of a lease whose node is gone: {other:?}"),
    }
    assert_eq!(lease.state(), LeaseState::Lost);
    assert!(lease.valid_until() > Instant::now() + TTL / 2);
    assert_eq!(fence.read(&data).await.unwrap().as_deref(), Some(&b"1"[..]));
    let _ = lease.release().await;
}

/// `check` asks the server: once the lock node is gone, the lease is NotHeld and Lost at once.
#[tokio::test]
async fn check_sees_a_lock_freed_behind_the_leases_back() {
    let url = with_prefix(&server_url("LOCKKIT_ZK_URL"), &fresh_prefix());
    let locks = ZkLock::connect(&url).await.expect("connect");
    let lease = locks.try_acquire("c", TTL).await.expect("acquire");
    lease.check().await.expect("held");
    delete_holder_node(&locks, "c").await;
    assert_check_finds_it_freed(&lease, TTL).await;
}
