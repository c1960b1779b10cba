//! What the server's configuration means for locks, looked at once when connecting:
//!
//! - **Eviction**: with a nonzero `maxmemory`, every `maxmemory-policy` but `noeviction` may
//!   evict lock keys (the `volatile-*` policies evict keys with a TTL, which every lock key
//!   has), which frees a lock behind its holder's back
//!   (<https://redis.io/docs/latest/develop/reference/eviction/>). Read with
//!   `CONFIG GET maxmemory maxmemory-policy`, or from `INFO memory` where `CONFIG` is renamed
//!   or refused. By default a warning; with [`RedisConfig::strict`](crate::RedisConfig::strict)
//!   the connect fails.
//! - **Keyspace notifications**: `notify-keyspace-events` must hold `K` (keyspace channels) and
//!   the classes `g` (`del`), `x` (`expired`) and `e` (`evicted`), or `A` for all classes
//!   (<https://redis.io/docs/latest/develop/use/keyspace-notifications/>). Missing flags are
//!   added with `CONFIG SET`, keeping the flags already set. Where that is not possible
//!   (`CONFIG` renamed or refused, as on many managed services) holders hear of a lost key only
//!   at their next renewal; a warning says so.
//! - **`run_id`** from `INFO server`: the server's identity until it restarts (see `watch.rs`).

use std::collections::HashMap;

use lockkit_core::{Error, Result};

use crate::config::Notifications;
use crate::conn::Conn;
use crate::error::from_redis;

/// The `notify-keyspace-events` flags lock keys need: keyspace channels, `del`, `expired`,
/// `evicted`.
const NEEDED: [char; 4] = ['K', 'g', 'x', 'e'];

/// What connecting learned about the server.
#[derive(Debug)]
pub(crate) struct Facts {
    /// Keyspace notifications of `del`, `expired` and `evicted` are on (found or set).
    pub(crate) notifications: bool,
    /// The server's `run_id`, if `INFO server` answered.
    pub(crate) run_id: Option<String>,
}

/// Looks at the server's eviction policy, keyspace notifications and `run_id` (see the module
/// docs): two or three commands.
///
/// # Errors
/// [`Error::InvalidConfig`] with `strict` when the server may evict lock keys or its policy
/// cannot be read, and when the server is a Redis Cluster node (`redis_mode:cluster`); [`Error::Unavailable`] (and others) when `INFO` fails for another reason
/// than being refused.
pub(crate) async fn inspect(conn: &Conn, strict: bool, mode: Notifications) -> Result<Facts> {
    let config = conn
        .query::<HashMap<String, String>>(
            redis::cmd("CONFIG")
                .arg("GET")
                .arg("notify-keyspace-events")
                .arg("maxmemory")
                .arg("maxmemory-policy"),
        )
        .await
        .map_err(|e| tracing::debug!(error = %e, "CONFIG GET refused"))
        .ok()
        .and_then(|mut m| {
            // Only a reply with all three parameters counts.
            Some(ServerConfig {
                flags: m.remove("notify-keyspace-events")?,
                maxmemory: m.remove("maxmemory")?,
                policy: m.remove("maxmemory-policy")?,
            })
        });
    check_eviction(conn, config.as_ref(), strict).await?;
    let notifications = match &config {
        _ if mode == Notifications::Off => false,
        Some(c) => enable_notifications(conn, &c.flags, mode).await,
        None if mode == Notifications::Use => {
            tracing::info!(
                "the redis server refuses CONFIG: lockkit cannot tell whether it sends keyspace \
                 notifications, so a holder hears that its lock key was lost at its next renewal"
            );
            false
        }
        None => {
            tracing::warn!(
                "the redis server refuses CONFIG (renamed or not permitted): lockkit cannot \
                 check or turn on keyspace notifications (notify-keyspace-events \"Kgxe\"), so a \
                 holder hears that its lock key was deleted, evicted or expired early only at \
                 its next renewal (within TTL/3), not within milliseconds"
            );
            false
        }
    };
    let run_id = match conn.query::<String>(redis::cmd("INFO").arg("server")).await {
        // A cluster node takes only keys of the slots it owns: every lock script would fail
        // with CROSSSLOT or MOVED. Say which URL to use instead.
        Ok(info) if info_field(&info, "redis_mode") == Some("cluster") => {
            return Err(Error::config(
                "the server is a Redis Cluster node: connect with \
                 redis+cluster://host:port[,host:port...]",
            ));
        }
        Ok(info) => info_field(&info, "run_id").map(str::to_owned),
        Err(e) => {
            tracing::warn!(error = %e,
                "INFO server failed: a restart of the redis server while leases are held is \
                 noticed only at their next renewal");
            None
        }
    };
    Ok(Facts {
        notifications,
        run_id,
    })
}

/// The parameters `CONFIG GET` read.
struct ServerConfig {
    /// `notify-keyspace-events`.
    flags: String,
    /// `maxmemory`, in bytes.
    maxmemory: String,
    /// `maxmemory-policy`.
    policy: String,
}

