//! What [`PgLock`](crate::PgLock) and [`PgLease`](crate::PgLease) share: the dedicated
//! connections (opening, the idle cache), lockkit's SQL texts, the session watch, and unit
//! conversions.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use lockkit_core::{Error, Instant, Result};
use sha2::{Digest, Sha256};
use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgListener, PgPoolOptions};

use crate::config::PgConfig;
use crate::error::{BACKEND, Msg, from_sqlx, unavailable};

/// How often a backend that is busy (waiting in a lock queue) checks that its client is still
/// connected: `client_connection_check_interval`, in milliseconds.
const CLIENT_CHECK_MS: &str = "250";

/// How often the safety net of held leases checks, on another connection, that their sessions
/// still exist.
///
/// A lease hears at once (within milliseconds) that its session ended when the server closes
/// the connection (`pg_terminate_backend`, restart, crash of the backend, idle timeout): its
/// connection is read while idle (see [`PgLease`](crate::PgLease)). This slow check covers the
/// one case that reading cannot see: a connection that died without a FIN or RST reaching the
/// client (a middlebox dropped its state, a cut cable), whose session the server ends through
/// its TCP keepalive (about 16 s) while new connections still work. Without it the holder would
/// hear of that only at its deadline. One query per [`PgLock`](crate::PgLock) with held leases
/// every 5 s.
pub const SESSION_CHECK: Duration = Duration::from_secs(5);

pub(crate) fn key_of(full: &str) -> i64 {
    let digest = Sha256::digest(full.as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first)
}

/// The key `migrate()` serializes on; `\0` cannot appear in a prefix, so no lock name maps here.
fn migrate_key() -> i64 {
    key_of("\0lockkit-migrate")
}

/// A connection dedicated to one lease at a time, with what we know of its session state.
///
/// The connection is sqlx's [`PgListener`] on a pool of its own that is closed once the
/// connection is open (it never opens another one, so a dead session is never silently
/// replaced): it runs statements like a plain connection, and [`Conn::closed`] waits, reading
/// the idle connection, until the server closes it.
pub(crate) struct Conn {
    pub(crate) conn: PgListener,
    /// The session's `idle_session_timeout`, in ms (0 = off).
    pub(crate) idle_ms: u64,
    /// Send time of the last statement: the server's idle timer started after it.
    pub(crate) last_sent: Instant,
    /// `pg_backend_pid()` of the session.
    pub(crate) pid: i32,
}

/// SQL texts with lockkit's schema filled in.
pub(crate) struct Sql {
    /// Try-acquire: `pg_try_advisory_lock` and, if granted and no lock-delay is pending, the
    /// token bump and the delay row, in one statement (see [`grant_sql`]).
    pub(crate) grant_try: String,
    /// The same for a session that already holds the advisory lock (after a wait).
    pub(crate) grant_held: String,
    /// Release of a lease with a lock-delay: deletes its delay row, then unlocks, in one
    /// statement.
    pub(crate) release_delay: String,
    /// Whether key `$1` is held (`pg_locks`), with its fence token and stored name.
    pub(crate) holder: String,
    pub(crate) table_exists: String,
    /// Whether all of lockkit's tables exist: the lock's (fence, delay) and the slots'
    /// (elections, semaphores).
    pub(crate) all_tables_exist: String,
    pub(crate) migrate: String,
}

/// A row of the grant statement (see [`grant_sql`]): `(locked, token, wait_ms, other)`.
pub(crate) type GrantRow = (bool, Option<i64>, i64, Option<String>);

