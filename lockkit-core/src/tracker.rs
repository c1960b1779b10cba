//! A lease's shared parts, used by both the lease ([`crate::lease`]) and the keepalive scheduler
//! ([`crate::keeper`]): the client-side clock of a lease ([`LeaseTracker`], [`TrackerHandle`], its
//! states and reasons) and the server half each backend implements ([`LeaseOps`]). It imports
//! neither of them.

use std::any::Any;
use std::cell::Cell;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::observe::{Labels, TARGET};
use crate::slots::SlotKind;
use crate::{Error, FencingToken, Result};

#[cfg(doc)]
use crate::Lease;

/// What the holder can know about its lease, on the client's monotonic clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LeaseState {
    /// Renewed recently: the lease is valid until [`Lease::valid_until`].
    Held,
    /// No renewal has been acknowledged for more than half the TTL (or the backend reports its
    /// connection down). The lease may still be valid until [`Lease::valid_until`], but the holder
    /// should stop starting new work that it cannot finish before that deadline.
    Suspect,
    /// The deadline passed, the server said the lease is gone, or the lease was released.
    /// Final: a lost lease never becomes held again. Another holder may have the lock.
    Lost,
}

/// The clock-drift margin subtracted from every deadline: 1 % of the TTL plus 2 ms, the rule of
/// the Redlock description (<https://redis.io/docs/latest/develop/use/patterns/distributed-locks/>,
/// "Safety arguments"). It covers the server's clock running up to 1 % faster than ours.
pub fn drift_margin(ttl: Duration) -> Duration {
    ttl / 100 + Duration::from_millis(2)
}

/// Why a lease was lost: [`Lease::loss_reason`], [`Error::LeaseLost`], the `reason` of the lease
/// events and of [`LEASES_LOST_TOTAL`](crate::observe::LEASES_LOST_TOTAL).
///
/// When several apply, the first one wins: a lease whose deadline passed and that was released
/// afterwards was lost to [`DeadlineExpired`](Self::DeadlineExpired).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LossReason {
    /// The client-side deadline passed without an acknowledged renewal (the server may free the
    /// lock about now).
    DeadlineExpired,
    /// A renewal or release found that the server no longer holds the lease for this grant.
    NotHeldOnServer,
    /// The backend session that carried the lease (etcd lease, ZooKeeper session, PostgreSQL
    /// connection) expired or ended.
    SessionExpired,
    /// The holder released it.
    Released,
    /// The holder dropped the [`Lease`] without releasing it.
    Dropped,
    /// A fenced write with this lease's token was rejected: a newer holder exists.
    StaleWrite,
}

impl LossReason {
    /// The `snake_case` label value (`"deadline_expired"`, `"not_held_on_server"`,
    /// `"session_expired"`, `"released"`, `"dropped"`, `"stale_write"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::DeadlineExpired => "deadline_expired",
            Self::NotHeldOnServer => "not_held_on_server",
            Self::SessionExpired => "session_expired",
            Self::Released => "released",
            Self::Dropped => "dropped",
            Self::StaleWrite => "stale_write",
        }
    }

    /// `true` for the reasons where the holder ended the lease itself (released, dropped).
    pub fn by_holder(self) -> bool {
        matches!(self, Self::Released | Self::Dropped)
    }
}

impl fmt::Display for LossReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::DeadlineExpired => "deadline passed without an acknowledged renewal",
            Self::NotHeldOnServer => "the server no longer holds it",
            Self::SessionExpired => "session expired",
            Self::Released => "released",
            Self::Dropped => "dropped without release",
            Self::StaleWrite => "a fenced write was rejected: a newer holder exists",
        })
    }
}

/// Why a lease turned [`Suspect`](LeaseState::Suspect): the `reason` of the lease event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SuspectReason {
    /// A renewal was sent and not acknowledged (error or no answer). Counted as a `failed`
    /// renewal in [`RENEWALS_TOTAL`](crate::observe::RENEWALS_TOTAL).
    RenewalFailed,
    /// Half the TTL passed since the last acknowledged renewal (set by the clock).
    RenewalOverdue,
    /// The backend's connection or session is disconnected.
    ConnectionLost,
}

