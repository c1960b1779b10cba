//! A 3-member etcd cluster on loopback: clients contend for one lock doing fenced increments
//! while the leader is SIGKILLed.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockkit::etcd::etcd_client::GetOptions;
use lockkit::etcd::{EtcdFence, EtcdLock};
use lockkit::{AcquireOptions, Error, FencingToken, Lock, Wait};
use tokio::time::Instant;

use super::support;
use crate::common::fresh_prefix;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// The fenced increment was acknowledged.
    Acked,
    /// The fence rejected it (the lease had lapsed): nothing was written.
    Stale,
    /// The answer was lost (failover): it may or may not have been applied.
    Uncertain,
    /// No write was attempted (the read failed).
    NoWrite,
}

#[derive(Debug, Clone)]
struct Grant {
    token: FencingToken,
    acquired_at: Instant,
    /// When the holder stopped treating itself as the holder: just before release, or the
    /// lease's deadline if that came first.
    held_until: Instant,
    outcome: Outcome,
}

/// Five clients (each with all three endpoints) contend for one lock; each grant reads a counter
/// and writes counter + 1 together with a marker key, fenced by the lock. The leader is
/// SIGKILLed mid-run. Afterwards: the counter equals the number of increments etcd applied (no
/// lost update), acknowledged ≤ applied ≤ acknowledged + uncertain, tokens strictly increase in
/// grant order, no two grants were held at once on the client side, and grants resumed after
/// the new leader was elected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_sigkill_during_fenced_increments() {
    let mut members = support::start_cluster(3).await;
    let eps: Vec<String> = members.iter().map(|m| m.endpoint()).collect();
    let prefix = fresh_prefix();
    let url = format!(
        "etcd://{}?prefix={prefix}&request_timeout_ms=1000&connect_timeout_ms=3000",
        eps.join(",")
    );
    let counter = format!("{prefix}-data/counter");
    let markers = format!("{prefix}-data/applied/");
    let stop = Arc::new(AtomicBool::new(false));
    let grants = Arc::new(Mutex::new(Vec::<Grant>::new()));
    let errors = Arc::new(AtomicUsize::new(0));
    let mut joins = Vec::new();
    for c in 0..5 {
        let locks = EtcdLock::connect(&url)
            .await
            .expect("connect to the cluster");
        let (stop, grants, errors) = (stop.clone(), grants.clone(), errors.clone());
        let (counter, markers) = (counter.clone(), markers.clone());
        joins.push(tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(Ordering::SeqCst) {
                i += 1;
                let opts = AcquireOptions::new()
                    .ttl(Duration::from_secs(2))
                    .wait(Wait::Timeout(Duration::from_secs(15)));
                let lease = match locks.acquire("counter", opts).await {
                    Ok(l) => l,
                    Err(e) => {
                        assert!(
                            matches!(
                                e,
                                Error::Unavailable { .. }
                                    | Error::LeaseLost { .. }
                                    | Error::Timeout { .. }
                            ),
                            "unexpected acquire error: {e:?}"
                        );
                        errors.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let acquired_at = Instant::now();
                let mut kv = locks.client().kv_client();
                let read =
                    tokio::time::timeout(Duration::from_secs(1), kv.get(counter.clone(), None))
                        .await;
                let outcome = match read {
                    Ok(Ok(r)) => {
                        let v: u64 = r
                            .kvs()
                            .first()
                            .and_then(|kv| std::str::from_utf8(kv.value()).ok()?.parse().ok())
                            .unwrap_or(0);
                        let fence = EtcdFence::from_lease(&lease).expect("etcd lease");
                        let marker = format!("{markers}{}-{c}-{i}", lease.token().get());
                        let writes = [
                            (
                                counter.clone().into_bytes(),
                                (v + 1).to_string().into_bytes(),
                            ),
                            (marker.into_bytes(), Vec::new()),
                        ];
                        match fence.put_all(writes).await {
                            Ok(_) => Outcome::Acked,
                            Err(Error::StaleToken { .. }) => Outcome::Stale,
                            Err(_) => Outcome::Uncertain,
                        }
                    }
                    _ => Outcome::NoWrite,
                };
                let held_until = Instant::now().min(lease.valid_until());
                let token = lease.token();
                let _ = lease.release().await;
                grants.lock().unwrap().push(Grant {
                    token,
                    acquired_at,
                    held_until,
                    outcome,
                });
            }
        }));
    }
    // Let contention run, then kill the leader.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let leader = support::leader_index(&members).await;
    let before_kill = grants.lock().unwrap().len();
    assert!(
        before_kill >= 5,
        "no contention before the kill: {before_kill} grants"
    );
    let killed_at = Instant::now();
    members[leader].proc.kill();
    tokio::time::sleep(Duration::from_secs(5)).await;
    stop.store(true, Ordering::SeqCst);
    for j in joins {
        j.await.expect("client task panicked");
    }
    let survivors: Vec<String> = members
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != leader)
        .map(|(_, m)| m.endpoint())
        .collect();
    support::wait_for_leader(&survivors, Duration::from_secs(10)).await;

    // Final state, read from the survivors.
    let reader = EtcdLock::connect(&format!("etcd://{}", survivors.join(",")))
        .await
        .expect("connect to survivors");
    let mut kv = reader.client().kv_client();
    let value: u64 = kv
        .get(counter.clone(), None)
        .await
        .unwrap()
        .kvs()
        .first()
        .map(|kv| std::str::from_utf8(kv.value()).unwrap().parse().unwrap())
        .unwrap_or(0);
    let applied = kv
        .get(
            markers.clone(),
            Some(GetOptions::new().with_prefix().with_count_only()),
        )
        .await
        .unwrap()
        .count() as u64;
    let mut grants = grants.lock().unwrap().clone();
    let count = |o: Outcome| grants.iter().filter(|g| g.outcome == o).count() as u64;
    let (acked, uncertain) = (count(Outcome::Acked), count(Outcome::Uncertain));
    eprintln!(
        "grants {} (before kill {before_kill}), acked {acked}, stale {}, uncertain {uncertain}, \
         no-write {}, acquire errors {}, counter {value}, applied {applied}",
        grants.len(),
        count(Outcome::Stale),
        count(Outcome::NoWrite),
        errors.load(Ordering::SeqCst)
    );
    assert_eq!(value, applied, "lost update: counter != applied increments");
    assert!(acked <= applied && applied <= acked + uncertain);

    grants.sort_by_key(|g| g.acquired_at);
    for w in grants.windows(2) {
        assert!(
            w[0].token < w[1].token,
            "tokens not increasing in grant order: {:?} then {:?}",
            w[0],
            w[1]
        );
        assert!(
            w[0].held_until <= w[1].acquired_at,
            "two grants held at once: {:?} and {:?}",
            w[0],
            w[1]
        );
    }
    let first_after = grants
        .iter()
        .filter(|g| g.acquired_at > killed_at && g.outcome == Outcome::Acked)
        .map(|g| g.acquired_at - killed_at)
        .next();
    eprintln!("first acknowledged grant after the kill: {first_after:?}");
    let after = grants
        .iter()
        .filter(|g| g.acquired_at > killed_at && g.outcome == Outcome::Acked)
        .count();
    assert!(
        after >= 3,
        "contention did not resume after the failover: {after} acknowledged grants"
    );
}

