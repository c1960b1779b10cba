//! [`ZkLock`]: the lock recipe on ephemeral sequential nodes.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Weak};
use std::time::Duration;

use lockkit_core::backend::{
    LockBackend, TrackerHandle, retry_transient, validate_name, wait_deadline,
};
use lockkit_core::{
    AcquireOptions, Error, FencingToken, Guarantees, HolderInfo, Instant, Lease, LockKind, Result,
    Wait, async_trait,
};
use tokio::sync::watch;
use zookeeper_client as zk;

use crate::config::{CONTROL_SESSION_TTL, ZkConfig, encode_name};
use crate::core::{
    Ahead, Created, Granted, Pending, Target, in_line, own_id, sorted_children, wait_ahead,
};
use crate::error::{BACKEND, connection_lost, from_zk, unavailable};
use crate::lease::ZkLease;
use crate::session::{Session, shared_acls};

/// The longest a server may keep a lapsed lease past its TTL with ZooKeeper's default
/// `tickTime` of 2 s: the server checks session expiry once per tick, rounding each session's
/// deadline up to the next tick ([`ExpiryQueue`](https://github.com/apache/zookeeper/blob/release-3.8.0/zookeeper-server/src/main/java/org/apache/zookeeper/server/ExpiryQueue.java)).
pub const EXPIRY_SLACK: Duration = Duration::from_secs(2);

/// The most ZooKeeper sessions one [`ZkLock`] (and its clones) keeps open at once, the control
/// session included: one per distinct TTL in use. ZooKeeper refuses more than `maxClientCnxns`
/// (60 by default) connections from one IP address, for every client on that host together.
pub const MAX_SESSIONS: usize = 16;

/// How soon a holder hears that the server deleted its node ([`Guarantees::loss_notice`]): the
/// watch on its own node fires on the delete (1–4 ms measured); a session the server expired
/// is heard at the session's expiry event, or at the holder's own deadline.
const LOSS_NOTICE: Duration = Duration::from_millis(500);

/// Counters of the waiting machinery, for tests (herd checks; feature `test-hooks`). Not part
/// of the API.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WaitStats {
    /// Acquires now blocked on their predecessor's watch.
    pub waiting: usize,
    /// Watch events (node events, not session events) that woke a waiter, since connect.
    pub wakeups: u64,
}

/// Distributed locks on ZooKeeper: one ephemeral sequential node per acquire, the lowest
/// sequence holds, each waiter watches only its predecessor (the
/// [lock recipe](https://zookeeper.apache.org/doc/r3.8.0/recipes.html#sc_recipes_Locks), without
/// herd effect).
///
/// - **Lease = session.** A lock node is ephemeral: the server deletes it when its
///   [session](https://zookeeper.apache.org/doc/r3.8.0/zookeeperProgrammers.html#ch_zkSessions)
///   expires. The session timeout is therefore the TTL; each distinct TTL gets a session of its
///   own (opened on first use, shared by all leases of that TTL from this `ZkLock`, closed once
///   it has carried no lease for one to two TTLs, or at once when a new TTL needs room). At most
///   [`MAX_SESSIONS`] are open at once: an acquire that needs one more while every open session
///   carries a lease fails with [`Error::Backend`]. A TTL the
///   server cannot negotiate (outside its `minSessionTimeout`..`maxSessionTimeout`, by default
///   2..20 ticks) is refused with [`Error::InvalidConfig`]; TTLs must be whole milliseconds.
/// - **Keepalive** is the session's heartbeat and cannot be paused per lease, so
///   `keepalive(false)` is [`Error::NotSupported`]. A [`leak`](lockkit_core::Lease::leak)ed
///   lease, or one dropped with `release_on_drop(false)`, stops being confirmed and its node is
///   deleted at its deadline (one TTL after its last confirmation), so it is held for its TTL
///   and no longer, as on other backends (unless this process exits first: its sessions then
///   expire within the TTL).
/// - **Fencing token** = the holder node's `czxid`, the zxid of the transaction that created it.
///   Zxids are totally ordered over the whole ensemble and every later create gets a larger one,
///   across leader elections (the epoch is the high 32 bits) and across the lock's parent node
///   being deleted and re-created (sequence numbers restart there; zxids do not).
///
/// Cheap to clone (shared sessions).
#[derive(Clone)]
pub struct ZkLock {
    inner: Arc<Inner>,
}

struct Inner {
    cfg: ZkConfig,
    sessions: tokio::sync::Mutex<HashMap<Duration, Arc<Session>>>,
    control_ttl: Duration,
    stats: watch::Sender<WaitStats>,
}

impl fmt::Debug for ZkLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZkLock")
            .field("config", &self.inner.cfg)
            .finish_non_exhaustive()
    }
}

