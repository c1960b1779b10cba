//! The Redis backend: the contract suite against the shared server (`LOCKKIT_REDIS_URL`), bad
//! connects, and Redis-specific failure tests on private `redis-server` processes.

use lockkit::backend::LeaseBackendExt;
use std::process::Command;
use std::time::Duration;

use lockkit::redis::RedisLock;
use lockkit::redis::redis;
use lockkit::{AcquireOptions, Error, Lock, LockExt, Wait};
use tokio::time::Instant;

use crate::common::{ServerProcess, free_port, fresh_prefix, server_url, wait_until, with_prefix};

mod break_modes;
mod break_perf;
mod break_slots;
mod cluster;
mod delay;
mod edge_cases;
mod failures;
mod fence;
mod notify;
mod queue;
mod redlock;
mod sentinel;
mod slots;

mod contract {
    use crate::common::UrlHarness;
    lockkit::contract_suite!(UrlHarness::from_env("LOCKKIT_REDIS_URL"));
}

/// A private `redis-server` without persistence, killed on drop.
struct PrivateRedis {
    proc: ServerProcess,
    port: u16,
    password: Option<&'static str>,
    extra: Vec<String>,
}

impl PrivateRedis {
    async fn start(password: Option<&'static str>) -> Self {
        Self::start_with(password, &[]).await
    }

    /// With `extra` command-line arguments for `redis-server`.
    async fn start_with(password: Option<&'static str>, extra: &[&str]) -> Self {
        let port = free_port();
        let dir = tempfile::tempdir().expect("temp dir");
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let proc = Self::spawn(dir, port, password, &extra);
        let me = Self {
            proc,
            port,
            password,
            extra,
        };
        me.wait_ready().await;
        me
    }

    fn spawn(
        dir: tempfile::TempDir,
        port: u16,
        password: Option<&str>,
        extra: &[String],
    ) -> ServerProcess {
        let mut cmd = Command::new("redis-server");
        cmd.args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .arg("--dir")
            .arg(dir.path())
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .args(extra);
        if let Some(pw) = password {
            cmd.args(["--requirepass", pw]);
        }
        ServerProcess::spawn("redis", dir, cmd)
    }

    /// SIGKILL, then a new server on the same port (with an empty data dir: nothing survives).
    async fn restart(&mut self) {
        self.proc.kill();
        let dir = tempfile::tempdir().expect("temp dir");
        self.proc = Self::spawn(dir, self.port, self.password, &self.extra);
        self.wait_ready().await;
    }

    async fn wait_ready(&self) {
        let port = self.port.to_string();
        let pw = self.password;
        wait_until("private redis-server", Duration::from_secs(10), || {
            let mut c = Command::new("redis-cli");
            c.args(["-p", &port]);
            if let Some(pw) = pw {
                c.args(["--no-auth-warning", "-a", pw]);
            }
            c.arg("ping")
                .output()
                .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "PONG")
        })
        .await;
    }

    fn url(&self) -> String {
        match self.password {
            Some(pw) => format!("redis://:{pw}@127.0.0.1:{}", self.port),
            None => format!("redis://127.0.0.1:{}", self.port),
        }
    }

    /// A plain connection for looking at keys directly.
    async fn raw(&self) -> redis::aio::MultiplexedConnection {
        raw(&self.url()).await
    }

    /// Creates ACL user `app` (password `app-pw`, every key) with `rules` added, and returns a
    /// URL that logs in as it, with a fresh prefix.
    async fn app_user(&self, rules: &[&str]) -> String {
        let mut conn = self.raw().await;
        redis::cmd("ACL")
            .arg(&["SETUSER", "app", "on", ">app-pw", "~*"])
            .arg(rules)
            .query_async::<()>(&mut conn)
            .await
            .expect("ACL SETUSER");
        format!(
            "redis://app:app-pw@127.0.0.1:{}?prefix={}",
            self.port,
            fresh_prefix()
        )
    }
}

async fn raw(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .expect("client")
        .get_multiplexed_async_connection()
        .await
        .expect("raw connection")
}

/// A try-acquire's options (`Wait::No`) for a lease of `ttl` without keepalive: it lapses
/// at `ttl` unless renewed by hand.
fn unkept(ttl: Duration) -> AcquireOptions {
    AcquireOptions::new()
        .ttl(ttl)
        .keepalive(false)
        .wait(Wait::No)
}

