//! Holder sessions: the server sessions that hold the advisory locks of a
//! [`PgLock`](crate::PgLock)'s leases, many leases per session.
//!
//! - A **shared** session holds up to [`SESSION_LEASES`] keepalive leases of one TTL (its
//!   `idle_session_timeout` is that TTL). Try-once grants run on it (the grant statement of a
//!   lease taken by hand), releases unlock on it, and it renews itself: one statement every
//!   TTL/3 (none if another statement ran meanwhile), which restarts the server's idle timer
//!   for all its leases and confirms all of them. The sessions of one TTL form a pool; a grant
//!   takes the first one with room, and a new one is opened when all are full.
//! - A **solo** session holds one lease renewed by hand (`keepalive(false)`): its expiry must
//!   follow that lease's own renewals, which a shared session cannot do (any lease's statement
//!   restarts its idle timer).
//!
//! **Who runs the statements.** The session's connection sits behind an async mutex. A caller
//! (grant, release, renewal by hand, check) takes it and runs its statement itself, on its own
//! task: no message to another task and no reply back, so a grant costs what the statement
//! costs. (An earlier design ran every statement in a task per session; the two task hand-offs
//! per statement made an uncontended acquire + release 1.6× the same statements by hand.)
//! Each session also has a *keeper* task, which takes the same mutex only for the renewal
//! every TTL/3 (when no other statement ran meanwhile), to unlock leases that lapsed, and for
//! the clean-up below.
//!
//! **Cancel safety.** A caller that drops its future mid-statement leaves the statement to
//! sqlx, which finishes reading it (or sends its unsent rest) before the connection's next
//! statement. What the statement may have done on the server is written down *before* it is
//! sent (`State::pending`: keys to unlock): a dropped grant (it may have taken the lock), a
//! dropped release; a grant handed over but dropped before a [`PgLease`](crate::PgLease) took
//! it ([`Grant`]'s drop). Whoever takes the connection next, the keeper (woken at the drop)
//! or a caller, runs those unlocks before any other statement, so no later grant of the same
//! key on the session can be undone by them. A dropped renewal by hand of a solo session
//! closes the session instead (a statement the server has yet to read cannot extend it).
//!
//! **Loss notice.** While no statement runs, the keeper reads the idle connection (it polls
//! sqlx's read of it whenever it can take the mutex without waiting, and each caller, when it
//! lets go of the connection, registers the keeper's waker for the next read), so when the
//! server ends the session (`pg_terminate_backend`, restart, idle timeout) all its leases are
//! marked lost at once, within milliseconds. A watch task per `PgLock` checks every
//! [`SESSION_CHECK`](crate::SESSION_CHECK) on another connection that the sessions exist (for
//! a connection that died silently).
//!
//! A lease whose holder stops renewing it while the session lives on (its [`PgLease`] dropped
//! without release, or lost on the client side) is unlocked by the keeper at its client-side
//! deadline, without deleting its lock-delay row: it lapses as it would on its own session.
//!
//! [`PgLease`]: crate::PgLease

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use lockkit_core::backend::TrackerHandle;
use lockkit_core::{Error, Instant, LeaseState, LossReason, Result};
use tokio::sync::Notify;

use crate::core::{Conn, GrantRow, Inner, SESSION_CHECK, Sql};
use crate::error::{Msg, from_sqlx, unavailable};

/// The most leases one shared holder session carries: 1,000. With PostgreSQL's default
/// `max_connections` (100), 10,000 leases of one TTL take 10 sessions; each session runs one
/// statement at a time, so more sessions also mean more grants in parallel.
pub const SESSION_LEASES: usize = 1000;

/// The answer to a try-once grant on a shared session.
pub(crate) enum TryGrant {
    Granted(Grant),
    /// Held by another session (or a lock-delay is pending); nothing is held.
    Held,
    /// Another name (the stored one) maps to the key; nothing is held.
    Collision(Option<String>),
}

/// A lease held on a holder session, until a [`PgLease`](crate::PgLease) takes it over. If it
/// is dropped before that (the acquire was cancelled), the lock is released.
pub(crate) struct Grant {
    pub(crate) holder: Arc<Holder>,
    pub(crate) key: i64,
    pub(crate) token: i64,
    pub(crate) tracker: TrackerHandle,
    armed: bool,
}

impl Grant {
    /// Hands the lease to its new owner, who releases it from now on.
    pub(crate) fn take(mut self) -> (Arc<Holder>, i64, TrackerHandle) {
        self.armed = false;
        (self.holder.clone(), self.key, self.tracker.clone())
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        if self.armed {
            self.holder.give_back(self.key, false);
        }
    }
}

/// A lease granted on a connection of its own, for [`Sessions::adopt`].
pub(crate) struct Adopted {
    pub(crate) key: i64,
    pub(crate) token: i64,
    pub(crate) tracker: TrackerHandle,
    /// A lock-delay row was written at the grant.
    pub(crate) lock_delay: bool,
    /// Kept alive by lockkit (shared session), else renewed by hand (solo).
    pub(crate) auto: bool,
}