impl ZkLock {
    /// Connects with a `zk://` URL (see [`ZkConfig::from_url`] for its form and parameters).
    ///
    /// # Errors
    /// As [`ZkLock::connect_with`], and [`Error::InvalidConfig`] for a malformed URL.
    ///
    /// # Cancel safety
    /// Cancel safe: a session being opened is closed when the future is dropped.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_with(ZkConfig::from_url(url)?).await
    }

    /// The old name of [`connect_with`](Self::connect_with).
    ///
    /// # Errors
    /// As [`connect_with`](Self::connect_with).
    ///
    /// # Cancel safety
    /// Cancel safe: a session being opened is closed when the future is dropped.
    pub async fn with_config(cfg: ZkConfig) -> Result<Self> {
        Self::connect_with(cfg).await
    }

    /// Connects with `cfg`: opens one session (asking for a 30 s timeout) and checks that the
    /// chroot exists and that the credentials may read the prefix node.
    ///
    /// # Errors
    /// - [`Error::InvalidConfig`]: invalid `cfg`, or the chroot does not exist.
    /// - [`Error::Unavailable`]: no server answered within the connect timeout.
    /// - [`Error::Auth`]: the server refused the credentials, or (`sasl=digest-md5`) did not
    ///   authenticate them (no SASL configured on the server).
    /// - [`Error::Backend`]: the credentials may not read the prefix node (its ACL, set by
    ///   an older version of this crate or by hand, does not grant them).
    ///
    /// # Cancel safety
    /// Cancel safe: a session being opened is closed when the future is dropped.
    pub async fn connect_with(cfg: ZkConfig) -> Result<Self> {
        cfg.validate()?;
        let control = Session::open(&cfg, CONTROL_SESSION_TTL, false).await?;
        let deadline = Some(Instant::now() + cfg.get_connect_timeout());
        match control
            .retry_loss(deadline, || control.client.check_stat("/"))
            .await
        {
            Ok(Some(_)) => {}
            Ok(None) => return Err(Error::config("the ZooKeeper chroot does not exist")),
            Err(e) => return Err(from_zk(e)),
        }
        let prefix = format!("/{}", cfg.get_prefix());
        match control
            .retry_loss(deadline, || control.client.list_children(&prefix))
            .await
        {
            Ok(_) | Err(zk::Error::NoNode) => {}
            Err(e) => return Err(from_zk(e)),
        }
        let control_ttl = control.ttl;
        let mut sessions = HashMap::new();
        sessions.insert(control_ttl, control);
        Ok(Self {
            inner: Arc::new(Inner {
                cfg,
                sessions: tokio::sync::Mutex::new(sessions),
                control_ttl,
                stats: watch::Sender::new(WaitStats::default()),
            }),
        })
    }

    /// The configuration this lock service was built with.
    pub fn config(&self) -> &ZkConfig {
        &self.inner.cfg
    }

    /// The identity of lock `name` in its tokens ([`FencingToken::lock`]):
    /// `zk{chroot}/{prefix}/{name}`, e.g. `zk/lockkit/report`, or `zk/apps/x/lockkit/report`
    /// with chroot `/apps/x`.
    pub fn lock_id(&self, name: &str) -> String {
        let chroot = self.inner.cfg.get_chroot().unwrap_or("");
        let chroot = chroot.trim_end_matches('/');
        format!("zk{chroot}/{}/{name}", self.inner.cfg.get_prefix())
    }

    /// The path (below the chroot) of the node under which lock `name`'s nodes are created.
    ///
    /// # Errors
    /// [`Error::InvalidName`] as [`validate_name`].
    pub fn lock_dir(&self, name: &str) -> Result<String> {
        validate_name(name)?;
        Ok(format!(
            "/{}/{}",
            self.inner.cfg.get_prefix(),
            encode_name(name)
        ))
    }

    /// The lock nodes now queued for `name`, in grant order: the holder's first, then the
    /// waiters'. For inspection (operators, tests); the answer may be stale at once.
    ///
    /// # Errors
    /// [`Error::InvalidName`]; [`Error::Unavailable`] if no answer came within the connect
    /// timeout; other errors from the server.
    ///
    /// # Cancel safety
    /// Cancel safe (a read).
    pub async fn contenders(&self, name: &str) -> Result<Vec<String>> {
        let dir = self.lock_dir(name)?;
        self.bounded(async { sorted_children(&*self.control_session().await?, &dir).await })
            .await
    }

    /// The shortest TTL the server allows: the session timeout it negotiates when asked for
    /// [`MIN_TTL`](lockkit_core::MIN_TTL), which is its `minSessionTimeout` (by default 2 ×
    /// `tickTime`: 4 s with the stock `tickTime=2000`). Opens one session for the question and
    /// closes it.
    ///
    /// # Errors
    /// [`Error::Unavailable`] if no session could be opened within the connect timeout;
    /// [`Error::Auth`] if the server refuses the credentials.
    ///
    /// # Cancel safety
    /// Cancel safe: a session being opened is closed when the future is dropped.
    pub async fn min_ttl(&self) -> Result<Duration> {
        let probe = Session::open(&self.inner.cfg, lockkit_core::MIN_TTL, false).await?;
        Ok(probe.ttl)
    }

    /// Runs `fut` for at most the connect timeout (the bound of one request round), else
    /// [`Error::Unavailable`].
    pub(crate) async fn bounded<T>(&self, fut: impl Future<Output = Result<T>>) -> Result<T> {
        tokio::time::timeout(self.inner.cfg.get_connect_timeout(), fut)
            .await
            .unwrap_or_else(|_| {
                Err(unavailable(
                    "no answer from ZooKeeper within the connect timeout",
                ))
            })
    }

    /// Waiting counters, for tests (feature `test-hooks`).
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub fn wait_stats(&self) -> watch::Receiver<WaitStats> {
        self.inner.stats.subscribe()
    }

    /// The id and password of the control session (which observers and reads use), so that a
    /// test can take the session over and close it, as an administrator could (feature
    /// `test-hooks`).
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub async fn control_session_info(&self) -> Result<zk::SessionInfo> {
        Ok(self.control_session().await?.client.session().clone())
    }

    /// A live session whose timeout is `ttl`, opened if needed. With `strict`, a server that
    /// negotiates another timeout is an error. Keeps at most [`MAX_SESSIONS`] open: idle ones
    /// (used by nothing but the map) are closed to make room.
    pub(crate) async fn session(&self, ttl: Duration, strict: bool) -> Result<Arc<Session>> {
        let mut sessions = self.inner.sessions.lock().await;
        if let Some(s) = sessions.get(&ttl)
            && !s.is_dead()
        {
            return Ok(s.clone());
        }
        let control = self.inner.control_ttl;
        // Dead sessions go at once; idle ones too when room is needed. Under the map's lock a
        // strong count of 1 means no lease, acquire or background delete uses the session (they
        // only get it from the map, under this lock), so closing it takes nothing from anyone.
        sessions.retain(|t, s| *t == control || !s.is_dead());
        if sessions.len() >= MAX_SESSIONS {
            sessions.retain(|t, s| *t == control || Arc::strong_count(s) > 1);
        }
        if sessions.len() >= MAX_SESSIONS {
            return Err(Error::Backend {
                backend: BACKEND,
                source: format!(
                    "this ZkLock already has {MAX_SESSIONS} ZooKeeper sessions open, one per \
                     distinct TTL with a live lease; use fewer distinct TTLs (ZooKeeper also \
                     limits connections per client IP with maxClientCnxns, 60 by default)"
                )
                .into(),
            });
        }
        let s = Session::open(&self.inner.cfg, ttl, strict).await?;
        sessions.insert(s.ttl, s.clone());
        if s.ttl != control {
            spawn_janitor(Arc::downgrade(&self.inner), Arc::downgrade(&s));
        }
        Ok(s)
    }

    /// The session used for requests that carry no lease (fence writes).
    pub(crate) async fn control_session(&self) -> Result<Arc<Session>> {
        self.session(self.inner.control_ttl, false).await
    }

    /// Refuses what no ZooKeeper lease can do: `keepalive(false)` (a session's heartbeat cannot
    /// be paused per lease) and a TTL that is not whole milliseconds.
    pub(crate) fn check_opts(opts: &AcquireOptions) -> Result<()> {
        opts.validate()?;
        if !opts.keepalive {
            return Err(Error::NotSupported {
                operation: "keepalive(false) (manual renewal)",
                backend: BACKEND,
            });
        }
        if !opts.ttl.subsec_nanos().is_multiple_of(1_000_000) {
            return Err(Error::config(format!(
                "TTL {:?} is not a whole number of milliseconds (ZooKeeper session timeouts are)",
                opts.ttl
            )));
        }
        Ok(())
    }

    /// The lock recipe in `t.dir` ([`LockBackend::grant`] documents it): locks and leaderships
    /// (the election's candidates are the lock's waiters, their value the node's data).
    pub(crate) async fn grant_at(&self, t: &Target<'_>, opts: AcquireOptions) -> Result<Granted> {
        Self::check_opts(&opts)?;
        let start = Instant::now();
        let deadline = wait_deadline(opts.wait, start);
        let acquire = retry_transient(&opts, deadline, || self.attempt(t, &opts, start, deadline));
        if opts.wait == Wait::No {
            // `retry_transient` retries a try-once acquire's transient errors without a deadline;
            // bound the whole of it by one connect timeout (dropping attempts is cancel safe).
            return self.bounded(acquire).await;
        }
        acquire.await
    }

    pub(crate) fn fail(
        &self,
        e: zk::Error,
        name: &str,
        start: Instant,
        opts: &AcquireOptions,
    ) -> Error {
        if e == CHROOT_GONE {
            return Error::config(format!(
                "the ZooKeeper chroot {} does not exist (any more): lock nodes cannot be created",
                self.inner.cfg.get_chroot().unwrap_or("/")
            ));
        }
        match (e, opts.wait) {
            (zk::Error::Timeout, Wait::Timeout(_)) => Error::Timeout {
                name: name.to_owned(),
                waited: start.elapsed(),
            },
            (e, _) => from_zk(e),
        }
    }

    /// One acquire attempt on one session: create our node, then wait for our turn.
    async fn attempt(
        &self,
        t: &Target<'_>,
        opts: &AcquireOptions,
        start: Instant,
        deadline: Option<Instant>,
    ) -> Result<Granted> {
        let (name, dir) = (t.name, t.dir.as_str());
        // Requests are bounded by the wait deadline, but never cut shorter than one connect
        // timeout from the start: a free lock is granted even with `Wait::No` or a zero timeout
        // (only waiting for a holder is cut by the deadline), and a frozen server costs a
        // try-once acquire one connect timeout, not a session's life.
        let floor = start + self.inner.cfg.get_connect_timeout();
        let io_deadline = deadline.map(|d| d.max(floor));
        let session = match io_deadline {
            Some(d) => tokio::time::timeout_at(d, self.session(opts.ttl, true))
                .await
                .map_err(|_| self.fail(zk::Error::Timeout, name, start, opts))??,
            None => self.session(opts.ttl, true).await?,
        };
        let own = own_id();
        let mut pending = Pending {
            session: session.clone(),
            dir: dir.to_owned(),
            own: own.clone(),
            path: None,
            armed: true,
        };
        let (node, Created { czxid, ctime }, mut created_at) = self
            .create_node(&session, t, &own, io_deadline, &mut pending)
            .await
            .map_err(|e| self.fail(e, name, start, opts))?;
        let node_name = node.rsplit('/').next().unwrap_or_default().to_owned();
        loop {
            // The lease starts at the send time of a leader-ordered request whose success shows
            // the session alive on the leader (see the session module): the create itself
            // (a write goes through the leader, which checks the session) or the session's
            // latest answered heartbeat (a `sync`), whichever is later, as long as it is less
            // than half a TTL old (a waiter woken by its predecessor's delete); else a `sync`
            // pipelined before the listing. The listing itself needs no `sync` for the queue's
            // sake: lock nodes are only ever appended (higher sequence) or deleted, so a
            // follower's view that lags can only show a predecessor that is gone already, never
            // hide one.
            let proof = created_at.take().max(session.last_confirmed());
            let (sent, children) = match proof.filter(|t| t.elapsed() < session.ttl / 2) {
                Some(at) => (
                    at,
                    session
                        .retry_loss(io_deadline, || session.client.list_children(dir))
                        .await,
                ),
                None => {
                    let at = Instant::now();
                    (at, session.synced_children(dir, io_deadline).await)
                }
            };
            let children = children.map_err(|e| self.fail(e, name, start, opts))?;
            let queue = in_line(children.iter().map(String::as_str));
            let Some(pos) = queue.iter().position(|(_, c)| *c == node_name) else {
                return Err(unavailable(
                    "the lock node disappeared while waiting (its session expired)",
                ));
            };
            if pos == 0 {
                // First in line. A lock-delay marker left by a holder that did not release
                // holds the grant back until its delay is over.
                if children.iter().any(|c| c == DELAY_MARKER) {
                    let marker = format!("{dir}/{DELAY_MARKER}");
                    let Some((remaining, version)) = self
                        .delay_left(&session, &marker, &node_name, ctime, io_deadline)
                        .await
                        .map_err(|e| self.fail(e, name, start, opts))?
                    else {
                        continue; // gone meanwhile (or ours): look again
                    };
                    if !remaining.is_zero() {
                        if opts.wait == Wait::No {
                            pending.delete_now().await;
                            return Err(Error::Held {
                                name: name.to_owned(),
                            });
                        }
                        let end = Instant::now() + remaining;
                        // One sleep: nothing wakes a lock-delay early.
                        if let Some(d) = deadline.filter(|d| *d < end) {
                            tokio::time::sleep_until(d).await;
                            pending.delete_now().await;
                            return Err(Error::Timeout {
                                name: name.to_owned(),
                                waited: start.elapsed(),
                            });
                        }
                        tokio::time::sleep_until(end).await;
                    }
                    match session
                        .retry_loss(io_deadline, || {
                            session.client.delete(&marker, Some(version))
                        })
                        .await
                    {
                        Ok(()) | Err(zk::Error::NoNode | zk::Error::BadVersion) => {}
                        Err(e) => return Err(self.fail(e, name, start, opts)),
                    }
                    continue; // list again: a fresh proof of the session for the lease's start
                }
                let marker = match opts.effective_lock_delay() {
                    None => None,
                    Some(delay) => {
                        let marker = format!("{dir}/{DELAY_MARKER}");
                        if !self
                            .create_marker(&session, &marker, delay, &node_name, io_deadline)
                            .await
                            .map_err(|e| self.fail(e, name, start, opts))?
                        {
                            continue; // another marker is there: deal with it first
                        }
                        Some(marker)
                    }
                };
                // Granted. `sent` is the lease's start (see above).
                let tracker = TrackerHandle::new(sent, session.ttl);
                let Some(reg) = session.register(tracker.clone(), node.clone()) else {
                    return Err(unavailable(
                        "the ZooKeeper session ended during the acquire",
                    ));
                };
                pending.armed = false;
                let ops = Arc::new(ZkLease {
                    session: session.clone(),
                    granted_by: Arc::new(self.clone()),
                    name: name.to_owned(),
                    path: node,
                    czxid,
                    marker,
                    reg,
                    release_attempted: AtomicBool::new(false),
                    written: AtomicBool::new(false),
                });
                crate::lease::watch_own_node(&ops, tracker.clone());
                let token =
                    FencingToken::new(t.token_id.clone(), u64::try_from(czxid).unwrap_or(0));
                let lease = Lease::new(name, token, tracker, ops.clone(), opts);
                return Ok(Granted { lease, ops });
            }
            if opts.wait == Wait::No {
                pending.delete_now().await;
                return Err(Error::Held {
                    name: name.to_owned(),
                });
            }
            let stats = &self.inner.stats;
            match wait_ahead(
                &session,
                dir,
                queue[pos - 1].1,
                io_deadline,
                deadline,
                || WaitingGauge::new(stats),
            )
            .await
            .map_err(|e| self.fail(e, name, start, opts))?
            {
                Ahead::Changed(event) => {
                    if event.event_type != zk::EventType::Session {
                        stats.send_modify(|s| s.wakeups += 1);
                    }
                }
                Ahead::Gone => {}
                Ahead::Deadline => {
                    pending.delete_now().await;
                    return Err(Error::Timeout {
                        name: name.to_owned(),
                        waited: start.elapsed(),
                    });
                }
            }
        }
    }

    /// Creates this acquire's ephemeral sequential node `{dir}/{own}NNNNNNNNNN`, creating the
    /// container parents when missing. If the reply is lost (connection dropped after the
    /// request went out), lists `dir` after reconnecting and adopts the node carrying `own`, or
    /// creates again if there is none. Returns the path, its `czxid` and, when the create's own
    /// reply arrived, the create's send time (a leader-ordered proof of the session's life).
    pub(crate) async fn create_node(
        &self,
        session: &Session,
        t: &Target<'_>,
        own: &str,
        io_deadline: Option<Instant>,
        pending: &mut Pending,
    ) -> Result<(String, Created, Option<Instant>), zk::Error> {
        let dir = t.dir.as_str();
        let prefix = format!("{dir}/{own}");
        let mode = zk::CreateMode::EphemeralSequential.with_acls(session.own_acls());
        for _ in 0..8 {
            let sent = Instant::now();
            let res = match io_deadline {
                Some(d) => {
                    tokio::time::timeout_at(d, session.client.create(&prefix, t.data, &mode))
                        .await
                        .unwrap_or(Err(zk::Error::Timeout))
                }
                None => session.client.create(&prefix, t.data, &mode).await,
            };
            match res {
                // A plain create (OpCode create2) returns the node's stat; inside a multi-op it
                // would not on 3.8.0 (ZOOKEEPER-4026).
                Ok((stat, seq)) => {
                    let path = format!("{prefix}{seq}");
                    pending.path = Some(path.clone());
                    let created = if stat.czxid > 0 {
                        Created {
                            czxid: stat.czxid,
                            ctime: stat.ctime,
                        }
                    } else {
                        self.created_stat(session, &path, io_deadline).await?
                    };
                    return Ok((path, created, Some(sent)));
                }
                Err(zk::Error::NoNode) => self.ensure_dirs(session, t, io_deadline).await?,
                Err(e) if connection_lost(&e) => {
                    // `sync` first: a follower that lags behind the leader could otherwise list
                    // `dir` without the create, whose commit it has not applied yet.
                    let children = session.synced_children(dir, io_deadline).await;
                    let mine = match children {
                        Ok(c) => c.into_iter().find(|c| c.starts_with(own)),
                        Err(zk::Error::NoNode) => None,
                        Err(e) => return Err(e),
                    };
                    if let Some(child) = mine {
                        let path = format!("{dir}/{child}");
                        pending.path = Some(path.clone());
                        let created = self.created_stat(session, &path, io_deadline).await?;
                        return Ok((path, created, None));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Err(zk::Error::ConnectionLoss)
    }

    async fn created_stat(
        &self,
        session: &Session,
        path: &str,
        io_deadline: Option<Instant>,
    ) -> Result<Created, zk::Error> {
        match session
            .retry_loss(io_deadline, || session.client.check_stat(path))
            .await?
        {
            Some(stat) => Ok(Created {
                czxid: stat.czxid,
                ctime: stat.ctime,
            }),
            None => Err(zk::Error::NoNode),
        }
    }

    /// What is left of the lock-delay of the marker `marker`, seen by the first in line (whose
    /// node `own` was created at server time `own_ctime`), and the marker's version to delete
    /// it by once the delay is over (none left for a marker of our own); `None` if the marker
    /// is gone or was stamped meanwhile: look again.
    ///
    /// The marker names the holder node that created it. First in line, every node before
    /// ours is gone, so a marker naming another node was left by a holder that did not
    /// release. The first acquirer to find it so stamps it (a `setData`, version 0 → 1): the
    /// stamp's `mtime`, on the server's clock, is when the lock was seen free. The delay then
    /// counts from the stamp: all of it when we stamp now, else less what the server's clock
    /// shows passed between the stamp and our own node's creation (`ctime`; no credit when
    /// our node is older than the stamp).
    async fn delay_left(
        &self,
        session: &Session,
        marker: &str,
        own: &str,
        own_ctime: i64,
        io_deadline: Option<Instant>,
    ) -> Result<Option<(Duration, i32)>, zk::Error> {
        let (data, stat) = match session
            .retry_loss(io_deadline, || session.client.get_data(marker))
            .await
        {
            Ok(found) => found,
            Err(zk::Error::NoNode) => return Ok(None),
            Err(e) => return Err(e),
        };
        let (delay, holder) = parse_marker(&data);
        if holder == own {
            // Ours, from an attempt of this acquire that went no further: remove it now.
            return Ok(Some((Duration::ZERO, stat.version)));
        }
        if stat.version == 0 {
            return match session
                .retry_loss(io_deadline, || {
                    session.client.set_data(marker, &data, Some(0))
                })
                .await
            {
                Ok(stamped) => Ok(Some((delay, stamped.version))),
                // Stamped or deleted meanwhile (or our own lost stamp, applied): look again.
                Err(zk::Error::NoNode | zk::Error::BadVersion) => Ok(None),
                Err(e) => Err(e),
            };
        }
        let passed = u64::try_from(own_ctime.saturating_sub(stat.mtime)).unwrap_or(0);
        Ok(Some((
            delay.saturating_sub(Duration::from_millis(passed)),
            stat.version,
        )))
    }

    /// Creates this grant's lock-delay marker `marker` (persistent, naming our node `own`, open
    /// to everyone like the lock's container node: whoever comes next, with whatever
    /// credentials, must be able to remove it once its delay is over). `false` if another
    /// marker is in the way.
    async fn create_marker(
        &self,
        session: &Session,
        marker: &str,
        delay: Duration,
        own: &str,
        io_deadline: Option<Instant>,
    ) -> Result<bool, zk::Error> {
        let data = format!("{} {own}", delay.as_millis());
        let mode = zk::CreateMode::Persistent.with_acls(shared_acls());
        match session
            .retry_loss(io_deadline, || {
                session.client.create(marker, data.as_bytes(), &mode)
            })
            .await
        {
            Ok(_) => Ok(true),
            Err(zk::Error::NodeExists) => {
                // Ours if an earlier attempt whose reply was lost created it.
                match session
                    .retry_loss(io_deadline, || session.client.get_data(marker))
                    .await
                {
                    Ok((found, _)) => Ok(parse_marker(&found).1 == own),
                    Err(zk::Error::NoNode) => Ok(false),
                    Err(e) => Err(e),
                }
            }
            Err(e) => Err(e),
        }
    }

    /// Creates `/{prefix}`, the directories between it and `t.dir`, and `t.dir` itself (with
    /// `t.dir_data`) as container nodes (the server deletes a container once its last child is
    /// gone, so names used once do not pile up), open to everyone ([`shared_acls`]) whatever
    /// the credentials.
    pub(crate) async fn ensure_dirs(
        &self,
        session: &Session,
        t: &Target<'_>,
        io_deadline: Option<Instant>,
    ) -> Result<(), zk::Error> {
        let mode = zk::CreateMode::Container.with_acls(shared_acls());
        let prefix = format!("/{}", self.inner.cfg.get_prefix());
        let mut paths = vec![prefix.clone()];
        let rest = t.dir.strip_prefix(&prefix).unwrap_or_default();
        let mut at = prefix.clone();
        for part in rest.split('/').filter(|p| !p.is_empty()) {
            at = format!("{at}/{part}");
            paths.push(at.clone());
        }
        for path in &paths {
            let data = if *path == t.dir { t.dir_data } else { &[] };
            match session
                .retry_loss(io_deadline, || session.client.create(path, data, &mode))
                .await
            {
                Ok(_) | Err(zk::Error::NodeExists) => {}
                // The prefix node's parent is the chroot's root, which always exists unless the
                // chroot itself is missing (deleted after connect).
                Err(zk::Error::NoNode) if *path == prefix => return Err(CHROOT_GONE),
                // The server reaped an (empty) parent container between two creates: the
                // caller's next create fails with `NoNode` again and brings us back here.
                Err(zk::Error::NoNode) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// Closes `session` once it has been idle (used by nothing but the map) at two checks one TTL
/// apart, so a TTL's session lingers one to two TTLs after its last lease, ready for the next.
fn spawn_janitor(inner: Weak<Inner>, session: Weak<Session>) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    rt.spawn(async move {
        let mut idle_before = false;
        loop {
            let Some(ttl) = session.upgrade().map(|s| s.ttl) else {
                return;
            };
            tokio::time::sleep(ttl).await;
            let (Some(inner), Some(s)) = (inner.upgrade(), session.upgrade()) else {
                return;
            };
            let mut sessions = inner.sessions.lock().await;
            if !sessions.get(&ttl).is_some_and(|m| Arc::ptr_eq(m, &s)) {
                return; // replaced (it died) or already closed to make room
            }
            // 2: the map's reference and `s`.
            let idle = Arc::strong_count(&s) == 2;
            if idle && idle_before {
                sessions.remove(&ttl);
                // Dropping the last `Client` clone sends closeSession.
                return;
            }
            idle_before = idle;
        }
    });
}

/// Marker error: the chroot does not exist (reported as [`Error::InvalidConfig`]).
const CHROOT_GONE: zk::Error = zk::Error::BadArguments(&"the chroot does not exist");

/// The name, in a lock's container node, of the lock-delay marker: a persistent node created by
/// a holder granted with a lock-delay, deleted by its release (in one multi-op with its lock
/// node). A marker that outlives its holder's node tells the next in line that the holder
/// ended without a release. Never taken for a lock node (no `-lock-NNNN`).
pub(crate) const DELAY_MARKER: &str = "lock-delay";

/// A marker's data, `{delay in ms} {holder node}`: its delay (at most
/// [`MAX_LOCK_DELAY`](lockkit_core::MAX_LOCK_DELAY); that much for data this crate did not
/// write) and the holder node's name.
fn parse_marker(data: &[u8]) -> (Duration, &str) {
    let text = std::str::from_utf8(data).unwrap_or_default();
    let (ms, holder) = text.split_once(' ').unwrap_or(("", ""));
    let delay = ms
        .parse::<u64>()
        .map(Duration::from_millis)
        .unwrap_or(lockkit_core::MAX_LOCK_DELAY);
    (delay.min(lockkit_core::MAX_LOCK_DELAY), holder)
}

struct WaitingGauge<'a>(&'a watch::Sender<WaitStats>);

impl<'a> WaitingGauge<'a> {
    fn new(tx: &'a watch::Sender<WaitStats>) -> Self {
        tx.send_modify(|s| s.waiting += 1);
        Self(tx)
    }
}

impl Drop for WaitingGauge<'_> {
    fn drop(&mut self) {
        self.0
            .send_modify(|s| s.waiting = s.waiting.saturating_sub(1));
    }
}

#[async_trait]
impl LockBackend for ZkLock {
    /// Acquires `name`: creates an ephemeral sequential node under the lock's container node and
    /// waits, watching only its predecessor, until it is the lowest.
    ///
    /// # Errors
    /// As [`Lock::acquire`](lockkit_core::Lock::acquire), plus:
    /// - [`Error::NotSupported`] for `keepalive(false)`: a ZooKeeper session's heartbeat cannot
    ///   be paused, so a lease cannot be left to lapse while its holder lives.
    /// - [`Error::InvalidConfig`] if the TTL is not a whole number of milliseconds or the server
    ///   negotiates another session timeout for it.
    /// - [`Error::Unavailable`] for a `Wait::No` acquire that got no answer within the connect
    ///   timeout. A timed acquire's requests get at least one connect timeout too (a free lock is
    ///   granted even with a zero wait), so it may return up to that long after its deadline when
    ///   the server does not answer.
    /// - [`Error::Backend`] if [`MAX_SESSIONS`] sessions (distinct TTLs) are already in use.
    /// - [`Error::Held`] for a try-once acquire during a lock-delay left by a holder that ended
    ///   without a release (see the crate docs, "Lock-delay"); a waiting acquire sleeps it out
    ///   (at most until its deadline: [`Error::Timeout`]).
    ///
    /// # Cancel safety
    /// Cancel safe: a node created by a dropped acquire is deleted in the background (found by
    /// this acquire's unique id if the create's reply had not arrived yet); if the connection is
    /// down the session's expiry deletes it.
    async fn grant(&self, name: &str, opts: AcquireOptions) -> Result<Lease> {
        validate_name(name)?;
        let t = Target {
            name,
            dir: self.lock_dir(name)?,
            token_id: self.lock_id(name),
            data: &[],
            dir_data: &[],
        };
        Ok(self.grant_at(&t, opts).await?.lease)
    }

    fn guarantees(&self) -> Guarantees {
        let mut g = Guarantees::new(BACKEND, LockKind::Correctness);
        g.tokens_survive_restart = true;
        g.safe_across_failover = true;
        g.fifo_waiters = true;
        g.manual_renewal = false;
        g.expiry_slack = EXPIRY_SLACK;
        g.lock_delay = true;
        g.loss_notice = Some(LOSS_NOTICE);
        g.notes = "ZooKeeper: consensus-backed (ZAB); lease = session, TTL = negotiated session \
                   timeout; token = holder node czxid; FIFO by sequence number; tokens durable \
                   when the transaction log is fsynced (forceSync=yes, the default); lock-delay \
                   through a marker node, counted from when the next acquirer saw the lock free";
        g
    }

    /// Lists the lock's nodes and reads the first one's `czxid` (the holder's token; no holder
    /// while another node's lock-delay marker says a failed holder's delay runs). The
    /// remaining time is unknown: a node does not tell its owner session's timeout to others.
    /// A holder node deleted between the two reads makes the next one the holder: read again.
    ///
    /// # Errors
    /// As [`Lock::holder`](lockkit_core::Lock::holder); [`Error::Unavailable`] if no answer came within the connect timeout.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    async fn holder(&self, name: &str) -> Result<Option<HolderInfo>> {
        let dir = self.lock_dir(name)?;
        for _ in 0..3 {
            let Some(first) = self.contenders(name).await?.into_iter().next() else {
                return Ok(None);
            };
            let path = format!("{dir}/{first}");
            let marker = format!("{dir}/{DELAY_MARKER}");
            let (stat, delay_holder) = self
                .bounded(async {
                    let session = self.control_session().await?;
                    let stat = session.client.check_stat(&path).await.map_err(from_zk)?;
                    let delay_holder = match session.client.get_data(&marker).await {
                        Ok((data, _)) => Some(parse_marker(&data).1.to_owned()),
                        Err(zk::Error::NoNode) => None,
                        Err(e) => return Err(from_zk(e)),
                    };
                    Ok((stat, delay_holder))
                })
                .await?;
            if delay_holder.is_some_and(|h| h != first) {
                // Another grant's lock-delay marker: a failed holder's delay runs, and the first
                // node is a waiter sitting it out, not a holder.
                return Ok(None);
            }
            if let Some(stat) = stat {
                let token = u64::try_from(stat.czxid)
                    .ok()
                    .map(|z| FencingToken::new(self.lock_id(name), z));
                return Ok(Some(HolderInfo::new(token, None)));
            }
        }
        Err(unavailable(
            "the lock's holder changed during three reads in a row",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::sequence_of;

    #[test]
    fn sequences() {
        assert_eq!(sequence_of("abc-lock-0000000012"), Some(12));
        assert_eq!(sequence_of("a-lock-b-lock-0000000003"), Some(3));
        assert_eq!(sequence_of("abc-lock-"), None);
        assert_eq!(sequence_of("abc-lock-12x"), None);
        assert_eq!(sequence_of("other"), None);
        assert_eq!(sequence_of(DELAY_MARKER), None);
        let listing = [
            "b-lock-0000000010",
            DELAY_MARKER,
            "a-lock-0000000009",
            "slot-0",
        ];
        assert_eq!(
            in_line(listing),
            [(9, "a-lock-0000000009"), (10, "b-lock-0000000010")]
        );
    }

    #[test]
    fn markers() {
        assert_eq!(
            parse_marker(b"1500 abc-lock-0000000001"),
            (Duration::from_millis(1500), "abc-lock-0000000001")
        );
        assert_eq!(
            parse_marker(b"9999999 x"),
            (lockkit_core::MAX_LOCK_DELAY, "x")
        );
        assert_eq!(parse_marker(b"\xff"), (lockkit_core::MAX_LOCK_DELAY, ""));
        assert_eq!(parse_marker(b""), (lockkit_core::MAX_LOCK_DELAY, ""));
    }
}
