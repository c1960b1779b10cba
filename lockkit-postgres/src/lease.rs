//! [`PgLease`]: renewal and release of one advisory lock on its dedicated connection.

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use lockkit_core::backend::{LeaseOps, TrackerHandle};
use lockkit_core::{Error, Instant, LeaseState, LossReason, Result};
use tokio::sync::{MutexGuard, Notify};

use crate::core::{Conn, Inner, ttl_ms};

/// The server side of one PostgreSQL lease: the dedicated connection whose session holds the
/// advisory lock.
///
/// - **Renew** runs one statement on that connection, which restarts the session's
///   `idle_session_timeout` (= TTL) and checks the session is the one that was granted the lock
///   (same `pg_backend_pid()`).
/// - **Release** runs `pg_advisory_unlock(key)` (a lease granted with a lock-delay first
///   deletes its row in `{schema}.delay`, in the same statement); the connection, now holding
///   nothing, is kept for later acquires.
/// - **Close watch.** Between statements, a task of the lease reads its idle connection
///   (sqlx's `PgListener::try_recv`, with nothing listened to): when the server ends the session
///   (`pg_terminate_backend`, server shutdown or restart, crash of the backend, idle timeout) it
///   sends a FATAL error and closes the connection, and the lease is marked lost
///   ([`LossReason::SessionExpired`]) as soon as the client reads that, within milliseconds.
///   Renewals and the release take the connection from the task for their statement and give
///   it back. No statement is sent for this, so it adds no load.
/// - **Safety net.** A connection that dies without a FIN or RST reaching the client cannot
///   be read as closed: for that, the [`PgLock`](crate::PgLock)'s watch task asks the server
///   every [`SESSION_CHECK`](crate::SESSION_CHECK) (5 s, one query on another connection for
///   all the leases of that `PgLock`) whether the session still exists.
/// - Any error on the connection means the session is gone or unusable: the connection is
///   closed (the server frees the lock when the session ends, at the latest one TTL after the
///   last renewal) and the call returns [`Error::NotHeld`]. The lock is never taken again.
///
/// Reach it from a [`Lease`](lockkit_core::Lease) with
/// `lease.ops().as_any().downcast_ref::<PgLease>()`.
pub struct PgLease {
    inner: Arc<Inner>,
    name: String,
    key: i64,
    pid: i32,
    ttl: Duration,
    tracker: TrackerHandle,
    session: Arc<Session>,
    /// Set when a renewal was dropped while its statement was in flight (which closed the
    /// connection).
    renew_dropped: AtomicBool,
    /// Id in the `PgLock`'s session watch.
    watch: u64,
    /// Whether the grant recorded a lock-delay row, which the release deletes.
    lock_delay: bool,
}

/// The lease's connection, shared between the lease's calls and its close watch
/// ([`watch_close`]).
struct Session {
    /// `None` once the connection was closed or handed back to the idle cache.
    conn: tokio::sync::Mutex<Option<Conn>>,
    /// How many calls want or hold the connection: the close watch takes it only while none
    /// does.
    want: AtomicUsize,
    /// Wakes the close watch: a call wants the connection, a call is done, or the lease was
    /// dropped.
    turn: Notify,
    /// Set when the [`PgLease`] is dropped.
    dropped: AtomicBool,
}

/// A call's claim on the connection (see [`Session::want`]); given up when dropped.
struct Want<'a>(&'a Session);

impl Drop for Want<'_> {
    fn drop(&mut self) {
        self.0.want.fetch_sub(1, Ordering::AcqRel);
        self.0.turn.notify_waiters();
    }
}

impl Session {
    /// The connection, taken from the close watch, which lets go as soon as it is told and
    /// does not take it again until the returned claim is dropped.
    async fn lock(&self) -> (Want<'_>, MutexGuard<'_, Option<Conn>>) {
        self.want.fetch_add(1, Ordering::AcqRel);
        let want = Want(self);
        self.turn.notify_waiters();
        (want, self.conn.lock().await)
    }
}

