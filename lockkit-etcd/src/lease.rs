//! [`EtcdLease`], the [`LeaseOps`] of one granted lock: its key, renewal, release, and the watch
//! that tells it at once when etcd deletes its key.

use std::any::Any;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, Txn};
use lockkit_core::backend::{LeaseOps, TrackerHandle};
use lockkit_core::{Error, Instant, LeaseState, LossReason, Result, async_trait};

use crate::core::{
    KeepAlive, KeyWatch, KeyWatched, Marker, Reservation, delete_key_ops, delete_while_lease_lives,
    detach_marker, keep_alive_hedged, keepalive_attempt_limit, renew_companions, renewal_counts,
    stale_term, timed, with_retries,
};
/// How a granted lock's key is attached.
pub(crate) enum Binding {
    /// On the session lease, kept alive by its task; `tracker_id` is this lock's registration.
    Shared {
        reservation: Reservation,
        tracker_id: u64,
    },
    /// On a lease of its own, renewed only by explicit [`LeaseOps::renew`].
    Dedicated,
}

/// The etcd side of one granted lock: its key, the key's create revision (the fencing token)
/// and its lease.
pub struct EtcdLease {
    pub(crate) client: Arc<Client>,
    pub(crate) name: String,
    /// `{prefix}/{name}/` — every contender's key for this lock starts with it.
    pub(crate) name_prefix: Vec<u8>,
    pub(crate) key: Vec<u8>,
    pub(crate) create_revision: i64,
    pub(crate) lease_id: i64,
    pub(crate) binding: Binding,
    pub(crate) request_timeout: Duration,
    pub(crate) released: AtomicBool,
    /// The key slot on the lease, freed once a release got a definite answer.
    pub(crate) slot: u32,
    /// A request of the acquire that may create this key went unanswered and may still be
    /// applied after the release: the slot is then burnt, not freed.
    pub(crate) create_uncertain: bool,
    /// A release was tried (so a drop without a completed release is a failure to clean up,
    /// not a deliberate leak).
    pub(crate) release_attempted: AtomicBool,
    /// The lock-delay marker of a grant with a delay.
    pub(crate) marker: Option<Marker>,
    /// The key is gone without a release: a dedicated lease's companion (of the marker) is no
    /// longer renewed, so the delay runs.
    pub(crate) marker_frozen: AtomicBool,
    /// The watcher of the key's delete ([`watch_own_key`]); dropped with the lease.
    pub(crate) key_watch: OnceLock<KeyWatched>,
}

impl fmt::Debug for EtcdLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdLease")
            .field("key", &String::from_utf8_lossy(&self.key))
            .field("create_revision", &self.create_revision)
            .field("lease_id", &format_args!("{:x}", self.lease_id))
            .field(
                "keepalive",
                &match self.binding {
                    Binding::Shared { .. } => "session",
                    Binding::Dedicated => "manual",
                },
            )
            .finish()
    }
}

impl EtcdLease {
    /// The lock key (`{prefix}/{name}/{lease id hex}-{slot}`).
    pub fn key(&self) -> &[u8] {
        &self.key
    }

    /// The key's create revision: the fencing token.
    pub fn create_revision(&self) -> i64 {
        self.create_revision
    }

    /// The etcd lease the key is attached to.
    pub fn lease_id(&self) -> i64 {
        self.lease_id
    }

    /// The key prefix shared by every contender for this lock.
    pub fn name_prefix(&self) -> &[u8] {
        &self.name_prefix
    }

    pub(crate) fn not_held(&self) -> Error {
        Error::NotHeld {
            name: self.name.clone(),
        }
    }

