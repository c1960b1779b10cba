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
use std::time::{Duration, Instant};

#[cfg(feature = "etcd")]
mod etcd;
mod memory;
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

/// Runs `op` `warmup` times unmeasured, then `iters` times measured, one at a time.
pub async fn measure<F, Fut>(backend: &'static str, what: &str, iters: usize, mut op: F) -> Row
where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    for _ in 0..(iters / 10).max(10) {
        op().await;
    }
    let mut samples = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        op().await;
        samples.push(t.elapsed());
    }
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
            rows.extend(redis::run(iters).await);
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
