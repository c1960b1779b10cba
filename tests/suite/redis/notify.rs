//! Loss notices and the server checks made at connect, on private `redis-server` processes:
//! keyspace notifications tell a holder within milliseconds that its key was deleted, expired
//! early or evicted (on its key's own channel, which only the holder's client subscribes to, a
//! loss before the subscription found by the check that follows it); an evicting `maxmemory-policy` is warned about (refused with `strict`); a
//! server without `CONFIG` still works, without notifications; a restart loses every lease
//! held; a silent pub/sub connection is replaced.
//!
//! Leases here have long TTLs (renewed every TTL/3 = 20 s): a loss heard within [`HEARD`] came
//! from a notification or a restart check, never from a renewal.

use std::time::Duration;

use lockkit::redis::redis;
use lockkit::redis::{LOSS_NOTICE, RedisLock};
use lockkit::{AcquireOptions, Error, Lease, LeaseState, Lock, LossReason, Wait};
use tokio::time::Instant;

use super::{PrivateRedis, exists, kill_pubsub_connections, until_subscribers};
use crate::common::proxy::Proxy;
use crate::common::{fresh_prefix, with_prefix};

const TTL: Duration = Duration::from_secs(60);

/// Far below TTL/3: a loss heard this soon was not found by a renewal.
const HEARD: Duration = Duration::from_secs(5);

/// A deleted or evicted key's event is sent by the command that removed it: the holder hears
/// within this (measured: under 6 ms on a loaded 2-core machine).
const DELETE_HEARD: Duration = Duration::from_millis(100);

fn opts(keepalive: bool) -> AcquireOptions {
    AcquireOptions::new()
        .ttl(TTL)
        .keepalive(keepalive)
        .wait(Wait::No)
}

/// Resolves with the instant `lease` turned Lost (a task, so that the instant is taken when it
/// happens, not when the test looks).
fn lost_at(lease: &Lease) -> tokio::task::JoinHandle<Instant> {
    let lost = lease.lost();
    tokio::spawn(async move {
        lost.await;
        Instant::now()
    })
}

/// How long after `since` the lease was lost; fails if not within [`HEARD`].
async fn heard(lease: &Lease, at: tokio::task::JoinHandle<Instant>, since: Instant) -> Duration {
    match tokio::time::timeout(HEARD, at).await {
        Ok(at) => at.expect("lost task").saturating_duration_since(since),
        Err(_) => panic!(
            "the lease was not lost within {HEARD:?} (state {:?})",
            lease.state()
        ),
    }
}

/// `DEL key` by another client (the admin); the key existed.
async fn delete(admin: &mut redis::aio::MultiplexedConnection, key: &str) {
    let n: i64 = redis::cmd("DEL")
        .arg(key)
        .query_async(admin)
        .await
        .expect("DEL");
    assert_eq!(n, 1, "{key} did not exist");
}

async fn config_get(conn: &mut redis::aio::MultiplexedConnection, name: &str) -> String {
    let (_, v): (String, String) = redis::cmd("CONFIG")
        .arg("GET")
        .arg(name)
        .query_async(conn)
        .await
        .expect("CONFIG GET");
    v
}

fn report(what: &str, mut took: Vec<Duration>) {
    took.sort();
    eprintln!(
        "{what}: {} losses heard after min {:?} / median {:?} / max {:?}",
        took.len(),
        took[0],
        took[took.len() / 2],
        took[took.len() - 1]
    );
}

