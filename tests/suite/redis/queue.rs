//! The waiters' queue and the batched keepalive, on private servers: FIFO hand-off with one
//! message per release, cancelled and dead waiters, and per-lease results of a batch renewal.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockkit::redis::redis;
use lockkit::redis::{RedisLock, WAITER_TTL};
use lockkit::{AcquireOptions, LeaseState, Lock, Wait};
use tokio::time::Instant;

use super::{
    PrivateRedis, await_exists, exists, kill_pubsub_connections, plant_ghost_waiter,
    subscriber_to_every_channel,
};
use crate::common::proxy::Proxy;
use crate::common::{fresh_prefix, with_prefix};

/// A private Redis server of this test's own, and its URL with a fresh key prefix.
async fn private_server() -> (PrivateRedis, String) {
    let server = PrivateRedis::start(None).await;
    let url = with_prefix(&server.url(), &fresh_prefix());
    (server, url)
}

fn opts(ttl_ms: u64, wait: Wait) -> AcquireOptions {
    AcquireOptions::new()
        .ttl(Duration::from_millis(ttl_ms))
        .keepalive(false)
        .wait(wait)
}

fn stat(info: &str, command: &str) -> u64 {
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// The commands a lock runs (those of its scripts among them) that ran between two
/// `INFO commandstats` answers, with how often, in a fixed order; those that did not run are left
/// out.
fn ran_between(before: &str, after: &str) -> Vec<(&'static str, u64)> {
    [
        "evalsha", "exists", "set", "incr", "get", "zpopmin", "del", "time", "publish", "zrange",
        "zrem", "zadd", "pexpire", "pttl", "getdel",
    ]
    .into_iter()
    .map(|c| (c, stat(after, c) - stat(before, c)))
    .filter(|(_, n)| *n > 0)
    .collect()
}

async fn info(conn: &mut redis::aio::MultiplexedConnection) -> String {
    redis::cmd("INFO")
        .arg("commandstats")
        .query_async::<String>(conn)
        .await
        .expect("INFO")
}

async fn queue_len(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> u64 {
    redis::cmd("ZCARD")
        .arg(key)
        .query_async(conn)
        .await
        .expect("ZCARD")
}

/// Waits (bounded, 10 s) until the queue at `key` has `n` entries.
async fn await_queue(conn: &mut redis::aio::MultiplexedConnection, key: &str, n: u64) {
    let start = Instant::now();
    while queue_len(conn, key).await != n {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "queue {key:?} never reached {n} entries"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waiters get the lock in the order they queued, each hand-off is one PUBLISH to the one
/// waiter concerned, and no waiter retries the acquire script on a release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_are_handed_the_lock_in_queue_order_one_message_each() {
    let (server, url) = private_server().await;
    let holder = RedisLock::connect(&url).await.expect("connect");
    let name = "fifo";
    let queue = holder.queue_key(name);
    let mut conn = server.raw().await;
    let lease = holder
        .acquire(name, opts(30_000, Wait::No))
        .await
        .expect("acquire");
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut joins = Vec::new();
    for i in 0..4u64 {
        let c = RedisLock::connect(&url).await.expect("connect");
        let order = order.clone();
        joins.push(tokio::spawn(async move {
            let l = c
                .acquire(name, opts(30_000, Wait::Timeout(Duration::from_secs(20))))
                .await
                .expect("acquire");
            order.lock().unwrap().push(i);
            l.release().await.expect("release");
        }));
        await_queue(&mut conn, &queue, i + 1).await;
    }
    let before = info(&mut conn).await;
    lease.release().await.expect("release");
    for j in joins {
        j.await.expect("waiter");
    }
    let after = info(&mut conn).await;
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3]);
    let publishes = stat(&after, "publish") - stat(&before, "publish");
    assert_eq!(publishes, 4, "one hand-off message per waiter");
    // Five releases; any other script is a waiter's look (at most one per second each).
    let scripts = stat(&after, "evalsha") - stat(&before, "evalsha");
    assert!(
        scripts <= 5 + 4,
        "{scripts} scripts for 5 releases and 4 hand-offs"
    );
    assert_eq!(queue_len(&mut conn, &queue).await, 0);
    assert!(!exists(&mut conn, &holder.lock_key(name)).await);
}

/// A queued waiter that is cancelled (its future dropped) leaves nothing behind: its place and
/// its waiter key are removed, and the next release does not hand it the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_waiter_in_the_queue_leaves_nothing_behind() {
    let server = PrivateRedis::start(None).await;
    let prefix = fresh_prefix();
    let url = with_prefix(&server.url(), &prefix);
    let holder = RedisLock::connect(&url).await.expect("connect");
    let waiter = RedisLock::connect(&url).await.expect("connect");
    let name = "cancelled";
    let queue = holder.queue_key(name);
    let mut conn = server.raw().await;
    let lease = holder
        .acquire(name, opts(30_000, Wait::No))
        .await
        .expect("acquire");
    let task = tokio::spawn(async move {
        waiter
            .acquire(name, opts(30_000, Wait::Forever))
            .await
            .map(|l| l.leak())
    });
    await_queue(&mut conn, &queue, 1).await;
    let ids: Vec<String> = redis::cmd("ZRANGE")
        .arg(&queue)
        .arg(0)
        .arg(-1)
        .query_async(&mut conn)
        .await
        .expect("ZRANGE");
    let waiter_key = format!("{prefix}:waiter:{}", ids[0]);
    assert!(exists(&mut conn, &waiter_key).await, "no waiter key");
    task.abort();
    await_exists(&mut conn, &waiter_key, false, Duration::from_secs(5)).await;
    assert_eq!(queue_len(&mut conn, &queue).await, 0, "queue entry left");
    lease.release().await.expect("release");
    assert!(
        !exists(&mut conn, &holder.lock_key(name)).await,
        "the release handed the lock to the cancelled waiter"
    );
}

