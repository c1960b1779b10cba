//! ZooKeeper sessions as lease carriers.
//!
//! One [`Session`] per distinct TTL per [`ZkLock`](crate::ZkLock): its negotiated session timeout
//! *is* the TTL of every lease it carries. A monitor task per session maps session states to lease
//! states and confirms the leases' trackers with the send time of its own periodic round trip.
//!
//! # Leader-ordered heartbeat
//!
//! A [`sync`](https://zookeeper.apache.org/doc/r3.8.0/zookeeperProgrammers.html#ch_zkGuarantees)
//! sent to a follower is forwarded to the leader, which checks the session
//! (`PrepRequestProcessor`: `sessionTracker.checkSession`, failing with `SessionExpired` for an
//! expired or closing session) and answers only after every proposal issued before it has been
//! committed; the follower applies those commits, in order, before it answers the `sync`. So if
//! the leader had expired the session (a `closeSession` transaction) before the `sync` reached
//! it, the follower applies that transaction first and drops the session: the `sync` is never
//! answered with success. A follower cut off from the leader cannot answer a `sync` at all. A
//! successful `sync` sent at `t` therefore shows the session alive on the leader at some point
//! after `t`; the leader times the session out only `TTL` after the follower's last report of
//! client activity (followers report session touches with every ping, every `tickTime / 2`), and
//! rounds expiry up to the next tick. Residual window, stated plainly: if the quorum link breaks
//! within half a tick after the `sync` reached the follower, the leader's last report of this
//! session may be older than `t` (by at most the time since the client's previous request or
//! ping, under `TTL / 3`). On a standalone server the `sync` is answered locally, which is the
//! same server that expires sessions.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use lockkit_core::backend::{Backoff, SuspectReason, TrackerHandle};
use lockkit_core::{Error, Instant, LossReason, Result};
use tokio::task::AbortHandle;
use zookeeper_client as zk;

use crate::config::ZkConfig;
use crate::error::{connection_lost, from_zk, unavailable};

/// A lease registered with its session: the monitor confirms, suspects or loses its tracker.
struct Registered {
    tracker: TrackerHandle,
    path: String,
}

