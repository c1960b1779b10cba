//! [`RedisLock`]: the [`Lock`] implementation.

use std::fmt;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use async_trait::async_trait;
use rand::Rng;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{AsyncConnectionConfig, Script};
use tokio::time::Instant;

use lockkit_core::{
    AcquireOptions, Error, FencingToken, Guarantees, Lease, LeaseTracker, Lock, LockKind, Result,
    Wait, retry_transient, validate_name, wait_deadline,
};

use crate::config::RedisConfig;
use crate::error::{BACKEND, bad_reply, from_redis, timed_out};
use crate::lease::{RedisLease, compare_and_delete, ttl_millis};
use crate::waiters::{Hub, Subscription};

/// The longest a waiter sleeps without looking at the lock again, when no release message
/// arrives: about 1 s (jittered down by up to 10 %).
pub const MAX_WAIT_POLL: Duration = Duration::from_secs(1);

/// The most a waiter sleeps past the holder's expiry (reported by `PTTL`), as jitter so that
/// waiters of one lock do not all ask at the same instant: 20 ms.
pub const EXPIRY_JITTER: Duration = Duration::from_millis(20);

/// How much later than its TTL a lapsed lock may be granted to a waiter: [`EXPIRY_JITTER`] plus
/// a round trip on a busy machine. Declared as [`Guarantees::expiry_slack`].
pub const EXPIRY_SLACK: Duration = Duration::from_millis(50);

/// The acquire script. `KEYS[1]` lock key, `KEYS[2]` fence counter key; `ARGV[1]` owner value,
/// `ARGV[2]` TTL in ms.
///
/// Free lock: `SET NX PX` with our owner value, then the counter becomes
/// `max(counter + 1, TIME in µs)` and is returned as `{1, token}`. Held lock: `{0, PTTL}` (the
/// holder's remaining TTL in ms, or -1 for a key without expiry). The counter is checked before
/// anything is written, so a corrupt counter fails the script without taking the lock. Lua
/// numbers are doubles: tokens stay exact below 2^53 µs (the year 2255).
/// See <https://redis.io/docs/latest/commands/set/> and <https://redis.io/docs/latest/commands/time/>.
static ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local last = redis.call('GET', KEYS[2])
local counter = 0
if last then
  counter = tonumber(last)
  if not counter then
    return redis.error_reply('lockkit: the fence counter is not a number')
  end
end
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return {0, redis.call('PTTL', KEYS[1])}
end
local t = redis.call('TIME')
local token = tonumber(t[1]) * 1000000 + tonumber(t[2])
if counter + 1 > token then
  token = counter + 1
end
redis.call('SET', KEYS[2], string.format('%d', token))
return {1, token}
",
    )
});

const NOTES: &str = "efficiency lock on one Redis server. Tokens: a per-name counter that never \
expires, floored at the server's TIME in µs, so they keep increasing across restarts without \
persistence as long as the server's wall clock never steps backwards and the lock is granted \
fewer than once per µs on average. A failover to an asynchronously replicated replica can \
grant a held lock a second time.";

/// The keys and channel of one lock name. See the crate docs, "Keys".
#[derive(Debug, Clone)]
pub(crate) struct Keys {
    pub(crate) lock: String,
    pub(crate) fence: String,
    pub(crate) channel: String,
}