/// A waiter whose process died (all its connections frozen: no refresh and no cleanup reaches
/// the server) drops out of the queue after WAITER_TTL: a release after that hands the lock to
/// the live waiter behind it at once. Handed to the dead waiter before that, the lock is free
/// again after that lease's TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_waiter_does_not_block_the_queue_past_its_ttl() {
    let server = PrivateRedis::start(None).await;
    let prefix = fresh_prefix();
    let url = with_prefix(&server.url(), &prefix);
    let holder = RedisLock::connect(&url).await.expect("connect");
    let mut conn = server.raw().await;
    for (round, wait_out) in [("expired", true), ("handed", false)] {
        let name = format!("dead-{round}");
        let queue = holder.queue_key(&name);
        let proxy = Proxy::start_local(server.port).await;
        let doomed =
            RedisLock::connect(&format!("redis://127.0.0.1:{}?prefix={prefix}", proxy.port))
                .await
                .expect("connect");
        let live = RedisLock::connect(&url).await.expect("connect");
        let lease = holder
            .acquire(&name, opts(30_000, Wait::No))
            .await
            .expect("acquire");
        let n = name.clone();
        let dead =
            tokio::spawn(async move { doomed.acquire(&n, opts(1_000, Wait::Forever)).await });
        await_queue(&mut conn, &queue, 1).await;
        proxy.freeze(); // the process is gone as far as the server can tell
        let n = name.clone();
        let waiting = tokio::spawn(async move {
            let l = live
                .acquire(&n, opts(30_000, Wait::Timeout(Duration::from_secs(20))))
                .await;
            (Instant::now(), l)
        });
        await_queue(&mut conn, &queue, 2).await;
        if wait_out {
            tokio::time::sleep(WAITER_TTL + Duration::from_millis(200)).await;
        }
        let released = Instant::now();
        lease.release().await.expect("release");
        let (at, l) = waiting.await.expect("live waiter");
        let l = l.expect("the live waiter got the lock");
        let took = at - released;
        let limit = if wait_out {
            Duration::from_millis(500)
        } else {
            Duration::from_millis(1_000 + 2_500)
        };
        assert!(took < limit, "{round}: the live waiter waited {took:?}");
        l.release().await.expect("release");
        dead.abort();
    }
}