/// `CLIENT KILL TYPE pubsub` on `conn`'s server: how many pub/sub connections it closed.
async fn kill_pubsub_connections(conn: &mut redis::aio::MultiplexedConnection) -> i64 {
    redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("pubsub")
        .query_async(conn)
        .await
        .expect("CLIENT KILL")
}

async fn exists(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> bool {
    redis::cmd("EXISTS")
        .arg(key)
        .query_async::<i64>(conn)
        .await
        .expect("EXISTS")
        == 1
}

/// Waits (bounded) until `key` exists or not, as `want`; returns how long it took.
async fn await_exists(
    conn: &mut redis::aio::MultiplexedConnection,
    key: &str,
    want: bool,
    limit: Duration,
) -> Duration {
    let start = Instant::now();
    while exists(conn, key).await != want {
        assert!(
            start.elapsed() < limit,
            "key {key:?} still {} after {limit:?}",
            if want { "absent" } else { "present" }
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    start.elapsed()
}

/// After a failover that lost grant `lost`: the new grant `new` has the larger token, and `fence`
/// (which took `lost`'s write to "report") takes `new`'s write and refuses a late one of `lost`.
pub fn newer_grant_fences_out_the_lost_one(
    fence: &lockkit::MemoryFence<&'static str>,
    lost: &lockkit::Lease,
    new: &lockkit::Lease,
) {
    assert!(
        new.token() > lost.token(),
        "the new grant's {:?} is not above the lost grant's {:?}",
        new.token(),
        lost.token()
    );
    fence.write("report", new.token(), "new").unwrap();
    assert!(matches!(
        fence.write("report", lost.token(), "stale"),
        Err(Error::StaleToken { .. })
    ));
}

fn fast(start: Instant, what: &str) {
    let took = start.elapsed();
    assert!(took < Duration::from_secs(3), "{what} took {took:?}");
}

// ---- bad connects ----

#[tokio::test]
async fn malformed_urls_are_invalid_config() {
    let good = server_url("LOCKKIT_REDIS_URL");
    for url in [
        "redis://".to_owned(),
        "redis://127.0.0.1:notaport".to_owned(),
        "redis://127.0.0.1:6379/notadb".to_owned(),
        with_prefix(&good, ""),
        with_prefix(&good, "has:colon"),
        format!("{good}?connect_timeout_ms=0"),
    ] {
        let start = Instant::now();
        match lockkit::connect(&url).await {
            Err(Error::InvalidConfig { .. }) => {}
            other => panic!("{url:?}: expected InvalidConfig, got {other:?}"),
        }
        fast(start, &url);
    }
}

#[tokio::test]
async fn unreachable_server_is_unavailable_quickly() {
    let port = free_port(); // nothing listens there
    let start = Instant::now();
    match lockkit::connect(&format!("redis://127.0.0.1:{port}")).await {
        Err(e @ Error::Unavailable { .. }) => assert!(e.is_retryable()),
        other => panic!("expected Unavailable, got {other:?}"),
    }
    fast(start, "connect to a closed port");
}

/// A URL that names an HTTP server (or any service that is not Redis): `Unavailable`, saying that
/// the server does not speak Redis (it used to be a `Backend` "Incompatible type - Parse error").
#[tokio::test]
async fn http_server_is_unavailable_not_redis() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let http = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((mut sock, _)) = listener.accept().await {
            let mut buf = [0u8; 1024];
            if sock.read(&mut buf).await.unwrap_or(0) > 0 {
                let _ = sock
                    .write_all(
                        b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/html\r\n\
                          Content-Length: 13\r\n\r\n<html></html>",
                    )
                    .await;
            }
            held.push(sock);
        }
    });
    let url = format!("redis://127.0.0.1:{port}?connect_timeout_ms=2000");
    match lockkit::connect(&url).await {
        Err(e @ Error::Unavailable { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("does not speak the Redis protocol"), "{msg}");
            assert!(!msg.contains('\n'), "one line: {msg:?}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    http.abort();
}

#[tokio::test]
async fn silent_server_times_out_as_unavailable() {
    // Accepts TCP connections and never answers: the connect timeout must end the wait.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let start = Instant::now();
    let url = format!("redis://127.0.0.1:{port}?connect_timeout_ms=300&response_timeout_ms=300");
    match lockkit::connect(&url).await {
        Err(Error::Unavailable { .. }) => {}
        other => panic!("expected Unavailable, got {other:?}"),
    }
    fast(start, "connect to a silent server");
    drop(listener);
}

#[tokio::test]
async fn wrong_or_missing_password_is_auth_and_right_one_works() {
    let server = PrivateRedis::start(Some("correct-horse")).await;
    for url in [
        format!("redis://:wrong-password@127.0.0.1:{}", server.port),
        format!("redis://127.0.0.1:{}", server.port),
        format!("redis://nobody:correct-horse@127.0.0.1:{}", server.port),
    ] {
        let start = Instant::now();
        match lockkit::connect(&url).await {
            Err(e @ Error::Auth { .. }) => {
                let shown = format!("{e} {e:?}");
                assert!(
                    !shown.contains("wrong-password"),
                    "password leaked: {shown}"
                );
            }
            other => panic!("{url}: expected Auth, got {other:?}"),
        }
        fast(start, "connect with bad credentials");
    }
    // A password for a server that has none: Auth, and the message says it may be that.
    let none = PrivateRedis::start(None).await;
    match lockkit::connect(&format!("redis://:extra-pw@127.0.0.1:{}", none.port)).await {
        Err(e @ Error::Auth { .. }) => {
            let shown = format!("{e} {e:?}");
            assert!(shown.contains("no password set"), "{shown}");
            assert!(!shown.contains("extra-pw"), "password leaked: {shown}");
        }
        other => panic!("a password for a server without one: expected Auth, got {other:?}"),
    }
    let locks = lockkit::connect(&with_prefix(&server.url(), &fresh_prefix()))
        .await
        .expect("connect with the right password");
    let shown = format!("{locks:?}");
    assert!(
        !shown.contains("correct-horse"),
        "password in Debug: {shown}"
    );
    let lease = locks
        .try_acquire("authed", Duration::from_secs(5))
        .await
        .expect("acquire");
    lease.release().await.expect("release");
}

#[tokio::test]
async fn rediss_to_a_plain_server_fails_cleanly() {
    // The `tls` feature is on: a TLS handshake with a plain-text server must fail fast with a
    // typed error, not hang or panic.
    let url = server_url("LOCKKIT_REDIS_URL").replacen("redis://", "rediss://", 1);
    let url = format!("{url}?connect_timeout_ms=1000&response_timeout_ms=1000");
    let start = Instant::now();
    match lockkit::connect(&url).await {
        Err(Error::Unavailable { .. } | Error::Backend { .. }) => {}
        other => panic!("expected Unavailable or Backend, got {other:?}"),
    }
    fast(start, "rediss to a plain server");
}

/// `rediss://` with a password against a real TLS listener of a private redis-server, with the
/// test certificates `scripts/certs.sh` made at server start (`LOCKKIT_TLS_DIR`: a test CA and
/// a server certificate for 127.0.0.1 signed by it): verified through `tls_ca_file` (the old
/// spelling of `tls_ca`), accepted unverified
/// with the redis crate's `#insecure`, rejected against the system's roots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_with_password_over_tls() {
    let tls = std::path::PathBuf::from(server_url("LOCKKIT_TLS_DIR"));
    let (ca, cert, key) = (
        tls.join("ca.pem"),
        tls.join("server.pem"),
        tls.join("server.key"),
    );
    let dir = tempfile::tempdir().expect("temp dir");
    let port = free_port();
    let mut cmd = Command::new("redis-server");
    cmd.args([
        "--bind",
        "127.0.0.1",
        "--port",
        "0",
        "--tls-port",
        &port.to_string(),
    ])
    .arg("--tls-cert-file")
    .arg(&cert)
    .arg("--tls-key-file")
    .arg(&key)
    .args(["--tls-auth-clients", "no", "--requirepass", "tls-secret"])
    .arg("--dir")
    .arg(dir.path())
    .args(["--save", "", "--appendonly", "no", "--daemonize", "no"]);
    let _server = ServerProcess::spawn("redis-tls", dir, cmd);
    let p = port.to_string();
    wait_until("redis-server with TLS", Duration::from_secs(10), || {
        Command::new("redis-cli")
            .args([
                "--tls",
                "--insecure",
                "-p",
                &p,
                "--no-auth-warning",
                "-a",
                "tls-secret",
                "ping",
            ])
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "PONG")
    })
    .await;

    let prefix = fresh_prefix();
    let url = format!("rediss://:tls-secret@127.0.0.1:{port}/?prefix={prefix}#insecure");
    let locks = lockkit::connect(&url).await.expect("connect over TLS");
    let lease = locks
        .try_acquire("tls", Duration::from_secs(5))
        .await
        .expect("acquire over TLS");
    lease.release().await.expect("release over TLS");

    let wrong = format!("rediss://:nope@127.0.0.1:{port}/#insecure");
    match lockkit::connect(&wrong).await {
        Err(Error::Auth { .. }) => {}
        other => panic!("wrong password over TLS: expected Auth, got {other:?}"),
    }
    // Verified against the test CA (the server certificate's SAN is 127.0.0.1).
    let verified = format!(
        "rediss://:tls-secret@127.0.0.1:{port}/?prefix={prefix}&tls_ca_file={}",
        ca.display()
    );
    let locks = lockkit::connect(&verified)
        .await
        .expect("connect over verified TLS");
    let lease = locks
        .try_acquire("tls-verified", Duration::from_secs(5))
        .await
        .expect("acquire over verified TLS");
    lease.release().await.expect("release");
    // Against the system's roots the self-signed certificate is rejected: a typed error, no hang.
    let strict = format!("rediss://:tls-secret@127.0.0.1:{port}/?connect_timeout_ms=2000");
    let start = Instant::now();
    match lockkit::connect(&strict).await {
        Err(Error::Auth { .. }) => {}
        other => panic!("untrusted certificate: expected Auth, got {other:?}"),
    }
    fast(start, "rediss with an untrusted certificate");
}

// ---- Redis-specific behaviour ----

/// Tokens keep increasing after the server restarts with no persistence: the fence counter is
/// gone, and the `TIME` floor carries the order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_increase_across_a_restart_without_persistence() {
    let mut server = PrivateRedis::start(None).await;
    let prefix = fresh_prefix();
    let url = with_prefix(&server.url(), &prefix);
    let locks = RedisLock::connect(&url).await.expect("connect");
    assert!(locks.guarantees().tokens_survive_restart);
    let name = "restart";
    let mut t = None;
    for _ in 0..3 {
        let lease = locks
            .try_acquire(name, Duration::from_secs(10))
            .await
            .expect("acquire");
        assert!(t.is_none_or(|t| lease.token() > t));
        t = Some(lease.token());
        lease.release().await.expect("release");
    }
    let t = t.expect("a token");

    server.restart().await;
    let mut conn = server.raw().await;
    assert!(
        !exists(&mut conn, &locks.fence_key(name)).await,
        "the fence counter survived the restart: the test proves nothing"
    );
    let (secs, micros): (u64, u64) = redis::cmd("TIME")
        .query_async(&mut conn)
        .await
        .expect("TIME");
    let now_us = secs * 1_000_000 + micros;
    // The same client (its connection reconnects) and a brand-new one.
    let again = locks
        .acquire(
            name,
            AcquireOptions::new()
                .ttl(Duration::from_secs(10))
                .wait(Wait::Timeout(Duration::from_secs(10))),
        )
        .await
        .expect("acquire after restart");
    assert!(
        again.token() > t,
        "token {} after restart is not above {t}",
        again.token()
    );
    assert!(
        again.token().get() >= now_us,
        "token {} is below the server's TIME {now_us} µs: not floored",
        again.token()
    );
    let t2 = again.token();
    again.release().await.expect("release");
    let fresh = RedisLock::connect(&url).await.expect("connect");
    let third = fresh
        .try_acquire(name, Duration::from_secs(10))
        .await
        .expect("acquire");
    assert!(third.token() > t2);
    third.release().await.expect("release");
}

