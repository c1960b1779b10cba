//! [`RedisLock`]: the [`Lock`] implementation.

use std::fmt;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use rand::Rng;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{AsyncConnectionConfig, Script};
use tokio::time::Instant;

use lockkit_core::backend::{
    LockBackend, TrackerHandle, retry_transient, validate_name, wait_deadline,
};
use lockkit_core::{
    AcquireOptions, Error, FencingToken, Guarantees, HolderInfo, Lease, LeaseState, LockKind,
    Result, Wait,
};

use crate::config::{RedisConfig, RedisMode, connect_error};
use crate::conn::Conn;
use crate::core::{
    Call, Keys, RedisLease, Registration, SERVE_LUA, Subscribing, Subscription, Woken, cancel_once,
    compare_and_pexpire, delay_px, ttl_millis,
};
use crate::error::{BACKEND, bad_reply, from_redis, timed_out};
use crate::renewer::Renewer;
use crate::sentinel::Discovery;
use crate::waiters::{Hub, Waiting};
use crate::watch::{LOSS_NOTICE, Watch};
use crate::{replicas, server};

/// The longest a waiter sleeps without looking at the lock again, when no release message
/// arrives: about 1 s (jittered down by up to 10 %).
pub const MAX_WAIT_POLL: Duration = Duration::from_secs(1);

/// The most a waiter sleeps past the holder's expiry (reported by `PTTL`), as jitter so that
/// waiters of one lock do not all ask at the same instant: 20 ms.
pub const EXPIRY_JITTER: Duration = Duration::from_millis(20);

/// How long a waiter polls without trying to subscribe again after the server refused its
/// SUBSCRIBE (for instance an ACL user without permission for the channel): 30 s.
pub(crate) const REFUSED_SUBSCRIBE_RETRY: Duration = Duration::from_secs(30);

/// How much later than its TTL a lapsed lock may be granted to a waiter: [`EXPIRY_JITTER`] plus
/// a round trip on a busy machine. Declared as [`Guarantees::expiry_slack`].
pub const EXPIRY_SLACK: Duration = Duration::from_millis(50);

/// How long a queued waiter's key (`P:waiter:ID`) lives unless the waiter looks at the lock
/// again (it does at least every [`MAX_WAIT_POLL`]): 3 s. A waiter whose process died drops out
/// of the queue this long after its last look. Until then a release passes it over if the
/// server has closed its client's connections (a killed process: the hand-off `PUBLISH` reaches
/// nobody), but hands it the lock if they look alive (a frozen process, a partition), and then
/// the lock waits out that lease's TTL.
pub const WAITER_TTL: Duration = Duration::from_secs(3);

/// The acquire script (with [`SERVE_LUA`]). `KEYS[1]` lock key, `KEYS[2]` fence counter key,
/// `KEYS[3]` queue, `KEYS[4]` lock-delay key, `KEYS[5]` the waiter ID's tombstone key; `ARGV[1]`
/// waiter-key prefix, `ARGV[2]` the acquire's waiter ID (also the owner value of its grant),
/// `ARGV[3]` TTL in ms, `ARGV[4]` the client's hand-off channel (`''`: do not queue), `ARGV[5]`
/// [`WAITER_TTL`] in ms, `ARGV[6]` TTL + lock-delay in ms (`0`: no lock-delay).
///
/// - The common case first: no tombstone, no lock-delay key and no queue (one `EXISTS` of the
///   three): `SET NX PX … GET` and, if that took the lock, the token bump (`TIME` and
///   `SET … GET` of the counter, see [`SERVE_LUA`]); a held lock is joined as below. Four
///   commands for a free lock. Otherwise (after one `EXISTS` of the tombstone, one `GET` of
///   the lock key tells the cases apart):
/// - A tombstone means the ID was retired and its cleanup ran first (it came on another
///   connection): `{2, 0, '', ''}`, nothing touched.
/// - No lock key but a lock-delay key: the last holder lapsed with a lock-delay, and nobody gets
///   the lock before the delay key expires. As for a held lock, but with the delay key's `PTTL`
///   and no holder: `{0, PTTL, '', COUNTER}`.
/// - The lock key holds our ID (a release handed it to us): the TTL is set anew from now and
///   the token read back, `{1, token, '', ''}`.
/// - Free lock (set to our ID with `SET PX`): if live waiters queue before
///   us (the holder's key expired, nobody released), the first is handed the lock instead and we
///   go on as for a held lock. Otherwise the counter is bumped (a counter that is not an
///   integer fails the script, and the lock key is deleted again) and we leave the queue:
///   `{1, token, '', ''}`. A queue or counter key of another type fails the script too, with the
///   lock key deleted again.
/// - Held lock: with a channel, we join the queue's tail (`ZADD NX` scored by the server's
///   `TIME` in µs: a script takes longer than a µs, so scores increase in arrival order; an
///   existing entry keeps its place) and refresh our waiter key; `{0, PTTL, holder, COUNTER}`
///   (the holder's remaining TTL in ms, or -1 for a key without expiry; `COUNTER` the fence
///   counter now, `''` if missing: a hand-off message with a token up to it is for a grant made
///   before this look, which has lapsed since, and is ignored).
///
/// A grant with a lock-delay sets the delay key to our ID with TTL + delay.
///
/// Lua numbers are doubles: tokens stay exact below 2^53 µs (the year 2255).
/// See <https://redis.io/docs/latest/commands/set/> and <https://redis.io/docs/latest/commands/zadd/>.
static ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"{SERVE_LUA}
local me = ARGV[2]
local function wait(pttl, holder)
  if ARGV[4] ~= '' then
    local now = redis.call('TIME')
    redis.call('ZADD', KEYS[3], 'NX', tonumber(now[1]) * 1000000 + tonumber(now[2]), me)
    redis.call('SET', ARGV[1] .. me, ARGV[3] .. ' ' .. ARGV[6] .. ' ' .. ARGV[4], 'PX', ARGV[5])
  end
  local seen = redis.pcall('GET', KEYS[2])
  if type(seen) ~= 'string' then seen = '' end
  return {{0, pttl, holder, seen}}
