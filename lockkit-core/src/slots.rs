//! Slots: the one backend primitive behind [`Election`](crate::Election) and
//! [`Semaphore`](crate::Semaphore).
//!
//! A leadership is one slot of a name, granted as a lease and carrying a value that observers
//! watch; a semaphore permit is one of N slots. A backend implements [`SlotBackend`] and gets
//! both user traits from the core, which validates input, cuts timeouts, gives back grants that
//! arrive too late, and instruments every call. See
//! [docs/election-semaphore.md](https://example.invalid/lockkit/blob/main/docs/election-semaphore.md).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::lock::with_min_validity;
use crate::{AcquireOptions, Error, FencingToken, Guarantees, Lease, Result};

/// The largest number of permits of a semaphore: 1024. More is almost surely a mistake (a
/// semaphore that large is a rate limiter), and some backends try each slot in turn.
pub const MAX_PERMITS: u32 = 1024;

/// The longest value a leader or slot holder may carry, in bytes: 4096. Values travel with
/// every observer event; keep them to an address or a small document.
pub const MAX_VALUE_BYTES: usize = 4096;

/// Which kind of slot a request is for. Each kind has a key space of its own on every backend:
/// the election `x`, the semaphore `x` and the lock `x` are three different things.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SlotKind {
    /// A leader election: one slot, with the leader's value.
    Election,
    /// A semaphore: N slots.
    Semaphore,
}

impl SlotKind {
    /// The key-space component backends use for this kind: `"elect"` or `"sem"`. Token lock
    /// identities are `{backend prefix}elect/{name}` and `{backend prefix}sem/{name}/{slot}`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Election => "elect",
            Self::Semaphore => "sem",
        }
    }

    /// What users call this kind: `"election"` or `"semaphore"` (in errors).
    pub fn noun(self) -> &'static str {
        match self {
            Self::Election => "election",
            Self::Semaphore => "semaphore",
        }
    }
}

/// Checks an election's or a semaphore's name: the rules of [`validate_name`](crate::backend::validate_name), with an error
/// that says which kind of name it was.
///
/// # Errors
/// [`Error::InvalidName`] naming `kind` ("invalid election name …").
pub fn validate_slot_name(kind: SlotKind, name: &str) -> Result<()> {
    crate::options::validate_name_of(kind.noun(), name)
}

/// One request for a slot, validated by the core before the backend sees it.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct SlotRequest<'a> {
    /// Election or semaphore.
    pub kind: SlotKind,
    /// The name (checked by [`validate_slot_name`]).
    pub name: &'a str,
    /// How many slots the name has: 1 for an election, N (1..=[`MAX_PERMITS`]) for a semaphore.
    pub permits: u32,
    /// The holder's value (at most [`MAX_VALUE_BYTES`]; empty for a semaphore permit).
    pub value: &'a [u8],
}

impl<'a> SlotRequest<'a> {
    /// A request for one of `permits` slots of `name`, carrying `value`.
    pub fn new(kind: SlotKind, name: &'a str, permits: u32, value: &'a [u8]) -> Self {
        Self {
            kind,
            name,
            permits,
            value,
        }
    }

    /// Checks the name, the number of permits and the value.
    ///
    /// # Errors
    /// [`Error::InvalidName`]; [`Error::InvalidConfig`] for a bad `permits` or value.
    pub fn validate(&self) -> Result<()> {
        validate_slot_name(self.kind, self.name)?;
        validate_permits(self.permits)?;
        validate_value(self.value)
    }
}

/// Checks a number of permits: 1..=[`MAX_PERMITS`].
///
/// # Errors
/// [`Error::InvalidConfig`] naming the bound.
pub fn validate_permits(permits: u32) -> Result<()> {
    if permits == 0 {
        return Err(Error::config(
            "a semaphore of 0 permits could never be acquired",
        ));
    }
    if permits > MAX_PERMITS {
        return Err(Error::config(format!(
            "{permits} permits is more than the maximum {MAX_PERMITS}"
        )));
    }
    Ok(())
}

/// Checks a holder's value: at most [`MAX_VALUE_BYTES`].
///
/// # Errors
/// [`Error::InvalidConfig`].
pub fn validate_value(value: &[u8]) -> Result<()> {
    if value.len() > MAX_VALUE_BYTES {
        return Err(Error::config(format!(
            "value of {} bytes is longer than the maximum {MAX_VALUE_BYTES}",
            value.len()
        )));
    }
    Ok(())
}

/// The server side of a granted slot beyond its lease: implemented by each backend next to its
/// [`LeaseOps`](crate::backend::LeaseOps) (often by the same type).
#[async_trait]
pub trait SlotOps: Send + Sync + fmt::Debug + 'static {
    /// Replaces the value of the slot, if this grant still holds it, and tells the observers.
    ///
    /// # Errors
    /// [`Error::NotHeld`] if the grant no longer holds its slot (nothing changed); transport
    /// errors otherwise.
    ///
    /// # Cancel safety
    /// Must be cancel safe: a dropped call either replaced the value or did not.
    async fn set_value(&self, value: &[u8]) -> Result<()>;
}