/// An acquire dropped after its script was sent but before the reply leaves no lock behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_in_flight_acquire_leaves_no_lock() {
    let server = PrivateRedis::start(None).await;
    let prefix = fresh_prefix();
    let locks = RedisLock::connect(&with_prefix(&server.url(), &prefix))
        .await
        .expect("connect");
    let name = "in-flight";
    let ttl = Duration::from_secs(60);
    // Load the scripts first, so the stalled acquire is a single EVALSHA.
    locks
        .try_acquire("warm-up", ttl)
        .await
        .expect("warm-up")
        .release()
        .await
        .expect("release");

    server.proc.signal("STOP");
    let pending = locks.try_acquire(name, ttl);
    // The server is stopped: the request goes out, no reply can come.
    let r = tokio::time::timeout(Duration::from_millis(300), pending).await;
    assert!(r.is_err(), "acquire returned while the server was stopped");
    // (the future is dropped here, with its script sent)
    server.proc.signal("CONT");

    let mut conn = server.raw().await;
    // The acquire script did run (it bumped the fence counter)…
    await_exists(
        &mut conn,
        &locks.fence_key(name),
        true,
        Duration::from_secs(5),
    )
    .await;
    // …and the drop guard's compare-and-delete removed the lock long before its 60 s TTL.
    await_exists(
        &mut conn,
        &locks.lock_key(name),
        false,
        Duration::from_secs(5),
    )
    .await;
    let left: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:lock:*"))
        .query_async(&mut conn)
        .await
        .expect("KEYS");
    assert!(left.is_empty(), "lock keys left behind: {left:?}");
    let lease = locks
        .try_acquire(name, ttl)
        .await
        .expect("the lock is free again");
    lease.release().await.expect("release");
}

