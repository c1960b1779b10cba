//! Many leases per holder session: 10,000 leases within the server's default connection and
//! lock limits, renewed per session (not per lease), a terminated session that loses exactly
//! its own leases, cancelled grants, releases and waiters on shared sessions, a frozen holder
//! process whose leases all lapse within their TTL, and the statements of a waited grant.

use std::collections::HashMap;
use std::time::Duration;

use futures_util::future::join_all;
use lockkit::postgres::sqlx::{self, PgConnection};
use lockkit::postgres::{PgLock, SESSION_LEASES};
use lockkit::{AcquireOptions, Error, Lease, LeaseState, Lock, LockExt};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::time::Instant;

use super::server::{PgServer, admin};
use super::{
    advisory_locks, base_url, drop_waiters, pid_of, poll_paused, signal, spawn_test_child,
    tagged_line, two_clients, wait_no_advisory_lock,
};
use crate::common::{fresh_prefix, with_prefix};

const SLACK: Duration = Duration::from_millis(100); // PgLock's Guarantees::expiry_slack

/// Acquires `names` try-once with `ttl`, `tasks` acquires at a time.
async fn acquire_all(locks: &PgLock, names: &[String], ttl: Duration, tasks: usize) -> Vec<Lease> {
    let chunk = names.len().div_ceil(tasks);
    let runs = names.chunks(chunk).map(|part| {
        let locks = locks.clone();
        let part = part.to_vec();
        tokio::spawn(async move {
            let mut got = Vec::with_capacity(part.len());
            for n in part {
                got.push(locks.try_acquire(&n, ttl).await.expect("try-acquire"));
            }
            got
        })
    });
    join_all(runs)
        .await
        .into_iter()
        .flat_map(|r| r.expect("acquire task"))
        .collect()
}

async fn release_all(leases: Vec<Lease>) {
    let runs = leases.into_iter().map(|l| async move { l.release().await });
    for r in join_all(runs).await {
        r.expect("release");
    }
}

/// Client backends of lockkit on the server (`application_name = 'lockkit'`).
async fn lockkit_sessions(db: &mut PgConnection) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'lockkit' \
         AND backend_type = 'client backend'",
    )
    .fetch_one(db)
    .await
    .expect("pg_stat_activity")
}

async fn granted_advisory_locks(db: &mut PgConnection) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted")
        .fetch_one(db)
        .await
        .expect("pg_locks")
}

