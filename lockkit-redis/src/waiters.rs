//! Hand-off messages for queued acquires: one pub/sub connection per
//! [`RedisLock`](crate::RedisLock), subscribed once to the client's own channel
//! (`P:client:ID`, a random ID per `RedisLock`), shared by all its waiters.
//!
//! A waiting acquire joins the lock's queue with this channel. When a release (or an expiry that
//! an acquire notices) hands the lock to the first live waiter, the script `PUBLISH`es
//! `"WAITER TOKEN"` on that waiter's channel only
//! (<https://redis.io/docs/latest/develop/interact/pubsub/>): one message per hand-off, to the
//! one client concerned, and no SUBSCRIBE or UNSUBSCRIBE per wait. The reader routes the message
//! to the waiting future by its waiter ID.
//!
//! Pub/sub delivery is at-most-once (a dropped connection loses messages), so waiters also look
//! at the lock on a bounded, jittered timer (see `lock.rs`): a waiter that was handed the lock
//! finds its own ID in the lock key.
//!
//! The same connection carries the keyspace notifications of the keys of leases held through
//! the client (a `SUBSCRIBE` of each key held longer than `WATCH_AFTER`, see `watch.rs`). Where
//! the server sends them, the connection is opened at connect and kept up: when it drops it is
//! opened again (with backoff), and once per keepalive tick a `PING` checks that it still
//! answers (a silent connection is dropped and replaced).
//!
//! In Cluster mode hand-offs take sharded channels instead, one per hash slot (`shard.rs`); the
//! `*_for` methods pick the mode's channel.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::PubSubSink;
use tokio::sync::oneshot;
use tokio::task::AbortHandle;

use lockkit_core::backend::Backoff;
use lockkit_core::{Error, Result};

use crate::conn::Conn;
use crate::core::Keys;
use crate::error::{from_redis, timed_out};
use crate::shard::{Shards, slot_of};
use crate::watch::Watch;

#[derive(Default)]
struct State {
    /// The current, subscribed pub/sub connection and its generation number.
    conn: Option<(u64, PubSubSink)>,
    generation: u64,
    /// Waiting acquires by waiter ID: the registration's number and where its hand-off token
    /// goes.
    routes: HashMap<String, (u64, oneshot::Sender<u64>)>,
    /// Number of the next registration.
    next_route: u64,
    reader: Option<AbortHandle>,
    /// When a waiter last had the connection checked ([`Hub::probe_while_waiting`]).
    waiter_probe: Option<tokio::time::Instant>,
}

/// The shared pub/sub connection of one `RedisLock` and its waiters' routes.
pub(crate) struct Hub {
    /// The command connection, whose current client (in Sentinel mode: the current master's)
    /// opens the pub/sub connection.
    conn: Conn,
    /// This client's hand-off channel, `P:client:ID`.
    channel: String,
    /// Bounds opening the pub/sub connection (the connect timeout).
    connect_timeout: Duration,
    /// Bounds the SUBSCRIBE (the response timeout); when it passes, the connection is taken for
    /// dead and dropped.
    timeout: Duration,
    /// Whether a refused SUBSCRIBE was logged at warn level already.
    warned: AtomicBool,
    state: Mutex<State>,
    /// Serializes connecting, so that concurrent waiters open one connection.
    ops: tokio::sync::Mutex<()>,
    /// Where keyspace events go.
    watch: Arc<Watch>,
    /// Keep the connection up (reopen it when it drops): set while the server sends keyspace
    /// notifications.
    keep: AtomicBool,
    /// Whether a refused SUBSCRIBE to a keyspace channel was logged at warn level already.
    warned_keyspace: AtomicBool,
    /// A [`tick`](Self::tick) is running.
    ticking: AtomicBool,
    /// The sharded hand-off channels, in Cluster mode.
    shards: Option<Arc<Shards>>,
    me: Weak<Hub>,
}

