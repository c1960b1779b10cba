//! Failures a PostgreSQL lease must survive: a frozen holder process, a killed session, a
//! server crash and restart, and acquires cancelled (or timed out) at every moment.

use lockkit::backend::LeaseBackendExt;
use std::time::Duration;

use lockkit::postgres::sqlx::postgres::PgArguments;
use lockkit::postgres::sqlx::{self, Arguments, Connection};
use lockkit::postgres::{PgFence, PgLock};
use lockkit::{AcquireOptions, Error, LeaseState, Lock, LockExt, Wait, drift_margin};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::time::Instant;

use super::server::{PgServer, admin};
use super::{
    base_url, drop_waiters, pid_of, poll_paused, scratch_table, signal, spawn_test_child,
    tagged_line, two_clients, wait_no_advisory_lock, waiting_pid,
};
use crate::common::proxy::Proxy;
use crate::common::{fresh_prefix, with_prefix};

const SLACK: Duration = Duration::from_millis(100); // PgLock's Guarantees::expiry_slack

fn body_args(body: &str) -> PgArguments {
    let mut args = PgArguments::default();
    args.add(body.to_owned()).expect("encode");
    args.add(1_i32).expect("encode");
    args
}

/// Not a test of its own: the holder process of `paused_holder_is_fenced_out`, which re-runs
/// this test binary with `LOCKKIT_PG_HOLDER_URL` set. Without it, it returns at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holder_child_process() {
    let Ok(url) = std::env::var("LOCKKIT_PG_HOLDER_URL") else {
        return;
    };
    let name = std::env::var("LOCKKIT_PG_HOLDER_NAME").expect("name");
    let table = std::env::var("LOCKKIT_PG_HOLDER_TABLE").expect("table");
    let ttl_ms: u64 = std::env::var("LOCKKIT_PG_HOLDER_TTL_MS")
        .expect("ttl")
        .parse()
        .expect("ttl");
    let locks = PgLock::connect(&url).await.expect("holder connect");
    let lease = locks
        .acquire(
            &name,
            AcquireOptions::new()
                .ttl(Duration::from_millis(ttl_ms))
                .wait(Wait::No),
        )
        .await
        .expect("holder acquire");
    let mut db = admin(&base_url()).await;
    println!("HOLDER TOKEN {}", lease.token());
    // Frozen here by SIGSTOP; the parent writes a line after SIGCONT.
    let line = tokio::task::spawn_blocking(|| {
        let mut s = String::new();
        std::io::stdin().read_line(&mut s).map(|_| s)
    })
    .await
    .expect("stdin task")
    .expect("stdin");
    assert_eq!(line.trim(), "GO");
    println!("HOLDER STATE {:?}", lease.state());
    // The paused holder still tries its write, with its old token.
    let fence = PgFence::new(&table, "fence_token", "fence_lock").expect("fence");
    let mut tx = db.begin().await.expect("begin");
    match fence
        .update(
            &mut tx,
            lease.token(),
            "body = $1",
            "id = $2",
            body_args("by paused holder"),
        )
        .await
    {
        Err(Error::StaleToken { current, .. }) => println!("HOLDER WRITE stale {current}"),
        Ok(n) => println!("HOLDER WRITE ok {n}"),
        Err(e) => println!("HOLDER WRITE error {e}"),
    }
    tx.commit().await.expect("commit");
    match lease.release().await {
        Err(Error::NotHeld { .. }) => println!("HOLDER RELEASE NotHeld"),
        other => println!("HOLDER RELEASE {other:?}"),
    }
}