/// Statements the server ran so far (`pg_stat_statements`), and of those the renewals
/// (`SELECT pg_backend_pid()`).
async fn statements(db: &mut PgConnection) -> (i64, i64) {
    sqlx::query_as(
        "SELECT coalesce(sum(calls), 0)::int8, \
                coalesce(sum(calls) FILTER (WHERE query = 'SELECT pg_backend_pid()'), 0)::int8 \
         FROM pg_stat_statements",
    )
    .fetch_one(db)
    .await
    .expect("pg_stat_statements")
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// 10,000 leases held through one `PgLock` on a server with PostgreSQL's default
/// `max_connections` (100) and `max_locks_per_transaction` (64): they take
/// 10,000 / `SESSION_LEASES` holder sessions, and over two TTLs the server commits far fewer
/// statements than there are leases (one renewal per session per TTL/3, not one per lease).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_leases_within_the_default_max_connections() {
    const N: usize = 10_000;
    let srv = PgServer::start(None);
    let url = with_prefix(&srv.url(), &fresh_prefix());
    let mut db = admin(&srv.url()).await;
    let max: String = sqlx::query_scalar("SHOW max_connections")
        .fetch_one(&mut db)
        .await
        .unwrap();
    assert_eq!(max, "100");
    // pg_stat_statements counts the statements the server runs (at once, in shared memory);
    // and no fsync, as on the shared test server, so the 10,000 commits do not wait on the
    // disk.
    for set in [
        "ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'",
        "ALTER SYSTEM SET fsync = off",
    ] {
        sqlx::Executor::execute(&mut db, set).await.unwrap();
    }
    drop(db);
    srv.crash_restart();
    let mut db = admin(&srv.url()).await;
    sqlx::Executor::execute(&mut db, "CREATE EXTENSION pg_stat_statements")
        .await
        .unwrap();
    let locks = PgLock::connect(&url).await.unwrap();
    let names: Vec<String> = (0..N).map(|i| format!("many-{i}")).collect();
    // Long enough that a loaded test machine does not starve a session past its TTL.
    let ttl = Duration::from_secs(5);
    let rss0 = rss_bytes();
    let t = Instant::now();
    let leases = acquire_all(&locks, &names, ttl, 16).await;
    let took = t.elapsed();
    let rss1 = rss_bytes();
    assert_eq!(leases.len(), N);
    let sessions = lockkit_sessions(&mut db).await;
    let mut by_pid: HashMap<i32, usize> = HashMap::new();
    for l in &leases {
        *by_pid.entry(pid_of(l)).or_default() += 1;
    }
    eprintln!(
        "postgres: {N} leases in {took:?}: {} holder sessions, {sessions} lockkit connections, \
         RSS +{} B per lease (shared test process: indicative)",
        by_pid.len(),
        rss1.saturating_sub(rss0) / N as u64
    );
    assert!(by_pid.values().all(|&n| n <= SESSION_LEASES), "{by_pid:?}");
    assert!(by_pid.len() <= N / SESSION_LEASES + 2, "{by_pid:?}");
    assert!(sessions <= 100, "{sessions} connections");
    assert_eq!(granted_advisory_locks(&mut db).await, N as i64);

    // Two TTLs: every lease is still held, renewed by its session.
    let (s0, r0) = statements(&mut db).await;
    let t0 = Instant::now();
    tokio::time::sleep(2 * ttl).await;
    let (s1, r1) = statements(&mut db).await;
    let secs = t0.elapsed().as_secs_f64();
    eprintln!(
        "postgres: {N} leases on {} sessions held for {secs:.1} s: {} statements ({:.1}/s), \
         {} of them renewals ({:.1}/s)",
        by_pid.len(),
        s1 - s0,
        (s1 - s0) as f64 / secs,
        r1 - r0,
        (r1 - r0) as f64 / secs
    );
    assert!(leases.iter().all(|l| l.state() != LeaseState::Lost));
    // Per lease, it would be 2 × 3 × 10,000 renewals.
    assert!(
        s1 - s0 < N as i64,
        "{} statements for {N} leases in two TTLs: renewals per lease?",
        s1 - s0
    );
    assert_eq!(granted_advisory_locks(&mut db).await, N as i64);
    release_all(leases).await;
    assert_eq!(granted_advisory_locks(&mut db).await, 0);
}

/// Terminating one holder session (`pg_terminate_backend`) marks exactly the leases on it lost,
/// at once, and the leases on the other sessions stay held and release normally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_session_loses_exactly_its_leases() {
    let url = with_prefix(&base_url(), &fresh_prefix());
    let locks = PgLock::connect(&url).await.unwrap();
    let n = 2 * SESSION_LEASES + SESSION_LEASES / 2;
    let names: Vec<String> = (0..n).map(|i| format!("t-{i}")).collect();
    let leases = acquire_all(&locks, &names, Duration::from_secs(30), 8).await;
    let victim = pid_of(&leases[0]);
    let (gone, kept): (Vec<Lease>, Vec<Lease>) =
        leases.into_iter().partition(|l| pid_of(l) == victim);
    assert!(!kept.is_empty() && !gone.is_empty());
    let mut db = admin(&base_url()).await;
    let killed = Instant::now();
    let ok: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(victim)
        .fetch_one(&mut db)
        .await
        .unwrap();
    assert!(ok);
    let lost = join_all(gone.iter().map(|l| l.lost()));
    tokio::time::timeout(Duration::from_secs(2), lost)
        .await
        .expect("the terminated session's leases were not told");
    eprintln!(
        "postgres: pg_terminate_backend of a session with {} leases -> all Lost in {:?}",
        gone.len(),
        killed.elapsed()
    );
    assert!(kept.iter().all(|l| l.state() == LeaseState::Held));
    for l in gone {
        assert!(matches!(l.release().await, Err(Error::NotHeld { .. })));
    }
    release_all(kept).await;
}

