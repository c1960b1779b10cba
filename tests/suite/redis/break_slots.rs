//! Attacks on Redis elections and semaphores (breakslots): tokens across a restart from an older
//! snapshot, an admin's deletion of a semaphore's N, many contending clients.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use lockkit::redis::RedisLock;
use lockkit::redis::redis;
use lockkit::{AcquireOptions, Election, Error, LeaseState, Semaphore, Wait};

use super::PrivateRedis;
use super::slots::RedisSlotHarness;
use crate::common::slot_stress;
use crate::common::{ServerProcess, free_port, fresh_prefix, server_url, wait_until, with_prefix};

fn harness() -> RedisSlotHarness {
    RedisSlotHarness::from_env("LOCKKIT_REDIS_URL")
}

/// A `redis-server` on `port` whose data (`dump.rdb`) lives in `data`, which outlives it.
async fn spawn_on(data: &Path, port: u16) -> ServerProcess {
    let mut cmd = Command::new("redis-server");
    cmd.args(["--bind", "127.0.0.1", "--port", &port.to_string()])
        .arg("--dir")
        .arg(data)
        .args(["--save", "", "--appendonly", "no", "--daemonize", "no"]);
    let proc = ServerProcess::spawn("redis", tempfile::tempdir().expect("log dir"), cmd);
    let p = port.to_string();
    wait_until("private redis-server", Duration::from_secs(10), || {
        Command::new("redis-cli")
            .args(["-p", &p, "ping"])
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "PONG")
    })
    .await;
    proc
}

/// A server killed (SIGKILL) and restarted from a snapshot taken before the last term was made
/// (an RDB `SAVE`, or `appendfsync everysec` losing its last second): the election's fence
/// counter is back at an older value. The next term must still be higher than every term
/// handed out before the kill: a term is a fencing token, and a fence that accepted the lost
/// term's writes must refuse the new leader's otherwise. The lock's `bump` floors the counter
/// at `TIME` on every grant for this; the slot scripts' `bump` floored it only when new, so the
/// next leader got the lost term again. FAILS on main e58afdb.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terms_increase_after_a_restart_from_an_older_snapshot() {
    let data = tempfile::tempdir().expect("data dir");
    let port = free_port();
    let mut server = spawn_on(data.path(), port).await;
    let url = format!("redis://127.0.0.1:{port}?prefix={}", fresh_prefix());
    let elections = RedisLock::connect(&url).await.expect("connect");
    let sems = RedisLock::connect(&url).await.expect("connect");
    let once = AcquireOptions::new()
        .ttl(Duration::from_secs(10))
        .wait(Wait::No);
    let a = elections
        .campaign("snap", b"a", once.clone())
        .await
        .expect("campaign a");
    let t1 = a.term();
    a.resign().await.expect("resign a");
    let p = sems
        .acquire_permit("snap", 1, once.clone())
        .await
        .expect("permit");
    let p1 = p.token();
    p.release().await.expect("release");
    let mut conn = super::raw(&format!("redis://127.0.0.1:{port}")).await;
    redis::cmd("SAVE")
        .query_async::<()>(&mut conn)
        .await
        .expect("SAVE");
    // Made after the snapshot: lost by the kill.
    let b = elections
        .campaign("snap", b"b", once.clone())
        .await
        .expect("campaign b");
    let t2 = b.term();
    assert!(t2 > t1);
    let q = sems
        .acquire_permit("snap", 1, once.clone())
        .await
        .expect("permit");
    let p2 = q.token();
    assert!(p2 > p1);
    server.kill();
    drop(b);
    drop(q);
    let _server = spawn_on(data.path(), port).await;
    let fresh = RedisLock::connect(&url)
        .await
        .expect("connect after restart");
    let c = fresh
        .campaign(
            "snap",
            b"c",
            once.clone().wait(Wait::Timeout(Duration::from_secs(15))),
        )
        .await
        .expect("campaign c");
    let r = fresh
        .acquire_permit(
            "snap",
            1,
            once.clone().wait(Wait::Timeout(Duration::from_secs(15))),
        )
        .await
        .expect("permit after restart");
    assert!(
        c.term() > t2 && r.token() > p2,
        "after the restart from a snapshot: term {:?} (lost one {t2:?}), permit token {:?} \
         (lost one {p2:?}): a token handed out twice",
        c.term(),
        r.token()
    );
    let _ = c.resign().await;
    let _ = r.release().await;
}

