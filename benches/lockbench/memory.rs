//! The in-process backend: the cost of lockkit's own machinery, with no network.

use std::time::Duration;

use lockkit::{AcquireOptions, Lock, MemoryLock, Wait};

use crate::{Row, measure};

pub async fn run(iters: usize) -> Vec<Row> {
    let locks = MemoryLock::new();
    let opts = AcquireOptions::new()
        .ttl(Duration::from_secs(10))
        .wait(Wait::No);
    vec![
        measure("memory", "lockkit acquire + release", iters, || async {
            let l = locks.acquire("bench", opts.clone()).await.expect("acquire");
            l.release().await.expect("release");
        })
        .await,
    ]
}
