//! `PgFence::update_as` on the shared server, with leases of `lockkit::connect`.

use std::time::Duration;

use lockkit::postgres::PgFence;
use lockkit::postgres::sqlx;
use lockkit::{Error, FencingToken, LeaseState, LockExt};
use tokio::time::Instant;

use super::server::admin;
use super::{args2, base_url, scratch_table};
use crate::common::{fresh_prefix, with_prefix};

const TTL: Duration = Duration::from_secs(30);

/// Rows written under a lease of `Arc<dyn Lock>` are bound to its lock: another lock's holder
/// is rejected (its lease unharmed); the holder's own write is rejected as stale once a newer
/// grant of the lock wrote (here one seen after a failover), and its lease is Lost at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_as_binds_rows_and_a_stale_write_loses_the_lease() {
    let url = base_url();
    let table = scratch_table(&url).await;
    let fence = PgFence::new(&table, "fence_token", "fence_lock").unwrap();
    let locks = lockkit::connect(&with_prefix(&url, &fresh_prefix()))
        .await
        .expect("connect");
    let mut db = admin(&url).await;

    let x = locks.try_acquire("x", TTL).await.expect("acquire x");
    let n = fence
        .update_as(&mut db, &x, "body = $1", "id = $2", args2("by x", 1))
        .await
        .expect("x writes");
    assert_eq!(n, 1);
    let lock: String = sqlx::query_scalar(&format!("SELECT fence_lock FROM {table} WHERE id = 1"))
        .fetch_one(&mut db)
        .await
        .unwrap();
    assert_eq!(lock, x.token().lock());

    let y = locks.try_acquire("y", TTL).await.expect("acquire y");
    match fence
        .update_as(&mut db, &y, "body = $1", "id = $2", args2("by y", 1))
        .await
    {
        Err(Error::ForeignToken {
            expected_lock,
            token,
            ..
        }) => {
            assert_eq!(expected_lock, x.token().lock());
            assert_eq!(token, y.token());
        }
        other => panic!("a token of another lock: expected ForeignToken, got {other:?}"),
    }
    assert_eq!(y.state(), LeaseState::Held);
    y.release().await.expect("release");

    let newer = FencingToken::new(x.token().lock(), x.token().get() + 1);
    fence
        .update(
            &mut db,
            newer.clone(),
            "body = $1",
            "id = $2",
            args2("newer", 1),
        )
        .await
        .expect("a newer grant writes");
    assert_eq!(x.state(), LeaseState::Held);
    match fence
        .update_as(&mut db, &x, "body = $1", "id = $2", args2("stale", 1))
        .await
    {
        Err(Error::StaleToken { token, current, .. }) => {
            assert_eq!(token, x.token());
            assert_eq!(current, newer);
        }
        other => panic!("the old holder's write: expected StaleToken, got {other:?}"),
    }
    assert_eq!(x.state(), LeaseState::Lost);
    assert!(x.valid_until() > Instant::now() + TTL / 2);
    let body: String = sqlx::query_scalar(&format!("SELECT body FROM {table} WHERE id = 1"))
        .fetch_one(&mut db)
        .await
        .unwrap();
    assert_eq!(body, "newer");
    let _ = x.release().await;
    sqlx::Executor::execute(&mut db, format!("DROP TABLE {table}").as_str())
        .await
        .unwrap();
}
