//! Loss notices: the leases held through one [`RedisLock`](crate::RedisLock), by lock key, so
//! that a holder hears within milliseconds that the server ended its lease behind its back.
//!
//! - **Key deleted, expired or evicted**: the waiters' pub/sub connection (`waiters.rs`) also
//!   `SUBSCRIBE`s to the keyspace channel of each lock key held here for [`WATCH_AFTER`] or
//!   longer, `__keyspace@DB__:P:lock:NAME`
//!   (<https://redis.io/docs/latest/develop/use/keyspace-notifications/>; the server must have
//!   `notify-keyspace-events` `Kgxe`, see `server.rs`), and `UNSUBSCRIBE`s when no lease here
//!   holds it any more. A key's events reach only the client that holds it: the server's cost
//!   per grant does not grow with the number of clients (a `PSUBSCRIBE` of every client to
//!   `P:lock:*`, as before, sent every grant's `expire` and every release's `del` to every
//!   client). A `del`, `expired` or `evicted` event for the key of a lease held here costs one
//!   map look-up and one `GET`: if the key no longer holds the lease's owner value, the lease
//!   is [`Lost`](lockkit_core::LeaseState::Lost) with
//!   [`NotHeldOnServer`](LossReason::NotHeldOnServer). Every other event (a renewal's
//!   `expire`) is one look-up and nothing else. A lease's own release takes it out of the map
//!   before its script is sent, so its `del` is never taken for a loss; an event that arrives
//!   late (a delete before our grant) finds the key ours and changes nothing.
//! - **Subscribed late, checked once**: a task per client subscribes, once per
//!   [`WATCH_AFTER`] (25 ms), the keys of the leases granted before the previous tick and still
//!   held (one `SUBSCRIBE` for all of them), so a lease is subscribed between 25 and 50 ms
//!   after its grant, and one released sooner (the common short critical section) costs
//!   nothing on the server. When the `SUBSCRIBE` is confirmed, one `MGET` of the new keys
//!   checks that each still holds its lease's owner value: a loss before the subscription
//!   (which no event told us of) is found there. So a loss is heard at most 2 ×
//!   [`WATCH_AFTER`] (50 ms) plus two round trips after the grant, or within a message's
//!   delivery once subscribed (for an expiry: the server's expiry cycle, up to ~100 ms) —
//!   within [`LOSS_NOTICE`] either way. Pub/sub delivery is at-most-once: while the
//!   connection is down holders hear only at their next renewal, as without notifications;
//!   when it is back every key held is subscribed at once and checked the same way (after the
//!   `run_id` check below, so that a restart is told as one).
//! - **Server restart**: the server's `run_id` (`INFO server`) is read at connect, when the
//!   pub/sub connection comes back after a drop, and once per keepalive tick. A new `run_id`
//!   means the server restarted: every lease held here is
//!   [`Lost`](lockkit_core::LeaseState::Lost) with
//!   [`SessionExpired`](LossReason::SessionExpired) (the server run that held it ended; even
//!   with persistence the restart may have dropped its last writes), and its key is given back
//!   as lapsed (compare-and-delete, keeping a lock-delay) in case it survived. A lease the new run granted before the client
//!   saw the new `run_id` is lost too (which run granted it cannot be told apart cheaply): the
//!   holder stops early, and the lock is free again at once.
//! - **New master** (Sentinel mode): a failover also shows as a new `run_id` (the promoted
//!   replica's), but there a lease is not lost for that alone: each lease held here must prove
//!   that the new master holds it, with one compare-and-`PEXPIRE` of its key and owner value
//!   (which also makes good a renewal the old master did not replicate). Until then it is
//!   [`Suspect`](lockkit_core::LeaseState::Suspect) (from the moment the client switched
//!   masters); a key that is missing or holds another value makes it
//!   [`Lost`](lockkit_core::LeaseState::Lost) with
//!   [`NotHeldOnServer`](LossReason::NotHeldOnServer). The same holds for a restart of the
//!   master in Sentinel mode.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use redis::aio::PubSubSink;
use tokio::sync::Notify;
use tokio::task::AbortHandle;

