//! Leases: what a successful acquire returns, its client-side state and its keepalive.
//!
//! Keepalive: a lease that core renews is first handed to its runtime's keepalive scheduler (one
//! driver task per Tokio runtime, shared by all leases), which waits out the first TTL/3. Only a
//! lease still held then gets a renewal task of its own (`keepalive_loop`), so the common acquire,
//! short critical section, release spawns no task at all.

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::watch;
use tokio::time::Instant;

use tracing::Instrument;

use crate::keeper::{self, Registration};
use crate::observe::{Labels, TARGET};
use crate::{AcquireOptions, Error, FencingToken, Result};

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
    token: FencingToken,
    labels: Labels,
    granted_at: Instant,
    /// The end (loss, release, drop, leak) was counted in the metrics.
    ended: AtomicBool,
}

struct Shared {
    tx: watch::Sender<Validity>,
    ttl: Duration,
    meta: OnceLock<Meta>,
}

/// A state change to report, computed under the watch lock and reported outside it.
struct Change {
    from: LeaseState,
    to: LeaseState,
    suspect: Option<SuspectReason>,
    lost: Option<LossReason>,
}

impl Shared {
    /// Applies `f` to the state (after latching a deadline that passed), wakes the watchers if
    /// anything changed, reports the change of state, if any, and returns what `f` returned.
    fn update<R: Default>(&self, f: impl FnOnce(&mut Validity, Instant) -> R) -> R {
        let now = Instant::now();
        let mut change = None;
        let mut out = R::default();
        self.tx.send_if_modified(|v| {
            let before = *v;
            if v.lost.is_none() && now >= v.valid_until {
                v.lost = Some(LossReason::DeadlineExpired);
            }
            out = f(v, now);
            let state = state_at(v, self.ttl, now);
            if state != v.reported {
                change = Some(Change {
                    from: v.reported,
                    to: state,
                    suspect: v.suspect,
                    lost: v.lost,
                });
                v.reported = state;
            }
            *v != before
        });
        if let Some(c) = change {
            self.report(c, now);
        }
        out
    }

    /// The state now; reports a change the clock alone made since the last report.
    fn observe(&self) -> LeaseState {
        let now = Instant::now();
        let (state, reported) = {
            let v = self.tx.borrow();
            (state_at(&v, self.ttl, now), v.reported)
        };
        if state == reported {
            return state;
        }
        self.update(|_, _| ());
        state_at(&self.tx.borrow(), self.ttl, Instant::now())
    }

    fn report(&self, c: Change, now: Instant) {
        let Some(m) = self.meta.get() else {
            return; // not a lease's tracker (yet): Lease::new reports what happened before
        };
        let (lock, backend, token) = (m.name.as_str(), m.labels.backend, m.token.get());
        let (from, to) = (state_name(c.from), state_name(c.to));
        match c.to {
            LeaseState::Lost => {
                let reason = c.lost.unwrap_or(LossReason::DeadlineExpired);
                if reason.by_holder() {
                    tracing::debug!(target: TARGET, lock, backend, token, from, to, reason = reason.as_str(), "lease ended: {reason}");
                } else {
                    tracing::warn!(target: TARGET, lock, backend, token, from, to, reason = reason.as_str(), "lease on lock {lock:?} lost: {reason}");
                }
                if !m.ended.swap(true, Ordering::AcqRel) {
                    let lost = (!reason.by_holder()).then_some(reason.as_str());
                    m.labels
                        .ended(now.saturating_duration_since(m.granted_at), lost);
                }
            }
            LeaseState::Suspect => {
                let reason = c.suspect.unwrap_or(SuspectReason::RenewalOverdue);
                tracing::warn!(target: TARGET, lock, backend, token, from, to, reason = reason.as_str(), "lease on lock {lock:?} at risk: {reason}");
            }
            LeaseState::Held => {
                tracing::info!(target: TARGET, lock, backend, token, from, to, reason = "renewed", "lease on lock {lock:?} held again");
            }
        }
    }

