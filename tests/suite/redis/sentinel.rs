//! Redis behind Sentinel: the contract suite on the shared topology
//! (`LOCKKIT_REDIS_SENTINEL_URL`, started by `LOCKKIT_SERVERS=sentinel scripts/servers.sh`), and
//! failovers on private topologies (a primary behind a [`Proxy`], a replica and three
//! sentinels), each started by its test and killed with it.
//!
//! The sentinels monitor the primary at the proxy's address, and the replica replicates through
//! it, so the replica's view of its master matches the sentinels' (no `+fix-slave-config`).
//! Freezing the replica's connection through the proxy blocks replication alone: the primary's
//! writes stay "in the network", and a primary killed then takes them with it, as an
//! asynchronous replica that lags behind does in production.

use std::process::Command;
use std::time::Duration;

use futures_util::StreamExt;
use lockkit::backend::SlotKind;
use lockkit::redis::{NotReplicated, RedisLock, redis};
use lockkit::{
    AcquireOptions, Election, Error, LeaseState, Lock, LockExt, LossReason, MemoryFence, Semaphore,
    Wait,
};
use tokio::time::Instant;

use crate::common::proxy::Proxy;
use crate::common::{ServerProcess, free_port, fresh_prefix, wait_until, with_prefix};

mod contract {
    use crate::common::UrlHarness;
    lockkit::contract_suite!(UrlHarness::from_env("LOCKKIT_REDIS_SENTINEL_URL"));
}

/// Elections and semaphores through the sentinels.
mod election_contract {
    use super::super::slots::RedisSlotHarness;
    lockkit::election_suite!(RedisSlotHarness::from_env("LOCKKIT_REDIS_SENTINEL_URL"));
}

/// A private Sentinel topology for service `lockkit`.
struct Topology {
    primary: ServerProcess,
    primary_port: u16,
    replica_port: u16,
    _replica: ServerProcess,
    /// In front of the primary: the address the sentinels, the replica and the clients use.
    link: Proxy,
    /// The replica's connection through the proxy.
    replication: u64,
    sentinel_ports: Vec<u16>,
    _sentinels: Vec<ServerProcess>,
}

fn redis_server(name: &str, port: u16, extra: &[&str]) -> ServerProcess {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut cmd = Command::new("redis-server");
    cmd.args(["--bind", "127.0.0.1", "--port", &port.to_string()])
        .arg("--dir")
        .arg(dir.path())
        .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
        .args(["--repl-diskless-sync-delay", "0"])
        .args(extra);
    ServerProcess::spawn(name, dir, cmd)
}

