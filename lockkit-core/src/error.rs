//! The one error type of lockkit.

use std::time::Duration;

use crate::{FencingToken, LossReason};

/// A boxed error from a backend's client library, kept as the `source()` of an [`Error`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Shorthand for `Result<T, lockkit_core::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong when acquiring, renewing, releasing or fencing.
///
/// Variants are matchable in tests; client-library errors are kept as [`source`](std::error::Error::source)
/// and, for [`Auth`](Error::Auth), [`Unavailable`](Error::Unavailable) and
/// [`Backend`](Error::Backend), also shown in the message (as object_store does), so a plain
/// `{}` already says what went wrong. Use [`Error::is_retryable`] to tell a transient
/// failure (worth a retry with backoff) from a permanent one.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A try-acquire ([`Wait::No`](crate::Wait::No)) found the lock held by someone else.
    #[error("lock {name:?} is held by another holder")]
    Held {
        /// The lock name.
        name: String,
    },

    /// A waiting acquire did not get the lock within its timeout.
    #[error("timed out after {waited:?} waiting for lock {name:?}")]
    Timeout {
        /// The lock name.
        name: String,
        /// How long the acquire waited.
        waited: Duration,
    },

    /// A try-once acquire ([`Wait::No`](crate::Wait::No)) was granted the lock, but the grant
    /// arrived with less validity left than
    /// [`AcquireOptions::min_validity`](crate::AcquireOptions#structfield.min_validity) (a slow
    /// network or server). The grant was given back (compare-and-delete). Transient: worth a retry.
    #[error(
        "lock {name:?} was granted with only {remaining:?} left, below the minimum validity \
         {min_validity:?}; the grant was given back"
    )]
    GrantTooShort {
        /// The lock name.
        name: String,
        /// The validity the grant had left when it arrived.
        remaining: Duration,
        /// The minimum it had to have.
        min_validity: Duration,
    },

    /// Renew or release by a lease that no longer owns the lock on the server: it lapsed, and the
    /// lock is free or was granted to someone else. Nothing was changed on the server.
    #[error("lease on lock {name:?} is no longer held")]
    NotHeld {
        /// The lock name.
        name: String,
    },

    /// The lease is [`LeaseState::Lost`](crate::LeaseState::Lost) on the client side: its deadline
    /// passed or the backend session that carried it expired. A lost lease is never revived.
    #[error("lease on lock {name:?} was lost: {reason}")]
    LeaseLost {
        /// The lock name.
        name: String,
        /// Why it was lost.
        reason: LossReason,
    },

    /// A fenced write carried a token lower than one the resource already accepted.
    #[error("stale fencing token {token} for {resource:?}: the resource has seen {current}")]
    StaleToken {
        /// The protected resource.
        resource: String,
        /// The token that was rejected.
        token: FencingToken,
        /// The highest token the resource has seen (or the current holder's token).
        current: FencingToken,
    },

    /// A fenced write carried a token of another lock than the one guarding the resource. Every
    /// fence binds a resource to the lock of the first token that wrote it; nothing was written.
    #[error(
        "fencing token {token} for {resource:?} belongs to another lock: the resource is \
         guarded by lock {expected_lock:?}"
    )]
    ForeignToken {
        /// The protected resource.
        resource: String,
        /// The lock guarding the resource (see [`FencingToken::lock`]).
        expected_lock: String,
        /// The token that was rejected (its [`lock`](FencingToken::lock) is the other lock).
        token: FencingToken,
    },

    /// A string is not a fencing token in its
    /// [documented form](crate::FencingToken#string-form-version-1).
    #[error("invalid fencing token: {reason}")]
    InvalidToken {
        /// What is wrong.
        reason: &'static str,
    },

    /// The lock, election or semaphore name is empty, too long, or could escape the backend's
    /// key namespace.
    #[error("invalid {what} name {name:?}: {reason}")]
    InvalidName {
        /// What the name was for: `"lock"`, `"election"` or `"semaphore"`.
        what: &'static str,
        /// The rejected name; a longer one than 64 characters is cut to its first 64 and `…`.
        name: String,
        /// Why it was rejected.
        reason: &'static str,
    },

    /// Bad options or configuration: zero or absurd TTL, malformed URL, unknown scheme,
    /// a scheme whose Cargo feature is off.
    #[error("invalid configuration: {reason}")]
    InvalidConfig {
        /// What is wrong, for humans.
        reason: String,
        /// The parser's error, if any.
        #[source]
        source: Option<BoxError>,
    },

    /// A semaphore acquire asked for another number of permits than the one in force for the
    /// name (set by the acquire that found it idle, kept while it has holders or waiters).
    /// Nothing was changed: the clients of one semaphore must agree on its N.
    #[error(
        "semaphore {name:?} has {theirs} permits, but this acquire asked for {ours}: all its \
         clients must use the same number"
    )]
    PermitsMismatch {
        /// The semaphore name.
        name: String,
        /// The number of permits this acquire asked for.
        ours: u32,
        /// The number in force on the server.
        theirs: u32,
    },

    /// The backend cannot do this (for example a manual-renewal lease on ZooKeeper, whose session
    /// heartbeats cannot be paused).
    #[error("{operation} is not supported by the {backend} backend")]
    NotSupported {
        /// What was asked.
        operation: &'static str,
        /// Which backend.
        backend: &'static str,
    },

    /// The server refused the credentials.
    #[error("{backend}: authentication failed: {source}")]
    Auth {
        /// Which backend.
        backend: &'static str,
        /// The client library's error.
        #[source]
        source: BoxError,
    },

    /// The server could not be reached or did not answer in time. Transient: worth a retry.
    #[error("{backend}: server unavailable: {source}")]
    Unavailable {
        /// Which backend.
        backend: &'static str,
        /// The client library's error.
        #[source]
        source: BoxError,
    },

    /// Any other error reported by the backend's client library. Treated as permanent.
    #[error("{backend}: {source}")]
    Backend {
        /// Which backend.
        backend: &'static str,
        /// The client library's error.
        #[source]
        source: BoxError,
    },
}

impl Error {
    /// Whether retrying the same call later may succeed (the server was unreachable or slow).
    ///
    /// [`Held`](Error::Held) and [`Timeout`](Error::Timeout) are not "retryable" in this sense: they
    /// describe contention, which the acquire's [`Wait`](crate::Wait) policy handles.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Error::Unavailable { .. } | Error::GrantTooShort { .. }
        )
    }

    /// Builds [`Error::InvalidConfig`] without a source.
    pub fn config(reason: impl Into<String>) -> Self {
        Error::InvalidConfig {
            reason: reason.into(),
            source: None,
        }
    }

    /// Builds [`Error::InvalidConfig`] keeping the parser's error as source.
    pub fn config_with(reason: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Error::InvalidConfig {
            reason: reason.into(),
            source: Some(source.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retryable_classification() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert!(
            Error::Unavailable {
                backend: "redis",
                source: io.into()
            }
            .is_retryable()
        );
        assert!(!Error::Held { name: "a".into() }.is_retryable());
        assert!(!Error::config("x").is_retryable());
    }

    #[test]
    fn source_is_kept() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let e = Error::Unavailable {
            backend: "redis",
            source: io.into(),
        };
        let src = std::error::Error::source(&e).expect("source kept");
        assert_eq!(src.to_string(), "refused");
    }
}