/// One ZooKeeper session (one `zookeeper_client::Client`), the lease of every lock node it owns.
pub(crate) struct Session {
    pub(crate) client: zk::Client,
    /// The negotiated session timeout, equal to the TTL of every lease on this session.
    pub(crate) ttl: Duration,
    /// The session id, as stored in its ephemeral nodes' `ephemeralOwner`.
    pub(crate) id: i64,
    /// Lock nodes get `CREATOR_ALL_ACL` when the client authenticated, else `OPEN_ACL_UNSAFE`
    /// (see [`own_acls`](Self::own_acls)).
    pub(crate) creator_acl: bool,
    leases: Mutex<HashMap<u64, Registered>>,
    /// Send time of the latest answered heartbeat (`sync`), or of the session's creation.
    confirmed: Mutex<Option<Instant>>,
    next_id: AtomicU64,
    dead: AtomicBool,
    monitor: Mutex<Option<AbortHandle>>,
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session")
            .field("id", &format_args!("{:#x}", self.id))
            .field("ttl", &self.ttl)
            .field("dead", &self.is_dead())
            .finish()
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Some(h) = self.monitor_slot().take() {
            h.abort();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section leaves the map consistent; a panic elsewhere must not poison it.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Session {
    /// Opens a session asking for `ttl` as its session timeout.
    ///
    /// With `strict`, a server that negotiates another timeout (it clamps to its
    /// `minSessionTimeout`/`maxSessionTimeout`) gets the session closed and an
    /// [`Error::InvalidConfig`] naming both values: a lease never silently gets another TTL.
    pub(crate) async fn open(cfg: &ZkConfig, ttl: Duration, strict: bool) -> Result<Arc<Self>> {
        let mut connector = zk::Client::connector()
            .with_session_timeout(ttl)
            .with_fail_eagerly();
        if let Some(auth) = cfg.digest_auth() {
            connector = connector.with_auth("digest", &auth);
        }
        if let Some(sasl) = cfg.sasl_options() {
            connector = connector.with_sasl(sasl);
        }
        let tls = cfg.tls_options().await?;
        let secure = tls.is_some();
        if let Some(tls) = tls {
            // zookeeper-client builds its rustls config from the process-wide provider.
            // Install ring unless the application installed one already (then a no-op).
            let _ = rustls::crypto::ring::default_provider().install_default();
            connector = connector.with_tls(tls);
        }
        let cs = cfg.connect_string();
        // A new session is created by a transaction the leader orders (`createSession`), after
        // this instant: its send time is the first proof of the session's life.
        let opened = Instant::now();
        let client = match tokio::time::timeout(cfg.get_connect_timeout(), async {
            if secure {
                connector.secure_connect(&cs).await
            } else {
                connector.connect(&cs).await
            }
        })
        .await
        {
            Err(_) => return Err(unavailable("connecting to ZooKeeper timed out")),
            Ok(Err(e @ zk::Error::BadArguments(_))) => {
                return Err(Error::config_with("invalid ZooKeeper connect string", e));
            }
            Ok(Err(e @ (zk::Error::NoHosts | zk::Error::ConnectionLoss))) => {
                // A server at its `maxClientCnxns` limit for this host accepts the TCP
                // connection and closes it at once; the client sees exactly this.
                return Err(Error::Unavailable {
                    backend: crate::error::BACKEND,
                    source: format!(
                        "could not open a ZooKeeper session ({e}): no server reachable, or \
                             each closed the connection (a server also does this to clients \
                             beyond its maxClientCnxns connections per IP address, 60 by \
                             default){}",
                        if secure {
                            "; with TLS, also a certificate refused by either side (the \
                             client does not tell which): check tls_ca, tls_cert, tls_key and \
                             that the port is the secureClientPort"
                        } else {
                            ""
                        }
                    )
                    .into(),
                });
            }
            Ok(Err(e)) => return Err(from_zk(e)),
            Ok(Ok(c)) => c,
        };
        if cfg.sasl_options().is_some() {
            check_sasl(&client, cfg.get_connect_timeout()).await?;
        }
        let negotiated = client.session_timeout();
        if strict && negotiated != ttl {
            return Err(Error::config(format!(
                "ZooKeeper negotiated a session timeout of {negotiated:?} for a requested TTL of \
                 {ttl:?}: the server's minSessionTimeout/maxSessionTimeout do not allow this TTL \
                 (a ZooKeeper lease's TTL is its session timeout)"
            )));
        }
        let session = Arc::new(Session {
            id: client.session_id().0,
            ttl: negotiated,
            creator_acl: cfg.authenticated(),
            client,
            leases: Mutex::new(HashMap::new()),
            confirmed: Mutex::new(Some(opened)),
            next_id: AtomicU64::new(0),
            dead: AtomicBool::new(false),
            monitor: Mutex::new(None),
        });
        let states = session.client.state_watcher();
        let h = tokio::spawn(monitor(Arc::downgrade(&session), states, negotiated / 3));
        *session.monitor_slot() = Some(h.abort_handle());
        Ok(session)
    }

    fn monitor_slot(&self) -> MutexGuard<'_, Option<AbortHandle>> {
        lock(&self.monitor)
    }

    /// ACLs for the nodes that belong to one holder (its lock node, its fenced data node):
    /// creator-only when the client authenticated. Shared parents (the prefix node, a lock's
    /// container node) get [`shared_acls`] instead.
    pub(crate) fn own_acls(&self) -> zk::Acls<'static> {
        if self.creator_acl {
            zk::Acls::creator_all()
        } else {
            zk::Acls::anyone_all()
        }
    }

