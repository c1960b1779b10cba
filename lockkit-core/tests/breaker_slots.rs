//! Breaker tests (helper break1) of elections and semaphores on the memory backend: a waiter
//! whose handed slot ran out before it ran, permits that expire without keepalive, 100
//! candidates with cancellations in the middle of hand-offs, and a lagging observer.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use lockkit_core::{
    AcquireOptions, Election, Error, LeaderEvent, LeaseState, MemoryLock, Semaphore, Wait,
};

fn once(ttl: Duration) -> AcquireOptions {
    AcquireOptions::new().ttl(ttl).wait(Wait::No)
}

/// A candidate that was handed the leadership (by a resign) but whose runtime stalled past its
/// short TTL before the candidate's task ran: the expired slot is reaped by the next look at the
/// name. The candidate is out of the line by then; it must not be left waiting for a wake that
/// never comes (nobody else wants the election, so it should simply lead).
#[test]
fn a_candidate_whose_handed_slot_ran_out_before_it_ran_is_not_stuck() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let m = MemoryLock::new();
        let leader = m
            .campaign("stall", b"a", once(Duration::from_secs(10)))
            .await
            .expect("first leader");
        let m2 = m.clone();
        let candidate = tokio::spawn(async move {
            m2.campaign(
                "stall",
                b"w",
                AcquireOptions::new()
                    .ttl(Duration::from_millis(100))
                    .wait(Wait::Timeout(Duration::from_secs(5))),
            )
            .await
        });
        // Let the candidate queue (one thread: it runs until it waits).
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        leader
            .resign()
            .await
            .expect("resign: hands over to the candidate");
        // The runtime stalls (a busy thread, a paused process) past the candidate's 100 ms TTL.
        std::thread::sleep(Duration::from_millis(200));
        // Any look at the name reaps the expired slot.
        assert_eq!(m.leader("stall").await.expect("leader()"), None);
        match candidate.await.expect("task") {
            Ok(l) => {
                assert_ne!(l.state(), LeaseState::Lost);
                l.resign().await.expect("resign");
            }
            Err(Error::Timeout { .. }) => panic!(
                "stuck candidate: handed a slot that ran out before it ran, it was out of the \
                 line and never woken again, though nobody else wanted the election"
            ),
            Err(e) => panic!("candidate: {e:?}"),
        }
    });
}

/// Permits that nobody renews (`keepalive(false)`) run out: their slots go back to waiters,
/// and once the semaphore is idle another N is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_permits_are_reclaimed_and_an_idle_semaphore_takes_a_new_n() {
    let m = MemoryLock::new();
    let ttl = Duration::from_millis(300);
    let a = m
        .acquire_permit("exp", 2, once(ttl).keepalive(false))
        .await
        .expect("a");
    let b = m
        .acquire_permit("exp", 2, once(ttl).keepalive(false))
        .await
        .expect("b");
    assert!(matches!(
        m.acquire_permit("exp", 2, once(ttl)).await,
        Err(Error::Held { .. })
    ));
    assert!(matches!(
        m.acquire_permit("exp", 3, once(ttl)).await,
        Err(Error::PermitsMismatch { .. })
    ));
    // A waiter gets a slot once they expire.
    let w = m
        .acquire_permit(
            "exp",
            2,
            AcquireOptions::new().wait(Wait::Timeout(Duration::from_secs(5))),
        )
        .await
        .expect("a reclaimed permit");
    assert!(a.state() == LeaseState::Lost || b.state() == LeaseState::Lost);
    w.release().await.expect("release");
    a.lost().await;
    b.lost().await;
    // All expired, nobody waits: idle, so N = 5 is accepted now.
    let p = m
        .acquire_permit("exp", 5, once(ttl))
        .await
        .expect("an idle semaphore takes a new N");
    assert_eq!(p.permits(), 5);
    p.release().await.expect("release");
}