/// A holder process frozen with SIGSTOP loses the lock within its TTL: another client acquires
/// it with a larger token, and after SIGCONT the old holder sees its lease Lost and its fenced
/// update is rejected with StaleToken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_holder_is_fenced_out() {
    let url = with_prefix(&base_url(), &fresh_prefix());
    let table = scratch_table(&base_url()).await;
    let name = "paused";
    let ttl = Duration::from_secs(2);
    let ttl_ms = ttl.as_millis().to_string();
    let mut child = spawn_test_child(
        "postgres::failures::holder_child_process",
        &[
            ("LOCKKIT_PG_HOLDER_URL", &url),
            ("LOCKKIT_PG_HOLDER_NAME", name),
            ("LOCKKIT_PG_HOLDER_TABLE", &table),
            ("LOCKKIT_PG_HOLDER_TTL_MS", &ttl_ms),
        ],
        true,
    );
    let pid = child.id().expect("pid");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut stdin = child.stdin.take().expect("stdin");
    let mut next = async |what: &str| -> String {
        let tag = format!("HOLDER {what} ");
        tagged_line(&mut lines, &tag, Duration::from_secs(20)).await
    };
    let old_token = next("TOKEN")
        .await
        .parse::<lockkit::FencingToken>()
        .expect("token")
        .get();

    signal(pid, "STOP");
    let stopped = Instant::now();
    let locks = PgLock::connect(&url).await.expect("connect");
    let lease = locks
        .acquire(
            name,
            AcquireOptions::new()
                .ttl(Duration::from_secs(10))
                .wait(Wait::Timeout(ttl + SLACK + Duration::from_secs(5))),
        )
        .await
        .expect("the frozen holder's lock did not lapse");
    let took = stopped.elapsed();
    assert!(
        took <= ttl + SLACK + Duration::from_millis(1500),
        "granted {took:?} after the holder froze (TTL {ttl:?})"
    );
    assert!(lease.token().get() > old_token);
    let fence = PgFence::new(&table, "fence_token", "fence_lock").unwrap();
    let mut db = admin(&base_url()).await;
    let mut tx = db.begin().await.unwrap();
    fence
        .update(
            &mut tx,
            lease.token(),
            "body = $1",
            "id = $2",
            body_args("by new holder"),
        )
        .await
        .expect("new holder's write");
    tx.commit().await.unwrap();

    signal(pid, "CONT");
    stdin.write_all(b"GO\n").await.expect("write GO");
    stdin.flush().await.expect("flush");
    assert_eq!(next("STATE").await, "Lost");
    assert_eq!(next("WRITE").await, format!("stale {}", lease.token()));
    assert_eq!(next("RELEASE").await, "NotHeld");
    let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .expect("holder did not exit")
        .expect("wait");
    assert!(status.success(), "holder process failed: {status}");

    let body: String = sqlx::query_scalar(&format!("SELECT body FROM {table} WHERE id = 1"))
        .fetch_one(&mut db)
        .await
        .unwrap();
    assert_eq!(body, "by new holder");
    lease.release().await.expect("release");
    sqlx::Executor::execute(&mut db, format!("DROP TABLE {table}").as_str())
        .await
        .unwrap();
}

/// `pg_terminate_backend` on the holder's session frees the lock at once; the holder learns it
/// by reading the close on its connection (long before its deadline), and the next token is
/// larger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_session_releases_and_tells_holder() {
    let url = with_prefix(&base_url(), &fresh_prefix());
    let (a, b) = (
        PgLock::connect(&url).await.unwrap(),
        PgLock::connect(&url).await.unwrap(),
    );
    let ttl = Duration::from_secs(9);
    let lease = a.try_acquire("killed", ttl).await.unwrap();
    let pid = pid_of(&lease);
    let mut db = admin(&base_url()).await;
    let killed = Instant::now();
    let ok: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&mut db)
        .await
        .unwrap();
    assert!(ok, "pg_terminate_backend({pid}) found no session");
    let next = b
        .acquire_timeout("killed", ttl, Duration::from_secs(3))
        .await
        .expect("the killed session's lock was not freed");
    assert!(killed.elapsed() < Duration::from_secs(3));
    assert!(next.token() > lease.token());
    // The close watch reads the close at once (see loss.rs for the bound): before the first
    // keepalive (TTL/3 = 3 s) and well before the deadline.
    tokio::time::timeout(Duration::from_secs(1), lease.lost())
        .await
        .expect("the holder was not told its session was killed");
    assert_eq!(lease.state(), LeaseState::Lost);
    assert!(
        Instant::now() < lease.valid_until(),
        "lost only by the clock, not by the server's word"
    );
    match lease.release().await {
        Err(Error::NotHeld { .. }) => {}
        other => panic!("release after kill: {other:?}"),
    }
    next.release().await.unwrap();
}

