//! Regression tests for the findings of the review that tried to break the PostgreSQL adapter
//! (/work/notes/pg-findings.md); each names its finding.

use lockkit::backend::LeaseBackendExt;
use std::time::Duration;

use lockkit::postgres::sqlx::postgres::PgArguments;
use lockkit::postgres::sqlx::{self, Arguments};
use lockkit::postgres::{PgFence, PgLock, SESSION_CHECK};
use lockkit::{AcquireOptions, Error, FencingToken, Lock, LockExt, Wait};
use tokio::time::Instant;

use super::server::{PgServer, admin};
use super::{base_url, pid_of, port_of, signal, waiting_pid};
use crate::common::proxy::Proxy;
use crate::common::{fresh_prefix, with_prefix};

/// Finding 2: a waiting acquire holds no lock on the fence table while it waits, so DDL on the
/// table is not queued behind it (nor every acquire behind that DDL): an `ALTER TABLE` on the
/// fence table runs while it waits. (Its snapshot, `backend_xmin`, is another matter: any
/// running statement has one, see the crate docs.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_acquire_holds_no_table_lock() {
    let schema = format!("lk_w{:08x}", rand::random::<u32>());
    let url = format!(
        "{}&schema={schema}",
        with_prefix(&base_url(), &fresh_prefix())
    );
    let (a, b) = (
        PgLock::connect(&url).await.unwrap(),
        PgLock::connect(&url).await.unwrap(),
    );
    let ttl = Duration::from_secs(10);
    let held = a.try_acquire("w", ttl).await.unwrap();
    let waiter = tokio::spawn({
        let b = b.clone();
        async move { b.acquire_timeout("w", ttl, Duration::from_secs(20)).await }
    });
    let pid = waiting_pid(&base_url(), a.key("w")).await;
    let mut db = admin(&base_url()).await;
    let fence_locks: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM pg_locks WHERE pid = $1 AND relation = to_regclass('{schema}.fence')"
    ))
    .bind(pid)
    .fetch_one(&mut db)
    .await
    .unwrap();
    assert_eq!(fence_locks, 0, "the waiting session locks the fence table");
    // DDL on the fence table is not queued behind the waiter.
    sqlx::Executor::execute(
        &mut db,
        format!("SET lock_timeout = '3s'; ALTER TABLE {schema}.fence ADD COLUMN x int").as_str(),
    )
    .await
    .expect("ALTER TABLE queued behind a waiting acquire");
    // And an acquire of another name is not stalled either.
    let other = tokio::time::timeout(Duration::from_secs(3), a.try_acquire("w2", ttl))
        .await
        .expect("an unrelated acquire stalled")
        .unwrap();
    other.release().await.unwrap();
    held.release().await.unwrap();
    let next = waiter.await.unwrap().expect("the waiter got the lock");
    assert!(next.token().get() > 1, "token bumped after the grant");
    next.release().await.unwrap();
    sqlx::Executor::execute(&mut db, format!("DROP SCHEMA {schema} CASCADE").as_str())
        .await
        .unwrap();
}

/// Finding 4: opening a connection counts against the wait. With a server that accepts TCP but
/// never answers, a `Wait::Timeout(500 ms)` acquire returns `Timeout` after about 500 ms, and a
/// try-once returns `Unavailable` within the connect timeout (retries included).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_counts_against_the_wait_deadline() {
    let relay = Proxy::start_local(port_of(&base_url())).await;
    let url = with_prefix(
        &format!(
            "postgres://postgres@127.0.0.1:{}/postgres?connect_timeout=1",
            relay.port
        ),
        &fresh_prefix(),
    );
    let locks = PgLock::connect(&url).await.unwrap();
    // Occupy the cached connection so that the next acquires must open new ones.
    let held = locks
        .try_acquire("c1", Duration::from_secs(10))
        .await
        .unwrap();
    relay.freeze();
    let t = Instant::now();
    let res = locks
        .acquire(
            "c2",
            AcquireOptions::new().wait(Wait::Timeout(Duration::from_millis(500))),
        )
        .await;
    let took = t.elapsed();
    assert!(matches!(res, Err(Error::Timeout { .. })), "{res:?}");
    assert!(
        took < Duration::from_millis(2000),
        "timed acquire took {took:?}"
    );
    let t = Instant::now();
    let res = locks.try_acquire("c3", Duration::from_secs(10)).await;
    let took = t.elapsed();
    assert!(matches!(res, Err(Error::Unavailable { .. })), "{res:?}");
    assert!(took < Duration::from_millis(2500), "try-once took {took:?}");
    held.leak();
}

