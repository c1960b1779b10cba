//! Redlock over five masters: the contract suite against the shared five nodes
//! (`LOCKKIT_REDLOCK_URL`), one and two nodes down (still works), three down (fails clearly), a
//! node restarted empty during a hold (the delayed restart keeps mutual exclusion), and tokens
//! that strictly increase throughout. Nodes "down" on the shared topology are closed ports; the
//! tests that kill and restart nodes use private `redis-server`s.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use lockkit::redis::redis;
use lockkit::redis::{REDLOCK_BOOT_KEY, RedlockLock};
use lockkit::{AcquireOptions, Error, FencingToken, LeaseState, Lock, LockExt, Wait};

use crate::common::{ServerProcess, free_port, fresh_prefix, server_url, wait_until};

mod contract {
    use crate::common::UrlHarness;
    lockkit::contract_suite!(UrlHarness::from_env("LOCKKIT_REDLOCK_URL"));
}

/// The `host:port` list of the shared Redlock topology.
fn shared_hosts() -> Vec<String> {
    let url = server_url("LOCKKIT_REDLOCK_URL");
    let hosts = url.strip_prefix("redlock://").expect("a redlock:// URL");
    let hosts = hosts.split(['/', '?']).next().unwrap_or(hosts);
    hosts.split(',').map(str::to_owned).collect()
}

/// A Redlock URL over `hosts`, with short timeouts so that a dead node costs little.
fn url_of(hosts: &[String], prefix: &str, extra: &str) -> String {
    format!(
        "redlock://{}?prefix={prefix}&connect_timeout=1s&response_timeout=500ms{extra}",
        hosts.join(",")
    )
}

/// A closed port on loopback: a node that is down (connection refused).
fn dead() -> String {
    format!("127.0.0.1:{}", free_port())
}

