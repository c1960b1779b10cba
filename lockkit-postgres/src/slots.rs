//! Elections and semaphores on PostgreSQL: [`SlotBackend`] for [`PgLock`].
//!
//! Each slot is a lock lease on a derived name, granted and kept by the lock's own machinery
//! (a session advisory lock on a dedicated connection, `idle_session_timeout` = TTL, the
//! session watch): the leadership of election `x` is the lock `elect/x`, permit `k` of
//! semaphore `x` the lock `sem/x/k`, with tokens from their rows of `{schema}.fence`. Beside
//! the lock, `{schema}.slot_holders` keeps each holder's value (and session, token and TTL, so
//! that a stale row is never read as a holder), and `{schema}.slot_names` a semaphore's N.
//! Changes are announced with `NOTIFY` on the name's channel. See
//! [docs/election-semaphore.md](https://example.invalid/lockkit/blob/main/docs/election-semaphore.md).

use std::any::Any;
use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use lockkit_core::backend::{
    LeaseOps, LockBackend, SlotBackend, SlotGrant, SlotGuarantees, SlotHolder, SlotHolders,
    SlotKind, SlotOps, SlotRequest, SlotWatch, TrackerHandle, WatchEvent, retry_transient,
    validate_slot_name, wait_deadline,
};
use lockkit_core::{AcquireOptions, Error, FencingToken, Instant, Lease, Result, Wait};
use sqlx::postgres::{PgListener, PgPoolOptions};

use crate::core::{Conn, Inner, duration_ms, quote_ident, ttl_ms};
use crate::error::{Msg, backend, cancelled, from_sqlx, sqlstate, unavailable};
use crate::lease::PgLease;
use crate::lock::{PgLock, Request, WAIT_CHECK, full_name, lock_key_in};
use crate::session::Adopted;

/// Extra time a waiting permit acquire gives the server's `lock_timeout` before it closes its
/// connection itself (as for locks).
const CLIENT_WAIT_GRACE: Duration = Duration::from_secs(2);

/// How often a mismatched N is re-read before `PermitsMismatch` (the name may just have gone
/// idle).
const JOIN_TRIES: u32 = 3;

/// The names and keys of one election or semaphore.
struct Names {
    kind: SlotKind,
    /// The user's name.
    name: String,
    /// `{prefix}/{kind}/{name}`.
    base: String,
    /// The shared lock every semaphore acquirer holds until it holds a slot (see
    /// `join`), and the key of the name's row in `slot_names`.
    members: i64,
    /// The lock waiting permit acquirers queue on, FIFO, one at a time trying the slots.
    gate: i64,
    /// The `NOTIFY` channel of the name's changes.
    channel: String,
}

impl PgLock {
    fn names(&self, kind: SlotKind, name: &str) -> Names {
        let c = &self.inner.config;
        let rel = format!("{}/{name}", kind.as_str());
        // `\0` appears in no name or prefix: these keys collide with no lock or slot.
        let members = lock_key_in(&c.schema, &c.prefix, &format!("{rel}\0members"));
        let gate = lock_key_in(&c.schema, &c.prefix, &format!("{rel}\0gate"));
        let events = lock_key_in(&c.schema, &c.prefix, &format!("{rel}\0events"));
        Names {
            kind,
            name: name.to_owned(),
            base: full_name(&c.prefix, &rel),
            members,
            gate,
            channel: format!("lockkit_{:016x}", events as u64),
        }
    }

    /// Slot `slot`'s name relative to the prefix: `elect/{name}` or `sem/{name}/{slot}`.
    fn slot_rel(n: &Names, slot: u32) -> String {
        match n.kind {
            SlotKind::Semaphore => format!("sem/{}/{slot}", n.name),
            _ => format!("elect/{}", n.name),
        }
    }

    fn slot_key(&self, n: &Names, slot: u32) -> i64 {
        let c = &self.inner.config;
        lock_key_in(&c.schema, &c.prefix, &Self::slot_rel(n, slot))
    }

    fn slot_keys(&self, n: &Names, permits: u32) -> Vec<i64> {
        (0..permits).map(|s| self.slot_key(n, s)).collect()
    }

    fn slot_full(&self, n: &Names, slot: u32) -> String {
        full_name(&self.inner.config.prefix, &Self::slot_rel(n, slot))
    }

    /// The slot's token identity: `postgres/{schema}/{prefix}/elect/{name}` or
    /// `…/sem/{name}/{slot}`.
    fn slot_token(&self, n: &Names, slot: u32, value: u64) -> FencingToken {
        FencingToken::new(self.lock_id(&Self::slot_rel(n, slot)), value)
    }

    fn q(&self) -> String {
        quote_ident(&self.inner.config.schema)
    }
}

/// `pg_locks` condition: advisory key `{key}` (an SQL expression) held in this database.
fn held_on(key: &str) -> String {
    format!(
        "l.locktype = 'advisory' AND l.granted \
         AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
         AND l.classid = ((({key}) >> 32) & 4294967295)::oid \
         AND l.objid = (({key}) & 4294967295)::oid AND l.objsubid = 1"
    )
}

/// One slot as read from the server.
#[derive(Debug, Clone)]
struct SlotRow {
    slot: u32,
    /// Its advisory lock is held by some session.
    held: bool,
    /// The holder's row is current (same session, token the last granted): `(token, value)`.
    holder: Option<(u64, Vec<u8>)>,
    /// What the holder's session has left of its idle timeout, if it is idle.
    remaining: Option<Duration>,
    /// The last token granted for the slot (its fence row).
    granted: Option<u64>,
    /// How often the holder's value was replaced (0 at the grant).
    version: u64,
}

/// The state of a name's slots and when to look again.
struct Status {
    rows: Vec<SlotRow>,
    /// The name has a holder or (semaphore) a member: its N is in force.
    active: bool,
}