/// Finding 3: a `Wait::Forever` acquire whose connection is cut off (no FIN, no RST) ends with
/// `Unavailable` instead of hanging: the wait is checked every 3 s on another connection,
/// which cannot be opened through the cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forever_wait_on_a_cut_connection_ends() {
    let base = base_url();
    let relay = Proxy::start_local(port_of(&base)).await;
    let prefix = fresh_prefix();
    let through = with_prefix(
        &format!(
            "postgres://postgres@127.0.0.1:{}/postgres?connect_timeout=1",
            relay.port
        ),
        &prefix,
    );
    let a = PgLock::connect(&through).await.unwrap();
    let b = PgLock::connect(&with_prefix(&base, &prefix)).await.unwrap();
    let held = b.try_acquire("f", Duration::from_secs(30)).await.unwrap();
    let waiter = tokio::spawn(async move {
        a.acquire(
            "f",
            AcquireOptions::new()
                .ttl(Duration::from_secs(30))
                .wait(Wait::Forever)
                .retry(None),
        )
        .await
    });
    waiting_pid(&base, b.key("f")).await;
    relay.freeze();
    let cut = Instant::now();
    let res = tokio::time::timeout(Duration::from_secs(15), waiter)
        .await
        .expect("Wait::Forever acquire hangs on a cut connection")
        .unwrap();
    assert!(matches!(res, Err(Error::Unavailable { .. })), "{res:?}");
    // Check interval 3 s + connect timeout 1 s, with room for a loaded machine.
    assert!(
        cut.elapsed() < Duration::from_secs(9),
        "{:?}",
        cut.elapsed()
    );
    held.release().await.unwrap();
}

/// Finding 7: a stale write that matches several rows fails as a whole (tokens 10, 3, NULL;
/// writer 5): `StaleToken`, no row changed; a current writer updates all of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_multi_row_write_is_all_or_nothing() {
    let table = format!("lk_multi_{:08x}", rand::random::<u32>());
    let mut db = admin(&base_url()).await;
    sqlx::Executor::execute(
        &mut db,
        format!(
            "CREATE TABLE {table} (id int PRIMARY KEY, body text, fence_token bigint, \
                                    fence_lock text); \
             INSERT INTO {table} VALUES (1, 'a', 10, 't'), (2, 'b', 3, 't'), (3, 'c', NULL, NULL);"
        )
        .as_str(),
    )
    .await
    .unwrap();
    let fence = PgFence::new(&table, "fence_token", "fence_lock").unwrap();
    let args = || {
        let mut a = PgArguments::default();
        a.add("new").unwrap();
        a
    };
    let res = fence
        .update(
            &mut db,
            FencingToken::new("t", 5),
            "body = $1",
            "id IN (1, 2, 3)",
            args(),
        )
        .await;
    match res {
        Err(Error::StaleToken { current, .. }) => assert_eq!(current, FencingToken::new("t", 10)),
        other => panic!("stale multi-row write: {other:?}"),
    }
    let changed: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {table} WHERE body = 'new' OR fence_token = 5"
    ))
    .fetch_one(&mut db)
    .await
    .unwrap();
    assert_eq!(changed, 0, "a stale write changed rows");
    let n = fence
        .update(
            &mut db,
            FencingToken::new("t", 10),
            "body = $1",
            "id IN (1, 2, 3)",
            args(),
        )
        .await
        .unwrap();
    assert_eq!(n, 3);
    let n = fence
        .update(
            &mut db,
            FencingToken::new("t", 11),
            "body = $1",
            "id = 99",
            args(),
        )
        .await
        .unwrap();
    assert_eq!(n, 0, "no matching row is not stale");
    sqlx::Executor::execute(&mut db, format!("DROP TABLE {table}").as_str())
        .await
        .unwrap();
}

/// Finding 5: releasing a lease that is already lost (here: cut off by the network, lost by the
/// clock) returns `NotHeld` at once instead of waiting a TTL for an answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_of_a_lost_lease_returns_at_once() {
    let relay = Proxy::start_local(port_of(&base_url())).await;
    let url = with_prefix(
        &format!("postgres://postgres@127.0.0.1:{}/postgres", relay.port),
        &fresh_prefix(),
    );
    let locks = PgLock::connect(&url).await.unwrap();
    let ttl = Duration::from_secs(3);
    let lease = locks
        .acquire("r", AcquireOptions::new().ttl(ttl).keepalive(false))
        .await
        .unwrap();
    relay.freeze();
    tokio::time::timeout(ttl + Duration::from_secs(2), lease.lost())
        .await
        .expect("the lease was not lost by its deadline");
    let t = Instant::now();
    let res = lease.release().await;
    assert!(matches!(res, Err(Error::NotHeld { .. })), "{res:?}");
    assert!(
        t.elapsed() < Duration::from_millis(1000),
        "{:?}",
        t.elapsed()
    );
}

