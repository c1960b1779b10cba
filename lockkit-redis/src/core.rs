//! What the lock, its leases and the batched renewer share: the keys of a lock name, the Lua
//! scripts that renew, release and cancel on the server
//! (<https://redis.io/docs/latest/develop/interact/programmability/eval-intro/>), and the
//! grant's state on the client ([`RedisLease`]). No other module of the crate is imported here
//! but the connection and error helpers, so no two modules import each other.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};
use std::time::Duration;

use redis::Script;
use tokio::time::Instant;

use lockkit_core::backend::Backoff;
use lockkit_core::{Error, Result};

use crate::conn::Conn;
use crate::error::{bad_reply, from_redis};

/// The keys of one lock name. See the crate docs, "Keys". Cheap to clone (one `Arc`): a grant
/// hands them to its call, its lease and its watch entry.
#[derive(Debug, Clone)]
pub(crate) struct Keys(Arc<KeyNames>);

/// The key names behind [`Keys`].
#[derive(Debug, Clone)]
pub(crate) struct KeyNames {
    pub(crate) lock: String,
    pub(crate) fence: String,
    /// The waiters' queue, a ZSET of waiter IDs in arrival order.
    pub(crate) queue: String,
    /// The lock-delay key: while it exists and the lock key does not, the lock is granted to no
    /// one (its holder lapsed with a lock-delay). Set with the lock key to TTL + delay.
    pub(crate) delay: String,
    /// `P:waiter:`, to which a waiter ID is appended for its liveness key.
    pub(crate) waiter_prefix: String,
    /// `P:cancelled:`, to which a waiter ID is appended for its tombstone.
    cancelled: String,
}

impl std::ops::Deref for Keys {
    type Target = KeyNames;

    fn deref(&self) -> &KeyNames {
        &self.0
    }
}

impl Keys {
    /// The single-node (and Sentinel) layout: `P:kind:N`, waiter keys `P:waiter:ID`.
    pub(crate) fn new(prefix: &str, name: &str) -> Self {
        Self::build(prefix, name, false)
    }

    /// The one place where the keys of a lock name are made. With `tagged` (Redis Cluster)
    /// the name is wrapped in a hash tag (`P:kind:{=N}`, waiter keys `P:waiter:{=N}:ID`, see
    /// <https://redis.io/docs/latest/operate/oss_and_stack/reference/cluster-spec/#hash-tags>):
    /// Redis hashes only what lies between the first `{` and the first `}` after it, here `=`
    /// and the name up to its first `}`, the same for every kind, so every key of one name
    /// (including its waiters' keys and tombstones, which the scripts reach through their
    /// prefixes) lands in one slot and one script can touch them all. The `=` keeps the tag
    /// non-empty for a name that starts with `}` (an empty tag would hash the whole key). The
    /// prefix holds no `{` in Cluster mode ([`RedisConfig::validate`](crate::RedisConfig::validate)),
    /// so the name's `{` is the first one. Without `tagged` the layout is the one of earlier
    /// releases, unchanged.
    ///
    /// Built with `push_str` rather than `format!`: this runs at every acquire, and six
    /// `format!`s were a seventh of a grant's client instructions (callgrind,
    /// `scripts/profile-redis.sh`).
    pub(crate) fn build(prefix: &str, name: &str, tagged: bool) -> Self {
        // `P:kind:N` for the name's kinds; with `tagged`, N is `{=name}`.
        let named = |kind: &str| {
            let mut k = String::with_capacity(prefix.len() + kind.len() + name.len() + 5);
            k.push_str(prefix);
            k.push(':');
            k.push_str(kind);
            k.push(':');
            if tagged {
                k.push_str("{=");
                k.push_str(name);
                k.push('}');
            } else {
                k.push_str(name);
            }
            k
        };
        // Waiter IDs follow the tag in a tagged layout (`P:kind:{=N}:`), the kind otherwise
        // (`P:kind:`).
        let ids = |kind: &str| {
            if tagged {
                let mut k = named(kind);
                k.push(':');
                k
            } else {
                let mut k = String::with_capacity(prefix.len() + kind.len() + 2);
                k.push_str(prefix);
                k.push(':');
                k.push_str(kind);
                k.push(':');
                k
            }
        };
        Self(Arc::new(KeyNames {
            lock: named("lock"),
            fence: named("fence"),
            queue: named("queue"),
            delay: named("delay"),
            waiter_prefix: ids("waiter"),
            cancelled: ids("cancelled"),
        }))
    }