/// The grant statement: `$1` key, `$2` full name, `$3` the acquire's own lock-delay in ms (0 =
/// none); `lock` is the SQL that takes (or has taken) the advisory lock. Returns
/// `(locked, token, wait_ms, other)` ([`GrantRow`]): `other` is the name stored under the key
/// when it is not `$2` and no token was granted (a hash collision), so that a try that finds
/// the lock held needs no second statement to tell a collision from a holder.
///
/// Only the session holding the advisory lock touches the key's rows, so the statement runs in
/// lock order. With the lock it reads the key's delay row (`FOR UPDATE`: a release deleting
/// it is waited for, so the row a releasing holder deletes is never seen):
/// - no row, or the delay has passed since `free_since`: granted. The token is bumped (no row
///   if another name is stored under the key: a hash collision), and the row is deleted, or
///   replaced by this acquire's own delay (`free_since` NULL: the lock is held).
/// - a row whose delay has not passed (a holder with a lock-delay ended without a release):
///   not granted; `free_since` is set to now if it was NULL (the first acquirer that finds the
///   lock free starts the delay, on the server's clock) and `wait_ms` is what is left of it.
///   The caller keeps or gives back the advisory lock.
///
/// The autocommit statement commits the token and the rows when it returns, never a
/// transaction that might roll back. Every CTE is materialized or data-modifying, so each runs
/// exactly once.
fn grant_sql(q: &str, lock: &str) -> String {
    format!(
        "WITH l AS MATERIALIZED (SELECT {lock} AS ok), \
         r AS MATERIALIZED (SELECT d.delay_ms, d.free_since FROM {q}.delay d, l \
                            WHERE l.ok AND d.key = $1 FOR UPDATE OF d), \
         w AS MATERIALIZED (SELECT coalesce((SELECT CASE WHEN r.free_since IS NULL \
                              THEN r.delay_ms \
                              ELSE ceil(r.delay_ms \
                                - extract(epoch FROM now() - r.free_since) * 1000)::bigint \
                              END FROM r), 0) AS wait_ms), \
         g AS MATERIALIZED (SELECT l.ok AND w.wait_ms <= 0 AS ok FROM l, w), \
         s AS (UPDATE {q}.delay d SET free_since = now() FROM l, w \
               WHERE l.ok AND w.wait_ms > 0 AND d.key = $1 AND d.free_since IS NULL), \
         x AS (DELETE FROM {q}.delay d USING g WHERE g.ok AND $3::bigint = 0 AND d.key = $1), \
         i AS (INSERT INTO {q}.delay AS d (key, name, delay_ms) \
               SELECT $1, $2, $3::bigint FROM g WHERE g.ok AND $3::bigint > 0 \
                 AND NOT EXISTS (SELECT 1 FROM {q}.fence f WHERE f.key = $1 AND f.name <> $2) \
               ON CONFLICT (key) DO UPDATE \
                 SET name = excluded.name, delay_ms = excluded.delay_ms, free_since = NULL), \
         b AS (INSERT INTO {q}.fence AS f (key, name, token) SELECT $1, $2, 1 FROM g WHERE g.ok \
               ON CONFLICT (key) DO UPDATE SET token = f.token + 1 \
               WHERE f.name = excluded.name \
               RETURNING f.token) \
         SELECT l.ok, (SELECT token FROM b), w.wait_ms, \
                (SELECT f.name FROM {q}.fence f WHERE f.key = $1 AND f.name <> $2 \
                   AND NOT EXISTS (SELECT 1 FROM b)) \
         FROM l, w"
    )
}

/// The settings every connection of lockkit starts its server session with (a holder session
/// then sets `idle_session_timeout` to its TTL).
///
/// Not part of the API: lockbench runs its by-hand statements on a connection with these
/// settings too (`benches/lockbench/postgres.rs`), to tell their server cost from lockkit's
/// client-side work.
#[doc(hidden)]
pub const SESSION_SETTINGS: [(&str, &str); 10] = [
    ("statement_timeout", "0"),
    ("lock_timeout", "0"),
    ("idle_in_transaction_session_timeout", "0"),
    ("idle_session_timeout", "0"),
    ("synchronous_commit", "on"),
    ("client_connection_check_interval", CLIENT_CHECK_MS),
    ("tcp_keepalives_idle", "10"),
    ("tcp_keepalives_interval", "2"),
    ("tcp_keepalives_count", "3"),
    ("tcp_user_timeout", "10000"),
];

