//! What [`PgLock`](crate::PgLock) and [`PgLease`](crate::PgLease) share: the dedicated
//! connections (opening, the idle cache), lockkit's SQL texts, the session watch, and unit
//! conversions.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use lockkit_core::backend::TrackerHandle;
use lockkit_core::{Error, Instant, LeaseState, LossReason, Result};
use sha2::{Digest, Sha256};
use sqlx::{Connection, PgConnection};

use crate::config::PgConfig;
use crate::error::{BACKEND, Msg, from_sqlx, unavailable};

/// How often a backend that is busy (waiting in a lock queue) checks that its client is still
/// connected: `client_connection_check_interval`, in milliseconds.
const CLIENT_CHECK_MS: &str = "250";

/// How often a held lease checks, on another connection, that its session still exists.
pub const SESSION_CHECK: Duration = Duration::from_secs(1);

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
pub(crate) struct Conn {
    pub(crate) conn: PgConnection,
    /// The session's `idle_session_timeout`, in ms (0 = off).
    pub(crate) idle_ms: u64,
    /// Send time of the last statement: the server's idle timer started after it.
    pub(crate) last_sent: Instant,
    /// `pg_backend_pid()` of the session.
    pub(crate) pid: i32,
}

/// SQL texts with lockkit's schema filled in.
pub(crate) struct Sql {
    pub(crate) grant_try: String,
    pub(crate) bump: String,
    pub(crate) name_of: String,
    /// Whether key `$1` is held (`pg_locks`), with its fence token and stored name.
    pub(crate) holder: String,
    pub(crate) table_exists: String,
    /// Whether the fence table and the slot tables (elections, semaphores) all exist.
    pub(crate) all_tables_exist: String,
    pub(crate) migrate: String,
}

