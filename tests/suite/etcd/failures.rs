//! Failure tests: holder loss behind a blackholed proxy, expired and revoked waiters, leftovers
//! of failed acquires, session-lease sharing, authentication, tokens across a server restart.

use lockkit::backend::LeaseBackendExt;
use std::time::Duration;

use lockkit::etcd::etcd_client::{Client, EventType, GetOptions};
use lockkit::etcd::{EtcdFence, EtcdLease, EtcdLock};
use lockkit::{AcquireOptions, Error, Lease, LeaseState, Lock, LockExt, Wait};
use tokio::time::Instant;

use super::support::{self, PrefixWatch};
use crate::common::proxy::Proxy;
use crate::common::{free_port, fresh_prefix, server_url, with_prefix};

const TOLERANCE: Duration = Duration::from_secs(2);

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

async fn count_under(client: &Client, prefix: &[u8]) -> i64 {
    let mut kv = client.kv_client();
    kv.get(
        prefix.to_vec(),
        Some(GetOptions::new().with_prefix().with_count_only()),
    )
    .await
    .expect("count")
    .count()
}

/// A holder whose keepalives stop reaching etcd turns suspect, then lost by its deadline (while
/// the TCP connection stays open); another client gets the lock after the TTL with a larger
/// token; the old holder's fenced write is rejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holder_loss_behind_blackholed_proxy() {
    let url = shared_url();
    let prefix = fresh_prefix();
    let proxy = Proxy::start(url.trim_start_matches("etcd://")).await;
    let a = EtcdLock::connect(&format!("etcd://{}?prefix={prefix}", proxy.endpoint()))
        .await
        .expect("connect through proxy");
    let b = EtcdLock::connect(&with_prefix(&url, &prefix))
        .await
        .expect("connect");
    let slack = b.guarantees().expiry_slack;
    let ttl = Duration::from_secs(2);
    let lease_a = a.try_acquire("job", ttl).await.expect("acquire");
    let lost_at = {
        let lost = lease_a.lost();
        tokio::spawn(async move {
            lost.await;
            Instant::now()
        })
    };
    proxy.freeze();
    let cut = Instant::now();
    assert!(lease_a.valid_until() <= cut + ttl);
    // Half a TTL after the last acknowledged keepalive the lease is suspect, not yet lost.
    tokio::time::sleep_until(
        lease_a.tracker().confirmed_at() + ttl / 2 + Duration::from_millis(100),
    )
    .await;
    assert_eq!(lease_a.state(), LeaseState::Suspect);

    let lease_b = b
        .acquire(
            "job",
            AcquireOptions::new()
                .ttl(ttl)
                .wait(Wait::Timeout(ttl + slack + TOLERANCE * 2)),
        )
        .await
        .expect("the lock did not lapse after the TTL");
    let granted = Instant::now();
    assert!(
        lost_at.is_finished(),
        "B was granted before A was told it lost the lock"
    );
    let lost_at = lost_at.await.unwrap();
    assert!(lost_at <= granted);
    assert!(
        lost_at <= cut + ttl + TOLERANCE,
        "loss signal late: {:?} after the cut",
        lost_at - cut
    );
    // etcd freed the lock no earlier than A's client-side deadline.
    assert!(granted >= lease_a.valid_until());
    assert_eq!(lease_a.state(), LeaseState::Lost);
    assert!(lease_b.token() > lease_a.token());

    // The network heals; the stale holder tries to write.
    proxy.thaw();
    let data = format!("{prefix}-data/report");
    match EtcdFence::from_lease(&lease_a)
        .unwrap()
        .put(data.clone(), "from A")
        .await
    {
        Err(Error::StaleToken { token, current, .. }) => {
            assert_eq!(token, lease_a.token());
            assert_eq!(current, lease_b.token());
        }
        other => panic!("stale holder's fenced write: {other:?}"),
    }
    EtcdFence::from_lease(&lease_b)
        .unwrap()
        .put(data.clone(), "from B")
        .await
        .expect("holder's fenced write");
    let mut kv = b.client().kv_client();
    let got = kv.get(data.clone(), None).await.unwrap();
    assert_eq!(got.kvs()[0].value(), b"from B");
    match lease_a.release().await {
        Err(Error::NotHeld { .. }) => {}
        other => panic!("release of the lost lease: {other:?}"),
    }
    lease_b.release().await.expect("release");
    kv.delete(data, None).await.unwrap();
}

/// Queues a waiter on a held lock; returns its join handle once its key exists.
async fn queue_waiter(
    w: &EtcdLock,
    name: &str,
    ttl: Duration,
    watch: &mut PrefixWatch,
) -> (tokio::task::JoinHandle<lockkit::Result<Lease>>, Vec<u8>) {
    let (w, n) = (w.clone(), name.to_owned());
    let join = tokio::spawn(async move { w.acquire(&n, AcquireOptions::new().ttl(ttl)).await });
    let key = watch.next(EventType::Put, TOLERANCE * 2).await;
    (join, key)
}