impl SuspectReason {
    /// The `snake_case` value (`"renewal_failed"`, `"renewal_overdue"`, `"connection_lost"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::RenewalFailed => "renewal_failed",
            Self::RenewalOverdue => "renewal_overdue",
            Self::ConnectionLost => "connection_lost",
        }
    }
}

impl fmt::Display for SuspectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::RenewalFailed => "a renewal was not acknowledged",
            Self::RenewalOverdue => "no acknowledged renewal for half the TTL",
            Self::ConnectionLost => "the connection to the server is down",
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Validity {
    /// Send time of the last request that granted or renewed the lease (acknowledged).
    confirmed_sent_at: Instant,
    valid_until: Instant,
    suspect: Option<SuspectReason>,
    lost: Option<LossReason>,
    /// The state the last event reported (events fire on changes of it).
    reported: LeaseState,
}

/// Who the lease is, for its events and metrics; set once by [`Lease::new`].
#[derive(Debug)]
struct Meta {
    name: String,
    /// `None`: a lock's lease; else a leadership's or a permit's.
    kind: Option<SlotKind>,
    token: FencingToken,
    labels: Labels,
    granted_at: Instant,
    /// The end (loss, release, drop, leak) was counted in the metrics.
    ended: AtomicBool,
}

struct Shared {
    /// The state. Its lock is held only to read or change it (never across an await, nor while
    /// a change is reported).
    validity: Mutex<Validity>,
    /// Wakes every waiter of [`LeaseTracker::first_state`] after a change of `validity`. (A
    /// `tokio::sync::watch` channel did this before: with its eight `Notify`s it took 376 B
    /// per lease, heaptrack of the many-leases benchmark; these two fields take about 90.)
    changed: Notify,
    ttl: Duration,
    meta: OnceLock<Meta>,
    /// Held from publishing a change of state until it is reported, so whoever sees the new
    /// state (and waits for this lock when it is not `Held`) also sees its event and metrics.
    reporting: Mutex<()>,
}

thread_local! {
    /// This thread holds some tracker's reporting lock.
    static REPORTING: Cell<bool> = const { Cell::new(false) };
}

/// A held reporting lock (see [`Shared::reporting`]); `None` when this thread held one already.
struct Reporting<'a>(Option<MutexGuard<'a, ()>>);

impl Drop for Reporting<'_> {
    fn drop(&mut self) {
        if self.0.is_some() {
            REPORTING.set(false);
        }
    }
}

/// A state change to report, computed under the state's lock and reported outside it.
struct Change {
    from: LeaseState,
    to: LeaseState,
    suspect: Option<SuspectReason>,
    lost: Option<LossReason>,
}

impl Shared {
    /// Applies `f` to the state (after latching a deadline that passed), wakes the watchers if
    /// anything changed, reports the change of state, if any, and returns what `f` returned.
    fn update<R>(&self, f: impl FnOnce(&mut Validity, Instant) -> R) -> R {
        let _reporting = self.reporting();
        let now = Instant::now();
        let (out, modified, change) = {
            let mut guard = self.validity();
            let v = &mut *guard;
            let before = *v;
            if v.lost.is_none() && now >= v.valid_until {
                v.lost = Some(LossReason::DeadlineExpired);
            }
            let out = f(v, now);
            let state = state_at(v, self.ttl, now);
            let mut change = None;
            if state != v.reported {
                change = Some(Change {
                    from: v.reported,
                    to: state,
                    suspect: v.suspect,
                    lost: v.lost,
                });
                v.reported = state;
            }
            (out, *v != before, change)
        };
        if modified {
            self.changed.notify_waiters();
        }
        if let Some(c) = change {
            self.report(c, now);
        }
        out
    }

    /// The state now; reports a change the clock alone made since the last report.
    ///
    /// Returns only a state that was reported: after reporting one, it looks again, since the
    /// clock may have moved on meanwhile (a Suspect reported just before the deadline, on a
    /// loaded machine, is Lost by the time its event is written). At most as many rounds as
    /// there are states.
    fn observe(&self) -> LeaseState {
        loop {
            let now = Instant::now();
            let (state, reported) = {
                let v = self.get();
                (state_at(&v, self.ttl, now), v.reported)
            };
            if state == reported {
                if state != LeaseState::Held {
                    // Its event may still be being written by whoever published it.
                    drop(self.reporting());
                }
                return state;
            }
            self.update(|_, _| ());
        }
    }

