//! The contract suite: public async test functions every backend must pass.
//!
//! Each function takes a [`Harness`] that hands out fresh clients of the backend under test (all
//! with the same, run-unique key prefix) and panics with a readable message when the backend
//! breaks the contract. [`contract_suite!`](crate::contract_suite) turns the whole list into named,
//! filterable `#[tokio::test]`s:
//!
//! ```ignore
//! lockkit_core::contract_suite!(my_backend_harness().await);
//! ```
//!
//! Capabilities a backend does not claim in its [`Guarantees`] are asserted to fail with
//! [`Error::NotSupported`], never skipped silently.

use crate::backend::LeaseBackendExt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use crate::{
    AcquireOptions, Error, FencingToken, Guarantees, Lease, LeaseState, Lock, LockExt, MemoryFence,
    Wait, drift_margin,
};

/// [`Lock::holder`] of a held lock, read by another client, reports the holder's token and at
/// most its TTL left; of a free lock, `None`. A backend that cannot tell returns
/// [`Error::NotSupported`] for both.
pub async fn holder_is_reported(h: &dyn Harness) {
    let (a, b) = (h.client().await, h.client().await);
    let name = unique("holder");
    let ttl = Duration::from_secs(10);
    match b.holder(&name).await {
        Ok(None) => {}
        Err(Error::NotSupported { .. }) => {
            let lease = a.try_acquire(&name, ttl).await.expect("acquire");
            assert!(
                matches!(b.holder(&name).await, Err(Error::NotSupported { .. })),
                "holder() of a held lock must be NotSupported too"
            );
            lease.release().await.expect("release");
            return;
        }
        other => panic!("holder() of a lock never taken: expected Ok(None), got {other:?}"),
    }
    let lease = a.try_acquire(&name, ttl).await.expect("acquire");
    let info = b
        .holder(&name)
        .await
        .expect("holder() of a held lock")
        .expect("a held lock has a holder");
    assert_eq!(info.token, Some(lease.token()), "holder token");
    if let Some(left) = info.remaining {
        assert!(left <= ttl, "{left:?} left of a {ttl:?} lease");
    }
    lease.release().await.expect("release");
    let after = b.holder(&name).await.expect("holder() after release");
    assert_eq!(after, None, "holder() of a released lock");
    assert!(matches!(
        b.holder("bad/name").await,
        Err(Error::InvalidName { .. })
    ));
}

/// Hands out clients of the backend under test.
#[async_trait]
pub trait Harness: Send + Sync {
    /// A new, independent client (its own connection or session), using this run's key prefix.
    async fn client(&self) -> Arc<dyn Lock>;

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

async fn guarantees(h: &dyn Harness) -> Guarantees {
    h.client().await.guarantees()
}

/// Acquire, see it held by others, release, acquire again with a larger token.
pub async fn acquire_release(h: &dyn Harness) {
    let (a, b) = (h.client().await, h.client().await);
    let name = unique("acquire-release");
    let ttl = Duration::from_secs(10);
    let l1 = a.try_acquire(&name, ttl).await.expect("first acquire");
    assert_eq!(l1.name(), name);
    assert_eq!(l1.ttl(), ttl);
    assert_eq!(l1.state(), LeaseState::Held);
    assert!(l1.remaining() > Duration::ZERO);
    let t1 = l1.token();
    l1.release().await.expect("release");
    let l2 = b
        .try_acquire(&name, ttl)
        .await
        .expect("acquire after release");
    assert!(l2.token() > t1, "token {} not above {}", l2.token(), t1);
    l2.release().await.expect("release");
}

/// A try-acquire of a held lock fails at once with `Held`, from another client and from the same.
pub async fn try_acquire_while_held(h: &dyn Harness) {
    let (a, b) = (h.client().await, h.client().await);
    let name = unique("try-held");
    let ttl = Duration::from_secs(10);
    let lease = a.try_acquire(&name, ttl).await.expect("acquire");
    for c in [&b, &a] {
        let start = Instant::now();
        match c.try_acquire(&name, ttl).await {
            Err(Error::Held { name: n }) => assert_eq!(n, name),
            other => panic!("expected Held, got {other:?}"),
        }
        assert!(start.elapsed() < h.tolerance(), "try-acquire waited");
    }
    lease.release().await.expect("release");
}

/// `tasks` clients × `rounds` rounds of acquire → fenced read-increment-write → release end at
/// exactly `tasks × rounds`, and the tokens seen inside the critical section strictly increase.
pub async fn fenced_counter(h: &dyn Harness, tasks: usize, rounds: usize) {
    let name = unique("counter");
    let fence = Arc::new(MemoryFence::<u64>::new());
    let seen = Arc::new(Mutex::new(Vec::<FencingToken>::new()));
    let mut joins = Vec::new();
    for _ in 0..tasks {
        let client = h.client().await;
        let (name, fence, seen) = (name.clone(), fence.clone(), seen.clone());
        joins.push(tokio::spawn(async move {
            for _ in 0..rounds {
                let opts = AcquireOptions::new()
                    .ttl(Duration::from_secs(10))
                    .wait(Wait::Timeout(Duration::from_secs(60)));
                let lease = client.acquire(&name, opts).await.expect("acquire");
                seen.lock().unwrap().push(lease.token());
                let v = fence.read("counter").unwrap_or(0);
                tokio::task::yield_now().await;
                fence
                    .write("counter", lease.token(), v + 1)
                    .expect("fenced write rejected: a later token wrote while we held the lock");
                lease.release().await.expect("release");
            }
        }));
    }
    for j in joins {
        j.await.expect("task panicked");
    }
    assert_eq!(
        fence.read("counter"),
        Some((tasks * rounds) as u64),
        "lost updates"
    );
    let seen = seen.lock().unwrap();
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "tokens not strictly increasing in grant order: {seen:?}"
    );
}