/// An acquire whose request created its key but whose reply was lost retries, finds its own
/// key (the transaction's "our key exists" branch) instead of creating a second one, and is
/// granted on that key; after its release that key is not reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_whose_reply_is_lost_keeps_one_key() {
    let url = shared_url();
    let prefix = fresh_prefix();
    let proxy = Proxy::start(url.trim_start_matches("etcd://")).await;
    let w = EtcdLock::connect(&format!(
        "etcd://{}?prefix={prefix}&request_timeout_ms=500",
        proxy.endpoint()
    ))
    .await
    .expect("connect through proxy");
    let direct = EtcdLock::connect(&with_prefix(&url, &prefix))
        .await
        .expect("connect");
    let ttl = Duration::from_secs(10);
    // Grant the session lease while replies still pass (same TTL: reused below).
    w.try_acquire("warm-up", ttl)
        .await
        .expect("warm-up")
        .release()
        .await
        .expect("release");
    let name_prefix = format!("{prefix}/job/").into_bytes();
    let mut watch = PrefixWatch::new(direct.client(), &name_prefix).await;

    proxy.hold_replies(true);
    let join = {
        let w = w.clone();
        tokio::spawn(async move {
            w.acquire(
                "job",
                AcquireOptions::new()
                    .ttl(ttl)
                    .wait(Wait::Timeout(Duration::from_secs(30))),
            )
            .await
        })
    };
    let key = watch.next(EventType::Put, TOLERANCE * 2).await;
    // The transaction took effect; its reply is held. Once the client has given up on it (it
    // resets the stream) and sent its retry, let replies through again.
    let after_put = proxy.sent();
    proxy.wait_sent_more_than(after_put + 1).await;
    proxy.hold_replies(false);

    let lease = join.await.unwrap().expect("granted after the retry");
    assert_eq!(
        etcd_of(&lease).key(),
        key.as_slice(),
        "granted on its first key"
    );
    assert_eq!(
        lease.token().get(),
        create_revision_of(direct.client(), &key).await
    );
    assert_eq!(
        count_under(direct.client(), &name_prefix).await,
        1,
        "one key"
    );
    lease.release().await.expect("release");
    assert_eq!(count_under(direct.client(), &name_prefix).await, 0);
    // The unanswered attempt may still land: its key is never reused, so a later grant of the
    // same name gets another key (here on a new session lease: the old one takes no
    // newcomers), which that late request cannot touch.
    let again = w.try_acquire("job", ttl).await.expect("acquire again");
    assert_ne!(etcd_of(&again).key(), key.as_slice());
    again.release().await.expect("release");
}

/// The create revision of `key` (which must exist).
async fn create_revision_of(client: &Client, key: &[u8]) -> u64 {
    let mut kv = client.kv_client();
    let r = kv.get(key.to_vec(), None).await.expect("get");
    u64::try_from(r.kvs().first().expect("key exists").create_revision()).unwrap()
}

/// A waiter whose keepalives stop while it is queued loses its lease (its key is deleted by
/// etcd); it never gets the lock on that key (it may queue again with a fresh lease and get it
/// on a new key); the next client gets a larger token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_whose_lease_lapses_gets_no_lease() {
    let url = with_prefix(&shared_url(), &fresh_prefix());
    let (h, w, c) = (
        EtcdLock::connect(&url).await.unwrap(),
        EtcdLock::connect(&url).await.unwrap(),
        EtcdLock::connect(&url).await.unwrap(),
    );
    let slack = h.guarantees().expiry_slack;
    let held = h
        .try_acquire("q", Duration::from_secs(30))
        .await
        .expect("acquire");
    let mut watch = PrefixWatch::new(h.client(), &h.name_prefix("q")).await;
    let ttl = Duration::from_secs(2);
    let (waiter, key) = queue_waiter(&w, "q", ttl, &mut watch).await;
    let old_rev = h
        .client()
        .kv_client()
        .get(key.clone(), None)
        .await
        .unwrap()
        .kvs()[0]
        .create_revision();
    w.pause_keepalive_for_tests(true);
    let held_token = held.token();
    // etcd deletes the waiter's key when its lease expires.
    assert_eq!(
        watch.next(EventType::Delete, ttl + slack + TOLERANCE).await,
        key
    );
    held.release().await.expect("release");
    let res = tokio::time::timeout(TOLERANCE * 2, waiter)
        .await
        .expect("the waiter hung")
        .unwrap();
    // It queued again with a fresh lease (so it may get the lock on a new key, with a larger
    // token), never on its lapsed key.
    match res {
        Ok(l) => {
            assert!(l.token().get() > u64::try_from(old_rev).unwrap());
            w.pause_keepalive_for_tests(false);
            let _ = l.release().await;
        }
        Err(Error::LeaseLost { .. } | Error::Unavailable { .. }) => {}
        Err(other) => panic!("a waiter with a lapsed lease got {other:?}"),
    }
    let next = c
        .acquire_timeout("q", ttl, TOLERANCE)
        .await
        .expect("third client");
    assert!(next.token() > held_token);
    next.release().await.unwrap();
}

/// The store's current revision: every key created so far has a create revision at most this.
async fn watch_rev_bound(client: &Client) -> u64 {
    let resp = client.kv_client().get("\0", None).await.unwrap();
    u64::try_from(resp.header().unwrap().revision()).unwrap()
}

