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
//! Each session is owned by a task (its *actor*) that runs every statement on it, in order, so
//! a caller that drops its future never leaves a statement half-read on a shared connection: a
//! dropped grant is given back by the actor ([`Grant`]'s drop), a dropped release still
//! happens. Between statements the actor reads the idle connection, so when the server ends
//! the session (`pg_terminate_backend`, restart, idle timeout) all its leases are marked lost
//! at once, within milliseconds. A watch task per `PgLock` checks every
//! [`SESSION_CHECK`](crate::SESSION_CHECK) on another connection that the sessions exist (for
//! a connection that died silently).
//!
//! A lease whose holder stops renewing it while the session lives on (its [`PgLease`] dropped
//! without release, or lost on the client side) is unlocked by the actor at its client-side
//! deadline, without deleting its lock-delay row: it lapses as it would on its own session.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use lockkit_core::backend::TrackerHandle;
use lockkit_core::{Error, Instant, LeaseState, LossReason, Result};
use tokio::sync::{mpsc, oneshot};

use crate::core::{Conn, Inner, SESSION_CHECK, Sql};
use crate::error::{Msg, from_sqlx, unavailable};

/// The most leases one shared holder session carries: 1,000. With PostgreSQL's default
/// `max_connections` (100), 10,000 leases of one TTL take 10 sessions; each session's actor
/// runs one statement at a time, so more sessions also mean more grants in parallel.
pub const SESSION_LEASES: usize = 1000;

/// What a caller asks of a holder session's actor.
pub(crate) enum Cmd {
    /// A try-once grant (never waits): the grant statement on this session.
    Grant {
        res: Reservation,
        key: i64,
        full: String,
        delay_ms: i64,
        ttl: Duration,
        reply: oneshot::Sender<Result<TryGrant>>,
    },
    /// Unlock `key`; with `lapse`, leave its lock-delay row (the lease lapsed). The reply is
    /// whether the session held it.
    Release {
        key: i64,
        lapse: bool,
        reply: Option<oneshot::Sender<Result<bool>>>,
    },
    /// The lease was dropped without a release: no longer renewed, unlocked at its deadline.
    Abandon { key: i64 },
    /// A renewal by hand: one statement (on a solo session it also sets the idle timeout).
    Renew {
        ttl_ms: u64,
        reply: oneshot::Sender<Result<()>>,
    },
    /// Whether this session holds `key` (`pg_locks`).
    Check {
        key: i64,
        reply: oneshot::Sender<Result<bool>>,
    },
    /// The session is gone (the watch found it missing): end.
    Kill,
}

/// The answer to [`Cmd::Grant`].
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
            self.holder.send(Cmd::Release {
                key: self.key,
                lapse: false,
                reply: None,
            });
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

/// One holder session, as callers and the watch see it; its connection is in its actor.
pub(crate) struct Holder {
    /// `pg_backend_pid()` of the session.
    pub(crate) pid: i32,
    /// Its `idle_session_timeout` in ms: the TTL of its leases.
    ttl_ms: u64,
    /// One lease renewed by hand (see the module docs).
    solo: bool,
    tx: mpsc::UnboundedSender<Cmd>,
    st: Mutex<State>,
    /// A renewal by hand was dropped mid-statement, which closed the (solo) session.
    pub(crate) renew_dropped: AtomicBool,
}

#[derive(Default)]
struct State {
    leases: HashMap<i64, Held>,
    /// Grants in flight to this session.
    reserved: usize,
    /// Ended or retired: takes no more grants.
    dead: bool,
    /// Id in the `PgLock`'s session watch.
    watch: u64,
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

    /// Sends `cmd` to the actor; `false` if it has ended (the session is gone).
    pub(crate) fn send(&self, cmd: Cmd) -> bool {
        self.tx.send(cmd).is_ok()
    }