/// A brand-new client gets a larger token than every earlier grant, even after the earlier
/// clients are gone.
pub async fn new_client_larger_token(h: &dyn Harness) {
    let name = unique("new-client");
    let mut highest = None;
    for _ in 0..3 {
        let c = h.client().await;
        let lease = c
            .try_acquire(&name, Duration::from_secs(10))
            .await
            .expect("acquire");
        if let Some(prev) = highest {
            assert!(lease.token() > prev, "{} not above {}", lease.token(), prev);
        }
        highest = Some(lease.token());
        lease.release().await.expect("release");
        drop(c);
    }
}

/// A holder that stops renewing loses the lock after its TTL and not before; its loss signal
/// fires no later than the moment another client gets the lock.
pub async fn expiry_without_renewal(h: &dyn Harness) {
    let g = guarantees(h).await;
    let (a, b) = (h.client().await, h.client().await);
    let name = unique("expiry");
    let ttl = h.short_ttl();
    let opts = AcquireOptions::new().ttl(ttl).keepalive(false);
    if !g.manual_renewal {
        match a.acquire(&name, opts).await {
            Err(Error::NotSupported { .. }) => return,
            other => panic!("manual_renewal=false but keepalive(false) gave {other:?}"),
        }
    }
    let sent = Instant::now();
    let lease_a = a.acquire(&name, opts).await.expect("acquire");
    let lost = tokio::spawn(lease_a.lost());
    let wait = ttl + g.expiry_slack + h.tolerance() * 2;
    let lease_b = b
        .acquire(
            &name,
            AcquireOptions::new().ttl(ttl).wait(Wait::Timeout(wait)),
        )
        .await
        .expect("the lock did not lapse after its TTL");
    let granted = Instant::now();
    let earliest = sent + ttl - drift_margin(ttl);
    assert!(
        granted >= earliest,
        "granted {:?} before the TTL ran out",
        earliest - granted
    );
    assert!(
        granted <= sent + ttl + g.expiry_slack + h.tolerance(),
        "lapsed lock granted only after {:?}",
        granted - sent
    );
    assert!(lease_b.token() > lease_a.token());
    // A's signal fired by its deadline, which is before B's grant.
    assert!(
        lost.is_finished() || lease_a.valid_until() <= granted,
        "loss signal late"
    );
    tokio::time::timeout(h.tolerance(), lost)
        .await
        .expect("loss signal did not fire")
        .unwrap();
    assert_eq!(lease_a.state(), LeaseState::Lost);
    lease_b.release().await.expect("release");
    drop(lease_a);
}

