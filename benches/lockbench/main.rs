//! lockbench: uncontended acquire+release latency of lockkit on each backend, side by side with
//! the same round trips done by hand with the backend's client crate, in the same run.
//!
//! ```text
//! scripts/bench.sh                      # starts private servers, runs everything, stops them
//! cargo bench -p lockbench -- [memory] [redis] [etcd] [zk] [postgres] [slots]
//! ```
//! Server URLs come from `LOCKKIT_*_URL` (see `scripts/servers.sh`). Prints median and p99 per
//! row and the ratio of lockkit to the hand-written floor. Then, per backend, the scenarios of
//! issue #11 next to the backend's peer (`redis.rs` for Redis, `scenario.rs` for the others:
//! contention, hand-off, many leases) and issue #14's election and semaphore rows (`slots.rs`,
//! argument `slots`); `LOCKBENCH_NO_SCENARIOS=1` skips them. With `LOCKBENCH_REPORT` set (a
//! path, e.g. `docs/benchmarks.md`) the tables are written there and the plots beside it in
//! `benchmarks/`. Speed targets live here, never in tests.

use std::fmt::Write as _;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::time::{Duration, Instant};

#[cfg(feature = "etcd")]
mod etcd;
mod many;
mod memory;
mod plot;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redis")]
mod redis;
mod scenario;
mod slots;
#[cfg(feature = "zk")]
mod zk;

/// Latency summary of one measured sequence.
#[derive(Debug, Clone)]
pub struct Row {
    pub backend: &'static str,
    pub what: String,
    pub median: Duration,
    pub p99: Duration,
}

/// One measured sequence: makes the future for one sample.
pub type Op<'a> = Box<dyn FnMut() -> Pin<Box<dyn Future<Output = ()> + 'a>> + 'a>;

/// Boxes a closure returning a future into an [`Op`].
pub fn op<'a, F, Fut>(mut f: F) -> Op<'a>
where
    F: FnMut() -> Fut + 'a,
    Fut: Future<Output = ()> + 'a,
{
    Box::new(move || Box::pin(f()))
}

/// Measures `ops` **interleaved**: after `warmup` unmeasured rounds, `iters` rounds each run
/// every op once, starting with a different op each round. Load changes on the shared machine
/// then hit all rows alike, so their ratios stay meaningful (measured one after the other,
/// ratios moved by ±20 % between runs).
pub async fn interleaved(
    backend: &'static str,
    mut ops: Vec<(&str, Op<'_>)>,
    warmup: usize,
    iters: usize,
) -> Vec<Row> {
    // LOCKBENCH_ONLY=TEXT keeps only the sequences whose name contains TEXT: for a profile of
    // one library's calls (`perf record`), not for ratios.
    if let Ok(only) = std::env::var("LOCKBENCH_ONLY") {
        ops.retain(|(what, _)| what.contains(only.as_str()));
    }
    let n = ops.len();
    for r in 0..warmup {
        for k in 0..n {
            (ops[(k + r) % n].1)().await;
        }
    }
    let mut samples = vec![Vec::with_capacity(iters); n];
    for r in 0..iters {
        for k in 0..n {
            let i = (k + r) % n;
            let t = Instant::now();
            (ops[i].1)().await;
            samples[i].push(t.elapsed());
        }
    }
    ops.iter()
        .zip(samples)
        .map(|((what, _), s)| row(backend, what, s))
        .collect()
}

/// Median and p99 of `samples`.
pub fn row(backend: &'static str, what: &str, mut samples: Vec<Duration>) -> Row {
    samples.sort();
    let at = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize];
    Row {
        backend,
        what: what.to_owned(),
        median: at(0.5),
        p99: at(0.99),
    }
}

/// Prints rows grouped by backend, each with its median's ratio to the group's first row.
pub fn report(rows: &[Row]) {
    println!(
        "{:<10} {:<58} {:>11} {:>11} {:>8}",
        "backend", "sequence", "median", "p99", "ratio"
    );
    let mut base: Option<(&str, Duration)> = None;
    for r in rows {
        if base.is_none_or(|(b, _)| b != r.backend) {
            base = Some((r.backend, r.median));
        }
        let ratio = r.median.as_secs_f64() / base.map(|b| b.1).unwrap_or(r.median).as_secs_f64();
        println!(
            "{:<10} {:<58} {:>8.1} µs {:>8.1} µs {:>7.2}×",
            r.backend,
            r.what,
            r.median.as_secs_f64() * 1e6,
            r.p99.as_secs_f64() * 1e6,
            ratio
        );
    }
}

pub fn url(var: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| panic!("{var} not set: run scripts/bench.sh"))
}

pub fn env_or<T: std::str::FromStr>(var: &str, default: T) -> T {
    std::env::var(var)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// The median (of an even count, the mean of the middle two).
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n.is_multiple_of(2) {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    } else {
        v[n / 2]
    }
}

