//! # lockkit-postgres
//!
//! The PostgreSQL backend of [lockkit](https://docs.rs/lockkit): distributed locks that are
//! **leases** (the server frees a lock one TTL after its holder stops renewing) with durable,
//! strictly increasing **fencing tokens**, on one PostgreSQL 14+ server, through
//! [sqlx](https://docs.rs/sqlx).
//!
//! ```no_run
//! use std::time::Duration;
//! use lockkit_core::{AcquireOptions, Error, Lock, Wait};
//! use lockkit_postgres::{PgFence, PgLock};
//! use sqlx::{Arguments, Connection, postgres::PgArguments};
//!
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let url = "postgres://postgres@127.0.0.1:5432/postgres?prefix=billing";
//! let locks = PgLock::connect(url).await?; // creates lockkit.fence if missing
//!
//! let opts = AcquireOptions::new()
//!     .ttl(Duration::from_secs(10))
//!     .wait(Wait::Timeout(Duration::from_secs(5)));
//! let lease = locks.acquire("invoice-run", opts).await?;
//!
//! // The protected data lives in PostgreSQL too: every write is fenced by the lease's token,
//! // in your own transaction, and each row is bound to the lock of its first fenced write.
//! // (CREATE TABLE invoices (id int PRIMARY KEY, state text, fence_token bigint, fence_lock text))
//! let fence = PgFence::new("invoices", "fence_token", "fence_lock")?;
//! let mut db = sqlx::PgConnection::connect("postgres://postgres@127.0.0.1:5432/postgres").await?;
//! let mut tx = db.begin().await?;
//! let mut args = PgArguments::default();
//! args.add("sent")?; // $1
//! args.add(42_i32)?; // $2
//! tokio::select! {
//!     _ = lease.lost() => return Err("lease lost: another holder may run now".into()),
//!     res = fence.update_as(&mut *tx, &lease, "state = $1", "id = $2", args) => match res {
//!         Ok(_) => tx.commit().await?,
//!         // A holder with a newer token already wrote: we were paused past our TTL (the lease
//!         // is now Lost).
//!         Err(Error::StaleToken { .. }) => tx.rollback().await?,
//!         Err(e) => return Err(e.into()),
//!     },
//! }
//! lease.release().await?;
//! # Ok(()) }
//! ```
//!
//! ## How a lease works
//! Each lease is a **session-level advisory lock**
//! (<https://www.postgresql.org/docs/current/explicit-locking.html#ADVISORY-LOCKS>) held by a
//! **holder session**: a connection of the [`PgLock`]'s own (never a pooled one, never used by
//! anything else) that holds many leases.
//!
//! - **Sharing.** Leases kept alive by lockkit (the default) of one TTL share holder sessions,
//!   up to [`SESSION_LEASES`] (1,000) per session: 10,000 such leases take 10 server
//!   connections. A try-once grant runs its one statement on the first session of its TTL that
//!   has room (a new session is opened when all are full), a release unlocks on that session.
//!   The caller runs its statement itself, holding the session's connection lock (one
//!   statement at a time per session; no hand-off to another task). What a dropped acquire
//!   or release may have done is written down before its statement is sent, and undone
//!   before the session's next statement: a grant whose caller is gone is released, a
//!   dropped release still happens (see `session.rs`). Advisory locks are re-entrant within
//!   a session, so a key its session already holds is never granted on it again.
//! - **Renewal** is per session, not per lease: one statement (`SELECT pg_backend_pid()`, none
//!   if another statement ran since) every TTL/3 restarts the session's idle timer and confirms
//!   all its leases at once; their leases are
//!   [`self_renewing`](lockkit_core::backend::LeaseOps::self_renewing), so the core schedules
//!   nothing for them. 10,000 leases of TTL 3 s: about 10 statements per second. A holder
//!   session's `lock_timeout` is TTL/6, so a grant or release that waits for a lock on
//!   lockkit's tables (an operator's `LOCK TABLE`, `VACUUM FULL`) gives up with
//!   [`Unavailable`](lockkit_core::Error::Unavailable) before the session's other leases miss
//!   their renewal.
//! - **Waiting** acquires first try once on a shared session; if the lock is held, they wait in
//!   the server's queue on a connection of their own (a blocking `pg_advisory_lock` cannot
//!   share a session), and that connection, which now holds the lock, becomes a holder session
//!   that takes further grants of its TTL. The cost: one connection per concurrent waiter (as
//!   before), and three statements for a waited grant: the first try (which also returns the
//!   name stored under the key, telling a held lock from a key collision), the wait (which
//!   also sets the session's `idle_session_timeout` and `lock_timeout`), and the token bump
//!   after the grant; a session stays open while it holds a lease,
//!   so the waiters' sessions add to the pool until their leases are released. A session
//!   that holds nothing goes back to the idle cache at its last release if its pool has
//!   another session (so the next wait reuses its connection), else TTL/3 after its last
//!   grant. FIFO order is kept by the server's queue.
//! - **Renewed by hand** (`keepalive(false)`): such a lease keeps a session of its own, since
//!   its expiry must follow its own renewals and any statement on a shared session restarts
//!   the session's idle timer.
//! - **Server limits.** Advisory locks live in the server's shared lock table, sized
//!   `max_locks_per_transaction × (max_connections + max_prepared_transactions + background
//!   workers)`: with the defaults (64 × about 122) that is 7,808 entries nominally, and measured
//!   on PostgreSQL 15 with `max_connections = 100` one session could take 12,734 advisory locks
//!   before "out of shared memory" (the table borrows spare shared memory). So 10,000 leases
//!   fit with the defaults, but leave about 2,700 entries for every other lock of the whole
//!   server that is not a fast-path relation lock. For more leases, or a busy server, raise
//!   `max_locks_per_transaction` (for example 128 doubles the table; a restart is needed).
//! - **Expiry.** Before a lock is requested, the session's
//!   [`idle_session_timeout`](https://www.postgresql.org/docs/current/runtime-config-client.html#GUC-IDLE-SESSION-TIMEOUT)
//!   (PostgreSQL 14+, milliseconds) is set to the TTL (all leases of a shared session have
//!   that TTL). While the holder renews, every renewal is a statement on that session and
//!   restarts the timer. If the holder stops (paused process, crash, network cut), the server
//!   terminates the session after one TTL of idleness, and ending a session releases all its
//!   advisory locks. A lease whose holder stops renewing it while its session lives on (a
//!   dropped or leaked [`Lease`](lockkit_core::Lease), one lost on the client side) is
//!   unlocked by the session's keeper task at its deadline, leaving its lock-delay row, as a lapse. No client cooperation and no
//!   TCP timeout is needed. The client's own deadline is `send time + TTL − drift margin`, so
//!   the holder is told it lost the lock before the server frees it.
//! - **Dead peers.** The session also sets `tcp_keepalives_idle = 10 s`,
//!   `tcp_keepalives_interval = 2 s`, `tcp_keepalives_count = 3` and `tcp_user_timeout = 10 s`
//!   (<https://www.postgresql.org/docs/current/runtime-config-connection.html#RUNTIME-CONFIG-TCP-SETTINGS>),
//!   and `client_connection_check_interval = 250 ms`
//!   (<https://www.postgresql.org/docs/current/runtime-config-connection.html#GUC-CLIENT-CONNECTION-CHECK-INTERVAL>),
//!   so a waiter whose client went away leaves the lock queue promptly.
//! - **Session watch.** A session can also end while its holder is fine: server restart or
//!   crash, `pg_terminate_backend`, a killed backend. The server then frees its locks at once
//!   and may grant them to other clients. It also sends a FATAL error and closes the
//!   connection, and the session's keeper task, which reads the idle connection between statements
//!   (sqlx's `PgListener`, listening to nothing, on a pool of that one connection), marks all
//!   the leases of that session lost at once
//!   ([`LossReason::SessionExpired`](lockkit_core::LossReason::SessionExpired)); the leases of
//!   other sessions are not touched. No statement is sent for it.
//!   **Detection window:** milliseconds after the close reaches the client
//!   ([`Guarantees::loss_notice`](lockkit_core::Guarantees::loss_notice) = 100 ms; measured
//!   3–16 ms after `pg_terminate_backend`, under 1 ms after `pg_ctl stop -m immediate`). A
//!   connection that dies without a FIN or RST reaching the client (a middlebox that dropped
//!   its state) cannot be read as closed; the server ends its session through TCP keepalive
//!   (about 16 s). For that case each [`PgLock`] still checks every [`SESSION_CHECK`] (5 s),
//!   with one query on another connection, that the sessions of its held leases exist in
//!   `pg_stat_activity` (one query for all its sessions): the holder is then told within
//!   `SESSION_CHECK` + 2 × connect timeout (each check takes up to one connect timeout, and the
//!   check running when the session ended may have read `pg_stat_activity` just before: the
//!   next one starts `SESSION_CHECK` after it returns).
//!   Within the window two clients may both believe they hold the lock: writes must be fenced
//!   by the token (a server restart or kill is not a pause the TTL covers).
//! - **Renew** (by the session's keeper task, or by hand) runs one statement on the session
//!   (restarting the idle timer) and checks the backend pid is unchanged. If the session is gone (idle timeout, `pg_terminate_backend`,
//!   server restart, broken connection), renew and release return
//!   [`Error::NotHeld`](lockkit_core::Error::NotHeld) and the lease is lost; the lock is never
//!   re-taken.
//! - **Release** is `pg_advisory_unlock(key)` (with a lock-delay, in the statement that first
//!   deletes the delay row: see [Lock-delay](#lock-delay)).
//! - **Waiting** happens in the server's lock queue: `SELECT pg_advisory_lock(key)` with
//!   [`lock_timeout`](https://www.postgresql.org/docs/current/runtime-config-client.html#GUC-LOCK-TIMEOUT)
//!   set to the time left; no polling. The waiting statement touches no table (the token is
//!   bumped by a separate statement once the lock is granted), so it holds no table lock and
//!   DDL on the fence table is never queued behind a waiter. Like any running statement it
//!   does hold a snapshot (`backend_xmin` in `pg_stat_activity`) for as long as it waits, which
//!   holds back VACUUM's cleanup horizon: prefer bounded waits over very long `Wait::Forever`
//!   ones on busy databases. Every 3 s a waiting acquire checks on another connection that its
//!   waiting session still exists, so a connection cut off without FIN or RST (which sqlx would
//!   otherwise wait on forever) ends the wait with
//!   [`Error::Unavailable`](lockkit_core::Error::Unavailable), which the acquire retries by its
//!   retry policy (each retry bounded by the connect timeout; a `Wait::Forever` acquire retries
//!   until the server answers again, so it lives through a restart or an outage of the server;
//!   with `retry(None)` it ends after about 3 s + the connect timeout). Opening a connection counts
//!   against the wait: a timed acquire returns
//!   [`Error::Timeout`](lockkit_core::Error::Timeout) at its deadline even if the server does
//!   not answer the connect, and a try-once (`Wait::No`) gets the connect timeout in all,
//!   retries included. Dropping a waiting acquire cancels its statement on another connection
//!   (`pg_cancel_backend`; closing the connection alone would wait for the statement's reply,
//!   i.e. for the grant) and closes its connection, which ends the session and so its place in
//!   the queue and any lock granted just before the cancel.
//!
//! ## Fencing tokens
//! A token is a per-name counter in lockkit's table `{schema}.fence` (created by
//! [`PgLock::migrate`], or on connect), bumped only by the session that holds the lock. A
//! try-acquire takes the lock and bumps the counter in one autocommit statement, only when the
//! lock was granted; a waiting acquire runs the same `INSERT … ON CONFLICT` bump as a separate
//! statement right after the grant (if it fails or is cancelled, the connection is closed, which
//! frees the lock):
//!
//! ```sql
//! WITH l AS MATERIALIZED (SELECT pg_try_advisory_lock($1) AS ok),
//!      b AS (INSERT INTO lockkit.fence AS f (key, name, token) SELECT $1, $2, 1 FROM l WHERE l.ok
//!            ON CONFLICT (key) DO UPDATE SET token = f.token + 1 WHERE f.name = excluded.name
//!            RETURNING f.token)
//! SELECT l.ok, (SELECT token FROM b) FROM l
//! ```
//!
//! The bump commits when the statement returns (with `synchronous_commit = on` forced on
//! lockkit's sessions), so a token that reached a client is durable, and no transaction that
//! might roll back ever holds it: tokens never repeat, across killed sessions, client restarts
//! and server restarts (as long as the server's `fsync` is on and its WAL survives). Tokens of
//! one name are granted in lock order, because only the lock holder bumps.
//!
//! ## Lock-delay
//! A session-level advisory lock is freed by the server the moment its session ends, so a
//! lock-delay ([`AcquireOptions::lock_delay`](lockkit_core::AcquireOptions::lock_delay)) is
//! kept in lockkit's table `{schema}.delay`: a grant with a delay writes `(key, name,
//! delay_ms)` in the grant statement, and the release deletes the row in the statement that
//! unlocks (before the unlock). A later grant (with or without a delay of its own) that gets
//! the advisory lock and finds a row was preceded by a holder that ended without a release: it
//! records `free_since = coalesce(free_since, now())` (the first acquirer that saw the lock free
//! starts the delay; the server cannot tell when the dead session ended, so the delay may come
//! out longer, never shorter) and computes what is left on the server's clock. A waiting
//! acquire keeps the advisory lock (its place at the head of the queue) and sleeps that long,
//! then is granted; a try-once gives the advisory lock back and returns
//! [`Error::Held`](lockkit_core::Error::Held). No polling. Once the delay is over, the grant
//! deletes the row (or replaces it with its own delay). A holder whose row was never seen by
//! anyone leaves it until the next grant, which is one row per name at most.
//!
//! ## Lock keys
//! Names map to the advisory key space by [`lock_key`]: the first 8 bytes of SHA-256 of
//! `"{prefix}/{name}"` (with the schema mixed in for a schema other than `lockkit`, see
//! [`lock_key_in`], so two schemas on one database never share a lock). The fence row stores the full name, so a collision between two names is
//! reported as an error instead of making them share a lock.
//!
//! ## Elections and semaphores
//! [`PgLock`] also implements [`SlotBackend`](lockkit_core::backend::SlotBackend), so it is an
//! [`Election`](lockkit_core::Election) and a [`Semaphore`](lockkit_core::Semaphore): a
//! leadership is the lock lease of `elect/{name}`, permit k of a semaphore the lock lease of
//! `sem/{name}/{k}` (tokens per derived name in the fence table), with the holder's value in
//! `{schema}.slot_holders` and a semaphore's N in `{schema}.slot_names`. Permit waiters queue
//! FIFO on a per-name gate lock; releases `NOTIFY` the name's channel, which observers
//! `LISTEN` to. See
//! [docs/election-semaphore.md](https://example.invalid/lockkit/blob/main/docs/election-semaphore.md).
//!
//! ## Connection poolers
//! A transaction-mode pooler (PgBouncer `pool_mode = transaction`) hands a server session to
//! other clients between transactions, which breaks session advisory locks. lockkit sends its
//! settings in the startup packet together with a random marker and checks that the session
//! reports the marker back: PgBouncer refuses (or ignores) such startup options, and the
//! connect fails with [`Error::InvalidConfig`](lockkit_core::Error::InvalidConfig) naming the
//! pooler. Renewals also check the backend pid. Connect lockkit directly to PostgreSQL.
//!
//! ## Guarantees
//! | | |
//! |---|---|
//! | kind | correctness lock, on one server |
//! | lease expiry | idle_session_timeout = TTL, ms precision, slack ≤ 100 ms (per holder session; a lease the holder stops renewing while its session lives is unlocked at its deadline) |
//! | renewal traffic | one statement per holder session per TTL/3 (up to 1,000 leases each) |
//! | lock-delay | yes: a row in `{schema}.delay`, counted from when the next acquirer first saw the lock free (server clock) |
//! | session ended by restart / kill | all leases of that session told within milliseconds (reads the close); a silently dead connection within [`SESSION_CHECK`] (5 s) + check |
//! | tokens | durable, strictly increasing per name, survive server restarts |
//! | waiters | FIFO (PostgreSQL's lock queue) |
//! | manual renewal | yes (`keepalive(false)`) |
//! | failover | **not safe**: advisory locks are not replicated; a promoted standby has none |
//!
//! TLS: `sslmode=require` (encrypted), `verify-ca` or `verify-full` (certificate checked against
//! the system roots or `sslrootcert=…`), through sqlx's rustls support.
//!
//! Requires PostgreSQL 14 or newer, a role that may create lockkit's schema and tables once
//! (or run [`PgLock::migrate`] from one that can), and per [`PgLock`] one server connection
//! per [`SESSION_LEASES`] kept-alive leases of one TTL, one per lease renewed by hand, one per
//! waiting acquire while it waits, plus up to 8 idle ones.
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations)]
#![deny(rustdoc::broken_intra_doc_links)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod config;
mod core;
mod error;
mod fence;
mod lease;
mod lock;
mod session;
mod slots;

pub use config::{
    DEFAULT_CONNECT_TIMEOUT, DEFAULT_PREFIX, DEFAULT_SCHEMA, MIN_CONNECT_TIMEOUT, PgConfig,
};
pub use core::SESSION_CHECK;
#[doc(hidden)]
pub use core::{SESSION_SETTINGS, grant_try_sql};
pub use fence::PgFence;
pub use lease::PgLease;
pub use lock::{PgLock, lock_key, lock_key_in};
pub use session::SESSION_LEASES;

/// sqlx, as used by this crate (for [`PgFence`]'s arguments and [`PgConfig::new`]'s options).
#[doc(no_inline)]
pub use sqlx;
