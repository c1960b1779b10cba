//! Hand-off messages in Cluster mode ([`RedisMode::Cluster`](crate::RedisMode::Cluster)):
//! sharded pub/sub (<https://redis.io/docs/latest/develop/interact/pubsub/#sharded-pubsub>).
//!
//! A classic `PUBLISH` in a cluster goes over the cluster bus to every node. So in Cluster mode
//! a waiter's hand-off channel lies in its lock name's hash slot, `P:client:{T}:ID` (`ID` the
//! client's random ID, `T` a short tag that hashes to the name's slot: one channel per slot and
//! client, shared by all names of that slot), the release script `SPUBLISH`es on it, and the
//! message stays on the slot's shard (its master and that master's replicas).
//!
//! The channels are subscribed (`SSUBSCRIBE`) on a cluster connection of their own, speaking
//! RESP3 (push messages), opened on the first wait: one subscription per slot in which this
//! client waits, confirmed by the slot's master before a waiter of that slot joins the queue with
//! the channel (until then it looks at the lock on its timer, as without pub/sub). A slot stays
//! subscribed while it is idle (no waiter), for the next wait; at most [`MAX_CHANNELS`] slots
//! are: a wait in another slot first unsubscribes the idle ones, and if none is idle it polls.
//!
//! When the slot moves (a migration, or a failover makes a replica the slot's master), the old
//! master tells its subscribers (`SUNSUBSCRIBE`); when a node's connection drops, the redis crate
//! says so. Either way the slot's (or every) waiter is woken, looks at its lock again, and
//! subscribes anew, which the cluster connection sends to the slot's master now (following
//! `MOVED`). A hand-off message lost meanwhile is covered by the waiters' timer (see `lock.rs`).

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, Weak};
use std::time::Duration;

use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::Slot;
use redis::{PushInfo, PushKind, Value};
use tokio::sync::{mpsc, oneshot};
use tokio::task::AbortHandle;

use lockkit_core::Result;

use crate::conn::Conn;
use crate::error::{from_redis, timed_out};

/// The most hash slots one client keeps subscribed (one channel each): 256.
pub(crate) const MAX_CHANNELS: usize = 256;

/// The number of hash slots of a Redis Cluster.
const SLOTS: usize = 16384;

/// For every hash slot, the smallest number whose decimal digits hash to it (so `{N}` puts a
/// channel in that slot). Every slot has one up to 109 757 (checked by a unit test); computed
/// once, on the first wait in Cluster mode (109 758 CRC16s of at most six bytes).
static TAGS: LazyLock<HashMap<Slot, u32>> = LazyLock::new(|| {
    let mut tags = HashMap::with_capacity(SLOTS);
    let mut n: u32 = 0;
    while tags.len() < SLOTS && n < 10_000_000 {
        tags.entry(Slot::for_key(n.to_string())).or_insert(n);
        n += 1;
    }
    tags
});

/// The slot of a lock's keys (they share one hash tag).
pub(crate) fn slot_of(lock_key: &str) -> Slot {
    Slot::for_key(lock_key)
}

struct Route {
    seq: u64,
    slot: Slot,
    tx: oneshot::Sender<u64>,
}

#[derive(Default)]
struct State {
    /// The pub/sub cluster connection, once opened.
    conn: Option<ClusterConnection>,
    reader: Option<AbortHandle>,
    /// The slots whose channel the server confirmed (and did not take back since).
    subscribed: HashSet<Slot>,
    /// Waiting acquires by waiter ID.
    routes: HashMap<String, Route>,
    next_route: u64,
}

/// The sharded hand-off channels of one `RedisLock` in Cluster mode, and its waiters' routes.
pub(crate) struct Shards {
    conn: Conn,
    /// `P:client:`.
    base: String,
    /// The client's random ID.
    id: String,
    connect_timeout: Duration,
    timeout: Duration,
    state: Mutex<State>,
    /// Serializes opening the connection and subscribing.
    ops: tokio::sync::Mutex<()>,
}

impl fmt::Debug for Shards {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.lock();
        f.debug_struct("Shards")
            .field("subscribed", &st.subscribed.len())
            .field("waiters", &st.routes.len())
            .finish()
    }
}