/// Finding 6: a renewal dropped while its statement is in flight (the backend is stopped with
/// SIGSTOP) closes the connection, so when the backend resumes the statement does not keep the
/// session (and the lock) alive for another TTL: the lock is free at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_renewal_does_not_extend_the_session() {
    let url = with_prefix(&base_url(), &fresh_prefix());
    let (a, b) = (
        PgLock::connect(&url).await.unwrap(),
        PgLock::connect(&url).await.unwrap(),
    );
    let ttl = Duration::from_secs(8);
    let lease = a
        .acquire("late", AcquireOptions::new().ttl(ttl).keepalive(false))
        .await
        .unwrap();
    let pid = pid_of(&lease);
    signal(pid, "STOP");
    let renew = tokio::time::timeout(Duration::from_millis(300), lease.ops().renew(ttl)).await;
    signal(pid, "CONT");
    assert!(
        renew.is_err(),
        "renewal answered by a stopped backend: {renew:?}"
    );
    let t = Instant::now();
    let next = b
        .acquire_timeout("late", ttl, Duration::from_secs(4))
        .await
        .expect("a dropped renewal kept the lock held");
    assert!(t.elapsed() < Duration::from_secs(4));
    assert!(next.token() > lease.token());
    next.release().await.unwrap();
    lease.leak();
}

/// Finding 8: two schemas on one database keep separate token counters, so they must not share
/// advisory keys: the same prefix and name are two independent locks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemas_do_not_share_lock_keys() {
    let prefix = fresh_prefix();
    let (s1, s2) = (
        format!("lk_s{:08x}", rand::random::<u32>()),
        format!("lk_s{:08x}", rand::random::<u32>()),
    );
    let base = with_prefix(&base_url(), &prefix);
    let a = PgLock::connect(&format!("{base}&schema={s1}"))
        .await
        .unwrap();
    let b = PgLock::connect(&format!("{base}&schema={s2}"))
        .await
        .unwrap();
    let c = PgLock::connect(&base).await.unwrap();
    assert_ne!(a.key("n"), b.key("n"));
    assert_eq!(c.key("n"), lockkit::postgres::lock_key(&prefix, "n"));
    let ttl = Duration::from_secs(10);
    let la = a.try_acquire("n", ttl).await.expect("schema 1");
    let lb = b
        .try_acquire("n", ttl)
        .await
        .expect("schema 2 shares schema 1's lock");
    let lc = c.try_acquire("n", ttl).await.expect("default schema");
    for l in [la, lb, lc] {
        l.release().await.unwrap();
    }
    let mut db = admin(&base_url()).await;
    sqlx::Executor::execute(
        &mut db,
        format!("DROP SCHEMA {s1} CASCADE; DROP SCHEMA {s2} CASCADE").as_str(),
    )
    .await
    .unwrap();
}

/// Finding 1: a lease whose session is killed (`pg_terminate_backend`) is lost within
/// `SESSION_CHECK` (1 s) plus one check, for keepalive leases (long before their TTL/3
/// renewal) and for manual ones (which never renew by themselves).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_session_is_noticed_within_the_check_interval() {
    let url = with_prefix(&base_url(), &fresh_prefix());
    let locks = PgLock::connect(&url).await.unwrap();
    let ttl = Duration::from_secs(30);
    let auto = locks.try_acquire("k1", ttl).await.unwrap();
    let manual = locks
        .acquire("k2", AcquireOptions::new().ttl(ttl).keepalive(false))
        .await
        .unwrap();
    // Watched by the same query, and must not be touched: another TTL, so another holder
    // session (leases of one TTL share a session, and are lost together when it ends).
    let bystander = locks
        .try_acquire("k3", ttl + Duration::from_secs(1))
        .await
        .unwrap();
    assert_ne!(pid_of(&bystander), pid_of(&auto));
    let mut db = admin(&base_url()).await;
    for lease in [&auto, &manual] {
        let killed = Instant::now();
        let ok: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
            .bind(pid_of(lease))
            .fetch_one(&mut db)
            .await
            .unwrap();
        assert!(ok);
        tokio::time::timeout(SESSION_CHECK + Duration::from_secs(3), lease.lost())
            .await
            .expect("the killed session was not noticed within the check interval");
        eprintln!(
            "postgres: pg_terminate_backend -> Lost in {:?}",
            killed.elapsed()
        );
        assert!(killed.elapsed() < SESSION_CHECK + Duration::from_secs(3));
    }
    for lease in [auto, manual] {
        assert!(matches!(lease.release().await, Err(Error::NotHeld { .. })));
    }
    assert_eq!(bystander.state(), lockkit::LeaseState::Held);
    bystander
        .release()
        .await
        .expect("the bystander lease was disturbed");
}

