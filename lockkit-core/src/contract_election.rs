//! The contract suite of elections and semaphores: public async test functions every
//! [`SlotBackend`](crate::backend::SlotBackend) must pass.
//!
//! Like [`contract`](crate::contract): each function takes a [`SlotHarness`] handing out fresh
//! clients (same run-unique key prefix) and panics with a readable message when the backend
//! breaks the contract. [`election_suite!`](crate::election_suite) turns the list into named
//! `#[tokio::test]`s:
//!
//! ```ignore
//! lockkit_core::election_suite!(my_backend_harness().await);
//! ```
//!
//! Capabilities a backend does not claim in its [`SlotGuarantees`](crate::SlotGuarantees) are
//! asserted to fail with [`Error::NotSupported`], never skipped silently.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::{
    AcquireOptions, Election, Error, FencingToken, LeaderEvent, LeaderInfo, LeaseState,
    MAX_PERMITS, MAX_VALUE_BYTES, MemoryFence, Semaphore, Wait, drift_margin,
};

/// Hands out clients of the backend under test.
#[async_trait]
pub trait SlotHarness: Send + Sync {
    /// A new, independent election client (its own connection or session), using this run's
    /// key prefix.
    async fn election(&self) -> Arc<dyn Election>;

    /// A new, independent semaphore client, using this run's key prefix.
    async fn semaphore(&self) -> Arc<dyn Semaphore>;

    /// A short TTL the backend supports, for the expiry tests. Default 1 s.
    fn short_ttl(&self) -> Duration {
        Duration::from_secs(1)
    }

    /// Extra time allowed for scheduling and network on a loaded machine. Default 1 s.
    fn tolerance(&self) -> Duration {
        Duration::from_secs(1)
    }
}

fn unique(name: &str) -> String {
    format!("{name}-{:08x}", rand::random::<u32>())
}

const TTL: Duration = Duration::from_secs(10);

fn waiting(timeout: Duration) -> AcquireOptions {
    AcquireOptions::new().ttl(TTL).wait(Wait::Timeout(timeout))
}

fn once() -> AcquireOptions {
    AcquireOptions::new().ttl(TTL).wait(Wait::No)
}

/// `candidates` clients × `rounds` rounds of campaign → fenced read-increment-write keyed by
/// the term → resign: never two leaders at once, the counter is exact, the terms strictly
/// increase in the order of the leaderships, and [`Election::leader`] names the leader.
pub async fn one_leader_at_a_time(h: &dyn SlotHarness, candidates: usize, rounds: usize) {
    let name = unique("one-leader");
    let fence = Arc::new(MemoryFence::<u64>::new());
    let leading = Arc::new(AtomicUsize::new(0));
    let terms = Arc::new(Mutex::new(Vec::<FencingToken>::new()));
    let mut joins = Vec::new();
    for i in 0..candidates {
        let client = h.election().await;
        let (name, fence, leading, terms) =
            (name.clone(), fence.clone(), leading.clone(), terms.clone());
        joins.push(tokio::spawn(async move {
            let value = format!("candidate-{i}").into_bytes();
            for _ in 0..rounds {
                let leader = client
                    .campaign(&name, &value, waiting(Duration::from_secs(60)))
                    .await
                    .expect("campaign");
                let now = leading.fetch_add(1, Ordering::SeqCst) + 1;
                assert_eq!(now, 1, "{now} leaders at once");
                terms.lock().unwrap().push(leader.term());
                let seen = client.leader(&name).await.expect("leader()");
                match seen {
                    Some(info) => {
                        assert_eq!(info, LeaderInfo::new(leader.term(), value.clone()));
                    }
                    None => panic!("leader() says no one leads while {:?} does", leader.term()),
                }
                let v = fence.read("counter").unwrap_or(0);
                tokio::task::yield_now().await;
                fence
                    .write_as(&leader, "counter", v + 1)
                    .expect("fenced write rejected: a later term wrote while we led");
                leading.fetch_sub(1, Ordering::SeqCst);
                leader.resign().await.expect("resign");
            }
        }));
    }
    for j in joins {
        j.await.expect("candidate panicked");
    }
    assert_eq!(
        fence.read("counter"),
        Some((candidates * rounds) as u64),
        "lost updates"
    );
    let terms = terms.lock().unwrap();
    assert!(
        terms.windows(2).all(|w| w[0] < w[1]),
        "terms not strictly increasing: {terms:?}"
    );
}

