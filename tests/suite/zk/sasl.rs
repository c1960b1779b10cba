//! SASL DIGEST-MD5 against the shared server that requires it (`LOCKKIT_ZK_SASL_URL`: JAAS
//! `DigestLoginModule`, `enforce.auth.schemes=sasl`, user `app`).

use std::time::Duration;

use lockkit::zk::zookeeper_client as zk;
use lockkit::zk::{ZkConfig, ZkFence, ZkLock};
use lockkit::{Error, LockExt};
use tokio::time::Instant;

use crate::common::{UrlHarness, fresh_prefix, server_url, with_prefix};

const TTL: Duration = Duration::from_secs(10);

fn sasl_url() -> String {
    server_url("LOCKKIT_ZK_SASL_URL")
}

/// `sasl_url()` with its password replaced by `password`.
fn with_password(password: &str) -> String {
    let url = sasl_url();
    assert!(
        url.contains(":secret@"),
        "LOCKKIT_ZK_SASL_URL is zk://app:secret@…"
    );
    url.replace(":secret@", &format!(":{password}@"))
}

fn harness() -> UrlHarness {
    UrlHarness::from_env("LOCKKIT_ZK_SASL_URL")
}

#[tokio::test]
async fn acquire_release_over_sasl() {
    lockkit::contract::acquire_release(&harness()).await;
}

#[tokio::test]
async fn try_acquire_while_held_over_sasl() {
    lockkit::contract::try_acquire_while_held(&harness()).await;
}

#[tokio::test]
async fn fenced_counter_over_sasl() {
    lockkit::contract::fenced_counter(&harness(), 3, 5).await;
}

/// Lock nodes of a SASL client are creator-only, for the identity `sasl:app`.
#[tokio::test]
async fn lock_nodes_belong_to_the_sasl_identity() {
    let locks = ZkLock::connect(&with_prefix(&sasl_url(), &fresh_prefix()))
        .await
        .expect("connect over SASL");
    let lease = locks.try_acquire("acl", TTL).await.expect("acquire");
    let node = format!(
        "{}/{}",
        locks.lock_dir("acl").unwrap(),
        locks.contenders("acl").await.unwrap()[0]
    );
    let cfg = ZkConfig::from_url(&sasl_url()).unwrap();
    let raw = zk::Client::connector()
        .with_sasl(zk::SaslOptions::digest_md5("app", "secret"))
        .connect(&cfg.connect_string())
        .await
        .expect("raw SASL client");
    let (acls, _) = raw.get_acl(&node).await.expect("get acl");
    assert_eq!(acls.len(), 1, "{acls:?}");
    assert_eq!(acls[0].scheme(), "sasl");
    assert_eq!(acls[0].id(), "app");
    let fence = ZkFence::from_lease(&lease).expect("zk lease");
    fence
        .write(&format!("/{}-data", fresh_prefix()), b"x")
        .await
        .expect("fenced write over SASL");
    lease.release().await.expect("release");
}

/// A wrong password is refused by the server: `Error::Auth`, within the connect timeout (no
/// hang, no retry loop), and neither the wrong nor the right password shows in the error.
#[tokio::test]
async fn wrong_password_is_auth_error_at_once() {
    let url = format!("{}&connect_timeout=3s", with_password("wrong-pw-4711"));
    let started = Instant::now();
    let res = tokio::time::timeout(Duration::from_secs(10), ZkLock::connect(&url))
        .await
        .expect("connect with a wrong password hung");
    let err = res.expect_err("a wrong SASL password was accepted");
    assert!(matches!(err, Error::Auth { .. }), "{err:?}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "refused only after {:?} (the connect timeout is 3 s)",
        started.elapsed()
    );
    let shown = format!("{err} {err:?} {err:#}");
    assert!(
        !shown.contains("wrong-pw-4711") && !shown.contains("secret"),
        "{shown}"
    );
}

/// The server requires SASL: a client without credentials is refused with `Error::Auth`.
#[tokio::test]
async fn no_credentials_on_a_sasl_only_server_is_auth_error() {
    let url = sasl_url()
        .replace("app:secret@", "")
        .replace("?sasl=digest-md5", "");
    let res = tokio::time::timeout(Duration::from_secs(10), ZkLock::connect(&url))
        .await
        .expect("connect without credentials hung");
    assert!(matches!(res, Err(Error::Auth { .. })), "{res:?}");
}

/// The password shows neither in the config's nor in the lock's `Debug`.
#[tokio::test]
async fn password_not_in_debug() {
    let locks = ZkLock::connect(&sasl_url()).await.expect("connect");
    let shown = format!("{locks:?} {:?}", locks.config());
    assert!(!shown.contains("secret"), "{shown}");
    assert!(shown.contains("app"), "{shown}");
}

/// SASL against a server that has no SASL configured (the plain shared server): refused with
/// `Error::Auth` within the connect timeout, never a hang.
#[tokio::test]
async fn sasl_against_a_server_without_sasl_is_auth_error() {
    let plain = server_url("LOCKKIT_ZK_URL");
    let host = plain.strip_prefix("zk://").expect("zk://host:port");
    let url = format!("zk://app:secret@{host}?sasl=digest-md5&connect_timeout=3s");
    let res = tokio::time::timeout(Duration::from_secs(10), ZkLock::connect(&url))
        .await
        .expect("connect hung");
    assert!(matches!(res, Err(Error::Auth { .. })), "{res:?}");
}
