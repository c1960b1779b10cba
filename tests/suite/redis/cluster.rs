//! Redis Cluster (`redis+cluster://`): the contract suite against the shared cluster
//! (`LOCKKIT_REDIS_CLUSTER_URL`: three masters with a replica each, started by
//! `scripts/servers.sh`), names on every master, and on private clusters (started by their test,
//! killed with it) a slot migration of a held lock's slot and master failovers.

use std::process::Command;
use std::time::Duration;

use lockkit::redis::{NotReplicated, RedisLock};
use lockkit::{AcquireOptions, Error, LeaseState, Lock, LockExt, LossReason, MemoryFence, Wait};
use tokio::time::Instant;

use crate::common::{ServerProcess, fresh_prefix, server_url, wait_until, with_prefix};

mod contract {
    use crate::common::UrlHarness;
    lockkit::contract_suite!(UrlHarness::from_env("LOCKKIT_REDIS_CLUSTER_URL"));
}

/// A free port P whose cluster bus port P + 10000 is free too (both bound, then released).
fn cluster_port() -> u16 {
    loop {
        let p: u16 = 20000 + rand::random::<u16>() % 25000;
        let free = |q: u16| std::net::TcpListener::bind(("127.0.0.1", q)).is_ok();
        if free(p) && free(p + 10000) {
            return p;
        }
    }
}

fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// One line of `CLUSTER NODES`.
#[derive(Debug, Clone)]
pub(super) struct Node {
    id: String,
    pub(super) port: u16,
    master: bool,
    /// The master's ID, for a replica.
    of: Option<String>,
    slots: Vec<(u16, u16)>,
}

fn nodes(port: u16) -> Vec<Node> {
    cli(port, &["cluster", "nodes"])
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.len() < 8 || f[2].contains("fail") {
                return None;
            }
            let addr = f[1].split('@').next()?;
            let port = addr.rsplit(':').next()?.parse().ok()?;
            let slots = f[8..]
                .iter()
                .filter(|s| !s.starts_with('['))
                .filter_map(|s| match s.split_once('-') {
                    Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                    None => s.parse().ok().map(|n| (n, n)),
                })
                .collect();
            Some(Node {
                id: f[0].to_owned(),
                port,
                master: f[2].contains("master"),
                of: (f[3] != "-").then(|| f[3].to_owned()),
                slots,
            })
        })
        .collect()
}

pub(super) fn slot_of(port: u16, key: &str) -> u16 {
    cli(port, &["cluster", "keyslot", key])
        .parse()
        .expect("keyslot")
}

/// The master that serves `slot`, as `port` sees the cluster.
pub(super) fn owner(port: u16, slot: u16) -> Node {
    try_owner(port, slot).unwrap_or_else(|| panic!("no master for slot {slot}"))
}

fn try_owner(port: u16, slot: u16) -> Option<Node> {
    nodes(port)
        .into_iter()
        .find(|n| n.master && n.slots.iter().any(|&(a, b)| a <= slot && slot <= b))
}

/// The seed ports of a `redis+cluster://` URL.
fn seed_ports(url: &str) -> Vec<u16> {
    let hosts = url
        .trim_start_matches("redis+cluster://")
        .split(['/', '?'])
        .next()
        .unwrap_or_default();
    hosts
        .split(',')
        .filter_map(|h| h.rsplit(':').next()?.parse().ok())
        .collect()
}

/// A private cluster of three masters (and with `replicas` one replica each), on loopback.
pub(super) struct PrivateCluster {
    pub(super) ports: Vec<u16>,
    procs: Vec<ServerProcess>,
}

impl PrivateCluster {
    pub(super) async fn start(replicas: bool) -> Self {
        let n = if replicas { 6 } else { 3 };
        let mut ports = Vec::new();
        let mut procs = Vec::new();
        for i in 0..n {
            let port = cluster_port();
            let dir = tempfile::tempdir().expect("temp dir");
            let mut cmd = Command::new("redis-server");
            cmd.args(["--bind", "127.0.0.1", "--port", &port.to_string()])
                .arg("--dir")
                .arg(dir.path())
                .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
                .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "1000"])
                .args(["--cluster-replica-validity-factor", "0"])
                .arg("--cluster-config-file")
                .arg(dir.path().join("nodes.conf"));
            procs.push(ServerProcess::spawn(&format!("cluster-{i}"), dir, cmd));
            ports.push(port);
        }
        for &p in &ports {
            wait_until("a cluster node", Duration::from_secs(10), || {
                cli(p, &["ping"]) == "PONG"
            })
            .await;
        }
        let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        // Bounded: a node that never joins would leave `--cluster create` waiting forever.
        let st = Command::new("timeout")
            .args(["60", "redis-cli", "--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", if replicas { "1" } else { "0" }])
            .arg("--cluster-yes")
            .stdout(std::process::Stdio::null())
            .status()
            .expect("redis-cli --cluster create");
        assert!(st.success(), "cluster create failed");
        let me = Self { ports, procs };
        me.wait_ok().await;
        me
    }

    /// Until every live node says `cluster_state:ok` (and, with replicas, every replica's link
    /// is up).
    async fn wait_ok(&self) {
        let live: Vec<u16> = self.ports.clone();
        // With replicas, half the nodes are replicas: each node must see them all as such
        // (gossip can lag `--cluster create` on a loaded machine).
        let replicas = if live.len() == 6 { 3 } else { 0 };
        wait_until("cluster_state:ok", Duration::from_secs(20), || {
            live.iter().all(|&p| {
                let info = cli(p, &["cluster", "info"]);
                let seen = cli(p, &["cluster", "nodes"]).matches("slave").count();
                info.is_empty() || (info.contains("cluster_state:ok") && seen >= replicas)
            })
        })
        .await;
    }

    pub(super) fn url(&self, prefix: &str) -> String {
        let seeds: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        with_prefix(&format!("redis+cluster://{}", seeds.join(",")), prefix)
    }

    pub(super) fn proc(&mut self, port: u16) -> &mut ServerProcess {
        let i = self.ports.iter().position(|&p| p == port).expect("a node");
        &mut self.procs[i]
    }

    fn any_live(&self, except: u16) -> u16 {
        *self.ports.iter().find(|&&p| p != except).expect("a node")
    }
}