/// A holder cut off by the network (a relay that stops forwarding but keeps the sockets open)
/// loses the lock within its TTL on the server, without waiting for TCP to give up: another
/// client gets it with a larger token, and the holder's loss signal fires by its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_cut_frees_the_lock_within_ttl() {
    let base = base_url();
    let upstream: u16 = base
        .rsplit(':')
        .next()
        .and_then(|s| s.split('/').next())
        .and_then(|p| p.parse().ok())
        .expect("port in LOCKKIT_POSTGRES_URL");
    let relay = Proxy::start_local(upstream).await;
    let prefix = fresh_prefix();
    let through = with_prefix(
        &format!("postgres://postgres@127.0.0.1:{}/postgres", relay.port),
        &prefix,
    );
    let a = PgLock::connect(&through)
        .await
        .expect("connect through relay");
    let b = PgLock::connect(&with_prefix(&base, &prefix)).await.unwrap();
    let ttl = Duration::from_millis(1500);
    let lease = a.try_acquire("cut", ttl).await.unwrap();
    let lost = tokio::spawn(lease.lost());
    relay.freeze();
    let cut = Instant::now();
    let next = b
        .acquire_timeout(
            "cut",
            Duration::from_secs(10),
            ttl + SLACK + Duration::from_secs(5),
        )
        .await
        .expect("the cut-off holder's lock was not freed");
    let took = cut.elapsed();
    assert!(
        took <= ttl + SLACK + Duration::from_millis(1500),
        "freed {took:?} after the cut (TTL {ttl:?})"
    );
    assert!(next.token() > lease.token());
    tokio::time::timeout(Duration::from_secs(1), lost)
        .await
        .expect("the holder's loss signal did not fire")
        .unwrap();
    assert_eq!(lease.state(), LeaseState::Lost);
    next.release().await.unwrap();
    lease.leak();
}

/// Tokens never repeat across crash-restarts of the server (`pg_ctl -m immediate`), for new
/// clients and for the client that lived through the restart; a lease held across the crash is
/// NotHeld afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_restart_tokens_never_repeat() {
    let srv = PgServer::start(None);
    let url = with_prefix(&srv.url(), &fresh_prefix());
    let locks = PgLock::connect(&url).await.expect("connect");
    let ttl = Duration::from_secs(10);
    let mut highest = 0u64;
    let mut check = |t: u64, what: &str| {
        assert!(t > highest, "{what}: token {t} not above {highest}");
        highest = t;
    };
    for round in 0..3 {
        for _ in 0..4 {
            let l = locks.try_acquire("restart", ttl).await.expect("acquire");
            check(l.token().get(), "before the crash");
            l.release().await.expect("release");
        }
        let held = locks
            .acquire(
                "restart",
                AcquireOptions::new()
                    .ttl(ttl)
                    .wait(Wait::No)
                    .keepalive(false),
            )
            .await
            .expect("acquire");
        check(held.token().get(), "held across the crash");
        srv.crash_restart();
        match held.ops().renew(ttl).await {
            Err(Error::NotHeld { .. }) => {}
            other => panic!("round {round}: renew across a restart: {other:?}"),
        }
        let fresh = PgLock::connect(&url).await.expect("connect after restart");
        let l = fresh.try_acquire("restart", ttl).await.expect("acquire");
        check(l.token().get(), "new client after the crash");
        l.release().await.unwrap();
        // The client whose cached connections all died recovers by itself.
        let l = locks
            .try_acquire("restart", ttl)
            .await
            .expect("acquire on the old client");
        check(l.token().get(), "old client after the crash");
        l.release().await.unwrap();
        drop(held);
    }
}

/// A `Wait::Forever` acquire lives through a server outage longer than its retry policy's
/// `max_retries` budget (default: 5 retries, about 1.5–3 s of backoff) and gets the lock once
/// the server is back: "forever" survives a restart. Before the fix it ended with
/// `Unavailable` about 3 s into the outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forever_wait_survives_a_server_outage() {
    let srv = PgServer::start(None);
    let url = with_prefix(&format!("{}?connect_timeout=1", srv.url()), &fresh_prefix());
    let (a, b) = (
        PgLock::connect(&url).await.expect("connect"),
        PgLock::connect(&url).await.expect("connect"),
    );
    let ttl = Duration::from_secs(10);
    let held = a.try_acquire("outage", ttl).await.expect("acquire");
    let waiter = tokio::spawn(async move {
        b.acquire("outage", AcquireOptions::new().ttl(ttl).wait(Wait::Forever))
            .await
    });
    waiting_pid(&srv.url(), a.key("outage")).await;
    srv.stop_immediate();
    // The outage itself: twice the longest the default retry budget lasts. Nothing to await.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(
        !waiter.is_finished(),
        "a Wait::Forever acquire ended during a 6 s outage: {:?}",
        waiter.await
    );
    srv.start_again();
    let lease = tokio::time::timeout(Duration::from_secs(30), waiter)
        .await
        .expect("the waiter did not get the lock after the server came back")
        .unwrap()
        .expect("the waiter's acquire failed after the server came back");
    // The holder's session died with the server: the lock was free, and the token moved on.
    assert!(lease.token() > held.token());
    lease.release().await.expect("release");
    drop(held);
}