/// An administrator (or an `allkeys-*` eviction) deletes a semaphore's hash `P:slots:sem/N`
/// (its `n` field, N in force) while 2 of its N = 2 permits are held. A client asking for
/// N = 3 must not get a third permit while those two are Held: N may change only while the
/// semaphore is idle, and with `n` gone the acquire script saw no N in force and took slot 2.
/// FAILS on main e58afdb.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_n_does_not_let_a_larger_n_add_permits() {
    let url = with_prefix(&server_url("LOCKKIT_REDIS_URL"), &fresh_prefix());
    let (a, b) = (
        RedisLock::connect(&url).await.expect("connect"),
        RedisLock::connect(&url).await.expect("connect"),
    );
    let name = "n-deleted";
    let once = AcquireOptions::new()
        .ttl(Duration::from_secs(10))
        .wait(Wait::No);
    let p0 = a
        .acquire_permit(name, 2, once.clone())
        .await
        .expect("permit 0");
    let p1 = a
        .acquire_permit(name, 2, once.clone())
        .await
        .expect("permit 1");
    let hash = format!("{}:slots:sem/{name}", a.prefix());
    let mut conn = super::raw(&server_url("LOCKKIT_REDIS_URL")).await;
    for del in [vec!["HDEL", hash.as_str(), "n"], vec!["DEL", hash.as_str()]] {
        redis::cmd(del[0])
            .arg(&del[1..])
            .query_async::<i64>(&mut conn)
            .await
            .expect("delete");
        let third = b.acquire_permit(name, 3, once.clone()).await;
        let also = b.acquire_permit(name, 2, once.clone()).await;
        assert!(
            matches!(
                third,
                Err(Error::PermitsMismatch { .. } | Error::Held { .. })
            ) && matches!(
                also,
                Err(Error::PermitsMismatch { .. } | Error::Held { .. })
            ),
            "after {}: with 2 of N = 2 permits Held, an acquire of N = 3 gave {:?} and one of \
             N = 2 gave {:?}",
            del[0],
            third.as_ref().map(|p| p.slot()),
            also.as_ref().map(|p| p.slot())
        );
    }
    assert_eq!(p0.state(), LeaseState::Held);
    assert_eq!(p1.state(), LeaseState::Held);
    p0.release().await.expect("release");
    p1.release().await.expect("release");
    // Idle again: a new N is taken.
    b.acquire_permit(name, 3, once)
        .await
        .expect("N = 3 once idle")
        .release()
        .await
        .expect("release");
}

/// [`slot_stress::permits_hold_under_cancels_and_lapses`] on Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_hold_under_cancels_and_lapses() {
    slot_stress::permits_hold_under_cancels_and_lapses(&harness(), "redis").await;
}

/// [`slot_stress::one_leader_under_cancels_and_lapses`] on Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_leader_under_cancels_and_lapses() {
    slot_stress::one_leader_under_cancels_and_lapses(&harness(), "redis").await;
}

/// [`slot_stress::permits_of_two_ns_never_mix`] on Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_of_two_ns_never_mix() {
    slot_stress::permits_of_two_ns_never_mix(&harness(), "redis").await;
}

/// Permit holders and waiters whose server is killed and restarted without persistence: the
/// waiters are granted the slots on the new server with tokens above the old ones (the `TIME`
/// floor), never one slot to both at once, and every old holder becomes Lost within its TTL. (That a
/// waiter may be granted while an old holder still reads Held is the documented efficiency
/// caveat of a restart that loses the data: only the larger token keeps a resource safe.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_after_a_restart_without_persistence() {
    let mut server = PrivateRedis::start(None).await;
    let url = with_prefix(&server.url(), &fresh_prefix());
    let (a, b) = (
        RedisLock::connect(&url).await.expect("connect"),
        RedisLock::connect(&url).await.expect("connect"),
    );
    let name = "restart";
    let ttl = Duration::from_secs(3);
    let opts = AcquireOptions::new().ttl(ttl);
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(
            a.acquire_permit(name, 2, opts.clone().wait(Wait::No))
                .await
                .expect("permit"),
        );
    }
    let max_old = held.iter().map(|p| p.token().get()).max().expect("tokens");
    let mut waiters = Vec::new();
    for _ in 0..2 {
        let b = b.clone();
        let o = opts.clone().wait(Wait::Timeout(Duration::from_secs(20)));
        waiters.push(tokio::spawn(
            async move { b.acquire_permit(name, 2, o).await },
        ));
    }
    let mut conn = server.raw().await;
    await_queued(&mut conn, &format!("{}:queue:sem/{name}", a.prefix()), 2).await;
    server.restart().await;
    let mut got = Vec::new();
    for w in waiters {
        got.push(w.await.expect("task").expect("a waiter's permit"));
    }
    for g in &got {
        assert!(
            g.token().get() > max_old,
            "{:?} not above {max_old}",
            g.token()
        );
    }
    if got[0].slot() == got[1].slot() {
        // A permit the new run granted before `b` saw the new run_id is Lost by design (it
        // cannot be told from one of the old run's) and its slot given back: the other waiter
        // took it then. Never two holders of one slot at once.
        let held_now = got.iter().filter(|g| g.state() == LeaseState::Held).count();
        assert!(held_now <= 1, "slot {} held twice", got[0].slot());
        assert_ne!(got[0].token(), got[1].token());
    }
    for p in &held {
        tokio::time::timeout(ttl + Duration::from_secs(2), p.lost())
            .await
            .unwrap_or_else(|_| panic!("slot {} still {:?} after its TTL", p.slot(), p.state()));
    }
}