/// Manual renewals keep a lease alive past several TTLs.
pub async fn renew_extends(h: &dyn Harness) {
    let g = guarantees(h).await;
    let (a, b) = (h.client().await, h.client().await);
    let name = unique("renew");
    let ttl = h.short_ttl();
    let opts = AcquireOptions::new().ttl(ttl).keepalive(false);
    if !g.manual_renewal {
        assert!(matches!(
            a.acquire(&name, opts).await,
            Err(Error::NotSupported { .. })
        ));
        return;
    }
    let lease = a.acquire(&name, opts).await.expect("acquire");
    let first_deadline = lease.valid_until();
    // Renew every TTL/3 until the lease has outlived its first TTL plus the server's slack.
    let mut renewals = 0;
    while renewals < 4 || Instant::now() <= first_deadline + g.expiry_slack {
        tokio::time::sleep(ttl / 3).await;
        lease.renew().await.expect("renew");
        assert_eq!(lease.state(), LeaseState::Held);
        renewals += 1;
    }
    assert!(lease.valid_until() > first_deadline);
    assert!(matches!(
        b.try_acquire(&name, ttl).await,
        Err(Error::Held { .. })
    ));
    lease.release().await.expect("release");
}

/// The automatic keepalive holds a lease across several TTLs.
pub async fn keepalive_holds(h: &dyn Harness) {
    let (a, b) = (h.client().await, h.client().await);
    let name = unique("keepalive");
    let ttl = h.short_ttl();
    let lease = a.try_acquire(&name, ttl).await.expect("acquire");
    let lost = lease.lost();
    tokio::select! {
        _ = lost => panic!("lease lost despite keepalive: {lease:?}"),
        _ = tokio::time::sleep(ttl * 3) => {}
    }
    assert_ne!(lease.state(), LeaseState::Lost);
    assert!(matches!(
        b.try_acquire(&name, ttl).await,
        Err(Error::Held { .. })
    ));
    lease.release().await.expect("release");
}

/// Renew and release by a lease that lapsed and was re-granted return `NotHeld` (or `LeaseLost`
/// on the client side) and leave the new holder untouched.
pub async fn lapsed_lease_cannot_touch_new_holder(h: &dyn Harness) {
    let g = guarantees(h).await;
    if !g.manual_renewal {
        return; // covered by expiry_without_renewal's NotSupported check
    }
    let (a, b, c) = (h.client().await, h.client().await, h.client().await);
    let name = unique("lapsed");
    let ttl = h.short_ttl();
    let lease_a = a
        .acquire(&name, AcquireOptions::new().ttl(ttl).keepalive(false))
        .await
        .expect("acquire");
    let wait = ttl + g.expiry_slack + h.tolerance() * 2;
    let lease_b = b
        .acquire(
            &name,
            AcquireOptions::new()
                .ttl(Duration::from_secs(10))
                .wait(Wait::Timeout(wait)),
        )
        .await
        .expect("re-grant");
    match lease_a.check().await {
        Err(Error::LeaseLost { .. } | Error::NotHeld { .. }) => {}
        other => panic!("check of a lapsed lease: {other:?}"),
    }
    match lease_a.ops().check().await {
        Err(Error::NotHeld { .. }) => {}
        other => panic!("server-side check of a lapsed lease: {other:?}"),
    }
    lease_b.check().await.expect("new holder's check");
    match lease_a.renew().await {
        Err(Error::LeaseLost { .. } | Error::NotHeld { .. }) => {}
        other => panic!("renew of a lapsed lease: {other:?}"),
    }
    // The server-side check itself, bypassing the client-side state.
    match lease_a.ops().renew(ttl).await {
        Err(Error::NotHeld { .. }) => {}
        other => panic!("server-side renew of a lapsed lease: {other:?}"),
    }
    match lease_a.release().await {
        Err(Error::NotHeld { .. }) => {}
        other => panic!("release of a lapsed lease: {other:?}"),
    }
    assert!(matches!(
        c.try_acquire(&name, ttl).await,
        Err(Error::Held { .. })
    ));
    lease_b.renew().await.expect("new holder's renew");
    lease_b.release().await.expect("new holder's release");
}