fn unavailable_saying(res: &lockkit::Result<impl std::fmt::Debug>, words: &str) {
    match res {
        Err(Error::Unavailable { backend, source }) => {
            assert_eq!(*backend, "redlock");
            let msg = source.to_string();
            assert!(msg.contains(words), "{msg}");
        }
        other => panic!("expected Unavailable ({words}), got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_and_two_nodes_down_still_work_three_down_fail_clearly() {
    let live = shared_hosts();
    assert_eq!(live.len(), 5, "the redlock topology has five nodes");
    let prefix = fresh_prefix();
    let name = "down";
    let ttl = Duration::from_secs(10);
    let mut last: Option<FencingToken> = None;
    for down in 0..=2 {
        let mut hosts = live.clone();
        for h in hosts.iter_mut().take(down) {
            *h = dead();
        }
        let url = url_of(&hosts, &prefix, "");
        let (a, b) = (
            lockkit::connect(&url).await.expect("connect"),
            lockkit::connect(&url).await.expect("connect"),
        );
        let lease = a.try_acquire(name, ttl).await.expect("acquire");
        if let Some(t) = &last {
            assert!(
                lease.token() > *t,
                "{} not above {t} ({down} down)",
                lease.token()
            );
        }
        assert!(matches!(
            b.try_acquire(name, ttl).await,
            Err(Error::Held { .. })
        ));
        lease.renew().await.expect("renew on a majority");
        lease.check().await.expect("check on a majority");
        let info = b.holder(name).await.expect("holder").expect("held");
        assert_eq!(info.token, Some(lease.token()));
        last = Some(lease.token());
        lease.release().await.expect("release");
        let again = b.try_acquire(name, ttl).await.expect("free after release");
        assert!(again.token() > *last.as_ref().unwrap());
        last = Some(again.token());
        again.release().await.expect("release");
    }
    // Three down: connecting fails, saying why.
    let mut hosts = live.clone();
    for h in hosts.iter_mut().take(3) {
        *h = dead();
    }
    let res = RedlockLock::connect(&url_of(&hosts, &prefix, "")).await;
    unavailable_saying(&res, "a majority (3) is needed");
}

/// A private `redis-server` node; with `aof`, its data (the boot marker included) survives a
/// SIGKILL and a restart on the same port.
struct Node {
    proc: ServerProcess,
    port: u16,
    aof: Option<tempfile::TempDir>,
}

impl Node {
    async fn start(aof: bool) -> Self {
        let port = free_port();
        let aof = aof.then(|| tempfile::tempdir().expect("temp dir"));
        let proc = Self::spawn(port, aof.as_ref().map(|d| d.path()));
        let me = Self { proc, port, aof };
        me.wait_ready().await;
        me
    }

    fn spawn(port: u16, aof: Option<&Path>) -> ServerProcess {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut cmd = Command::new("redis-server");
        cmd.args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .args(["--save", "", "--daemonize", "no"]);
        match aof {
            Some(data) => {
                cmd.arg("--dir")
                    .arg(data)
                    .args(["--appendonly", "yes", "--appendfsync", "always"])
            }
            None => cmd
                .arg("--dir")
                .arg(dir.path())
                .args(["--appendonly", "no"]),
        };
        ServerProcess::spawn("redlock-node", dir, cmd)
    }

    async fn wait_ready(&self) {
        let port = self.port.to_string();
        wait_until("private redis-server", Duration::from_secs(10), || {
            Command::new("redis-cli")
                .args(["-p", &port, "ping"])
                .output()
                .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "PONG")
        })
        .await;
    }

    fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn kill(&mut self) {
        self.proc.kill();
    }

    /// Starts the server again on its port: with its data if it keeps an AOF, else empty.
    async fn restart(&mut self) {
        self.proc.kill();
        self.proc = Self::spawn(self.port, self.aof.as_ref().map(|d| d.path()));
        self.wait_ready().await;
    }

    /// Declares the node fresh (no lease can be on it): it votes at once.
    async fn declare_fresh(&self) {
        let mut c = redis::Client::open(format!("redis://{}", self.host()))
            .expect("client")
            .get_multiplexed_async_connection()
            .await
            .expect("raw connection");
        redis::cmd("SET")
            .arg(REDLOCK_BOOT_KEY)
            .arg(0)
            .query_async::<()>(&mut c)
            .await
            .expect("SET boot marker");
    }
}

async fn five(aof: [bool; 5]) -> Vec<Node> {
    let mut nodes = Vec::new();
    for a in aof {
        let n = Node::start(a).await;
        n.declare_fresh().await;
        nodes.push(n);
    }
    nodes
}

fn hosts(nodes: &[Node]) -> Vec<String> {
    nodes.iter().map(Node::host).collect()
}

/// Kleppmann's scenario: A holds on nodes 0–2 only (3 and 4 are down), node 2 restarts without
/// its data, 3 and 4 come back (with theirs). Without the delayed restart, B would get 2, 3
/// and 4, a majority, while A holds. With it, node 2 refuses to vote for one max_ttl, B is
/// refused, A's next renewal finds no majority and A loses the lease; B gets the lock only
/// after that, with a larger token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_restarted_empty_during_a_hold_keeps_mutual_exclusion() {
    let mut nodes = five([false, false, false, true, true]).await;
    let max_ttl = Duration::from_secs(6);
    let url = url_of(&hosts(&nodes), &fresh_prefix(), "&max_ttl=6s");
    let name = "restart";
    nodes[3].kill();
    nodes[4].kill();
    let a = RedlockLock::connect(&url)
        .await
        .expect("connect, 3 of 5 up");
    let ttl = Duration::from_secs(5);
    let manual = AcquireOptions::new()
        .ttl(ttl)
        .wait(Wait::No)
        .keepalive(false);
    let lease = a
        .acquire(name, manual)
        .await
        .expect("A acquires on 3 nodes");
    let t1 = lease.token();
    nodes[2].restart().await; // empty
    nodes[3].restart().await; // with its data
    nodes[4].restart().await;
    let b = RedlockLock::connect(&url).await.expect("connect");
    match b.try_acquire(name, ttl).await {
        Err(Error::Held { .. }) => {}
        other => panic!("B must not get the lock while A holds it: {other:?}"),
    }
    assert_eq!(lease.state(), LeaseState::Held);
    // A's renewal: node 2 lost the key and 3, 4 had no key when A was granted, so no majority
    // (NotHeld once A's client has reconnected to 3 and 4, Unavailable before): never renewed.
    // Unless A's vote to 3 or 4, which is never cancelled and retries its connection within
    // the response timeout, reached it when it came back: then A holds on a majority again
    // (0, 1 and 3 or 4), and B must still be refused.
    match lease.renew().await {
        Err(Error::NotHeld { .. } | Error::Unavailable { .. }) => {}
        Ok(()) => match b.try_acquire(name, ttl).await {
            Err(Error::Held { .. }) => {}
            other => panic!("B must not get the lock while A holds a majority: {other:?}"),
        },
        Err(e) => panic!("A's renewal: {e:?}"),
    }
    // B gets it once node 2's delayed restart ends or A's keys expire, with a larger token.
    let waited = b
        .acquire(
            name,
            AcquireOptions::new()
                .ttl(ttl)
                .wait(Wait::Timeout(max_ttl + Duration::from_secs(10))),
        )
        .await
        .expect("B after A lost");
    assert_eq!(
        lease.state(),
        LeaseState::Lost,
        "B granted while A's lease is valid"
    );
    assert!(waited.token() > t1, "{} not above {t1}", waited.token());
    waited.release().await.expect("release");
}