end
local function delay()
  if ARGV[6] ~= '0' then
    redis.call('SET', KEYS[4], me, 'PX', ARGV[6])
  end
end
local function granted()
  local ok, t = pcall(bump)
  if not ok then
    redis.call('DEL', KEYS[1])
    return redis.error_reply('lockkit: the fence counter is not an integer')
  end
  delay()
  return {{1, t, '', ''}}
end
if redis.call('EXISTS', KEYS[5], KEYS[4], KEYS[3]) == 0 then
  local v = redis.call('SET', KEYS[1], me, 'NX', 'PX', ARGV[3], 'GET')
  if not v then
    return granted()
  end
  if v ~= me then
    return wait(redis.call('PTTL', KEYS[1]), v)
  end
end
if redis.call('EXISTS', KEYS[5]) == 1 then
  return {{2, 0, '', ''}}
end
local v = redis.call('GET', KEYS[1])
if v == me then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  delay()
  return {{1, tonumber(redis.call('GET', KEYS[2])) or bump(), '', ''}}
end
if v then
  return wait(redis.call('PTTL', KEYS[1]), v)
end
if redis.call('EXISTS', KEYS[4]) == 1 then
  return wait(redis.call('PTTL', KEYS[4]), '')
end
redis.call('SET', KEYS[1], me, 'PX', ARGV[3])
local ok
ok, v = pcall(serve, me)
if not ok then
  redis.call('DEL', KEYS[1])
  return redis.error_reply('lockkit: the queue key is not a sorted set or the fence counter not an integer')
end
if not v then
  return granted()
end
return wait(redis.call('PTTL', KEYS[1]), v)
"
    ))
});

/// The holder-read script. `KEYS[1]` lock key, `KEYS[2]` fence counter key. A free lock:
/// `{0, 0, ''}`; a held one: `{1, PTTL, counter}`. The counter is the holder's token: the acquire
/// script bumps it in the same step as it sets the lock key, and nothing else writes it.
static HOLDER: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {0, 0, ''}
end
return {1, redis.call('PTTL', KEYS[1]), redis.call('GET', KEYS[2]) or ''}
",
    )
});

const NOTES: &str = "efficiency lock on one Redis server. Tokens: a per-name counter that never \
expires and is never left below the server's TIME in µs, so they keep increasing across restarts \
without persistence as long as the server's wall clock never steps backwards and the lock is \
granted fewer than once per µs on average. A failover to an asynchronously replicated replica can \
grant a held lock a second time, and so can a restart that loses the data: a waiter may get the \
lock while the old holder still reads Held until the client sees the server's new run_id (when its \
pub/sub connection is back, or at the next keepalive tick) or its next renewal fails. A lock key \
deleted, expired early or evicted is heard of within 200 ms where the server sends keyspace \
notifications (turned on at connect), else at the next renewal (up to TTL/3 later). Waiters are \
served in queue order (a waiter that stops looking drops out after 3 s). Lock-delay: a \
key with TTL + delay beside the lock key, so a holder that lapses keeps the lock from everyone \
until the delay after its key expired; a release deletes it. Fence counters are never deleted: one \
small key per lock name ever used.";