/// `redis-cli -p PORT [-a PASSWORD] ARGS…`'s output.
fn cli(port: u16, password: Option<&str>, args: &[&str]) -> String {
    let mut cmd = Command::new("redis-cli");
    cmd.args(["-p", &port.to_string()]);
    if let Some(pw) = password {
        cmd.args(["--no-auth-warning", "-a", pw]);
    }
    cmd.args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

impl Topology {
    async fn start() -> Self {
        Self::start_with(None).await
    }

    /// With `auth` = (the master's password, the sentinels' password): the primary and the
    /// replica `requirepass` the first, the sentinels the second.
    async fn start_with(auth: Option<(&str, &str)>) -> Self {
        let (master_pw, sentinel_pw) = auth.unzip();
        let auth_args: Vec<&str> = match master_pw {
            Some(pw) => vec!["--requirepass", pw, "--masterauth", pw],
            None => vec![],
        };
        let primary_port = free_port();
        let primary = redis_server("sentinel-primary", primary_port, &auth_args);
        wait_until("the primary", Duration::from_secs(10), || {
            cli(primary_port, master_pw, &["ping"]).trim() == "PONG"
        })
        .await;
        let link = Proxy::start_local(primary_port).await;
        let replica_port = free_port();
        let link_port = link.port.to_string();
        let mut replica_args = vec!["--replicaof", "127.0.0.1", &link_port];
        replica_args.extend(&auth_args);
        let replica = redis_server("sentinel-replica", replica_port, &replica_args);
        wait_until("the replica's link", Duration::from_secs(10), || {
            cli(replica_port, master_pw, &["info", "replication"]).contains("master_link_status:up")
        })
        .await;
        let replication = link.connections() - 1;
        let master_port = link.port;
        // Sentinels that know each other and the replica from the start (no 10 s of hello
        // messages before a failover can succeed).
        let sentinel_ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let ids: Vec<String> = (0..3)
            .map(|_| format!("{:040x}", rand::random::<u128>()))
            .collect();
        let mut sentinels = Vec::new();
        for (i, port) in sentinel_ports.iter().enumerate() {
            let dir = tempfile::tempdir().expect("temp dir");
            let mut conf = format!(
                "port {port}\nbind 127.0.0.1\ndir {dir}\nsentinel myid {id}\n\
                 sentinel monitor lockkit 127.0.0.1 {master_port} 2\n\
                 sentinel down-after-milliseconds lockkit 500\n\
                 sentinel failover-timeout lockkit 2000\n\
                 sentinel known-replica lockkit 127.0.0.1 {replica_port}\n",
                dir = dir.path().display(),
                id = ids[i],
            );
            if let (Some(m), Some(s)) = (master_pw, sentinel_pw) {
                conf.push_str(&format!(
                    "sentinel auth-pass lockkit {m}\nrequirepass {s}\nsentinel sentinel-pass {s}\n"
                ));
            }
            for (j, other) in sentinel_ports.iter().enumerate() {
                if j != i {
                    conf.push_str(&format!(
                        "sentinel known-sentinel lockkit 127.0.0.1 {other} {}\n",
                        ids[j]
                    ));
                }
            }
            let path = dir.path().join("sentinel.conf");
            std::fs::write(&path, conf).expect("sentinel.conf");
            let mut cmd = Command::new("redis-server");
            cmd.arg(&path).arg("--sentinel");
            sentinels.push(ServerProcess::spawn(&format!("sentinel-{i}"), dir, cmd));
        }
        for port in &sentinel_ports {
            let port = *port;
            wait_until("a sentinel", Duration::from_secs(10), || {
                cli(
                    port,
                    sentinel_pw,
                    &["sentinel", "get-master-addr-by-name", "lockkit"],
                )
                .contains(&master_port.to_string())
            })
            .await;
        }
        Self {
            primary,
            primary_port,
            replica_port,
            _replica: replica,
            link,
            replication,
            sentinel_ports,
            _sentinels: sentinels,
        }
    }

    /// The sentinel URL with a fresh prefix and `params` (`a=b&c=d`, or empty).
    fn url(&self, prefix: &str, params: &str) -> String {
        let hosts: Vec<String> = self
            .sentinel_ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let base = format!("redis+sentinel://{}/lockkit", hosts.join(","));
        let url = with_prefix(&base, prefix);
        if params.is_empty() {
            url
        } else {
            format!("{url}&{params}")
        }
    }

    /// A plain connection to the primary, without a response timeout (for `WAIT`).
    async fn primary_conn(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(format!("redis://127.0.0.1:{}", self.primary_port))
            .expect("client")
            .get_multiplexed_async_connection_with_config(
                &redis::AsyncConnectionConfig::new().set_response_timeout(None),
            )
            .await
            .expect("raw connection")
    }

    /// Waits until the replica acknowledged everything the primary wrote so far.
    async fn replicated(&self) {
        let mut c = self.primary_conn().await;
        let () = redis::cmd("SET")
            .arg("lockkit-test-marker")
            .arg(1)
            .query_async(&mut c)
            .await
            .expect("SET");
        let acked: i64 = redis::cmd("WAIT")
            .arg(1)
            .arg(10_000)
            .query_async(&mut c)
            .await
            .expect("WAIT");
        assert_eq!(acked, 1, "the replica did not acknowledge");
    }

    /// A subscription to `+switch-master` on the first sentinel: made before the kill, awaited
    /// after it.
    async fn switch_watch(&self) -> redis::aio::PubSub {
        let client = redis::Client::open(format!("redis://127.0.0.1:{}", self.sentinel_ports[0]))
            .expect("client");
        let mut p = client.get_async_pubsub().await.expect("pub/sub");
        p.subscribe("+switch-master").await.expect("SUBSCRIBE");
        p
    }

    /// SIGKILLs the primary, then waits for the sentinels to promote the replica; returns the
    /// kill's time.
    async fn fail_over(&mut self) -> Instant {
        let mut watch = self.switch_watch().await;
        let killed = Instant::now();
        self.primary.kill();
        let msg = tokio::time::timeout(Duration::from_secs(20), watch.on_message().next())
            .await
            .expect("no +switch-master within 20 s")
            .expect("sentinel pub/sub closed");
        let payload: String = msg.get_payload().expect("payload");
        assert!(
            payload.ends_with(&format!("127.0.0.1 {}", self.replica_port)),
            "switched to another address: {payload}"
        );
        eprintln!(
            "sentinel: +switch-master {:?} after the kill",
            killed.elapsed()
        );
        killed
    }

    /// Blocks replication: the replica's connection to the primary is frozen (both ways).
    fn block_replication(&self) {
        self.link.freeze_connection(self.replication);
    }

    fn replica_addr(&self) -> String {
        format!("127.0.0.1:{}", self.replica_port)
    }
}

/// Waits (bounded, polling a local state every 10 ms) until `done` holds.
async fn until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "{what}: not after {limit:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn opts() -> AcquireOptions {
    AcquireOptions::new()
        .ttl(Duration::from_secs(10))
        .wait(Wait::No)
}

