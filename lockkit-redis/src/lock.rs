//! [`RedisLock`]: the [`Lock`] implementation.

use std::fmt;
use std::pin::Pin;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use rand::Rng;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{AsyncConnectionConfig, Script};
use tokio::time::Instant;

use lockkit_core::backend::{retry_transient, validate_name, wait_deadline};
use lockkit_core::{
    AcquireOptions, Error, FencingToken, Guarantees, Lease, LeaseState, LeaseTracker, Lock,
    LockKind, Result, Wait,
};

use crate::config::{RedisConfig, TlsFiles, connect_error};
use crate::conn::Conn;
use crate::error::{BACKEND, bad_reply, from_redis, timed_out};
use crate::lease::{RedisLease, cancel_attempt, cancel_once, ttl_millis};
use crate::waiters::{Hub, Subscription};

/// The longest a waiter sleeps without looking at the lock again, when no release message
/// arrives: about 1 s (jittered down by up to 10 %).
pub const MAX_WAIT_POLL: Duration = Duration::from_secs(1);

/// The most a waiter sleeps past the holder's expiry (reported by `PTTL`), as jitter so that
/// waiters of one lock do not all ask at the same instant: 20 ms.
pub const EXPIRY_JITTER: Duration = Duration::from_millis(20);

/// How long a waiter polls without trying to subscribe again after the server refused its
/// SUBSCRIBE (for instance an ACL user without permission for the channel): 30 s.
const REFUSED_SUBSCRIBE_RETRY: Duration = Duration::from_secs(30);

/// How much later than its TTL a lapsed lock may be granted to a waiter: [`EXPIRY_JITTER`] plus
/// a round trip on a busy machine. Declared as [`Guarantees::expiry_slack`].
pub const EXPIRY_SLACK: Duration = Duration::from_millis(50);

/// The acquire script. `KEYS[1]` lock key, `KEYS[2]` fence counter key, `KEYS[3]` this
/// attempt's tombstone key; `ARGV[1]` owner value, `ARGV[2]` TTL in ms.
///
/// A tombstone means the attempt was cancelled and its cleanup ran first (it came on another
/// connection): `{2, 0, ''}`, nothing taken. Free lock: `SET NX PX` with our owner value, then
/// the counter becomes `max(counter + 1, TIME in µs)` and is returned as `{1, token, ''}`. Held
/// lock: `{0, PTTL, holder}` (the holder's remaining TTL in ms, or -1 for a key without expiry,
/// and its owner value). The counter is checked before
/// anything is written, so a corrupt counter fails the script without taking the lock. Lua
/// numbers are doubles: tokens stay exact below 2^53 µs (the year 2255).
/// See <https://redis.io/docs/latest/commands/set/> and <https://redis.io/docs/latest/commands/time/>.
static ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('EXISTS', KEYS[3]) == 1 then
  return {2, 0, ''}
end
local last = redis.call('GET', KEYS[2])
local counter = 0
if last then
  counter = tonumber(last)
  if not counter then
    return redis.error_reply('lockkit: the fence counter is not a number')
  end
end
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return {0, redis.call('PTTL', KEYS[1]), redis.call('GET', KEYS[1])}
end
local t = redis.call('TIME')
local token = tonumber(t[1]) * 1000000 + tonumber(t[2])
if counter + 1 > token then
  token = counter + 1
end
redis.call('SET', KEYS[2], string.format('%d', token))
return {1, token, ''}
",
    )
});

const NOTES: &str = "efficiency lock on one Redis server. Tokens: a per-name counter that never \
expires, floored at the server's TIME in µs, so they keep increasing across restarts without \
persistence as long as the server's wall clock never steps backwards and the lock is granted \
fewer than once per µs on average. A failover to an asynchronously replicated replica can \
grant a held lock a second time, and so can a restart that loses the data: a waiter may get the \
lock while the old holder still reads Held until its next renewal (up to TTL/3 later). Fence \
counters are never deleted: one small key per lock name ever used.";

/// The keys and channel of one lock name. See the crate docs, "Keys".
#[derive(Debug, Clone)]
pub(crate) struct Keys {
    pub(crate) lock: String,
    pub(crate) fence: String,
    pub(crate) channel: String,
    /// `P:cancelled:`, to which an attempt's owner value is appended for its tombstone.
    cancelled: String,
}