/// A place on a shared session taken for a grant in flight; given up when dropped.
pub(crate) struct Reservation(Arc<Holder>);

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut st = self.0.state();
        st.reserved = st.reserved.saturating_sub(1);
    }
}

/// An unlock owed on the session: of a lease released or given back, or of a grant or release
/// whose caller was dropped while its statement was in flight (it may have taken, or not yet
/// freed, the lock).
#[derive(Clone, Copy)]
struct Pending {
    key: i64,
    /// Also delete the key's lock-delay row if this session wrote it (see `release_delay`).
    delay: bool,
}

/// One holder session: its connection (behind an async mutex, see the module docs) and what
/// callers and the keeper know of it.
pub(crate) struct Holder {
    /// `pg_backend_pid()` of the session.
    pub(crate) pid: i32,
    /// Its `idle_session_timeout` in ms: the TTL of its leases.
    ttl_ms: u64,
    /// One lease renewed by hand (see the module docs).
    solo: bool,
    /// The connection; `None` once the session is closed or back in the idle cache.
    conn: tokio::sync::Mutex<Option<Conn>>,
    st: Mutex<State>,
    /// Wakes the keeper: owed unlocks, a lease no longer renewed, the session ended.
    wake: Notify,
    /// The keeper's waker, for the read of the idle connection.
    waker: Mutex<Option<Waker>>,
    sql: Arc<Sql>,
    inner: Weak<Inner>,
    sessions: Weak<Sessions>,
    connect_timeout: Duration,
    /// A renewal by hand was dropped mid-statement, which closed the (solo) session.
    pub(crate) renew_dropped: AtomicBool,
}

struct State {
    leases: HashMap<i64, Held>,
    /// Grants in flight to this session.
    reserved: usize,
    /// Ended or retired: takes no more grants.
    dead: bool,
    /// Id in the `PgLock`'s session watch.
    watch: u64,
    /// Unlocks owed, run before any other statement (see the module docs).
    pending: Vec<Pending>,
    /// Releases whose lease has left `leases` but whose unlock has not run yet: the session
    /// is not retired meanwhile.
    unlocking: usize,
    /// A statement was dropped in flight: the keeper settles the connection (sqlx finishes
    /// it) before it reads the idle connection again.
    dirty: bool,
    /// A caller's read of the idle connection found it closed by the server.
    closed: bool,
    /// Leases not confirmed by the session's renewals: unlocked at their deadline.
    manual: HashSet<i64>,
    /// Send time of the statement the leases were last confirmed with.
    last_renew: Instant,
    /// Send time of the last statement that succeeded (it restarted the idle timer).
    last_ok: Instant,
    /// When the last grant was asked for.
    last_grant: Instant,
}

struct Held {
    tracker: TrackerHandle,
    /// Confirmed by the session's renewals (false: renewed by hand, or dropped).
    auto: bool,
    /// A lock-delay row was written at the grant (a release deletes it).
    lock_delay: bool,
}

impl std::fmt::Debug for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Holder")
            .field("backend_pid", &self.pid)
            .field("ttl_ms", &self.ttl_ms)
            .field("solo", &self.solo)
            .finish_non_exhaustive()
    }
}

impl Holder {
    fn state(&self) -> MutexGuard<'_, State> {
        // Consistent after every statement; recover from a poisoned lock.
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn ttl(&self) -> Duration {
        Duration::from_millis(self.ttl_ms)
    }

    /// Marks all its leases lost (the session ended) and takes no more grants.
    fn fail(&self) {
        let leases: Vec<TrackerHandle> = {
            let mut st = self.state();
            st.dead = true;
            st.pending.clear();
            st.leases.drain().map(|(_, h)| h.tracker).collect()
        };
        self.wake.notify_one();
        if !leases.is_empty() {
            tracing::debug!(
                backend_pid = self.pid,
                leases = leases.len(),
                "the holder session ended; its leases are lost"
            );
        }
        for t in leases {
            t.mark_lost(LossReason::SessionExpired);
        }
    }

    /// Whether the session ended (or went back to the idle cache).
    pub(crate) fn gone(&self) -> bool {
        self.state().dead
    }

    /// How many leases it holds.
    pub(crate) fn leases(&self) -> usize {
        self.state().leases.len()
    }

    /// Gives lease `key` back without waiting: the keeper unlocks it (with `lapse`, its
    /// lock-delay row stays).
    pub(crate) fn give_back(&self, key: i64, lapse: bool) {
        {
            let mut st = self.state();
            let Some(h) = st.leases.remove(&key) else {
                return;
            };
            st.manual.remove(&key);
            st.pending.push(Pending {
                key,
                delay: h.lock_delay && !lapse,
            });
        }
        self.wake.notify_one();
    }

    /// The lease was dropped without a release: no longer renewed, unlocked at its deadline.
    pub(crate) fn abandon(&self, key: i64) {
        {
            let mut st = self.state();
            let Some(h) = st.leases.get_mut(&key) else {
                return;
            };
            h.auto = false;
            st.manual.insert(key);
        }
        self.wake.notify_one();
    }