impl Drop for Shards {
    fn drop(&mut self) {
        if let Some(h) = self.lock().reader.take() {
            h.abort();
        }
    }
}

impl Shards {
    /// `id` is the client's random ID (as in its classic channel).
    pub(crate) fn new(
        conn: Conn,
        prefix: &str,
        id: &str,
        connect_timeout: Duration,
        timeout: Duration,
    ) -> Arc<Self> {
        Arc::new(Self {
            conn,
            base: format!("{prefix}:client:"),
            id: id.to_owned(),
            connect_timeout,
            timeout,
            state: Mutex::new(State::default()),
            ops: tokio::sync::Mutex::new(()),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every statement leaves the state consistent; a panic elsewhere must not poison it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// This client's channel in `slot`: `P:client:{T}:ID` (`None` if no tag was found for the
    /// slot, which does not happen: then waiters of that slot poll).
    pub(crate) fn channel(&self, slot: Slot) -> Option<String> {
        let tag = TAGS.get(&slot)?;
        Some(format!("{}{{{tag}}}:{}", self.base, self.id))
    }

    /// A route for waiter `id` in `slot`, if that slot's channel is subscribed now (else
    /// `None`: the waiter must not join the queue with the channel yet).
    pub(crate) fn register(&self, id: &str, slot: Slot) -> Option<(u64, oneshot::Receiver<u64>)> {
        let mut st = self.lock();
        if !st.subscribed.contains(&slot) {
            return None;
        }
        let (tx, rx) = oneshot::channel();
        let seq = st.next_route;
        st.next_route += 1;
        st.routes.insert(id.to_owned(), Route { seq, slot, tx });
        Some((seq, rx))
    }

    /// Removes the route of waiter `id` registered as `seq` (a dropped `Waiting`).
    pub(crate) fn unregister(&self, id: &str, seq: u64) {
        let mut st = self.lock();
        if st.routes.get(id).is_some_and(|r| r.seq == seq) {
            st.routes.remove(id);
        }
    }

    /// Subscribes to this client's channel in `slot`, unless it is subscribed already (opening
    /// the connection first, and unsubscribing idle slots when [`MAX_CHANNELS`] are); when this
    /// returns `Ok`, the slot's master has confirmed the subscription.
    ///
    /// # Errors
    /// Connecting failed or took longer than the connect timeout; the `SSUBSCRIBE` failed or
    /// took longer than the response timeout; [`MAX_CHANNELS`] slots have waiters now
    /// (retryable: the waiter polls and tries again later).
    ///
    /// # Cancel safety
    /// Cancel safe: a dropped call may leave the slot subscribed (idle), never a route.
    pub(crate) async fn ensure(self: &Arc<Self>, slot: Slot) -> Result<()> {
        let _ops = self.ops.lock().await;
        let Some(channel) = self.channel(slot) else {
            return Err(unavailable("no channel for the lock's hash slot"));
        };
        let (mut conn, idle) = {
            let st = self.lock();
            if st.subscribed.contains(&slot) {
                return Ok(());
            }
            let idle: Vec<Slot> = if st.subscribed.len() >= MAX_CHANNELS {
                let busy: HashSet<Slot> = st.routes.values().map(|r| r.slot).collect();
                st.subscribed
                    .iter()
                    .filter(|s| !busy.contains(s))
                    .copied()
                    .collect()
            } else {
                Vec::new()
            };
            if st.subscribed.len() >= MAX_CHANNELS && idle.is_empty() {
                return Err(unavailable(
                    "this client waits in the most hash slots it subscribes to at once",
                ));
            }
            (st.conn.clone(), idle)
        };
        if conn.is_none() {
            conn = Some(self.open().await?);
        }
        let Some(mut conn) = conn else {
            return Err(unavailable("no pub/sub connection"));
        };
        if !idle.is_empty() {
            let channels: Vec<String> = {
                let mut st = self.lock();
                idle.iter()
                    .filter(|s| st.subscribed.remove(s))
                    .filter_map(|s| self.channel(*s))
                    .collect()
            };
            // One SUNSUBSCRIBE per channel: each goes to its own slot's master.
            for c in channels {
                match tokio::time::timeout(self.timeout, conn.sunsubscribe(&c)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "SUNSUBSCRIBE of an idle slot failed")
                    }
                    Err(_) => tracing::debug!("SUNSUBSCRIBE of an idle slot timed out"),
                }
            }
        }
        match tokio::time::timeout(self.timeout, conn.ssubscribe(&channel)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(from_redis(e)),
            Err(_) => return Err(timed_out("SSUBSCRIBE", self.timeout)),
        }
        self.lock().subscribed.insert(slot);
        Ok(())
    }

    /// Opens the pub/sub cluster connection (bounded by the connect timeout) and starts its
    /// reader.
    async fn open(self: &Arc<Self>) -> Result<ClusterConnection> {
        let (tx, rx) = mpsc::unbounded_channel();
        let client = match self.conn.cluster_client(Some(tx)) {
            Some(c) => c.map_err(from_redis)?,
            None => return Err(unavailable("not a cluster connection")),
        };
        let ct = self.connect_timeout;
        let conn = match tokio::time::timeout(ct, client.get_async_connection()).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(from_redis(e)),
            Err(_) => return Err(timed_out("connecting the sharded pub/sub connection", ct)),
        };
        let reader = tokio::spawn(read(Arc::downgrade(self), rx));
        let mut st = self.lock();
        if let Some(old) = st.reader.replace(reader.abort_handle()) {
            old.abort();
        }
        st.conn = Some(conn.clone());
        Ok(conn)
    }

