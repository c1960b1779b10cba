//! # lockkit
//!
//! Distributed locks that stay correct when holders pause, crash or lose the network: every lock
//! is a **lease** with a TTL, every grant carries a strictly increasing [`FencingToken`], and the
//! holder is told on a deadline when its lease is lost. One API on every backend, chosen at run
//! time from a URL: [`connect`] gives locks, [`connect_election`] leader elections and
//! [`connect_semaphore`] counting semaphores (each a lease with a fencing token as well):
//!
//! | URL | backend | Cargo feature | elections, semaphores |
//! |---|---|---|---|
//! | `memory://` | in-process ([`MemoryLock`]) | always on | yes |
//! | `redis://host:port`, `rediss://…` (TLS) | Redis (efficiency lock) | `redis` | yes |
//! | `redis+sentinel://host:port[,host:port]/service` | Redis behind Sentinel (efficiency lock) | `redis` | yes |
//! | `redis+cluster://host:port[,host:port]`, `rediss+cluster://…` (TLS) | Redis Cluster, the hosts are seed nodes (efficiency lock) | `redis` | no |
//! | `redlock://host:port,host:port,…`, `redlocks://…` (TLS) | Redlock over N independent Redis masters (efficiency lock) | `redis` | no ([`Error::NotSupported`]) |
//! | `etcd://host:port[,host:port]`, `etcds://…` (TLS) | etcd v3 (correctness lock) | `etcd` | yes |
//! | `zk://host:port[,host:port][/chroot]` | ZooKeeper (correctness lock) | `zk` | yes |
//! | `postgres://user@host:port/db` (TLS with `sslmode`, `tls_ca`, …) | PostgreSQL advisory locks | `postgres` | yes |
//!
//! ```
//! use std::time::Duration;
//! use lockkit::{AcquireOptions, MemoryFence};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> lockkit::Result<()> {
//! let locks = lockkit::connect("memory://").await?;
//! let storage = MemoryFence::new();
//!
//! let lease = locks.acquire("nightly-report", AcquireOptions::new().ttl(Duration::from_secs(10))).await?;
//! tokio::select! {
//!     _ = lease.lost() => { /* stop at once: another holder may have the lock */ }
//!     written = async { storage.write("report.csv", lease.token(), "rows…") } => written?,
//! }
//! lease.release().await?;
//! # Ok(()) }
//! ```
//!
//! ## Why fencing tokens
//! A holder can pause (GC, SIGSTOP, a swapped-out VM) past its TTL and wake up believing it still
//! holds the lock after someone else got it. No timeout fixes that. The resource must check the
//! token: keep the highest token seen and reject lower ones ([`MemoryFence`], and each backend's
//! fence for data stored in it).
//!
//! A token belongs to one lock ([`FencingToken::lock`], e.g. `etcd/lockkit/report`): a resource
//! guarded by lock `X` must also refuse a token of lock `Y`, whatever its number. Every fence
//! binds a resource to the lock of its first fenced write and rejects other locks' tokens with
//! [`Error::ForeignToken`]. To travel to a remote service a token is one string,
//! `v1:<number>:<lock>` (`to_string()`, `parse()`, serde with feature `serde`).
//!
//! The wrong way and the right way, for a table you own (`fence_token BIGINT`,
//! `fence_lock TEXT` next to the data):
//! ```text
//! let lease = locks.acquire("job", opts).await?;
//! // WRONG: a holder that paused past its TTL overwrites the new holder's data.
//! UPDATE reports SET body = $1 WHERE id = $2
//! // RIGHT: the resource keeps the highest token of its lock and rejects older ones and other
//! // locks' (0 rows = stale or foreign). $3 = lease.token().get(), $4 = lease.token().lock()
//! UPDATE reports SET body = $1, fence_token = $3, fence_lock = $4
//!   WHERE id = $2 AND (fence_lock IS NULL OR fence_lock = $4) AND (fence_token IS NULL OR fence_token <= $3)
//! ```
//! Ready-made fences: [`MemoryFence`] in process (tokens from anywhere), and for data kept in a
//! backend, each made from a [`Lease`] (also one from [`connect`]'s `Arc<dyn Lock>`), whose lease
//! turns [`Lost`](LeaseState::Lost) at once when its own write is rejected as stale:
//! `lockkit::etcd::EtcdFence::from_lease` (a txn compare on the holder key),
//! `lockkit::zk::ZkFence::from_lease` (a multi-op check on the holder node),
//! `lockkit::redis::RedisFence::from_lease` (a script keeping the highest token per key) and
//! `lockkit::postgres::PgFence::update_as` (the conditional UPDATE above, in your transaction).
//!
//! ## What each backend guarantees
//! Each backend declares it in [`Lock::guarantees`]; the contract suite checks it.
//!
//! | backend | kind | tokens survive server restart | safe across failover | FIFO waiters | loss heard when the server ends a lease | lock-delay |
//! |---|---|---|---|---|---|---|
//! | memory | correctness, one process | no | yes (nothing to fail over to) | yes | (nothing ends it early) | yes |
//! | Redis (single node) | **efficiency** | yes (counter never below server `TIME`) | **no** | yes (a queue the release hands the lock to) | ≤ 200 ms with keyspace notifications, else at the next renewal | yes |
//! | Redis Sentinel | **efficiency** | yes (also on a promoted replica that lost the last grants) | **no**: an unreplicated grant can be given twice; leases must prove the new master holds them, else Lost (`min_replicas` narrows, not consensus) | yes | as single node, and at the master switch | yes |
//! | etcd | correctness (Raft) | yes | yes | yes | ≤ 500 ms (one watch stream per client) | yes |
//! | ZooKeeper | correctness (ZAB) | yes | yes | yes | ≤ 500 ms (a watch on the holder node) | yes |
//! | PostgreSQL | correctness, one server | yes | **no** (advisory locks are not replicated) | yes | ≤ 100 ms (the connection closing) | yes |
//!
//! Every grant has at least `AcquireOptions::min_validity` left (default half the TTL); the
//! README's table has the fine print.
//!
//! Elections and semaphores ([`Election::election_guarantees`], [`SlotGuarantees`]) keep the
//! lease promises above (without lock-delay) and add what observers see:
//!
//! | backend | FIFO candidates and permit waiters | observers ([`Election::observe`]) can miss |
//! |---|---|---|
//! | memory | yes | nothing, unless more than 1024 changes behind ([`LeaderEvent::Missed`]) |
//! | PostgreSQL | yes (the server's lock queue; permit waiters on a gate lock) | changes while the observer's connection is down (`LISTEN` is not durable): `Missed`, then the state |
//! | etcd | yes (create-revision order; permit waiters on a gate lock) | nothing while the watch lasts; after a reconnect, `Missed` only if etcd compacted past where it resumes |
//! | Redis (single node) | yes (a hand-off queue: a release hands the slot to the first waiter and tells only it) | pub/sub is at-most-once: after a resubscribe, or a token or value version that jumps, `Missed`, then the state |
//! | ZooKeeper | yes (sequence order; each waiter watches only the node ahead; the first permit waiter alone watches the slots) | watches are one-shot: a leader that came and went between a watch firing and the re-read, or changes during a session loss: `Missed`, then the state |
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations)]
#![deny(rustdoc::broken_intra_doc_links)]
#![cfg_attr(docsrs, feature(doc_cfg))]