/// A try-acquire dropped at any moment of its grant on a shared session (which another lease
/// keeps open) leaves no lock behind, and neither does a dropped waiter; the other lease on
/// the session is not disturbed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_grants_and_waiters_on_a_shared_session_leave_nothing() {
    let (base, a, b) = two_clients().await;
    let ttl = Duration::from_secs(30);
    let bystander = b.try_acquire("bystander", ttl).await.unwrap();
    let session = pid_of(&bystander);
    let key = b.key("free");
    for polls in 1..=3 {
        for us in [0u64, 20, 50, 100, 200, 500, 1000, 3000] {
            let mut fut = Box::pin(b.try_acquire("free", ttl));
            match poll_paused(fut.as_mut(), polls, us).await {
                Some(Ok(lease)) => {
                    assert_eq!(pid_of(&lease), session);
                    lease.release().await.expect("release");
                }
                Some(Err(e)) => panic!("try-acquire of a free lock: {e:?}"),
                None => drop(fut),
            }
            wait_no_advisory_lock(&base, key, Duration::from_secs(3)).await;
        }
    }
    // Waiters for a lock held on a shared session, dropped at several points of their wait.
    let holder = a.try_acquire("held", ttl).await.unwrap();
    let held_key = a.key("held");
    drop_waiters(&b, "held", ttl, &[0, 1, 5, 20, 100, 300]).await;
    holder.release().await.unwrap();
    wait_no_advisory_lock(&base, held_key, Duration::from_secs(3)).await;
    let next = b
        .acquire_timeout("held", ttl, Duration::from_secs(2))
        .await
        .expect("a cancelled waiter left something behind");
    assert_eq!(advisory_locks(&base, held_key).await, 1);
    next.release().await.unwrap();
    assert_eq!(bystander.state(), LeaseState::Held);
    assert_eq!(pid_of(&bystander), session);
    bystander
        .release()
        .await
        .expect("the bystander was disturbed");
}

/// Not a test of its own: the holder process of `a_frozen_holder_process_frees_all_its_leases`,
/// which re-runs this test binary with `LOCKKIT_PG_MANY_URL` set. Without it, it returns at
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_holder_child_process() {
    let Ok(url) = std::env::var("LOCKKIT_PG_MANY_URL") else {
        return;
    };
    let n: usize = std::env::var("LOCKKIT_PG_MANY_N")
        .expect("n")
        .parse()
        .expect("n");
    let ttl_ms: u64 = std::env::var("LOCKKIT_PG_MANY_TTL_MS")
        .expect("ttl")
        .parse()
        .expect("ttl");
    let locks = PgLock::connect(&url).await.expect("holder connect");
    let names: Vec<String> = (0..n).map(|i| format!("frozen-{i}")).collect();
    let leases = acquire_all(&locks, &names, Duration::from_millis(ttl_ms), 4).await;
    let mut pids: Vec<i32> = leases.iter().map(pid_of).collect();
    pids.sort_unstable();
    pids.dedup();
    let pids: Vec<String> = pids.iter().map(i32::to_string).collect();
    println!("HOLDER READY {} {}", leases.len(), pids.join(","));
    // Frozen (SIGSTOP) and then killed by the parent.
    std::future::pending::<()>().await;
}

