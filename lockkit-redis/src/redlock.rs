//! Redlock: one lock over N independent Redis masters, granted by a majority within the
//! validity time (<https://redis.io/docs/latest/develop/use/patterns/distributed-locks/>), with
//! fencing tokens written back to a majority before a grant returns, and the delayed restart
//! of a node that lost its data. See the crate docs, "Redlock", and docs/redlock.md.

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{AsyncConnectionConfig, Script};
use tokio::time::Instant;

use lockkit_core::backend::{
    Backoff, LeaseOps, LockBackend, TrackerHandle, retry_transient, validate_name, wait_deadline,
};
use lockkit_core::{
    AcquireOptions, Error, FencingToken, Guarantees, HolderInfo, Lease, LockKind, Result, Wait,
    drift_margin,
};

use crate::config::{RedisConfig, connect_error};
use crate::conn::Conn;
use crate::core::{Keys, compare_and_delete, compare_and_pexpire, holds, ttl_millis};
use crate::error::{bad_reply, from_redis, timed_out};
use crate::redlock_config::RedlockConfig;

/// The backend name of Redlock in errors, tokens and [`Guarantees`]: `redlock`.
const REDLOCK: &str = "redlock";

/// The node-wide key holding, in ms of the node's `TIME`, when the node (re)started as far as
/// Redlock knows: created by the first Redlock script that finds it missing (a new node, or one
/// restarted without its data). A node votes only from this instant + the client's `max_ttl`
/// on. Outside every prefix (a prefix has no `:`, and no lock key is `P:boot`), shared by all
/// prefixes, because a restart affects them all.
pub const REDLOCK_BOOT_KEY: &str = "lockkit-redlock:boot";

/// The longest pause between two looks of a waiting acquire (it backs off with jitter from
/// 10 ms up to this, or sleeps until the holder's keys expire if that is sooner): 250 ms.
pub const REDLOCK_MAX_POLL: Duration = Duration::from_millis(250);

/// How long after its TTL a lapsed holder's lock is taken by a waiter at most: its keys expire
/// on the nodes at the TTL (rounded up to the ms), and a waiter looks at least every
/// [`REDLOCK_MAX_POLL`] (twice that with jitter), then needs one round trip: 550 ms.
pub const REDLOCK_EXPIRY_SLACK: Duration = Duration::from_millis(550);

/// One node's vote. `KEYS[1]` lock key, `KEYS[2]` fence key, `KEYS[3]` [`REDLOCK_BOOT_KEY`];
/// `ARGV[1]` owner value, `ARGV[2]` TTL in ms, `ARGV[3]` max TTL in ms. Returns
/// `{1, counter}` (granted: `SET NX PX`, and the node's fence counter, never below its `TIME`
/// in µs), `{0, pttl}` (held by another), or `{2, ms}` (the node is in its delayed restart for
/// `ms` more).
static VOTE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local boot = tonumber(redis.call('GET', KEYS[3]))
if not boot then
  boot = now
  redis.call('SET', KEYS[3], string.format('%.0f', now))
end
local left = boot + tonumber(ARGV[3]) - now
if left > 0 then
  return {2, string.format('%.0f', left)}
end
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return {0, tostring(redis.call('PTTL', KEYS[1]))}
end
local floor = tonumber(t[1]) * 1000000 + tonumber(t[2])
local c = tonumber(redis.call('GET', KEYS[2])) or 0
if c < floor then c = floor end
return {1, string.format('%.0f', c)}
",
    )
});

/// The write-back of a grant's token. `KEYS[1]` fence key; `ARGV[1]` the token. Sets the
/// counter to the token unless it is larger already; returns 1.
static WRITE_BACK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local c = tonumber(redis.call('GET', KEYS[1])) or 0
if c < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]) end
return 1
",
    )
});

/// A read of the holder. `KEYS[1]` lock key, `KEYS[2]` fence key. Returns `{owner, pttl,
/// counter}` (`owner` empty when the lock key does not exist).
static READ: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local v = redis.call('GET', KEYS[1])
local c = redis.call('GET', KEYS[2]) or '0'
if not v then return {'', '-2', c} end
return {v, tostring(redis.call('PTTL', KEYS[1])), c}
",
    )
});

