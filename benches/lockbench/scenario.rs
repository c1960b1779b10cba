//! The issue-#11 scenarios for any backend, lockkit next to its peer(s), variants interleaved in
//! rotating order and repeated (windows):
//!
//! - contention: 1, 4, 16 clients on one lock as tasks in this process (each with its own client
//!   and connection), and `LOCKBENCH_PROCS` (16) clients as separate processes (this binary
//!   re-executed as a worker, see [`worker`]): grants/s, fairness (min/max grants per client),
//!   requests (and writes) per grant from the server's own counters;
//! - hand-off: N = 1, 4, 16 queued waiters, release → the next acquire returns (median, p99),
//!   wakes per release where the server counts them;
//! - many leases (lockkit): 1,000 and 10,000 held with keepalive, time to acquire all, client RSS
//!   per lease (the client in a process of its own), renewal requests/s from the server's
//!   counters.
//!
//! A backend module describes itself as a [`Spec`]: its variants (lockkit first) and its
//! [`Counters`].

use std::fmt::Write as _;
use std::future::Future;
use std::ops::Sub;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lockkit::{AcquireOptions, Lease, Lock, Wait};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::{Row, env_or, many, median, spread};

pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A held lock of some variant.
pub trait Held: Send {
    fn release(self: Box<Self>) -> BoxFut<'static, ()>;
}

/// One client (its own connection) of a variant.
pub trait Client: Send + Sync {
    /// Acquires `name`, waiting as long as it takes.
    fn acquire<'a>(&'a self, name: &'a str) -> BoxFut<'a, Box<dyn Held>>;
}

pub type Connect = Arc<dyn Fn() -> BoxFut<'static, Box<dyn Client>> + Send + Sync>;

/// lockkit or a peer.
pub struct Variant {
    pub name: String,
    pub connect: Connect,
}

/// Lease TTL of the contention and hand-off clients.
pub const TTL: Duration = Duration::from_secs(10);

struct LockkitClient(Arc<dyn Lock>);
struct LockkitHeld(Lease);

impl Held for LockkitHeld {
    fn release(self: Box<Self>) -> BoxFut<'static, ()> {
        Box::pin(async move { self.0.release().await.expect("lockkit release") })
    }
}

impl Client for LockkitClient {
    fn acquire<'a>(&'a self, name: &'a str) -> BoxFut<'a, Box<dyn Held>> {
        Box::pin(async move {
            let opts = AcquireOptions::new().ttl(TTL).wait(Wait::Forever);
            let lease = self.0.acquire(name, opts).await.expect("lockkit acquire");
            Box::new(LockkitHeld(lease)) as Box<dyn Held>
        })
    }
}

/// lockkit through `lockkit::connect(url)`.
pub fn lockkit(url: String) -> Variant {
    Variant {
        name: "lockkit".to_owned(),
        connect: Arc::new(move || {
            let url = url.clone();
            Box::pin(async move {
                let l = lockkit::connect(&url).await.expect("lockkit connect");
                Box::new(LockkitClient(l)) as Box<dyn Client>
            })
        }),
    }
}

/// What the server counted; NaN where it counts nothing of the kind.
#[derive(Clone, Copy, Debug)]
pub struct Counts {
    pub requests: f64,
    pub writes: f64,
    pub wakes: f64,
}

impl Sub for Counts {
    type Output = Counts;
    fn sub(self, o: Counts) -> Counts {
        Counts {
            requests: self.requests - o.requests,
            writes: self.writes - o.writes,
            wakes: self.wakes - o.wakes,
        }
    }
}

impl Counts {
    fn per(self, n: f64) -> Counts {
        Counts {
            requests: self.requests / n,
            writes: self.writes / n,
            wakes: self.wakes / n,
        }
    }
}