/// A lock key deleted by another client (an admin's `DEL`) or given a short expiry
/// (`PEXPIRE`, as a server clock step would) is heard of through the keyspace notifications
/// that connecting turned on (keeping the flags already set), by kept-alive and by hand-renewed
/// leases alike; the lease's own release is not taken for a loss. Half the leases are
/// subscribed to their key's channel before the loss (a deletion is then heard within
/// [`DELETE_HEARD`]); the others lose their key right after the grant, before the subscription
/// (`WATCH_AFTER`), and hear of it from the check that follows it, still within
/// [`LOSS_NOTICE`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_or_expired_lock_key_is_heard_within_milliseconds() {
    let server = PrivateRedis::start_with(None, &["--notify-keyspace-events", "El"]).await;
    let mut admin = server.raw().await;
    let locks = RedisLock::connect(&with_prefix(&server.url(), &fresh_prefix()))
        .await
        .expect("connect");
    assert_eq!(locks.guarantees().loss_notice, Some(LOSS_NOTICE));
    assert_eq!(locks.loss_notice(), Some(LOSS_NOTICE));
    let flags = config_get(&mut admin, "notify-keyspace-events").await;
    for c in ['E', 'l', 'K', 'g', 'x', 'e'] {
        assert!(flags.contains(c), "flag {c} missing in {flags:?}");
    }

    let (mut deleted, mut expired, mut unsubscribed) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..20 {
        let lease = locks
            .acquire(&format!("del-{i}"), opts(i % 2 == 0))
            .await
            .expect("acquire");
        let key = locks.lock_key(lease.name());
        let subscribed = i % 2 == 0;
        if subscribed {
            until_subscribers(&mut admin, &key, 1).await;
        }
        let at = lost_at(&lease);
        let sent = Instant::now();
        if i % 4 >= 2 {
            let n: i64 = redis::cmd("PEXPIRE")
                .arg(&key)
                .arg(1)
                .query_async(&mut admin)
                .await
                .expect("PEXPIRE");
            assert_eq!(n, 1);
        } else {
            delete(&mut admin, &key).await;
        }
        let took = heard(&lease, at, sent).await;
        if i % 4 >= 2 {
            // Reported by the server's expiry cycle (10 times a second), within LOSS_NOTICE.
            assert!(
                took < LOSS_NOTICE,
                "early expiry heard after {took:?} (subscribed before: {subscribed})"
            );
            expired.push(took);
        } else if subscribed {
            assert!(took < DELETE_HEARD, "DEL heard after {took:?}");
            deleted.push(took);
        } else {
            assert!(
                took < LOSS_NOTICE,
                "DEL before the subscription heard after {took:?}"
            );
            unsubscribed.push(took);
        }
        assert_eq!(lease.loss_reason(), Some(LossReason::NotHeldOnServer));
    }
    report("deleted", deleted);
    report("deleted right after the grant", unsubscribed);
    // An expiry is reported when the server's active expiry cycle (10 times a second) or an
    // access removes the key.
    report("expired early (PEXPIRE 1)", expired);
}

/// A keyspace event may arrive after the same client holds the key again (its release's `DEL`,
/// delayed on the pub/sub connection, reaches it after the next grant of the same name): the
/// lease is checked with a `GET` and stays held. Events come in order, so once a later loss (the
/// sentinel's) is heard, the delayed event was seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_event_for_a_key_held_again_is_checked_not_taken_for_a_loss() {
    let server = PrivateRedis::start(None).await;
    let proxy = Proxy::start_local(server.port).await;
    let locks = RedisLock::connect(&format!(
        "redis://127.0.0.1:{}?prefix={}",
        proxy.port,
        fresh_prefix()
    ))
    .await
    .expect("connect");
    assert_eq!(locks.loss_notice(), Some(LOSS_NOTICE));
    let mut admin = server.raw().await;
    // The pub/sub connection is the last one connecting opened; hand-renewed leases, so no
    // keepalive tick PINGs it while it is frozen.
    let pubsub = proxy.connections() - 1;
    let first = locks.acquire("again", opts(false)).await.expect("acquire");
    let sentinel = locks
        .acquire("sentinel", opts(false))
        .await
        .expect("acquire");
    // Both keys subscribed: the release's `DEL` event is sent to this client.
    until_subscribers(&mut admin, &locks.lock_key("again"), 1).await;
    until_subscribers(&mut admin, &locks.lock_key("sentinel"), 1).await;
    proxy.freeze_connection(pubsub);
    first.release().await.expect("release");
    let again = locks
        .acquire("again", opts(false))
        .await
        .expect("acquire again");
    let at = lost_at(&sentinel);
    let sent = Instant::now();
    redis::cmd("DEL")
        .arg(locks.lock_key("sentinel"))
        .query_async::<()>(&mut admin)
        .await
        .expect("DEL");
    proxy.thaw();
    heard(&sentinel, at, sent).await;
    again.check().await.expect("still held");
    assert_eq!(again.state(), LeaseState::Held);
    again.release().await.expect("release");
}