fn not_replicated(e: &Error) -> Option<&NotReplicated> {
    match e {
        Error::Unavailable { source, .. } => source.downcast_ref::<NotReplicated>(),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_urls_and_a_bad_service_name() {
    let topo = Topology::start().await;
    let locks = RedisLock::connect(&topo.url(&fresh_prefix(), ""))
        .await
        .expect("connect through the sentinels");
    assert_eq!(locks.master_addr(), topo.link.endpoint());
    assert!(locks.guarantees().notes.contains("Sentinel"));
    let facade = lockkit::connect(&topo.url(&fresh_prefix(), ""))
        .await
        .unwrap();
    let lease = facade
        .try_acquire("x", Duration::from_secs(5))
        .await
        .unwrap();
    lease.release().await.unwrap();
    let wrong = topo
        .url(&fresh_prefix(), "")
        .replace("/lockkit?", "/no-such-service?");
    unknown_service_is_invalid_config(&wrong, "no-such-service").await;
}

/// Connecting to a service the sentinels do not monitor fails with `InvalidConfig` that names
/// it (each sentinel's `SENTINEL GET-MASTER-ADDR-BY-NAME` is nil), not as a server that is down.
async fn unknown_service_is_invalid_config(url: &str, service: &str) {
    match RedisLock::connect(url).await {
        Err(Error::InvalidConfig { reason, .. }) => {
            assert!(reason.contains(&format!("{service:?}")), "{reason}")
        }
        other => panic!("an unknown service: {other:?}"),
    }
}

/// On the shared topology (`scripts/servers.sh`: three sentinels of service `lockkit`): a wrong
/// service name is `InvalidConfig`; the same name with none of the sentinels reachable stays
/// `Unavailable` (nobody said the service does not exist), and so does the right name then.
#[tokio::test]
async fn a_wrong_service_name_is_invalid_config_unless_no_sentinel_answers() {
    let url = with_prefix(
        &crate::common::server_url("LOCKKIT_REDIS_SENTINEL_URL"),
        &fresh_prefix(),
    );
    assert!(url.contains("/lockkit?"), "{url}");
    unknown_service_is_invalid_config(&url.replace("/lockkit?", "/lockkit-typo?"), "lockkit-typo")
        .await;
    let nobody = format!(
        "redis+sentinel://127.0.0.1:{},127.0.0.1:{}/",
        free_port(),
        free_port()
    );
    for service in ["lockkit-typo", "lockkit"] {
        match RedisLock::connect(&format!("{nobody}{service}")).await {
            Err(Error::Unavailable { .. }) => {}
            other => panic!("{service} with no sentinel up: {other:?}"),
        }
    }
}

/// The URL's user info logs in to the master, `sentinel_password` to the sentinels; each wrong
/// or missing one is an `Auth` error that shows neither password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_master_and_the_sentinels_have_their_own_passwords() {
    let topo = Topology::start_with(Some(("m-secret", "s-secret"))).await;
    let base = topo.url(&fresh_prefix(), "");
    let with = |master: &str, sentinel: &str| {
        let url = base.replace("redis+sentinel://", &format!("redis+sentinel://:{master}@"));
        format!("{url}&sentinel_password={sentinel}")
    };
    let locks = RedisLock::connect(&with("m-secret", "s-secret"))
        .await
        .expect("both passwords right");
    let lease = locks.acquire("job", opts()).await.unwrap();
    lease.release().await.unwrap();
    for (master, sentinel) in [("m-secret", "wrong-s"), ("wrong-m", "s-secret")] {
        match RedisLock::connect(&with(master, sentinel)).await {
            Err(e @ Error::Auth { .. }) => {
                let shown = format!("{e} {e:?}");
                assert!(
                    !shown.contains("secret") && !shown.contains("wrong-"),
                    "a password shown: {shown}"
                );
            }
            other => panic!("master {master}, sentinel {sentinel}: {other:?}"),
        }
    }
}

/// A lease whose grant reached the replica survives the failover: the new master proves it
/// holds the key (the lease stays Held, its expiry set anew there), the release works on the
/// new master, and the next grant has a larger token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_keeps_a_lease_the_new_master_holds() {
    let mut topo = Topology::start().await;
    let prefix = fresh_prefix();
    let locks = RedisLock::connect(&topo.url(&prefix, "")).await.unwrap();
    let a = locks.acquire("job", opts()).await.unwrap();
    topo.replicated().await;
    let killed = topo.fail_over().await;
    let replica = topo.replica_addr();
    until("the client switched", Duration::from_secs(10), || {
        locks.master_addr() == replica
    })
    .await;
    eprintln!(
        "sentinel: client on the new master {:?} after the kill",
        killed.elapsed()
    );
    // Proved: renewed on the new master after the kill.
    until("the lease proved", Duration::from_secs(10), || {
        a.valid_until() > killed + a.ttl()
    })
    .await;
    eprintln!(
        "sentinel: lease proved {:?} after the kill",
        killed.elapsed()
    );
    assert_eq!(a.state(), LeaseState::Held);
    a.check().await.expect("the new master holds the key");
    let token = a.token();
    a.release().await.expect("release on the new master");
    let other = RedisLock::connect(&topo.url(&prefix, "")).await.unwrap();
    let b = other.acquire("job", opts()).await.unwrap();
    assert!(b.token() > token, "{:?} after {token:?}", b.token());
    b.release().await.unwrap();
}