/// What a backend returns for a granted slot.
#[derive(Debug)]
#[non_exhaustive]
pub struct SlotGrant {
    /// The lease (built with [`Lease::new`]); its token is the slot's fencing token.
    pub lease: Lease,
    /// Which slot: `0..permits`.
    pub slot: u32,
    /// The handle to change the slot's value.
    pub ops: Arc<dyn SlotOps>,
}

impl SlotGrant {
    /// A grant of `slot` held by `lease`, whose value `ops` changes.
    pub fn new(lease: Lease, slot: u32, ops: Arc<dyn SlotOps>) -> Self {
        Self { lease, slot, ops }
    }
}

/// One holder of a slot, as a backend reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SlotHolder {
    /// Which slot: `0..permits`.
    pub slot: u32,
    /// The holder's fencing token (a leader's term).
    pub token: FencingToken,
    /// The holder's value.
    pub value: Vec<u8>,
    /// How long the holder's lease has left on the server unless renewed, if known (`None` in
    /// observer events).
    pub remaining: Option<Duration>,
}

impl SlotHolder {
    /// A holder of `slot` with `token` and `value`.
    pub fn new(
        slot: u32,
        token: FencingToken,
        value: Vec<u8>,
        remaining: Option<Duration>,
    ) -> Self {
        Self {
            slot,
            token,
            value,
            remaining,
        }
    }
}

/// The holders of a name's slots, from [`SlotBackend::slot_holders`] and
/// [`Semaphore::permit_holders`](crate::Semaphore::permit_holders).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SlotHolders {
    /// The number of slots in force (the name's N).
    pub permits: u32,
    /// The live holders, by slot.
    pub holders: Vec<SlotHolder>,
}

impl SlotHolders {
    /// `holders` of a name with `permits` slots.
    pub fn new(permits: u32, holders: Vec<SlotHolder>) -> Self {
        Self { permits, holders }
    }
}

/// One item of a backend's watch on a name's slots.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WatchEvent {
    /// The holders now (after one change, or the state when the watch started).
    Holders(Vec<SlotHolder>),
    /// Changes may have happened here that the watch did not deliver (it fell behind, its
    /// stream was re-established, history was compacted). The next `Holders` is a state at or
    /// after them.
    Missed,
}

/// A backend's watch on one name's slots.
#[async_trait]
pub trait SlotWatch: Send + fmt::Debug {
    /// The next event: the first call returns the holders when the watch was created, every
    /// later one the holders after the next change, in the order of the changes. A change is
    /// never skipped without a [`WatchEvent::Missed`] before the state that follows it.
    ///
    /// # Errors
    /// Transport errors the watch cannot recover from; the watch is then finished.
    ///
    /// # Cancel safety
    /// Must be cancel safe: a dropped call loses no event.
    async fn next(&mut self) -> Result<WatchEvent>;
}

/// What a backend promises for elections and semaphores.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SlotGuarantees {
    /// The lease promises, as for locks: kind, FIFO waiters (candidates and permit waiters),
    /// manual renewal, expiry slack, lock-delay, loss notice.
    pub lock: Guarantees,
    /// Observers are supported ([`SlotBackend::watch_slots`]); without them
    /// [`Election::observe`](crate::Election::observe) returns [`Error::NotSupported`].
    pub observe: bool,
    /// An observer that keeps reading sees every change; it gets
    /// [`Missed`](crate::LeaderEvent::Missed) only when it fell far behind or the backend's
    /// history was compacted. `false`: `Missed` may come after any reconnect or between two
    /// reads of a one-shot watch (it still marks every place where a change may be missing).
    pub every_change_observed: bool,
    /// The largest N the backend accepts (at most [`MAX_PERMITS`]).
    pub max_permits: u32,
    /// One line for humans: the fine print.
    pub notes: &'static str,
}

impl SlotGuarantees {
    /// Elections and semaphores with the lease promises `lock`, no observers, N up to
    /// [`MAX_PERMITS`].
    pub fn new(lock: Guarantees) -> Self {
        Self {
            lock,
            observe: false,
            every_change_observed: false,
            max_permits: MAX_PERMITS,
            notes: "",
        }
    }
}