/// An evicting policy is warned about at connect (and refused with `strict=true`, naming the
/// policy); an evicted lock key is heard of within milliseconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicted_lock_key_is_heard_within_milliseconds() {
    let server = PrivateRedis::start_with(
        None,
        &["--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"],
    )
    .await;
    let mut admin = server.raw().await;
    let url = with_prefix(&server.url(), &fresh_prefix());
    match RedisLock::connect(&format!("{url}&strict=true")).await {
        Err(Error::InvalidConfig { reason, .. }) => {
            assert!(reason.contains("allkeys-lru"), "{reason}")
        }
        other => panic!("strict connect to an evicting server: {other:?}"),
    }
    let locks = RedisLock::connect(&url).await.expect("connect");
    let lease = locks.acquire("evicted", opts(true)).await.expect("acquire");
    let key = locks.lock_key("evicted");
    until_subscribers(&mut admin, &key, 1).await;
    let at = lost_at(&lease);
    let filler = "x".repeat(64 * 1024);
    let mut sent = None;
    for i in 0..4000 {
        let t = Instant::now();
        redis::cmd("SET")
            .arg(format!("filler:{i}"))
            .arg(&filler)
            .query_async::<()>(&mut admin)
            .await
            .expect("SET filler");
        // EXISTS does not touch the key's LRU clock.
        if !exists(&mut admin, &key).await {
            sent = Some(t);
            break;
        }
    }
    let sent = sent.expect("the lock key was never evicted");
    let took = heard(&lease, at, sent).await;
    eprintln!("evicted: loss heard {took:?} after the write that evicted the key");
    assert!(took < DELETE_HEARD, "eviction heard after {took:?}");
    assert_eq!(lease.loss_reason(), Some(LossReason::NotHeldOnServer));
}

/// The connect-time warning about an evicting policy is logged (captured with the test
/// subscriber); `strict` refuses `volatile-*` policies too and accepts `noeviction`.
#[test]
fn an_evicting_policy_is_warned_about_by_default_and_refused_with_strict() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let server = rt.block_on(PrivateRedis::start_with(
        None,
        &["--maxmemory", "8mb", "--maxmemory-policy", "volatile-lru"],
    ));
    let url = with_prefix(&server.url(), &fresh_prefix());
    let (locks, text) = lockkit::observe::testing::traced(&rt, RedisLock::connect(&url));
    locks.expect("a default connect uses the server");
    assert!(
        text.contains("WARN") && text.contains("maxmemory-policy is volatile-lru"),
        "no warning about the eviction policy:\n{text}"
    );
    rt.block_on(async {
        let strict = format!("{url}&strict=true");
        match RedisLock::connect(&strict).await {
            Err(Error::InvalidConfig { reason, .. }) => {
                assert!(reason.contains("volatile-lru"), "{reason}")
            }
            other => panic!("strict connect: {other:?}"),
        }
        let mut admin = server.raw().await;
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory-policy")
            .arg("noeviction")
            .query_async::<()>(&mut admin)
            .await
            .expect("CONFIG SET");
        RedisLock::connect(&strict)
            .await
            .expect("strict connect to a noeviction server");
    });
}

