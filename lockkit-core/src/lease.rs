//! Leases: what a successful acquire returns, its release and release-on-drop.
//!
//! Keepalive: a lease that core renews is first handed to its runtime's keepalive scheduler
//! ([`crate::keeper`], one driver task per Tokio runtime, shared by all leases), which waits out
//! the first TTL/3. Only a lease still held then gets a renewal task of its own, so the common
//! acquire, short critical section, release spawns no task at all. The lease's clock and the
//! server half it shares with the scheduler live in [`crate::tracker`].

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use tracing::Instrument;

use crate::backoff::Backoff;
use crate::keeper::{self, Registration};
use crate::observe::{Labels, TARGET};
use crate::tracker::{
    LeaseOps, LeaseState, LeaseTracker, LossReason, SuspectReason, TrackerHandle, drift_margin,
};
use crate::{AcquireOptions, Error, FencingToken, Result};

/// A granted lock: name, fencing token, TTL, client-side state, renewal and release.
///
/// Returned by [`Lock::acquire`](crate::Lock::acquire). While it lives (and unless the acquire
/// opted out) it is renewed about every TTL/3. Use [`token`](Self::token) on every write to the
/// protected resource, and stop when [`lost`](Self::lost) resolves.
///
/// Dropping a lease without [`release`](Self::release) stops its keepalive and, if
/// [`AcquireOptions::release_on_drop`] is on (the default), spawns a best-effort release on the
/// current Tokio runtime. That release is **not immediate** and may not happen at all (no runtime,
/// runtime shutting down, server unreachable); the TTL frees the lock in any case.
/// [`leak`](Self::leak) stops keepalive without releasing.
#[must_use = "a lease that is dropped at once releases the lock at once"]
pub struct Lease {
    name: String,
    token: FencingToken,
    tracker: TrackerHandle,
    ops: Arc<dyn LeaseOps>,
    backend: &'static str,
    /// Dropping it stops keepalive.
    keepalive: Option<Registration>,
    release_on_drop: bool,
    done: bool,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("name", &self.name)
            .field("token", &self.token)
            .field("ttl", &self.tracker.ttl())
            .field("state", &self.state())
            .field("ops", &self.ops)
            .finish()
    }
}

impl Lease {
    /// Assembles a lease; called by backends once the server granted the lock.
    ///
    /// `tracker` must have been created with the send time of the granting request. When
    /// `opts.keepalive` is on and `ops` is not [`self_renewing`](LeaseOps::self_renewing), the
    /// lease is scheduled for renewal at `tracker.confirmed_at() + TTL/3` (and every TTL/3 after
    /// each acknowledged renewal) by the current Tokio runtime's keepalive scheduler; no task is
    /// spawned until then. Outside a Tokio runtime (every backend's acquire runs on one) nothing
    /// could renew the lease: it is not kept alive and expires at its deadline.
    ///
    /// From here on the tracker's state changes are reported as lease events and metrics,
    /// labelled with the backend that [`Lock::acquire`](crate::Lock::acquire) runs (`"unknown"`
    /// for a lease built outside it).
    pub fn new(
        name: impl Into<String>,
        token: FencingToken,
        tracker: TrackerHandle,
        ops: Arc<dyn LeaseOps>,
        opts: &AcquireOptions,
    ) -> Self {
        let name = name.into();
        let backend = opts.observed_backend.unwrap_or("unknown");
        tracker.attach(
            &name,
            opts.observed_kind,
            token.clone(),
            Labels::new(backend, &name, opts.lock_name_label),
        );
        let keepalive = if opts.keepalive && !ops.self_renewing() {
            let reg = keeper::register(&name, &tracker, &ops);
            if reg.is_none() {
                tracing::warn!(target: TARGET, lock = %name, backend, "no Tokio runtime: the lease will not be kept alive");
            }
            reg
        } else {
            None
        };
        Self {
            name,
            token,
            tracker,
            ops,
            backend,
            keepalive,
            release_on_drop: opts.release_on_drop,
            done: false,
        }
    }

    /// The lock name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The fencing token of this grant: the lock's identity and this grant's number (see
    /// [`FencingToken`]). Send it with every write to the protected resource (as its string
    /// form, `to_string()`, to a remote service).
    pub fn token(&self) -> FencingToken {
        self.token.clone()
    }