    /// The key was deleted without a release (an admin's delete or lease revoke): from now on
    /// the lock-delay marker (if any) runs out. A marker on a dedicated lease's companion stops
    /// being renewed; one on a session lease's companion, which other locks keep alive, moves
    /// to a lease of its own with the delay as TTL ([`detach_marker`]).
    /// Deletes this grant's key (compare-and-delete), with its lock-delay marker unless
    /// `lapsed` ([`LeaseOps::relinquish`]: the marker then runs out, counting the delay). See
    /// [`LeaseOps::release`] below for the rules.
    async fn give_back(&self, lapsed: bool) -> Result<()> {
        let kv = self.client.kv_client();
        self.release_attempted.store(true, Ordering::SeqCst);
        let attempts = std::sync::atomic::AtomicUsize::new(0);
        // With a lock-delay marker, one transaction deletes the key and (if the key was still
        // ours) the marker: the lock is free at once.
        let txn = self.marker.as_ref().map(|m| {
            Txn::new()
                .when([Compare::create_revision(
                    self.key.clone(),
                    CompareOp::Equal,
                    self.create_revision,
                )])
                .and_then(delete_key_ops(&self.key, Some(m).filter(|_| !lapsed)))
        });
        let attempt = || {
            attempts.fetch_add(1, Ordering::SeqCst);
            let (mut kv, key, txn) = (kv.clone(), self.key.clone(), txn.clone());
            async move {
                match txn {
                    Some(txn) => kv.txn(txn).await.map(|r| r.succeeded()),
                    None => kv.delete(key, None).await.map(|r| r.deleted() > 0),
                }
            }
        };
        let deleted = match with_retries(self.request_timeout, "a lock release", attempt).await {
            Ok(r) => r,
            Err(e) => {
                // The key may outlive this call. Stop reusing the lease, so that it retires (and
                // is revoked, taking the key with it) once its other locks are done.
                if let Binding::Shared { reservation, .. } = &self.binding {
                    reservation.shared.close_to_newcomers();
                }
                return Err(e);
            }
        };
        self.released.store(true, Ordering::SeqCst);
        if !deleted || lapsed {
            // The key was gone already (a failure), or it is given up as lapsed: its delay runs
            // (if the key watch has not started it yet).
            self.start_delay();
        }
        if let Binding::Shared { reservation, .. } = &self.binding {
            if self.create_uncertain {
                // A released grant's marker may be swept with its key; a lapsed one's runs out.
                let marker = self.marker.clone().filter(|_| deleted && !lapsed);
                reservation.shared.burn_slot(self.key.clone(), marker);
            } else if attempts.load(Ordering::SeqCst) == 1 {
                reservation.shared.free_slot(&self.name, self.slot);
            }
            // Else an earlier delete attempt may still be applied: the slot stays busy.
        }
        if let Binding::Dedicated = self.binding {
            let client = self.client.clone();
            let (id, limit) = (self.lease_id, self.request_timeout);
            // The marker's companion too, unless the lock was lost first (its delay runs).
            let companion = self
                .marker
                .as_ref()
                .filter(|_| deleted && !self.marker_frozen.load(Ordering::SeqCst))
                .map(|m| m.lease);
            tokio::spawn(async move {
                let mut lc = client.lease_client();
                for id in std::iter::once(id).chain(companion) {
                    let _ = timed(limit, "a lease revoke", lc.revoke(id)).await;
                }
            });
        }
        if deleted {
            Ok(())
        } else {
            Err(self.not_held())
        }
    }

    fn start_delay(&self) {
        let Some(marker) = self.marker.clone() else {
            return;
        };
        if self.marker_frozen.swap(true, Ordering::SeqCst) {
            return;
        }
        let Binding::Shared { reservation, .. } = &self.binding else {
            return;
        };
        let (Some(pin), Ok(rt)) = (
            reservation.shared.pin(),
            tokio::runtime::Handle::try_current(),
        ) else {
            return;
        };
        let (client, limit) = (self.client.clone(), self.request_timeout);
        rt.spawn(async move { detach_marker(&client, &marker, limit, &pin.shared).await });
    }

    /// One linearizable read: does our key still exist with our create revision? Also returns
    /// the raft term the read was served in.
    async fn key_exists(&self) -> Result<(bool, u64)> {
        let txn = Txn::new().when([Compare::create_revision(
            self.key.clone(),
            CompareOp::Equal,
            self.create_revision,
        )]);
        let kv = self.client.kv_client();
        let resp = with_retries(self.request_timeout, "a lock check", || {
            let (mut kv, txn) = (kv.clone(), txn.clone());
            async move { kv.txn(txn).await }
        })
        .await?;
        Ok((resp.succeeded(), resp.header().map_or(0, |h| h.raft_term())))
    }
}

