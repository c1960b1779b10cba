//! Attacks on the Redis modes of issue #13 — Cluster (`redis+cluster://`), Redlock
//! (`redlock://`) and Sentinel (`redis+sentinel://`) — each asserting what the mode promises
//! (its `guarantees()` and docs/redis-cluster.md, docs/redlock.md): never two holders at once,
//! tokens that strictly increase per name, typed errors without secrets for bad input, nothing
//! left on the servers by a dropped acquire, and a lease that is Lost by its deadline once the
//! servers that hold it stop answering.

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use lockkit::redis::REDLOCK_BOOT_KEY;
use lockkit::redis::{RedisLock, redis};
use lockkit::{AcquireOptions, Error, LeaseState, Lock, LockExt, Wait};
use tokio::time::Instant;

use super::cluster::{PrivateCluster, owner, slot_of};
use super::unkept;
use crate::common::proxy::Proxy;
use crate::common::{ServerProcess, free_port, fresh_prefix, server_url, wait_until, with_prefix};

/// The `host:port` list of a multi-host URL in env var `var`.
fn hosts_of(var: &str) -> Vec<String> {
    let url = server_url(var);
    let rest = url.split_once("://").expect("a URL").1;
    let hosts = rest.split(['/', '?']).next().unwrap_or(rest);
    hosts.split(',').map(str::to_owned).collect()
}

/// A Redlock URL over `hosts` with short timeouts.
fn redlock_url(hosts: &[String], prefix: &str) -> String {
    format!(
        "redlock://{}?prefix={prefix}&connect_timeout=1s&response_timeout=500ms",
        hosts.join(",")
    )
}

async fn raw(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .expect("client")
        .get_multiplexed_async_connection()
        .await
        .expect("raw connection")
}

/// Every key of node `host` matching `pattern`.
async fn keys_on(host: &str, pattern: &str) -> Vec<String> {
    let mut c = raw(&format!("redis://{host}")).await;
    redis::cmd("KEYS")
        .arg(pattern)
        .query_async(&mut c)
        .await
        .expect("KEYS")
}