const NOTES: &str = "efficiency lock over N independent Redis masters (Redlock): granted by a \
majority within the validity time (TTL − elapsed since the first request − drift), renewed on a \
majority, lost when a majority cannot be renewed. Tokens: max of the granting nodes' counters + 1, \
written back to a majority before the grant returns, each counter never below its node's TIME in \
µs. A node restarted without its data votes again only after max_ttl (delayed restart). Relies on \
bounded clock drift, pauses and network delays for mutual exclusion (Kleppmann's critique, \
docs/redlock.md): fence the resource. No FIFO: waiters poll with backoff and jitter.";

/// A lock service over N independent Redis masters: the Redlock algorithm
/// (<https://redis.io/docs/latest/develop/use/patterns/distributed-locks/>), an **efficiency**
/// lock (see [`Guarantees`], the crate docs, "Redlock", and docs/redlock.md).
///
/// ```no_run
/// # async fn f() -> lockkit_core::Result<()> {
/// use lockkit_core::{Lock, LockExt};
/// let locks = lockkit_redis::RedlockLock::connect(
///     "redlock://:secret@10.0.0.1:6379,10.0.0.2:6379,10.0.0.3:6379,10.0.0.4:6379,10.0.0.5:6379",
/// )
/// .await?;
/// let lease = locks.try_acquire("job", std::time::Duration::from_secs(10)).await?;
/// lease.release().await?;
/// # Ok(()) }
/// ```
///
/// Elections and semaphores are not offered on Redlock ([`lockkit`](https://docs.rs/lockkit)'s
/// `connect_election` and `connect_semaphore` return [`Error::NotSupported`]).
///
/// Cheap to clone: clones share one connection per node.
#[derive(Clone)]
pub struct RedlockLock {
    inner: Arc<Inner>,
}

struct Inner {
    nodes: Vec<Node>,
    config: RedlockConfig,
    /// Per-node reply timeout.
    response_timeout: Duration,
}

struct Node {
    addr: String,
    conn: Conn,
}

impl fmt::Debug for RedlockLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedlockLock")
            .field("config", &self.inner.config)
            .finish()
    }
}

/// One node's answer to a vote.
enum Vote {
    Granted(u64),
    Held(Duration),
    Restarting(Duration),
}