use lockkit_core::backend::{SuspectReason, TrackerHandle};
use lockkit_core::{LeaseState, LossReason};

use crate::config::Notifications;
use crate::conn::Conn;
use crate::core::{RedisLease, compare_and_pexpire, holds};
use crate::server::info_field;

/// Within how long a holder hears that its lock key was deleted, evicted or expired on the
/// server, while keyspace notifications are on and the pub/sub connection is up: 200 ms. A
/// lease held for [`WATCH_AFTER`] or longer is subscribed to its key's keyspace channel: a
/// deletion or an eviction then costs one pub/sub message and one `GET` (0.3–5 ms measured on
/// loopback). An expiry is reported when the server actually removes the key, by its active
/// expiry cycle (10 times a second at the default `hz`) or when the key is next touched: up to
/// about 100 ms after the expiry (38–98 ms measured). A loss in a lease's first moments, before
/// its subscription, is found by the `GET` that follows the subscription: at most
/// 2 × [`WATCH_AFTER`] (50 ms) after the grant, plus two round trips. Declared as
/// [`Guarantees::loss_notice`](lockkit_core::Guarantees::loss_notice).
pub const LOSS_NOTICE: Duration = Duration::from_millis(200);

/// How long a lease is held before its client subscribes to its key's keyspace channel: 25 ms.
/// The client subscribes the leases of one [`RedisLock`](crate::RedisLock) together, once per
/// `WATCH_AFTER` (one `SUBSCRIBE` and one `MGET` for all of them), those granted at least one
/// such tick earlier: between 25 and 50 ms after the grant. A lease released sooner costs no
/// subscription at all. See [`LOSS_NOTICE`].
pub const WATCH_AFTER: Duration = Duration::from_millis(25);

/// The keyspace events that may end a lease: `DEL` (and `UNLINK`), expiry, eviction.
const LOSSES: [&str; 4] = ["del", "unlink", "expired", "evicted"];

/// The most channels in one `SUBSCRIBE` or `UNSUBSCRIBE`, and keys in one `MGET`.
const CHUNK: usize = 1000;

struct Entry {
    id: u64,
    owner: String,
    tracker: TrackerHandle,
    lease: Weak<RedisLease>,
}

#[derive(Default)]
struct State {
    /// Held leases by lock key (normally one per key).
    by_key: HashMap<String, Vec<Entry>>,
    next: u64,
    /// The pub/sub connection that carries the keyspace channels, with its generation; `None`
    /// while it is down (or notifications are off): then nothing is queued for subscription,
    /// and the next connection subscribes every key held.
    sink: Option<(u64, PubSubSink)>,
    /// Bounds each `SUBSCRIBE` and `UNSUBSCRIBE` on `sink` (the response timeout).
    timeout: Duration,
    /// A new connection came up: every key held is to be subscribed (and checked) on it.
    resubscribe: bool,
    /// Keys whose channel is subscribed (or being subscribed) on the current connection.
    subscribed: HashSet<String>,
    /// Keys whose `SUBSCRIBE` timed out on the current connection: the server may still carry
    /// it out (a server that stalled answers late), so they are unsubscribed like `subscribed`
    /// ones when no lease here holds them any more.
    doubtful: HashSet<String>,
    /// Grants since the last tick (`young`) and during the tick before (`old`, subscribed at
    /// the next tick if still held), by key and registration.
    young: Vec<(String, u64)>,
    old: Vec<(String, u64)>,
    /// Subscribed keys whose last lease here ended (unsubscribed at the next tick unless held
    /// again).
    unsub: Vec<String>,
    /// The task that subscribes and unsubscribes, once a connection came up.
    task: Option<AbortHandle>,
}

impl State {
    fn is_registered(&self, key: &str, id: u64) -> bool {
        self.by_key
            .get(key)
            .is_some_and(|v| v.iter().any(|e| e.id == id))
    }

    fn idle(&self) -> bool {
        !self.resubscribe && self.young.is_empty() && self.old.is_empty() && self.unsub.is_empty()
    }
}