/// Reads `events` until the observer reports `NoLeader` after `last` was seen, and returns
/// what it read. Panics after `patience` without an event.
async fn read_until_no_leader_after(
    events: &mut mpsc::UnboundedReceiver<crate::Result<LeaderEvent>>,
    last: &FencingToken,
    patience: Duration,
) -> Vec<LeaderEvent> {
    let mut got = Vec::new();
    let mut seen_last = false;
    let mut after_missed = false;
    loop {
        // A `NoLeader` right after a `Missed` may be the final state with the last term hidden
        // in the gap (a one-shot watch re-read after the last resign): called once the sequence
        // is over, so it is the end if nothing follows it within the quiet time.
        let quiet = matches!(got.last(), Some(LeaderEvent::NoLeader)) && after_missed;
        let wait = if quiet { patience / 5 } else { patience };
        let event = match tokio::time::timeout(wait, events.recv()).await {
            Ok(e) => e.expect("observer task ended").expect("observer error"),
            Err(_) if quiet => return got,
            Err(_) => panic!("no observer event for {patience:?}; so far {got:?}"),
        };
        match &event {
            LeaderEvent::Leader(l) => {
                seen_last = l.term == *last;
                after_missed = false;
            }
            LeaderEvent::NoLeader if seen_last => {
                got.push(event);
                return got;
            }
            // A gap may have hidden the last term; what follows is a state after it.
            LeaderEvent::Missed => {
                seen_last = false;
                after_missed = true;
            }
            LeaderEvent::NoLeader => {}
        }
        got.push(event);
    }
}