/// The server's own counters.
pub trait Counters: Send + Sync {
    /// The counters for `variant` (PostgreSQL keeps each variant in a database of its own; the
    /// others count server-wide).
    fn read(&self, variant: usize) -> BoxFut<'_, Counts>;
    /// True when the server publishes its counters late (PostgreSQL's statistics are flushed up
    /// to 10 s after a backend goes idle, or when it exits): then contention counts per block
    /// of windows, from before the clients connect to after they disconnected and [`settle`]
    /// returned.
    ///
    /// [`settle`]: Counters::settle
    fn lagging(&self) -> bool {
        false
    }
    /// Waits until the counters of a finished block are published.
    fn settle(&self) -> BoxFut<'_, ()> {
        Box::pin(async {})
    }
}

/// Names of the counted quantities in the report (None: not counted).
pub struct Labels {
    pub requests: &'static str,
    pub writes: Option<&'static str>,
    pub wakes: Option<&'static str>,
}

/// One backend's scenarios.
pub struct Spec {
    /// `etcd`, `zk`, `postgres`: the file names of its plots, the worker's argument.
    pub backend: &'static str,
    pub title: &'static str,
    /// lockkit first, then the peers.
    pub variants: Vec<Variant>,
    pub counters: Arc<dyn Counters>,
    pub labels: Labels,
    /// lockkit's URL for the many-leases scenario.
    pub lockkit_url: String,
    /// Notes for the report (how the peer is run, what a counter includes).
    pub notes: &'static str,
    /// Only the contention block of separate processes (Redis: `redis.rs` runs the rest).
    pub procs_only: bool,
}

/// The benchmark's knobs (environment variables, see scripts/bench.sh).
#[derive(Clone, Debug)]
pub struct Cfg {
    pub rounds: usize,
    pub window: Duration,
    pub handoffs: usize,
    pub procs: usize,
    pub leases: Vec<usize>,
}

impl Cfg {
    pub fn from_env() -> Cfg {
        let leases = std::env::var("LOCKBENCH_LEASES")
            .ok()
            .map(|s| s.split(',').filter_map(|n| n.trim().parse().ok()).collect())
            .unwrap_or_else(|| vec![1_000, 10_000]);
        Cfg {
            rounds: env_or("LOCKBENCH_ROUNDS", 3),
            window: Duration::from_millis(env_or("LOCKBENCH_WINDOW_MS", 1000)),
            handoffs: env_or("LOCKBENCH_HANDOFFS", 200),
            procs: env_or("LOCKBENCH_PROCS", 16),
            leases,
        }
    }
}

/// One window of one variant.
#[derive(Clone, Debug)]
struct Window {
    grants_per_s: f64,
    fairness: f64,
    grants: u64,
    /// Per grant, when the counters are read per window.
    per_grant: Option<Counts>,
}

/// All windows of one client count (tasks or processes).
struct Block {
    clients: usize,
    procs: bool,
    /// Per variant.
    windows: Vec<Vec<Window>>,
    /// Per variant, for lagging counters: the block's counts per grant.
    block_per_grant: Vec<Option<Counts>>,
}

fn fairness(grants: &[u64]) -> f64 {
    let min = grants.iter().copied().min().unwrap_or(0);
    let max = grants.iter().copied().max().unwrap_or(0);
    if max == 0 {
        0.0
    } else {
        min as f64 / max as f64
    }
}

/// Clients of one variant for one block: tasks here or worker processes.
enum Pool {
    Tasks(Vec<Arc<Box<dyn Client>>>),
    Procs(Vec<Worker>),
}

/// A child process of this binary (re-executed with some `LOCKBENCH_*` variables set), spoken
/// to in lines on its stdin and stdout: a contention worker ([`worker`]) or the many-leases
/// client ([`many::child`]).
pub struct Worker {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    stdout: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
}

impl Worker {
    /// Starts this binary again with `env` added to its environment.
    pub fn start(env: &[(&str, &str)]) -> Worker {
        let exe = std::env::current_exe().expect("current exe");
        let mut child = tokio::process::Command::new(exe)
            .envs(env.iter().copied())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn a child process");
        let stdin = child.stdin.take().expect("child stdin");
        let stdout = BufReader::new(child.stdout.take().expect("child stdout")).lines();
        Worker {
            child,
            stdin,
            stdout,
        }
    }