fn opts(ttl: Duration) -> AcquireOptions {
    AcquireOptions::new()
        .ttl(ttl)
        .wait(Wait::Timeout(Duration::from_secs(20)))
}

async fn until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    wait_until(what, limit, &mut done).await;
}

fn is_held_error(e: &Error) -> bool {
    matches!(e, Error::Held { .. })
}

/// A try-acquire while the slot migrates: refused, as held, or as unavailable (`TRYAGAIN`:
/// Redis refuses a multi-key script with some keys missing while their slot migrates).
fn refused_while_migrating(e: &Error) -> bool {
    matches!(e, Error::Held { .. } | Error::Unavailable { .. })
}

/// Names on all three masters of the shared cluster, held at once: every grant works on its
/// slot's master, renewal (grouped by slot) keeps them all, tokens are per name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_on_every_master_are_granted_and_renewed_together() {
    let url = server_url("LOCKKIT_REDIS_CLUSTER_URL");
    let seed = seed_ports(&url)[0];
    let locks = RedisLock::connect(&with_prefix(&url, &fresh_prefix()))
        .await
        .unwrap();
    let mut leases = Vec::new();
    let mut masters = std::collections::BTreeSet::new();
    for i in 0..24 {
        let name = format!("n{i}");
        masters.insert(owner(seed, slot_of(seed, &locks.lock_key(&name))).id);
        leases.push(
            locks
                .acquire(&name, opts(Duration::from_secs(2)))
                .await
                .unwrap(),
        );
    }
    assert_eq!(
        masters.len(),
        3,
        "24 names should land on all three masters"
    );
    // Two renewal rounds (every TTL/3) later, every lease is still held and extended.
    let t = Instant::now();
    for l in &leases {
        until("a renewal", Duration::from_secs(5), || {
            l.valid_until() > t + Duration::from_millis(1500)
        })
        .await;
        assert_eq!(l.state(), LeaseState::Held);
    }
    let other = RedisLock::connect(&with_prefix(&url, locks.prefix()))
        .await
        .unwrap();
    for (i, l) in leases.into_iter().enumerate() {
        let name = format!("n{i}");
        let e = other
            .acquire(&name, AcquireOptions::new().wait(Wait::No))
            .await
            .unwrap_err();
        assert!(is_held_error(&e), "{name}: {e:?}");
        let token = l.token();
        l.release().await.unwrap();
        let next = other
            .try_acquire(&name, Duration::from_secs(2))
            .await
            .expect("free after the release");
        assert!(next.token() > token);
        next.release().await.unwrap();
    }
}

