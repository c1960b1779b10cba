//! Leader election: campaign, resign, proclaim, observe.
//!
//! Built on [`SlotBackend`](crate::backend::SlotBackend) (one slot with a value); see
//! [docs/election-semaphore.md](https://example.invalid/lockkit/blob/main/docs/election-semaphore.md).

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use async_trait::async_trait;
use tracing::Instrument;

use crate::backend::validate_slot_name;
use crate::observe::TARGET;
use crate::slots::{
    SlotBackend, SlotGuarantees, SlotKind, SlotOps, SlotRequest, SlotWatch, WatchEvent,
    grant_checked, outcome, validate_value,
};
use crate::{AcquireOptions, Error, FencingToken, Lease, LossReason, Result};

/// A leader as others see it: its term and its value.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeaderInfo {
    /// The leader's term: the fencing token of its leadership. Strictly increases with every new
    /// leader of the name (only ordered within one election, see [`FencingToken`]).
    pub term: FencingToken,
    /// The value the leader campaigned with or last proclaimed.
    pub value: Vec<u8>,
}

impl LeaderInfo {
    /// A leader of `term` with `value`.
    pub fn new(term: FencingToken, value: Vec<u8>) -> Self {
        Self { term, value }
    }
}

/// What an [`Observer`] sees.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LeaderEvent {
    /// This leader leads: a new term, or (the same term as the event before) a value it
    /// proclaimed.
    Leader(LeaderInfo),
    /// No one leads: the last leader resigned or lapsed and no candidate has been granted yet.
    NoLeader,
    /// Changes may have happened here that this observer did not see (it fell behind, its
    /// connection was re-established, or, where
    /// [`SlotGuarantees::every_change_observed`] is `false`, between two reads of a one-shot
    /// watch). The next event is a state at or after them.
    Missed,
}

/// A stream of an election's changes, from [`Election::observe`].
///
/// The first event is the state when `observe` returned (a [`Leader`](LeaderEvent::Leader) or
/// [`NoLeader`](LeaderEvent::NoLeader)); each later one is the next change, in order. The core
/// holds every backend to the same rules: terms never go down, a state is not repeated, and a
/// change the backend may have lost is marked with [`Missed`](LeaderEvent::Missed), never
/// skipped silently.
pub struct Observer {
    name: String,
    watch: Box<dyn SlotWatch>,
    /// The last state delivered (`None` before the first one and after a `Missed`).
    last: Option<LeaderEvent>,
    /// The highest term delivered.
    term: Option<FencingToken>,
}

impl fmt::Debug for Observer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Observer")
            .field("name", &self.name)
            .field("last", &self.last)
            .finish_non_exhaustive()
    }
}

impl Observer {
    pub(crate) fn new(name: &str, watch: Box<dyn SlotWatch>) -> Self {
        Self {
            name: name.to_owned(),
            watch,
            last: None,
            term: None,
        }
    }

    /// The election's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The last state delivered by [`next`](Self::next) (`None` before the first and right
    /// after a [`Missed`](LeaderEvent::Missed)).
    pub fn last(&self) -> Option<&LeaderEvent> {
        self.last.as_ref()
    }

    /// The next event (see the type docs).
    ///
    /// # Errors
    /// Transport errors the backend's watch cannot recover from; observe again to go on.
    ///
    /// # Cancel safety
    /// Cancel safe: a dropped call loses no event (use it in `select!`).
    pub async fn next(&mut self) -> Result<LeaderEvent> {
        loop {
            let event = match self.watch.next().await? {
                WatchEvent::Missed => {
                    self.last = None;
                    return Ok(LeaderEvent::Missed);
                }
                WatchEvent::Holders(holders) => match holders.into_iter().next() {
                    Some(h) => LeaderEvent::Leader(LeaderInfo::new(h.token, h.value)),
                    None => LeaderEvent::NoLeader,
                },
            };
            if self.last.as_ref() == Some(&event) {
                continue;
            }
            if let LeaderEvent::Leader(l) = &event {
                if self.term.as_ref().is_some_and(|t| l.term < *t) {
                    tracing::debug!(target: TARGET, election = %self.name, term = l.term.get(), "observer got an older term than it delivered; dropped");
                    continue;
                }
                self.term = Some(l.term.clone());
            }
            self.last = Some(event.clone());
            return Ok(event);
        }
    }
}