/// Waits (bounded, polling the server) until `n` waiters queue in `queue`.
async fn await_queued(conn: &mut redis::aio::MultiplexedConnection, queue: &str, n: i64) {
    let start = tokio::time::Instant::now();
    loop {
        let queued: i64 = redis::cmd("ZCARD")
            .arg(queue)
            .query_async(conn)
            .await
            .expect("ZCARD");
        if queued == n {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{queued} waiters queued in {queue}, want {n}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A permit holder whose connections go through a proxy that freezes (renewals and the loss
/// watch cut) loses its slot to a waiter only after its own state left `Held`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_permit_holder_is_not_held_when_reclaimed() {
    crate::common::slot_stress::cut_off_through_a_proxy(
        "LOCKKIT_REDIS_URL",
        "redis",
        |url| async move { RedisLock::connect(&url).await.expect("connect") },
    )
    .await;
}

/// The server stopped (SIGSTOP) for longer than a permit's TTL while its holder and a waiter
/// are connected: once it runs again the waiter gets the slot, and the holder is no longer
/// Held by then (its renewals failed; its key expired on the server's clock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_outlived_by_a_stopped_server_is_not_held_when_reclaimed() {
    use crate::common::slot_stress::cut_off_holder_is_not_held_when_reclaimed;
    let server = Arc::new(PrivateRedis::start(None).await);
    let url = with_prefix(&server.url(), &fresh_prefix());
    let a = RedisLock::connect(&url).await.expect("connect");
    let b = RedisLock::connect(&url).await.expect("connect");
    let s = server.clone();
    cut_off_holder_is_not_held_when_reclaimed(&a, Arc::new(b), "stopped", move || {
        s.proc.signal("STOP");
        // No signal exists for "the holder's TTL (2 s) has passed on the server": the stop has
        // to outlast it.
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(3000)).await;
            s.proc.signal("CONT");
        });
    })
    .await;
}

/// Values with spaces, newlines, NUL bytes, `%` and non-UTF-8 bytes (the scripts keep records
/// as `"OWNER TOKEN VERSION VALUE"` and publish `g SLOT TOKEN VERSION TTL VALUE`) round-trip
/// through `leader()`, a proclaim and an observer; so does a value of the maximum length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_values_round_trip() {
    let url = with_prefix(&server_url("LOCKKIT_REDIS_URL"), &fresh_prefix());
    let (a, w) = (
        RedisLock::connect(&url).await.expect("connect"),
        RedisLock::connect(&url).await.expect("connect"),
    );
    let odd: &[u8] = b" a b\n\0c %d %s\r\n \xff\xfe 1 2 3 ";
    let big: Vec<u8> = (0..lockkit::MAX_VALUE_BYTES)
        .map(|i| if i % 7 == 0 { b' ' } else { (i % 251) as u8 })
        .collect();
    let mut l = a
        .campaign(
            "odd",
            odd,
            AcquireOptions::new()
                .ttl(Duration::from_secs(10))
                .wait(Wait::No),
        )
        .await
        .expect("campaign");
    let term = l.term();
    assert_eq!(
        a.leader("odd").await.expect("leader"),
        Some(lockkit::LeaderInfo::new(term.clone(), odd.to_vec()))
    );
    let mut obs = w.observe("odd").await.expect("observe");
    assert_eq!(
        obs.next().await.expect("first"),
        lockkit::LeaderEvent::Leader(lockkit::LeaderInfo::new(term.clone(), odd.to_vec()))
    );
    for v in [&big[..], b"", odd] {
        l.proclaim(v).await.expect("proclaim");
        let e = tokio::time::timeout(Duration::from_secs(10), obs.next())
            .await
            .expect("the observer did not report the proclaim")
            .expect("observer");
        assert_eq!(
            e,
            lockkit::LeaderEvent::Leader(lockkit::LeaderInfo::new(term.clone(), v.to_vec())),
            "proclaimed {} bytes",
            v.len()
        );
        assert_eq!(
            a.leader("odd").await.expect("leader").map(|i| i.value),
            Some(v.to_vec())
        );
    }
    l.resign().await.expect("resign");
}