impl RedlockLock {
    /// Connects to the nodes of a `redlock://` or `redlocks://` URL (see
    /// [`RedlockConfig::from_url`]).
    ///
    /// # Errors
    /// As [`connect_with`](Self::connect_with), and [`Error::InvalidConfig`] for a bad URL.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future closes whatever connections it opened.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_with(RedlockConfig::from_url(url)?).await
    }

    /// Connects with a [`RedlockConfig`]: every node is asked (`PING`, in parallel, each within
    /// its connect timeout); a majority must answer. Nodes that do not answer are used as they
    /// come back (each node's connection reconnects by itself).
    ///
    /// Every node's answer is waited for, so that two names of one server are found (see
    /// `# Errors`): a node that accepts connections but does not answer (stopped, or
    /// overloaded) holds the connect up for the whole connect timeout (default 5 s; set
    /// `connect_timeout` lower to shorten it), then is named (`host:port`) in a
    /// `tracing::warn!` "a redlock node did not answer at connect". Acquires, renewals and
    /// releases do not wait for such nodes once a majority has answered.
    ///
    /// # Errors
    /// - [`Error::InvalidConfig`]: a bad config, unreadable TLS files, or two nodes that are one
    ///   server (the same `run_id`).
    /// - [`Error::Auth`]: a node refused the credentials or the TLS certificate.
    /// - [`Error::Unavailable`]: fewer than a majority of the nodes answered; the message says
    ///   how many.
    ///
    /// # Cancel safety
    /// Cancel safe, as [`connect`](Self::connect).
    pub async fn connect_with(config: RedlockConfig) -> Result<Self> {
        config.validate()?;
        #[cfg(feature = "tls")]
        {
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let opened = futures_util::future::join_all(config.nodes.iter().map(open_node)).await;
        let mut nodes = Vec::with_capacity(opened.len());
        let mut answered = 0;
        let mut last_down = None;
        let mut seen: Vec<(String, &str)> = Vec::new();
        for (res, addr) in opened.into_iter().zip(&config.addrs) {
            let (conn, up) = res?;
            match up {
                Ok(run_id) => {
                    answered += 1;
                    if let Some(id) = run_id {
                        if let Some((_, first)) = seen.iter().find(|(seen, _)| *seen == id) {
                            return Err(Error::config(format!(
                                "the redlock nodes {first} and {addr} are the same Redis server \
                                 (one run_id): the nodes must be independent"
                            )));
                        }
                        seen.push((id, addr));
                    }
                }
                Err(e) => {
                    tracing::warn!(node = %addr, error = %e, "a redlock node did not answer at connect");
                    last_down = Some(e);
                }
            }
            nodes.push(Node {
                addr: addr.clone(),
                conn,
            });
        }
        let q = config.quorum();
        if answered < q {
            return Err(Error::Unavailable {
                backend: REDLOCK,
                source: format!(
                    "only {answered} of {} redlock nodes answered at connect; a majority ({q}) is \
                     needed (last error: {})",
                    nodes.len(),
                    last_down.map_or_else(String::new, |e| e.to_string())
                )
                .into(),
            });
        }
        let response_timeout = config
            .nodes
            .iter()
            .map(RedisConfig::get_response_timeout)
            .max()
            .unwrap_or(crate::DEFAULT_RESPONSE_TIMEOUT);
        Ok(Self {
            inner: Arc::new(Inner {
                nodes,
                config,
                response_timeout,
            }),
        })
    }

    /// The config.
    pub fn config(&self) -> &RedlockConfig {
        &self.inner.config
    }

    /// The lock identity of `name` in tokens: `redlock/{prefix}/{name}`.
    pub fn lock_id(&self, name: &str) -> String {
        format!("{REDLOCK}/{}/{name}", self.inner.config.get_prefix())
    }

    /// One attempt: a vote on every node, then the token write-back.
    async fn attempt(&self, name: &str, opts: &AcquireOptions) -> Result<Attempted> {
        let inner = &self.inner;
        let keys = Keys::new(inner.config.get_prefix(), name);
        let owner = format!("{:032x}", rand::random::<u128>());
        let mut pending = Pending {
            inner: inner.clone(),
            keys: keys.clone(),
            owner: owner.clone(),
            armed: true,
        };
        let (n, q) = (inner.nodes.len(), inner.config.quorum());
        let ttl_ms = ttl_millis(opts.ttl);
        let max_ms = ttl_millis(inner.config.max_ttl);
        let sent = Instant::now();
        let votes = inner
            .gather(
                |conn| {
                    let (keys, owner) = (keys.clone(), owner.clone());
                    async move {
                        let (code, v): (i64, String) = conn
                            .invoke(
                                VOTE.key(&keys.lock)
                                    .key(&keys.fence)
                                    .key(REDLOCK_BOOT_KEY)
                                    .arg(&owner)
                                    .arg(ttl_ms)
                                    .arg(max_ms),
                            )
                            .await
                            .map_err(from_redis)?;
                        let num = v.parse::<i64>().map_err(|_| bad_reply("redlock vote"))?;
                        let ms = Duration::from_millis(num.max(0).unsigned_abs());
                        match code {
                            1 => Ok(Vote::Granted(num.max(0).unsigned_abs())),
                            0 => Ok(Vote::Held(ms)),
                            2 => Ok(Vote::Restarting(ms)),
                            _ => Err(bad_reply("redlock vote")),
                        }
                    }
                },
                // Done on success, or once the answers so far decide the failure (no majority can
                // grant, and the nodes yet to answer cannot make it "no majority can vote"): a
                // stopped node does not hold a refused attempt up for the response timeout.
                |answers| {
                    let count = |f: fn(&Option<Result<Vote>>) -> bool| {
                        answers.iter().filter(|a| f(a)).count()
                    };
                    let granted = count(|a| matches!(a, Some(Ok(Vote::Granted(_)))));
                    let unanswered = count(Option::is_none);
                    let cannot_vote =
                        count(|a| matches!(a, Some(Err(_)) | Some(Ok(Vote::Restarting(_)))));
                    granted >= q || (granted + unanswered < q && cannot_vote + unanswered <= n - q)
                },
            )
            .await;
        // The nodes that answered the vote: the give-back waits for them (see `give_back`).
        let answered: Vec<bool> = votes.iter().map(Option::is_some).collect();
        let valid_until = sent + opts.ttl.saturating_sub(drift_margin(opts.ttl));
        let (mut counters, mut held, mut restarting, mut failed) = (Vec::new(), Vec::new(), 0, 0);
        let mut last_error = None;
        let mut restart_left = Duration::ZERO;
        for (a, node) in votes.into_iter().zip(&inner.nodes) {
            match a {
                Some(Ok(Vote::Granted(c))) => counters.push(c),
                Some(Ok(Vote::Held(pttl))) => held.push(pttl),
                Some(Ok(Vote::Restarting(left))) => {
                    restarting += 1;
                    restart_left = restart_left.max(left);
                }
                Some(Err(e)) => {
                    failed += 1;
                    tracing::debug!(node = %node.addr, error = %e, "a redlock node did not vote");
                    last_error = Some(e);
                }
                None => {}
            }
        }
        if counters.len() >= q && Instant::now() < valid_until {
            let token = counters
                .iter()
                .copied()
                .max()
                .unwrap_or(0)
                .saturating_add(1);
            let acks = inner
                .gather(
                    |conn| {
                        let fence = keys.fence.clone();
                        async move {
                            let _: i64 = conn
                                .invoke(WRITE_BACK.key(&fence).arg(token))
                                .await
                                .map_err(from_redis)?;
                            Ok(())
                        }
                    },
                    |answers| {
                        let ok = answers.iter().filter(|a| matches!(a, Some(Ok(())))).count();
                        let bad = answers.iter().filter(|a| matches!(a, Some(Err(_)))).count();
                        ok >= q || bad > n - q
                    },
                )
                .await;
            let ok = acks.iter().filter(|a| matches!(a, Some(Ok(())))).count();
            if ok >= q && Instant::now() < valid_until {
                pending.armed = false;
                let ops = Arc::new(RedlockLease {
                    inner: inner.clone(),
                    keys,
                    owner,
                    name: name.to_owned(),
                });
                return Ok(Attempted::Granted(Lease::new(
                    name,
                    FencingToken::new(self.lock_id(name), token),
                    TrackerHandle::new(sent, opts.ttl),
                    ops,
                    opts,
                )));
            }
            pending.give_back(&answered).await;
            return Err(unavailable(format!(
                "the token was written back to only {ok} of {n} redlock nodes within the \
                 validity time; a majority ({q}) is needed"
            )));
        }
        pending.give_back(&answered).await;
        if counters.len() >= q {
            return Err(unavailable(format!(
                "a majority of the redlock nodes granted the lock only after its validity time \
                 (TTL {:?} − elapsed − drift) ran out",
                opts.ttl
            )));
        }
        if failed + restarting > n - q {
            let err = unavailable(format!(
                "no majority of the {n} redlock nodes can vote: {failed} did not answer{}, \
                 {restarting} are in their delayed restart (for up to {restart_left:?} more); \
                 a majority ({q}) is needed",
                last_error.map_or_else(String::new, |e| format!(" (last error: {e})"))
            ));
            if failed <= n - q {
                // Enough nodes are up: the lock can be had once the delayed restarts end.
                return Ok(Attempted::Restarting(restart_left, err));
            }
            return Err(err);
        }
        Ok(Attempted::Held(held.into_iter().min()))
    }
}