/// With `CONFIG` renamed away (as managed services do), connecting works, the guarantees say
/// that losses are heard only at the next renewal, and the eviction policy is still read (from
/// `INFO memory`): `strict` refuses an evicting one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_config_locks_work_and_declare_no_loss_notice() {
    let server = PrivateRedis::start_with(None, &["--rename-command", "CONFIG", ""]).await;
    let url = with_prefix(&server.url(), &fresh_prefix());
    let locks = RedisLock::connect(&url).await.expect("connect");
    assert_eq!(locks.guarantees().loss_notice, None);
    assert_eq!(locks.loss_notice(), None);
    let lease = locks
        .acquire("no-config", opts(true))
        .await
        .expect("acquire");
    lease.release().await.expect("release");
    RedisLock::connect(&format!("{url}&strict=true"))
        .await
        .expect("strict: no maxmemory, no eviction");

    let evicting = PrivateRedis::start_with(
        None,
        &[
            "--rename-command",
            "CONFIG",
            "",
            "--maxmemory",
            "8mb",
            "--maxmemory-policy",
            "allkeys-random",
        ],
    )
    .await;
    let url = with_prefix(&evicting.url(), &fresh_prefix());
    match RedisLock::connect(&format!("{url}&strict=true")).await {
        Err(Error::InvalidConfig { reason, .. }) => {
            assert!(reason.contains("allkeys-random"), "{reason}")
        }
        other => panic!("strict connect without CONFIG: {other:?}"),
    }
}

/// `notifications=use` never reconfigures the server: without the flags it connects with no
/// loss notice and leaves `notify-keyspace-events` as it was; with them already set (by the
/// operator) it uses them. `notifications=off` uses none even where the server sends them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_use_and_off_leave_the_server_setting_alone() {
    let server = PrivateRedis::start_with(None, &["--notify-keyspace-events", "El"]).await;
    let mut admin = server.raw().await;
    let url = with_prefix(&server.url(), &fresh_prefix());
    let using = RedisLock::connect(&format!("{url}&notifications=use"))
        .await
        .expect("connect");
    assert_eq!(using.guarantees().loss_notice, None);
    assert_eq!(config_get(&mut admin, "notify-keyspace-events").await, "lE");
    let off = RedisLock::connect(&format!("{url}&notifications=off"))
        .await
        .expect("connect");
    assert_eq!(off.guarantees().loss_notice, None);
    assert_eq!(config_get(&mut admin, "notify-keyspace-events").await, "lE");

    // The operator turns them on: `use` now hears an admin DEL at once, `off` still does not.
    redis::cmd("CONFIG")
        .arg("SET")
        .arg("notify-keyspace-events")
        .arg("KEA")
        .query_async::<()>(&mut admin)
        .await
        .expect("CONFIG SET");
    let using = RedisLock::connect(&format!("{url}&notifications=use"))
        .await
        .expect("connect");
    assert_eq!(using.guarantees().loss_notice, Some(LOSS_NOTICE));
    let off = RedisLock::connect(&format!("{url}&notifications=off"))
        .await
        .expect("connect");
    assert_eq!(off.guarantees().loss_notice, None);
    let lease = using.acquire("use-del", opts(true)).await.expect("acquire");
    until_subscribers(&mut admin, &using.lock_key("use-del"), 1).await;
    let at = lost_at(&lease);
    let sent = Instant::now();
    let _: i64 = redis::cmd("DEL")
        .arg(using.lock_key("use-del"))
        .query_async(&mut admin)
        .await
        .expect("DEL");
    let took = heard(&lease, at, sent).await;
    assert!(took < DELETE_HEARD, "DEL heard after {took:?}");
    let kept = off.acquire("off-del", opts(true)).await.expect("acquire");
    let _: i64 = redis::cmd("DEL")
        .arg(off.lock_key("off-del"))
        .query_async(&mut admin)
        .await
        .expect("DEL");
    // Off: no notification reaches it; `check` (a server round trip) is what finds the loss.
    assert_eq!(kept.state(), LeaseState::Held);
    assert!(matches!(kept.check().await, Err(Error::NotHeld { .. })));
    assert_eq!(kept.state(), LeaseState::Lost);
}

