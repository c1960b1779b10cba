//! Semaphores: at most N holders of a name, each permit a lease.
//!
//! Built on [`SlotBackend`](crate::backend::SlotBackend) (N slots); see
//! [docs/election-semaphore.md](https://example.invalid/lockkit/blob/main/docs/election-semaphore.md).

use std::fmt;
use std::ops::Deref;

use async_trait::async_trait;
use tracing::Instrument;

use crate::observe::TARGET;
use crate::slots::{
    SlotBackend, SlotGuarantees, SlotHolders, SlotKind, SlotRequest, grant_checked, outcome,
    validate_slot_name,
};
use crate::{AcquireOptions, Lease, Result};

/// One permit of a semaphore, from [`Semaphore::acquire_permit`]: a [`Lease`] (it derefs to
/// it: TTL, keepalive, state, loss signal, renew…) on one of the semaphore's N slots.
///
/// Each slot is a fencing domain of its own: the permit's [`token`](Lease::token) names the
/// slot (`…sem/{name}/{slot}`) and strictly increases with every grant of that slot. N holders
/// work at once, so a resource guarded by the semaphore is fenced per slot (one part per slot,
/// or one fence per slot), never by one token order for all. Dropping a permit releases it in
/// the background, as a lease does.
#[must_use = "a permit that is dropped at once is released at once"]
pub struct Permit {
    lease: Lease,
    slot: u32,
    permits: u32,
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field("lease", &self.lease)
            .field("slot", &self.slot)
            .field("permits", &self.permits)
            .finish()
    }
}

impl Deref for Permit {
    type Target = Lease;

    fn deref(&self) -> &Lease {
        &self.lease
    }
}

impl Permit {
    /// Which slot this permit holds: `0..permits()`.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// The semaphore's N.
    pub fn permits(&self) -> u32 {
        self.permits
    }

    /// The permit's lease.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// Releases the permit: the first waiter, if any, gets the slot.
    ///
    /// # Errors
    /// As [`Lease::release`].
    ///
    /// # Cancel safety
    /// As [`Lease::release`].
    pub async fn release(self) -> Result<()> {
        self.lease.release().await
    }

    /// The lease alone.
    pub fn into_lease(self) -> Lease {
        self.lease
    }
}

/// Counting semaphores on a backend: at most N holders of a name at once.
///
/// Object safe (`Arc<dyn Semaphore>`). Implemented once, here, for every
/// [`SlotBackend`](crate::backend::SlotBackend).
///
/// ```
/// use lockkit_core::{AcquireOptions, Error, MemoryFence, MemoryLock, Semaphore, Wait};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lockkit_core::Result<()> {
/// let backend = MemoryLock::new();
/// let storage = MemoryFence::new();
/// let permit = backend.acquire_permit("transcoders", 2, AcquireOptions::new()).await?;
/// // N holders work at once: fence per slot.
/// storage.write(&format!("slot-{}", permit.slot()), permit.token(), "job 1")?;
/// // Every client must agree on N while the semaphore is in use:
/// let other = backend.acquire_permit("transcoders", 3, AcquireOptions::new()).await;
/// assert!(matches!(other, Err(Error::PermitsMismatch { ours: 3, theirs: 2, .. })));
/// permit.release().await?; // admits the first waiter, if any
/// # Ok(()) }
/// ```
///
/// # Contract
/// - At most N permits of a name are [`Held`](crate::LeaseState::Held) at once (up to the
///   backend's [`Guarantees`](crate::Guarantees)); each is a lease on one slot, whose tokens
///   strictly increase.
/// - N is part of the name's contract while it has holders or waiters: an acquire with another
///   N fails with [`Error::PermitsMismatch`](crate::Error::PermitsMismatch).
/// - Waiters queue (FIFO where [`Guarantees::fifo_waiters`](crate::Guarantees::fifo_waiters));
///   a released or expired permit admits the first waiter only.
///
/// The contract suite (`lockkit_core::contract_election`, feature `contract`) tests all of this.
#[async_trait]
pub trait Semaphore: Send + Sync + fmt::Debug {
    /// Acquires one of the `permits` permits of semaphore `name`, in an `acquire_permit` span
    /// (fields `semaphore`, `backend`, `permits`, `ttl`; recorded `outcome`, `slot`, `token`).
    ///
    /// # Errors
    /// - [`Error::InvalidName`](crate::Error::InvalidName),
    ///   [`Error::InvalidConfig`](crate::Error::InvalidConfig) (options; `permits` not in
    ///   1..=[`MAX_PERMITS`](crate::MAX_PERMITS) or above the backend's
    ///   [`SlotGuarantees::max_permits`]): bad input, nothing was sent.
    /// - [`Error::PermitsMismatch`](crate::Error::PermitsMismatch): the semaphore is in use with
    ///   another N.
    /// - [`Error::Held`](crate::Error::Held): with [`Wait::No`](crate::Wait::No), all permits
    ///   are held (or others wait first).
    /// - [`Error::Timeout`](crate::Error::Timeout) and the rest: as
    ///   [`Lock::acquire`](crate::Lock::acquire).
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future leaves no waiter behind (a permit handed over meanwhile
    /// is handed on).
    async fn acquire_permit(
        &self,
        name: &str,
        permits: u32,
        opts: AcquireOptions,
    ) -> Result<Permit>;

    /// Reads the holders of semaphore `name` and its N in force: `None` if it is idle.
    ///
    /// # Errors
    /// [`Error::InvalidName`](crate::Error::InvalidName);
    /// [`Error::NotSupported`](crate::Error::NotSupported) where the backend cannot tell;
    /// transport errors.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    async fn permit_holders(&self, name: &str) -> Result<Option<SlotHolders>>;

    /// What this backend promises for semaphores.
    fn semaphore_guarantees(&self) -> SlotGuarantees;
}

#[async_trait]
impl<B: SlotBackend + ?Sized> Semaphore for B {
    async fn acquire_permit(
        &self,
        name: &str,
        permits: u32,
        opts: AcquireOptions,
    ) -> Result<Permit> {
        let backend = self.slot_guarantees().lock.backend;
        let span = tracing::info_span!(target: TARGET, "acquire_permit", semaphore = %name, backend, permits, ttl = ?opts.ttl, outcome = tracing::field::Empty, slot = tracing::field::Empty, token = tracing::field::Empty);
        let req = SlotRequest::new(SlotKind::Semaphore, name, permits, &[]);
        let res = grant_checked(self, req, opts)
            .instrument(span.clone())
            .await;
        span.record("outcome", outcome(&res));
        let grant = res?;
        span.record("slot", grant.slot);
        span.record("token", grant.lease.token().get());
        Ok(Permit {
            lease: grant.lease,
            slot: grant.slot,
            permits,
        })
    }

    async fn permit_holders(&self, name: &str) -> Result<Option<SlotHolders>> {
        validate_slot_name(SlotKind::Semaphore, name)?;
        self.slot_holders(SlotKind::Semaphore, name).await
    }

    fn semaphore_guarantees(&self) -> SlotGuarantees {
        self.slot_guarantees()
    }
}
