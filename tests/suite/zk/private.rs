//! Tests on a private ZooKeeper server: restarts and container-node cleanup.

use std::time::Duration;

use lockkit::LockExt;
use lockkit::zk::ZkLock;
use lockkit::zk::zookeeper_client as zk;

use super::server::PrivateZk;

const TTL: Duration = Duration::from_secs(10);

/// Fencing tokens keep growing after the server is SIGKILLed and restarted (czxid: the zxid
/// epoch and counter come back from the fsynced transaction log).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_survive_server_restart() {
    let mut server = PrivateZk::start("").await;
    let name = "restart";
    let before = {
        let locks = ZkLock::connect(&server.url()).await.expect("connect");
        let lease = locks.try_acquire(name, TTL).await.expect("acquire");
        let t = lease.token();
        lease.release().await.expect("release");
        t
    };
    server.kill_and_restart().await;
    let locks = ZkLock::connect(&server.url()).await.expect("reconnect");
    let lease = locks
        .try_acquire(name, TTL)
        .await
        .expect("acquire after restart");
    assert!(
        lease.token() > before,
        "token {} after restart is not above {} before",
        lease.token(),
        before
    );
    lease.release().await.expect("release");
}

/// A lock's container node is removed by the server once empty; the next acquire re-creates it
/// and its sequence numbers restart at 0, but the token (czxid) still grows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_lock_nodes_are_removed_and_tokens_still_grow() {
    let server = PrivateZk::start("-Dznode.container.checkIntervalMs=100").await;
    let locks = ZkLock::connect(&format!("{}?prefix=locks", server.url()))
        .await
        .expect("connect");
    let raw = zk::Client::connect(&format!("127.0.0.1:{}", server.port))
        .await
        .expect("raw client");
    let name = "container";
    let dir = locks.lock_dir(name).unwrap();

    let first = locks.try_acquire(name, TTL).await.expect("acquire");
    let t1 = first.token();
    first.release().await.expect("release");
    // Await the server's removal of the empty container (a watch, not polling).
    let (stat, watcher) = raw.check_and_watch_stat(&dir).await.expect("exists");
    if stat.is_some() {
        let event = tokio::time::timeout(Duration::from_secs(30), watcher.changed())
            .await
            .expect("the empty lock node was never removed");
        assert_eq!(event.event_type, zk::EventType::NodeDeleted);
    }
    assert!(raw.check_stat(&dir).await.unwrap().is_none());

    let second = locks.try_acquire(name, TTL).await.expect("acquire again");
    let nodes = locks.contenders(name).await.unwrap();
    assert!(
        nodes[0].ends_with("-lock-0000000000"),
        "sequence did not restart: {nodes:?}"
    );
    assert!(second.token() > t1, "{} !> {}", second.token(), t1);
    second.release().await.expect("release");
}