impl Keys {
    pub(crate) fn new(prefix: &str, name: &str) -> Self {
        Self {
            lock: format!("{prefix}:lock:{name}"),
            fence: format!("{prefix}:fence:{name}"),
            channel: format!("{prefix}:released:{name}"),
        }
    }
}

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
    conn: ConnectionManager,
    hub: Arc<Hub>,
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
    /// `connect_timeout_ms`, `response_timeout_ms`).
    ///
    /// ```no_run
    /// # async fn f() -> lockkit_core::Result<()> {
    /// let locks = lockkit_redis::RedisLock::connect("redis://:secret@127.0.0.1:6379/0?prefix=billing").await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// - [`Error::InvalidConfig`]: malformed URL or options (the URL is not echoed).
    /// - [`Error::Unavailable`]: the server did not answer within the connect timeout
    ///   (default 5 s), refused the connection, or is loading.
    /// - [`Error::Auth`]: wrong user name or password, or a password is required.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future closes whatever connection it opened.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::with_config(RedisConfig::from_url(url)?).await
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
    pub async fn with_config(config: RedisConfig) -> Result<Self> {
        config.validate()?;
        #[cfg(feature = "tls")]
        {
            // The redis crate builds its rustls config from the process-wide provider. Install
            // ring unless the application installed one already (then this is a no-op).
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let client = match &config.tls_root_cert {
            None => redis::Client::open(config.connection_info()?),
            #[cfg(feature = "tls")]
            Some(pem) => redis::Client::build_with_tls(
                config.connection_info()?,
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem.clone()),
                },
            ),
            #[cfg(not(feature = "tls"))]
            Some(_) => {
                return Err(Error::config(
                    "TLS needs lockkit-redis's Cargo feature \"tls\" (on by default)",
                ));
            }
        }
        .map_err(from_redis)?;
        let ct = config.connect_timeout;
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
            Ok(Err(e)) => return Err(from_redis(e)),
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
            ConnectionManager::new_with_config(client.clone(), manager),
        )
        .await
        {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(from_redis(e)),
            Err(_) => return Err(timed_out("connecting to redis", ct)),
        };
        Ok(Self {
            inner: Arc::new(Inner {
                conn,
                hub: Hub::new(client, ct),
                config,
            }),
        })
    }

    /// The key prefix of this client.
    pub fn prefix(&self) -> &str {
        &self.inner.config.prefix
    }

    /// The Redis key holding lock `name` (its value is the holder's random owner value), for
    /// inspection and tests. Does not validate `name`.
    pub fn lock_key(&self, name: &str) -> String {
        Keys::new(self.prefix(), name).lock
    }

    /// The Redis key of the fence counter of lock `name` (never expires), for inspection.
    /// Does not validate `name`.
    pub fn fence_key(&self, name: &str) -> String {
        Keys::new(self.prefix(), name).fence
    }

    /// One run of the acquire script with a fresh owner value.
    ///
    /// Cancel safe: if the future is dropped (or the reply is lost) after the script may have
    /// run, a drop guard spawns a compare-and-delete for this owner value.
    async fn attempt(&self, keys: &Keys, ttl_ms: u64) -> Result<Attempt> {
        let owner = format!("{:032x}", rand::random::<u128>());
        let mut guard = InFlight {
            conn: self.inner.conn.clone(),
            keys: keys.clone(),
            owner,
            armed: true,
        };
        let mut conn = self.inner.conn.clone();
        let sent = Instant::now();
        let reply: (i64, i64) = ACQUIRE
            .key(&keys.lock)
            .key(&keys.fence)
            .arg(&guard.owner)
            .arg(ttl_ms)
            .invoke_async(&mut conn)
            .await
            // The script may have run: the guard stays armed and cleans up.
            .map_err(from_redis)?;
        match reply {
            (1, token) if token > 0 => {
                guard.armed = false;
                Ok(Attempt::Granted {
                    token: token.unsigned_abs(),
                    owner: std::mem::take(&mut guard.owner),
                    sent,
                })
            }
            (0, pttl) => {
                guard.armed = false;
                let pttl = u64::try_from(pttl).ok().filter(|&ms| ms > 0);
                Ok(Attempt::Held {
                    pttl: pttl.map(Duration::from_millis),
                })
            }
            _ => Err(bad_reply("acquire")),
        }
    }
}

enum Attempt {
    Granted {
        token: u64,
        owner: String,
        sent: Instant,
    },
    Held {
        /// The holder's remaining TTL, if it has one.
        pttl: Option<Duration>,
    },
}

/// Armed while an acquire script is in flight: on drop it spawns a compare-and-delete of its
/// owner value, so a cancelled acquire leaves no lock behind.
struct InFlight {
    conn: ConnectionManager,
    keys: Keys,
    owner: String,
    armed: bool,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return; // no runtime: the TTL frees the lock
        };
        let conn = self.conn.clone();
        let keys = self.keys.clone();
        let owner = std::mem::take(&mut self.owner);
        rt.spawn(async move {
            match compare_and_delete(&conn, &keys.lock, &owner, &keys.channel).await {
                Ok(true) => {
                    tracing::debug!(key = %keys.lock, "removed the lock of a cancelled acquire")
                }
                Ok(false) => {}
                Err(e) => tracing::debug!(key = %keys.lock, error = %e,
                    "cleanup of a cancelled acquire failed; the TTL will free the lock"),
            }
        });
    }
}

