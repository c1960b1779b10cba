//! Redis edge cases of lock-delay and of many clients: a manual renewal acknowledged after the
//! lease's deadline, a lost lease dropped, a waiter polling through a delay, and contention
//! (also while the server kills every connection), checked by a fenced counter.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockkit::redis::RedisLock;
use lockkit::redis::redis;
use lockkit::{AcquireOptions, Error, LeaseState, Lock, Wait};
use tokio::time::Instant;

use super::PrivateRedis;
use crate::common::proxy::Proxy;
use crate::common::{fresh_prefix, server_url, with_prefix};

/// A `keepalive(false)` lease with a lock-delay whose `Lease::renew` reached the server (the
/// key was renewed) but whose reply came only after the lease's client-side deadline: the
/// holder has been told it lost the lock, and may still have writes in flight. The batched
/// renewer gives such a lease back *as lapsed* (keeping the delay, see `give_back_lapsed`);
/// the manual renewal path must do the same: no other client gets the lock during the delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_acknowledged_manual_renewal_keeps_the_lock_delay() {
    let server = PrivateRedis::start(None).await;
    let proxy = Proxy::start_local(server.port).await;
    let prefix = fresh_prefix();
    let holder = RedisLock::connect(&format!("redis://127.0.0.1:{}?prefix={prefix}", proxy.port))
        .await
        .expect("connect through the proxy");
    let other = RedisLock::connect(&format!(
        "redis://127.0.0.1:{}?prefix={prefix}",
        server.port
    ))
    .await
    .expect("connect directly");
    let (ttl, delay) = (Duration::from_millis(1500), Duration::from_secs(20));
    let lease = holder
        .acquire(
            "late-renew",
            AcquireOptions::new()
                .ttl(ttl)
                .keepalive(false)
                .lock_delay(delay)
                .wait(Wait::No),
        )
        .await
        .expect("acquire");
    // Load the renew script, so that the held renewal is one EVALSHA that runs.
    lease.renew().await.expect("first renewal");
    proxy.hold_replies(true);
    let sent = proxy.sent();
    let renewing = {
        let lease = Arc::new(lease);
        let l = lease.clone();
        (lease, tokio::spawn(async move { l.renew().await }))
    };
    proxy.wait_sent_more_than(sent).await;
    // The renewal ran on the server (the key now lives TTL from now); its reply is held until
    // the holder's deadline passed.
    renewing.0.lost().await;
    proxy.hold_replies(false);
    let renewed = renewing.1.await.expect("task");
    assert!(
        matches!(renewed, Err(Error::LeaseLost { .. })),
        "a renewal acknowledged after the deadline: {renewed:?}"
    );
    assert_eq!(renewing.0.state(), LeaseState::Lost);
    // The holder was told it lost the lock without releasing it: the lock-delay applies.
    match other
        .acquire("late-renew", AcquireOptions::new().wait(Wait::No))
        .await
    {
        Err(Error::Held { .. }) => {}
        Ok(l) => panic!(
            "granted (token {}) right after the holder lost its lease: the late renewal's \
             give-back released the lock and deleted its {delay:?} lock-delay",
            l.token()
        ),
        Err(e) => panic!("try-once during the delay: {e:?}"),
    }
}

/// 50 clients (each its own `RedisLock`, so 50 connections) contend on one lock for 20 s with a
/// mix of waits, try-once acquires, cancelled acquires, lapsing holders with a lock-delay and
/// releases: never two holders at once, tokens strictly increase in grant order, and no
/// waiter is stuck (every waited acquire is granted within 15 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_clients_contend_for_twenty_seconds() {
    let url = with_prefix(&server_url("LOCKKIT_REDIS_URL"), &fresh_prefix());
    contend(&url, 50, Duration::from_secs(20), false).await;
}

/// As [`fifty_clients_contend_for_twenty_seconds`] (20 clients, 10 s) on a private server that
/// kills every client connection (commands and pub/sub) every 300 ms: transport errors are
/// allowed, double grants and stuck waiters are not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contention_while_the_server_kills_every_connection() {
    let server = PrivateRedis::start(None).await;
    let url = format!(
        "redis://127.0.0.1:{}?prefix={}",
        server.port,
        fresh_prefix()
    );
    let mut conn = server.raw().await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let killer = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut kills = 0u64;
            while !stop.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(300)).await;
                for t in ["normal", "pubsub"] {
                    let _: redis::RedisResult<i64> = redis::cmd("CLIENT")
                        .arg("KILL")
                        .arg("TYPE")
                        .arg(t)
                        .arg("SKIPME")
                        .arg("yes")
                        .query_async(&mut conn)
                        .await;
                }
                kills += 1;
            }
            kills
        })
    };
    contend(&url, 20, Duration::from_secs(10), true).await;
    stop.store(true, Ordering::Relaxed);
    eprintln!("kill rounds {}", killer.await.expect("killer"));
}

