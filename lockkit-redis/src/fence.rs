//! [`RedisFence`]: fenced writes to data kept in Redis itself.

use lockkit_core::backend::LeaseBackendExt;
use std::fmt;
use std::sync::LazyLock;

use lockkit_core::backend::LeaseFence;
use lockkit_core::{Error, FencingToken, Lease, Result};
use redis::Script;

use crate::conn::Conn;
use crate::core::RedisLease;
use crate::error::{bad_reply, from_redis};

/// Checks every key's guard record, then writes all keys or none.
///
/// `KEYS[1..n]` are the data keys, `KEYS[n+1..2n]` their guard records (hashes with fields
/// `lock` and `token`); `ARGV[1]` is the lock identity, `ARGV[2]` the token's number (decimal,
/// no leading zeros, so numbers compare exactly as strings of equal length), `ARGV[3..]` the
/// values. Replies `{0, 0, ''}` when written, `{1, i, lock}` when key `i` is guarded by another
/// lock, `{2, i, token}` when key `i` has seen a newer token.
static WRITE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local n = #KEYS / 2
local lock, token = ARGV[1], ARGV[2]
local function older(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
for i = 1, n do
  local g = redis.call('HMGET', KEYS[n + i], 'lock', 'token')
  if g[1] and g[1] ~= lock then return {1, i, g[1]} end
  if g[2] and older(token, g[2]) then return {2, i, g[2]} end
end
for i = 1, n do
  redis.call('SET', KEYS[i], ARGV[2 + i])
  redis.call('HSET', KEYS[n + i], 'lock', lock, 'token', token)
end
return {0, 0, ''}
",
    )
});

/// Fenced writes for data stored in Redis, made from a Redis [`Lease`] (also one obtained as
/// `Arc<dyn Lock>` from `lockkit::connect`), on the lock's own connection.
///
/// Every key written through the fence has a **guard record**, the hash
/// `{prefix}:guard:{key}` (`lock`, `token`): the identity of the lock guarding the key
/// ([`FencingToken::lock`], bound by the key's first fenced write) and the highest token that
/// wrote it. A write is one Lua script, run atomically by the server, that writes only if every
/// key is guarded by the lease's lock (or by none yet) and has seen no newer token than the
/// lease's, and then records the token; several keys are written all or nothing
/// ([`set_all`](Self::set_all)).
///
/// - A token of another lock fails with [`Error::ForeignToken`], whatever its number.
/// - An older token fails with [`Error::StaleToken`], and the lease becomes
///   [`Lost`](lockkit_core::LeaseState::Lost) at once: a newer grant of the lock wrote.
///
/// This is a token check, like a remote resource's: it rejects a write once a **newer holder
/// has written** the key, not the moment the lease lapses. Write through the fence only (a plain
/// `SET` bypasses it), and keep the guard records (they are never expired or deleted by
/// lockkit). Redis persistence decides whether guard records survive a restart.
///
/// In Cluster mode (`redis+cluster://`) a key and its guard record must share a slot: give every
/// key a hash tag (`{report}:today`, guard record `{prefix}:guard:{report}:today`), the same
/// tag for all keys of one [`set_all`](Self::set_all); without one the server refuses the
/// script (`CROSSSLOT`, an [`Error::Backend`] saying to give the key a hash tag).
///
/// ```no_run
/// use std::time::Duration;
/// use lockkit_core::LockExt;
/// use lockkit_redis::{RedisFence, RedisLock};
///
/// # async fn f() -> lockkit_core::Result<()> {
/// let locks = RedisLock::connect("redis://127.0.0.1:6379").await?;
/// let lease = locks.try_acquire("report", Duration::from_secs(10)).await?;
/// RedisFence::from_lease(&lease)?.set("reports:today", "rows…").await?;
/// lease.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisFence {
    lease: LeaseFence,
    conn: Conn,
    /// `{prefix}:guard:`, to which a data key is appended for its guard record.
    guard_prefix: String,
}

impl fmt::Debug for RedisFence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisFence")
            .field("token", self.lease.token())
            .finish()
    }
}

