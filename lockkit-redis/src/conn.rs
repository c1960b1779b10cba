//! The command connection of a [`RedisLock`](crate::RedisLock): the redis crate's
//! auto-reconnecting [`ConnectionManager`], replaced by a fresh one when a command times out,
//! and in Sentinel mode when the sentinels name another master.
//!
//! The connection manager reconnects when the connection is closed or reset, but not when a
//! reply merely never comes: a connection that silently stopped carrying bytes (a dead NAT
//! entry, a partition that drops packets, a stuck proxy) would otherwise time out every
//! command forever while new connections work. So a response timeout retires the connection
//! that timed out, and the next command opens a new one.
//!
//! In Sentinel mode ([`crate::sentinel`]) a failed command (refused, dropped, timed out, or
//! `READONLY`: the old master came back as a replica) and every `+switch-master` message of the
//! sentinels start a discovery of the master; when it names another address, the connection,
//! the confirmation connection and the client are replaced, and the master's generation number
//! ([`Conn::switches`]) goes up, which the pub/sub connection and the loss notices follow.
//!
//! In Cluster mode ([`Conn::cluster`]) commands and scripts go through the redis crate's
//! cluster connection ([`redis::cluster_async`]), which routes each to the master of its first
//! key's slot and follows `MOVED` and `ASK` redirections (refreshing its slot map on `MOVED`).
//! Hand-offs use sharded pub/sub on cluster connections of their own (`shard.rs`,
//! [`Conn::cluster_client`]); a replication-confirmed grant sends its script and `WAIT` on a
//! second cluster connection, `WAIT` routed to the master of the grant's slot.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, ConnectionInfo, FromRedisValue, PushInfo, RedisResult, ScriptInvocation};
use tokio::sync::watch;

use lockkit_core::backend::Backoff;

use crate::sentinel::Discovery;

/// How long one discovery keeps asking the sentinels for a master before it gives up (the next
/// failed command starts another): 30 s.
const DISCOVERY_PERSISTENCE: Duration = Duration::from_secs(30);

/// How often a cluster connection retries a command whose node failed or redirected it
/// (each after a slot-map refresh and a wait of 20 ms up to 500 ms, all within the response
/// timeout): 6.
const CLUSTER_RETRIES: u32 = 6;

/// The builder of a cluster client for the seed nodes `nodes`, with connect timeout `ct` and
/// response timeout `rt` (each command's retries, after `MOVED`, `ASK` or a failed node, fit
/// within `rt`).
pub(crate) fn cluster_builder(
    nodes: Vec<ConnectionInfo>,
    ct: Duration,
    rt: Duration,
    tls: &ClusterTls,
) -> ClusterClientBuilder {
    let b = ClusterClientBuilder::new(nodes)
        .connection_timeout(ct)
        .response_timeout(rt)
        .retries(CLUSTER_RETRIES)
        .min_retry_wait(20)
        .max_retry_wait(500);
    #[cfg(feature = "tls")]
    if let Some(certs) = tls {
        return b.certs(certs.clone());
    }
    #[cfg(not(feature = "tls"))]
    let _ = tls;
    b
}

/// The certificates of every node's connection in Cluster mode over TLS
/// (`rediss+cluster://`), `None` without TLS.
#[cfg(feature = "tls")]
pub(crate) type ClusterTls = Option<redis::TlsCertificates>;
/// Without the `tls` feature there are none.
#[cfg(not(feature = "tls"))]
pub(crate) type ClusterTls = Option<std::convert::Infallible>;

/// Cheap to clone: clones share the current connection.
#[derive(Clone)]
pub(crate) struct Conn {
    inner: Arc<Inner>,
}

struct Inner {
    config: ConnectionManagerConfig,
    current: Mutex<Current>,
    /// The sentinels, in Sentinel mode.
    discovery: Option<Arc<Discovery>>,
    /// A discovery is running.
    discovering: AtomicBool,
    /// The master's generation number, bumped when the sentinels name another master.
    switched: watch::Sender<u64>,
    /// In Cluster mode: the cluster connection, and the seed nodes' clients for pub/sub.
    cluster: Option<Cluster>,
}

struct Cluster {
    conn: ClusterConnection,
    seeds: Vec<redis::Client>,
    /// The seed the next pub/sub connection goes to.
    next: AtomicUsize,
    /// The seed nodes and timeouts, for the cluster clients of sharded pub/sub and of
    /// replication-confirmed grants.
    nodes: Vec<ConnectionInfo>,
    timeouts: (Duration, Duration),
    /// Their TLS certificates (`rediss+cluster://`).
    tls: ClusterTls,
    /// The connection for replication-confirmed grants (`WAIT` blocks its connection to the
    /// node), opened on first use.
    side: tokio::sync::Mutex<Option<ClusterConnection>>,
}

