//! The server half of a ZooKeeper lease: one ephemeral sequential node, owned by one session.

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use lockkit_core::backend::{Backoff, LeaseOps, TrackerHandle};
use lockkit_core::{Error, Instant, LossReason, Result, async_trait};
use zookeeper_client as zk;

use crate::error::{connection_lost, from_zk, unavailable};
use crate::session::{Session, spawn_release};

/// The ZooKeeper side of a [`Lease`](lockkit_core::Lease): the lock node it owns and the session
/// that carries it. Reach it from a lease with
/// `lease.ops().as_any().downcast_ref::<ZkLease>()` (the fence does this for you).
pub struct ZkLease {
    pub(crate) session: Arc<Session>,
    /// The `ZkLock` that granted the lease (its control session carries fenced writes); typed
    /// `Any` so that this module does not depend on the lock module.
    pub(crate) granted_by: Arc<dyn Any + Send + Sync>,
    pub(crate) name: String,
    pub(crate) path: String,
    pub(crate) czxid: i64,
    /// The lock-delay marker this grant created (see `DELAY_MARKER` in the lock module), which
    /// only a release deletes.
    pub(crate) marker: Option<String>,
    pub(crate) reg: u64,
    /// A release was sent: the node's deletion from then on is ours, not a loss.
    pub(crate) release_attempted: AtomicBool,
    /// The node's data was written (a leader's proclaim): its release deletes it whatever its
    /// version (its name holds the acquire's unique id, so it is ours), not at version 0.
    pub(crate) written: AtomicBool,
}

impl fmt::Debug for ZkLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZkLease")
            .field("node", &self.path)
            .field("czxid", &self.czxid)
            .field("session", &format_args!("{:#x}", self.session.id))
            .finish()
    }
}

impl Drop for ZkLease {
    fn drop(&mut self) {
        // A released lease was deregistered already; a leaked one is still live here.
        self.session.abandon(self.reg);
    }
}

impl ZkLease {
    /// Deletes this lease's node as [`LeaseOps::release`] documents, with its lock-delay marker
    /// unless `lapsed` ([`LeaseOps::relinquish`]).
    async fn give_back(&self, lapsed: bool) -> Result<()> {
        let marker = self.marker.clone().filter(|_| !lapsed);
        self.release_attempted.store(true, Ordering::SeqCst);
        if self.session.is_dead() {
            self.session.deregister(self.reg);
            return Err(self.not_held());
        }
        let deadline = Instant::now() + self.session.ttl;
        let (res, retried) = self
            .session
            .retry_loss_seen(Some(deadline), || {
                self.session
                    .delete_holder(&self.path, marker.as_deref(), self.version())
            })
            .await;
        match res {
            Ok(()) => {
                self.session.deregister(self.reg);
                Ok(())
            }
            // An earlier attempt whose reply was lost deleted the node: the answer came on this
            // (live) session, whose ephemeral node nothing else deletes.
            Err(zk::Error::NoNode) if retried => {
                self.session.deregister(self.reg);
                Ok(())
            }
            Err(zk::Error::NoNode | zk::Error::BadVersion | zk::Error::SessionExpired) => {
                self.session.deregister(self.reg);
                Err(self.not_held())
            }
            Err(e) if connection_lost(&e) || e == zk::Error::Timeout => {
                spawn_release(
                    self.session.clone(),
                    self.path.clone(),
                    marker.clone(),
                    self.version(),
                    Some(self.reg),
                );
                Err(unavailable(
                    "release not acknowledged; the lock node is deleted in the background, or \
                     with its session when that expires",
                ))
            }
            Err(e) => Err(from_zk(e)),
        }
    }

    /// The version a release deletes the node at: 0 (lock nodes are never written), any once
    /// a proclaim wrote it.
    fn version(&self) -> Option<i32> {
        (!self.written.load(Ordering::SeqCst)).then_some(0)
    }

    /// The lock node's path (below the chroot, if any).
    pub fn node_path(&self) -> &str {
        &self.path
    }

    /// The lock node's `czxid`: the lease's fencing token.
    pub fn czxid(&self) -> i64 {
        self.czxid
    }

    /// The id of the ZooKeeper session that owns the node (its `ephemeralOwner`).
    pub fn session_id(&self) -> i64 {
        self.session.id
    }

    fn not_held(&self) -> Error {
        Error::NotHeld {
            name: self.name.clone(),
        }
    }
}