/// The `calls=` of `cmdstat_COMMAND` in `INFO commandstats` of the node on `port` (0 if the
/// command never ran there; commands that scripts run are counted too).
fn calls(port: u16, command: &str) -> u64 {
    let line = format!("cmdstat_{command}:calls=");
    cli(port, &["info", "commandstats"])
        .lines()
        .find_map(|l| l.strip_prefix(line.as_str()))
        .and_then(|rest| rest.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

/// A hand-off stays on the lock's shard: while a waiter waits, the master of the lock's slot
/// has the waiter's client subscribed to a shard channel in that slot (`PUBSUB SHARDCHANNELS`,
/// `SHARDNUMSUB`); the release `SPUBLISH`es the hand-off there, no node of the cluster counts
/// a `PUBLISH` (which the cluster bus would carry to every node), and the waiter gets the lock
/// with a larger token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hand_offs_are_spublished_on_the_locks_shard() {
    let url = server_url("LOCKKIT_REDIS_CLUSTER_URL");
    let seed = seed_ports(&url)[0];
    let prefix = fresh_prefix();
    let locks = RedisLock::connect(&with_prefix(&url, &prefix))
        .await
        .unwrap();
    let other = RedisLock::connect(&with_prefix(&url, &prefix))
        .await
        .unwrap();
    let ttl = Duration::from_secs(30);
    let a = locks.acquire("handed", opts(ttl)).await.unwrap();
    let slot = slot_of(seed, &locks.lock_key("handed"));
    let master = owner(seed, slot);
    let everyone: Vec<u16> = nodes(seed).iter().map(|n| n.port).collect();
    assert_eq!(everyone.len(), 6, "three masters and three replicas");
    let queue = other.queue_key("handed");
    let waiting = tokio::spawn({
        let other = other.clone();
        async move { other.acquire("handed", opts(ttl)).await }
    });
    let pattern = format!("{prefix}:client:*");
    until(
        "the waiter queued with its shard channel",
        Duration::from_secs(10),
        || {
            cli(master.port, &["zcard", &queue]) == "1"
                && !cli(master.port, &["pubsub", "shardchannels", &pattern]).is_empty()
        },
    )
    .await;
    let channels = cli(master.port, &["pubsub", "shardchannels", &pattern]);
    let channels: Vec<&str> = channels.lines().collect();
    assert_eq!(channels.len(), 1, "{channels:?}");
    assert_eq!(slot_of(seed, channels[0]), slot, "{}", channels[0]);
    assert_eq!(
        cli(master.port, &["pubsub", "shardnumsub", channels[0]]),
        format!("{}\n1", channels[0])
    );
    // Classic pub/sub is not used for it.
    assert_eq!(cli(master.port, &["pubsub", "channels", &pattern]), "");
    let published: Vec<u64> = everyone.iter().map(|&p| calls(p, "publish")).collect();
    let spublished = calls(master.port, "spublish");
    let token = a.token();
    a.release().await.unwrap();
    let b = waiting.await.unwrap().unwrap();
    assert!(b.token() > token);
    assert!(calls(master.port, "spublish") > spublished);
    let after: Vec<u64> = everyone.iter().map(|&p| calls(p, "publish")).collect();
    assert_eq!(after, published, "PUBLISH calls on {everyone:?}");
    b.release().await.unwrap();
}

/// A hand-off message reaches the lock's whole shard, replicas too, so the waiter it names
/// must be the one the script wrote the lock for: a queued waiter whose client listens on the
/// slot's replica only (where the redis crate may subscribe a client again after a reconnect)
/// is handed the lock, not passed over because `SPUBLISH` counts only the master's own
/// subscribers. Passed over, it took a lease the server had given to the next waiter or freed:
/// two holders (the second breaker's find, with pub/sub connections killed every 250 ms).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_told_of_a_hand_off_on_a_replica_is_the_holder() {
    use std::process::Stdio;
    use tokio::io::{AsyncBufReadExt, BufReader};
    let url = server_url("LOCKKIT_REDIS_CLUSTER_URL");
    let seed = seed_ports(&url)[0];
    let prefix = fresh_prefix();
    let holder = RedisLock::connect(&with_prefix(&url, &prefix))
        .await
        .unwrap();
    let name = "told";
    let lease = holder
        .acquire(name, opts(Duration::from_secs(30)).wait(Wait::No))
        .await
        .unwrap();
    let (lock, queue) = (holder.lock_key(name), holder.queue_key(name));
    let master = owner(seed, slot_of(seed, &queue));
    let replica = nodes(seed)
        .into_iter()
        .find(|n| n.of.as_deref() == Some(master.id.as_str()))
        .expect("the master's replica");
    // Waiter `w`, whose client listens on the replica only.
    let channel = format!("{prefix}:client:{{={name}}}:w");
    let mut listener = tokio::process::Command::new("redis-cli")
        .args(["-p", &replica.port.to_string(), "ssubscribe", &channel])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("redis-cli ssubscribe");
    let mut lines = BufReader::new(listener.stdout.take().expect("stdout")).lines();
    until(
        "the replica has the subscriber",
        Duration::from_secs(10),
        || cli(replica.port, &["pubsub", "shardnumsub", &channel]).ends_with("\n1"),
    )
    .await;
    assert_eq!(cli(master.port, &["zadd", &queue, "1", "w"]), "1");
    let waiter_key = format!("{prefix}:waiter:{{={name}}}:w");
    let value = format!("5000 0 :{channel}");
    assert_eq!(
        cli(master.port, &["set", &waiter_key, &value, "px", "60000"]),
        "OK"
    );
    lease.release().await.unwrap();
    let told = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(line) = lines.next_line().await.expect("redis-cli output") {
            if line.starts_with("w ") {
                return line;
            }
        }
        panic!("redis-cli ended");
    })
    .await
    .expect("the hand-off message reached the replica");
    assert_eq!(
        cli(master.port, &["get", &lock]),
        "w",
        "w was told {told:?}, but the lock is not w's"
    );
    cli(master.port, &["del", &lock]);
}

/// Cluster mode refuses elections and semaphores with a typed error: `lockkit::connect_election`
/// and `connect_semaphore` at connect (as for Redlock, so that `lockkit guarantees` lists none),
/// a `RedisLock` used as a `SlotBackend` directly at the campaign or acquire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn elections_are_not_supported_in_cluster_mode() {
    let url = server_url("LOCKKIT_REDIS_CLUSTER_URL");
    let url = with_prefix(&url, &fresh_prefix());
    let Err(e) = lockkit::connect_election(&url).await else {
        panic!("connect_election on a cluster must be refused");
    };
    assert!(matches!(e, Error::NotSupported { .. }), "{e:?}");
    let Err(e) = lockkit::connect_semaphore(&url).await else {
        panic!("connect_semaphore on a cluster must be refused");
    };
    assert!(matches!(e, Error::NotSupported { .. }), "{e:?}");
    let direct: std::sync::Arc<dyn lockkit::Election> =
        std::sync::Arc::new(lockkit::redis::RedisLock::connect(&url).await.unwrap());
    let e = direct
        .campaign("leader", b"me", AcquireOptions::new().wait(Wait::No))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::NotSupported { .. }), "{e:?}");
    let direct: std::sync::Arc<dyn lockkit::Semaphore> =
        std::sync::Arc::new(lockkit::redis::RedisLock::connect(&url).await.unwrap());
    let e = direct
        .acquire_permit("pool", 2, AcquireOptions::new().wait(Wait::No))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::NotSupported { .. }), "{e:?}");
}