/// The try-once grant statement lockkit sends for lockkit's tables in `schema` (`grant_sql`
/// with `pg_try_advisory_lock($1)`): `$1` key, `$2` full name, `$3` lock-delay in ms (0 = none).
///
/// Not part of the API: lockbench runs this text by hand (`benches/lockbench/postgres.rs`) to
/// compare lockkit's acquire with its own statement, so the two cannot drift apart.
#[doc(hidden)]
pub fn grant_try_sql(schema: &str) -> String {
    grant_sql(&quote_ident(schema), "pg_try_advisory_lock($1)")
}

impl Sql {
    pub(crate) fn new(schema: &str) -> Self {
        // validate_schema allows only [a-z_][a-z0-9_]*, so quoting changes nothing but lets
        // reserved words (`select`, `user`) through.
        let q = quote_ident(schema);
        Self {
            // A try-acquire never waits, so it holds its snapshot and its row locks only for
            // an instant.
            grant_try: grant_try_sql(schema),
            // `$4`: the session's `lock_timeout` from now on (a holder session's, see
            // `holder_lock_timeout_ms`; the wait ran with the time left to wait).
            grant_held: grant_sql(&q, "set_config('lock_timeout', $4, false) IS NOT NULL"),
            // `count(*)` makes the DELETE run to completion before the unlock: the next
            // holder's grant then waits for this statement to commit (its `FOR UPDATE`) and
            // finds no row. Only a session that holds the lock deletes the row, and only
            // a row with `free_since` NULL: while a session holds the lock, such a row was
            // written by that session's grant (a grant that finds another holder's row sets
            // `free_since`), so this is also the unlock of a grant dropped mid-statement.
            release_delay: format!(
                "WITH x AS (DELETE FROM {q}.delay d WHERE d.key = $1 AND d.free_since IS NULL \
                   AND EXISTS ( \
                   SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted \
                     AND pid = pg_backend_pid() AND classid = (($1 >> 32) & 4294967295)::oid \
                     AND objid = ($1 & 4294967295)::oid AND objsubid = 1) RETURNING 1) \
                 SELECT pg_advisory_unlock($1) FROM (SELECT count(*) FROM x) n"
            ),
            holder: format!(
                "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted \
                   AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                   AND classid = (($1 >> 32) & 4294967295)::oid \
                   AND objid = ($1 & 4294967295)::oid AND objsubid = 1), \
                 (SELECT token FROM {q}.fence WHERE key = $1), \
                 (SELECT name FROM {q}.fence WHERE key = $1)"
            ),
            table_exists: format!(
                "SELECT to_regclass('{s}.fence') IS NOT NULL AND to_regclass('{s}.delay') IS NOT NULL",
                s = q.replace('\'', "''")
            ),
            all_tables_exist: format!(
                "SELECT to_regclass('{s}.fence') IS NOT NULL \
                 AND to_regclass('{s}.delay') IS NOT NULL \
                 AND to_regclass('{s}.slot_names') IS NOT NULL \
                 AND to_regclass('{s}.slot_holders') IS NOT NULL",
                s = q.replace('\'', "''")
            ),
            migrate: format!(
                "BEGIN; \
                 SELECT pg_advisory_xact_lock({mk}); \
                 CREATE SCHEMA IF NOT EXISTS {q}; \
                 CREATE TABLE IF NOT EXISTS {q}.fence ( \
                   key bigint PRIMARY KEY, \
                   name text NOT NULL, \
                   token bigint NOT NULL CHECK (token > 0)); \
                 COMMENT ON TABLE {q}.fence IS \
                   'lockkit: last fencing token granted per advisory lock key (name = prefix/name)'; \
                 CREATE TABLE IF NOT EXISTS {q}.delay ( \
                   key bigint PRIMARY KEY, \
                   name text NOT NULL, \
                   delay_ms bigint NOT NULL CHECK (delay_ms > 0), \
                   free_since timestamptz); \
                 COMMENT ON TABLE {q}.delay IS \
                   'lockkit: lock-delay of the holder of an advisory lock key; free_since: when an acquirer first found the lock free without a release'; \
                 CREATE TABLE IF NOT EXISTS {q}.slot_names ( \
                   key bigint PRIMARY KEY, \
                   name text NOT NULL, \
                   permits integer NOT NULL CHECK (permits > 0)); \
                 COMMENT ON TABLE {q}.slot_names IS \
                   'lockkit: the number of permits of a semaphore (name = prefix/sem/name)'; \
                 CREATE TABLE IF NOT EXISTS {q}.slot_holders ( \
                   key bigint PRIMARY KEY, \
                   name text NOT NULL, \
                   slot integer NOT NULL, \
                   token bigint NOT NULL, \
                   pid integer NOT NULL, \
                   ttl_ms bigint NOT NULL, \
                   version bigint NOT NULL DEFAULT 0, \
                   value bytea NOT NULL); \
                 COMMENT ON TABLE {q}.slot_holders IS \
                   'lockkit: the value, token and session of an election or semaphore slot holder'; \
                 COMMIT;",
                mk = migrate_key(),
            ),
        }
    }
}