/// The outcome of one attempt that reached enough nodes.
enum Attempted {
    Granted(Lease),
    /// Held by another (or split between contenders): the shortest `PTTL` of the holder's keys.
    Held(Option<Duration>),
    /// No majority can vote until nodes in their delayed restart take part again (in at most
    /// this long); the error for an acquire that does not wait.
    Restarting(Duration, Error),
}

fn unavailable(msg: String) -> Error {
    Error::Unavailable {
        backend: REDLOCK,
        source: msg.into(),
    }
}

/// The votes an attempt asked for, given back (compare-and-delete on every node) unless the
/// attempt turned into a lease: at once on failure, in the background if the acquire is dropped.
struct Pending {
    inner: Arc<Inner>,
    keys: Keys,
    owner: String,
    armed: bool,
}

impl Pending {
    /// Gives the votes back on every node, waiting for the nodes that `answered` the vote: the
    /// next attempt should find no vote of this one left there. On the others the delete is
    /// queued behind the vote on the node's connection (and goes on in the background), so it
    /// runs after the vote there too.
    async fn give_back(&mut self, answered: &[bool]) {
        self.armed = false;
        let _ = self
            .inner
            .delete_everywhere(&self.keys, &self.owner, |a| {
                a.iter()
                    .zip(answered)
                    .all(|(a, &voted)| a.is_some() || !voted)
            })
            .await;
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (inner, keys, owner) = (
            self.inner.clone(),
            self.keys.clone(),
            std::mem::take(&mut self.owner),
        );
        rt.spawn(async move {
            let _ = inner.delete_everywhere(&keys, &owner, |_| false).await;
        });
    }
}