/// A server restarted (with its data lost) while leases are held: every lease held through the
/// client is lost, kept-alive or not, long before a renewal could find out; a lease granted by
/// the new server is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_restart_loses_every_lease_held() {
    let mut server = PrivateRedis::start(None).await;
    let locks = RedisLock::connect(&with_prefix(&server.url(), &fresh_prefix()))
        .await
        .expect("connect");
    let kept = locks.acquire("kept", opts(true)).await.expect("acquire");
    let manual = locks.acquire("manual", opts(false)).await.expect("acquire");
    let (a, b) = (lost_at(&kept), lost_at(&manual));
    let restarted = Instant::now();
    server.restart().await;
    let ta = heard(&kept, a, restarted).await;
    let tb = heard(&manual, b, restarted).await;
    eprintln!("restart: leases lost {ta:?} and {tb:?} after the SIGKILL");
    assert_eq!(kept.loss_reason(), Some(LossReason::SessionExpired));
    assert_eq!(manual.loss_reason(), Some(LossReason::SessionExpired));
    // The new server's notifications were turned on again, and a new lease lives on.
    let fresh = locks
        .acquire(
            "fresh",
            AcquireOptions::new()
                .ttl(TTL)
                .wait(Wait::Timeout(Duration::from_secs(10))),
        )
        .await
        .expect("acquire after the restart");
    let at = lost_at(&fresh);
    let mut admin = server.raw().await;
    // Turned on again right after the leases were marked lost: wait for the CONFIG SET.
    let start = Instant::now();
    while !config_get(&mut admin, "notify-keyspace-events")
        .await
        .contains('K')
    {
        assert!(
            start.elapsed() < HEARD,
            "notifications not turned on again after the restart"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let sent = Instant::now();
    redis::cmd("DEL")
        .arg(locks.lock_key("fresh"))
        .query_async::<()>(&mut admin)
        .await
        .expect("DEL");
    heard(&fresh, at, sent).await;
    assert_eq!(fresh.loss_reason(), Some(LossReason::NotHeldOnServer));
}

/// A restart that keeps the data (AOF, fsynced on every write) on a server without `CONFIG`
/// (no notifications, so no pub/sub connection kept up): the renewals would go on succeeding,
/// and only the keepalive tick's `run_id` check finds that the server restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_that_keeps_the_data_is_found_by_the_keepalive_tick() {
    let data = tempfile::tempdir().expect("temp dir");
    let dir = data.path().to_str().expect("utf-8 path").to_owned();
    let mut server = PrivateRedis::start_with(
        None,
        &[
            "--dir",
            &dir,
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--rename-command",
            "CONFIG",
            "",
        ],
    )
    .await;
    let locks = RedisLock::connect(&with_prefix(&server.url(), &fresh_prefix()))
        .await
        .expect("connect");
    let ttl = Duration::from_secs(3);
    let lease = locks
        .acquire("kept", AcquireOptions::new().ttl(ttl).wait(Wait::No))
        .await
        .expect("acquire");
    let at = lost_at(&lease);
    let key = locks.lock_key("kept");
    let restarted = Instant::now();
    server.restart().await;
    let mut admin = server.raw().await;
    assert!(
        exists(&mut admin, &key).await,
        "the lock key did not survive the restart: the test proves nothing"
    );
    let took = heard(&lease, at, restarted).await;
    eprintln!("restart keeping the data: lease lost {took:?} after the SIGKILL (tick every 1 s)");
    assert_eq!(lease.loss_reason(), Some(LossReason::SessionExpired));
}

/// A pub/sub connection that silently stops carrying bytes is found by the keepalive tick's
/// `PING` and replaced: a deleted key is heard of again afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_pubsub_connection_is_replaced() {
    let server = PrivateRedis::start(None).await;
    let proxy = Proxy::start_local(server.port).await;
    let locks = RedisLock::connect(&format!(
        "redis://127.0.0.1:{}?prefix={}&response_timeout_ms=500",
        proxy.port,
        fresh_prefix()
    ))
    .await
    .expect("connect");
    assert_eq!(locks.loss_notice(), Some(LOSS_NOTICE));
    // The pub/sub connection is the last one connecting opened.
    proxy.freeze_connection(proxy.connections() - 1);
    let opened = proxy.connections();
    // A short kept-alive lease drives the tick (every 1 s); the hand-renewed one is renewed by
    // nobody, so only a notification can tell it was deleted.
    let ticker = locks
        .acquire(
            "ticker",
            AcquireOptions::new()
                .ttl(Duration::from_secs(3))
                .wait(Wait::No),
        )
        .await
        .expect("acquire");
    let start = Instant::now();
    while proxy.connections() == opened {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the silent pub/sub connection was never replaced"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Subscribed again once a DEL is heard: retry on fresh leases until one is.
    let mut admin = server.raw().await;
    let mut heard_again = None;
    for i in 0..50 {
        let lease = locks
            .acquire(&format!("after-{i}"), opts(false))
            .await
            .expect("acquire");
        let at = lost_at(&lease);
        let sent = Instant::now();
        redis::cmd("DEL")
            .arg(locks.lock_key(lease.name()))
            .query_async::<()>(&mut admin)
            .await
            .expect("DEL");
        if let Ok(at) = tokio::time::timeout(Duration::from_millis(200), at).await {
            heard_again = Some(at.expect("task") - sent);
            break;
        }
    }
    let took = heard_again.expect("no loss heard after the pub/sub connection was replaced");
    eprintln!("after replacing a silent pub/sub connection: loss heard in {took:?}");
    ticker.release().await.expect("release");
}