impl Status {
    fn holders(&self, lock: &PgLock, n: &Names, with_remaining: bool) -> Vec<SlotHolder> {
        self.rows
            .iter()
            .filter(|r| r.held)
            .filter_map(|r| {
                let (token, value) = r.holder.clone()?;
                Some(SlotHolder::new(
                    r.slot,
                    lock.slot_token(n, r.slot, token),
                    value,
                    if with_remaining { r.remaining } else { None },
                ))
            })
            .collect()
    }

    /// When a holder's session may end by its idle timeout (no `NOTIFY` tells of that):
    /// the earliest idle holder's end, else `cap` from now.
    fn recheck(&self, cap: Duration) -> Instant {
        let soonest = self
            .rows
            .iter()
            .filter(|r| r.held)
            .map(|r| r.remaining.unwrap_or(cap))
            .min()
            .unwrap_or(cap)
            .min(cap);
        // A few ms after the server's timer fires.
        Instant::now() + soonest + Duration::from_millis(20)
    }
}

impl Inner {
    /// Reads the slots with keys `keys` (slot `i` = `keys[i]`), on `c`.
    async fn status_on(&self, c: &mut Conn, q: &str, keys: &[i64]) -> Result<Status> {
        let sql = format!(
            "SELECT (k.i - 1)::int4, l.pid IS NOT NULL, h.token, h.value, \
                    (h.pid = l.pid AND h.token = f.token AND h.name = f.name), \
                    CASE WHEN a.state = 'idle' THEN GREATEST(0, h.ttl_ms - \
                      (extract(epoch FROM clock_timestamp() - a.state_change) * 1000)::int8) END, \
                    f.token, h.version \
             FROM unnest($1::int8[]) WITH ORDINALITY AS k(key, i) \
             LEFT JOIN pg_locks l ON {held} \
             LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
             LEFT JOIN {q}.slot_holders h ON h.key = k.key \
             LEFT JOIN {q}.fence f ON f.key = k.key \
             ORDER BY k.i",
            held = held_on("k.key"),
        );
        c.last_sent = Instant::now();
        type Row = (
            i32,
            bool,
            Option<i64>,
            Option<Vec<u8>>,
            Option<bool>,
            Option<i64>,
            Option<i64>,
            Option<i64>,
        );
        let rows: Vec<Row> = sqlx::query_as(&sql)
            .bind(keys)
            .fetch_all(&mut c.conn)
            .await
            .map_err(from_sqlx)?;
        Ok(Status {
            active: false,
            rows: rows
                .into_iter()
                .map(
                    |(slot, held, token, value, current, remaining, granted, version)| SlotRow {
                        slot: u32::try_from(slot).unwrap_or(0),
                        held,
                        holder: match (current, token, value) {
                            (Some(true), Some(t), Some(v)) => u64::try_from(t).ok().map(|t| (t, v)),
                            _ => None,
                        },
                        remaining: remaining
                            .and_then(|ms| u64::try_from(ms).ok())
                            .map(Duration::from_millis),
                        granted: granted.and_then(|t| u64::try_from(t).ok()),
                        version: version.and_then(|v| u64::try_from(v).ok()).unwrap_or(0),
                    },
                )
                .collect(),
        })
    }

    /// Runs `fut` within the connect timeout.
    async fn within<T>(&self, fut: impl std::future::Future<Output = Result<T>>) -> Result<T> {
        let t = self.config.connect_timeout;
        tokio::time::timeout(t, fut).await.unwrap_or_else(|_| {
            Err(unavailable(Msg(format!(
                "no answer from the server within the connect timeout ({t:?})"
            ))))
        })
    }
}

/// A granted semaphore slot, before it becomes a lease.
struct SemGranted {
    conn: Conn,
    slot: u32,
    token: i64,
    sent: Instant,
}

enum SemOutcome {
    Granted {
        slot: u32,
        token: i64,
        sent: Instant,
    },
    Held,
    Timeout,
    /// A waiting statement (on the gate, or for the members lock) was cancelled by the server
    /// (`pg_cancel_backend`, SQLSTATE 57014): wait again on a new session (this one may hold
    /// what the cancel raced; closing it frees that).
    Cancelled,
}

/// One semaphore acquire's fixed inputs.
struct SemReq<'a> {
    names: &'a Names,
    permits: u32,
    keys: Vec<i64>,
    fulls: Vec<String>,
    opts: &'a AcquireOptions,
    start: Instant,
    deadline: Option<Instant>,
}

impl SemReq<'_> {
    fn timeout(&self) -> Error {
        Error::Timeout {
            name: self.names.name.clone(),
            waited: self.start.elapsed(),
        }
    }
}

