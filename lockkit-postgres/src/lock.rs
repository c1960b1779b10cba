//! [`PgLock`]: acquiring advisory locks as leases, with tokens from lockkit's fence table.

use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use lockkit_core::backend::{
    LockBackend, TrackerHandle, retry_transient, validate_name, wait_deadline,
};
use lockkit_core::{
    AcquireOptions, Error, FencingToken, Guarantees, HolderInfo, Instant, Lease, LockKind, Result,
    Wait,
};

use crate::config::PgConfig;
use crate::core::{CancelOnDrop, Conn, GrantRow, Inner, Sql, duration_ms, key_of, ttl_ms};
use crate::error::{BACKEND, Msg, backend, cancelled, from_sqlx, sqlstate, unavailable};
use crate::lease::PgLease;
use crate::session::{Adopted, Grant, Sessions, TryGrant};

/// Extra time the client waits for the server's `lock_timeout` to fire before it gives up on
/// its own and closes the connection.
const CLIENT_WAIT_GRACE: Duration = Duration::from_secs(2);

/// How often a waiting acquire checks, on another connection, that its waiting session still
/// exists (see `Inner::watched`).
pub(crate) const WAIT_CHECK: Duration = Duration::from_secs(3);

/// [`Guarantees::loss_notice`]: the holder reads the server's close of its idle connection (after
/// `pg_terminate_backend`, a shutdown or restart, a crash of its backend) within milliseconds;
/// 100 ms leaves room for a loaded client. A connection that dies without a FIN or RST reaching
/// the client is caught by the [`SESSION_CHECK`](crate::SESSION_CHECK) safety net instead.
const LOSS_NOTICE: Duration = Duration::from_millis(100);

/// What `guarantees` says of a lock on PostgreSQL, in plain words (the 5 s is
/// [`SESSION_CHECK`](crate::SESSION_CHECK)).
const NOTES: &str = "one PostgreSQL 14+ server: a lease is a session advisory lock on a holder \
session (up to 1,000 kept-alive leases of one TTL each, renewed together once per TTL/3; a lease \
renewed by hand has its own) that idle_session_timeout (= TTL) ends unless renewed; tokens are \
committed (synchronous_commit=on) in {schema}.fence; a session ended by a server restart or \
pg_terminate_backend frees the lock at once, and the holder reads the server's close on its idle \
connection within milliseconds (a connection that dies silently: within 5 s + 2 × the connect \
timeout, by a check on another connection); another client may hold the lock meanwhile: fence \
writes; advisory locks are not replicated, so a failover to a standby may grant a held lock again";

/// The advisory lock key of lock `name` under `prefix`.
///
/// The key is the first 8 bytes of the SHA-256 digest of the UTF-8 bytes of `"{prefix}/{name}"`,
/// read as a big-endian `i64`: the same on every platform, process and lockkit version (changing
/// it would be a breaking change). It is used with the single-`bigint` forms of
/// PostgreSQL's advisory lock functions
/// (<https://www.postgresql.org/docs/current/functions-admin.html#FUNCTIONS-ADVISORY-LOCKS>), so
/// `pg_locks` shows it split into `classid` (high 32 bits) and `objid` (low 32 bits) with
/// `objsubid = 1`.
///
/// This is the key in lockkit's default schema ([`DEFAULT_SCHEMA`](crate::DEFAULT_SCHEMA)); see
/// [`lock_key_in`] for other schemas.
///
/// Two different names share a key with probability about 2⁻⁶⁴ per pair. lockkit detects it: the
/// fence row of a key stores the full name, and an acquire whose name differs from the stored one
/// fails with [`Error::Backend`] instead of sharing (or silently waiting for) the other lock.
///
/// ```
/// assert_eq!(
///     lockkit_postgres::lock_key("lockkit", "jobs"),
///     lockkit_postgres::lock_key("lockkit", "jobs"),
/// );
/// assert_ne!(
///     lockkit_postgres::lock_key("lockkit", "jobs"),
///     lockkit_postgres::lock_key("other", "jobs"),
/// );
/// ```
pub fn lock_key(prefix: &str, name: &str) -> i64 {
    key_of(&full_name(prefix, name))
}