/// Warns about (or, `strict`, refuses) a server that may evict lock keys.
async fn check_eviction(conn: &Conn, config: Option<&ServerConfig>, strict: bool) -> Result<()> {
    let (maxmemory, policy) = match config {
        Some(c) => (c.maxmemory.clone(), c.policy.clone()),
        None => match conn.query::<String>(redis::cmd("INFO").arg("memory")).await {
            Ok(info) => (
                info_field(&info, "maxmemory")
                    .unwrap_or_default()
                    .to_owned(),
                info_field(&info, "maxmemory_policy")
                    .unwrap_or_default()
                    .to_owned(),
            ),
            Err(e) if strict => {
                return Err(Error::config_with(
                    "strict: cannot read the redis server's maxmemory-policy (CONFIG and INFO \
                     memory are refused), so it may evict lock keys",
                    from_redis(e),
                ));
            }
            Err(e) => {
                tracing::warn!(error = %e,
                    "cannot read the redis server's maxmemory-policy (CONFIG and INFO memory \
                     are refused): if it evicts keys, locks are freed behind their holders' backs");
                return Ok(());
            }
        },
    };
    let Some(policy) = evicting_policy(&maxmemory, &policy) else {
        return Ok(());
    };
    let why = format!(
        "the redis server's maxmemory-policy is {policy} with maxmemory {maxmemory} bytes: it can \
         evict lock keys, which frees locks behind their holders' backs; set maxmemory-policy \
         noeviction (or maxmemory 0)"
    );
    if strict {
        return Err(Error::config(format!("strict: {why}")));
    }
    tracing::warn!(policy = %policy, maxmemory = %maxmemory, "{why} (refused with strict=true)");
    Ok(())
}

/// The policy, if it may evict lock keys: any policy but `noeviction` with a nonzero (or
/// unreadable) `maxmemory`.
fn evicting_policy<'a>(maxmemory: &str, policy: &'a str) -> Option<&'a str> {
    let limited = maxmemory.trim().parse::<u64>().map_or(true, |m| m > 0);
    (limited && policy != "noeviction").then_some(policy)
}

/// After a restart (the server forgot a `CONFIG SET` made at runtime): turns the keyspace
/// notifications on again. Whether they are on.
pub(crate) async fn renotify(conn: &Conn, mode: Notifications) -> bool {
    let flags = conn
        .query::<HashMap<String, String>>(
            redis::cmd("CONFIG")
                .arg("GET")
                .arg("notify-keyspace-events"),
        )
        .await
        .ok()
        .and_then(|mut m| m.remove("notify-keyspace-events"));
    match flags {
        Some(f) => enable_notifications(conn, &f, mode).await,
        None => {
            tracing::warn!(
                "after its restart the redis server refuses CONFIG: keyspace notifications are \
                 off, holders hear of a lost lock key at their next renewal"
            );
            false
        }
    }
}

/// Makes sure `notify-keyspace-events` (now `current`) holds [`NEEDED`], adding what is
/// missing with `CONFIG SET` if `mode` allows it. Whether notifications are on now.
async fn enable_notifications(conn: &Conn, current: &str, mode: Notifications) -> bool {
    let Some(merged) = merged_flags(current) else {
        return true;
    };
    if mode != Notifications::Set {
        tracing::info!(current = %current,
            "the redis server does not send the keyspace notifications lockkit needs \
             (notify-keyspace-events \"Kgxe\") and notifications=use forbids turning them on: a \
             holder hears that its lock key was lost at its next renewal (within TTL/3)");
        return false;
    }
    match conn
        .query::<()>(
            redis::cmd("CONFIG")
                .arg("SET")
                .arg("notify-keyspace-events")
                .arg(&merged),
        )
        .await
    {
        Ok(()) => {
            tracing::info!(was = %current, now = %merged,
                "turned on keyspace notifications on the redis server for lock-key losses");
            true
        }
        Err(e) => {
            tracing::warn!(error = %e, current = %current,
                "cannot turn on keyspace notifications (CONFIG SET notify-keyspace-events \
                 refused): a holder hears that its lock key was deleted, evicted or expired \
                 early only at its next renewal (within TTL/3)");
            false
        }
    }
}

/// `current` with the [`NEEDED`] flags it lacks appended, or `None` if it lacks none. `A`
/// stands for every class (`g`, `x` and `e` among them).
fn merged_flags(current: &str) -> Option<String> {
    let has = |c: char| current.contains(c) || (c != 'K' && current.contains('A'));
    let missing: String = NEEDED.into_iter().filter(|&c| !has(c)).collect();
    (!missing.is_empty()).then(|| format!("{current}{missing}"))
}

/// The value of `field` in an `INFO` reply (`field:value` lines).
pub(crate) fn info_field<'a>(info: &'a str, field: &str) -> Option<&'a str> {
    info.lines().find_map(|l| {
        l.strip_prefix(field)?
            .strip_prefix(':')
            .map(|v| v.trim_end_matches('\r'))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_are_merged_not_overwritten() {
        assert_eq!(merged_flags("").as_deref(), Some("Kgxe"));
        assert_eq!(merged_flags("Ex").as_deref(), Some("ExKge"));
        assert_eq!(merged_flags("AK"), None);
        assert_eq!(merged_flags("KA$"), None);
        assert_eq!(merged_flags("gxeK"), None);
        assert_eq!(merged_flags("AE").as_deref(), Some("AEK"));
    }

    #[test]
    fn which_policies_evict_lock_keys() {
        assert_eq!(evicting_policy("0", "allkeys-lru"), None);
        assert_eq!(evicting_policy("1000000", "noeviction"), None);
        assert_eq!(
            evicting_policy("1000000", "volatile-ttl"),
            Some("volatile-ttl")
        );
        assert_eq!(
            evicting_policy("1048576", "allkeys-lru"),
            Some("allkeys-lru")
        );
        assert_eq!(evicting_policy("", "allkeys-lfu"), Some("allkeys-lfu"));
    }

    #[test]
    fn info_fields() {
        let info = "# Server\r\nredis_version:7.0.15\r\nrun_id:abc123\r\nrun_id_x:no\r\n";
        assert_eq!(info_field(info, "run_id"), Some("abc123"));
        assert_eq!(info_field(info, "redis_version"), Some("7.0.15"));
        assert_eq!(info_field(info, "maxmemory"), None);
    }
}
