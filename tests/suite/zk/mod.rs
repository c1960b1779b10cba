//! ZooKeeper backend: the contract suite against the shared server (`LOCKKIT_ZK_URL`), bad
//! connects, and ZooKeeper's own failure modes through a test proxy (session expiry of a frozen
//! holder, a create whose reply is lost, the herd check).

mod contract {
    use std::time::Duration;

    use crate::common::UrlHarness;

    fn harness() -> UrlHarness {
        let mut h = UrlHarness::from_env("LOCKKIT_ZK_URL");
        // The shared server's minSessionTimeout is 1 s; 2 s leaves room for tick rounding.
        h.short_ttl = Duration::from_secs(2);
        h.tolerance = Duration::from_secs(2);
        h
    }

    lockkit::contract_suite!(harness());
}

/// `ZkLock::min_ttl` reports the server's minSessionTimeout (1 s on the shared test server),
/// and a lease of that TTL is granted.
#[tokio::test]
async fn min_ttl_is_the_servers_min_session_timeout() {
    use lockkit::LockExt;
    let url = crate::common::with_prefix(
        &crate::common::server_url("LOCKKIT_ZK_URL"),
        &crate::common::fresh_prefix(),
    );
    let locks = lockkit::zk::ZkLock::connect(&url).await.expect("connect");
    let min = locks.min_ttl().await.expect("min_ttl");
    assert_eq!(min, std::time::Duration::from_secs(1));
    let lease = locks
        .try_acquire("min-ttl", min)
        .await
        .expect("a lease of the minimum TTL");
    assert_eq!(lease.ttl(), min);
    lease.release().await.expect("release");
}

mod break_slots;
mod ensemble;
mod failures;
mod fence;
mod private;
mod sasl;
mod server;
mod slots;
