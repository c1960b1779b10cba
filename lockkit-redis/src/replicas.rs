//! Replication-confirmed grants ([`RedisConfig::min_replicas`](crate::RedisConfig::min_replicas)):
//! a grant is handed out only once `n` replicas acknowledged it.
//!
//! After the acquire script granted the lock or a slot (or a release handed it over), the grant's key is
//! renewed with the compare-and-`PEXPIRE` script and then `WAIT n timeout` is sent
//! (<https://redis.io/docs/latest/commands/wait/>), both on a connection of their own: `WAIT`
//! blocks the connection it is sent on until the replicas acknowledged every write that
//! connection made, so the shared command connection (renewals, other acquires) never waits
//! behind it; the renewal is that connection's write, and it comes after the grant in the
//! master's replication stream, so its acknowledgement covers the grant (also a grant that
//! another client's release made). Fewer than `n` acknowledgements within the timeout: the grant
//! is given back (the cleanup script of a cancelled acquire: the next waiter gets it) and the
//! attempt fails with [`Error::Unavailable`] whose source is a [`NotReplicated`]; an acquire
//! that may wait retries it (with its retry policy) until its deadline.

use std::fmt;
use std::time::Duration;

use lockkit_core::{Error, Result};

use crate::conn::Conn;
use crate::core::{Keys, RENEW, delay_px, ttl_millis};
use crate::error::{BACKEND, bad_reply, from_redis};

/// The source of the [`Error::Unavailable`] of a grant given back because fewer replicas than
/// [`RedisConfig::min_replicas`](crate::RedisConfig::min_replicas) acknowledged it in time.
/// Find it with `std::error::Error::source` and `downcast_ref`:
///
/// ```
/// # fn f(e: &lockkit_core::Error) -> Option<u32> {
/// use lockkit_redis::NotReplicated;
/// match e {
///     lockkit_core::Error::Unavailable { source, .. } => {
///         source.downcast_ref::<NotReplicated>().map(|n| n.acknowledged)
///     }
///     _ => None,
/// }
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct NotReplicated {
    /// How many replicas had to acknowledge the grant.
    pub wanted: u32,
    /// How many did, within [`timeout`](Self::timeout).
    pub acknowledged: u32,
    /// How long the grant waited for them (`WAIT`'s timeout).
    pub timeout: Duration,
}

impl fmt::Display for NotReplicated {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the grant was given back: {} of {} replicas acknowledged it within {:?}",
            self.acknowledged, self.wanted, self.timeout
        )
    }
}

impl std::error::Error for NotReplicated {}

/// Confirms the grant of `keys` to `owner` (TTL `ttl`, lock-delay `delay`) on `wanted`
/// replicas within `timeout`: renews it and sends `WAIT` on the confirmation connection.
///
/// # Errors
/// [`Error::Unavailable`] with a [`NotReplicated`] source when too few replicas acknowledged,
/// or saying the grant was gone before it was confirmed; the converted redis error otherwise.
/// In every case the caller gives the grant back.
///
/// # Cancel safety
/// Cancel safe; the commands may still run on the server.
pub(crate) async fn confirm(
    conn: &Conn,
    keys: &Keys,
    owner: &str,
    ttl: Duration,
    delay: Option<Duration>,
    wanted: u32,
    timeout: Duration,
) -> Result<()> {
    let mut wait = redis::cmd("WAIT");
    wait.arg(wanted).arg(ttl_millis(timeout));
    let (renewed, acked): (i64, i64) = conn
        .invoke_then(
            RENEW
                .key(&keys.lock)
                .key(&keys.delay)
                .arg(owner)
                .arg(ttl_millis(ttl))
                .arg(delay_px(ttl, delay)),
            &keys.lock,
            &wait,
        )
        .await
        .map_err(from_redis)?;
    match renewed {
        1 => {}
        0 => {
            return Err(Error::Unavailable {
                backend: BACKEND,
                source: "the grant was gone before its replicas confirmed it".into(),
            });
        }
        _ => return Err(bad_reply("renew")),
    }
    let acknowledged = u32::try_from(acked).unwrap_or(0);
    if acknowledged >= wanted {
        return Ok(());
    }
    tracing::debug!(lock = %keys.lock, wanted, acknowledged, ?timeout,
        "too few replicas acknowledged a grant; giving it back");
    Err(Error::Unavailable {
        backend: BACKEND,
        source: Box::new(NotReplicated {
            wanted,
            acknowledged,
            timeout,
        }),
    })
}