    /// These keys with the queue `queue` (an election's or semaphore's slots share one).
    pub(crate) fn with_queue(self, queue: String) -> Self {
        let mut names = Arc::unwrap_or_clone(self.0);
        names.queue = queue;
        Self(Arc::new(names))
    }

    /// The tombstone key of a retired waiter ID. The lock name is not in it:
    /// `P:cancelled:ID`, a kind of its own.
    pub(crate) fn tombstone(&self, id: &str) -> String {
        let mut k = String::with_capacity(self.cancelled.len() + id.len());
        k.push_str(&self.cancelled);
        k.push_str(id);
        k
    }
}

/// What Redis Cluster hashes of `key` to find its slot (the cluster spec's hash tag rule):
/// the bytes between the first `{` and the first `}` after it, if there are any; else the
/// whole key. Keys with equal tags share a slot.
pub(crate) fn hash_tag(key: &str) -> &str {
    if let Some(open) = key.find('{')
        && let Some(len) = key[open + 1..].find('}')
        && len > 0
    {
        return &key[open + 1..open + 1 + len];
    }
    key
}

/// Compare-and-pexpire. `KEYS[1]` lock key, `KEYS[2]` lock-delay key; `ARGV[1]` owner value,
/// `ARGV[2]` TTL in ms, `ARGV[3]` TTL + lock-delay in ms (`0`: no delay). Returns 1 if the key
/// held our owner value and its expiry was set (and the delay key's, to TTL + delay), 0
/// otherwise. A lapsed lock (key gone, someone else's value, or a key of another type: the
/// `GET` is a `pcall`) is never re-taken.
pub(crate) static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.pcall('GET', KEYS[1]) == ARGV[1] then
  if ARGV[3] ~= '0' then
    redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[3])
  end
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
",
    )
});

/// Lua shared by the scripts that hand a lock or slot to a queued waiter ([`SERVE_LUA`], the
/// slot scripts): `tell(ch, msg)` sends hand-off message `msg` to the waiter's client channel
/// `ch` and says whether that waiter is to be served (`false`: pass it over, nothing was sent).
/// The rule it keeps: a waiter told of a grant is the one the script writes the lock for, since
/// a waiter takes the lease a message names without asking the server again.
///
/// A classic channel is `PUBLISH`ed only if `PUBSUB NUMSUB` counts a subscriber of its own (a
/// client subscribes to its channel before any of its waiters queues and stays subscribed, so
/// none means its process died and the server closed its sockets, or it is reconnecting), not
/// by `PUBLISH`'s own count, which includes pattern subscribers (anyone's `PSUBSCRIBE *`, a
/// monitoring tool) and would serve a dead waiter. If `PUBSUB` is refused (an ACL), or the
/// `PUBLISH` is, the waiter is served (it finds its ID by polling if it heard nothing): a
/// `PUBLISH` reaches the server's replicas too, where no count sees a subscriber.
///
/// A channel that starts with `:` (Cluster mode, the client's channel in the lock's slot,
/// `shard.rs`) is `SPUBLISH`ed without the `:`, and the waiter is always served: the message
/// reaches the slot's replicas, where the redis crate may subscribe a client again after a
/// reconnect, but `SPUBLISH` and `PUBSUB SHARDNUMSUB` count only the master's own subscribers:
/// a waiter passed over by that count could still hear of the grant and take a lease someone
/// else holds (the second breaker's find: two holders). So in Cluster mode a dead waiter holds
/// the lock for its TTL.
///
/// See <https://redis.io/docs/latest/commands/pubsub-numsub/> and
/// <https://redis.io/docs/latest/commands/publish/>.
macro_rules! tell_lua {
    () => {
        r"
local function tell(ch, msg)
  if string.sub(ch, 1, 1) == ':' then
    redis.pcall('SPUBLISH', string.sub(ch, 2), msg)
    return true
  end
  if redis.pcall('PUBSUB', 'NUMSUB', ch)[2] == 0 then return false end
  redis.pcall('PUBLISH', ch, msg)
  return true
end
"
    };
}
pub(crate) use tell_lua;