/// The wake path: a queued waiter whose lease was revoked on the server (its client still
/// thinks it is fine) is woken by the holder's release, finds its key gone in its linearizable
/// re-check, and never gets the lock on it: it queues again with a fresh lease and gets the
/// (now free) lock on a new key; a third client acquires with a larger token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoked_waiter_is_refused_on_wake() {
    let url = with_prefix(&shared_url(), &fresh_prefix());
    let (h, w, c) = (
        EtcdLock::connect(&url).await.unwrap(),
        EtcdLock::connect(&url).await.unwrap(),
        EtcdLock::connect(&url).await.unwrap(),
    );
    let held = h
        .try_acquire("q", Duration::from_secs(30))
        .await
        .expect("acquire");
    let first = held.token();
    let mut watch = PrefixWatch::new(h.client(), &h.name_prefix("q")).await;
    let (waiter, key) = queue_waiter(&w, "q", Duration::from_secs(30), &mut watch).await;
    // Keep its client from noticing through a keepalive answer: only the wake path may see it.
    w.pause_keepalive_for_tests(true);
    let mut kv = h.client().kv_client();
    let lease_id = kv.get(key.clone(), None).await.unwrap().kvs()[0].lease();
    h.client().lease_client().revoke(lease_id).await.unwrap();
    assert_eq!(watch.next(EventType::Delete, TOLERANCE).await, key);
    assert!(!waiter.is_finished());
    let waiter_key_rev = first; // the holder's token bounds every earlier grant
    // Every key so far (the revoked one included) has a create revision at most this.
    let old_key_max_rev = watch_rev_bound(h.client()).await;
    held.release().await.expect("release");
    // Never the lock on its revoked key; it may queue again with a fresh lease and get the lock
    // on a new key (a larger token than any earlier key's).
    match tokio::time::timeout(TOLERANCE * 2, waiter)
        .await
        .expect("the woken waiter hung")
        .unwrap()
    {
        Ok(l) => {
            assert!(l.token().get() > old_key_max_rev);
            w.pause_keepalive_for_tests(false);
            let _ = l.release().await;
        }
        // The lock is free: the acquire must not fail just because its first lease ended.
        Err(other) => panic!("a waiter with a revoked lease got {other:?}"),
    }
    let next = c
        .acquire_timeout("q", Duration::from_secs(5), TOLERANCE)
        .await
        .expect("third client");
    assert!(next.token() > waiter_key_rev);
    next.release().await.unwrap();
}

/// Try-acquire of a held lock and a timed-out acquire leave no key behind (checked at once);
/// a dropped waiting acquire's key is deleted in the background.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_acquires_leave_no_keys() {
    let url = with_prefix(&shared_url(), &fresh_prefix());
    let (a, b) = (
        EtcdLock::connect(&url).await.unwrap(),
        EtcdLock::connect(&url).await.unwrap(),
    );
    let ttl = Duration::from_secs(10);
    let held = a.try_acquire("k", ttl).await.unwrap();
    let prefix = a.name_prefix("k");
    assert_eq!(count_under(a.client(), &prefix).await, 1);
    assert!(matches!(
        b.try_acquire("k", ttl).await,
        Err(Error::Held { .. })
    ));
    assert_eq!(
        count_under(a.client(), &prefix).await,
        1,
        "try-acquire left a key"
    );
    assert!(matches!(
        b.acquire_timeout("k", ttl, Duration::from_millis(200))
            .await,
        Err(Error::Timeout { .. })
    ));
    assert_eq!(
        count_under(a.client(), &prefix).await,
        1,
        "timeout left a key"
    );
    let mut watch = PrefixWatch::new(a.client(), &prefix).await;
    let waiting = b.acquire("k", AcquireOptions::new().ttl(ttl));
    assert!(
        tokio::time::timeout(Duration::from_millis(300), waiting)
            .await
            .is_err()
    );
    let put = watch.next(EventType::Put, TOLERANCE).await;
    assert_eq!(watch.next(EventType::Delete, TOLERANCE).await, put);
    assert_eq!(count_under(a.client(), &prefix).await, 1);
    held.release().await.unwrap();
    assert_eq!(count_under(a.client(), &prefix).await, 0);
}

