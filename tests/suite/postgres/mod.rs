//! PostgreSQL backend: the contract suite against the shared server (`LOCKKIT_POSTGRES_URL`),
//! bad connects, the fence, key collisions, migration, pooler detection, and (in `failures`)
//! paused holders, killed sessions, server restarts and cancelled waits.

mod break_perf;
mod break_slots;
mod cancelled_wait;
mod delay;
mod failures;
mod fence;
mod loss;
mod multiplex;
mod review;
mod server;
mod slots;
mod slow_grants;

use std::future::Future;
use std::pin::Pin;
use std::process::Stdio;
use std::task::Poll;
use std::time::Duration;

use lockkit::backend::LeaseBackendExt;
use lockkit::postgres::sqlx::postgres::PgArguments;
use lockkit::postgres::sqlx::{self, Arguments, Connection};
use lockkit::postgres::{PgFence, PgLock};
use lockkit::{AcquireOptions, Error, FencingToken, Lock, LockExt};
use tokio::io::{BufReader, Lines};
use tokio::process::{Child, ChildStdout};
use tokio::time::Instant;

use crate::common::{free_port, fresh_prefix, server_url, wait_until, with_prefix};
use server::{PgServer, admin, pgbouncer};

mod contract {
    use crate::common::UrlHarness;
    lockkit::contract_suite!(UrlHarness::from_env("LOCKKIT_POSTGRES_URL"));
}

/// The port in a `postgres://` URL.
pub fn port_of(url: &str) -> u16 {
    url.rsplit(':')
        .next()
        .and_then(|s| s.split('/').next())
        .and_then(|p| p.parse().ok())
        .expect("port in the URL")
}

/// The shared server's URL (no lockkit parameters).
pub fn base_url() -> String {
    server_url("LOCKKIT_POSTGRES_URL")
}

/// The shared server's URL and two clients of it under one fresh key prefix (two pools, so
/// that their sessions differ: a holder and a waiter).
pub async fn two_clients() -> (String, PgLock, PgLock) {
    let base = base_url();
    let url = with_prefix(&base, &fresh_prefix());
    let a = PgLock::connect(&url).await.unwrap();
    let b = PgLock::connect(&url).await.unwrap();
    (base, a, b)
}

/// Advisory locks on `key` in `pg_locks` (granted or waiting), on the server of `url`.
pub async fn advisory_locks(url: &str, key: i64) -> i64 {
    let mut db = admin(url).await;
    let hi = (key as u64 >> 32) as i64;
    let lo = (key as u64 & 0xffff_ffff) as i64;
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
         AND classid = $1::bigint::oid AND objid = $2::bigint::oid AND objsubid = 1",
    )
    .bind(hi)
    .bind(lo)
    .fetch_one(&mut db)
    .await
    .expect("pg_locks")
}