/// Lua shared by the scripts that may hand a free lock to the next waiter. `KEYS[1]` lock key,
/// `KEYS[2]` fence counter key, `KEYS[3]` the lock's queue, `KEYS[4]` the lock-delay key;
/// `ARGV[1]` the waiter-key prefix (`P:waiter:`).
///
/// `bump()` is the one place a token is made: the fence counter plus one, floored at the
/// server's `TIME` in µs, i.e. `max(counter + 1, TIME)`, in two commands in the common case:
/// `TIME`, then `SET … GET` of the counter to the floor (reading the old value in the same
/// step); only a counter at or above the floor (more than one grant per µs, or a clock that
/// stepped back) takes a third command, the `SET` of counter + 1. So tokens keep
/// increasing when the counter was lost (a restart without persistence, an eviction, a
/// deletion) and also when it is merely *old*: a replica promoted after a failover that did not
/// receive the last grants has the counter of an earlier grant, and `INCR` alone would hand out
/// a lost grant's token a second time (the Sentinel test
/// `failover_with_replication_blocked_loses_the_lease_and_tokens_still_increase` saw equal
/// tokens before the floor applied to every grant). A counter that is not an integer (or not
/// exact as a Lua number, 2^53 and up) is put back as it was and `INCR`ed, as before: for a
/// non-integer that fails (and the script with it), leaving the counter as it was; a key of
/// another type fails the `SET … GET` with nothing written.
///
/// `serve(me)` hands the free lock to the first live waiter of the queue (a ZSET in arrival
/// order, members are waiter IDs): a waiter is live while its key `P:waiter:ID` (value
/// `"TTL_MS DELAY_MS CHANNEL"`, with a short expiry the waiter refreshes; `DELAY_MS` is TTL +
/// lock-delay, `0` without a delay) exists; dead ones are dropped on the way. The lock key
/// becomes the waiter's ID with its TTL (and the delay key its ID with TTL + delay, if it asked
/// for a delay; else the delay key is deleted), the counter is bumped, and
/// `"ID TOKEN"` is `PUBLISH`ed on that waiter's client channel only ([`tell_lua`]; a `pcall`:
/// an ACL without channel permission still hands over, and the waiter then finds its ID by
/// polling). A channel with no subscriber means the waiter's client has no pub/sub connection
/// (a client subscribes to its channel before any of its waiters queues and stays subscribed):
/// its process died and the server closed its sockets, or it is reconnecting. That waiter is
/// dropped and the next one served, so a dead waiter does not hold the lock for its TTL (a live
/// one looks again within [`MAX_WAIT_POLL`](crate::MAX_WAIT_POLL) and queues at the tail);
/// only the token it was to get is skipped. A channel that starts with `:` (Cluster mode: the
/// client's channel in the lock's slot, `shard.rs`) is `SPUBLISH`ed without the `:`, stays on
/// the slot's shard, and its waiter is always served (see [`tell_lua`]). Returns the new
/// holder's ID, or `false` if no other waiter is live. With `me` (a waiter's own acquire),
/// the queue is only looked at up to `me`, which is removed: then the caller takes the lock.
pub(crate) const SERVE_LUA: &str = concat!(
    tell_lua!(),
    r"
local function bump()
  local now = redis.call('TIME')
  local t = tonumber(now[1]) * 1000000 + tonumber(now[2])
  local old = redis.call('SET', KEYS[2], string.format('%d', t), 'GET')
  if old then
    local o = string.match(old, '^%-?%d+$') and tonumber(old)
    if not o or o >= 9007199254740992 then
      -- not a counter Lua holds exactly: put it back and INCR it (which fails for a
      -- non-integer, writing nothing)
      redis.call('SET', KEYS[2], old, 'KEEPTTL')
      return redis.call('INCR', KEYS[2])
    end
    if o >= t then
      t = o + 1
      redis.call('SET', KEYS[2], string.format('%d', t))
    end
  end
  return t
end
local function serve(me)
  while true do
    local h
    if me then
      h = redis.call('ZRANGE', KEYS[3], 0, 0)[1]
      if not h then return false end
      redis.call('ZREM', KEYS[3], h)
      if h == me then
        redis.call('DEL', ARGV[1] .. me)
        return false
      end
    else
      h = redis.call('ZPOPMIN', KEYS[3])[1]
      if not h then return false end
    end
    local w = redis.call('GETDEL', ARGV[1] .. h)
    if w then
      local ttl, dpx, ch = string.match(w, '^(%d+) (%d+) (.*)$')
      if not ttl then
        -- queued by an older client: no delay field
        dpx = '0'
        ttl, ch = string.match(w, '^(%d+) (.*)$')
      end
      local t = bump()
      -- Nobody is subscribed to the waiter's channel: its client is gone (or reconnecting,
      -- and looks again within MAX_WAIT_POLL): the next waiter is served instead.
      if tell(ch, h .. ' ' .. string.format('%d', t)) then
        redis.call('SET', KEYS[1], h, 'PX', ttl)
        if dpx ~= '0' then
          redis.call('SET', KEYS[4], h, 'PX', dpx)
        else
          redis.call('DEL', KEYS[4])
        end
        return h
      end
    end
  end
end
"
);