    /// Takes the connection, then runs the unlocks owed (see the module docs).
    async fn op(self: &Arc<Self>) -> Result<Op<'_>> {
        let conn = self.conn.lock().await;
        if conn.is_none() {
            return Err(session_gone());
        }
        let mut op = Op {
            h: self,
            conn,
            flight: Flight::Idle,
        };
        op.settle().await?;
        Ok(op)
    }

    /// Unlocks lease `key` (deleting its lock-delay row): whether the session held it.
    ///
    /// Cancel safe: a release dropped before its statement is answered is owed (see the
    /// module docs), so it still happens.
    pub(crate) async fn release(self: &Arc<Self>, key: i64) -> Result<bool> {
        let p = {
            let mut st = self.state();
            let Some(h) = st.leases.remove(&key) else {
                return Ok(false);
            };
            st.manual.remove(&key);
            st.unlocking += 1;
            Pending {
                key,
                delay: h.lock_delay,
            }
        };
        // Dropped last: a release dropped before its unlock ran leaves it owed first.
        let unlocking = Unlocking(self);
        let mut owed = Owed(self, Some(p));
        let mut op = self.op().await?;
        op.flight = Flight::Unlock(owed.1.take().unwrap_or(p));
        let held = op.unlock_one(p).await;
        op.flight = Flight::Idle;
        let held = held?;
        drop(unlocking);
        op.after_release();
        Ok(held)
    }

    /// A renewal by hand: one statement (on a solo session it also sets the idle timeout to
    /// `ttl_ms`) that checks the backend pid is unchanged.
    pub(crate) async fn renew(self: &Arc<Self>, ttl_ms: u64) -> Result<()> {
        let mut op = self.op().await?;
        let solo = self.solo;
        // A solo session's renewal dropped mid-statement closes the session, so that a
        // statement the server has yet to read cannot extend it (the lock is freed when the
        // server sees the close).
        op.flight = if solo { Flight::SoloRenew } else { Flight::Any };
        let sent = Instant::now();
        let res = if solo {
            let q = "SELECT pg_backend_pid() FROM (SELECT set_config('idle_session_timeout', $1, false)) s";
            match conn(&mut op.conn) {
                Ok(c) => {
                    let q = sqlx::query_scalar::<_, i32>(q)
                        .bind(ttl_ms.to_string())
                        .fetch_one(&mut c.conn);
                    stmt(self, q, sent).await
                }
                Err(e) => Err(e),
            }
        } else {
            op.ping(sent).await
        };
        op.flight = Flight::Idle;
        match res {
            Ok(pid) if pid == self.pid => {
                if solo && let Some(c) = op.conn.as_mut() {
                    c.idle_ms = ttl_ms;
                }
                Ok(())
            }
            Ok(pid) => {
                tracing::warn!(
                    expected = self.pid,
                    got = pid,
                    "renew reached another server session (connection pooler?); leases lost"
                );
                op.die();
                Err(session_gone())
            }
            Err(e) => {
                tracing::debug!(backend_pid = self.pid, error = %e, "renew failed: session gone");
                op.die();
                Err(from_sqlx(e))
            }
        }
    }

    /// Whether this session holds `key` (`pg_locks`).
    pub(crate) async fn check(self: &Arc<Self>, key: i64) -> Result<bool> {
        let mut op = self.op().await?;
        op.flight = Flight::Any;
        let (hi, lo) = ((key as u64 >> 32) as i64, (key as u64 & 0xffff_ffff) as i64);
        let sent = Instant::now();
        let c = conn(&mut op.conn).map_err(from_sqlx)?;
        let q = sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND pid = pg_backend_pid() AND classid = $1::bigint::oid \
             AND objid = $2::bigint::oid AND objsubid = 1)",
        )
        .bind(hi)
        .bind(lo)
        .fetch_one(&mut c.conn);
        let r = stmt(self, q, sent).await;
        op.flight = Flight::Idle;
        if r.as_ref().is_err_and(broken) {
            op.die();
        }
        r.map_err(from_sqlx)
    }

    /// Reads the idle connection with the keeper's waker (see the module docs): `Ready` if the
    /// server closed it. Never waits: if a caller has the connection, it registers the waker
    /// when it lets go.
    fn poll_closed(&self, cx: &mut Context<'_>) -> Poll<()> {
        self.set_waker(cx);
        match self.conn.try_lock() {
            Ok(mut g) => match g.as_mut() {
                Some(c) => read_idle(c, cx),
                None => Poll::Ready(()),
            },
            Err(_) => Poll::Pending,
        }
    }

    /// Keeps the keeper's waker, for callers to register on the idle connection.
    fn set_waker(&self, cx: &Context<'_>) {
        let mut w = self.waker.lock().unwrap_or_else(|p| p.into_inner());
        if !w.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            *w = Some(cx.waker().clone());
        }
    }

    /// The latest a statement may take: the connect timeout, and never past the leases' end
    /// (a session that does not answer is given up, which frees its locks when the server
    /// sees the close).
    fn deadline(&self) -> Instant {
        let d = Instant::now() + self.connect_timeout;
        let st = self.state();
        if st.leases.is_empty() {
            return d;
        }
        if self.solo {
            let end = st.leases.values().map(|h| h.tracker.valid_until()).min();
            return end.map_or(d, |e| {
                d.min(e.max(Instant::now() + Duration::from_millis(1)))
            });
        }
        d.min(st.last_renew + self.ttl())
    }

    /// When the next renewal (shared) or lapse of an unrenewed lease is due.
    fn next_wake(&self) -> Instant {
        let far = Instant::now() + Duration::from_secs(3600);
        let st = self.state();
        let renew = if self.solo {
            far
        } else {
            st.last_renew + self.ttl() / 3
        };
        st.manual
            .iter()
            .filter_map(|k| st.leases.get(k))
            .map(|h| h.tracker.valid_until())
            .fold(renew, Instant::min)
    }
}

