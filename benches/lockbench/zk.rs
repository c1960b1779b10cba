//! ZooKeeper rows: the hand-written floor (the lock recipe's round trips done by hand with
//! zookeeper-client), zookeeper-client's own lock recipe, lockkit's acquire + release, and the
//! handoff latency with 16 waiters.
//!
//! The first three rows are measured **interleaved** (floor, recipe, lockkit, floor, …) so that
//! they see the same server and machine load; measured one after the other, the shared 2-core
//! machine's load swings moved their ratio by ±20 % between runs.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lockkit::zk::ZkLock;
use lockkit::zk::zookeeper_client as zk;
use lockkit::{AcquireOptions, Lock, Wait};

use crate::{Op, Row, interleaved, row, url};

const BACKEND: &str = "zk";

pub async fn run(iters: usize) -> Vec<Row> {
    let base = url("LOCKKIT_ZK_URL");
    let hostport = base
        .strip_prefix("zk://")
        .expect("LOCKKIT_ZK_URL is zk://host:port")
        .to_owned();
    let run_id = format!("{:08x}", rand::random::<u32>());
    let client = zk::Client::connector()
        .with_session_timeout(Duration::from_secs(10))
        .connect(&hostport)
        .await
        .expect("connect zookeeper-client");
    let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
    let ephemeral_seq = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
    let dir = format!("/lockbench-{run_id}");
    let floor_dir = format!("{dir}/floor");
    let recipe_dir = format!("{dir}/recipe");
    for d in [&dir, &floor_dir] {
        client.create(d, &[], &persistent).await.expect("bench dir");
    }
    let lockkit_url = format!("{base}?prefix=lockbench-{run_id}-lk");
    let locks = ZkLock::connect(&lockkit_url)
        .await
        .expect("connect lockkit");
    let opts = AcquireOptions::new()
        .ttl(Duration::from_secs(10))
        .wait(Wait::No);
    let lock_options = zk::LockOptions::new(zk::Acls::anyone_all())
        .with_ancestor_options(persistent.clone())
        .expect("lock options");

    let (client, floor_dir, recipe_dir) = (&client, &floor_dir, &recipe_dir);
    let (ephemeral_seq, lock_options, locks, opts) = (&ephemeral_seq, &lock_options, &locks, &opts);
    let ops: Vec<(&str, Op<'_>)> = vec![
        // Floor: exactly the round trips of one uncontended grant and release.
        (
            "hand: create ephemeral-seq + getChildren + delete",
            Box::new(move || {
                Box::pin(async move {
                    let prefix = format!("{floor_dir}/n-");
                    let (_, seq) = client
                        .create(&prefix, &[], ephemeral_seq)
                        .await
                        .expect("create");
                    let children = client.list_children(floor_dir).await.expect("children");
                    assert_eq!(children.len(), 1);
                    client
                        .delete(&format!("{prefix}{seq}"), None)
                        .await
                        .expect("delete");
                })
            }),
        ),
        // zookeeper-client's recipe (Client::lock, Curator-style node names). Its LockClient
        // deletes the node in the background on drop; the row deletes it explicitly instead, so
        // the release is inside the measurement, and forgets the guard.
        (
            "zookeeper-client Client::lock + delete (its recipe)",
            Box::new(move || {
                Box::pin(async move {
                    let prefix = zk::LockPrefix::new_curator(recipe_dir, "lock-").expect("prefix");
                    let guard = client
                        .lock(prefix, b"", lock_options.clone())
                        .await
                        .expect("lock");
                    client
                        .delete(guard.lock_path(), None)
                        .await
                        .expect("unlock");
                    std::mem::forget(guard);
                })
            }),
        ),
        (
            "lockkit acquire + release",
            Box::new(move || {
                Box::pin(async move {
                    let l = locks.acquire("bench", opts.clone()).await.expect("acquire");
                    l.release().await.expect("release");
                })
            }),
        ),
    ];
    // Warm-up of iters / 2 rounds: the server is a JVM whose code paths get compiled during the
    // first thousands of requests.
    let mut rows = interleaved(BACKEND, ops, (iters / 2).max(10), iters).await;
    rows.push(handoff(&lockkit_url, 16, iters.min(1000)).await);

    // Clean up the hand-made nodes (lockkit's are container nodes, removed by the server).
    for p in [recipe_dir.as_str(), floor_dir.as_str(), dir.as_str()] {
        let _ = client.delete(p, None).await;
    }
    rows
}

/// `waiters` + 1 clients loop acquire → release on one lock, so `waiters` are always queued; each
/// sample is the time from a holder starting its release to the next holder's acquire returning.
async fn handoff(url: &str, waiters: usize, samples: usize) -> Row {
    let last_release: Arc<Mutex<Option<Instant>>> = Arc::new(Mutex::new(None));
    let got: Arc<Mutex<Vec<Duration>>> = Arc::new(Mutex::new(Vec::with_capacity(samples)));
    let warmup = 32;
    let mut tasks = Vec::new();
    for _ in 0..=waiters {
        let locks = ZkLock::connect(url).await.expect("connect");
        let (last_release, got) = (last_release.clone(), got.clone());
        tasks.push(tokio::spawn(async move {
            let opts = AcquireOptions::new().ttl(Duration::from_secs(10));
            loop {
                let lease = locks
                    .acquire("handoff", opts.clone())
                    .await
                    .expect("acquire");
                let now = Instant::now();
                let done = {
                    let mut got = got.lock().unwrap();
                    if got.len() >= samples + warmup {
                        true
                    } else {
                        if let Some(t) = last_release.lock().unwrap().take() {
                            got.push(now - t);
                        }
                        false
                    }
                };
                if done {
                    *last_release.lock().unwrap() = None;
                    lease.release().await.expect("release");
                    return;
                }
                *last_release.lock().unwrap() = Some(Instant::now());
                lease.release().await.expect("release");
            }
        }));
    }
    for t in tasks {
        t.await.expect("handoff task");
    }
    let v = got.lock().unwrap().split_off(warmup);
    row(
        BACKEND,
        &format!("lockkit handoff, {waiters} waiters (release → next acquire returns)"),
        v,
    )
}