/// `RedisFence` on a cluster: a hash-tagged key and its guard record `{prefix}:guard:{key}`
/// share a slot, so fenced writes go through, and a stale token is rejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_writes_with_a_hash_tagged_key() {
    use lockkit::redis::RedisFence;
    let prefix = fresh_prefix();
    let url = with_prefix(&server_url("LOCKKIT_REDIS_CLUSTER_URL"), &prefix);
    let locks = lockkit::connect(&url).await.unwrap();
    let name = format!("fence-{prefix}");
    let a = locks
        .acquire(&name, opts(Duration::from_secs(2)))
        .await
        .unwrap();
    let fence_a = RedisFence::from_lease(&a).unwrap();
    assert_eq!(fence_a.guard_key("{r}x"), format!("{prefix}:guard:{{r}}x"));
    fence_a.set("{r}x", "a").await.expect("a's write");
    a.release().await.unwrap();
    let b = locks
        .acquire(&name, opts(Duration::from_secs(2)))
        .await
        .unwrap();
    RedisFence::from_lease(&b)
        .unwrap()
        .set("{r}x", "b")
        .await
        .expect("b's write");
    let stale = fence_a.set("{r}x", "a again").await.unwrap_err();
    assert!(matches!(stale, Error::StaleToken { .. }), "{stale:?}");
    b.release().await.unwrap();
}

/// A private cluster (no replicas) where `_locks` holds "moving" (the lease returned with it),
/// `other` is a second client, and `dst` is a master other than the slot's owner `src`: the
/// stage of the slot migration tests, which move the slot from `src` to `dst` in three steps.
struct Migration {
    cluster: PrivateCluster,
    prefix: String,
    _locks: RedisLock,
    other: RedisLock,
    key: String,
    slot: u16,
    src: Node,
    dst: Node,
}

impl Migration {
    async fn of_a_held_lock(ttl: Duration) -> (Self, lockkit::Lease) {
        let cluster = PrivateCluster::start(false).await;
        let seed = cluster.ports[0];
        let prefix = fresh_prefix();
        let locks = RedisLock::connect(&cluster.url(&prefix)).await.unwrap();
        let other = RedisLock::connect(&cluster.url(&prefix)).await.unwrap();
        let a = locks.acquire("moving", opts(ttl)).await.unwrap();
        let key = locks.lock_key("moving");
        let slot = slot_of(seed, &key);
        let src = owner(seed, slot);
        let dst = nodes(seed)
            .into_iter()
            .find(|n| n.master && n.id != src.id)
            .unwrap();
        let stage = Self {
            cluster,
            prefix,
            _locks: locks,
            other,
            key,
            slot,
            src,
            dst,
        };
        (stage, a)
    }

    /// `SETSLOT … IMPORTING` on `dst`, `SETSLOT … MIGRATING` on `src`.
    fn start(&self) {
        let s = self.slot.to_string();
        assert_eq!(
            cli(
                self.dst.port,
                &["cluster", "setslot", &s, "importing", &self.src.id]
            ),
            "OK"
        );
        assert_eq!(
            cli(
                self.src.port,
                &["cluster", "setslot", &s, "migrating", &self.dst.id]
            ),
            "OK"
        );
    }

    /// `MIGRATE`s every key of the slot from `src` to `dst`; the keys it found there.
    fn move_keys(&self) -> Vec<String> {
        let s = self.slot.to_string();
        let keys: Vec<String> = cli(self.src.port, &["cluster", "getkeysinslot", &s, "100"])
            .lines()
            .map(str::to_owned)
            .collect();
        let port = self.dst.port.to_string();
        let mut args = vec!["migrate", "127.0.0.1", &port, "", "0", "5000", "keys"];
        args.extend(keys.iter().map(String::as_str));
        assert_eq!(cli(self.src.port, &args), "OK");
        keys
    }

    /// `SETSLOT … NODE dst` on every master.
    fn finish(&self) {
        let s = self.slot.to_string();
        for n in nodes(self.cluster.ports[0]).iter().filter(|n| n.master) {
            assert_eq!(
                cli(n.port, &["cluster", "setslot", &s, "node", &self.dst.id]),
                "OK"
            );
        }
    }
}

/// `RedisFence` on a cluster with a key without a hash tag: its guard record is in another
/// slot, the server refuses the script (`CROSSSLOT`), and the error says to give the key a hash
/// tag instead of only quoting the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_key_without_a_hash_tag_is_refused_with_a_hint() {
    use lockkit::redis::RedisFence;
    let prefix = fresh_prefix();
    let url = with_prefix(&server_url("LOCKKIT_REDIS_CLUSTER_URL"), &prefix);
    let locks = lockkit::connect(&url).await.unwrap();
    let lease = locks
        .acquire(&format!("untagged-{prefix}"), opts(Duration::from_secs(2)))
        .await
        .unwrap();
    let fence = RedisFence::from_lease(&lease).unwrap();
    // "reports:today" and "{prefix}:guard:reports:today" hash to different slots (checked, so
    // that the test does not pass by a lucky slot).
    let seed: u16 = url
        .split("//")
        .nth(1)
        .and_then(|h| h.split([',', '/', '?']).next())
        .and_then(|h| h.rsplit(':').next())
        .and_then(|p| p.parse().ok())
        .expect("a seed port");
    assert_ne!(
        slot_of(seed, "reports:today"),
        slot_of(seed, &fence.guard_key("reports:today"))
    );
    let e = fence.set("reports:today", "rows").await.unwrap_err();
    assert!(matches!(e, Error::Backend { .. }), "{e:?}");
    assert!(e.to_string().contains("hash tag"), "{e}");
    lease.release().await.unwrap();
}

