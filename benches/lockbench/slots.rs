//! Issue #14's rows, for every backend that implements `Election` and `Semaphore`, backends
//! interleaved in rotating order:
//!
//! - election handover: N = 1, 4 candidates waiting behind the leader; resign → the next
//!   candidate's campaign returns (median, p99), next to the same backend's lock hand-off;
//! - semaphore throughput: 16 clients on a semaphore of 4 permits, each acquiring and releasing
//!   a permit in a loop: grants/s, fairness (min/max grants per client), the most holders seen
//!   at once.
//!
//! A backend is one [`target`] or [`from_url`] line in `main.rs` (`slot_targets`).

use std::fmt::Write as _;
use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lockkit::{AcquireOptions, Election, Semaphore, Wait};

use crate::scenario::{BoxFut, Cfg};
use crate::{median, spread};

const TTL: Duration = Duration::from_secs(10);
const PERMITS: u32 = 4;
const SEM_CLIENTS: usize = 16;

/// One client's handles on a backend.
pub struct Handles {
    pub election: Arc<dyn Election>,
    pub semaphore: Arc<dyn Semaphore>,
}

/// A backend with elections and semaphores; `connect` makes one client.
pub struct Target {
    pub backend: &'static str,
    connect: Arc<dyn Fn() -> BoxFut<'static, Handles> + Send + Sync>,
}