/// Sqlx's read of the idle connection, polled once: `Ready` once the server closed it.
/// (`Conn::closed` is cancel safe: a message read in part stays in sqlx's buffer.)
fn read_idle(c: &mut Conn, cx: &mut Context<'_>) -> Poll<()> {
    pin!(c.closed()).poll(cx)
}

/// A release or give-back not yet handed to an [`Op`]: owed if dropped (see the module docs).
struct Owed<'a>(&'a Holder, Option<Pending>);

impl Drop for Owed<'_> {
    fn drop(&mut self) {
        if let Some(p) = self.1.take() {
            self.0.state().pending.push(p);
            self.0.wake.notify_one();
        }
    }
}

/// The connection of an [`Op`], if the session still has it.
fn conn(g: &mut Option<Conn>) -> std::result::Result<&mut Conn, sqlx::Error> {
    g.as_mut()
        .ok_or_else(|| sqlx::Error::Io(std::io::ErrorKind::NotConnected.into()))
}

/// Runs a statement sent at `sent` on `h`, bounded by the session's deadline.
async fn stmt<T>(
    h: &Holder,
    fut: impl Future<Output = std::result::Result<T, sqlx::Error>>,
    sent: Instant,
) -> std::result::Result<T, sqlx::Error> {
    let r = tokio::time::timeout_at(h.deadline(), fut)
        .await
        .unwrap_or_else(|_| Err(timed_out()));
    if r.is_ok() {
        let mut st = h.state();
        if sent > st.last_ok {
            st.last_ok = sent;
        }
    }
    r
}

/// A release in progress (see `State::unlocking`).
struct Unlocking<'a>(&'a Holder);

impl Drop for Unlocking<'_> {
    fn drop(&mut self) {
        let mut st = self.0.state();
        st.unlocking = st.unlocking.saturating_sub(1);
    }
}

/// What a statement in flight may leave behind if its caller is dropped.
#[derive(Clone, Copy)]
enum Flight {
    Idle,
    /// Nothing on the server (a read, a renewal of a shared session).
    Any,
    /// The lock `key` may be taken or not yet freed: owed.
    Unlock(Pending),
    /// A solo session's renewal: the session is closed.
    SoloRenew,
}

/// A holder session's connection, taken by a caller or the keeper (see the module docs).
struct Op<'a> {
    h: &'a Arc<Holder>,
    conn: tokio::sync::MutexGuard<'a, Option<Conn>>,
    flight: Flight,
}

impl Drop for Op<'_> {
    fn drop(&mut self) {
        let mut wake = false;
        match self.flight {
            Flight::Idle => {}
            Flight::Any => {
                self.h.state().dirty = true;
                wake = true;
            }
            Flight::Unlock(p) => {
                let mut st = self.h.state();
                st.pending.push(p);
                st.dirty = true;
                wake = true;
            }
            Flight::SoloRenew => {
                self.h.renew_dropped.store(true, Ordering::Release);
                self.h.state().dead = true;
                drop(self.conn.take());
                if let Some(s) = self.h.sessions.upgrade() {
                    s.remove(self.h);
                }
                wake = true;
            }
        }
        {
            let st = self.h.state();
            wake |= !st.pending.is_empty() || st.dead;
        }
        if !wake {
            // The keeper reads the idle connection from now on (see the module docs).
            let waker = self
                .h
                .waker
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            wake = match (waker, self.conn.as_mut()) {
                (Some(w), Some(c)) => {
                    let closed = read_idle(c, &mut Context::from_waker(&w)).is_ready();
                    if closed {
                        self.h.state().closed = true;
                    }
                    closed
                }
                _ => true,
            };
        }
        if wake {
            self.h.wake.notify_one();
        }
    }
}