/// `ident` as a quoted SQL identifier (`"…"`, inner quotes doubled).
pub(crate) fn quote_ident(ident: &str) -> String {
    format!("\"{}\"", ident.replace('"', "\"\""))
}

pub(crate) struct Inner {
    pub(crate) config: PgConfig,
    pub(crate) sql: Arc<Sql>,
    pub(crate) idle: Mutex<Vec<Conn>>,
}

impl Inner {
    pub(crate) fn idle(&self) -> MutexGuard<'_, Vec<Conn>> {
        // The list is consistent after every statement; recover from a poisoned lock.
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An idle connection that is not about to be ended by its idle timeout.
    fn take_idle(&self) -> Option<Conn> {
        let mut idle = self.idle();
        while let Some(c) = idle.pop() {
            let life = Duration::from_millis(c.idle_ms);
            if c.idle_ms == 0 || c.last_sent.elapsed() < life / 2 {
                return Some(c);
            }
        }
        None
    }

    /// Keeps a connection that holds no lock for a later acquire.
    pub(crate) fn put_idle(&self, c: Conn) {
        let mut idle = self.idle();
        if idle.len() < self.config.max_idle {
            idle.push(c);
        }
    }

    /// Opens a new dedicated connection and checks it talks to a PostgreSQL session of its own,
    /// all within the connect timeout.
    pub(crate) async fn open(&self) -> Result<Conn> {
        let t = self.config.connect_timeout;
        tokio::time::timeout(t, self.open_untimed())
            .await
            .map_err(|_| unavailable(Msg(format!("connecting timed out after {t:?}"))))?
    }

    async fn open_untimed(&self) -> Result<Conn> {
        let probe = format!("{:016x}", rand::random::<u64>());
        let mut opts = self
            .config
            .connect
            .clone()
            .options(SESSION_SETTINGS)
            .options([("lockkit.session", probe.as_str())]);
        if opts.get_application_name().is_none() {
            opts = opts.application_name("lockkit");
        }
        let mut conn = connect_listener(opts).await?;
        let db = sqlx::Acquire::acquire(&mut conn).await.map_err(from_sqlx)?;
        if let Some(v) = db.server_version_num()
            && v < 140_000
        {
            return Err(Error::NotSupported {
                operation: "PostgreSQL older than 14 (idle_session_timeout is needed)",
                backend: BACKEND,
            });
        }
        let sent = Instant::now();
        let (seen, pid): (Option<String>, i32) =
            sqlx::query_as("SELECT current_setting('lockkit.session', true), pg_backend_pid()")
                .fetch_one(&mut conn)
                .await
                .map_err(from_sqlx)?;
        if seen.as_deref() != Some(probe.as_str()) {
            return Err(pooler_detected());
        }
        Ok(Conn {
            conn,
            idle_ms: 0,
            last_sent: sent,
            pid,
        })
    }

