//! Redis: uncontended rows (the hand-written floor, `SET NX PX` + Lua compare-and-delete with the
//! redis crate, next to lockkit's try-once acquire + release and the peers rslock and
//! redis-lock), then the scenarios of issue #11, each variant interleaved with the others in
//! rotating order and repeated:
//!
//! - contention: 1, 4, 16, 64 clients (tasks in this process, each with its own client and
//!   connection) on one lock, empty and 100 µs critical sections: grants/s, fairness (min/max
//!   grants per client), client requests and Redis commands per grant (from the server's
//!   `INFO commandstats`, commands inside scripts included);
//! - hand-off: N = 1, 4, 16 queued waiters, release → next acquire returns (median, p99), and
//!   hand-off messages (PUBLISH) per release;
//! - many leases: 1,000 and 10,000 held leases on one client: time to acquire them, client RSS
//!   per lease (the client in a process of its own), renewal requests and commands per second
//!   from the server's counters.
//!
//! With `LOCKKIT_REDIS_CLUSTER_URL` set (`scripts/servers.sh`'s cluster topology), the same
//! floor done with the redis crate's cluster client and lockkit on `redis+cluster://` join the
//! uncontended rows, lockkit on the cluster joins the contention rotation, and hand-off runs on
//! the cluster follow the single node's; the peers run on one node only (issue #13).
//!
//! Writes Markdown tables and one SVG plot per scenario to `LOCKBENCH_REPORT` (a path, e.g.
//! `docs/benchmarks.md`; plots go to `benchmarks/` beside it) when set.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lockkit::redis::RedisLock;
use lockkit::redis::redis::{self, Script, aio::ConnectionManager};
use lockkit::{AcquireOptions, Lease, Lock, Wait};

use crate::{Row, env_or, interleaved, median, op, spread, url};
use crate::{many, scenario};

const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
";

/// The peers and lockkit, as contention variants.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Variant {
    Lockkit,
    Rslock,
    RedisLock,
    /// lockkit on `LOCKKIT_REDIS_CLUSTER_URL` (the peers run on one node only).
    LockkitCluster,
}

impl Variant {
    /// The single-node variants: lockkit and the peers.
    const ALL: [Variant; 3] = [Variant::Lockkit, Variant::Rslock, Variant::RedisLock];

    /// [`Variant::ALL`], then lockkit on the cluster when there is one.
    fn with_cluster(cluster: bool) -> Vec<Variant> {
        let mut v = Variant::ALL.to_vec();
        if cluster {
            v.push(Variant::LockkitCluster);
        }
        v
    }

    fn name(self) -> &'static str {
        match self {
            Variant::Lockkit => "lockkit",
            Variant::LockkitCluster => "lockkit Cluster",
            Variant::Rslock => "rslock 0.10",
            Variant::RedisLock => "redis-lock 0.5.1",
        }
    }

    /// The commands a client sends itself (the rest of `INFO commandstats` ran inside scripts):
    /// their calls, or with `"usec:"` prefixed keys the server's time in them (a script's time
    /// includes the commands it ran).
    fn requests(self, stats: &HashMap<String, u64>) -> u64 {
        self.top_level(stats, "")
    }

    /// Server time (µs) spent in the commands the clients sent.
    fn server_us(self, stats: &HashMap<String, u64>) -> u64 {
        self.top_level(stats, "usec:")
    }

    fn top_level(self, stats: &HashMap<String, u64>, kind: &str) -> u64 {
        let get = |c: &str| stats.get(&format!("{kind}{c}")).copied().unwrap_or(0);
        match self {
            Variant::Lockkit | Variant::LockkitCluster => get("evalsha") + get("eval"),
            // SET NX PX by the client, release as a script.
            Variant::Rslock | Variant::RedisLock => get("set") + get("evalsha") + get("eval"),
        }
    }
}

/// One client of a variant: acquires and releases the bench lock.
enum Client {
    Lockkit(RedisLock),
    Rslock(rslock::LockManager),
    RedisLock(Arc<tokio::sync::Mutex<redis027::aio::MultiplexedConnection>>),
}

const TTL: Duration = Duration::from_secs(10);

impl Client {
    async fn connect(v: Variant, base: &str, prefix: &str) -> Client {
        match v {
            Variant::Lockkit | Variant::LockkitCluster => {
                Client::Lockkit(lockkit_client(base, prefix).await)
            }
            Variant::Rslock => Client::Rslock(rslock::LockManager::new(vec![base.to_owned()])),
            Variant::RedisLock => {
                let c = redis027::Client::open(base).expect("redis027 client");
                Client::RedisLock(Arc::new(tokio::sync::Mutex::new(
                    c.get_multiplexed_async_connection()
                        .await
                        .expect("redis027 connection"),
                )))
            }
        }
    }

    /// Acquire (waiting), run `cs`, release.
    async fn cycle(&self, name: &str, cs: Duration) {
        match self {
            Client::Lockkit(l) => {
                let opts = AcquireOptions::new().ttl(TTL).wait(Wait::Forever);
                let lease = l.acquire(name, opts).await.expect("acquire");
                spin(cs);
                lease.release().await.expect("release");
            }
            Client::Rslock(m) => {
                let lock = m
                    .acquire_no_guard(name.as_bytes(), TTL)
                    .await
                    .expect("rslock");
                spin(cs);
                m.unlock(&lock).await;
            }
            Client::RedisLock(c) => {
                let options = redis_lock::LockAcrossOptions {
                    ttl: TTL,
                    duration: Duration::from_secs(600),
                    ..Default::default()
                };
                redis_lock::lock_across(
                    std::slice::from_ref(c),
                    name,
                    async move { spin(cs) },
                    options,
                )
                .await
                .expect("redis-lock");
            }
        }
    }
}