/// Compare-and-delete, handing the lock to the next live waiter if there is one (see
/// [`SERVE_LUA`]; no `PUBLISH` when nobody waits): `GET`, the queue's `ZPOPMIN`, and one `DEL`
/// of the lock and lock-delay keys when nobody was handed the lock (a hand-over sets both keys
/// anew, so the lock key sees no `del` event then). `KEYS[1..4]` as there; `ARGV[1]` waiter-key
/// prefix, `ARGV[2]` owner value, `ARGV[3]` `0` for a release (the lock-delay key is deleted:
/// a release frees the lock at once), or a lock-delay in ms for a lease given back as lapsed
/// (the lock key is deleted and the delay key set to expire after the delay; nobody is served).
/// Returns 1 if our value was deleted (or handed on), 0 otherwise (also for a lock key of another
/// type: its `GET` is a `pcall`). A hand-over that fails (a queue or fence counter key of another
/// type, a counter that is not an integer: `serve` is `pcall`ed) fails before it writes the lock
/// key, which is then deleted as if nobody waited: the holder's release is never held up by
/// them.
pub(crate) static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"{SERVE_LUA}
if redis.pcall('GET', KEYS[1]) ~= ARGV[2] then
  return 0
end
if ARGV[3] ~= '0' then
  redis.call('SET', KEYS[4], ARGV[2], 'PX', ARGV[3])
  redis.call('DEL', KEYS[1])
  return 1
end
local ok, h = pcall(serve, false)
if not (ok and h) then
  redis.call('DEL', KEYS[1], KEYS[4])
end
return 1
"
    ))
});

/// Cleanup of an acquire that was cancelled, timed out or gave up (or whose reply was lost or
/// came too late), for its waiter ID, sent with plain `EVAL` so that a flushed script cache
/// cannot fail it. `KEYS[1..4]` as in [`SERVE_LUA`], `KEYS[5]` the ID's tombstone key;
/// `ARGV[1]` waiter-key prefix, `ARGV[2]` the ID, `ARGV[3]` tombstone TTL in ms.
///
/// Leaves a tombstone for the ID (an acquire script still on its way, queued on another
/// connection, finds it and does nothing), takes the ID out of the queue, and if the lock is
/// held by the ID (it took it, or it was handed to it) gives the lock to the next live waiter
/// or deletes it with its lock-delay key (the grant never reached a caller: no lock-delay):
/// then 1, else 0. A queue or fence counter key of another type fails neither the cleanup nor
/// the deletion (`pcall`s, as in [`RELEASE`]).
fn cancel_script() -> String {
    format!(
        r"{SERVE_LUA}
redis.call('SET', KEYS[5], '1', 'PX', ARGV[3])
redis.pcall('ZREM', KEYS[3], ARGV[2])
redis.call('DEL', ARGV[1] .. ARGV[2])
if redis.pcall('GET', KEYS[1]) == ARGV[2] then
  local ok, h = pcall(serve, false)
  if not (ok and h) then
    redis.call('DEL', KEYS[1], KEYS[4])
  end
  return 1
end
return 0
"
    )
}

static CANCEL: LazyLock<String> = LazyLock::new(cancel_script);

/// How long a cancelled attempt's tombstone lives, and how long its cleanup keeps retrying:
/// the attempt's TTL, but at least 60 s. An acquire script that reaches the server even later
/// than that may still take the lock, which then lives for its TTL.
pub(crate) fn cancel_horizon(ttl: Duration) -> Duration {
    ttl.max(Duration::from_secs(60))
}

/// One run of the [`CANCEL`] script for the acquire attempt with `owner` (and TTL `ttl`):
/// `Ok(true)` if it deleted the lock that attempt had taken.
///
/// # Errors
/// The converted redis error.
///
/// # Cancel safety
/// Cancel safe; the script may still run.
pub(crate) async fn cancel_once(
    conn: &Conn,
    keys: &Keys,
    owner: &str,
    ttl: Duration,
) -> Result<bool> {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(CANCEL.as_str())
        .arg(5)
        .arg(&keys.lock)
        .arg(&keys.fence)
        .arg(&keys.queue)
        .arg(&keys.delay)
        .arg(keys.tombstone(owner))
        .arg(&keys.waiter_prefix)
        .arg(owner)
        .arg(ttl_millis(cancel_horizon(ttl)));
    match conn.query::<i64>(&cmd).await.map_err(from_redis)? {
        1 => Ok(true),
        0 => Ok(false),
        _ => Err(bad_reply("cleanup")),
    }
}