/// The advisory lock key of lock `name` under `prefix` when lockkit's table lives in `schema`.
///
/// Advisory locks are database-wide while each schema has its own token counters, so two
/// schemas must never share a key: a lock taken through schema `a` would otherwise exclude the
/// same name in schema `b` while the tokens of the two counters interleave (and so could go
/// backwards for the lock). For the default schema this is [`lock_key`]; for any other schema
/// the key is derived from `"{schema}\0{prefix}/{name}"` (`\0` appears neither in a schema
/// nor in a prefix), so the same name in two schemas is two different locks.
///
/// ```
/// use lockkit_postgres::{lock_key, lock_key_in};
/// assert_eq!(lock_key_in("lockkit", "app", "jobs"), lock_key("app", "jobs"));
/// assert_ne!(lock_key_in("other", "app", "jobs"), lock_key("app", "jobs"));
/// ```
pub fn lock_key_in(schema: &str, prefix: &str, name: &str) -> i64 {
    let full = full_name(prefix, name);
    if schema == crate::DEFAULT_SCHEMA {
        key_of(&full)
    } else {
        key_of(&format!("{schema}\0{full}"))
    }
}

pub(crate) fn full_name(prefix: &str, name: &str) -> String {
    format!("{prefix}/{name}")
}

impl Inner {
    /// One acquire attempt: on a cached connection, or a fresh one if the cached one turns out
    /// dead. Every error path drops the connection it used (closing it frees anything it held),
    /// except the outcomes known to leave nothing held (`Held`, a key collision after its
    /// explicit unlock, a deadline that passed before the wait started), which keep it.
    ///
    /// A timed wait gets no more than its deadline to obtain a connection (else
    /// [`Error::Timeout`]) and its deadline plus a grace period in all; a try-once is bounded
    /// by the caller ([`PgLock::acquire`] gives it the connect timeout in all).
    ///
    /// `held`: a try on a shared holder session has just found the lock held (and no other
    /// name stored under its key), so the attempt goes straight to the wait, without trying
    /// again: `pg_advisory_lock` grants a lock freed meanwhile at once, and the grant statement
    /// after it still sits out a pending lock-delay and detects a collision.
    pub(crate) async fn attempt(&self, req: &Request<'_>, held: bool) -> Result<Granted> {
        let mut may_retry = true;
        loop {
            let timed = matches!(req.opts.wait, Wait::Timeout(_));
            let (mut c, reused) = match req.deadline.filter(|_| timed) {
                Some(d) => match tokio::time::timeout_at(d, self.checkout()).await {
                    Ok(r) => r?,
                    Err(_) => return Err(req.timeout()),
                },
                None => self.checkout().await?,
            };
            // A server that stops answering must not hang the acquire: a timed wait gets its
            // deadline plus a grace period, and every wait is watched (see `watched`). On
            // expiry the connection is dropped (closed), which ends the session and whatever
            // it held. A try-once is bounded by `acquire`.
            let pid = c.pid;
            let once = self.try_once(&mut c, req, held);
            let res = match (req.opts.wait, req.deadline) {
                (Wait::No, _) => once.await,
                (_, Some(d)) => {
                    let watched = self.watched(pid, once);
                    match tokio::time::timeout_at(d + CLIENT_WAIT_GRACE, watched).await {
                        Ok(r) => r.and_then(|r| r),
                        Err(_) => Ok(Outcome::Timeout { reusable: false }),
                    }
                }
                (_, None) => self.watched(pid, once).await.and_then(|r| r),
            };
            match res {
                Ok(Outcome::Granted { token, sent }) => {
                    return Ok(Granted {
                        conn: c,
                        token,
                        sent,
                    });
                }
                Ok(Outcome::Held) => {
                    self.put_idle(c);
                    return Err(Error::Held {
                        name: req.name.to_owned(),
                    });
                }
                Ok(Outcome::Timeout { reusable }) => {
                    if reusable {
                        self.put_idle(c);
                    }
                    return Err(req.timeout());
                }
                Ok(Outcome::Collision(e)) => {
                    self.put_idle(c);
                    return Err(e);
                }
                Ok(Outcome::Cancelled) => {
                    tracing::debug!(lock = %req.name, "the server cancelled the wait (pg_cancel_backend); waiting again on a new session");
                    drop(c); // ends the session, and a lock a racing grant left on it
                }
                Err(e) if reused && may_retry && e.is_retryable() => {
                    // Most likely the server restarted or killed idle sessions: the other
                    // cached connections are dead too.
                    tracing::debug!(error = %e, "cached connection failed; opening a new one");
                    may_retry = false;
                    drop(c);
                    self.idle().clear();
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Whether a session of this database holds the advisory lock `key`, and the token and
    /// name the fence table stores for it: `None` if not held. One statement on a cached or
    /// new connection, within the connect timeout. `pg_locks` shows a single-`bigint` key as
    /// `classid` (high 32 bits), `objid` (low 32 bits), `objsubid = 1`.
    async fn holder_of(&self, key: i64) -> Result<Option<(Option<i64>, Option<String>)>> {
        let t = self.config.connect_timeout;
        let read = async {
            let (mut c, _) = self.checkout().await?;
            if !self.table_exists(&mut c).await? {
                self.put_idle(c);
                return Ok(None); // never migrated: nothing was ever granted
            }
            c.last_sent = Instant::now();
            let row: (bool, Option<i64>, Option<String>) = sqlx::query_as(&self.sql.holder)
                .bind(key)
                .fetch_one(&mut c.conn)
                .await
                .map_err(from_sqlx)?;
            self.put_idle(c);
            Ok(row.0.then_some((row.1, row.2)))
        };
        tokio::time::timeout(t, read).await.unwrap_or_else(|_| {
            Err(unavailable(Msg(format!(
                "no answer from the server within the connect timeout ({t:?})"
            ))))
        })
    }

    async fn try_once(&self, c: &mut Conn, req: &Request<'_>, held: bool) -> Result<Outcome> {
        // The idle timeout must be in place before the lock can be granted: if the reply is
        // lost (or this future dropped and the close never reaches the server), the session
        // still ends after one TTL of idleness.
        // After a held try on a shared session the wait statement sets it.
        let ttl_ms = ttl_ms(req.opts.ttl);
        if c.idle_ms != ttl_ms && !held {
            c.last_sent = Instant::now();
            sqlx::query("SELECT set_config('idle_session_timeout', $1, false)")
                .bind(ttl_ms.to_string())
                .execute(&mut c.conn)
                .await
                .map_err(from_sqlx)?;
            c.idle_ms = ttl_ms;
        }
        if !held && let Some(outcome) = self.try_first(c, req).await? {
            return Ok(outcome);
        }
        self.wait(c, req).await
    }

    /// The grant statement, never waiting: the outcome, or `None` if the lock is held (no
    /// collision) and the acquire may wait.
    async fn try_first(&self, c: &mut Conn, req: &Request<'_>) -> Result<Option<Outcome>> {
        let sent = Instant::now();
        let (ok, token, wait_ms, other): GrantRow = sqlx::query_as(&self.sql.grant_try)
            .bind(req.key)
            .bind(req.full)
            .bind(req.delay_ms())
            .fetch_one(&mut c.conn)
            .await
            .map_err(from_sqlx)?;
        c.last_sent = sent;
        match (ok, token) {
            (true, Some(t)) => Ok(Some(Outcome::Granted { token: t, sent })),
            // A holder with a lock-delay ended without a release, and the delay is not over.
            (true, None) if wait_ms > 0 => {
                if req.opts.wait == Wait::No {
                    self.unlock(c, req).await?;
                    return Ok(Some(Outcome::Held));
                }
                self.sit_out_delay(c, req, wait_ms).await.map(Some)
            }
            (true, None) => self.collision(c, req, other).await.map(Some),
            // Held. A different name stored under this key is a hash collision: report it
            // rather than wait for an unrelated lock.
            (false, _) if other.is_some() => Ok(Some(Outcome::Collision(collision_error(
                req,
                other.as_deref(),
            )))),
            (false, _) if req.opts.wait == Wait::No => Ok(Some(Outcome::Held)),
            (false, _) => Ok(None),
        }
    }

    /// Waits in the server's own lock queue, bounded by lock_timeout, then runs the grant
    /// statement on the session that holds the lock.
    async fn wait(&self, c: &mut Conn, req: &Request<'_>) -> Result<Outcome> {
        let remaining = req
            .deadline
            .map(|d| d.saturating_duration_since(Instant::now()));
        if remaining.is_some_and(|r| r.is_zero()) {
            return Ok(Outcome::Timeout { reusable: true });
        }
        let lock_timeout_ms = remaining.map(duration_ms).unwrap_or(0);
        let ttl_ms = ttl_ms(req.opts.ttl);
        // The wait is a statement that touches no table, so a waiting session holds no table
        // lock (one would queue DDL on the fence table, and every acquire behind that DDL).
        // Like any statement it runs with a snapshot, so a long wait holds back VACUUM's
        // horizon (`backend_xmin` of the waiting backend in `pg_stat_activity`; the README
        // says so). The token is bumped afterwards, while the lock is held. The same statement first sets the session's idle timeout (in place
        // before the lock can be granted, see `try_once`) and `lock_timeout` (read when the
        // wait starts); the materialized CTE runs before the lock is asked for.
        c.last_sent = Instant::now();
        let wait = sqlx::query(
            "WITH s AS MATERIALIZED (SELECT set_config('idle_session_timeout', $2, false), \
                                            set_config('lock_timeout', $3, false)) \
             SELECT pg_advisory_lock($1) FROM s",
        )
        .bind(req.key)
        .bind(ttl_ms.to_string())
        .bind(lock_timeout_ms.to_string())
        .execute(&mut c.conn);
        match wait.await {
            Ok(_) => c.idle_ms = ttl_ms,
            // lock_not_available: lock_timeout ran out. Usually in the queue, but the timeout
            // can also fire just as the lock is granted: its SIGINT then cancels the rest of
            // the statement, and the session-level lock stays held (an error does not release
            // session locks). So the connection is never reused after this: dropping it ends
            // the session and frees whatever it holds. (Found by
            // `timeout_racing_grant_leaks_nothing`.)
            Err(e) if sqlstate(&e).as_deref() == Some("55P03") => {
                return Ok(Outcome::Timeout { reusable: false });
            }
            // query_canceled: an admin's `pg_cancel_backend` of the waiting statement (a routine
            // action against long queries), not a reason to give up a wait.
            Err(e) if cancelled(&e) => return Ok(Outcome::Cancelled),
            Err(e) => return Err(from_sqlx(e)),
        }
        // Granted. The bump restarts the session's idle timer (which the server started when
        // it sent the grant), so its send time is a safe start for the client-side deadline.
        // If this future is dropped or the bump fails, the caller drops the connection, which
        // ends the session and frees the lock.
        let sent = Instant::now();
        let (token, wait_ms, other) = self
            .grant_held(c, req)
            .await
            .map_err(|e| unavailable(Msg(format!("session lost right after the grant: {e}"))))?;
        c.last_sent = sent;
        match token {
            Some(token) => Ok(Outcome::Granted { token, sent }),
            None if wait_ms > 0 => self.sit_out_delay(c, req, wait_ms).await,
            None => self.collision(c, req, other).await,
        }
    }

    /// The grant statement on a session that holds the advisory lock:
    /// `(token, wait_ms, other)` (see [`GrantRow`]).
    async fn grant_held(
        &self,
        c: &mut Conn,
        req: &Request<'_>,
    ) -> std::result::Result<(Option<i64>, i64, Option<String>), sqlx::Error> {
        let lock_timeout = crate::core::holder_lock_timeout_ms(ttl_ms(req.opts.ttl));
        let (_, token, wait_ms, other): GrantRow = sqlx::query_as(&self.sql.grant_held)
            .bind(req.key)
            .bind(req.full)
            .bind(req.delay_ms())
            .bind(lock_timeout.to_string())
            .fetch_one(&mut c.conn)
            .await?;
        Ok((token, wait_ms, other))
    }

    /// Holds the advisory lock (so the queue behind it stays in order) while the lock-delay of
    /// a holder that ended without a release runs out: sleeps the `wait_ms` the server computed
    /// (from the `free_since` it recorded, on its own clock), then runs the grant again. No
    /// polling: one sleep, and another only if the server still counts time left. The
    /// session's idle timeout is lengthened for the sleep and set back to the TTL before the
    /// grant. A deadline that comes first ends the wait with `Timeout`; the caller then drops
    /// the connection, which gives the lock back, and `free_since` stays for the next acquirer.
    async fn sit_out_delay(
        &self,
        c: &mut Conn,
        req: &Request<'_>,
        mut wait_ms: i64,
    ) -> Result<Outcome> {
        let ttl_ms = ttl_ms(req.opts.ttl);
        loop {
            let left = Duration::from_millis(u64::try_from(wait_ms).unwrap_or(0));
            if let Some(d) = req.deadline
                && Instant::now() + left > d
            {
                tokio::time::sleep_until(d).await;
                return Ok(Outcome::Timeout { reusable: false });
            }
            tracing::debug!(lock = %req.name, wait = ?left,
                "the last holder ended without a release: waiting out its lock-delay");
            self.set_idle_timeout(c, ttl_ms.saturating_add(duration_ms(left)))
                .await?;
            tokio::time::sleep(left).await;
            self.set_idle_timeout(c, ttl_ms).await?;
            let sent = Instant::now();
            let (token, left_ms, other) = self.grant_held(c, req).await.map_err(from_sqlx)?;
            c.last_sent = sent;
            match token {
                Some(token) => return Ok(Outcome::Granted { token, sent }),
                None if left_ms > 0 => wait_ms = left_ms,
                None => return self.collision(c, req, other).await,
            }
        }
    }

    async fn set_idle_timeout(&self, c: &mut Conn, ms: u64) -> Result<()> {
        c.last_sent = Instant::now();
        sqlx::query("SELECT set_config('idle_session_timeout', $1, false)")
            .bind(ms.to_string())
            .execute(&mut c.conn)
            .await
            .map_err(from_sqlx)?;
        c.idle_ms = ms;
        Ok(())
    }

    /// Gives back the advisory lock this session took (a try-once that found a lock-delay
    /// pending).
    async fn unlock(&self, c: &mut Conn, req: &Request<'_>) -> Result<()> {
        c.last_sent = Instant::now();
        let unlocked: bool = sqlx::query_scalar("SELECT pg_advisory_unlock($1)")
            .bind(req.key)
            .fetch_one(&mut c.conn)
            .await
            .map_err(from_sqlx)?;
        if !unlocked {
            return Err(backend(Msg(
                "advisory unlock during a lock-delay failed".into()
            )));
        }
        Ok(())
    }

    /// Runs `wait` (a statement waiting in the server's lock queue on session `pid`), checking
    /// every [`WAIT_CHECK`] on another connection that the session still exists. A connection
    /// that died without a FIN or RST (network partition, crashed host) would otherwise leave
    /// the client waiting for a reply forever: the server ends such a session through its TCP
    /// keepalive / `tcp_user_timeout` (about 16 s), and a cut-off client cannot open the check
    /// connection. Either way the wait ends with [`Error::Unavailable`] (the caller drops the
    /// connection).
    ///
    /// Dropped (or given up) before `wait` ends, it cancels the statement on the server
    /// ([`CancelOnDrop`]), so that the session leaves the lock queue at once.
    pub(crate) async fn watched<T>(&self, pid: i32, wait: impl Future<Output = T>) -> Result<T> {
        tokio::pin!(wait);
        let cancel = CancelOnDrop::new(self, pid);
        loop {
            tokio::select! {
                biased;
                r = &mut wait => {
                    cancel.disarm();
                    return Ok(r);
                }
                () = tokio::time::sleep(WAIT_CHECK) => {
                    if !self.session_alive(pid).await {
                        return Err(unavailable(Msg(
                            "the waiting session is gone or the server stopped answering".into(),
                        )));
                    }
                }
            }
        }
    }

    /// Gives back the advisory lock that the grant statement took but could not keep: the
    /// name `stored` under the key is another one.
    async fn collision(
        &self,
        c: &mut Conn,
        req: &Request<'_>,
        stored: Option<String>,
    ) -> Result<Outcome> {
        let unlocked: bool = sqlx::query_scalar("SELECT pg_advisory_unlock($1)")
            .bind(req.key)
            .fetch_one(&mut c.conn)
            .await
            .map_err(from_sqlx)?;
        if !unlocked {
            return Err(backend(Msg(
                "advisory unlock after a key collision failed".into()
            )));
        }
        Ok(Outcome::Collision(collision_error(req, stored.as_deref())))
    }
}

fn collision_error(req: &Request<'_>, stored: Option<&str>) -> Error {
    backend(Msg(format!(
        "advisory lock key collision: {:?} and {:?} both map to key {}; rename one of them",
        req.full,
        stored.unwrap_or("?"),
        req.key
    )))
}

pub(crate) struct Request<'a> {
    pub(crate) name: &'a str,
    pub(crate) full: &'a str,
    pub(crate) key: i64,
    pub(crate) opts: &'a AcquireOptions,
    pub(crate) start: Instant,
    pub(crate) deadline: Option<Instant>,
}

enum Outcome {
    Granted {
        token: i64,
        sent: Instant,
    },
    Held,
    Timeout {
        reusable: bool,
    },
    /// The wait statement was cancelled by the server (`pg_cancel_backend`, sqlstate 57014):
    /// wait again on a new session (this one may hold the lock if the cancel raced the grant).
    Cancelled,
    Collision(Error),
}

impl Request<'_> {
    /// The acquire's own lock-delay in ms, 0 for none (at most `MAX_LOCK_DELAY`, so it fits).
    pub(crate) fn delay_ms(&self) -> i64 {
        self.opts
            .effective_lock_delay()
            .map_or(0, |d| i64::try_from(duration_ms(d)).unwrap_or(i64::MAX))
    }

    pub(crate) fn timeout(&self) -> Error {
        Error::Timeout {
            name: self.name.to_owned(),
            waited: self.start.elapsed(),
        }
    }
}

pub(crate) struct Granted {
    pub(crate) conn: Conn,
    pub(crate) token: i64,
    pub(crate) sent: Instant,
}

/// Distributed locks on one PostgreSQL server (14 or newer): each lease is a session-level
/// advisory lock held by a holder session shared with up to [`SESSION_LEASES`](crate::SESSION_LEASES)
/// leases of the same TTL, ended by the server after one TTL without renewal, with a fencing
/// token from lockkit's table `{schema}.fence`.
///
/// See the [crate docs](crate) for the mechanism and its guarantees. Cheap to clone: clones share
/// the configuration and the cache of idle connections.
#[derive(Clone)]
pub struct PgLock {
    pub(crate) inner: Arc<Inner>,
    pub(crate) sessions: Arc<Sessions>,
}

impl fmt::Debug for PgLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgLock")
            .field("config", &self.inner.config)
            .field("idle_connections", &self.inner.idle().len())
            .field("holder_sessions", &self.sessions.count())
            .finish()
    }
}