struct Current {
    /// The connection in use and its generation number (bumped on every replacement).
    generation: u64,
    manager: ConnectionManager,
    /// The connection for replication-confirmed grants (`WAIT` blocks its connection), opened
    /// on first use.
    side: Option<ConnectionManager>,
    client: redis::Client,
    /// The master's address, as `host:port`.
    addr: String,
}

impl Conn {
    /// Wraps a connected `first` manager of `client`; replacements are built from `client` and
    /// `config`, or in Sentinel mode from the master `discovery` names.
    pub(crate) fn new(
        client: redis::Client,
        config: ConnectionManagerConfig,
        first: ConnectionManager,
        discovery: Option<Arc<Discovery>>,
    ) -> Self {
        let addr = client.get_connection_info().addr().to_string();
        let this = Self {
            inner: Arc::new(Inner {
                config,
                current: Mutex::new(Current {
                    generation: 0,
                    manager: first,
                    side: None,
                    client,
                    addr,
                }),
                discovering: AtomicBool::new(false),
                discovery,
                switched: watch::channel(0).0,
                cluster: None,
            }),
        };
        if let Some(d) = &this.inner.discovery {
            d.listen(this.downgrade(), this.switches());
        }
        this
    }

    /// Wraps a connected cluster connection of a client for the seed nodes `nodes` (connect
    /// and response timeouts `timeouts`); `seeds` (at least one) are the seed nodes' clients.
    pub(crate) fn cluster(
        conn: ClusterConnection,
        seeds: Vec<redis::Client>,
        config: ConnectionManagerConfig,
        nodes: Vec<ConnectionInfo>,
        timeouts: (Duration, Duration),
        tls: ClusterTls,
    ) -> redis::RedisResult<Self> {
        let first = seeds.first().cloned().ok_or_else(|| {
            redis::RedisError::from((redis::ErrorKind::InvalidClientConfig, "no seed node"))
        })?;
        // Never used for commands in Cluster mode; lazy, so it opens no connection.
        let manager = ConnectionManager::new_lazy_with_config(first.clone(), config.clone())?;
        let addr = first.get_connection_info().addr().to_string();
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                current: Mutex::new(Current {
                    generation: 0,
                    manager,
                    side: None,
                    client: first,
                    addr,
                }),
                discovery: None,
                discovering: AtomicBool::new(false),
                switched: watch::channel(0).0,
                cluster: Some(Cluster {
                    conn,
                    seeds,
                    next: AtomicUsize::new(0),
                    nodes,
                    timeouts,
                    tls,
                    side: tokio::sync::Mutex::new(None),
                }),
            }),
        })
    }

    /// Whether this is a Cluster connection.
    pub(crate) fn is_cluster(&self) -> bool {
        self.inner.cluster.is_some()
    }

    /// In Cluster mode, a new cluster client for the seed nodes, with this connection's
    /// timeouts; with `push`, speaking RESP3 and sending its push messages (pub/sub) there.
    /// `None` in the other modes.
    pub(crate) fn cluster_client(
        &self,
        push: Option<tokio::sync::mpsc::UnboundedSender<PushInfo>>,
    ) -> Option<RedisResult<ClusterClient>> {
        let c = self.inner.cluster.as_ref()?;
        let (ct, rt) = c.timeouts;
        let mut b = cluster_builder(c.nodes.clone(), ct, rt, &c.tls);
        if let Some(tx) = push {
            b = b
                .use_protocol(redis::ProtocolVersion::RESP3)
                .push_sender(tx);
        }
        Some(b.build())
    }

    fn lock(&self) -> MutexGuard<'_, Current> {
        self.inner.current.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn current(&self) -> (u64, ConnectionManager) {
        let cur = self.lock();
        (cur.generation, cur.manager.clone())
    }

    /// The client of the current master (for the pub/sub connection); in Cluster mode the
    /// next seed node's, round robin, so that a pub/sub connection reopened after a node
    /// failed tries another one.
    pub(crate) fn client(&self) -> redis::Client {
        if let Some(c) = &self.inner.cluster {
            let i = c.next.fetch_add(1, Ordering::Relaxed);
            if let Some(seed) = c.seeds.get(i % c.seeds.len().max(1)) {
                return seed.clone();
            }
        }
        self.lock().client.clone()
    }

    /// The current master's address (`host:port`), for logs and tests.
    pub(crate) fn master_addr(&self) -> String {
        self.lock().addr.clone()
    }

    /// Changes of the master's generation number (Sentinel mode; never changes otherwise).
    pub(crate) fn switches(&self) -> watch::Receiver<u64> {
        self.inner.switched.subscribe()
    }

    pub(crate) fn downgrade(&self) -> WeakConn {
        WeakConn(Arc::downgrade(&self.inner))
    }

    /// Runs a script (`EVALSHA`, loading it on `NOSCRIPT`).
    ///
    /// # Errors
    /// The redis client's error.
    ///
    /// # Cancel safety
    /// Cancel safe; the script may still run on the server.
    pub(crate) async fn invoke<T: FromRedisValue>(
        &self,
        script: &ScriptInvocation<'_>,
    ) -> RedisResult<T> {
        if let Some(c) = &self.inner.cluster {
            return script.invoke_async(&mut c.conn.clone()).await;
        }
        let (generation, mut conn) = self.current();
        let r = script.invoke_async(&mut conn).await;
        self.check(generation, &r);
        r
    }

    /// Runs one command.
    ///
    /// # Errors
    /// The redis client's error.
    ///
    /// # Cancel safety
    /// Cancel safe; the command may still run on the server.
    pub(crate) async fn query<T: FromRedisValue>(&self, cmd: &Cmd) -> RedisResult<T> {
        if let Some(c) = &self.inner.cluster {
            return cmd.query_async(&mut c.conn.clone()).await;
        }
        let (generation, mut conn) = self.current();
        let r = cmd.query_async(&mut conn).await;
        self.check(generation, &r);
        r
    }

    /// Runs `script` and then `wait` on the confirmation connection, one after the other: the
    /// `WAIT` of a replication-confirmed grant covers the script's write (and everything the
    /// master applied before it). In Cluster mode `key` is the script's first key: `WAIT` goes
    /// to the master of its slot, which ran the script.
    ///
    /// # Errors
    /// The redis client's error.
    ///
    /// # Cancel safety
    /// Cancel safe; the commands may still run on the server.
    pub(crate) async fn invoke_then<T: FromRedisValue, U: FromRedisValue>(
        &self,
        script: &ScriptInvocation<'_>,
        key: &str,
        wait: &Cmd,
    ) -> RedisResult<(T, U)> {
        if let Some(c) = &self.inner.cluster {
            return Self::cluster_invoke_then(c, self, script, key, wait).await;
        }
        let (generation, mut side) = {
            let mut cur = self.lock();
            let side = match &cur.side {
                Some(s) => s.clone(),
                None => {
                    let s = ConnectionManager::new_lazy_with_config(
                        cur.client.clone(),
                        self.inner.config.clone(),
                    )?;
                    cur.side = Some(s.clone());
                    s
                }
            };
            (cur.generation, side)
        };
        let r: RedisResult<(T, U)> = async {
            let t = script.invoke_async(&mut side).await?;
            let u = wait.query_async(&mut side).await?;
            Ok((t, u))
        }
        .await;
        if let Err(e) = &r {
            if e.is_timeout() {
                // A silent side connection: open a new one next time (the command connection
                // is not concerned).
                let mut cur = self.lock();
                if cur.generation == generation {
                    cur.side = None;
                }
            }
            self.maybe_failed_over(e);
        }
        r
    }

    /// [`invoke_then`](Self::invoke_then) in Cluster mode, on the cluster's confirmation
    /// connection (opened on first use, bounded by the connect timeout): the script goes to
    /// the master of its keys' slot, and `WAIT` to the master of `key`'s slot, the same node
    /// unless the slot moved in between (then `WAIT` asks the new master, which did not take
    /// this connection's write: it answers at once with its replicas' count, and the grant's
    /// next renewal on the new master tells whether it is held there).
    async fn cluster_invoke_then<T: FromRedisValue, U: FromRedisValue>(
        c: &Cluster,
        conn: &Conn,
        script: &ScriptInvocation<'_>,
        key: &str,
        wait: &Cmd,
    ) -> RedisResult<(T, U)> {
        let mut side = {
            let mut slot = c.side.lock().await;
            match &*slot {
                Some(s) => s.clone(),
                None => {
                    let client = conn.cluster_client(None).ok_or_else(|| {
                        redis::RedisError::from((
                            redis::ErrorKind::InvalidClientConfig,
                            "not a cluster",
                        ))
                    })??;
                    let (ct, _) = c.timeouts;
                    let s = match tokio::time::timeout(ct, client.get_async_connection()).await {
                        Ok(r) => r?,
                        Err(_) => {
                            return Err(redis::RedisError::from(std::io::Error::new(
                                std::io::ErrorKind::TimedOut,
                                "connecting the confirmation connection",
                            )));
                        }
                    };
                    *slot = Some(s.clone());
                    s
                }
            }
        };
        let t = script.invoke_async(&mut side).await?;
        let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(
            redis::cluster_routing::Route::with_key(key, SlotAddr::Master),
        ));
        let v = side.route_command(wait.clone(), route).await?;
        Ok((t, redis::from_redis_value(v)?))
    }

    /// In Sentinel mode, starts a discovery of the master after an error that a failover
    /// explains: a failed connection, a timeout, `READONLY` (the old master came back as a
    /// replica) or `MASTERDOWN`.
    fn maybe_failed_over(&self, e: &redis::RedisError) {
        if self.inner.discovery.is_some()
            && (e.is_timeout()
                || e.is_io_error()
                || e.is_connection_refusal()
                || e.is_connection_dropped()
                || e.code() == Some("READONLY")
                || e.code() == Some("MASTERDOWN"))
        {
            self.rediscover();
        }
    }

    /// After a response timeout, retires connection `generation` (unless it was replaced
    /// already): the next command connects anew. In Sentinel mode a failed connection or a
    /// `READONLY` reply also starts a discovery of the master.
    fn check<T>(&self, generation: u64, r: &RedisResult<T>) {
        let Err(e) = r else { return };
        self.maybe_failed_over(e);
        if !e.is_timeout() {
            return;
        }
        let mut cur = self.lock();
        if cur.generation != generation {
            return;
        }
        match ConnectionManager::new_lazy_with_config(cur.client.clone(), self.inner.config.clone())
        {
            Ok(fresh) => {
                cur.generation += 1;
                cur.manager = fresh;
                tracing::debug!("a redis command timed out; the next one uses a new connection");
            }
            Err(e) => tracing::debug!(error = %e, "cannot replace a timed-out redis connection"),
        }
    }

    /// Starts a discovery of the master in the background (Sentinel mode; one at a time): asks
    /// the sentinels (with backoff, 50 ms doubling up to 500 ms, for up to
    /// [`DISCOVERY_PERSISTENCE`]) until one names a master that confirms its role; if that is
    /// another address than the current one, switches to it.
    pub(crate) fn rediscover(&self) {
        let Some(discovery) = self.inner.discovery.clone() else {
            return;
        };
        if self.inner.discovering.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            self.inner.discovering.store(false, Ordering::Release);
            return;
        };
        let weak = self.downgrade();
        rt.spawn(async move {
            let until = tokio::time::Instant::now() + DISCOVERY_PERSISTENCE;
            let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_millis(500));
            loop {
                let found = discovery.master().await;
                let Some(conn) = weak.upgrade() else { return };
                match found {
                    Ok(client) => {
                        conn.switch_to(client);
                        break;
                    }
                    Err(e) if tokio::time::Instant::now() < until => {
                        tracing::debug!(error = %e, "no master from the sentinels yet; asking again");
                        drop(conn);
                        tokio::time::sleep(backoff.next_delay()).await;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e,
                            "the sentinels named no reachable master within 30 s; the next \
                             failed command asks again");
                        break;
                    }
                }
            }
            if let Some(conn) = weak.upgrade() {
                conn.inner.discovering.store(false, Ordering::Release);
            }
        });
    }

    /// Uses the master of `client` from now on, if it is another one than the current master.
    fn switch_to(&self, client: redis::Client) {
        let addr = client.get_connection_info().addr().to_string();
        let mut cur = self.lock();
        if cur.addr == addr {
            return;
        }
        let fresh = match ConnectionManager::new_lazy_with_config(
            client.clone(),
            self.inner.config.clone(),
        ) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "cannot connect to the new master");
                return;
            }
        };
        tracing::warn!(old = %cur.addr, new = %addr,
            "the sentinels name a new redis master: leases held are kept only where it proves it \
             holds them");
        cur.generation += 1;
        cur.manager = fresh;
        cur.side = None;
        cur.client = client;
        cur.addr = addr;
        drop(cur);
        self.inner.switched.send_modify(|g| *g += 1);
    }
}

/// A [`Conn`] that does not keep it alive (for its background tasks).
#[derive(Clone)]
pub(crate) struct WeakConn(Weak<Inner>);

impl WeakConn {
    pub(crate) fn upgrade(&self) -> Option<Conn> {
        self.0.upgrade().map(|inner| Conn { inner })
    }
}
