//! Sentinel mode: the master of a service is found through its sentinels
//! (<https://redis.io/docs/latest/operate/oss_and_stack/management/sentinel/>), with the redis
//! crate's [`Sentinel`] (`SENTINEL MASTERS` on the sentinels in turn, then `ROLE` on the master
//! they name, which must say `master`), and found again after a failover.
//!
//! - **When**: at connect; when a command fails in a way a failover explains (connection
//!   refused or dropped, a timeout, `READONLY` from an old master that came back as a replica,
//!   `MASTERDOWN`), see `conn.rs`; and at once on a sentinel's `+switch-master` message: one
//!   pub/sub connection per [`RedisLock`](crate::RedisLock) to one sentinel at a time (the next
//!   one in the list when it drops, with backoff), `SUBSCRIBE +switch-master`.
//! - **Credentials**: the sentinels get `sentinel_username` / `sentinel_password`, the master
//!   the URL's user info (and database and protocol). Neither is ever logged.
//! - **Timeouts**: the redis crate's lookups have none of their own; each discovery is bounded
//!   by the connect timeout (a blackholed sentinel or master cannot stall it).
//! - **Leases across a failover** (see `watch.rs`): the new master has another `run_id`. Every
//!   lease held through the client must then prove that the new master still holds it: one
//!   compare-and-`PEXPIRE` of its key with its owner value. A lease whose key is missing or
//!   holds another value is [`Lost`](lockkit_core::LeaseState::Lost)
//!   ([`NotHeldOnServer`](lockkit_core::LossReason::NotHeldOnServer)); one that proves it stays
//!   held, with its expiry on the new master set anew from now (a renewal the old master took
//!   but did not replicate is made good).

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use redis::sentinel::{Sentinel, SentinelNodeConnectionInfo};
use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo, RedisConnectionInfo};
use tokio::sync::watch;

use lockkit_core::backend::Backoff;
use lockkit_core::{Error, Result};

use crate::config::SentinelSettings;
use crate::conn::{Conn, WeakConn};
use crate::error::{from_redis, timed_out};
use crate::waiters::Hub;

/// The sentinels of one service and how to reach the master they name.
pub(crate) struct Discovery {
    sentinel: tokio::sync::Mutex<Sentinel>,
    /// Each sentinel's connection settings (for the `+switch-master` subscription).
    nodes: Vec<ConnectionInfo>,
    service: String,
    /// The master's `AUTH`, database and protocol.
    master: SentinelNodeConnectionInfo,
    /// Bounds each discovery.
    timeout: Duration,
}

impl Discovery {
    /// The discovery of the master of `settings.service`, logging in to the master with
    /// `master` and bounded by `timeout`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if the redis crate refuses the sentinels' settings.
    pub(crate) fn new(
        settings: &SentinelSettings,
        master: RedisConnectionInfo,
        timeout: Duration,
    ) -> Result<Arc<Self>> {
        let mut auth = RedisConnectionInfo::default();
        if let Some(u) = &settings.username {
            auth = auth.set_username(u);
        }
        if let Some(p) = &settings.password {
            auth = auth.set_password(p);
        }
        let nodes = settings
            .nodes
            .iter()
            .map(|(h, p)| {
                Ok(ConnectionAddr::Tcp(h.clone(), *p)
                    .into_connection_info()
                    .map_err(from_redis)?
                    .set_redis_settings(auth.clone()))
            })
            .collect::<Result<Vec<_>>>()?;
        let sentinel = Sentinel::build(nodes.clone())
            .map_err(|e| Error::config_with("the redis client refused the sentinels", e))?;
        Ok(Arc::new(Self {
            sentinel: tokio::sync::Mutex::new(sentinel),
            nodes,
            service: settings.service.clone(),
            master: SentinelNodeConnectionInfo::default().set_redis_connection_info(master),
            timeout,
        }))
    }

    /// A client for the master the sentinels name now (checked with `ROLE`).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the service if every sentinel that answers knows no
    /// such service (`SENTINEL GET-MASTER-ADDR-BY-NAME` is nil on each); [`Error::Unavailable`]
    /// if no sentinel answers, none names a master that is up, or that took longer than the
    /// connect timeout; [`Error::Auth`] for refused credentials.
    ///
    /// # Cancel safety
    /// Cancel safe (the redis crate's lookup may be dropped at any await).
    pub(crate) async fn master(&self) -> Result<redis::Client> {
        let deadline = tokio::time::Instant::now() + self.timeout;
        let found = tokio::time::timeout_at(deadline, async {
            let mut s = self.sentinel.lock().await;
            s.async_master_for(&self.service, Some(&self.master)).await
        })
        .await;
        match found {
            Ok(Ok(client)) => Ok(client),
            Ok(Err(e)) => match from_redis(e) {
                // The redis crate says the same (`MasterNameNotFoundBySentinel`) for a name no
                // sentinel knows and for a master they all flag down: ask them which.
                Error::Backend { source, .. } => Err(if self.service_unknown(deadline).await {
                    Error::config(format!(
                        "the sentinels monitor no service named {:?} (the URL's path names \
                         the service)",
                        self.service
                    ))
                } else {
                    Error::Unavailable {
                        backend: crate::error::BACKEND,
                        source: format!("the sentinels name no usable master: {source}").into(),
                    }
                }),
                other => Err(other),
            },
            Err(_) => Err(timed_out(
                "finding the master through the sentinels",
                self.timeout,
            )),
        }
    }