    /// The lease's TTL.
    pub fn ttl(&self) -> Duration {
        self.tracker.ttl()
    }

    /// The state now (see [`LeaseState`]).
    pub fn state(&self) -> LeaseState {
        self.tracker.state()
    }

    /// Why the lease was lost (`None` while it is not [`Lost`](LeaseState::Lost)).
    pub fn loss_reason(&self) -> Option<LossReason> {
        self.tracker.view().loss_reason()
    }

    /// The deadline on the monotonic clock after which the lease is [`Lost`](LeaseState::Lost)
    /// unless renewed: send time of the last acknowledged grant/renewal + TTL − [`drift_margin`].
    pub fn valid_until(&self) -> Instant {
        self.tracker.valid_until()
    }

    /// Time left until [`valid_until`](Self::valid_until); zero once lost.
    pub fn remaining(&self) -> Duration {
        if self.state() == LeaseState::Lost {
            return Duration::ZERO;
        }
        self.valid_until().saturating_duration_since(Instant::now())
    }

    /// Resolves when the lease is lost: on the deadline, without waiting for a socket error, or
    /// as soon as the backend learns it is gone. `'static`: move it into a task or `select!`.
    ///
    /// ```no_run
    /// # async fn f(lease: lockkit_core::Lease) {
    /// tokio::select! {
    ///     _ = lease.lost() => { /* stop: someone else may hold the lock now */ }
    ///     _ = async { /* the critical section */ } => {}
    /// }
    /// # }
    /// ```
    ///
    /// # Cancel safety
    /// Cancel safe: dropping it has no effect on the lease.
    pub fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
        self.tracker.view().lost()
    }

    /// Resolves with the new state once the lease is no longer [`Held`](LeaseState::Held):
    /// [`Suspect`](LeaseState::Suspect) or [`Lost`](LeaseState::Lost). See
    /// [`LeaseTracker::at_risk`].
    ///
    /// # Cancel safety
    /// Cancel safe: dropping it has no effect on the lease.
    pub fn at_risk(&self) -> impl Future<Output = LeaseState> + Send + 'static {
        self.tracker.view().at_risk()
    }

    /// The lease's clock, read-only, to watch from elsewhere (it may outlive the lease).
    pub fn tracker(&self) -> &LeaseTracker {
        self.tracker.view()
    }

    /// The backend's handle, for core's fences (which may end the lease, never extend it).
    pub(crate) fn tracker_handle(&self) -> &TrackerHandle {
        &self.tracker
    }

    /// Builds [`Error::LeaseLost`] for this lease.
    pub fn lost_error(&self) -> Error {
        Error::LeaseLost {
            name: self.name.clone(),
            reason: self.loss_reason().unwrap_or(LossReason::DeadlineExpired),
        }
    }

    /// Renews the lease once, now: extends it on the server by its TTL if this grant still holds
    /// the lock. On success the deadline moves to send time + TTL − margin. Runs in a `renew`
    /// span (see [`crate::observe`]).
    ///
    /// # Errors
    /// - [`Error::LeaseLost`] if the lease is already lost on the client side (no request is sent:
    ///   a lost lease is never revived).
    /// - [`Error::NotHeld`] if the server says the lock lapsed; the lease becomes lost. The lock
    ///   is never silently re-taken.
    /// - Transport errors ([`Error::Unavailable`]…): the lease state is unchanged and turns
    ///   suspect/lost by the clock.
    ///
    /// # Cancel safety
    /// Cancel safe: a dropped renewal either extended the lease on the server or did not; the
    /// client-side deadline only moves on an acknowledged renewal.
    pub async fn renew(&self) -> Result<()> {
        let span = tracing::info_span!(target: TARGET, "renew", lock = %self.name, backend = self.backend, token = self.token.get(), keepalive = false, outcome = tracing::field::Empty);
        let res = renew_once(&self.tracker, &*self.ops, &self.name)
            .instrument(span.clone())
            .await;
        span.record("outcome", outcome_of(&res));
        res
    }

    /// Asks the server whether this grant still holds the lock, **without** extending it: for a
    /// holder about to start work it cannot undo, or one that suspects the lease (see
    /// [`at_risk`](Self::at_risk)). The deadline does not move.
    ///
    /// An answer is a snapshot: the lease may lapse right after it. Fence the writes anyway.
    ///
    /// # Errors
    /// - [`Error::LeaseLost`] if the lease is already lost on the client side (nothing is sent).
    /// - [`Error::NotHeld`] if the server says the grant no longer holds the lock; the lease
    ///   becomes lost.
    /// - Transport errors ([`Error::Unavailable`]…): the state is unchanged.
    ///
    /// # Cancel safety
    /// Cancel safe: a read.
    pub async fn check(&self) -> Result<()> {
        if let Some(reason) = self.loss_reason() {
            return Err(Error::LeaseLost {
                name: self.name.clone(),
                reason,
            });
        }
        match self.ops.check().await {
            Err(e @ Error::NotHeld { .. }) => {
                self.tracker.mark_lost(LossReason::NotHeldOnServer);
                Err(e)
            }
            other => other,
        }
    }

    /// Releases the lock if this grant still holds it (compare-and-delete), and stops keepalive.
    /// Runs in a `release` span (see [`crate::observe`]).
    ///
    /// # Errors
    /// - [`Error::NotHeld`] if the lease lapsed and the lock is free or held by someone else;
    ///   nothing was touched.
    /// - Transport errors: the lock stays held until its TTL ends; if release-on-drop is on, one
    ///   more best-effort release is spawned.
    ///
    /// # Cancel safety
    /// Cancel safe: if the future is dropped, the release either happened or the lease is dropped
    /// with it (best-effort release on drop, then the TTL).
    pub async fn release(mut self) -> Result<()> {
        let span = tracing::info_span!(target: TARGET, "release", lock = %self.name, backend = self.backend, token = self.token.get(), outcome = tracing::field::Empty);
        self.stop_keepalive();
        let res = self.ops.release().instrument(span.clone()).await;
        match &res {
            Err(Error::NotHeld { .. }) => self.tracker.mark_lost(LossReason::NotHeldOnServer),
            _ => self.tracker.mark_lost(LossReason::Released),
        }
        match &res {
            Ok(()) | Err(Error::NotHeld { .. }) => self.done = true,
            Err(_) => {}
        }
        span.record("outcome", outcome_of(&res));
        res
    }

    /// Stops keepalive and forgets the lease without releasing it: the lock stays held on the
    /// server until its TTL runs out. For handing a lock over to a process that will not renew it.
    pub fn leak(mut self) {
        self.stop_keepalive();
        self.tracker.leaked();
        self.done = true;
    }

    fn stop_keepalive(&mut self) {
        // Removes the lease from the scheduler's queue, or aborts its renewal task.
        drop(self.keepalive.take());
    }
}

