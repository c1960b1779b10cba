//! The holder hears at once that the server ended its session: it reads the server's close on
//! its idle lease connection (no polling), after `pg_terminate_backend` and after a server
//! stop, within `Guarantees::loss_notice`.

use std::time::Duration;

use lockkit::postgres::PgLock;
use lockkit::postgres::sqlx;
use lockkit::{AcquireOptions, Error, LeaseState, Lock, LockExt, LossReason, Wait};
use tokio::time::Instant;

use super::server::{PgServer, admin};
use super::{base_url, pid_of};
use crate::common::{fresh_prefix, with_prefix};

/// Held without keepalive, so that no renewal can be the one that finds out.
fn manual(ttl: Duration) -> AcquireOptions {
    AcquireOptions::new()
        .ttl(ttl)
        .wait(Wait::No)
        .keepalive(false)
}

/// `pg_terminate_backend` of the holder's backend by an admin connection: the lease is Lost
/// (SessionExpired) within `loss_notice` (100 ms) of the kill, far below the safety net's
/// SESSION_CHECK (5 s) and the TTL, in each of 8 runs (one reused PgLock, so cached
/// connections are watched too). A renewal then reports NotHeld.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_backend_is_heard_at_once() {
    let url = with_prefix(&base_url(), &fresh_prefix());
    let locks = PgLock::connect(&url).await.unwrap();
    let bound = lockkit::backend::LockBackend::guarantees(&locks)
        .loss_notice
        .expect("loss_notice declared");
    assert!(bound < lockkit::postgres::SESSION_CHECK);
    let mut db = admin(&base_url()).await;
    let ttl = Duration::from_secs(30);
    let mut took = Vec::new();
    for run in 0..8 {
        let lease = locks.acquire("terminated", manual(ttl)).await.unwrap();
        // A renewal first: the watch must survive statements on the connection.
        lease.renew().await.unwrap();
        let pid = pid_of(&lease);
        let lost = lease.lost();
        let sent = Instant::now();
        let ok: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .fetch_one(&mut db)
            .await
            .unwrap();
        assert!(ok, "run {run}: no session {pid}");
        tokio::time::timeout(bound, lost)
            .await
            .unwrap_or_else(|_| panic!("run {run}: not Lost within {bound:?} of the kill"));
        took.push(sent.elapsed());
        assert_eq!(lease.state(), LeaseState::Lost);
        assert_eq!(lease.loss_reason(), Some(LossReason::SessionExpired));
        match lease.renew().await {
            Err(Error::NotHeld { .. } | Error::LeaseLost { .. }) => {}
            other => panic!("run {run}: renew after the kill: {other:?}"),
        }
        drop(lease);
    }
    eprintln!("pg_terminate_backend -> Lost: {took:?}");
    // The lock is free again, and the next holder is not told anything.
    let next = locks.try_acquire("terminated", ttl).await.unwrap();
    assert_eq!(next.state(), LeaseState::Held);
    next.release().await.unwrap();
}

/// A lease idle in its connection after releases and renewals is not marked lost by them:
/// released leases hand their connection back to the cache, and the next lease on it hears of
/// its own kill (and only of its own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_killed_lease_is_lost() {
    let url = with_prefix(&base_url(), &fresh_prefix());
    let locks = PgLock::connect(&url).await.unwrap();
    let ttl = Duration::from_secs(30);
    let a = locks.acquire("a", manual(ttl)).await.unwrap();
    let b = locks.acquire("b", manual(ttl)).await.unwrap();
    let mut db = admin(&base_url()).await;
    let lost_b = b.lost();
    let _: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid_of(&b))
        .fetch_one(&mut db)
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(2), lost_b)
        .await
        .expect("b not told");
    a.renew().await.expect("a is still held");
    assert_eq!(a.state(), LeaseState::Held);
    a.release().await.unwrap();
}

/// A server stop (`pg_ctl -m immediate`: every backend killed) is heard by the holder at once
/// too, in each of 3 runs (the server is started again between runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_stop_is_heard_at_once() {
    let srv = PgServer::start(None);
    let url = with_prefix(&srv.url(), &fresh_prefix());
    let ttl = Duration::from_secs(30);
    let mut took = Vec::new();
    for run in 0..3 {
        let locks = PgLock::connect(&url).await.expect("connect");
        let lease = locks.acquire("stopped", manual(ttl)).await.unwrap();
        let lost = lease.lost();
        srv.stop_immediate();
        let stopped = Instant::now();
        tokio::time::timeout(Duration::from_millis(100), lost)
            .await
            .unwrap_or_else(|_| panic!("run {run}: not Lost within 100 ms of the stop"));
        took.push(stopped.elapsed());
        assert_eq!(lease.loss_reason(), Some(LossReason::SessionExpired));
        drop(lease);
        srv.start_again();
    }
    eprintln!("pg_ctl stop -m immediate (returned) -> Lost: {took:?}");
}