/// Locks of one client and TTL share one etcd lease; another TTL or `keepalive(false)` gets its
/// own; names are prefix-free (`a` does not cover `ab`); dropping the client revokes its idle
/// session leases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_leases_are_shared_and_revoked() {
    let url = with_prefix(&shared_url(), &fresh_prefix());
    let a = EtcdLock::connect(&url).await.unwrap();
    let ttl = Duration::from_secs(5);
    let l1 = a.try_acquire("a", ttl).await.unwrap();
    let l2 = a
        .try_acquire("ab", ttl)
        .await
        .expect("ab is another lock than a");
    let l3 = a.try_acquire("c", Duration::from_secs(7)).await.unwrap();
    let l4 = a
        .acquire(
            "d",
            AcquireOptions::new()
                .ttl(ttl)
                .keepalive(false)
                .wait(Wait::No),
        )
        .await
        .unwrap();
    let ids: Vec<i64> = [&l1, &l2, &l3, &l4]
        .iter()
        .map(|l| etcd_of(l).lease_id())
        .collect();
    assert_eq!(ids[0], ids[1], "same TTL, same session lease");
    assert_ne!(ids[0], ids[2], "another TTL, another lease");
    assert_ne!(ids[0], ids[3], "keepalive(false) gets its own lease");
    assert_eq!(count_under(a.client(), &a.name_prefix("a")).await, 1);
    let raw = a.client().clone();
    for l in [l1, l2, l3, l4] {
        l.release().await.unwrap();
    }
    drop(a);
    // The session's keepalive tasks revoke idle leases once the client is gone; the dedicated
    // lease was revoked by its release.
    let deadline = Instant::now() + TOLERANCE * 2;
    for id in [ids[0], ids[2], ids[3]] {
        loop {
            let ttl = raw
                .lease_client()
                .time_to_live(id, None)
                .await
                .unwrap()
                .ttl();
            if ttl == -1 {
                break;
            }
            assert!(Instant::now() < deadline, "lease {id:x} still alive");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Keepalive stops when the last lock on a session lease is released (the client stays
/// alive): the lease is never renewed again (its remaining TTL on the server only goes down;
/// polled, as etcd has no signal for it) and is revoked at its next keepalive tick, within
/// TTL/3 of its grant. An acquire right after a release reuses the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_session_lease_is_not_renewed_after_last_release() {
    let url = with_prefix(&shared_url(), &fresh_prefix());
    let a = EtcdLock::connect(&url).await.unwrap();
    let ttl = Duration::from_secs(6);
    let first = a.try_acquire("x", ttl).await.unwrap();
    let id = etcd_of(&first).lease_id();
    first.release().await.unwrap();
    let again = a.try_acquire("y", ttl).await.unwrap();
    assert_eq!(etcd_of(&again).lease_id(), id, "reused while still fresh");
    let last_renewal = again.tracker().confirmed_at();
    again.release().await.unwrap();
    let released = Instant::now();
    let mut lc = a.client().lease_client();
    let mut left = i64::MAX;
    loop {
        let now_left = lc.time_to_live(id, None).await.unwrap().ttl();
        if now_left == -1 {
            break;
        }
        assert!(now_left <= left, "renewed after its last lock was released");
        left = now_left;
        assert!(
            Instant::now() < last_renewal + ttl / 3 + TOLERANCE,
            "lease {id:x} not revoked {:?} after the last release",
            released.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A wrong password, or none, is `Error::Auth` at connect; the right one works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_password_is_auth_error() {
    let data = support::fresh_data_dir();
    let m = support::start_single(data.path(), free_port(), free_port()).await;
    let ep = m.endpoint();
    support::etcdctl(&ep, &["user", "add", "root", "--new-user-password=r00t-pw"]);
    support::etcdctl(&ep, &["auth", "enable"]);
    let start = Instant::now();
    match lockkit::connect(&format!("etcd://root:wrong-pw@{ep}")).await {
        Err(e @ Error::Auth { .. }) => {
            assert!(!format!("{e:?}").contains("wrong-pw"));
            assert!(!e.is_retryable());
        }
        other => panic!("wrong password: {other:?}"),
    }
    assert!(start.elapsed() < TOLERANCE);
    // No credentials at all: refused at connect, not at the first acquire.
    match lockkit::connect(&format!("etcd://{ep}")).await {
        Err(e @ Error::Auth { .. }) => assert!(!e.is_retryable()),
        other => panic!("no credentials: {other:?}"),
    }
    let locks = lockkit::connect(&format!("etcd://root:r00t-pw@{ep}?prefix=authd"))
        .await
        .expect("right password");
    let lease = locks
        .try_acquire("x", Duration::from_secs(5))
        .await
        .expect("acquire with auth");
    lease.release().await.unwrap();
    assert!(!format!("{locks:?}").contains("r00t-pw"));
}

/// Tokens keep increasing across a SIGKILL and restart of the (single) etcd member, for a new
/// client and for one that was connected before the crash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_survive_server_restart() {
    let data = support::fresh_data_dir();
    let (cp, pp) = (free_port(), free_port());
    let mut m = support::start_single(data.path(), cp, pp).await;
    let url = format!("etcd://{}", m.endpoint());
    let old = EtcdLock::connect(&url).await.unwrap();
    let lease = old.try_acquire("r", Duration::from_secs(5)).await.unwrap();
    let before = lease.token();
    lease.release().await.unwrap();
    m.proc.kill();
    let _m = support::start_single(data.path(), cp, pp).await;
    let fresh = EtcdLock::connect(&url)
        .await
        .expect("connect after restart");
    let l1 = fresh
        .try_acquire("r", Duration::from_secs(5))
        .await
        .unwrap();
    assert!(l1.token() > before, "{} not above {}", l1.token(), before);
    let t1 = l1.token();
    l1.release().await.unwrap();
    let l2 = old
        .acquire(
            "r",
            AcquireOptions::new()
                .ttl(Duration::from_secs(5))
                .wait(Wait::Timeout(TOLERANCE * 2)),
        )
        .await
        .expect("the old client reconnects");
    assert!(l2.token() > t1);
    l2.release().await.unwrap();
}

/// Acquires dropped at random points (before, during and after their create transaction,
/// while waiting, and just after being granted) leave nothing behind: every key they created is
/// deleted, and the next client gets the lock at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquires_dropped_at_any_point_leave_nothing() {
    let url = with_prefix(&shared_url(), &fresh_prefix());
    let (a, b, c) = (
        EtcdLock::connect(&url).await.unwrap(),
        EtcdLock::connect(&url).await.unwrap(),
        EtcdLock::connect(&url).await.unwrap(),
    );
    let prefix = a.name_prefix("cancel");
    let mut watch = PrefixWatch::new(a.client(), &prefix).await;
    let ttl = Duration::from_secs(10);
    for round in 0..2 {
        // Round 0: the lock is free (drops hit grants too); round 1: it is held (drops hit
        // waiters).
        let held = if round == 1 {
            Some(a.try_acquire("cancel", ttl).await.unwrap())
        } else {
            None
        };
        for i in 0..40u64 {
            let b = b.clone();
            let task =
                tokio::spawn(
                    async move { b.acquire("cancel", AcquireOptions::new().ttl(ttl)).await },
                );
            tokio::time::sleep(Duration::from_micros(i * 150)).await;
            task.abort();
            let _ = task.await;
        }
        if let Some(h) = held {
            h.release().await.unwrap();
        }
        // Every key created is deleted (in the background after the drops; a key whose create
        // went unanswered is swept by the keepalive tick, up to TTL/3 later): wait on the watch
        // for deletions until none is left, before the next round takes the lock.
        let deadline = Instant::now() + TOLERANCE * 3;
        while count_under(a.client(), &prefix).await > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "keys left behind by dropped acquires in round {round}"
            );
            watch.next(EventType::Delete, left).await;
        }
    }
    let lease = c
        .acquire_timeout("cancel", ttl, TOLERANCE)
        .await
        .expect("a dropped acquire left something behind");
    lease.release().await.unwrap();
}

/// A keepalive answered with `TTL <= 0` (the session lease was revoked behind the client's back)
/// marks every lock on that lease lost at once, long before their deadlines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoked_session_lease_loses_every_lock_on_it() {
    let url = with_prefix(&shared_url(), &fresh_prefix());
    let (a, b) = (
        EtcdLock::connect(&url).await.unwrap(),
        EtcdLock::connect(&url).await.unwrap(),
    );
    let ttl = Duration::from_secs(6);
    let l1 = a.try_acquire("one", ttl).await.unwrap();
    let l2 = a.try_acquire("two", ttl).await.unwrap();
    assert_eq!(etcd_of(&l1).lease_id(), etcd_of(&l2).lease_id());
    b.client()
        .lease_client()
        .revoke(etcd_of(&l1).lease_id())
        .await
        .unwrap();
    let revoked = Instant::now();
    for l in [&l1, &l2] {
        // The next keepalive (within TTL/3) learns the lease is gone.
        tokio::time::timeout(ttl / 3 + TOLERANCE, l.lost())
            .await
            .expect("loss not signalled after the lease was revoked");
        assert_eq!(l.state(), LeaseState::Lost);
    }
    assert!(Instant::now() < l1.valid_until().max(revoked + ttl / 2));
    // Both locks are free for others; the stale leases' releases are refused.
    let other = b.try_acquire("one", ttl).await.expect("free after revoke");
    other.release().await.unwrap();
    for l in [l1, l2] {
        assert!(matches!(l.release().await, Err(Error::NotHeld { .. })));
    }
    // The client takes a fresh session lease for new acquires.
    let again = a.try_acquire("two", ttl).await.expect("acquire again");
    again.release().await.unwrap();
}