/// The `outcome` field of a renew or release span.
fn outcome_of(res: &Result<()>) -> &'static str {
    match res {
        Ok(()) => "ok",
        Err(Error::NotHeld { .. }) => "not_held",
        Err(Error::LeaseLost { .. }) => "lost",
        Err(_) => "error",
    }
}

/// One renewal of `tracker`'s lease through `ops`, as [`Lease::renew`] documents it.
async fn renew_once(tracker: &TrackerHandle, ops: &dyn LeaseOps, name: &str) -> Result<()> {
    let lost = |t: &TrackerHandle| Error::LeaseLost {
        name: name.to_owned(),
        reason: t
            .view()
            .loss_reason()
            .unwrap_or(LossReason::DeadlineExpired),
    };
    if tracker.state() == LeaseState::Lost {
        return Err(lost(tracker));
    }
    let sent = Instant::now();
    match ops.renew(tracker.ttl()).await {
        Ok(()) if tracker.confirm(sent) => Ok(()),
        Ok(()) => {
            // Acknowledged after the deadline: the holder may already have been told it lost
            // the lock, so the renewal must not keep it held. Give it back as lapsed (its
            // lock-delay runs).
            let _ = ops.relinquish().await;
            Err(lost(tracker))
        }
        Err(e @ Error::NotHeld { .. }) => {
            tracker.renewal("not_held");
            tracker.mark_lost(LossReason::NotHeldOnServer);
            Err(e)
        }
        Err(e) => {
            tracker.mark_suspect(SuspectReason::RenewalFailed);
            Err(e)
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.stop_keepalive();
        if self.done {
            return;
        }
        // A lease already lost (deadline passed, server said so) is not released but given up
        // as lapsed: its holder was told it lost the lock and may have writes in flight, so a
        // lock-delay set at the grant must run.
        let was_lost = self.tracker.state() == LeaseState::Lost;
        self.tracker.mark_lost(LossReason::Dropped);
        if self.release_on_drop
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            rt.spawn(release_in_background(
                self.name.clone(),
                self.ops.clone(),
                self.tracker.valid_until() + drift_margin(self.tracker.ttl()),
                was_lost,
            ));
        }
    }
}

