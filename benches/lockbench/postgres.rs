//! PostgreSQL rows, all on the same server in the same run:
//! 1. floor: raw `pg_try_advisory_lock` + `pg_advisory_unlock` on one connection (2 round trips);
//! 2. sqlx's own `PgAdvisoryLock` (`try_acquire` + `release_now`), same two statements;
//! 3. the SQL lockkit sends, by hand: the grant statement that also bumps and commits the
//!    name's token in `lockkit.fence`, then `pg_advisory_unlock` (2 round trips, one commit);
//!    3b. the same with lockkit's exact grant statement (the text `grant_try_sql` gives, the
//!    one lockkit sends): row 3's plus its lock-delay handling (it reads and clears the key's
//!    `lockkit.delay` row) and the name of a colliding key;
//!    3c. row 3b's statements on a connection with the session settings of lockkit's holder
//!    sessions (`SESSION_SETTINGS`: `client_connection_check_interval`, TCP keepalives,
//!    `synchronous_commit`, …; `idle_session_timeout` = the TTL): row 4 over this row is lockkit's client-side work,
//!    this row over 3b the server's cost of those settings;
//! 4. lockkit try-once acquire + release (keepalive on, TTL 10 s): the row; both
//!    statements run on a shared holder session, by the caller's task under the session's
//!    connection lock;
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
//! The target (#11) is row 4 within 1.1× of row 3 while issuing a durable token. Note that
//! `scripts/servers.sh` runs PostgreSQL with `fsync=off`: with fsync on, rows 3–5 also pay one
//! WAL flush per acquire (the price of a durable token) and rows 1–2 do not.
//!
//! [`spec`] describes PostgreSQL for the scenarios (`scenario.rs`): lockkit next to sqlx's
//! `PgAdvisoryLock`.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use lockkit::postgres::sqlx::postgres::{PgAdvisoryLock, PgConnectOptions};
use lockkit::postgres::sqlx::{self, Connection, Either, PgConnection};
use lockkit::postgres::{PgLock, SESSION_SETTINGS, grant_try_sql};
use lockkit::{AcquireOptions, Lock, Wait};
use tokio::sync::Mutex;