/// An admin's `lease revoke` turns the holder's lease Lost (reason `not_held_on_server`, from
/// the watch on its own key) within tens of milliseconds, not at the next keepalive (TTL/3
/// later), and no later than (within scheduling noise of) a waiting second client's grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_revoke_is_lost_before_the_next_grant() {
    let url = with_prefix(&shared_url(), &fresh_prefix());
    let (a, b) = (
        EtcdLock::connect(&url).await.unwrap(),
        EtcdLock::connect(&url).await.unwrap(),
    );
    let admin = Client::connect([shared_url().trim_start_matches("etcd://")], None)
        .await
        .unwrap();
    let ttl = Duration::from_secs(30);
    let held = a.try_acquire("revoked", ttl).await.unwrap();
    let waiter = tokio::spawn(async move {
        let lease = b
            .acquire_timeout("revoked", ttl, Duration::from_secs(10))
            .await
            .expect("the second client's grant");
        (Instant::now(), lease)
    });
    let lost = held.lost();
    let lost_at = tokio::spawn(async move {
        lost.await;
        Instant::now()
    });
    let revoked = Instant::now();
    admin
        .lease_client()
        .revoke(etcd_of(&held).lease_id())
        .await
        .unwrap();
    let answered = revoked.elapsed();
    let lost_at = tokio::time::timeout(Duration::from_secs(2), lost_at)
        .await
        .expect("revoke not noticed within 2 s")
        .unwrap();
    let noticed = lost_at - revoked;
    let (granted_at, next) = waiter.await.unwrap();
    eprintln!(
        "etcd: admin revoke -> Lost in {noticed:?} (revoke answered in {answered:?}, second grant after {:?})",
        granted_at - revoked
    );
    assert_eq!(
        held.loss_reason(),
        Some(lockkit::LossReason::NotHeldOnServer)
    );
    // Both hear of the same revision through watches on two streams, so which comes first is
    // not ordered; the holder must not lag the next grant by more than scheduling noise.
    assert!(
        lost_at <= granted_at + Duration::from_millis(100),
        "the holder heard of its loss {:?} after the second grant returned",
        lost_at - granted_at
    );
    assert!(noticed < Duration::from_millis(500), "took {noticed:?}");
    next.release().await.unwrap();
}

/// An admin's `del` of the holder's key turns its lease Lost at once; the client's other lock
/// on the same session lease stays held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_delete_of_the_key_is_lost_at_once() {
    let url = with_prefix(&shared_url(), &fresh_prefix());
    let a = EtcdLock::connect(&url).await.unwrap();
    let admin = Client::connect([shared_url().trim_start_matches("etcd://")], None)
        .await
        .unwrap();
    let ttl = Duration::from_secs(30);
    let gone = a.try_acquire("deleted", ttl).await.unwrap();
    let kept = a.try_acquire("kept", ttl).await.unwrap();
    let t = Instant::now();
    admin
        .kv_client()
        .delete(etcd_of(&gone).key().to_vec(), None)
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(2), gone.lost())
        .await
        .expect("delete not noticed within 2 s");
    eprintln!("etcd: admin delete -> Lost in {:?}", t.elapsed());
    assert!(t.elapsed() < Duration::from_millis(500));
    assert_eq!(kept.state(), LeaseState::Held);
    // Our own release is not a loss by the server.
    kept.release().await.unwrap();
}