/// Two clients of the cluster (all endpoints) on a fresh prefix, with a request timeout longer
/// than the tests' TTL: a keepalive must not wait for it.
async fn two_clients(eps: &[String]) -> (EtcdLock, EtcdLock, String) {
    let prefix = fresh_prefix();
    let url = format!(
        "etcd://{}?prefix={prefix}&request_timeout_ms=5000&connect_timeout_ms=3000",
        eps.join(",")
    );
    let locks = EtcdLock::connect(&url)
        .await
        .expect("connect to the cluster");
    let other = EtcdLock::connect(&url)
        .await
        .expect("connect to the cluster");
    (locks, other, prefix)
}

/// Try-acquires `name` from `other` after a freeze: `None` if it is held, else the lease and
/// when it was granted. Retries transient errors for up to 15 s (the other client may first
/// reach the member that was just resumed); any other error fails the test.
async fn try_from_other(
    other: &EtcdLock,
    name: &str,
    ttl: Duration,
) -> Option<(lockkit::Lease, Instant)> {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let opts = AcquireOptions::new().ttl(ttl).wait(Wait::No);
        match other.acquire(name, opts).await {
            Err(Error::Held { .. }) => return None,
            Err(e) if e.is_retryable() && Instant::now() < deadline => {}
            Ok(new) => return Some((new, Instant::now())),
            Err(e) => panic!("{name}: {e:?}"),
        }
    }
}

