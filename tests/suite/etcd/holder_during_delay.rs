//! `Lock::holder` during a lock-delay: a waiter sitting out a failed holder's delay is not reported as the holder.

use std::time::Duration;

use lockkit::etcd::EtcdLock;
use lockkit::etcd::etcd_client::EventType;
use lockkit::{AcquireOptions, Lock, Wait};

use super::support::PrefixWatch;
use crate::common::{fresh_prefix, server_url, with_prefix};

/// During a delay `Lock::holder` reports no holder (the crate docs, "Lock-delay"), also with a
/// waiter queued: its key is first in line but it holds nothing yet (before the fix `holder()`
/// reported the waiter's future token and lease TTL, and the CLI printed "held with token N").
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