    fn renewal(&self, result: &'static str) {
        if let Some(m) = self.meta.get() {
            m.labels.renewal(result);
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
        self.shared.tx.borrow().lost
    }

    /// When the lease becomes [`Lost`](LeaseState::Lost) unless renewed.
    pub fn valid_until(&self) -> Instant {
        self.shared.tx.borrow().valid_until
    }

    /// Send time of the request that last granted or renewed the lease.
    pub fn confirmed_at(&self) -> Instant {
        self.shared.tx.borrow().confirmed_sent_at
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
        let mut rx = shared.tx.subscribe();
        async move {
            loop {
                // Mark the state seen before reading it: a change after this wakes `changed()`.
                let v = *rx.borrow_and_update();
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
                    _ = rx.changed() => {}
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
                    tx: watch::Sender::new(v),
                    ttl,
                    meta: OnceLock::new(),
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
        let was_lost = shared.tx.borrow().lost.is_some();
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

    /// Counts a renewal result the tracker cannot see by itself (`not_held`).
    pub(crate) fn renewal(&self, result: &'static str) {
        self.view.shared.renewal(result);
    }

    /// Makes this the tracker of the lease `name`/`token`: from now on its changes are reported
    /// with these labels; a change that happened before is reported now.
    fn attach(&self, name: &str, token: FencingToken, labels: Labels) {
        let shared = &self.view.shared;
        let granted_at = shared.tx.borrow().confirmed_sent_at;
        let fresh = shared
            .meta
            .set(Meta {
                name: name.to_owned(),
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
            let v = shared.tx.borrow();
            (v.reported != LeaseState::Held).then_some(*v)
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
        shared.observe();
    }

    /// The lease was leaked: it is no longer this process's to count.
    fn leaked(&self) {
        if let Some(m) = self.view.shared.meta.get() {
            if !m.ended.swap(true, Ordering::AcqRel) {
                m.labels
                    .ended(Instant::now().saturating_duration_since(m.granted_at), None);
            }
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
            // the lock, so the renewal must not keep it held. Give it back.
            let _ = ops.release().await;
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
        self.tracker.mark_lost(LossReason::Dropped);
        if self.release_on_drop {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(release_in_background(
                    self.name.clone(),
                    self.ops.clone(),
                    self.tracker.valid_until() + drift_margin(self.tracker.ttl()),
                ));
            }
        }
    }
}

/// Release on drop: retries transient failures with backoff until `until` (after which the server
/// frees the lock by itself).
async fn release_in_background(name: String, ops: Arc<dyn LeaseOps>, until: Instant) {
    let mut pause = Duration::from_millis(20);
    loop {
        match tokio::time::timeout_at(until, ops.release()).await {
            Ok(Err(e)) if e.is_retryable() && Instant::now() + pause < until => {
                tracing::debug!(target: TARGET, lock = %name, error = %e, "release on drop failed; retrying");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            Ok(Err(e)) => {
                tracing::debug!(target: TARGET, lock = %name, error = %e, "release on drop failed; the TTL will free the lock");
                return;
            }
            Ok(Ok(())) | Err(_) => return,
        }
    }
}

/// Renews at about TTL/3 from the last acknowledged send time; a failed renewal is retried every
/// TTL/12 until the deadline. Stops when the lease is lost or the task is aborted. Each renewal
/// runs in a `renew` span with `keepalive = true`.
///
/// `first` is when the first renewal is due: the grant's `confirmed_at() + TTL/3`. The keepalive
/// scheduler starts the loop at that instant.
pub(crate) async fn keepalive_loop(
    name: String,
    tracker: TrackerHandle,
    ops: Arc<dyn LeaseOps>,
    first: Instant,
) {
    let ttl = tracker.ttl();
    let interval = ttl / 3;
    let retry = (ttl / 12).max(Duration::from_millis(5));
    let (backend, token) = tracker
        .view()
        .shared
        .meta
        .get()
        .map_or(("unknown", 0), |m| (m.labels.backend, m.token.get()));
    let mut next = first;
    loop {
        tokio::time::sleep_until(next).await;
        if tracker.state() == LeaseState::Lost {
            return;
        }
        let span = tracing::debug_span!(target: TARGET, "renew", lock = %name, backend, token, keepalive = true, outcome = tracing::field::Empty);
        let sent = Instant::now();
        let answer = tokio::time::timeout_at(tracker.valid_until(), ops.renew(ttl))
            .instrument(span.clone())
            .await;
        match answer {
            Ok(Ok(())) => {
                if !tracker.confirm(sent) {
                    span.record("outcome", "late");
                    // Acknowledged too late: the holder has been told it lost the lock, so give
                    // the lock back rather than keep a lease nobody uses.
                    let _ = ops.release().await;
                    return;
                }
                span.record("outcome", "ok");
                next = sent + interval;
            }
            Ok(Err(Error::NotHeld { .. })) => {
                span.record("outcome", "not_held");
                tracker.renewal("not_held");
                tracker.mark_lost(LossReason::NotHeldOnServer);
                return;
            }
            Ok(Err(e)) => {
                span.record("outcome", "error");
                // The renewal failed: the lease may still be valid, but can no longer be counted on.
                tracing::debug!(target: TARGET, lock = %name, backend, error = %e, "keepalive failed; retrying");
                tracker.mark_suspect(SuspectReason::RenewalFailed);
                next = Instant::now() + retry;
            }
            Err(_elapsed) => {
                span.record("outcome", "timeout");
                tracker.renewal("failed");
                tracing::debug!(target: TARGET, lock = %name, backend, "keepalive did not answer before the deadline");
                next = Instant::now();
            }
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

    #[tokio::test(start_paused = true)]
    async fn drop_release_retries_transient_failures() {
        #[derive(Debug, Default)]
        struct FlakyRelease(std::sync::atomic::AtomicUsize);
        #[async_trait]
        impl LeaseOps for FlakyRelease {
            async fn renew(&self, _ttl: Duration) -> Result<()> {
                Ok(())
            }
            async fn release(&self) -> Result<()> {
                if self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < 2 {
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
        let ops = Arc::new(FlakyRelease::default());
        let ttl = Duration::from_secs(3);
        let opts = AcquireOptions::new().ttl(ttl).keepalive(false);
        let lease = Lease::new(
            "l",
            FencingToken::new("memory/0/l", 1),
            TrackerHandle::new(Instant::now(), ttl),
            ops.clone(),
            &opts,
        );
        drop(lease);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(ops.0.load(std::sync::atomic::Ordering::SeqCst), 3);
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