impl Inner {
    /// Runs `op` on every node at once, each bounded by the response timeout, and collects the
    /// answers in node order until `done` says the outcome is decided (`None`: no answer yet).
    /// The nodes that have not answered by then still get their request: it runs on in the
    /// background (bounded by the response timeout as well), its answer unread. Dropping it
    /// instead would cancel a request still waiting for its node's connection (the first one on
    /// a new connection), so a grant or a renewal decided by the fastest majority would leave
    /// the other nodes without the key, and the lease would not survive losing the nodes it was
    /// said to tolerate.
    async fn gather<T, F, Fut>(
        &self,
        op: F,
        done: impl Fn(&[Option<Result<T>>]) -> bool,
    ) -> Vec<Option<Result<T>>>
    where
        F: Fn(Conn) -> Fut,
        Fut: Future<Output = Result<T>> + Send + 'static,
        T: Send + 'static,
    {
        let limit = self.response_timeout;
        let mut running: FuturesUnordered<_> = self
            .nodes
            .iter()
            .enumerate()
            .map(|(i, node)| {
                let fut = op(node.conn.clone());
                async move {
                    let r = match tokio::time::timeout(limit, fut).await {
                        Ok(r) => r,
                        Err(_) => Err(timed_out("a redlock node's reply", limit)),
                    };
                    (i, r)
                }
            })
            .collect();
        let mut answers: Vec<Option<Result<T>>> = (0..self.nodes.len()).map(|_| None).collect();
        while let Some((i, r)) = running.next().await {
            answers[i] = Some(r);
            if done(&answers) {
                break;
            }
        }
        if !running.is_empty() {
            tokio::spawn(async move { while running.next().await.is_some() {} });
        }
        answers
    }

    /// Compare-and-delete of `owner` on every node, until `done` says the outcome is decided
    /// (the others still get theirs, in the background; see [`gather`](Self::gather)).
    async fn delete_everywhere(
        &self,
        keys: &Keys,
        owner: &str,
        done: impl Fn(&[Option<Result<bool>>]) -> bool,
    ) -> Vec<Option<Result<bool>>> {
        self.gather(
            |conn| {
                let (keys, owner) = (keys.clone(), owner.to_owned());
                async move { compare_and_delete(&conn, &keys, &owner, None).await }
            },
            done,
        )
        .await
    }

    /// `Ok(())` if `yes` answers reach a majority, [`Error::NotHeld`] if the `no` answers make
    /// a majority impossible, else [`Error::Unavailable`].
    fn majority(&self, name: &str, what: &str, answers: &[Option<Result<bool>>]) -> Result<()> {
        let (n, q) = (self.nodes.len(), self.config.quorum());
        let yes = answers
            .iter()
            .filter(|a| matches!(a, Some(Ok(true))))
            .count();
        let no = answers
            .iter()
            .filter(|a| matches!(a, Some(Ok(false))))
            .count();
        if yes >= q {
            Ok(())
        } else if no > n - q {
            Err(Error::NotHeld {
                name: name.to_owned(),
            })
        } else {
            Err(unavailable(format!(
                "{what} reached only {yes} of {n} redlock nodes; a majority ({q}) is needed"
            )))
        }
    }
}