impl PgLock {
    /// Connects from a `postgres://` URL (see [`PgConfig::from_url`] for the parameters), checks
    /// the server, and creates lockkit's table if it is missing (unless `auto_migrate=false`).
    ///
    /// ```no_run
    /// # async fn f() -> lockkit_core::Result<()> {
    /// let locks = lockkit_postgres::PgLock::connect("postgres://app@127.0.0.1:5432/app?prefix=billing").await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// - [`Error::InvalidConfig`]: malformed URL or parameter; a connection pooler was detected;
    ///   a TLS file (`tls_ca`, `tls_cert`, `tls_key`) missing or not PEM; the server has no TLS
    ///   while `sslmode` demands it.
    /// - [`Error::Unavailable`]: the server cannot be reached within the connect timeout.
    /// - [`Error::Auth`]: the server refused the credentials (a `hostnossl … reject` line
    ///   refusing a plain connection included); or TLS refused a certificate (the server's:
    ///   unknown CA, expired, not for the host; or the server refused ours, or its absence).
    /// - [`Error::NotSupported`]: the server is older than PostgreSQL 14.
    /// - [`Error::Backend`]: anything else the server reported (e.g. no right to create the table).
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future closes the connection it was opening.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_with(PgConfig::from_url(url)?).await
    }

    /// The old name of [`connect_with`](Self::connect_with).
    ///
    /// # Errors
    /// As [`connect`](Self::connect).
    ///
    /// # Cancel safety
    /// As [`connect`](Self::connect).
    pub async fn with_config(config: PgConfig) -> Result<Self> {
        Self::connect_with(config).await
    }

    /// Connects with `config`; see [`connect`](Self::connect).
    ///
    /// # Errors
    /// As [`connect`](Self::connect).
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future closes the connection it was opening.
    pub async fn connect_with(config: PgConfig) -> Result<Self> {
        config.validate()?;
        config.check_tls_files()?;
        let inner = Arc::new(Inner {
            sql: Arc::new(Sql::new(&config.schema)),
            config,
            idle: Mutex::new(Vec::new()),
        });
        let mut c = inner.open().await?;
        if inner.config.auto_migrate && !inner.all_tables_exist(&mut c).await? {
            inner.migrate_on(&mut c).await?;
        }
        inner.put_idle(c);
        Ok(Self {
            inner,
            sessions: Arc::new(Sessions::default()),
        })
    }

    /// Creates lockkit's schema and table if they do not exist (idempotent, safe to run from
    /// several processes at once: it serializes on an advisory transaction lock):
    ///
    /// ```sql
    /// CREATE SCHEMA IF NOT EXISTS lockkit;
    /// CREATE TABLE IF NOT EXISTS lockkit.fence (
    ///     key   bigint PRIMARY KEY,        -- lock_key(prefix, name)
    ///     name  text   NOT NULL,           -- "{prefix}/{name}", to detect key collisions
    ///     token bigint NOT NULL CHECK (token > 0)  -- the last fencing token granted
    /// );
    /// CREATE TABLE IF NOT EXISTS lockkit.delay (  -- lock-delays (AcquireOptions::lock_delay)
    ///     key        bigint PRIMARY KEY,   -- lock_key(prefix, name)
    ///     name       text   NOT NULL,      -- "{prefix}/{name}"
    ///     delay_ms   bigint NOT NULL CHECK (delay_ms > 0),  -- the holder's lock-delay
    ///     free_since timestamptz           -- when an acquirer first found the lock free
    /// );
    /// -- elections and semaphores: a semaphore's N, and each slot holder's value
    /// CREATE TABLE IF NOT EXISTS lockkit.slot_names (key bigint PRIMARY KEY, name text NOT NULL,
    ///     permits integer NOT NULL CHECK (permits > 0));
    /// CREATE TABLE IF NOT EXISTS lockkit.slot_holders (key bigint PRIMARY KEY, name text NOT NULL,
    ///     slot integer NOT NULL, token bigint NOT NULL, pid integer NOT NULL,
    ///     ttl_ms bigint NOT NULL, version bigint NOT NULL DEFAULT 0, value bytea NOT NULL);
    /// ```
    ///
    /// [`connect`](Self::connect) runs it when a table is missing (so a schema made by an older
    /// lockkit gets the delay table on the first connect), unless `auto_migrate=false`: then
    /// run it after upgrading, as every grant reads the delay table.
    ///
    /// # Errors
    /// [`Error::Backend`] if the role may not create the schema or table; connection errors as
    /// in [`connect`](Self::connect).
    ///
    /// # Cancel safety
    /// Cancel safe: the DDL runs in one transaction; a dropped future closes the connection,
    /// which rolls it back if it had not committed.
    pub async fn migrate(&self) -> Result<()> {
        let (mut c, _) = self.inner.checkout().await?;
        self.inner.migrate_on(&mut c).await?;
        self.inner.put_idle(c);
        Ok(())
    }

    /// The configuration.
    pub fn config(&self) -> &PgConfig {
        &self.inner.config
    }

    /// The advisory lock key of `name` in this lock's namespace ([`lock_key_in`] with the
    /// schema and prefix).
    pub fn key(&self, name: &str) -> i64 {
        let c = &self.inner.config;
        lock_key_in(&c.schema, &c.prefix, name)
    }

    /// The identity of lock `name` in its tokens ([`FencingToken::lock`]):
    /// `postgres/{schema}/{prefix}/{name}`.
    pub fn lock_id(&self, name: &str) -> String {
        let c = &self.inner.config;
        format!("postgres/{}/{}/{name}", c.schema, c.prefix)
    }
}

