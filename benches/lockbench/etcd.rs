//! etcd rows: uncontended acquire + release.
//!
//! (a) the floor: the same two round trips by hand with etcd-client — a put-if-absent
//!     transaction attaching the key to a pre-granted lease, then a delete;
//! (b) etcd's server-side lock service (v3lock `Lock` + `Unlock`) through etcd-client, with a
//!     pre-granted lease;
//! (c) lockkit (session lease already granted: the warm-up acquires grant it; back-to-back
//!     acquires reuse it), waiting acquire (put if the name is free; else a second
//!     transaction queues and reads the holder) and try-acquire (put only if the name is
//!     free), each followed by a release (a delete of the grant's own key);
//! (d) the two requests lockkit's try-acquire + release send, written by hand: what the
//!     library itself adds on top of its round trips is (c) − (d);
//! (e) (a) with the release made a compare-and-delete transaction.
//!
//! Then the hand-off scenario ([`handoff`]): N = 1, 4, 16 queued waiters, release → the next
//! waiter's acquire returns, lockkit beside etcd's own Lock/Unlock, runs interleaved
//! (`LOCKBENCH_ETCD_HANDOFF_ROUNDS` rounds, default 3, of `LOCKBENCH_ETCD_HANDOFFS` samples, 200;
//! `LOCKBENCH_NO_SCENARIOS=1` skips it).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use lockkit::etcd::EtcdLock;

use lockkit::etcd::etcd_client::{Compare, CompareOp, LockOptions, PutOptions, Txn, TxnOp};
use lockkit::{AcquireOptions, Lock, Wait};

use crate::{Row, interleaved, op, url};

pub async fn run(iters: usize) -> Vec<Row> {
    let url = url("LOCKKIT_ETCD_URL");
    let prefix = format!("lockbench-{:08x}", rand::random::<u32>());
    let locks = EtcdLock::connect(&format!("{url}?prefix={prefix}"))
        .await
        .expect("connect");
    let client = locks.client().clone();
    let lease = client
        .lease_client()
        .grant(30, None)
        .await
        .expect("grant")
        .id();
    // Keep the hand-made lease alive for the run.
    let keeper = {
        let client = client.clone();
        tokio::spawn(async move {
            let (mut keeper, mut stream) = client
                .lease_client()
                .keep_alive(lease)
                .await
                .expect("keepalive");
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                if keeper.keep_alive().await.is_err() || stream.message().await.is_err() {
                    return;
                }
            }
        })
    };

    let floor_key = format!("{prefix}/floor/k");
    let v3lock_name = format!("{prefix}/v3lock");
    let ttl = Duration::from_secs(30);
    let names = [
        "(a) by hand: put-if-absent txn (lease) + delete",
        "(b) etcd server-side Lock + Unlock (v3lock)",
        "(c) lockkit acquire + release (waiting acquire)",
        "(c) lockkit acquire + release (try-acquire)",
        "(d) lockkit's try-acquire requests by hand",
        "(e) by hand: put-if-absent txn + compare-delete txn",
    ];
    let one = |i: usize| {
        let (client, locks) = (&client, &locks);
        let (floor_key, v3lock_name) = (&floor_key, &v3lock_name);
        async move {
            match i {
                0 => {
                    let mut kv = client.kv_client();
                    let txn = Txn::new()
                        .when([Compare::create_revision(
                            floor_key.clone(),
                            CompareOp::Equal,
                            0,
                        )])
                        .and_then([TxnOp::put(
                            floor_key.clone(),
                            "",
                            Some(PutOptions::new().with_lease(lease)),
                        )]);
                    let r = kv.txn(txn).await.expect("txn");
                    assert!(r.succeeded());
                    kv.delete(floor_key.clone(), None).await.expect("delete");
                }
                1 => {
                    let mut lc = client.lock_client();
                    let r = lc
                        .lock(
                            v3lock_name.clone(),
                            Some(LockOptions::new().with_lease(lease)),
                        )
                        .await
                        .expect("lock");
                    lc.unlock(r.key().to_vec()).await.expect("unlock");
                }
                2 => {
                    let l = locks
                        .acquire("bench", AcquireOptions::new().ttl(ttl))
                        .await
                        .expect("acquire");
                    l.release().await.expect("release");
                }
                4 => {
                    let mut kv = client.kv_client();
                    let pfx = format!("{floor_key}d/");
                    let key = format!("{pfx}{lease:016x}-0");
                    let txn = Txn::new()
                        .when([Compare::create_revision(pfx.clone(), CompareOp::Equal, 0)
                            .with_prefix()])
                        .and_then([TxnOp::put(
                            key.clone(),
                            "",
                            Some(PutOptions::new().with_lease(lease)),
                        )]);
                    let r = kv.txn(txn).await.expect("txn");
                    assert!(r.succeeded());
                    let d = kv.delete(key.clone(), None).await.expect("delete");
                    assert_eq!(d.deleted(), 1);
                }
                5 => {
                    let mut kv = client.kv_client();
                    let key = format!("{floor_key}e");
                    let txn = Txn::new()
                        .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
                        .and_then([TxnOp::put(
                            key.clone(),
                            "",
                            Some(PutOptions::new().with_lease(lease)),
                        )]);
                    let r = kv.txn(txn).await.expect("txn");
                    assert!(r.succeeded());
                    let rev = r.header().unwrap().revision();
                    let txn = Txn::new()
                        .when([Compare::create_revision(key.clone(), CompareOp::Equal, rev)])
                        .and_then([TxnOp::delete(key.clone(), None)]);
                    assert!(kv.txn(txn).await.expect("txn").succeeded());
                }
                _ => {
                    let l = locks
                        .acquire("bench-try", AcquireOptions::new().ttl(ttl).wait(Wait::No))
                        .await
                        .expect("acquire");
                    l.release().await.expect("release");
                }
            }
        }
    };
    let one = &one;
    let ops = names
        .iter()
        .enumerate()
        .map(|(i, what)| (*what, op(move || one(i))))
        .collect();
    let mut rows = interleaved("etcd", ops, (iters / 10).max(10), iters).await;
    keeper.abort();
    let _ = client.lease_client().revoke(lease).await;
    if std::env::var_os("LOCKBENCH_NO_SCENARIOS").is_none() {
        rows.extend(handoffs(&url).await);
    }
    rows
}