/// The held leases of one client, and what the server's run is.
pub(crate) struct Watch {
    conn: Conn,
    /// Whether the server sends keyspace notifications of lock-key losses and the pub/sub
    /// connection may subscribe to them.
    notifications: AtomicBool,
    /// Whether notifications may be turned on again after a server restart.
    mode: Notifications,
    /// The keyspace channel of lock key `K` is `channel_prefix + K`: `__keyspace@DB__:`.
    channel_prefix: String,
    /// The keyspace channel of the prefix's lock key with an empty name (`P:lock:`, never a
    /// lock key: names are not empty), subscribed at connect to learn whether the server lets
    /// this client subscribe to the lock keys' channels.
    probe: String,
    state: Mutex<State>,
    /// Wakes the subscribing task when there is work after it went idle.
    wake: Arc<Notify>,
    /// The `run_id` of the server run the client talks to (`None` if `INFO` never answered);
    /// the lock serializes checks.
    run: tokio::sync::Mutex<Option<String>>,
    /// Sentinel mode: on a new `run_id` leases prove they are held instead of being lost.
    prove: bool,
}

impl fmt::Debug for Watch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = lock(&self.state);
        f.debug_struct("Watch")
            .field("notifications", &self.notifications())
            .field("keys", &st.by_key.len())
            .field("subscribed", &st.subscribed.len())
            .finish()
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some(h) = lock(&self.state).task.take() {
            h.abort();
        }
    }
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A lease's place in the [`Watch`]; dropping it (at release, or with the lease) takes it out.
pub(crate) struct Watched {
    watch: Arc<Watch>,
    key: String,
    id: u64,
}

impl fmt::Debug for Watched {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watched").field("key", &self.key).finish()
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        let mut st = lock(&self.watch.state);
        let Some(v) = st.by_key.get_mut(&self.key) else {
            return;
        };
        v.retain(|e| e.id != self.id);
        if v.is_empty() {
            st.by_key.remove(&self.key);
            if st.subscribed.contains(&self.key) || st.doubtful.contains(&self.key) {
                let wake = st.idle();
                st.unsub.push(self.key.clone());
                if wake {
                    self.watch.wake.notify_one();
                }
            }
        }
    }
}

impl Watch {
    /// The watch of a client on database `db` with key prefix `prefix`, for a server whose
    /// `run_id` is `run_id`.
    pub(crate) fn new(
        conn: Conn,
        db: i64,
        prefix: &str,
        notifications: bool,
        mode: Notifications,
        run_id: Option<String>,
        prove: bool,
    ) -> Arc<Self> {
        let channel_prefix = format!("__keyspace@{db}__:");
        let probe = format!("{channel_prefix}{prefix}:lock:");
        Arc::new(Self {
            conn,
            notifications: AtomicBool::new(notifications),
            mode,
            channel_prefix,
            probe,
            state: Mutex::new(State::default()),
            wake: Arc::new(Notify::new()),
            run: tokio::sync::Mutex::new(run_id),
            prove,
        })
    }

    /// Whether the server sends keyspace notifications of lock-key losses (found or turned on
    /// at connect) and the pub/sub connection was not refused them.
    pub(crate) fn notifications(&self) -> bool {
        self.notifications.load(Ordering::Relaxed)
    }

    /// The subscription to the lock keys' keyspace channels was refused.
    pub(crate) fn disable_notifications(&self) {
        self.notifications.store(false, Ordering::Relaxed);
    }

    /// The channel a new pub/sub connection subscribes to first, to learn whether the server
    /// lets it subscribe to the lock keys' keyspace channels (see [`Self::connected`]).
    pub(crate) fn probe_channel(&self) -> &str {
        &self.probe
    }

    /// Whether `channel` is a keyspace channel (its messages go to [`Self::on_event`]).
    pub(crate) fn is_keyspace(&self, channel: &str) -> bool {
        channel.starts_with(self.channel_prefix.as_str())
    }