/// `check` asks the server and says the lease is held, without moving its deadline.
pub async fn check_answers_without_extending(h: &dyn Harness) {
    let g = guarantees(h).await;
    let a = h.client().await;
    let name = unique("check");
    let opts = AcquireOptions::new()
        .ttl(Duration::from_secs(20))
        .keepalive(!g.manual_renewal)
        .wait(Wait::No);
    let lease = a.acquire(&name, opts).await.expect("acquire");
    let until = lease.valid_until();
    lease.check().await.expect("check of a held lease");
    lease.ops().check().await.expect("server-side check");
    assert_eq!(lease.valid_until(), until, "check moved the deadline");
    assert_eq!(lease.state(), LeaseState::Held);
    lease.release().await.expect("release");
}

/// A waiting acquire with a timeout returns `Timeout` on schedule and leaves no waiter behind.
pub async fn wait_timeout(h: &dyn Harness) {
    let (a, b, c) = (h.client().await, h.client().await, h.client().await);
    let name = unique("timeout");
    let ttl = Duration::from_secs(10);
    let lease = a.try_acquire(&name, ttl).await.expect("acquire");
    let timeout = Duration::from_millis(300);
    let start = Instant::now();
    match b.acquire_timeout(&name, ttl, timeout).await {
        Err(Error::Timeout { name: n, .. }) => assert_eq!(n, name),
        other => panic!("expected Timeout, got {other:?}"),
    }
    let took = start.elapsed();
    assert!(took >= timeout, "gave up early: {took:?}");
    assert!(took <= timeout + h.tolerance(), "gave up late: {took:?}");
    lease.release().await.expect("release");
    // The timed-out waiter must not stand in line ahead of c.
    let lease_c = c
        .acquire_timeout(&name, ttl, h.tolerance() * 3)
        .await
        .expect("a timed-out waiter left something behind");
    lease_c.release().await.expect("release");
}

/// Dropping a waiting acquire leaves nothing behind: once the holder releases, another client
/// gets the lock promptly (long before any TTL).
pub async fn dropped_waiter_leaves_nothing(h: &dyn Harness) {
    let (a, b, c) = (h.client().await, h.client().await, h.client().await);
    let name = unique("dropped-waiter");
    let ttl = Duration::from_secs(30);
    let lease = a.try_acquire(&name, ttl).await.expect("acquire");
    for _ in 0..3 {
        let waiting = b.acquire(&name, AcquireOptions::new().ttl(ttl));
        assert!(
            tokio::time::timeout(Duration::from_millis(200), waiting)
                .await
                .is_err(),
            "acquire of a held lock returned"
        );
    }
    lease.release().await.expect("release");
    let lease_c = c
        .acquire_timeout(&name, ttl, h.tolerance() * 3)
        .await
        .expect("a dropped waiter left something behind");
    lease_c.release().await.expect("release");
}

/// Dropping a lease releases it in the background, long before its TTL.
pub async fn drop_releases(h: &dyn Harness) {
    let (a, b) = (h.client().await, h.client().await);
    let name = unique("drop");
    let ttl = Duration::from_secs(30);
    let lease = a.try_acquire(&name, ttl).await.expect("acquire");
    drop(lease);
    let again = b
        .acquire_timeout(&name, ttl, h.tolerance() * 3)
        .await
        .expect("drop did not release");
    again.leak();
}

/// `with_lock` runs the closure with the held lease and releases afterwards.
pub async fn with_lock_releases(h: &dyn Harness) {
    let (a, b) = (h.client().await, h.client().await);
    let name = unique("with-lock");
    let (token, state) = a
        .with_lock(
            &name,
            AcquireOptions::new().ttl(Duration::from_secs(10)),
            |lease| {
                let got = (lease.token(), lease.state());
                async move { got }
            },
        )
        .await
        .expect("with_lock");
    assert_eq!(state, LeaseState::Held);
    let lease = b
        .try_acquire(&name, Duration::from_secs(10))
        .await
        .expect("released");
    assert!(lease.token() > token);
    lease.release().await.expect("release");
}