/// Waits (up to 10 s, else fails with `what`) until node `host` has no lock key under `prefix`.
async fn until_no_lock_key(host: &str, prefix: &str, what: &str) {
    let pattern = format!("{prefix}:lock:*");
    let start = Instant::now();
    while !keys_on(host, &pattern).await.is_empty() {
        assert!(start.elapsed() < Duration::from_secs(10), "{host}: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn no_secret(e: &impl std::fmt::Debug, secret: &str) {
    let shown = format!("{e:?}");
    assert!(!shown.contains(secret), "secret {secret:?} shown: {shown}");
}

// ---- many clients on one name ----

/// `clients` clients, each taking `name` `rounds` times (waiting), doing a short critical
/// section: never two inside at once, and the tokens in grant order strictly increase.
async fn contend(url: &str, clients: usize, rounds: usize) {
    let inside = Arc::new(AtomicBool::new(false));
    let tokens = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let locks = lockkit::connect(url).await.expect("connect");
        let (inside, tokens) = (inside.clone(), tokens.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..rounds {
                let lease = locks
                    .acquire(
                        "contended",
                        AcquireOptions::new()
                            .ttl(Duration::from_secs(10))
                            .wait(Wait::Timeout(Duration::from_secs(30))),
                    )
                    .await
                    .expect("acquire");
                assert!(
                    !inside.swap(true, Ordering::SeqCst),
                    "two holders at once (token {})",
                    lease.token()
                );
                tokens.lock().unwrap().push(lease.token().get());
                tokio::task::yield_now().await;
                inside.store(false, Ordering::SeqCst);
                lease.release().await.expect("release");
            }
        }));
    }
    for t in tasks {
        t.await.expect("client task");
    }
    let tokens = tokens.lock().unwrap();
    assert_eq!(tokens.len(), clients * rounds);
    for w in tokens.windows(2) {
        assert!(w[1] > w[0], "token {} after {}: not increasing", w[1], w[0]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_many_clients_one_name_one_holder_increasing_tokens() {
    let url = with_prefix(&server_url("LOCKKIT_REDIS_CLUSTER_URL"), &fresh_prefix());
    contend(&url, 6, 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_many_clients_one_name_one_holder_increasing_tokens() {
    let url = redlock_url(&hosts_of("LOCKKIT_REDLOCK_URL"), &fresh_prefix());
    contend(&url, 6, 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_many_clients_one_name_one_holder_increasing_tokens() {
    let url = with_prefix(&server_url("LOCKKIT_REDIS_SENTINEL_URL"), &fresh_prefix());
    contend(&url, 6, 5).await;
}

// ---- what each mode declares ----

/// Cluster mode refuses elections and semaphores (docs/redis-cluster.md): connecting to them
/// says so at once, so `lockkit guarantees` does not list them as offered.
#[tokio::test]
async fn cluster_url_does_not_offer_elections_or_semaphores() {
    let url = with_prefix(&server_url("LOCKKIT_REDIS_CLUSTER_URL"), &fresh_prefix());
    match lockkit::connect_election(&url).await {
        Err(Error::NotSupported { .. }) => {}
        Err(e) => panic!("connect_election on a cluster: {e:?}"),
        Ok(_) => panic!("connect_election on a cluster URL succeeded"),
    }
    match lockkit::connect_semaphore(&url).await {
        Err(Error::NotSupported { .. }) => {}
        Err(e) => panic!("connect_semaphore on a cluster: {e:?}"),
        Ok(_) => panic!("connect_semaphore on a cluster URL succeeded"),
    }
}

// ---- bad input ----

/// Names that look like hash tags map to one slot each and do not collide with other names;
/// names that are too long or carry NUL are refused as InvalidName before any key is made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_hash_tag_lookalike_names() {
    let prefix = fresh_prefix();
    let url = with_prefix(&server_url("LOCKKIT_REDIS_CLUSTER_URL"), &prefix);
    let a = RedisLock::connect(&url).await.expect("connect");
    let b = RedisLock::connect(&url).await.expect("connect");
    let names = [
        "{", "}", "{}", "}{", "{=", "{=}", "=}", "a}b", "a}c", "a", "{a}", "{=a}", "x{y}z", "}}}",
        "{{{",
    ];
    let mut leases = Vec::new();
    for n in names {
        let l = a
            .try_acquire(n, Duration::from_secs(10))
            .await
            .unwrap_or_else(|e| panic!("{n:?}: {e}"));
        // Held for everyone else, under exactly this name.
        match b.try_acquire(n, Duration::from_secs(10)).await {
            Err(Error::Held { .. }) => {}
            other => panic!("{n:?} granted twice: {other:?}"),
        }
        let info = b.holder(n).await.expect("holder").expect("held");
        assert_eq!(info.token, Some(l.token()), "{n:?}");
        leases.push(l);
    }
    // One waiter queued on a look-alike name is served when it is released.
    let first = leases.remove(0);
    let waiter = tokio::spawn({
        let b = b.clone();
        async move {
            b.acquire(
                "{",
                AcquireOptions::new()
                    .ttl(Duration::from_secs(10))
                    .wait(Wait::Timeout(Duration::from_secs(10))),
            )
            .await
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    first.release().await.expect("release");
    let got = waiter.await.expect("task").expect("the waiter got `{`");
    got.release().await.expect("release");
    for l in leases {
        l.check().await.expect("still held");
        l.release().await.expect("release");
    }
    for bad in ["a\0b".to_owned(), "x".repeat(4096), "{".repeat(4096)] {
        match a.try_acquire(&bad, Duration::from_secs(10)).await {
            Err(Error::InvalidName { name, .. }) => assert!(name.len() <= 256),
            other => panic!("{} bytes: {other:?}", bad.len()),
        }
    }
}

/// Bad URLs for each mode are typed errors, fast, and never echo the password.
#[tokio::test]
async fn bad_mode_urls_are_typed_errors_without_secrets() {
    let rl = hosts_of("LOCKKIT_REDLOCK_URL");
    let bad = [
        "redis+cluster://:hunter2@".to_owned(),
        "redis+cluster://:hunter2@127.0.0.1:notaport".to_owned(),
        "redis+cluster://:hunter2@127.0.0.1:99999".to_owned(),
        "redis+cluster://:hunter2@127.0.0.1:0".to_owned(),
        "redis+sentinel://:hunter2@/svc".to_owned(),
        "redis+sentinel://:hunter2@127.0.0.1:1".to_owned(),
        "redis+sentinel://:hunter2@127.0.0.1:notaport/svc".to_owned(),
        "redlock://:hunter2@".to_owned(),
        format!("redlock://:hunter2@{},{},{}", rl[0], rl[1], rl[0]),
        format!(
            "redlock://:hunter2@{},{},{}:65536",
            rl[0], rl[1], "127.0.0.1"
        ),
        format!("redlock://:hunter2@{},{}", rl[0], rl[1]),
    ];
    for url in bad {
        let start = Instant::now();
        match lockkit::connect(&url).await {
            Err(e @ Error::InvalidConfig { .. }) => no_secret(&e, "hunter2"),
            other => panic!("{url}: expected InvalidConfig, got {other:?}"),
        }
        assert!(start.elapsed() < Duration::from_secs(3), "{url} was slow");
    }
}

/// A password the servers do not have (they have none: Redis refuses an `AUTH` then) is
/// [`Error::Auth`] on every mode — not a retryable `Unavailable` — fast, and the password is in
/// no error.
#[tokio::test]
async fn wrong_passwords_on_every_mode_are_auth_without_the_secret() {
    let cl = server_url("LOCKKIT_REDIS_CLUSTER_URL").replacen("://", "://:hunter2@", 1);
    let se = server_url("LOCKKIT_REDIS_SENTINEL_URL").replacen("://", "://:hunter2@", 1);
    let rl = server_url("LOCKKIT_REDLOCK_URL").replacen("://", "://:hunter2@", 1);
    for url in [cl, se, rl] {
        let url = format!("{url}?connect_timeout=2s");
        let start = Instant::now();
        match lockkit::connect(&url).await {
            Err(e @ Error::Auth { .. }) => {
                no_secret(&e, "hunter2");
                assert!(!e.to_string().contains("hunter2"), "{e}");
                assert!(!e.is_retryable(), "{e:?}");
            }
            other => panic!("{url}: expected Auth, got {other:?}"),
        }
        assert!(start.elapsed() < Duration::from_secs(5), "{url} was slow");
    }
}

// ---- Redlock node identity ----

/// One server reached under two names (here a TCP proxy in front of it; a DNS alias or a load
/// balancer does the same) would vote twice: two real servers would be a "majority" of three.
/// Connecting refuses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_refuses_one_server_reached_under_two_names() {
    let rl = hosts_of("LOCKKIT_REDLOCK_URL");
    let alias = Proxy::start(rl[0].clone()).await;
    let hosts = vec![rl[0].clone(), alias.endpoint(), rl[1].clone()];
    match lockkit::connect(&redlock_url(&hosts, &fresh_prefix())).await {
        Err(Error::InvalidConfig { reason, .. }) => {
            assert!(reason.contains("same"), "{reason}")
        }
        Err(e) => panic!("expected InvalidConfig, got {e:?}"),
        Ok(_) => panic!("a server reached under two names was taken as two redlock nodes"),
    }
}

/// Four nodes need three (N/2 + 1): one down still works, two down fail clearly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_four_nodes_need_three() {
    let rl = hosts_of("LOCKKIT_REDLOCK_URL");
    let dead = || format!("127.0.0.1:{}", free_port());
    let prefix = fresh_prefix();
    let one_down = vec![rl[0].clone(), rl[1].clone(), rl[2].clone(), dead()];
    let locks = lockkit::connect(&redlock_url(&one_down, &prefix))
        .await
        .expect("connect with one of four down");
    let lease = locks
        .try_acquire("even", Duration::from_secs(5))
        .await
        .expect("acquire with three of four");
    lease.release().await.expect("release");
    let two_down = vec![rl[0].clone(), rl[1].clone(), dead(), dead()];
    match lockkit::connect(&redlock_url(&two_down, &prefix)).await {
        Err(Error::Unavailable { source, .. }) => {
            assert!(source.to_string().contains("(3)"), "{source}")
        }
        other => panic!("two of four down: expected Unavailable, got {other:?}"),
    }
}

// ---- cancellation ----

/// A Redlock acquire dropped while its votes are on the nodes (they took effect, the replies
/// are held in the network) leaves no lock key on any node: the give-back runs in the
/// background.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_dropped_acquire_leaves_no_key_on_any_node() {
    let rl = hosts_of("LOCKKIT_REDLOCK_URL");
    let mut proxies = Vec::new();
    for h in &rl {
        proxies.push(Proxy::start(h.clone()).await);
    }
    let hosts: Vec<String> = proxies.iter().map(Proxy::endpoint).collect();
    let prefix = fresh_prefix();
    let url = format!(
        "redlock://{}?prefix={prefix}&connect_timeout=1s&response_timeout=2s",
        hosts.join(",")
    );
    let locks = lockkit::connect(&url).await.expect("connect");
    // Warm up: every node's connection open and the scripts loaded.
    locks
        .try_acquire("warm-up", Duration::from_secs(5))
        .await
        .expect("warm-up")
        .release()
        .await
        .expect("release");
    let before: Vec<u64> = proxies.iter().map(Proxy::sent).collect();
    for p in &proxies {
        p.hold_replies(true);
    }
    let pending = tokio::spawn({
        let locks = locks.clone();
        async move { locks.try_acquire("dropped", Duration::from_secs(30)).await }
    });
    for (p, n) in proxies.iter().zip(&before) {
        p.wait_sent_more_than(*n).await;
    }
    // Every vote was sent; the keys are on the nodes now.
    let mut on = 0;
    for h in &rl {
        on += keys_on(h, &format!("{prefix}:lock:*")).await.len();
    }
    assert!(on >= 3, "the votes did not reach a majority ({on})");
    pending.abort();
    assert!(pending.await.is_err_and(|e| e.is_cancelled()));
    for p in &proxies {
        p.hold_replies(false);
    }
    for h in &rl {
        until_no_lock_key(h, &prefix, "a dropped acquire left its key").await;
    }
    // And the name is free at once.
    let l = locks
        .try_acquire("dropped", Duration::from_secs(5))
        .await
        .expect("free after the dropped acquire");
    l.release().await.expect("release");
}

/// `redis-cli -c` on the shared cluster (follows MOVED).
fn cluster_cli(args: &[&str]) -> String {
    let seed = hosts_of("LOCKKIT_REDIS_CLUSTER_URL")[0].clone();
    let port = seed.rsplit(':').next().expect("port").to_owned();
    let out = Command::new("redis-cli")
        .args(["-c", "-p", &port])
        .args(args)
        .output()
        .expect("redis-cli");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A cluster waiter dropped while queued leaves no queue entry behind: the next waiter is
/// served at once on release, and the queue key is gone after the hand-off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_dropped_waiter_leaves_no_queue_entry() {
    let url = with_prefix(&server_url("LOCKKIT_REDIS_CLUSTER_URL"), &fresh_prefix());
    let holder = RedisLock::connect(&url).await.expect("connect");
    let waiter = RedisLock::connect(&url).await.expect("connect");
    let name = "{dropped}";
    let queue = holder.queue_key(name);
    let lease = holder
        .try_acquire(name, Duration::from_secs(30))
        .await
        .expect("acquire");
    let waiting = tokio::spawn({
        let waiter = waiter.clone();
        async move {
            waiter
                .acquire(
                    name,
                    AcquireOptions::new()
                        .ttl(Duration::from_secs(10))
                        .wait(Wait::Timeout(Duration::from_secs(20))),
                )
                .await
        }
    });
    wait_until("the waiter queued", Duration::from_secs(10), || {
        cluster_cli(&["zcard", &queue]) == "1"
    })
    .await;
    waiting.abort();
    let _ = waiting.await;
    wait_until(
        "the dropped waiter left the queue",
        Duration::from_secs(5),
        || cluster_cli(&["zcard", &queue]) == "0",
    )
    .await;
    lease.release().await.expect("release");
    let again = waiter
        .try_acquire(name, Duration::from_secs(5))
        .await
        .expect("free after release");
    again.release().await.expect("release");
    assert_eq!(cluster_cli(&["exists", &queue]), "0");
}

// ---- Redlock nodes stopped during a hold ----

/// Five private redlock nodes, declared fresh.
async fn five_nodes() -> (Vec<ServerProcess>, Vec<String>) {
    let mut procs = Vec::new();
    let mut hosts = Vec::new();
    for i in 0..5 {
        let port = free_port();
        let dir = tempfile::tempdir().expect("temp dir");
        let mut cmd = Command::new("redis-server");
        cmd.args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .arg("--dir")
            .arg(dir.path())
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"]);
        procs.push(ServerProcess::spawn(&format!("redlock-{i}"), dir, cmd));
        let p = port.to_string();
        wait_until("a redlock node", Duration::from_secs(10), || {
            Command::new("redis-cli")
                .args(["-p", &p, "set", REDLOCK_BOOT_KEY, "0"])
                .output()
                .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "OK")
        })
        .await;
        hosts.push(format!("127.0.0.1:{port}"));
    }
    (procs, hosts)
}

/// SIGSTOP of two of five nodes right after the grant of a new client (its connections to the
/// nodes are opened by the vote itself): every node got the vote, not only the fastest
/// majority, so renewals still reach a majority and the lease outlives its TTL. SIGSTOP of a third: the lease is Lost by its deadline (no renewal can reach
/// a majority), never kept Held; after SIGCONT the name is granted again with a larger token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_stopped_minority_keeps_the_lease_stopped_majority_loses_it() {
    let (procs, hosts) = five_nodes().await;
    let prefix = fresh_prefix();
    let url = redlock_url(&hosts, &prefix);
    let a = lockkit::connect(&url).await.expect("connect");
    let ttl = Duration::from_secs(2);
    let lease = a
        .acquire("stopped", AcquireOptions::new().ttl(ttl).wait(Wait::No))
        .await
        .expect("acquire");
    let t = lease.token();
    procs[0].signal("STOP");
    procs[1].signal("STOP");
    tokio::time::sleep(ttl + ttl / 2).await;
    lease.check().await.expect("held on three of five");
    assert_ne!(lease.state(), LeaseState::Lost);
    procs[2].signal("STOP");
    let stopped = Instant::now();
    tokio::time::timeout(ttl + Duration::from_secs(1), lease.lost())
        .await
        .expect("the lease stayed held with a majority of its nodes stopped");
    assert!(stopped.elapsed() <= ttl + Duration::from_secs(1));
    for p in &procs[..3] {
        p.signal("CONT");
    }
    let b = lockkit::connect(&url).await.expect("connect");
    let again = b
        .acquire(
            "stopped",
            AcquireOptions::new()
                .ttl(ttl)
                .wait(Wait::Timeout(Duration::from_secs(10))),
        )
        .await
        .expect("granted after the nodes came back");
    assert!(again.token() > t, "{} not above {t}", again.token());
    again.release().await.expect("release");
}

/// Two of five nodes stopped (SIGSTOP: their connections stay open, they never answer) while
/// a client holds a lock: another client's try-acquire is refused as held once the three
/// others refused, and the holder's release is done once the three others deleted the key,
/// neither held up for the stopped nodes' response timeout (60 s here, beyond the test's
/// bound); the stopped nodes still get their delete, and carry it out once they run again
/// (their key is gone before its 60 s TTL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_refusal_and_release_with_a_stopped_minority_do_not_wait_for_it() {
    let (procs, hosts) = five_nodes().await;
    let prefix = fresh_prefix();
    let url = format!(
        "redlock://{}?prefix={prefix}&response_timeout=60s",
        hosts.join(",")
    );
    let locks = lockkit::connect(&url).await.expect("connect");
    let other = lockkit::connect(&url).await.expect("connect");
    // One round of each client on every node first, done on each: it opens the clients'
    // connections and loads the scripts there. Requests waiting for a connection being opened,
    // or refused as NOSCRIPT (then sent again after a SCRIPT LOAD), may run out of order: a
    // queued delete before the queued vote it was to undo.
    for c in [&locks, &other] {
        let warm = AcquireOptions::new().wait(Wait::No);
        let l = c.acquire("stopped", warm).await.unwrap();
        l.release().await.unwrap();
        for h in &hosts {
            until_no_lock_key(h, &prefix, "the first round's key stayed").await;
        }
    }
    procs[0].signal("STOP");
    procs[1].signal("STOP");
    let lease = locks
        .acquire(
            "stopped",
            AcquireOptions::new()
                .ttl(Duration::from_secs(60))
                .wait(Wait::No),
        )
        .await
        .expect("granted by three of five");
    let refused = tokio::time::timeout(
        Duration::from_secs(20),
        other.acquire("stopped", AcquireOptions::new().wait(Wait::No)),
    )
    .await
    .expect("the refusal waited for the stopped nodes");
    assert!(matches!(refused, Err(Error::Held { .. })), "{refused:?}");
    tokio::time::timeout(Duration::from_secs(20), lease.release())
        .await
        .expect("the release waited for the stopped nodes")
        .expect("released on three of five");
    for p in &procs[..2] {
        p.signal("CONT");
    }
    // Each resumed node runs what its connection queued meanwhile: the vote, then the delete.
    for h in &hosts {
        until_no_lock_key(h, &prefix, "the lock key outlived the release").await;
    }
}

// ---- client restarts ----

/// A client that dies holding a lock (its lease leaked, the client dropped: no release) and a
/// new client started after it: the new one is granted the lock once the TTL ran out, never
/// before, with a larger token.
async fn restart_while_holding(url: &str) {
    let ttl = Duration::from_secs(2);
    let old = lockkit::connect(url).await.expect("connect");
    let lease = old.acquire("restart", unkept(ttl)).await.expect("acquire");
    let (t, until) = (lease.token(), lease.valid_until());
    lease.leak();
    drop(old);
    let new = lockkit::connect(url).await.expect("connect");
    match new.try_acquire("restart", ttl).await {
        Err(Error::Held { .. }) => {}
        other => panic!("granted while the dead client's lease runs: {other:?}"),
    }
    let again = new
        .acquire(
            "restart",
            AcquireOptions::new()
                .ttl(ttl)
                .wait(Wait::Timeout(Duration::from_secs(10))),
        )
        .await
        .expect("granted after the TTL");
    assert!(
        Instant::now() >= until,
        "granted before the old lease's deadline"
    );
    assert!(again.token() > t, "{} not above {t}", again.token());
    again.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_client_restarted_while_holding() {
    restart_while_holding(&with_prefix(
        &server_url("LOCKKIT_REDIS_CLUSTER_URL"),
        &fresh_prefix(),
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_client_restarted_while_holding() {
    restart_while_holding(&redlock_url(
        &hosts_of("LOCKKIT_REDLOCK_URL"),
        &fresh_prefix(),
    ))
    .await;
}

// ---- a Cluster master stopped during a hold ----

/// SIGSTOP of the master that serves a held lock (a private 3-master cluster, no replicas, so
/// no failover): the holder's renewals get no answer and the lease is Lost by its deadline,
/// not kept Held; after SIGCONT the lock is granted again with a larger token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_master_stopped_during_a_hold_loses_the_lease_by_its_deadline() {
    let mut cluster = PrivateCluster::start(false).await;
    let url = format!("{}&response_timeout=500ms", cluster.url(&fresh_prefix()));
    let a = RedisLock::connect(&url).await.expect("connect");
    let ttl = Duration::from_secs(2);
    let name = "stopped-master";
    let lease = a
        .acquire(name, AcquireOptions::new().ttl(ttl).wait(Wait::No))
        .await
        .expect("acquire");
    let t = lease.token();
    let seed = *cluster.ports.first().expect("a node");
    let master = owner(seed, slot_of(seed, &a.lock_key(name))).port;
    cluster.proc(master).signal("STOP");
    let stopped = Instant::now();
    tokio::time::timeout(ttl + Duration::from_secs(1), lease.lost())
        .await
        .expect("the lease stayed Held with its master stopped");
    assert!(stopped.elapsed() <= ttl + Duration::from_secs(1));
    assert_eq!(lease.state(), LeaseState::Lost);
    cluster.proc(master).signal("CONT");
    let b = RedisLock::connect(&url).await.expect("connect");
    let again = b
        .acquire(
            name,
            AcquireOptions::new()
                .ttl(ttl)
                .wait(Wait::Timeout(Duration::from_secs(15))),
        )
        .await
        .expect("granted after the master came back");
    assert!(again.token() > t, "{} not above {t}", again.token());
    again.release().await.expect("release");
}