    /// Pub/sub connection `generation` is up, its `SUBSCRIBE` to the [probe
    /// channel](Self::probe_channel) confirmed: from now on (while notifications are on) the
    /// keys of leases held here are subscribed on `sink`, every key held now at once (and
    /// checked with a `GET`, for what the connection missed while it was down).
    /// Each (un)subscription on it is bounded by `timeout`.
    pub(crate) fn connected(
        self: &Arc<Self>,
        generation: u64,
        sink: PubSubSink,
        timeout: Duration,
    ) {
        if !self.notifications() {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut st = lock(&self.state);
        st.sink = Some((generation, sink));
        st.timeout = timeout;
        st.subscribed.clear();
        st.doubtful.clear();
        st.young.clear();
        st.old.clear();
        st.unsub.clear();
        st.resubscribe = !st.by_key.is_empty();
        if st.task.is_none() {
            let weak = Arc::downgrade(self);
            let wake = self.wake.clone();
            st.task = Some(rt.spawn(subscriber(weak, wake)).abort_handle());
        }
        self.wake.notify_one();
    }

    /// Pub/sub connection `generation` is gone: its subscriptions with it.
    pub(crate) fn disconnected(&self, generation: u64) {
        let mut st = lock(&self.state);
        if st.sink.as_ref().is_some_and(|s| s.0 == generation) {
            st.sink = None;
            st.resubscribe = false;
            st.subscribed.clear();
            st.doubtful.clear();
            st.young.clear();
            st.old.clear();
            st.unsub.clear();
        }
    }

    /// Adds a held lease (its lock key and owner value are in `lease`) with its tracker; its
    /// key is subscribed to after [`WATCH_AFTER`] if it is still held then.
    pub(crate) fn register(
        self: &Arc<Self>,
        lease: &Arc<RedisLease>,
        tracker: &TrackerHandle,
    ) -> Watched {
        let key = lease.keys.lock.clone();
        let mut st = lock(&self.state);
        let id = st.next;
        st.next += 1;
        if st.sink.is_some() && !st.subscribed.contains(&key) {
            let wake = st.idle();
            st.young.push((key.clone(), id));
            if wake {
                self.wake.notify_one();
            }
        }
        // Capacity 1: one lease per key is the rule (a `Vec`'s first push reserves 4 entries,
        // 144 B per held lease that stay unused; `scripts/bench.sh`'s many-leases rows).
        st.by_key
            .entry(key.clone())
            .or_insert_with(|| Vec::with_capacity(1))
            .push(Entry {
                id,
                owner: lease.owner.clone(),
                tracker: tracker.clone(),
                lease: Arc::downgrade(lease),
            });
        Watched {
            watch: self.clone(),
            key,
            id,
        }
    }

    /// A keyspace event on `channel` (`__keyspace@DB__:KEY`) with payload `event`: for a loss
    /// of a lease held here, a `GET` is spawned that marks it lost unless the key is still
    /// its. One look-up per event otherwise.
    pub(crate) fn on_event(self: &Arc<Self>, channel: &str, event: &str) {
        if !LOSSES.contains(&event) {
            return;
        }
        let Some(key) = channel.strip_prefix(self.channel_prefix.as_str()) else {
            return;
        };
        let held: Vec<(u64, String, TrackerHandle)> = {
            let st = lock(&self.state);
            let Some(v) = st.by_key.get(key) else {
                return;
            };
            v.iter()
                .filter(|e| e.tracker.state() != LeaseState::Lost)
                .map(|e| (e.id, e.owner.clone(), e.tracker.clone()))
                .collect()
        };
        for (id, owner, tracker) in held {
            let this = self.clone();
            let key = key.to_owned();
            let event = event.to_owned();
            tokio::spawn(async move {
                this.verify(&key, id, &owner, &tracker, &event).await;
            });
        }
    }

    /// One tick of the subscribing task: unsubscribes the keys no lease here holds any more,
    /// subscribes the keys of leases held since the tick before (or, on a new connection,
    /// every key held, once the server's run is checked), then checks the newly subscribed
    /// leases with one `MGET`: a loss before the subscription was confirmed is found there.
    /// A `SUBSCRIBE` that times out is tried again at the next tick (and its keys are
    /// unsubscribed once no lease here holds them: the server may have carried it out late).
    async fn tick(&self) {
        let fresh = {
            let st = lock(&self.state);
            if st.sink.is_none() {
                return;
            }
            st.resubscribe
        };
        if fresh && !self.check_run().await {
            return; // a restart is told by the run check, not by the keys gone missing
        }
        let (generation, mut sink, timeout, unsub, sub) = {
            let mut st = lock(&self.state);
            let Some((generation, sink)) = st.sink.clone() else {
                return;
            };
            let timeout = st.timeout;
            let st = &mut *st;
            let sub: Vec<String> = if std::mem::take(&mut st.resubscribe) {
                st.young.clear();
                st.old.clear();
                st.unsub.clear();
                st.by_key.keys().cloned().collect()
            } else {
                let old = std::mem::replace(&mut st.old, std::mem::take(&mut st.young));
                old.into_iter()
                    .filter(|(k, id)| st.is_registered(k, *id) && !st.subscribed.contains(k))
                    .map(|(k, _)| k)
                    .collect::<HashSet<_>>()
                    .into_iter()
                    .collect()
            };
            let mut unsub = std::mem::take(&mut st.unsub);
            unsub.retain(|k| !st.by_key.contains_key(k));
            // (`|`, not `||`: out of both sets.)
            unsub.retain(|k| st.subscribed.remove(k) | st.doubtful.remove(k));
            st.subscribed.extend(sub.iter().cloned());
            (generation, sink, timeout, unsub, sub)
        };
        let channels = |keys: &[String]| -> Vec<String> {
            keys.iter()
                .map(|k| format!("{}{k}", self.channel_prefix))
                .collect()
        };
        let mut unsink = sink.clone();
        let unsubscribing = async {
            for chunk in unsub.chunks(CHUNK) {
                // One that fails leaves a channel whose events find no lease here.
                let _ = tokio::time::timeout(timeout, unsink.unsubscribe(channels(chunk))).await;
            }
        };
        let subscribing = async {
            let mut confirmed = Vec::with_capacity(sub.len());
            for chunk in sub.chunks(CHUNK) {
                match tokio::time::timeout(timeout, sink.subscribe(channels(chunk))).await {
                    Ok(Ok(())) => confirmed.extend_from_slice(chunk),
                    Ok(Err(e)) => {
                        // Refused (or the connection is going, and the next one subscribes
                        // every key held): these keys are heard at their next renewal.
                        tracing::debug!(error = %e,
                            "SUBSCRIBE to lock keys' keyspace channels failed");
                        self.unsubscribed(generation, chunk, false);
                    }
                    Err(_) => {
                        tracing::debug!("SUBSCRIBE to lock keys' keyspace channels timed out");
                        self.unsubscribed(generation, chunk, true);
                    }
                }
            }
            confirmed
        };
        // Both sent at once (the sink keeps their order): a slow UNSUBSCRIBE must not hold up
        // a subscription.
        let ((), confirmed) = futures_util::future::join(unsubscribing, subscribing).await;
        self.check_keys(&confirmed).await;
    }

    /// `keys`, whose `SUBSCRIBE` on connection `generation` failed, are not subscribed; with
    /// `retry` (it timed out, so the server may still carry it out) they are subscribed at the
    /// next tick if still held, and unsubscribed when no longer held (at the next tick if no
    /// lease here holds them now).
    fn unsubscribed(&self, generation: u64, keys: &[String], retry: bool) {
        let mut st = lock(&self.state);
        if st.sink.as_ref().is_none_or(|s| s.0 != generation) {
            return;
        }
        for k in keys {
            st.subscribed.remove(k);
            if !retry {
                continue;
            }
            if st.doubtful.insert(k.clone()) && !st.by_key.contains_key(k) {
                st.unsub.push(k.clone());
            }
            let ids: Vec<u64> = st
                .by_key
                .get(k)
                .map(|v| v.iter().map(|e| e.id).collect())
                .unwrap_or_default();
            st.old.extend(ids.into_iter().map(|id| (k.clone(), id)));
        }
    }

    /// Checks the leases held here on `keys` (one `MGET` per [`CHUNK`] keys): a lease whose
    /// key no longer holds its owner value is lost, unless it left the watch meanwhile. A
    /// failed `MGET` changes nothing: the next renewal finds out.
    async fn check_keys(&self, keys: &[String]) {
        let held: Vec<(String, u64, String, TrackerHandle)> = {
            let st = lock(&self.state);
            keys.iter()
                .filter_map(|k| Some((k, st.by_key.get(k)?)))
                .flat_map(|(k, v)| v.iter().map(move |e| (k, e)))
                .filter(|(_, e)| e.tracker.state() != LeaseState::Lost)
                .map(|(k, e)| (k.clone(), e.id, e.owner.clone(), e.tracker.clone()))
                .collect()
        };
        for chunk in held.chunks(CHUNK) {
            let mut cmd = redis::cmd("MGET");
            for (k, ..) in chunk {
                cmd.arg(k);
            }
            let values: Vec<Option<String>> = match self.conn.query(&cmd).await {
                Ok(v) => v,
                Err(e) => {
                    tracing::debug!(error = %e,
                        "cannot check leases after subscribing to their keys; their next \
                         renewals will");
                    continue;
                }
            };
            for ((key, id, owner, tracker), value) in chunk.iter().zip(values) {
                if value.as_deref() != Some(owner.as_str()) && self.is_registered(key, *id) {
                    tracing::warn!(key = %key,
                        "the lock key was removed on the server: lease lost");
                    tracker.mark_lost(LossReason::NotHeldOnServer);
                }
            }
        }
    }

    /// Marks the lease `id` on `key` lost if the key does not hold `owner` (one `GET`), unless
    /// the lease left the watch meanwhile (released). A failed `GET` changes nothing: the next
    /// renewal finds out.
    async fn verify(&self, key: &str, id: u64, owner: &str, tracker: &TrackerHandle, why: &str) {
        match holds(&self.conn, key, owner).await {
            Ok(true) => {}
            Ok(false) => {
                if self.is_registered(key, id) {
                    tracing::warn!(key = %key, event = %why,
                        "the lock key was removed on the server: lease lost");
                    tracker.mark_lost(LossReason::NotHeldOnServer);
                }
            }
            Err(e) => {
                tracing::debug!(key = %key, error = %e,
                    "cannot check a lease after a keyspace event; its next renewal will");
            }
        }
    }

    /// Every lease held here that is not lost, with its registration.
    fn held(&self) -> Vec<(String, u64, TrackerHandle, Weak<RedisLease>)> {
        let st = lock(&self.state);
        st.by_key
            .iter()
            .flat_map(|(k, v)| v.iter().map(move |e| (k, e)))
            .filter(|(_, e)| e.tracker.state() != LeaseState::Lost)
            .map(|(k, e)| (k.clone(), e.id, e.tracker.clone(), e.lease.clone()))
            .collect()
    }

    /// Marks every lease held here suspect (the client switched to a new master; they have not
    /// proved it holds them yet).
    pub(crate) fn suspect_all(&self) {
        for (_, _, tracker, _) in self.held() {
            tracker.mark_suspect(SuspectReason::ConnectionLost);
        }
    }

    /// After the server run changed from `old` to `now` (Sentinel mode): each lease held here
    /// proves the new run holds it (compare-and-`PEXPIRE`, which also restarts its expiry
    /// there), or is lost. A lease whose call fails stays as it is: its renewal decides.
    async fn prove_all(&self, old: &str, now: &str) {
        let held = self.held();
        tracing::warn!(old_run_id = %old, new_run_id = %now, leases = held.len(),
            "the redis master changed: every lease held through this client must prove the new              master holds it");
        let proofs = held.into_iter().map(|(key, id, tracker, lease)| async move {
            let Some(lease) = lease.upgrade() else { return };
            let sent = tokio::time::Instant::now();
            match compare_and_pexpire(
                &lease.conn,
                &lease.keys,
                &lease.owner,
                tracker.ttl(),
                lease.delay,
            )
            .await
            {
                Ok(true) => {
                    tracker.confirm(sent);
                    tracing::info!(key = %key, "the new master holds the lease: kept");
                }
                Ok(false) => {
                    if self.is_registered(&key, id) {
                        tracing::warn!(key = %key,
                            "the new master does not hold the lease (not replicated before the                              failover, or expired since): lease lost");
                        tracker.mark_lost(LossReason::NotHeldOnServer);
                    }
                }
                Err(e) => {
                    tracing::debug!(key = %key, error = %e,
                        "cannot prove a lease on the new master; its next renewal will");
                }
            }
        });
        futures_util::future::join_all(proofs).await;
    }

    fn is_registered(&self, key: &str, id: u64) -> bool {
        lock(&self.state).is_registered(key, id)
    }

    /// Reads the server's `run_id` (one `INFO server`); if it changed since the last look, the
    /// server restarted: every lease held here is lost
    /// ([`SessionExpired`](LossReason::SessionExpired)) and its key given back in the
    /// background, and keyspace notifications are turned on again. A failed `INFO` changes
    /// nothing: then `false`.
    ///
    /// # Cancel safety
    /// Cancel safe: a dropped check leaves the last known run as it was.
    pub(crate) async fn check_run(&self) -> bool {
        if self.conn.is_cluster() {
            // Many servers, no one run_id: a lease on a restarted or failed-over master is
            // found lost by its renewal (compare-and-PEXPIRE on the slot's master).
            return true;
        }
        let mut run = self.run.lock().await;
        let info = match self
            .conn
            .query::<String>(redis::cmd("INFO").arg("server"))
            .await
        {
            Ok(info) => info,
            Err(e) => {
                tracing::debug!(error = %e, "INFO server failed; the restart check waits");
                return false;
            }
        };
        let Some(now) = info_field(&info, "run_id") else {
            return true; // a server that does not tell (a proxy): nothing to compare
        };
        if run.as_deref() == Some(now) {
            return true;
        }
        let Some(old) = run.replace(now.to_owned()) else {
            return true; // the first answer: nothing to compare with
        };
        if self.prove {
            self.prove_all(&old, now).await;
            if self.notifications() && !crate::server::renotify(&self.conn, self.mode).await {
                self.disable_notifications();
            }
            return true;
        }
        let held: Vec<Weak<RedisLease>> = {
            let st = lock(&self.state);
            st.by_key
                .values()
                .flatten()
                .filter(|e| e.tracker.state() != LeaseState::Lost)
                .map(|e| {
                    e.tracker.mark_lost(LossReason::SessionExpired);
                    e.lease.clone()
                })
                .collect()
        };
        tracing::warn!(old_run_id = %old, new_run_id = %now, lost = held.len(),
            "the redis server restarted: every lease held through this client is lost");
        if let (false, Ok(rt)) = (held.is_empty(), tokio::runtime::Handle::try_current()) {
            // Give back keys that survived (persistence) or that the new run granted, as lapsed:
            // a lock-delay is kept (the holders may still have writes in flight).
            rt.spawn(async move {
                for lease in held.iter().filter_map(Weak::upgrade) {
                    let _ = lease.give_back_lapsed().await;
                }
            });
        }
        if self.notifications() && !crate::server::renotify(&self.conn, self.mode).await {
            self.disable_notifications();
        }
        true
    }
}

/// The subscribing task of one [`Watch`]: idle (waiting on `wake`) while there is nothing to
/// subscribe or unsubscribe, else one [`Watch::tick`] per [`WATCH_AFTER`]. Holds the watch
/// weakly: it ends with the watch (whose drop also aborts it).
async fn subscriber(watch: Weak<Watch>, wake: Arc<Notify>) {
    loop {
        let idle = match watch.upgrade() {
            Some(w) => lock(&w.state).idle(),
            None => return,
        };
        if idle {
            wake.notified().await;
            continue;
        }
        tokio::time::sleep(WATCH_AFTER).await;
        let Some(w) = watch.upgrade() else { return };
        w.tick().await;
    }
}
