//! The server side of a Redis lease: compare-and-pexpire and compare-and-delete on the owner
//! value, as Lua scripts (<https://redis.io/docs/latest/develop/interact/programmability/eval-intro/>).

use std::any::Any;
use std::fmt;
use std::sync::LazyLock;
use std::time::Duration;

use async_trait::async_trait;
use redis::Script;
use redis::aio::ConnectionManager;

use lockkit_core::{Error, LeaseOps, Result};

use crate::error::{bad_reply, from_redis};

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
pub(crate) static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], '')
  return 1
end
return 0
",
    )
});

/// A TTL in whole milliseconds, rounded **up**: the server must never free a lease earlier than
/// the client's deadline assumes.
pub(crate) fn ttl_millis(ttl: Duration) -> u64 {
    let ms = ttl.as_nanos().div_ceil(1_000_000);
    u64::try_from(ms).unwrap_or(u64::MAX)
}

/// Runs the release script for `owner`: `Ok(true)` if it deleted the lock.
pub(crate) async fn compare_and_delete(
    conn: &ConnectionManager,
    lock_key: &str,
    owner: &str,
    channel: &str,
) -> Result<bool> {
    let mut conn = conn.clone();
    let n: i64 = RELEASE
        .key(lock_key)
        .arg(owner)
        .arg(channel)
        .invoke_async(&mut conn)
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
    pub(crate) conn: ConnectionManager,
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
        let mut conn = self.conn.clone();
        let n: i64 = RENEW
            .key(&self.lock_key)
            .arg(&self.owner)
            .arg(ttl_millis(ttl))
            .invoke_async(&mut conn)
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
