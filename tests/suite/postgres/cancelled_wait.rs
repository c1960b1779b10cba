//! A waiter (of a lock, a permit, a leadership) whose waiting statement an admin cancels
//! (`pg_cancel_backend`) keeps waiting; a waiter whose acquire is dropped leaves the server's
//! lock queue at once.

use std::time::Duration;

use lockkit::postgres::PgLock;
use lockkit::postgres::sqlx;
use lockkit::{AcquireOptions, Election, Lock, LockExt, Semaphore, Wait};
use tokio::time::Instant;

use super::server::admin;
use super::{advisory_locks, base_url, wait_no_advisory_lock, waiting_pid};
use crate::common::{fresh_prefix, with_prefix};

/// A waiter queued in the server's lock queue (`SELECT pg_advisory_lock($1)`) whose statement
/// an admin cancels with `pg_cancel_backend` (what a DBA or a "cancel long-running queries" job
/// does) keeps waiting on a new session; before the fix its acquire ended with a non-retryable
/// `Error::Backend` (SQLSTATE 57014) although it was asked to wait 30 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_survives_pg_cancel_backend() {
    let url = with_prefix(&base_url(), &fresh_prefix());
    let (a, b) = (
        PgLock::connect(&url).await.unwrap(),
        PgLock::connect(&url).await.unwrap(),
    );
    let held = a.try_acquire("c", Duration::from_secs(30)).await.unwrap();
    let key = a.key("c");
    let waiter = tokio::spawn(async move {
        let opts = AcquireOptions::new()
            .ttl(Duration::from_secs(30))
            .wait(Wait::Timeout(Duration::from_secs(30)));
        b.acquire("c", opts).await.map(|l| l.token())
    });
    let mut db = admin(&base_url()).await;
    // No signal for "the waiter is queued": poll the server's view of it.
    let until = Instant::now() + Duration::from_secs(10);
    let pid: i32 = loop {
        // Only this test's waiter: the server is shared, and cancelling another test's wait
        // failed it (postgres::break_slots::permits_of_two_ns_never_mix got the 57014).
        let pid: Option<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
             AND classid = (($1 >> 32) & 4294967295)::oid AND objid = ($1 & 4294967295)::oid \
             AND objsubid = 1 LIMIT 1",
        )
        .bind(key)
        .fetch_optional(&mut db)
        .await
        .unwrap();
        if let Some(pid) = pid {
            break pid;
        }
        assert!(Instant::now() < until, "the waiter never queued");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let cancelled: bool = sqlx::query_scalar("SELECT pg_cancel_backend($1)")
        .bind(pid)
        .fetch_one(&mut db)
        .await
        .unwrap();
    assert!(cancelled);
    held.release().await.unwrap();
    let got = waiter.await.unwrap();
    assert!(
        got.is_ok(),
        "the waiter's acquire ended after pg_cancel_backend of its wait: {got:?}"
    );
}

/// `pg_cancel_backend` of the session waiting for advisory key `key` (this test's own: the
/// server is shared).
async fn cancel_waiter_of(key: i64) {
    let pid = waiting_pid(&base_url(), key).await;
    let mut db = admin(&base_url()).await;
    let cancelled: bool = sqlx::query_scalar("SELECT pg_cancel_backend($1)")
        .bind(pid)
        .fetch_one(&mut db)
        .await
        .unwrap();
    assert!(cancelled, "pg_cancel_backend({pid}) found no session");
}

fn waiting(ttl: Duration) -> AcquireOptions {
    AcquireOptions::new()
        .ttl(ttl)
        .wait(Wait::Timeout(Duration::from_secs(30)))
}

