//! Attempts to break session 8's PostgreSQL change (leases multiplexed on shared holder
//! sessions: a connection lock plus a keeper task that renews and reads the idle connection).

use std::time::Duration;

use lockkit::postgres::PgLock;
use lockkit::postgres::sqlx::{self, PgConnection};
use lockkit::{LeaseState, LockExt};
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

/// Two clients, six tasks each, take and give back four names (try-once and waited grants,
/// so shared and adopted holder sessions) while a killer task `pg_terminate_backend`s the
/// session of a lease just granted, every 100 ms. A lease whose session was killed must be
/// lost; any other holder must never overlap the next one (a grant while the previous holder
/// is live means its session was killed); tokens increase per name; and at the end every
/// name can be taken at once by another client (nothing left on the server).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_sessions_during_concurrent_grants_and_releases() {
    use std::collections::{HashMap, HashSet};
    use std::sync::{Arc, Mutex};
    let url = with_prefix(&base_url(), &fresh_prefix());
    let clients = [
        PgLock::connect(&url).await.expect("connect"),
        PgLock::connect(&url).await.expect("connect"),
    ];
    let ttl = Duration::from_secs(3);
    /// Per name: the live holder's (token, pid), and the largest token seen.
    type Holders = HashMap<String, (Option<(u64, i32)>, u64)>;
    let held: Arc<Mutex<Holders>> = Arc::default();
    let killed: Arc<Mutex<HashSet<i32>>> = Arc::default();
    let victims: Arc<Mutex<Vec<i32>>> = Arc::default();
    let until = Instant::now() + Duration::from_secs(4);
    let mut tasks = Vec::new();
    for (c, locks) in clients.iter().enumerate() {
        for t in 0..6u64 {
            let (locks, held, killed, victims) =
                (locks.clone(), held.clone(), killed.clone(), victims.clone());
            tasks.push(tokio::spawn(async move {
                let mut i = t;
                let mut grants = 0u32;
                while Instant::now() < until {
                    i += 1;
                    let name = format!("kill{}", (i + c as u64) % 4);
                    let got = if i % 2 == 0 {
                        locks.try_acquire(&name, ttl).await
                    } else {
                        locks
                            .acquire_timeout(&name, ttl, Duration::from_secs(2))
                            .await
                    };
                    let lease = match got {
                        Ok(l) => l,
                        Err(e)
                            if e.is_retryable()
                                || matches!(
                                    e,
                                    lockkit::Error::Held { .. } | lockkit::Error::Timeout { .. }
                                ) =>
                        {
                            continue;
                        }
                        Err(e) => panic!("{name}: acquire: {e:?}"),
                    };
                    let token = lease.token().get();
                    let pid = super::pid_of(&lease);
                    {
                        let mut h = held.lock().unwrap();
                        let e = h.entry(name.clone()).or_insert((None, 0));
                        let k = killed.lock().unwrap();
                        if let Some((old, old_pid)) = e.0 {
                            assert!(
                                k.contains(&old_pid),
                                "{name}: granted ({token}) while {old} of a live session held it"
                            );
                        }
                        assert!(
                            token > e.1 || k.contains(&pid),
                            "{name}: token {token} not above {}",
                            e.1
                        );
                        e.0 = Some((token, pid));
                        e.1 = e.1.max(token);
                    }
                    victims.lock().unwrap().push(pid);
                    tokio::time::sleep(Duration::from_millis((i * 7919) % 21)).await;
                    {
                        let mut h = held.lock().unwrap();
                        let e = h.get_mut(&name).expect("held");
                        if e.0 == Some((token, pid)) {
                            e.0 = None;
                        }
                    }
                    if killed.lock().unwrap().contains(&pid) {
                        tokio::time::timeout(Duration::from_secs(2), lease.lost())
                            .await
                            .unwrap_or_else(|_| {
                                panic!(
                                    "{name}: its session was killed, the lease is {:?}",
                                    lease.state()
                                )
                            });
                        let _ = lease.release().await;
                    } else if lease.state() == LeaseState::Held {
                        // Killed just now (after the look) is possible: then NotHeld.
                        let r = lease.release().await;
                        assert!(
                            r.is_ok() || killed.lock().unwrap().contains(&pid),
                            "{name}: release: {r:?}"
                        );
                    } else {
                        assert!(
                            killed.lock().unwrap().contains(&pid),
                            "{name}: lost ({:?}) but its session was not killed",
                            lease.loss_reason()
                        );
                    }
                    grants += 1;
                }
                grants
            }));
        }
    }
    let killer = {
        let (killed, victims) = (killed.clone(), victims.clone());
        tokio::spawn(async move {
            let mut db = admin(&base_url()).await;
            let mut kills = 0u32;
            while Instant::now() < until {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let Some(pid) = victims.lock().unwrap().pop() else {
                    continue;
                };
                // Marked first: a grant seen overlapping this session's lease is allowed.
                killed.lock().unwrap().insert(pid);
                let _: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
                    .bind(pid)
                    .fetch_one(&mut db)
                    .await
                    .expect("pg_terminate_backend");
                kills += 1;
            }
            kills
        })
    };
    let mut grants = 0;
    for t in tasks {
        grants += t.await.expect("task");
    }
    let kills = killer.await.expect("killer");
    eprintln!("{grants} grants, {kills} sessions terminated");
    let other = PgLock::connect(&url).await.expect("connect");
    for i in 0..4 {
        let name = format!("kill{i}");
        other
            .acquire_timeout(&name, ttl, ttl * 2)
            .await
            .unwrap_or_else(|e| panic!("{name} is not free: {e}"))
            .release()
            .await
            .expect("release");
    }
}