    /// The session expired, was closed, or failed authentication: its ephemeral nodes are gone
    /// (or going) and it can carry no lease any more. Final.
    pub(crate) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst) || self.client.state().is_terminated()
    }

    /// Registers a granted lease so the monitor drives its tracker. Returns its id, or `None` if
    /// the session died meanwhile (the tracker is then marked lost).
    pub(crate) fn register(&self, tracker: TrackerHandle, path: String) -> Option<u64> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        lock(&self.leases).insert(
            id,
            Registered {
                tracker: tracker.clone(),
                path,
            },
        );
        // A state change between the grant and the insert above would have been missed.
        if self.is_dead() {
            self.kill();
            return None;
        }
        if !matches!(
            self.client.state(),
            zk::SessionState::SyncConnected | zk::SessionState::ConnectedReadOnly
        ) {
            tracker.mark_suspect(SuspectReason::ConnectionLost);
        }
        Some(id)
    }

    /// A lease object went away while its lease is still live (`Lease::leak`): stop confirming it
    /// and delete its node at its deadline, so it is held for its TTL and no longer, as a lease
    /// nobody renews on other backends.
    pub(crate) fn abandon(self: &Arc<Self>, id: u64) {
        let Some(r) = lock(&self.leases).remove(&id) else {
            return;
        };
        if r.tracker.state() == lockkit_core::LeaseState::Lost {
            // Released or lost: put it back for the monitor / the background delete to finish.
            lock(&self.leases).insert(id, r);
            return;
        }
        spawn_delete_at(self.clone(), r.path, r.tracker.valid_until());
    }

    /// Send time of the latest answered heartbeat, or of the session's creation: the session
    /// was alive on the leader at some point after it (see the module docs).
    pub(crate) fn last_confirmed(&self) -> Option<Instant> {
        *lock(&self.confirmed)
    }

    /// Forgets a lease (after its node was deleted, or found gone).
    pub(crate) fn deregister(&self, id: u64) {
        lock(&self.leases).remove(&id);
    }

    fn suspect_all(&self) {
        for r in lock(&self.leases).values() {
            r.tracker.mark_suspect(SuspectReason::ConnectionLost);
        }
    }

    /// The session is over: every lease it carried is lost.
    fn kill(&self) {
        self.dead.store(true, Ordering::SeqCst);
        let all: Vec<Registered> = lock(&self.leases).drain().map(|(_, r)| r).collect();
        for r in all {
            r.tracker.mark_lost(LossReason::SessionExpired);
        }
    }

    /// A round trip sent at `sent` was answered: the session was alive on the server at some
    /// point after `sent`, so it stays alive until at least `sent + ttl`. Confirms every tracker.
    /// A tracker that is already lost is dropped from the session and its node deleted: at once
    /// if its deadline passed (the holder was told it lost the lock), else at its deadline (the
    /// holder dropped the lease without releasing it: it lapses after its TTL, as elsewhere).
    fn confirm_all(self: &Arc<Self>, sent: Instant) {
        {
            let mut c = lock(&self.confirmed);
            *c = (*c).max(Some(sent));
        }
        let mut lost = Vec::new();
        {
            let mut leases = lock(&self.leases);
            leases.retain(|_, r| {
                if r.tracker.confirm(sent) {
                    true
                } else {
                    lost.push((std::mem::take(&mut r.path), r.tracker.valid_until()));
                    false
                }
            });
        }
        for (path, deadline) in lost {
            spawn_delete_at(self.clone(), path, deadline);
        }
    }

    /// Retries `op` while it fails with a lost connection and the session lives: the client
    /// queues requests until it reconnects, so this waits at most until the session reconnects
    /// or expires. Stops early at `deadline`.
    pub(crate) async fn retry_loss<T, F, Fut>(
        &self,
        deadline: Option<Instant>,
        op: F,
    ) -> Result<T, zk::Error>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, zk::Error>>,
    {
        self.retry_loss_seen(deadline, op).await.0
    }

    /// [`retry_loss`](Self::retry_loss), also telling whether an attempt was lost on the way (it
    /// may have been applied: a retried delete may find its node already gone).
    pub(crate) async fn retry_loss_seen<T, F, Fut>(
        &self,
        deadline: Option<Instant>,
        mut op: F,
    ) -> (Result<T, zk::Error>, bool)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, zk::Error>>,
    {
        let mut backoff = Backoff::new(Duration::from_millis(10), Duration::from_millis(500));
        let mut lost = false;
        loop {
            let attempt = op();
            let res = match deadline {
                Some(d) => match tokio::time::timeout_at(d, attempt).await {
                    Ok(r) => r,
                    Err(_) => return (Err(zk::Error::Timeout), true),
                },
                None => attempt.await,
            };
            match res {
                Err(e) if connection_lost(&e) && !self.is_dead() => {
                    lost = true;
                    let pause = backoff.next_delay();
                    if deadline.is_some_and(|d| Instant::now() + pause >= d) {
                        return (Err(e), lost);
                    }
                    tokio::time::sleep(pause).await;
                }
                other => return (other, lost),
            }
        }
    }

    /// Deletes a holder's node `path` at `version` (`Some(0)` for a lock node, which is never
    /// written; `None` once a leader proclaimed into it) and, in the same multi-op, its
    /// lock-delay marker `marker` if it has one: a release frees the lock at once. A marker
    /// found gone (deleted by hand) does not stop the node's delete.
    pub(crate) async fn delete_holder(
        &self,
        path: &str,
        marker: Option<&str>,
        version: Option<i32>,
    ) -> Result<(), zk::Error> {
        let Some(marker) = marker else {
            return self.client.delete(path, version).await;
        };
        let mut w = self.client.new_multi_writer();
        w.add_delete(path, version)?;
        w.add_delete(marker, None)?;
        match w.commit().await {
            Ok(_) => Ok(()),
            Err(zk::MultiWriteError::OperationFailed {
                index: 1,
                source: zk::Error::NoNode,
            }) => self.client.delete(path, version).await,
            Err(e) => Err(e.into()),
        }
    }

    /// `sync(dir)` then `list_children(dir)`, queued together (a session answers in order): a
    /// listing that reflects every transaction the leader committed before the `sync` reached
    /// it.
    pub(crate) async fn synced_children(
        &self,
        dir: &str,
        io_deadline: Option<Instant>,
    ) -> Result<Vec<String>, zk::Error> {
        self.retry_loss(io_deadline, || {
            let sync = self.client.sync(dir);
            let list = self.client.list_children(dir);
            async move {
                let (synced, list) = tokio::join!(sync, list);
                synced?;
                list
            }
        })
        .await
    }
}