use std::sync::Arc;

pub use lockkit_core::*;

#[cfg(feature = "etcd")]
#[cfg_attr(docsrs, doc(cfg(feature = "etcd")))]
#[doc(inline)]
pub use lockkit_etcd as etcd;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
#[doc(inline)]
pub use lockkit_postgres as postgres;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
#[doc(inline)]
pub use lockkit_redis as redis;
#[cfg(feature = "zk")]
#[cfg_attr(docsrs, doc(cfg(feature = "zk")))]
#[doc(inline)]
pub use lockkit_zk as zk;

/// Connects to the lock service named by `url` and returns it as `Arc<dyn Lock>`.
///
/// The scheme picks the backend (see the table in the crate docs). Every backend splits its URL
/// by the same grammar ([`backend::BackendUrl`]: user info before the query, each parameter
/// once, unknown parameters refused, durations such as `2s`) and shares the parameter names
/// `prefix`, `connect_timeout`, `tls_ca`, `tls_cert`, `tls_key`; each backend's config type
/// documents its own. `memory://` returns a fresh, empty in-process lock table each time and
/// takes no host or parameter.
///
/// # Errors
/// - [`Error::InvalidConfig`] for a malformed URL, an unknown scheme, or a scheme whose Cargo
///   feature is not enabled (the message names the feature). The URL is never echoed back, so a
///   password in it does not reach logs.
/// - [`Error::Unavailable`] if the server cannot be reached, [`Error::Auth`] if it refuses the
///   credentials.
pub async fn connect(url: &str) -> Result<Arc<dyn Lock>> {
    Ok(Connected::open(url).await?.lock())
}