/// A leadership won by [`Election::campaign`]: a [`Lease`] (it derefs to it: TTL, keepalive,
/// [`state`](Lease::state), [`lost`](Lease::lost), [`renew`](Lease::renew)…) whose token is
/// the leader's **term**, plus the leader's value.
///
/// Fence every write the leader makes with [`term`](Self::term): a paused leader whose lease
/// lapsed still believes it leads; the resource rejects its term once a newer leader wrote.
/// Dropping a leadership resigns in the background (release on drop), as a lease does.
#[must_use = "a leadership that is dropped at once resigns at once"]
pub struct Leadership {
    lease: Lease,
    value: Vec<u8>,
    ops: Arc<dyn SlotOps>,
}

impl fmt::Debug for Leadership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leadership")
            .field("lease", &self.lease)
            .field("value_len", &self.value.len())
            .finish()
    }
}

impl Deref for Leadership {
    type Target = Lease;

    fn deref(&self) -> &Lease {
        &self.lease
    }
}

impl Leadership {
    /// The election's name.
    pub fn name(&self) -> &str {
        self.lease.name()
    }

    /// The term: the leadership's fencing token.
    pub fn term(&self) -> FencingToken {
        self.lease.token()
    }

    /// The value this leader campaigned with or last proclaimed.
    pub fn value(&self) -> &[u8] {
        &self.value
    }

    /// The lease of this leadership.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// Replaces the leader's value (the term stays); observers see it as a
    /// [`Leader`](LeaderEvent::Leader) event of the same term.
    ///
    /// # Errors
    /// - [`Error::InvalidConfig`]: the value is longer than
    ///   [`MAX_VALUE_BYTES`](crate::MAX_VALUE_BYTES); nothing was sent.
    /// - [`Error::LeaseLost`]: the leadership is already lost on the client side (nothing sent).
    /// - [`Error::NotHeld`]: the server says this is no longer the leader; the lease becomes
    ///   lost.
    /// - Transport errors: the value may or may not have changed.
    ///
    /// # Cancel safety
    /// Cancel safe: the value either changed on the server or did not; [`value`](Self::value)
    /// changes only on success.
    pub async fn proclaim(&mut self, value: &[u8]) -> Result<()> {
        validate_value(value)?;
        if let Some(reason) = self.lease.loss_reason() {
            return Err(Error::LeaseLost {
                name: self.lease.name().to_owned(),
                reason,
            });
        }
        match self.ops.set_value(value).await {
            Ok(()) => {
                self.value = value.to_vec();
                Ok(())
            }
            Err(e @ Error::NotHeld { .. }) => {
                self.lease
                    .tracker_handle()
                    .mark_lost(LossReason::NotHeldOnServer);
                Err(e)
            }
            Err(e) => Err(e),
        }
    }

    /// Resigns: releases the leadership so that the next candidate in line becomes leader.
    ///
    /// # Errors
    /// As [`Lease::release`].
    ///
    /// # Cancel safety
    /// As [`Lease::release`].
    pub async fn resign(self) -> Result<()> {
        self.lease.release().await
    }

    /// The lease, giving up the means to proclaim.
    pub fn into_lease(self) -> Lease {
        self.lease
    }
}