    /// The state's lock (a panic while holding it cannot leave a `Validity` half-written: it
    /// is `Copy` and written whole or field by field, so a poisoned lock is used as is).
    fn validity(&self) -> MutexGuard<'_, Validity> {
        self.validity.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A copy of the state.
    fn get(&self) -> Validity {
        *self.validity()
    }

    /// Takes the reporting lock, unless this thread is reporting already (a tracing layer or a
    /// metrics recorder that reads a lease's state from the event being reported): then
    /// nothing, so a thread never waits for a reporting lock while it holds one (no
    /// self-deadlock, and no two threads each waiting for the other's).
    fn reporting(&self) -> Reporting<'_> {
        if REPORTING.get() {
            return Reporting(None);
        }
        let guard = self
            .reporting
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        REPORTING.set(true);
        Reporting(Some(guard))
    }

    fn report(&self, c: Change, now: Instant) {
        let Some(m) = self.meta.get() else {
            return; // not a lease's tracker (yet): Lease::new reports what happened before
        };
        let (lock, backend, token) = (m.name.as_str(), m.labels.backend, m.token.get());
        let (from, to) = (state_name(c.from), state_name(c.to));
        let what = Subject(m.kind, lock);
        match c.to {
            LeaseState::Lost => {
                let reason = c.lost.unwrap_or(LossReason::DeadlineExpired);
                if reason.by_holder() {
                    tracing::debug!(target: TARGET, lock, backend, token, from, to, reason = reason.as_str(), "{what} ended: {reason}");
                } else {
                    tracing::warn!(target: TARGET, lock, backend, token, from, to, reason = reason.as_str(), "{what} lost: {reason}");
                }
                if !m.ended.swap(true, Ordering::AcqRel) {
                    let lost = (!reason.by_holder()).then_some(reason.as_str());
                    m.labels
                        .ended(now.saturating_duration_since(m.granted_at), lost);
                }
            }
            LeaseState::Suspect => {
                let reason = c.suspect.unwrap_or(SuspectReason::RenewalOverdue);
                tracing::warn!(target: TARGET, lock, backend, token, from, to, reason = reason.as_str(), "{what} at risk: {reason}");
            }
            LeaseState::Held => {
                tracing::info!(target: TARGET, lock, backend, token, from, to, reason = "renewed", "{what} held again");
            }
        }
    }

    fn renewal(&self, result: &'static str) {
        if let Some(m) = self.meta.get() {
            m.labels.renewal(result);
        }
    }
}

/// What a lease is, in its events: `lease on lock "x"`, `leadership of election "x"` or
/// `permit of semaphore "x"`.
struct Subject<'a>(Option<SlotKind>, &'a str);

impl fmt::Display for Subject<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = self.1;
        match self.0 {
            None => write!(f, "lease on lock {name:?}"),
            Some(SlotKind::Election) => write!(f, "leadership of election {name:?}"),
            Some(SlotKind::Semaphore) => write!(f, "permit of semaphore {name:?}"),
        }
    }
}

fn state_name(s: LeaseState) -> &'static str {
    match s {
        LeaseState::Held => "held",
        LeaseState::Suspect => "suspect",
        LeaseState::Lost => "lost",
    }
}