/// An observer sees the state when it started, then every leader of a sequence (terms and
/// proclaimed values) in order, then `NoLeader`; terms never go down, and a leader it did not
/// see is marked by `Missed` before the next state, only where the backend claims
/// `every_change_observed: false`.
pub async fn observers_see_every_term(h: &dyn SlotHarness) {
    let (watcher, a, b) = (h.election().await, h.election().await, h.election().await);
    let g = watcher.election_guarantees();
    let name = unique("observe");
    if !g.observe {
        match watcher.observe(&name).await {
            Err(Error::NotSupported { .. }) => return,
            other => panic!("observe = false but observe() gave {other:?}"),
        }
    }
    let mut observer = watcher.observe(&name).await.expect("observe");
    let first = observer.next().await.expect("first event");
    assert_eq!(first, LeaderEvent::NoLeader, "an election never held");
    let (tx, mut events) = mpsc::unbounded_channel();
    let reader = tokio::spawn(async move {
        loop {
            let e = observer.next().await;
            let failed = e.is_err();
            if tx.send(e).is_err() || failed {
                return;
            }
        }
    });
    let mut expected: Vec<LeaderInfo> = Vec::new();
    let mut last = None;
    for round in 0..3 {
        let mut la = a
            .campaign(&name, format!("a{round}").as_bytes(), once())
            .await
            .expect("campaign of a free election");
        expected.push(LeaderInfo::new(la.term(), la.value().to_vec()));
        let proclaimed = format!("a{round}-proclaimed").into_bytes();
        la.proclaim(&proclaimed).await.expect("proclaim");
        assert_eq!(la.value(), proclaimed);
        expected.push(LeaderInfo::new(la.term(), proclaimed.clone()));
        let now = b.leader(&name).await.expect("leader()");
        assert_eq!(now, Some(LeaderInfo::new(la.term(), proclaimed)));
        // B stands in line, then A hands over to it.
        let b2 = b.clone();
        let (name2, value) = (name.clone(), format!("b{round}").into_bytes());
        let next = tokio::spawn(async move {
            b2.campaign(&name2, &value, waiting(Duration::from_secs(30)))
                .await
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        la.resign().await.expect("resign");
        let lb = next.await.unwrap().expect("campaign of the next candidate");
        assert!(lb.term() > expected[expected.len() - 1].term);
        expected.push(LeaderInfo::new(lb.term(), lb.value().to_vec()));
        last = Some(lb.term());
        lb.resign().await.expect("resign");
    }
    let last = last.expect("three rounds ran");
    let got = read_until_no_leader_after(&mut events, &last, h.tolerance() * 5).await;
    reader.abort();
    // Check the order: each leader state is the next expected one, or a later one after a Missed.
    let mut at = 0;
    let mut gap = false;
    let mut highest: Option<FencingToken> = None;
    for event in &got {
        match event {
            LeaderEvent::Missed => {
                assert!(
                    !g.every_change_observed,
                    "Missed from a backend that claims every change is observed: {got:?}"
                );
                gap = true;
            }
            LeaderEvent::NoLeader => {}
            LeaderEvent::Leader(l) => {
                if let Some(t) = &highest {
                    assert!(l.term >= *t, "term went down: {got:?}");
                }
                highest = Some(l.term.clone());
                let Some(pos) = expected[at..].iter().position(|e| e == l) else {
                    panic!(
                        "unexpected or out-of-order leader {l:?}; expected {expected:?}, got {got:?}"
                    );
                };
                assert!(
                    pos == 0 || gap,
                    "skipped {:?} without a Missed: got {got:?}",
                    &expected[at..at + pos]
                );
                at += pos + 1;
                gap = false;
            }
        }
    }
    assert_eq!(got.last(), Some(&LeaderEvent::NoLeader));
    // Leaders after the last one delivered may be missing only behind a final `Missed`.
    assert!(
        at == expected.len() || gap,
        "the last leader was not seen (and no Missed said so): {got:?}"
    );
}

/// A resign hands leadership to the next candidate in line, within the tolerance, and to that
/// one only: the candidate after it keeps waiting until the next resign. FIFO where claimed.
pub async fn resign_hands_over(h: &dyn SlotHarness) {
    let (a, reader) = (h.election().await, h.election().await);
    let fifo = a.election_guarantees().lock.fifo_waiters;
    let name = unique("resign");
    let la = a.campaign(&name, b"a", once()).await.expect("campaign");
    let (won_tx, mut won) = mpsc::unbounded_channel();
    let mut resign = Vec::new();
    for label in ["b", "c"] {
        let c = h.election().await;
        let (name, won_tx) = (name.clone(), won_tx.clone());
        let (resign_tx, resign_rx) = oneshot::channel::<()>();
        resign.push(resign_tx);
        tokio::spawn(async move {
            let l = c
                .campaign(&name, label.as_bytes(), waiting(Duration::from_secs(60)))
                .await
                .expect("campaign");
            let _ = won_tx.send((label, l.term(), Instant::now()));
            let _ = resign_rx.await;
            l.resign().await.expect("resign");
        });
        // Let each candidate join the line before the next one.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(won.try_recv().is_err(), "a candidate won while A led");
    let resigned = Instant::now();
    let term_a = la.term();
    la.resign().await.expect("resign");
    let (first, term_1, at) = tokio::time::timeout(h.tolerance() * 3, won.recv())
        .await
        .expect("no candidate took over after the resign")
        .expect("candidate task");
    assert!(
        at - resigned <= h.tolerance(),
        "hand-over took {:?}",
        at - resigned
    );
    if fifo {
        assert_eq!(first, "b", "FIFO: the first candidate in line leads next");
    }
    assert!(term_1 > term_a);
    assert_eq!(
        reader.leader(&name).await.expect("leader()"),
        Some(LeaderInfo::new(term_1.clone(), first.as_bytes().to_vec()))
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(300), won.recv())
            .await
            .is_err(),
        "two candidates won one resign"
    );
    let i = usize::from(first != "b");
    let _ = resign.remove(i).send(());
    let (second, term_2, _) = tokio::time::timeout(h.tolerance() * 3, won.recv())
        .await
        .expect("the last candidate did not take over")
        .expect("candidate task");
    assert_ne!(second, first);
    assert!(term_2 > term_1);
    let _ = resign.remove(0).send(());
    // Once the last leader resigned, no one leads.
    let deadline = Instant::now() + h.tolerance() * 3;
    while reader.leader(&name).await.expect("leader()").is_some() {
        assert!(
            Instant::now() < deadline,
            "a leader stayed after its resign"
        );
        tokio::task::yield_now().await;
    }
}

/// A leader that stops renewing (paused) loses leadership after its TTL: the next candidate
/// leads with a higher term, the old leader's loss signal fires, its fenced writes are
/// rejected, its proclaim and resign fail.
pub async fn lapsed_leader_loses(h: &dyn SlotHarness) {
    let (a, b, reader) = (h.election().await, h.election().await, h.election().await);
    let g = a.election_guarantees();
    let name = unique("lapsed-leader");
    let ttl = h.short_ttl();
    let paused = AcquireOptions::new()
        .ttl(ttl)
        .keepalive(false)
        .wait(Wait::No);
    if !g.lock.manual_renewal {
        match a.campaign(&name, b"a", paused).await {
            Err(Error::NotSupported { .. }) => return,
            other => panic!("manual_renewal=false but keepalive(false) gave {other:?}"),
        }
    }
    let sent = Instant::now();
    let mut la = a.campaign(&name, b"a", paused).await.expect("campaign");
    let fence = MemoryFence::new();
    fence
        .write_as(&la, "resource", 1)
        .expect("the leader's write");
    let lost = tokio::spawn(la.lost());
    let wait = ttl + g.lock.expiry_slack + h.tolerance() * 2;
    let lb = b
        .campaign(&name, b"b", waiting(wait))
        .await
        .expect("no new leader after the old one lapsed");
    let granted = Instant::now();
    assert!(
        granted >= sent + ttl - drift_margin(ttl),
        "a new leader before the old one's TTL ran out"
    );
    assert!(lb.term() > la.term());
    tokio::time::timeout(h.tolerance(), lost)
        .await
        .expect("the old leader's loss signal did not fire")
        .unwrap();
    fence
        .write_as(&lb, "resource", 2)
        .expect("the new leader's write");
    match fence.write_as(&la, "resource", 3) {
        Err(Error::StaleToken { token, current, .. }) => {
            assert_eq!(token, la.term());
            assert_eq!(current, lb.term());
        }
        other => panic!("the old leader's write: expected StaleToken, got {other:?}"),
    }
    assert_eq!(fence.read("resource"), Some(2));
    assert_eq!(la.state(), LeaseState::Lost);
    match la.proclaim(b"still me").await {
        Err(Error::LeaseLost { .. } | Error::NotHeld { .. }) => {}
        other => panic!("proclaim by a lapsed leader: {other:?}"),
    }
    assert_eq!(
        reader.leader(&name).await.expect("leader()"),
        Some(LeaderInfo::new(lb.term(), b"b".to_vec())),
        "the lapsed leader's proclaim changed something"
    );
    match la.resign().await {
        Err(Error::NotHeld { .. }) => {}
        other => panic!("resign by a lapsed leader: {other:?}"),
    }
    lb.check().await.expect("the new leader is untouched");
    lb.resign().await.expect("resign");
}

/// Dropping a waiting campaign leaves no candidate behind: after the leader resigns, a
/// try-once campaign wins at once.
pub async fn cancelled_candidate_leaves_nothing(h: &dyn SlotHarness) {
    let (a, b, c) = (h.election().await, h.election().await, h.election().await);
    let name = unique("cancelled-candidate");
    let la = a.campaign(&name, b"a", once()).await.expect("campaign");
    for _ in 0..3 {
        let campaign = b.campaign(&name, b"b", AcquireOptions::new().ttl(TTL));
        assert!(
            tokio::time::timeout(Duration::from_millis(200), campaign)
                .await
                .is_err(),
            "a campaign won while another candidate led"
        );
    }
    match c.campaign(&name, b"c", once()).await {
        Err(Error::Held { .. }) => {}
        other => panic!("a try-once campaign while A leads: expected Held, got {other:?}"),
    }
    la.resign().await.expect("resign");
    let deadline = Instant::now() + h.tolerance() * 3;
    let lc = loop {
        match c.campaign(&name, b"c", once()).await {
            Ok(l) => break l,
            Err(Error::Held { .. }) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => panic!("a dropped candidate left something behind: {other:?}"),
        }
    };
    lc.resign().await.expect("resign");
}

/// Bad names, values and TTLs (and a lock-delay the backend lacks) get typed errors before any
/// I/O; a value of exactly
/// `MAX_VALUE_BYTES` works; an election never held has no leader.
pub async fn election_bad_input(h: &dyn SlotHarness) {
    let a = h.election().await;
    let long = "x".repeat(257);
    for name in [
        "",
        "a/b",
        "..",
        ".",
        "nul\0byte",
        "../escape",
        long.as_str(),
    ] {
        // The error says what the name was for ("invalid election name"), not "lock".
        match a.campaign(name, b"v", once()).await {
            Err(Error::InvalidName {
                what: "election", ..
            }) => {}
            other => panic!("campaign {name:?}: expected InvalidName, got {other:?}"),
        }
        assert!(
            matches!(
                a.leader(name).await,
                Err(Error::InvalidName {
                    what: "election",
                    ..
                })
            ),
            "leader({name:?})"
        );
        assert!(
            matches!(
                a.observe(name).await,
                Err(Error::InvalidName {
                    what: "election",
                    ..
                })
            ),
            "observe({name:?})"
        );
    }
    let name = unique("election-bad-input");
    assert_eq!(a.leader(&name).await.expect("leader()"), None);
    let huge = vec![b'v'; MAX_VALUE_BYTES + 1];
    match a.campaign(&name, &huge, once()).await {
        Err(Error::InvalidConfig { .. }) => {}
        other => panic!("oversized value: expected InvalidConfig, got {other:?}"),
    }
    for ttl in [Duration::ZERO, Duration::from_millis(1)] {
        match a.campaign(&name, b"v", once().ttl(ttl)).await {
            Err(Error::InvalidConfig { .. }) => {}
            other => panic!("ttl {ttl:?}: expected InvalidConfig, got {other:?}"),
        }
    }
    if !a.election_guarantees().lock.lock_delay {
        match a
            .campaign(&name, b"v", once().lock_delay(Duration::from_secs(1)))
            .await
        {
            Err(Error::NotSupported { .. }) => {}
            other => panic!("lock-delay without support: expected NotSupported, got {other:?}"),
        }
    }
    let full: Vec<u8> = (0..MAX_VALUE_BYTES).map(|i| (i % 251) as u8).collect();
    let mut leader = a
        .campaign(&name, &full, once())
        .await
        .expect("a value of MAX_VALUE_BYTES");
    assert_eq!(
        a.leader(&name).await.expect("leader()"),
        Some(LeaderInfo::new(leader.term(), full))
    );
    match leader.proclaim(&huge).await {
        Err(Error::InvalidConfig { .. }) => {}
        other => panic!("oversized proclaim: expected InvalidConfig, got {other:?}"),
    }
    assert_eq!(leader.state(), LeaseState::Held);
    leader.resign().await.expect("resign");
    assert_eq!(a.leader(&name).await.expect("leader()"), None);
}

/// `4 × permits` clients × `rounds` rounds: never more than `permits` holders at once, a fenced
/// counter per slot adds up exactly, each slot's tokens strictly increase; and `permits`
/// try-once acquires all succeed, on distinct slots, where one more is refused with `Held`.
pub async fn semaphore_at_most_n(h: &dyn SlotHarness, permits: u32, rounds: usize) {
    let name = unique("at-most-n");
    // Exactly N are admitted.
    let mut held = Vec::new();
    for _ in 0..permits {
        let s = h.semaphore().await;
        held.push(
            s.acquire_permit(&name, permits, once())
                .await
                .expect("a free permit"),
        );
    }
    let mut slots: Vec<u32> = held.iter().map(|p| p.slot()).collect();
    slots.sort_unstable();
    assert_eq!(
        slots,
        (0..permits).collect::<Vec<_>>(),
        "slots of N holders"
    );
    let extra = h.semaphore().await;
    match extra.acquire_permit(&name, permits, once()).await {
        Err(Error::Held { .. }) => {}
        other => panic!("permit N+1: expected Held, got {other:?}"),
    }
    if let Some(info) = extra.permit_holders(&name).await.ok().flatten() {
        assert_eq!(info.permits, permits);
        assert_eq!(info.holders.len(), permits as usize);
    }
    for p in held {
        p.release().await.expect("release");
    }
    // 4N contend.
    let fence = Arc::new(MemoryFence::<u64>::new());
    let holding = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let tokens = Arc::new(Mutex::new(Vec::<(u32, FencingToken)>::new()));
    let mut joins = Vec::new();
    for _ in 0..4 * permits {
        let client = h.semaphore().await;
        let (name, fence, holding, most, tokens) = (
            name.clone(),
            fence.clone(),
            holding.clone(),
            most.clone(),
            tokens.clone(),
        );
        joins.push(tokio::spawn(async move {
            for _ in 0..rounds {
                let p = client
                    .acquire_permit(&name, permits, waiting(Duration::from_secs(60)))
                    .await
                    .expect("acquire_permit");
                let now = holding.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                assert!(
                    now <= permits as usize,
                    "{now} holders of {permits} permits"
                );
                tokens.lock().unwrap().push((p.slot(), p.token()));
                let resource = format!("slot-{}", p.slot());
                let v = fence.read(&resource).unwrap_or(0);
                tokio::task::yield_now().await;
                fence
                    .write_as(&p, &resource, v + 1)
                    .expect("fenced write rejected: a later holder of our slot wrote");
                holding.fetch_sub(1, Ordering::SeqCst);
                p.release().await.expect("release");
            }
        }));
    }
    for j in joins {
        j.await.expect("client panicked");
    }
    let total: u64 = (0..permits)
        .map(|s| fence.read(&format!("slot-{s}")).unwrap_or(0))
        .sum();
    assert_eq!(
        total,
        u64::from(4 * permits) * rounds as u64,
        "lost updates"
    );
    assert!(most.load(Ordering::SeqCst) <= permits as usize);
    let tokens = tokens.lock().unwrap();
    for s in 0..permits {
        let of_slot: Vec<_> = tokens.iter().filter(|(t, _)| *t == s).collect();
        assert!(
            of_slot.windows(2).all(|w| w[0].1 < w[1].1),
            "slot {s}: tokens not strictly increasing: {of_slot:?}"
        );
    }
}

/// Permits whose holders stop renewing are reclaimed after their TTL: a waiter gets one, with
/// a higher token of the same slot, and the old holders' loss signals fire.
pub async fn expired_permits_reclaimed(h: &dyn SlotHarness) {
    let (a, b, c) = (
        h.semaphore().await,
        h.semaphore().await,
        h.semaphore().await,
    );
    let g = a.semaphore_guarantees();
    let name = unique("expired-permits");
    let ttl = h.short_ttl();
    let paused = AcquireOptions::new()
        .ttl(ttl)
        .keepalive(false)
        .wait(Wait::No);
    if !g.lock.manual_renewal {
        match a.acquire_permit(&name, 2, paused).await {
            Err(Error::NotSupported { .. }) => return,
            other => panic!("manual_renewal=false but keepalive(false) gave {other:?}"),
        }
    }
    let sent = Instant::now();
    let p1 = a
        .acquire_permit(&name, 2, paused.clone())
        .await
        .expect("permit");
    let p2 = b.acquire_permit(&name, 2, paused).await.expect("permit");
    match c.acquire_permit(&name, 2, once()).await {
        Err(Error::Held { .. }) => {}
        other => panic!("a third permit of two: expected Held, got {other:?}"),
    }
    let lost = tokio::spawn({
        let (l1, l2) = (p1.lost(), p2.lost());
        async move { tokio::join!(l1, l2) }
    });
    let wait = ttl + g.lock.expiry_slack + h.tolerance() * 2;
    let p3 = c
        .acquire_permit(&name, 2, waiting(wait))
        .await
        .expect("an expired permit was not reclaimed");
    assert!(
        Instant::now() >= sent + ttl - drift_margin(ttl),
        "a permit reclaimed before its TTL ran out"
    );
    let old = if p3.slot() == p1.slot() { &p1 } else { &p2 };
    assert!(p3.token().same_lock(&old.token()), "tokens name their slot");
    assert!(p3.token() > old.token());
    tokio::time::timeout(h.tolerance(), lost)
        .await
        .expect("loss signals did not fire")
        .unwrap();
    let p4 = a
        .acquire_permit(&name, 2, waiting(h.tolerance() * 3))
        .await
        .expect("the second expired permit");
    assert_ne!(p3.slot(), p4.slot());
    for p in [p1, p2] {
        assert!(matches!(p.release().await, Err(Error::NotHeld { .. })));
    }
    p3.release().await.expect("release");
    p4.release().await.expect("release");
    if let Ok(info) = c.permit_holders(&name).await {
        assert_eq!(info, None, "holders of an idle semaphore");
    }
}

/// Dropping a waiting acquire leaves nothing behind: once the holder releases, a try-once
/// acquire gets the permit, and the semaphore is idle again (a new N is accepted).
pub async fn cancelled_permit_waiter_leaves_nothing(h: &dyn SlotHarness) {
    let (a, b, c) = (
        h.semaphore().await,
        h.semaphore().await,
        h.semaphore().await,
    );
    let name = unique("cancelled-waiter");
    let p = a.acquire_permit(&name, 1, once()).await.expect("permit");
    for _ in 0..3 {
        let waiting = b.acquire_permit(&name, 1, AcquireOptions::new().ttl(TTL));
        assert!(
            tokio::time::timeout(Duration::from_millis(200), waiting)
                .await
                .is_err(),
            "acquire of a full semaphore returned"
        );
    }
    p.release().await.expect("release");
    let deadline = Instant::now() + h.tolerance() * 3;
    let again = loop {
        match c.acquire_permit(&name, 1, once()).await {
            Ok(p) => break p,
            Err(Error::Held { .. }) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => panic!("a dropped waiter left something behind: {other:?}"),
        }
    };
    again.release().await.expect("release");
    // No waiter pins the old N.
    let wider = c
        .acquire_permit(&name, 3, once())
        .await
        .expect("an idle semaphore takes a new N");
    assert_eq!(wider.permits(), 3);
    wider.release().await.expect("release");
}

/// N = 0, N above `MAX_PERMITS`, bad names and TTLs get typed errors before any I/O; an acquire
/// with another N than the one in force fails with `PermitsMismatch` at once (even a waiting
/// one) and changes nothing.
pub async fn semaphore_bad_input(h: &dyn SlotHarness) {
    let (a, b) = (h.semaphore().await, h.semaphore().await);
    let name = unique("semaphore-bad-input");
    for n in [0, MAX_PERMITS + 1, u32::MAX] {
        match a.acquire_permit(&name, n, once()).await {
            Err(Error::InvalidConfig { .. }) => {}
            other => panic!("{n} permits: expected InvalidConfig, got {other:?}"),
        }
    }
    let long = "x".repeat(257);
    for bad in ["", "a/b", "..", "nul\0byte", long.as_str()] {
        match a.acquire_permit(bad, 2, once()).await {
            Err(Error::InvalidName {
                what: "semaphore", ..
            }) => {}
            other => panic!("name {bad:?}: expected InvalidName, got {other:?}"),
        }
        assert!(matches!(
            a.permit_holders(bad).await,
            Err(Error::InvalidName {
                what: "semaphore",
                ..
            })
        ));
    }
    match a.acquire_permit(&name, 2, once().ttl(Duration::ZERO)).await {
        Err(Error::InvalidConfig { .. }) => {}
        other => panic!("ttl 0: expected InvalidConfig, got {other:?}"),
    }
    let p = a.acquire_permit(&name, 2, once()).await.expect("permit");
    for (n, opts) in [(3, once()), (1, AcquireOptions::new().ttl(TTL))] {
        let start = Instant::now();
        match b.acquire_permit(&name, n, opts).await {
            Err(Error::PermitsMismatch {
                name: got,
                ours,
                theirs,
            }) => {
                assert_eq!((got.as_str(), ours, theirs), (name.as_str(), n, 2));
            }
            other => panic!(
                "{n} permits of a 2-permit semaphore: expected PermitsMismatch, got {other:?}"
            ),
        }
        assert!(
            start.elapsed() < h.tolerance(),
            "a mismatched acquire waited"
        );
    }
    // The mismatches changed nothing: the second permit is still free.
    let q = b.acquire_permit(&name, 2, once()).await.expect("permit");
    assert_ne!(p.slot(), q.slot());
    p.release().await.expect("release");
    q.release().await.expect("release");
}

/// An election and a semaphore of the same name are two things, and their tokens name them:
/// `…elect/{name}` for a term, `…sem/{name}/{slot}` for a permit.
pub async fn elections_and_semaphores_are_separate(h: &dyn SlotHarness) {
    let (e, s) = (h.election().await, h.semaphore().await);
    let name = unique("separate");
    let leader = e.campaign(&name, b"v", once()).await.expect("campaign");
    let permit = s
        .acquire_permit(&name, 1, once())
        .await
        .expect("a semaphore of an election's name");
    let backend = e.election_guarantees().lock.backend;
    let (term, token) = (leader.term(), permit.token());
    assert!(
        term.lock().starts_with(&format!("{backend}/"))
            && term.lock().ends_with(&format!("/elect/{name}")),
        "term {term}"
    );
    assert!(
        token.lock().starts_with(&format!("{backend}/"))
            && token
                .lock()
                .ends_with(&format!("/sem/{name}/{}", permit.slot())),
        "permit token {token}"
    );
    assert!(!term.same_lock(&token));
    assert_eq!(term.to_string().parse::<FencingToken>().ok(), Some(term));
    leader.resign().await.expect("resign");
    permit.release().await.expect("release");
}

/// Expands to one `#[tokio::test]` per function of this suite, each building its harness
/// with `$harness` (an expression of a type implementing [`SlotHarness`], may contain `.await`).
#[macro_export]
macro_rules! election_suite {
    ($harness:expr) => {
        $crate::election_suite!(@tests $harness;
            observers_see_every_term, resign_hands_over, lapsed_leader_loses,
            cancelled_candidate_leaves_nothing, election_bad_input, expired_permits_reclaimed,
            cancelled_permit_waiter_leaves_nothing, semaphore_bad_input,
            elections_and_semaphores_are_separate);
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn one_leader_at_a_time() {
            let h = $harness;
            $crate::contract_election::one_leader_at_a_time(&h, 4, 10).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn semaphore_at_most_n() {
            let h = $harness;
            $crate::contract_election::semaphore_at_most_n(&h, 3, 10).await;
        }
    };
    (@tests $harness:expr; $($name:ident),*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let h = $harness;
                $crate::contract_election::$name(&h).await;
            }
        )*
    };
}