/// The backend half of [`Election`](crate::Election) and [`Semaphore`](crate::Semaphore):
/// what an adapter implements to get both (instrumented, validated) from the core.
///
/// # Contract
/// - `grant_slot` grants one free slot of `req.name` as a lease whose token strictly increases
///   with every grant of that slot (for an election, of the name: the term); at most
///   `req.permits` slots are held at once; a request whose `permits` differs from the one in
///   force while the name has holders or waiters fails with [`Error::PermitsMismatch`] and
///   changes nothing. Waiting follows `opts.wait`; a released or expired slot is handed to the
///   first waiter only (FIFO where [`Guarantees::fifo_waiters`]), with one wake per change.
///   Dropping the future leaves nothing behind (a slot handed over meanwhile is handed on).
/// - The lease's token identity is `{backend prefix}elect/{name}` for an election and
///   `{backend prefix}sem/{name}/{slot}` for a semaphore (see [`SlotKind::as_str`]).
/// - Releasing or losing the lease frees the slot; [`SlotOps::set_value`] changes its value.
/// - `watch_slots` starts with the state now and delivers every change after it in order, or
///   [`WatchEvent::Missed`] where it may not have.
///
/// The contract suite (`lockkit_core::contract_election`, feature `contract`) tests all of this.
#[async_trait]
pub trait SlotBackend: Send + Sync + fmt::Debug {
    /// Grants a slot, as the contract says. The core has validated `req` and `opts`; the grant
    /// is handed to [`Lease::new`] with `opts`.
    ///
    /// # Errors
    /// As [`Lock::acquire`](crate::Lock::acquire), plus [`Error::PermitsMismatch`].
    ///
    /// # Cancel safety
    /// Must be cancel safe, as the contract says.
    async fn grant_slot(&self, req: SlotRequest<'_>, opts: AcquireOptions) -> Result<SlotGrant>;

    /// Reads the holders of `name`'s slots: `None` if the name has no holder and no N in force.
    ///
    /// # Errors
    /// [`Error::InvalidName`]; transport errors; [`Error::NotSupported`] if it cannot tell.
    ///
    /// # Cancel safety
    /// Must be cancel safe: it only reads.
    async fn slot_holders(&self, kind: SlotKind, name: &str) -> Result<Option<SlotHolders>>;

    /// Watches `name`'s slots. The default returns [`Error::NotSupported`].
    ///
    /// # Errors
    /// [`Error::InvalidName`]; transport errors; [`Error::NotSupported`].
    ///
    /// # Cancel safety
    /// Must be cancel safe: dropping it leaves no watch behind.
    async fn watch_slots(&self, kind: SlotKind, name: &str) -> Result<Box<dyn SlotWatch>> {
        validate_slot_name(kind, name)?;
        Err(Error::NotSupported {
            operation: "observing an election",
            backend: self.slot_guarantees().lock.backend,
        })
    }

    /// What this backend promises.
    fn slot_guarantees(&self) -> SlotGuarantees;
}

/// One grant around the backend's `grant_slot`, for every backend alike: validation before any
/// I/O, lock-delay refused where unsupported, the timeout cut and the minimum-validity give-back
/// of [`Lock::acquire`](crate::Lock::acquire).
pub(crate) async fn grant_checked<B: SlotBackend + ?Sized>(
    backend: &B,
    req: SlotRequest<'_>,
    mut opts: AcquireOptions,
) -> Result<SlotGrant> {
    req.validate()?;
    opts.validate()?;
    let g = backend.slot_guarantees();
    if req.permits > g.max_permits {
        return Err(Error::config(format!(
            "{} permits is more than the {} backend's maximum {}",
            req.permits, g.lock.backend, g.max_permits
        )));
    }
    if opts.effective_lock_delay().is_some() && !g.lock.lock_delay {
        return Err(Error::NotSupported {
            operation: "lock-delay",
            backend: g.lock.backend,
        });
    }
    opts.observed_backend = Some(g.lock.backend);
    opts.observed_kind = Some(req.kind);
    with_min_validity(
        req.name,
        &opts,
        |attempt| backend.grant_slot(req, attempt),
        |g| &g.lease,
        |g| g.lease,
    )
    .await
}

/// The `outcome` of a grant span.
pub(crate) fn outcome<T>(res: &Result<T>) -> &'static str {
    match res {
        Ok(_) => "granted",
        Err(Error::Held { .. }) => "held",
        Err(Error::Timeout { .. }) => "timeout",
        Err(Error::PermitsMismatch { .. }) => "permits_mismatch",
        Err(_) => "error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permits_and_values_are_bounded() {
        validate_permits(1).unwrap();
        validate_permits(MAX_PERMITS).unwrap();
        for bad in [0, MAX_PERMITS + 1, u32::MAX] {
            assert!(matches!(
                validate_permits(bad),
                Err(Error::InvalidConfig { .. })
            ));
        }
        validate_value(&[]).unwrap();
        validate_value(&[0; MAX_VALUE_BYTES]).unwrap();
        assert!(matches!(
            validate_value(&[0; MAX_VALUE_BYTES + 1]),
            Err(Error::InvalidConfig { .. })
        ));
    }
}