async fn contend(url: &str, clients: usize, secs: Duration, flaky: bool) {
    let name = "contended";
    // (holder client and, for a holder left to lapse, the earliest instant the next grant may
    // come; last token) — a fenced counter kept by the test.
    type Held = Option<(usize, Option<Instant>)>;
    let state: Arc<Mutex<(Held, u64)>> = Arc::new(Mutex::new((None, 0)));
    let grants = Arc::new(AtomicU64::new(0));
    let stats: Arc<Mutex<HashMap<&'static str, u64>>> = Arc::default();
    let until = Instant::now() + secs;
    let mut tasks = Vec::new();
    for c in 0..clients {
        // Where the server kills connections, a connect may be cut too (`Unavailable`): again.
        let mut attempts = 0;
        let locks = loop {
            match RedisLock::connect(url).await {
                Ok(l) => break l,
                Err(e) if flaky && e.is_retryable() && attempts < 20 => attempts += 1,
                Err(e) => panic!("connect: {e:?}"),
            }
        };
        let (state, grants, stats) = (state.clone(), grants.clone(), stats.clone());
        tasks.push(tokio::spawn(async move {
            let mut round = 0u64;
            while Instant::now() < until {
                round += 1;
                let kind = (c as u64 + round) % 10;
                let opts = match kind {
                    0 => AcquireOptions::new()
                        .ttl(Duration::from_secs(5))
                        .wait(Wait::No),
                    // A short wait that may be cancelled by the timeout around it.
                    1 => AcquireOptions::new()
                        .ttl(Duration::from_secs(5))
                        .wait(Wait::Timeout(Duration::from_millis(30))),
                    _ => AcquireOptions::new()
                        .ttl(Duration::from_secs(5))
                        .wait(Wait::Timeout(Duration::from_secs(15))),
                };
                let lapse = kind == 3 && round.is_multiple_of(5);
                let opts = if lapse {
                    opts.ttl(Duration::from_millis(300))
                        .lock_delay(Duration::from_millis(200))
                        .keepalive(false)
                        .release_on_drop(false)
                } else {
                    opts
                };
                let asked = Instant::now();
                let acquired = if kind == 2 {
                    // Cancelled mid-wait by dropping the future.
                    match tokio::time::timeout(Duration::from_millis(5), locks.acquire(name, opts))
                        .await
                    {
                        Ok(r) => r,
                        Err(_) => {
                            *stats.lock().unwrap().entry("cancelled").or_default() += 1;
                            continue;
                        }
                    }
                } else {
                    locks.acquire(name, opts).await
                };
                let lease = match acquired {
                    Ok(l) => l,
                    Err(Error::Held { .. }) => {
                        *stats.lock().unwrap().entry("held").or_default() += 1;
                        continue;
                    }
                    Err(Error::Timeout { .. }) if kind == 1 => {
                        *stats.lock().unwrap().entry("short_timeout").or_default() += 1;
                        continue;
                    }
                    Err(e) if flaky && e.is_retryable() => {
                        *stats.lock().unwrap().entry("transport").or_default() += 1;
                        continue;
                    }
                    Err(e) => panic!("client {c} round {round} kind {kind}: {e:?}"),
                };
                let token = lease.token().get();
                {
                    let mut st = state.lock().unwrap();
                    match st.0 {
                        None => {}
                        Some((_, Some(free_at))) if Instant::now() >= free_at => {}
                        Some(h) => panic!(
                            "double grant: client {c} got token {token} while {h:?} holds \
                             (or its lock-delay runs)"
                        ),
                    }
                    assert!(
                        token > st.1,
                        "token {token} of client {c} not above the last one {}",
                        st.1
                    );
                    let free_at = lapse
                        .then(|| asked + Duration::from_millis(300) + Duration::from_millis(200));
                    *st = (Some((c, free_at)), token);
                }
                grants.fetch_add(1, Ordering::Relaxed);
                if lapse {
                    *stats.lock().unwrap().entry("lapsed").or_default() += 1;
                    drop(lease); // lapses at its TTL, then its lock-delay runs
                    continue;
                }
                tokio::task::yield_now().await;
                if !flaky {
                    assert_eq!(lease.state(), LeaseState::Held, "client {c}'s lease");
                }
                state.lock().unwrap().0 = None;
                match lease.release().await {
                    Ok(()) => {}
                    Err(_) if flaky => {
                        *stats.lock().unwrap().entry("release_failed").or_default() += 1;
                    }
                    Err(e) => panic!("release: {e:?}"),
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("client task");
    }
    let n = grants.load(Ordering::Relaxed);
    eprintln!("grants {n}, others {:?}", stats.lock().unwrap());
    assert!(n > 0);
}

/// A kept-alive lease with a lock-delay whose renewals reach the server but whose replies do
/// not come back (the holder is cut off one way): the client marks it lost at its deadline
/// while the server still holds it (each renewal moved the key's expiry). When the lost lease
/// is then dropped (as `lockkit hold`/`run` do on a lost lease), its release on drop must not
/// free the lock without the lock-delay: the holder failed, and may have writes in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_lease_lost_to_its_deadline_keeps_the_lock_delay() {
    let server = PrivateRedis::start(None).await;
    let proxy = Proxy::start_local(server.port).await;
    let prefix = fresh_prefix();
    let holder = RedisLock::connect(&format!("redis://127.0.0.1:{}?prefix={prefix}", proxy.port))
        .await
        .expect("connect through the proxy");
    let other = RedisLock::connect(&format!(
        "redis://127.0.0.1:{}?prefix={prefix}",
        server.port
    ))
    .await
    .expect("connect directly");
    let mut conn = server.raw().await;
    let (ttl, delay) = (Duration::from_secs(3), Duration::from_secs(20));
    let lease = holder
        .acquire(
            "drop-lost",
            AcquireOptions::new()
                .ttl(ttl)
                .lock_delay(delay)
                .wait(Wait::No),
        )
        .await
        .expect("acquire");
    proxy.hold_replies(true);
    // A renewal that reaches the server (its reply is held): the server's key now outlives the
    // client's deadline, which counts from the last acknowledged renewal.
    let _ = tokio::time::timeout(Duration::from_millis(300), lease.renew()).await;
    lease.lost().await;
    assert!(
        super::exists(&mut conn, &holder.lock_key("drop-lost")).await,
        "the server still holds the lease its renewals extended"
    );
    let delay_key = format!("{prefix}:delay:drop-lost");
    assert!(
        super::exists(&mut conn, &delay_key).await,
        "the delay key is set"
    );
    proxy.hold_replies(false);
    drop(lease);
    // The lock key goes: by the release on drop, or at the end of the last renewal's TTL.
    super::await_exists(
        &mut conn,
        &holder.lock_key("drop-lost"),
        false,
        Duration::from_secs(5),
    )
    .await;
    match other
        .acquire("drop-lost", AcquireOptions::new().wait(Wait::No))
        .await
    {
        Err(Error::Held { .. }) => {}
        Ok(l) => panic!(
            "granted (token {}) right after the holder lost its lease: the release on drop of \
             the lost lease deleted its {delay:?} lock-delay",
            l.token()
        ),
        Err(e) => panic!("try-once during the delay: {e:?}"),
    }
}

/// A waiter during a lock-delay sleeps until the delay ends (or at most every
/// `MAX_WAIT_POLL`, ≈1 s, to keep its place): nothing can be handed over during a delay, so a
/// short TTL of its own is no reason to look more often. Counted on a private server: the
/// acquire scripts a waiter with a 200 ms TTL runs during a 5 s delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_with_a_short_ttl_does_not_poll_through_a_lock_delay() {
    let server = PrivateRedis::start(None).await;
    let prefix = fresh_prefix();
    let url = format!("redis://127.0.0.1:{}?prefix={prefix}", server.port);
    let holder = RedisLock::connect(&url).await.expect("connect");
    let waiter = RedisLock::connect(&url).await.expect("connect");
    let mut conn = server.raw().await;
    let (ttl, delay) = (Duration::from_millis(200), Duration::from_secs(5));
    drop(
        holder
            .acquire(
                "poll",
                AcquireOptions::new()
                    .ttl(ttl)
                    .lock_delay(delay)
                    .keepalive(false)
                    .release_on_drop(false)
                    .wait(Wait::No),
            )
            .await
            .expect("acquire"),
    );
    super::await_exists(
        &mut conn,
        &holder.lock_key("poll"),
        false,
        Duration::from_secs(5),
    )
    .await;
    let () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut conn)
        .await
        .expect("CONFIG RESETSTAT");
    let lease = waiter
        .acquire(
            "poll",
            AcquireOptions::new()
                .ttl(ttl)
                .wait(Wait::Timeout(Duration::from_secs(20))),
        )
        .await
        .expect("granted after the delay");
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await
        .expect("INFO");
    let calls = |cmd: &str| -> u64 {
        info.lines()
            .find_map(|l| l.strip_prefix(&format!("cmdstat_{cmd}:calls=")))
            .and_then(|r| r.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    let scripts = calls("evalsha") + calls("eval");
    lease.release().await.expect("release");
    // 5 s at one look per ≈1 s, plus the first look, the look once subscribed and the grant.
    assert!(
        scripts <= 10,
        "{scripts} acquire scripts by one waiter during a {delay:?} lock-delay: it polled at \
         its TTL / 4 ({:?}) instead of sleeping until the delay's end",
        ttl / 4
    );
}