/// Connects to the service named by `url` and returns its leader elections as
/// `Arc<dyn Election>` (see [`Election`] and
/// [docs/election-semaphore.md](https://example.invalid/lockkit/blob/main/docs/election-semaphore.md)).
///
/// The URL is the one [`connect`] takes; the same server and prefix give the same elections to
/// every process. `memory://` returns a fresh in-process backend each time (nothing is shared
/// with another call). Every backend has elections and semaphores except Redis Cluster and
/// Redlock (see `# Errors`; the crate docs' table says what each backend guarantees).
///
/// ```
/// use lockkit::{AcquireOptions, LeaderEvent};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lockkit::Result<()> {
/// let elections = lockkit::connect_election("memory://").await?;
/// let leader = elections.campaign("scheduler", b"10.0.0.7:8080", AcquireOptions::new()).await?;
/// let now = elections.leader("scheduler").await?.expect("we lead");
/// assert_eq!((now.term, now.value), (leader.term(), b"10.0.0.7:8080".to_vec()));
/// leader.resign().await?;
/// let mut observer = elections.observe("scheduler").await?;
/// assert_eq!(observer.next().await?, LeaderEvent::NoLeader);
/// # Ok(()) }
/// ```
///
/// # Errors
/// As [`connect`], and [`Error::NotSupported`] for `redlock://` and `redis+cluster://` (every
/// other backend has elections and semaphores).
pub async fn connect_election(url: &str) -> Result<Arc<dyn Election>> {
    Ok(Connected::open(url).await?.slots()?.election)
}

/// Connects to the service named by `url` and returns its counting semaphores as
/// `Arc<dyn Semaphore>` (see [`Semaphore`] and
/// [docs/election-semaphore.md](https://example.invalid/lockkit/blob/main/docs/election-semaphore.md)).
///
/// The URL is the one [`connect`] takes; `memory://` returns a fresh in-process backend each
/// time.
///
/// ```
/// use lockkit::{AcquireOptions, Error, Wait};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lockkit::Result<()> {
/// let semaphores = lockkit::connect_semaphore("memory://").await?;
/// let once = || AcquireOptions::new().wait(Wait::No);
/// let a = semaphores.acquire_permit("transcoders", 2, once()).await?;
/// let b = semaphores.acquire_permit("transcoders", 2, once()).await?;
/// assert_ne!(a.slot(), b.slot());
/// let third = semaphores.acquire_permit("transcoders", 2, once()).await;
/// assert!(matches!(third, Err(Error::Held { .. })));
/// # Ok(()) }
/// ```
///
/// # Errors
/// As [`connect_election`].
pub async fn connect_semaphore(url: &str) -> Result<Arc<dyn Semaphore>> {
    Ok(Connected::open(url).await?.slots()?.semaphore)
}

/// One backend, connected: what [`connect`], [`connect_election`] and [`connect_semaphore`]
/// share (the scheme dispatch, done once).
enum Connected {
    Memory(MemoryLock),
    #[cfg(feature = "redis")]
    Redis(lockkit_redis::RedisLock),
    /// `redis+cluster://`: the same client, without elections and semaphores.
    #[cfg(feature = "redis")]
    RedisCluster(lockkit_redis::RedisLock),
    #[cfg(feature = "redis")]
    Redlock(lockkit_redis::RedlockLock),
    #[cfg(feature = "etcd")]
    Etcd(lockkit_etcd::EtcdLock),
    #[cfg(feature = "zk")]
    Zk(lockkit_zk::ZkLock),
    #[cfg(feature = "postgres")]
    Postgres(lockkit_postgres::PgLock),
}

/// Every scheme [`connect`] takes (with the backend's feature), for its error message.
const SCHEMES: &[&str] = &[
    "memory",
    "redis",
    "rediss",
    "redis+sentinel",
    "rediss+sentinel",
    "redis+cluster",
    "rediss+cluster",
    "redlock",
    "redlocks",
    "etcd",
    "etcds",
    "zk",
    "postgres",
    "postgresql",
];

/// A backend's elections and semaphores: the same object behind both.
struct Slots {
    election: Arc<dyn Election>,
    semaphore: Arc<dyn Semaphore>,
}

impl Slots {
    fn of<B: backend::SlotBackend + 'static>(backend: B) -> Self {
        let b = Arc::new(backend);
        Self {
            election: b.clone(),
            semaphore: b,
        }
    }
}