/// A token names its lock: `{backend}/…/{name}`, the same for every client of the backend and
/// another for another name; its string form parses back to it.
pub async fn tokens_name_their_lock(h: &dyn Harness) {
    let (a, b) = (h.client().await, h.client().await);
    let backend = a.guarantees().backend;
    let (name, other) = (unique("token-lock"), unique("token-lock"));
    let ttl = Duration::from_secs(10);
    let l1 = a.try_acquire(&name, ttl).await.expect("acquire");
    let l2 = b.try_acquire(&other, ttl).await.expect("acquire");
    let (t1, t2) = (l1.token(), l2.token());
    for (t, n) in [(&t1, &name), (&t2, &other)] {
        assert!(
            t.lock().starts_with(&format!("{backend}/")) && t.lock().ends_with(&format!("/{n}")),
            "token {t} of lock {n:?} on {backend}"
        );
        let s = t.to_string();
        assert_eq!(s.parse::<FencingToken>().expect("string form parses"), *t);
    }
    assert!(!t1.same_lock(&t2));
    assert_eq!(t1.partial_cmp(&t2), None, "tokens of two locks compared");
    l1.release().await.expect("release");
    let again = b.try_acquire(&name, ttl).await.expect("acquire");
    assert!(
        again.token().same_lock(&t1),
        "another client, another lock identity"
    );
    assert!(again.token() > t1);
    again.release().await.expect("release");
    l2.release().await.expect("release");
}

/// A fence binds a resource to the lock of its first writer: a token of another lock is
/// rejected with `ForeignToken` whatever its number, and the rightful holder is not locked out.
pub async fn foreign_token_rejected(h: &dyn Harness) {
    let (a, b) = (h.client().await, h.client().await);
    let (guard, other) = (unique("guard"), unique("other"));
    let ttl = Duration::from_secs(10);
    let fence = MemoryFence::new();
    let rightful = a.try_acquire(&guard, ttl).await.expect("acquire");
    fence
        .write("resource", rightful.token(), 1)
        .expect("first write");
    // Acquired later: on most backends its number is higher than the rightful holder's.
    let intruder = b.try_acquire(&other, ttl).await.expect("acquire");
    match fence.write_as(&intruder, "resource", 2) {
        Err(Error::ForeignToken {
            expected_lock,
            token,
            ..
        }) => {
            assert_eq!(expected_lock, rightful.token().lock());
            assert_eq!(token, intruder.token());
        }
        other => panic!("a token of another lock: expected ForeignToken, got {other:?}"),
    }
    fence
        .write_as(&rightful, "resource", 3)
        .expect("the rightful holder locked out");
    assert_eq!(fence.read("resource"), Some(3));
    assert_eq!(rightful.state(), LeaseState::Held);
    assert_eq!(
        intruder.state(),
        LeaseState::Held,
        "a foreign write cost its lease"
    );
    intruder.release().await.expect("release");
    rightful.release().await.expect("release");
}

/// A holder whose own fenced write is rejected as stale (a newer grant of its lock wrote, here
/// one the resource saw after a failover) is told at once: its lease is `Lost` long before its
/// deadline.
pub async fn own_stale_write_loses_the_lease(h: &dyn Harness) {
    let a = h.client().await;
    let name = unique("stale-write");
    let lease = a
        .try_acquire(&name, Duration::from_secs(30))
        .await
        .expect("acquire");
    let fence = MemoryFence::new();
    fence
        .write_as(&lease, "resource", 1)
        .expect("the holder's write");
    let newer = FencingToken::new(lease.token().lock(), lease.token().get() + 1);
    fence
        .write("resource", newer.clone(), 2)
        .expect("a newer grant's write");
    match fence.write_as(&lease, "resource", 3) {
        Err(Error::StaleToken { token, current, .. }) => {
            assert_eq!(token, lease.token());
            assert_eq!(current, newer);
        }
        other => panic!("the old holder's write: expected StaleToken, got {other:?}"),
    }
    assert_eq!(lease.state(), LeaseState::Lost, "told only by the clock");
    assert!(lease.valid_until() > Instant::now() + Duration::from_secs(20));
    assert_eq!(fence.read("resource"), Some(2));
    let _ = lease.release().await;
}

