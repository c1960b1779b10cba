//! Wake-ups for waiting acquires: one pub/sub connection per [`RedisLock`](crate::RedisLock),
//! shared by all its waiters, subscribed to the `…:released:{name}` channel of each lock that
//! someone waits for.
//!
//! The release script `PUBLISH`es on that channel after deleting the lock key
//! (<https://redis.io/docs/latest/develop/interact/pubsub/>). A waiter subscribes *before* the
//! acquire attempt that finds the lock held, so a release between that attempt and the wait is
//! not missed: every message bumps a [`watch`] counter, and a waiter that starts waiting after the
//! bump sees it at once.
//!
//! Pub/sub delivery is at-most-once (a dropped connection loses messages) and an expiry publishes
//! nothing, so waiters also wake on a bounded, jittered timer; see `lock.rs`.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::PubSubSink;
use tokio::sync::watch;
use tokio::task::AbortHandle;

use lockkit_core::{Error, Result};

use crate::error::{from_redis, timed_out};

struct Route {
    tx: watch::Sender<u64>,
    /// Live [`Subscription`]s of this channel.
    count: usize,
}

#[derive(Default)]
struct State {
    /// The current pub/sub connection and its generation number.
    conn: Option<(u64, PubSubSink)>,
    generation: u64,
    routes: HashMap<String, Route>,
    reader: Option<AbortHandle>,
}

/// The shared pub/sub connection of one `RedisLock` and the waiters' routes.
pub(crate) struct Hub {
    client: redis::Client,
    /// Bounds opening the pub/sub connection (the connect timeout).
    connect_timeout: Duration,
    /// Bounds one SUBSCRIBE or UNSUBSCRIBE (the response timeout); when it passes, the
    /// connection is taken for dead and dropped.
    timeout: Duration,
    /// Whether a refused SUBSCRIBE was logged at warn level already.
    warned: AtomicBool,
    state: Mutex<State>,
    /// Serializes SUBSCRIBE/UNSUBSCRIBE and reconnects, so that a waiter that finds a route in
    /// place knows its SUBSCRIBE was confirmed.
    ops: tokio::sync::Mutex<()>,
}

impl fmt::Debug for Hub {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = lock(&self.state);
        f.debug_struct("Hub")
            .field("connected", &st.conn.is_some())
            .field("channels", &st.routes.len())
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

/// One waiter's registration on a channel. Dropping it unregisters, and the last one of a
/// channel sends `UNSUBSCRIBE` in the background.
pub(crate) struct Subscription {
    hub: Arc<Hub>,
    channel: String,
    generation: u64,
    rx: watch::Receiver<u64>,
}

impl fmt::Debug for Subscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscription")
            .field("channel", &self.channel)
            .finish()
    }
}

impl Subscription {
    /// Resolves at the first message on the channel since the subscription (or the previous
    /// call), or when the pub/sub connection is lost (then [`is_dead`](Self::is_dead)).
    ///
    /// # Cancel safety
    /// Cancel safe: a message that arrives while nobody waits is remembered.
    pub(crate) async fn released(&mut self) {
        let _ = self.rx.changed().await;
    }

    /// Whether the pub/sub connection behind this subscription is gone.
    pub(crate) fn is_dead(&self) -> bool {
        self.rx.has_changed().is_err()
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let last = {
            let mut st = lock(&self.hub.state);
            if st.conn.as_ref().map(|c| c.0) != Some(self.generation) {
                return; // that connection is gone, and its routes with it
            }
            match st.routes.get_mut(&self.channel) {
                Some(r) => {
                    r.count = r.count.saturating_sub(1);
                    if r.count == 0 {
                        st.routes.remove(&self.channel);
                        true
                    } else {
                        false
                    }
                }
                None => false,
            }
        };
        if !last {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let hub = self.hub.clone();
        let channel = std::mem::take(&mut self.channel);
        let generation = self.generation;
        rt.spawn(async move { hub.unsubscribe(channel, generation).await });
    }
}

impl Hub {
    pub(crate) fn new(
        client: redis::Client,
        connect_timeout: Duration,
        timeout: Duration,
    ) -> Arc<Self> {
        Arc::new(Self {
            client,
            connect_timeout,
            timeout,
            warned: AtomicBool::new(false),
            state: Mutex::new(State::default()),
            ops: tokio::sync::Mutex::new(()),
        })
    }