/// A TTL in whole milliseconds, rounded **up**: the server must never free a lease earlier than
/// the client's deadline assumes.
pub(crate) fn ttl_millis(ttl: Duration) -> u64 {
    let ms = ttl.as_nanos().div_ceil(1_000_000);
    u64::try_from(ms).unwrap_or(u64::MAX)
}

/// What the delay key's expiry is set to with a lock key of TTL `ttl`, in ms: `ttl` plus the
/// lock-delay (both rounded up), or 0 without a delay.
pub(crate) fn delay_px(ttl: Duration, delay: Option<Duration>) -> u64 {
    delay.map_or(0, |d| ttl_millis(ttl).saturating_add(ttl_millis(d)))
}

/// Runs the renew script for `owner`: `Ok(true)` if the lock key held it and now expires after
/// `ttl` (and the delay key after `ttl` + `delay`).
///
/// # Errors
/// The converted redis error; [`Error::Backend`] for a reply that is not 0 or 1.
///
/// # Cancel safety
/// Cancel safe; the script may still run.
pub(crate) async fn compare_and_pexpire(
    conn: &Conn,
    keys: &Keys,
    owner: &str,
    ttl: Duration,
    delay: Option<Duration>,
) -> Result<bool> {
    let n: i64 = conn
        .invoke(
            RENEW
                .key(&keys.lock)
                .key(&keys.delay)
                .arg(owner)
                .arg(ttl_millis(ttl))
                .arg(delay_px(ttl, delay)),
        )
        .await
        .map_err(from_redis)?;
    match n {
        1 => Ok(true),
        0 => Ok(false),
        _ => Err(bad_reply("renew")),
    }
}

/// Runs the release script for `owner`: `Ok(true)` if it deleted the lock (or handed it on).
/// With `lapse` (a lock-delay), the lock is given back as a lease that lapsed: it is granted to
/// no one for that long (see [`RELEASE`]).
///
/// # Errors
/// The converted redis error; [`Error::Backend`] for a reply that is not 0 or 1.
///
/// # Cancel safety
/// Cancel safe; the script may still run.
pub(crate) async fn compare_and_delete(
    conn: &Conn,
    keys: &Keys,
    owner: &str,
    lapse: Option<Duration>,
) -> Result<bool> {
    let n: i64 = conn
        .invoke(
            RELEASE
                .key(&keys.lock)
                .key(&keys.fence)
                .key(&keys.queue)
                .key(&keys.delay)
                .arg(&keys.waiter_prefix)
                .arg(owner)
                .arg(lapse.map_or(0, ttl_millis)),
        )
        .await
        .map_err(from_redis)?;
    match n {
        1 => Ok(true),
        0 => Ok(false),
        _ => Err(bad_reply("release")),
    }
}

/// Whether the lock key `lock_key` holds `owner` now (one `GET`), for `lease.check()` and the
/// fence. A key of another type (`WRONGTYPE`) is not held.
///
/// # Errors
/// [`Error::Unavailable`] and others from the server.
pub(crate) async fn holds(conn: &Conn, lock_key: &str, owner: &str) -> Result<bool> {
    match conn
        .query::<Option<String>>(redis::cmd("GET").arg(lock_key))
        .await
    {
        Ok(held) => Ok(held.as_deref() == Some(owner)),
        // The key holds another type now (replaced by someone else): not ours.
        Err(e) if e.code() == Some("WRONGTYPE") => Ok(false),
        Err(e) => Err(from_redis(e)),
    }
}

/// A lease's place in its connection's batched renewal (a `renewer::Batched`) or in its
/// client's loss notices (a `watch::Watched`), opaque here so that this module need not import
/// the modules that import it: dropping it stops the lease's renewal, or its notices.
pub(crate) type Registration = Box<dyn Send + Sync>;

/// One grant: the lock's keys and the owner value stored in its lock key (the grant's waiter
/// ID).
pub(crate) struct RedisLease {
    pub(crate) conn: Conn,
    pub(crate) name: String,
    pub(crate) keys: Keys,
    pub(crate) owner: String,
    /// The lease's place in its connection's batched renewal; `None` for a lease renewed by hand
    /// (`keepalive(false)`). Taken out at release.
    pub(crate) batch: Mutex<Option<Registration>>,
    /// The lease's place in its client's loss notices (keyspace events, restarts). Taken out at
    /// release, before the release's own `DEL`.
    pub(crate) watched: Mutex<Option<Registration>>,
    pub(crate) self_renewing: bool,
    /// The grant's lock-delay ([`AcquireOptions::effective_lock_delay`](lockkit_core::AcquireOptions::effective_lock_delay)).
    pub(crate) delay: Option<Duration>,
}