    /// Whether at least one sentinel answered `SENTINEL GET-MASTER-ADDR-BY-NAME` for the service
    /// by `deadline` and every one that did answered nil (it monitors no such service). The
    /// sentinels are asked at once; one that cannot be reached, refuses the login or does not
    /// answer in time is left out.
    async fn service_unknown(&self, deadline: tokio::time::Instant) -> bool {
        let asks = self.nodes.iter().map(|node| async move {
            let ask = async {
                let mut c = redis::Client::open(node.clone())?
                    .get_multiplexed_async_connection()
                    .await?;
                redis::cmd("SENTINEL")
                    .arg("GET-MASTER-ADDR-BY-NAME")
                    .arg(&self.service)
                    .query_async::<Option<Vec<String>>>(&mut c)
                    .await
            };
            match tokio::time::timeout_at(deadline, ask).await {
                Ok(Ok(addr)) => Some(addr.is_none()),
                Ok(Err(_)) | Err(_) => None,
            }
        });
        let answers: Vec<bool> = futures_util::future::join_all(asks)
            .await
            .into_iter()
            .flatten()
            .collect();
        !answers.is_empty() && answers.iter().all(|&unknown| unknown)
    }

    /// Listens for `+switch-master` on the sentinels (one at a time, the next one when the
    /// connection drops, with backoff from 100 ms to 2 s) while `conn` lives (`closed` ends
    /// when it is dropped), and starts a discovery on every message.
    pub(crate) fn listen(self: &Arc<Self>, conn: WeakConn, mut closed: watch::Receiver<u64>) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let nodes = self.nodes.clone();
        let timeout = self.timeout;
        rt.spawn(async move {
            let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
            for node in nodes.iter().cycle() {
                let subscribed = tokio::time::timeout(timeout, async {
                    let mut pubsub = redis::Client::open(node.clone())?.get_async_pubsub().await?;
                    pubsub.subscribe("+switch-master").await?;
                    Ok::<_, redis::RedisError>(pubsub)
                });
                let subscribed = tokio::select! {
                    s = subscribed => s,
                    _ = gone(&mut closed) => return,
                };
                let mut stream = match subscribed {
                    Ok(Ok(p)) => p.into_on_message(),
                    other => {
                        if let Ok(Err(e)) = other {
                            tracing::debug!(error = %e, "cannot subscribe to +switch-master on a sentinel");
                        }
                        tokio::select! {
                            _ = tokio::time::sleep(backoff.next_delay()) => continue,
                            _ = gone(&mut closed) => return,
                        }
                    }
                };
                backoff.reset();
                loop {
                    let msg = tokio::select! {
                        m = stream.next() => m,
                        _ = gone(&mut closed) => return,
                    };
                    let Some(conn) = conn.upgrade() else { return };
                    if msg.is_some() {
                        tracing::info!("a sentinel announced +switch-master; finding the master");
                    }
                    // A message, or the sentinel went away (a failover may be under way).
                    conn.rediscover();
                    if msg.is_none() {
                        break;
                    }
                }
            }
        });
    }
}

/// Resolves when the connection that `closed` belongs to is dropped (its sender is gone).
async fn gone(closed: &mut watch::Receiver<u64>) {
    while closed.changed().await.is_ok() {}
}

/// Follows master switches of `conn` (Sentinel mode; nothing happens otherwise): on each, the
/// pub/sub connection of `hub` is reopened to the new master and the leases held through the
/// client must prove the new master holds them (`Watch::check_run`, retried with backoff until
/// `INFO` answers, at most 8 times). Ends when the hub or the connection is dropped.
pub(crate) fn follow(hub: &Arc<Hub>, conn: &Conn) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let mut switches = conn.switches();
    let weak = Arc::downgrade(hub);
    rt.spawn(async move {
        while switches.changed().await.is_ok() {
            let Some(hub) = weak.upgrade() else { return };
            hub.watch().suspect_all();
            hub.reconnect();
            let mut backoff = Backoff::new(Duration::from_millis(20), Duration::from_millis(500));
            for _ in 0..8 {
                if hub.watch().check_run().await {
                    break;
                }
                tokio::time::sleep(backoff.next_delay()).await;
            }
        }
    });
}

/// [`Guarantees::notes`](lockkit_core::Guarantees::notes) in Sentinel mode.
pub(crate) const NOTES: &str = "efficiency lock on the master of a Redis Sentinel service. The \
master is found through the sentinels and found again after a failover (+switch-master, or a \
failed command). Replication is asynchronous: a grant the old master did not pass on before it \
failed is unknown to the promoted replica, which can grant the lock a second time while the old \
holder still reads Held, until the client switches masters (then every lease must prove that the \
new master holds its key with its owner value, or it is Lost). min_replicas (WAIT) narrows that \
window to grants no replica acknowledged; it is still not a consensus lock (WAIT does not make \
replication synchronous, and Sentinel may promote a replica that did not acknowledge). Tokens: a \
per-name counter never below the server's TIME in µs, so a promoted replica that lost the last \
grants still hands out larger tokens, as long as the servers' clocks agree better than the \
failover takes and a lock is granted fewer than once per µs on average. Loss notices, waiters \
and lock-delay as on a single server.";