/// Release on drop (or, for a lease already `lost`, [`LeaseOps::relinquish`]): retries transient
/// failures with backoff until `until` (after which the server frees the lock by itself).
async fn release_in_background(name: String, ops: Arc<dyn LeaseOps>, until: Instant, lost: bool) {
    let mut backoff = Backoff::new(Duration::from_millis(20), Duration::from_secs(1));
    loop {
        let give_back = async {
            if lost {
                ops.relinquish().await
            } else {
                ops.release().await
            }
        };
        let outcome = tokio::time::timeout_at(until, give_back).await;
        let pause = backoff.next_delay();
        match outcome {
            Ok(Err(e)) if e.is_retryable() && Instant::now() + pause < until => {
                tracing::debug!(target: TARGET, lock = %name, error = %e, "release on drop failed; retrying");
                tokio::time::sleep(pause).await;
            }
            Ok(Err(e)) => {
                tracing::debug!(target: TARGET, lock = %name, error = %e, "release on drop failed; the TTL will free the lock");
                return;
            }
            Ok(Ok(())) | Err(_) => return,
        }
    }
}

/// For backends, their fences and their tests: the backend's half of a [`Lease`].
///
/// Not part of the lock user's API: calling [`LeaseOps::renew`] or [`LeaseOps::release`]
/// through it bypasses the lease's client-side state (it could shorten the lease on the server
/// while the lease still reads `Held`). Fences reach their grant's details with
/// `lease.ops().as_any().downcast_ref::<BackendLease>()`.
pub trait LeaseBackendExt {
    /// The backend's half of the lease.
    fn ops(&self) -> &dyn LeaseOps;
}

impl LeaseBackendExt for Lease {
    fn ops(&self) -> &dyn LeaseOps {
        &*self.ops
    }
}

#[cfg(test)]
mod tests {
    use std::any::Any;

    use async_trait::async_trait;

    use super::*;

    /// A scripted server half: each renewal succeeds, fails, or hangs, as told.
    #[derive(Debug)]
    struct Scripted {
        renew: std::sync::Mutex<std::collections::VecDeque<Step>>,
        renews: std::sync::atomic::AtomicUsize,
        releases: std::sync::atomic::AtomicUsize,
        renewed_at: std::sync::Mutex<Vec<Instant>>,
    }

    #[derive(Debug, Clone, Copy)]
    enum Step {
        Ok,
        Transient,
        NotHeld,
        Hang,
    }

    impl Scripted {
        fn new(steps: &[Step]) -> Arc<Self> {
            Arc::new(Self {
                renew: std::sync::Mutex::new(steps.iter().copied().collect()),
                renews: Default::default(),
                releases: Default::default(),
                renewed_at: Default::default(),
            })
        }

        fn renews(&self) -> usize {
            self.renews.load(std::sync::atomic::Ordering::SeqCst)
        }
    }

    #[async_trait]
    impl LeaseOps for Scripted {
        async fn renew(&self, _ttl: Duration) -> Result<()> {
            self.renews
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            self.renewed_at.lock().unwrap().push(Instant::now());
            let step = self.renew.lock().unwrap().pop_front().unwrap_or(Step::Ok);
            match step {
                Step::Ok => Ok(()),
                Step::Transient => Err(Error::Unavailable {
                    backend: "test",
                    source: "down".into(),
                }),
                Step::NotHeld => Err(Error::NotHeld { name: "l".into() }),
                Step::Hang => std::future::pending().await,
            }
        }
        async fn release(&self) -> Result<()> {
            self.releases
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(())
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
    }