impl RedisFence {
    /// The fence for writes made under `lease`. It keeps what it needs (the connection and the
    /// token), so it may outlive the borrow.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if `lease` was not granted by a [`RedisLock`](crate::RedisLock)
    /// (a [`RedlockLock`](crate::RedlockLock) lease is refused too).
    pub fn from_lease(lease: &Lease) -> Result<Self> {
        let redis = lease
            .ops()
            .as_any()
            .downcast_ref::<RedisLease>()
            .ok_or_else(|| {
                Error::config(
                    "RedisFence needs a lease of a RedisLock (redis://, rediss://, \
                     redis+sentinel://, redis+cluster://); a Redlock lease has no RedisFence",
                )
            })?;
        // `{prefix}:lock:{name}`, in Cluster mode `{prefix}:lock:{={name}}` (`Keys::build`).
        let suffix = if redis.conn.is_cluster() {
            format!(":lock:{{={}}}", redis.name)
        } else {
            format!(":lock:{}", redis.name)
        };
        let prefix =
            redis.keys.lock.strip_suffix(&suffix).ok_or_else(|| {
                Error::config("RedisFence: the lease's lock key has an unknown form")
            })?;
        Ok(Self {
            lease: LeaseFence::new(lease),
            conn: redis.conn.clone(),
            guard_prefix: format!("{prefix}:guard:"),
        })
    }

    /// The lease's fencing token, which the writes carry.
    pub fn token(&self) -> &FencingToken {
        self.lease.token()
    }

    /// The key of `key`'s guard record.
    pub fn guard_key(&self, key: &str) -> String {
        format!("{}{key}", self.guard_prefix)
    }

    /// `SET key value` if `key` is guarded by the lease's lock (or by none yet) and has seen no
    /// newer token.
    ///
    /// # Errors
    /// - [`Error::ForeignToken`]: another lock guards `key`; nothing was written.
    /// - [`Error::StaleToken`]: a newer token wrote `key`; nothing was written, the lease is now
    ///   lost.
    /// - [`Error::InvalidConfig`]: `key` is a guard record.
    /// - [`Error::Unavailable`] and others from the server: the write may or may not have been
    ///   applied (entirely or not at all).
    ///
    /// # Cancel safety
    /// The script runs entirely or not at all; a dropped call may have run it.
    pub async fn set(&self, key: &str, value: impl AsRef<[u8]>) -> Result<()> {
        self.set_all([(key, value)]).await
    }

    /// Sets every `key = value` of `pairs` in one script, all or nothing, under the conditions
    /// of [`set`](Self::set) for each key.
    ///
    /// # Errors
    /// As [`set`](Self::set); the `resource` of an error is the offending key.
    ///
    /// # Cancel safety
    /// As [`set`](Self::set).
    pub async fn set_all<K, V>(&self, pairs: impl IntoIterator<Item = (K, V)>) -> Result<()>
    where
        K: AsRef<str>,
        V: AsRef<[u8]>,
    {
        let pairs: Vec<(K, V)> = pairs.into_iter().collect();
        if pairs
            .iter()
            .any(|(k, _)| k.as_ref().starts_with(&self.guard_prefix))
        {
            return Err(Error::config(
                "a fenced write cannot touch a guard record (a key under {prefix}:guard:)",
            ));
        }
        let mut call = WRITE.prepare_invoke();
        for (k, _) in &pairs {
            call.key(k.as_ref());
        }
        for (k, _) in &pairs {
            call.key(self.guard_key(k.as_ref()));
        }
        let token = self.lease.token();
        call.arg(token.lock()).arg(token.get().to_string());
        for (_, v) in &pairs {
            call.arg(v.as_ref());
        }
        let (code, index, detail): (i64, usize, String) =
            self.conn.invoke(&call).await.map_err(from_redis)?;
        let resource = || {
            index
                .checked_sub(1)
                .and_then(|i| pairs.get(i))
                .map(|(k, _)| k.as_ref().to_owned())
                .unwrap_or_default()
        };
        match code {
            0 => Ok(()),
            1 => Err(self.lease.foreign(resource(), detail)),
            2 => {
                let current = detail.parse().map_err(|_| bad_reply("fenced write"))?;
                Err(self
                    .lease
                    .stale(resource(), FencingToken::new(token.lock(), current)))
            }
            _ => Err(bad_reply("fenced write")),
        }
    }

    /// `GET key` (reads are not fenced). `None` if the key does not exist.
    ///
    /// # Errors
    /// [`Error::Unavailable`] and others from the server.
    ///
    /// # Cancel safety
    /// Cancel safe (a read).
    pub async fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.conn
            .query(redis::cmd("GET").arg(key))
            .await
            .map_err(from_redis)
    }
}