/// Replication blocked, then the primary killed: the promoted replica never saw the grant.
/// Without replication-confirmed grants the holder was granted a lease the new master does not
/// know: it becomes Lost (NotHeldOnServer) once the client switches, a new acquire succeeds on
/// the promoted replica with a **larger** token (the counter the replica has is older than the
/// lost grant's; the TIME floor keeps tokens increasing) and the old holder's fenced write is
/// rejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_with_replication_blocked_loses_the_lease_and_tokens_still_increase() {
    let mut topo = Topology::start().await;
    let prefix = fresh_prefix();
    let locks = RedisLock::connect(&topo.url(&prefix, "")).await.unwrap();
    // The replica has a counter for the lock: that of an earlier grant.
    let first = locks.acquire("job", opts()).await.unwrap();
    let first_token = first.token();
    first.release().await.unwrap();
    topo.replicated().await;
    topo.block_replication();
    let a = locks.acquire("job", opts()).await.unwrap();
    assert!(a.token() > first_token);
    let fence = MemoryFence::new();
    fence.write("report", a.token(), "a").unwrap();
    let killed = topo.fail_over().await;
    tokio::time::timeout(Duration::from_secs(10), a.lost())
        .await
        .expect("the lease was not lost within 10 s of the kill");
    let lost_after = killed.elapsed();
    assert_eq!(a.loss_reason(), Some(LossReason::NotHeldOnServer));
    let other = RedisLock::connect(&topo.url(&prefix, "")).await.unwrap();
    let b = other.acquire("job", opts()).await.unwrap();
    let granted_after = killed.elapsed();
    eprintln!(
        "sentinel, replication blocked: lease Lost {lost_after:?} after the kill; new grant \
         {granted_after:?} after it; tokens {} then {}",
        a.token().get(),
        b.token().get()
    );
    super::newer_grant_fences_out_the_lost_one(&fence, &a, &b);
    b.release().await.unwrap();
}