    fn lease_with(ops: Arc<Scripted>, ttl: Duration, keepalive: bool) -> Lease {
        let opts = AcquireOptions::new().ttl(ttl).keepalive(keepalive);
        Lease::new(
            "l",
            FencingToken::new("memory/0/l", 1),
            TrackerHandle::new(Instant::now(), ttl),
            ops,
            &opts,
        )
    }

    #[tokio::test(start_paused = true)]
    async fn keepalive_holds_through_transient_failures() {
        let ops = Scripted::new(&[Step::Transient, Step::Transient, Step::Ok]);
        let ttl = Duration::from_secs(3);
        let lease = lease_with(ops.clone(), ttl, true);
        tokio::select! {
            _ = lease.lost() => panic!("lost despite a successful renewal in time"),
            _ = tokio::time::sleep(ttl * 5) => {}
        }
        assert_ne!(lease.state(), LeaseState::Lost);
        assert!(ops.renews.load(std::sync::atomic::Ordering::SeqCst) >= 5);
    }

    #[tokio::test(start_paused = true)]
    async fn hanging_keepalive_is_lost_on_the_deadline_not_on_a_socket_error() {
        let ops = Scripted::new(&[Step::Hang]);
        let ttl = Duration::from_secs(3);
        let start = Instant::now();
        let lease = lease_with(ops, ttl, true);
        lease.lost().await;
        assert_eq!(start.elapsed(), ttl - drift_margin(ttl));
        assert_eq!(lease.state(), LeaseState::Lost);
        assert!(matches!(lease.renew().await, Err(Error::LeaseLost { .. })));
    }

    #[tokio::test(start_paused = true)]
    async fn not_held_renewal_loses_at_once() {
        let ops = Scripted::new(&[Step::NotHeld]);
        let ttl = Duration::from_secs(30);
        let start = Instant::now();
        let lease = lease_with(ops, ttl, true);
        lease.lost().await;
        // The first keepalive (at TTL/3) learned the lease is gone: no waiting for the deadline.
        assert_eq!(start.elapsed(), ttl / 3);
    }

    #[tokio::test(start_paused = true)]
    async fn transient_keepalive_failure_turns_suspect_at_once() {
        let ops = Scripted::new(&[Step::Transient, Step::Ok]);
        let ttl = Duration::from_secs(30);
        let lease = lease_with(ops, ttl, true);
        tokio::time::sleep(ttl / 3 + Duration::from_millis(1)).await;
        assert_eq!(lease.state(), LeaseState::Suspect);
        tokio::time::sleep(ttl / 12).await;
        assert_eq!(lease.state(), LeaseState::Held);
    }

    /// A release that fails twice, then succeeds; records when each attempt was made.
    #[derive(Debug, Default)]
    struct FlakyRelease(std::sync::Mutex<Vec<Instant>>);

    #[async_trait]
    impl LeaseOps for FlakyRelease {
        async fn renew(&self, _ttl: Duration) -> Result<()> {
            Ok(())
        }
        async fn release(&self) -> Result<()> {
            let mut at = self.0.lock().unwrap();
            at.push(Instant::now());
            if at.len() <= 2 {
                Err(Error::Unavailable {
                    backend: "test",
                    source: "down".into(),
                })
            } else {
                Ok(())
            }
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
    }

    fn dropped_flaky_lease() -> Arc<FlakyRelease> {
        let ops = Arc::new(FlakyRelease::default());
        let ttl = Duration::from_secs(3);
        let opts = AcquireOptions::new().ttl(ttl).keepalive(false);
        drop(Lease::new(
            "l",
            FencingToken::new("memory/0/l", 1),
            TrackerHandle::new(Instant::now(), ttl),
            ops.clone(),
            &opts,
        ));
        ops
    }