    async fn spawn(backend: &str, variant: usize, name: &str, prefix: &str) -> Worker {
        let spec = format!("{backend}\t{variant}\t{name}");
        let mut w = Self::start(&[("LOCKBENCH_WORKER", &spec), ("LOCKBENCH_PREFIX", prefix)]);
        assert_eq!(w.line().await, "ready", "worker did not start");
        w
    }

    /// The child's next line.
    pub async fn line(&mut self) -> String {
        self.stdout
            .next_line()
            .await
            .expect("child stdout")
            .expect("child exited")
    }

    /// Writes `s` and a newline to the child.
    pub async fn send(&mut self, s: &str) {
        self.stdin
            .write_all(format!("{s}\n").as_bytes())
            .await
            .expect("child stdin");
        self.stdin.flush().await.expect("child stdin");
    }

    /// Waits until the child has exited.
    pub async fn wait(mut self) {
        let _ = self.child.wait().await;
    }

    async fn finish(mut self) {
        self.send("exit").await;
        self.wait().await;
    }
}

/// The worker process: one client of `LOCKBENCH_WORKER`'s variant; on `go` it acquires and
/// releases the lock in a loop until `stop`, then prints its number of grants.
pub async fn worker(spec: Spec, variant: usize, name: String) {
    let client: Arc<Box<dyn Client>> = Arc::new((spec.variants[variant].connect)().await);
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    println!("ready");
    while let Ok(Some(l)) = lines.next_line().await {
        if l != "go" {
            break;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let task = {
            let (client, stop, name) = (client.clone(), stop.clone(), name.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    client.acquire(&name).await.release().await;
                    n += 1;
                }
                n
            })
        };
        let _ = lines.next_line().await;
        stop.store(true, Ordering::Relaxed);
        let n = task.await.expect("worker loop");
        println!("grants {n}");
    }
}