impl fmt::Debug for Hub {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = lock(&self.state);
        f.debug_struct("Hub")
            .field("connected", &st.conn.is_some())
            .field("waiters", &st.routes.len())
            .finish()
    }
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    // Every statement leaves the state consistent; a panic elsewhere must not poison it.
    state.lock().unwrap_or_else(|p| p.into_inner())
}

impl Drop for Hub {
    fn drop(&mut self) {
        if let Some(h) = lock(&self.state).reader.take() {
            h.abort();
        }
    }
}

/// One waiter's route: resolves with the token of the grant the server handed to this waiter
/// ID. Dropping it removes the route.
pub(crate) struct Waiting {
    hub: Arc<Hub>,
    id: String,
    seq: u64,
    rx: Option<oneshot::Receiver<u64>>,
    /// A route of the sharded channels (Cluster mode).
    sharded: bool,
}

impl fmt::Debug for Waiting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Waiting").field("id", &self.id).finish()
    }
}

impl Waiting {
    /// The waiter ID this route is for.
    pub(crate) fn id(&self) -> &str {
        &self.id
    }

    /// Whether no message can come on this route any more: its pub/sub connection is gone, or
    /// it already delivered its hand-off.
    pub(crate) fn is_dead(&self) -> bool {
        self.rx.is_none()
    }

    /// Resolves with the hand-off token, or with `None` once the pub/sub connection behind the
    /// route is lost. Either way the route is used up ([`is_dead`](Self::is_dead): register a
    /// new one to hear of a later hand-off) and pends forever on later calls: a oneshot receiver
    /// must not be polled again once it has answered.
    ///
    /// # Cancel safety
    /// Cancel safe: a message that arrives while nobody polls is kept.
    pub(crate) async fn handed(&mut self) -> Option<u64> {
        let Some(rx) = self.rx.as_mut() else {
            return std::future::pending().await;
        };
        let answer = rx.await;
        self.rx = None;
        answer.ok()
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if let Some(s) = self.sharded.then_some(self.hub.shards.as_ref()).flatten() {
            s.unregister(&self.id, self.seq);
            return;
        }
        let mut st = lock(&self.hub.state);
        if st.routes.get(&self.id).is_some_and(|r| r.0 == self.seq) {
            st.routes.remove(&self.id);
        }
    }
}

impl Hub {
    pub(crate) fn new(
        conn: Conn,
        prefix: &str,
        connect_timeout: Duration,
        timeout: Duration,
        watch: Arc<Watch>,
    ) -> Arc<Self> {
        let id = format!("{:032x}", rand::random::<u128>());
        let shards = conn
            .is_cluster()
            .then(|| Shards::new(conn.clone(), prefix, &id, connect_timeout, timeout));
        Arc::new_cyclic(|me| Self {
            conn,
            channel: format!("{prefix}:client:{id}"),
            connect_timeout,
            timeout,
            warned: AtomicBool::new(false),
            state: Mutex::new(State::default()),
            ops: tokio::sync::Mutex::new(()),
            watch,
            keep: AtomicBool::new(false),
            warned_keyspace: AtomicBool::new(false),
            ticking: AtomicBool::new(false),
            shards,
            me: me.clone(),
        })
    }

    /// Opens the connection now and keeps it up from now on (reopened with backoff when it
    /// drops), for keyspace notifications.
    ///
    /// # Errors
    /// As [`ensure`](Self::ensure).
    ///
    /// # Cancel safety
    /// Cancel safe, as [`ensure`](Self::ensure).
    pub(crate) async fn keep_up(self: &Arc<Self>) -> Result<()> {
        self.keep.store(true, Ordering::Relaxed);
        match self.ensure().await {
            Ok(()) => Ok(()),
            Err(e) if e.is_retryable() => {
                self.spawn_reconnect();
                Err(e)
            }
            Err(e) => {
                // Refused (an ACL without channel permission): no notifications, and waiters
                // poll; retrying would only be refused again.
                self.keep.store(false, Ordering::Relaxed);
                self.watch.disable_notifications();
                self.refused(&e);
                Err(e)
            }
        }
    }