/// No client subscribes to a pattern: a key's keyspace events go to the one client that holds
/// it (its channel has one subscriber while it is held, none once it is released), so the
/// server's cost per grant does not grow with the clients connected. An admin's `DEL` of one
/// client's key ends that lease only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_holders_client_subscribes_to_its_key() {
    let server = PrivateRedis::start(None).await;
    let mut admin = server.raw().await;
    let url = with_prefix(&server.url(), &fresh_prefix());
    let a = RedisLock::connect(&url).await.expect("connect");
    let b = RedisLock::connect(&url).await.expect("connect");
    assert_eq!(a.loss_notice(), Some(LOSS_NOTICE));
    assert_eq!(b.loss_notice(), Some(LOSS_NOTICE));
    let x = a.acquire("x", opts(true)).await.expect("acquire x");
    let y = b.acquire("y", opts(true)).await.expect("acquire y");
    let (kx, ky) = (a.lock_key("x"), b.lock_key("y"));
    until_subscribers(&mut admin, &kx, 1).await;
    until_subscribers(&mut admin, &ky, 1).await;
    let numpat: i64 = redis::cmd("PUBSUB")
        .arg("NUMPAT")
        .query_async(&mut admin)
        .await
        .expect("PUBSUB NUMPAT");
    assert_eq!(numpat, 0, "a client subscribed to a pattern");

    let at = lost_at(&x);
    let sent = Instant::now();
    delete(&mut admin, &kx).await;
    let took = heard(&x, at, sent).await;
    assert!(took < DELETE_HEARD, "DEL heard after {took:?}");
    assert_eq!(x.loss_reason(), Some(LossReason::NotHeldOnServer));
    y.check().await.expect("y is still held");
    assert_eq!(y.state(), LeaseState::Held);

    // Released (or lost and let go): the channels are unsubscribed.
    let _ = x.release().await;
    y.release().await.expect("release y");
    until_subscribers(&mut admin, &kx, 0).await;
    until_subscribers(&mut admin, &ky, 0).await;
}

/// A key deleted while the pub/sub connection was down (its event went to nobody) is found
/// when the connection is back: every key held is subscribed again and checked, long before
/// the lease's next renewal (20 s away).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_deleted_while_the_pubsub_connection_was_down_is_found_when_it_is_back() {
    let server = PrivateRedis::start(None).await;
    let mut admin = server.raw().await;
    let locks = RedisLock::connect(&with_prefix(&server.url(), &fresh_prefix()))
        .await
        .expect("connect");
    let lease = locks.acquire("gap", opts(true)).await.expect("acquire");
    let key = locks.lock_key("gap");
    until_subscribers(&mut admin, &key, 1).await;
    let at = lost_at(&lease);
    let killed = kill_pubsub_connections(&mut admin).await;
    assert_eq!(
        killed, 1,
        "expected to kill the client's pub/sub connection"
    );
    let sent = Instant::now();
    delete(&mut admin, &key).await;
    let took = heard(&lease, at, sent).await;
    eprintln!("deleted while the pub/sub connection was down: heard after {took:?}");
    assert_eq!(lease.loss_reason(), Some(LossReason::NotHeldOnServer));
}