/// A holder process frozen with SIGSTOP (as a hung or cut-off host: its sockets stay open)
/// holds many leases on shared sessions: the server ends those sessions by their idle
/// timeout, so every lock is free within the TTL, and another client gets them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_holder_process_frees_all_its_leases() {
    let url = with_prefix(&base_url(), &fresh_prefix());
    let n = 1500;
    let ttl = Duration::from_secs(2);
    let mut child = spawn_test_child(
        "postgres::multiplex::many_holder_child_process",
        &[
            ("LOCKKIT_PG_MANY_URL", &url),
            ("LOCKKIT_PG_MANY_N", &n.to_string()),
            ("LOCKKIT_PG_MANY_TTL_MS", &ttl.as_millis().to_string()),
        ],
        false,
    );
    let pid = child.id().expect("pid");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let ready = format!("HOLDER READY {n} ");
    let pids: Vec<i32> = tagged_line(&mut lines, &ready, Duration::from_secs(60))
        .await
        .split(',')
        .map(|p| p.trim().parse().expect("pid"))
        .collect();
    signal(pid, "STOP");
    let stopped = Instant::now();
    // The server ends each frozen session one TTL after its last statement (there is no
    // signal to await in this process: ask the server).
    let mut db = admin(&base_url()).await;
    loop {
        let left: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1)")
                .bind(&pids)
                .fetch_one(&mut db)
                .await
                .unwrap();
        if left == 0 {
            break;
        }
        assert!(
            stopped.elapsed() <= ttl + SLACK + Duration::from_millis(1500),
            "{left} of the frozen holder's {} sessions still exist {:?} after the freeze (TTL {ttl:?})",
            pids.len(),
            stopped.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = stopped.elapsed();
    let locks = PgLock::connect(&url).await.unwrap();
    let names: Vec<String> = (0..n).map(|i| format!("frozen-{i}")).collect();
    let all = acquire_all(&locks, &names, Duration::from_secs(30), 4).await;
    eprintln!(
        "postgres: the {} sessions of a frozen holder of {n} leases ended {took:?} after the \
         freeze (TTL {ttl:?}); all {} locks re-acquired",
        pids.len(),
        all.len()
    );
    let _ = child.kill().await;
    release_all(all).await;
}

/// A waiting acquire waits on a connection of its own, which then holds the lease. Once that
/// lease is released its connection goes back to the idle cache (the pool has another
/// session for tries), so the next waiting acquire waits on it instead of opening a new
/// server session per wait (found by the benchmark: every contended acquire opened one).
#[tokio::test]
async fn a_released_waited_lease_gives_its_connection_to_the_next_wait() {
    let url = with_prefix(&base_url(), &fresh_prefix());
    let locks = PgLock::connect(&url).await.expect("connect");
    let other = PgLock::connect(&url).await.expect("connect");
    let ttl = Duration::from_secs(10);
    let key = locks.key("job");
    let mut pids = Vec::new();
    for _ in 0..3 {
        let held = other.try_acquire("job", ttl).await.expect("try-acquire");
        let shared = pid_of(&held);
        let waiter = locks.clone();
        let wait =
            tokio::spawn(
                async move { waiter.acquire("job", AcquireOptions::new().ttl(ttl)).await },
            );
        // Queued: the holder's entry and the waiter's (pg_locks has no change signal).
        while advisory_locks(&url, key).await < 2 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        held.release().await.expect("release");
        let lease = wait.await.expect("wait task").expect("acquire");
        assert_ne!(pid_of(&lease), shared);
        pids.push(pid_of(&lease));
        lease.release().await.expect("release");
    }
    assert_eq!(pids, vec![pids[0]; 3], "each wait opened a new session");
}

const BYSTANDER_TTL: Duration = Duration::from_secs(30);

/// The shared server's URL, a client with a prefix of its own, and a lease ("bystander",
/// [`BYSTANDER_TTL`]) it holds on its shared session, for tests that cancel other calls on
/// that session and check the bystander is not disturbed.
async fn with_a_bystander() -> (String, PgLock, lockkit::Lease) {
    let base = base_url();
    let locks = PgLock::connect(&with_prefix(&base, &fresh_prefix()))
        .await
        .unwrap();
    let bystander = locks.try_acquire("bystander", BYSTANDER_TTL).await.unwrap();
    (base, locks, bystander)
}

/// A release dropped at any moment (while it waits for the session's connection, or with its
/// unlock in flight) still happens: the lock is free soon after, the other lease on the
/// session is not disturbed, and the session keeps working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_releases_on_a_shared_session_still_happen() {
    let (base, locks, bystander) = with_a_bystander().await;
    let ttl = BYSTANDER_TTL;
    let session = pid_of(&bystander);
    let key = locks.key("dropped-release");
    for polls in 1..=2 {
        for us in [0u64, 20, 50, 100, 200, 500] {
            let lease = locks.try_acquire("dropped-release", ttl).await.unwrap();
            assert_eq!(pid_of(&lease), session);
            let mut fut = Box::pin(lease.release());
            if poll_paused(fut.as_mut(), polls, us).await.is_none() {
                drop(fut);
            }
            wait_no_advisory_lock(&base, key, Duration::from_secs(3)).await;
        }
    }
    // The session still grants and releases.
    let again = locks.try_acquire("dropped-release", ttl).await.unwrap();
    assert_eq!(pid_of(&again), session);
    again.release().await.unwrap();
    assert_eq!(bystander.state(), LeaseState::Held);
    bystander.release().await.unwrap();
}