use crate::scenario::{self, BoxFut, Counters, Counts, Held, Labels, Spec, Variant};
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
    // Row 3c's connection has the session settings of lockkit's holder sessions (the TTL as
    // idle timeout).
    let set_opts = PgConnectOptions::from_str(&base)
        .expect("url")
        .options(SESSION_SETTINGS)
        .options([("idle_session_timeout", "10000")]);
    let set_conn = Arc::new(Mutex::new(
        PgConnection::connect_with(&set_opts)
            .await
            .expect("connect"),
    ));
    let set_name = format!("{prefix}/full-settings");
    let set_key = locks.key("full-settings");
    let floor_key = locks.key("floor");
    let sqlx_lock = Arc::new(PgAdvisoryLock::new(format!("{prefix}/sqlx")));
    let hand_name = format!("{prefix}/by-hand");
    let hand_key = locks.key("by-hand");
    // Row 3b's statement is lockkit's own text (its default schema), not a copy of it.
    let full_sql = grant_try_sql(locks.config().get_schema());
    let full_name = format!("{prefix}/full");
    let full_key = locks.key("full");
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
    let full_row: Op = Box::new(|| {
        let (conn, name, sql) = (conn.clone(), full_name.clone(), &full_sql);
        Box::pin(async move {
            let mut g = conn.lock().await;
            let c = g.as_mut().expect("conn");
            exact_statements(c, sql, full_key, &name).await;
        })
    });
    let settings_row: Op = Box::new(|| {
        let (conn, name, sql) = (set_conn.clone(), set_name.clone(), &full_sql);
        Box::pin(async move {
            let mut c = conn.lock().await;
            exact_statements(&mut c, sql, set_key, &name).await;
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
                "lockkit's exact statements by hand: its grant (with lock-delay), unlock",
                full_row,
            ),
            (
                "the same on a connection with lockkit's session settings",
                settings_row,
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

/// The databases of the scenarios' variants (lockkit, sqlx): PostgreSQL counts transactions per
/// database.
const DATABASES: [&str; 2] = ["lockbench_lockkit", "lockbench_sqlx"];

/// `base` with its database replaced by `db`.
fn with_db(base: &str, db: &str) -> String {
    let mut u = url::Url::parse(base).expect("LOCKKIT_POSTGRES_URL");
    u.set_path(&format!("/{db}"));
    u.to_string()
}

/// sqlx's `PgAdvisoryLock` on a connection of its own: `acquire` (`pg_advisory_lock`, waiting)
/// and `force_release` (`pg_advisory_unlock`; what the guard's `release_now` sends: the guard
/// borrows the lock, so it is leaked here and the lock released by key).
struct SqlxClient {
    conn: Arc<Mutex<Option<PgConnection>>>,
    prefix: String,
}

struct SqlxHeld {
    conn: Arc<Mutex<Option<PgConnection>>>,
    lock: PgAdvisoryLock,
}

impl Held for SqlxHeld {
    fn release(self: Box<Self>) -> BoxFut<'static, ()> {
        Box::pin(async move {
            let mut g = self.conn.lock().await;
            let c = g.take().expect("conn");
            let (c, released) = self.lock.force_release(c).await.expect("sqlx release");
            assert!(released, "sqlx lock was not held");
            *g = Some(c);
        })
    }
}

impl scenario::Client for SqlxClient {
    fn acquire<'a>(&'a self, name: &'a str) -> BoxFut<'a, Box<dyn Held>> {
        Box::pin(async move {
            let lock = PgAdvisoryLock::new(format!("{}/{name}", self.prefix));
            let mut g = self.conn.lock().await;
            let c = g.take().expect("conn");
            let guard = lock.acquire(c).await.expect("sqlx acquire");
            *g = Some(guard.leak());
            drop(g);
            Box::new(SqlxHeld {
                conn: self.conn.clone(),
                lock,
            }) as Box<dyn Held>
        })
    }
}

/// `pg_stat_database.xact_commit` of each variant's database.
struct XactCommit {
    admin: Mutex<PgConnection>,
}

impl XactCommit {
    async fn commits(&self, dbs: &[&str]) -> f64 {
        let mut c = self.admin.lock().await;
        let n: Option<i64> = sqlx::query_scalar(
            "SELECT sum(xact_commit)::bigint FROM pg_stat_database WHERE datname = ANY($1)",
        )
        .bind(dbs)
        .fetch_one(&mut *c)
        .await
        .expect("pg_stat_database");
        n.unwrap_or(0) as f64
    }
}

impl Counters for XactCommit {
    fn read(&self, variant: usize) -> BoxFut<'_, Counts> {
        Box::pin(async move {
            Counts {
                requests: self.commits(&DATABASES[variant..=variant]).await,
                writes: f64::NAN,
                wakes: f64::NAN,
            }
        })
    }

    fn lagging(&self) -> bool {
        true
    }

    /// Until no one is connected to the variants' databases (a backend flushes its statistics
    /// when it exits) and the counts stand still for 300 ms; at most 15 s.
    fn settle(&self) -> BoxFut<'_, ()> {
        Box::pin(async move {
            let deadline = std::time::Instant::now() + Duration::from_secs(15);
            let mut last = f64::NAN;
            while std::time::Instant::now() < deadline {
                let connected: i64 = {
                    let mut c = self.admin.lock().await;
                    sqlx::query_scalar(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = ANY($1)",
                    )
                    .bind(&DATABASES[..])
                    .fetch_one(&mut *c)
                    .await
                    .expect("pg_stat_activity")
                };
                let now = self.commits(&DATABASES).await;
                if connected == 0 && now == last {
                    return;
                }
                last = now;
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            eprintln!("postgres: statistics did not settle within 15 s");
        })
    }
}

/// The scenarios' description of PostgreSQL: lockkit and sqlx's `PgAdvisoryLock`, each in a
/// database of its own (created if missing).
pub async fn spec(prefix: &str) -> Spec {
    let base = url("LOCKKIT_POSTGRES_URL");
    let mut admin = PgConnection::connect(&base).await.expect("connect");
    for db in DATABASES {
        let exists: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
                .bind(db)
                .fetch_one(&mut admin)
                .await
                .expect("pg_database");
        if !exists {
            sqlx::query(&format!("CREATE DATABASE {db}"))
                .execute(&mut admin)
                .await
                .expect("create database");
        }
    }
    let lockkit_url = format!("{}?prefix={prefix}", with_db(&base, DATABASES[0]));
    let sqlx_url = with_db(&base, DATABASES[1]);
    let prefix = prefix.to_owned();
    Spec {
        backend: "postgres",
        title: "PostgreSQL",
        variants: vec![
            scenario::lockkit(lockkit_url.clone()),
            Variant {
                name: "sqlx PgAdvisoryLock".to_owned(),
                connect: Arc::new(move || {
                    let (url, prefix) = (sqlx_url.clone(), prefix.clone());
                    Box::pin(async move {
                        let c = PgConnection::connect(&url).await.expect("connect");
                        Box::new(SqlxClient {
                            conn: Arc::new(Mutex::new(Some(c))),
                            prefix,
                        }) as Box<dyn scenario::Client>
                    })
                }),
            },
        ],
        counters: Arc::new(XactCommit {
            admin: Mutex::new(admin),
        }),
        labels: Labels {
            requests: "committed transactions (`pg_stat_database.xact_commit` of the variant's \
                       own database; every statement outside a transaction block is one), \
                       counted per block of windows from before the clients connect to after \
                       they disconnected (PostgreSQL publishes a backend's counts late), \
                       connection setup included; for many leases, over 4 s that start 11 s \
                       after the last grant, so that no grant is counted",
            writes: None,
            wakes: None,
        },
        lockkit_url,
        notes: "Peer: sqlx 0.8's `PgAdvisoryLock` (`acquire`: `pg_advisory_lock`, then \
                `force_release`: `pg_advisory_unlock`) on one `PgConnection` per client, no \
                token. PostgreSQL 15 with `fsync=off`, `max_connections=300` \
                (`scripts/servers.sh`). The server wakes lock waiters itself: wakes are not \
                counted. Many-leases requests/s is read over 4 s of steady keepalive traffic \
                (each backend publishes its counts at most once a second, so ±25 %).",
        procs_only: false,
    }
}

/// Rows 3b and 3c: lockkit-postgres's grant statement `sql` for advisory key `key` and lock
/// `name`, then the unlock, on `c`.
async fn exact_statements(c: &mut sqlx::PgConnection, sql: &str, key: i64, name: &str) {
    let (ok, token, _w, _other): (bool, Option<i64>, i64, Option<String>) = sqlx::query_as(sql)
        .bind(key)
        .bind(name)
        .bind(0i64)
        .fetch_one(&mut *c)
        .await
        .expect("grant");
    assert!(ok && token.is_some());
    let ok: bool = sqlx::query_scalar("SELECT pg_advisory_unlock($1)")
        .bind(key)
        .fetch_one(&mut *c)
        .await
        .expect("unlock");
    assert!(ok);
}