impl fmt::Debug for RedisLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLease")
            .field("lock_key", &self.keys.lock)
            .field("owner", &self.owner)
            .field("batched", &self.self_renewing)
            .finish()
    }
}

impl RedisLease {
    /// Whether the lease is still renewed by its connection's batch (not released).
    pub(crate) fn is_batched(&self) -> bool {
        self.batch
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    /// Gives the lock back as a lease that *lapsed*, keeping its lock-delay: for a lease whose
    /// renewal was acknowledged after its deadline, so that its holder has been told it lost the
    /// lock (and may still have writes in flight). Out of the batch first. `Ok(true)` if the
    /// lock key still held this lease.
    ///
    /// # Errors
    /// As [`compare_and_delete`].
    pub(crate) async fn give_back_lapsed(&self) -> Result<bool> {
        drop(self.batch.lock().unwrap_or_else(|p| p.into_inner()).take());
        drop(
            self.watched
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(),
        );
        compare_and_delete(&self.conn, &self.keys, &self.owner, self.delay).await
    }

    pub(crate) fn not_held(&self) -> Error {
        Error::NotHeld {
            name: self.name.clone(),
        }
    }
}

/// What an acquire call's guard ([`Call`]) cleans up after: the keys of a lock name (the lock's
/// acquire) or of an election or semaphore (`slots.rs`), with the one-shot cleanup script of a
/// waiter ID for them.
pub(crate) trait Cleanup: Clone + Send + Sync + 'static {
    /// One run of the cleanup for the acquire attempt with waiter ID `id` (and TTL `ttl`):
    /// `Ok(true)` if it freed (or handed on) what that attempt had taken.
    ///
    /// # Errors
    /// The converted redis error.
    ///
    /// # Cancel safety
    /// Cancel safe; the script may still run.
    fn cancel_once<'a>(
        &'a self,
        conn: &'a Conn,
        id: &'a str,
        ttl: Duration,
    ) -> impl Future<Output = Result<bool>> + Send + 'a;

    /// What the logs name: a lock key, or an election or semaphore name.
    fn label(&self) -> &str;
}

impl Cleanup for Keys {
    fn cancel_once<'a>(
        &'a self,
        conn: &'a Conn,
        id: &'a str,
        ttl: Duration,
    ) -> impl Future<Output = Result<bool>> + Send + 'a {
        cancel_once(conn, self, id, ttl)
    }

    fn label(&self) -> &str {
        &self.lock
    }
}

/// Removes what the acquire attempt with waiter ID `id` (sent at `sent`) may have taken,
/// retrying transient errors (with [`Backoff`], steps of 50 ms doubling up to 1 s, jittered)
/// until [`cancel_horizon`] after `sent`.
///
/// # Cancel safety
/// Meant to be spawned; dropping it stops the retries.
pub(crate) async fn cancel_attempt<K: Cleanup>(
    conn: Conn,
    keys: K,
    id: String,
    sent: Instant,
    ttl: Duration,
) {
    let until = sent.checked_add(cancel_horizon(ttl));
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
    loop {
        match keys.cancel_once(&conn, &id, ttl).await {
            Ok(true) => {
                tracing::debug!(key = %keys.label(), "removed what a cancelled acquire took");
                return;
            }
            Ok(false) => return,
            Err(e) => {
                let delay = backoff.next_delay();
                if e.is_retryable() && until.is_none_or(|u| Instant::now() + delay < u) {
                    tracing::debug!(key = %keys.label(), error = %e, "cleanup of a cancelled acquire failed; retrying");
                    tokio::time::sleep(delay).await;
                } else {
                    tracing::warn!(key = %keys.label(), error = %e,
                        "cleanup of a cancelled acquire failed; if it took the lock, its TTL frees it");
                    return;
                }
            }
        }
    }
}

/// A fresh waiter ID: a random 128-bit value in hex (also the owner value of its grant).
pub(crate) fn new_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// A subscription of this client to its hand-off channel, under way (the hub's `ensure`).
pub(crate) type Subscribing = Pin<Box<dyn Future<Output = Result<()>> + Send>>;

/// What ended one sleep of a waiter ([`Subscription::sleep`]).
pub(crate) enum Woken {
    /// A release handed the lock (or slot) to the waiter: its token.
    Handed(u64),
    /// Time to look at the lock again.
    Look,
    /// The acquire's deadline has passed.
    Deadline,
}

/// The hand-off subscription of one waiting acquire (of a lock or of a slot), and the sleeps
/// between its looks at the lock.
pub(crate) struct Subscription {
    running: Option<Subscribing>,
    /// No new subscription is started before this (after one failed).
    next: Instant,
}