/// A server without SASL (no JAAS `Server` section, no `SASLAuthenticationProvider`) lets a
/// SASL client on without authenticating it: lock nodes would then fail with `InvalidACL`
/// (creator-only ACL, no identity) and fenced writes likewise. Asks the server who this session
/// is (`whoami`, ZooKeeper ≥ 3.7; skipped on older servers) and refuses a session without a
/// `sasl` identity with [`Error::Auth`].
async fn check_sasl(client: &zk::Client, timeout: Duration) -> Result<()> {
    match tokio::time::timeout(timeout, client.list_auth_users()).await {
        Err(_) => Err(unavailable(
            "no answer from ZooKeeper to whoami within the connect timeout",
        )),
        Ok(Ok(users)) if users.iter().any(|u| u.scheme() == "sasl") => Ok(()),
        Ok(Ok(_)) => Err(Error::Auth {
            backend: crate::error::BACKEND,
            source: "the ZooKeeper server did not authenticate the SASL user: it has no SASL \
                     configured (a JAAS Server section and authProvider \
                     SASLAuthenticationProvider)"
                .into(),
        }),
        Ok(Err(zk::Error::Unimplemented)) => Ok(()),
        Ok(Err(e)) => Err(from_zk(e)),
    }
}

/// Deletes `path` (a node this client created, whose name holds its acquire's unique id, so
/// at any version) in the background, retrying lost connections
/// until the delete is acknowledged, the node is found gone, or the session ends (its ephemeral
/// nodes then go with it). Then deregisters `lease_id`.
pub(crate) fn spawn_delete(session: Arc<Session>, path: String, lease_id: Option<u64>) {
    spawn_release(session, path, None, None, lease_id);
}

/// [`spawn_delete`] of a released holder's node together with its lock-delay `marker`
/// ([`Session::delete_holder`]). If the session ends first, the marker stays: the lease then
/// ended without a release as far as the next holder can tell.
pub(crate) fn spawn_release(
    session: Arc<Session>,
    path: String,
    marker: Option<String>,
    version: Option<i32>,
    lease_id: Option<u64>,
) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return; // no runtime: the session's end frees the node
    };
    rt.spawn(async move {
        let res = session
            .retry_loss(None, || {
                session.delete_holder(&path, marker.as_deref(), version)
            })
            .await;
        if let Err(e) = &res
            && !matches!(e, zk::Error::NoNode | zk::Error::BadVersion) && !session.is_dead() {
                tracing::warn!(node = %path, error = %e, "could not delete lock node; the session's end will");
            }
        if let Some(id) = lease_id {
            session.deregister(id);
        }
    });
}