/// How long a waiter sleeps when no release message comes: until just after the holder's expiry,
/// but never more than about [`MAX_WAIT_POLL`].
fn fallback_delay(pttl: Option<Duration>) -> Duration {
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

async fn released(sub: &mut Option<Subscription>) {
    match sub {
        Some(s) => s.released().await,
        None => std::future::pending().await,
    }
}

async fn until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

#[async_trait]
impl Lock for RedisLock {
    /// Acquires `name`: one atomic script sets the lock key if it is free and bumps the fence
    /// counter.
    ///
    /// A waiting acquire subscribes to the lock's release channel before the attempt that finds
    /// it held, then sleeps until a release message arrives, the holder's TTL runs out (jittered
    /// by up to [`EXPIRY_JITTER`]) or [`MAX_WAIT_POLL`] passes, whichever comes first. Waiters
    /// are not served in FIFO order.
    ///
    /// # Errors
    /// As [`Lock::acquire`]. [`Error::Backend`] if the fence counter key holds something that is
    /// not a number (nothing is written then).
    ///
    /// # Cancel safety
    /// Cancel safe: if dropped while the acquire script is in flight, a compare-and-delete for
    /// this attempt's owner value is spawned (it runs after the script on the same connection);
    /// a dropped waiter's subscription is removed in the background.
    async fn acquire(&self, name: &str, opts: AcquireOptions) -> Result<Lease> {
        validate_name(name)?;
        opts.validate()?;
        let start = Instant::now();
        let deadline = wait_deadline(opts.wait, start);
        let keys = Keys::new(self.prefix(), name);
        let ttl_ms = ttl_millis(opts.ttl);
        let timeout = || Error::Timeout {
            name: name.to_owned(),
            waited: start.elapsed(),
        };
        let mut sub: Option<Subscription> = None;
        let mut next_subscribe = start;
        loop {
            let attempt = retry_transient(&opts, deadline, || self.attempt(&keys, ttl_ms)).await?;
            let pttl = match attempt {
                Attempt::Granted { token, owner, sent } => {
                    let ops = Arc::new(RedisLease {
                        conn: self.inner.conn.clone(),
                        name: name.to_owned(),
                        lock_key: keys.lock,
                        channel: keys.channel,
                        owner,
                    });
                    let tracker = LeaseTracker::new(sent, opts.ttl);
                    return Ok(Lease::new(
                        name,
                        FencingToken::new(token),
                        tracker,
                        ops,
                        &opts,
                    ));
                }
                Attempt::Held { pttl } => pttl,
            };
            if opts.wait == Wait::No {
                return Err(Error::Held {
                    name: name.to_owned(),
                });
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Err(timeout());
            }
            if sub.as_ref().is_some_and(Subscription::is_dead) {
                sub = None;
            }
            if sub.is_none() && now >= next_subscribe {
                let subscribed = tokio::select! {
                    s = self.inner.hub.subscribe(&keys.channel) => s,
                    _ = until(deadline) => return Err(timeout()),
                };
                match subscribed {
                    Ok(s) => {
                        sub = Some(s);
                        // Subscribed: look again before sleeping, so a release between the
                        // last attempt and the subscription is not missed.
                        continue;
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "cannot subscribe to release messages; polling");
                        next_subscribe = Instant::now() + MAX_WAIT_POLL;
                    }
                }
            }
            let poll = fallback_delay(pttl);
            tokio::select! {
                _ = released(&mut sub) => {}
                _ = tokio::time::sleep(poll) => {}
                _ = until(deadline) => return Err(timeout()),
            }
        }
    }

    fn guarantees(&self) -> Guarantees {
        // `Guarantees` is non-exhaustive: start from "nothing promised" and switch on.
        let mut g = Guarantees::new(BACKEND, LockKind::Efficiency);
        g.tokens_survive_restart = true;
        g.safe_across_failover = false;
        g.fifo_waiters = false;
        g.manual_renewal = true;
        g.expiry_slack = EXPIRY_SLACK;
        g.notes = NOTES;
        g
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_distinct_and_keep_the_name_verbatim() {
        let k = Keys::new("app", "a:lock:b *?[x]");
        assert_eq!(k.lock, "app:lock:a:lock:b *?[x]");
        assert_eq!(k.fence, "app:fence:a:lock:b *?[x]");
        assert_eq!(k.channel, "app:released:a:lock:b *?[x]");
        assert_ne!(Keys::new("app", "x").lock, Keys::new("app", "x ").lock);
    }

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
}