/// The close watch of one lease (see [`PgLease`]): while the connection is idle in the lease,
/// reads it until the server closes it, then marks the lease lost and drops the connection.
/// Ends when the connection is gone (released, closed by a failed call). After the lease was
/// dropped without release, keeps the session (so the lock) until the server's idle timeout
/// ends it, and at most one TTL and a second after the last statement.
async fn watch_close(session: Arc<Session>, tracker: TrackerHandle, name: String) {
    loop {
        // Registered before `want` is read: a call that starts later wakes it.
        let wake = session.turn.notified();
        tokio::pin!(wake);
        wake.as_mut().enable();
        if session.want.load(Ordering::Acquire) > 0 {
            wake.await;
            continue;
        }
        let mut guard = session.conn.lock().await;
        if session.want.load(Ordering::Acquire) > 0 {
            continue;
        }
        let Some(c) = guard.as_mut() else {
            return;
        };
        if session.dropped.load(Ordering::Acquire) {
            let until = c.last_sent + tracker.ttl() + Duration::from_secs(1);
            let _ = tokio::time::timeout_at(until, c.closed()).await;
            *guard = None;
            return;
        }
        let pid = c.pid;
        let closed = tokio::select! {
            biased;
            () = &mut wake => false,
            () = c.closed() => true,
        };
        if closed {
            // The tracker reports the loss, naming the lock.
            tracing::debug!(lock = %name, backend_pid = pid,
                "the server closed the lease's connection: session ended; lease lost");
            tracker.mark_lost(LossReason::SessionExpired);
            *guard = None;
            return;
        }
    }
}

/// Sets `flag` when dropped while armed.
struct DropFlag<'a> {
    flag: &'a AtomicBool,
    armed: bool,
}

impl DropFlag<'_> {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for DropFlag<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.flag.store(true, Ordering::Release);
        }
    }
}

impl fmt::Debug for PgLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgLease")
            .field("name", &self.name)
            .field("key", &self.key)
            .field("backend_pid", &self.pid)
            .finish()
    }
}

impl PgLease {
    pub(crate) fn new(
        inner: Arc<Inner>,
        name: &str,
        key: i64,
        tracker: TrackerHandle,
        conn: Conn,
        lock_delay: bool,
    ) -> Self {
        let watch = inner.watch(conn.pid, tracker.clone());
        let pid = conn.pid;
        let session = Arc::new(Session {
            conn: tokio::sync::Mutex::new(Some(conn)),
            want: AtomicUsize::new(0),
            turn: Notify::new(),
            dropped: AtomicBool::new(false),
        });
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(watch_close(
                session.clone(),
                tracker.clone(),
                name.to_owned(),
            ));
        }
        Self {
            inner,
            name: name.to_owned(),
            key,
            pid,
            ttl: tracker.ttl(),
            tracker,
            session,
            renew_dropped: AtomicBool::new(false),
            watch,
            lock_delay,
        }
    }

    fn stop_watch(&self) {
        self.inner.unwatch(self.watch);
    }

    /// The advisory lock key (see [`lock_key`](crate::lock_key)).
    pub fn key(&self) -> i64 {
        self.key
    }

    /// `pg_backend_pid()` of the session that holds the lock: the `pid` column of `pg_locks` and
    /// `pg_stat_activity`.
    pub fn backend_pid(&self) -> i32 {
        self.pid
    }

    fn not_held(&self) -> Error {
        Error::NotHeld {
            name: self.name.clone(),
        }
    }
}