/// A backend whose clients each come from `connect` (a connection of their own), or share one
/// in-process instance (memory: `|| async { shared.clone() }`).
pub fn target<B, F, Fut>(backend: &'static str, connect: F) -> Target
where
    B: Election + Semaphore + 'static,
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Arc<B>> + Send + 'static,
{
    Target {
        backend,
        connect: Arc::new(move || {
            let fut = connect();
            Box::pin(async move {
                let b = fut.await;
                Handles {
                    election: b.clone(),
                    semaphore: b,
                }
            })
        }),
    }
}

/// A backend connected from the URL in environment variable `var` (None if it is not set), one
/// connection per client.
pub fn from_url<B, F, Fut>(backend: &'static str, var: &str, connect: F) -> Option<Target>
where
    B: Election + Semaphore + 'static,
    F: Fn(String) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = lockkit::Result<B>> + Send + 'static,
{
    let url = std::env::var(var).ok()?;
    Some(target(backend, move || {
        let fut = connect(url.clone());
        async move { Arc::new(fut.await.expect("connect")) }
    }))
}

/// One election handover run: latencies, sorted.
async fn handover(t: &Target, waiting: usize, samples: usize, run: usize) -> Vec<Duration> {
    let name = format!(
        "lockbench-elect-{:08x}-{waiting}-{run}",
        rand::random::<u32>()
    );
    let resigned_at = Arc::new(std::sync::Mutex::new(None::<Instant>));
    let lat = Arc::new(std::sync::Mutex::new(Vec::with_capacity(samples)));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for i in 0..=waiting {
        let h = (t.connect)().await;
        let (resigned_at, lat, stop, name) =
            (resigned_at.clone(), lat.clone(), stop.clone(), name.clone());
        tasks.push(tokio::spawn(async move {
            let value = format!("candidate-{i}");
            let opts = AcquireOptions::new().ttl(TTL).wait(Wait::Forever);
            while !stop.load(Ordering::Relaxed) {
                let leader = h
                    .election
                    .campaign(&name, value.as_bytes(), opts.clone())
                    .await
                    .expect("campaign");
                if let Some(t) = resigned_at.lock().unwrap().take() {
                    let mut lat = lat.lock().unwrap();
                    lat.push(t.elapsed());
                    if lat.len() >= samples {
                        stop.store(true, Ordering::Relaxed);
                    }
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
                *resigned_at.lock().unwrap() = if stop.load(Ordering::Relaxed) {
                    None
                } else {
                    Some(Instant::now())
                };
                leader.resign().await.expect("resign");
            }
        }));
    }
    for t in tasks {
        t.await.expect("candidate task");
    }
    let mut lat = std::mem::take(&mut *lat.lock().unwrap());
    lat.sort();
    lat
}

struct SemWindow {
    grants_per_s: f64,
    fairness: f64,
    max_holders: i64,
}

async fn sem_window(clients: &[Arc<Handles>], name: &str, length: Duration) -> SemWindow {
    let stop = Arc::new(AtomicBool::new(false));
    let holders = Arc::new(AtomicI64::new(0));
    let max_holders = Arc::new(AtomicI64::new(0));
    let counts: Vec<Arc<AtomicU64>> = clients.iter().map(|_| Arc::default()).collect();
    let started = Instant::now();
    let tasks: Vec<_> = clients
        .iter()
        .zip(&counts)
        .map(|(h, n)| {
            let (h, n, stop, name) = (h.clone(), n.clone(), stop.clone(), name.to_owned());
            let (holders, max_holders) = (holders.clone(), max_holders.clone());
            tokio::spawn(async move {
                let opts = AcquireOptions::new().ttl(TTL).wait(Wait::Forever);
                while !stop.load(Ordering::Relaxed) {
                    let p = h
                        .semaphore
                        .acquire_permit(&name, PERMITS, opts.clone())
                        .await
                        .expect("acquire_permit");
                    let now = holders.fetch_add(1, Ordering::SeqCst) + 1;
                    max_holders.fetch_max(now, Ordering::SeqCst);
                    holders.fetch_sub(1, Ordering::SeqCst);
                    p.release().await.expect("release permit");
                    n.fetch_add(1, Ordering::Relaxed);
                    // memory's uncontended grant and release never wait: without a yield the
                    // clients would keep both runtime threads busy, and the window's timer
                    // would never fire.
                    tokio::task::yield_now().await;
                }
            })
        })
        .collect();
    tokio::time::sleep(length).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.expect("semaphore client");
    }
    let elapsed = started.elapsed();
    let grants: Vec<u64> = counts.iter().map(|n| n.load(Ordering::Relaxed)).collect();
    let (min, max) = (
        grants.iter().copied().min().unwrap_or(0),
        grants.iter().copied().max().unwrap_or(0),
    );
    SemWindow {
        grants_per_s: grants.iter().sum::<u64>() as f64 / elapsed.as_secs_f64(),
        fairness: if max == 0 {
            0.0
        } else {
            min as f64 / max as f64
        },
        max_holders: max_holders.load(Ordering::SeqCst),
    }
}

/// What the lock scenarios measured on a backend, for the ratios.
#[derive(Default, Clone)]
pub struct LockRef {
    /// (waiters, lockkit's median lock hand-off).
    pub handoff: Vec<(usize, Duration)>,
    /// lockkit's median grants/s with 16 clients on one lock.
    pub grants16: Option<f64>,
}

pub struct SlotResults {
    /// Per target: (waiting, runs).
    elect: Vec<Vec<(usize, Vec<Vec<Duration>>)>>,
    sem: Vec<Vec<SemWindow>>,
    pub elapsed: Duration,
}

pub async fn run(targets: &[Target], cfg: &Cfg) -> SlotResults {
    let started = Instant::now();
    let n = targets.len();
    let mut elect: Vec<Vec<(usize, Vec<Vec<Duration>>)>> = (0..n).map(|_| Vec::new()).collect();
    for waiting in [1usize, 4] {
        let mut runs: Vec<Vec<Vec<Duration>>> = (0..n).map(|_| Vec::new()).collect();
        for r in 0..2 {
            for k in 0..n {
                let i = (k + r) % n;
                let lat = handover(&targets[i], waiting, cfg.handoffs, r).await;
                eprintln!(
                    "election {} N={waiting}: median {:?} p99 {:?}",
                    targets[i].backend,
                    lat[lat.len() / 2],
                    lat[(lat.len() - 1) * 99 / 100]
                );
                runs[i].push(lat);
            }
        }
        for (i, r) in runs.into_iter().enumerate() {
            elect[i].push((waiting, r));
        }
    }
    let mut pools = Vec::new();
    for t in targets {
        let mut cs = Vec::new();
        for _ in 0..SEM_CLIENTS {
            cs.push(Arc::new((t.connect)().await));
        }
        pools.push(cs);
    }
    let mut sem: Vec<Vec<SemWindow>> = (0..n).map(|_| Vec::new()).collect();
    let name = format!("lockbench-sem-{:08x}", rand::random::<u32>());
    for r in 0..cfg.rounds {
        for k in 0..n {
            let i = (k + r) % n;
            let w = sem_window(&pools[i], &name, cfg.window).await;
            eprintln!(
                "semaphore {}: {:.0} grants/s fairness {:.2} max holders {}",
                targets[i].backend, w.grants_per_s, w.fairness, w.max_holders
            );
            sem[i].push(w);
        }
    }
    SlotResults {
        elect,
        sem,
        elapsed: started.elapsed(),
    }
}

fn us(d: Duration) -> String {
    format!("{:.0} µs", d.as_secs_f64() * 1e6)
}

/// The section of docs/benchmarks.md; `refs` per target (same order), the plots into `plots`.
pub fn report(
    targets: &[Target],
    res: &SlotResults,
    refs: &[LockRef],
    plots: Option<&Path>,
) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "## Elections and semaphores (issue #14)\n");
    let _ = writeln!(
        md,
        "Backends that implement `Election` and `Semaphore`, interleaved in rotating order, each \
         client with a connection of its own (memory: one shared in-process instance). These \
         rows took {:.0} s.\n",
        res.elapsed.as_secs_f64()
    );
    let _ = writeln!(
        md,
        "### Election handover: resign → the next candidate's campaign returns\n\nTwo runs per \
         backend and N ({} samples each; a leader keeps leadership 2 ms so that all candidates \
         wait). Ratio = the median handover over the same backend's lockkit lock hand-off at \
         the same number of waiters (above; – where not measured).\n",
        res.elect
            .first()
            .and_then(|e| e.first())
            .map_or(0, |(_, r)| r[0].len())
    );
    let _ = writeln!(
        md,
        "| backend | candidates waiting | ratio to lock hand-off | median (runs) | p99 (runs) |\n|---|---|---|---|---|"
    );
    let run_median = |runs: &[Vec<Duration>]| {
        median(
            &mut runs
                .iter()
                .map(|l| crate::pct(l, 50).as_secs_f64())
                .collect::<Vec<_>>(),
        )
    };
    for (i, t) in targets.iter().enumerate() {
        for (waiting, runs) in &res.elect[i] {
            let ratio = refs
                .get(i)
                .and_then(|r| r.handoff.iter().find(|(n, _)| n == waiting))
                .map_or("–".to_owned(), |(_, h)| {
                    format!("**{:.2}×**", run_median(runs) / h.as_secs_f64())
                });
            let at = |q: usize| {
                runs.iter()
                    .map(|l| us(crate::pct(l, q)))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let _ = writeln!(
                md,
                "| {} | {waiting} | {ratio} | {} | {} |",
                t.backend,
                at(50),
                at(99)
            );
        }
    }
    let _ = writeln!(
        md,
        "\n![election handover](benchmarks/election-handover.svg)\n"
    );
    let _ = writeln!(
        md,
        "### Semaphore: {SEM_CLIENTS} clients, {PERMITS} permits, empty critical section\n\n\
         Median of the windows (min–max). Ratio = permit grants/s over the same backend's \
         lockkit lock grants/s with 16 clients (above). Most holders at once: counted in this \
         process between a grant returning and its release (must be ≤ {PERMITS}).\n"
    );
    let _ = writeln!(
        md,
        "| backend | ratio to lock at 16 clients | grants/s | fairness (min/max per client) | most holders at once |\n|---|---|---|---|---|"
    );
    for (i, t) in targets.iter().enumerate() {
        let ws = &res.sem[i];
        let g: Vec<f64> = ws.iter().map(|w| w.grants_per_s).collect();
        let (lo, hi) = spread(&g);
        let med = median(&mut g.clone());
        let ratio = refs
            .get(i)
            .and_then(|r| r.grants16)
            .map_or("–".to_owned(), |l| format!("**{:.2}×**", med / l));
        let _ = writeln!(
            md,
            "| {} | {ratio} | {med:.0} ({lo:.0}–{hi:.0}) | {:.2} | {} |",
            t.backend,
            median(&mut ws.iter().map(|w| w.fairness).collect::<Vec<_>>()),
            ws.iter().map(|w| w.max_holders).max().unwrap_or(0)
        );
    }
    let _ = writeln!(md, "\n![semaphore](benchmarks/semaphore.svg)\n");
    if let Some(dir) = plots {
        let series: Vec<(String, Vec<(f64, f64)>)> = targets
            .iter()
            .enumerate()
            .map(|(i, t)| {
                (
                    t.backend.to_owned(),
                    res.elect[i]
                        .iter()
                        .map(|(n, runs)| (*n as f64, run_median(runs) * 1e6))
                        .collect(),
                )
            })
            .collect();
        crate::plot::lines(
            &dir.join("election-handover.svg"),
            "Election: resign → next campaign returns (median, µs)",
            "candidates waiting",
            "µs",
            &series,
        );
        let series: Vec<(String, Vec<(f64, f64)>)> = targets
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let mut g: Vec<f64> = res.sem[i].iter().map(|w| w.grants_per_s).collect();
                (
                    t.backend.to_owned(),
                    vec![(SEM_CLIENTS as f64, median(&mut g))],
                )
            })
            .collect();
        crate::plot::lines(
            &dir.join("semaphore.svg"),
            "Semaphore of 4 permits (median grants/s)",
            "clients",
            "grants/s",
            &series,
        );
    }
    md
}