    /// Registers for messages on `channel`; when this returns, the server has confirmed the
    /// subscription.
    ///
    /// # Errors
    /// Connecting failed or took longer than the connect timeout, or SUBSCRIBE failed or took
    /// longer than the response timeout. A timed-out connection is dropped (and its waiters
    /// woken), so that the next call opens a new one.
    ///
    /// # Cancel safety
    /// Cancel safe: a dropped call leaves at most a server-side subscription that no one listens
    /// to, removed when the next waiter of that channel leaves or the connection closes.
    pub(crate) async fn subscribe(self: &Arc<Self>, channel: &str) -> Result<Subscription> {
        let _ops = self.ops.lock().await;
        let current = lock(&self.state).conn.clone();
        let (generation, mut sink) = match current {
            Some(c) => c,
            None => self.connect().await?,
        };
        let existing = {
            let mut st = lock(&self.state);
            st.routes.get_mut(channel).map(|r| {
                r.count += 1;
                r.tx.subscribe()
            })
        };
        let rx = match existing {
            Some(rx) => rx,
            None => {
                let sub = tokio::time::timeout(self.timeout, sink.subscribe(channel));
                match sub.await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        let e = from_redis(e);
                        if e.is_retryable() {
                            self.drop_connection(generation);
                        }
                        return Err(e);
                    }
                    Err(_) => {
                        self.drop_connection(generation);
                        return Err(timed_out("SUBSCRIBE", self.timeout));
                    }
                }
                let mut st = lock(&self.state);
                if st.conn.as_ref().map(|c| c.0) != Some(generation) {
                    // The connection died while we subscribed: a dead subscription makes the
                    // waiter fall back to its timer and subscribe again.
                    let (tx, rx) = watch::channel(0);
                    drop(tx);
                    return Ok(Subscription {
                        hub: self.clone(),
                        channel: channel.to_owned(),
                        generation,
                        rx,
                    });
                }
                let (tx, rx) = watch::channel(0);
                st.routes.insert(channel.to_owned(), Route { tx, count: 1 });
                rx
            }
        };
        Ok(Subscription {
            hub: self.clone(),
            channel: channel.to_owned(),
            generation,
            rx,
        })
    }

    /// Logs, once per hub at warn level (then at debug), that the server refused a SUBSCRIBE:
    /// waiters then only poll.
    pub(crate) fn refused(&self, e: &Error) {
        if self.warned.swap(true, Ordering::Relaxed) {
            tracing::debug!(error = %e, "SUBSCRIBE refused; waiters poll");
        } else {
            tracing::warn!(error = %e,
                "the redis server refused SUBSCRIBE to a lock's release channel (an ACL without \
                 channel permission?): waiters poll instead (about once a second), which costs \
                 latency and load");
        }
    }

    /// Drops pub/sub connection `generation` if it is still the current one: its reader stops,
    /// and every route is removed, which wakes their waiters (they subscribe again).
    fn drop_connection(&self, generation: u64) {
        let mut st = lock(&self.state);
        if st.conn.as_ref().map(|c| c.0) != Some(generation) {
            return;
        }
        tracing::debug!("the pub/sub connection timed out; dropping it");
        st.conn = None;
        st.routes.clear();
        if let Some(h) = st.reader.take() {
            h.abort();
        }
    }

    /// Opens a new pub/sub connection and starts its reader. Called with `ops` held.
    async fn connect(self: &Arc<Self>) -> Result<(u64, PubSubSink)> {
        let ct = self.connect_timeout;
        let pubsub = match tokio::time::timeout(ct, self.client.get_async_pubsub()).await {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => return Err(from_redis(e)),
            Err(_) => return Err(timed_out("connecting the pub/sub connection", ct)),
        };
        let (sink, mut stream) = pubsub.split();
        let mut st = lock(&self.state);
        st.generation += 1;
        let generation = st.generation;
        let weak: Weak<Hub> = Arc::downgrade(self);
        let reader = tokio::spawn(async move {
            while let Some(msg) = stream.next().await {
                let Some(hub) = weak.upgrade() else { return };
                let st = lock(&hub.state);
                if let Some(r) = st.routes.get(msg.get_channel_name()) {
                    r.tx.send_modify(|n| *n = n.wrapping_add(1));
                }
            }
            // The connection is gone: drop every route, which wakes all waiters (their
            // receivers see the sender closed) so they retry and subscribe anew.
            if let Some(hub) = weak.upgrade() {
                let mut st = lock(&hub.state);
                if st.conn.as_ref().map(|c| c.0) == Some(generation) {
                    st.conn = None;
                    st.routes.clear();
                }
            }
        });
        if let Some(old) = st.reader.replace(reader.abort_handle()) {
            old.abort();
        }
        st.conn = Some((generation, sink.clone()));
        st.routes.clear();
        Ok((generation, sink))
    }

    /// Sends `UNSUBSCRIBE channel` unless a waiter registered for it again meanwhile.
    async fn unsubscribe(&self, channel: String, generation: u64) {
        let _ops = self.ops.lock().await;
        let sink = {
            let st = lock(&self.state);
            match &st.conn {
                Some((g, sink)) if *g == generation && !st.routes.contains_key(&channel) => {
                    sink.clone()
                }
                _ => return,
            }
        };
        let mut sink = sink;
        match tokio::time::timeout(self.timeout, sink.unsubscribe(&channel)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::debug!(error = %e, "UNSUBSCRIBE failed"),
            Err(_) => {
                tracing::debug!("UNSUBSCRIBE timed out");
                self.drop_connection(generation);
            }
        }
    }
}
