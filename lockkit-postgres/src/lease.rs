//! [`PgLease`]: renewal and release of one advisory lock held on a holder session.

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use lockkit_core::backend::{LeaseOps, TrackerHandle};
use lockkit_core::{Error, LeaseState, LossReason, Result};

use crate::core::ttl_ms;
use crate::error::{Msg, unavailable};
use crate::session::{Grant, Holder};

/// The server side of one PostgreSQL lease: the advisory lock `key` held by a *holder
/// session* of its [`PgLock`](crate::PgLock).
///
/// - A lease kept alive by lockkit (the default) shares its session with up to
///   [`SESSION_LEASES`](crate::SESSION_LEASES) leases of the same TTL. The session renews
///   itself (one statement per TTL/3 for all of them), so the lease is
///   [`self_renewing`](LeaseOps::self_renewing) and core schedules no renewal of its own.
/// - A lease renewed by hand (`keepalive(false)`) has a session of its own, whose
///   `idle_session_timeout` only its renewals restart.
/// - **Renew** runs one statement on the session (restarting its idle timer) and checks the
///   backend pid is unchanged.
/// - **Release** runs `pg_advisory_unlock(key)` on the session (a lease granted with a
///   lock-delay first deletes its row in `{schema}.delay`, in the same statement).
/// - **Loss.** When the server ends the session (`pg_terminate_backend`, shutdown or restart,
///   crash of the backend, idle timeout), every lease on it is marked lost
///   ([`LossReason::SessionExpired`]) as soon as the client reads the close, within
///   milliseconds; a connection that died silently is found by the `PgLock`'s check every
///   [`SESSION_CHECK`](crate::SESSION_CHECK).
/// - Statements run on the caller's task, under the session's connection lock; a call dropped
///   mid-statement leaves what it may have done to the session to undo (see `session.rs`).
///
/// Reach it from a [`Lease`](lockkit_core::Lease) with
/// `lease.ops().as_any().downcast_ref::<PgLease>()`.
pub struct PgLease {
    name: String,
    key: i64,
    holder: Arc<Holder>,
    tracker: TrackerHandle,
    /// Renewed by its session (keepalive on).
    auto: bool,
    /// Released (or given up): the drop has nothing left to do.
    done: AtomicBool,
}

impl fmt::Debug for PgLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgLease")
            .field("name", &self.name)
            .field("key", &self.key)
            .field("backend_pid", &self.holder.pid)
            .finish()
    }
}

impl PgLease {
    /// Takes over `grant`; `auto`: its session renews it.
    pub(crate) fn new(name: &str, grant: Grant, auto: bool) -> Self {
        let (holder, key, tracker) = grant.take();
        Self {
            name: name.to_owned(),
            key,
            holder,
            tracker,
            auto,
            done: AtomicBool::new(false),
        }
    }

    /// The advisory lock key (see [`lock_key`](crate::lock_key)).
    pub fn key(&self) -> i64 {
        self.key
    }

    /// `pg_backend_pid()` of the session that holds the lock: the `pid` column of `pg_locks` and
    /// `pg_stat_activity`. Leases of one [`PgLock`](crate::PgLock) with the same TTL share it.
    pub fn backend_pid(&self) -> i32 {
        self.holder.pid
    }

    /// How many leases the session that holds this one holds (this one included, if held).
    pub fn session_leases(&self) -> usize {
        self.holder.leases()
    }

    fn not_held(&self) -> Error {
        Error::NotHeld {
            name: self.name.clone(),
        }
    }

    /// Runs `call` on the session, answered before the lease's deadline. With `queued`, the
    /// answer may come later: the session keeps renewing the lease while the call waits its
    /// turn behind the others of the session, and each statement of the session is bounded by
    /// the connect timeout and by the session's own deadline (a session that does not answer
    /// is closed, which ends every call waiting for it).
    async fn ask<T>(
        &self,
        queued: bool,
        call: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        if queued && self.tracker.state() != LeaseState::Lost {
            return call.await;
        }
        match tokio::time::timeout_at(self.tracker.valid_until(), call).await {
            Ok(r) => r,
            Err(_) => Err(unavailable(Msg(
                "no answer from the holder session before the lease's deadline".into(),
            ))),
        }
    }

    /// Gives the lock back as lapsed (its lock-delay row stays), without waiting.
    fn lapse(&self) {
        self.done.store(true, Ordering::Release);
        self.holder.give_back(self.key, true);
    }
}