/// A `keepalive(false)` acquire that waits longer than its TTL keeps its own lease alive while
/// queued, gets the lock with a fresh deadline, and from then on is renewed by hand only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manual_lease_survives_a_long_wait() {
    let url = with_prefix(&shared_url(), &fresh_prefix());
    let (a, b) = (
        EtcdLock::connect(&url).await.unwrap(),
        EtcdLock::connect(&url).await.unwrap(),
    );
    let held = a.try_acquire("m", Duration::from_secs(10)).await.unwrap();
    let ttl = Duration::from_secs(2);
    let waiter = {
        let b = b.clone();
        tokio::spawn(async move {
            b.acquire("m", AcquireOptions::new().ttl(ttl).keepalive(false))
                .await
        })
    };
    // Let more than the waiter's TTL pass while it is queued.
    tokio::time::sleep(ttl + Duration::from_secs(1)).await;
    assert!(!waiter.is_finished());
    held.release().await.unwrap();
    let lease = tokio::time::timeout(TOLERANCE, waiter)
        .await
        .expect("waiter not woken")
        .unwrap()
        .expect("a waiter on a manual lease got no lock");
    assert_eq!(lease.state(), LeaseState::Held);
    assert!(lease.remaining() > ttl / 2);
    lease.renew().await.expect("manual renew");
    // Not renewed any more: it ends by its deadline and the lock is free again.
    tokio::time::timeout(ttl + TOLERANCE, lease.lost())
        .await
        .expect("manual lease not lost after its TTL");
    let slack = a.guarantees().expiry_slack;
    let next = a
        .acquire_timeout("m", ttl, slack + TOLERANCE * 2)
        .await
        .expect("free after the manual lease lapsed");
    assert!(next.token() > lease.token());
    next.release().await.unwrap();
}

/// A leaked lock on a session lease that other locks keep alive stays held for its TTL, then
/// is freed (not for the life of the shared lease).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaked_lock_on_a_shared_lease_ends_at_its_deadline() {
    let url = with_prefix(&shared_url(), &fresh_prefix());
    let (a, b) = (
        EtcdLock::connect(&url).await.unwrap(),
        EtcdLock::connect(&url).await.unwrap(),
    );
    let ttl = Duration::from_secs(2);
    let keeper = a.try_acquire("keeps-the-lease-alive", ttl).await.unwrap();
    let leaked = a.try_acquire("leaked", ttl).await.unwrap();
    assert_eq!(etcd_of(&keeper).lease_id(), etcd_of(&leaked).lease_id());
    let (deadline, token) = (leaked.valid_until(), leaked.token());
    leaked.leak();
    assert!(matches!(
        b.try_acquire("leaked", ttl).await,
        Err(Error::Held { .. })
    ));
    let next = b
        .acquire_timeout("leaked", ttl, ttl + TOLERANCE * 2)
        .await
        .expect("a leaked lock was held past its deadline");
    let granted = Instant::now();
    assert!(granted >= deadline, "freed before its deadline");
    assert!(next.token() > token);
    assert_eq!(
        keeper.state(),
        LeaseState::Held,
        "the shared lease stayed alive"
    );
    next.release().await.unwrap();
    keeper.release().await.unwrap();
}

/// A waiter cancelled while etcd is down (its key cannot be deleted then) must not leave its
/// key behind once etcd is back, even though its client keeps the session lease alive with
/// another lock: the cleanup keeps retrying for as long as the lease lives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_cancelled_during_an_outage_leaves_no_key() {
    let data = support::fresh_data_dir();
    let (cp, pp) = (free_port(), free_port());
    let mut m = support::start_single(data.path(), cp, pp).await;
    let url = format!("etcd://{}", m.endpoint());
    let a = EtcdLock::connect(&url).await.unwrap();
    let b = EtcdLock::connect(&url).await.unwrap();
    let ttl = Duration::from_secs(30);
    // Keeps a's session lease in use (and renewed) throughout.
    let a_x = a.try_acquire("x", ttl).await.unwrap();
    let b_y = b.try_acquire("y", ttl).await.unwrap();
    let mut watch = PrefixWatch::new(a.client(), &a.name_prefix("y")).await;
    let (waiter, _key) = queue_waiter(&a, "y", ttl, &mut watch).await;
    drop(watch);
    m.proc.kill();
    // Cancelled while etcd is down: the cleanup's first attempts fail.
    waiter.abort();
    let _ = waiter.await;
    // Longer than the old cleanup's retries (about 3 s).
    tokio::time::sleep(Duration::from_secs(6)).await;
    let _m = support::start_single(data.path(), cp, pp).await;
    // If this release fails (the client is still reconnecting), its drop deletes the key in
    // the background.
    let _ = b_y.release().await;
    // y is free: nobody else is queued, the abandoned key must be gone.
    let again = b
        .acquire(
            "y",
            AcquireOptions::new()
                .ttl(ttl)
                .wait(Wait::Timeout(TOLERANCE * 5)),
        )
        .await
        .expect("the abandoned waiter's key was deleted");
    assert_ne!(a_x.state(), LeaseState::Lost);
    again.release().await.unwrap();
    a_x.release().await.unwrap();
}