impl PgLock {
    /// A lock-path grant of the election `n` (its one slot is the lock `elect/{name}`), then
    /// the holder's row and a `NOTIFY`.
    async fn grant_election(
        &self,
        n: &Names,
        value: &[u8],
        opts: &AcquireOptions,
    ) -> Result<(Conn, i64, Instant)> {
        let full = self.slot_full(n, 0);
        let start = Instant::now();
        let req = Request {
            name: &n.name,
            full: &full,
            key: self.slot_key(n, 0),
            opts,
            start,
            deadline: wait_deadline(opts.wait, start),
        };
        let attempts = retry_transient(opts, req.deadline, || self.inner.attempt(&req, false));
        let granted = if opts.wait == Wait::No {
            let t = self.inner.config.connect_timeout;
            tokio::time::timeout(t, attempts).await.map_err(|_| {
                unavailable(Msg(format!(
                    "no answer from the server within the connect timeout ({t:?})"
                )))
            })??
        } else {
            attempts.await?
        };
        let mut c = granted.conn;
        // If this fails or is dropped, the connection is closed, which frees the slot.
        let sql = format!(
            "WITH v AS (INSERT INTO {q}.slot_holders AS h (key, name, slot, token, pid, ttl_ms, value) \
                        VALUES ($1, $2, 0, $3, pg_backend_pid(), $4, $5) \
                        ON CONFLICT (key) DO UPDATE SET name = excluded.name, slot = 0, \
                          token = excluded.token, pid = excluded.pid, ttl_ms = excluded.ttl_ms, \
                          value = excluded.value, version = 0 \
                        RETURNING h.slot, h.token, h.version, h.value) \
             SELECT count(*) FROM v, LATERAL pg_notify($6, 'g ' || v.slot || ' ' || v.token || ' ' || v.version || ' ' || translate(encode(v.value, 'base64'), E'\\n', '')) AS n",
            q = self.q()
        );
        let sent = Instant::now();
        sqlx::query(&sql)
            .bind(req.key)
            .bind(&full)
            .bind(granted.token)
            .bind(i64::try_from(ttl_ms(opts.ttl)).unwrap_or(i64::MAX))
            .bind(value)
            .bind(&n.channel)
            .execute(&mut c.conn)
            .await
            .map_err(|e| unavailable(Msg(format!("session lost right after the grant: {e}"))))?;
        c.last_sent = sent;
        Ok((c, granted.token, granted.sent))
    }