/// A lock service on one Redis server (an **efficiency** lock: see [`Guarantees`] and the crate
/// docs).
///
/// Cheap to clone: clones share one connection (the redis crate's auto-reconnecting
/// [`ConnectionManager`]) and one pub/sub connection for waiters.
#[derive(Clone)]
pub struct RedisLock {
    inner: Arc<Inner>,
}

struct Inner {
    conn: Conn,
    hub: Arc<Hub>,
    renewer: Arc<Renewer>,
    config: RedisConfig,
}

impl fmt::Debug for RedisLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLock")
            .field("config", &self.inner.config)
            .field("waiters", &self.inner.hub)
            .finish()
    }
}

impl RedisLock {
    /// Connects to the server named by a `redis://` or `rediss://` URL (see
    /// [`RedisConfig::from_url`] for the format and lockkit's query parameters `prefix`,
    /// `connect_timeout`, `response_timeout`, `tls_ca`, `tls_cert`, `tls_key`).
    ///
    /// ```no_run
    /// # async fn f() -> lockkit_core::Result<()> {
    /// let locks = lockkit_redis::RedisLock::connect("redis://:secret@127.0.0.1:6379/0?prefix=billing").await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// - [`Error::InvalidConfig`]: malformed URL or options (the URL is not echoed), a
    ///   `tls_ca`, `tls_cert` or `tls_key` that is not a readable regular file of at most 1 MiB, or a database
    ///   number the server does not have; with `redis+sentinel://`, a service that none of the
    ///   sentinels that answer monitors (with none answering, [`Error::Unavailable`]).
    /// - [`Error::Unavailable`]: the server did not answer within the connect timeout
    ///   (default 5 s), refused the connection, or is loading. A `rediss://` URL for a
    ///   plain-text port ends here too, after the connect timeout (the server never answers
    ///   the TLS handshake).
    /// - [`Error::Auth`]: wrong user name or password, or a password is required; or TLS
    ///   refused a certificate (the server's: unknown CA, expired, not for the host; or the
    ///   server refused ours, or its absence).
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future closes whatever connection it opened.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_with(RedisConfig::from_url(url)?).await
    }

    /// The old name of [`connect_with`](Self::connect_with).
    ///
    /// # Errors
    /// As [`connect`](Self::connect).
    ///
    /// # Cancel safety
    /// Cancel safe, as [`connect`](Self::connect).
    pub async fn with_config(config: RedisConfig) -> Result<Self> {
        Self::connect_with(config).await
    }

    /// Connects with a [`RedisConfig`] built by hand.
    ///
    /// One connection attempt, bounded by the connect timeout, checks that the server answers and
    /// accepts the credentials; then the connection manager (which reconnects by itself, with
    /// backoff, when a connection drops) is started. The pub/sub connection for waiters is opened
    /// on the first acquire that has to wait.
    ///
    /// # Errors
    /// As [`connect`](Self::connect).
    ///
    /// # Cancel safety
    /// Cancel safe, as [`connect`](Self::connect).
    pub async fn connect_with(config: RedisConfig) -> Result<Self> {
        config.validate()?;
        #[cfg(feature = "tls")]
        {
            // The redis crate builds its rustls config from the process-wide provider. Install
            // ring unless the application installed one already (then this is a no-op).
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        if config.mode() == RedisMode::Cluster {
            let conn = crate::cluster::connect(&config).await?;
            let facts = server::Facts {
                notifications: false,
                run_id: None,
            };
            return Ok(Self::assemble(config, conn, facts).await);
        }
        let ct = config.connect_timeout;
        let client = config.client().await?;
        let discovery = match &config.sentinel {
            Some(s) => Some(Discovery::new(s, config.redis_settings().clone(), ct)?),
            None => None,
        };
        let client = match &discovery {
            // The master the sentinels name now (the client above was for the first sentinel).
            Some(d) => d.master().await?,
            None => client,
        };
        let rt = config.response_timeout;
        let probe = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(ct))
            .set_response_timeout(Some(rt));
        // A PING, because a server that requires a password only says so (NOAUTH) to the first
        // command when the client sent none.
        let probed = tokio::time::timeout(ct, async {
            let mut c = client
                .get_multiplexed_async_connection_with_config(&probe)
                .await?;
            redis::cmd("PING").query_async::<()>(&mut c).await
        });
        match probed.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(connect_error(e)),
            Err(_) => return Err(timed_out("connecting to redis", ct)),
        }
        let manager = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(ct))
            .set_response_timeout(Some(rt))
            .set_number_of_retries(2)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_secs(1));
        let conn = match tokio::time::timeout(
            ct,
            ConnectionManager::new_with_config(client.clone(), manager.clone()),
        )
        .await
        {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(from_redis(e)),
            Err(_) => return Err(timed_out("connecting to redis", ct)),
        };
        let conn = Conn::new(client, manager, conn, discovery);
        let facts = match tokio::time::timeout(
            ct,
            server::inspect(&conn, config.strict, config.notifications),
        )
        .await
        {
            Ok(r) => r?,
            Err(_) => return Err(timed_out("checking the server's configuration", ct)),
        };
        Ok(Self::assemble(config, conn, facts).await)
    }

    /// The client around a connected `conn`: loss notices, waiters, renewer.
    async fn assemble(config: RedisConfig, conn: Conn, facts: server::Facts) -> Self {
        let ct = config.connect_timeout;
        let rt = config.response_timeout;
        let watch = Watch::new(
            conn.clone(),
            config.db_number(),
            &config.prefix,
            facts.notifications,
            config.notifications,
            facts.run_id,
            config.sentinel.is_some(),
        );
        let hub = Hub::new(conn.clone(), &config.prefix, ct, rt, watch);
        crate::sentinel::follow(&hub, &conn);
        if hub.watch().notifications() {
            // Subscribed before the first lease exists; if this fails, it is retried in the
            // background (or, refused, notifications are off: see `loss_notice`).
            if let Err(e) = hub.keep_up().await {
                tracing::debug!(error = %e, "the pub/sub connection for loss notices is not up yet");
            }
        }
        Self {
            inner: Arc::new(Inner {
                renewer: Renewer::new(conn.clone(), hub.clone()),
                conn,
                hub,
                config,
            }),
        }
    }

    /// The keys of lock `name`, in the layout of this client's mode (see [`Keys::build`]).
    pub(crate) fn keys(&self, name: &str) -> Keys {
        Keys::build(self.prefix(), name, self.inner.conn.is_cluster())
    }

    /// Within how long a holder hears that the server removed its lock key (deleted, expired
    /// early, evicted): [`LOSS_NOTICE`] (200 ms) where the server sends keyspace notifications
    /// (`notify-keyspace-events` with `Kgxe`, found or turned on at connect) and this client may
    /// subscribe to them; `None` otherwise (`CONFIG` renamed or refused, an ACL without the
    /// lock keys' keyspace channels): then a holder hears at its next renewal (the keepalive renews every
    /// TTL/3) or [`check`](lockkit_core::Lease::check). Also
    /// [`Guarantees::loss_notice`]. While the pub/sub connection is down (until it is
    /// reopened, with backoff) holders hear at their next renewal too.
    pub fn loss_notice(&self) -> Option<Duration> {
        self.inner
            .hub
            .watch()
            .notifications()
            .then_some(LOSS_NOTICE)
    }

    /// How this client reaches Redis: one server, Sentinel or Cluster, as its URL said
    /// (`redis://`, `redis+sentinel://`, `redis+cluster://`). The guarantees depend on it (their
    /// notes, elections only outside Cluster); [`Lock::guarantees`](lockkit_core::Lock::guarantees)
    /// names it in [`Guarantees::mode`].
    pub fn mode(&self) -> RedisMode {
        self.inner.config.mode()
    }

    /// The key prefix of this client.
    pub fn prefix(&self) -> &str {
        &self.inner.config.prefix
    }

    /// The identity of lock `name` in its tokens ([`FencingToken::lock`]):
    /// `redis/{prefix}/{name}`.
    pub fn lock_id(&self, name: &str) -> String {
        // `push_str`, not `format!`: every grant's token carries one (callgrind,
        // `scripts/profile-redis.sh`).
        let prefix = self.prefix();
        let mut id = String::with_capacity(7 + prefix.len() + name.len());
        id.push_str("redis/");
        id.push_str(prefix);
        id.push('/');
        id.push_str(name);
        id
    }

    /// The Redis key holding lock `name` (its value is the holder's random owner value), for
    /// inspection and tests. Does not validate `name`.
    pub fn lock_key(&self, name: &str) -> String {
        self.keys(name).lock.clone()
    }

    /// The Redis key of the fence counter of lock `name` (never expires), for inspection.
    /// Does not validate `name`.
    pub fn fence_key(&self, name: &str) -> String {
        self.keys(name).fence.clone()
    }

    /// This client's hand-off channel (`P:client:ID`, subscribed on the waiters' pub/sub
    /// connection while anyone waits), for inspection and tests.
    pub fn waiter_channel(&self) -> &str {
        self.inner.hub.channel()
    }

    /// The Redis key of the waiters' queue of lock `name` (a sorted set of waiter IDs in
    /// arrival order), for inspection. Does not validate `name`.
    pub fn queue_key(&self, name: &str) -> String {
        self.keys(name).queue.clone()
    }

    /// One run of the acquire script for the call's current waiter ID, joining the queue if
    /// `route` is this ID's hand-off route.
    ///
    /// A grant whose reply came after its TTL (the lease would be lost on arrival) is undone and
    /// reported as [`Error::Unavailable`], so that the caller retries.
    ///
    /// An attempt that fails after its script may have run retires the ID (see [`Call`]), so
    /// that the caller can tell its own orphaned grant from another holder.
    ///
    /// Cancel safe: if the future is dropped (or the reply is lost) after the script may have
    /// run, the call's drop guard cleans up for this ID (see [`Call`]).
    async fn attempt(
        &self,
        call: &Call<Keys>,
        ttl: Duration,
        delay: Option<Duration>,
        route: Option<&Waiting>,
    ) -> Result<Attempt> {
        let keys = &call.keys;
        let (me, queue) = {
            let mut st = call.lock();
            st.armed = true;
            let queue = route.filter(|w| w.id() == st.me).is_some();
            (st.me.clone(), queue)
        };
        let channel = if queue {
            self.inner.hub.channel_for(keys).unwrap_or_default()
        } else {
            String::new()
        };
        let sent = Instant::now();
        let reply: (i64, i64, String, String) = match self
            .inner
            .conn
            .invoke(
                ACQUIRE
                    .key(&keys.lock)
                    .key(&keys.fence)
                    .key(&keys.queue)
                    .key(&keys.delay)
                    .key(keys.tombstone(&me))
                    .arg(&keys.waiter_prefix)
                    .arg(&me)
                    .arg(ttl_millis(ttl))
                    .arg(&channel)
                    .arg(ttl_millis(WAITER_TTL))
                    .arg(delay_px(ttl, delay)),
            )
            .await
        {
            Ok(r) => r,
            Err(e) => {
                // The script may have run: the old ID is cleaned up in the background.
                call.retire(&me);
                return Err(from_redis(e));
            }
        };
        match reply {
            (1, token, _, _) if token > 0 => {
                if let Err(e) = self.confirm(keys, &me, ttl, delay).await {
                    // Not replicated: give the grant back (the next waiter gets it).
                    if cancel_once(&self.inner.conn, keys, &me, ttl).await.is_ok() {
                        call.forget(&me);
                    } else {
                        call.retire(&me);
                    }
                    return Err(e);
                }
                let tracker = TrackerHandle::new(sent, ttl);
                if tracker.state() == LeaseState::Lost {
                    // Too late to be of use: undo it now (if that fails, the cleanup retries in
                    // the background) so that the retry does not find its own stale lock.
                    if cancel_once(&self.inner.conn, keys, &me, ttl).await.is_ok() {
                        call.forget(&me);
                    } else {
                        call.retire(&me);
                    }
                    return Err(Error::Unavailable {
                        backend: BACKEND,
                        source: format!(
                            "the grant arrived {:?} after the request, later than its TTL of \
                             {ttl:?}; it was given back",
                            sent.elapsed()
                        )
                        .into(),
                    });
                }
                Ok(Attempt::Granted {
                    token: token.unsigned_abs(),
                    owner: call.granted(),
                    tracker,
                })
            }
            (0, pttl, holder, seen) => {
                let mut st = call.lock();
                st.queued |= queue;
                st.armed = st.queued;
                if queue {
                    st.queued_at = Some(sent);
                }
                // A grant to us before this look would have shown here as ours: a hand-off
                // message with a token up to the counter seen now is stale (a lock handed to
                // this ID while it could not hear, that lapsed since).
                st.seen_token = st.seen_token.max(seen.parse().unwrap_or(0));
                Ok(Attempt::Held {
                    pttl: held_pttl(pttl),
                    holder,
                })
            }
            _ => {
                call.retire(&me);
                Err(bad_reply("acquire"))
            }
        }
    }

    /// With [`RedisConfig::min_replicas`]: waits until that many replicas acknowledged the grant
    /// of `keys` to `owner` (see `replicas.rs`); else nothing.
    ///
    /// # Errors
    /// As `replicas::confirm`: the caller gives the grant back.
    pub(crate) async fn confirm(
        &self,
        keys: &Keys,
        owner: &str,
        ttl: Duration,
        delay: Option<Duration>,
    ) -> Result<()> {
        let c = &self.inner.config;
        if c.min_replicas == 0 {
            return Ok(());
        }
        replicas::confirm(
            &self.inner.conn,
            keys,
            owner,
            ttl,
            delay,
            c.min_replicas,
            c.replica_timeout,
        )
        .await
    }

    /// The address (`host:port`) of the server this client sends its commands to now: in
    /// Sentinel mode the master the sentinels named last, for logs and tests.
    pub fn master_addr(&self) -> String {
        self.inner.conn.master_addr()
    }

    /// The lease of a grant with `token` to `owner`, renewed by this connection's batch when
    /// `opts.keepalive` is on.
    fn lease(
        &self,
        name: &str,
        keys: Keys,
        owner: String,
        token: u64,
        tracker: TrackerHandle,
        opts: &AcquireOptions,
    ) -> Lease {
        let ops = Arc::new(RedisLease {
            conn: self.inner.conn.clone(),
            name: name.to_owned(),
            keys,
            owner,
            batch: Mutex::new(None),
            watched: Mutex::new(None),
            self_renewing: opts.keepalive,
            delay: opts.effective_lock_delay(),
        });
        let watched = self.inner.hub.watch().register(&ops, &tracker);
        *ops.watched.lock().unwrap_or_else(|p| p.into_inner()) = Some(Box::new(watched));
        if opts.keepalive {
            // Registered once the lease exists: the renewer drops entries whose lease is gone.
            let batch = self.inner.renewer.register(Arc::downgrade(&ops), &tracker);
            if batch.is_none() {
                tracing::warn!(lock = %name, "no Tokio runtime: the lease will not be kept alive");
            }
            *ops.batch.lock().unwrap_or_else(|p| p.into_inner()) =
                batch.map(|b| Box::new(b) as Registration);
        }
        Lease::new(
            name,
            FencingToken::new(self.lock_id(name), token),
            tracker,
            ops,
            opts,
        )
    }
}