/// A lockkit client under `prefix`; `LOCKBENCH_LOCKKIT_PARAMS` (e.g. `notifications=off`) adds
/// URL parameters to lockkit's clients only, for A/B runs against the peers.
async fn lockkit_client(base: &str, prefix: &str) -> RedisLock {
    RedisLock::connect(&lockkit_url(base, prefix))
        .await
        .expect("lockkit connect")
}

/// lockkit's URL for the server at `base` with key prefix `prefix` (and `LOCKBENCH_LOCKKIT_PARAMS`).
fn lockkit_url(base: &str, prefix: &str) -> String {
    let sep = if base.contains('?') { '&' } else { '?' };
    let extra = std::env::var("LOCKBENCH_LOCKKIT_PARAMS")
        .map(|p| format!("&{p}"))
        .unwrap_or_default();
    format!("{base}{sep}prefix={prefix}{extra}")
}

/// A critical section of `d` of work (busy, as a computation would be: a timer sleep has
/// millisecond granularity).
fn spin(d: Duration) {
    if d.is_zero() {
        return;
    }
    let t = Instant::now();
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

/// Connections to the servers whose `INFO commandstats` count a variant's commands: the single
/// node, or each master of the cluster (a replica's counts would add the replicated writes).
struct Admin(Vec<ConnectionManager>);

async fn manager(url: &str) -> ConnectionManager {
    let client = redis::Client::open(url).expect("redis client");
    ConnectionManager::new(client)
        .await
        .expect("redis connection")
}

impl Admin {
    async fn node(url: &str) -> Admin {
        Admin(vec![manager(url).await])
    }

    /// The masters among the seed nodes of a `redis+cluster://h:p,h:p` URL.
    async fn cluster_masters(url: &str) -> Admin {
        let mut masters = Vec::new();
        for seed in cluster_seeds(url) {
            let mut conn = manager(&seed).await;
            let info: String = redis::cmd("INFO")
                .arg("replication")
                .query_async(&mut conn)
                .await
                .expect("INFO replication");
            if info.lines().any(|l| l.trim() == "role:master") {
                masters.push(conn);
            }
        }
        assert!(!masters.is_empty(), "no master among the cluster's seeds");
        Admin(masters)
    }
}

/// `redis://host:port` of each seed of a `redis+cluster://host:port,host:port` URL (the bench's
/// URLs from `scripts/servers.sh` carry no credentials or parameters).
fn cluster_seeds(url: &str) -> Vec<String> {
    let hosts = url
        .strip_prefix("redis+cluster://")
        .expect("a redis+cluster:// URL");
    let hosts = hosts.split(['/', '?']).next().unwrap_or_default();
    hosts.split(',').map(|h| format!("redis://{h}")).collect()
}

/// `INFO commandstats` summed over `admin`'s servers: calls per command and, under `"usec:"`
/// prefixed keys, the server's time in it.
async fn commandstats(admin: &mut Admin) -> HashMap<String, u64> {
    let mut out = HashMap::new();
    for conn in &mut admin.0 {
        for (k, n) in node_commandstats(conn).await {
            *out.entry(k).or_default() += n;
        }
    }
    out
}

async fn node_commandstats(conn: &mut ConnectionManager) -> HashMap<String, u64> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .expect("INFO");
    let mut out = HashMap::new();
    for l in info.lines() {
        let Some((cmd, rest)) = l
            .strip_prefix("cmdstat_")
            .and_then(|r| r.split_once(":calls="))
        else {
            continue;
        };
        let mut fields = rest.split(',');
        let calls = fields.next().and_then(|n| n.parse().ok());
        let usec = fields
            .next()
            .and_then(|f| f.strip_prefix("usec="))
            .and_then(|n| n.parse().ok());
        if let (Some(calls), Some(usec)) = (calls, usec) {
            out.insert(cmd.to_owned(), calls);
            out.insert(format!("usec:{cmd}"), usec);
        }
    }
    out
}