/// N at the bounds: 0 and `MAX_PERMITS + 1` are refused before any I/O; a semaphore of
/// `MAX_PERMITS` grants, reads back with that N, and refuses another N while held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_at_the_bounds() {
    let url = with_prefix(&server_url("LOCKKIT_REDIS_URL"), &fresh_prefix());
    let s = RedisLock::connect(&url).await.expect("connect");
    let once = AcquireOptions::new()
        .ttl(Duration::from_secs(10))
        .wait(Wait::No);
    for bad in [0, lockkit::MAX_PERMITS + 1, u32::MAX] {
        assert!(
            matches!(
                s.acquire_permit("bounds", bad, once.clone()).await,
                Err(Error::InvalidConfig { .. })
            ),
            "N = {bad}"
        );
    }
    let max = lockkit::MAX_PERMITS;
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(
            s.acquire_permit("bounds", max, once.clone())
                .await
                .expect("permit of N = MAX_PERMITS"),
        );
    }
    let holders = s
        .permit_holders("bounds")
        .await
        .expect("holders")
        .expect("some");
    assert_eq!(holders.permits, max);
    assert_eq!(holders.holders.len(), 3);
    assert!(matches!(
        s.acquire_permit("bounds", 1, once.clone()).await,
        Err(Error::PermitsMismatch { theirs, .. }) if theirs == max
    ));
    for p in held {
        p.release().await.expect("release");
    }
}

/// Terms jump (every grant floors the counter at `TIME` in µs), yet an observer that keeps up
/// reports five leaders, each resigning before the next one campaigns, without a `Missed`: a
/// grant's message names the token it follows (`PREV`), so a jump is not a gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jumping_terms_are_not_missed_by_an_observer_that_keeps_up() {
    use lockkit::{LeaderEvent, LeaderInfo};
    let url = with_prefix(&server_url("LOCKKIT_REDIS_URL"), &fresh_prefix());
    let (a, w) = (
        RedisLock::connect(&url).await.expect("connect"),
        RedisLock::connect(&url).await.expect("connect"),
    );
    let once = AcquireOptions::new()
        .ttl(Duration::from_secs(10))
        .wait(Wait::No);
    let mut obs = w.observe("jumps").await.expect("observe");
    assert_eq!(obs.next().await.expect("first"), LeaderEvent::NoLeader);
    let mut last = None;
    for i in 0..5u8 {
        let l = a
            .campaign("jumps", &[i], once.clone())
            .await
            .expect("campaign");
        if let Some(t) = &last {
            assert!(
                l.term().get() > t + 1,
                "terms did not jump: {t} then {:?}",
                l.term()
            );
        }
        last = Some(l.term().get());
        let e = tokio::time::timeout(Duration::from_secs(10), obs.next())
            .await
            .expect("no event")
            .expect("observer");
        assert_eq!(
            e,
            LeaderEvent::Leader(LeaderInfo::new(l.term(), vec![i])),
            "leader {i}"
        );
        l.resign().await.expect("resign");
        let e = tokio::time::timeout(Duration::from_secs(10), obs.next())
            .await
            .expect("no event")
            .expect("observer");
        assert_eq!(e, LeaderEvent::NoLeader, "after leader {i}");
    }
}