/// The client-side clock of one lease, read-only: when it was last confirmed, when it becomes
/// [`Suspect`](LeaseState::Suspect) and [`Lost`](LeaseState::Lost), and why it was lost.
///
/// The deadline is `send time of the last acknowledged grant/renewal + TTL − drift_margin(TTL)`:
/// because the server started its TTL no earlier than that request was sent, the client always
/// gives up before the server frees the lock (up to the drift margin). The state flips on that
/// deadline by itself; no socket error is awaited. Only the backend that granted the lease moves
/// the deadline (through [`backend::TrackerHandle`](crate::backend::TrackerHandle)).
///
/// Returned by [`Lease::tracker`]; cheap to clone, all clones share one state, and it may outlive
/// the lease (to watch it from another task).
///
/// A holder cannot move its own deadline (that would extend the lease on the client with no
/// renewal on the server):
///
/// ```compile_fail
/// # fn f(lease: &lockkit_core::Lease) {
/// lease.tracker().confirm(lockkit_core::Instant::now());
/// # }
/// ```
///
/// A state change that the clock alone makes (half the TTL without a renewal: suspect; the
/// deadline: lost) is reported as an event when it is first seen: by the lease's keepalive, by
/// [`lost`](Self::lost) / [`at_risk`](Self::at_risk) futures waiting on it, by
/// [`state`](Self::state), and at the latest when the lease is released or dropped.
#[derive(Clone)]
pub struct LeaseTracker {
    shared: Arc<Shared>,
}

impl fmt::Debug for LeaseTracker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseTracker")
            .field("ttl", &self.shared.ttl)
            .field("state", &self.state())
            .field("valid_until", &self.valid_until())
            .field("loss_reason", &self.loss_reason())
            .finish()
    }
}

impl LeaseTracker {
    /// The lease's TTL.
    pub fn ttl(&self) -> Duration {
        self.shared.ttl
    }

    /// The state now.
    pub fn state(&self) -> LeaseState {
        self.shared.observe()
    }

    /// Why the lease was lost; `None` while it is not [`Lost`](LeaseState::Lost).
    pub fn loss_reason(&self) -> Option<LossReason> {
        self.shared.observe();
        self.shared.get().lost
    }

    /// When the lease becomes [`Lost`](LeaseState::Lost) unless renewed.
    pub fn valid_until(&self) -> Instant {
        self.shared.get().valid_until
    }

    /// Send time of the request that last granted or renewed the lease.
    pub fn confirmed_at(&self) -> Instant {
        self.shared.get().confirmed_sent_at
    }

    /// A future that resolves once the lease is lost: at the deadline if nothing renews it, or as
    /// soon as the backend learns it is gone. It owns what it needs (`'static`), so it can be
    /// moved into a task or a `select!`.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping it has no effect on the lease.
    pub fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
        let lost = self.first_state(|s| s == LeaseState::Lost);
        async move {
            lost.await;
        }
    }

    /// A future that resolves with the new state as soon as the lease is no longer
    /// [`Held`](LeaseState::Held): [`Suspect`](LeaseState::Suspect) (a renewal is late or failed,
    /// or the connection dropped) or [`Lost`](LeaseState::Lost). The early warning: stop starting
    /// work that cannot finish before [`valid_until`](Self::valid_until). Resolves at once if the
    /// lease is not held now. `'static`.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping it has no effect on the lease.
    pub fn at_risk(&self) -> impl Future<Output = LeaseState> + Send + 'static {
        self.first_state(|s| s != LeaseState::Held)
    }

    /// Resolves with the first state for which `done` holds, waking on every change and at the
    /// instants where the clock alone changes the state (TTL/2 after the last confirmation:
    /// Suspect; the deadline: Lost), and reporting such clock-made changes as it sees them.
    fn first_state(
        &self,
        done: fn(LeaseState) -> bool,
    ) -> impl Future<Output = LeaseState> + Send + 'static {
        let shared = self.shared.clone();
        async move {
            loop {
                // Registered before the state is read: a change after this wakes `changed`.
                let changed = shared.changed.notified();
                tokio::pin!(changed);
                changed.as_mut().enable();
                let v = shared.get();
                let state = shared.observe();
                if done(state) {
                    return state;
                }
                let next = match state {
                    LeaseState::Held => (v.confirmed_sent_at + shared.ttl / 2).min(v.valid_until),
                    _ => v.valid_until,
                };
                tokio::select! {
                    _ = tokio::time::sleep_until(next) => {}
                    () = changed => {}
                }
            }
        }
    }
}