/// The holder's remaining TTL from the acquire script's `PTTL`: `None` for a key without expiry
/// (-1), zero for a key in its last millisecond (`PTTL` rounds down, so 0 means "expires now",
/// <https://redis.io/docs/latest/commands/pttl/>).
fn held_pttl(pttl: i64) -> Option<Duration> {
    u64::try_from(pttl).ok().map(Duration::from_millis)
}

enum Attempt {
    Granted {
        token: u64,
        owner: String,
        tracker: TrackerHandle,
    },
    Held {
        /// The holder's remaining TTL, if it has one.
        pttl: Option<Duration>,
        /// The holder's owner value.
        holder: String,
    },
}

/// How long a waiter sleeps when no release message comes: until just after the holder's expiry,
/// but never more than about [`MAX_WAIT_POLL`].
pub(crate) fn fallback_delay(pttl: Option<Duration>) -> Duration {
    let mut rng = rand::rng();
    let cap_ms = MAX_WAIT_POLL.as_millis() as u64;
    let cap = Duration::from_millis(cap_ms - rng.random_range(0..=cap_ms / 10));
    match pttl {
        Some(p) => {
            let jitter = rng.random_range(1..=EXPIRY_JITTER.as_millis() as u64);
            (p + Duration::from_millis(jitter)).min(cap)
        }
        None => cap,
    }
}