/// Every normal connection cut (`CLIENT KILL TYPE normal`, then `TYPE pubsub`) while a leader
/// leads, a candidate waits and an observer watches: the leader stays Held (its client
/// reconnects and renews), the candidate is not elected meanwhile, the resign still hands over
/// to it with a higher term, and the observer (which says `Missed` after resubscribing) never
/// reports a term going back and reaches the new leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_connections_keep_one_leader() {
    use lockkit::{LeaderEvent, LeaderInfo};
    let server = PrivateRedis::start(None).await;
    let url = with_prefix(&server.url(), &fresh_prefix());
    let (a, b, w) = (
        RedisLock::connect(&url).await.expect("connect"),
        RedisLock::connect(&url).await.expect("connect"),
        RedisLock::connect(&url).await.expect("connect"),
    );
    let ttl = Duration::from_secs(3);
    let la = a
        .campaign("cut", b"a", AcquireOptions::new().ttl(ttl).wait(Wait::No))
        .await
        .expect("campaign a");
    let mut obs = w.observe("cut").await.expect("observe");
    assert_eq!(
        obs.next().await.expect("first"),
        LeaderEvent::Leader(LeaderInfo::new(la.term(), b"a".to_vec()))
    );
    let bb = b.clone();
    let waiter = tokio::spawn(async move {
        bb.campaign(
            "cut",
            b"b",
            AcquireOptions::new()
                .ttl(ttl)
                .wait(Wait::Timeout(Duration::from_secs(30))),
        )
        .await
    });
    let mut admin = server.raw().await;
    await_queued(&mut admin, &format!("{}:queue:elect/cut", a.prefix()), 1).await;
    for kind in ["normal", "pubsub"] {
        let killed: i64 = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg(kind)
            .arg("SKIPME")
            .arg("yes")
            .query_async(&mut admin)
            .await
            .expect("CLIENT KILL");
        assert!(killed >= 1, "no {kind} connection to kill");
    }
    // Through two renewal ticks (TTL/3 each) after the cut: still the one leader.
    tokio::time::sleep(ttl).await;
    assert_eq!(
        la.state(),
        LeaseState::Held,
        "the leader lost to a cut connection"
    );
    assert!(
        !waiter.is_finished(),
        "a second leader while the first is Held"
    );
    let t1 = la.term();
    la.resign().await.expect("resign");
    let lb = waiter.await.expect("task").expect("campaign b");
    assert!(lb.term() > t1);
    let mut seen = Vec::new();
    let mut last = t1.clone();
    loop {
        let e = tokio::time::timeout(Duration::from_secs(10), obs.next())
            .await
            .unwrap_or_else(|_| panic!("the observer never reported b: {seen:?}"))
            .expect("observer");
        seen.push(e.clone());
        if let LeaderEvent::Leader(l) = &e {
            assert!(l.term >= last, "term went back: {seen:?}");
            last = l.term.clone();
            if l.term == lb.term() {
                break;
            }
        }
    }
    lb.resign().await.expect("resign b");
}

/// Ten waiting permit acquires dropped (their futures aborted) while the one permit is held
/// leave nothing on the server: the queue empties and no waiter's stored value (`w{ID}`) or
/// waiter key stays; the holder's release then finds no one to hand to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_permit_waiters_leave_nothing_on_the_server() {
    let url = with_prefix(&server_url("LOCKKIT_REDIS_URL"), &fresh_prefix());
    let a = RedisLock::connect(&url).await.expect("connect");
    let name = "dropped";
    let held = a
        .acquire_permit(
            name,
            1,
            AcquireOptions::new()
                .ttl(Duration::from_secs(10))
                .wait(Wait::No),
        )
        .await
        .expect("permit");
    let mut waiters = Vec::new();
    for _ in 0..10 {
        let c = RedisLock::connect(&url).await.expect("connect");
        waiters.push(tokio::spawn(async move {
            c.acquire_permit(
                name,
                1,
                AcquireOptions::new()
                    .ttl(Duration::from_secs(10))
                    .wait(Wait::Timeout(Duration::from_secs(60))),
            )
            .await
        }));
    }
    let mut conn = super::raw(&server_url("LOCKKIT_REDIS_URL")).await;
    let queue = format!("{}:queue:sem/{name}", a.prefix());
    await_queued(&mut conn, &queue, 10).await;
    for w in &waiters {
        w.abort();
    }
    for w in waiters {
        assert!(w.await.is_err_and(|e| e.is_cancelled()));
    }
    await_queued(&mut conn, &queue, 0).await;
    let hash = format!("{}:slots:sem/{name}", a.prefix());
    let start = tokio::time::Instant::now();
    loop {
        let fields: Vec<String> = redis::cmd("HKEYS")
            .arg(&hash)
            .query_async(&mut conn)
            .await
            .expect("HKEYS");
        let waiters: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}:waiter:*", a.prefix()))
            .query_async(&mut conn)
            .await
            .expect("KEYS");
        if !fields.iter().any(|f| f.starts_with('w')) && waiters.is_empty() {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "left on the server: fields {fields:?}, waiter keys {waiters:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    held.release().await.expect("release");
    assert_eq!(a.permit_holders(name).await.expect("holders"), None);
}
