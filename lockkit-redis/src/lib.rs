//! # lockkit-redis
//!
//! The Redis backend of [lockkit](https://docs.rs/lockkit): leases with TTLs and strictly
//! increasing fencing tokens on **one** Redis server (no cluster, no Redlock). It is an
//! **efficiency lock**: it saves duplicate work, and a fenced resource keeps data safe, but a
//! failover can grant a held lock twice (see [Guarantees](#guarantees)).
//!
//! ```no_run
//! use std::time::Duration;
//! use lockkit_core::{AcquireOptions, Lock, MemoryFence, Wait};
//! use lockkit_redis::RedisLock;
//!
//! # #[tokio::main] async fn main() -> lockkit_core::Result<()> {
//! let locks = RedisLock::connect("redis://:secret@127.0.0.1:6379/0?prefix=billing").await?;
//! let storage = MemoryFence::new();
//!
//! let opts = AcquireOptions::new()
//!     .ttl(Duration::from_secs(10))
//!     .wait(Wait::Timeout(Duration::from_secs(5)));
//! let lease = locks.acquire("nightly-report", opts).await?;
//! tokio::select! {
//!     _ = lease.lost() => { /* stop at once: another holder may have the lock */ }
//!     written = async { storage.write("report.csv", lease.token(), "rows…") } => written?,
//! }
//! lease.release().await?;
//! # Ok(()) }
//! ```
//!
//! The wrong way and the right way to use the lease:
//! ```text
//! let lease = locks.acquire("job", opts).await?;
//! storage.put(data).await?;                                   // WRONG: a holder paused past its TTL overwrites the new holder
//! storage.put_if_token_at_least(lease.token(), data).await?;  // RIGHT: the stale write is rejected
//! ```
//!
//! ## How it works
//! - **Acquire** is one Lua script, run atomically by the server
//!   (<https://redis.io/docs/latest/develop/interact/programmability/eval-intro/>): if the lock key
//!   is free it is `SET … NX PX ttl` (<https://redis.io/docs/latest/commands/set/>) to this grant's
//!   random 128-bit owner value (hex), and the lock's fence counter becomes
//!   `max(counter + 1, server TIME in µs)` (<https://redis.io/docs/latest/commands/time/>); the new
//!   counter is the [`FencingToken`](lockkit_core::FencingToken). If the lock is held, the script
//!   returns the holder's remaining `PTTL` instead. The scripts run with `EVALSHA` through the
//!   redis crate's [`Script`](redis::Script), which reloads them after a server restart.
//! - **Renew** is compare-and-`PEXPIRE` and **release** is compare-and-`DEL` on the owner value
//!   (both scripts), so a lease that lapsed can neither extend nor delete another holder's lock:
//!   both return [`Error::NotHeld`](lockkit_core::Error::NotHeld), and a lapsed lock is never
//!   re-taken by a renewal.
//! - **Waiting** does not spin. The release script `PUBLISH`es on the lock's release channel
//!   (<https://redis.io/docs/latest/develop/interact/pubsub/>); a waiter subscribes (one shared
//!   pub/sub connection per [`RedisLock`]) *before* the attempt that finds the lock held, so no
//!   release is missed between its attempt and its sleep. Expiry publishes nothing and pub/sub
//!   delivery is at-most-once, so a waiter also wakes just after the holder's `PTTL` (plus up to
//!   [`EXPIRY_JITTER`]) and at least every [`MAX_WAIT_POLL`] (≈1 s, jittered). Waiters are not
//!   served in FIFO order.
//! - **Cancel safety**: if an acquire is dropped after its script was sent but before the reply
//!   arrived (or the reply was lost), a drop guard spawns a compare-and-delete for that
//!   attempt's owner value, so no orphaned lock waits out its TTL.
//! - **Leases** use lockkit-core's [`LeaseTracker`](lockkit_core::LeaseTracker) from the *send*
//!   time of the granting request, and its keepalive (renew at about TTL/3). TTLs are sent in
//!   whole milliseconds, rounded up.
//! - **Connections**: one auto-reconnecting [`ConnectionManager`](redis::aio::ConnectionManager)
//!   per [`RedisLock`] (clones share it). Connecting makes one attempt bounded by the connect
//!   timeout (default 5 s), so an unreachable server fails fast with
//!   [`Error::Unavailable`](lockkit_core::Error::Unavailable) and a wrong password with
//!   [`Error::Auth`](lockkit_core::Error::Auth). Commands time out after the response timeout
//!   (default 2 s).
//!
//! ## Keys
//! For the prefix `P` (default `lockkit`; see [`RedisConfig::prefix`]) and the lock name `N`:
//!
//! | key / channel | holds |
//! |---|---|
//! | `P:lock:N` | the holder's owner value, with the lease's TTL |
//! | `P:fence:N` | the fence counter (the last token), no expiry |
//! | channel `P:released:N` | a message on every release |
//!
//! Any valid name (1–256 bytes of UTF-8 without `/` or control characters, see
//! [`validate_name`](lockkit_core::validate_name)) maps safely into this space, and cannot
//! reach another key:
//! - Names are never spliced into Lua source or parsed by a command: they travel as
//!   length-prefixed RESP bulk strings in `KEYS`/`ARGV`, and no command that interprets
//!   patterns (`KEYS`, `SCAN MATCH`, `PSUBSCRIBE`) ever sees them. `*`, `?`, `[`, `:`, spaces
//!   and any Unicode are plain bytes.
//! - The prefix may not contain `:`, so in `P:kind:N` the first `:` ends the prefix and the
//!   second ends the kind (`lock` or `fence`); the rest is the name, verbatim. The map
//!   (prefix, kind, name) → key is therefore one-to-one: two names never share a key, a lock key
//!   is never a fence key, and two prefixes never share a key.
//! - Keys are at most 64 + 7 + 256 bytes.
//!
//! Pub/sub channels are shared by all databases of a server; a release in another database with
//! the same prefix and name only causes a spurious wake-up.
//!
//! ## Guarantees
//! [`RedisLock::guarantees`](lockkit_core::Lock::guarantees) declares:
//!
//! | promise | | why |
//! |---|---|---|
//! | kind | efficiency | see below |
//! | safe across failover | **no** | Redis replicates asynchronously: a failover to a replica that had not yet received the lock key grants the lock again while the old holder still holds it (<https://redis.io/docs/latest/operate/oss_and_stack/management/replication/>). Fencing tokens may then also repeat. |
//! | tokens survive restart | yes, with the caveat below | |
//! | FIFO waiters | no | waiters race after each release |
//! | manual renewal | yes | `keepalive(false)` leases renew with [`Lease::renew`](lockkit_core::Lease::renew) |
//! | expiry slack | [`EXPIRY_SLACK`] (50 ms) | a waiter wakes up to [`EXPIRY_JITTER`] after the holder's `PTTL`, then needs one round trip |
//!
//! **Tokens across restarts.** A server restarted without persistence (or with its data lost)
//! forgets the fence counter. Because every grant sets the counter to at least the server's
//! `TIME` in microseconds, the first grant after the restart still gets a token above every
//! earlier one, **provided that** (1) the server's wall clock never steps backwards (across the
//! restart too: NTP slews, it does not step, unless told to), and (2) the lock is granted fewer
//! than once per microsecond on average, so that the counter never runs ahead of the clock by
//! more than the time the restart takes. The same floor protects against the counter key being
//! evicted (`maxmemory` with an `allkeys-*` policy) or deleted. Tokens are exact below 2^53 (Lua
//! numbers are doubles), which `TIME` in µs reaches in the year 2255.
//!
//! A lease's TTL also stops mattering if the server restarts with its data lost: the lock is
//! free at once. The holder learns it at its next renewal ([`Error::NotHeld`](lockkit_core::Error::NotHeld),
//! the lease becomes lost) or at its deadline; the new holder's larger token fences it off.
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations)]
#![deny(rustdoc::broken_intra_doc_links)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod config;
mod error;
mod lease;
mod lock;
mod waiters;

pub use config::{
    DEFAULT_CONNECT_TIMEOUT, DEFAULT_PREFIX, DEFAULT_RESPONSE_TIMEOUT, MAX_PREFIX_BYTES,
    RedisConfig, validate_prefix,
};
pub use lock::{EXPIRY_JITTER, EXPIRY_SLACK, MAX_WAIT_POLL, RedisLock};

/// The redis crate this backend is built on, for users who need its types.
pub use redis;