impl PgLock {
    /// One acquire attempt. A lease kept alive by lockkit first tries once on a shared holder
    /// session (one statement); a waiting acquire that finds the lock held, and a lease renewed
    /// by hand, take the lock on a connection of their own ([`Inner::attempt`]), which then
    /// becomes a holder session.
    async fn attempt(&self, req: &Request<'_>, auto: bool) -> Result<Grant> {
        if auto {
            let ttl = req.opts.ttl;
            let shared =
                self.sessions
                    .try_shared(&self.inner, req.key, req.full, req.delay_ms(), ttl);
            let tried = match req.deadline.filter(|_| req.opts.wait != Wait::No) {
                Some(d) => tokio::time::timeout_at(d, shared)
                    .await
                    .map_err(|_| req.timeout())?,
                None => shared.await,
            };
            match tried? {
                TryGrant::Granted(g) => return Ok(g),
                TryGrant::Collision(stored) => {
                    return Err(collision_error(req, stored.as_deref()));
                }
                TryGrant::Held if req.opts.wait == Wait::No => {
                    return Err(Error::Held {
                        name: req.name.to_owned(),
                    });
                }
                // Wait in the server's lock queue, on a session of its own.
                TryGrant::Held => {}
            }
        }
        let g = self.inner.attempt(req, auto).await?;
        let tracker = TrackerHandle::new(g.sent, req.opts.ttl);
        let adopted = Adopted {
            key: req.key,
            token: g.token,
            tracker,
            lock_delay: req.delay_ms() > 0,
            auto,
        };
        Ok(self.sessions.adopt(&self.inner, g.conn, adopted))
    }
}