/// The `q`-th percentile of sorted `lat` (nearest rank below).
pub fn pct(lat: &[Duration], q: usize) -> Duration {
    lat[(lat.len() - 1) * q / 100]
}

pub fn spread(v: &[f64]) -> (f64, f64) {
    let min = v.iter().copied().fold(f64::INFINITY, f64::min);
    let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (min, max)
}

/// The uncontended rows of one backend as a Markdown table, ratios to its first row.
pub fn uncontended_table(md: &mut String, rows: &[Row]) {
    let Some(first) = rows.first() else {
        return;
    };
    let _ = writeln!(
        md,
        "### Uncontended acquire + release (one client)\n\n| sequence | ratio to first row | \
         median | p99 |\n|---|---|---|---|"
    );
    for r in rows {
        let _ = writeln!(
            md,
            "| {} | **{:.2}×** | {:.1} µs | {:.1} µs |",
            r.what,
            r.median.as_secs_f64() / first.median.as_secs_f64(),
            r.median.as_secs_f64() * 1e6,
            r.p99.as_secs_f64() * 1e6
        );
    }
    let _ = writeln!(md);
}

fn version(cmd: &str, arg: &str) -> String {
    std::process::Command::new(cmd)
        .arg(arg)
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or_default()
                .trim()
                .to_owned()
        })
        .unwrap_or_default()
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// The machine and servers the run used.
fn machine(load_at_start: &str) -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("model name")
                    .map(|r| r.trim_start_matches([' ', '\t', ':']).to_owned())
            })
        })
        .unwrap_or_else(|| "unknown CPU".to_owned());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("MemTotal:").map(|r| r.trim().to_owned()))
        })
        .unwrap_or_default();
    format!(
        "{cpu}, {cores} cores available, {mem} RAM, Linux {}; {}, etcd {}, ZooKeeper 3.8 \
         (Debian), {}; load average at the start {load_at_start}, at the end {}",
        kernel.trim(),
        version("redis-server", "--version")
            .split(" sha=")
            .next()
            .unwrap_or_default(),
        version("etcd", "--version").trim_start_matches("etcd Version: "),
        pg_version(),
        load()
    )
}

fn pg_version() -> String {
    let Ok(dirs) = std::fs::read_dir("/usr/lib/postgresql") else {
        return "PostgreSQL".to_owned();
    };
    let mut v: Vec<String> = dirs
        .filter_map(|d| d.ok().map(|d| d.file_name().to_string_lossy().into_owned()))
        .collect();
    v.sort();
    format!("PostgreSQL {}", v.join("/"))
}

/// Runs `run` with the scenarios' knobs; one Markdown section.
fn plots_dir() -> Option<PathBuf> {
    let path = PathBuf::from(std::env::var_os("LOCKBENCH_REPORT")?);
    let dir = path.parent().unwrap_or(Path::new(".")).join("benchmarks");
    std::fs::create_dir_all(&dir).expect("plot dir");
    Some(dir)
}