/// A lock handed to a waiter that cannot hear (its connections frozen, as for a SIGSTOPped
/// process) is lost on the server before the waiter learns of it (deleted here, as by an
/// eviction or the lease's TTL running out) and another client takes it; the waiter's next look
/// finds it held by the other and queues again; only then does the old hand-off message arrive.
/// It is stale and must not come back as a lease: the breaker saw such a waiter return a `Held`
/// lease with the old (lower) token while the other client held the lock. Here the waiter must
/// get the lock only from the other's release, with a higher token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_off_heard_after_the_lock_was_lost_and_retaken_is_ignored() {
    let (server, url) = private_server().await;
    let a = RedisLock::connect(&url).await.expect("connect");
    let prefix = a.prefix().to_owned();
    let name = "stale-hand-off";
    let (queue, lock_key) = (a.queue_key(name), a.lock_key(name));
    let mut admin = server.raw().await;
    let proxy = Proxy::start_local(server.port).await;
    // A response timeout longer than the test: W's pub/sub PING must not replace the frozen
    // connection that holds the message.
    let w = RedisLock::connect(&format!(
        "redis://127.0.0.1:{}?prefix={prefix}&response_timeout=20s",
        proxy.port
    ))
    .await
    .expect("connect");
    // W's connections in the order it opened them: its connect's PING, its commands, and last
    // its pub/sub connection (subscribed at connect, for loss notices).
    let pubsub = proxy.connections() - 1;
    let lease_a = a
        .acquire(name, opts(10_000, Wait::No))
        .await
        .expect("acquire");
    let mut waiting = tokio::spawn(async move {
        w.acquire(name, opts(2_000, Wait::Timeout(Duration::from_secs(20))))
            .await
            .map(|l| (l.token(), l.state(), l))
    });
    await_queue(&mut admin, &queue, 1).await;
    assert_eq!(
        proxy.connections(),
        pubsub + 1,
        "W waits on the connections it opened"
    );
    for id in 0..=pubsub {
        proxy.freeze_connection(id);
    }
    // Handed to W (its channel still has a subscriber on the server): the message is held.
    lease_a.release().await.expect("release");
    assert!(
        !exists(&mut admin, &queue).await,
        "W was popped from the queue"
    );
    let _: () = redis::cmd("DEL")
        .arg(&lock_key)
        .query_async(&mut admin)
        .await
        .expect("DEL");
    let c = RedisLock::connect(&url).await.expect("connect");
    let lease_c = c
        .acquire(name, opts(10_000, Wait::No))
        .await
        .expect("C takes the lost lock");
    // W's next look finds C holding (W queues again); then the message.
    for id in 0..pubsub {
        proxy.thaw_connection(id);
    }
    await_queue(&mut admin, &queue, 1).await;
    proxy.thaw();
    if let Ok(got) = tokio::time::timeout(Duration::from_millis(700), &mut waiting).await {
        let (token, state, _l) = got.expect("W's task").expect("W got a lease");
        panic!(
            "W returned a lease ({state:?}, token {token}) while C holds the lock (token {})",
            lease_c.token()
        );
    }
    let c_token = lease_c.token();
    lease_c.release().await.expect("release");
    let (token, state, l) = waiting
        .await
        .expect("W's task")
        .expect("W got the lock after C");
    assert!(token > c_token, "W's token {token} after C's {c_token}");
    assert_eq!(state, LeaseState::Held);
    l.release().await.expect("release");
}