/// The pid of a session waiting for advisory key `key` (polls pg_locks, which has no change
/// signal, until one shows up).
pub async fn waiting_pid(url: &str, key: i64) -> i32 {
    let mut db = admin(url).await;
    let hi = (key as u64 >> 32) as i64;
    let lo = (key as u64 & 0xffff_ffff) as i64;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let pid: Option<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
             AND classid = $1::bigint::oid AND objid = $2::bigint::oid AND objsubid = 1",
        )
        .bind(hi)
        .bind(lo)
        .fetch_optional(&mut db)
        .await
        .expect("pg_locks");
        if let Some(p) = pid {
            return p;
        }
        assert!(Instant::now() < deadline, "no session waits for key {key}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits (polling pg_locks, which has no change signal) until no session holds or waits for
/// `key`.
pub async fn wait_no_advisory_lock(url: &str, key: i64, limit: Duration) {
    let deadline = Instant::now() + limit;
    loop {
        let n = advisory_locks(url, key).await;
        if n == 0 {
            return;
        }
        if Instant::now() >= deadline {
            let mut db = admin(url).await;
            let who: Vec<(i32, Option<String>, Option<String>, bool)> = sqlx::query_as(
                "SELECT l.pid, a.state, a.query, l.granted FROM pg_locks l \
                 LEFT JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype = 'advisory'",
            )
            .fetch_all(&mut db)
            .await
            .expect("pg_stat_activity");
            panic!(
                "{n} advisory lock entries for key {key} still in pg_locks after {limit:?}: {who:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Polls `fut` up to `polls` times, each poll followed by a (blocking) pause of `us` µs during
/// which the server may grant and answer: its output if it finished, else `None` (the caller
/// then drops it, with the reply unread). tokio's timers tick in milliseconds, too coarse to land
/// inside a ~0.2 ms grant, hence the polls by hand.
pub async fn poll_paused<F: Future>(
    mut fut: Pin<&mut F>,
    polls: usize,
    us: u64,
) -> Option<F::Output> {
    for _ in 0..polls {
        let mut once = Some(fut.as_mut());
        let polled = std::future::poll_fn(|cx| {
            Poll::Ready(once.take().map(|f| f.poll(cx)).unwrap_or(Poll::Pending))
        })
        .await;
        if let Poll::Ready(r) = polled {
            return Some(r);
        }
        std::thread::sleep(Duration::from_micros(us));
    }
    None
}

/// Acquires of `name` by `locks` while another client holds it, each dropped after one of
/// `after_ms` ms: none may return.
pub async fn drop_waiters(locks: &PgLock, name: &str, ttl: Duration, after_ms: &[u64]) {
    for &ms in after_ms {
        let r = tokio::time::timeout(
            Duration::from_millis(ms),
            locks.acquire(name, AcquireOptions::new().ttl(ttl)),
        )
        .await;
        assert!(r.is_err(), "an acquire of a held lock returned: {r:?}");
    }
}

/// The server pid of the session that holds `lease` (a PostgreSQL lease's `backend_pid`).
pub fn pid_of(lease: &lockkit::Lease) -> i32 {
    lease
        .ops()
        .as_any()
        .downcast_ref::<lockkit::postgres::PgLease>()
        .expect("a PgLease")
        .backend_pid()
}

/// This test binary re-run for its one test `test` (the body of a child process, which reads
/// its orders from `envs`): stdout piped (stdin too when `stdin`, else null), killed on drop.
pub fn spawn_test_child(test: &str, envs: &[(&str, &str)], stdin: bool) -> Child {
    tokio::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([test, "--exact", "--nocapture", "--test-threads", "1"])
        .envs(envs.iter().copied())
        .stdin(if stdin { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn holder")
}

/// What follows `tag` in the child's next line that holds it (libtest may print "test … ... "
/// before a child's first line), each line awaited for at most `limit`.
pub async fn tagged_line(
    lines: &mut Lines<BufReader<ChildStdout>>,
    tag: &str,
    limit: Duration,
) -> String {
    loop {
        let line = tokio::time::timeout(limit, lines.next_line())
            .await
            .unwrap_or_else(|_| panic!("holder did not report {tag:?}"))
            .expect("read")
            .unwrap_or_else(|| panic!("holder exited before {tag:?}"));
        if let Some(i) = line.find(tag) {
            return line[i + tag.len()..].to_owned();
        }
    }
}

/// Sends `SIGsig` to process `pid` (`kill -sig pid`: a test process or a server backend).
pub fn signal(pid: impl std::fmt::Display, sig: &str) {
    let st = std::process::Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .expect("kill");
    assert!(st.success(), "kill -{sig} {pid}");
}

/// A token of the lock these tests pretend guards the scratch table.
fn tok(n: u64) -> FencingToken {
    FencingToken::new("postgres/test/report", n)
}

fn args2(a: &str, b: i32) -> PgArguments {
    let mut args = PgArguments::default();
    args.add(a.to_owned()).expect("encode");
    args.add(b).expect("encode");
    args
}

/// A scratch table `(id int primary key, body text, fence_token bigint, fence_lock text)` with
/// row 1.
pub async fn scratch_table(url: &str) -> String {
    let table = format!("lk_fenced_{:08x}", rand::random::<u32>());
    let mut db = admin(url).await;
    sqlx::Executor::execute(
        &mut db,
        format!(
            "CREATE TABLE {table} (id int PRIMARY KEY, body text, fence_token bigint, \
                                    fence_lock text); \
             INSERT INTO {table} VALUES (1, 'initial', NULL, NULL);"
        )
        .as_str(),
    )
    .await
    .expect("scratch table");
    table
}

/// Fenced update through `PgFence` as the issue describes: newer or equal tokens pass, an older
/// one gets `StaleToken` and changes nothing, inside the caller's transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_update_rejects_older_tokens() {
    let url = base_url();
    let table = scratch_table(&url).await;
    let fence = PgFence::new(&table, "fence_token", "fence_lock").unwrap();
    let mut db = admin(&url).await;

    let mut tx = db.begin().await.unwrap();
    let n = fence
        .update(&mut tx, tok(34), "body = $1", "id = $2", args2("by 34", 1))
        .await
        .expect("first fenced write");
    assert_eq!(n, 1);
    tx.commit().await.unwrap();

    // Same token again: the same holder writing twice.
    let mut tx = db.begin().await.unwrap();
    fence
        .update(
            &mut tx,
            tok(34),
            "body = $1",
            "id = $2",
            args2("by 34 again", 1),
        )
        .await
        .expect("equal token");
    tx.commit().await.unwrap();

    // The paused holder with token 33 wakes up.
    let mut tx = db.begin().await.unwrap();
    match fence
        .update(&mut tx, tok(33), "body = $1", "id = $2", args2("by 33", 1))
        .await
    {
        Err(Error::StaleToken {
            token,
            current,
            resource,
        }) => {
            assert_eq!(token, tok(33));
            assert_eq!(current, tok(34));
            assert_eq!(resource, table);
        }
        other => panic!("expected StaleToken, got {other:?}"),
    }
    tx.commit().await.unwrap();

    // A token of another lock, even a higher one: ForeignToken, nothing changed.
    let mut tx = db.begin().await.unwrap();
    let foreign = FencingToken::new("postgres/test/other", 99);
    match fence
        .update(
            &mut tx,
            foreign.clone(),
            "body = $1",
            "id = $2",
            args2("by another lock", 1),
        )
        .await
    {
        Err(Error::ForeignToken {
            token,
            expected_lock,
            resource,
        }) => {
            assert_eq!(token, foreign);
            assert_eq!(expected_lock, "postgres/test/report");
            assert_eq!(resource, table);
        }
        other => panic!("expected ForeignToken, got {other:?}"),
    }
    tx.commit().await.unwrap();

    // A write rolled back with its transaction leaves nothing.
    let mut tx = db.begin().await.unwrap();
    fence
        .update(
            &mut tx,
            tok(40),
            "body = $1",
            "id = $2",
            args2("rolled back", 1),
        )
        .await
        .unwrap();
    tx.rollback().await.unwrap();

    // No row matches the filter: not a stale write.
    let n = fence
        .update(&mut db, tok(50), "body = $1", "id = $2", args2("x", 99))
        .await
        .unwrap();
    assert_eq!(n, 0);

    let (body, tok): (String, i64) = sqlx::query_as(&format!(
        "SELECT body, fence_token FROM {table} WHERE id = 1"
    ))
    .fetch_one(&mut db)
    .await
    .unwrap();
    assert_eq!((body.as_str(), tok), ("by 34 again", 34));
    sqlx::Executor::execute(&mut db, format!("DROP TABLE {table}").as_str())
        .await
        .unwrap();
}

/// Bad URLs and parameters are typed errors before any I/O.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_urls_are_invalid_config() {
    let port = free_port();
    for url in [
        "postgres://[::1".to_owned(),
        format!("postgres://127.0.0.1:{port}/db?prefix="),
        format!("postgres://127.0.0.1:{port}/db?prefix=a%2Fb"),
        format!("postgres://127.0.0.1:{port}/db?schema=Robert');DROP"),
        format!("postgres://127.0.0.1:{port}/db?connect_timeout=-1"),
        format!("postgres://127.0.0.1:{port}/db?sslmode=sometimes"),
    ] {
        let start = Instant::now();
        match lockkit::connect(&url).await {
            Err(Error::InvalidConfig { .. }) => {}
            other => panic!("{url}: expected InvalidConfig, got {other:?}"),
        }
        assert!(start.elapsed() < Duration::from_secs(1));
    }
}

/// A closed port is `Unavailable` at once; a port that never answers is `Unavailable` after the
/// connect timeout, never a hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_server_is_unavailable_quickly() {
    let start = Instant::now();
    match lockkit::connect(&format!(
        "postgres://postgres@127.0.0.1:{}/postgres",
        free_port()
    ))
    .await
    {
        Err(e @ Error::Unavailable { .. }) => assert!(e.is_retryable()),
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );

    // A listener that accepts and never speaks.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let start = Instant::now();
    match lockkit::connect(&format!(
        "postgres://postgres@127.0.0.1:{port}/postgres?connect_timeout=1"
    ))
    .await
    {
        Err(Error::Unavailable { .. }) => {}
        other => panic!("expected Unavailable, got {other:?}"),
    }
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(4),
        "{took:?}"
    );
    drop(silent);
}

/// Against a private server with scram-sha-256: a wrong password is `Auth` (and is not printed),
/// the right one works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_password_is_auth() {
    let srv = PgServer::start(Some("right-pw"));
    let bad = format!(
        "postgres://postgres:wrong-pw-123@127.0.0.1:{}/postgres",
        srv.port
    );
    let start = Instant::now();
    match lockkit::connect(&bad).await {
        Err(e @ Error::Auth { .. }) => {
            let shown = format!("{e} {e:?} {:?}", std::error::Error::source(&e));
            assert!(!shown.contains("wrong-pw-123"), "password printed: {shown}");
        }
        other => panic!("expected Auth, got {other:?}"),
    }
    assert!(start.elapsed() < Duration::from_secs(3));
    let locks = PgLock::connect(&srv.url()).await.expect("right password");
    assert!(!format!("{locks:?}").contains("right-pw"));
    let lease = locks
        .try_acquire("auth-ok", Duration::from_secs(5))
        .await
        .unwrap();
    lease.release().await.unwrap();
    // Unknown database: a configuration error that says so (the CLI's exit 64), not a hang.
    match lockkit::connect(&format!(
        "postgres://postgres:right-pw@127.0.0.1:{}/no_such_db",
        srv.port
    ))
    .await
    {
        Err(e @ Error::InvalidConfig { .. }) => {
            let shown = format!("{e} {:?}", std::error::Error::source(&e));
            assert!(shown.contains("does not exist"), "{shown}");
            assert!(!shown.contains("right-pw"), "password printed: {shown}");
        }
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}

/// TLS (sqlx with rustls): against a server that rejects every non-TLS TCP connection,
/// `sslmode=require` connects and locks, `sslmode=disable` is refused with a typed error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_connections_work() {
    let srv = PgServer::start_tls_only();
    let url = with_prefix(&format!("{}?sslmode=require", srv.url()), &fresh_prefix());
    let locks = PgLock::connect(&url).await.expect("TLS connect");
    let lease = locks
        .try_acquire("tls", Duration::from_secs(5))
        .await
        .unwrap();
    lease.release().await.unwrap();
    match lockkit::connect(&format!("{}?sslmode=disable", srv.url())).await {
        Err(Error::Auth { .. } | Error::Backend { .. }) => {}
        other => panic!("non-TLS connection to a TLS-only server: {other:?}"),
    }
}

/// Two names on one advisory key (simulated by planting the other name in the fence row, as a
/// real SHA-256 prefix collision cannot be produced): the acquire fails with a collision error,
/// both when the key is free and when the other name holds it (no silent wait), and leaves no
/// lock behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_collision_is_detected() {
    let url = base_url();
    let prefix = fresh_prefix();
    let locks = PgLock::connect(&with_prefix(&url, &prefix)).await.unwrap();
    let key = locks.key("victim");
    let mut db = admin(&url).await;
    sqlx::query("INSERT INTO lockkit.fence (key, name, token) VALUES ($1, $2, 7)")
        .bind(key)
        .bind(format!("{prefix}/someone-else"))
        .execute(&mut db)
        .await
        .unwrap();
    let is_collision = |r: &lockkit::Result<lockkit::Lease>| match r {
        Err(e @ Error::Backend { .. }) => format!("{:#?}", e).contains("collision"),
        _ => false,
    };
    let r = locks.try_acquire("victim", Duration::from_secs(5)).await;
    assert!(is_collision(&r), "{r:?}");
    wait_no_advisory_lock(&url, key, Duration::from_secs(2)).await;
    // The other name holds the key: a waiting acquire reports the collision at once.
    let _: () = sqlx::query_scalar("SELECT pg_advisory_lock($1)")
        .bind(key)
        .fetch_one(&mut db)
        .await
        .unwrap();
    let start = Instant::now();
    let r = locks
        .acquire_timeout("victim", Duration::from_secs(5), Duration::from_secs(10))
        .await;
    assert!(is_collision(&r), "{r:?}");
    assert!(start.elapsed() < Duration::from_secs(2));
    sqlx::query("SELECT pg_advisory_unlock_all()")
        .execute(&mut db)
        .await
        .unwrap();
    wait_no_advisory_lock(&url, key, Duration::from_secs(2)).await;
}

/// `migrate()` is explicit, idempotent and safe to run concurrently, in a configurable schema;
/// without it (and with auto_migrate=false) acquires fail with a backend error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_is_idempotent_in_a_custom_schema() {
    let url = base_url();
    let schema = format!("lk_schema_{:08x}", rand::random::<u32>());
    let with = format!(
        "{}&schema={schema}&auto_migrate=false",
        with_prefix(&url, &fresh_prefix())
    );
    let locks = PgLock::connect(&with).await.unwrap();
    match locks.try_acquire("m", Duration::from_secs(5)).await {
        Err(Error::Backend { .. }) => {}
        other => panic!("expected Backend (no table yet), got {other:?}"),
    }
    let other = PgLock::connect(&with).await.unwrap();
    let (a, b) = tokio::join!(locks.migrate(), other.migrate());
    a.unwrap();
    b.unwrap();
    locks.migrate().await.unwrap();
    let l1 = locks
        .try_acquire("m", Duration::from_secs(5))
        .await
        .unwrap();
    let t1 = l1.token();
    l1.release().await.unwrap();
    let l2 = locks
        .try_acquire("m", Duration::from_secs(5))
        .await
        .unwrap();
    assert!(l2.token() > t1);
    l2.release().await.unwrap();
    let mut db = admin(&url).await;
    let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {schema}.fence"))
        .fetch_one(&mut db)
        .await
        .unwrap();
    assert_eq!(n, 1);
    sqlx::Executor::execute(&mut db, format!("DROP SCHEMA {schema} CASCADE").as_str())
        .await
        .unwrap();
}