/// Bad names and TTLs get typed errors before any I/O, and nothing panics.
pub async fn bad_input(h: &dyn Harness) {
    let a = h.client().await;
    let ttl = Duration::from_secs(10);
    let long = "x".repeat(257);
    for name in [
        "",
        "a/b",
        "..",
        ".",
        "nul\0byte",
        "/etc/passwd",
        "../escape",
        long.as_str(),
    ] {
        match a.try_acquire(name, ttl).await {
            Err(Error::InvalidName { .. }) => {}
            other => panic!("name {name:?}: expected InvalidName, got {other:?}"),
        }
    }
    let ok = unique("bad-input");
    for ttl in [
        Duration::ZERO,
        Duration::from_millis(1),
        Duration::from_secs(10 * 365 * 86_400),
    ] {
        match a.try_acquire(&ok, ttl).await {
            Err(Error::InvalidConfig { .. }) => {}
            other => panic!("ttl {ttl:?}: expected InvalidConfig, got {other:?}"),
        }
    }
    let too_long = crate::MAX_LOCK_DELAY + Duration::from_millis(1);
    let opts = AcquireOptions::new()
        .ttl(ttl)
        .lock_delay(too_long)
        .wait(Wait::No);
    match a.acquire(&ok, opts).await {
        Err(Error::InvalidConfig { .. }) => {}
        other => panic!("lock-delay {too_long:?}: expected InvalidConfig, got {other:?}"),
    }
    // Unusual but valid names work and stay distinct.
    let n1 = format!("{ok} spaced:*?[]ü");
    let n2 = format!("{ok} spaced:*?[]u");
    let l1 = a.try_acquire(&n1, ttl).await.expect("unicode name");
    let l2 = a
        .try_acquire(&n2, ttl)
        .await
        .expect("a similar name is another lock");
    l1.release().await.expect("release");
    l2.release().await.expect("release");
}

/// Every grant reaches the caller with at least its minimum validity left (by default half the
/// TTL, with the short TTL too), and a minimum validity that no grant could meet is refused
/// before any I/O.
pub async fn grants_have_the_minimum_validity(h: &dyn Harness) {
    let a = h.client().await;
    let name = unique("min-validity");
    for ttl in [h.short_ttl(), Duration::from_secs(10)] {
        let opts = AcquireOptions::new().ttl(ttl).wait(Wait::No);
        let lease = a.acquire(&name, opts.clone()).await.expect("acquire");
        let remaining = lease.remaining();
        assert!(
            remaining >= opts.effective_min_validity(),
            "granted with {remaining:?} of {ttl:?} left"
        );
        lease.release().await.expect("release");
    }
    let never = AcquireOptions::new()
        .ttl(Duration::from_secs(10))
        .min_validity(Duration::from_secs(10))
        .wait(Wait::No);
    match a.acquire(&name, never).await {
        Err(Error::InvalidConfig { .. }) => {}
        other => panic!("min validity = TTL: expected InvalidConfig, got {other:?}"),
    }
}