    #[tokio::test(start_paused = true)]
    async fn drop_release_retries_transient_failures_with_jittered_backoff() {
        let (a, b) = (dropped_flaky_lease(), dropped_flaky_lease());
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (a, b) = (a.0.lock().unwrap().clone(), b.0.lock().unwrap().clone());
        assert_eq!((a.len(), b.len()), (3, 3), "{a:?} {b:?}");
        let pauses = |at: &[Instant]| [at[1] - at[0], at[2] - at[1]];
        for p in [pauses(&a), pauses(&b)] {
            // Backoff steps 20 ms, 40 ms, each plus up to one step of jitter.
            let (first, second) = (Duration::from_millis(20), Duration::from_millis(40));
            assert!(p[0] >= first && p[0] <= first * 2, "{p:?}");
            assert!(p[1] >= second && p[1] <= second * 2, "{p:?}");
        }
        // Two leases dropped together do not retry in step.
        assert_ne!(pauses(&a), pauses(&b), "retries without jitter");
    }

    #[tokio::test(start_paused = true)]
    async fn drop_releases_in_background_and_leak_does_not() {
        let ops = Scripted::new(&[]);
        drop(lease_with(ops.clone(), Duration::from_secs(3), false));
        tokio::task::yield_now().await;
        assert_eq!(ops.releases.load(std::sync::atomic::Ordering::SeqCst), 1);

        let ops = Scripted::new(&[]);
        lease_with(ops.clone(), Duration::from_secs(3), true).leak();
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(ops.releases.load(std::sync::atomic::Ordering::SeqCst), 0);
        assert_eq!(ops.renews.load(std::sync::atomic::Ordering::SeqCst), 0);
    }

    fn driver() -> Arc<keeper::Driver> {
        keeper::test_support::current_driver().expect("this runtime's keepalive driver")
    }