#[async_trait]
impl LeaseOps for PgLease {
    /// Restarts the session's idle timer (one statement); see [`PgLease`].
    ///
    /// # Errors
    /// [`Error::NotHeld`] if the session is gone (killed by its idle timeout or an
    /// administrator, server restart, broken connection), is not the one that was granted
    /// the lock, or the lease is already lost on the client side.
    ///
    /// # Cancel safety
    /// Cancel safe. On a session of its own (`keepalive(false)`), a renewal dropped while its
    /// statement is in flight closes the connection: a statement the server has yet to read
    /// then cannot keep the session alive past its TTL (the server ends the session when it
    /// reads the close, which frees the lock). On a shared session the statement completes.
    async fn renew(&self, ttl: Duration) -> Result<()> {
        if self.tracker.state() == LeaseState::Lost {
            return Err(self.not_held());
        }
        let ttl_ms = ttl_ms(ttl);
        match self.ask(self.auto, self.holder.renew(ttl_ms)).await {
            Ok(()) if self.tracker.state() != LeaseState::Lost => Ok(()),
            Err(e) => {
                tracing::debug!(lock = %self.name, error = %e, "renew failed: session gone");
                Err(self.not_held())
            }
            Ok(()) => Err(self.not_held()),
        }
    }

    /// Asks `pg_locks`, on the lease's session, whether that session holds the advisory lock.
    /// Like any statement it restarts the session's `idle_session_timeout`.
    ///
    /// # Errors
    /// [`Error::NotHeld`] if the session is gone or does not hold the lock (or the lease is
    /// lost on the client side); [`Error::Unavailable`] if no answer came before the lease's
    /// deadline.
    async fn check(&self) -> Result<()> {
        if self.tracker.state() == LeaseState::Lost {
            return Err(self.not_held());
        }
        match self.ask(false, self.holder.check(self.key)).await {
            Ok(true) => Ok(()),
            Err(e @ Error::Unavailable { .. }) if !self.holder.gone() => Err(e),
            _ => Err(self.not_held()),
        }
    }

    /// Unlocks with `pg_advisory_unlock(key)` on the session; see [`PgLease`].
    ///
    /// # Errors
    /// [`Error::NotHeld`] if the session is gone or did not hold the lock, if the lease is
    /// already lost on the client side other than by being dropped (then it is given back as
    /// lapsed, without waiting, so a lock-delay applies), or if the session did not answer
    /// before the lease's deadline.
    ///
    /// If a renewal by hand was dropped mid-flight just before, its session is already
    /// closed, which frees the lock when the server reads the close: release then returns
    /// `Ok(())` without a request.
    ///
    /// # Cancel safety
    /// Cancel safe: a release dropped before its unlock was answered is left to the session,
    /// which runs the unlock before its next statement (its keeper is woken at the drop), so
    /// a dropped release still happens.
    async fn release(&self) -> Result<()> {
        // A lease dropped with release-on-drop is Lost (Dropped) on the client side only: its
        // release is still a release (no lock-delay), and unlocking is safe, since only this
        // session can hold the lock.
        if self.tracker.state() == LeaseState::Lost
            && self.tracker.view().loss_reason() != Some(LossReason::Dropped)
        {
            self.lapse();
            return Err(self.not_held());
        }
        self.done.store(true, Ordering::Release);
        match self.ask(true, self.holder.release(self.key)).await {
            Ok(true) => Ok(()),
            // The session is gone: after a dropped renewal by hand that closed it, the lock
            // is freed by that close.
            Err(_)
                if self.holder.renew_dropped.load(Ordering::Acquire)
                    && self.tracker.state() != LeaseState::Lost =>
            {
                Ok(())
            }
            _ => Err(self.not_held()),
        }
    }

    /// Gives the lock back as a lapse would (its lock-delay row stays).
    ///
    /// # Errors
    /// [`Error::NotHeld`] always: the lease was already lost on the client side.
    ///
    /// # Cancel safety
    /// Cancel safe: it does not wait.
    async fn relinquish(&self) -> Result<()> {
        self.lapse();
        Err(self.not_held())
    }

    fn self_renewing(&self) -> bool {
        self.auto
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for PgLease {
    /// A lease dropped without release (after [`Lease::leak`](lockkit_core::Lease::leak), or with
    /// release-on-drop off) is no longer renewed and keeps the lock until its deadline (at
    /// most its TTL), when its session unlocks it as lapsed.
    fn drop(&mut self) {
        if !self.done.load(Ordering::Acquire) {
            self.holder.abandon(self.key);
        }
    }
}
