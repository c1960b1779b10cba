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
//!   per lease, renewal requests and commands per second from the server's counters.
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

use crate::scenario;
use crate::{Row, env_or, interleaved, median, op, spread, url};

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
}

impl Variant {
    const ALL: [Variant; 3] = [Variant::Lockkit, Variant::Rslock, Variant::RedisLock];

    fn name(self) -> &'static str {
        match self {
            Variant::Lockkit => "lockkit",
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
            Variant::Lockkit => get("evalsha") + get("eval"),
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
            Variant::Lockkit => Client::Lockkit(lockkit_client(base, prefix).await),
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
    let sep = if base.contains('?') { '&' } else { '?' };
    let extra = std::env::var("LOCKBENCH_LOCKKIT_PARAMS")
        .map(|p| format!("&{p}"))
        .unwrap_or_default();
    RedisLock::connect(&format!("{base}{sep}prefix={prefix}{extra}"))
        .await
        .expect("lockkit connect")
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

async fn commandstats(conn: &mut ConnectionManager) -> HashMap<String, u64> {
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
    admin: &mut ConnectionManager,
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

async fn contention(base: &str, admin: &mut ConnectionManager) -> Vec<ContentionResult> {
    let rounds: usize = env_or("LOCKBENCH_ROUNDS", 5);
    let length = Duration::from_millis(env_or("LOCKBENCH_WINDOW_MS", 600));
    let mut out = Vec::new();
    for clients in [1usize, 4, 16, 64] {
        let prefix = format!("lockbench-{:08x}", rand::random::<u32>());
        let mut pools: HashMap<Variant, Vec<Arc<Client>>> = HashMap::new();
        for v in Variant::ALL {
            let mut pool = Vec::new();
            for _ in 0..clients {
                pool.push(Arc::new(Client::connect(v, base, &prefix).await));
            }
            pools.insert(v, pool);
        }
        for cs in [Duration::ZERO, Duration::from_micros(100)] {
            let mut windows: HashMap<Variant, Vec<Window>> = HashMap::new();
            for r in 0..rounds {
                for k in 0..Variant::ALL.len() {
                    let v = Variant::ALL[(k + r) % Variant::ALL.len()];
                    let name = format!("{prefix}-c{clients}-{}", v.name().replace(' ', "-"));
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
async fn handoff(
    base: &str,
    waiters: usize,
    samples: usize,
    admin: &mut ConnectionManager,
) -> HandoffRun {
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
    let publishes = stats.get("publish").copied().unwrap_or(0) as f64;
    let mut lat = std::mem::take(&mut *lat.lock().unwrap());
    lat.sort();
    (
        lat,
        publishes / releases.load(Ordering::Relaxed).max(1) as f64,
    )
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

struct ManyResult {
    leases: usize,
    acquire_time: Duration,
    rss_per_lease: f64,
    requests_per_s: f64,
    commands_per_s: f64,
    per_lease_requests_per_s: f64,
}

/// `n` leases held by one client with keepalive (TTL 3 s: a tick every second), then the
/// server's counters over 4 s.
async fn many(base: &str, n: usize, admin: &mut ConnectionManager) -> ManyResult {
    let prefix = format!("lockbench-{:08x}", rand::random::<u32>());
    let locks = lockkit_client(base, &prefix).await;
    let ttl = Duration::from_secs(3);
    let opts = AcquireOptions::new().ttl(ttl).wait(Wait::No);
    let names: Vec<String> = (0..n).map(|i| format!("many-{i}")).collect();
    let rss0 = rss_bytes();
    let t = Instant::now();
    let mut leases = Vec::with_capacity(n);
    for chunk in names.chunks(256) {
        let got = futures_util::future::join_all(
            chunk.iter().map(|name| locks.acquire(name, opts.clone())),
        )
        .await;
        leases.extend(got.into_iter().map(|l| l.expect("acquire")));
    }
    let acquire_time = t.elapsed();
    let rss1 = rss_bytes();
    let window = Duration::from_secs(4);
    let before = commandstats(admin).await;
    tokio::time::sleep(window).await;
    let stats = delta(&commandstats(admin).await, &before);
    let held = leases
        .iter()
        .filter(|l| l.state() != lockkit::LeaseState::Lost)
        .count();
    assert_eq!(held, n, "leases lost while kept alive");
    let secs = window.as_secs_f64();
    let r = ManyResult {
        leases: n,
        acquire_time,
        rss_per_lease: rss1.saturating_sub(rss0) as f64 / n as f64,
        requests_per_s: Variant::Lockkit.requests(&stats) as f64 / secs,
        commands_per_s: stats
            .iter()
            .filter(|(c, _)| !c.starts_with("usec:"))
            .map(|(_, n)| *n)
            .sum::<u64>() as f64
            / secs,
        per_lease_requests_per_s: n as f64 / (ttl / 3).as_secs_f64(),
    };
    while !leases.is_empty() {
        let tail = leases.split_off(leases.len().saturating_sub(256));
        futures_util::future::join_all(tail.into_iter().map(|l| l.release())).await;
    }
    r
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
    let floor = op(|| {
        let mut conn = conn.clone();
        let (release, key) = (&release, &floor_key);
        async move {
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
    });
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
    interleaved("redis", ops, (iters / 10).max(10), iters).await
}

/// The issue-#11 scenarios: the report's Redis section; the plots go into `plots`.
/// The Redis scenarios' Markdown, and what lockkit's lock measured for the slot ratios.
pub async fn scenarios(
    uncontended: &[Row],
    plots: Option<&std::path::Path>,
) -> (String, crate::slots::LockRef) {
    let base = url("LOCKKIT_REDIS_URL");
    let client = redis::Client::open(base.as_str()).expect("redis client");
    let mut admin = ConnectionManager::new(client)
        .await
        .expect("redis connection");
    let started = Instant::now();
    let cont = contention(&base, &mut admin).await;
    let handoff_samples: usize = env_or("LOCKBENCH_HANDOFFS", 300);
    let mut hand = Vec::new();
    for n in [1usize, 4, 16] {
        let mut runs = Vec::new();
        for _ in 0..2 {
            runs.push(handoff(&base, n, handoff_samples, &mut admin).await);
        }
        eprintln!(
            "handoff N={n}: {:?}",
            runs.iter()
                .map(|(l, w)| (l[l.len() / 2], *w))
                .collect::<Vec<_>>()
        );
        hand.push((n, runs));
    }
    let mut manies = Vec::new();
    for n in [1_000usize, 10_000] {
        let m = many(&base, n, &mut admin).await;
        eprintln!(
            "many {n}: acquire {:?}, {:.0} B/lease, {:.1} requests/s, {:.0} commands/s",
            m.acquire_time, m.rss_per_lease, m.requests_per_s, m.commands_per_s
        );
        manies.push(m);
    }
    let md = report(uncontended, &cont, &hand, &manies, started.elapsed());
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
    let mut out = Vec::new();
    for cs in [Duration::ZERO, Duration::from_micros(100)] {
        for v in Variant::ALL {
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
         per TTL/3 (core's keepalive, before) sends.\n"
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
struct CommandStats(tokio::sync::Mutex<ConnectionManager>);

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
    let admin = ConnectionManager::new(redis::Client::open(base.as_str()).expect("redis client"))
        .await
        .expect("redis connection");
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