async fn window(pool: &mut Pool, name: &str, length: Duration) -> (Vec<u64>, Duration) {
    let started = Instant::now();
    match pool {
        Pool::Tasks(clients) => {
            let stop = Arc::new(AtomicBool::new(false));
            let counts: Vec<Arc<AtomicU64>> = clients.iter().map(|_| Arc::default()).collect();
            let tasks: Vec<_> = clients
                .iter()
                .zip(&counts)
                .map(|(c, n)| {
                    let (c, n, stop, name) = (c.clone(), n.clone(), stop.clone(), name.to_owned());
                    tokio::spawn(async move {
                        while !stop.load(Ordering::Relaxed) {
                            c.acquire(&name).await.release().await;
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
            let grants = counts.iter().map(|n| n.load(Ordering::Relaxed)).collect();
            (grants, started.elapsed())
        }
        Pool::Procs(workers) => {
            for w in workers.iter_mut() {
                w.send("go").await;
            }
            let started = Instant::now();
            tokio::time::sleep(length).await;
            for w in workers.iter_mut() {
                w.send("stop").await;
            }
            let mut grants = Vec::new();
            for w in workers.iter_mut() {
                let l = w.line().await;
                grants.push(
                    l.strip_prefix("grants ")
                        .and_then(|n| n.parse().ok())
                        .expect("worker grants"),
                );
            }
            (grants, started.elapsed())
        }
    }
}

async fn contention(spec: &Spec, cfg: &Cfg, prefix: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut plan: Vec<(usize, bool)> = if spec.procs_only {
        Vec::new()
    } else {
        [1usize, 4, 16].iter().map(|&c| (c, false)).collect()
    };
    if cfg.procs > 0 {
        plan.push((cfg.procs, true));
    }
    let n = spec.variants.len();
    let lagging = spec.counters.lagging();
    for (clients, procs) in plan {
        let tag = if procs { "p" } else { "t" };
        let lock_name = |v: usize| format!("c{clients}{tag}-v{v}");
        let mut before = Vec::new();
        if lagging {
            for v in 0..n {
                before.push(spec.counters.read(v).await);
            }
        }
        let mut pools = Vec::new();
        for (v, variant) in spec.variants.iter().enumerate() {
            pools.push(if procs {
                let name = lock_name(v);
                let ws = futures_util::future::join_all(
                    (0..clients).map(|_| Worker::spawn(spec.backend, v, &name, prefix)),
                )
                .await;
                Pool::Procs(ws)
            } else {
                let mut cs = Vec::new();
                for _ in 0..clients {
                    cs.push(Arc::new((variant.connect)().await));
                }
                Pool::Tasks(cs)
            });
        }
        let mut windows: Vec<Vec<Window>> = vec![Vec::new(); n];
        for r in 0..cfg.rounds {
            for k in 0..n {
                let v = (k + r) % n;
                let c0 = if lagging {
                    None
                } else {
                    Some(spec.counters.read(v).await)
                };
                let (grants, elapsed) = window(&mut pools[v], &lock_name(v), cfg.window).await;
                let total: u64 = grants.iter().sum();
                let per_grant = match c0 {
                    Some(c0) => Some((spec.counters.read(v).await - c0).per(total.max(1) as f64)),
                    None => None,
                };
                let w = Window {
                    grants_per_s: total as f64 / elapsed.as_secs_f64(),
                    fairness: fairness(&grants),
                    grants: total,
                    per_grant,
                };
                eprintln!(
                    "{} contention {clients:>2} {}, {:<28} {:>8.0} grants/s fairness {:.2} per grant {:?}",
                    spec.backend,
                    if procs { "processes" } else { "tasks" },
                    spec.variants[v].name,
                    w.grants_per_s,
                    w.fairness,
                    w.per_grant
                );
                windows[v].push(w);
            }
        }
        for p in pools {
            match p {
                Pool::Tasks(cs) => drop(cs),
                Pool::Procs(ws) => {
                    for w in ws {
                        w.finish().await;
                    }
                }
            }
        }
        let mut block_per_grant = vec![None; n];
        if lagging {
            spec.counters.settle().await;
            for v in 0..n {
                let grants: u64 = windows[v].iter().map(|w| w.grants).sum();
                let d = spec.counters.read(v).await - before[v];
                block_per_grant[v] = Some(d.per(grants.max(1) as f64));
            }
        }
        out.push(Block {
            clients,
            procs,
            windows,
            block_per_grant,
        });
    }
    out
}

/// One hand-off run: latencies (sorted), and the server's counts per release.
struct HandRun {
    lat: Vec<Duration>,
    per_release: Option<Counts>,
}

/// `waiters` + 1 clients take turns on one lock; each holds for 2 ms (so that all others are
/// queued), then releases. Samples release start → the next acquire returns.
async fn handoff(spec: &Spec, v: usize, waiters: usize, samples: usize, run: usize) -> HandRun {
    let name = format!("handoff-{waiters}-{run}-v{v}");
    let released_at = Arc::new(std::sync::Mutex::new(None::<Instant>));
    let lat = Arc::new(std::sync::Mutex::new(Vec::with_capacity(samples)));
    let stop = Arc::new(AtomicBool::new(false));
    let releases = Arc::new(AtomicU64::new(0));
    let mut clients = Vec::new();
    for _ in 0..=waiters {
        clients.push((spec.variants[v].connect)().await);
    }
    let c0 = if spec.counters.lagging() {
        None
    } else {
        Some(spec.counters.read(v).await)
    };
    let tasks: Vec<_> = clients
        .into_iter()
        .map(|c| {
            let (released_at, lat, stop, releases, name) = (
                released_at.clone(),
                lat.clone(),
                stop.clone(),
                releases.clone(),
                name.clone(),
            );
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let held = c.acquire(&name).await;
                    if let Some(t) = released_at.lock().unwrap().take() {
                        let mut lat = lat.lock().unwrap();
                        lat.push(t.elapsed());
                        if lat.len() >= samples {
                            stop.store(true, Ordering::Relaxed);
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    if stop.load(Ordering::Relaxed) {
                        *released_at.lock().unwrap() = None;
                    } else {
                        *released_at.lock().unwrap() = Some(Instant::now());
                        releases.fetch_add(1, Ordering::Relaxed);
                    }
                    held.release().await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("handoff task");
    }
    let per_release = match c0 {
        Some(c0) => Some(
            (spec.counters.read(v).await - c0).per(releases.load(Ordering::Relaxed).max(1) as f64),
        ),
        None => None,
    };
    let mut lat = std::mem::take(&mut *lat.lock().unwrap());
    lat.sort();
    HandRun { lat, per_release }
}

struct ManyResult {
    leases: usize,
    held: usize,
    error: Option<String>,
    acquire_time: Duration,
    rss_per_lease: f64,
    per_s: Counts,
}

/// `n` leases (TTL 3 s, keepalive: a renewal due every second) held by one lockkit client in a
/// process of its own ([`many::hold`]), then the server's counters over 4 s.
async fn many(spec: &Spec, n: usize) -> ManyResult {
    let url = format!("{}-many{n}", spec.lockkit_url);
    let (holder, acquired) = many::hold(&url, n).await;
    let window = Duration::from_secs(4);
    if spec.counters.lagging() {
        // Counters published late (PostgreSQL: up to 10 s after a backend went idle) would
        // put the grants' statements into the window.
        tokio::time::sleep(LAG).await;
    }
    let c0 = spec.counters.read(0).await;
    tokio::time::sleep(window).await;
    let d = spec.counters.read(0).await - c0;
    let held = holder.finish().await;
    let mut error = acquired.error;
    if held < acquired.count && error.is_none() {
        error = Some(format!(
            "{} leases lost while kept alive",
            acquired.count - held
        ));
    }
    ManyResult {
        leases: n,
        held,
        error,
        acquire_time: acquired.acquire_time,
        rss_per_lease: acquired.rss_per_lease,
        per_s: d.per(window.as_secs_f64()),
    }
}

/// How long the many-leases scenario waits before its window where counters are published late
/// ([`Counters::lagging`]): PostgreSQL 15 flushes an idle backend's statistics 10 s after it
/// went idle (`PGSTAT_IDLE_INTERVAL`).
const LAG: Duration = Duration::from_secs(11);

/// What one backend's scenarios measured; the report is made from it.
pub struct Results {
    blocks: Vec<Block>,
    hand: Vec<(usize, Vec<Vec<HandRun>>)>,
    many: Vec<ManyResult>,
    window: Duration,
    pub elapsed: Duration,
}

impl Results {
    /// Median grants/s of lockkit with `clients` tasks (for the semaphore's ratio).
    pub fn lockkit_grants(&self, clients: usize) -> Option<f64> {
        self.blocks
            .iter()
            .find(|b| b.clients == clients && !b.procs)
            .map(|b| {
                median(
                    &mut b.windows[0]
                        .iter()
                        .map(|w| w.grants_per_s)
                        .collect::<Vec<_>>(),
                )
            })
    }

    /// Median hand-off of lockkit at `waiters` (median over runs of each run's median).
    pub fn lockkit_handoff(&self, waiters: usize) -> Option<Duration> {
        self.hand
            .iter()
            .find(|(n, _)| *n == waiters)
            .map(|(_, runs)| {
                let mut m: Vec<f64> = runs[0]
                    .iter()
                    .map(|r| crate::pct(&r.lat, 50).as_secs_f64())
                    .collect();
                Duration::from_secs_f64(median(&mut m))
            })
    }
}

pub async fn run(spec: &Spec, cfg: &Cfg, prefix: &str) -> Results {
    let started = Instant::now();
    let blocks = contention(spec, cfg, prefix).await;
    let n = spec.variants.len();
    let mut hand = Vec::new();
    let sizes: &[usize] = if spec.procs_only { &[] } else { &[1, 4, 16] };
    for &waiters in sizes {
        let mut runs: Vec<Vec<HandRun>> = (0..n).map(|_| Vec::new()).collect();
        for r in 0..2 {
            for k in 0..n {
                let v = (k + r) % n;
                let h = handoff(spec, v, waiters, cfg.handoffs, r).await;
                eprintln!(
                    "{} handoff N={waiters} {:<28} median {:?} p99 {:?} per release {:?}",
                    spec.backend,
                    spec.variants[v].name,
                    h.lat[h.lat.len() / 2],
                    h.lat[(h.lat.len() - 1) * 99 / 100],
                    h.per_release
                );
                runs[v].push(h);
            }
        }
        hand.push((waiters, runs));
    }
    let mut manies = Vec::new();
    for &n in if spec.procs_only {
        &[][..]
    } else {
        &cfg.leases[..]
    } {
        let m = many(spec, n).await;
        eprintln!(
            "{} many {n}: held {} in {:?} ({:?}), {:.0} B/lease, {:?}/s",
            spec.backend, m.held, m.acquire_time, m.error, m.rss_per_lease, m.per_s
        );
        manies.push(m);
    }
    Results {
        blocks,
        hand,
        many: manies,
        window: cfg.window,
        elapsed: started.elapsed(),
    }
}

fn us(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us >= 10_000.0 {
        format!("{:.1} ms", us / 1000.0)
    } else {
        format!("{us:.0} µs")
    }
}

fn opt(x: f64, prec: usize) -> String {
    if x.is_finite() {
        format!("{x:.prec$}")
    } else {
        "–".to_owned()
    }
}

/// The backend's section of docs/benchmarks.md; draws its plots into `plots` (a directory).
pub fn report(spec: &Spec, uncontended: &[Row], res: &Results, plots: Option<&Path>) -> String {
    let mut md = String::new();
    let b = spec.backend;
    let names: Vec<&str> = spec.variants.iter().map(|v| v.name.as_str()).collect();
    if spec.procs_only {
        let _ = writeln!(md, "### {}: clients as separate processes\n", spec.title);
    } else {
        let _ = writeln!(md, "## {}\n", spec.title);
    }
    let _ = writeln!(
        md,
        "{} These scenarios took {:.0} s.\n",
        spec.notes,
        res.elapsed.as_secs_f64()
    );
    crate::uncontended_table(&mut md, uncontended);

    let _ = writeln!(
        md,
        "### Contention: clients on one lock, empty critical section\n\nEach cell: median of \
         {} windows of {:.1} s (min–max in brackets), variants interleaved. Ratio = lockkit's \
         median grants/s over {}'s. Fairness = min/max grants per client in a window (median). \
         Per grant: {}{}.\n",
        res.blocks.first().map_or(0, |b| b.windows[0].len()),
        res.window.as_secs_f64(),
        names[1..].join(" / "),
        spec.labels.requests,
        spec.labels
            .writes
            .map(|w| format!("; {w}"))
            .unwrap_or_default(),
    );
    let vs = names[1..].join(" / ");
    let _ = writeln!(
        md,
        "| clients | ratio to {vs} | lockkit grants/s | {} | fairness {} | requests per grant {}{} |\n|{}{}",
        names[1..]
            .iter()
            .map(|n| format!("{n} grants/s"))
            .collect::<Vec<_>>()
            .join(" | "),
        names.join(" / "),
        names.join(" / "),
        spec.labels
            .writes
            .map(|_| format!(" | writes per grant {}", names.join(" / ")))
            .unwrap_or_default(),
        "---|".repeat(names.len() + 4),
        if spec.labels.writes.is_some() {
            "---|"
        } else {
            ""
        },
    );
    for blk in &res.blocks {
        let med = |v: usize, f: fn(&Window) -> f64| {
            median(&mut blk.windows[v].iter().map(f).collect::<Vec<_>>())
        };
        let cell = |v: usize| {
            let xs: Vec<f64> = blk.windows[v].iter().map(|w| w.grants_per_s).collect();
            let (lo, hi) = spread(&xs);
            format!("{:.0} ({lo:.0}–{hi:.0})", med(v, |w| w.grants_per_s))
        };
        let ratios = (1..names.len())
            .map(|v| {
                format!(
                    "**{:.2}×**",
                    med(0, |w| w.grants_per_s) / med(v, |w| w.grants_per_s).max(1e-9)
                )
            })
            .collect::<Vec<_>>()
            .join(" / ");
        let per_grant = |v: usize, f: fn(&Counts) -> f64, prec: usize| -> String {
            match blk.block_per_grant[v] {
                Some(c) => opt(f(&c), prec),
                None => {
                    let mut xs: Vec<f64> = blk.windows[v]
                        .iter()
                        .filter_map(|w| w.per_grant.as_ref().map(f))
                        .collect();
                    if xs.is_empty() {
                        "–".to_owned()
                    } else {
                        opt(median(&mut xs), prec)
                    }
                }
            }
        };
        let all = |f: fn(&Counts) -> f64, prec: usize| {
            (0..names.len())
                .map(|v| per_grant(v, f, prec))
                .collect::<Vec<_>>()
                .join(" / ")
        };
        let _ = writeln!(
            md,
            "| {} {} | {ratios} | {} | {} | {} | {} |{}",
            blk.clients,
            if blk.procs { "processes" } else { "tasks" },
            cell(0),
            (1..names.len()).map(cell).collect::<Vec<_>>().join(" | "),
            (0..names.len())
                .map(|v| format!("{:.2}", med(v, |w| w.fairness)))
                .collect::<Vec<_>>()
                .join(" / "),
            all(|c| c.requests, 2),
            spec.labels
                .writes
                .map(|_| format!(" {} |", all(|c| c.writes, 2)))
                .unwrap_or_default(),
        );
    }
    if spec.procs_only {
        return md;
    }
    let _ = writeln!(md, "\n![{b} contention](benchmarks/{b}-contention.svg)\n");

    let _ = writeln!(
        md,
        "### Hand-off: release → the next queued waiter's acquire returns\n\nTwo runs per \
         variant and N ({} samples each; each holder keeps the lock 2 ms so that all others are \
         queued). Ratio = lockkit's median over {}'s (median of the runs' medians).{}\n",
        res.hand.first().map_or(0, |h| h.1[0][0].lat.len()),
        vs,
        spec.labels
            .wakes
            .map(|w| format!(" Wakes per release: {w}."))
            .unwrap_or_default()
    );
    let _ = writeln!(
        md,
        "| waiters | ratio to {vs} | {} |{}\n|---|---|{}{}",
        names
            .iter()
            .map(|n| format!("{n} median (runs) | {n} p99 (runs)"))
            .collect::<Vec<_>>()
            .join(" | "),
        spec.labels
            .wakes
            .map(|_| format!(" wakes per release {} |", names.join(" / ")))
            .unwrap_or_default(),
        "---|---|".repeat(names.len()),
        if spec.labels.wakes.is_some() {
            "---|"
        } else {
            ""
        }
    );
    let run_median = |runs: &[HandRun]| {
        median(
            &mut runs
                .iter()
                .map(|r| crate::pct(&r.lat, 50).as_secs_f64())
                .collect::<Vec<_>>(),
        )
    };
    for (n, runs) in &res.hand {
        let ratios = (1..names.len())
            .map(|v| format!("**{:.2}×**", run_median(&runs[0]) / run_median(&runs[v])))
            .collect::<Vec<_>>()
            .join(" / ");
        let cols = runs
            .iter()
            .map(|rs| {
                let at = |q: usize| {
                    rs.iter()
                        .map(|r| us(crate::pct(&r.lat, q)))
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                format!("{} | {}", at(50), at(99))
            })
            .collect::<Vec<_>>()
            .join(" | ");
        let wakes = spec.labels.wakes.map(|_| {
            format!(
                " {} |",
                runs.iter()
                    .map(|rs| rs
                        .iter()
                        .map(|r| r.per_release.map_or("–".to_owned(), |c| opt(c.wakes, 2)))
                        .collect::<Vec<_>>()
                        .join(", "))
                    .collect::<Vec<_>>()
                    .join(" / ")
            )
        });
        let _ = writeln!(
            md,
            "| {n} | {ratios} | {cols} |{}",
            wakes.unwrap_or_default()
        );
    }
    let _ = writeln!(md, "\n![{b} hand-off](benchmarks/{b}-handoff.svg)\n");

    let _ = writeln!(
        md,
        "### Many held leases on one lockkit client (TTL 3 s, keepalive on)\n\nServer counters \
         over 4 s while the leases are held ({}{}); RSS = the resident memory growth, while \
         acquiring, of the client's process (one of its own, `many.rs`), per lease.\n",
        spec.labels.requests,
        spec.labels
            .writes
            .map(|w| format!("; {w}"))
            .unwrap_or_default()
    );
    let _ = writeln!(
        md,
        "| leases | held | renewal requests/s | per lease per s | {}time to acquire all | client RSS per lease | error |\n|---|---|---|---|{}---|---|---|",
        if spec.labels.writes.is_some() {
            "writes/s | "
        } else {
            ""
        },
        if spec.labels.writes.is_some() {
            "---|"
        } else {
            ""
        }
    );
    for m in &res.many {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {}{:.2} s | {:.0} B | {} |",
            m.leases,
            m.held,
            opt(m.per_s.requests, 1),
            opt(m.per_s.requests / m.held.max(1) as f64, 4),
            if spec.labels.writes.is_some() {
                format!("{} | ", opt(m.per_s.writes, 1))
            } else {
                String::new()
            },
            m.acquire_time.as_secs_f64(),
            m.rss_per_lease,
            m.error.as_deref().unwrap_or("")
        );
    }
    let _ = writeln!(md, "\n![{b} many leases](benchmarks/{b}-many-leases.svg)\n");

    if let Some(dir) = plots {
        let series = (0..names.len())
            .flat_map(|v| {
                [false, true].map(|procs| {
                    let pts: Vec<(f64, f64)> = res
                        .blocks
                        .iter()
                        .filter(|blk| blk.procs == procs)
                        .map(|blk| {
                            (
                                blk.clients as f64,
                                median(
                                    &mut blk.windows[v]
                                        .iter()
                                        .map(|w| w.grants_per_s)
                                        .collect::<Vec<_>>(),
                                ),
                            )
                        })
                        .collect();
                    let kind = if procs { "processes" } else { "tasks" };
                    (format!("{} ({kind})", names[v]), pts)
                })
            })
            .filter(|(_, p)| !p.is_empty())
            .collect::<Vec<_>>();
        crate::plot::lines(
            &dir.join(format!("{b}-contention.svg")),
            &format!("{}: clients on one lock (median grants/s)", spec.title),
            "clients",
            "grants/s",
            &series,
        );
        let series = (0..names.len())
            .map(|v| {
                (
                    names[v].to_owned(),
                    res.hand
                        .iter()
                        .map(|(n, runs)| (*n as f64, run_median(&runs[v]) * 1e6))
                        .collect(),
                )
            })
            .collect::<Vec<_>>();
        crate::plot::lines(
            &dir.join(format!("{b}-handoff.svg")),
            &format!(
                "{}: release → next acquire returns (median, µs)",
                spec.title
            ),
            "queued waiters",
            "µs",
            &series,
        );
        crate::plot::lines(
            &dir.join(format!("{b}-many-leases.svg")),
            &format!("{}: server requests/s while leases are held", spec.title),
            "held leases",
            "requests/s",
            &[(
                "lockkit".to_owned(),
                res.many
                    .iter()
                    .filter(|m| m.per_s.requests.is_finite())
                    .map(|m| (m.held.max(1) as f64, m.per_s.requests))
                    .collect(),
            )],
        );
    }
    md
}
