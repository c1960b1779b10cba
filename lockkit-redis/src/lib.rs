//! # lockkit-redis
//!
//! The Redis backend of [lockkit](https://docs.rs/lockkit): leases with TTLs and strictly
//! increasing fencing tokens on **one** Redis server, or on the master of a
//! [Sentinel](#sentinel) service, on a [Redis Cluster](#cluster), or over N independent masters
//! with [Redlock](#redlock) ([`RedlockLock`]). It is an **efficiency lock**: it
//! saves duplicate work, and a fenced resource keeps data safe, but a failover can grant a held
//! lock twice (see [Guarantees](#guarantees); [replication-confirmed
//! grants](#replication-confirmed-grants) narrow that window).
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
//!   is free and no live waiter queues before us, it is `SET … NX PX ttl GET` (Redis 7.0 or
//!   later)
//!   (<https://redis.io/docs/latest/commands/set/>) to the acquire's random 128-bit waiter ID
//!   (hex), and the lock's fence counter goes up by one and is never left below the server's
//!   `TIME` in µs (<https://redis.io/docs/latest/commands/time/>; `max(counter + 1, TIME)`,
//!   one `TIME` and one `SET … GET` per grant): a counter that did not exist (new name, or lost
//!   in a restart without persistence, evicted or deleted) or that is old (a
//!   promoted replica that did not receive the last grants) jumps to it. The counter is the
//!   [`FencingToken`](lockkit_core::FencingToken). If the lock is held, the same script puts a
//!   waiting acquire at the end of the lock's queue and returns the holder's remaining `PTTL` (0
//!   in the key's last millisecond, which a waiter takes as "expires now"). The scripts run with
//!   `EVALSHA` through the redis crate's [`Script`](redis::Script), which reloads them after a
//!   server restart or `SCRIPT FLUSH`.
//! - **Renew** is compare-and-`PEXPIRE` and **release** is compare-and-`DEL` on the owner value
//!   (both scripts), so a lease that lapsed can neither extend nor delete another holder's lock:
//!   both return [`Error::NotHeld`](lockkit_core::Error::NotHeld), and a lapsed lock is never
//!   re-taken by a renewal.
//! - **Waiting** does not spin and does not herd. The queue `P:queue:N` is a sorted set of
//!   waiter IDs in arrival order; each waiter also has a key `P:waiter:ID` (its TTL and its
//!   client's channel) that expires after [`WAITER_TTL`] unless the waiter looks at the lock
//!   again. A release (or an acquire that finds the holder's key expired) hands the lock to the
//!   first live waiter: the lock key becomes that waiter's ID with its TTL, the counter is
//!   bumped, and `"ID TOKEN"` is `PUBLISH`ed on that waiter's client channel `P:client:CID`
//!   only (<https://redis.io/docs/latest/develop/interact/pubsub/>); a release with nobody
//!   waiting publishes nothing. A waiter whose client channel has no subscriber (`PUBSUB
//!   NUMSUB`, which unlike `PUBLISH`'s count leaves out pattern subscribers: the waiter's
//!   client is gone, killed, its sockets closed by the server) is passed over to the next, so a
//!   dead waiter does not hold the lock for its TTL (semaphore permits and election terms, in
//!   `slots.rs`, are handed on the same way). Where the user may not run `PUBSUB` (an ACL),
//!   and in Cluster mode (see *Cluster*), every waiter is served, dead or not. Each
//!   [`RedisLock`] subscribes to its own channel once, on one shared pub/sub connection,
//!   before its first waiter queues; no SUBSCRIBE per wait. Pub/sub delivery is at-most-once,
//!   so a waiter also looks again just after the holder's `PTTL` (plus up to
//!   [`EXPIRY_JITTER`]) and at least every [`MAX_WAIT_POLL`] (≈1 s, jittered): a waiter that
//!   was handed the lock finds its ID in the lock key. A `SUBSCRIBE` that gets no reply within
//!   the response timeout drops the pub/sub connection (the next waiter opens a new one).
//!   Waiters are served in FIFO order; one that
//!   stops looking (its process died) leaves the queue after [`WAITER_TTL`], and a lock handed
//!   to it in that window is free again after that lease's TTL, plus its lock-delay if it
//!   asked for one (it failed before it could release: nobody can tell it never saw the grant).
//! - **Lock-delay** ([`AcquireOptions::lock_delay`](lockkit_core::AcquireOptions::lock_delay)):
//!   a grant with a delay `d` also sets the key `P:delay:N` (to its waiter ID) with `PX` TTL +
//!   `d`, and every renewal sets it again with the lock key, so it outlives the lock key by `d`.
//!   While it exists and the lock key does not (the holder lapsed: unrenewed, its process died,
//!   its connection lost), the acquire script grants no one and hands the lock to no waiter: a
//!   try-once acquire gets [`Error::Held`](lockkit_core::Error::Held), and waiters queue and are
//!   answered the delay key's `PTTL`, so they sleep until it ends (capped as for a holder's
//!   `PTTL`), then the first live waiter takes the lock. A release (and the cleanup of a cancelled
//!   acquire, whose grant never reached a caller) deletes it, so the release's hand-off is
//!   immediate; a hand-off sets it for the new holder from the delay its waiter key carries. A
//!   kept-alive lease whose renewal was acknowledged only after its deadline is given back as
//!   lapsed: its lock key is deleted and the delay key set to `d`. The Redis server measures the
//!   delay from its own expiry of the lock key, so it is never shorter than `d`, and at most
//!   [`EXPIRY_SLACK`] longer for a waiter.
//! - **Keepalive** is batched: the leases of one [`RedisLock`] that are kept alive are renewed
//!   together, by one script per [`RENEW_BATCH`] leases every TTL/3 (of the shortest TTL among
//!   them), answering per lease: a lease whose key is gone is marked lost alone, and a failed
//!   call marks its leases suspect and is retried after TTL/12. `keepalive(false)` leases renew
//!   with [`Lease::renew`](lockkit_core::Lease::renew), one script each.
//! - **Loss notices**: a lock key deleted (an admin's `DEL`), expired early (a server clock
//!   step, a stray `PEXPIRE`) or evicted is heard of within [`LOSS_NOTICE`] (200 ms; a deletion
//!   or eviction 0.3–5 ms measured on loopback, an early expiry at the server's next expiry
//!   cycle, up to ~100 ms), not only at the next renewal (up to TTL/3 later): the waiters' pub/sub
//!   connection also `SUBSCRIBE`s to the keyspace channel of each lock key held through this
//!   client for [`WATCH_AFTER`] (25 ms) or longer (`__keyspace@DB__:P:lock:NAME`,
//!   <https://redis.io/docs/latest/develop/use/keyspace-notifications/>; all due keys in one
//!   `SUBSCRIBE` per 25 ms, then one `MGET` that finds a loss from before the subscription),
//!   so a key's events reach only its holder's client, and a lease released within 25 ms costs
//!   the server nothing for its notice. A `del`, `expired` or `evicted` event for a key held
//!   through this client costs one `GET`: if the key is no longer the lease's, the lease is
//!   lost ([`NotHeldOnServer`](lockkit_core::LossReason::NotHeldOnServer)). A loss in a lease's
//!   first 25–50 ms is heard when its subscription is checked: at most 50 ms plus two round
//!   trips after the grant. Connecting reads
//!   `notify-keyspace-events` and adds what is missing of `Kgxe` with `CONFIG SET` (keeping
//!   the flags already set); where `CONFIG` is renamed or refused (managed services) a warning
//!   is logged, holders hear at their next renewal, and
//!   [`Guarantees::loss_notice`](lockkit_core::Guarantees::loss_notice) (and
//!   [`RedisLock::loss_notice`]) is `None`. The connection is then kept up: reopened with
//!   backoff when it drops, and `PING`ed once per keepalive tick (a silent one is replaced).
//!   While it is down, holders hear at their next renewal.
//! - **Elections and semaphores** ([`Election`](lockkit_core::Election),
//!   [`Semaphore`](lockkit_core::Semaphore), through
//!   [`SlotBackend`](lockkit_core::backend::SlotBackend)): each slot is a lock key of a derived
//!   name (`elect/N`, `sem/N/K`; lock names cannot contain `/`), so leaderships and permits get
//!   the lock's tokens, batched keepalive, loss notices, FIFO hand-off and cancel safety; slot
//!   scripts add the values, N, and an events channel for observers ([`MAX_OBSERVE_POLL`]).
//!   See docs/election-semaphore.md, "Redis".
//! - **Server checks at connect**: a nonzero `maxmemory` with any `maxmemory-policy` but
//!   `noeviction` can evict lock keys (the `volatile-*` policies evict keys with a TTL, which
//!   lock keys have; read with `CONFIG GET`, or `INFO memory` without `CONFIG`): a warning, or
//!   with [`RedisConfig::strict`] (`strict=true`) the connect fails with
//!   [`Error::InvalidConfig`](lockkit_core::Error::InvalidConfig) naming the policy.
//! - **Restarts**: the server's `run_id` (`INFO server`) is read at connect, when the pub/sub
//!   connection comes back after a drop, and once per keepalive tick (one `INFO` per client,
//!   not per lease). A new `run_id` means the server restarted: every lease held through the
//!   client is lost ([`SessionExpired`](lockkit_core::LossReason::SessionExpired): the server
//!   run that held it ended), even if persistence brought its key back, and its key is given
//!   back as lapsed (compare-and-delete; a lock-delay is kept). A lease the new run granted before the client saw the new
//!   `run_id` is lost too: which run granted it cannot be told cheaply, and stopping early is
//!   the safe side.
//! - **ACL users** need the commands `EVAL`, `EVALSHA`, `SCRIPT`, `PING`, `SUBSCRIBE`,
//!   `UNSUBSCRIBE`, `GET`, `MGET` and `INFO` (and `CONFIG` for the checks above; without it
//!   they fall back as described), and the keys and channels under the prefix (and the
//!   channels `__keyspace@DB__:P:lock:*`)
//!   (<https://redis.io/docs/latest/operate/oss_and_stack/management/security/acl/>). Without
//!   channel permission (Redis 7's default `acl-pubsub-default resetchannels`) locks still work:
//!   the hand-off `PUBLISH` is best effort, and waiters poll about once a second (a warning is
//!   logged once per [`RedisLock`]); they do not queue then.
//! - **Cancel safety**: if an acquire is dropped (or times out, or fails) while its script is in
//!   flight or while it is queued (or its reply was lost, or came after the TTL), a drop guard
//!   spawns a cleanup for its waiter ID, sent as plain `EVAL` (immune to a flushed script
//!   cache) and retried on transient errors for the TTL (at least 60 s): it takes the ID out of
//!   the queue, gives the lock to the next live waiter (or deletes it) if the ID holds it (the
//!   script took it, or a release handed it over), and leaves a *tombstone*
//!   (`P:cancelled:ID`, expiring after the TTL or 60 s, whichever is longer) that makes a
//!   script of that ID do nothing if it reaches the server later, on another connection. An
//!   acquire whose reply was lost goes on with a fresh ID (at the end of the queue). So no
//!   orphaned lock waits out its TTL, unless the script reaches the server after the tombstone
//!   expired. An acquire never hands out a lease that is already lost (a grant whose reply took
//!   longer than the TTL is given back and retried; a handed-over lock whose waiter last looked
//!   more than TTL/2 ago is renewed first).
//! - **Leases** use lockkit-core's [`TrackerHandle`](lockkit_core::backend::TrackerHandle) from the *send*
//!   time of the granting request, and its keepalive (renew at about TTL/3). TTLs are sent in
//!   whole milliseconds, rounded up.
//! - **Connections**: one auto-reconnecting [`ConnectionManager`](redis::aio::ConnectionManager)
//!   per [`RedisLock`] (clones share it). It reconnects when a connection is closed or reset,
//!   but not when replies merely stop coming (a dead NAT entry, a partition that drops packets),
//!   so a command that times out also retires its connection and the next command opens a new
//!   one. Connecting makes one attempt bounded by the connect timeout (default 5 s), so an
//!   unreachable server fails fast with [`Error::Unavailable`](lockkit_core::Error::Unavailable)
//!   and a wrong password with [`Error::Auth`](lockkit_core::Error::Auth). A `rediss://` URL
//!   pointing at a plain-text port fails with `Unavailable` only after the connect timeout: the
//!   plain server waits for the rest of what it takes for a command and never answers the TLS
//!   handshake. Commands time out after the response timeout (default 2 s).
//! - **Data kept in Redis**: [`RedisFence::from_lease`] writes keys with one script that checks
//!   each key's guard record: the key is bound to the lock of its first fenced write, a token of
//!   another lock fails with [`ForeignToken`](lockkit_core::Error::ForeignToken), an older token
//!   with [`StaleToken`](lockkit_core::Error::StaleToken) (and the writer's lease is lost).
//! - **Errors**: `LOADING`, `BUSY`, `TRYAGAIN` and `MASTERDOWN` replies are transient
//!   ([`Error::Unavailable`](lockkit_core::Error::Unavailable), retried); `READONLY` (the URL
//!   names a read-only replica) and `NOPERM` are [`Error::Backend`](lockkit_core::Error::Backend)
//!   errors that say so.
//!
//! ## Redlock
//! `redlock[s]://[[user]:password@]host[:port],host[:port],…[/db]` ([`RedlockConfig`],
//! [`RedlockLock`]): N (3 to [`MAX_REDLOCK_NODES`]) independent masters, each reached as a
//! `redis://` URL with the same user info, database and parameters, plus `max_ttl`
//! ([`DEFAULT_REDLOCK_MAX_TTL`]). A grant needs a majority of votes (`SET NX PX` per node, in
//! parallel) within the validity time (TTL − elapsed since the first request − drift); its
//! token is the largest counter of the granting nodes + 1, written back to a majority before
//! the grant returns. A failed attempt gives back with compare-and-delete on every node; renewal
//! needs a majority of compare-and-`PEXPIRE`s; a node restarted without its data refuses to vote
//! for one `max_ttl` ([`REDLOCK_BOOT_KEY`]). An **efficiency** lock: waiters poll (no FIFO),
//! no lock-delay, no elections or semaphores. The design, and Kleppmann's critique with
//! antirez's reply: docs/redlock.md.
//!
//! ## Sentinel
//! `redis+sentinel://[[user]:password@]host[:port][,host[:port]…]/service[/db]` (or
//! [`RedisConfig::sentinel`]): the hosts are sentinels (default port
//! [`DEFAULT_SENTINEL_PORT`]), the service is the master name they monitor
//! (<https://redis.io/docs/latest/operate/oss_and_stack/management/sentinel/>). The user info
//! logs in to the **master**; the sentinels get the parameters `sentinel_username` and
//! `sentinel_password`. TLS is not supported in this mode yet: a `rediss+sentinel://`
//! URL, or TLS settings on a [`RedisConfig::sentinel`] config, fail with
//! [`Error::NotSupported`](lockkit_core::Error::NotSupported).
//! - **Discovery**: at connect, the sentinels are asked in turn (`SENTINEL MASTERS`) and the
//!   master they name must answer `ROLE` as a master (the redis crate's
//!   [`redis::sentinel`]), within the connect timeout. It is asked again when a command fails
//!   the way a failover makes it fail (refused, dropped, timed out, `READONLY` from an old
//!   master that came back as a replica, `MASTERDOWN`) and at once on a sentinel's
//!   `+switch-master` message (one pub/sub connection per [`RedisLock`] to one sentinel at a
//!   time). On a new address, the command connection, the confirmation connection and the
//!   pub/sub connection (hand-offs, loss notices) move to the new master.
//! - **Leases across a failover**: from the switch, every lease held through the client is
//!   [`Suspect`](lockkit_core::LeaseState::Suspect) until it proves that the new master holds
//!   its key with its owner value (one compare-and-`PEXPIRE`, which also sets its expiry there
//!   anew); a lease that cannot is [`Lost`](lockkit_core::LeaseState::Lost)
//!   ([`NotHeldOnServer`](lockkit_core::LossReason::NotHeldOnServer)). Never silently kept: a
//!   grant the old master did not replicate is lost. Measured on loopback (three sentinels,
//!   `down-after-milliseconds 500`, SIGKILL of the primary): `+switch-master` 1.8–3.5 s after
//!   the kill (11 failovers); an unreplicated lease Lost 4–240 ms after that message and a new
//!   grant on the promoted replica 10–60 ms later, 1.9–3.7 s after the kill (5 runs); a
//!   replicated lease proved on the new master 2.2–2.5 s after the kill (3 runs).
//! - **What it does not prevent**: Redis replicates asynchronously. Between the old master's
//!   death and the switch, and for a grant no replica received, the promoted replica may grant
//!   the lock to someone else while the old holder still reads Held: a fenced resource rejects
//!   the old holder's writes (tokens still increase), nothing else does. A partitioned old
//!   master that still takes writes from clients on its side can grant locks too, until
//!   Sentinel demotes it.
//!
//! ## Cluster
//! `redis+cluster://[[user]:password@]host[:port][,host[:port]…]` (or [`RedisConfig::cluster`]):
//! the hosts are seed nodes of a Redis Cluster
//! (<https://redis.io/docs/latest/operate/oss_and_stack/reference/cluster-spec/>); the user info
//! logs in to every node; `rediss+cluster://` with the TLS parameters of `rediss://` (the same
//! files for every node; the nodes must announce their TLS ports, `tls-cluster yes`). See also
//! `docs/redis-cluster.md`.
//! - **Keys**: every key of one lock name carries the name as its hash tag, `P:kind:{=N}` (and
//!   waiter keys and tombstones `P:waiter:{=N}:ID`, `P:cancelled:{=N}:ID`), so they share one
//!   slot and each script (the same scripts as on one server) runs atomically on that slot's
//!   master. The `=` keeps the tag non-empty for a name that starts with `}`. The single-node
//!   layout is not changed by this (the two modes do not share keys).
//! - **Routing**: the redis crate's cluster connection ([`redis::cluster_async`]) sends each
//!   script to the master of its first key's slot and follows `MOVED` (refreshing its slot map)
//!   and `ASK` (a slot being migrated). While a lock's slot migrates, Redis refuses its scripts
//!   with `TRYAGAIN` (a multi-key command with some keys missing): acquires and renewals of that
//!   lock fail as [`Unavailable`](lockkit_core::Error::Unavailable) and are retried until the
//!   slot's migration ends; a lock held through it stays held if that takes less than its TTL
//!   (`MIGRATE` moves its keys with their expiries; tested), and nobody else gets it meanwhile.
//! - **Renewal**: one script may only touch one slot, so the batched renewal groups leases by
//!   hash tag (one call per lock name, each call up to [`RENEW_BATCH`] leases of that name), all
//!   calls in flight together.
//! - **Waiters**: the hand-off queue as on one server; the hand-off goes by sharded pub/sub
//!   (<https://redis.io/docs/latest/develop/interact/pubsub/#sharded-pubsub>): the release
//!   script `SPUBLISH`es it on the waiter's client channel *in the lock's hash slot*
//!   (`P:client:{T}:ID`, `T` a tag that hashes to that slot), so it stays on the slot's shard
//!   instead of crossing the cluster bus to every node as a `PUBLISH` would. A client
//!   subscribes (`SSUBSCRIBE`, on a RESP3 cluster connection of its own) to its channel of
//!   each slot it waits in, at most 256 slots at once (idle ones are dropped first; beyond
//!   that its waiters poll), and again after the slot moved or a node's connection dropped;
//!   a message lost meanwhile is covered by the waiters' timer. Unlike on one server, a waiter
//!   whose client is gone is not passed over: the message also reaches the slot's replicas,
//!   where a client may be subscribed after a reconnect, and no count covers them, so a dead
//!   waiter is handed the lock and holds it for its TTL.
//! - **Failover**: a master's replica is promoted by the cluster. A lease whose key reached
//!   the replica stays held (its next renewal, after `MOVED`, proves it there); one whose key
//!   did not is [`Lost`](lockkit_core::LeaseState::Lost)
//!   ([`NotHeldOnServer`](lockkit_core::LossReason::NotHeldOnServer)) at its next renewal
//!   (within TTL/3), while a new acquire may already have the lock on the new master with a
//!   larger token (the `TIME` floor): the same efficiency-lock limit as Sentinel's.
//! - **Not supported yet**: TLS, keyspace notifications (loss notice: none;
//!   a deleted key is found at the next renewal), elections and semaphores
//!   ([`NotSupported`](lockkit_core::Error::NotSupported)), the eviction check at connect.
//!
//! ## Replication-confirmed grants
//! `min_replicas=N&replica_timeout=100ms` (or [`RedisConfig::min_replicas`], on `redis://`,
//! `redis+sentinel://` and `redis+cluster://`): every grant (of a lock, a leadership or a permit) is followed by
//! `WAIT N timeout`
//! (<https://redis.io/docs/latest/commands/wait/>) on a connection of its own (in Cluster
//! mode sent to the master of the lock's slot, where the grant was made); with fewer than
//! `N` acknowledgements the grant is given back (the next waiter gets it) and the attempt fails
//! with [`Error::Unavailable`](lockkit_core::Error::Unavailable) whose source is a
//! [`NotReplicated`] (retried while the acquire may wait; a deadline that cuts a retry ends in
//! [`Error::Timeout`](lockkit_core::Error::Timeout)). Election observers may see such a grant
//! (it is published when made) followed by its release. What it narrows: a failover to a replica
//! that acknowledged the grant keeps it (the lease proves itself on the new master), so the
//! window in which a failover can grant a held lock twice shrinks to the grants that Sentinel
//! loses anyway: a promotion of a replica that did not acknowledge (with `N` smaller than the
//! number of replicas), and writes lost in memory on both sides (`WAIT` does not make them
//! durable). It is still **not a consensus lock**: [`Guarantees::safe_across_failover`](lockkit_core::Guarantees::safe_across_failover)
//! stays `false`. It costs one more round trip per grant (the renewal and `WAIT`), plus the
//! replicas' acknowledgement; a master without `N` connected replicas grants nothing. The
//! confirmations of one [`RedisLock`] share one connection, on which the server runs one `WAIT`
//! after the other: while replicas lag, concurrent grants wait for each other's timeouts (and
//! fail as `Unavailable` once that passes the response timeout).
//!
//! ## Keys
//! For the prefix `P` (default `lockkit`; see [`RedisConfig::prefix`]) and the lock name `N`:
//!
//! | key / channel | holds |
//! |---|---|
//! | `P:lock:N` | the holder's owner value, with the lease's TTL |
//! | `P:fence:N` | the fence counter (the last token), no expiry |
//! | `P:queue:N` | the waiters' queue: waiter IDs scored by arrival |
//! | `P:delay:N` | with a lock-delay: the holder's waiter ID, expiring the delay after its lock key (see *Lock-delay*) |
//! | `P:waiter:ID` | a queued waiter's TTL, TTL + lock-delay and client channel, expires after [`WAITER_TTL`] |
//! | `P:cancelled:ID` | tombstone of a cancelled acquire (see *Cancel safety*), expires |
//! | `P:guard:K` | for a key `K` written through [`RedisFence`]: the lock guarding it and the highest token that wrote it, no expiry |
//! | channel `P:client:CID` | hand-off messages for the waiters of one [`RedisLock`] |
//! | shard channel `P:client:{T}:CID` | in Cluster mode, hand-off messages for the waiters of one [`RedisLock`] in hash slot `T`'s slot (`SPUBLISH`; see *Cluster*) |
//! | `P:lock:elect/N`, `P:lock:sem/N/K` (and their `fence`/`queue` keys) | an election's leadership, a semaphore's permit `K`: lock keys of derived names (see *Elections and semaphores*) |
//! | `P:slots:elect/N`, `P:slots:sem/N` | an election's or semaphore's N in force, its holders' values and its waiters' values |
//! | channel `P:events:elect/N`, `P:events:sem/N` | every grant, hand-off, proclaim and release of the election or semaphore, with its token |
//!
//! Fence counters are never deleted (deleting one would let tokens repeat, were it not for the
//! `TIME` floor): every lock name ever used keeps one small key. With a name per request (for
//! example a lock per order id) memory grows without bound; prefer a bounded set of names, or
//! delete old fence keys yourself with a `SCAN` over `P:fence:*` once no lease on them can
//! exist (a fresh counter then starts from the server's `TIME` floor).
//!
//! Any valid name (1–256 bytes of UTF-8 without `/` or control characters, see
//! [`validate_name`](lockkit_core::backend::validate_name)) maps safely into this space, and cannot
//! reach another key:
//! - Names are never spliced into Lua source or parsed by a command: they travel as
//!   length-prefixed RESP bulk strings in `KEYS`/`ARGV`, and no command that interprets
//!   patterns (`KEYS`, `SCAN MATCH`, `PSUBSCRIBE`) ever sees them. `*`, `?`, `[`, `:`, spaces
//!   and any Unicode are plain bytes.
//! - The prefix may not contain `:`, so in `P:kind:N` the first `:` ends the prefix and the
//!   second ends the kind (`lock`, `fence`, `queue`, `delay`, `waiter` or `cancelled`); the rest is the name (or the owner
//!   value), verbatim. The map
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
//! | safe across failover | **no** | Redis replicates asynchronously: a failover to a replica that had not yet received the lock key grants the lock again while the old holder still holds it (<https://redis.io/docs/latest/operate/oss_and_stack/management/replication/>); in [Sentinel](#sentinel) mode that holder becomes Lost at the switch, and with [`min_replicas`](#replication-confirmed-grants) only unacknowledged grants are exposed. Tokens still increase (the `TIME` floor, below). |
//! | tokens survive restart | yes, with the caveat below | |
//! | FIFO waiters | yes | the release hands the lock to the first live waiter of the queue |
//! | manual renewal | yes | `keepalive(false)` leases renew with [`Lease::renew`](lockkit_core::Lease::renew) |
//! | lock-delay | yes | a key that outlives the lock key by the delay, deleted by a release (see *Lock-delay* above) |
//! | expiry slack | [`EXPIRY_SLACK`] (50 ms) | a waiter wakes up to [`EXPIRY_JITTER`] after the holder's `PTTL`, then needs one round trip |
//! | loss notice | [`LOSS_NOTICE`] (200 ms) with keyspace notifications, else none (at the next renewal) | see *Loss notices* above |
//!
//! **Tokens across restarts.** A server restarted without persistence (or with its data lost)
//! forgets the fence counter, and a promoted replica may have an older one. Because every grant
//! sets the counter to at least the server's `TIME` in microseconds (and otherwise it grows by
//! one per grant), the first grant after the restart or failover still gets a token above every
//! earlier one, **provided that** (1) the server's wall clock never steps backwards (across the
//! restart too: NTP slews, it does not step, unless told to), and (2) the lock is granted fewer
//! than once per microsecond on average, so that the counter never runs ahead of the clock by
//! more than the time the restart (or failover) takes; after a failover also (3) the two
//! servers' clocks agree better than the failover takes (at least `down-after-milliseconds`). The same floor protects against the counter key being
//! evicted (`maxmemory` with an `allkeys-*` policy) or deleted. Tokens are exact below 2^53 (Lua
//! numbers are doubles), which `TIME` in µs reaches in the year 2255.
//!
//! A lease's TTL also stops mattering if the server restarts with its data lost: the lock is
//! free at once, and a waiter may get it while the old holder's lease still reads
//! [`Held`](lockkit_core::LeaseState::Held) until the client sees the new `run_id` (when its
//! pub/sub connection comes back, with backoff of up to 4 s, or at the next keepalive tick,
//! TTL/3) or a renewal fails with [`Error::NotHeld`](lockkit_core::Error::NotHeld), and the
//! lease becomes lost. This is why this is an efficiency lock: two holders can overlap, and only
//! the new holder's larger token, checked by the fenced resource, keeps data safe.
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations)]
#![deny(rustdoc::broken_intra_doc_links)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod cluster;
mod config;
mod conn;
mod core;
mod error;
mod fence;
mod lease;
mod lock;
mod redlock;
mod redlock_config;
mod renewer;
mod replicas;
mod sentinel;
mod server;
mod shard;
mod slots;
mod waiters;
mod watch;

pub use config::{
    DEFAULT_CONNECT_TIMEOUT, DEFAULT_PREFIX, DEFAULT_REPLICA_TIMEOUT, DEFAULT_RESPONSE_TIMEOUT,
    DEFAULT_SENTINEL_PORT, MAX_CA_FILE_BYTES, MAX_MIN_REPLICAS, MAX_PREFIX_BYTES, Notifications,
    RedisConfig, RedisMode, validate_prefix,
};
pub use fence::RedisFence;
pub use lock::{EXPIRY_JITTER, EXPIRY_SLACK, MAX_WAIT_POLL, RedisLock, WAITER_TTL};
pub use redlock::{REDLOCK_BOOT_KEY, REDLOCK_EXPIRY_SLACK, REDLOCK_MAX_POLL, RedlockLock};
pub use redlock_config::{DEFAULT_REDLOCK_MAX_TTL, MAX_REDLOCK_NODES, RedlockConfig};
pub use renewer::BATCH as RENEW_BATCH;
pub use replicas::NotReplicated;
pub use slots::MAX_OBSERVE_POLL;
pub use watch::{LOSS_NOTICE, WATCH_AFTER};

/// The redis crate this backend is built on, for users who need its types.
#[doc(no_inline)]
pub use redis;
