//! # lockkit-zk
//!
//! The ZooKeeper backend of [lockkit](https://docs.rs/lockkit): leases on
//! [ephemeral sequential nodes](https://zookeeper.apache.org/doc/r3.8.0/zookeeperProgrammers.html#Sequence+Nodes+--+Unique+Naming),
//! a correctness lock (consensus-backed, durable fencing tokens, FIFO waiters).
//!
//! ```no_run
//! use std::time::Duration;
//! use lockkit_core::{AcquireOptions, Lock, Wait};
//! use lockkit_zk::{ZkFence, ZkLock};
//!
//! # #[tokio::main] async fn main() -> lockkit_core::Result<()> {
//! // zk://[user:password@]host:port[,host:port…][/chroot][?prefix=…&sasl=digest-md5&connect_timeout=…&tls_ca=…]
//! let locks = ZkLock::connect("zk://127.0.0.1:2181,127.0.0.1:2182/apps/billing?prefix=locks").await?;
//! let opts = AcquireOptions::new()
//!     .ttl(Duration::from_secs(10)) // = the ZooKeeper session timeout of this lease
//!     .wait(Wait::Timeout(Duration::from_secs(30)));
//! let lease = locks.acquire("nightly-invoices", opts).await?;
//! let fence = ZkFence::from_lease(&lease)?;
//! tokio::select! {
//!     _ = lease.lost() => { /* session expired or deadline passed: stop, someone else may hold it */ }
//!     res = fence.write("/invoice-run", b"started") => res?,
//! }
//! lease.release().await?;
//! # Ok(()) }
//! ```
//!
//! ## How it works
//! - Lock `name` is the [container node](https://zookeeper.apache.org/doc/r3.8.0/zookeeperProgrammers.html#Container+Nodes)
//!   `/{prefix}/{name}` (below the chroot; `%` and characters ZooKeeper forbids in node names are
//!   percent-encoded). Each acquire creates `{unique id}-lock-{sequence}` in it, ephemeral and
//!   sequential; the lowest sequence holds the lock; every waiter watches only the node just ahead
//!   of it, so a release wakes one waiter ([recipe](https://zookeeper.apache.org/doc/r3.8.0/recipes.html#sc_recipes_Locks)).
//!   Container nodes are removed by the server once empty (ZooKeeper ≥ 3.5), so names used once
//!   do not pile up.
//! - The unique id in the node name lets an acquire whose create reply was lost (connection
//!   dropped after the request left) find its node after reconnecting, and use or delete it. A
//!   failed, timed-out or dropped acquire deletes its node; a node that cannot be deleted goes
//!   with its session. Nothing ever deletes a node another acquire created.
//! - **Lease = session.** A lease's TTL is its session's timeout (one session per TTL per
//!   [`ZkLock`], at most [`MAX_SESSIONS`] at once, closed one to two TTLs after its last lease);
//!   TTLs the server will not negotiate are refused, never silently changed.
//!   Session states drive lease states: `Disconnected` → Suspect; `Expired`/`Closed` → Lost. The
//!   client also computes the deadline itself: every TTL/3 it sends a
//!   [`sync`](https://zookeeper.apache.org/doc/r3.8.0/zookeeperProgrammers.html#ch_zkGuarantees),
//!   each answer confirms the session's leases with the request's **send** time, and without
//!   answers a lease is Lost at send time + TTL − margin, before the server can expire the
//!   session, without waiting for the server to say so. A new session never revives a lease of
//!   an old one. The heartbeat is a `sync`, not a read, because only the leader expires
//!   sessions: a follower cut off from the leader goes on answering reads for `syncLimit`
//!   ticks, long after the leader expired the session and granted the lock to someone else,
//!   whereas a `sync` is answered only through the leader, after it checked the session. A
//!   grant likewise starts the lease at the send time of a leader-ordered request (the create,
//!   the session's last heartbeat, or a `sync`).
//! - **Fencing token = the holder node's `czxid`**: the zxid of its creation. Zxids grow with
//!   every transaction of the ensemble (epoch in the high 32 bits, so also across leader
//!   changes and restarts), and unlike sequence numbers they keep growing when the lock's
//!   container node is deleted and re-created. The czxid comes from a plain create's reply:
//!   ZooKeeper 3.8.0 returns no stat for a create inside a multi-op
//!   ([ZOOKEEPER-4026](https://issues.apache.org/jira/browse/ZOOKEEPER-4026)).
//! - **Release** is a version-checked delete of the lease's own node. If it cannot be
//!   acknowledged, it keeps going in the background and the lease stays registered with its
//!   session until the node is gone (deleted, or with its expired session).
//! - **Lock-delay** ([`AcquireOptions::lock_delay`](lockkit_core::AcquireOptions::lock_delay)):
//!   ZooKeeper deletes an expired session's nodes and tells no one when. So a grant with a
//!   delay creates a persistent marker node `lock-delay` in the lock's container node (open to
//!   everyone like the container, naming the holder's node and the delay), and its release
//!   deletes it in one multi-op with the holder's node. The next in line that finds a marker
//!   whose holder node is gone stamps it (`setData`: its `mtime` on the server's clock is when
//!   the lock was seen free), waits out the rest of the delay in one sleep, deletes it and is
//!   granted; a
//!   try-once acquire gets [`Held`](lockkit_core::Error::Held) (and deletes its node) until the
//!   server's clock shows the delay passed since the stamp (its own node's `ctime` − the stamp's
//!   `mtime`). A lapsed holder's node deleted by this client at its deadline (a leaked lease)
//!   leaves its marker too.
//! - **Elections and semaphores** ([`Election`](lockkit_core::Election),
//!   [`Semaphore`](lockkit_core::Semaphore), from `SlotBackend`): an election is the lock
//!   recipe in `/{prefix}/%elect/{name}` with the candidate's value as its node's data (the
//!   term is the leader node's `czxid`, proclaim a `setData`); a semaphore queues its acquirers
//!   FIFO in `/{prefix}/%sem/{name}` (N is that node's data) and the first in line claims an
//!   ephemeral `slot-{k}` (its `czxid` is the permit's token). Observers use one-shot watches
//!   re-armed after each event and report `Missed` where a leader or a value may have come and
//!   gone unseen, and after a session loss. See
//!   [docs/election-semaphore.md](https://example.invalid/lockkit/blob/main/docs/election-semaphore.md).
//! - [`ZkFence::from_lease`] writes your own ZooKeeper data only while a lease holds its lock: a
//!   multi-op checking the lease's node and the data node's guard record, which binds the node to
//!   the lock of its first fenced write (a holder of another lock gets
//!   [`ForeignToken`](lockkit_core::Error::ForeignToken)).
//!
//! ## Limits
//! - `keepalive(false)` is [`NotSupported`](lockkit_core::Error::NotSupported): session heartbeats
//!   cannot be paused per lease.
//! - A leaked lease is freed by this client at its deadline, not by the server (its session is
//!   shared and stays alive); see [`ZkLock`].
//! - Residual window of the heartbeat: the leader learns of a session's activity on a follower
//!   from the follower's pings (every `tickTime / 2`). If the follower is cut off within half a
//!   tick after a heartbeat reached it, the leader may time the session out from an earlier
//!   activity report (at most about TTL/3 earlier) while the client counts from that heartbeat.
//!   Connecting to the leader, or to a standalone server, has no such window.
//! - Authentication: with `user:password`, lock nodes, fenced data nodes and their guard records
//!   are creator-only;
//!   the shared prefix and lock container nodes are open to everyone, so clients with other or
//!   no credentials can queue on the same locks. ZooKeeper's `digest` scheme never refuses a
//!   password: a wrong one is another identity, and an ACL refusing it is
//!   [`Backend`](lockkit_core::Error::Backend) "no permission", not `Auth`. With
//!   `sasl=digest-md5` ([`ZkConfig::sasl_digest_md5`]) the same `user:password` is presented by
//!   SASL DIGEST-MD5 instead: the server checks it (JAAS `DigestLoginModule`), a wrong password
//!   is [`Auth`](lockkit_core::Error::Auth) at connect, and the ACL identity is `sasl:user`.
//! - Expiry granularity: the server expires sessions on tick boundaries, up to one `tickTime`
//!   (default 2 s, [`EXPIRY_SLACK`]) after the timeout.
//! - Lock-delay counts from when the next acquirer saw the lock free (later than the server
//!   freed it, never earlier). The one that stamps the marker sleeps the whole delay on its
//!   own monotonic clock; later ones (a try-once acquire, a waiter whose node is younger than
//!   the stamp) subtract what the server's wall clock (the leader's) shows passed between the
//!   stamp and their own node's creation: a leader change between the two to a server whose
//!   clock is behind, or a clock step, can shorten the delay they see by that much.
//! - Tokens survive restarts only if the server's transaction log is fsynced (`forceSync=yes`,
//!   the default): with `forceSync=no` a crash can lose the last zxids, which are then reused.
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations)]
#![deny(rustdoc::broken_intra_doc_links)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod config;
mod core;
mod error;
mod fence;
mod lease;
mod lock;
mod session;
mod slots;

pub use config::{
    CONTROL_SESSION_TTL, DEFAULT_CONNECT_TIMEOUT, DEFAULT_PREFIX, MAX_CONNECT_TIMEOUT, ZkConfig,
};
pub use fence::ZkFence;
pub use lease::ZkLease;
#[cfg(feature = "test-hooks")]
pub use lock::WaitStats;
pub use lock::{EXPIRY_SLACK, MAX_SESSIONS, ZkLock};

/// The ZooKeeper client crate this backend is built on, re-exported so that code working with
/// ZooKeeper next to lockkit (its own nodes, ACLs, the benchmark's hand-written floor) names the
/// same version.
#[doc(no_inline)]
pub use zookeeper_client;
