//! Leader election and semaphores through the facade, on any backend that has them.
//!
//! ```text
//! cargo run --example election                                    # embedded in-memory backend
//! cargo run --example election --features postgres -- --backend postgres://postgres@127.0.0.1:5432/postgres
//! ```
//!
//! The README's "Leader election" and "Semaphores" code is the part of each function between
//! its `README: begin` and `README: end` lines (a unit test of the facade checks that the two
//! match), so what the README shows is built by CI and run by `scripts/test.sh`.

use std::time::Duration;

use lockkit::{AcquireOptions, Error, LeaderEvent, MemoryFence, Wait};

#[tokio::main(flavor = "current_thread")]
async fn main() -> lockkit::Result<()> {
    let url = std::env::args()
        .skip_while(|a| a != "--backend")
        .nth(1)
        .unwrap_or_else(|| "memory://".into());
    let storage = MemoryFence::new();
    election(&url, &storage).await?;
    semaphore(&url, &storage).await?;
    Ok(())
}

async fn election(url: &str, storage: &MemoryFence<&str>) -> lockkit::Result<()> {
    // README: begin
    let elections = lockkit::connect_election(url).await?;
    let mut observer = elections.observe("scheduler").await?; // watches, does not campaign
    let opts = AcquireOptions::new().ttl(Duration::from_secs(10));
    // Waits its turn, then leads until it resigns or its lease is lost.
    let addr = b"10.0.0.7:8080";
    let mut leader = elections.campaign("scheduler", addr, opts).await?;
    storage.write("plan", leader.term(), "v1")?; // fence every write with the term
    leader.proclaim(b"10.0.0.7:9090").await?; // the same term, a new value
    let term = leader.term();
    leader.resign().await?; // the next candidate in line leads

    // Every change, in order: no leader, the term and its values, no leader again
    // (ZooKeeper's observer may report a quick term as missed instead).
    let mut led = false;
    while !(led && observer.last() == Some(&LeaderEvent::NoLeader)) {
        match observer.next().await? {
            LeaderEvent::Leader(l) => {
                led |= l.term == term;
                let value = String::from_utf8_lossy(&l.value);
                println!("term {}: {value}", l.term.get());
            }
            LeaderEvent::NoLeader => println!("no leader"),
            _ => {
                led = true; // our term may be among the changes this observer missed
                println!("missed: changes may be lost here; next is the state after them");
            }
        }
    }
    // README: end
    Ok(())
}

async fn semaphore(url: &str, storage: &MemoryFence<&str>) -> lockkit::Result<()> {
    // README: begin
    let semaphores = lockkit::connect_semaphore(url).await?;
    // At most 2 holders at once; every client must agree on N (else Error::PermitsMismatch).
    let opts = || AcquireOptions::new().ttl(Duration::from_secs(30));
    let a = semaphores.acquire_permit("transcoders", 2, opts()).await?;
    let b = semaphores.acquire_permit("transcoders", 2, opts()).await?;
    // Two holders work at once: each slot is a fencing domain of its own.
    storage.write(&format!("slot-{}", a.slot()), a.token(), "job 1")?;
    storage.write(&format!("slot-{}", b.slot()), b.token(), "job 2")?;
    let once = AcquireOptions::new().wait(Wait::No);
    let third = semaphores.acquire_permit("transcoders", 2, once).await;
    assert!(matches!(third, Err(Error::Held { .. })));
    a.release().await?; // admits the first waiter, if any
    b.release().await?;
    // README: end
    println!("semaphore: two permits held at once, a third refused");
    Ok(())
}