/// The node side of the delayed restart: a node restarted empty refuses to vote for one
/// max_ttl, then votes; with three nodes down (or refusing) acquires fail with a clear
/// `Unavailable`, a held lease becomes Lost, and tokens still increase afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_down_fail_clearly_and_restarted_nodes_wait_one_max_ttl() {
    let mut nodes = five([false; 5]).await;
    let url = url_of(&hosts(&nodes), &fresh_prefix(), "&max_ttl=3s");
    let name = "three-down";
    let locks = RedlockLock::connect(&url).await.expect("connect");
    let ttl = Duration::from_secs(2);
    let lease = locks.try_acquire(name, ttl).await.expect("acquire");
    let t1 = lease.token();
    for n in &mut nodes[..3] {
        n.kill();
    }
    tokio::time::timeout(ttl * 2, lease.lost())
        .await
        .expect("a lease that cannot be renewed on a majority is lost");
    let res = locks.try_acquire(name, ttl).await;
    unavailable_saying(
        &res,
        "no majority of the 5 redlock nodes can vote: 3 did not answer",
    );
    // The three come back empty: they refuse to vote until their delayed restart ends.
    for n in &mut nodes[..3] {
        n.restart().await;
    }
    let res = locks.try_acquire(name, ttl).await;
    unavailable_saying(&res, "in their delayed restart");
    let lease = locks
        .acquire(
            name,
            AcquireOptions::new()
                .ttl(ttl)
                .wait(Wait::Timeout(Duration::from_secs(10))),
        )
        .await
        .expect("acquire after the delayed restart");
    assert!(lease.token() > t1, "{} not above {t1}", lease.token());
    lease.release().await.expect("release");
}

#[tokio::test]
async fn elections_and_semaphores_are_not_supported() {
    let url = url_of(&shared_hosts(), &fresh_prefix(), "");
    assert!(matches!(
        lockkit::connect_election(&url).await,
        Err(Error::NotSupported { .. })
    ));
    assert!(matches!(
        lockkit::connect_semaphore(&url).await,
        Err(Error::NotSupported { .. })
    ));
    let ttl_too_long = lockkit::connect(&format!("{url}&max_ttl=5s"))
        .await
        .expect("connect")
        .try_acquire("long", Duration::from_secs(6))
        .await;
    assert!(matches!(ttl_too_long, Err(Error::InvalidConfig { .. })));
}

/// `RedisFence` refuses a Redlock lease with a message that says so (not "needs a lease granted
/// by lockkit-redis", which Redlock is).
#[tokio::test]
async fn redis_fence_refuses_a_redlock_lease_saying_why() {
    let url = url_of(&shared_hosts(), &fresh_prefix(), "");
    let lease = lockkit::connect(&url)
        .await
        .expect("connect")
        .try_acquire("fenced", Duration::from_secs(5))
        .await
        .expect("acquire");
    match lockkit::redis::RedisFence::from_lease(&lease) {
        Err(Error::InvalidConfig { reason, .. }) => {
            assert!(reason.contains("Redlock"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    lease.release().await.expect("release");
}