/// A holder that fails (here: its lease lapses unrenewed and it is dropped without a release)
/// keeps the lock from everyone for its lock-delay after its TTL: a try-once during the delay
/// gets `Held`, a waiter is granted no earlier than TTL + delay after the holder's request was
/// sent (less the drift margin) and, without spinning, about when the delay ends. A backend
/// without lock-delay refuses a nonzero one with `NotSupported`. Backends without manual
/// renewal (whose holders cannot simply stop renewing) test it on their own.
pub async fn lock_delay_after_a_lapsed_holder(h: &dyn Harness) {
    let g = guarantees(h).await;
    let (a, b, c) = (h.client().await, h.client().await, h.client().await);
    let name = unique("lock-delay");
    let ttl = h.short_ttl();
    // Wide enough that the try-once below lands inside it on a loaded machine.
    let delay = Duration::from_secs(1) + g.expiry_slack + h.tolerance();
    let opts = AcquireOptions::new()
        .ttl(ttl)
        .keepalive(false)
        .release_on_drop(false)
        .lock_delay(delay)
        .wait(Wait::No);
    if !g.lock_delay {
        match a.acquire(&name, opts).await {
            Err(Error::NotSupported { .. }) => return,
            other => panic!("lock_delay=false but a lock-delay of {delay:?} gave {other:?}"),
        }
    }
    if !g.manual_renewal {
        return;
    }
    let sent = Instant::now();
    let holder = a.acquire(&name, opts).await.expect("acquire");
    let granted_a = Instant::now();
    let token_a = holder.token();
    drop(holder); // no release reaches the server
    // By now the server freed the lock (its TTL ran out): the delay runs.
    tokio::time::sleep_until(granted_a + ttl + g.expiry_slack).await;
    match c.try_acquire(&name, ttl).await {
        Err(Error::Held { .. }) => {}
        Ok(_lease) => panic!(
            "granted {:?} after the lapsed holder's request, during its lock-delay of {delay:?}",
            sent.elapsed()
        ),
        Err(e) => panic!("try-once during the lock-delay: expected Held, got {e:?}"),
    }
    let wait = ttl + g.expiry_slack + delay + h.tolerance() * 2;
    let lease_b = b
        .acquire(
            &name,
            AcquireOptions::new().ttl(ttl).wait(Wait::Timeout(wait)),
        )
        .await
        .expect("the lock was not granted after the lock-delay");
    let granted = Instant::now();
    let earliest = sent + ttl + delay - drift_margin(ttl);
    assert!(
        granted >= earliest,
        "granted {:?} after the lapsed holder's request, {:?} before TTL {ttl:?} + lock-delay \
         {delay:?} ran out",
        granted - sent,
        earliest - granted
    );
    assert!(
        granted <= granted_a + ttl + g.expiry_slack + delay + h.tolerance(),
        "granted only {:?} after the lapsed holder's request (TTL {ttl:?}, lock-delay {delay:?})",
        granted - sent
    );
    assert!(lease_b.token() > token_a);
    eprintln!(
        "{}: lock-delay: granted {:?} after the lapsed holder's request (TTL {ttl:?}, lock-delay \
         {delay:?})",
        g.backend,
        granted - sent
    );
    lease_b.release().await.expect("release");
}

/// A lease dropped *after* it was lost (its deadline passed unrenewed) is given up as lapsed,
/// not released: its holder was told it lost the lock and may have writes in flight, so the
/// lock-delay still runs even though the drop's give-back reaches the server before the TTL
/// would have freed the lock. (Backends without manual renewal are covered by their own tests.)
pub async fn lock_delay_after_a_lost_lease_is_dropped(h: &dyn Harness) {
    let g = guarantees(h).await;
    if !g.lock_delay || !g.manual_renewal {
        return; // lock_delay_after_a_lapsed_holder checks the NotSupported
    }
    let (a, c) = (h.client().await, h.client().await);
    let name = unique("lock-delay-lost-drop");
    let ttl = h.short_ttl();
    let delay = Duration::from_secs(2) + g.expiry_slack + h.tolerance() * 2;
    let opts = AcquireOptions::new()
        .ttl(ttl)
        .keepalive(false)
        .lock_delay(delay)
        .wait(Wait::No);
    let holder = a.acquire(&name, opts).await.expect("acquire");
    let granted_a = Instant::now();
    holder.lost().await; // the client deadline: the server still holds it
    drop(holder); // release on drop: must give it up as lapsed
    tokio::time::sleep_until(granted_a + ttl + g.expiry_slack + h.tolerance() / 2).await;
    match c.try_acquire(&name, ttl).await {
        Err(Error::Held { .. }) => {}
        Ok(_lease) => panic!(
            "granted {:?} after the grant of a lease dropped once lost, during its lock-delay of \
             {delay:?}",
            granted_a.elapsed()
        ),
        Err(e) => panic!("try-once during the lock-delay: expected Held, got {e:?}"),
    }
    let lease = c
        .acquire(
            &name,
            AcquireOptions::new().ttl(ttl).wait(Wait::Timeout(
                ttl + g.expiry_slack + delay + h.tolerance() * 2,
            )),
        )
        .await
        .expect("the lock was not granted after the lock-delay");
    lease.release().await.expect("release");
}

