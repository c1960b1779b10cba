//! The hand-off to the next waiter: taken from the watch event alone when the released key was
//! the only one ahead and its grant puts no lock-delay marker; read again otherwise; never on a
//! waiter key deleted at or before the hand-off.

use std::time::Duration;

use lockkit::etcd::etcd_client::{DeleteOptions, EventType};
use lockkit::etcd::{EtcdLock, WaitStats};
use lockkit::{AcquireOptions, Lease, Lock, LockExt};

use super::support::PrefixWatch;
use crate::common::{fresh_prefix, server_url, with_prefix};

const TOLERANCE: Duration = Duration::from_secs(5);
const TTL: Duration = Duration::from_secs(30);

async fn client(url: &str) -> EtcdLock {
    EtcdLock::connect(url).await.expect("connect")
}

/// Starts a waiting acquire of `name` on `w` and returns once it watches the queue.
async fn queue(w: &EtcdLock, name: &str) -> tokio::task::JoinHandle<lockkit::Result<Lease>> {
    let mut stats = w.wait_stats();
    let (l, n) = (w.clone(), name.to_owned());
    let join = tokio::spawn(async move { l.acquire(&n, AcquireOptions::new().ttl(TTL)).await });
    tokio::time::timeout(TOLERANCE, stats.wait_for(|s| s.waiting == 1))
        .await
        .expect("the waiter never watched the queue")
        .expect("stats");
    join
}

fn stats(l: &EtcdLock) -> WaitStats {
    *l.wait_stats().borrow()
}

async fn granted(join: tokio::task::JoinHandle<lockkit::Result<Lease>>) -> Lease {
    tokio::time::timeout(TOLERANCE, join)
        .await
        .expect("the waiter was not handed the lock")
        .expect("task")
        .expect("acquire")
}

/// Three queued waiters (each its own client) get the lock in queue order, each from the
/// delete of the key ahead alone: no waiter reads the queue again after its wake (the one two
/// places back reads when the holder goes, before its own turn). Fails if a hand-off needs
/// the read after the watch event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_waiters_are_handed_the_lock_in_order_from_the_watch_event() {
    let url = with_prefix(&server_url("LOCKKIT_ETCD_URL"), &fresh_prefix());
    let h = client(&url).await;
    let held = h.try_acquire("q", TTL).await.expect("acquire");
    let mut waiters = Vec::new();
    for _ in 0..3 {
        let w = client(&url).await;
        let join = queue(&w, "q").await;
        waiters.push((w, join));
    }
    let mut token = held.token();
    held.release().await.expect("release");
    for (w, join) in waiters {
        let lease = granted(join).await;
        assert!(lease.token() > token, "not in queue order");
        token = lease.token();
        assert_eq!(stats(&w).reads_after_wake, 0, "{:?}", stats(&w));
        lease.release().await.expect("release");
    }
}

/// A waiter behind a holder with a lock-delay reads the queue again when the holder's key goes
/// (the holder's marker may still be there): the watch event alone is not taken as the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_behind_a_holder_with_a_lock_delay_reads_again_on_wake() {
    let url = with_prefix(&server_url("LOCKKIT_ETCD_URL"), &fresh_prefix());
    let (h, w) = (client(&url).await, client(&url).await);
    let held = h
        .acquire(
            "d",
            AcquireOptions::new()
                .ttl(TTL)
                .lock_delay(Duration::from_secs(2)),
        )
        .await
        .expect("acquire");
    let join = queue(&w, "d").await;
    held.release().await.expect("release");
    let lease = granted(join).await;
    assert_eq!(stats(&w).reads_after_wake, 1, "{:?}", stats(&w));
    lease.release().await.expect("release");
}

/// An admin's delete of the whole queue in one request (the holder's key and the waiter's, one
/// revision) never hands the waiter the lock on its deleted key: it queues again with a new key
/// (a token above the delete's revision) and gets the now free lock; the holder turns Lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_of_the_whole_queue_in_one_request_grants_no_deleted_key() {
    let url = with_prefix(&server_url("LOCKKIT_ETCD_URL"), &fresh_prefix());
    let (h, w) = (client(&url).await, client(&url).await);
    let held = h.try_acquire("x", TTL).await.expect("acquire");
    let prefix = h.name_prefix("x");
    let mut watch = PrefixWatch::new(h.client(), &prefix).await;
    let join = queue(&w, "x").await;
    let deleted = h
        .client()
        .kv_client()
        .delete(prefix, Some(DeleteOptions::new().with_prefix()))
        .await
        .expect("delete");
    assert_eq!(deleted.deleted(), 2);
    let rev = deleted.header().expect("header").revision();
    watch.next(EventType::Delete, TOLERANCE).await;
    let lease = granted(join).await;
    assert!(
        lease.token().get() > u64::try_from(rev).unwrap(),
        "granted on a key the delete removed: token {} ≤ revision {rev}",
        lease.token().get()
    );
    tokio::time::timeout(TOLERANCE, held.lost())
        .await
        .expect("the holder did not hear of its key's delete");
    lease.release().await.expect("release");
}