impl Connected {
    async fn open(url: &str) -> Result<Self> {
        let Some((scheme, _)) = url.split_once("://") else {
            return Err(Error::config(
                "malformed lock service URL: expected scheme://…, e.g. redis://127.0.0.1:6379",
            ));
        };
        // Schemes are case-insensitive (RFC 3986 §3.1); each backend's parser lowercases them too.
        let scheme = scheme.to_ascii_lowercase();
        match scheme.as_str() {
            "memory" => {
                memory_url(url)?;
                Ok(Self::Memory(MemoryLock::new()))
            }
            // rediss+sentinel: lockkit-redis's typed NotSupported (no TLS in Sentinel mode yet).
            "redis" | "rediss" | "redis+sentinel" | "rediss+sentinel" => {
                #[cfg(feature = "redis")]
                return Ok(Self::Redis(lockkit_redis::RedisLock::connect(url).await?));
                #[cfg(not(feature = "redis"))]
                return Err(feature_off(&scheme, "redis"));
            }
            "redis+cluster" | "rediss+cluster" => {
                #[cfg(feature = "redis")]
                return Ok(Self::RedisCluster(
                    lockkit_redis::RedisLock::connect(url).await?,
                ));
                #[cfg(not(feature = "redis"))]
                return Err(feature_off(&scheme, "redis"));
            }
            "redlock" | "redlocks" => {
                #[cfg(feature = "redis")]
                return Ok(Self::Redlock(
                    lockkit_redis::RedlockLock::connect(url).await?,
                ));
                #[cfg(not(feature = "redis"))]
                return Err(feature_off(&scheme, "redis"));
            }
            "etcd" | "etcds" => {
                #[cfg(feature = "etcd")]
                return Ok(Self::Etcd(lockkit_etcd::EtcdLock::connect(url).await?));
                #[cfg(not(feature = "etcd"))]
                return Err(feature_off(&scheme, "etcd"));
            }
            "zk" => {
                #[cfg(feature = "zk")]
                return Ok(Self::Zk(lockkit_zk::ZkLock::connect(url).await?));
                #[cfg(not(feature = "zk"))]
                return Err(feature_off(&scheme, "zk"));
            }
            "postgres" | "postgresql" => {
                #[cfg(feature = "postgres")]
                return Ok(Self::Postgres(
                    lockkit_postgres::PgLock::connect(url).await?,
                ));
                #[cfg(not(feature = "postgres"))]
                return Err(feature_off(&scheme, "postgres"));
            }
            other => {
                let plausible = !other.is_empty()
                    && other.len() <= 16
                    && other
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"+-.".contains(&b));
                let named = if plausible {
                    format!(" {other:?}")
                } else {
                    String::new()
                };
                Err(Error::config(format!(
                    "unknown lock service scheme{named}: expected {}",
                    SCHEMES.join(", ")
                )))
            }
        }
    }

    fn lock(self) -> Arc<dyn Lock> {
        match self {
            Self::Memory(b) => Arc::new(b),
            #[cfg(feature = "redis")]
            Self::Redis(b) | Self::RedisCluster(b) => Arc::new(b),
            #[cfg(feature = "redis")]
            Self::Redlock(b) => Arc::new(b),
            #[cfg(feature = "etcd")]
            Self::Etcd(b) => Arc::new(b),
            #[cfg(feature = "zk")]
            Self::Zk(b) => Arc::new(b),
            #[cfg(feature = "postgres")]
            Self::Postgres(b) => Arc::new(b),
        }
    }

    /// The backend's elections and semaphores (every backend but Redlock implements
    /// `SlotBackend`; Redis refuses them in Cluster mode, so say so here, before any campaign,
    /// and `lockkit guarantees` does not list them).
    fn slots(self) -> Result<Slots> {
        Ok(match self {
            Self::Memory(b) => Slots::of(b),
            #[cfg(feature = "redis")]
            Self::Redis(b) => Slots::of(b),
            #[cfg(feature = "redis")]
            Self::RedisCluster(_) => {
                return Err(Error::NotSupported {
                    operation: "an election or semaphore in Redis Cluster mode",
                    backend: "redis",
                });
            }
            #[cfg(feature = "redis")]
            Self::Redlock(_) => {
                return Err(Error::NotSupported {
                    operation: "an election or semaphore",
                    backend: "redlock",
                });
            }
            #[cfg(feature = "etcd")]
            Self::Etcd(b) => Slots::of(b),
            #[cfg(feature = "zk")]
            Self::Zk(b) => Slots::of(b),
            #[cfg(feature = "postgres")]
            Self::Postgres(b) => Slots::of(b),
        })
    }
}