/// The slot of a held lock moves to another master (`SETSLOT … IMPORTING/MIGRATING`, `MIGRATE`
/// of all its keys, `SETSLOT … NODE`): nobody else gets the lock meanwhile (refused as held, or
/// `TRYAGAIN` while the slot is half moved), the holder keeps it (its renewal after the move
/// follows `MOVED` to the new owner), a waiter queued there is handed it at the release, and
/// its token is larger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_locks_slot_migrates_and_the_holder_keeps_it() {
    let ttl = Duration::from_secs(6);
    let (m, a) = Migration::of_a_held_lock(ttl).await;
    let Migration {
        other, slot, dst, ..
    } = &m;
    m.start();
    // Mid-migration, keys still on the source: not granted.
    let e = other
        .acquire("moving", AcquireOptions::new().wait(Wait::No))
        .await
        .unwrap_err();
    assert!(refused_while_migrating(&e), "{e:?}");
    let keys = m.move_keys();
    assert!(keys.contains(&m.key), "{keys:?}");
    // Keys on the target, slot still migrating (ASK, then TRYAGAIN for the missing keys):
    // not granted.
    let e = other
        .acquire("moving", AcquireOptions::new().wait(Wait::No))
        .await
        .unwrap_err();
    assert!(refused_while_migrating(&e), "{e:?}");
    // Its renewals fail the same way meanwhile: Suspect, not Lost.
    assert_ne!(a.state(), LeaseState::Lost);
    m.finish();
    assert_eq!(owner(dst.port, *slot).id, dst.id);
    // Done: MOVED from the old owner, the client refreshes its map.
    let done = Instant::now();
    until("a renewal after MOVED", Duration::from_secs(5), || {
        a.valid_until() > done + ttl - Duration::from_millis(500)
    })
    .await;
    eprintln!(
        "cluster, slot migration: lease renewed on the new owner {:?} after SETSLOT NODE",
        done.elapsed()
    );
    assert_eq!(a.state(), LeaseState::Held);
    a.check().await.expect("the new owner holds the key");
    let e = other
        .acquire("moving", AcquireOptions::new().wait(Wait::No))
        .await
        .unwrap_err();
    assert!(is_held_error(&e), "{e:?}");
    // A waiter queued on the new owner is handed the lock at the release.
    let waiting = tokio::spawn({
        let other = other.clone();
        async move { other.acquire("moving", opts(ttl)).await }
    });
    until("the waiter queued", Duration::from_secs(5), || {
        cli(dst.port, &["zcard", &other.queue_key("moving")]) == "1"
    })
    .await;
    let token = a.token();
    a.release().await.unwrap();
    let b = waiting.await.unwrap().unwrap();
    assert!(b.token() > token, "{:?} after {token:?}", b.token());
    b.release().await.unwrap();
}

/// A waiter subscribed to its shard channel on the slot's master while the slot migrates to
/// another master: the old master takes the subscription back (`SUNSUBSCRIBE`), the waiter
/// subscribes again on the new one (`PUBSUB SHARDCHANNELS` there), and the release's hand-off
/// is `SPUBLISH`ed there and reaches it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiters_shard_channel_follows_its_slot_to_the_new_master() {
    let (m, a) = Migration::of_a_held_lock(Duration::from_secs(10)).await;
    let Migration {
        other,
        src,
        dst,
        prefix,
        ..
    } = &m;
    let waiting = tokio::spawn({
        let other = other.clone();
        async move { other.acquire("moving", opts(Duration::from_secs(30))).await }
    });
    let pattern = format!("{prefix}:client:*");
    until(
        "the waiter subscribed on the old master",
        Duration::from_secs(10),
        || {
            cli(src.port, &["zcard", &other.queue_key("moving")]) == "1"
                && !cli(src.port, &["pubsub", "shardchannels", &pattern]).is_empty()
        },
    )
    .await;
    m.start();
    m.move_keys();
    m.finish();
    until(
        "the waiter subscribed on the new master",
        Duration::from_secs(10),
        || !cli(dst.port, &["pubsub", "shardchannels", &pattern]).is_empty(),
    )
    .await;
    assert_eq!(cli(src.port, &["pubsub", "shardchannels", &pattern]), "");
    let spublished = calls(dst.port, "spublish");
    let token = a.token();
    a.release().await.unwrap();
    let b = waiting.await.unwrap().unwrap();
    assert!(b.token() > token);
    assert!(calls(dst.port, "spublish") > spublished);
    b.release().await.unwrap();
}

/// A coordinated failover (`CLUSTER FAILOVER` on the replica, which first catches up): the new
/// master has the lock key, the holder's renewal (after `MOVED`) proves it, the lease stays
/// Held, and the next grant has a larger token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coordinated_failover_keeps_a_lease_the_new_master_holds() {
    let cluster = PrivateCluster::start(true).await;
    let seed = cluster.ports[0];
    let prefix = fresh_prefix();
    let locks = RedisLock::connect(&cluster.url(&prefix)).await.unwrap();
    // Long enough that a failover on a loaded machine (clients paused meanwhile) does not
    // outlast it.
    let ttl = Duration::from_secs(10);
    let a = locks.acquire("job", opts(ttl)).await.unwrap();
    let slot = slot_of(seed, &locks.lock_key("job"));
    let master = owner(seed, slot);
    let replica = nodes(seed)
        .into_iter()
        .find(|n| n.of.as_deref() == Some(master.id.as_str()))
        .expect("a replica of the master");
    assert_eq!(cli(replica.port, &["cluster", "failover"]), "OK");
    let started = Instant::now();
    until("the replica promoted", Duration::from_secs(10), || {
        owner(seed, slot).id == replica.id
    })
    .await;
    until("the lease proved", Duration::from_secs(15), || {
        assert_ne!(a.state(), LeaseState::Lost, "{:?}", a.loss_reason());
        a.valid_until() > started + ttl
    })
    .await;
    eprintln!(
        "cluster, coordinated failover: lease renewed on the new master {:?} after CLUSTER FAILOVER",
        started.elapsed()
    );
    assert_eq!(a.state(), LeaseState::Held);
    a.check().await.expect("the new master holds the key");
    let token = a.token();
    a.release().await.unwrap();
    let other = RedisLock::connect(&cluster.url(&prefix)).await.unwrap();
    let b = other.acquire("job", opts(ttl)).await.unwrap();
    assert!(b.token() > token);
    b.release().await.unwrap();
}