/// Deletes `path` in the background at `at` (at once if `at` has passed).
fn spawn_delete_at(session: Arc<Session>, path: String, at: Instant) {
    if at <= Instant::now() {
        tracing::debug!(node = %path, "lease lapsed on the client side; deleting its node");
        return spawn_delete(session, path, None);
    }
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return; // no runtime: the session's end frees the node
    };
    rt.spawn(async move {
        tokio::time::sleep_until(at).await;
        spawn_delete(session, path, None);
    });
}

/// Deletes, in the background, every child of `dir` whose name starts with `own_prefix` (this
/// acquire's unique id), for an acquire dropped while its create may have been in flight.
pub(crate) fn spawn_delete_own(session: Arc<Session>, dir: String, own_prefix: String) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    rt.spawn(async move {
        // Requests on one session are answered in order, so this listing sees a create that was
        // sent before it; the `sync` makes a lagging follower catch up with the leader first.
        let children = match session.synced_children(&dir, None).await {
            Ok(c) => c,
            Err(_) => return, // no parent, or the session ended: nothing of ours remains
        };
        for child in children.into_iter().filter(|c| c.starts_with(&own_prefix)) {
            spawn_delete(session.clone(), format!("{dir}/{child}"), None);
        }
    });
}

/// ACLs for shared parent nodes (the prefix node, a lock's container node): open to everyone
/// (`OPEN_ACL_UNSAFE`). Whoever creates such a node first (they are containers: the server
/// deletes them when empty and the next acquire re-creates them) must not lock every other
/// user out of the lock; the lock nodes inside stay creator-only when authenticated.
pub(crate) fn shared_acls() -> zk::Acls<'static> {
    zk::Acls::anyone_all()
}

type Heartbeat = Pin<Box<dyn Future<Output = (Instant, Result<(), zk::Error>)> + Send>>;

/// Session states → lease states, and the client-side confirmation of every lease:
/// - `Disconnected` → every lease [`Suspect`](lockkit_core::LeaseState::Suspect);
/// - `Expired`, `Closed`, `AuthFailed` → every lease [`Lost`](lockkit_core::LeaseState::Lost);
/// - every `interval` (TTL/3) a `sync` round trip; its answer confirms every lease with the
///   request's send time. A `sync` is leader-ordered (see the module docs); a plain read is
///   not: a follower cut off from the leader keeps answering reads from its own state for up to
///   `syncLimit` ticks while the leader may already have expired the session and granted the
///   lock to someone else. Without answers the trackers reach their deadline (send time of the
///   last answered round trip + TTL − margin) and turn Lost on their own, whether or not the
///   server has said anything.
async fn monitor(weak: Weak<Session>, mut states: zk::StateWatcher, interval: Duration) {
    let mut next = Instant::now() + interval;
    let mut inflight: Option<Heartbeat> = None;
    loop {
        tokio::select! {
            state = states.changed() => {
                let Some(s) = weak.upgrade() else { return };
                match state {
                    zk::SessionState::Disconnected => s.suspect_all(),
                    zk::SessionState::SyncConnected | zk::SessionState::ConnectedReadOnly => {
                        // Confirmed by the next round trip; send it now.
                        next = Instant::now();
                    }
                    _ => {
                        tracing::debug!(session = %format_args!("{:#x}", s.id), ?state, "ZooKeeper session ended; its leases are lost");
                        s.kill();
                        return;
                    }
                }
            }
            (sent, res) = async {
                match inflight.as_mut() {
                    Some(hb) => hb.await,
                    None => std::future::pending().await,
                }
            }, if inflight.is_some() => {
                inflight = None;
                let Some(s) = weak.upgrade() else { return };
                match res {
                    Ok(()) => s.confirm_all(sent),
                    Err(e) if e == zk::Error::SessionExpired || s.is_dead() => {
                        s.kill();
                        return;
                    }
                    Err(e) => tracing::debug!(error = %e, "session heartbeat failed"),
                }
            }
            _ = tokio::time::sleep_until(next), if inflight.is_none() => {
                let Some(s) = weak.upgrade() else { return };
                let client = s.client.clone();
                drop(s);
                let sent = Instant::now();
                inflight = Some(Box::pin(async move {
                    // `sync`, not a read: see `leader_ordered` below.
                    let res = client.sync("/").await;
                    (sent, res)
                }));
                next = sent + interval;
            }
        }
    }
}