/// `memory://` takes nothing after the scheme but an optional `/`: no host, user, path or
/// parameter (a typo such as `memory://?prefx=a` must not be ignored).
fn memory_url(url: &str) -> Result<()> {
    let u = backend::BackendUrl::parse(url, &["memory"])?;
    if !u.hosts().is_empty()
        || u.username().is_some()
        || u.password().is_some()
        || !matches!(u.path(), "" | "/")
        || u.fragment().is_some()
    {
        return Err(Error::config(
            "memory:// takes no host, user, path or fragment: write memory://",
        ));
    }
    u.finish("memory", &["none"])
}

#[allow(dead_code)] // unused when every backend feature is on
fn feature_off(scheme: &str, feature: &str) -> Error {
    Error::config(format!(
        "the {scheme}:// backend is not compiled in: enable lockkit's Cargo feature \"{feature}\""
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bad_urls_are_typed_errors() {
        for url in ["", "no-scheme", "ftp://x", "://"] {
            match connect(url).await {
                Err(Error::InvalidConfig { .. }) => {}
                other => panic!("{url:?}: {other:?}"),
            }
        }
        assert!(connect("memory://").await.is_ok());
        assert!(connect("MEMORY://").await.is_ok());
        assert!(connect("memory:///").await.is_ok());
        for bad in [
            "memory://x/?prefx=typo",
            "memory://?prefix=a",
            "memory://host",
            "memory://u:p@",
            "memory:///path",
            "memory://#f",
        ] {
            match connect(bad).await {
                Err(Error::InvalidConfig { .. }) => {}
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        // Every scheme the message lists is one `connect` takes (an error of that backend, or
        // of its feature being off, never "unknown scheme"), and the message lists them all.
        let unknown = connect("foo://x").await.err().unwrap().to_string();
        for scheme in SCHEMES {
            assert!(unknown.contains(scheme), "{unknown}");
            let e = connect(&format!("{scheme}://h:1/?no_such_parameter=1"))
                .await
                .err();
            assert!(
                !e.as_ref()
                    .is_some_and(|e| e.to_string().contains("unknown lock service scheme")),
                "{scheme}: {e:?}"
            );
        }
        let huge = format!("{}://x", "s".repeat(40_000));
        let e = connect(&huge).await.err().unwrap();
        assert!(e.to_string().len() < 300, "{e}");
    }

    /// TLS to Redis Sentinel is a typed `NotSupported`, not an unknown scheme.
    #[cfg(feature = "redis")]
    #[tokio::test]
    async fn tls_sentinel_urls_are_not_supported() {
        match connect("rediss+sentinel://127.0.0.1:1/svc").await {
            Err(Error::NotSupported { backend, .. }) => assert_eq!(backend, "redis"),
            other => panic!("{other:?}"),
        }
    }

    /// The README's election and semaphore code is the marked code of examples/election.rs
    /// (which CI builds and scripts/test.sh runs), so the README's code compiles.
    #[test]
    fn readme_code_is_the_election_example() {
        let readme = include_str!("../README.md");
        let example = include_str!("../examples/election.rs");
        let parts: Vec<_> = example.split("    // README: begin\n").skip(1).collect();
        assert_eq!(parts.len(), 2);
        for part in parts {
            let (code, _) = part
                .split_once("    // README: end\n")
                .expect("an end line");
            let code: String = code
                .lines()
                .map(|l| format!("{}\n", l.strip_prefix("    ").unwrap_or(l)))
                .collect();
            assert!(
                readme.contains(&format!("```rust\n{code}```\n")),
                "README.md lacks this block of examples/election.rs:\n{code}"
            );
        }
    }

    /// Elections and semaphores take the same URLs, through the same dispatch.
    #[tokio::test]
    async fn election_and_semaphore_urls() {
        for url in [
            "",
            "no-scheme",
            "ftp://x",
            "memory://host",
            "memory://?prefix=a",
        ] {
            assert!(
                matches!(
                    connect_election(url).await,
                    Err(Error::InvalidConfig { .. })
                ),
                "{url:?}"
            );
            assert!(
                matches!(
                    connect_semaphore(url).await,
                    Err(Error::InvalidConfig { .. })
                ),
                "{url:?}"
            );
        }
        let e = connect_election("MEMORY://").await.unwrap();
        assert_eq!(e.election_guarantees().lock.backend, "memory");
        let s = connect_semaphore("memory://").await.unwrap();
        assert!(s.semaphore_guarantees().observe);
    }
}
