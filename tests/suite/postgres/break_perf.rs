//! Attempts to break session 8's PostgreSQL change (leases multiplexed on shared holder
//! sessions: a connection lock plus a keeper task that renews and reads the idle connection).

use std::time::Duration;

use lockkit::postgres::PgLock;
use lockkit::postgres::sqlx::{self, PgConnection};
use lockkit::{LeaseState, Lock, LockExt};
use tokio::time::Instant;

use super::base_url;
use super::server::admin;
use crate::common::{fresh_prefix, with_prefix};

/// A URL with a fresh key prefix and a schema of its own (so that locking its tables disturbs
/// no other test), and the schema.
fn private_schema_url() -> (String, String) {
    let prefix = fresh_prefix();
    let schema = prefix.replace('-', "_");
    (
        format!("{}&schema={schema}", with_prefix(&base_url(), &prefix)),
        schema,
    )
}

/// Sessions waiting for a lock on table `schema.table` (polled: `pg_locks` has no signal).
async fn waiting_on(db: &mut PgConnection, schema: &str, table: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = to_regclass($1)",
    )
    .bind(format!("{schema}.{table}"))
    .fetch_one(db)
    .await
    .expect("pg_locks")
}

/// A try-once grant on a shared holder session that blocks on a table lock (an operator's
/// `LOCK TABLE … ACCESS EXCLUSIVE` on lockkit's fence table, as a `VACUUM FULL` or an
/// `ALTER TABLE` takes) holds the session's connection: the session's other lease must still
/// be renewed, not be lost at its deadline because the keeper could not take the connection
/// for the renewal. Once the table is free again, the lease is still held on the server and
/// nothing of the stuck grant is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_stuck_on_a_table_lock_does_not_starve_the_sessions_renewal() {
    let (url, schema) = private_schema_url();
    let locks = PgLock::connect(&url).await.expect("connect");
    let ttl = Duration::from_secs(2);
    let held = locks.try_acquire("held", ttl).await.expect("acquire held");
    let mut db = admin(&base_url()).await;
    sqlx::query("BEGIN").execute(&mut db).await.expect("BEGIN");
    sqlx::query(&format!(
        "LOCK TABLE {schema}.fence IN ACCESS EXCLUSIVE MODE"
    ))
    .execute(&mut db)
    .await
    .expect("LOCK TABLE");
    let l2 = locks.clone();
    let stuck = tokio::spawn(async move { l2.try_acquire("stuck", ttl).await });
    let mut watcher = admin(&base_url()).await;
    let start = Instant::now();
    while waiting_on(&mut watcher, &schema, "fence").await == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the grant never waited on the table lock"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Two TTLs with the table locked: several renewals are due meanwhile.
    tokio::select! {
        s = held.at_risk() => panic!(
            "the lease turned {s:?} ({:?}) while another grant on its session waited on a \
             table lock", held.loss_reason()),
        () = tokio::time::sleep(ttl * 2) => {}
    }
    sqlx::query("COMMIT")
        .execute(&mut db)
        .await
        .expect("COMMIT");
    // Given up after the session's lock_timeout: retryable, the tables are busy.
    match stuck.await.expect("stuck task") {
        Ok(lease) => lease.release().await.expect("release stuck"),
        Err(e) => {
            eprintln!("the grant stuck on the table lock ended with: {e}");
            assert!(e.is_retryable(), "not retryable: {e:?}");
        }
    }
    assert_eq!(held.state(), LeaseState::Held);
    held.check().await.expect("still held on the server");
    held.release().await.expect("release held");
    // Nothing of either grant is left: both names can be taken at once by another client.
    let other = PgLock::connect(&url).await.expect("connect");
    for name in ["held", "stuck"] {
        other
            .try_acquire(name, ttl)
            .await
            .unwrap_or_else(|e| panic!("{name} is not free: {e}"))
            .release()
            .await
            .expect("release");
    }
}