impl Op<'_> {
    async fn ping(&mut self, sent: Instant) -> std::result::Result<i32, sqlx::Error> {
        let c = conn(&mut self.conn)?;
        let q = sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()").fetch_one(&mut c.conn);
        stmt(self.h, q, sent).await
    }

    /// The session failed or was given up: all its leases are lost, the connection is closed.
    fn die(&mut self) {
        self.flight = Flight::Idle;
        self.h.fail();
        drop(self.conn.take());
        if let Some(s) = self.h.sessions.upgrade() {
            s.remove(self.h);
        }
    }

    /// Runs the unlocks owed (and settles a connection a dropped statement left), before any
    /// other statement. They stay owed until their statement succeeded.
    async fn settle(&mut self) -> Result<()> {
        let (owed, dirty) = {
            let st = self.h.state();
            (st.pending.clone(), st.dirty)
        };
        if owed.is_empty() && !dirty {
            return Ok(());
        }
        let res = if owed.is_empty() {
            let sent = Instant::now();
            match self.ping(sent).await {
                Ok(pid) if pid == self.h.pid => Ok(()),
                Ok(_) => Err(session_gone()),
                Err(e) => Err(from_sqlx(e)),
            }
        } else {
            self.unlock(&owed).await.map(|_| ())
        };
        if let Err(e) = res {
            tracing::debug!(backend_pid = self.h.pid, error = %e, "unlock failed; ending the session");
            self.die();
            return Err(e);
        }
        {
            let mut st = self.h.state();
            let n = owed.len().min(st.pending.len());
            st.pending.drain(..n);
            st.dirty = false;
        }
        self.after_release();
        Ok(())
    }

    /// One release (`release_delay` if it deletes a lock-delay row, else
    /// `pg_advisory_unlock`): whether the session held the lock. A failure ends the session.
    async fn unlock_one(&mut self, p: Pending) -> Result<bool> {
        let r = self.unlock(&[p]).await.map(|n| n > 0);
        if r.is_err() {
            self.die();
        }
        r
    }

    /// Unlocks `owed` (one statement for those without a delay row, one each for the others):
    /// how many the session held.
    async fn unlock(&mut self, owed: &[Pending]) -> Result<usize> {
        let sql = self.h.sql.clone();
        let plain: Vec<i64> = owed.iter().filter(|p| !p.delay).map(|p| p.key).collect();
        let mut held = 0;
        for p in owed.iter().filter(|p| p.delay) {
            let sent = Instant::now();
            let c = conn(&mut self.conn).map_err(from_sqlx)?;
            let q = sqlx::query_scalar::<_, bool>(&sql.release_delay)
                .bind(p.key)
                .fetch_one(&mut c.conn);
            held += usize::from(stmt(self.h, q, sent).await.map_err(from_sqlx)?);
        }
        let sent = Instant::now();
        if let [key] = plain.as_slice() {
            let c = conn(&mut self.conn).map_err(from_sqlx)?;
            let q = sqlx::query_scalar::<_, bool>("SELECT pg_advisory_unlock($1)")
                .bind(key)
                .fetch_one(&mut c.conn);
            held += usize::from(stmt(self.h, q, sent).await.map_err(from_sqlx)?);
        } else if !plain.is_empty() {
            let c = conn(&mut self.conn).map_err(from_sqlx)?;
            let q = sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FILTER (WHERE pg_advisory_unlock(k)) FROM unnest($1::int8[]) AS k",
            )
            .bind(&plain)
            .fetch_one(&mut c.conn);
            let n = stmt(self.h, q, sent).await.map_err(from_sqlx)?;
            held += usize::try_from(n).unwrap_or(0);
        }
        Ok(held)
    }

    /// A session that holds nothing goes back to the idle cache: a solo one always, a shared
    /// one if its pool has another open session (a waiting acquire, which needs a connection
    /// of its own, then reuses this one instead of opening a new one).
    fn after_release(&mut self) {
        let empty = self.h.state().leases.is_empty();
        if empty && (self.h.solo || self.spare()) {
            self.retire();
        }
    }

    /// Whether another session of this shared session's pool is open.
    fn spare(&self) -> bool {
        let Some(sessions) = self.h.sessions.upgrade() else {
            return false;
        };
        let pools = sessions.pools();
        pools.get(&self.h.ttl_ms).is_some_and(|pool| {
            pool.iter()
                .any(|h| !Arc::ptr_eq(h, self.h) && !h.state().dead)
        })
    }

    /// Leaves the pool, if nothing is held, reserved or owed, and puts the connection back in
    /// the idle cache; `false` if a grant came meanwhile.
    fn retire(&mut self) -> bool {
        let sessions = self.h.sessions.upgrade();
        {
            let pools = sessions.as_ref().map(|s| s.pools());
            let mut st = self.h.state();
            if !st.leases.is_empty()
                || st.reserved > 0
                || st.unlocking > 0
                || !st.pending.is_empty()
                || st.dirty
            {
                return false;
            }
            st.dead = true;
            drop(pools);
        }
        if let Some(s) = &sessions {
            s.remove(self.h);
        }
        if let Some(mut c) = self.conn.take()
            && let Some(inner) = self.h.inner.upgrade()
        {
            c.last_sent = self.h.state().last_ok;
            inner.put_idle(c);
        }
        true
    }

    /// The grant statement (see `grant_sql` in core.rs) on this session, never waiting. A lock
    /// the statement took but cannot keep (a pending lock-delay, a key collision, an error) is
    /// given back at once.
    async fn grant(
        &mut self,
        key: i64,
        full: &str,
        delay_ms: i64,
        ttl: Duration,
    ) -> Result<TryGrant> {
        // Advisory locks are re-entrant within a session: a key this session holds must not
        // be granted again.
        if self.h.state().leases.contains_key(&key) {
            return Ok(TryGrant::Held);
        }
        let sql = self.h.sql.clone();
        let sent = Instant::now();
        let owed = Pending {
            key,
            delay: delay_ms > 0,
        };
        self.flight = Flight::Unlock(owed);
        let c = conn(&mut self.conn).map_err(from_sqlx)?;
        let q = sqlx::query_as::<_, GrantRow>(&sql.grant_try)
            .bind(key)
            .bind(full)
            .bind(delay_ms)
            .fetch_one(&mut c.conn);
        let row = match stmt(self.h, q, sent).await {
            Ok(r) => r,
            Err(e) => {
                // An autocommit statement that failed may still have taken the session lock
                // (a rollback does not release it).
                if broken(&e) {
                    self.die();
                } else if self.unlock_one(Pending { key, delay: false }).await.is_ok() {
                    self.flight = Flight::Idle;
                }
                return Err(from_sqlx(e));
            }
        };
        let (ok, token, wait_ms, other) = row;
        match (ok, token) {
            (true, Some(token)) => {
                let tracker = TrackerHandle::new(sent, ttl);
                self.h.state().leases.insert(
                    key,
                    Held {
                        tracker: tracker.clone(),
                        auto: true,
                        lock_delay: delay_ms > 0,
                    },
                );
                self.flight = Flight::Idle;
                Ok(TryGrant::Granted(Grant {
                    holder: self.h.clone(),
                    key,
                    token,
                    tracker,
                    armed: true,
                }))
            }
            (true, None) => {
                // A lock-delay is pending (wait_ms > 0), or another name is stored under the
                // key: give the lock back (its delay row, not this acquire's, stays).
                let owed = Pending { key, delay: false };
                self.flight = Flight::Unlock(owed);
                self.unlock_one(owed).await?;
                self.flight = Flight::Idle;
                if wait_ms > 0 {
                    Ok(TryGrant::Held)
                } else {
                    Ok(TryGrant::Collision(other))
                }
            }
            (false, _) => {
                self.flight = Flight::Idle;
                match other {
                    Some(s) => Ok(TryGrant::Collision(Some(s))),
                    None => Ok(TryGrant::Held),
                }
            }
        }
    }

    /// Renews a shared session (one statement, or none if one ran since the last renewal),
    /// confirms its leases, unlocks those that lapsed, and retires a session that has held
    /// nothing for a while. `false`: the session ended.
    async fn tick(&mut self) -> bool {
        let now = Instant::now();
        let h = self.h;
        let due = !h.solo && now >= h.state().last_renew + h.ttl() / 3;
        if due {
            let (last_ok, last_renew) = {
                let st = h.state();
                (st.last_ok, st.last_renew)
            };
            let at = if last_ok > last_renew {
                last_ok
            } else {
                self.flight = Flight::Any;
                let r = self.ping(now).await;
                self.flight = Flight::Idle;
                match r {
                    Ok(pid) if pid == h.pid => now,
                    Ok(_) => {
                        self.die();
                        return false;
                    }
                    Err(e) => {
                        tracing::debug!(backend_pid = h.pid, error = %e, "session renewal failed");
                        self.die();
                        return false;
                    }
                }
            };
            h.state().last_renew = at;
        }
        let lapsed: Vec<Pending> = {
            let mut st = h.state();
            let last_renew = st.last_renew;
            let keys: Vec<i64> = st
                .leases
                .iter()
                .filter(|(_, l)| {
                    if l.auto && !h.solo {
                        // Lost on the client side (too late an answer, a stale fenced
                        // write): given back as lapsed.
                        !l.tracker.confirm(last_renew) || l.tracker.state() == LeaseState::Lost
                    } else {
                        l.tracker.valid_until() <= now || l.tracker.state() == LeaseState::Lost
                    }
                })
                .map(|(k, _)| *k)
                .collect();
            if !keys.is_empty() && !h.solo {
                for k in &keys {
                    st.leases.remove(k);
                    st.manual.remove(k);
                }
            }
            keys.into_iter()
                .map(|key| Pending { key, delay: false })
                .collect()
        };
        if !lapsed.is_empty() {
            if h.solo {
                // Closing the connection frees the lock (the server ends the session).
                self.die();
                return false;
            }
            h.state().pending.extend(lapsed);
            if self.settle().await.is_err() {
                return false;
            }
        }
        let idle = {
            let st = h.state();
            st.leases.is_empty() && st.last_grant.elapsed() >= h.ttl() / 3
        };
        if idle && self.retire() {
            return false;
        }
        self.conn.is_some()
    }
}