    /// One semaphore acquire attempt on a cached (or, if that is dead, a new) connection.
    async fn sem_attempt(&self, r: &SemReq<'_>) -> Result<SemGranted> {
        let mut may_retry = true;
        loop {
            let timed = matches!(r.opts.wait, Wait::Timeout(_));
            let (mut c, reused) = match r.deadline.filter(|_| timed) {
                Some(d) => match tokio::time::timeout_at(d, self.inner.checkout()).await {
                    Ok(res) => res?,
                    Err(_) => return Err(r.timeout()),
                },
                None => self.inner.checkout().await?,
            };
            let res = match (r.opts.wait, r.deadline) {
                (_, Some(d)) if r.opts.wait != Wait::No => {
                    match tokio::time::timeout_at(d + CLIENT_WAIT_GRACE, self.sem_on(&mut c, r))
                        .await
                    {
                        Ok(res) => res,
                        Err(_) => Ok(SemOutcome::Timeout),
                    }
                }
                _ => self.sem_on(&mut c, r).await,
            };
            match res {
                Ok(SemOutcome::Granted { slot, token, sent }) => {
                    return Ok(SemGranted {
                        conn: c,
                        slot,
                        token,
                        sent,
                    });
                }
                Ok(SemOutcome::Held) => {
                    // Nothing is held (the members lock was given back): keep the connection.
                    self.inner.put_idle(c);
                    return Err(Error::Held {
                        name: r.names.name.clone(),
                    });
                }
                // The connection is closed (dropped): whatever it held or waited for is freed.
                Ok(SemOutcome::Timeout) => return Err(r.timeout()),
                Ok(SemOutcome::Cancelled) => {
                    tracing::debug!(semaphore = %r.names.name, "the server cancelled the wait (pg_cancel_backend); waiting again on a new session");
                    drop(c); // ends the session, and whatever a racing grant left on it
                }
                Err(e) if reused && may_retry && e.is_retryable() => {
                    tracing::debug!(error = %e, "cached connection failed; opening a new one");
                    may_retry = false;
                    drop(c);
                    self.inner.idle().clear();
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// A semaphore acquire on connection `c`: join the name (N check), then take a free slot,
    /// or (waiting) queue on the gate and, first in line, take the next slot that frees.
    async fn sem_on(&self, c: &mut Conn, r: &SemReq<'_>) -> Result<SemOutcome> {
        let ttl = ttl_ms(r.opts.ttl);
        // The idle timeout is in place before anything is held (see the lock's try_once); the
        // lock timeout bounds the short waits of `join`.
        c.last_sent = Instant::now();
        sqlx::query(
            "SELECT set_config('idle_session_timeout', $1, false), \
                    set_config('lock_timeout', $2, false)",
        )
        .bind(ttl.to_string())
        .bind(duration_ms(self.inner.config.connect_timeout).to_string())
        .execute(&mut c.conn)
        .await
        .map_err(from_sqlx)?;
        c.idle_ms = ttl;
        if !self.join(c, r).await? {
            return Ok(SemOutcome::Cancelled);
        }
        if r.opts.wait == Wait::No {
            let status = self.inner.status_on(c, &self.q(), &r.keys).await?;
            if let Some((slot, token, sent)) = self.try_slots(c, r, &status).await? {
                self.unlock(c, r, false).await?;
                return Ok(SemOutcome::Granted { slot, token, sent });
            }
            self.unlock(c, r, false).await?;
            return Ok(SemOutcome::Held);
        }
        // Queue on the gate: FIFO in the server's lock queue, bounded by lock_timeout.
        let remaining = r
            .deadline
            .map(|d| d.saturating_duration_since(Instant::now()));
        if remaining.is_some_and(|d| d.is_zero()) {
            return Ok(SemOutcome::Timeout);
        }
        c.last_sent = Instant::now();
        sqlx::query("SELECT set_config('lock_timeout', $1, false)")
            .bind(remaining.map(duration_ms).unwrap_or(0).to_string())
            .execute(&mut c.conn)
            .await
            .map_err(from_sqlx)?;
        c.last_sent = Instant::now();
        let pid = c.pid;
        let wait = sqlx::query("SELECT pg_advisory_lock($1)")
            .bind(r.names.gate)
            .execute(&mut c.conn);
        match self.inner.watched(pid, wait).await? {
            Ok(_) => {}
            Err(e) if sqlstate(&e).as_deref() == Some("55P03") => return Ok(SemOutcome::Timeout),
            Err(e) if cancelled(&e) => return Ok(SemOutcome::Cancelled),
            Err(e) => return Err(from_sqlx(e)),
        }
        // First in line. Wake on NOTIFY of a release; a session that ended by its idle
        // timeout or was terminated sends none, so look again when the first idle holder's
        // timeout runs out, and at least every WAIT_CHECK (which also keeps this session, idle
        // meanwhile, within its own idle timeout).
        let cap = WAIT_CHECK
            .min(r.opts.ttl / 3)
            .max(Duration::from_millis(10));
        let mut listener: Option<PgListener> = None;
        loop {
            let status = self.inner.status_on(c, &self.q(), &r.keys).await?;
            if status.rows.iter().any(|s| !s.held)
                && let Some((slot, token, sent)) = self.try_slots(c, r, &status).await?
            {
                self.unlock(c, r, true).await?;
                return Ok(SemOutcome::Granted { slot, token, sent });
            }
            let Some(l) = listener.as_mut() else {
                // Listen before the next look, so no release between the two is missed.
                listener = Some(self.listen(&r.names.channel).await?);
                continue;
            };
            let recheck = status.recheck(cap);
            let until = match r.deadline {
                Some(d) => recheck.min(d),
                None => recheck,
            };
            tokio::select! {
                got = l.try_recv() => {
                    got.map_err(from_sqlx)?;
                    while l.next_buffered().is_some() {}
                }
                () = tokio::time::sleep_until(until) => {
                    if r.deadline.is_some_and(|d| Instant::now() >= d) {
                        return Ok(SemOutcome::Timeout);
                    }
                }
            }
        }
    }

    /// Joins semaphore `r` as a member (the shared lock `members`), checking N: the N stored
    /// for the name is in force while anyone is a member or holds a slot; it is replaced only
    /// by a joiner holding `members` exclusively (no other member) while no slot is held.
    /// `Ok(false)`: the server cancelled the wait for the members lock (`pg_cancel_backend`).
    async fn join(&self, c: &mut Conn, r: &SemReq<'_>) -> Result<bool> {
        let q = self.q();
        let n = r.names;
        let mut theirs = None;
        for attempt in 0..JOIN_TRIES {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(20 * u64::from(attempt))).await;
            }
            c.last_sent = Instant::now();
            let alone: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
                .bind(n.members)
                .fetch_one(&mut c.conn)
                .await
                .map_err(from_sqlx)?;
            let stored = self.stored_permits(c, &q, n).await?;
            if alone {
                if stored != Some(r.permits) {
                    let busy = match stored {
                        Some(old) => self
                            .inner
                            .status_on(c, &q, &self.slot_keys(n, old))
                            .await?
                            .rows
                            .iter()
                            .any(|s| s.held),
                        None => false,
                    };
                    if busy {
                        c.last_sent = Instant::now();
                        sqlx::query("SELECT pg_advisory_unlock($1)")
                            .bind(n.members)
                            .execute(&mut c.conn)
                            .await
                            .map_err(from_sqlx)?;
                        return Err(mismatch(n, r.permits, stored));
                    }
                    let set = format!(
                        "INSERT INTO {q}.slot_names AS s (key, name, permits) VALUES ($1, $2, $3) \
                         ON CONFLICT (key) DO UPDATE SET permits = excluded.permits \
                         WHERE s.name = excluded.name RETURNING 1"
                    );
                    c.last_sent = Instant::now();
                    let done: Option<i32> = sqlx::query_scalar(&set)
                        .bind(n.members)
                        .bind(&n.base)
                        .bind(i32::try_from(r.permits).unwrap_or(i32::MAX))
                        .fetch_optional(&mut c.conn)
                        .await
                        .map_err(from_sqlx)?;
                    if done.is_none() {
                        return Err(backend(Msg(format!(
                            "advisory lock key collision for semaphore {:?}; rename it",
                            n.base
                        ))));
                    }
                }
                // Shared on top of our exclusive lock, then the exclusive one goes.
                c.last_sent = Instant::now();
                sqlx::query("SELECT pg_advisory_lock_shared($1), pg_advisory_unlock($1)")
                    .bind(n.members)
                    .execute(&mut c.conn)
                    .await
                    .map_err(from_sqlx)?;
                return Ok(true);
            }
            // Others are members: they agree on the stored N, which cannot change while we
            // hold the shared lock. (It waits while a joiner holds it exclusively.)
            c.last_sent = Instant::now();
            match sqlx::query("SELECT pg_advisory_lock_shared($1)")
                .bind(n.members)
                .execute(&mut c.conn)
                .await
            {
                Ok(_) => {}
                Err(e) if cancelled(&e) => return Ok(false),
                Err(e) => return Err(from_sqlx(e)),
            }
            let stored = self.stored_permits(c, &q, n).await?;
            if stored == Some(r.permits) {
                return Ok(true);
            }
            theirs = stored;
            c.last_sent = Instant::now();
            sqlx::query("SELECT pg_advisory_unlock_shared($1)")
                .bind(n.members)
                .execute(&mut c.conn)
                .await
                .map_err(from_sqlx)?;
        }
        Err(mismatch(n, r.permits, theirs))
    }

    async fn stored_permits(&self, c: &mut Conn, q: &str, n: &Names) -> Result<Option<u32>> {
        c.last_sent = Instant::now();
        let stored: Option<i32> = sqlx::query_scalar(&format!(
            "SELECT permits FROM {q}.slot_names WHERE key = $1 AND name = $2"
        ))
        .bind(n.members)
        .bind(&n.base)
        .fetch_optional(&mut c.conn)
        .await
        .map_err(from_sqlx)?;
        Ok(stored.and_then(|p| u32::try_from(p).ok()))
    }

    /// Tries the free slots in order: the first one granted, with its token bumped and its
    /// holder row written in the same statement.
    async fn try_slots(
        &self,
        c: &mut Conn,
        r: &SemReq<'_>,
        status: &Status,
    ) -> Result<Option<(u32, i64, Instant)>> {
        let q = self.q();
        let sql = format!(
            "WITH l AS MATERIALIZED (SELECT pg_try_advisory_lock($1) AS ok), \
             b AS (INSERT INTO {q}.fence AS f (key, name, token) SELECT $1, $2, 1 FROM l WHERE l.ok \
                   ON CONFLICT (key) DO UPDATE SET token = f.token + 1 \
                   WHERE f.name = excluded.name RETURNING f.token), \
             v AS (INSERT INTO {q}.slot_holders AS h (key, name, slot, token, pid, ttl_ms, value) \
                   SELECT $1, $2, $3, b.token, pg_backend_pid(), $4, ''::bytea FROM b \
                   ON CONFLICT (key) DO UPDATE SET name = excluded.name, slot = excluded.slot, \
                     token = excluded.token, pid = excluded.pid, ttl_ms = excluded.ttl_ms, \
                     value = excluded.value, version = 0 \
                   RETURNING h.slot, h.token), \
             n AS (SELECT pg_notify($5, 'g ' || v.slot || ' ' || v.token || ' 0 ') FROM v) \
             SELECT l.ok, (SELECT token FROM b), (SELECT count(*) FROM n) FROM l"
        );
        for row in status.rows.iter().filter(|s| !s.held) {
            let i = row.slot as usize;
            let (Some(key), Some(full)) = (r.keys.get(i), r.fulls.get(i)) else {
                continue;
            };
            let sent = Instant::now();
            let (ok, token, _): (bool, Option<i64>, i64) = sqlx::query_as(&sql)
                .bind(key)
                .bind(full)
                .bind(i32::try_from(row.slot).unwrap_or(0))
                .bind(i64::try_from(ttl_ms(r.opts.ttl)).unwrap_or(i64::MAX))
                .bind(&r.names.channel)
                .fetch_one(&mut c.conn)
                .await
                .map_err(from_sqlx)?;
            c.last_sent = sent;
            match (ok, token) {
                (true, Some(t)) => return Ok(Some((row.slot, t, sent))),
                (true, None) => {
                    return Err(backend(Msg(format!(
                        "advisory lock key collision for {full:?}; rename the semaphore"
                    ))));
                }
                (false, _) => {}
            }
        }
        Ok(None)
    }

    /// Gives back the members lock (and the gate) once a slot is held or the acquire ends
    /// empty-handed.
    async fn unlock(&self, c: &mut Conn, r: &SemReq<'_>, gate: bool) -> Result<()> {
        c.last_sent = Instant::now();
        let res = if gate {
            sqlx::query("SELECT pg_advisory_unlock_shared($1), pg_advisory_unlock($2)")
                .bind(r.names.members)
                .bind(r.names.gate)
                .execute(&mut c.conn)
                .await
        } else {
            sqlx::query("SELECT pg_advisory_unlock_shared($1)")
                .bind(r.names.members)
                .execute(&mut c.conn)
                .await
        };
        res.map_err(from_sqlx)?;
        Ok(())
    }

    /// A connection of its own listening on `channel` (sqlx reconnects it, and says so, if
    /// the connection is lost).
    async fn listen(&self, channel: &str) -> Result<PgListener> {
        let t = self.inner.config.connect_timeout;
        let open = async {
            let pool = PgPoolOptions::new()
                .max_connections(1)
                .acquire_timeout(t)
                .connect_lazy_with(self.inner.config.connect.clone());
            let mut l = PgListener::connect_with(&pool)
                .await
                .map_err(crate::core::connect_error)?;
            l.listen(channel).await.map_err(from_sqlx)?;
            Ok::<_, Error>(l)
        };
        tokio::time::timeout(t, open).await.unwrap_or_else(|_| {
            Err(unavailable(Msg(format!(
                "connecting timed out after {t:?}"
            ))))
        })
    }

    /// The status of `n`'s slots now (N of them for a semaphore), or `None` if it was never
    /// used (no tables, or a semaphore without N). Within the connect timeout.
    async fn read_status(&self, n: &Names) -> Result<Option<(u32, Status)>> {
        self.inner
            .within(async {
                let (mut c, _) = self.inner.checkout().await?;
                let res = self.read_status_on(&mut c, n).await;
                if res.is_ok() {
                    self.inner.put_idle(c);
                }
                res
            })
            .await
    }

    async fn read_status_on(&self, c: &mut Conn, n: &Names) -> Result<Option<(u32, Status)>> {
        let q = self.q();
        if !self.inner.all_tables_exist(c).await? {
            return Ok(None);
        }
        if n.kind != SlotKind::Semaphore {
            let mut s = self.inner.status_on(c, &q, &[self.slot_key(n, 0)]).await?;
            s.active = s.rows.iter().any(|r| r.held && r.holder.is_some());
            return Ok(Some((1, s)));
        }
        c.last_sent = Instant::now();
        let row: Option<(i32, bool)> = sqlx::query_as(&format!(
            "SELECT s.permits, EXISTS (SELECT 1 FROM pg_locks l WHERE {held}) \
             FROM {q}.slot_names s WHERE s.key = $1 AND s.name = $2",
            held = held_on("$1")
        ))
        .bind(n.members)
        .bind(&n.base)
        .fetch_optional(&mut c.conn)
        .await
        .map_err(from_sqlx)?;
        let Some((permits, joined)) = row else {
            return Ok(None);
        };
        let permits = u32::try_from(permits).unwrap_or(1);
        let mut s = self
            .inner
            .status_on(c, &q, &self.slot_keys(n, permits))
            .await?;
        s.active = joined || s.rows.iter().any(|r| r.held);
        Ok(Some((permits, s)))
    }
}

fn mismatch(n: &Names, ours: u32, theirs: Option<u32>) -> Error {
    Error::PermitsMismatch {
        name: n.name.clone(),
        ours,
        theirs: theirs.unwrap_or(0),
    }
}

/// One granted slot: the lock's lease (renewal, release, loss detection) plus the slot's row
/// and its `NOTIFY`s.
struct PgSlotLease {
    lease: PgLease,
    inner: Arc<Inner>,
    schema_q: String,
    name: String,
    key: i64,
    slot: u32,
    token: i64,
    channel: String,
}

impl fmt::Debug for PgSlotLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgSlotLease")
            .field("lease", &self.lease)
            .field("token", &self.token)
            .finish()
    }
}