/// Watches a granted lock's own key (a watcher on the client's one [`KeyWatch`] stream) and
/// marks its tracker lost as soon as etcd deletes the key while the holder did not release it:
/// an admin's `etcdctl lease revoke` (etcd deletes every key of the lease, in one revision) or
/// `etcdctl del`. Without it the holder would learn of it only at its next keepalive (up to
/// TTL/3 later) or at its deadline. The watcher lives as long as `lease` (its [`KeyWatched`] is
/// kept there) or until the delete; a delete after the lease ended (released, or lost for
/// another reason) changes nothing.
pub(crate) fn watch_own_key(lease: &Arc<EtcdLease>, tracker: TrackerHandle, keys: &KeyWatch) {
    let weak = Arc::downgrade(lease);
    let on_delete = Box::new(move || {
        // Our own release (or the drop's cleanup) deletes the key too: only a delete nobody on
        // this side asked for is a loss.
        let Some(lease) = weak.upgrade() else {
            return;
        };
        if lease.release_attempted.load(Ordering::SeqCst)
            || tracker.view().state() == LeaseState::Lost
        {
            return;
        }
        tracing::debug!(key = %String::from_utf8_lossy(&lease.key), "etcd deleted the lock's key (lease revoked or key deleted)");
        tracker.mark_lost(LossReason::NotHeldOnServer);
        lease.start_delay();
    });
    let watched = keys.watch(lease.key.clone(), lease.create_revision, on_delete);
    // Set once, by the grant that made the lease.
    let _ = lease.key_watch.set(watched);
}

#[async_trait]
impl LeaseOps for EtcdLease {
    /// One linearizable read: does our key still exist with our create revision? (Once a key
    /// holds the lock it holds it for as long as it exists.)
    ///
    /// # Errors
    /// [`Error::NotHeld`] if the key is gone; [`Error::Unavailable`] if etcd did not answer in
    /// time.
    async fn check(&self) -> Result<()> {
        if self.released.load(Ordering::SeqCst) {
            return Err(self.not_held());
        }
        match self.key_exists().await? {
            (true, _) => Ok(()),
            (false, _) => Err(self.not_held()),
        }
    }

    /// First the companion leases of lock-delay markers (of a session lease, or this lock's
    /// own), then one `LeaseKeepAlive` exchange of this lock's etcd lease (two round trips on one stream:
    /// etcd-client keeps the first answer to itself, and the second one carries the answering
    /// member's raft term) — a session lease also confirms the other locks on it — then one
    /// linearizable read that our key still exists. The renewal counts only if that read
    /// reports the same raft term: etcd 3.4 lets a paused former leader renew leases in its own
    /// lessor on resuming, before it learns of the newer term, while a linearizable read goes
    /// through the current leader (<https://etcd.io/docs/v3.4/learning/api_guarantees/>).
    ///
    /// # Errors
    /// [`Error::NotHeld`] if the lease or the key is gone; [`Error::Unavailable`] if etcd did
    /// not answer in time or the answer came from a member of an older term (a paused former
    /// leader): the renewal does not count.
    async fn renew(&self, ttl: Duration) -> Result<()> {
        if self.released.load(Ordering::SeqCst) {
            return Err(self.not_held());
        }
        let until = Instant::now()
            .checked_add(self.request_timeout)
            .unwrap_or_else(Instant::now);
        let hedge_every = keepalive_attempt_limit(ttl, self.request_timeout);
        // Companion leases of lock-delay markers first, as the keepalive task does: the
        // marker outlives the key by the delay.
        let terms = match &self.binding {
            Binding::Shared { reservation, .. } => {
                renew_companions(&self.client, &reservation.shared, until, hedge_every).await?
            }
            Binding::Dedicated => match &self.marker {
                Some(m) if !self.marker_frozen.load(Ordering::SeqCst) => {
                    match keep_alive_hedged(&self.client, m.lease, until, hedge_every, |_| {})
                        .await
                        .1?
                    {
                        KeepAlive::Alive { term } => vec![term],
                        KeepAlive::Gone => Vec::new(),
                    }
                }
                _ => Vec::new(),
            },
        };
        let (sent, answer) =
            keep_alive_hedged(&self.client, self.lease_id, until, hedge_every, |_| {}).await;
        let term = match answer? {
            KeepAlive::Gone => {
                if let Binding::Shared { reservation, .. } = &self.binding {
                    reservation.shared.mark_lost(LossReason::SessionExpired);
                }
                return Err(self.not_held());
            }
            KeepAlive::Alive { term } => term,
        };
        let (exists, current) = self.key_exists().await?;
        if let Some(stale) = std::iter::once(term)
            .chain(terms)
            .find(|t| !renewal_counts(*t, current))
        {
            return Err(stale_term(stale, current));
        }
        if !exists {
            // Gone without a release (the key watch may not have told us yet).
            self.start_delay();
        }
        if let Binding::Shared { reservation, .. } = &self.binding {
            reservation.shared.confirm(sent);
        }
        if exists { Ok(()) } else { Err(self.not_held()) }
    }

