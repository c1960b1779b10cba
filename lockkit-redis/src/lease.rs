//! The server side of a Redis lease: compare-and-pexpire and compare-and-delete on the owner
//! value, as Lua scripts (<https://redis.io/docs/latest/develop/interact/programmability/eval-intro/>).

use std::any::Any;
use std::fmt;
use std::sync::LazyLock;
use std::time::Duration;

use async_trait::async_trait;
use redis::Script;
use tokio::time::Instant;

use lockkit_core::backend::LeaseOps;
use lockkit_core::{Error, Result};

use crate::conn::Conn;
use crate::error::{bad_reply, from_redis};
use crate::lock::Keys;

/// Compare-and-pexpire. `KEYS[1]` lock key; `ARGV[1]` owner value, `ARGV[2]` TTL in ms.
/// Returns 1 if the key held our owner value and its expiry was set, 0 otherwise. A lapsed lock
/// (key gone or someone else's value) is never re-taken.
pub(crate) static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
",
    )
});

/// Compare-and-delete, then wake the waiters. `KEYS[1]` lock key; `ARGV[1]` owner value,
/// `ARGV[2]` the lock's release channel. Returns 1 if our value was deleted, 0 otherwise.
///
/// The `PUBLISH` is a `redis.pcall`: an ACL user without permission for the channel
/// (<https://redis.io/docs/latest/operate/oss_and_stack/management/security/acl/>, "Pub/Sub
/// channel permissions") still releases; its waiters then wake by polling.
pub(crate) static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.pcall('PUBLISH', ARGV[2], '')
  return 1
end
return 0
",
    )
});

/// Cleanup of an acquire that was cancelled (or whose reply was lost or came too late), sent
/// with plain `EVAL` so that a flushed script cache cannot fail it. `KEYS[1]` lock key,
/// `KEYS[2]` the attempt's tombstone key; `ARGV[1]` owner value, `ARGV[2]` release channel,
/// `ARGV[3]` tombstone TTL in ms.
///
/// If the attempt took the lock, the lock is deleted (and waiters woken): 1. If not (yet), a
/// tombstone for the attempt's owner value is left, so that an acquire script still on its way
/// (queued on another connection) finds it and takes nothing: 0.
const CANCEL: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.pcall('PUBLISH', ARGV[2], '')
  return 1
end
redis.call('SET', KEYS[2], '1', 'PX', ARGV[3])
return 0
";

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
    cmd.arg(CANCEL)
        .arg(2)
        .arg(&keys.lock)
        .arg(keys.tombstone(owner))
        .arg(owner)
        .arg(&keys.channel)
        .arg(ttl_millis(cancel_horizon(ttl)));
    match conn.query::<i64>(&cmd).await.map_err(from_redis)? {
        1 => Ok(true),
        0 => Ok(false),
        _ => Err(bad_reply("cleanup")),
    }
}

/// Removes what the acquire attempt with `owner` (sent at `sent`) may have taken, retrying
/// transient errors (with backoff, 50 ms up to 1 s) until [`cancel_horizon`] after `sent`.
///
/// # Cancel safety
/// Meant to be spawned; dropping it stops the retries.
pub(crate) async fn cancel_attempt(
    conn: Conn,
    keys: Keys,
    owner: String,
    sent: Instant,
    ttl: Duration,
) {
    let until = sent.checked_add(cancel_horizon(ttl));
    let mut delay = Duration::from_millis(50);
    loop {
        match cancel_once(&conn, &keys, &owner, ttl).await {
            Ok(true) => {
                tracing::debug!(key = %keys.lock, "removed the lock of a cancelled acquire");
                return;
            }
            Ok(false) => return,
            Err(e) if e.is_retryable() && until.is_none_or(|u| Instant::now() + delay < u) => {
                tracing::debug!(key = %keys.lock, error = %e, "cleanup of a cancelled acquire failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(1));
            }
            Err(e) => {
                tracing::warn!(key = %keys.lock, error = %e,
                    "cleanup of a cancelled acquire failed; if it took the lock, its TTL frees it");
                return;
            }
        }
    }
}

/// A TTL in whole milliseconds, rounded **up**: the server must never free a lease earlier than
/// the client's deadline assumes.
pub(crate) fn ttl_millis(ttl: Duration) -> u64 {
    let ms = ttl.as_nanos().div_ceil(1_000_000);
    u64::try_from(ms).unwrap_or(u64::MAX)
}

/// Runs the release script for `owner`: `Ok(true)` if it deleted the lock.
pub(crate) async fn compare_and_delete(
    conn: &Conn,
    lock_key: &str,
    owner: &str,
    channel: &str,
) -> Result<bool> {
    let n: i64 = conn
        .invoke(RELEASE.key(lock_key).arg(owner).arg(channel))
        .await
        .map_err(from_redis)?;
    match n {
        1 => Ok(true),
        0 => Ok(false),
        _ => Err(bad_reply("release")),
    }
}

/// One grant: the lock key and the random owner value stored in it.
pub(crate) struct RedisLease {
    pub(crate) conn: Conn,
    pub(crate) name: String,
    pub(crate) lock_key: String,
    pub(crate) channel: String,
    pub(crate) owner: String,
}

impl fmt::Debug for RedisLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLease")
            .field("lock_key", &self.lock_key)
            .field("owner", &self.owner)
            .finish()
    }
}

impl RedisLease {
    fn not_held(&self) -> Error {
        Error::NotHeld {
            name: self.name.clone(),
        }
    }
}

#[async_trait]
impl LeaseOps for RedisLease {
    async fn renew(&self, ttl: Duration) -> Result<()> {
        let n: i64 = self
            .conn
            .invoke(
                RENEW
                    .key(&self.lock_key)
                    .arg(&self.owner)
                    .arg(ttl_millis(ttl)),
            )
            .await
            .map_err(from_redis)?;
        match n {
            1 => Ok(()),
            0 => Err(self.not_held()),
            _ => Err(bad_reply("renew")),
        }
    }

    async fn release(&self) -> Result<()> {
        if compare_and_delete(&self.conn, &self.lock_key, &self.owner, &self.channel).await? {
            Ok(())
        } else {
            Err(self.not_held())
        }
    }

    async fn check(&self) -> Result<()> {
        crate::fence::holds(&self.conn, &self.lock_key, &self.owner)
            .await?
            .then_some(())
            .ok_or_else(|| self.not_held())
    }

    fn as_any(&self) -> &dyn Any {
        self
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
}