async fn handed(route: &mut Option<Waiting>) -> Option<u64> {
    match route {
        Some(w) => w.handed().await,
        None => std::future::pending().await,
    }
}

/// One sleep of a lock's or slot's waiter between two looks ([`Subscription::sleep`]) on `hub`
/// (subscribed for the slot of the lock `keys`, in Cluster mode; slots pass `None`):
/// woken by a hand-off on `route`, after `poll`, or at `deadline`. A queued waiter has the
/// pub/sub connection checked first ([`Hub::probe_while_waiting`]). A SUBSCRIBE that fails is
/// tried again after [`MAX_WAIT_POLL`] if the error is transient, else after
/// [`REFUSED_SUBSCRIBE_RETRY`] (and the hub is told of the refusal).
pub(crate) async fn wait_turn(
    subscription: &mut Subscription,
    hub: &Arc<Hub>,
    keys: Option<&Keys>,
    route: &mut Option<Waiting>,
    poll: Duration,
    deadline: Option<Instant>,
) -> Woken {
    let subscribe = || -> Subscribing {
        let (hub, keys) = (hub.clone(), keys.cloned());
        Box::pin(async move {
            match keys {
                Some(keys) => hub.ensure_for(&keys).await,
                None => hub.ensure().await,
            }
        })
    };
    let retry_after = |e: &Error| {
        if e.is_retryable() {
            MAX_WAIT_POLL
        } else {
            hub.refused(e);
            REFUSED_SUBSCRIBE_RETRY
        }
    };
    let queued = route.is_some();
    if queued {
        hub.probe_while_waiting();
    }
    subscription
        .sleep(
            queued,
            subscribe,
            handed(route),
            poll,
            deadline,
            retry_after,
        )
        .await
}