/// An explicit release frees a lock at once whatever its lock-delay, and so does a release on
/// drop (which reaches the server).
pub async fn lock_delay_not_after_a_release(h: &dyn Harness) {
    let g = guarantees(h).await;
    if !g.lock_delay {
        return; // lock_delay_after_a_lapsed_holder checks the NotSupported
    }
    let (a, b) = (h.client().await, h.client().await);
    let name = unique("lock-delay-release");
    let ttl = Duration::from_secs(10);
    let opts = AcquireOptions::new()
        .ttl(ttl)
        .lock_delay(Duration::from_secs(30))
        .wait(Wait::No);
    let lease = a.acquire(&name, opts.clone()).await.expect("acquire");
    lease.release().await.expect("release");
    let next = b
        .try_acquire(&name, ttl)
        .await
        .expect("a released lock is free at once, lock-delay or not");
    next.release().await.expect("release");
    drop(a.acquire(&name, opts).await.expect("acquire"));
    let again = b
        .acquire_timeout(&name, ttl, h.tolerance() * 3)
        .await
        .expect("a lock released on drop is free at once, lock-delay or not");
    again.release().await.expect("release");
}

/// Claims in [`Guarantees`] are consistent with the lock kind.
pub async fn guarantees_are_consistent(h: &dyn Harness) {
    let g = guarantees(h).await;
    assert!(!g.backend.is_empty());
    if g.kind == crate::LockKind::Efficiency {
        assert!(
            !g.safe_across_failover,
            "an efficiency lock claims failover safety"
        );
    }
}

/// Waiters on a FIFO backend are served in arrival order.
pub async fn fifo_waiters(h: &dyn Harness) {
    let g = guarantees(h).await;
    if !g.fifo_waiters {
        return;
    }
    let name = unique("fifo");
    let holder = h.client().await;
    let first = holder
        .try_acquire(&name, Duration::from_secs(10))
        .await
        .expect("acquire");
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut joins = Vec::new();
    for i in 0..3 {
        let c = h.client().await;
        let (name, order) = (name.clone(), order.clone());
        joins.push(tokio::spawn(async move {
            let l = c
                .acquire(&name, AcquireOptions::new().ttl(Duration::from_secs(10)))
                .await
                .expect("acquire");
            order.lock().unwrap().push(i);
            l.release().await.expect("release");
        }));
        // Give each waiter time to join the queue before the next one.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    first.release().await.expect("release");
    for j in joins {
        j.await.expect("waiter panicked");
    }
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2]);
}

/// Keeps a lease alive for the duration of a test and proves it was held.
#[doc(hidden)]
pub fn assert_held(lease: &Lease) {
    assert_eq!(lease.state(), LeaseState::Held, "{lease:?}");
}

/// Expands to one `#[tokio::test]` per contract function, each building its harness with
/// `$harness` (an expression of a type implementing [`Harness`], may contain `.await`).
#[macro_export]
macro_rules! contract_suite {
    ($harness:expr) => {
        $crate::contract_suite!(@tests $harness;
            acquire_release, try_acquire_while_held, new_client_larger_token,
            expiry_without_renewal, renew_extends, keepalive_holds,
            lapsed_lease_cannot_touch_new_holder, wait_timeout, dropped_waiter_leaves_nothing,
            drop_releases, with_lock_releases, tokens_name_their_lock, foreign_token_rejected,
            own_stale_write_loses_the_lease, check_answers_without_extending,
            bad_input, grants_have_the_minimum_validity, guarantees_are_consistent,
            fifo_waiters, holder_is_reported, lock_delay_after_a_lapsed_holder,
            lock_delay_after_a_lost_lease_is_dropped, lock_delay_not_after_a_release);
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn fenced_counter() {
            let h = $harness;
            $crate::contract::fenced_counter(&h, 4, 10).await;
        }
    };
    (@tests $harness:expr; $($name:ident),*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let h = $harness;
                $crate::contract::$name(&h).await;
            }
        )*
    };
}