impl Subscription {
    /// For an acquire that started at `start`.
    pub(crate) fn new(start: Instant) -> Self {
        Self {
            running: None,
            next: start,
        }
    }

    /// One sleep of a waiter between two looks. [`Woken::Deadline`] at once if `deadline` has
    /// passed. Else, unless the waiter is `queued` (its client's channel is subscribed), starts
    /// `subscribe()` if none is under way and no failure holds it back, then sleeps until
    /// `handed` yields a token, `poll` passes, the deadline, or the subscription ends: then
    /// [`Woken::Look`] (a subscribed waiter looks again at once, queued this time; after a failure
    /// the next subscription waits `retry_after(error)`).
    ///
    /// Cancel safe: a dropped sleep keeps the subscription under way for the next one.
    pub(crate) async fn sleep(
        &mut self,
        queued: bool,
        subscribe: impl FnOnce() -> Subscribing,
        handed: impl Future<Output = Option<u64>>,
        poll: Duration,
        deadline: Option<Instant>,
        retry_after: impl FnOnce(&Error) -> Duration,
    ) -> Woken {
        let now = Instant::now();
        if deadline.is_some_and(|d| now >= d) {
            return Woken::Deadline;
        }
        if !queued && self.running.is_none() && now >= self.next {
            self.running = Some(subscribe());
        }
        let running = async {
            match &mut self.running {
                Some(f) => f.await,
                None => std::future::pending().await,
            }
        };
        let until = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        let subscribed = tokio::select! {
            s = running => s,
            t = handed => return t.map_or(Woken::Look, Woken::Handed),
            _ = tokio::time::sleep(poll) => return Woken::Look,
            _ = until => return Woken::Deadline,
        };
        self.running = None;
        if let Err(e) = subscribed {
            self.next = Instant::now() + retry_after(&e);
        }
        Woken::Look
    }
}

/// The guard of one acquire call on the server (a lock's, an election's or a semaphore's): its
/// current waiter ID and whether the server may hold something for that ID (an attempt in
/// flight, a place in the queue, a lock or slot handed to it).
///
/// Dropped while armed (the acquire was cancelled, timed out or failed), it spawns the cleanup
/// for the ID ([`cancel_attempt`]). An attempt whose reply was lost *retires* the ID: its
/// cleanup is spawned, and the call goes on with a fresh ID (at the end of the queue), so a late
/// script of the old ID can never touch the new one's grant.
pub(crate) struct Call<K: Cleanup> {
    pub(crate) conn: Conn,
    pub(crate) keys: K,
    ttl: Duration,
    state: Mutex<CallState>,
}

pub(crate) struct CallState {
    pub(crate) me: String,
    pub(crate) armed: bool,
    /// Some attempt of this ID joined the queue.
    pub(crate) queued: bool,
    /// Send time of the last attempt of this ID that left it queued: a lock handed to the ID
    /// later was handed after that.
    pub(crate) queued_at: Option<Instant>,
    /// The highest fence counter a look of this call saw with the lock held by another (or in
    /// its lock-delay): a hand-off message whose token is not above it was sent for a grant made
    /// before that look, which has lapsed since.
    pub(crate) seen_token: u64,
    /// Retired IDs whose grant this call may still meet (their cleanup runs in the background).
    retired: Vec<String>,
}

impl CallState {
    /// A fresh ID, with nothing on the server for it.
    fn renew_id(&mut self) {
        self.me = new_id();
        self.armed = false;
        self.queued = false;
        self.queued_at = None;
    }
}