fn env_or(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// The hand-off rows: for each N, lockkit and etcd's Lock/Unlock in alternating order, a few
/// rounds each; one row per (variant, N) over all samples, and the per-run medians printed.
async fn handoffs(url: &str) -> Vec<Row> {
    let rounds = env_or("LOCKBENCH_ETCD_HANDOFF_ROUNDS", 3);
    let samples = env_or("LOCKBENCH_ETCD_HANDOFFS", 200);
    let mut rows = Vec::new();
    for n in [1usize, 4, 16] {
        let mut all: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
        let mut medians: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
        for r in 0..rounds {
            for k in 0..2 {
                let v = (k + r) % 2;
                // etcd's Lock stalls ~50 ms per hand-off at N = 1: fewer samples there.
                let s = if v == 1 && n == 1 {
                    samples / 4
                } else {
                    samples
                };
                let mut lat = handoff(url, n, s.max(10), v == 1).await;
                lat.sort();
                medians[v].push(lat[lat.len() / 2]);
                all[v].extend(lat);
            }
        }
        for (v, what) in ["lockkit", "etcd Lock/Unlock (v3lock)"].iter().enumerate() {
            let ms: Vec<String> = medians[v]
                .iter()
                .map(|d| format!("{:.0}", d.as_secs_f64() * 1e6))
                .collect();
            println!(
                "etcd hand-off N={n} {what}: run medians µs {}",
                ms.join(", ")
            );
            rows.push(crate::row(
                "etcd-handoff",
                &format!("{what}, {n} waiters: release → next acquire returns"),
                std::mem::take(&mut all[v]),
            ));
        }
    }
    rows
}

/// One hand-off run: `waiters` + 1 contenders, each with its own client (own connection, own
/// lease), take turns on one lock; each holds 2 ms (so the others are queued), then releases.
/// Returns release call start → next acquire returns, for `samples` hand-offs.
async fn handoff(url: &str, waiters: usize, samples: usize, v3lock: bool) -> Vec<Duration> {
    let prefix = format!("lockbench-{:08x}", rand::random::<u32>());
    let released_at = Arc::new(std::sync::Mutex::new(None::<Instant>));
    let lat = Arc::new(std::sync::Mutex::new(Vec::with_capacity(samples)));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..=waiters {
        let locks = EtcdLock::connect(&format!("{url}?prefix={prefix}"))
            .await
            .expect("connect");
        let (released, lat, stop) = (released_at.clone(), lat.clone(), stop.clone());
        let name = format!("{prefix}/v3handoff");
        let record = {
            let (released, stop) = (released.clone(), stop.clone());
            move || {
                if let Some(t) = released.lock().unwrap().take() {
                    let mut lat = lat.lock().unwrap();
                    lat.push(t.elapsed());
                    if lat.len() >= samples {
                        stop.store(true, Ordering::Relaxed);
                    }
                }
            }
        };
        tasks.push(tokio::spawn(async move {
            let hold = Duration::from_millis(2);
            if v3lock {
                let client = locks.client().clone();
                let lease = client
                    .lease_client()
                    .grant(30, None)
                    .await
                    .expect("grant")
                    .id();
                let (mut keeper, _stream) = client
                    .lease_client()
                    .keep_alive(lease)
                    .await
                    .expect("keepalive");
                let mut lc = client.lock_client();
                let mut renewed = Instant::now();
                while !stop.load(Ordering::Relaxed) {
                    let r = lc
                        .lock(name.clone(), Some(LockOptions::new().with_lease(lease)))
                        .await
                        .expect("lock");
                    record();
                    tokio::time::sleep(hold).await;
                    if renewed.elapsed() > Duration::from_secs(5) {
                        keeper.keep_alive().await.expect("keepalive");
                        renewed = Instant::now();
                    }
                    *released.lock().unwrap() = Some(Instant::now());
                    lc.unlock(r.key().to_vec()).await.expect("unlock");
                }
                let _ = client.lease_client().revoke(lease).await;
            } else {
                let opts = AcquireOptions::new().ttl(Duration::from_secs(30));
                while !stop.load(Ordering::Relaxed) {
                    let l = locks
                        .acquire("handoff", opts.clone())
                        .await
                        .expect("acquire");
                    record();
                    tokio::time::sleep(hold).await;
                    *released.lock().unwrap() = Some(Instant::now());
                    l.release().await.expect("release");
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("handoff task");
    }
    std::mem::take(&mut *lat.lock().unwrap())
}