/// A try-acquire with a lock-delay dropped at any moment of its grant on a shared session
/// leaves neither the lock nor its delay row: the next try is granted at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_grant_with_a_lock_delay_leaves_no_delay() {
    let (base, locks, bystander) = with_a_bystander().await;
    let ttl = BYSTANDER_TTL;
    let key = locks.key("delayed");
    let delayed = AcquireOptions::new()
        .ttl(ttl)
        .wait(lockkit::Wait::No)
        .lock_delay(Duration::from_secs(20));
    for polls in 1..=2 {
        for us in [0u64, 50, 100, 200, 500, 1000, 3000] {
            let mut fut = Box::pin(locks.acquire("delayed", delayed.clone()));
            match poll_paused(fut.as_mut(), polls, us).await {
                Some(r) => r
                    .expect("try-acquire of a free lock")
                    .release()
                    .await
                    .unwrap(),
                None => drop(fut),
            }
            wait_no_advisory_lock(&base, key, Duration::from_secs(3)).await;
            let next = locks
                .acquire("delayed", delayed.clone())
                .await
                .expect("a cancelled grant left its lock-delay behind");
            next.release().await.unwrap();
        }
    }
    bystander.release().await.unwrap();
}

/// A waited grant (the lock held by another client, released while the acquire waits) costs
/// the waiter three statements: the try on its shared session (which also tells a held lock
/// from a key collision), the wait (which also sets the session's timeouts), and the token
/// bump after it; the holder's release one. Counted by `pg_stat_statements` on a server of
/// the test's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waited_grant_takes_three_statements() {
    let srv = PgServer::start(None);
    let mut db = admin(&srv.url()).await;
    sqlx::Executor::execute(
        &mut db,
        "ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'",
    )
    .await
    .unwrap();
    drop(db);
    srv.crash_restart();
    let mut db = admin(&srv.url()).await;
    sqlx::Executor::execute(&mut db, "CREATE EXTENSION pg_stat_statements")
        .await
        .unwrap();
    let url = with_prefix(&srv.url(), &fresh_prefix());
    let (a, b) = (
        PgLock::connect(&url).await.unwrap(),
        PgLock::connect(&url).await.unwrap(),
    );
    let ttl = Duration::from_secs(60);
    // Keeps b's shared session open, so that a released waited lease's connection goes back
    // to b's idle cache (the second round then opens no connection).
    let keep = b.try_acquire("keep", ttl).await.unwrap();
    let opts = AcquireOptions::new().ttl(ttl);
    let mut counted = Vec::new();
    for _ in 0..2 {
        let held = a.try_acquire("waited", ttl).await.unwrap();
        sqlx::Executor::execute(&mut db, "SELECT pg_stat_statements_reset()")
            .await
            .unwrap();
        let waiter = tokio::spawn({
            let (b, opts) = (b.clone(), opts.clone());
            async move { b.acquire("waited", opts).await }
        });
        super::waiting_pid(&srv.url(), a.key("waited")).await;
        held.release().await.unwrap();
        let lease = waiter.await.unwrap().expect("waited acquire");
        let (n, texts): (i64, Vec<String>) = sqlx::query_as(
            "SELECT coalesce(sum(calls), 0)::int8, coalesce(array_agg(query), '{}') \
             FROM pg_stat_statements \
             WHERE query NOT LIKE '%pg_stat_%' AND query NOT LIKE '%pg_locks%'",
        )
        .fetch_one(&mut db)
        .await
        .unwrap();
        counted.push((n, texts));
        lease.release().await.unwrap();
    }
    eprintln!("postgres: statements of a waited grant + the holder's release: {counted:?}");
    let (n, texts) = &counted[1];
    assert_eq!(
        *n, 4,
        "waiter's try, wait, bump + holder's release: {texts:?}"
    );
    keep.release().await.unwrap();
}