/// The master killed after a grant its replica never received (the replica's replication link
/// cut and the replica stopped while the grant is made): the replica is promoted without the
/// key, the holder's next renewal there fails, and it becomes Lost (NotHeldOnServer); a new
/// acquire gets a larger token (the TIME floor), and the old holder's fenced write is rejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn master_killed_before_replicating_loses_the_lease_and_tokens_still_increase() {
    let mut cluster = PrivateCluster::start(true).await;
    let seed = cluster.ports[0];
    let prefix = fresh_prefix();
    let locks = RedisLock::connect(&cluster.url(&prefix)).await.unwrap();
    // Long enough that the lease is lost by its renewal, not by its deadline.
    let ttl = Duration::from_secs(15);
    let first = locks.acquire("job", opts(ttl)).await.unwrap();
    let first_token = first.token();
    first.release().await.unwrap();
    let slot = slot_of(seed, &locks.lock_key("job"));
    let master = owner(seed, slot);
    let replica = nodes(seed)
        .into_iter()
        .find(|n| n.of.as_deref() == Some(master.id.as_str()))
        .expect("a replica of the master");
    // The replica has what the master wrote so far.
    until("the replica caught up", Duration::from_secs(10), || {
        let m = cli(master.port, &["info", "replication"]);
        let r = cli(replica.port, &["info", "replication"]);
        let field = |s: &str, f: &str| {
            s.lines()
                .find_map(|l| l.strip_prefix(f))
                .map(|v| v.trim().to_owned())
        };
        field(&m, "master_repl_offset:").is_some()
            && field(&m, "master_repl_offset:") == field(&r, "slave_repl_offset:")
    })
    .await;
    cluster.proc(replica.port).signal("STOP");
    assert_eq!(
        cli(master.port, &["client", "kill", "type", "replica"])
            .parse::<u32>()
            .ok(),
        Some(1)
    );
    let a = locks.acquire("job", opts(ttl)).await.unwrap();
    assert!(a.token() > first_token);
    let fence = MemoryFence::new();
    fence.write("report", a.token(), "a").unwrap();
    cluster.proc(master.port).kill();
    let killed = Instant::now();
    cluster.proc(replica.port).signal("CONT");
    let live = cluster.any_live(master.port);
    until("the replica promoted", Duration::from_secs(20), || {
        try_owner(live, slot).is_some_and(|n| n.id == replica.id)
    })
    .await;
    let promoted = killed.elapsed();
    tokio::time::timeout(ttl, a.lost())
        .await
        .expect("the lease was not lost within its TTL of the kill");
    let lost_after = killed.elapsed();
    assert_eq!(a.loss_reason(), Some(LossReason::NotHeldOnServer));
    let other = RedisLock::connect(&cluster.url(&prefix)).await.unwrap();
    let b = other.acquire("job", opts(ttl)).await.unwrap();
    eprintln!(
        "cluster, master killed: replica promoted {promoted:?} after the kill, lease Lost \
         {lost_after:?}, new grant {:?}; tokens {} then {}",
        killed.elapsed(),
        a.token().get(),
        b.token().get()
    );
    super::newer_grant_fences_out_the_lost_one(&fence, &a, &b);
    b.release().await.unwrap();
}

fn not_replicated(e: &Error) -> Option<&NotReplicated> {
    match e {
        Error::Unavailable { source, .. } => source.downcast_ref::<NotReplicated>(),
        _ => None,
    }
}

/// Replication-confirmed grants on the shared cluster (every master has a replica): grants on
/// all three masters are confirmed (`WAIT` on each name's slot master) and handed out, a
/// hand-off to a waiter too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replication_confirmed_grants_on_every_master() {
    let url = server_url("LOCKKIT_REDIS_CLUSTER_URL");
    let seed = seed_ports(&url)[0];
    let prefix = fresh_prefix();
    let confirmed = format!(
        "{}&min_replicas=1&replica_timeout=500ms",
        with_prefix(&url, &prefix)
    );
    let locks = RedisLock::connect(&confirmed).await.unwrap();
    let other = RedisLock::connect(&confirmed).await.unwrap();
    let ttl = Duration::from_secs(10);
    let mut masters = std::collections::BTreeSet::new();
    for i in 0..12 {
        let name = format!("r{i}");
        masters.insert(owner(seed, slot_of(seed, &locks.lock_key(&name))).id);
        let l = locks
            .acquire(&name, AcquireOptions::new().ttl(ttl).wait(Wait::No))
            .await
            .unwrap_or_else(|e| panic!("{name}: {e:?}"));
        l.release().await.unwrap();
    }
    assert_eq!(
        masters.len(),
        3,
        "12 names should land on all three masters"
    );
    let a = locks.acquire("handed", opts(ttl)).await.unwrap();
    let waiting = tokio::spawn({
        let other = other.clone();
        async move { other.acquire("handed", opts(ttl)).await }
    });
    let queue = other.queue_key("handed");
    let master = owner(seed, slot_of(seed, &queue));
    until("the waiter queued", Duration::from_secs(10), || {
        cli(master.port, &["zcard", &queue]) == "1"
    })
    .await;
    a.release().await.unwrap();
    let b = waiting.await.unwrap().unwrap();
    b.release().await.unwrap();
}