    /// Marks all its leases lost (the session ended) and takes no more grants.
    fn fail(&self) {
        let leases: Vec<TrackerHandle> = {
            let mut st = self.state();
            st.dead = true;
            st.leases.drain().map(|(_, h)| h.tracker).collect()
        };
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

    /// How many leases it holds.
    pub(crate) fn leases(&self) -> usize {
        self.state().leases.len()
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

#[derive(Default)]
struct Watch {
    next_id: u64,
    holders: HashMap<u64, Weak<Holder>>,
    running: bool,
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

    /// A try-once grant of `key` (`full` its name) on a shared session of TTL `ttl`.
    ///
    /// Cancel safe: the statement runs in the session's actor; a grant whose caller is gone is
    /// released there.
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
        let (reply, answer) = oneshot::channel();
        let sent = holder.send(Cmd::Grant {
            res,
            key,
            full: full.to_owned(),
            delay_ms,
            ttl,
            reply,
        });
        if !sent {
            return Err(session_gone());
        }
        answer.await.map_err(|_| session_gone())?
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

    /// Starts the actor of a new holder session on `conn`, holding `leases`.
    fn start(
        self: &Arc<Self>,
        inner: &Arc<Inner>,
        conn: Conn,
        solo: bool,
        leases: Vec<(i64, Held)>,
    ) -> Arc<Holder> {
        let (tx, rx) = mpsc::unbounded_channel();
        let h = Arc::new(Holder {
            pid: conn.pid,
            ttl_ms: conn.idle_ms,
            solo,
            tx,
            st: Mutex::new(State {
                leases: leases.into_iter().collect(),
                ..State::default()
            }),
            renew_dropped: AtomicBool::new(false),
        });
        let id = {
            let mut w = self.watch_list();
            w.next_id += 1;
            let id = w.next_id;
            w.holders.insert(id, Arc::downgrade(&h));
            if !w.running {
                w.running = true;
                tokio::spawn(watch_loop(Arc::downgrade(self), Arc::downgrade(inner)));
            }
            id
        };
        h.state().watch = id;
        let actor = Actor {
            holder: h.clone(),
            sql: inner.sql.clone(),
            inner: Arc::downgrade(inner),
            sessions: Arc::downgrade(self),
            connect_timeout: inner.config.connect_timeout,
            ttl: Duration::from_millis(h.ttl_ms),
            last_renew: conn.last_sent,
            last_ok: conn.last_sent,
            last_grant: Instant::now(),
            manual: HashSet::new(),
        };
        tokio::spawn(actor.run(conn, rx));
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
async fn watch_loop(sessions: Weak<Sessions>, inner: Weak<Inner>) {
    loop {
        tokio::time::sleep(SESSION_CHECK).await;
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
                h.send(Cmd::Kill);
                sessions.remove(&h);
            }
        }
    }
}

/// The task that owns a holder session's connection (see the module docs).
struct Actor {
    holder: Arc<Holder>,
    sql: Arc<Sql>,
    inner: Weak<Inner>,
    sessions: Weak<Sessions>,
    connect_timeout: Duration,
    ttl: Duration,
    /// Send time of the statement the leases were last confirmed with.
    last_renew: Instant,
    /// Send time of the last statement that succeeded (it restarted the idle timer).
    last_ok: Instant,
    /// When the last grant was asked for.
    last_grant: Instant,
    /// Leases not confirmed by the session's renewals: unlocked at their deadline.
    manual: HashSet<i64>,
}

/// What woke the actor.
enum Event {
    Cmd(Option<Cmd>),
    Closed,
    Tick,
}

/// How the actor's loop goes on after an event.
enum Next {
    Go,
    /// The session failed or was given up: all its leases are lost.
    Die,
    /// Closes the connection (the server frees its locks) without marking its leases lost.
    Close,
    /// Nothing is held any more: the connection goes back to the idle cache.
    Retire,
}

impl Actor {
    async fn run(mut self, mut c: Conn, mut rx: mpsc::UnboundedReceiver<Cmd>) {
        if self.holder.solo {
            self.manual
                .extend(self.holder.state().leases.keys().copied());
        }
        loop {
            let wake = self.next_wake();
            // Commands come first, but a stream of them never holds back a renewal.
            let ev = if Instant::now() >= wake {
                Event::Tick
            } else {
                tokio::select! {
                    biased;
                    cmd = rx.recv() => Event::Cmd(cmd),
                    () = c.closed() => Event::Closed,
                    () = tokio::time::sleep_until(wake) => Event::Tick,
                }
            };
            let next = match ev {
                Event::Cmd(Some(cmd)) => self.command(&mut c, cmd).await,
                Event::Cmd(None) | Event::Closed => Next::Die,
                Event::Tick => self.tick(&mut c).await,
            };
            match next {
                Next::Go => {}
                Next::Die => {
                    self.holder.fail();
                    self.remove();
                    return;
                }
                Next::Close => {
                    self.holder.state().dead = true;
                    self.remove();
                    return;
                }
                Next::Retire => {
                    if self.retire() {
                        if let Some(inner) = self.inner.upgrade() {
                            c.last_sent = self.last_ok;
                            inner.put_idle(c);
                        }
                        return;
                    }
                }
            }
        }
    }

    /// When the next renewal (shared) or lapse of an unrenewed lease is due.
    fn next_wake(&self) -> Instant {
        let far = Instant::now() + Duration::from_secs(3600);
        let renew = if self.holder.solo {
            far
        } else {
            self.last_renew + self.ttl / 3
        };
        if self.manual.is_empty() {
            return renew;
        }
        let st = self.holder.state();
        self.manual
            .iter()
            .filter_map(|k| st.leases.get(k))
            .map(|h| h.tracker.valid_until())
            .fold(renew, Instant::min)
    }

    /// The latest a statement may take: the connect timeout, and never past the leases' end
    /// (a session that does not answer is given up, which frees its locks when the server
    /// sees the close).
    fn deadline(&self) -> Instant {
        let d = Instant::now() + self.connect_timeout;
        let st = self.holder.state();
        if st.leases.is_empty() {
            return d;
        }
        if self.holder.solo {
            let end = st.leases.values().map(|h| h.tracker.valid_until()).min();
            return end.map_or(d, |e| {
                d.min(e.max(Instant::now() + Duration::from_millis(1)))
            });
        }
        d.min(self.last_renew + self.ttl)
    }

    async fn stmt<T>(
        &mut self,
        fut: impl std::future::Future<Output = std::result::Result<T, sqlx::Error>>,
        sent: Instant,
    ) -> std::result::Result<T, sqlx::Error> {
        let r = tokio::time::timeout_at(self.deadline(), fut)
            .await
            .unwrap_or_else(|_| Err(timed_out()));
        if r.is_ok() {
            self.last_ok = sent;
        }
        r
    }

    async fn command(&mut self, c: &mut Conn, cmd: Cmd) -> Next {
        match cmd {
            Cmd::Grant {
                res,
                key,
                full,
                delay_ms,
                ttl,
                reply,
            } => {
                self.last_grant = Instant::now();
                let (out, next) = self.grant(c, key, &full, delay_ms, ttl).await;
                drop(res);
                // A caller that is gone drops the grant, which releases it (see `Grant`).
                let _ = reply.send(out);
                next
            }
            Cmd::Release { key, lapse, reply } => {
                let (out, next) = self.release(c, &[key], lapse).await;
                if let Some(r) = reply {
                    let _ = r.send(out.map(|n| n > 0));
                }
                next
            }
            Cmd::Abandon { key } => {
                if let Some(h) = self.holder.state().leases.get_mut(&key) {
                    h.auto = false;
                    self.manual.insert(key);
                }
                Next::Go
            }
            Cmd::Renew { ttl_ms, reply } => self.renew(c, ttl_ms, reply).await,
            Cmd::Check { key, reply } => {
                let (hi, lo) = ((key as u64 >> 32) as i64, (key as u64 & 0xffff_ffff) as i64);
                let sent = Instant::now();
                let q = sqlx::query_scalar::<_, bool>(
                    "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted \
                     AND pid = pg_backend_pid() AND classid = $1::bigint::oid \
                     AND objid = $2::bigint::oid AND objsubid = 1)",
                )
                .bind(hi)
                .bind(lo)
                .fetch_one(&mut c.conn);
                let r = self.stmt(q, sent).await;
                let next = match &r {
                    Err(e) if broken(e) => Next::Die,
                    _ => Next::Go,
                };
                let _ = reply.send(r.map_err(from_sqlx));
                next
            }
            Cmd::Kill => Next::Die,
        }
    }

    /// The grant statement (see `grant_sql` in core.rs) on this session, never waiting. A lock
    /// the statement took but cannot keep (a pending lock-delay, a key collision, an error) is
    /// given back at once.
    async fn grant(
        &mut self,
        c: &mut Conn,
        key: i64,
        full: &str,
        delay_ms: i64,
        ttl: Duration,
    ) -> (Result<TryGrant>, Next) {
        // Advisory locks are re-entrant within a session: a key this session holds must not
        // be granted again.
        if self.holder.state().leases.contains_key(&key) {
            return (Ok(TryGrant::Held), Next::Go);
        }
        let sent = Instant::now();
        let sql = self.sql.clone();
        let q = sqlx::query_as::<_, (bool, Option<i64>, i64)>(&sql.grant_try)
            .bind(key)
            .bind(full)
            .bind(delay_ms)
            .fetch_one(&mut c.conn);
        let (ok, token, wait_ms) = match self.stmt(q, sent).await {
            Ok(r) => r,
            Err(e) => {
                // An autocommit statement that failed may still have taken the session lock
                // (a rollback does not release it).
                let next = if broken(&e) || !self.unlock(c, key).await {
                    Next::Die
                } else {
                    Next::Go
                };
                return (Err(from_sqlx(e)), next);
            }
        };
        match (ok, token) {
            (true, Some(token)) => {
                let tracker = TrackerHandle::new(sent, ttl);
                self.holder.state().leases.insert(
                    key,
                    Held {
                        tracker: tracker.clone(),
                        auto: true,
                        lock_delay: delay_ms > 0,
                    },
                );
                let g = Grant {
                    holder: self.holder.clone(),
                    key,
                    token,
                    tracker,
                    armed: true,
                };
                (Ok(TryGrant::Granted(g)), Next::Go)
            }
            (true, None) => {
                // A lock-delay is pending (wait_ms > 0), or another name is stored under the
                // key: give the lock back.
                let stored = if wait_ms > 0 {
                    None
                } else {
                    Some(self.name_of(c, key).await)
                };
                if !self.unlock(c, key).await {
                    return (Err(session_gone()), Next::Die);
                }
                match stored {
                    None => (Ok(TryGrant::Held), Next::Go),
                    Some(Ok(s)) => (Ok(TryGrant::Collision(s)), Next::Go),
                    Some(Err(e)) => (Err(e), Next::Go),
                }
            }
            (false, _) => match self.name_of(c, key).await {
                Ok(Some(s)) if s != full => (Ok(TryGrant::Collision(Some(s))), Next::Go),
                Ok(_) => (Ok(TryGrant::Held), Next::Go),
                Err(e) => (Err(e), Next::Go),
            },
        }
    }

    async fn name_of(&mut self, c: &mut Conn, key: i64) -> Result<Option<String>> {
        let sql = self.sql.clone();
        let sent = Instant::now();
        let q = sqlx::query_scalar::<_, String>(&sql.name_of)
            .bind(key)
            .fetch_optional(&mut c.conn);
        self.stmt(q, sent).await.map_err(from_sqlx)
    }

    /// `pg_advisory_unlock(key)`; `false` if the statement failed.
    async fn unlock(&mut self, c: &mut Conn, key: i64) -> bool {
        let sent = Instant::now();
        let q = sqlx::query_scalar::<_, bool>("SELECT pg_advisory_unlock($1)")
            .bind(key)
            .fetch_one(&mut c.conn);
        self.stmt(q, sent).await.is_ok()
    }

    /// Unlocks `keys` this session holds (in one statement), deleting a lease's lock-delay
    /// row unless `lapse`. Returns how many it held.
    async fn release(&mut self, c: &mut Conn, keys: &[i64], lapse: bool) -> (Result<usize>, Next) {
        let (mine, delayed): (Vec<i64>, Vec<bool>) = {
            let mut st = self.holder.state();
            keys.iter()
                .filter_map(|k| st.leases.remove(k).map(|h| (*k, h.lock_delay && !lapse)))
                .unzip()
        };
        for k in &mine {
            self.manual.remove(k);
        }
        if mine.is_empty() {
            return (Ok(0), self.after_release());
        }
        let sent = Instant::now();
        let res = if let ([key], [true]) = (mine.as_slice(), delayed.as_slice()) {
            let sql = self.sql.clone();
            let q = sqlx::query_scalar::<_, bool>(&sql.release_delay)
                .bind(key)
                .fetch_one(&mut c.conn);
            self.stmt(q, sent).await.map(i64::from)
        } else if let [key] = mine.as_slice() {
            let q = sqlx::query_scalar::<_, bool>("SELECT pg_advisory_unlock($1)")
                .bind(key)
                .fetch_one(&mut c.conn);
            self.stmt(q, sent).await.map(i64::from)
        } else {
            // Only lapses come in batches: their delay rows stay.
            let q = sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FILTER (WHERE pg_advisory_unlock(k)) FROM unnest($1::int8[]) AS k",
            )
            .bind(&mine)
            .fetch_one(&mut c.conn);
            self.stmt(q, sent).await
        };
        match res {
            Ok(n) => (Ok(usize::try_from(n).unwrap_or(0)), self.after_release()),
            Err(e) => {
                tracing::debug!(backend_pid = self.holder.pid, error = %e, "unlock failed; ending the session");
                (Err(from_sqlx(e)), Next::Die)
            }
        }
    }

    /// A session that holds nothing goes back to the idle cache: a solo one always, a shared
    /// one if its pool has another open session (a waiting acquire, which needs a connection
    /// of its own, then reuses this one instead of opening a new one).
    fn after_release(&self) -> Next {
        let empty = self.holder.state().leases.is_empty();
        if empty && (self.holder.solo || self.spare()) {
            Next::Retire
        } else {
            Next::Go
        }
    }

    /// Whether another session of this shared session's pool is open.
    fn spare(&self) -> bool {
        let Some(sessions) = self.sessions.upgrade() else {
            return false;
        };
        let pools = sessions.pools();
        pools.get(&self.holder.ttl_ms).is_some_and(|pool| {
            pool.iter()
                .any(|h| !Arc::ptr_eq(h, &self.holder) && !h.state().dead)
        })
    }

    async fn renew(
        &mut self,
        c: &mut Conn,
        ttl_ms: u64,
        reply: oneshot::Sender<Result<()>>,
    ) -> Next {
        let mut reply = reply;
        let sent = Instant::now();
        let deadline = self.deadline();
        let solo = self.holder.solo;
        let q = async {
            if solo {
                sqlx::query_scalar::<_, i32>(
                    "SELECT pg_backend_pid() FROM (SELECT set_config('idle_session_timeout', $1, false)) s",
                )
                .bind(ttl_ms.to_string())
                .fetch_one(&mut c.conn)
                .await
            } else {
                sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()")
                    .fetch_one(&mut c.conn)
                    .await
            }
        };
        let res = tokio::select! {
            r = tokio::time::timeout_at(deadline, q) => r.unwrap_or_else(|_| Err(timed_out())),
            // A solo session's renewal dropped mid-statement closes the session, so that a
            // statement the server has yet to read cannot extend it (the lock is freed when
            // the server sees the close).
            () = reply.closed(), if solo => {
                self.holder.renew_dropped.store(true, Ordering::Release);
                return Next::Close;
            }
        };
        match res {
            Ok(pid) if pid == self.holder.pid => {
                self.last_ok = sent;
                if solo {
                    c.idle_ms = ttl_ms;
                }
                let _ = reply.send(Ok(()));
                Next::Go
            }
            Ok(pid) => {
                tracing::warn!(
                    expected = self.holder.pid,
                    got = pid,
                    "renew reached another server session (connection pooler?); leases lost"
                );
                let _ = reply.send(Err(session_gone()));
                Next::Die
            }
            Err(e) => {
                tracing::debug!(backend_pid = self.holder.pid, error = %e, "renew failed: session gone");
                let _ = reply.send(Err(from_sqlx(e)));
                Next::Die
            }
        }
    }

    /// Renews a shared session (one statement, or none if one ran since the last renewal),
    /// confirms its leases, unlocks those that lapsed, and retires a session that has held
    /// nothing for a while.
    async fn tick(&mut self, c: &mut Conn) -> Next {
        let now = Instant::now();
        if !self.holder.solo && now >= self.last_renew + self.ttl / 3 {
            let at = if self.last_ok > self.last_renew {
                self.last_ok
            } else {
                let q =
                    sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()").fetch_one(&mut c.conn);
                match self.stmt(q, now).await {
                    Ok(pid) if pid == self.holder.pid => now,
                    Ok(_) => return Next::Die,
                    Err(e) => {
                        tracing::debug!(backend_pid = self.holder.pid, error = %e, "session renewal failed");
                        return Next::Die;
                    }
                }
            };
            self.last_renew = at;
        }
        let lapsed: Vec<i64> = {
            let st = self.holder.state();
            st.leases
                .iter()
                .filter(|(_, h)| {
                    if h.auto && !self.holder.solo {
                        // Lost on the client side (too late an answer, a stale fenced
                        // write): given back as lapsed.
                        !h.tracker.confirm(self.last_renew) || h.tracker.state() == LeaseState::Lost
                    } else {
                        h.tracker.valid_until() <= now || h.tracker.state() == LeaseState::Lost
                    }
                })
                .map(|(k, _)| *k)
                .collect()
        };
        if !lapsed.is_empty() {
            if self.holder.solo {
                // Closing the connection frees the lock (the server ends the session).
                return Next::Die;
            }
            let (_, next) = self.release(c, &lapsed, true).await;
            if !matches!(next, Next::Go) {
                return next;
            }
        }
        let idle =
            self.holder.state().leases.is_empty() && self.last_grant.elapsed() >= self.ttl / 3;
        if idle { Next::Retire } else { Next::Go }
    }

    /// Leaves the pool if nothing is held or reserved; `false` if a grant came meanwhile.
    fn retire(&self) -> bool {
        let Some(sessions) = self.sessions.upgrade() else {
            return self.holder.state().leases.is_empty();
        };
        {
            let pools = sessions.pools();
            let mut st = self.holder.state();
            if !st.leases.is_empty() || st.reserved > 0 {
                return false;
            }
            st.dead = true;
            drop(pools);
        }
        sessions.remove(&self.holder);
        true
    }

    fn remove(&self) {
        if let Some(s) = self.sessions.upgrade() {
            s.remove(&self.holder);
        }
    }
}
