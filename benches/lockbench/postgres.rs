//! PostgreSQL rows, all on the same server in the same run:
//! 1. floor: raw `pg_try_advisory_lock` + `pg_advisory_unlock` on one connection (2 round trips);
//! 2. sqlx's own `PgAdvisoryLock` (`try_acquire` + `release_now`), same two statements;
//! 3. the SQL lockkit sends, by hand: the grant statement that also bumps and commits the
//!    name's token in `lockkit.fence`, then `pg_advisory_unlock` (2 round trips, one commit);
//! 4. lockkit try-once acquire + release (keepalive on, TTL 10 s): the row; both
//!    statements run on a shared holder session, by its task (two hand-offs between tasks per
//!    statement);
//! 5. the same with `keepalive(false)`: the lease takes a connection of its own from the idle
//!    cache (the grant runs on it), which gets a task for the life of the lease.
//!
//! Only try-once acquires are measured: an uncontended waiting acquire sends the same grant
//! statement; a contended one waits in `SELECT pg_advisory_lock` and bumps the token in a
//! separate statement after the grant (as many round trips as before that change).
//!
//! The rows are measured **interleaved** (see `interleaved` in main.rs), so a load change on a
//! shared machine hits all rows alike and the ratios stay meaningful.
//!
//! The target is row 4 within 1.5× of row 1 while issuing a durable token. Note that
//! `scripts/servers.sh` runs PostgreSQL with `fsync=off`: with fsync on, rows 3–5 also pay one
//! WAL flush per acquire (the price of a durable token) and rows 1–2 do not.

use std::sync::Arc;
use std::time::Duration;

use lockkit::postgres::PgLock;
use lockkit::postgres::sqlx::postgres::PgAdvisoryLock;
use lockkit::postgres::sqlx::{self, Connection, Either, PgConnection};
use lockkit::{AcquireOptions, Lock, Wait};
use tokio::sync::Mutex;

use crate::{Op, Row, interleaved, url};

const GRANT: &str = "WITH l AS MATERIALIZED (SELECT pg_try_advisory_lock($1) AS ok), \
     b AS (INSERT INTO lockkit.fence AS f (key, name, token) \
           SELECT $1, $2, 1 FROM l WHERE l.ok \
           ON CONFLICT (key) DO UPDATE SET token = f.token + 1 \
           WHERE f.name = excluded.name \
           RETURNING f.token) \
     SELECT l.ok, (SELECT token FROM b) FROM l";

pub async fn run(iters: usize) -> Vec<Row> {
    let base = url("LOCKKIT_POSTGRES_URL");
    let prefix = format!("lockbench-{:08x}", rand::random::<u32>());
    // Connecting lockkit first also creates lockkit.fence for row 3.
    let locks = PgLock::connect(&format!("{base}?prefix={prefix}"))
        .await
        .expect("lockkit connect");
    let conn = Arc::new(Mutex::new(Some(
        PgConnection::connect(&base).await.expect("connect"),
    )));
    let floor_key = locks.key("floor");
    let sqlx_lock = Arc::new(PgAdvisoryLock::new(format!("{prefix}/sqlx")));
    let hand_name = format!("{prefix}/by-hand");
    let hand_key = locks.key("by-hand");
    let opts = AcquireOptions::new()
        .ttl(Duration::from_secs(10))
        .wait(Wait::No);
    let manual = opts.clone().keepalive(false);

    let floor: Op = Box::new(|| {
        let conn = conn.clone();
        Box::pin(async move {
            let mut g = conn.lock().await;
            let c = g.as_mut().expect("conn");
            let ok: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
                .bind(floor_key)
                .fetch_one(&mut *c)
                .await
                .expect("lock");
            assert!(ok);
            let ok: bool = sqlx::query_scalar("SELECT pg_advisory_unlock($1)")
                .bind(floor_key)
                .fetch_one(&mut *c)
                .await
                .expect("unlock");
            assert!(ok);
        })
    });
    let sqlx_row: Op = Box::new(|| {
        let (conn, lock) = (conn.clone(), sqlx_lock.clone());
        Box::pin(async move {
            let mut g = conn.lock().await;
            let c = g.take().expect("conn");
            let guard = match lock.try_acquire(c).await.expect("try_acquire") {
                Either::Left(guard) => guard,
                Either::Right(_) => panic!("sqlx lock held"),
            };
            *g = Some(guard.release_now().await.expect("release"));
        })
    });
    let by_hand: Op = Box::new(|| {
        let (conn, name) = (conn.clone(), hand_name.clone());
        Box::pin(async move {
            let mut g = conn.lock().await;
            let c = g.as_mut().expect("conn");
            let (ok, token): (bool, Option<i64>) = sqlx::query_as(GRANT)
                .bind(hand_key)
                .bind(&name)
                .fetch_one(&mut *c)
                .await
                .expect("grant");
            assert!(ok && token.is_some());
            let ok: bool = sqlx::query_scalar("SELECT pg_advisory_unlock($1)")
                .bind(hand_key)
                .fetch_one(&mut *c)
                .await
                .expect("unlock");
            assert!(ok);
        })
    });
    let lockkit_row: Op = Box::new(|| {
        let (locks, opts) = (&locks, opts.clone());
        Box::pin(async move {
            let l = locks.acquire("bench", opts).await.expect("acquire");
            l.release().await.expect("release");
        })
    });
    let no_keepalive: Op = Box::new(|| {
        let (locks, opts) = (&locks, manual.clone());
        Box::pin(async move {
            let l = locks.acquire("bench-manual", opts).await.expect("acquire");
            l.release().await.expect("release");
        })
    });
    interleaved(
        "postgres",
        vec![
            ("floor: pg_try_advisory_lock + pg_advisory_unlock", floor),
            ("sqlx PgAdvisoryLock try_acquire + release_now", sqlx_row),
            (
                "lockkit's SQL by hand: grant + token bump (commit), unlock",
                by_hand,
            ),
            (
                "lockkit try-acquire + release (durable token, keepalive)",
                lockkit_row,
            ),
            (
                "lockkit try-acquire + release, keepalive(false)",
                no_keepalive,
            ),
        ],
        (iters / 10).max(10),
        iters,
    )
    .await
}