/// Leader election on a backend: campaign for a name with a value, observe who leads.
///
/// Object safe (`Arc<dyn Election>`). Implemented once, here, for every
/// [`SlotBackend`](crate::backend::SlotBackend).
///
/// ```
/// use lockkit_core::{AcquireOptions, Election, LeaderEvent, LeaderInfo, MemoryFence, MemoryLock};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lockkit_core::Result<()> {
/// let backend = MemoryLock::new();
/// let storage = MemoryFence::new();
/// let mut observer = backend.observe("scheduler").await?;
/// assert_eq!(observer.next().await?, LeaderEvent::NoLeader);
///
/// let mut leader = backend.campaign("scheduler", b"10.0.0.7:8080", AcquireOptions::new()).await?;
/// storage.write("plan", leader.term(), "v1")?; // every write is fenced by the term
/// leader.proclaim(b"10.0.0.7:9090").await?; // the same term, a new value
/// let term = leader.term();
/// leader.resign().await?; // the next candidate in line, if any, leads
///
/// let expect = |v: &[u8]| LeaderEvent::Leader(LeaderInfo::new(term.clone(), v.to_vec()));
/// assert_eq!(observer.next().await?, expect(b"10.0.0.7:8080"));
/// assert_eq!(observer.next().await?, expect(b"10.0.0.7:9090"));
/// assert_eq!(observer.next().await?, LeaderEvent::NoLeader);
/// # Ok(()) }
/// ```
///
/// # Contract
/// - At most one [`Leadership`] per name is [`Held`](crate::LeaseState::Held) at a time (up to
///   the backend's [`Guarantees`](crate::Guarantees)), and every new leader's term is larger
///   than every earlier one's.
/// - Candidates wait per [`AcquireOptions::wait`], in line (FIFO where
///   [`Guarantees::fifo_waiters`](crate::Guarantees::fifo_waiters)); a resign or a lapse hands
///   leadership to the first candidate only.
/// - Observers see every change in order, or [`LeaderEvent::Missed`] where they may not have.
///
/// The contract suite (`lockkit_core::contract_election`, feature `contract`) tests all of this.
#[async_trait]
pub trait Election: Send + Sync + fmt::Debug {
    /// Campaigns for leadership of `name` with `value` and returns once this candidate leads,
    /// in a `campaign` span (fields `election`, `backend`, `ttl`; recorded `outcome`, `term`).
    ///
    /// # Errors
    /// - [`Error::InvalidName`], [`Error::InvalidConfig`] (options, a value longer than
    ///   [`MAX_VALUE_BYTES`](crate::MAX_VALUE_BYTES)): bad input, nothing was sent.
    /// - [`Error::Held`]: with [`Wait::No`](crate::Wait::No), someone else leads or is first in line.
    /// - [`Error::Timeout`]: with [`Wait::Timeout`](crate::Wait::Timeout), not elected in time.
    /// - [`Error::NotSupported`], [`Error::Unavailable`], [`Error::Auth`], [`Error::Backend`],
    ///   [`Error::LeaseLost`]: as [`Lock::acquire`](crate::Lock::acquire).
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future leaves no candidate behind (a leadership handed over
    /// meanwhile is handed on).
    async fn campaign(&self, name: &str, value: &[u8], opts: AcquireOptions) -> Result<Leadership>;

    /// Reads who leads `name` now: `None` if no one does. A read only.
    ///
    /// # Errors
    /// [`Error::InvalidName`]; [`Error::NotSupported`] where the backend cannot tell; transport
    /// errors.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    async fn leader(&self, name: &str) -> Result<Option<LeaderInfo>>;

    /// Observes `name` without campaigning (see [`Observer`]).
    ///
    /// # Errors
    /// [`Error::InvalidName`]; [`Error::NotSupported`] where the backend has no watch
    /// ([`SlotGuarantees::observe`]); transport errors.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future leaves no watch behind.
    async fn observe(&self, name: &str) -> Result<Observer>;

    /// What this backend promises for elections.
    fn election_guarantees(&self) -> SlotGuarantees;
}

#[async_trait]
impl<B: SlotBackend + ?Sized> Election for B {
    async fn campaign(&self, name: &str, value: &[u8], opts: AcquireOptions) -> Result<Leadership> {
        let backend = self.slot_guarantees().lock.backend;
        let span = tracing::info_span!(target: TARGET, "campaign", election = %name, backend, ttl = ?opts.ttl, outcome = tracing::field::Empty, term = tracing::field::Empty);
        let req = SlotRequest::new(SlotKind::Election, name, 1, value);
        let res = grant_checked(self, req, opts)
            .instrument(span.clone())
            .await;
        span.record("outcome", outcome(&res));
        let grant = res?;
        span.record("term", grant.lease.token().get());
        Ok(Leadership {
            lease: grant.lease,
            value: value.to_vec(),
            ops: grant.ops,
        })
    }

    async fn leader(&self, name: &str) -> Result<Option<LeaderInfo>> {
        validate_slot_name(SlotKind::Election, name)?;
        let holders = self.slot_holders(SlotKind::Election, name).await?;
        Ok(holders
            .and_then(|h| h.holders.into_iter().next())
            .map(|h| LeaderInfo::new(h.token, h.value)))
    }

    async fn observe(&self, name: &str) -> Result<Observer> {
        validate_slot_name(SlotKind::Election, name)?;
        let watch = self.watch_slots(SlotKind::Election, name).await?;
        Ok(Observer::new(name, watch))
    }

    fn election_guarantees(&self) -> SlotGuarantees {
        self.slot_guarantees()
    }
}