#[async_trait]
impl LockBackend for PgLock {
    /// Acquires `name` (see [`Lock::acquire`](lockkit_core::Lock::acquire)).
    ///
    /// A try-acquire is one statement on a shared holder session of its TTL (see the crate
    /// docs): `pg_try_advisory_lock` and, if granted, the bump of the name's token in
    /// `{schema}.fence`. A waiting acquire then waits in the server's lock queue
    /// (`SELECT pg_advisory_lock(key)` with `lock_timeout` set to the time left), which is
    /// FIFO, and bumps the token after the grant. The wait is checked every 3 s on another
    /// connection (a cut-off connection ends it with [`Error::Unavailable`]). Opening a
    /// connection counts against the wait: a timed acquire returns [`Error::Timeout`] at its
    /// deadline; a try-once gets the connect timeout in all, retries included.
    ///
    /// If the last holder had a lock-delay and ended without a release, the grant waits until
    /// that delay has passed since the lock was first seen free (holding the advisory lock; a
    /// try-once returns [`Error::Held`] instead): see the crate docs' Lock-delay section.
    ///
    /// # Errors
    /// As [`Lock::acquire`](lockkit_core::Lock::acquire); [`Error::Backend`] also reports an advisory lock key collision
    /// between two names (see [`lock_key`]).
    ///
    /// # Cancel safety
    /// Cancel safe. A try on a shared holder session runs on the caller's task, holding the
    /// session's connection lock: if the future is dropped, a lock granted meanwhile is
    /// unlocked by the session before its next statement (the session is not closed, its
    /// other leases stay). A wait runs on a connection owned by the attempt. Dropping the
    /// future cancels the waiting statement on another connection (`pg_cancel_backend`, in a
    /// spawned task, within the connect timeout), which takes it out of the lock queue at once,
    /// and closes the connection: the server ends the session, and with it any lock it was
    /// granted just before the cancel. If the cancel or the close cannot reach the server, the
    /// session's `idle_session_timeout` (the TTL, set before the lock is requested) ends it.
    /// (Without a Tokio runtime to spawn the cancel on, the process is ending: the server ends
    /// the session when its socket closes.)
    async fn grant(&self, name: &str, opts: AcquireOptions) -> Result<Lease> {
        validate_name(name)?;
        opts.validate()?;
        let full = full_name(&self.inner.config.prefix, name);
        let start = Instant::now();
        let req = Request {
            name,
            full: &full,
            key: lock_key_in(&self.inner.config.schema, &self.inner.config.prefix, name),
            opts: &opts,
            start,
            deadline: wait_deadline(opts.wait, start),
        };
        let auto = opts.keepalive;
        let attempts = retry_transient(&opts, req.deadline, || self.attempt(&req, auto));
        let granted = if opts.wait == Wait::No {
            // A try-once gets the connect timeout in all, retries included; a dropped attempt
            // gives back whatever it was granted.
            let t = self.inner.config.connect_timeout;
            tokio::time::timeout(t, attempts).await.map_err(|_| {
                unavailable(Msg(format!(
                    "no answer from the server within the connect timeout ({t:?})"
                )))
            })??
        } else {
            attempts.await?
        };
        let token = u64::try_from(granted.token)
            .map_err(|_| backend(Msg("negative fencing token in the fence table".into())))?;
        let tracker = granted.tracker.clone();
        let ops = Arc::new(PgLease::new(name, granted, auto));
        Ok(Lease::new(
            name,
            FencingToken::new(self.lock_id(name), token),
            tracker,
            ops,
            &opts,
        ))
    }