/// One member of a 3-member cluster is frozen (SIGSTOP) for several TTLs while a client (with
/// all three endpoints) holds locks on its session lease: keepalives that the client sends to
/// the frozen member must time out quickly and go to a live member, so no lock is lost.
/// Run with a frozen follower (a frozen leader: `frozen_leader_keeps_fenced_writes_safe`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_member_does_not_lose_held_locks() {
    let members = support::start_cluster(3).await;
    let eps: Vec<String> = members.iter().map(|m| m.endpoint()).collect();
    let (locks, other, _prefix) = two_clients(&eps).await;
    let ttl = Duration::from_secs(2);
    // Only a frozen follower: a frozen leader may revoke the lease early when it resumes
    // (etcd-io/etcd#15247), see frozen_leader_keeps_fenced_writes_safe.
    for round in ["follower"] {
        let leader = support::leader_index(&members).await;
        let victim = if round == "leader" {
            leader
        } else {
            (leader + 1) % 3
        };
        let mut leases = Vec::new();
        for i in 0..4 {
            let opts = AcquireOptions::new().ttl(ttl).wait(Wait::No);
            let name = format!("frozen-{round}-{i}");
            leases.push(locks.acquire(&name, opts).await.expect("acquire"));
        }
        members[victim].proc.signal("STOP");
        // A lost lock stays lost, so looking after the freeze is enough.
        tokio::time::sleep(ttl * 4).await;
        members[victim].proc.signal("CONT");
        support::wait_for_leader(&eps, Duration::from_secs(10)).await;
        for l in &leases {
            assert_ne!(
                l.state(),
                lockkit::LeaseState::Lost,
                "{round}: {}",
                l.name()
            );
            if let Some((new, _)) = try_from_other(&other, l.name(), ttl).await {
                panic!(
                    "{round}: {} should still be held, got {:?}",
                    l.name(),
                    new.token()
                );
            }
        }
        for l in leases {
            l.release().await.expect("release");
        }
    }
}