impl PgSlotLease {
    /// After a release: drops the row (if still ours) and tells the name's waiters and
    /// observers. Best effort: waiters and observers also look again on their own.
    async fn announce_release(&self) {
        let sql = format!(
            "WITH d AS (DELETE FROM {q}.slot_holders WHERE key = $1 AND token = $2 RETURNING 1) \
             SELECT (SELECT count(*) FROM d), \
                    (SELECT count(*) FROM pg_notify($3, 'r ' || $4::int4 || ' ' || $2::int8) AS n)",
            q = self.schema_q
        );
        let inner = &self.inner;
        let res = inner
            .within(async {
                let (mut c, _) = inner.checkout().await?;
                c.last_sent = Instant::now();
                sqlx::query(&sql)
                    .bind(self.key)
                    .bind(self.token)
                    .bind(&self.channel)
                    .bind(i32::try_from(self.slot).unwrap_or(0))
                    .execute(&mut c.conn)
                    .await
                    .map_err(from_sqlx)?;
                inner.put_idle(c);
                Ok(())
            })
            .await;
        if let Err(e) = res {
            tracing::debug!(name = %self.name, error = %e, "could not announce a released slot");
        }
    }
}

#[async_trait]
impl LeaseOps for PgSlotLease {
    async fn renew(&self, ttl: Duration) -> Result<()> {
        self.lease.renew(ttl).await
    }