/// The holder sessions of one [`PgLock`](crate::PgLock): the shared pools by TTL and the
/// session watch.
#[derive(Default)]
pub(crate) struct Sessions {
    pools: Mutex<HashMap<u64, Vec<Arc<Holder>>>>,
    /// Serializes the opening of new shared sessions (so a burst of grants opens one, not one
    /// each).
    opening: tokio::sync::Mutex<()>,
    watch: Mutex<Watch>,
}

impl Drop for Sessions {
    /// The [`PgLock`](crate::PgLock) and its leases are gone: a session with nothing on it
    /// (e.g. the one a waiting acquire tried first, before it was dropped) is closed now, not
    /// kept open by its keeper until it would retire (a third of its TTL after its last grant).
    fn drop(&mut self) {
        for h in self
            .pools
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .flatten()
        {
            let mut st = h.state();
            let empty = st.leases.is_empty()
                && st.reserved == 0
                && st.unlocking == 0
                && st.pending.is_empty()
                && !st.dirty;
            if empty && !st.dead {
                st.dead = true;
                drop(st);
                h.wake.notify_one();
            }
        }
    }
}

#[derive(Default)]
struct Watch {
    next_id: u64,
    holders: HashMap<u64, Weak<Holder>>,
    running: bool,
    /// Dropped with the `Sessions`: ends the watch loop at once (it ends at its next check
    /// otherwise, up to [`SESSION_CHECK`] later).
    ended: Option<tokio::sync::watch::Sender<()>>,
}