    pub(crate) async fn checkout(&self) -> Result<(Conn, bool)> {
        match self.take_idle() {
            Some(c) => Ok((c, true)),
            None => Ok((self.open().await?, false)),
        }
    }

    /// A connection for a new shared holder session: its `idle_session_timeout` set to
    /// `ttl_ms` (a cached connection that turns out dead is replaced by a new one, once).
    pub(crate) async fn holder_conn(&self, ttl_ms: u64) -> Result<Conn> {
        let (mut c, reused) = self.checkout().await?;
        match self.set_idle(&mut c, ttl_ms).await {
            Ok(()) => Ok(c),
            Err(_) if reused => {
                drop(c);
                self.idle().clear();
                let mut c = self.open().await?;
                self.set_idle(&mut c, ttl_ms).await?;
                Ok(c)
            }
            Err(e) => Err(e),
        }
    }

    /// Sets the session's `idle_session_timeout` to `ms`, and its `lock_timeout` to
    /// [`holder_lock_timeout_ms`] of it (one statement).
    pub(crate) async fn set_idle(&self, c: &mut Conn, ms: u64) -> Result<()> {
        c.last_sent = Instant::now();
        sqlx::query(
            "SELECT set_config('idle_session_timeout', $1, false), \
                    set_config('lock_timeout', $2, false)",
        )
        .bind(ms.to_string())
        .bind(holder_lock_timeout_ms(ms).to_string())
        .execute(&mut c.conn)
        .await
        .map_err(from_sqlx)?;
        c.idle_ms = ms;
        Ok(())
    }

    pub(crate) async fn table_exists(&self, c: &mut Conn) -> Result<bool> {
        c.last_sent = Instant::now();
        sqlx::query_scalar(&self.sql.table_exists)
            .fetch_one(&mut c.conn)
            .await
            .map_err(from_sqlx)
    }

    pub(crate) async fn all_tables_exist(&self, c: &mut Conn) -> Result<bool> {
        c.last_sent = Instant::now();
        sqlx::query_scalar(&self.sql.all_tables_exist)
            .fetch_one(&mut c.conn)
            .await
            .map_err(from_sqlx)
    }

    pub(crate) async fn migrate_on(&self, c: &mut Conn) -> Result<()> {
        c.last_sent = Instant::now();
        // No arguments: sqlx sends it as one simple-protocol query, statements in order.
        sqlx::Executor::execute(&mut c.conn, self.sql.migrate.as_str())
            .await
            .map_err(from_sqlx)?;
        Ok(())
    }

    /// Whether the session `pid` still exists on the server, asked on another connection
    /// within the connect timeout. `false` also when the server cannot be asked.
    pub(crate) async fn session_alive(&self, pid: i32) -> bool {
        self.sessions_gone(&[pid])
            .await
            .is_some_and(|g| g.is_empty())
    }

    /// Which of the sessions `pids` no longer exist on the server (one query on another
    /// connection, within the connect timeout); `None` if the server could not be asked.
    pub(crate) async fn sessions_gone(&self, pids: &[i32]) -> Option<Vec<i32>> {
        let query = "SELECT p FROM unnest($1::int4[]) AS p \
                     WHERE NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = p)";
        let check = async {
            let (mut c, reused) = self.checkout().await?;
            c.last_sent = Instant::now();
            let res = sqlx::query_scalar(query)
                .bind(pids)
                .fetch_all(&mut c.conn)
                .await;
            let gone: Vec<i32> = match res {
                Ok(g) => g,
                Err(_) if reused => {
                    // A dead cached connection (the server restarted): so are the others.
                    self.idle().clear();
                    c = self.open().await?;
                    c.last_sent = Instant::now();
                    sqlx::query_scalar(query)
                        .bind(pids)
                        .fetch_all(&mut c.conn)
                        .await
                        .map_err(from_sqlx)?
                }
                Err(e) => return Err(from_sqlx(e)),
            };
            self.put_idle(c);
            Ok::<_, Error>(gone)
        };
        match tokio::time::timeout(self.config.connect_timeout, check).await {
            Ok(Ok(gone)) => Some(gone),
            _ => None,
        }
    }
}