    async fn check(&self) -> Result<()> {
        self.lease.check().await
    }

    async fn release(&self) -> Result<()> {
        let res = self.lease.release().await;
        if res.is_ok() {
            self.announce_release().await;
        }
        res
    }

    async fn relinquish(&self) -> Result<()> {
        self.lease.relinquish().await
    }

    fn self_renewing(&self) -> bool {
        self.lease.self_renewing()
    }

    fn as_any(&self) -> &dyn Any {
        self.lease.as_any()
    }
}

#[async_trait]
impl SlotOps for PgSlotLease {
    /// Replaces the row's value if this grant's session still holds the slot, and `NOTIFY`s.
    async fn set_value(&self, value: &[u8]) -> Result<()> {
        let sql = format!(
            "WITH u AS (UPDATE {q}.slot_holders SET value = $3, version = version + 1 \
                        WHERE key = $1 AND token = $2 AND pid = $4 AND EXISTS \
                          (SELECT 1 FROM pg_locks l WHERE {held} AND l.pid = $4) \
                        RETURNING slot, token, version, value) \
             SELECT count(*) FROM u AS v, LATERAL pg_notify($5, 'g ' || v.slot || ' ' || v.token || ' ' || v.version || ' ' || translate(encode(v.value, 'base64'), E'\\n', '')) AS n",
            q = self.schema_q,
            held = held_on("$1")
        );
        let inner = &self.inner;
        let updated: i64 = inner
            .within(async {
                let (mut c, _) = inner.checkout().await?;
                c.last_sent = Instant::now();
                let n = sqlx::query_scalar(&sql)
                    .bind(self.key)
                    .bind(self.token)
                    .bind(value)
                    .bind(self.lease.backend_pid())
                    .bind(&self.channel)
                    .fetch_one(&mut c.conn)
                    .await
                    .map_err(from_sqlx)?;
                inner.put_idle(c);
                Ok(n)
            })
            .await?;
        if updated == 0 {
            return Err(Error::NotHeld {
                name: self.name.clone(),
            });
        }
        Ok(())
    }
}

/// An observer's watch: `LISTEN` on the name's channel; every grant, proclaim and release
/// `NOTIFY`s with what changed (`g {slot} {token} {version} {base64 value}` or
/// `r {slot} {token}`), delivered in commit order, which the watch applies in turn. A read of
/// the slots, at the first holder's possible idle-timeout end and at least every
/// [`WAIT_CHECK`], finds what sends no notification (a lapsed or terminated holder) and, after
/// a reconnect, the state behind the lost notifications.
struct PgWatch {
    lock: PgLock,
    names: Names,
    listener: PgListener,
    /// Per slot: the last token and value version applied, and the value while held.
    slots: Vec<SlotState>,
    /// The holders last delivered.
    last: Vec<SlotHolder>,
    pending: VecDeque<WatchEvent>,
    recheck: Instant,
    /// Notifications may have been lost (an error, or the listener reconnected): read the
    /// state and emit it after a `Missed` before anything else.
    resync: bool,
}

#[derive(Debug, Clone)]
struct SlotState {
    slot: u32,
    token: u64,
    version: u64,
    /// The value while held.
    value: Option<Vec<u8>>,
}

/// One change as a notification or a read tells it.
enum Change {
    Held {
        slot: u32,
        token: u64,
        version: u64,
        value: Vec<u8>,
    },
    Free {
        slot: u32,
        token: u64,
    },
}

