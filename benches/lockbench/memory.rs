//! The in-process backend: the cost of lockkit's own machinery, with no network.

use std::time::Duration;

use lockkit::{AcquireOptions, Lock, MemoryLock, Wait};

use crate::{Row, interleaved, op};

pub async fn run(iters: usize) -> Vec<Row> {
    let locks = MemoryLock::new();
    let opts = AcquireOptions::new()
        .ttl(Duration::from_secs(10))
        .wait(Wait::No);
    let lockkit = op(|| async {
        let l = locks.acquire("bench", opts.clone()).await.expect("acquire");
        l.release().await.expect("release");
    });
    let warmup = (iters / 10).max(10);
    interleaved(
        "memory",
        vec![("lockkit acquire + release", lockkit)],
        warmup,
        iters,
    )
    .await
}