impl Sql {
    pub(crate) fn new(schema: &str) -> Self {
        // validate_schema allows only [a-z_][a-z0-9_]*, so quoting changes nothing but lets
        // reserved words (`select`, `user`) through.
        let q = quote_ident(schema);
        // The bump of the name's token, run only by the session that holds the lock: tokens of
        // one name follow lock order. It returns no row if another name is stored under the key
        // (a hash collision).
        let bump = format!(
            "INSERT INTO {q}.fence AS f (key, name, token) VALUES ($1, $2, 1) \
             ON CONFLICT (key) DO UPDATE SET token = f.token + 1 \
             WHERE f.name = excluded.name \
             RETURNING f.token"
        );
        Self {
            // A try-acquire takes the lock and, only if it was granted, bumps the token in the
            // same implicit transaction, which commits when the statement ends (autocommit): a
            // returned token is committed, and a granted lock always comes with a fresh token.
            // The CTE `l` is referenced twice, so it is evaluated exactly once. It never waits,
            // so it holds its snapshot and its lock on the fence table only for an instant.
            grant_try: format!(
                "WITH l AS MATERIALIZED (SELECT pg_try_advisory_lock($1) AS ok), \
                 b AS (INSERT INTO {q}.fence AS f (key, name, token) \
                       SELECT $1, $2, 1 FROM l WHERE l.ok \
                       ON CONFLICT (key) DO UPDATE SET token = f.token + 1 \
                       WHERE f.name = excluded.name \
                       RETURNING f.token) \
                 SELECT l.ok, (SELECT token FROM b) FROM l"
            ),
            bump,
            name_of: format!("SELECT name FROM {q}.fence WHERE key = $1"),
            holder: format!(
                "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted \
                   AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                   AND classid = (($1 >> 32) & 4294967295)::oid \
                   AND objid = ($1 & 4294967295)::oid AND objsubid = 1), \
                 (SELECT token FROM {q}.fence WHERE key = $1), \
                 (SELECT name FROM {q}.fence WHERE key = $1)"
            ),
            table_exists: format!(
                "SELECT to_regclass('{}.fence') IS NOT NULL",
                q.replace('\'', "''")
            ),
            all_tables_exist: format!(
                "SELECT to_regclass('{s}.fence') IS NOT NULL \
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
    pub(crate) sql: Sql,
    pub(crate) idle: Mutex<Vec<Conn>>,
    pub(crate) watch: Mutex<Watch>,
}

/// The held leases of one [`PgLock`](crate::PgLock) whose sessions the watch task checks.
#[derive(Default)]
pub(crate) struct Watch {
    next_id: u64,
    leases: HashMap<u64, (i32, TrackerHandle)>,
    /// Whether the watch task runs (it ends when no lease is left).
    running: bool,
}

/// The session watch of one [`PgLock`](crate::PgLock): every [`SESSION_CHECK`], one query for all its held
/// leases; a lease whose session no longer exists is marked lost. Ends when no lease is left
/// or the `PgLock` (and its leases) are gone.
async fn watch_loop(inner: Weak<Inner>) {
    loop {
        tokio::time::sleep(SESSION_CHECK).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let watched: Vec<(u64, i32, TrackerHandle)> = {
            let mut w = inner.watch_list();
            w.leases.retain(|_, (_, t)| t.state() != LeaseState::Lost);
            if w.leases.is_empty() {
                w.running = false;
                return;
            }
            w.leases
                .iter()
                .map(|(id, (pid, t))| (*id, *pid, t.clone()))
                .collect()
        };
        let pids: Vec<i32> = watched.iter().map(|(_, pid, _)| *pid).collect();
        let Some(gone) = inner.sessions_gone(&pids).await else {
            continue;
        };
        for (id, pid, tracker) in watched {
            if gone.contains(&pid) {
                // The tracker reports the loss, naming the lock.
                tracing::debug!(
                    backend_pid = pid,
                    "the lease's server session ended; lease lost"
                );
                tracker.mark_lost(LossReason::SessionExpired);
                inner.unwatch(id);
            }
        }
    }
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
        let mut opts = self.config.connect.clone().options([
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
            ("lockkit.session", probe.as_str()),
        ]);
        if opts.get_application_name().is_none() {
            opts = opts.application_name("lockkit");
        }
        let mut conn = PgConnection::connect_with(&opts)
            .await
            .map_err(connect_error)?;
        if let Some(v) = conn.server_version_num() {
            if v < 140_000 {
                return Err(Error::NotSupported {
                    operation: "PostgreSQL older than 14 (idle_session_timeout is needed)",
                    backend: BACKEND,
                });
            }
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
    async fn sessions_gone(&self, pids: &[i32]) -> Option<Vec<i32>> {
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

    fn watch_list(&self) -> MutexGuard<'_, Watch> {
        self.watch.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts watching the session `pid` of a held lease (see [`SESSION_CHECK`]): the lease is
    /// marked lost when the session no longer exists. Returns the id for [`unwatch`](Self::unwatch).
    pub(crate) fn watch(self: &Arc<Self>, pid: i32, tracker: TrackerHandle) -> u64 {
        let mut w = self.watch_list();
        w.next_id += 1;
        let id = w.next_id;
        w.leases.insert(id, (pid, tracker));
        if !w.running {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                w.running = true;
                rt.spawn(watch_loop(Arc::downgrade(self)));
            }
        }
        id
    }

    /// Stops watching lease `id`.
    pub(crate) fn unwatch(&self, id: u64) {
        self.watch_list().leases.remove(&id);
    }
}

pub(crate) fn connect_error(e: sqlx::Error) -> Error {
    if let sqlx::Error::Database(db) = &e {
        if db.message().contains("unsupported startup parameter") {
            return pooler_detected();
        }
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

pub(crate) fn duration_ms(d: Duration) -> u64 {
    let ms = d.as_nanos().div_ceil(1_000_000);
    u64::try_from(ms).unwrap_or(u64::MAX).max(1)
}

pub(crate) fn ttl_ms(ttl: Duration) -> u64 {
    duration_ms(ttl)
}