/// 100 candidates campaign for one election; every third one is cancelled while waiting (some
/// right as a resign hands it the leadership). One leader at a time (a fenced counter), terms
/// increase, and every candidate that was not cancelled leads exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_candidates_with_cancellations_in_the_hand_offs() {
    let m = MemoryLock::new();
    let leading = Arc::new(AtomicU64::new(0));
    let last_term = Arc::new(AtomicU64::new(0));
    let led = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for i in 0..100u64 {
        let (m, leading, last_term, led) =
            (m.clone(), leading.clone(), last_term.clone(), led.clone());
        tasks.push(tokio::spawn(async move {
            let value = format!("c{i}");
            let campaign = m.campaign(
                "hundred",
                value.as_bytes(),
                AcquireOptions::new()
                    .ttl(Duration::from_secs(5))
                    .wait(Wait::Timeout(Duration::from_secs(30))),
            );
            let res = if i % 3 == 0 {
                match tokio::time::timeout(Duration::from_millis(i % 7), campaign).await {
                    Ok(r) => r,
                    Err(_) => return false,
                }
            } else {
                campaign.await
            };
            let l = res.unwrap_or_else(|e| panic!("candidate {i}: {e:?}"));
            assert_eq!(leading.fetch_add(1, Ordering::SeqCst), 0, "two leaders");
            let term = l.term().get();
            assert!(
                term > last_term.swap(term, Ordering::SeqCst),
                "term went down"
            );
            tokio::task::yield_now().await;
            leading.fetch_sub(1, Ordering::SeqCst);
            l.resign().await.expect("resign");
            led.fetch_add(1, Ordering::SeqCst);
            true
        }));
    }
    let mut not_cancelled = 0;
    for t in tasks {
        if t.await.expect("task") {
            not_cancelled += 1;
        }
    }
    assert_eq!(led.load(Ordering::SeqCst), not_cancelled);
    assert_eq!(m.leader("hundred").await.expect("leader()"), None);
}

/// An observer that leaves more than 1024 changes unread gets `Missed`, then states whose
/// terms never go down, ending at the last one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_observer_gets_missed_then_ordered_terms() {
    let m = MemoryLock::new();
    let mut obs = m.observe("lag").await.expect("observe");
    assert_eq!(obs.next().await.expect("first"), LeaderEvent::NoLeader);
    let mut last = 0;
    for _ in 0..1500 {
        let l = m
            .campaign("lag", b"v", once(Duration::from_secs(5)))
            .await
            .expect("leader");
        last = l.term().get();
        l.resign().await.expect("resign");
    }
    let mut saw_missed = false;
    let mut term = 0;
    loop {
        match obs.next().await.expect("next") {
            LeaderEvent::Missed => saw_missed = true,
            LeaderEvent::Leader(info) => {
                assert!(info.term.get() > term || !saw_missed || term == 0);
                term = info.term.get();
            }
            LeaderEvent::NoLeader if term == last => break,
            LeaderEvent::NoLeader => {}
            _ => {}
        }
    }
    assert!(saw_missed, "3000 unread changes and no Missed");
}

/// The memory lock (not a slot): a lease with a lock-delay that nobody renews is lost on the
/// client at its deadline (TTL minus the drift margin), a little before the table frees it.
/// Dropped at that moment (release on drop on, as `lockkit run` drops a lost lease), its
/// release on drop must not free the lock without the delay: the holder failed to renew.
#[tokio::test(start_paused = true)]
async fn dropping_a_lost_memory_lease_keeps_the_lock_delay() {
    use lockkit_core::{Lock, LockExt};
    let m = MemoryLock::new();
    let (ttl, delay) = (Duration::from_secs(10), Duration::from_secs(30));
    let lease = m
        .acquire(
            "lost-drop",
            AcquireOptions::new()
                .ttl(ttl)
                .keepalive(false)
                .lock_delay(delay)
                .wait(Wait::No),
        )
        .await
        .expect("acquire");
    lease.lost().await;
    assert_eq!(lease.state(), LeaseState::Lost);
    drop(lease);
    for _ in 0..10 {
        tokio::task::yield_now().await; // the release on drop
    }
    match m.try_acquire("lost-drop", ttl).await {
        Err(Error::Held { .. }) => {}
        Ok(l) => panic!(
            "granted (token {}) right after the holder's lease was lost: the release on drop \
             of a lost lease skipped its {delay:?} lock-delay",
            l.token()
        ),
        Err(e) => panic!("{e:?}"),
    }
}

fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

/// Observing an election that nobody runs, then dropping the observer, leaves nothing that
/// grows with the number of names: 5000 names observed once each stay well under 50 MiB.
/// (Each observed name keeps its entry and its broadcast channel of 1024 slots forever.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observing_many_names_once_does_not_keep_memory() {
    let m = MemoryLock::new();
    let before = rss_kib();
    for i in 0..5000 {
        let mut obs = m.observe(&format!("obs-{i}")).await.expect("observe");
        assert_eq!(obs.next().await.expect("first"), LeaderEvent::NoLeader);
    }
    let grown = rss_kib().saturating_sub(before);
    assert!(
        grown < 50 * 1024,
        "RSS grew by {} MiB after observing 5000 idle names once each",
        grown / 1024
    );
}