#[async_trait]
impl LeaseOps for PgLease {
    /// Restarts the session's idle timer (one statement); see [`PgLease`].
    ///
    /// # Errors
    /// [`Error::NotHeld`] if the session is gone (killed by its idle timeout or an
    /// administrator, server restart, broken connection), is not the one that was granted
    /// the lock, or the lease was already lost on the client side when the renewal was
    /// acknowledged (the connection is then closed, which frees the lock).
    ///
    /// # Cancel safety
    /// Cancel safe: the connection is owned by the renewal while it runs, and a dropped renewal
    /// closes it. A renewal statement still in flight then cannot keep the session alive past
    /// its TTL: the server ends the session when it reads the close, which frees the lock.
    async fn renew(&self, ttl: Duration) -> Result<()> {
        let (_want, mut guard) = self.session.lock().await;
        // Owned by this future from here on: dropping the future closes the connection.
        let Some(mut c) = guard.take() else {
            return Err(self.not_held());
        };
        if self.tracker.state() == LeaseState::Lost {
            return Err(self.not_held());
        }
        let ms = ttl_ms(ttl);
        let sent = Instant::now();
        // Records a renewal dropped mid-flight (its connection is closed with it), for release.
        let in_flight = DropFlag {
            flag: &self.renew_dropped,
            armed: true,
        };
        // A renewal that outlives the lease is useless: give up at the deadline and close.
        let res = tokio::time::timeout_at(
            self.tracker.valid_until(),
            sqlx::query_scalar::<_, i32>(
                "SELECT pg_backend_pid() FROM (SELECT set_config('idle_session_timeout', $1, false)) s",
            )
            .bind(ms.to_string())
            .fetch_one(&mut c.conn),
        )
        .await
        .unwrap_or_else(|_| Err(sqlx::Error::Io(std::io::ErrorKind::TimedOut.into())));
        in_flight.disarm();
        match res {
            Ok(_) if self.tracker.state() == LeaseState::Lost => {
                // Acknowledged after the holder was told the lease is lost: closing the
                // connection gives the lock back.
                Err(self.not_held())
            }
            Ok(pid) if pid == self.pid => {
                c.last_sent = sent;
                c.idle_ms = ms;
                *guard = Some(c);
                Ok(())
            }
            Ok(pid) => {
                tracing::warn!(lock = %self.name, expected = self.pid, got = pid,
                    "renew reached another server session (connection pooler?); lease lost");
                Err(self.not_held())
            }
            Err(e) => {
                tracing::debug!(lock = %self.name, error = %e, "renew failed: session gone");
                Err(self.not_held())
            }
        }
    }

