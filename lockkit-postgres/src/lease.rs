//! [`PgLease`]: renewal and release of one advisory lock on its dedicated connection.

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use lockkit_core::{Error, Instant, LeaseOps, Result};

use crate::lock::{Conn, Inner, ttl_ms};

/// The server side of one PostgreSQL lease: the dedicated connection whose session holds the
/// advisory lock.
///
/// - **Renew** runs one statement on that connection, which restarts the session's
///   `idle_session_timeout` (= TTL) and checks the session is the one that was granted the lock
///   (same `pg_backend_pid()`).
/// - **Release** runs `pg_advisory_unlock(key)`; the connection, now holding nothing, is kept for
///   later acquires.
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
    conn: tokio::sync::Mutex<Option<Conn>>,
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
    pub(crate) fn new(inner: Arc<Inner>, name: &str, key: i64, ttl: Duration, conn: Conn) -> Self {
        Self {
            inner,
            name: name.to_owned(),
            key,
            pid: conn.pid,
            ttl,
            conn: tokio::sync::Mutex::new(Some(conn)),
        }
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
    /// administrator, server restart, broken connection) or is not the one that was granted
    /// the lock.
    ///
    /// # Cancel safety
    /// Cancel safe: the statement either reached the server (and restarted the timer) or not;
    /// the connection finishes the pending exchange before its next statement.
    async fn renew(&self, ttl: Duration) -> Result<()> {
        let mut guard = self.conn.lock().await;
        let Some(c) = guard.as_mut() else {
            return Err(self.not_held());
        };
        let ms = ttl_ms(ttl);
        let sent = Instant::now();
        // A renewal that takes a whole TTL is useless: the server ends an idle session then,
        // and the client-side deadline has passed. Give up and close the connection.
        let res = tokio::time::timeout(
            ttl,
            sqlx::query_scalar::<_, i32>(
                "SELECT pg_backend_pid() FROM (SELECT set_config('idle_session_timeout', $1, false)) s",
            )
            .bind(ms.to_string())
            .fetch_one(&mut c.conn),
        )
        .await
        .unwrap_or_else(|_| Err(sqlx::Error::Io(std::io::ErrorKind::TimedOut.into())));
        match res {
            Ok(pid) if pid == self.pid => {
                c.last_sent = sent;
                c.idle_ms = ms;
                Ok(())
            }
            Ok(pid) => {
                tracing::warn!(lock = %self.name, expected = self.pid, got = pid,
                    "renew reached another server session (connection pooler?); lease lost");
                *guard = None;
                Err(self.not_held())
            }
            Err(e) => {
                tracing::debug!(lock = %self.name, error = %e, "renew failed: session gone");
                *guard = None;
                Err(self.not_held())
            }
        }
    }

    /// Unlocks with `pg_advisory_unlock(key)`; see [`PgLease`].
    ///
    /// # Errors
    /// [`Error::NotHeld`] if the session is gone or did not hold the lock;
    /// [`Error::Unavailable`] if the server did not answer within the TTL (the connection is
    /// closed, so the server frees the lock when it sees the close or after the TTL).
    ///
    /// # Cancel safety
    /// Cancel safe: if the future is dropped, the connection is closed, which ends the session
    /// and frees the lock.
    async fn release(&self) -> Result<()> {
        let mut guard = self.conn.lock().await;
        let Some(mut c) = guard.take() else {
            return Err(self.not_held());
        };
        drop(guard);
        let sent = Instant::now();
        let unlock = sqlx::query_scalar::<_, bool>("SELECT pg_advisory_unlock($1)")
            .bind(self.key)
            .fetch_one(&mut c.conn);
        let Ok(res) = tokio::time::timeout(self.ttl, unlock).await else {
            // No answer within a TTL: close the connection (the server frees the lock when it
            // sees the close, or when the session's idle timeout fires).
            return Err(crate::error::unavailable(crate::error::Msg(
                "the server did not answer the unlock within the TTL".into(),
            )));
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
        let Some(c) = self.conn.get_mut().take() else {
            return;
        };
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let until = c.last_sent + self.ttl + Duration::from_secs(1);
            rt.spawn(async move {
                tokio::time::sleep_until(until).await;
                drop(c);
            });
        }
    }
}