    /// Where this connection's keyspace events go.
    pub(crate) fn watch(&self) -> &Arc<Watch> {
        &self.watch
    }

    /// Once per keepalive tick, in the background so that it never delays a renewal: checks
    /// that the pub/sub connection answers ([`probe`](Self::probe)) and whether the server
    /// restarted ([`Watch::check_run`]). Skipped while the previous one still runs.
    pub(crate) fn tick(self: &Arc<Self>) {
        if self.ticking.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            self.ticking.store(false, Ordering::Release);
            return;
        };
        let hub = self.clone();
        rt.spawn(async move {
            let _ = futures_util::future::join(hub.probe(), hub.watch.check_run()).await;
            hub.ticking.store(false, Ordering::Release);
        });
    }

    /// For a queued waiter, at most once per [`MAX_WAIT_POLL`](crate::MAX_WAIT_POLL) per
    /// client: [`probe`](Self::probe) in the background. A release passes over a waiter whose
    /// hand-off `PUBLISH` reaches nobody, so a connection the server dropped without the client
    /// hearing of it (half-open: a NAT or proxy lost it) must be found and replaced while the
    /// client only waits, too: the keepalive's [`tick`](Self::tick) runs only while a lease is
    /// held.
    pub(crate) fn probe_while_waiting(self: &Arc<Self>) {
        let now = tokio::time::Instant::now();
        {
            let mut st = lock(&self.state);
            if st
                .waiter_probe
                .is_some_and(|t| now.duration_since(t) < crate::MAX_WAIT_POLL)
            {
                return;
            }
            st.waiter_probe = Some(now);
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let hub = self.clone();
        rt.spawn(async move { hub.probe().await });
    }

    /// Checks that the connection still answers (one `PING`, bounded by the response timeout);
    /// drops it if not, which reopens it when it is kept up. Nothing without a connection.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub(crate) async fn probe(&self) {
        let Some((generation, mut sink)) = lock(&self.state).conn.clone() else {
            return;
        };
        match tokio::time::timeout(self.timeout, sink.ping::<redis::Value>()).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "the pub/sub connection failed a PING");
                self.drop_connection(generation);
            }
            Err(_) => {
                tracing::debug!("the pub/sub connection did not answer a PING in time");
                self.drop_connection(generation);
            }
        }
    }

    /// Reopens the connection in the background, with backoff (50 ms up to 2 s), while it is
    /// kept up and the hub lives; then checks whether the server restarted meanwhile.
    fn spawn_reconnect(&self) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let weak = self.me.clone();
        rt.spawn(async move {
            let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
            loop {
                tokio::time::sleep(backoff.next_delay()).await;
                let Some(hub) = weak.upgrade() else { return };
                match hub.ensure().await {
                    Ok(()) => {
                        // The command connection may still be reconnecting: retry the check.
                        backoff.reset();
                        for _ in 0..8 {
                            if hub.watch.check_run().await {
                                break;
                            }
                            tokio::time::sleep(backoff.next_delay()).await;
                        }
                        return;
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "reopening the pub/sub connection failed");
                    }
                }
            }
        });
    }

    /// This client's hand-off channel.
    pub(crate) fn channel(&self) -> &str {
        &self.channel
    }

    /// The hand-off channel of a waiter for the lock of `keys`, as the acquire script stores it:
    /// the client's channel, or in Cluster mode `:` and the client's channel in the keys' slot
    /// (`SPUBLISH`ed; a classic channel never starts with `:`, which no prefix holds). `None`
    /// if there is none (then the waiter polls).
    pub(crate) fn channel_for(&self, keys: &Keys) -> Option<String> {
        match &self.shards {
            Some(s) => s.channel(slot_of(&keys.lock)).map(|c| format!(":{c}")),
            None => Some(self.channel.clone()),
        }
    }

    /// [`register`](Self::register) for the lock of `keys`: in Cluster mode a route on the
    /// keys' slot's channel, if that is subscribed now.
    pub(crate) fn register_for(self: &Arc<Self>, id: &str, keys: &Keys) -> Option<Waiting> {
        let Some(shards) = &self.shards else {
            return self.register(id);
        };
        let (seq, rx) = shards.register(id, slot_of(&keys.lock))?;
        Some(Waiting {
            hub: self.clone(),
            id: id.to_owned(),
            seq,
            rx: Some(rx),
            sharded: true,
        })
    }

    /// [`ensure`](Self::ensure) for the lock of `keys`: in Cluster mode subscribes to the
    /// client's channel in the keys' slot.
    ///
    /// # Errors
    /// As [`ensure`](Self::ensure), or [`Shards::ensure`].
    ///
    /// # Cancel safety
    /// Cancel safe, as those.
    pub(crate) async fn ensure_for(self: &Arc<Self>, keys: &Keys) -> Result<()> {
        match &self.shards {
            Some(s) => s.ensure(slot_of(&keys.lock)).await,
            None => self.ensure().await,
        }
    }

    /// A route for waiter `id`, if the client's channel is subscribed now (else `None`: a waiter
    /// must not join a queue while no hand-off message could reach it). Registered before the
    /// acquire attempt that joins the queue, so no hand-off is missed.
    pub(crate) fn register(self: &Arc<Self>, id: &str) -> Option<Waiting> {
        let mut st = lock(&self.state);
        st.conn.as_ref()?;
        let (tx, rx) = oneshot::channel();
        let seq = st.next_route;
        st.next_route += 1;
        st.routes.insert(id.to_owned(), (seq, tx));
        Some(Waiting {
            hub: self.clone(),
            id: id.to_owned(),
            seq,
            rx: Some(rx),
            sharded: false,
        })
    }

    /// Opens the pub/sub connection and subscribes to the client's channel, unless that is done
    /// already; when this returns `Ok`, the server has confirmed the subscription.
    ///
    /// # Errors
    /// Connecting failed or took longer than the connect timeout, or SUBSCRIBE failed or took
    /// longer than the response timeout (the connection is dropped then).
    ///
    /// # Cancel safety
    /// Cancel safe: a dropped call leaves no route; a connection it opened is closed.
    pub(crate) async fn ensure(self: &Arc<Self>) -> Result<()> {
        let _ops = self.ops.lock().await;
        if lock(&self.state).conn.is_some() {
            return Ok(());
        }
        let ct = self.connect_timeout;
        let pubsub = match tokio::time::timeout(ct, self.conn.client().get_async_pubsub()).await {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => return Err(from_redis(e)),
            Err(_) => return Err(timed_out("connecting the pub/sub connection", ct)),
        };
        let (mut sink, mut stream) = pubsub.split();
        match tokio::time::timeout(self.timeout, sink.subscribe(&self.channel)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(from_redis(e)),
            Err(_) => return Err(timed_out("SUBSCRIBE", self.timeout)),
        }
        // May this client subscribe to the lock keys' keyspace channels? Without them (an ACL
        // without permission for the channels) hand-offs still work and holders hear of
        // losses at their next renewal.
        let keyspace = self.watch.notifications();
        if keyspace {
            let probe = self.watch.probe_channel();
            match tokio::time::timeout(self.timeout, sink.subscribe(probe)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    self.watch.disable_notifications();
                    self.keyspace_refused(&from_redis(e));
                }
                Err(_) => return Err(timed_out("SUBSCRIBE", self.timeout)),
            }
        }
        let mut st = lock(&self.state);
        st.generation += 1;
        let generation = st.generation;
        let weak: Weak<Hub> = Arc::downgrade(self);
        let reader = tokio::spawn(async move {
            while let Some(msg) = stream.next().await {
                let Some(hub) = weak.upgrade() else { return };
                let Ok(payload) = msg.get_payload::<String>() else {
                    continue;
                };
                if hub.watch.is_keyspace(msg.get_channel_name()) {
                    hub.watch.on_event(msg.get_channel_name(), &payload);
                    continue;
                }
                let Some((id, token)) = payload.split_once(' ') else {
                    continue;
                };
                let Ok(token) = token.parse::<u64>() else {
                    continue;
                };
                let tx = lock(&hub.state).routes.remove(id);
                if let Some((_, tx)) = tx {
                    let _ = tx.send(token);
                }
            }
            // The connection is gone: drop every route, which wakes all waiters (their
            // receivers see the sender closed) so they look at their locks and register anew.
            if let Some(hub) = weak.upgrade() {
                hub.drop_connection(generation);
            }
        });
        if let Some(old) = st.reader.replace(reader.abort_handle()) {
            old.abort();
        }
        if keyspace {
            self.watch.connected(generation, sink.clone(), self.timeout);
        }
        st.conn = Some((generation, sink));
        st.routes.clear();
        Ok(())
    }

    /// Opens a pub/sub connection of its own (bounded by the connect timeout) for a caller
    /// that subscribes to other channels: an election observer (`slots.rs`).
    ///
    /// # Errors
    /// Connecting failed or took longer than the connect timeout.
    ///
    /// # Cancel safety
    /// Cancel safe: a dropped call closes what it opened.
    pub(crate) async fn open_pubsub(&self) -> Result<redis::aio::PubSub> {
        let ct = self.connect_timeout;
        match tokio::time::timeout(ct, self.conn.client().get_async_pubsub()).await {
            Ok(Ok(p)) => Ok(p),
            Ok(Err(e)) => Err(from_redis(e)),
            Err(_) => Err(timed_out("connecting the pub/sub connection", ct)),
        }
    }

    /// The response timeout, which bounds a SUBSCRIBE.
    pub(crate) fn response_timeout(&self) -> Duration {
        self.timeout
    }

    /// Logs, once per hub at warn level (then at debug), that the server refused a SUBSCRIBE:
    /// waiters then only poll.
    pub(crate) fn refused(&self, e: &Error) {
        if self.warned.swap(true, Ordering::Relaxed) {
            tracing::debug!(error = %e, "SUBSCRIBE refused; waiters poll");
        } else {
            tracing::warn!(error = %e,
                "the redis server refused SUBSCRIBE to this client's hand-off channel (an ACL \
                 without channel permission?): waiters poll instead (about once a second), \
                 which costs latency and load");
        }
    }

    /// Logs, once per hub at warn level (then at debug), that the server refused the
    /// SUBSCRIBE to the lock keys' keyspace channels.
    fn keyspace_refused(&self, e: &Error) {
        if self.warned_keyspace.swap(true, Ordering::Relaxed) {
            tracing::debug!(error = %e, "SUBSCRIBE to the lock keys' keyspace channels refused");
        } else {
            tracing::warn!(error = %e,
                "the redis server refused SUBSCRIBE to the lock keys' keyspace channels (an \
                 ACL without channel permission?): holders hear of a lost lock key only at \
                 their next renewal (within TTL/3)");
        }
    }

    /// Drops the current pub/sub connection (the master changed): its waiters look at their
    /// locks again, and a connection kept up is reopened, to the new master.
    pub(crate) fn reconnect(&self) {
        let current = lock(&self.state).conn.as_ref().map(|c| c.0);
        if let Some(generation) = current {
            self.drop_connection(generation);
        }
    }

    /// Drops pub/sub connection `generation` if it is still the current one: its reader stops,
    /// and every route is removed, which wakes their waiters. A connection kept up is reopened.
    fn drop_connection(&self, generation: u64) {
        {
            let mut st = lock(&self.state);
            if st.conn.as_ref().map(|c| c.0) != Some(generation) {
                return;
            }
            tracing::debug!("the pub/sub connection is gone; dropping it");
            st.conn = None;
            st.routes.clear();
            if let Some(h) = st.reader.take() {
                h.abort();
            }
        }
        self.watch.disconnected(generation);
        if self.keep.load(Ordering::Relaxed) {
            self.spawn_reconnect();
        }
    }
}