    fn paused_runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn lease_released_before_its_first_renewal_is_never_renewed() {
        let ops = Scripted::new(&[]);
        let ttl = Duration::from_secs(3);
        let lease = lease_with(ops.clone(), ttl, true);
        assert_eq!(driver().queue_len(), 1);
        tokio::time::sleep(ttl / 3 - Duration::from_millis(1)).await;
        lease.release().await.unwrap();
        assert_eq!(driver().queue_len(), 0);
        tokio::time::sleep(ttl * 5).await;
        assert_eq!(ops.renews(), 0);
        assert_eq!(ops.releases.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn held_lease_is_renewed_every_ttl_third_from_its_grant() {
        let ops = Scripted::new(&[]);
        let ttl = Duration::from_secs(3);
        let start = Instant::now();
        let lease = lease_with(ops.clone(), ttl, true);
        tokio::select! {
            s = lease.at_risk() => panic!("lease turned {s:?} while renewed on schedule"),
            _ = tokio::time::sleep(ttl * 4 + ttl / 6) => {}
        }
        assert_eq!(lease.state(), LeaseState::Held);
        let expected: Vec<Instant> = (1..=12).map(|i| start + ttl / 3 * i).collect();
        assert_eq!(*ops.renewed_at.lock().unwrap(), expected);
        // The renewal task was started and left the queue; release stops it.
        assert_eq!(driver().queue_len(), 0);
        lease.release().await.unwrap();
        tokio::time::sleep(ttl * 3).await;
        assert_eq!(ops.renews(), 12);
    }

    #[tokio::test(start_paused = true)]
    async fn stopped_pending_leases_leave_the_queue() {
        let ops = Scripted::new(&[]);
        let ttl = Duration::from_secs(30);
        let released = lease_with(ops.clone(), ttl, true);
        let dropped = lease_with(ops.clone(), ttl, true);
        let leaked = lease_with(ops.clone(), ttl, true);
        let unkept = lease_with(ops.clone(), ttl, false);
        let d = driver();
        assert_eq!(d.queue_len(), 3);
        released.release().await.unwrap();
        assert_eq!(d.queue_len(), 2);
        drop(dropped);
        assert_eq!(d.queue_len(), 1);
        leaked.leak();
        assert_eq!(d.queue_len(), 0);
        drop(unkept);
        tokio::time::sleep(ttl * 2).await;
        assert_eq!(ops.renews(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn registrations_do_not_wake_the_driver_and_an_idle_driver_sleeps() {
        let ops = Scripted::new(&[]);
        let ttl = Duration::from_secs(3);
        lease_with(ops.clone(), ttl, true).release().await.unwrap();
        tokio::task::yield_now().await; // the driver's first run
        let d = driver();
        let before = d.wakeups();
        // A steady acquire/release loop for 2 s: only the 1 s idle ticks wake the driver.
        for _ in 0..200 {
            let lease = lease_with(ops.clone(), ttl, true);
            tokio::time::sleep(Duration::from_millis(10)).await;
            lease.release().await.unwrap();
        }
        let during = d.wakeups() - before;
        assert!(
            during <= 3,
            "{during} wake-ups during 2 s of acquire/release"
        );
        // Idle: it ticks for a while, then sleeps until a registration needs it.
        tokio::time::sleep(Duration::from_secs(60)).await;
        let idle = d.wakeups();
        tokio::time::sleep(Duration::from_secs(600)).await;
        assert_eq!(d.wakeups(), idle);
        // ...and a new lease still gets renewed on time.
        let start = Instant::now();
        let lease = lease_with(ops.clone(), ttl, true);
        tokio::time::sleep(ttl / 3 + ttl / 6).await;
        assert_eq!(*ops.renewed_at.lock().unwrap(), [start + ttl / 3]);
        assert_eq!(lease.state(), LeaseState::Held);
        assert_eq!(ops.renews(), 1);
    }

    #[test]
    fn leases_on_two_runtimes_are_each_renewed() {
        let both = Arc::new(std::sync::Barrier::new(2));
        let run = |both: Arc<std::sync::Barrier>| {
            move || {
                paused_runtime().block_on(async {
                    let ops = Scripted::new(&[]);
                    let ttl = Duration::from_secs(3);
                    let lease = lease_with(ops.clone(), ttl, true);
                    tokio::time::sleep(ttl + ttl / 6).await;
                    assert_eq!(lease.state(), LeaseState::Held);
                    assert_eq!(ops.renews(), 3);
                    let d = driver();
                    both.wait(); // both drivers alive at once: distinct addresses
                    Arc::as_ptr(&d) as usize
                })
            }
        };
        let a = std::thread::spawn(run(both.clone()));
        let b = std::thread::spawn(run(both));
        assert_ne!(a.join().unwrap(), b.join().unwrap());
    }

    #[test]
    fn driver_of_a_shut_down_runtime_is_replaced() {
        let ttl = Duration::from_secs(3);
        let ops_a = Scripted::new(&[]);
        let rt_a = paused_runtime();
        let (lease_a, driver_a) = rt_a.block_on(async {
            let lease = lease_with(ops_a.clone(), ttl, true);
            tokio::task::yield_now().await;
            (lease, driver())
        });
        assert!(driver_a.is_alive());
        assert_eq!(driver_a.queue_len(), 1);
        drop(rt_a);
        assert!(!driver_a.is_alive());
        assert_eq!(driver_a.queue_len(), 0);
        drop(lease_a); // outside any runtime: nothing to release on, no panic

        let ops_b = Scripted::new(&[]);
        paused_runtime().block_on(async {
            let lease = lease_with(ops_b.clone(), ttl, true);
            assert!(!Arc::ptr_eq(&driver(), &driver_a));
            tokio::time::sleep(ttl + ttl / 6).await;
            assert_eq!(lease.state(), LeaseState::Held);
        });
        assert_eq!(ops_b.renews(), 3);
        assert_eq!(ops_a.renews(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn dead_driver_on_a_live_runtime_is_replaced() {
        let ttl = Duration::from_secs(3);
        let _first = lease_with(Scripted::new(&[]), ttl, true);
        let dead = driver();
        dead.abort_task();
        for _ in 0..10 {
            if !dead.is_alive() {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert!(!dead.is_alive());
        let ops = Scripted::new(&[]);
        let lease = lease_with(ops.clone(), ttl, true);
        assert!(!Arc::ptr_eq(&driver(), &dead));
        tokio::time::sleep(ttl + ttl / 6).await;
        assert_eq!(lease.state(), LeaseState::Held);
        assert_eq!(ops.renews(), 3);
    }

    #[test]
    fn lease_outside_a_runtime_does_not_panic_and_is_not_kept_alive() {
        let ops = Scripted::new(&[]);
        let lease = lease_with(ops.clone(), Duration::from_secs(3), true);
        assert_eq!(lease.state(), LeaseState::Held);
        drop(lease);
        assert_eq!(ops.renews(), 0);
        assert_eq!(ops.releases.load(std::sync::atomic::Ordering::SeqCst), 0);
    }
}