impl<K: Cleanup> Call<K> {
    pub(crate) fn new(conn: Conn, keys: K, ttl: Duration) -> Self {
        Self {
            conn,
            keys,
            ttl,
            state: Mutex::new(CallState {
                me: new_id(),
                armed: false,
                queued: false,
                queued_at: None,
                seen_token: 0,
                retired: Vec::new(),
            }),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, CallState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn me(&self) -> String {
        self.lock().me.clone()
    }

    /// Retires `id` (if it is still the current one) and cleans up after it in the background.
    pub(crate) fn retire(&self, id: &str) {
        {
            let mut st = self.lock();
            if st.me != id {
                return;
            }
            st.renew_id();
            st.retired.push(id.to_owned());
        }
        self.spawn_cleanup(id.to_owned());
    }

    /// Replaces `id` after its cleanup ran to completion.
    pub(crate) fn forget(&self, id: &str) {
        let mut st = self.lock();
        if st.me == id {
            st.renew_id();
        }
    }

    pub(crate) fn is_retired(&self, holder: &str) -> bool {
        self.lock().retired.iter().any(|r| r == holder)
    }

    pub(crate) fn unretire(&self, holder: &str) {
        self.lock().retired.retain(|r| r != holder);
    }

    /// Runs the cleanup of every retired ID now (their background cleanups may not have
    /// reached the server yet): `true` if one ran, after which no retired ID holds anything (it
    /// freed it, or a background cleanup did): look again. An ID whose cleanup ran is
    /// forgotten; one whose cleanup failed stays retired.
    pub(crate) async fn clean_up_retired(&self) -> bool {
        let retired = std::mem::take(&mut self.lock().retired);
        let mut cleaned = false;
        for id in retired {
            match self.cancel_once(&id).await {
                Ok(_) => cleaned = true,
                Err(_) => self.lock().retired.push(id),
            }
        }
        cleaned
    }

    /// One run of the cleanup for `id`, now.
    ///
    /// # Errors
    /// As [`Cleanup::cancel_once`].
    pub(crate) async fn cancel_once(&self, id: &str) -> Result<bool> {
        self.keys.cancel_once(&self.conn, id, self.ttl).await
    }

    /// Cleans up after the current ID now, before the call returns (a timed-out wait): leaves
    /// the queue and gives back what was handed over meanwhile, so a program that exits right
    /// after its `Timeout` leaves nothing queued. One try; if it fails (or this future is
    /// dropped), the cleanup goes on in the background as for a cancelled call.
    pub(crate) async fn clean_up_now(&self) {
        let id = {
            let st = self.lock();
            if !st.armed {
                return;
            }
            st.me.clone()
        };
        if self.cancel_once(&id).await.is_ok() {
            self.forget(&id);
        }
    }

    /// The call got its grant: nothing to clean up. Returns the owner value.
    pub(crate) fn granted(&self) -> String {
        let mut st = self.lock();
        st.armed = false;
        st.me.clone()
    }

    fn spawn_cleanup(&self, id: String) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return; // no runtime: the TTLs free the lock and the queue
        };
        rt.spawn(cancel_attempt(
            self.conn.clone(),
            self.keys.clone(),
            id,
            Instant::now(),
            self.ttl,
        ));
    }
}

impl<K: Cleanup> Drop for Call<K> {
    fn drop(&mut self) {
        let st = self.lock();
        if !st.armed {
            return;
        }
        let id = st.me.clone();
        drop(st);
        self.spawn_cleanup(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_rounds_up() {
        assert_eq!(ttl_millis(Duration::from_millis(100)), 100);
        assert_eq!(ttl_millis(Duration::from_micros(100_001)), 101);
        assert_eq!(ttl_millis(Duration::from_secs(2)), 2000);
    }

    #[test]
    fn keys_are_distinct_and_keep_the_name_verbatim() {
        let k = Keys::new("app", "a:lock:b *?[x]");
        assert_eq!(k.lock, "app:lock:a:lock:b *?[x]");
        assert_eq!(k.fence, "app:fence:a:lock:b *?[x]");
        assert_eq!(k.queue, "app:queue:a:lock:b *?[x]");
        assert_ne!(Keys::new("app", "x").lock, Keys::new("app", "x ").lock);
    }

    #[test]
    fn tagged_keys_of_one_name_share_one_hash_tag() {
        for name in [
            "job", "}", "}x", "a}b", "{", "{}", "a{b}c", "x:lock:y", "ü *?[x]",
        ] {
            let k = Keys::build("app", name, true);
            let id = "0123456789abcdef0123456789abcdef";
            let waiter = format!("{}{id}", k.waiter_prefix);
            let all = [
                &k.lock,
                &k.fence,
                &k.queue,
                &k.delay,
                &waiter,
                &k.tombstone(id),
            ];
            let tag = hash_tag(&k.lock);
            assert!(!tag.is_empty() && tag != k.lock, "{name:?}: {tag:?}");
            for key in all {
                assert_eq!(hash_tag(key), tag, "{name:?}: {key}");
            }
        }
        let k = Keys::build("app", "job", true);
        assert_eq!(k.lock, "app:lock:{=job}");
        assert_eq!(k.waiter_prefix, "app:waiter:{=job}:");
        assert_ne!(
            Keys::build("app", "a}b", true).lock,
            Keys::build("app", "a}c", true).lock
        );
        // The single-node layout is unchanged.
        let plain = Keys::build("app", "job", false);
        assert_eq!(
            (plain.lock.as_str(), plain.waiter_prefix.as_str()),
            ("app:lock:job", "app:waiter:")
        );
    }
}