/// With the replica of a lock's slot master stopped (SIGSTOP: connected, but acknowledging
/// nothing), a replication-confirmed grant is refused with `NotReplicated` (1 wanted, 0
/// acknowledged) and given back: the master holds no lock key; names on the other masters are
/// still granted; once the replica runs again, the name is granted too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_replica_refuses_replication_confirmed_grants_of_its_slot() {
    let mut cluster = PrivateCluster::start(true).await;
    let seed = cluster.ports[0];
    let prefix = fresh_prefix();
    // Every replica synced before the first confirmed grant.
    until("every replica's link up", Duration::from_secs(20), || {
        nodes(seed).iter().filter(|n| !n.master).count() == 3
            && nodes(seed)
                .iter()
                .filter(|n| !n.master)
                .all(|n| cli(n.port, &["info", "replication"]).contains("master_link_status:up"))
    })
    .await;
    // Generous for a loaded machine; a stopped replica acknowledges nothing however long.
    let url = format!("{}&min_replicas=1&replica_timeout=1s", cluster.url(&prefix));
    let locks = RedisLock::connect(&url).await.unwrap();
    let no_wait = || {
        AcquireOptions::new()
            .ttl(Duration::from_secs(10))
            .wait(Wait::No)
    };
    let first = locks.acquire("job", no_wait()).await.unwrap();
    first.release().await.unwrap();
    let key = locks.lock_key("job");
    let slot = slot_of(seed, &key);
    let master = owner(seed, slot);
    let replica = nodes(seed)
        .into_iter()
        .find(|n| n.of.as_deref() == Some(master.id.as_str()))
        .expect("a replica of the master");
    // A name on another master.
    let elsewhere = (0..64)
        .map(|i| format!("other{i}"))
        .find(|n| owner(seed, slot_of(seed, &locks.lock_key(n))).id != master.id)
        .expect("a name on another master");
    cluster.proc(replica.port).signal("STOP");
    let e = locks.acquire("job", no_wait()).await.unwrap_err();
    let n = not_replicated(&e).unwrap_or_else(|| panic!("not a NotReplicated error: {e:?}"));
    assert_eq!((n.wanted, n.acknowledged), (1, 0));
    assert_eq!(n.timeout, Duration::from_secs(1));
    assert_eq!(cli(master.port, &["exists", &key]), "0", "given back");
    let l = locks.acquire(&elsewhere, no_wait()).await.unwrap();
    l.release().await.unwrap();
    cluster.proc(replica.port).signal("CONT");
    let deadline = Instant::now() + Duration::from_secs(20);
    let again = loop {
        match locks.acquire("job", no_wait()).await {
            Ok(l) => break l,
            Err(e) if not_replicated(&e).is_some() && Instant::now() < deadline => {
                // The replica is catching up: wait for its link, then try again.
                until("the replica's link", Duration::from_secs(10), || {
                    cli(replica.port, &["info", "replication"]).contains("master_link_status:up")
                })
                .await;
            }
            Err(e) => panic!("after the replica resumed: {e:?}"),
        }
    };
    again.release().await.unwrap();
}

/// Bad cluster URLs are typed errors through the facade too, and a cluster URL pointing at no
/// server fails fast with Unavailable.
#[tokio::test]
async fn bad_cluster_urls_and_an_unreachable_seed() {
    for bad in [
        "redis+cluster://",
        "redis+cluster://127.0.0.1:1/3",
        "redis+cluster://127.0.0.1:1?min_replicas=1&replica_timeout=1h",
    ] {
        let e = lockkit::connect(bad).await.unwrap_err();
        assert!(matches!(e, Error::InvalidConfig { .. }), "{bad}: {e:?}");
    }
    let port = crate::common::free_port();
    let e = lockkit::connect(&format!(
        "redis+cluster://127.0.0.1:{port}?connect_timeout=1s"
    ))
    .await
    .unwrap_err();
    assert!(matches!(e, Error::Unavailable { .. }), "{e:?}");
}

/// The wrong mode's URL is a configuration error that names the right scheme: `redis://` at a
/// cluster node (every script would fail with CROSSSLOT or MOVED), `redis+cluster://` at a
/// single server ("cluster support disabled").
#[tokio::test]
async fn the_wrong_modes_url_says_which_scheme_to_use() {
    let seed = seed_ports(&server_url("LOCKKIT_REDIS_CLUSTER_URL"))[0];
    let e = lockkit::connect(&format!("redis://127.0.0.1:{seed}"))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::InvalidConfig { .. }), "{e:?}");
    assert!(e.to_string().contains("redis+cluster://"), "{e}");
    let single = server_url("LOCKKIT_REDIS_URL");
    let hostport = single
        .strip_prefix("redis://")
        .expect("a redis:// URL")
        .rsplit('@')
        .next()
        .expect("host:port")
        .trim_end_matches('/');
    let e = lockkit::connect(&format!("redis+cluster://{hostport}"))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::InvalidConfig { .. }), "{e:?}");
    assert!(e.to_string().contains("redis://"), "{e}");
}

/// A file made by `scripts/certs.sh` at server start.
fn cert(name: &str) -> String {
    format!("{}/{name}", server_url("LOCKKIT_TLS_DIR"))
}

/// `redis-cli` over mutual TLS with the test certificates.
fn tls_cli(port: u16) -> Command {
    let mut c = Command::new("redis-cli");
    c.args(["--tls", "--cacert", &cert("ca.pem")])
        .args(["--cert", &cert("client.pem"), "--key", &cert("client.key")])
        .args(["-h", "127.0.0.1", "-p", &port.to_string()]);
    c
}