#[async_trait]
impl LockBackend for RedisLock {
    /// Acquires `name`: one atomic script takes the lock key if it is free and nobody queues
    /// before us, and bumps the fence counter; if it is held, the same script puts a waiting
    /// acquire at the end of the lock's queue.
    ///
    /// Waiters are served in queue order: a release hands the lock directly to the first live
    /// waiter and tells only that waiter's client (one `PUBLISH` on its own channel), so a
    /// waiter usually gets the lock with no request of its own. Before its first wait a client
    /// subscribes once to its channel (the first waiter of a `RedisLock` looks at the lock once
    /// more, queued, when that is confirmed). Waiters also look again just after the holder's
    /// TTL runs out (jittered by up to [`EXPIRY_JITTER`]) and at least every [`MAX_WAIT_POLL`],
    /// which keeps their place in the queue alive ([`WAITER_TTL`]) and covers lost messages.
    ///
    /// # Errors
    /// As [`Lock::acquire`](lockkit_core::Lock::acquire). [`Error::Backend`] if the fence counter key holds something that is
    /// not an integer (nothing is written then).
    ///
    /// # Cancel safety
    /// Cancel safe: if dropped (or timed out, or failed) while a script is in flight or while
    /// queued, a cleanup for the call's waiter ID is spawned: it leaves the queue, gives the lock
    /// to the next waiter (or deletes it) if the script took it or a release handed it over, and
    /// leaves a tombstone that stops a script of that ID arriving later (on another
    /// connection). It retries transient errors for the TTL (at least 60 s). Should the cleanup
    /// never get through, the waiter's place expires after [`WAITER_TTL`].
    async fn grant(&self, name: &str, opts: AcquireOptions) -> Result<Lease> {
        validate_name(name)?;
        opts.validate()?;
        let start = Instant::now();
        let deadline = wait_deadline(opts.wait, start);
        let delay = opts.effective_lock_delay();
        let keys = self.keys(name);
        let timeout = || Error::Timeout {
            name: name.to_owned(),
            waited: start.elapsed(),
        };
        let call = Call::new(self.inner.conn.clone(), keys.clone(), opts.ttl);
        let hub = &self.inner.hub;
        // The hand-off route of the current waiter ID, registered before the attempt that
        // queues, so that no hand-off is missed.
        let mut route: Option<Waiting> = None;
        // A SUBSCRIBE in progress goes on across sleeps, so that a slow or dead pub/sub
        // connection never delays a look at the lock.
        let mut subscription = Subscription::new(start);
        loop {
            if opts.wait != Wait::No {
                let me = call.me();
                if route.as_ref().is_none_or(|r| r.is_dead() || r.id() != me) {
                    route = hub.register_for(&me, &keys);
                }
            }
            let attempt = retry_transient(&opts, deadline, || {
                self.attempt(&call, opts.ttl, delay, route.as_ref())
            })
            .await?;
            let (pttl, in_delay) = match attempt {
                Attempt::Granted {
                    token,
                    owner,
                    tracker,
                } => return Ok(self.lease(name, keys, owner, token, tracker, &opts)),
                Attempt::Held { pttl, holder } => {
                    if call.is_retired(&holder) {
                        // An earlier attempt of this call timed out but took the lock after
                        // all: give it back and look again (never report it as Held).
                        if cancel_once(&self.inner.conn, &keys, &holder, opts.ttl)
                            .await
                            .is_ok()
                        {
                            call.unretire(&holder);
                            continue;
                        }
                    }
                    // No holder: a lapsed holder's lock-delay runs (nothing can be handed over).
                    (pttl, holder.is_empty())
                }
            };
            if opts.wait == Wait::No {
                return Err(Error::Held {
                    name: name.to_owned(),
                });
            }
            let mut poll = fallback_delay(pttl);
            if route.is_some() && !in_delay {
                // A handed-over lease counts from our last look: keep it recent (during a
                // lock-delay there is no holder to hand it over).
                poll = poll.min(opts.ttl / 4);
            }
            let woken = wait_turn(
                &mut subscription,
                hub,
                Some(&keys),
                &mut route,
                poll,
                deadline,
            )
            .await;
            match woken {
                Woken::Look => {}
                Woken::Deadline => {
                    call.clean_up_now().await;
                    return Err(timeout());
                }
                Woken::Handed(token) => {
                    let me = call.me();
                    let (queued_at, seen) = {
                        let st = call.lock();
                        (st.queued_at, st.seen_token)
                    };
                    let Some(queued_at) = queued_at else {
                        continue;
                    };
                    if token <= seen {
                        // Handed before our last look, which found the lock someone else's:
                        // that grant was lost (it lapsed, or the key was evicted) while we
                        // could not hear (the breaker's frozen waiter). Look again; never
                        // return it.
                        continue;
                    }
                    if route.as_ref().is_none_or(|r| r.id() != me) {
                        continue; // for a retired ID: its cleanup gives the lock on
                    }
                    let mut tracker = TrackerHandle::new(queued_at, opts.ttl);
                    if tracker.state() != LeaseState::Held {
                        // We last looked long ago (a short TTL): extend the handed lease from
                        // now rather than hand it out suspect or lost. If that fails, the next
                        // look finds out where the lock stands.
                        let sent = Instant::now();
                        let renewed =
                            compare_and_pexpire(&self.inner.conn, &keys, &me, opts.ttl, delay)
                                .await;
                        if !matches!(renewed, Ok(true)) {
                            continue;
                        }
                        tracker = TrackerHandle::new(sent, opts.ttl);
                    }
                    if self.confirm(&keys, &me, opts.ttl, delay).await.is_err() {
                        // Not replicated: give it back, and look again.
                        if cancel_once(&self.inner.conn, &keys, &me, opts.ttl)
                            .await
                            .is_ok()
                        {
                            call.forget(&me);
                        } else {
                            call.retire(&me);
                        }
                        continue;
                    }
                    let owner = call.granted();
                    return Ok(self.lease(name, keys, owner, token, tracker, &opts));
                }
            }
        }
    }