/// The backend's handle on a lease's clock: creates it and moves it. Every state change it makes
/// is reported as a lease event and in the lease metrics (see [`crate::observe`]).
///
/// Backends create one per grant with the **send time** of the request that granted it, hand a
/// clone to [`Lease::new`], and call [`confirm`](Self::confirm) with the send time of every
/// acknowledged renewal (or of a session heartbeat that keeps the lease alive), and
/// [`mark_suspect`](Self::mark_suspect) / [`mark_lost`](Self::mark_lost) with a reason when they
/// learn of trouble. Users only ever see the read-only [`LeaseTracker`].
///
/// Cheap to clone; all clones share one state.
#[derive(Clone)]
pub struct TrackerHandle {
    view: LeaseTracker,
}

impl fmt::Debug for TrackerHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.view.fmt(f)
    }
}

impl TrackerHandle {
    /// A tracker for a lease of `ttl` granted by a request sent at `sent_at`.
    pub fn new(sent_at: Instant, ttl: Duration) -> Self {
        let v = Validity {
            confirmed_sent_at: sent_at,
            valid_until: deadline(sent_at, ttl),
            suspect: None,
            lost: None,
            reported: LeaseState::Held,
        };
        Self {
            view: LeaseTracker {
                shared: Arc::new(Shared {
                    validity: Mutex::new(v),
                    changed: Notify::new(),
                    ttl,
                    meta: OnceLock::new(),
                    reporting: Mutex::new(()),
                }),
            },
        }
    }

    /// The read-only view, as users see it.
    pub fn view(&self) -> &LeaseTracker {
        &self.view
    }

    /// Records a renewal that the server acknowledged, sent at `sent_at`. Moves the deadline
    /// forward only, and clears a [`mark_suspect`](Self::mark_suspect). Counted as an `ok`
    /// renewal when it moved the deadline.
    ///
    /// Returns `false` (and changes nothing) if the lease is already lost: an acknowledgement
    /// arriving after the deadline does not revive it, because the holder may already have been
    /// told it lost the lock (counted as a `late` renewal when the deadline passed just now).
    pub fn confirm(&self, sent_at: Instant) -> bool {
        let shared = &self.view.shared;
        let was_lost = shared.get().lost.is_some();
        let (alive, moved) = shared.update(|v, _| {
            if v.lost.is_some() {
                return (false, false);
            }
            v.suspect = None;
            let moved = sent_at > v.confirmed_sent_at;
            if moved {
                v.confirmed_sent_at = sent_at;
                v.valid_until = deadline(sent_at, shared.ttl);
            }
            (true, moved)
        });
        if moved {
            shared.renewal("ok");
        } else if !alive && !was_lost {
            shared.renewal("late");
        }
        alive
    }

    /// Marks the lease suspect until the next [`confirm`](Self::confirm) (a renewal failed, the
    /// connection dropped). The deadline is unchanged. Each call with
    /// [`SuspectReason::RenewalFailed`] counts one `failed` renewal.
    pub fn mark_suspect(&self, reason: SuspectReason) {
        let shared = &self.view.shared;
        let alive = shared.update(|v, _| {
            if v.lost.is_some() {
                return false;
            }
            v.suspect = Some(reason);
            true
        });
        if alive && reason == SuspectReason::RenewalFailed {
            shared.renewal("failed");
        }
    }

    /// Marks the lease lost now, for `reason` (the server said it is gone, the session ended, it
    /// was released). Final; a lease already lost keeps its first reason.
    pub fn mark_lost(&self, reason: LossReason) {
        self.view.shared.update(|v, _| {
            if v.lost.is_none() {
                v.lost = Some(reason);
            }
        });
    }

    /// The state now.
    pub fn state(&self) -> LeaseState {
        self.view.state()
    }

    /// The lease's TTL.
    pub fn ttl(&self) -> Duration {
        self.view.ttl()
    }

    /// When the lease becomes [`Lost`](LeaseState::Lost) unless renewed.
    pub fn valid_until(&self) -> Instant {
        self.view.valid_until()
    }

    /// Send time of the request that last granted or renewed the lease.
    pub fn confirmed_at(&self) -> Instant {
        self.view.confirmed_at()
    }