    /// Asks `pg_locks`, on the lease's own session, whether that session holds the advisory
    /// lock. Like any statement it restarts the session's `idle_session_timeout`: the server
    /// then frees a silent holder's lock later, never earlier, than the client's deadline.
    ///
    /// # Errors
    /// [`Error::NotHeld`] if the session is gone or does not hold the lock (or the lease is
    /// lost on the client side); [`Error::Unavailable`] if no answer came before the lease's
    /// deadline.
    async fn check(&self) -> Result<()> {
        let (_want, mut guard) = self.session.lock().await;
        let Some(c) = guard.as_mut() else {
            return Err(self.not_held());
        };
        if self.tracker.state() == LeaseState::Lost {
            return Err(self.not_held());
        }
        let (hi, lo) = (
            (self.key as u64 >> 32) as i64,
            (self.key as u64 & 0xffff_ffff) as i64,
        );
        let sent = Instant::now();
        let res = tokio::time::timeout_at(
            self.tracker.valid_until(),
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted \
                 AND pid = pg_backend_pid() AND classid = $1::bigint::oid \
                 AND objid = $2::bigint::oid AND objsubid = 1)",
            )
            .bind(hi)
            .bind(lo)
            .fetch_one(&mut c.conn),
        )
        .await;
        match res {
            Ok(Ok(true)) => {
                c.last_sent = sent;
                Ok(())
            }
            Ok(Ok(false)) => Err(self.not_held()),
            Ok(Err(e)) => {
                tracing::debug!(lock = %self.name, error = %e, "check failed: session gone");
                Err(self.not_held())
            }
            Err(_) => Err(crate::error::unavailable(crate::error::Msg(
                "no answer to the lease check before the lease's deadline".into(),
            ))),
        }
    }

    /// Unlocks with `pg_advisory_unlock(key)`; see [`PgLease`].
    ///
    /// # Errors
    /// [`Error::NotHeld`] if the session is gone or did not hold the lock, if the lease is
    /// already lost on the client side other than by being dropped (the connection is closed at
    /// once, without a request, and a lock-delay applies),
    /// or if the server did not answer before the lease's deadline (the connection is closed,
    /// so the server frees the lock when it sees the close or after the TTL).
    ///
    /// If a renewal was dropped mid-flight just before (the core stops keepalive before it
    /// releases), its connection is already closed, which frees the lock when the server reads
    /// the close: release then returns `Ok(())` without a request.
    ///
    /// # Cancel safety
    /// Cancel safe: if the future is dropped, the connection is closed, which ends the session
    /// and frees the lock.
    async fn release(&self) -> Result<()> {
        self.stop_watch();
        let (_want, mut guard) = self.session.lock().await;
        let Some(mut c) = guard.take() else {
            // A keepalive renewal in flight when the lease was released (the core stops
            // keepalive first) was dropped and closed the connection: the server ends the
            // session when it reads the close, which frees the lock.
            if self.renew_dropped.load(Ordering::Acquire)
                && self.tracker.state() != LeaseState::Lost
            {
                return Ok(());
            }
            return Err(self.not_held());
        };
        drop(guard);
        // A lease dropped with release-on-drop is Lost (Dropped) on the client side only: its
        // release is still a release (no lock-delay), and unlocking is safe, since only this
        // session can hold the lock.
        if self.tracker.state() == LeaseState::Lost
            && self.tracker.view().loss_reason() != Some(LossReason::Dropped)
        {
            // Closing the connection (dropping `c`) ends the session, if it still exists.
            return Err(self.not_held());
        }
        let sent = Instant::now();
        // With a lock-delay, the delay row goes in the same statement, before the unlock.
        let sql = if self.lock_delay {
            self.inner.sql.release_delay.as_str()
        } else {
            "SELECT pg_advisory_unlock($1)"
        };
        let unlock = sqlx::query_scalar::<_, bool>(sql)
            .bind(self.key)
            .fetch_one(&mut c.conn);
        let Ok(res) = tokio::time::timeout_at(self.tracker.valid_until(), unlock).await else {
            // No answer before the deadline: close the connection (the server frees the lock
            // when it sees the close, or when the session's idle timeout fires).
            tracing::debug!(lock = %self.name, "no answer to the unlock before the deadline");
            return Err(self.not_held());
        };
        match res {
            Ok(true) => {
                c.last_sent = sent;
                self.inner.put_idle(c);
                Ok(())
            }
            Ok(false) => Err(self.not_held()),
            Err(e) => {
                tracing::debug!(lock = %self.name, error = %e, "release failed: session gone");
                Err(self.not_held())
            }
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for PgLease {
    /// A lease dropped without release (after [`Lease::leak`](lockkit_core::Lease::leak), or with
    /// release-on-drop off) keeps its session open until the server's idle timeout ends it, so
    /// the lock stays held for the TTL as documented, not longer.
    fn drop(&mut self) {
        self.stop_watch();
        self.session.dropped.store(true, Ordering::Release);
        // The close watch, if it holds the connection, takes care of it from here.
        self.session.turn.notify_waiters();
        let Ok(mut guard) = self.session.conn.try_lock() else {
            return;
        };
        let Some(c) = guard.take() else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                let until = c.last_sent + self.ttl + Duration::from_secs(1);
                rt.spawn(async move {
                    tokio::time::sleep_until(until).await;
                    drop(c);
                });
            }
            // sqlx closes a dropped connection in a task it spawns, which needs a runtime:
            // outside one, the connection is leaked (the server ends the session after one
            // TTL of idleness, or when the process exits).
            Err(_) => std::mem::forget(c),
        }
    }
}
