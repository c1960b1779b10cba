//! Findings of breaker "break2" on etcd (see each test's doc for whether it fails on main).

use std::time::Duration;

use lockkit::etcd::EtcdLock;
use lockkit::etcd::etcd_client::EventType;
use lockkit::{AcquireOptions, Lock, Wait};

use super::support::PrefixWatch;
use crate::common::{fresh_prefix, server_url, with_prefix};

/// FAILS on main (1b8b097). The crate docs (lockkit-etcd/src/lib.rs, "Lock-delay") say: "During
/// a delay `Lock::holder` reports no holder (there is no key)". With a waiter queued during the
/// delay there is a key — the waiter's — and `holder()` reports it as the holder: a token (and a
/// lease TTL) that no one has been granted yet. The CLI's waiting line shows the same ("held with
/// token N" where N is the waiter's own future token).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holder_during_a_delay_with_a_waiter_reports_no_holder() {
    let url = with_prefix(&server_url("LOCKKIT_ETCD_URL"), &fresh_prefix());
    let (a, b, c) = (
        EtcdLock::connect(&url).await.unwrap(),
        EtcdLock::connect(&url).await.unwrap(),
        EtcdLock::connect(&url).await.unwrap(),
    );
    let (ttl, delay) = (Duration::from_secs(2), Duration::from_secs(6));
    let opts = AcquireOptions::new()
        .ttl(ttl)
        .wait(Wait::No)
        .keepalive(false)
        .release_on_drop(false)
        .lock_delay(delay);
    let held = a.acquire("d", opts).await.expect("grant with a delay");
    let mut events = PrefixWatch::new(c.client(), &c.name_prefix("d")).await;
    drop(held);
    events.next(EventType::Delete, ttl * 3).await; // the holder's key lapsed
    let waiter = tokio::spawn(async move {
        let opts = AcquireOptions::new()
            .ttl(Duration::from_secs(5))
            .wait(Wait::Timeout(Duration::from_secs(30)));
        b.acquire("d", opts).await.map(|l| l.token())
    });
    events.next(EventType::Put, Duration::from_secs(5)).await; // the waiter's key
    let during = c.holder("d").await.expect("holder read");
    let granted = waiter.await.unwrap().expect("granted after the delay");
    assert!(
        during.is_none(),
        "holder() during the delay reported {during:?}; the waiter was granted {granted:?} only later"
    );
}