    /// Looks the name's advisory lock up in `pg_locks` and its token in the fence table. The
    /// remaining time is unknown: the lease's deadline lives in the holder's process (the
    /// server holds the lock as long as the holder's session lives).
    ///
    /// # Errors
    /// As [`Lock::holder`](lockkit_core::Lock::holder); [`Error::Unavailable`] if no answer came within the connect
    /// timeout.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads (a dropped read closes its connection).
    async fn holder(&self, name: &str) -> Result<Option<HolderInfo>> {
        validate_name(name)?;
        let c = &self.inner.config;
        let full = full_name(&c.prefix, name);
        Ok(match self.inner.holder_of(self.key(name)).await? {
            // Another name stored under the key is a hash collision: not this lock's holder.
            Some((_, Some(stored))) if stored != full => None,
            Some((token, _)) => Some(HolderInfo::new(
                token
                    .and_then(|t| u64::try_from(t).ok())
                    .map(|t| FencingToken::new(self.lock_id(name), t)),
                None,
            )),
            None => None,
        })
    }

    fn guarantees(&self) -> Guarantees {
        let mut g = Guarantees::new(BACKEND, LockKind::Correctness);
        g.tokens_survive_restart = true;
        g.safe_across_failover = false;
        g.fifo_waiters = true;
        g.manual_renewal = true;
        g.expiry_slack = Duration::from_millis(100);
        g.loss_notice = Some(LOSS_NOTICE);
        g.lock_delay = true;
        g.notes = NOTES;
        g
    }
}

#[cfg(test)]
mod tests {
    use sha2::{Digest, Sha256};

    use super::*;

    /// The notes users read (`lockkit guarantees`) give the durations in plain words: they must
    /// follow the constants.
    #[test]
    fn notes_name_the_durations_in_force() {
        assert_eq!(crate::core::SESSION_CHECK, Duration::from_secs(5));
        assert!(NOTES.contains("within 5 s + 2 × the connect timeout"));
    }

    #[test]
    fn key_is_stable() {
        // Pinned: changing the derivation would make old and new lockkit versions disagree.
        let d = Sha256::digest(b"lockkit/jobs");
        let expect = i64::from_be_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]]);
        assert_eq!(lock_key("lockkit", "jobs"), expect);
        assert_eq!(lock_key("lockkit", "jobs"), -488_728_649_642_272_023);
    }

    #[test]
    fn ms_rounds_up() {
        assert_eq!(duration_ms(Duration::from_micros(1)), 1);
        assert_eq!(duration_ms(Duration::from_micros(1500)), 2);
        assert_eq!(duration_ms(Duration::from_secs(1)), 1000);
    }
}
