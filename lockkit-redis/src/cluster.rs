//! Connecting to a Redis Cluster ([`RedisMode::Cluster`](crate::RedisMode::Cluster)) with the
//! redis crate's cluster client ([`redis::cluster::ClusterClient`],
//! [`redis::cluster_async`]).
//!
//! The cluster connection learns the slot map from the seed nodes (`CLUSTER SLOTS`), sends
//! each command to the master of its first key's slot, follows `MOVED` (and refreshes the map)
//! and `ASK` (a slot being migrated), and retries a command whose node failed after refreshing
//! the map, within the response timeout. Every key of one lock name shares one hash tag
//! ([`Keys::build`](crate::core::Keys::build)), so each script runs on one node, atomically.

use std::time::Duration;

use redis::aio::ConnectionManagerConfig;

use lockkit_core::Result;

use crate::config::{RedisConfig, TlsFiles, connect_error};
use crate::conn::{ClusterTls, Conn, cluster_builder};
use crate::error::timed_out;

/// [`Guarantees::notes`](lockkit_core::Guarantees::notes) in Cluster mode.
pub(crate) const NOTES: &str = "efficiency lock on a Redis Cluster: every key of one lock name in \
one hash slot (a hash tag), each script on that slot's master. Tokens: the per-name counter with \
the server's TIME floor, as on one server, so they keep increasing across a failover and a slot \
migration while the masters' clocks agree. Replication is asynchronous: a failover to a replica \
that had not received the lock key grants a held lock again; the old holder finds out at its next \
renewal (within TTL/3), which fails on the new master, and is Lost unless its key is there. A lock \
held while its slot migrates stays held (the scripts follow ASK and MOVED; MIGRATE moves the keys \
with their TTLs). No keyspace notifications in this mode: a deleted or evicted lock key is heard \
of at the next renewal. Waiters are served in queue order; hand-offs are SPUBLISHed on the \
waiter's channel in the lock's slot (sharded pub/sub: they stay on that slot's shard). With \
min_replicas, a grant is confirmed by WAIT on the slot's master (given back with fewer \
acknowledgements). Elections and semaphores are not supported in this mode (NotSupported).";

/// Connects to the cluster of `config`'s seed nodes: builds the slot map and sends one
/// `PING`, within the connect timeout.
///
/// # Errors
/// [`Error::Unavailable`](lockkit_core::Error::Unavailable) when no seed answers in time (or the
/// cluster is down), [`Error::Auth`](lockkit_core::Error::Auth) for refused credentials,
/// [`Error::InvalidConfig`](lockkit_core::Error::InvalidConfig) for a node address the redis
/// crate refuses, or a seed that is not a cluster node ("cluster support disabled").
///
/// # Cancel safety
/// Cancel safe: dropping the future closes what it opened.
pub(crate) async fn connect(config: &RedisConfig) -> Result<Conn> {
    let ct = config.connect_timeout;
    let rt = config.response_timeout;
    let nodes = config.cluster_node_infos()?;
    let files = match tokio::time::timeout(ct, config.tls_files()).await {
        Ok(r) => r?,
        Err(_) => return Err(timed_out("reading the TLS files", ct)),
    };
    let (seeds, tls): (_, ClusterTls) = match files {
        TlsFiles {
            root: None,
            client: None,
        } => (
            nodes
                .iter()
                .cloned()
                .map(redis::Client::open)
                .collect::<redis::RedisResult<Vec<_>>>(),
            None,
        ),
        #[cfg(feature = "tls")]
        TlsFiles { root, client } => {
            let certs = || redis::TlsCertificates {
                client_tls: client.clone().map(|(client_cert, client_key)| {
                    redis::ClientTlsConfig {
                        client_cert,
                        client_key,
                    }
                }),
                root_cert: root.clone(),
            };
            (
                nodes
                    .iter()
                    .cloned()
                    .map(|n| redis::Client::build_with_tls(n, certs()))
                    .collect(),
                Some(certs()),
            )
        }
        #[cfg(not(feature = "tls"))]
        _ => {
            return Err(lockkit_core::Error::config(
                "TLS needs lockkit-redis's Cargo feature \"tls\" (on by default)",
            ));
        }
    };
    let tls_files = |e| {
        lockkit_core::Error::config_with("cannot use the TLS files (tls_ca, tls_cert, tls_key)", e)
    };
    let seeds = seeds.map_err(tls_files)?;
    let client = cluster_builder(nodes.clone(), ct, rt, &tls)
        .build()
        .map_err(connect_error)?;
    let connected = tokio::time::timeout(ct, async {
        let mut c = client.get_async_connection().await?;
        redis::cmd("PING").query_async::<()>(&mut c).await?;
        Ok::<_, redis::RedisError>(c)
    });
    let conn = match connected.await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) if e.to_string().contains("cluster support disabled") => {
            return Err(lockkit_core::Error::config(
                "the server is not a Redis Cluster node (cluster support disabled): connect \
                 with redis://host:port, or redis+sentinel:// for a Sentinel-managed server",
            ));
        }
        Ok(Err(e)) => {
            if let Some(tls) = tls_cause(&seeds, ct).await {
                return Err(tls);
            }
            let auth = tokio::time::timeout(ct, refused_credentials(&seeds)).await;
            return Err(auth.ok().flatten().unwrap_or_else(|| connect_error(e)));
        }
        Err(_) => return Err(timed_out("connecting to the redis cluster", ct)),
    };
    let manager = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(ct))
        .set_response_timeout(Some(rt))
        .set_number_of_retries(2)
        .set_min_delay(Duration::from_millis(50))
        .set_max_delay(Duration::from_secs(1));
    Conn::cluster(conn, seeds, manager, nodes, (ct, rt), tls).map_err(connect_error)
}

/// The cluster client reports credentials refused by every seed as an I/O error ("Failed to
/// create initial connections") carrying the cause only as text. Asks the seeds directly, one
/// after the other: the first refusal of the credentials is returned ([`Error::Auth`]), so that a
/// wrong password is not a retryable `Unavailable`.
async fn refused_credentials(seeds: &[redis::Client]) -> Option<lockkit_core::Error> {
    for seed in seeds {
        if let Err(e) = seed.get_multiplexed_async_connection().await
            && let e @ lockkit_core::Error::Auth { .. } = connect_error(e)
        {
            return Some(e);
        }
    }
    None
}

/// The typed TLS failure (a certificate refused either way is [`Error::Auth`]) behind a failed
/// cluster connect, which the cluster client reports as text only ("Failed to create initial
/// connections - Io: invalid peer certificate…"): one plain connection to each seed with the
/// same TLS files, within the connect timeout; `None` without TLS or when no seed fails on TLS.
///
/// [`Error::Auth`]: lockkit_core::Error::Auth
///
/// # Cancel safety
/// Cancel safe: dropping the future closes what it opened.
async fn tls_cause(seeds: &[redis::Client], ct: Duration) -> Option<lockkit_core::Error> {
    #[cfg(feature = "tls")]
    for seed in seeds {
        if !matches!(
            seed.get_connection_info().addr(),
            redis::ConnectionAddr::TcpTls { .. }
        ) {
            return None;
        }
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(ct))
            .set_response_timeout(Some(ct));
        let probe = seed.get_multiplexed_async_connection_with_config(&config);
        if let Ok(Err(e)) = tokio::time::timeout(ct, probe).await
            && lockkit_core::backend::tls_failure(&e).is_some()
        {
            return Some(connect_error(e));
        }
    }
    #[cfg(not(feature = "tls"))]
    let _ = (seeds, ct);
    None
}