    /// The `backend` and `token` fields of the lease's spans (`"unknown"`, 0 before
    /// [`Lease::new`] attached it).
    pub(crate) fn span_labels(&self) -> (&'static str, u64) {
        self.view
            .shared
            .meta
            .get()
            .map_or(("unknown", 0), |m| (m.labels.backend, m.token.get()))
    }

    /// Counts a renewal result the tracker cannot see by itself (`not_held`).
    pub(crate) fn renewal(&self, result: &'static str) {
        self.view.shared.renewal(result);
    }

    /// Makes this the tracker of the lease `name`/`token`: from now on its changes are reported
    /// with these labels; a change that happened before is reported now.
    pub(crate) fn attach(
        &self,
        name: &str,
        kind: Option<SlotKind>,
        token: FencingToken,
        labels: Labels,
    ) {
        let shared = &self.view.shared;
        let granted_at = shared.get().confirmed_sent_at;
        // Taken before the labels are set: a change published meanwhile is reported either by
        // its `update` (after this) or below (before it), never by both.
        let reporting = shared.reporting();
        let fresh = shared
            .meta
            .set(Meta {
                name: name.to_owned(),
                kind,
                token,
                labels,
                granted_at,
                ended: AtomicBool::new(false),
            })
            .is_ok();
        if !fresh {
            return;
        }
        if let Some(m) = shared.meta.get() {
            m.labels.granted();
        }
        // Report what happened between the grant and now (a loss seen by the backend's session).
        let pending = {
            let v = shared.get();
            (v.reported != LeaseState::Held).then_some(v)
        };
        if let Some(v) = pending {
            shared.report(
                Change {
                    from: LeaseState::Held,
                    to: v.reported,
                    suspect: v.suspect,
                    lost: v.lost,
                },
                Instant::now(),
            );
        }
        drop(reporting);
        shared.observe();
    }

    /// The lease was leaked: it is no longer this process's to count.
    pub(crate) fn leaked(&self) {
        if let Some(m) = self.view.shared.meta.get()
            && !m.ended.swap(true, Ordering::AcqRel)
        {
            m.labels
                .ended(Instant::now().saturating_duration_since(m.granted_at), None);
        }
    }
}

fn deadline(sent_at: Instant, ttl: Duration) -> Instant {
    sent_at + ttl.saturating_sub(drift_margin(ttl))
}

fn state_at(v: &Validity, ttl: Duration, now: Instant) -> LeaseState {
    if v.lost.is_some() || now >= v.valid_until {
        LeaseState::Lost
    } else if v.suspect.is_some() || now >= v.confirmed_sent_at + ttl / 2 {
        LeaseState::Suspect
    } else {
        LeaseState::Held
    }
}

