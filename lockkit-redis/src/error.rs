//! Conversion of redis client errors into [`lockkit_core::Error`].
//!
//! - Unreachable server, refused or dropped connection, I/O error, timeout, and the transient
//!   server states `LOADING` (loading its data set), `BUSY` (another script runs too long),
//!   `TRYAGAIN` and `MASTERDOWN`, and in Cluster mode the redirections and states the cluster
//!   connection's retries did not get past (`ASK`, `MOVED`, `CLUSTERDOWN`: a slot being
//!   migrated or a failover) → [`Error::Unavailable`] (retryable).
//! - A reply that is not the Redis protocol (`ErrorKind::Parse`: the URL names an HTTP server or
//!   another service) → [`Error::Unavailable`] saying that the server does not speak Redis.
//! - Refused credentials (`AuthenticationFailed`, `WRONGPASS`, `NOAUTH`) → [`Error::Auth`].
//! - `READONLY` (the URL names a read-only replica, where no lock can be taken) →
//!   [`Error::Backend`] saying so; not retried, since a replica stays one unless promoted.
//! - `NOPERM` (the ACL user lacks a command, key or channel permission,
//!   <https://redis.io/docs/latest/operate/oss_and_stack/management/security/acl/>) →
//!   [`Error::Backend`] saying so.
//! - `CROSSSLOT` (in Cluster mode, a [`RedisFence`](crate::RedisFence) write of a key without a
//!   hash tag: the key and its guard record are in different slots) → [`Error::Backend`]
//!   saying to give the key a hash tag.
//! - A client configuration the redis crate rejects, or a database number the server does not
//!   have → [`Error::InvalidConfig`].
//! - Anything else → [`Error::Backend`].
//!
//! The redis crate's errors never contain the password (its connection info redacts it), and
//! this module never adds the URL to a message.

use redis::{ErrorKind, RedisError, ServerErrorKind};

use lockkit_core::Error;

/// The backend name used in errors and [`Guarantees`](lockkit_core::Guarantees).
pub(crate) const BACKEND: &str = "redis";

/// Converts a redis client error (see the module docs for the mapping).
pub(crate) fn from_redis(e: RedisError) -> Error {
    if is_auth(&e) {
        let source: lockkit_core::BoxError = if e.kind() == ErrorKind::AuthenticationFailed {
            Box::new(Refused(e))
        } else {
            e.into()
        };
        return Error::Auth {
            backend: BACKEND,
            source,
        };
    }
    if e.kind() == ErrorKind::Parse {
        // The reply is not RESP at all: the host and port are those of another service (an HTTP
        // server, a database), or a proxy that garbles the stream. Unavailable like a closed
        // port, since that is what it is for lockkit: no Redis answers there.
        let first = e.to_string().lines().next().unwrap_or_default().to_owned();
        return Error::Unavailable {
            backend: BACKEND,
            source: Box::new(NotRedis(first)),
        };
    }
    if is_transient(&e) {
        return Error::Unavailable {
            backend: BACKEND,
            source: e.into(),
        };
    }
    if e.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly) || e.code() == Some("READONLY") {
        return Error::Backend {
            backend: BACKEND,
            source: format!(
                "the server is a read-only replica; point lockkit at the primary ({e})"
            )
            .into(),
        };
    }
    if e.kind() == ErrorKind::Server(ServerErrorKind::NoPerm) || e.code() == Some("NOPERM") {
        return Error::Backend {
            backend: BACKEND,
            source: format!("permission denied by the server's ACL ({e})").into(),
        };
    }
    if e.kind() == ErrorKind::Server(ServerErrorKind::CrossSlot) {
        return Error::Backend {
            backend: BACKEND,
            source: format!(
                "on redis+cluster:// a fenced key and its guard record must share a slot: give \
                 the key a hash tag, e.g. {{reports}}:today (the same tag for every key of one \
                 set_all) ({e})"
            )
            .into(),
        };
    }
    if e.to_string().contains("DB index is out of range") {
        return Error::config_with("the server has no database with this number", e);
    }
    if e.kind() == ErrorKind::InvalidClientConfig {
        return Error::config_with("the redis client rejected the configuration", e);
    }
    Error::Backend {
        backend: BACKEND,
        source: e.into(),
    }
}

/// A reply that is not the Redis protocol: the server there is not a Redis server. Holds the
/// first line of the parser's error (the rest repeats the bytes it did not expect).
#[derive(Debug)]
struct NotRedis(String);

impl std::fmt::Display for NotRedis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the server does not speak the Redis protocol (is the URL's host:port a Redis \
             server?): its reply did not parse ({})",
            self.0
        )
    }
}

impl std::error::Error for NotRedis {}

/// Credentials the server refused while connecting. The client reports a wrong password and a
/// password sent to a server that has none (`AUTH … called without any password configured`)
/// alike, so the message names both.
#[derive(Debug)]
struct Refused(RedisError);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(
            "the server refused the URL's user name or password (a wrong one, or one given to a \
             server that has no password set)",
        )
    }
}

impl std::error::Error for Refused {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

fn is_auth(e: &RedisError) -> bool {
    e.kind() == ErrorKind::AuthenticationFailed || matches!(e.code(), Some("WRONGPASS" | "NOAUTH"))
}

fn is_transient(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_timeout()
        || e.is_connection_refusal()
        || e.is_connection_dropped()
        || matches!(
            e.kind(),
            ErrorKind::Server(
                ServerErrorKind::BusyLoading
                    | ServerErrorKind::TryAgain
                    | ServerErrorKind::MasterDown
            )
        )
        || matches!(
            e.code(),
            Some("BUSY" | "LOADING" | "TRYAGAIN" | "MASTERDOWN" | "ASK" | "MOVED" | "CLUSTERDOWN")
        )
}

/// The error for an operation that did not finish within `limit` (connect, subscribe).
pub(crate) fn timed_out(what: &'static str, limit: std::time::Duration) -> Error {
    Error::Unavailable {
        backend: BACKEND,
        source: format!("{what} did not finish within {limit:?}").into(),
    }
}

/// The error for a script reply of an unexpected shape (a script from another lockkit version
/// or a key written by someone else).
pub(crate) fn bad_reply(what: &'static str) -> Error {
    Error::Backend {
        backend: BACKEND,
        source: format!("unexpected reply from the {what} script").into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapping() {
        let auth = RedisError::from((
            ErrorKind::AuthenticationFailed,
            "Password authentication failed",
        ));
        assert!(matches!(from_redis(auth), Error::Auth { .. }));
        let io = RedisError::from(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "refused",
        ));
        assert!(matches!(from_redis(io), Error::Unavailable { .. }));
        let cfg = RedisError::from((ErrorKind::InvalidClientConfig, "Missing hostname"));
        assert!(matches!(from_redis(cfg), Error::InvalidConfig { .. }));
        let other = RedisError::from((ErrorKind::UnexpectedReturnType, "bad"));
        assert!(matches!(from_redis(other), Error::Backend { .. }));
        let not_resp = RedisError::from((ErrorKind::Parse, "bad"));
        assert!(matches!(from_redis(not_resp), Error::Unavailable { .. }));
    }
}