/// A queued waiter whose client is gone (its process was killed and the server closed its
/// sockets: nobody is subscribed to its channel, while its queue entry and waiter key live on
/// for up to WAITER_TTL) is passed over: its channel has no subscriber, so the live waiter
/// behind it gets the lock at once, not after the dead waiter's 30 s lease. Also while another
/// client subscribes to every channel by pattern, which a PUBLISH's count would include (the
/// breaker's find: the dead waiter was handed the lock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_client_is_gone_is_passed_over_at_once() {
    let (server, url) = private_server().await;
    let holder = RedisLock::connect(&url).await.expect("connect");
    let live = RedisLock::connect(&url).await.expect("connect");
    let prefix = holder.prefix().to_owned();
    let mut conn = server.raw().await;
    let name = "gone";
    let queue = holder.queue_key(name);
    let lease = holder
        .acquire(name, opts(30_000, Wait::No))
        .await
        .expect("acquire");
    let ghost_key = plant_ghost_waiter(&mut conn, &prefix, &queue).await;
    let _every_channel = subscriber_to_every_channel(&url).await;
    let waiting = tokio::spawn(async move {
        let l = live
            .acquire(name, opts(30_000, Wait::Timeout(Duration::from_secs(20))))
            .await;
        (Instant::now(), l)
    });
    await_queue(&mut conn, &queue, 2).await;
    let released = Instant::now();
    lease.release().await.expect("release");
    let (at, l) = waiting.await.expect("live waiter");
    let l = l.expect("the live waiter got the lock");
    let took = at - released;
    // A PUBLISH to the live waiter: no poll (MAX_WAIT_POLL, 1 s) is needed.
    assert!(
        took < Duration::from_millis(900),
        "the live waiter waited {took:?}"
    );
    assert_eq!(l.state(), LeaseState::Held);
    assert!(
        !exists(&mut conn, &ghost_key).await,
        "the ghost's waiter key"
    );
    assert_eq!(queue_len(&mut conn, &queue).await, 0);
    l.release().await.expect("release");
}

/// A user that may not run `PUBSUB` (an ACL: `-pubsub`) still hands the lock over by message:
/// the release cannot count the waiter's subscribers, so it serves the waiter rather than pass
/// it over or fail, and tells it by one PUBLISH.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_without_pubsub_still_hands_over_by_message() {
    let server = PrivateRedis::start(None).await;
    let mut admin = server.raw().await;
    let url = server.app_user(&["&*", "+@all", "-pubsub"]).await;
    let (holder, waiter) = (
        RedisLock::connect(&url).await.expect("connect as app"),
        RedisLock::connect(&url).await.expect("connect as app"),
    );
    let name = "no-pubsub";
    let queue = holder.queue_key(name);
    let lease = holder
        .acquire(name, opts(30_000, Wait::No))
        .await
        .expect("acquire");
    let waiting = tokio::spawn(async move {
        waiter
            .acquire(name, opts(30_000, Wait::Timeout(Duration::from_secs(10))))
            .await
    });
    await_queue(&mut admin, &queue, 1).await;
    let published = stat(&info(&mut admin).await, "publish");
    lease.release().await.expect("release without PUBSUB");
    let l = waiting.await.expect("waiter task");
    // Told by the release's one PUBLISH (not passed over, then finding the lock by a poll).
    assert_eq!(stat(&info(&mut admin).await, "publish"), published + 1);
    l.expect("the waiter got the lock")
        .release()
        .await
        .expect("release");
}

/// A live waiter whose pub/sub connection went half-open (the server dropped it, the client
/// never heard: the close is held in a frozen proxy connection) while two other clients take
/// turns on the lock: every hand-off's PUBLISH to it reaches nobody and passes it over, so it
/// must find the dead connection by itself (a PING while it waits, with no lease held) and
/// resubscribe. Without that it was passed over until its 8 s timeout (the breaker's run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_with_a_half_open_pubsub_connection_still_gets_the_lock() {
    let (server, url) = private_server().await;
    let holder = RedisLock::connect(&url).await.expect("connect");
    let prefix = holder.prefix().to_owned();
    let mut admin = server.raw().await;
    let proxy = Proxy::start_local(server.port).await;
    let name = "half-open";
    let queue = holder.queue_key(name);
    let lease = holder
        .acquire(name, opts(10_000, Wait::No))
        .await
        .expect("acquire");
    let b = RedisLock::connect(&format!("redis://127.0.0.1:{}?prefix={prefix}", proxy.port))
        .await
        .expect("connect");
    let waiting = tokio::spawn(async move {
        b.acquire(name, opts(10_000, Wait::Timeout(Duration::from_secs(8))))
            .await
            .map(|l| l.token())
    });
    await_queue(&mut admin, &queue, 1).await;
    // B's pub/sub connection is the one it opened last (to subscribe before queueing).
    proxy.freeze_connection(proxy.connections() - 1);
    kill_pubsub_connections(&mut admin).await;
    let stop = Instant::now() + Duration::from_secs(9);
    let mut others = Vec::new();
    for _ in 0..2 {
        let url = url.clone();
        others.push(tokio::spawn(async move {
            let c = RedisLock::connect(&url).await.expect("connect");
            while Instant::now() < stop {
                let l = c
                    .acquire(name, opts(10_000, Wait::Timeout(Duration::from_secs(20))))
                    .await
                    .expect("contender");
                tokio::time::sleep(Duration::from_millis(30)).await;
                l.release().await.expect("release");
            }
        }));
    }
    lease.release().await.expect("release");
    let got = waiting.await.expect("waiter task");
    for o in others {
        o.await.expect("contender");
    }
    proxy.thaw();
    got.expect("the waiter with a half-open pub/sub connection got the lock");
}