    fn guarantees(&self) -> Guarantees {
        // `Guarantees` is non-exhaustive: start from "nothing promised" and switch on.
        let mut g = Guarantees::new(BACKEND, LockKind::Efficiency);
        g.tokens_survive_restart = true;
        g.safe_across_failover = false;
        g.fifo_waiters = true;
        g.manual_renewal = true;
        g.lock_delay = true;
        g.expiry_slack = EXPIRY_SLACK;
        g.loss_notice = self.loss_notice();
        g.mode = Some(self.mode().name());
        g.notes = match self.mode() {
            RedisMode::Sentinel => crate::sentinel::NOTES,
            RedisMode::Cluster => crate::cluster::NOTES,
            RedisMode::Single => NOTES,
        };
        g
    }

    /// Reads the lock key's `PTTL` and the fence counter (the holder's token) in one script.
    ///
    /// # Errors
    /// As [`Lock::holder`](lockkit_core::Lock::holder); [`Error::Backend`] if the fence counter is not a number.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    async fn holder(&self, name: &str) -> Result<Option<HolderInfo>> {
        validate_name(name)?;
        let keys = self.keys(name);
        let (held, pttl, counter): (i64, i64, String) = self
            .inner
            .conn
            .invoke(HOLDER.key(&keys.lock).key(&keys.fence))
            .await
            .map_err(from_redis)?;
        if held == 0 {
            return Ok(None);
        }
        let token = match counter.as_str() {
            "" => None,
            c => Some(FencingToken::new(
                self.lock_id(name),
                c.parse().map_err(|_| bad_reply("holder"))?,
            )),
        };
        Ok(Some(HolderInfo::new(token, held_pttl(pttl))))
    }
}