/// The server side of one lease, implemented by each backend.
///
/// Both calls must be **conditional on ownership**: they act only if the lock is still held by
/// this very grant (compare-and-pexpire, compare-and-delete, version-checked delete…), and return
/// [`Error::NotHeld`] otherwise, touching nothing.
#[async_trait]
pub trait LeaseOps: Send + Sync + fmt::Debug + 'static {
    /// Extends the lease on the server to `ttl` from now, if this grant still holds the lock.
    /// Must never re-take a lock that lapsed.
    ///
    /// # Errors
    /// [`Error::NotHeld`] if the grant no longer holds the lock; transport errors otherwise.
    ///
    /// # Cancel safety
    /// Must be cancel safe: a dropped renewal either happened or did not.
    async fn renew(&self, ttl: Duration) -> Result<()>;

    /// Releases the lock if this grant still holds it.
    ///
    /// # Errors
    /// [`Error::NotHeld`] if the grant no longer holds the lock; transport errors otherwise.
    ///
    /// # Cancel safety
    /// Must be cancel safe: a dropped release either happened or did not; the TTL frees the lock
    /// in the second case.
    async fn release(&self) -> Result<()>;

    /// Gives up a grant the client already counts as lost (its deadline passed before a renewal
    /// was acknowledged, or it is dropped after it was lost): frees the lock *as a lapse would*,
    /// so that a [lock-delay](crate::AcquireOptions::lock_delay) set at the grant still runs
    /// (its holder may have been told it lost the lock and still have writes in flight), instead
    /// of the immediate free of [`release`](Self::release). The default calls `release`: right
    /// for backends without lock-delay; backends with it must override.
    ///
    /// # Errors
    /// As [`release`](Self::release).
    ///
    /// # Cancel safety
    /// As [`release`](Self::release): the TTL frees the lock (delay included) if it did not happen.
    async fn relinquish(&self) -> Result<()> {
        self.release().await
    }

    /// Asks the server whether this grant still holds the lock, without extending it.
    ///
    /// # Errors
    /// [`Error::NotHeld`] if the grant no longer holds the lock; transport errors otherwise.
    /// The default is [`Error::NotSupported`].
    ///
    /// # Cancel safety
    /// Must be cancel safe (a read).
    async fn check(&self) -> Result<()> {
        Err(Error::NotSupported {
            operation: "checking a lease",
            backend: "unknown",
        })
    }

    /// `true` if the backend keeps the lease's [`LeaseTracker`] confirmed by itself (a session
    /// keepalive shared by many leases, as on etcd and ZooKeeper), so the core must not schedule
    /// renewals of its own. Default `false`.
    fn self_renewing(&self) -> bool {
        false
    }

    /// The backend's own type, so its fence helpers can reach grant details (keys, revisions)
    /// from a `&Lease`.
    fn as_any(&self) -> &dyn Any;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn tracker_states_follow_the_clock() {
        let ttl = Duration::from_secs(10);
        let t = TrackerHandle::new(Instant::now(), ttl);
        assert_eq!(t.state(), LeaseState::Held);
        tokio::time::advance(Duration::from_secs(6)).await;
        assert_eq!(t.state(), LeaseState::Suspect);
        // A renewal sent now and acknowledged moves the deadline.
        assert!(t.confirm(Instant::now()));
        assert_eq!(t.state(), LeaseState::Held);
        let lost = t.view().lost();
        let start = Instant::now();
        lost.await;
        let waited = start.elapsed();
        assert_eq!(waited, ttl - drift_margin(ttl));
        assert_eq!(t.state(), LeaseState::Lost);
        // Lost is final.
        assert!(!t.confirm(Instant::now()));
        assert_eq!(t.state(), LeaseState::Lost);
    }

    #[tokio::test(start_paused = true)]
    async fn mark_lost_wakes_waiters_and_suspect_clears() {
        let t = TrackerHandle::new(Instant::now(), Duration::from_secs(10));
        t.mark_suspect(SuspectReason::ConnectionLost);
        assert_eq!(t.state(), LeaseState::Suspect);
        assert!(t.confirm(Instant::now()));
        assert_eq!(t.state(), LeaseState::Held);
        let lost = tokio::spawn(t.view().lost());
        tokio::task::yield_now().await;
        t.mark_lost(LossReason::NotHeldOnServer);
        lost.await.unwrap();
        assert_eq!(t.state(), LeaseState::Lost);
    }

    #[tokio::test(start_paused = true)]
    async fn at_risk_fires_at_half_ttl_or_on_a_flag() {
        let ttl = Duration::from_secs(10);
        let t = TrackerHandle::new(Instant::now(), ttl);
        let start = Instant::now();
        assert_eq!(t.view().at_risk().await, LeaseState::Suspect);
        assert_eq!(start.elapsed(), ttl / 2);
        assert!(t.confirm(Instant::now()));
        let risk = tokio::spawn(t.view().at_risk());
        tokio::task::yield_now().await;
        t.mark_suspect(SuspectReason::ConnectionLost);
        assert_eq!(risk.await.unwrap(), LeaseState::Suspect);
        assert_eq!(start.elapsed(), ttl / 2);
    }

    #[tokio::test(start_paused = true)]
    async fn deadline_counts_from_send_time() {
        let ttl = Duration::from_secs(3);
        let sent = Instant::now();
        tokio::time::advance(Duration::from_secs(1)).await; // a slow reply
        let t = TrackerHandle::new(sent, ttl);
        assert_eq!(t.valid_until(), sent + ttl - drift_margin(ttl));
    }
}