/// Replication blocked with replication-confirmed grants (`min_replicas=1`): no grant is handed
/// out (a typed `NotReplicated` error, the lock given back on the primary), so the failover
/// cannot grant a held lock twice; before the block, and on the promoted replica without the
/// option, grants succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replication_confirmed_grants_refuse_what_no_replica_acknowledged() {
    let mut topo = Topology::start().await;
    let prefix = fresh_prefix();
    let locks = RedisLock::connect(&topo.url(&prefix, "min_replicas=1&replica_timeout=100ms"))
        .await
        .unwrap();
    let first = locks.acquire("job", opts()).await.unwrap();
    let first_token = first.token();
    first.release().await.unwrap();
    topo.replicated().await;
    topo.block_replication();
    let e = locks.acquire("job", opts()).await.unwrap_err();
    let n = not_replicated(&e).unwrap_or_else(|| panic!("not a NotReplicated error: {e:?}"));
    assert_eq!((n.wanted, n.acknowledged), (1, 0));
    assert_eq!(n.timeout, Duration::from_millis(100));
    // Given back: the primary holds no lock key.
    let mut raw = topo.primary_conn().await;
    assert!(!super::exists(&mut raw, &locks.lock_key("job")).await);
    // Under Wait, the grant is retried and still refused: the last refusal, or the Timeout
    // when the deadline cuts a retry short (its grant is then given back in the background).
    let waited = locks
        .acquire(
            "job",
            opts().wait(Wait::Timeout(Duration::from_millis(600))),
        )
        .await
        .unwrap_err();
    assert!(
        not_replicated(&waited).is_some() || matches!(waited, Error::Timeout { .. }),
        "{waited:?}"
    );
    super::await_exists(
        &mut raw,
        &locks.lock_key("job"),
        false,
        Duration::from_secs(5),
    )
    .await;
    topo.fail_over().await;
    // The promoted replica has no replica of its own: confirmed grants fail there too …
    let confirmed = RedisLock::connect(&topo.url(&prefix, "min_replicas=1"))
        .await
        .unwrap();
    let e = confirmed.acquire("job", opts()).await.unwrap_err();
    assert!(not_replicated(&e).is_some(), "{e:?}");
    // … and plain ones succeed, above every earlier token.
    let plain = RedisLock::connect(&topo.url(&prefix, "")).await.unwrap();
    let b = plain.acquire("job", opts()).await.unwrap();
    assert!(b.token() > first_token);
    b.release().await.unwrap();
}