fn parse_payload(p: &str) -> Option<Change> {
    use base64::Engine as _;
    let mut it = p.split(' ');
    let kind = it.next()?;
    let slot = it.next()?.parse().ok()?;
    let token = it.next()?.parse().ok()?;
    match kind {
        "g" => {
            let version = it.next()?.parse().ok()?;
            let value = base64::engine::general_purpose::STANDARD
                .decode(it.next().unwrap_or(""))
                .ok()?;
            Some(Change::Held {
                slot,
                token,
                version,
                value,
            })
        }
        "r" => Some(Change::Free { slot, token }),
        _ => None,
    }
}

impl fmt::Debug for PgWatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgWatch")
            .field("name", &self.names.name)
            .finish_non_exhaustive()
    }
}

impl PgWatch {
    fn state(&mut self, slot: u32) -> &mut SlotState {
        let i = match self.slots.iter().position(|s| s.slot == slot) {
            Some(i) => i,
            None => {
                self.slots.push(SlotState {
                    slot,
                    token: 0,
                    version: 0,
                    value: None,
                });
                self.slots.len() - 1
            }
        };
        &mut self.slots[i]
    }

    /// Applies `change` if it is newer than what was applied; `Some(missed)` if it was
    /// (`missed`: a change between the two was not seen).
    fn apply(&mut self, change: Change) -> Option<bool> {
        match change {
            Change::Held {
                slot,
                token,
                version,
                value,
            } => {
                let st = self.state(slot);
                if (token, version) <= (st.token, st.version) {
                    return None;
                }
                let missed = if token > st.token {
                    token > st.token + 1 || version > 0
                } else {
                    version > st.version + 1 || st.value.is_none()
                };
                *st = SlotState {
                    slot,
                    token,
                    version,
                    value: Some(value),
                };
                Some(missed)
            }
            Change::Free { slot, token } => {
                let st = self.state(slot);
                if token < st.token || (token == st.token && st.value.is_none()) {
                    return None;
                }
                let missed = token > st.token;
                st.token = token;
                st.value = None;
                Some(missed)
            }
        }
    }

    fn holders(&self) -> Vec<SlotHolder> {
        let mut h: Vec<SlotHolder> = self
            .slots
            .iter()
            .filter_map(|s| {
                let v = s.value.clone()?;
                Some(SlotHolder::new(
                    s.slot,
                    self.lock.slot_token(&self.names, s.slot, s.token),
                    v,
                    None,
                ))
            })
            .collect();
        h.sort_by_key(|h| h.slot);
        h
    }

    /// Reads the slots and applies what is newer; `true` if a change was not seen: a token or
    /// value version skipped, or a new token while the last one applied was still held (its
    /// end and any value it proclaimed meanwhile are only in notifications not yet read).
    async fn read(&mut self) -> Result<bool> {
        let status = self.lock.read_status(&self.names).await?;
        self.recheck = match &status {
            Some((_, s)) => s.recheck(WAIT_CHECK),
            None => Instant::now() + WAIT_CHECK,
        };
        let mut missed = false;
        for r in status.map(|(_, s)| s.rows).unwrap_or_default() {
            if r.held && r.holder.is_none() {
                // Being granted (locked, row not yet written): its NOTIFY follows.
                continue;
            }
            let change = match r.holder {
                Some((token, value)) => Change::Held {
                    slot: r.slot,
                    token,
                    version: r.version,
                    value,
                },
                None => Change::Free {
                    slot: r.slot,
                    token: r.granted.unwrap_or(0),
                },
            };
            let jumped = match &change {
                Change::Held { slot, token, .. } => {
                    let st = self.state(*slot);
                    *token > st.token && st.value.is_some()
                }
                Change::Free { .. } => false,
            };
            missed |= self.apply(change).is_some_and(|m| m || jumped);
        }
        Ok(missed)
    }

    /// Queues the state if it changed, after a `Missed` if `missed`.
    fn emit(&mut self, missed: bool) {
        let now = self.holders();
        if missed {
            self.pending.push_back(WatchEvent::Missed);
        }
        if missed || now != self.last {
            self.last = now.clone();
            self.pending.push_back(WatchEvent::Holders(now));
        }
    }
}

#[async_trait]
impl SlotWatch for PgWatch {
    async fn next(&mut self) -> Result<WatchEvent> {
        let res = self.next_inner().await;
        if res.is_err() {
            // The listener reconnects on the next call, silently: what was sent meanwhile is
            // lost, so that call starts with a read and a `Missed`.
            self.resync = true;
        }
        res
    }
}

impl PgWatch {
    async fn next_inner(&mut self) -> Result<WatchEvent> {
        loop {
            if let Some(e) = self.pending.pop_front() {
                return Ok(e);
            }
            if self.resync {
                // Cleared only once the state is read: a failed read is retried next call.
                let _ = self.read().await?;
                self.resync = false;
                self.emit(true);
                continue;
            }
            let note = tokio::select! {
                got = self.listener.try_recv() => Some(got.map_err(from_sqlx)?),
                () = tokio::time::sleep_until(self.recheck) => None,
            };
            match note {
                Some(Some(n)) => {
                    let mut notes = vec![n];
                    while let Some(n) = self.listener.next_buffered() {
                        notes.push(n);
                    }
                    for n in notes {
                        match parse_payload(n.payload()) {
                            Some(change) => {
                                if let Some(missed) = self.apply(change) {
                                    self.emit(missed);
                                }
                            }
                            None => {
                                let missed = self.read().await?;
                                self.emit(missed);
                            }
                        }
                    }
                }
                // The connection was lost (and re-established): notifications are gone.
                Some(None) => self.resync = true,
                None => {
                    let missed = self.read().await?;
                    self.emit(missed);
                }
            }
        }
    }
}