/// The leader of a 3-member cluster is frozen (SIGSTOP) for several TTLs while a client holds
/// locks, then resumed. Safety, not liveness, is asserted: etcd 3.4.23 (Debian's) has
/// etcd-io/etcd#15247 — a former leader that was stalled may, on resuming, revoke leases it
/// considers expired by its own stale clock, and the new leader commits that revoke although the
/// client kept the lease alive through it (seen in about 15 % of rounds; fixed upstream by
/// etcd-io/etcd#16822). So each lock either stays held (another client gets `Held`) or, if
/// another client gets it, the old holder is told it lost it within a keepalive interval, the
/// new token is larger, and the old holder's fenced write is rejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_leader_keeps_fenced_writes_safe() {
    let members = support::start_cluster(3).await;
    let eps: Vec<String> = members.iter().map(|m| m.endpoint()).collect();
    let (locks, other, prefix) = two_clients(&eps).await;
    let ttl = Duration::from_secs(2);
    let leader = support::leader_index(&members).await;
    let mut leases = Vec::new();
    for i in 0..4 {
        let opts = AcquireOptions::new().ttl(ttl).wait(Wait::No);
        leases.push(
            locks
                .acquire(&format!("frozen-leader-{i}"), opts)
                .await
                .expect("acquire"),
        );
    }
    members[leader].proc.signal("STOP");
    tokio::time::sleep(ttl * 4).await;
    members[leader].proc.signal("CONT");
    support::wait_for_leader(&eps, Duration::from_secs(10)).await;
    for l in &leases {
        match try_from_other(&other, l.name(), ttl).await {
            None => assert_ne!(l.state(), lockkit::LeaseState::Lost, "{}", l.name()),
            Some((new, granted)) => {
                // Freed early by the former leader's revoke (etcd-io/etcd#15247).
                eprintln!("{}: freed early by the resumed former leader", l.name());
                assert!(new.token() > l.token());
                tokio::time::timeout_at(granted + ttl / 3 + Duration::from_secs(2), l.lost())
                    .await
                    .unwrap_or_else(|_| {
                        panic!("{}: old holder not told it lost the lock", l.name())
                    });
                let data = format!("{prefix}-data/{}", l.name());
                match EtcdFence::from_lease(l).unwrap().put(data, "stale").await {
                    Err(Error::StaleToken { .. }) => {}
                    r => panic!("{}: stale holder's fenced write: {r:?}", l.name()),
                }
                new.release().await.expect("release");
            }
        }
    }
    for l in leases {
        let _ = l.release().await;
    }
}

/// A waiter's watch may be served by a member that then freezes (SIGSTOP): the client notices
/// the dead connection only after its HTTP/2 keepalive (15 s), so the waiter must re-read on its
/// own and get the lock within about TTL/2 of the release. Each member is frozen in turn (the
/// watch lands on a random one); the holder talks to a member that stays up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_on_a_frozen_member_wakes_in_time() {
    let members = support::start_cluster(3).await;
    let eps: Vec<String> = members.iter().map(|m| m.endpoint()).collect();
    let prefix = fresh_prefix();
    let ttl = Duration::from_secs(6);
    for (victim, member) in members.iter().enumerate() {
        let other = (victim + 1) % 3;
        let h = EtcdLock::connect(&format!("etcd://{}?prefix={prefix}", eps[other]))
            .await
            .expect("connect the holder");
        let w = EtcdLock::connect(&format!("etcd://{}?prefix={prefix}", eps.join(",")))
            .await
            .expect("connect the waiter");
        let name = format!("frozen-watch-{victim}");
        let opts = AcquireOptions::new().ttl(ttl).wait(Wait::No);
        let held = h.acquire(&name, opts).await.expect("acquire");
        let mut watch = support::PrefixWatch::new(h.client(), &h.name_prefix(&name)).await;
        let (w2, n2) = (w.clone(), name.clone());
        let waiter = tokio::spawn(async move {
            let r = w2.acquire(&n2, AcquireOptions::new().ttl(ttl)).await;
            (Instant::now(), r)
        });
        watch
            .next(
                lockkit::etcd::etcd_client::EventType::Put,
                Duration::from_secs(5),
            )
            .await;
        // The waiter creates its watch after its key (one more round trip); a client cannot
        // observe another client's watch, so give it time to be in place.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        member.proc.signal("STOP");
        let released = Instant::now();
        let rel = held.release().await;
        let outcome = tokio::time::timeout(Duration::from_secs(20), waiter).await;
        member.proc.signal("CONT");
        rel.expect("release");
        let (at, r) = outcome.expect("waiter stuck").expect("join");
        let lease = r.expect("the waiter gets the lock");
        let late = at - released;
        // TTL/2 re-read + a leader election + generous tolerance; 13-15 s without the re-read.
        assert!(
            late < ttl / 2 + Duration::from_secs(5),
            "frozen m{victim}: waiter granted {late:?} after the release"
        );
        let _ = lease.release().await;
        support::wait_for_leader(&eps, Duration::from_secs(10)).await;
    }
}