impl Sessions {
    fn pools(&self) -> MutexGuard<'_, HashMap<u64, Vec<Arc<Holder>>>> {
        self.pools.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn watch_list(&self) -> MutexGuard<'_, Watch> {
        self.watch.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How many holder sessions are open (shared and solo).
    pub(crate) fn count(&self) -> usize {
        self.watch_list().holders.len()
    }

    /// A place on a shared session of TTL `ttl_ms` with room, if there is one.
    fn reserve(&self, ttl_ms: u64) -> Option<Reservation> {
        let pools = self.pools();
        for h in pools.get(&ttl_ms)? {
            let mut st = h.state();
            if !st.dead && st.leases.len() + st.reserved < SESSION_LEASES {
                st.reserved += 1;
                return Some(Reservation(h.clone()));
            }
        }
        None
    }

    /// A place on a shared session of TTL `ttl_ms`, opening a new session if all are full.
    async fn reserve_or_open(
        self: &Arc<Self>,
        inner: &Arc<Inner>,
        ttl_ms: u64,
    ) -> Result<Reservation> {
        if let Some(r) = self.reserve(ttl_ms) {
            return Ok(r);
        }
        let _opening = self.opening.lock().await;
        if let Some(r) = self.reserve(ttl_ms) {
            return Ok(r);
        }
        let c = inner.holder_conn(ttl_ms).await?;
        let h = self.start(inner, c, false, Vec::new());
        let r = {
            let mut st = h.state();
            st.reserved += 1;
            Reservation(h.clone())
        };
        self.pools().entry(ttl_ms).or_default().push(h);
        Ok(r)
    }

    /// A try-once grant of `key` (`full` its name) on a shared session of TTL `ttl`: the
    /// grant statement, run by the caller.
    ///
    /// Cancel safe: a lock a dropped grant may have taken is owed to the session (see the
    /// module docs) and unlocked before its next statement.
    pub(crate) async fn try_shared(
        self: &Arc<Self>,
        inner: &Arc<Inner>,
        key: i64,
        full: &str,
        delay_ms: i64,
        ttl: Duration,
    ) -> Result<TryGrant> {
        let res = self
            .reserve_or_open(inner, crate::core::ttl_ms(ttl))
            .await?;
        let holder = res.0.clone();
        holder.state().last_grant = Instant::now();
        let mut op = holder.op().await?;
        let out = op.grant(key, full, delay_ms, ttl).await;
        drop(res);
        out
    }

    /// Makes `conn`, whose session holds `a.key` (granted on it after a wait, or a slot), a
    /// holder session: shared (in the pool of its TTL) if the lease is kept alive by lockkit,
    /// else solo.
    pub(crate) fn adopt(self: &Arc<Self>, inner: &Arc<Inner>, conn: Conn, a: Adopted) -> Grant {
        let ttl_ms = conn.idle_ms;
        let held = Held {
            tracker: a.tracker.clone(),
            auto: a.auto,
            lock_delay: a.lock_delay,
        };
        let h = self.start(inner, conn, !a.auto, vec![(a.key, held)]);
        if a.auto {
            self.pools().entry(ttl_ms).or_default().push(h.clone());
        }
        Grant {
            holder: h,
            key: a.key,
            token: a.token,
            tracker: a.tracker,
            armed: true,
        }
    }

    /// Starts the keeper of a new holder session on `conn`, holding `leases`.
    fn start(
        self: &Arc<Self>,
        inner: &Arc<Inner>,
        conn: Conn,
        solo: bool,
        leases: Vec<(i64, Held)>,
    ) -> Arc<Holder> {
        let manual = if solo {
            leases.iter().map(|(k, _)| *k).collect()
        } else {
            HashSet::new()
        };
        let h = Arc::new(Holder {
            pid: conn.pid,
            ttl_ms: conn.idle_ms,
            solo,
            st: Mutex::new(State {
                leases: leases.into_iter().collect(),
                reserved: 0,
                dead: false,
                watch: 0,
                pending: Vec::new(),
                unlocking: 0,
                dirty: false,
                closed: false,
                manual,
                last_renew: conn.last_sent,
                last_ok: conn.last_sent,
                last_grant: Instant::now(),
            }),
            conn: tokio::sync::Mutex::new(Some(conn)),
            wake: Notify::new(),
            waker: Mutex::new(None),
            sql: inner.sql.clone(),
            inner: Arc::downgrade(inner),
            sessions: Arc::downgrade(self),
            connect_timeout: inner.config.connect_timeout,
            renew_dropped: AtomicBool::new(false),
        });
        let id = {
            let mut w = self.watch_list();
            w.next_id += 1;
            let id = w.next_id;
            w.holders.insert(id, Arc::downgrade(&h));
            if !w.running {
                w.running = true;
                let ended = w
                    .ended
                    .get_or_insert_with(|| tokio::sync::watch::channel(()).0)
                    .subscribe();
                tokio::spawn(watch_loop(
                    Arc::downgrade(self),
                    Arc::downgrade(inner),
                    ended,
                ));
            }
            id
        };
        h.state().watch = id;
        tokio::spawn(keeper(h.clone()));
        h
    }