/// A worker process of a multi-process contention block (see `scenario::worker`).
async fn worker(spec: &str) {
    let mut it = spec.split('\t');
    let (backend, variant, name) = (
        it.next().unwrap_or_default(),
        it.next().and_then(|v| v.parse().ok()).unwrap_or(0),
        it.next().unwrap_or_default().to_owned(),
    );
    let prefix = std::env::var("LOCKBENCH_PREFIX").unwrap_or_default();
    let spec = match backend {
        #[cfg(feature = "redis")]
        "redis" => redis::spec(&prefix).await,
        #[cfg(feature = "etcd")]
        "etcd" => etcd::spec(&prefix).await,
        #[cfg(feature = "zk")]
        "zk" => zk::spec(&prefix).await,
        #[cfg(feature = "postgres")]
        "postgres" => postgres::spec(&prefix).await,
        other => panic!("no worker for backend {other:?}"),
    };
    scenario::worker(spec, variant, name).await;
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    if let Ok(w) = std::env::var("LOCKBENCH_WORKER") {
        rt.block_on(worker(&w));
        return;
    }
    if let Ok(m) = std::env::var("LOCKBENCH_MANY") {
        rt.block_on(many::child(&m));
        return;
    }
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let want = |b: &str| args.is_empty() || args.iter().any(|a| a == b);
    let iters: usize = env_or("LOCKBENCH_ITERS", 2000);
    let scenarios = std::env::var_os("LOCKBENCH_NO_SCENARIOS").is_none();
    let cfg = scenario::Cfg::from_env();
    let plots = plots_dir();
    let plots = plots.as_deref();
    let prefix = format!("lockbench-{:08x}", rand::random::<u32>());
    let load_at_start = load();
    let started = std::time::Instant::now();
    let mut rows = Vec::new();
    let mut sections: Vec<String> = Vec::new();
    // Per slot target (memory, then the backends in `targets` order): the lock rows to compare.
    let mut refs: std::collections::HashMap<&str, slots::LockRef> = Default::default();
    rt.block_on(async {
        if want("memory") {
            rows.extend(memory::run(iters).await);
        }
        #[cfg(feature = "redis")]
        if want("redis") {
            let uncontended = redis::run(iters).await;
            if scenarios {
                let (mut md, lock) = redis::scenarios(&uncontended, plots).await;
                refs.insert("redis", lock);
                if cfg.procs > 0 {
                    let spec = redis::spec(&prefix).await;
                    let res = scenario::run(&spec, &cfg, &prefix).await;
                    md.push('\n');
                    md.push_str(&scenario::report(&spec, &[], &res, None));
                }
                sections.push(md);
            }
            rows.extend(uncontended);
        }
        #[cfg(feature = "etcd")]
        if want("etcd") {
            let r = etcd::run(iters).await;
            if scenarios {
                let spec = etcd::spec(&prefix).await;
                let res = scenario::run(&spec, &cfg, &prefix).await;
                sections.push(scenario::report(&spec, &r, &res, plots));
                refs.insert("etcd", lock_ref(&res));
            }
            rows.extend(r);
        }
        #[cfg(feature = "zk")]
        if want("zk") {
            let r = zk::run(iters).await;
            if scenarios {
                let spec = zk::spec(&prefix).await;
                let res = scenario::run(&spec, &cfg, &prefix).await;
                sections.push(scenario::report(&spec, &r, &res, plots));
                refs.insert("zk", lock_ref(&res));
            }
            rows.extend(r);
        }
        #[cfg(feature = "postgres")]
        if want("postgres") {
            let r = postgres::run(iters).await;
            if scenarios {
                let spec = postgres::spec(&prefix).await;
                let res = scenario::run(&spec, &cfg, &prefix).await;
                sections.push(scenario::report(&spec, &r, &res, plots));
                refs.insert("postgres", lock_ref(&res));
            }
            rows.extend(r);
        }
        if scenarios && want("slots") {
            let targets = slot_targets();
            let res = slots::run(&targets, &cfg).await;
            let refs: Vec<slots::LockRef> = targets
                .iter()
                .map(|t| refs.get(t.backend).cloned().unwrap_or_default())
                .collect();
            sections.push(slots::report(&targets, &res, &refs, plots));
        }
    });
    report(&rows);
    if sections.is_empty() {
        return;
    }
    let mut md = String::from("# Benchmarks\n\n");
    let _ = writeln!(
        md,
        "Generated by `scripts/bench.sh{}` in {:.0} s (`cargo bench -p lockbench`, \
         release build){}. Machine: {} — shared with other work, so absolute numbers are noisy: \
         compare the **ratios**, which come from variants interleaved in rotating order in the \
         same run, and the spread of the repeated windows. Knobs: {:?}.\n",
        if args.is_empty() {
            String::new()
        } else {
            format!(" {}", args.join(" "))
        },
        started.elapsed().as_secs_f64(),
        // What scripts/bench.sh says of the run: its start and the commit it measured.
        std::env::var("LOCKBENCH_RUN")
            .map(|r| format!(", {r}"))
            .unwrap_or_default(),
        machine(&load_at_start),
        cfg
    );
    for s in &sections {
        md.push_str(s);
        md.push('\n');
    }
    println!("{md}");
    if let Ok(path) = std::env::var("LOCKBENCH_REPORT") {
        std::fs::write(&path, md).expect("write report");
        eprintln!("wrote {path}");
    }
}

fn lock_ref(res: &scenario::Results) -> slots::LockRef {
    slots::LockRef {
        handoff: [1, 4]
            .iter()
            .filter_map(|&n| res.lockkit_handoff(n).map(|d| (n, d)))
            .collect(),
        grants16: res.lockkit_grants(16),
    }
}

/// The backends with elections and semaphores: one line each.
fn slot_targets() -> Vec<slots::Target> {
    let memory = std::sync::Arc::new(lockkit::MemoryLock::new());
    #[allow(unused_mut)]
    let mut targets = vec![slots::target("memory", move || {
        let m = memory.clone();
        async move { m }
    })];
    #[cfg(feature = "postgres")]
    targets.extend(slots::from_url(
        "postgres",
        "LOCKKIT_POSTGRES_URL",
        |u| async move { lockkit::postgres::PgLock::connect(&u).await },
    ));
    #[cfg(feature = "etcd")]
    targets.extend(slots::from_url(
        "etcd",
        "LOCKKIT_ETCD_URL",
        |u| async move { lockkit::etcd::EtcdLock::connect(&u).await },
    ));
    #[cfg(feature = "redis")]
    targets.extend(slots::from_url(
        "redis",
        "LOCKKIT_REDIS_URL",
        |u| async move { lockkit::redis::RedisLock::connect(&u).await },
    ));
    #[cfg(feature = "zk")]
    targets.extend(slots::from_url("zk", "LOCKKIT_ZK_URL", |u| async move {
        lockkit::zk::ZkLock::connect(&u).await
    }));
    targets
}