/// One batched keepalive renews every lease of the connection; a lease whose key is gone is
/// marked lost alone (soon, not at its deadline), while the others of the same batch stay held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_renewal_failing_for_one_lease_marks_only_that_one_lost() {
    let (server, url) = private_server().await;
    let locks = RedisLock::connect(&url).await.expect("connect");
    let mut conn = server.raw().await;
    let ttl = Duration::from_millis(1_500);
    let kept = AcquireOptions::new().ttl(ttl).wait(Wait::No);
    let mut leases = Vec::new();
    for i in 0..3 {
        leases.push(
            locks
                .acquire(&format!("batch{i}"), kept.clone())
                .await
                .expect("acquire"),
        );
    }
    let before = stat(&info(&mut conn).await, "evalsha");
    redis::cmd("DEL")
        .arg(locks.lock_key("batch1"))
        .query_async::<()>(&mut conn)
        .await
        .expect("DEL");
    let deleted = Instant::now();
    leases[1].lost().await;
    let took = deleted.elapsed();
    assert!(
        took < ttl / 3 + Duration::from_millis(300),
        "lost after {took:?}: not told by the batch renewal"
    );
    let window = ttl * 2;
    tokio::select! {
        s = leases[0].at_risk() => panic!("batch0 turned {s:?}"),
        s = leases[2].at_risk() => panic!("batch2 turned {s:?}"),
        _ = tokio::time::sleep(window) => {}
    }
    assert_eq!(leases[0].state(), LeaseState::Held);
    assert_eq!(leases[2].state(), LeaseState::Held);
    let calls = stat(&info(&mut conn).await, "evalsha") - before;
    // One call per tick (TTL/3) for all leases, not one per lease: about 7 calls in this window,
    // where per-lease renewals would make about 14 (two leases left) or 21.
    let ticks = (deleted.elapsed().as_millis() / (ttl / 3).as_millis()) as u64 + 1;
    assert!(calls <= ticks + 1, "{calls} renewal calls in {ticks} ticks");
    for l in leases {
        let _ = l.release().await;
    }
}

/// An uncontended acquire + release runs seven commands inside its two scripts: the acquire one
/// `EXISTS` (tombstone, lock-delay key and queue at once), `SET NX PX GET` and the token bump
/// (`TIME` and a `SET … GET` raising the counter to the server clock in µs and reading its old
/// value, which is below that unless granted more than once per µs: the floor that keeps tokens
/// increasing on a promoted replica); the release `GET`, `ZPOPMIN` and one `DEL` (of the lock and
/// lock-delay keys). No `INCR`, no `PUBLISH` when nobody waits. Try-acquire and waiting acquire
/// alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncontended_acquire_and_release_run_seven_commands() {
    let (server, url) = private_server().await;
    let locks = RedisLock::connect(&url).await.expect("connect");
    let mut conn = server.raw().await;
    let name = "six";
    // The first grant makes the fence counter.
    let first = locks
        .acquire(name, opts(30_000, Wait::No))
        .await
        .expect("acquire");
    first.release().await.expect("release");
    for wait in [Wait::No, Wait::Timeout(Duration::from_secs(5))] {
        let before = info(&mut conn).await;
        let lease = locks
            .acquire(name, opts(30_000, wait))
            .await
            .expect("acquire");
        lease.release().await.expect("release");
        let after = info(&mut conn).await;
        let ran = ran_between(&before, &after);
        assert_eq!(
            ran,
            [
                ("evalsha", 2),
                ("exists", 1),
                ("set", 2),
                ("get", 1),
                ("zpopmin", 1),
                ("del", 1),
                ("time", 1)
            ],
            "{wait:?}"
        );
    }
}

