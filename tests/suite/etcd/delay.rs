//! Lock-delay on etcd: a holder that ends without a release (lapsed, leaked, revoked by an
//! admin) leaves a marker `{prefix}/./delay/{name}` on a lease that outlives its key by the
//! delay; until it goes, try-once acquires get `Held` and waiters wait. A release frees at once.

use std::time::Duration;

use lockkit::backend::LeaseBackendExt;

use lockkit::etcd::etcd_client::{Client, EventType, GetOptions};
use lockkit::etcd::{EtcdLease, EtcdLock};
use lockkit::{AcquireOptions, Error, Lease, LeaseState, Lock, LockExt, Wait};
use tokio::time::Instant;

use super::support::PrefixWatch;
use crate::common::{fresh_prefix, server_url, with_prefix};

fn shared_url() -> String {
    server_url("LOCKKIT_ETCD_URL")
}

fn etcd_of(lease: &Lease) -> &EtcdLease {
    lease
        .ops()
        .as_any()
        .downcast_ref::<EtcdLease>()
        .expect("an etcd lease")
}

async fn clients() -> (EtcdLock, EtcdLock, String) {
    let prefix = fresh_prefix();
    let url = with_prefix(&shared_url(), &prefix);
    (
        EtcdLock::connect(&url).await.unwrap(),
        EtcdLock::connect(&url).await.unwrap(),
        prefix,
    )
}

/// Lock-delay markers under the client's prefix.
async fn markers(client: &Client, prefix: &str) -> i64 {
    client
        .kv_client()
        .get(
            format!("{prefix}/./delay/"),
            Some(GetOptions::new().with_prefix().with_count_only()),
        )
        .await
        .expect("count")
        .count()
}

fn waiting(ttl: Duration, wait: Duration) -> AcquireOptions {
    AcquireOptions::new().ttl(ttl).wait(Wait::Timeout(wait))
}

/// A `keepalive(false)` holder that is dropped without a release lapses at its TTL; the next
/// grant (a waiter without a delay of its own) comes no sooner than TTL + delay after the
/// holder's grant, and a try-once acquire after the key is gone but within the delay is `Held`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lapsed_holder_delays_the_next_grant() {
    let (a, b, prefix) = clients().await;
    let (ttl, delay) = (Duration::from_secs(2), Duration::from_secs(3));
    let opts = AcquireOptions::new()
        .ttl(ttl)
        .wait(Wait::No)
        .keepalive(false)
        .release_on_drop(false)
        .lock_delay(delay);
    let held = a.acquire("lapses", opts).await.expect("grant with a delay");
    let granted = Instant::now();
    let mut gone = PrefixWatch::new(b.client(), &b.name_prefix("lapses")).await;
    drop(held);
    // etcd expires the holder's key at its TTL...
    gone.next(EventType::Delete, ttl * 3).await;
    let freed = granted.elapsed();
    // ...but the lock is granted to no one for the delay.
    assert!(
        matches!(b.try_acquire("lapses", ttl).await, Err(Error::Held { .. })),
        "a try-once acquire got the lock {freed:?} after a lapsed holder's grant, within its delay"
    );
    let next = b
        .acquire("lapses", waiting(ttl, (ttl + delay) * 3))
        .await
        .expect("granted after the delay");
    let waited = granted.elapsed();
    eprintln!("etcd lock-delay: key freed {freed:?}, next grant {waited:?} after the grant");
    assert!(
        waited >= ttl + delay,
        "granted {waited:?} after a lapsed holder's grant (TTL {ttl:?} + delay {delay:?})"
    );
    next.release().await.unwrap();
    assert_eq!(markers(b.client(), &prefix).await, 0);
}