/// Elections and semaphores on PostgreSQL: slots are lock leases on derived names (see the
/// module docs and docs/election-semaphore.md).
#[async_trait]
impl SlotBackend for PgLock {
    /// Grants a slot.
    ///
    /// - **Election**: the lock `elect/{name}` through the lock's own path (try-lock, or wait
    ///   FIFO in the server's lock queue), then the leader's row and a `NOTIFY`.
    /// - **Semaphore**: join the name (a shared advisory lock; N checked against
    ///   `{schema}.slot_names`), then try the free slots in order; a waiting acquire first
    ///   queues on the name's gate lock (FIFO in the server's lock queue) and, first in line,
    ///   takes the next slot that frees, woken by the releaser's `NOTIFY` or, for a holder
    ///   whose session ended without one, at that holder's idle-timeout end (at least every
    ///   3 s).
    ///
    /// # Errors
    /// As [`Lock::acquire`](lockkit_core::Lock::acquire), plus [`Error::PermitsMismatch`].
    ///
    /// # Cancel safety
    /// Cancel safe: the acquire runs on a connection it owns; dropping it cancels a wait for
    /// the gate on another connection (`pg_cancel_backend`, as a lock's wait) and closes the
    /// connection, which ends the session and so its place in line, its members and gate
    /// locks and any slot granted meanwhile.
    async fn grant_slot(&self, req: SlotRequest<'_>, opts: AcquireOptions) -> Result<SlotGrant> {
        req.validate()?;
        opts.validate()?;
        let n = self.names(req.kind, req.name);
        let (conn, slot, token, sent) = match req.kind {
            SlotKind::Semaphore => {
                let start = Instant::now();
                let r = SemReq {
                    names: &n,
                    permits: req.permits,
                    keys: self.slot_keys(&n, req.permits),
                    fulls: (0..req.permits).map(|s| self.slot_full(&n, s)).collect(),
                    opts: &opts,
                    start,
                    deadline: wait_deadline(opts.wait, start),
                };
                let attempts = retry_transient(&opts, r.deadline, || self.sem_attempt(&r));
                let g = if opts.wait == Wait::No {
                    let t = self.inner.config.connect_timeout;
                    tokio::time::timeout(t, attempts).await.map_err(|_| {
                        unavailable(Msg(format!(
                            "no answer from the server within the connect timeout ({t:?})"
                        )))
                    })??
                } else {
                    attempts.await?
                };
                (g.conn, g.slot, g.token, g.sent)
            }
            _ => {
                let (c, token, sent) = self.grant_election(&n, req.value, &opts).await?;
                (c, 0, token, sent)
            }
        };
        let token_u = u64::try_from(token)
            .map_err(|_| backend(Msg("negative fencing token in the fence table".into())))?;
        let key = self.slot_key(&n, slot);
        let tracker = TrackerHandle::new(sent, opts.ttl);
        // Lock-delay is refused for slots (see slot_guarantees).
        let adopted = Adopted {
            key,
            token,
            tracker: tracker.clone(),
            lock_delay: false,
            auto: opts.keepalive,
        };
        let grant = self.sessions.adopt(&self.inner, conn, adopted);
        let lease = PgLease::new(req.name, grant, opts.keepalive);
        let ops = Arc::new(PgSlotLease {
            lease,
            inner: self.inner.clone(),
            schema_q: self.q(),
            name: req.name.to_owned(),
            key,
            slot,
            token,
            channel: n.channel.clone(),
        });
        let lease = Lease::new(
            req.name,
            self.slot_token(&n, slot, token_u),
            tracker,
            ops.clone(),
            &opts,
        );
        Ok(SlotGrant::new(lease, slot, ops))
    }

    /// Reads `pg_locks`, the holders' rows and (semaphore) the N in force; the time left is
    /// the holder session's idle timeout left, if it is idle.
    ///
    /// # Errors
    /// [`Error::InvalidName`]; [`Error::Unavailable`] if no answer came within the connect
    /// timeout.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    async fn slot_holders(&self, kind: SlotKind, name: &str) -> Result<Option<SlotHolders>> {
        validate_slot_name(kind, name)?;
        let n = self.names(kind, name);
        Ok(self
            .read_status(&n)
            .await?
            .filter(|(_, s)| s.active)
            .map(|(permits, s)| SlotHolders::new(permits, s.holders(self, &n, true))))
    }

    /// `LISTEN`s on the name's channel (a connection of its own per watch).
    ///
    /// # Errors
    /// [`Error::InvalidName`]; connection errors.
    ///
    /// # Cancel safety
    /// Cancel safe: a dropped call closes the connection it was opening.
    async fn watch_slots(&self, kind: SlotKind, name: &str) -> Result<Box<dyn SlotWatch>> {
        validate_slot_name(kind, name)?;
        let names = self.names(kind, name);
        let listener = self.listen(&names.channel).await?;
        let mut w = PgWatch {
            lock: self.clone(),
            names,
            listener,
            slots: Vec::new(),
            last: Vec::new(),
            pending: VecDeque::new(),
            recheck: Instant::now(),
            resync: false,
        };
        // The first state is the one when `observe` returned.
        let _ = w.read().await?;
        let now = w.holders();
        w.last = now.clone();
        w.pending.push_back(WatchEvent::Holders(now));
        Ok(Box::new(w))
    }

    fn slot_guarantees(&self) -> SlotGuarantees {
        let mut lock = LockBackend::guarantees(self);
        lock.lock_delay = false;
        let mut g = SlotGuarantees::new(lock);
        g.observe = true;
        g.every_change_observed = false;
        g.notes = "slots are lock leases on derived names (elect/{name}, sem/{name}/{slot}): \
                    the lock's guarantees hold; observers LISTEN, and a notification sent \
                    while an observer's connection is down is lost (it then gets Missed); a \
                    holder whose session ended without a release is seen at its idle timeout \
                    or within 3 s";
        g
    }
}