/// `keepalive(false)` acquires that fail (held, timed out) or are cancelled while waiting
/// revoke their private lease: no lease of theirs is left on the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_manual_acquires_revoke_their_lease() {
    let data = support::fresh_data_dir();
    let m = support::start_single(data.path(), free_port(), free_port()).await;
    let url = format!("etcd://{}", m.endpoint());
    let a = EtcdLock::connect(&url).await.unwrap();
    let b = EtcdLock::connect(&url).await.unwrap();
    let held = a.try_acquire("k", Duration::from_secs(30)).await.unwrap();
    // A TTL nothing else on this server uses, to tell the private leases apart.
    let ttl = Duration::from_secs(17);
    let manual = |wait| AcquireOptions::new().ttl(ttl).keepalive(false).wait(wait);
    for _ in 0..3 {
        match b.acquire("k", manual(Wait::No)).await {
            Err(Error::Held { .. }) => {}
            r => panic!("expected Held, got {r:?}"),
        }
        match b
            .acquire("k", manual(Wait::Timeout(Duration::from_millis(200))))
            .await
        {
            Err(Error::Timeout { .. }) => {}
            r => panic!("expected Timeout, got {r:?}"),
        }
        let waiting = b.acquire("k", manual(Wait::Forever));
        assert!(
            tokio::time::timeout(Duration::from_millis(300), waiting)
                .await
                .is_err()
        );
    }
    // The revokes run in the background: wait (bounded) until none of those leases is left.
    let client = a.client().clone();
    let deadline = Instant::now() + TOLERANCE * 2;
    loop {
        let mut lc = client.lease_client();
        let ids: Vec<i64> = lc
            .leases()
            .await
            .unwrap()
            .leases()
            .iter()
            .map(|l| l.id())
            .collect();
        let mut left = 0;
        for id in ids {
            let t = lc.time_to_live(id, None).await.unwrap();
            if t.granted_ttl() == 17 {
                left += 1;
            }
        }
        if left == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{left} private leases of failed acquires are still alive"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    held.release().await.unwrap();
}

/// With etcd hanging (every byte held by a blackholed proxy), a timed acquire ends with
/// `Timeout` at about its deadline, and a try-acquire with `Unavailable` after about one request
/// timeout, not after several request timeouts and retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_waits_are_bounded_when_etcd_hangs() {
    let url = shared_url();
    let prefix = fresh_prefix();
    let proxy = Proxy::start(url.trim_start_matches("etcd://")).await;
    let a = EtcdLock::connect(&format!(
        "etcd://{}?prefix={prefix}&request_timeout_ms=3000",
        proxy.endpoint()
    ))
    .await
    .expect("connect through proxy");
    proxy.freeze();
    let ttl = Duration::from_secs(5);
    let start = Instant::now();
    let opts = AcquireOptions::new()
        .ttl(ttl)
        .wait(Wait::Timeout(Duration::from_millis(300)));
    match a.acquire("hang", opts).await {
        Err(Error::Timeout { .. }) => {}
        r => panic!("expected Timeout, got {r:?}"),
    }
    assert!(start.elapsed() < Duration::from_millis(300) + TOLERANCE / 2);
    let start = Instant::now();
    let opts = AcquireOptions::new().ttl(ttl).wait(Wait::No);
    match a.acquire("hang", opts).await {
        Err(e @ Error::Unavailable { .. }) => assert!(e.is_retryable()),
        r => panic!("expected Unavailable, got {r:?}"),
    }
    assert!(
        start.elapsed() < Duration::from_secs(3) + TOLERANCE,
        "try-acquire took {:?}",
        start.elapsed()
    );
    proxy.thaw();
    let lease = a
        .acquire(
            "hang",
            AcquireOptions::new()
                .ttl(ttl)
                .wait(Wait::Timeout(TOLERANCE * 3)),
        )
        .await
        .expect("acquire once etcd answers");
    lease.release().await.unwrap();
}

/// Reads one gauge from etcd's `/metrics` (served on the client port), summed over its labels.
async fn etcd_gauge(endpoint: &str, name: &str) -> f64 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut sock = tokio::net::TcpStream::connect(endpoint).await.unwrap();
    sock.write_all(b"GET /metrics HTTP/1.0\r\nHost: etcd\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    sock.read_to_string(&mut body).await.unwrap();
    body.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Many locks held by one client share one watch stream (not a stream each), and an admin's
/// revoke of their session lease, or a delete of one key, still turns exactly those locks Lost
/// within the loss-notice bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_held_locks_share_one_watch_stream() {
    let data = support::fresh_data_dir();
    let m = support::start_single(data.path(), free_port(), free_port()).await;
    let url = format!("etcd://{}", m.endpoint());
    let a = EtcdLock::connect(&url).await.unwrap();
    let notice = a.guarantees().loss_notice.expect("a loss-notice bound");
    let admin = Client::connect([m.endpoint()], None).await.unwrap();
    let ttl = Duration::from_secs(30);
    const N: usize = 300;
    let mut held = Vec::new();
    for i in 0..N {
        held.push(a.try_acquire(&format!("many-{i}"), ttl).await.unwrap());
    }
    // A manual lease's key is watched on the same stream.
    let manual = a
        .acquire(
            "manual",
            AcquireOptions::new()
                .ttl(ttl)
                .keepalive(false)
                .wait(Wait::No),
        )
        .await
        .unwrap();
    let streams = etcd_gauge(&m.endpoint(), "etcd_debugging_mvcc_watch_stream_total").await;
    let watchers = etcd_gauge(&m.endpoint(), "etcd_debugging_mvcc_watcher_total").await;
    eprintln!(
        "etcd: {} held locks -> {streams} watch streams, {watchers} watchers",
        N + 1
    );
    assert_eq!(streams, 1.0, "one watch stream for every held lock");
    // (The watchers may still be being set up: the deletes below show they are.)
    // A delete of one key: that lock only.
    let t = Instant::now();
    admin
        .kv_client()
        .delete(etcd_of(&held[7]).key().to_vec(), None)
        .await
        .unwrap();
    tokio::time::timeout(notice, held[7].lost())
        .await
        .expect("the delete was not heard within the loss-notice bound");
    eprintln!("etcd: delete of 1 of {N} keys -> Lost in {:?}", t.elapsed());
    assert_eq!(held[8].state(), LeaseState::Held);
    assert_eq!(manual.state(), LeaseState::Held);
    // A revoke of the session lease: every lock on it.
    let t = Instant::now();
    admin
        .lease_client()
        .revoke(etcd_of(&held[0]).lease_id())
        .await
        .unwrap();
    for l in &held {
        tokio::time::timeout(notice, l.lost())
            .await
            .expect("the revoke was not heard within the loss-notice bound");
    }
    eprintln!(
        "etcd: revoke of a lease with {N} keys -> all Lost in {:?}",
        t.elapsed()
    );
    assert!(
        held.iter()
            .all(|l| l.loss_reason() == Some(lockkit::LossReason::NotHeldOnServer))
    );
    assert_eq!(manual.state(), LeaseState::Held);
    manual.release().await.unwrap();
}