    /// Deletes this grant's key: one `DeleteRange`, as etcd's own `concurrency.Mutex.Unlock`
    /// does; `deleted == 1` means we still held the lock. A grant with a lock-delay sends one
    /// transaction instead, which deletes the key and its own marker if the key still has its
    /// create revision (so the lock is free at once; a lapsed grant's marker stays). A
    /// dedicated lease (and its marker's companion lease) is then revoked in the background.
    ///
    /// This is compare-and-delete by construction. The key's name carries the etcd lease ID
    /// and a slot number that no other request of this client touches while the slot is busy,
    /// and etcd deletes the key when the lease ends, so the key exists only as this grant's.
    /// The slot is freed for reuse only when nothing can still land on it: when the first
    /// delete attempt was answered and no request of the acquire went unanswered. Otherwise
    /// (an attempt timed out on a stalled member and may be applied later) the slot is never
    /// reused, so a late delete cannot remove a later grant's key.
    ///
    /// # Errors
    /// [`Error::NotHeld`] if the key was already gone: the lease ended, or (rarely) an
    /// earlier attempt whose answer was lost deleted it; [`Error::Unavailable`] if etcd did not
    /// answer within the request timeout (retried until then).
    ///
    /// # Cancel safety
    /// If the future is dropped, the delete may or may not have happened; the lease's drop
    /// deletes the key in the background (or its TTL ends it).
    async fn release(&self) -> Result<()> {
        self.give_back(false).await
    }

    /// Deletes the key but leaves the lock-delay marker to run out (a lapse, not a release).
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

impl Drop for EtcdLease {
    fn drop(&mut self) {
        let released = self.released.load(Ordering::SeqCst);
        let attempted = self.release_attempted.load(Ordering::SeqCst);
        let binding = std::mem::replace(&mut self.binding, Binding::Dedicated);
        let (reservation, deadline) = match binding {
            Binding::Shared {
                reservation,
                tracker_id,
            } => {
                let tracker = reservation.shared.unregister(tracker_id);
                (Some(reservation), tracker.map(|t| t.valid_until()))
            }
            Binding::Dedicated => (None, None),
        };
        if released {
            return;
        }
        // Either every release failed (server unreachable), or none was tried (leak(),
        // release_on_drop(false)). A dedicated lease ends by its TTL since nobody renews it. A key
        // on the shared session lease would live as long as other locks keep that lease alive:
        // delete it (if it is still ours) — after a failed release as soon as etcd answers, after
        // a leak at the lock's deadline, so a leaked lock stays held for its TTL and no longer.
        let Some(reservation) = reservation else {
            return;
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            reservation.shared.keep_leaked_key();
            return;
        };
        let start_at = if attempted { None } else { deadline };
        let client = self.client.clone();
        let (key, rev, limit) = (self.key.clone(), self.create_revision, self.request_timeout);
        let (name, slot, uncertain) = (self.name.clone(), self.slot, self.create_uncertain);
        let marker = self.marker.clone();
        rt.spawn(async move {
            if let Some(at) = start_at {
                tokio::time::sleep_until(at).await;
            }
            let shared = &reservation.shared;
            // After a failed release, the key and the marker go together (a release); a leaked
            // lock lapses at its deadline, so its marker then runs out the delay.
            let with_key = if attempted { marker.as_ref() } else { None };
            if delete_while_lease_lives(&client, &key, Some(rev), with_key, limit, shared).await {
                if !attempted && let Some(m) = &marker {
                    detach_marker(&client, m, limit, shared).await;
                }
                if uncertain {
                    shared.burn_slot(key, marker.filter(|_| attempted));
                } else {
                    shared.free_slot(&name, slot);
                }
            }
        });
    }
}