/// Replication-confirmed grants hold for leaderships and permits as for locks: with
/// replication blocked, a campaign and a permit acquire fail with `NotReplicated` and the
/// primary keeps nothing of them (no slot key, no holder record, nobody queued); a waiting
/// campaign is refused on every retry and leaves nothing behind either. Before the block both
/// are granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replication_confirmed_slot_grants_refuse_what_no_replica_acknowledged() {
    let topo = Topology::start().await;
    let prefix = fresh_prefix();
    let locks = RedisLock::connect(&topo.url(&prefix, "min_replicas=1&replica_timeout=100ms"))
        .await
        .unwrap();
    let lead = locks.campaign("lead", b"a", opts()).await.unwrap();
    let term = lead.term();
    lead.resign().await.unwrap();
    let permit = locks.acquire_permit("pool", 2, opts()).await.unwrap();
    permit.release().await.unwrap();
    topo.replicated().await;
    topo.block_replication();
    let e = locks.campaign("lead", b"b", opts()).await.unwrap_err();
    let n = not_replicated(&e).unwrap_or_else(|| panic!("campaign: not NotReplicated: {e:?}"));
    assert_eq!((n.wanted, n.acknowledged), (1, 0));
    let e = locks.acquire_permit("pool", 2, opts()).await.unwrap_err();
    assert!(not_replicated(&e).is_some(), "permit: {e:?}");
    let mut raw = topo.primary_conn().await;
    let slot_keys = [
        locks.slot_key(SlotKind::Election, "lead", 0),
        locks.slot_key(SlotKind::Semaphore, "pool", 0),
        locks.slot_key(SlotKind::Semaphore, "pool", 1),
    ];
    for key in &slot_keys {
        assert!(
            !super::exists(&mut raw, key).await,
            "{key} left on the primary"
        );
    }
    for (hash, queue) in [("elect/lead", "elect/lead"), ("sem/pool", "sem/pool")] {
        let (records, queued): (Vec<String>, i64) = redis::pipe()
            .cmd("HKEYS")
            .arg(format!("{prefix}:slots:{hash}"))
            .cmd("ZCARD")
            .arg(format!("{prefix}:queue:{queue}"))
            .query_async(&mut raw)
            .await
            .expect("HKEYS, ZCARD");
        assert_eq!((records, queued), (vec!["n".to_owned()], 0), "{hash}");
    }
    assert_eq!(locks.leader("lead").await.unwrap(), None);
    let holders = locks.permit_holders("pool").await.unwrap();
    assert!(
        holders.as_ref().is_none_or(|h| h.holders.is_empty()),
        "{holders:?}"
    );
    // Waiting: refused on every retry (the last refusal, or the Timeout when the deadline cuts
    // a retry short: its grant is then given back in the background).
    let waited = locks
        .campaign(
            "lead",
            b"c",
            opts().wait(Wait::Timeout(Duration::from_millis(600))),
        )
        .await
        .unwrap_err();
    assert!(
        not_replicated(&waited).is_some() || matches!(waited, Error::Timeout { .. }),
        "{waited:?}"
    );
    super::await_exists(&mut raw, &slot_keys[0], false, Duration::from_secs(5)).await;
    // Without the option the same primary grants at once, above the earlier term.
    let plain = RedisLock::connect(&topo.url(&prefix, "")).await.unwrap();
    let lead = plain.campaign("lead", b"d", opts()).await.unwrap();
    assert!(lead.term() > term);
    lead.resign().await.unwrap();
}

/// A failover while two leaderships are held: the one whose grant reached the replica proves
/// itself on the new master (stays Held, renewed there, still the leader others read), the one
/// granted with replication blocked becomes Lost (NotHeldOnServer); the next terms of both
/// elections are larger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_keeps_a_leadership_the_new_master_holds_and_loses_the_others() {
    let mut topo = Topology::start().await;
    let prefix = fresh_prefix();
    let locks = RedisLock::connect(&topo.url(&prefix, "")).await.unwrap();
    let kept = locks.campaign("kept", b"k", opts()).await.unwrap();
    topo.replicated().await;
    topo.block_replication();
    let lost = locks.campaign("lost", b"l", opts()).await.unwrap();
    let killed = topo.fail_over().await;
    tokio::time::timeout(Duration::from_secs(10), lost.lease().lost())
        .await
        .expect("the unreplicated leadership was not lost within 10 s of the kill");
    let lost_after = killed.elapsed();
    assert_eq!(
        lost.lease().loss_reason(),
        Some(LossReason::NotHeldOnServer)
    );
    until(
        "the kept leadership proved",
        Duration::from_secs(10),
        || kept.lease().valid_until() > killed + kept.lease().ttl(),
    )
    .await;
    eprintln!(
        "sentinel: unreplicated leadership Lost {lost_after:?}, replicated one proved {:?} \
         after the kill",
        killed.elapsed()
    );
    assert_eq!(kept.lease().state(), LeaseState::Held);
    kept.lease()
        .check()
        .await
        .expect("the new master holds the leader key");
    let other = RedisLock::connect(&topo.url(&prefix, "")).await.unwrap();
    assert_eq!(locks.master_addr(), topo.replica_addr());
    let seen = other.leader("kept").await.unwrap().expect("a leader");
    assert_eq!(seen.term, kept.term());
    let next = other.campaign("lost", b"n", opts()).await.unwrap();
    assert!(
        next.term() > lost.term(),
        "the promoted replica's term {:?} is not above the lost one {:?}",
        next.term(),
        lost.term()
    );
    let kept_term = kept.term();
    kept.resign().await.expect("resign on the new master");
    let after = other.campaign("kept", b"a", opts()).await.unwrap();
    assert!(after.term() > kept_term);
    after.resign().await.unwrap();
    next.resign().await.unwrap();
}