pub(crate) fn connect_error(e: sqlx::Error) -> Error {
    if let sqlx::Error::Database(db) = &e
        && db.message().contains("unsupported startup parameter")
    {
        return pooler_detected();
    }
    if let Some(f) = lockkit_core::backend::tls_failure(&e) {
        return f.into_error(BACKEND, e.into());
    }
    if let sqlx::Error::Tls(tls) = &e {
        if tls.to_string().contains("does not support TLS") {
            return Error::config_with(
                "the server does not accept TLS connections, and sslmode (require, verify-ca, \
                 verify-full, or implied by tls_ca/tls_cert) demands TLS",
                e,
            );
        }
        // A TLS file sqlx could not read or parse (tls_ca, tls_cert, tls_key).
        return Error::config_with("cannot use the TLS files (tls_ca, tls_cert, tls_key)", e);
    }
    from_sqlx(e)
}

fn pooler_detected() -> Error {
    Error::config(
        "the server did not keep this connection's session settings: a connection pooler \
         (such as PgBouncer) sits between lockkit and PostgreSQL. Advisory locks belong to a \
         server session, which a transaction pooler hands to other clients; connect lockkit \
         directly to PostgreSQL",
    )
}

/// Opens the connection of a [`Conn`]: a [`PgListener`] on a pool of one connection, closed
/// right after (see [`Conn`]).
///
/// sqlx's pool retries a refused connection until its acquire timeout (it assumes a server
/// starting up); lockkit reports a refused connection at once, as a plain connect does. So if
/// the connect takes longer than a moment, a bare TCP connect tells whether the port refuses.
async fn connect_listener(opts: PgConnectOptions) -> Result<PgListener> {
    let tcp = opts
        .get_socket()
        .is_none()
        .then(|| (opts.get_host().to_owned(), opts.get_port()));
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .max_lifetime(None)
        .idle_timeout(None)
        .test_before_acquire(false)
        .acquire_timeout(crate::config::MAX_CONNECT_TIMEOUT)
        .connect_lazy_with(opts);
    let listen = PgListener::connect_with(&pool);
    tokio::pin!(listen);
    let res = tokio::select! {
        r = &mut listen => r,
        () = tokio::time::sleep(REFUSED_PROBE_AFTER) => {
            if let Some(addr) = &tcp
                && let Err(e) = tokio::net::TcpStream::connect((addr.0.as_str(), addr.1)).await
                    && e.kind() == std::io::ErrorKind::ConnectionRefused {
                        return Err(from_sqlx(sqlx::Error::Io(e)));
                    }
            listen.await
        }
    };
    let mut listener = res.map_err(connect_error)?;
    // The pool is closed for good: PgListener never reconnects behind our back, and the
    // connection is closed (Terminate) when the listener is dropped.
    drop(pool.close());
    listener.ignore_pool_close_event(true);
    listener.eager_reconnect(false);
    Ok(listener)
}

/// How long a connect may take before [`connect_listener`] checks whether the port refuses.
const REFUSED_PROBE_AFTER: Duration = Duration::from_millis(100);

impl Conn {
    /// Waits, reading the idle connection, until the server closes it (or it breaks): the
    /// session is gone. Cancel safe (sqlx reads whole messages only). Must only be awaited
    /// while no statement is in flight on the connection.
    pub(crate) async fn closed(&mut self) {
        // No LISTEN was sent, so no notification comes; the FATAL ErrorResponse that
        // precedes the close is skipped by `try_recv`, which then reads the end of the stream.
        while let Ok(Some(_)) = self.conn.try_recv().await {}
    }
}