/// An explicit release frees the lock at once, the marker with it; so does a release on drop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn released_holder_frees_at_once() {
    let (a, b, prefix) = clients().await;
    let (ttl, delay) = (Duration::from_secs(5), Duration::from_secs(30));
    for keepalive in [true, false] {
        let opts = AcquireOptions::new()
            .ttl(ttl)
            .keepalive(keepalive)
            .lock_delay(delay);
        let held = a.acquire("released", opts.clone()).await.unwrap();
        assert_eq!(markers(b.client(), &prefix).await, 1);
        held.release().await.unwrap();
        assert_eq!(markers(b.client(), &prefix).await, 0);
        let next = b
            .try_acquire("released", ttl)
            .await
            .expect("free at once after a release");
        next.release().await.unwrap();
        // Release on drop (in the background): a waiter gets it long before the delay.
        let dropped = a.acquire("released", opts).await.unwrap();
        drop(dropped);
        let next = b
            .acquire("released", waiting(ttl, delay / 2))
            .await
            .expect("free after a release on drop, before the delay");
        next.release().await.unwrap();
    }
    // A waiting grant with a delay (it queued behind a holder) puts its marker too, and its
    // release deletes it.
    let first = a.try_acquire("queued", ttl).await.unwrap();
    let opts = waiting(ttl, Duration::from_secs(10)).lock_delay(delay);
    let b2 = b.clone();
    let waiter = tokio::spawn(async move { b2.acquire("queued", opts).await });
    let mut watch = PrefixWatch::new(a.client(), &a.name_prefix("queued")).await;
    watch.next(EventType::Put, Duration::from_secs(5)).await;
    first.release().await.unwrap();
    let second = waiter.await.unwrap().expect("the waiter's grant");
    assert_eq!(markers(b.client(), &prefix).await, 1);
    second.release().await.unwrap();
    assert_eq!(markers(b.client(), &prefix).await, 0);
    a.try_acquire("queued", ttl)
        .await
        .expect("free at once")
        .release()
        .await
        .unwrap();
}

/// An admin's revoke of the holder's session lease is a failure, not a release: the holder
/// turns Lost at once (the watch on its key) and the lock stays granted to no one for at least
/// the delay after the revoke (counted from when the holder's client heard of it, which moves
/// the marker to a lease of its own with the delay as TTL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_revoke_of_the_holder_still_delays() {
    let (a, b, _) = clients().await;
    let admin = Client::connect([shared_url().trim_start_matches("etcd://")], None)
        .await
        .unwrap();
    let (ttl, delay) = (Duration::from_secs(6), Duration::from_secs(3));
    let opts = AcquireOptions::new().ttl(ttl).lock_delay(delay);
    // Another lock on the same session lease: its client keeps the lease (and the companion
    // lease of the marker) in use after the revoke.
    let held = a.acquire("revoked", opts.clone()).await.unwrap();
    let waiter_b = b.clone();
    let waiter = tokio::spawn(async move {
        let lease = waiter_b
            .acquire("revoked", waiting(ttl, (ttl + delay) * 3))
            .await;
        (Instant::now(), lease)
    });
    let mut watch = PrefixWatch::new(a.client(), &a.name_prefix("revoked")).await;
    watch.next(EventType::Put, Duration::from_secs(5)).await;
    let revoked = Instant::now();
    admin
        .lease_client()
        .revoke(etcd_of(&held).lease_id())
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(2), held.lost())
        .await
        .expect("the revoke was not noticed");
    assert_eq!(
        held.loss_reason(),
        Some(lockkit::LossReason::NotHeldOnServer)
    );
    assert!(matches!(
        b.try_acquire("revoked", ttl).await,
        Err(Error::Held { .. })
    ));
    let (granted_at, next) = waiter.await.unwrap();
    let next = next.expect("granted after the delay");
    let after = granted_at - revoked;
    eprintln!("etcd lock-delay: admin revoke -> next grant after {after:?} (delay {delay:?})");
    assert!(after >= delay, "granted {after:?} after the revoke");
    next.release().await.unwrap();
    // The holder's client takes a fresh session lease.
    a.try_acquire("other", ttl)
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}

