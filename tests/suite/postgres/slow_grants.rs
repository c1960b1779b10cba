//! Grants on a slow network (issue #10, "no grant that is already nearly gone"), on the real
//! server behind the shared proxy: replies held in the network while requests take effect.

use std::time::Duration;

use lockkit::postgres::PgLock;
use lockkit::{AcquireOptions, Error, Lock, LockExt, Wait};
use tokio::time::Instant;

use super::{base_url, port_of};
use crate::common::proxy::Proxy;
use crate::common::{fresh_prefix, with_prefix};

/// A client behind a proxy and one straight to the server, on the same fresh prefix, the first
/// warmed up (its connection open and configured for `ttl`) so that the next grant is one
/// round trip.
async fn slow_and_direct(ttl: Duration) -> (Proxy, PgLock, PgLock) {
    let base = base_url();
    let relay = Proxy::start_local(port_of(&base)).await;
    let prefix = fresh_prefix();
    let slow = PgLock::connect(&with_prefix(
        &format!("postgres://postgres@127.0.0.1:{}/postgres", relay.port),
        &prefix,
    ))
    .await
    .expect("connect through the proxy");
    slow.try_acquire("warm-up", ttl)
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let direct = PgLock::connect(&with_prefix(&base, &prefix)).await.unwrap();
    (relay, slow, direct)
}

/// A grant whose reply takes 700 ms of a 1 s TTL is never returned (it is below the default
/// minimum validity, half the TTL): the try-once fails with `GrantTooShort` and the lock is
/// free on the server right away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_below_the_minimum_validity_is_given_back() {
    let ttl = Duration::from_secs(1);
    let (relay, slow, direct) = slow_and_direct(ttl).await;
    let before = relay.sent();
    relay.hold_replies(true);
    let acquire = tokio::spawn(async move { slow.try_acquire("slow", ttl).await });
    relay.wait_sent_more_than(before).await;
    // The delay is the point of the test: the reply spends it in the network.
    tokio::time::sleep(Duration::from_millis(700)).await;
    relay.hold_replies(false);
    match acquire.await.unwrap() {
        Err(Error::GrantTooShort {
            remaining,
            min_validity,
            ..
        }) => {
            assert!(remaining < min_validity, "{remaining:?} {min_validity:?}");
        }
        other => panic!("expected GrantTooShort, got {other:?}"),
    }
    let next = direct
        .try_acquire("slow", ttl)
        .await
        .expect("the given-back grant was left on the server");
    next.release().await.unwrap();
}

/// A timed acquire whose grant's reply is held in the network returns `Timeout` on its
/// deadline, and leaves nothing on the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_acquire_times_out_on_time_during_a_slow_round_trip() {
    let ttl = Duration::from_secs(10);
    let (relay, slow, direct) = slow_and_direct(ttl).await;
    relay.hold_replies(true);
    let wait = Duration::from_millis(300);
    let t = Instant::now();
    let res = slow
        .acquire(
            "timed",
            AcquireOptions::new().ttl(ttl).wait(Wait::Timeout(wait)),
        )
        .await;
    let took = t.elapsed();
    assert!(matches!(res, Err(Error::Timeout { .. })), "{res:?}");
    assert!(took < wait + Duration::from_millis(400), "took {took:?}");
    relay.hold_replies(false);
    let next = direct
        .acquire_timeout("timed", ttl, Duration::from_secs(5))
        .await
        .expect("the cut-off acquire left its lock on the server");
    next.release().await.unwrap();
}