/// A permit waiter queued behind another on the semaphore's gate (`pg_advisory_lock(gate)`)
/// whose statement an admin cancels keeps waiting, as the lock's waiters do, and gets the
/// permit in its turn; before the fix its acquire ended with `Error::Backend` (SQLSTATE 57014).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permit_waiter_survives_pg_cancel_backend() {
    let url = with_prefix(&base_url(), &fresh_prefix());
    let (a, b, c) = (
        PgLock::connect(&url).await.unwrap(),
        PgLock::connect(&url).await.unwrap(),
        PgLock::connect(&url).await.unwrap(),
    );
    let ttl = Duration::from_secs(30);
    let held = a
        .acquire_permit("p", 1, AcquireOptions::new().ttl(ttl).wait(Wait::No))
        .await
        .unwrap();
    // B is first in line: it holds the gate and watches the slots (no statement running).
    let gate = a.key("sem/p\0gate");
    let first = tokio::spawn(async move { b.acquire_permit("p", 1, waiting(ttl)).await });
    let until = Instant::now() + Duration::from_secs(10);
    while advisory_locks(&base_url(), gate).await == 0 {
        assert!(
            Instant::now() < until,
            "the first waiter never took the gate"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // C queues behind B on the gate: its statement waits in the server's lock queue.
    let second = tokio::spawn(async move { c.acquire_permit("p", 1, waiting(ttl)).await });
    cancel_waiter_of(gate).await;
    held.release().await.unwrap();
    let p = first.await.unwrap().expect("the first waiter's permit");
    p.release().await.unwrap();
    let got = second.await.unwrap();
    assert!(
        got.is_ok(),
        "the permit waiter's acquire ended after pg_cancel_backend of its wait: {got:?}"
    );
    got.unwrap().release().await.unwrap();
}

/// A candidate waiting for the leadership (`pg_advisory_lock` on the election's slot) whose
/// statement an admin cancels keeps campaigning, and leads once the leader resigns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn candidate_survives_pg_cancel_backend() {
    let url = with_prefix(&base_url(), &fresh_prefix());
    let (a, b) = (
        PgLock::connect(&url).await.unwrap(),
        PgLock::connect(&url).await.unwrap(),
    );
    let ttl = Duration::from_secs(30);
    let leader = a
        .campaign("e", b"a", AcquireOptions::new().ttl(ttl).wait(Wait::No))
        .await
        .unwrap();
    let slot = a.key("elect/e");
    let candidate = tokio::spawn(async move { b.campaign("e", b"b", waiting(ttl)).await });
    cancel_waiter_of(slot).await;
    leader.resign().await.unwrap();
    let got = candidate.await.unwrap();
    assert!(
        got.is_ok(),
        "the candidate's campaign ended after pg_cancel_backend of its wait: {got:?}"
    );
    got.unwrap().resign().await.unwrap();
}

/// Sessions `pid` that wait on a lock (`pg_stat_activity`), on the shared server.
async fn waiting_on_a_lock(pid: i32) -> i64 {
    let mut db = admin(&base_url()).await;
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'",
    )
    .bind(pid)
    .fetch_one(&mut db)
    .await
    .expect("pg_stat_activity")
}

/// An acquire waiting in the server's lock queue, dropped (here by a `select!`, as a
/// `tokio::time::timeout` or a Ctrl-C handler does), leaves the queue at once: its statement
/// no longer waits, no lock of its session is left in `pg_locks`, and when the holder releases,
/// a try-once of a third client gets the lock. Before the fix the statement stayed queued
/// (sqlx's drop of the connection first waits for the statement's reply): the ghost waiter was
/// granted the lock at the release and gave it back only then, so the try-once got `Held`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_waiter_leaves_the_lock_queue() {
    let url = with_prefix(&base_url(), &fresh_prefix());
    let (a, b, c) = (
        PgLock::connect(&url).await.unwrap(),
        PgLock::connect(&url).await.unwrap(),
        PgLock::connect(&url).await.unwrap(),
    );
    let ttl = Duration::from_secs(30);
    let held = a.try_acquire("dw", ttl).await.unwrap();
    let key = a.key("dw");
    let base = base_url();
    // Boxed, so that dropping it really drops the acquire.
    let mut waiter = Box::pin(b.acquire("dw", AcquireOptions::new().ttl(ttl).wait(Wait::Forever)));
    let pid = tokio::select! {
        r = &mut waiter => panic!("the waiter returned while the lock is held: {r:?}"),
        pid = waiting_pid(&base, key) => pid,
    };
    drop(waiter);
    // No signal for "the server ended the wait": poll its view of the session.
    let until = Instant::now() + Duration::from_secs(5);
    while waiting_on_a_lock(pid).await > 0 {
        assert!(
            Instant::now() < until,
            "the dropped waiter's session {pid} still waits on a lock after 5 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        advisory_locks(&base_url(), key).await,
        1,
        "pg_locks has more than the holder's lock on the key after the waiter was dropped"
    );
    held.release().await.unwrap();
    let got = c.try_acquire("dw", ttl).await;
    assert!(
        got.is_ok(),
        "a try-once after the release found the lock taken (by the dropped waiter?): {got:?}"
    );
    got.unwrap().release().await.unwrap();
    wait_no_advisory_lock(&base_url(), key, Duration::from_secs(3)).await;
}