/// A private cluster of three masters that takes only TLS connections with a client
/// certificate (`tls-port`, `port 0`), its bus over TLS too (`tls-cluster yes`, each node's
/// outgoing links with the client certificate).
async fn tls_cluster() -> (Vec<u16>, Vec<ServerProcess>) {
    let mut ports = Vec::new();
    let mut procs = Vec::new();
    for i in 0..3 {
        let port = cluster_port();
        let dir = tempfile::tempdir().expect("temp dir");
        let mut cmd = Command::new("redis-server");
        cmd.args(["--bind", "127.0.0.1", "--port", "0"])
            .args(["--tls-port", &port.to_string(), "--tls-cluster", "yes"])
            .args(["--tls-cert-file", &cert("server.pem")])
            .args(["--tls-key-file", &cert("server.key")])
            .args(["--tls-client-cert-file", &cert("client.pem")])
            .args(["--tls-client-key-file", &cert("client.key")])
            .args(["--tls-ca-cert-file", &cert("ca.pem")])
            .args(["--tls-auth-clients", "yes"])
            .arg("--dir")
            .arg(dir.path())
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"])
            .arg("--cluster-config-file")
            .arg(dir.path().join("nodes.conf"));
        procs.push(ServerProcess::spawn(&format!("tls-cluster-{i}"), dir, cmd));
        ports.push(port);
    }
    let out = |c: &mut Command| {
        String::from_utf8_lossy(&c.output().expect("redis-cli").stdout)
            .trim()
            .to_owned()
    };
    for &p in &ports {
        wait_until("a TLS cluster node", Duration::from_secs(10), || {
            out(tls_cli(p).arg("ping")) == "PONG"
        })
        .await;
    }
    let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let st = tls_cli(ports[0])
        .args(["--cluster", "create"])
        .args(&addrs)
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .stdout(std::process::Stdio::null())
        .status()
        .expect("redis-cli --cluster create");
    assert!(st.success(), "TLS cluster create failed");
    wait_until("TLS cluster_state:ok", Duration::from_secs(20), || {
        ports
            .iter()
            .all(|&p| out(tls_cli(p).args(["cluster", "info"])).contains("cluster_state:ok"))
    })
    .await;
    (ports, procs)
}

/// `rediss+cluster://` over mutual TLS: names on every master are granted, waited for and
/// handed off (the waiter's pub/sub connection is TLS too), and a wrong CA, a missing client
/// certificate or a plain-text URL are typed errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_cluster_over_mutual_tls_and_bad_certificates() {
    let (ports, _procs) = tls_cluster().await;
    let seeds: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let seeds = seeds.join(",");
    let (ca, c, k) = (cert("ca.pem"), cert("client.pem"), cert("client.key"));
    let prefix = fresh_prefix();
    let url =
        format!("rediss+cluster://{seeds}?prefix={prefix}&tls_ca={ca}&tls_cert={c}&tls_key={k}");
    let a = RedisLock::connect(&url).await.expect("TLS cluster connect");
    let b = RedisLock::connect(&url).await.expect("TLS cluster connect");
    // A name in each third of the slots: `--cluster create` gives each of the three masters
    // one third (0–5460, 5461–10922, 10923–16383).
    let mut thirds = std::collections::HashSet::new();
    let mut names = Vec::new();
    for i in 0..64 {
        let name = format!("tls-{i}");
        let third = match slot_of_tls(ports[0], &format!("{{={name}}}")) {
            0..=5460 => 0,
            5461..=10922 => 1,
            _ => 2,
        };
        if thirds.insert(third) {
            names.push(name);
        }
        if thirds.len() == 3 {
            break;
        }
    }
    assert_eq!(thirds.len(), 3, "names on every master");
    for name in &names {
        let l = a
            .acquire(name, opts(Duration::from_secs(10)))
            .await
            .expect("acquire over TLS");
        let waiter = {
            let (b, name) = (b.clone(), name.clone());
            tokio::spawn(async move { b.acquire(&name, opts(Duration::from_secs(10))).await })
        };
        let first = l.token();
        l.release().await.expect("release over TLS");
        let next = waiter.await.expect("waiter").expect("hand-off over TLS");
        assert!(next.token() > first, "{name}: tokens increase");
        next.release().await.expect("release over TLS");
    }
    let q = "connect_timeout=2s&response_timeout=2s";
    let cases = [
        (
            "wrong CA",
            format!(
                "rediss+cluster://{seeds}?{q}&tls_ca={}&tls_cert={c}&tls_key={k}",
                cert("other-ca.pem")
            ),
            "Auth",
        ),
        (
            "no client certificate",
            format!("rediss+cluster://{seeds}?{q}&tls_ca={ca}"),
            "Auth",
        ),
        (
            "plain client, TLS-only cluster",
            format!("redis+cluster://{seeds}?{q}"),
            "Unavailable",
        ),
    ];
    for (what, url, want) in cases {
        let start = Instant::now();
        let e = match lockkit::connect(&url).await {
            Ok(_) => panic!("{what}: connected"),
            Err(e) => e,
        };
        let got = match e {
            Error::Auth { .. } => "Auth",
            Error::Unavailable { .. } => "Unavailable",
            Error::InvalidConfig { .. } => "InvalidConfig",
            ref other => panic!("{what}: untyped {other:?}"),
        };
        eprintln!("{what}: {got} after {:?}: {e:#}", start.elapsed());
        assert_eq!(got, want, "{what}: {e:?}");
        let shown = format!("{e} {e:#} {e:?}");
        assert!(!shown.contains("PRIVATE KEY"), "{what}: {shown}");
    }
}

/// `CLUSTER KEYSLOT` over TLS.
fn slot_of_tls(port: u16, key: &str) -> u16 {
    let out = tls_cli(port)
        .args(["cluster", "keyslot", key])
        .output()
        .expect("redis-cli");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("keyslot")
}
