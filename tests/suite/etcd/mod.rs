//! etcd backend: the contract suite on the shared single-member etcd (`LOCKKIT_ETCD_URL`), bad
//! connects, and failure tests on private etcd processes (`cluster`, `failures`).

mod break_slots;
mod cluster;
mod delay;
mod failures;
mod fence;
mod handoff;
mod holder_during_delay;
mod slots;
mod support;

use std::time::Duration;

use lockkit::Error;

use crate::common::{UrlHarness, server_url};

/// The contract harness: `short_ttl` must exceed 3 × `expiry_slack` (the suite's renewal test
/// renews 4 × TTL/3 and needs to outlive the first TTL plus the slack), and etcd's slack is
/// `max(1 s, minimum TTL) + 0.5 s` — so 5 s on the project's etcd (minimum TTL 1 s).
pub async fn harness() -> UrlHarness {
    use lockkit::contract::Harness;
    let mut h = UrlHarness::from_env("LOCKKIT_ETCD_URL");
    let slack = h.client().await.guarantees().expiry_slack;
    h.short_ttl = Duration::from_secs_f64((3.0 * slack.as_secs_f64() + 0.5).ceil());
    h.tolerance = Duration::from_secs(2);
    h
}

mod contract {
    lockkit::contract_suite!(super::harness().await);
}

#[tokio::test]
async fn connect_plain_url_and_guarantees() {
    let url = server_url("LOCKKIT_ETCD_URL");
    let locks = lockkit::connect(&url)
        .await
        .expect("connect etcd://host:port");
    let g = locks.guarantees();
    assert_eq!(g.backend, "etcd");
    assert_eq!(g.kind, lockkit::LockKind::Correctness);
    assert!(g.tokens_survive_restart && g.safe_across_failover && g.fifo_waiters);
    assert!(g.manual_renewal && g.lock_delay);
    assert!(g.expiry_slack >= Duration::from_millis(1500));
}

#[tokio::test]
async fn malformed_urls_are_invalid_config() {
    for url in [
        "etcd://",
        "etcd://127.0.0.1:notaport",
        "etcd://127.0.0.1:2379/some/path",
        "etcd://127.0.0.1:2379?prefix=",
        "etcd://127.0.0.1:2379?prefix=a/b",
        "etcd://127.0.0.1:2379?nosuch=1",
        "etcd://127.0.0.1:2379?tls=true",
        "etcd://user:hunter2@127.0.0.1:99999",
        "etcd://127.0.0.1:0",
        "etcd://127.0.0.1:2379?prefix=a&prefix=b",
        "etcd://127.0.0.1:2379?prefix=..",
    ] {
        let start = std::time::Instant::now();
        match lockkit::connect(url).await {
            Err(Error::InvalidConfig { reason, .. }) => {
                assert!(!reason.contains("hunter2"), "password echoed: {reason}")
            }
            other => panic!("{url}: expected InvalidConfig, got {other:?}"),
        }
        assert!(start.elapsed() < Duration::from_secs(1));
    }
}