/// The client's key watch stream reopens after the member restarts and sets its watchers up
/// again from their keys' revisions (1,000 of them): an admin's delete of a held key right after the restart
/// is still heard from the watch (long before the next keepalive, TTL/3 = 10 s later).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_watch_reconnects_after_a_member_restart() {
    let data = support::fresh_data_dir();
    let (cp, pp) = (free_port(), free_port());
    let mut m = support::start_single(data.path(), cp, pp).await;
    let url = format!("etcd://{}", m.endpoint());
    let a = EtcdLock::connect(&url).await.unwrap();
    let ttl = Duration::from_secs(30);
    // Enough watchers that the new stream's creates must be interleaved with reading answers.
    let mut many = Vec::new();
    for i in 0..1000 {
        many.push(a.try_acquire(&format!("many-{i}"), ttl).await.unwrap());
    }
    let gone = a.try_acquire("gone", ttl).await.unwrap();
    let kept = a.try_acquire("kept", ttl).await.unwrap();
    m.proc.kill();
    let m = support::start_single(data.path(), cp, pp).await;
    let admin = Client::connect([m.endpoint()], None).await.unwrap();
    let t = Instant::now();
    admin
        .kv_client()
        .delete(etcd_of(&gone).key().to_vec(), None)
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), gone.lost())
        .await
        .expect("the delete after a restart was not heard from the watch");
    eprintln!("etcd: delete after a restart -> Lost in {:?}", t.elapsed());
    assert_eq!(
        gone.loss_reason(),
        Some(lockkit::LossReason::NotHeldOnServer)
    );
    assert_ne!(kept.state(), LeaseState::Lost);
    kept.release().await.unwrap();
    // Every watcher was set up again: deletes of a spread of the other keys are heard too.
    for l in many.iter().step_by(97) {
        admin
            .kv_client()
            .delete(etcd_of(l).key().to_vec(), None)
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_secs(5), l.lost())
            .await
            .expect("a delete after a restart was not heard");
    }
    let lost = many
        .iter()
        .filter(|l| l.state() == LeaseState::Lost)
        .count();
    assert_eq!(lost, many.iter().step_by(97).count());
}

/// A `Wait::Forever` waiter queued behind a holder lives through a 6 s outage of the (single)
/// etcd member, longer than the default retry budget (5 retries, about 1.5–3 s), and gets the
/// lock when the holder releases after the restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forever_waiter_survives_a_server_outage() {
    let data = support::fresh_data_dir();
    let (cp, pp) = (free_port(), free_port());
    let mut m = support::start_single(data.path(), cp, pp).await;
    let url = format!("etcd://{}", m.endpoint());
    let (h, w) = (
        EtcdLock::connect(&url).await.unwrap(),
        EtcdLock::connect(&url).await.unwrap(),
    );
    let ttl = Duration::from_secs(30);
    let held = h.try_acquire("outage", ttl).await.expect("acquire");
    let waiter = tokio::spawn(async move {
        w.acquire("outage", AcquireOptions::new().ttl(ttl).wait(Wait::Forever))
            .await
    });
    // Queued: two keys under the lock's prefix (polled: etcd sends no signal for it).
    let mut kv = h.client().kv_client();
    let until = Instant::now() + TOLERANCE * 5;
    loop {
        let n = kv
            .get(
                h.name_prefix("outage"),
                Some(GetOptions::new().with_prefix().with_count_only()),
            )
            .await
            .unwrap()
            .count();
        if n == 2 {
            break;
        }
        assert!(Instant::now() < until, "the waiter never queued ({n} keys)");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    m.proc.kill();
    // The outage itself: twice the longest the default retry budget lasts. Nothing to await.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(
        !waiter.is_finished(),
        "a Wait::Forever acquire ended during a 6 s outage: {:?}",
        waiter.await.map(|r| r.map(|l| l.token()))
    );
    m = support::start_single(data.path(), cp, pp).await;
    held.release().await.expect("release after the restart");
    let lease = tokio::time::timeout(Duration::from_secs(30), waiter)
        .await
        .expect("the waiter did not get the lock after the server came back")
        .unwrap()
        .expect("the waiter's acquire failed after the server came back");
    lease.release().await.expect("release");
    drop(m);
}