/// Acquires dropped at every moment (waiting for a held lock, or racing the grant of a free one)
/// leave nothing in `pg_locks`, and the next acquirer gets the lock at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_acquire_leaves_no_lock() {
    let (base, a, b) = two_clients().await;
    let ttl = Duration::from_secs(30);
    // Free lock: cancel a try-acquire before, during and after its grant.
    let free_key = b.key("free");
    // tokio's timers tick in milliseconds, too coarse to land inside a ~0.2 ms grant, so the
    // acquire future is polled by hand: each poll in `polls` is followed by a (blocking) pause of
    // `us` µs, during which the server may grant and answer; then the future is dropped with
    // the reply unread.
    let mut completed = 0;
    let mut cases = 0;
    for polls in 1..=3 {
        for us in [0u64, 20, 50, 100, 150, 200, 300, 500, 1000, 3000] {
            cases += 1;
            // A warm connection in b's cache: the cancel lands while the grant statement itself
            // is in flight, not while connecting.
            b.try_acquire("warm", ttl)
                .await
                .expect("warm-up")
                .release()
                .await
                .expect("warm-up release");
            // Boxed, so that dropping it really drops the acquire (and its connection).
            let mut fut = Box::pin(b.try_acquire("free", ttl));
            match poll_paused(fut.as_mut(), polls, us).await {
                Some(Ok(lease)) => {
                    completed += 1;
                    lease.release().await.expect("release");
                }
                Some(Err(e)) => panic!("try-acquire of a free lock: {e:?}"),
                None => drop(fut),
            }
            wait_no_advisory_lock(&base, free_key, Duration::from_secs(3)).await;
        }
    }
    eprintln!("free lock: {completed} of {cases} try-acquires completed before their cancel");

    // Held lock: cancel waiters at several points of their wait.
    let key = a.key("held");
    let holder = a.try_acquire("held", ttl).await.unwrap();
    drop_waiters(&b, "held", ttl, &[0, 1, 2, 5, 10, 20, 50, 100, 300]).await;
    holder.release().await.unwrap();
    wait_no_advisory_lock(&base, key, Duration::from_secs(3)).await;
    let start = Instant::now();
    let c = a
        .acquire_timeout("held", ttl, Duration::from_secs(2))
        .await
        .expect("a cancelled waiter left something behind");
    assert!(start.elapsed() < Duration::from_secs(2));
    c.release().await.unwrap();
}

/// A wait that times out just as the holder releases (server-side `lock_timeout` and the
/// caller's own `tokio::time::timeout`, each raced against the release at offsets around the
/// deadline) never leaks the lock: either the waiter returns a lease, or nothing is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_racing_grant_leaks_nothing() {
    let (base, a, b) = two_clients().await;
    let ttl = Duration::from_secs(30);
    let key = a.key("race");
    let wait = Duration::from_millis(150);
    let mut granted = 0;
    for external in [false, true] {
        // Dense around the deadline: the server's lock_timeout starts a little after the
        // client's clock, so grants that race it land at small positive offsets.
        for offset in [-10i64, -5, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 8, 10, 15, 20] {
            let holder = a.try_acquire("race", ttl).await.unwrap();
            let waiter = {
                let b = b.clone();
                tokio::spawn(async move {
                    if external {
                        match tokio::time::timeout(
                            wait,
                            b.acquire("race", AcquireOptions::new().ttl(ttl)),
                        )
                        .await
                        {
                            Ok(r) => r,
                            Err(_) => Err(Error::Timeout {
                                name: "race".into(),
                                waited: wait,
                            }),
                        }
                    } else {
                        b.acquire_timeout("race", ttl, wait).await
                    }
                })
            };
            let at = Instant::now() + wait;
            let release_at = if offset >= 0 {
                at + Duration::from_millis(offset as u64)
            } else {
                at - Duration::from_millis((-offset) as u64)
            };
            tokio::time::sleep_until(release_at).await;
            holder.release().await.unwrap();
            match waiter.await.expect("waiter task") {
                Ok(lease) => {
                    granted += 1;
                    lease.release().await.expect("release the raced grant");
                }
                Err(Error::Timeout { .. }) => {}
                Err(e) => panic!("waiter: {e:?}"),
            }
            wait_no_advisory_lock(&base, key, Duration::from_secs(3)).await;
        }
    }
    eprintln!("race: {granted} of 32 waiters got the lock");
}