/// Sets a watch on a granted lease's own node and marks its tracker lost as soon as ZooKeeper
/// deletes the node while the holder did not release it (an admin's `delete`, or its session
/// closed by another client): without it the holder would hear of it only from its next
/// `renew`/`check`, or not before its session dies.
///
/// One watch on one node, which the server fires once, on the node's change. A watch lost with
/// a connection is set again (zookeeper-client re-registers watches on reconnect; a session
/// event wakes us and we set a fresh one); the session's expiry is the session monitor's to
/// report. The task ends with the lease (its tracker lost for any reason). It holds the session
/// weakly (and a clone of its client): a released lease's session must count as idle at once,
/// not once this task has noticed the release.
pub(crate) fn watch_own_node(lease: &Arc<ZkLease>, tracker: TrackerHandle) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let weak = Arc::downgrade(lease);
    let (client, path, czxid) = (
        lease.session.client.clone(),
        lease.path.clone(),
        lease.czxid,
    );
    let session = Arc::downgrade(&lease.session);
    let dead = move || session.upgrade().is_none_or(|s| s.is_dead());
    let ended = tracker.view().lost();
    rt.spawn(async move {
        let gone = async {
            let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
            loop {
                // The request's future is boxed (and the backoff's sleep): held only while it
                // runs, it would otherwise size this task, which waits on `changed()` almost all
                // its life (2,048 B per held lease before, heaptrack of the many-leases
                // benchmark).
                let watcher = match Box::pin(client.check_and_watch_stat(&path)).await {
                    Ok((Some(stat), w)) if stat.czxid == czxid => {
                        backoff.reset();
                        w
                    }
                    Ok(_) => return true,
                    Err(_) if dead() => return false,
                    Err(_) => {
                        Box::pin(tokio::time::sleep(backoff.next_delay())).await;
                        continue;
                    }
                };
                let event = watcher.changed().await;
                match event.event_type {
                    zk::EventType::NodeDeleted => return true,
                    _ if dead() || event.session_state.is_terminated() => return false,
                    _ => {}
                }
            }
        };
        tokio::select! {
            _ = ended => {}
            deleted = gone => {
                let ours = weak
                    .upgrade()
                    .is_some_and(|l| !l.release_attempted.load(Ordering::SeqCst));
                if deleted && ours {
                    tracing::debug!(node = %path, "the lock node was deleted behind the holder's back");
                    tracker.mark_lost(LossReason::NotHeldOnServer);
                }
            }
        }
    });
}

#[async_trait]
impl LeaseOps for ZkLease {
    /// The same `sync` + `exists` as [`renew`](Self::renew), which on ZooKeeper extends nothing
    /// either (the session's heartbeats do).
    async fn check(&self) -> Result<()> {
        self.renew(self.session.ttl).await
    }

    /// A lease on ZooKeeper lives as long as its session; a renewal is a `sync` (leader-ordered:
    /// it proves the session alive on the leader, see the session module) pipelined with an
    /// `exists` on the lock node, which, read after the `sync`, proves that the node (same
    /// `czxid`, same owner session) is still there. The session itself is kept alive by the
    /// client's heartbeats, whatever this returns.
    async fn renew(&self, _ttl: Duration) -> Result<()> {
        if self.session.is_dead() {
            return Err(self.not_held());
        }
        let deadline = Instant::now() + self.session.ttl;
        let res = self
            .session
            .retry_loss(Some(deadline), || {
                // Both requests are queued at once; the session answers them in order.
                let sync = self.session.client.sync(&self.path);
                let stat = self.session.client.check_stat(&self.path);
                async move {
                    let (synced, stat) = tokio::join!(sync, stat);
                    synced?;
                    stat
                }
            })
            .await;
        match res {
            Ok(Some(stat))
                if stat.czxid == self.czxid && stat.ephemeral_owner == self.session.id =>
            {
                Ok(())
            }
            Ok(_) | Err(zk::Error::SessionExpired) => Err(self.not_held()),
            Err(e) => Err(from_zk(e)),
        }
    }

    /// Deletes this lease's node, version-checked (`version 0`: lock nodes are never written),
    /// and in the same multi-op its lock-delay marker if it was granted with a lock-delay, so
    /// that the next in line is granted at once. The node's name holds this acquire's unique
    /// id, so no other holder's node can be hit.
    ///
    /// A lost connection is retried for up to one TTL (the client resends once it reconnects;
    /// after that the session has expired and the server deleted the node). A retry that finds
    /// the node gone while the session lives counts as released: the lost attempt was applied,
    /// since nothing else deletes a live session's ephemeral node. If the delete is still not
    /// acknowledged after one TTL, it goes on in the background until acknowledged or until the
    /// session ends, the lease stays registered with its session until then, and this returns
    /// [`Error::Unavailable`].
    async fn release(&self) -> Result<()> {
        self.give_back(false).await
    }

    /// Deletes the node but leaves the lock-delay marker: the next in line finds it with its
    /// holder gone and waits the delay (a lapse, not a release).
    async fn relinquish(&self) -> Result<()> {
        self.give_back(true).await
    }

    fn self_renewing(&self) -> bool {
        true
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