impl Keys {
    pub(crate) fn new(prefix: &str, name: &str) -> Self {
        Self {
            lock: format!("{prefix}:lock:{name}"),
            fence: format!("{prefix}:fence:{name}"),
            channel: format!("{prefix}:released:{name}"),
            cancelled: format!("{prefix}:cancelled:"),
        }
    }

    /// The tombstone key of a cancelled acquire attempt with `owner` value. The lock name is
    /// not in it: `P:cancelled:OWNER`, a kind of its own.
    pub(crate) fn tombstone(&self, owner: &str) -> String {
        format!("{}{owner}", self.cancelled)
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
    conn: Conn,
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
    ///   number the server does not have.
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
        let ct = config.connect_timeout;
        let files = match tokio::time::timeout(ct, config.tls_files()).await {
            Ok(r) => r?,
            Err(_) => return Err(timed_out("reading the TLS files", ct)),
        };
        let client = match files {
            TlsFiles {
                root: None,
                client: None,
            } => redis::Client::open(config.connection_info()?),
            #[cfg(feature = "tls")]
            TlsFiles { root, client } => redis::Client::build_with_tls(
                config.connection_info()?,
                redis::TlsCertificates {
                    client_tls: client.map(|(client_cert, client_key)| redis::ClientTlsConfig {
                        client_cert,
                        client_key,
                    }),
                    root_cert: root,
                },
            ),
            #[cfg(not(feature = "tls"))]
            _ => {
                return Err(Error::config(
                    "TLS needs lockkit-redis's Cargo feature \"tls\" (on by default)",
                ));
            }
        }
        .map_err(|e| {
            Error::config_with("cannot use the TLS files (tls_ca, tls_cert, tls_key)", e)
        })?;
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
        Ok(Self {
            inner: Arc::new(Inner {
                conn: Conn::new(client.clone(), manager, conn),
                hub: Hub::new(client, ct, rt),
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
    /// A grant whose reply came after its TTL (the lease would be lost on arrival) is undone and
    /// reported as [`Error::Unavailable`], so that the caller retries.
    ///
    /// An attempt that fails after its script may have run adds its owner value to
    /// `abandoned`, so that the caller can tell its own orphaned grant from another holder.
    ///
    /// Cancel safe: if the future is dropped (or the reply is lost) after the script may have
    /// run, a drop guard spawns a cleanup for this owner value (see [`cancel_attempt`]).
    async fn attempt(
        &self,
        keys: &Keys,
        ttl: Duration,
        abandoned: &Mutex<Vec<String>>,
    ) -> Result<Attempt> {
        let owner = format!("{:032x}", rand::random::<u128>());
        let tombstone = keys.tombstone(&owner);
        let sent = Instant::now();
        let mut guard = InFlight {
            conn: self.inner.conn.clone(),
            keys: keys.clone(),
            owner,
            sent,
            ttl,
            armed: true,
        };
        let reply: (i64, i64, String) = match self
            .inner
            .conn
            .invoke(
                ACQUIRE
                    .key(&keys.lock)
                    .key(&keys.fence)
                    .key(&tombstone)
                    .arg(&guard.owner)
                    .arg(ttl_millis(ttl)),
            )
            .await
        {
            Ok(r) => r,
            Err(e) => {
                // The script may have run: the guard stays armed and cleans up.
                locked(abandoned).push(guard.owner.clone());
                return Err(from_redis(e));
            }
        };
        match reply {
            (1, token, _) if token > 0 => {
                let tracker = LeaseTracker::new(sent, ttl);
                if tracker.state() == LeaseState::Lost {
                    // Too late to be of use: undo it now (if that fails, the guard retries in
                    // the background) so that the retry does not find its own stale lock.
                    if cancel_once(&self.inner.conn, keys, &guard.owner, ttl)
                        .await
                        .is_ok()
                    {
                        guard.armed = false;
                    } else {
                        locked(abandoned).push(guard.owner.clone());
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
                guard.armed = false;
                Ok(Attempt::Granted {
                    token: token.unsigned_abs(),
                    owner: std::mem::take(&mut guard.owner),
                    tracker,
                })
            }
            (0, pttl, holder) => {
                guard.armed = false;
                Ok(Attempt::Held {
                    pttl: held_pttl(pttl),
                    holder,
                })
            }
            _ => Err(bad_reply("acquire")),
        }
    }
}

fn locked(m: &Mutex<Vec<String>>) -> MutexGuard<'_, Vec<String>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
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
        tracker: LeaseTracker,
    },
    Held {
        /// The holder's remaining TTL, if it has one.
        pttl: Option<Duration>,
        /// The holder's owner value.
        holder: String,
    },
}

/// Armed while an acquire script is in flight: on drop it spawns [`cancel_attempt`] for its
/// owner value, so a cancelled acquire leaves no lock behind.
struct InFlight {
    conn: Conn,
    keys: Keys,
    owner: String,
    sent: Instant,
    ttl: Duration,
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
        rt.spawn(cancel_attempt(
            self.conn.clone(),
            self.keys.clone(),
            std::mem::take(&mut self.owner),
            self.sent,
            self.ttl,
        ));
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

type Subscribing = Pin<Box<dyn Future<Output = Result<Subscription>> + Send>>;

async fn subscribed(f: &mut Option<Subscribing>) -> Result<Subscription> {
    match f {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}

/// What ended a waiter's sleep.
enum Woken {
    Subscribed(Result<Subscription>),
    Look,
    Deadline,
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
    /// Cancel safe: if dropped while the acquire script is in flight, a cleanup for this
    /// attempt's owner value is spawned: it deletes the lock if the script took it, or else
    /// leaves a tombstone that stops the script if it arrives later (on another connection),
    /// and it retries transient errors for the TTL (at least 60 s). A dropped waiter's
    /// subscription is removed in the background.
    async fn acquire(&self, name: &str, opts: AcquireOptions) -> Result<Lease> {
        validate_name(name)?;
        opts.validate()?;
        let start = Instant::now();
        let deadline = wait_deadline(opts.wait, start);
        let keys = Keys::new(self.prefix(), name);
        let timeout = || Error::Timeout {
            name: name.to_owned(),
            waited: start.elapsed(),
        };
        // Owner values of this call's attempts that failed after their script may have run.
        let abandoned = Mutex::new(Vec::new());
        let mut sub: Option<Subscription> = None;
        // A SUBSCRIBE in progress: it goes on across sleeps, so that a slow or dead pub/sub
        // connection never delays a look at the lock.
        let mut subscribing: Option<Subscribing> = None;
        let mut next_subscribe = start;
        loop {
            let attempt = retry_transient(&opts, deadline, || {
                self.attempt(&keys, opts.ttl, &abandoned)
            })
            .await?;
            let pttl = match attempt {
                Attempt::Granted {
                    token,
                    owner,
                    tracker,
                } => {
                    let ops = Arc::new(RedisLease {
                        conn: self.inner.conn.clone(),
                        name: name.to_owned(),
                        lock_key: keys.lock,
                        channel: keys.channel,
                        owner,
                    });
                    return Ok(Lease::new(
                        name,
                        FencingToken::new(token),
                        tracker,
                        ops,
                        &opts,
                    ));
                }
                Attempt::Held { pttl, holder } => {
                    if locked(&abandoned).contains(&holder) {
                        // An earlier attempt of this call timed out but took the lock after
                        // all: give it back and look again (never report it as Held).
                        if cancel_once(&self.inner.conn, &keys, &holder, opts.ttl)
                            .await
                            .is_ok()
                        {
                            locked(&abandoned).retain(|o| *o != holder);
                            continue;
                        }
                    }
                    pttl
                }
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
            if sub.is_none() && subscribing.is_none() && now >= next_subscribe {
                let hub = self.inner.hub.clone();
                let channel = keys.channel.clone();
                subscribing = Some(Box::pin(async move { hub.subscribe(&channel).await }));
            }
            let poll = fallback_delay(pttl);
            let woken = tokio::select! {
                s = subscribed(&mut subscribing) => Woken::Subscribed(s),
                _ = released(&mut sub) => Woken::Look,
                _ = tokio::time::sleep(poll) => Woken::Look,
                _ = until(deadline) => Woken::Deadline,
            };
            match woken {
                Woken::Look => {}
                Woken::Deadline => return Err(timeout()),
                // Subscribed: look again before sleeping, so a release between the last
                // attempt and the subscription is not missed.
                Woken::Subscribed(Ok(s)) => {
                    subscribing = None;
                    sub = Some(s);
                }
                Woken::Subscribed(Err(e)) => {
                    subscribing = None;
                    next_subscribe = Instant::now()
                        + if e.is_retryable() {
                            MAX_WAIT_POLL
                        } else {
                            self.inner.hub.refused(&e);
                            REFUSED_SUBSCRIBE_RETRY
                        };
                }
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
