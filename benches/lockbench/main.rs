//! lockbench: uncontended acquire+release latency of lockkit on each backend, side by side with
//! the same round trips done by hand with the backend's client crate, in the same run.
//!
//! ```text
//! scripts/bench.sh                      # starts private servers, runs everything, stops them
//! cargo bench --bench lockbench --all-features -- [memory] [redis] [etcd] [zk] [postgres]
//! ```
//! Server URLs come from `LOCKKIT_*_URL` (see `scripts/servers.sh`). Prints median and p99 per
//! row and the ratio of lockkit to the hand-written floor. Speed targets live here, never in tests.

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

#[cfg(feature = "etcd")]
mod etcd;
mod memory;
#[cfg(feature = "redis")]
mod plot;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redis")]
mod redis;
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

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let want = |b: &str| args.is_empty() || args.iter().any(|a| a == b);
    let iters: usize = std::env::var("LOCKBENCH_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut rows = Vec::new();
    rt.block_on(async {
        if want("memory") {
            rows.extend(memory::run(iters).await);
        }
        #[cfg(feature = "redis")]
        if want("redis") {
            let uncontended = redis::run(iters).await;
            if std::env::var_os("LOCKBENCH_NO_SCENARIOS").is_none() {
                redis::scenarios(&uncontended).await;
            }
            rows.extend(uncontended);
        }
        #[cfg(feature = "etcd")]
        if want("etcd") {
            rows.extend(etcd::run(iters).await);
        }
        #[cfg(feature = "zk")]
        if want("zk") {
            rows.extend(zk::run(iters).await);
        }
        #[cfg(feature = "postgres")]
        if want("postgres") {
            rows.extend(postgres::run(iters).await);
        }
    });
    report(&rows);
}