fn evalsha_calls(info: &str) -> u64 {
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// A queued waiter is handed the lock by the release (one PUBLISH on the waiter's client
/// channel), long before the holder's TTL and before its own fallback poll (~1 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_is_woken_by_the_release_message() {
    // A private server, so the command counters below count only this test's commands.
    let server = PrivateRedis::start(None).await;
    let url = with_prefix(&server.url(), &fresh_prefix());
    let holder = RedisLock::connect(&url).await.expect("connect");
    let waiter = RedisLock::connect(&url).await.expect("connect");
    let channel = waiter.waiter_channel().to_owned();
    let name = "wake";
    let lease = holder
        .acquire(name, unkept(Duration::from_secs(30)))
        .await
        .expect("acquire");
    let conn = server.raw().await;
    let info = || {
        let mut c = conn.clone();
        async move {
            redis::cmd("INFO")
                .arg("commandstats")
                .query_async::<String>(&mut c)
                .await
                .expect("INFO")
        }
    };
    let before = evalsha_calls(&info().await);
    let waiting = tokio::spawn(async move {
        let l = waiter
            .acquire(
                name,
                AcquireOptions::new()
                    .ttl(Duration::from_secs(30))
                    .wait(Wait::Timeout(Duration::from_secs(20))),
            )
            .await;
        (Instant::now(), l)
    });
    // The waiter has subscribed to its client's channel and then tried again, queued (two
    // acquire scripts): it is asleep now.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let subs: (String, i64) = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(&channel)
            .query_async(&mut conn.clone())
            .await
            .expect("NUMSUB");
        if subs.1 >= 1 && evalsha_calls(&info().await) >= before + 2 {
            break;
        }
        assert!(Instant::now() < deadline, "the waiter never subscribed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let released = Instant::now();
    lease.release().await.expect("release");
    let (granted, l) = waiting.await.expect("waiter task");
    let l = l.expect("the waiter got the lock");
    let took = granted - released;
    assert!(
        took < Duration::from_millis(600),
        "the waiter needed {took:?} after the release: not woken by the release message"
    );
    l.release().await.expect("release");
}

/// When the waiters' pub/sub connection is killed, a waiter subscribes again on a new one and is
/// still handed the lock by the next release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_resubscribes_after_its_pubsub_connection_dies() {
    let server = PrivateRedis::start(None).await;
    let url = with_prefix(&server.url(), &fresh_prefix());
    let holder = RedisLock::connect(&url).await.expect("connect");
    let waiter = RedisLock::connect(&url).await.expect("connect");
    let channel = waiter.waiter_channel().to_owned();
    let name = "resubscribe";
    let lease = holder
        .acquire(name, unkept(Duration::from_secs(30)))
        .await
        .expect("acquire");
    let waiting = tokio::spawn(async move {
        let l = waiter
            .acquire(
                name,
                AcquireOptions::new()
                    .ttl(Duration::from_secs(30))
                    .wait(Wait::Timeout(Duration::from_secs(20))),
            )
            .await;
        (Instant::now(), l)
    });
    let conn = server.raw().await;
    let numsub = |mut c: redis::aio::MultiplexedConnection, ch: String| async move {
        let r: (String, i64) = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(ch)
            .query_async(&mut c)
            .await
            .expect("NUMSUB");
        r.1
    };
    let until_subscribed = |what: &'static str| {
        let (conn, channel) = (conn.clone(), channel.clone());
        async move {
            let deadline = Instant::now() + Duration::from_secs(10);
            while numsub(conn.clone(), channel.clone()).await < 1 {
                assert!(Instant::now() < deadline, "{what}");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    until_subscribed("the waiter never subscribed").await;
    let killed = kill_pubsub_connections(&mut conn.clone()).await;
    // The holder's too: both keep one up for keyspace notifications.
    assert!(
        killed >= 1,
        "expected to kill the waiter's pub/sub connection"
    );
    until_subscribed("the waiter did not subscribe again").await;
    // It subscribed again and then looks at the lock once more before sleeping; whether the
    // release lands before or after that look, the waiter must get the lock promptly.
    let released = Instant::now();
    lease.release().await.expect("release");
    let (granted, l) = waiting.await.expect("waiter task");
    let l = l.expect("the waiter got the lock");
    let took = granted - released;
    assert!(
        took < Duration::from_millis(600),
        "the waiter needed {took:?} after the release"
    );
    l.release().await.expect("release");
}

/// Renewing a lease whose key expired fails with NotHeld and does not re-create the key.
#[tokio::test]
async fn renew_after_expiry_is_not_held_and_does_not_retake() {
    let url = with_prefix(&server_url("LOCKKIT_REDIS_URL"), &fresh_prefix());
    let locks = RedisLock::connect(&url).await.expect("connect");
    let ttl = Duration::from_millis(200);
    let lease = locks.acquire("expire", unkept(ttl)).await.expect("acquire");
    let mut conn = raw(&url).await;
    let key = locks.lock_key("expire");
    assert!(exists(&mut conn, &key).await);
    tokio::time::sleep(ttl + Duration::from_millis(100)).await; // let the TTL pass
    match lease.ops().renew(Duration::from_secs(30)).await {
        Err(Error::NotHeld { name }) => assert_eq!(name, "expire"),
        other => panic!("renew of an expired lease: {other:?}"),
    }
    assert!(!exists(&mut conn, &key).await, "renew re-took the lock");
    match lease.renew().await {
        Err(Error::LeaseLost { .. } | Error::NotHeld { .. }) => {}
        other => panic!("{other:?}"),
    }
    assert!(!exists(&mut conn, &key).await, "renew re-took the lock");
}

/// A fence counter that is not a number fails the acquire with a Backend error, and the lock is
/// not taken (the script checks the counter before it writes anything).
#[tokio::test]
async fn corrupt_fence_counter_is_a_backend_error_and_takes_nothing() {
    let url = with_prefix(&server_url("LOCKKIT_REDIS_URL"), &fresh_prefix());
    let locks = RedisLock::connect(&url).await.expect("connect");
    let mut conn = raw(&url).await;
    let name = "corrupt";
    redis::cmd("SET")
        .arg(locks.fence_key(name))
        .arg("not a number")
        .query_async::<()>(&mut conn)
        .await
        .expect("SET");
    match locks.try_acquire(name, Duration::from_secs(10)).await {
        Err(Error::Backend { .. }) => {}
        other => panic!("expected Backend, got {other:?}"),
    }
    assert!(
        !exists(&mut conn, &locks.lock_key(name)).await,
        "lock taken"
    );
    let counter: String = redis::cmd("GET")
        .arg(locks.fence_key(name))
        .query_async(&mut conn)
        .await
        .expect("GET");
    assert_eq!(
        counter, "not a number",
        "the failed bump changed the counter"
    );
}

/// A fence counter that is *older* than the last token (a snapshot restored after a restart, a
/// promoted replica that missed the last grants) does not make tokens repeat: every grant
/// floors the token at the server's `TIME` in µs, not only a grant that finds no counter.
#[tokio::test]
async fn an_old_fence_counter_does_not_repeat_tokens() {
    let url = with_prefix(&server_url("LOCKKIT_REDIS_URL"), &fresh_prefix());
    let locks = RedisLock::connect(&url).await.expect("connect");
    let mut conn = raw(&url).await;
    let name = "old-counter";
    let mut last = None;
    for _ in 0..3 {
        let lease = locks
            .try_acquire(name, Duration::from_secs(10))
            .await
            .expect("acquire");
        let t = lease.token().get();
        assert!(last.is_none_or(|l| t > l), "token {t} not above {last:?}");
        lease.release().await.expect("release");
        // Back to a counter of long ago, as a restored snapshot would have it.
        redis::cmd("SET")
            .arg(locks.fence_key(name))
            .arg(t - 1_000_000)
            .query_async::<()>(&mut conn)
            .await
            .expect("SET");
        last = Some(t);
    }
}

/// Unusual names map to their own keys under the prefix, verbatim.
#[tokio::test]
async fn names_map_verbatim_under_the_prefix() {
    let prefix = fresh_prefix();
    let url = with_prefix(&server_url("LOCKKIT_REDIS_URL"), &prefix);
    let locks = RedisLock::connect(&url).await.expect("connect");
    let mut conn = raw(&url).await;
    let names = ["a", "a:lock:b", "*", "[x]?", "ünï cödé", "fence:a"];
    let mut leases = Vec::new();
    for n in names {
        leases.push(
            locks
                .try_acquire(n, Duration::from_secs(10))
                .await
                .unwrap_or_else(|e| panic!("{n:?}: {e}")),
        );
        let key = format!("{prefix}:lock:{n}");
        assert_eq!(locks.lock_key(n), key);
        assert!(exists(&mut conn, &key).await, "{key:?} missing");
    }
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:lock:*"))
        .query_async(&mut conn)
        .await
        .expect("KEYS");
    assert_eq!(keys.len(), names.len(), "{keys:?}");
    for l in leases {
        l.release().await.expect("release");
    }
}

/// How many clients are subscribed to `key`'s keyspace channel (database 0).
pub(super) async fn keyspace_subscribers(
    admin: &mut redis::aio::MultiplexedConnection,
    key: &str,
) -> i64 {
    let (_, n): (String, i64) = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg(format!("__keyspace@0__:{key}"))
        .query_async(admin)
        .await
        .expect("PUBSUB NUMSUB");
    n
}

/// Waits (up to 5 s) until `n` clients are subscribed to `key`'s keyspace channel.
pub(super) async fn until_subscribers(
    admin: &mut redis::aio::MultiplexedConnection,
    key: &str,
    n: i64,
) {
    let start = Instant::now();
    while keyspace_subscribers(admin, key).await != n {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{key}: its keyspace channel never had {n} subscribers"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// An unrelated client subscribed to every channel by pattern (`PSUBSCRIBE *`, as an operator's
/// `redis-cli` or a monitoring tool may be), for as long as the returned connection lives:
/// `PUBLISH` counts it for any channel, a dead waiter's too.
async fn subscriber_to_every_channel(url: &str) -> redis::aio::PubSub {
    let mut p = redis::Client::open(url)
        .expect("client")
        .get_async_pubsub()
        .await
        .expect("pub/sub connection");
    p.psubscribe("*").await.expect("PSUBSCRIBE");
    p
}

/// Plants what a killed client's queued waiter leaves under `prefix`: the ID `ghost` first in
/// `queue` (scores are the server's TIME in µs) and its waiter key `"30000 0 CHANNEL"` (a 30 s
/// lease, no lock-delay) on a channel nobody subscribes to. Returns the waiter key.
async fn plant_ghost_waiter(
    conn: &mut redis::aio::MultiplexedConnection,
    prefix: &str,
    queue: &str,
) -> String {
    let ghost_key = format!("{prefix}:waiter:ghost");
    let _: () = redis::pipe()
        .cmd("ZADD")
        .arg(queue)
        .arg(1)
        .arg("ghost")
        .ignore()
        .cmd("SET")
        .arg(&ghost_key)
        .arg(format!("30000 0 {prefix}:client:ghost"))
        .arg("PX")
        .arg(60_000)
        .ignore()
        .query_async(conn)
        .await
        .expect("ZADD + SET");
    ghost_key
}