/// Through PgBouncer, in transaction mode and in session mode, connect fails quickly with a
/// clear InvalidConfig naming the pooler: PgBouncer refuses lockkit's startup options, and when
/// told to ignore them, the session marker does not come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_is_detected() {
    let url = base_url();
    let upstream: u16 = url
        .rsplit(':')
        .next()
        .and_then(|s| s.split('/').next())
        .and_then(|p| p.parse().ok())
        .expect("port in LOCKKIT_POSTGRES_URL");
    for (mode, ignore) in [
        ("transaction", "extra_float_digits"),
        ("session", "extra_float_digits"),
        ("transaction", "extra_float_digits,options"),
    ] {
        let (bouncer, port) = pgbouncer(upstream, mode, ignore);
        wait_until("pgbouncer", Duration::from_secs(10), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        })
        .await;
        let start = Instant::now();
        match lockkit::connect(&format!("postgres://postgres@127.0.0.1:{port}/postgres")).await {
            Err(e @ Error::InvalidConfig { .. }) => {
                assert!(e.to_string().contains("pooler"), "{e}");
            }
            other => panic!(
                "{mode} mode, ignoring {ignore}: expected InvalidConfig, got {other:?}\n{}",
                bouncer.log_tail()
            ),
        }
        assert!(start.elapsed() < Duration::from_secs(3));
        drop(bouncer);
    }
}