/// Builds the client of one node and asks it for a `PING` and its `run_id` (`INFO server`)
/// within the connect timeout: the node's connection, and whether it answered (`Err` with the
/// transient error if not) with its run ID (`None` if `INFO` is refused, e.g. by an ACL). The
/// run ID tells one server reached under two names (a DNS alias, a proxy) from two servers.
///
/// # Errors
/// [`Error::InvalidConfig`] and [`Error::Auth`]: wrong for every attempt, so the connect fails.
async fn open_node(config: &RedisConfig) -> Result<(Conn, Result<Option<String>>)> {
    let ct = config.connect_timeout;
    let client = config.client().await?;
    let rt = config.response_timeout;
    let probe = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(ct))
        .set_response_timeout(Some(rt));
    let probed = tokio::time::timeout(ct, async {
        let mut c = client
            .get_multiplexed_async_connection_with_config(&probe)
            .await?;
        redis::cmd("PING").query_async::<()>(&mut c).await?;
        let info = redis::cmd("INFO")
            .arg("server")
            .query_async::<String>(&mut c)
            .await;
        Ok::<_, redis::RedisError>(info.ok().and_then(|i| {
            i.lines()
                .find_map(|l| l.strip_prefix("run_id:"))
                .map(|id| id.trim().to_owned())
        }))
    });
    let up = match probed.await {
        Ok(Ok(run_id)) => Ok(run_id),
        Ok(Err(e)) => match connect_error(e) {
            e @ (Error::Auth { .. } | Error::InvalidConfig { .. }) => return Err(e),
            e => Err(e),
        },
        Err(_) => Err(timed_out("connecting to a redlock node", ct)),
    };
    let manager = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(ct))
        .set_response_timeout(Some(rt))
        .set_number_of_retries(2)
        .set_min_delay(Duration::from_millis(50))
        .set_max_delay(Duration::from_secs(1));
    let first = ConnectionManager::new_lazy_with_config(client.clone(), manager.clone())
        .map_err(from_redis)?;
    Ok((Conn::new(client, manager, first, None), up))
}

#[async_trait]
impl LockBackend for RedlockLock {
    async fn grant(&self, name: &str, opts: AcquireOptions) -> Result<Lease> {
        validate_name(name)?;
        opts.validate()?;
        let max = self.inner.config.max_ttl;
        if opts.ttl > max {
            return Err(Error::config(format!(
                "the TTL {:?} is longer than this Redlock client's max_ttl {max:?}",
                opts.ttl
            )));
        }
        let start = Instant::now();
        let deadline = wait_deadline(opts.wait, start);
        let mut backoff = Backoff::new(Duration::from_millis(10), REDLOCK_MAX_POLL);
        loop {
            let pttl = match retry_transient(&opts, deadline, || self.attempt(name, &opts)).await? {
                Attempted::Granted(lease) => return Ok(lease),
                Attempted::Held(_) if opts.wait == Wait::No => {
                    return Err(Error::Held {
                        name: name.to_owned(),
                    });
                }
                Attempted::Restarting(_, e) if opts.wait == Wait::No => return Err(e),
                Attempted::Held(pttl) => pttl,
                Attempted::Restarting(left, _) => Some(left),
            };
            let mut pause = backoff.next_delay();
            if let Some(p) = pttl {
                pause = pause.min(p + Duration::from_millis(rand::random_range(1..=20)));
            }
            let wake = Instant::now() + pause;
            match deadline {
                Some(d) if wake >= d => {
                    tokio::time::sleep_until(d).await;
                    if let Ok(Attempted::Granted(lease)) = self.attempt(name, &opts).await {
                        return Ok(lease);
                    }
                    return Err(Error::Timeout {
                        name: name.to_owned(),
                        waited: start.elapsed(),
                    });
                }
                _ => tokio::time::sleep_until(wake).await,
            }
        }
    }

    fn guarantees(&self) -> Guarantees {
        let mut g = Guarantees::new(REDLOCK, LockKind::Efficiency);
        g.tokens_survive_restart = true;
        g.manual_renewal = true;
        g.expiry_slack = REDLOCK_EXPIRY_SLACK;
        g.notes = NOTES;
        g
    }