/// A `Wait::Forever` waiter queued behind a holder lives through a server outage longer than
/// the default retry budget (5 retries, about 1.5–3 s), and gets the lock from the restarted
/// (empty) server; it used to end with `Unavailable` about 3 s into the outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forever_waiter_survives_a_server_outage() {
    let (mut server, url) = private_server().await;
    let holder = RedisLock::connect(&url).await.expect("connect");
    let waiter = RedisLock::connect(&url).await.expect("connect");
    let name = "outage";
    let queue = holder.queue_key(name);
    let mut conn = server.raw().await;
    let held = holder
        .acquire(name, opts(30_000, Wait::No))
        .await
        .expect("acquire");
    let task = tokio::spawn(async move {
        waiter
            .acquire(name, AcquireOptions::new().ttl(Duration::from_secs(30)))
            .await
    });
    await_queue(&mut conn, &queue, 1).await;
    server.proc.kill();
    // The outage itself: twice the longest the default retry budget lasts. Nothing to await.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(
        !task.is_finished(),
        "a Wait::Forever acquire ended during a 6 s outage: {:?}",
        task.await.map(|r| r.map(|l| l.token()))
    );
    let dir = tempfile::tempdir().expect("temp dir");
    server.proc = PrivateRedis::spawn(dir, server.port, None, &[]);
    server.wait_ready().await;
    let lease = tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the waiter did not get the lock after the server came back")
        .unwrap()
        .expect("the waiter's acquire failed after the server came back");
    lease.release().await.expect("release");
    held.leak();
}

/// A hand-off to a queued waiter runs eight commands inside the release script: `GET`,
/// `ZPOPMIN`, the waiter key's `GETDEL`, the token bump (`TIME`, `SET … GET`), the lock key's
/// `SET PX`, the lock-delay key's `DEL` and one `PUBLISH`; the waiter sends nothing to take it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_off_runs_eight_commands() {
    let (server, url) = private_server().await;
    let holder = RedisLock::connect(&url).await.expect("connect");
    let waiter = Arc::new(RedisLock::connect(&url).await.expect("connect"));
    let mut conn = server.raw().await;
    // A waiter's fallback look (about once a second) may fall into the measured window: then
    // measure again, with a fresh name.
    for round in 0..5 {
        let name = format!("handoff-{round}");
        let lease = holder
            .acquire(&name, opts(30_000, Wait::No))
            .await
            .expect("acquire");
        let w = waiter.clone();
        let n = name.clone();
        let waiting = tokio::spawn(async move {
            w.acquire(&n, opts(30_000, Wait::Timeout(Duration::from_secs(20))))
                .await
        });
        await_queue(&mut conn, &holder.queue_key(&name), 1).await;
        let before = info(&mut conn).await;
        lease.release().await.expect("release");
        let handed = waiting
            .await
            .expect("waiter task")
            .expect("handed the lock");
        let after = info(&mut conn).await;
        handed.release().await.expect("release");
        let ran = ran_between(&before, &after);
        if ran.first() != Some(&("evalsha", 1)) {
            continue; // the waiter looked meanwhile
        }
        assert_eq!(
            ran,
            [
                ("evalsha", 1),
                ("set", 2),
                ("get", 1),
                ("zpopmin", 1),
                ("del", 1),
                ("time", 1),
                ("publish", 1),
                ("getdel", 1)
            ]
        );
        return;
    }
    panic!("the waiter looked at the lock during every measured hand-off");
}
