//! The many-leases scenario's client: one lockkit client in a process of its own (this binary
//! re-executed with `LOCKBENCH_MANY`), so that its resident memory grows only with the leases it
//! acquires. In the benchmark's own process, heap freed by the scenarios before was reused, and
//! the growth per lease read 0 B for backends measured late in the run.
//!
//! Protocol on the child's stdin/stdout, one line each: the child connects, acquires the
//! leases (TTL 3 s, keepalive on: a renewal due every second), prints
//! `acquired COUNT NANOS RSS_BYTES ERROR…`; while the parent reads the server's counters the
//! leases are held; on `check` it prints `held N` (leases not Lost), releases them and exits.

use std::time::{Duration, Instant};

use lockkit::{AcquireOptions, LeaseState, Wait};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::scenario::Worker;

/// What the child reported once its leases were acquired.
pub struct Acquired {
    /// Leases acquired (fewer than asked only with `error`).
    pub count: usize,
    pub acquire_time: Duration,
    /// The child's resident memory growth while acquiring, per acquired lease, in bytes.
    pub rss_per_lease: f64,
    /// The first acquire error, after which it stopped.
    pub error: Option<String>,
}

/// The child process holding the leases.
pub struct Holder(Worker);

/// Starts a child that acquires `n` leases named `many-0…` on a lockkit client of `url`; returns
/// once they are acquired.
pub async fn hold(url: &str, n: usize) -> (Holder, Acquired) {
    let spec = format!("{n}\t{url}");
    let mut w = Worker::start(&[("LOCKBENCH_MANY", &spec)]);
    let line = w.line().await;
    let mut it = line.splitn(5, ' ');
    assert_eq!(it.next(), Some("acquired"), "many-leases child: {line:?}");
    let mut num = || -> u64 {
        it.next()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("many-leases child: {line:?}"))
    };
    let (count, nanos, rss) = (num(), num(), num());
    let error = it.next().filter(|e| !e.is_empty()).map(str::to_owned);
    let count = usize::try_from(count).expect("count");
    let acquired = Acquired {
        count,
        acquire_time: Duration::from_nanos(nanos),
        rss_per_lease: rss as f64 / count.max(1) as f64,
        error,
    };
    (Holder(w), acquired)
}

impl Holder {
    /// How many of the leases are still held (not Lost); the child then releases them and exits.
    pub async fn finish(self) -> usize {
        let mut w = self.0;
        w.send("check").await;
        let line = w.line().await;
        let held = line
            .strip_prefix("held ")
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("many-leases child: {line:?}"));
        w.wait().await;
        held
    }
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

/// The child (`LOCKBENCH_MANY` = `N\tURL`).
pub async fn child(spec: &str) {
    let (n, url) = spec.split_once('\t').expect("LOCKBENCH_MANY: N\\tURL");
    let n: usize = n.parse().expect("LOCKBENCH_MANY: N");
    let locks = lockkit::connect(url).await.expect("lockkit connect");
    let opts = AcquireOptions::new()
        .ttl(Duration::from_secs(3))
        .wait(Wait::No);
    let names: Vec<String> = (0..n).map(|i| format!("many-{i}")).collect();
    let rss0 = rss_bytes();
    let t = Instant::now();
    let mut leases = Vec::with_capacity(n);
    let mut error = None;
    for chunk in names.chunks(256) {
        let got = futures_util::future::join_all(
            chunk.iter().map(|name| locks.acquire(name, opts.clone())),
        )
        .await;
        for g in got {
            match g {
                Ok(l) => leases.push(l),
                Err(e) => {
                    error.get_or_insert_with(|| e.to_string().replace('\n', " "));
                }
            }
        }
        if error.is_some() {
            break;
        }
    }
    let took = t.elapsed();
    let rss = rss_bytes().saturating_sub(rss0);
    println!(
        "acquired {} {} {rss} {}",
        leases.len(),
        took.as_nanos(),
        error.unwrap_or_default()
    );
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    let _ = lines.next_line().await;
    let held = leases
        .iter()
        .filter(|l| l.state() != LeaseState::Lost)
        .count();
    println!("held {held}");
    while !leases.is_empty() {
        let tail = leases.split_off(leases.len().saturating_sub(256));
        futures_util::future::join_all(tail.into_iter().map(|l| l.release())).await;
    }
}