/// idle_session_timeout has millisecond granularity: a 350 ms lease that is not renewed is
/// freed after 350 ms (not rounded to a second), and not before its client-side deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_has_millisecond_precision() {
    let url = with_prefix(&base_url(), &fresh_prefix());
    let (a, b) = (
        PgLock::connect(&url).await.unwrap(),
        PgLock::connect(&url).await.unwrap(),
    );
    let ttl = Duration::from_millis(350);
    for _ in 0..3 {
        let sent = Instant::now();
        let lease = a
            .acquire(
                "ms",
                AcquireOptions::new()
                    .ttl(ttl)
                    .wait(Wait::No)
                    .keepalive(false),
            )
            .await
            .unwrap();
        let next = b
            .acquire_timeout("ms", Duration::from_secs(10), Duration::from_secs(5))
            .await
            .expect("lapsed");
        let after = sent.elapsed();
        eprintln!("350 ms lease freed after {after:?}");
        assert!(after >= ttl - drift_margin(ttl), "freed early: {after:?}");
        assert!(
            after <= ttl + SLACK + Duration::from_millis(400),
            "freed late: {after:?}"
        );
        assert!(next.token() > lease.token());
        assert_eq!(lease.state(), LeaseState::Lost);
        next.release().await.unwrap();
        drop(lease);
    }
}

/// `leak()` keeps the lock held for the rest of its TTL (the session stays open, unrenewed),
/// then the server frees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaked_lease_holds_until_ttl() {
    let url = with_prefix(&base_url(), &fresh_prefix());
    let (a, b) = (
        PgLock::connect(&url).await.unwrap(),
        PgLock::connect(&url).await.unwrap(),
    );
    let ttl = Duration::from_secs(1);
    let sent = Instant::now();
    let lease = a.try_acquire("leak", ttl).await.unwrap();
    let token = lease.token();
    lease.leak();
    match b.try_acquire("leak", ttl).await {
        Err(Error::Held { .. }) => {}
        other => panic!("a leaked lease must stay held for its TTL: {other:?}"),
    }
    let next = b
        .acquire_timeout("leak", ttl, Duration::from_secs(5))
        .await
        .expect("the leaked lease did not lapse");
    let after = sent.elapsed();
    assert!(after >= ttl - drift_margin(ttl), "freed early: {after:?}");
    assert!(
        after <= ttl + SLACK + Duration::from_secs(1),
        "freed late: {after:?}"
    );
    assert!(next.token() > token);
    next.release().await.unwrap();
}

/// The Lock trait object from `lockkit::connect` is a PgLock with honest guarantees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantees_are_declared() {
    let l = lockkit::connect(&with_prefix(&base_url(), &fresh_prefix()))
        .await
        .unwrap();
    let g = l.guarantees();
    assert_eq!(g.backend, "postgres");
    assert!(g.tokens_survive_restart && g.fifo_waiters && g.manual_renewal);
    assert!(!g.safe_across_failover);
    assert_eq!(g.expiry_slack, SLACK);
    // The silent-death bound is the one README states (each check of `sessions_gone` takes up
    // to one connect timeout; the one running at the death may just have missed it): it said
    // "+ connect timeout" here and "+ 2 × connect timeout" in README.
    // The notes (shown by `lockkit guarantees`) give it in plain words, README by the constant.
    let notes = g.notes.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        notes.contains("within 5 s + 2 × the connect timeout"),
        "{notes}"
    );
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("README.md");
    let readme = readme.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(readme.contains("`SESSION_CHECK` (5 s) + 2 × connect timeout"));
}