/// What elections and semaphores (`slots.rs`) share with the lock: its command connection,
/// its waiters' pub/sub hub and its batched renewer.
impl RedisLock {
    pub(crate) fn conn(&self) -> &Conn {
        &self.inner.conn
    }

    pub(crate) fn hub(&self) -> &Arc<Hub> {
        &self.inner.hub
    }

    pub(crate) fn renewer(&self) -> &Arc<Renewer> {
        &self.inner.renewer
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fallback_is_bounded_and_follows_the_holder_ttl() {
        for _ in 0..1000 {
            let d = fallback_delay(None);
            assert!(d <= MAX_WAIT_POLL && d >= MAX_WAIT_POLL * 9 / 10, "{d:?}");
            let d = fallback_delay(Some(Duration::from_millis(30)));
            assert!(
                d > Duration::from_millis(30) && d <= Duration::from_millis(30) + EXPIRY_JITTER
            );
            assert!(fallback_delay(Some(Duration::from_secs(60))) <= MAX_WAIT_POLL);
        }
    }

    /// The notes users read (`lockkit guarantees`) give the durations in plain words: they must
    /// follow the constants.
    #[test]
    fn notes_name_the_durations_in_force() {
        assert_eq!(LOSS_NOTICE, Duration::from_millis(200));
        assert!(NOTES.contains("within 200 ms where"));
        assert_eq!(WAITER_TTL, Duration::from_secs(3));
        assert!(NOTES.contains("drops out after 3 s"));
    }
}