fn delta(after: &HashMap<String, u64>, before: &HashMap<String, u64>) -> HashMap<String, u64> {
    after
        .iter()
        .filter(|(c, _)| !c.ends_with("info"))
        .map(|(c, n)| (c.clone(), n - before.get(c).copied().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .collect()
}

/// One measured window of one contention variant.
#[derive(Clone, Debug)]
struct Window {
    grants_per_s: f64,
    fairness: f64,
    requests_per_grant: f64,
    commands_per_grant: f64,
    server_us_per_grant: f64,
}

async fn contention_window(
    variant: Variant,
    clients: &[Arc<Client>],
    name: &str,
    cs: Duration,
    length: Duration,
    admin: &mut Admin,
) -> Window {
    let stop = Arc::new(AtomicBool::new(false));
    let counts: Vec<Arc<AtomicU64>> = clients.iter().map(|_| Arc::default()).collect();
    let before = commandstats(admin).await;
    let started = Instant::now();
    let tasks: Vec<_> = clients
        .iter()
        .zip(&counts)
        .map(|(c, n)| {
            let (c, n, stop, name) = (c.clone(), n.clone(), stop.clone(), name.to_owned());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    c.cycle(&name, cs).await;
                    n.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    tokio::time::sleep(length).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.expect("client task");
    }
    let elapsed = started.elapsed();
    let stats = delta(&commandstats(admin).await, &before);
    let grants: Vec<u64> = counts.iter().map(|n| n.load(Ordering::Relaxed)).collect();
    let total: u64 = grants.iter().sum();
    let min = grants.iter().copied().min().unwrap_or(0);
    let max = grants.iter().copied().max().unwrap_or(0);
    let commands: u64 = stats
        .iter()
        .filter(|(c, _)| !c.starts_with("usec:"))
        .map(|(_, n)| n)
        .sum();
    Window {
        grants_per_s: total as f64 / elapsed.as_secs_f64(),
        fairness: if max == 0 {
            0.0
        } else {
            min as f64 / max as f64
        },
        requests_per_grant: variant.requests(&stats) as f64 / total.max(1) as f64,
        commands_per_grant: commands as f64 / total.max(1) as f64,
        server_us_per_grant: variant.server_us(&stats) as f64 / total.max(1) as f64,
    }
}

/// The contention windows of each variant for one (clients, critical section).
struct ContentionResult {
    clients: usize,
    cs: Duration,
    windows: HashMap<Variant, Vec<Window>>,
}

/// lockkit's median hand-off at 1 and 4 waiters and its median grants/s with 16 clients on one
/// lock (empty critical section).
fn lock_ref(cont: &[ContentionResult], hand: &[(usize, Vec<HandoffRun>)]) -> crate::slots::LockRef {
    let handoff = hand
        .iter()
        .filter(|(n, _)| *n == 1 || *n == 4)
        .map(|(n, runs)| {
            let mut all: Vec<Duration> = runs.iter().flat_map(|(l, _)| l.iter().copied()).collect();
            all.sort();
            (*n, all[all.len() / 2])
        })
        .collect();
    let grants16 = cont
        .iter()
        .find(|c| c.clients == 16 && c.cs.is_zero())
        .and_then(|c| c.windows.get(&Variant::Lockkit))
        .map(|w| median(&mut w.iter().map(|w| w.grants_per_s).collect::<Vec<_>>()));
    crate::slots::LockRef { handoff, grants16 }
}

/// The single node and, when `LOCKKIT_REDIS_CLUSTER_URL` is set, the cluster: each URL with
/// the connections that read its servers' counters.
struct Servers {
    base: String,
    admin: Admin,
    cluster: Option<(String, Admin)>,
}

impl Servers {
    async fn from_env() -> Servers {
        let base = url("LOCKKIT_REDIS_URL");
        let admin = Admin::node(&base).await;
        let cluster = match std::env::var("LOCKKIT_REDIS_CLUSTER_URL") {
            Ok(u) => {
                let a = Admin::cluster_masters(&u).await;
                Some((u, a))
            }
            Err(_) => None,
        };
        Servers {
            base,
            admin,
            cluster,
        }
    }

    fn variants(&self) -> Vec<Variant> {
        Variant::with_cluster(self.cluster.is_some())
    }

    /// The URL `v` connects to and the counters of its servers.
    fn of(&mut self, v: Variant) -> (&str, &mut Admin) {
        match (v, &mut self.cluster) {
            (Variant::LockkitCluster, Some((u, a))) => (u, a),
            _ => (&self.base, &mut self.admin),
        }
    }
}

async fn contention(servers: &mut Servers) -> Vec<ContentionResult> {
    let rounds: usize = env_or("LOCKBENCH_ROUNDS", 5);
    let length = Duration::from_millis(env_or("LOCKBENCH_WINDOW_MS", 600));
    let variants = servers.variants();
    let mut out = Vec::new();
    for clients in [1usize, 4, 16, 64] {
        let prefix = format!("lockbench-{:08x}", rand::random::<u32>());
        let mut pools: HashMap<Variant, Vec<Arc<Client>>> = HashMap::new();
        for &v in &variants {
            let base = servers.of(v).0.to_owned();
            let mut pool = Vec::new();
            for _ in 0..clients {
                pool.push(Arc::new(Client::connect(v, &base, &prefix).await));
            }
            pools.insert(v, pool);
        }
        for cs in [Duration::ZERO, Duration::from_micros(100)] {
            let mut windows: HashMap<Variant, Vec<Window>> = HashMap::new();
            for r in 0..rounds {
                for k in 0..variants.len() {
                    let v = variants[(k + r) % variants.len()];
                    let name = format!("{prefix}-c{clients}-{}", v.name().replace(' ', "-"));
                    let admin = servers.of(v).1;
                    let w = contention_window(v, &pools[&v], &name, cs, length, admin).await;
                    eprintln!(
                        "contention {clients:>2} clients, cs {cs:?}, {:<17} {:>9.0} grants/s \
                         fairness {:.2} requests/grant {:.2} commands/grant {:.1} server \
                         µs/grant {:.1}",
                        v.name(),
                        w.grants_per_s,
                        w.fairness,
                        w.requests_per_grant,
                        w.commands_per_grant,
                        w.server_us_per_grant
                    );
                    windows.entry(v).or_default().push(w);
                }
            }
            out.push(ContentionResult {
                clients,
                cs,
                windows,
            });
        }
    }
    out
}

/// One hand-off run: the latencies (sorted) and PUBLISH calls per release.
type HandoffRun = (Vec<Duration>, f64);

/// Hand-off latency: `waiters` + 1 lockkit clients take turns; each holds for 2 ms (so that all
/// others are queued), then releases. Samples release start → next acquire returns.
async fn handoff(base: &str, waiters: usize, samples: usize, admin: &mut Admin) -> HandoffRun {
    let prefix = format!("lockbench-{:08x}", rand::random::<u32>());
    let name = "handoff";
    let released_at = Arc::new(std::sync::Mutex::new(None::<Instant>));
    let lat = Arc::new(std::sync::Mutex::new(Vec::with_capacity(samples)));
    let stop = Arc::new(AtomicBool::new(false));
    let releases = Arc::new(AtomicU64::new(0));
    let mut clients = Vec::new();
    for _ in 0..=waiters {
        clients.push(lockkit_client(base, &prefix).await);
    }
    let before = commandstats(admin).await;
    let tasks: Vec<_> = clients
        .into_iter()
        .map(|l| {
            let (released_at, lat, stop, releases) = (
                released_at.clone(),
                lat.clone(),
                stop.clone(),
                releases.clone(),
            );
            tokio::spawn(async move {
                let opts = AcquireOptions::new().ttl(TTL).wait(Wait::Forever);
                while !stop.load(Ordering::Relaxed) {
                    let lease: Lease = l.acquire(name, opts.clone()).await.expect("acquire");
                    if let Some(t) = released_at.lock().unwrap().take() {
                        let mut lat = lat.lock().unwrap();
                        lat.push(t.elapsed());
                        if lat.len() >= samples {
                            stop.store(true, Ordering::Relaxed);
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    *released_at.lock().unwrap() = Some(Instant::now());
                    releases.fetch_add(1, Ordering::Relaxed);
                    lease.release().await.expect("release");
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("handoff task");
    }
    let stats = delta(&commandstats(admin).await, &before);
    // Classic PUBLISH on one server, SPUBLISH (sharded, within the slot) on a Cluster.
    let count = |c: &str| stats.get(c).copied().unwrap_or(0);
    let publishes = (count("publish") + count("spublish")) as f64;
    let mut lat = std::mem::take(&mut *lat.lock().unwrap());
    lat.sort();
    (
        lat,
        publishes / releases.load(Ordering::Relaxed).max(1) as f64,
    )
}

struct ManyResult {
    leases: usize,
    acquire_time: Duration,
    rss_per_lease: f64,
    requests_per_s: f64,
    commands_per_s: f64,
    per_lease_requests_per_s: f64,
}

/// `n` leases held by one client with keepalive (TTL 3 s: a tick every second) in a process of
/// its own ([`many::hold`]), then the server's counters over 4 s.
async fn many(base: &str, n: usize, admin: &mut Admin) -> ManyResult {
    let prefix = format!("lockbench-{:08x}", rand::random::<u32>());
    let ttl = Duration::from_secs(3);
    let (holder, acquired) = many::hold(&lockkit_url(base, &prefix), n).await;
    assert_eq!(acquired.error, None, "acquire");
    let window = Duration::from_secs(4);
    let before = commandstats(admin).await;
    tokio::time::sleep(window).await;
    let stats = delta(&commandstats(admin).await, &before);
    assert_eq!(holder.finish().await, n, "leases lost while kept alive");
    let secs = window.as_secs_f64();
    ManyResult {
        leases: n,
        acquire_time: acquired.acquire_time,
        rss_per_lease: acquired.rss_per_lease,
        requests_per_s: Variant::Lockkit.requests(&stats) as f64 / secs,
        commands_per_s: stats
            .iter()
            .filter(|(c, _)| !c.starts_with("usec:"))
            .map(|(_, n)| *n)
            .sum::<u64>() as f64
            / secs,
        per_lease_requests_per_s: n as f64 / (ttl / 3).as_secs_f64(),
    }
}

pub async fn run(iters: usize) -> Vec<Row> {
    let base = url("LOCKKIT_REDIS_URL");
    let prefix = format!("lockbench-{:08x}", rand::random::<u32>());

    let client = redis::Client::open(base.as_str()).expect("redis client");
    let conn = ConnectionManager::new(client)
        .await
        .expect("redis connection");
    let release = Script::new(RELEASE);
    let floor_key = format!("{prefix}:floor");
    let cluster_key = format!("{prefix}:cluster-floor");
    let rs_name = format!("{prefix}-rslock");
    let rl_name = format!("{prefix}-redis-lock");
    let locks = lockkit_client(&base, &prefix).await;
    let rslock = Client::connect(Variant::Rslock, &base, &prefix).await;
    let redis_lock = Client::connect(Variant::RedisLock, &base, &prefix).await;
    let opts = AcquireOptions::new()
        .ttl(Duration::from_secs(10))
        .wait(Wait::No)
        .keepalive(true);
    // Redlock over the five nodes of `scripts/servers.sh`'s redlock topology, next to one node.
    let redlock = match std::env::var("LOCKKIT_REDLOCK_URL") {
        Ok(u) => {
            let sep = if u.contains('?') { '&' } else { '?' };
            Some(
                lockkit::redis::RedlockLock::connect(&format!("{u}{sep}prefix={prefix}"))
                    .await
                    .expect("redlock connect"),
            )
        }
        Err(_) => None,
    };
    // The same floor and lockkit on the cluster of `scripts/servers.sh`'s cluster topology:
    // the redis crate's cluster client sends both commands to the key's master.
    let cluster = match std::env::var("LOCKKIT_REDIS_CLUSTER_URL") {
        Ok(u) => {
            let client = redis::cluster::ClusterClient::new(cluster_seeds(&u))
                .expect("redis cluster client");
            let conn = client
                .get_async_connection()
                .await
                .expect("redis cluster connection");
            Some((conn, lockkit_client(&u, &prefix).await))
        }
        Err(_) => None,
    };
    let floor = op(|| floor_cycle(conn.clone(), &release, &floor_key));
    let lockkit = op(|| async {
        let l = locks.acquire("bench", opts.clone()).await.expect("acquire");
        l.release().await.expect("release");
    });
    let rs = op(|| rslock.cycle(&rs_name, Duration::ZERO));
    let rl = op(|| redis_lock.cycle(&rl_name, Duration::ZERO));
    let mut ops = vec![
        ("floor: SET NX PX + Lua compare-and-delete", floor),
        ("lockkit acquire + release", lockkit),
        ("rslock 0.10 lock + unlock", rs),
        ("redis-lock 0.5.1 lock_across", rl),
    ];
    if let Some(redlock) = &redlock {
        let opts = &opts;
        ops.push((
            "lockkit Redlock (5 nodes) acquire + release",
            op(move || async move {
                let l = redlock
                    .acquire("bench", opts.clone())
                    .await
                    .expect("acquire");
                l.release().await.expect("release");
            }),
        ));
    }
    if let Some((conn, locks)) = &cluster {
        let (opts, release, key) = (&opts, &release, &cluster_key);
        ops.push((
            CLUSTER_FLOOR,
            op(move || floor_cycle(conn.clone(), release, key)),
        ));
        ops.push((
            CLUSTER_LOCKKIT,
            op(move || async move {
                let l = locks.acquire("bench", opts.clone()).await.expect("acquire");
                l.release().await.expect("release");
            }),
        ));
    }
    let mut rows = interleaved("redis", ops, (iters / 10).max(10), iters).await;
    // The cluster's rows: their own group, ratios to the cluster's floor.
    for r in &mut rows {
        if r.what == CLUSTER_FLOOR || r.what == CLUSTER_LOCKKIT {
            r.backend = "redis-cluster";
        }
    }
    rows
}

/// The uncontended row of the floor on the cluster.
const CLUSTER_FLOOR: &str = "Cluster floor: SET NX PX + Lua compare-and-delete (cluster client)";
/// The uncontended row of lockkit on the cluster.
const CLUSTER_LOCKKIT: &str = "lockkit Cluster acquire + release";

/// One floor cycle on `conn`: `SET key owner NX PX 10000`, then the compare-and-delete script.
async fn floor_cycle(mut conn: impl redis::aio::ConnectionLike, release: &Script, key: &str) {
    let owner = format!("{:032x}", rand::random::<u128>());
    let set: Option<String> = redis::cmd("SET")
        .arg(key)
        .arg(&owner)
        .arg("NX")
        .arg("PX")
        .arg(10_000)
        .query_async(&mut conn)
        .await
        .expect("SET");
    assert!(set.is_some(), "floor lock held");
    let n: i64 = release
        .key(key)
        .arg(&owner)
        .invoke_async(&mut conn)
        .await
        .expect("release");
    assert_eq!(n, 1);
}

/// The issue-#11 scenarios: the report's Redis section; the plots go into `plots`.
/// The Redis scenarios' Markdown, and what lockkit's lock measured for the slot ratios.
pub async fn scenarios(
    uncontended: &[Row],
    plots: Option<&std::path::Path>,
) -> (String, crate::slots::LockRef) {
    let mut servers = Servers::from_env().await;
    let started = Instant::now();
    let cont = contention(&mut servers).await;
    let handoff_samples: usize = env_or("LOCKBENCH_HANDOFFS", 300);
    let mut hand = Vec::new();
    let mut cluster_hand = Vec::new();
    for n in [1usize, 4, 16] {
        let (mut runs, mut cluster_runs) = (Vec::new(), Vec::new());
        for _ in 0..2 {
            let (base, admin) = servers.of(Variant::Lockkit);
            runs.push(handoff(base, n, handoff_samples, admin).await);
            if let Some((base, admin)) = &mut servers.cluster {
                cluster_runs.push(handoff(base, n, handoff_samples, admin).await);
            }
        }
        let medians = |runs: &[HandoffRun]| {
            runs.iter()
                .map(|(l, w)| (l[l.len() / 2], *w))
                .collect::<Vec<_>>()
        };
        eprintln!(
            "handoff N={n}: {:?}, cluster {:?}",
            medians(&runs),
            medians(&cluster_runs)
        );
        hand.push((n, runs));
        if !cluster_runs.is_empty() {
            cluster_hand.push((n, cluster_runs));
        }
    }
    let base = servers.base.clone();
    let mut manies = Vec::new();
    for n in [1_000usize, 10_000] {
        let m = many(&base, n, &mut servers.admin).await;
        eprintln!(
            "many {n}: acquire {:?}, {:.0} B/lease, {:.1} requests/s, {:.0} commands/s",
            m.acquire_time, m.rss_per_lease, m.requests_per_s, m.commands_per_s
        );
        manies.push(m);
    }
    let mut md = report(uncontended, &cont, &hand, &manies, started.elapsed());
    if servers.cluster.is_some() {
        md.push_str(&cluster_report(uncontended, &cont, &hand, &cluster_hand));
    }
    let lock_ref = lock_ref(&cont, &hand);
    let Some(dir) = plots else {
        return (md, lock_ref);
    };
    crate::plot::lines(
        &dir.join("redis-contention.svg"),
        "Redis: clients on one lock (median grants/s)",
        "clients",
        "grants/s",
        &contention_series(&cont),
    );
    let handoff_medians = hand
        .iter()
        .map(|(n, runs)| {
            let mut m: Vec<f64> = runs
                .iter()
                .map(|(l, _)| l[l.len() / 2].as_secs_f64() * 1e6)
                .collect();
            (*n as f64, median(&mut m))
        })
        .collect();
    crate::plot::lines(
        &dir.join("redis-handoff.svg"),
        "Redis hand-off: release → next acquire returns (median, µs)",
        "queued waiters",
        "µs",
        &[("lockkit".to_owned(), handoff_medians)],
    );
    crate::plot::lines(
        &dir.join("redis-many-leases.svg"),
        "Redis keepalive traffic for held leases (requests/s)",
        "held leases",
        "requests/s",
        &[
            (
                "lockkit (batched)".to_owned(),
                manies
                    .iter()
                    .map(|m| (m.leases as f64, m.requests_per_s))
                    .collect(),
            ),
            (
                "one script per lease per TTL/3".to_owned(),
                manies
                    .iter()
                    .map(|m| (m.leases as f64, m.per_lease_requests_per_s))
                    .collect(),
            ),
        ],
    );
    (md, lock_ref)
}

fn contention_series(cont: &[ContentionResult]) -> Vec<(String, Vec<(f64, f64)>)> {
    let cluster = cont
        .iter()
        .all(|c| c.windows.contains_key(&Variant::LockkitCluster));
    let mut out = Vec::new();
    for cs in [Duration::ZERO, Duration::from_micros(100)] {
        for v in Variant::with_cluster(cluster) {
            let pts = cont
                .iter()
                .filter(|c| c.cs == cs)
                .map(|c| {
                    let mut g: Vec<f64> = c.windows[&v].iter().map(|w| w.grants_per_s).collect();
                    (c.clients as f64, median(&mut g))
                })
                .collect();
            out.push((format!("{} ({})", v.name(), cs_label(cs)), pts));
        }
    }
    out
}

fn cs_label(cs: Duration) -> String {
    if cs.is_zero() {
        "empty".to_owned()
    } else {
        format!("{} µs", cs.as_micros())
    }
}

fn report(
    uncontended: &[Row],
    cont: &[ContentionResult],
    hand: &[(usize, Vec<HandoffRun>)],
    manies: &[ManyResult],
    total: Duration,
) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "## Redis (issue #11)\n");
    let _ = writeln!(
        md,
        "Peers: rslock 0.10 and redis-lock 0.5.1 (see `../shared/peers.md`). These scenarios \
         took {:.0} s.\n",
        total.as_secs_f64()
    );
    let redis_rows: Vec<&Row> = uncontended
        .iter()
        .filter(|r| r.backend == "redis")
        .collect();
    let floor = redis_rows.first().map(|r| r.median);
    let _ = writeln!(md, "### Uncontended acquire + release (one client)\n");
    let _ = writeln!(
        md,
        "| sequence | ratio to floor | median | p99 |\n|---|---|---|---|"
    );
    for r in &redis_rows {
        let ratio = floor.map_or(1.0, |f| r.median.as_secs_f64() / f.as_secs_f64());
        let _ = writeln!(
            md,
            "| {} | **{ratio:.2}×** | {:.1} µs | {:.1} µs |",
            r.what,
            r.median.as_secs_f64() * 1e6,
            r.p99.as_secs_f64() * 1e6
        );
    }
    let _ = writeln!(
        md,
        "\n### Contention: clients on one lock\n\nEach cell: median of the windows (min–max in \
         brackets). Ratio = lockkit's median grants/s over the best peer's. Fairness = min/max \
         grants per client in a window. Requests = commands the clients sent; commands = all \
         commands the server ran, inside scripts too; server µs = the server's time in the \
         clients' commands (scripts included), all from `INFO commandstats`.\n"
    );
    let _ = writeln!(
        md,
        "| clients | critical section | ratio to best peer | lockkit grants/s | rslock grants/s \
         | redis-lock grants/s | fairness lockkit / rslock / redis-lock | requests per grant \
         lockkit / rslock / redis-lock | commands per grant lockkit / rslock / redis-lock | \
         server µs per grant lockkit / rslock / redis-lock |\n\
         |---|---|---|---|---|---|---|---|---|---|"
    );
    for c in cont {
        let of = |v: Variant, f: fn(&Window) -> f64| -> Vec<f64> {
            c.windows[&v].iter().map(f).collect()
        };
        let cell = |v: Variant, f: fn(&Window) -> f64| {
            let mut xs = of(v, f);
            let (lo, hi) = spread(&xs);
            format!("{:.0} ({lo:.0}–{hi:.0})", median(&mut xs))
        };
        let med = |v: Variant| median(&mut of(v, |w| w.grants_per_s));
        let best_peer = med(Variant::Rslock).max(med(Variant::RedisLock));
        let three = |f: fn(&Window) -> f64, prec: usize| {
            Variant::ALL
                .iter()
                .map(|v| format!("{:.prec$}", median(&mut of(*v, f))))
                .collect::<Vec<_>>()
                .join(" / ")
        };
        let _ = writeln!(
            md,
            "| {} | {} | **{:.2}×** | {} | {} | {} | {} | {} | {} | {} |",
            c.clients,
            cs_label(c.cs),
            med(Variant::Lockkit) / best_peer.max(1e-9),
            cell(Variant::Lockkit, |w| w.grants_per_s),
            cell(Variant::Rslock, |w| w.grants_per_s),
            cell(Variant::RedisLock, |w| w.grants_per_s),
            three(|w| w.fairness, 2),
            three(|w| w.requests_per_grant, 2),
            three(|w| w.commands_per_grant, 1),
            three(|w| w.server_us_per_grant, 1),
        );
    }
    let _ = writeln!(md, "\n![contention](benchmarks/redis-contention.svg)\n");
    let _ = writeln!(
        md,
        "### Hand-off: release → the next queued waiter's acquire returns (lockkit)\n\nTwo runs \
         per N; hand-off messages = PUBLISH calls per release (1 = exactly one waiter told).\n"
    );
    let _ = writeln!(
        md,
        "| queued waiters | median | p99 | hand-off messages per release |\n|---|---|---|---|"
    );
    for (n, runs) in hand {
        let at = |q: usize| {
            runs.iter()
                .map(|(l, _)| format!("{:.0} µs", l[(l.len() - 1) * q / 100].as_secs_f64() * 1e6))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let wakes: Vec<String> = runs.iter().map(|(_, w)| format!("{w:.2}")).collect();
        let _ = writeln!(
            md,
            "| {n} | {} | {} | {} |",
            at(50),
            at(99),
            wakes.join(", ")
        );
    }
    let _ = writeln!(md, "\n![hand-off](benchmarks/redis-handoff.svg)\n");
    let _ = writeln!(
        md,
        "### Many held leases on one client (TTL 3 s, keepalive on)\n\nRenewal traffic over 4 s \
         from the server's counters; the per-lease column is what one renewal script per lease \
         per TTL/3 (core's keepalive, before) sends. RSS = the resident memory growth, while \
         acquiring, of the client's process (one of its own, `many.rs`), per lease.\n"
    );
    let _ = writeln!(
        md,
        "| leases | renewal requests/s | vs one script per lease | renewal commands/s (inside \
         scripts too) | time to acquire all | client RSS per lease |\n|---|---|---|---|---|---|"
    );
    for m in manies {
        let _ = writeln!(
            md,
            "| {} | {:.1} | **{:.4}×** of {:.0}/s | {:.0} | {:.2} s | {:.0} B |",
            m.leases,
            m.requests_per_s,
            m.requests_per_s / m.per_lease_requests_per_s,
            m.per_lease_requests_per_s,
            m.commands_per_s,
            m.acquire_time.as_secs_f64(),
            m.rss_per_lease
        );
    }
    let _ = writeln!(md, "\n![many leases](benchmarks/redis-many-leases.svg)");
    md
}

/// The Redis Cluster rows: lockkit on the cluster next to the floor on the cluster and, from the
/// same interleaved run, the single node's floor, lockkit and peers.
fn cluster_report(
    uncontended: &[Row],
    cont: &[ContentionResult],
    hand: &[(usize, Vec<HandoffRun>)],
    cluster_hand: &[(usize, Vec<HandoffRun>)],
) -> String {
    let mut md = String::new();
    let find = |backend: &str, what: &str| {
        uncontended
            .iter()
            .find(|r| r.backend == backend && r.what.starts_with(what))
            .map(|r| r.median.as_secs_f64())
    };
    let floor = find("redis", "floor:");
    let single = find("redis", "lockkit acquire");
    let cluster_floor = find("redis-cluster", CLUSTER_FLOOR);
    let ratio = |x: f64, of: Option<f64>| of.map_or("–".to_owned(), |f| format!("{:.2}×", x / f));
    let _ = writeln!(
        md,
        "\n### Redis Cluster (3 masters, each with a replica; `scripts/servers.sh` cluster)\n\nlockkit on `redis+cluster://` (the three masters as seeds) next to the same floor done with the redis crate's cluster client (it sends `SET` and the script to the key's master). The peers run on one node only, so the Cluster rows are compared with the Cluster floor and with the single node's floor and lockkit, measured interleaved in the same run.\n"
    );
    let _ = writeln!(
        md,
        "| sequence | ratio to Cluster floor | ratio to single-node floor | ratio to single-node lockkit | median | p99 |\n|---|---|---|---|---|---|"
    );
    for r in uncontended.iter().filter(|r| r.backend == "redis-cluster") {
        let m = r.median.as_secs_f64();
        let _ = writeln!(
            md,
            "| {} | **{}** | {} | {} | {:.1} µs | {:.1} µs |",
            r.what,
            ratio(m, cluster_floor),
            ratio(m, floor),
            ratio(m, single),
            m * 1e6,
            r.p99.as_secs_f64() * 1e6
        );
    }
    let _ = writeln!(
        md,
        "\n#### Contention: clients on one lock, on the Cluster\n\nWindows interleaved with the single-node variants above (same rotation). Ratios of medians: to single-node lockkit and to the best single-node peer. Requests, commands and server µs summed over the masters' `INFO commandstats`.\n"
    );
    let _ = writeln!(
        md,
        "| clients | critical section | lockkit Cluster grants/s | ratio to single-node lockkit | ratio to best single-node peer | fairness | requests per grant | commands per grant | server µs per grant |\n|---|---|---|---|---|---|---|---|---|"
    );
    for c in cont {
        let Some(ws) = c.windows.get(&Variant::LockkitCluster) else {
            continue;
        };
        let of = |v: Variant, f: fn(&Window) -> f64| -> Vec<f64> {
            c.windows
                .get(&v)
                .map_or(Vec::new(), |w| w.iter().map(f).collect())
        };
        let med = |v: Variant| median(&mut of(v, |w| w.grants_per_s));
        let mut g: Vec<f64> = ws.iter().map(|w| w.grants_per_s).collect();
        let (lo, hi) = spread(&g);
        let mine = median(&mut g);
        let best_peer = med(Variant::Rslock).max(med(Variant::RedisLock));
        let m = |f: fn(&Window) -> f64| median(&mut of(Variant::LockkitCluster, f));
        let _ = writeln!(
            md,
            "| {} | {} | {mine:.0} ({lo:.0}–{hi:.0}) | **{:.2}×** | {:.2}× | {:.2} | {:.2} | {:.1} | {:.1} |",
            c.clients,
            cs_label(c.cs),
            mine / med(Variant::Lockkit).max(1e-9),
            mine / best_peer.max(1e-9),
            m(|w| w.fairness),
            m(|w| w.requests_per_grant),
            m(|w| w.commands_per_grant),
            m(|w| w.server_us_per_grant),
        );
    }
    let _ = writeln!(
        md,
        "\n#### Hand-off on the Cluster: release → the next queued waiter's acquire returns\n\nTwo runs per N, each right after the single-node run of the same N; hand-off messages = PUBLISH calls per release on the masters.\n"
    );
    let _ = writeln!(
        md,
        "| queued waiters | median | p99 | ratio of medians to single node | hand-off messages per release |\n|---|---|---|---|---|"
    );
    let median_of = |runs: &[HandoffRun]| {
        let mut all: Vec<Duration> = runs.iter().flat_map(|(l, _)| l.iter().copied()).collect();
        all.sort();
        all.get(all.len() / 2).copied()
    };
    for (n, runs) in cluster_hand {
        let at = |q: usize| {
            runs.iter()
                .map(|(l, _)| format!("{:.0} µs", l[(l.len() - 1) * q / 100].as_secs_f64() * 1e6))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let single = hand
            .iter()
            .find(|(m, _)| m == n)
            .and_then(|(_, r)| median_of(r));
        let ratio = match (median_of(runs), single) {
            (Some(c), Some(s)) => format!("{:.2}×", c.as_secs_f64() / s.as_secs_f64()),
            _ => "–".to_owned(),
        };
        let wakes: Vec<String> = runs.iter().map(|(_, w)| format!("{w:.2}")).collect();
        let _ = writeln!(
            md,
            "| {n} | {} | {} | {ratio} | {} |",
            at(50),
            at(99),
            wakes.join(", ")
        );
    }
    md
}

/// A whole acquire + release cycle of a Redis variant as one scenario grant (redis-lock only
/// runs a closure under its lock, so acquire and release are not apart): for the contention
/// block of separate processes only.
struct Cycle(Client);
struct Done;

impl scenario::Held for Done {
    fn release(self: Box<Self>) -> scenario::BoxFut<'static, ()> {
        Box::pin(async {})
    }
}

impl scenario::Client for Cycle {
    fn acquire<'a>(&'a self, name: &'a str) -> scenario::BoxFut<'a, Box<dyn scenario::Held>> {
        Box::pin(async move {
            self.0.cycle(name, Duration::ZERO).await;
            Box::new(Done) as Box<dyn scenario::Held>
        })
    }
}

/// `INFO commandstats`: every command the server ran (inside scripts too).
struct CommandStats(tokio::sync::Mutex<Admin>);

impl scenario::Counters for CommandStats {
    fn read(&self, _variant: usize) -> scenario::BoxFut<'_, scenario::Counts> {
        Box::pin(async move {
            let stats = commandstats(&mut *self.0.lock().await).await;
            scenario::Counts {
                requests: stats
                    .iter()
                    .filter(|(c, _)| !c.starts_with("usec:") && !c.ends_with("info"))
                    .map(|(_, n)| *n as f64)
                    .sum(),
                writes: f64::NAN,
                wakes: f64::NAN,
            }
        })
    }
}

/// Redis for the scenarios' contention block of separate processes (the rest is above).
pub async fn spec(prefix: &str) -> scenario::Spec {
    let base = url("LOCKKIT_REDIS_URL");
    let admin = Admin::node(&base).await;
    let variants = Variant::ALL
        .iter()
        .map(|&v| {
            let (base, prefix) = (base.clone(), prefix.to_owned());
            scenario::Variant {
                name: v.name().to_owned(),
                connect: Arc::new(move || {
                    let (base, prefix) = (base.clone(), prefix.clone());
                    Box::pin(async move {
                        Box::new(Cycle(Client::connect(v, &base, &prefix).await))
                            as Box<dyn scenario::Client>
                    })
                }),
            }
        })
        .collect();
    scenario::Spec {
        backend: "redis",
        title: "Redis",
        variants,
        counters: Arc::new(CommandStats(tokio::sync::Mutex::new(admin))),
        labels: scenario::Labels {
            requests: "Redis commands the server ran (`INFO commandstats`, inside scripts too)",
            writes: None,
            wakes: None,
        },
        lockkit_url: String::new(),
        notes: "Each client a process of its own (this binary re-executed), empty critical \
                section.",
        procs_only: true,
    }
}
