//! PostgreSQL rows, all on the same server in the same run:
//! 1. floor: raw `pg_try_advisory_lock` + `pg_advisory_unlock` on one connection (2 round trips);
//! 2. sqlx's own `PgAdvisoryLock` (`try_acquire` + `release_now`), same two statements;
//! 3. the SQL lockkit sends, by hand: the grant statement that also bumps and commits the
//!    name's token in `lockkit.fence`, then `pg_advisory_unlock` (2 round trips, one commit);
//! 4. lockkit try-once acquire + release (keepalive on, TTL 10 s): the row;
//! 5. the same with `keepalive(false)`, which shows the cost of the core's per-lease keepalive
//!    task (a spawn and an abort, i.e. cross-thread wake-ups) apart from the backend's.
//!
//! The target is row 4 within 1.5× of row 1 while issuing a durable token. Note that
//! `scripts/servers.sh` runs PostgreSQL with `fsync=off`: with fsync on, row 3 and 4 also pay
//! one WAL flush per acquire (that is the price of a durable token) and rows 1–2 do not.

use std::sync::Arc;
use std::time::Duration;

use lockkit::postgres::PgLock;
use lockkit::postgres::sqlx::postgres::PgAdvisoryLock;
use lockkit::postgres::sqlx::{self, Connection, Either, PgConnection};
use lockkit::{AcquireOptions, Lock, Wait};
use tokio::sync::Mutex;

use crate::{Row, measure, url};

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
    let key = locks.key("floor");

    let floor = measure(
        "postgres",
        "floor: pg_try_advisory_lock + pg_advisory_unlock",
        iters,
        || {
            let conn = conn.clone();
            async move {
                let mut g = conn.lock().await;
                let c = g.as_mut().expect("conn");
                let ok: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
                    .bind(key)
                    .fetch_one(&mut *c)
                    .await
                    .expect("lock");
                assert!(ok);
                let ok: bool = sqlx::query_scalar("SELECT pg_advisory_unlock($1)")
                    .bind(key)
                    .fetch_one(&mut *c)
                    .await
                    .expect("unlock");
                assert!(ok);
            }
        },
    )
    .await;

    let sqlx_lock = Arc::new(PgAdvisoryLock::new(format!("{prefix}/sqlx")));
    let sqlx_row = measure(
        "postgres",
        "sqlx PgAdvisoryLock try_acquire + release_now",
        iters,
        || {
            let (conn, lock) = (conn.clone(), sqlx_lock.clone());
            async move {
                let mut g = conn.lock().await;
                let c = g.take().expect("conn");
                let guard = match lock.try_acquire(c).await.expect("try_acquire") {
                    Either::Left(guard) => guard,
                    Either::Right(_) => panic!("sqlx lock held"),
                };
                *g = Some(guard.release_now().await.expect("release"));
            }
        },
    )
    .await;

    let name = format!("{prefix}/by-hand");
    let hand_key = locks.key("by-hand");
    let by_hand = measure(
        "postgres",
        "lockkit's SQL by hand: grant + token bump (commit), unlock",
        iters,
        || {
            let (conn, name) = (conn.clone(), name.clone());
            async move {
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
            }
        },
    )
    .await;

    let opts = AcquireOptions::new()
        .ttl(Duration::from_secs(10))
        .wait(Wait::No);
    let lockkit_row = measure(
        "postgres",
        "lockkit try-acquire + release (durable token, keepalive)",
        iters,
        || {
            let (locks, opts) = (&locks, opts.clone());
            async move {
                let l = locks.acquire("bench", opts).await.expect("acquire");
                l.release().await.expect("release");
            }
        },
    )
    .await;
    let manual = opts.clone().keepalive(false);
    let no_keepalive = measure(
        "postgres",
        "lockkit try-acquire + release, keepalive(false)",
        iters,
        || {
            let (locks, opts) = (&locks, manual.clone());
            async move {
                let l = locks.acquire("bench-manual", opts).await.expect("acquire");
                l.release().await.expect("release");
            }
        },
    )
    .await;
    vec![floor, sqlx_row, by_hand, lockkit_row, no_keepalive]
}