    /// The holder a majority of the nodes agree on: its token (the largest fence counter of the
    /// nodes that answered) and the time until fewer than a majority of its keys are left.
    async fn holder(&self, name: &str) -> Result<Option<HolderInfo>> {
        validate_name(name)?;
        let inner = &self.inner;
        let keys = Keys::new(inner.config.get_prefix(), name);
        let (n, q) = (inner.nodes.len(), inner.config.quorum());
        let answers = inner
            .gather(
                |conn| {
                    let keys = keys.clone();
                    async move {
                        let (owner, pttl, counter): (String, String, String) = conn
                            .invoke(READ.key(&keys.lock).key(&keys.fence))
                            .await
                            .map_err(from_redis)?;
                        let pttl = pttl.parse::<i64>().map_err(|_| bad_reply("redlock read"))?;
                        let counter = counter
                            .parse::<u64>()
                            .map_err(|_| bad_reply("redlock read"))?;
                        Ok((owner, pttl, counter))
                    }
                },
                |_| false,
            )
            .await;
        let read: Vec<(String, i64, u64)> = answers.into_iter().flatten().flatten().collect();
        if read.len() < q {
            return Err(unavailable(format!(
                "only {} of {n} redlock nodes answered; a majority ({q}) is needed",
                read.len()
            )));
        }
        let token = read.iter().map(|r| r.2).max().unwrap_or(0);
        for (owner, _, _) in &read {
            if owner.is_empty() {
                continue;
            }
            let mut left: Vec<i64> = read.iter().filter(|r| &r.0 == owner).map(|r| r.1).collect();
            if left.len() >= q {
                left.sort_unstable_by(|a, b| b.cmp(a));
                let remaining = Duration::from_millis(left[q - 1].max(0).unsigned_abs());
                return Ok(Some(HolderInfo::new(
                    Some(FencingToken::new(self.lock_id(name), token)),
                    Some(remaining),
                )));
            }
        }
        Ok(None)
    }
}

/// One Redlock grant: its keys and owner value on every node.
struct RedlockLease {
    inner: Arc<Inner>,
    keys: Keys,
    owner: String,
    name: String,
}

impl fmt::Debug for RedlockLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedlockLease")
            .field("name", &self.name)
            .field("nodes", &self.inner.nodes.len())
            .finish()
    }
}

#[async_trait]
impl LeaseOps for RedlockLease {
    /// Compare-and-`PEXPIRE` on every node at once; a majority must extend the key (the core
    /// counts the new deadline from the send time, and drops an answer that comes after the old
    /// one).
    async fn renew(&self, ttl: Duration) -> Result<()> {
        let (n, q) = (self.inner.nodes.len(), self.inner.config.quorum());
        let answers = self
            .inner
            .gather(
                |conn| {
                    let (keys, owner) = (self.keys.clone(), self.owner.clone());
                    async move { compare_and_pexpire(&conn, &keys, &owner, ttl, None).await }
                },
                |a| {
                    let yes = a.iter().filter(|a| matches!(a, Some(Ok(true)))).count();
                    let no = a.iter().filter(|a| matches!(a, Some(Ok(false)))).count();
                    yes >= q || no > n - q
                },
            )
            .await;
        self.inner.majority(&self.name, "the renewal", &answers)
    }

    /// Compare-and-delete on every node at once; done when a majority deleted the key (the
    /// lock is free: no other majority can hold it), the nodes that have not answered yet still
    /// get theirs in the background. A node that is stopped (connection open, no answer) thus
    /// no longer holds the release up for the response timeout. [`Error::NotHeld`] if a
    /// majority no longer held it, [`Error::Unavailable`] if neither is known.
    async fn release(&self) -> Result<()> {
        let (n, q) = (self.inner.nodes.len(), self.inner.config.quorum());
        let answers = self
            .inner
            .delete_everywhere(&self.keys, &self.owner, |a| {
                let yes = a.iter().filter(|a| matches!(a, Some(Ok(true)))).count();
                let no = a.iter().filter(|a| matches!(a, Some(Ok(false)))).count();
                yes >= q || no > n - q
            })
            .await;
        self.inner.majority(&self.name, "the release", &answers)
    }

    async fn check(&self) -> Result<()> {
        let answers = self
            .inner
            .gather(
                |conn| {
                    let (lock, owner) = (self.keys.lock.clone(), self.owner.clone());
                    async move { holds(&conn, &lock, &owner).await }
                },
                |_| false,
            )
            .await;
        self.inner.majority(&self.name, "the check", &answers)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