    /// A hand-off message `payload` (`"WAITER TOKEN"`) to its waiter's route.
    fn deliver(&self, payload: &str) {
        let Some((id, token)) = payload.split_once(' ') else {
            return;
        };
        let Ok(token) = token.parse::<u64>() else {
            return;
        };
        let route = self.lock().routes.remove(id);
        if let Some(r) = route {
            let _ = r.tx.send(token);
        }
    }

    /// The channel of `slot` is no longer subscribed (`None`: every slot's, a node's
    /// connection dropped): its routes are dropped, which wakes their waiters, who look at
    /// their locks and subscribe anew.
    fn lost(&self, slot: Option<Slot>) {
        let mut st = self.lock();
        match slot {
            Some(s) => {
                st.subscribed.remove(&s);
                st.routes.retain(|_, r| r.slot != s);
            }
            None => {
                st.subscribed.clear();
                st.routes.clear();
            }
        }
    }
}

/// Reads the push messages of the pub/sub cluster connection while the [`Shards`] live.
async fn read(shards: Weak<Shards>, mut rx: mpsc::UnboundedReceiver<PushInfo>) {
    while let Some(push) = rx.recv().await {
        let Some(this) = shards.upgrade() else { return };
        let text = |i: usize| match push.data.get(i) {
            Some(Value::BulkString(b)) => std::str::from_utf8(b).ok(),
            _ => None,
        };
        match push.kind {
            PushKind::SMessage => {
                if let Some(payload) = text(1) {
                    this.deliver(payload);
                }
            }
            PushKind::SUnsubscribe => {
                // The server took the channel back (its slot moved), or we gave up an idle one.
                if let Some(channel) = text(0) {
                    tracing::debug!(%channel, "a sharded hand-off channel was unsubscribed");
                    this.lost(Some(Slot::for_key(channel)));
                }
            }
            PushKind::Disconnection => {
                tracing::debug!("a node of the sharded pub/sub connection disconnected");
                this.lost(None);
            }
            _ => {}
        }
    }
}

fn unavailable(what: &'static str) -> lockkit_core::Error {
    lockkit_core::Error::Unavailable {
        backend: crate::error::BACKEND,
        source: what.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_slot_has_a_tag_that_hashes_to_it() {
        assert_eq!(TAGS.len(), SLOTS);
        assert_eq!(TAGS.values().max(), Some(&109_757));
        for (slot, tag) in TAGS.iter().take(100) {
            assert_eq!(Slot::for_key(format!("p:client:{{{tag}}}:id")), *slot);
        }
        let key = "app:lock:{=job}";
        let s = slot_of(key);
        let ch = format!("app:client:{{{}}}:x", TAGS[&s]);
        assert_eq!(Slot::for_key(ch), s);
    }
}