/// A leaked lock (dropped without release) on a session lease that another lock keeps alive
/// lapses at its deadline; its marker then moves off the shared companion lease, so the lock is
/// free the delay after the deadline — not for the life of the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaked_lock_on_a_shared_lease_delays_from_its_deadline() {
    let (a, b, prefix) = clients().await;
    let (ttl, delay) = (Duration::from_secs(2), Duration::from_secs(2));
    let opts = AcquireOptions::new()
        .ttl(ttl)
        .wait(Wait::No)
        .release_on_drop(false)
        .lock_delay(delay);
    let keeper = a.acquire("keeper", opts.clone()).await.unwrap();
    let leaked = a.acquire("leaked", opts).await.unwrap();
    assert_eq!(etcd_of(&keeper).lease_id(), etcd_of(&leaked).lease_id());
    let deadline = leaked.valid_until();
    drop(leaked);
    let next = b
        .acquire("leaked", waiting(ttl, (ttl + delay) * 4))
        .await
        .expect("granted after the deadline and the delay");
    let granted = Instant::now();
    assert!(
        granted >= deadline + delay,
        "granted {:?} after the leaked lock's deadline",
        granted.saturating_duration_since(deadline)
    );
    // The shared session lease lives on (Suspect is allowed: on a loaded 2-core machine a
    // 2 s TTL's renewal can be late; the release below proves the lease is still ours).
    assert_ne!(keeper.state(), LeaseState::Lost);
    next.release().await.unwrap();
    keeper.release().await.unwrap();
    assert_eq!(markers(b.client(), &prefix).await, 0);
}

/// A holder whose client stops renewing (as if it died) lapses with its whole session lease;
/// the marker's companion lease, renewed just before it, runs the delay out after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_lease_that_lapses_delays_the_next_grant() {
    let (a, b, _) = clients().await;
    let (ttl, delay) = (Duration::from_secs(3), Duration::from_secs(2));
    let opts = AcquireOptions::new().ttl(ttl).lock_delay(delay);
    let held = a.acquire("lapses", opts).await.unwrap();
    // A renewal (the companion lease first, then the session lease), then silence.
    held.renew().await.expect("renew");
    a.pause_keepalive_for_tests(true);
    let deadline = held.valid_until();
    held.lost().await;
    let next = b
        .acquire("lapses", waiting(ttl, (ttl + delay) * 4))
        .await
        .expect("granted after the delay");
    let granted = Instant::now();
    assert!(
        granted >= deadline + delay,
        "granted {:?} after the lapsed holder's deadline",
        granted.saturating_duration_since(deadline)
    );
    next.release().await.unwrap();
}

/// An admin's `del` of the holder's key while its client keeps the session lease alive (another
/// lock on it): the holder turns Lost, the marker moves off the shared companion lease, and the
/// lock is granted again after the delay — not for as long as the session lives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_delete_of_the_key_delays_then_frees() {
    let (a, b, prefix) = clients().await;
    let admin = Client::connect([shared_url().trim_start_matches("etcd://")], None)
        .await
        .unwrap();
    let (ttl, delay) = (Duration::from_secs(3), Duration::from_secs(2));
    let opts = AcquireOptions::new().ttl(ttl).lock_delay(delay);
    let keeper = a.acquire("keeper", opts.clone()).await.unwrap();
    let held = a.acquire("deleted", opts).await.unwrap();
    let deleted = Instant::now();
    admin
        .kv_client()
        .delete(etcd_of(&held).key().to_vec(), None)
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(2), held.lost())
        .await
        .expect("the delete was not noticed");
    let next = b
        .acquire("deleted", waiting(ttl, (ttl + delay) * 4))
        .await
        .expect("granted after the delay, while the session lease lives on");
    let after = deleted.elapsed();
    eprintln!("etcd lock-delay: admin delete -> next grant after {after:?} (delay {delay:?})");
    assert!(after >= delay, "granted {after:?} after the delete");
    // The shared session lease lives on (Suspect is allowed: on a loaded 2-core machine a
    // 2 s TTL's renewal can be late; the release below proves the lease is still ours).
    assert_ne!(keeper.state(), LeaseState::Lost);
    next.release().await.unwrap();
    keeper.release().await.unwrap();
    drop(held);
    assert_eq!(markers(b.client(), &prefix).await, 0);
}
