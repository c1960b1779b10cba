//! A waiter whose waiting statement an admin cancels (`pg_cancel_backend`) keeps waiting.

use std::time::Duration;

use lockkit::postgres::PgLock;
use lockkit::postgres::sqlx;
use lockkit::{AcquireOptions, Lock, LockExt, Wait};
use tokio::time::Instant;

use super::base_url;
use super::server::admin;
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