#[tokio::test]
async fn unreachable_is_unavailable_quickly() {
    // A port nobody listens on.
    let port = crate::common::free_port();
    let start = std::time::Instant::now();
    match lockkit::connect(&format!("etcd://127.0.0.1:{port}")).await {
        Err(e @ Error::Unavailable { .. }) => {
            assert!(e.is_retryable());
            // Plain words naming the endpoint, not the gRPC status and tonic's error chain.
            let msg = e.to_string();
            assert!(
                msg.contains(&format!(
                    "could not connect to etcd at http://127.0.0.1:{port}: "
                )) && msg.contains("refused"),
                "{msg}"
            );
            assert!(!msg.contains("tonic") && !msg.contains("grpc"), "{msg}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(
        start.elapsed() < Duration::from_secs(6),
        "took {:?}",
        start.elapsed()
    );
    // A server that accepts connections and never answers: the connect timeout ends it.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let silent = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((sock, _)) = listener.accept().await {
            held.push(sock);
        }
    });
    let url = format!("etcd://127.0.0.1:{port}?connect_timeout_ms=500");
    let start = std::time::Instant::now();
    match lockkit::connect(&url).await {
        Err(e @ Error::Unavailable { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains(&format!("127.0.0.1:{port}")), "{msg}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(start.elapsed() < Duration::from_secs(3));
    silent.abort();
}

/// Out-of-range durations in the config are refused at connect (they used to overflow an
/// instant in a background task, which then lost every lock on its lease).
#[tokio::test]
async fn huge_durations_are_invalid_config() {
    use lockkit::etcd::{EtcdConfig, EtcdLock};
    let url = server_url("LOCKKIT_ETCD_URL");
    let base = || EtcdConfig::from_url(&url).expect("valid URL");
    for (what, cfg) in [
        ("linger", base().lease_linger(Some(Duration::MAX))),
        ("request timeout", base().request_timeout(Duration::MAX)),
        ("connect timeout", base().connect_timeout(Duration::MAX)),
    ] {
        match EtcdLock::connect_with(cfg).await {
            Err(Error::InvalidConfig { .. }) => {}
            other => panic!("{what}: expected InvalidConfig, got {other:?}"),
        }
    }
    // The longest accepted linger works: a released lock's lease lingers, nothing panics.
    let locks = EtcdLock::connect_with(base().lease_linger(Some(lockkit::MAX_TTL)))
        .await
        .expect("24 h linger is valid");
    use lockkit::LockExt;
    let name = format!("linger-{}", crate::common::fresh_prefix());
    let lease = locks
        .try_acquire(&name, Duration::from_secs(2))
        .await
        .unwrap();
    lease.release().await.unwrap();
    // The keepalive task ticks (every TTL/3) while the lease is idle and lingering...
    tokio::time::sleep(Duration::from_secs(1)).await;
    // ...and still renews it for the next lock on it, past its TTL.
    let again = locks
        .try_acquire(&name, Duration::from_secs(2))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_ne!(again.state(), lockkit::LeaseState::Lost);
    again.release().await.unwrap();
}

/// With one of two endpoints dead (nothing listens), connect, acquire, renew and release all
/// succeed: each request that lands on the dead endpoint is retried within its timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_dead_endpoint_is_tolerated() {
    use lockkit::Lock;
    use lockkit::etcd::EtcdLock;
    let live = server_url("LOCKKIT_ETCD_URL");
    let live = live.trim_start_matches("etcd://");
    let dead = format!("127.0.0.1:{}", crate::common::free_port());
    let url = format!(
        "etcd://{dead},{live}?prefix={}",
        crate::common::fresh_prefix()
    );
    for i in 0..8 {
        let locks = EtcdLock::connect(&url)
            .await
            .unwrap_or_else(|e| panic!("connect {i} with one dead endpoint: {e:?}"));
        let name = format!("dead-endpoint-{i}");
        let opts = lockkit::AcquireOptions::new()
            .ttl(Duration::from_secs(5))
            .keepalive(i % 2 == 0)
            .wait(lockkit::Wait::Timeout(Duration::from_secs(5)));
        let lease = locks.acquire(&name, opts).await.expect("acquire");
        lease.renew().await.expect("renew");
        lease.release().await.expect("release");
    }
}

/// Credentials for a server without authentication are a configuration error, at connect.
#[tokio::test]
async fn credentials_without_server_auth_are_invalid_config() {
    let url = server_url("LOCKKIT_ETCD_URL");
    let ep = url.trim_start_matches("etcd://");
    match lockkit::connect(&format!("etcd://someone:s3cret-pw@{ep}")).await {
        Err(Error::InvalidConfig { reason, .. }) => assert!(!reason.contains("s3cret-pw")),
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}

/// Credentials for an etcd without authentication enabled (the shared test server) are refused
/// with an `InvalidConfig` that says so, and how to fix it, without the password; it used to say
/// only "etcd client rejected the configuration".
#[tokio::test]
async fn credentials_for_a_server_without_auth_say_so() {
    const SECRET: &str = "pw-Hunter2-etcd";
    let url =
        server_url("LOCKKIT_ETCD_URL").replacen("etcd://", &format!("etcd://app:{SECRET}@"), 1);
    match lockkit::connect(&url).await {
        Err(e @ Error::InvalidConfig { .. }) => {
            let shown = format!("{e} | {e:#} | {e:?}");
            assert!(!shown.contains(SECRET), "password echoed: {shown}");
            let text = e.to_string();
            assert!(
                text.contains("authentication is not enabled on the etcd server"),
                "{text}"
            );
            assert!(text.contains("without user and password"), "{text}");
        }
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}
