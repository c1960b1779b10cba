//! # lockkit-etcd
//!
//! The etcd v3 backend of [lockkit](https://docs.rs/lockkit): a **correctness** lock built on
//! etcd's Raft-replicated key space, leases and watches, with the lock protocol of etcd's own
//! `concurrency` package.
//!
//! ```no_run
//! use std::time::Duration;
//! use lockkit_core::{AcquireOptions, Lock, Wait};
//! use lockkit_etcd::{EtcdFence, EtcdLock};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> lockkit_core::Result<()> {
//! // Or lockkit::connect("etcd://127.0.0.1:2379,127.0.0.1:22379?prefix=jobs") for Arc<dyn Lock>.
//! let locks = EtcdLock::connect("etcd://127.0.0.1:2379?prefix=jobs").await?;
//! let opts = AcquireOptions::new()
//!     .ttl(Duration::from_secs(10))
//!     .wait(Wait::Timeout(Duration::from_secs(30)));
//! let lease = locks.acquire("nightly-report", opts).await?;
//! tokio::select! {
//!     _ = lease.lost() => { /* stop at once: another holder may have the lock */ }
//!     written = async {
//!         // Applied only while this lease still holds the lock (one etcd transaction).
//!         EtcdFence::from_lease(&lease)?.put("reports/nightly", "rows…").await
//!     } => written?,
//! }
//! lease.release().await?;
//! # Ok(()) }
//! ```
//!
//! ## URL
//! `etcd://[user[:password]@]host[:port][,host[:port]…][?prefix=…]` — see [`EtcdConfig`]. Each
//! `host:port` is an `http://` endpoint; `etcds://…?tls_ca=…&tls_cert=…&tls_key=…` makes them
//! `https://` (mutual TLS with a client certificate; a refused server certificate is
//! [`Error::Auth`](lockkit_core::Error::Auth)). A wrong password
//! fails [`EtcdLock::connect`] with [`Error::Auth`](lockkit_core::Error::Auth); an unreachable
//! cluster with [`Error::Unavailable`](lockkit_core::Error::Unavailable) after the connect
//! timeout (3 s by default).
//!
//! ## Protocol
//! - Each acquire puts its own key `{prefix}/{name}/{lease id hex}-{slot}`, attached to an
//!   etcd lease. The key with the lowest create revision is the holder; the others are waiters
//!   in FIFO order. An acquire first sends one transaction that creates the key only if no key
//!   exists under `{prefix}/{name}/` and no [lock-delay](#lock-delay) marker exists (the
//!   uncontended case: granted in one round trip); a
//!   waiting acquire that finds the name taken queues with a second transaction, which creates
//!   its key and reads the holder (the lowest create revision). `slot` is the lowest number not
//!   in use by another acquire of the same client, lease and name, so back-to-back acquires
//!   reuse one key (etcd's key index keeps every key ever created until compaction, and reads
//!   over a lock's prefix would otherwise slow down with every acquire). A slot on which a
//!   request went unanswered (it may still be applied late) is never reused; a key such a
//!   request may create is deleted by the keepalive task and its lease takes no new acquires.
//! - A waiter reads, in one linearizable transaction, that its own key still exists (so its
//!   lease is alive: etcd deletes a lease's keys when the lease ends) and the two keys just
//!   ahead of it (largest create revisions below its own). It watches the nearest for its
//!   deletion, and the next one too, so that it reads again as soon as it is next in line; one
//!   release wakes the next waiter and the one behind it. It also re-reads every TTL/2 (0.5 s
//!   to 5 s), in case its watch is stuck on a frozen member.
//! - The hand-off needs no request: when the key ahead is the only one, its value says its
//!   grant puts no [lock-delay](#lock-delay) marker (`no-delay`; a grant with a delay leaves
//!   the value empty) and no marker exists, the waiter watches the key range from that key to
//!   its own with one watcher, and that key's delete makes it the holder at that revision
//!   (create revisions only grow, so no key can get ahead of it later; one watcher reports
//!   every event of a revision in one answer and the answers in revision order, so a delete of
//!   its own key at or before then is seen first). Otherwise a wake re-reads. A waiter whose
//!   key is gone never gets the lock on it: it queues again with a fresh lease (up to 5 leases
//!   per acquire, then [`Error::Unavailable`](lockkit_core::Error::Unavailable)).
//! - Release is one delete of the grant's own key, which exists only as this grant's (its name
//!   carries the lease ID and a busy slot; etcd deletes it when the lease ends), so it is
//!   compare-and-delete by construction, as in etcd's own `concurrency.Mutex.Unlock`.
//! - Dropping an acquire at any point deletes its key in the background; a timed-out acquire
//!   deletes it before returning.
//! - A granted lock's own key is watched for its delete (an admin's `etcdctl del` or
//!   `lease revoke`): the holder turns Lost within milliseconds
//!   ([`Guarantees::loss_notice`](lockkit_core::Guarantees::loss_notice): 500 ms while the
//!   member serving the watch answers; else the next keepalive, within TTL/3, or the deadline
//!   tells it). All the keys a client holds are watched on **one** watch stream (one watcher per
//!   key, filtered to deletes, with watch IDs of our own), so many held locks cost one stream.
//!
//! See <https://etcd.io/docs/v3.4/dev-guide/api_concurrency_reference_v3/> and
//! <https://etcd.io/docs/v3.4/learning/api/>.
//!
//! ## Lock-delay
//! [`AcquireOptions::lock_delay`](lockkit_core::AcquireOptions::lock_delay) `d` is honoured
//! ([`Guarantees::lock_delay`](lockkit_core::Guarantees::lock_delay)). A grant with a delay also
//! puts a marker `{prefix}/./delay/{name}` (`.` is never a lock name), in the same transaction as
//! its key when the lock is free, or in one more transaction once its key is first in line. The
//! marker is attached to a **companion lease** of the lock's lease, with a TTL of the lock
//! lease's granted TTL + `d` + 1.5 s rounded up to whole seconds (the 1.5 s cover the leader's
//! 0.5 s expiry sweep and a companion keepalive answered up to 1 s before the lock lease's). One
//! companion per session lease and delay, renewed at every keepalive tick just **before** the
//! session lease (and by [`Lease::renew`](lockkit_core::Lease::renew) before the lock's own
//! lease), so the marker always outlives the key by at least `d`. Every acquire, with a delay of
//! its own or not, treats a marker that is not its own as "held": the free-name transaction
//! compares it absent, a try-once acquire gets [`Error::Held`](lockkit_core::Error::Held), and a
//! waiter that is first in line watches the marker for its delete (no polling).
//! - **Release** (also on drop, and the cleanup of a failed or cancelled acquire) deletes the key
//!   and its own marker in one transaction: the lock is free at once.
//! - **Lapse** (holder died, its keepalives stopped, a `keepalive(false)` lease not renewed): etcd
//!   frees the key at the lease's expiry and the marker at the companion's, at least `d` later.
//! - **Admin revoke or delete** (`etcdctl lease revoke`, `etcdctl del` of the key): the holder
//!   hears of it from the watch on its key (Lost within milliseconds) and moves its marker to a
//!   lease of its own with TTL `d` (rounded up), granted then: the delay counts from when the
//!   holder's client heard of it (a few ms after etcd freed the key). If that client is gone
//!   too, the companion lease runs out, at most TTL + `d` + 1.5 s (rounded up) after its last
//!   renewal. A revoke of the whole session lease also ends the companion's renewal at the next
//!   keepalive tick.
//! - A leaked lock ([`Lease::leak`](lockkit_core::Lease::leak)) on a session lease lapses at its
//!   deadline: its key is deleted then and its marker moved as after an admin delete.
//! - A companion lease revoked by hand takes its markers with it; those locks keep their grant
//!   but lose their delay (logged as a warning).
//! - During a delay [`Lock::holder`](lockkit_core::Lock::holder) reports no holder (there is no
//!   key), though no acquire gets the lock.
//!
//! ## Elections and semaphores
//! [`EtcdLock`] also implements [`SlotBackend`](lockkit_core::backend::SlotBackend), so it is an
//! [`Election`](lockkit_core::Election) and a [`Semaphore`](lockkit_core::Semaphore). Every
//! leadership and permit is a grant of the lock's own path (above) in a key space of its own:
//! candidates of election `x` are contenders in `{prefix}/./elect/x/` whose keys carry their
//! values (the leader is the lowest create revision, which is the term); permit `k` of
//! semaphore `x` is the one key under `{prefix}/./sem/x/m/s/{k}/`, taken by a transaction that
//! also compares N (`{prefix}/./sem/x/n`), with waiters queued FIFO on a gate lock. Observers
//! watch the keys from the revision of their first read and see every change, except after a
//! compaction past where a reconnecting watch resumes (`Missed`). See
//! [docs/election-semaphore.md](https://example.invalid/lockkit/blob/main/docs/election-semaphore.md).
//!
//! ## Fencing tokens
//! The token is the holder key's **create revision**: etcd's revision is one cluster-wide
//! counter, bumped by every write, replicated and persisted through the Raft log, and never
//! reused, so it survives client restarts, member restarts and leader failover. A later holder's
//! key was created after the earlier holder's key existed, so its revision is larger. The one
//! exception: restoring a cluster from an old snapshot (`etcdctl snapshot restore`) rewinds the
//! revision, and tokens handed out after the snapshot may repeat.
//!
//! For data kept in etcd itself, [`EtcdFence::from_lease`] makes each write a transaction that
//! checks the holder key's create revision, so a stale holder's write is rejected atomically
//! (and the lease is lost at once), and that the key's guard record names the lease's lock, so a
//! holder of another lock cannot write it.
//!
//! ## Leases and keepalive
//! - Locks acquired with keepalive on (the default) share **one etcd lease per client and TTL**
//!   (the session lease), kept alive by one task at about TTL/3 that confirms every lock on it
//!   with the send time of each acknowledged keepalive. Each lock's deadline is
//!   `send time of the last acknowledged keepalive + TTL − drift margin`; the lock turns
//!   suspect when keepalives go unanswered and lost at that deadline, even if the TCP connection
//!   looks fine. A keepalive answered with `TTL <= 0` marks every lock on the lease lost at once.
//! - A keepalive counts only if a linearizable read sent after its answer reports the same raft
//!   term as the member that answered it. etcd 3.4 renews a lease in the lessor of whichever
//!   member believes it is the leader, without checking with a quorum first, so a paused former
//!   leader can acknowledge keepalives on resuming that the real leader never saw. The read
//!   goes through the current leader (ReadIndex,
//!   <https://etcd.io/docs/v3.4/learning/api_guarantees/>), so a term mismatch means "not
//!   confirmed": the locks turn suspect and the keepalive is retried. Each keepalive is
//!   therefore three round trips every TTL/3.
//! - Keepalive stops when the last lock on a session lease is released: at its next tick (at
//!   most TTL/3 after its last renewal) an idle lease is revoked instead of renewed, and
//!   back-to-back acquires until then reuse it ([`EtcdConfig::lease_linger`] keeps it alive
//!   longer, or revokes it at once). When the
//!   [`EtcdLock`] (all clones) is dropped, idle session leases are revoked at once; leases of
//!   locks still held keep being renewed until those are released or dropped.
//! - A lock dropped without release and without release-on-drop ([`Lease::leak`](lockkit_core::Lease::leak))
//!   stays held until its deadline, then its key is deleted (other locks may keep the session
//!   lease alive much longer). A lock whose release failed keeps retrying the delete in the
//!   background, and its session lease takes no new locks.
//! - `keepalive(false)` acquires get a lease of their own, renewed only by
//!   [`Lease::renew`](lockkit_core::Lease::renew) (a `LeaseKeepAlive` exchange and a
//!   linearizable read of the lock's key, with the term check above).
//! - etcd lease TTLs are whole seconds: a TTL is rounded up, and the server raises it to its
//!   minimum (1.5 × election timeout, rounded up; 2 s with default settings). Client-side
//!   deadlines use the TTL you asked for, so they are conservative; the server may free the lock
//!   up to [`Guarantees::expiry_slack`](lockkit_core::Guarantees::expiry_slack) later
//!   (`max(1 s, minimum TTL) + 0.5 s` for the leader's expiry sweep). After a leader change
//!   etcd extends every lease by up to its TTL (no lease checkpointing in 3.4 by default).
//! - Known etcd bug, not preventable by a client: in etcd 3.4 releases without the fix for
//!   [etcd-io/etcd#15247](https://github.com/etcd-io/etcd/issues/15247) (fixed by
//!   [#16822](https://github.com/etcd-io/etcd/pull/16822), backported to 3.4 in
//!   [#17465](https://github.com/etcd-io/etcd/pull/17465); Debian's 3.4.23 lacks it), a leader
//!   that was stalled (paused, starved of CPU or disk) may, on resuming, revoke leases it
//!   considers expired by its own stale clock, and the new leader commits the revoke although
//!   the client kept the lease alive through it. The lock is then freed before the holder's
//!   deadline (in tests: up to a whole TTL early); the holder is told at its next keepalive
//!   (within TTL/3 plus a round trip). Fenced writes ([`EtcdFence`], or a resource checking the
//!   token) stay safe; the cluster test `frozen_leader_keeps_fenced_writes_safe` checks that.
//!
//! ## Performance
//! An uncontended acquire + release is two round trips and two Raft writes, like the same steps
//! done by hand: a transaction that creates the key only if the name is free, and a delete of
//! that key. `cargo bench -p lockbench -- etcd` (single member on tmpfs,
//! loopback, 2 shared cores, 2000 interleaved rounds, medians of three runs):
//!
//! | sequence | median | vs. (a) |
//! |---|---|---|
//! | (a) by hand: put-if-absent txn with a lease + delete | 0.84–0.88 ms | 1.00× |
//! | (b) etcd's server-side `Lock` + `Unlock` (v3lock) | 0.97–1.00 ms | 1.14–1.16× |
//! | (c) lockkit acquire + release, waiting acquire | 0.93–0.98 ms | 1.10–1.12× |
//! | (c) lockkit acquire + release, try-acquire | 0.90–0.94 ms | 1.07–1.08× |
//! | (d) lockkit's two requests by hand | 0.85–0.90 ms | 1.01–1.02× |
//!
//! (b) runs a heavier transaction inside the server (it also reads the holder) and forwards it
//! through an in-process client; lockkit reads the holder only when the name is taken. What
//! lockkit adds on its client side, (c) − (d), is about 40–50 µs (session-lease bookkeeping,
//! timeouts, cancel-safety guards).
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
mod slots;

pub use config::{DEFAULT_PORT, DEFAULT_PREFIX, EtcdConfig, validate_prefix};
pub use fence::EtcdFence;
pub use lease::EtcdLease;
pub use lock::EtcdLock;
#[cfg(feature = "test-hooks")]
pub use lock::WaitStats;

/// The etcd client crate this backend is built on, re-exported so users name the same version
/// (for reads through [`EtcdLock::client`]).
#[doc(no_inline)]
pub use etcd_client;