/// Finding 1, server restart: a lease held across a crash-restart is lost within
/// `SESSION_CHECK` plus one check of the server being back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_restart_is_noticed_within_the_check_interval() {
    let srv = PgServer::start(None);
    let url = with_prefix(&format!("{}?connect_timeout=2", srv.url()), &fresh_prefix());
    let locks = PgLock::connect(&url).await.unwrap();
    let lease = locks
        .acquire(
            "rs",
            AcquireOptions::new()
                .ttl(Duration::from_secs(60))
                .keepalive(false),
        )
        .await
        .unwrap();
    srv.crash_restart();
    let back = Instant::now();
    tokio::time::timeout(SESSION_CHECK + Duration::from_secs(4), lease.lost())
        .await
        .expect("the restart was not noticed within the check interval");
    assert!(back.elapsed() < SESSION_CHECK + Duration::from_secs(4));
}

/// Smaller findings: `sslmode=require` to a server without TLS is a configuration error (not
/// retryable); misspelled parameters are rejected; reserved words work as schema, table and
/// column names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_mistakes_are_typed_and_reserved_words_work() {
    let t = Instant::now();
    match lockkit::connect(&format!("{}?sslmode=require", base_url())).await {
        Err(e @ Error::InvalidConfig { .. }) => assert!(!e.is_retryable()),
        other => panic!("sslmode=require to a plain server: {other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(5));
    for bad in [
        "ssl_mode=require",
        "sslmod=require",
        "connect_timeout=0.000001",
    ] {
        match lockkit::connect(&format!("{}?{bad}", base_url())).await {
            Err(Error::InvalidConfig { .. }) => {}
            other => panic!("{bad}: {other:?}"),
        }
    }
    // schema=select (a reserved word)
    let url = format!(
        "{}&schema=select",
        with_prefix(&base_url(), &fresh_prefix())
    );
    let locks = PgLock::connect(&url).await.expect("schema=select");
    let lease = locks
        .try_acquire("rw", Duration::from_secs(5))
        .await
        .unwrap();
    // A fenced table and column named by reserved words.
    let schema = format!("lk_r{:08x}", rand::random::<u32>());
    let mut db = admin(&base_url()).await;
    sqlx::Executor::execute(
        &mut db,
        format!(
            "CREATE SCHEMA {schema}; \
             CREATE TABLE {schema}.\"user\" (id int PRIMARY KEY, body text, \"order\" bigint, \
                                           \"table\" text); \
             INSERT INTO {schema}.\"user\" VALUES (1, 'x', NULL, NULL);"
        )
        .as_str(),
    )
    .await
    .unwrap();
    let fence = PgFence::new(&format!("{schema}.user"), "order", "table").unwrap();
    let mut args = PgArguments::default();
    args.add("y").unwrap();
    let n = fence
        .update(&mut db, lease.token(), "body = $1", "id = 1", args)
        .await
        .expect("fenced update on reserved-word names");
    assert_eq!(n, 1);
    lease.release().await.unwrap();
    sqlx::Executor::execute(&mut db, format!("DROP SCHEMA {schema} CASCADE").as_str())
        .await
        .unwrap();
}

/// Follow-up of finding 6: a release right after a renewal was dropped mid-flight (what the
/// core does when it stops keepalive to release) returns `Ok` (the renewal closed the
/// connection, which frees the lock), not `NotHeld`, and the lock is free once the server
/// reads the close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_after_a_dropped_renewal_is_ok() {
    let url = with_prefix(&base_url(), &fresh_prefix());
    let (a, b) = (
        PgLock::connect(&url).await.unwrap(),
        PgLock::connect(&url).await.unwrap(),
    );
    let ttl = Duration::from_secs(8);
    let lease = a
        .acquire("rd", AcquireOptions::new().ttl(ttl).keepalive(false))
        .await
        .unwrap();
    let pid = pid_of(&lease);
    signal(pid, "STOP");
    tokio::select! {
        r = lease.ops().renew(ttl) => panic!("renewal answered by a stopped backend: {r:?}"),
        () = tokio::time::sleep(Duration::from_millis(200)) => {}
    }
    let t = Instant::now();
    let res = lease.release().await;
    signal(pid, "CONT");
    assert!(res.is_ok(), "release after a dropped renewal: {res:?}");
    assert!(t.elapsed() < Duration::from_secs(1));
    let next = b
        .acquire_timeout("rd", ttl, Duration::from_secs(4))
        .await
        .expect("the lock was not freed by the closed connection");
    next.release().await.unwrap();
}