    /// Takes `h` out of its pool and the watch.
    fn remove(&self, h: &Holder) {
        if let Some(pool) = self.pools().get_mut(&h.ttl_ms) {
            pool.retain(|x| !std::ptr::eq(Arc::as_ptr(x), h));
        }
        let id = h.state().watch;
        self.watch_list().holders.remove(&id);
    }
}

fn session_gone() -> Error {
    unavailable(Msg("the holder session ended".into()))
}

/// Whether a statement's error leaves the connection unusable (anything but an error the
/// server reported for the statement).
fn broken(e: &sqlx::Error) -> bool {
    !matches!(e, sqlx::Error::Database(_))
}

fn timed_out() -> sqlx::Error {
    sqlx::Error::Io(std::io::ErrorKind::TimedOut.into())
}

/// The watch of one `PgLock`'s holder sessions (see [`SESSION_CHECK`]): every 5 s, one query
/// for all of them; a session that no longer exists has all its leases marked lost. Ends when
/// no session is left or the `PgLock` is gone.
async fn watch_loop(
    sessions: Weak<Sessions>,
    inner: Weak<Inner>,
    mut ended: tokio::sync::watch::Receiver<()>,
) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(SESSION_CHECK) => {}
            // Nothing is sent: this is the `Sessions` (the `PgLock`) being dropped.
            _ = ended.changed() => return,
        }
        let (Some(sessions), Some(inner)) = (sessions.upgrade(), inner.upgrade()) else {
            return;
        };
        let watched: Vec<Arc<Holder>> = {
            let mut w = sessions.watch_list();
            w.holders.retain(|_, h| h.strong_count() > 0);
            if w.holders.is_empty() {
                w.running = false;
                return;
            }
            w.holders.values().filter_map(Weak::upgrade).collect()
        };
        let pids: Vec<i32> = watched.iter().map(|h| h.pid).collect();
        let Some(gone) = inner.sessions_gone(&pids).await else {
            continue;
        };
        for h in watched {
            if gone.contains(&h.pid) {
                h.fail();
                sessions.remove(&h);
            }
        }
    }
}

/// The keeper's last step (an error, the server's close, or the session failed or retired
/// elsewhere): if the session still has its connection, its leases are lost and the
/// connection is closed; either way it leaves its pool and the watch. Whoever took the
/// connection before (`die`, `retire`, a dropped solo renewal) also took it out of both, so
/// `remove` again changes nothing; a session the watch failed still has its connection, and
/// `fail` again finds only leases granted since.
async fn end(h: &Holder) {
    let mut g = h.conn.lock().await;
    if g.is_some() {
        h.fail();
        drop(g.take());
    }
    if let Some(s) = h.sessions.upgrade() {
        s.remove(h);
    }
}

/// What woke the keeper.
enum Event {
    /// Owed unlocks, a lease no longer renewed, or the session ended.
    Work,
    Closed,
    Tick,
}

/// The keeper of a holder session (see the module docs): renews it, unlocks lapsed and owed
/// leases, reads the idle connection. Ends with the session.
async fn keeper(h: Arc<Holder>) {
    loop {
        // Callers register this waker on the idle connection (see `Op`'s drop).
        std::future::poll_fn(|cx| {
            h.set_waker(cx);
            Poll::Ready(())
        })
        .await;
        let wake = h.next_wake();
        let (dead, work, closed) = {
            let st = h.state();
            (st.dead, !st.pending.is_empty() || st.dirty, st.closed)
        };
        if dead {
            // Failed or retired elsewhere (the watch, a caller): close the connection.
            end(&h).await;
            return;
        }
        let ev = if closed {
            Event::Closed
        } else if work {
            Event::Work
        } else if Instant::now() >= wake {
            Event::Tick
        } else {
            tokio::select! {
                biased;
                () = h.wake.notified() => Event::Work,
                () = std::future::poll_fn(|cx| h.poll_closed(cx)) => Event::Closed,
                () = tokio::time::sleep_until(wake) => Event::Tick,
            }
        };
        match ev {
            Event::Work => {
                if h.state().dead {
                    continue;
                }
                // Settles what is owed; an error ends the session (in `settle`).
                if h.op().await.is_err() {
                    end(&h).await;
                    return;
                }
            }
            Event::Closed => {
                end(&h).await;
                return;
            }
            Event::Tick => match h.op().await {
                Ok(mut op) => {
                    if !op.tick().await {
                        return;
                    }
                }
                Err(_) => return,
            },
        }
    }
}