/// Armed while a statement that may wait in the server's lock queue runs on session `pid`: if
/// dropped armed (the acquire's future was dropped, or gave up on the statement), it cancels the
/// statement on another connection (`pg_cancel_backend`, in a task of its own, within the
/// connect timeout).
///
/// Dropping the connection alone does not end the wait: sqlx's drop of a [`PgListener`] first
/// waits for the reply to the statement in flight before it closes the connection, so the
/// statement would stay queued until the lock frees, be granted it, and only then give it
/// back. Once cancelled, the drop closes the connection at once, and the server ends the
/// session. A grant that races the cancel is given back the same way (the session ends
/// with the close); if the close cannot reach the server, the session's idle timeout (the
/// TTL, set before the lock is asked for) ends it.
///
/// Only a session waiting on a lock (`wait_event_type = 'Lock'`) is cancelled: an idle one (the
/// grant came first) is left alone, and so is another session that took over the pid after
/// this one ended.
pub(crate) struct CancelOnDrop<'a> {
    inner: &'a Inner,
    pid: i32,
    armed: bool,
}

impl<'a> CancelOnDrop<'a> {
    pub(crate) fn new(inner: &'a Inner, pid: i32) -> Self {
        Self {
            inner,
            pid,
            armed: true,
        }
    }

    /// The statement is over: nothing to cancel.
    pub(crate) fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // Outside a runtime the process is ending: the server ends the session when its socket
        // closes (noticed within `client_connection_check_interval`).
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let opts = self.inner.config.connect.clone();
        let t = self.inner.config.connect_timeout;
        let pid = self.pid;
        rt.spawn(async move {
            let cancel = async {
                let mut db = PgConnection::connect_with(&opts).await?;
                sqlx::query(
                    "SELECT pg_cancel_backend(pid) FROM pg_stat_activity \
                     WHERE pid = $1 AND wait_event_type = 'Lock'",
                )
                .bind(pid)
                .execute(&mut db)
                .await?;
                db.close().await
            };
            match tokio::time::timeout(t, cancel).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::debug!(pid, error = %e, "cancelling a dropped wait failed");
                }
                Err(_) => tracing::debug!(pid, "cancelling a dropped wait timed out"),
            }
        });
    }
}

impl Drop for Inner {
    /// sqlx closes a dropped [`PgListener`] in a task it spawns, which needs a Tokio runtime:
    /// outside one, the idle connections are leaked instead (the process is ending; the server
    /// ends their sessions when their sockets close).
    fn drop(&mut self) {
        if tokio::runtime::Handle::try_current().is_err() {
            for c in self
                .idle
                .get_mut()
                .unwrap_or_else(|p| p.into_inner())
                .drain(..)
            {
                std::mem::forget(c);
            }
        }
    }
}

pub(crate) fn duration_ms(d: Duration) -> u64 {
    let ms = d.as_nanos().div_ceil(1_000_000);
    u64::try_from(ms).unwrap_or(u64::MAX).max(1)
}

/// The `lock_timeout` of a holder session of TTL `ttl_ms`: TTL/6 (at least 1 ms). A statement
/// on it that waits for a table or row lock (an operator's `LOCK TABLE`, `VACUUM FULL` or
/// `ALTER TABLE` on lockkit's tables) gives up after that with `lock_not_available`, so the
/// session is renewed (every TTL/3) before its leases turn suspect (TTL/2 without a renewal):
/// one stuck grant must not starve the renewal of the session's other leases.
pub(crate) fn holder_lock_timeout_ms(ttl_ms: u64) -> u64 {
    (ttl_ms / 6).max(1)
}

pub(crate) fn ttl_ms(ttl: Duration) -> u64 {
    duration_ms(ttl)
}
