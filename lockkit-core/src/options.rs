//! Acquire options and input validation shared by every backend.

use std::time::Duration;

use crate::{Error, Result};

/// The shortest TTL any backend accepts: 100 ms. Shorter leases cannot be renewed reliably over
/// a network and would only produce spurious losses.
pub const MIN_TTL: Duration = Duration::from_millis(100);

/// The longest TTL any backend accepts: 24 hours. A lease that long is a lock that a crashed holder
/// blocks for a day; anything longer is taken as a unit mistake (seconds passed as milliseconds).
pub const MAX_TTL: Duration = Duration::from_secs(24 * 60 * 60);

/// The TTL used when none is given: 30 s.
pub const DEFAULT_TTL: Duration = Duration::from_secs(30);

/// The longest pause between two retries of a transient failure: 10 minutes.
pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(600);

/// Longest [`AcquireOptions::lock_delay`]: one minute, Chubby's bound (a delay is for in-flight
/// writes to drain, not a second TTL).
pub const MAX_LOCK_DELAY: Duration = Duration::from_secs(60);

/// The longest lock name, in bytes of UTF-8: 256.
pub const MAX_NAME_BYTES: usize = 256;

/// How long an acquire waits for a lock that is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Wait {
    /// Try once: fail with [`Error::Held`] if the lock is held.
    No,
    /// Wait up to this long, then fail with [`Error::Timeout`].
    Timeout(Duration),
    /// Wait until the lock is granted (or the future is dropped).
    #[default]
    Forever,
}

/// Retry of *transient* failures ([`Error::is_retryable`]) during an acquire: exponential backoff
/// with jitter (each pause between 1× and 2× the current delay), bounded by the acquire's [`Wait`]
/// deadline.
///
/// Contention is not a transient failure: waiting for a held lock is the job of [`Wait`], and the
/// backends do it by watching, not by retrying.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryPolicy {
    /// First delay. Default 50 ms.
    pub min_delay: Duration,
    /// Largest delay. Default 2 s.
    pub max_delay: Duration,
    /// Attempts after the first one, for a try-once or timed acquire. Default 5. A
    /// [`Wait::Forever`] acquire is not bounded by it: it retries transient failures until the
    /// server answers (or the future is dropped); set [`retry`](AcquireOptions#structfield.retry) to `None` to not
    /// retry at all.
    pub max_retries: usize,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            min_delay: Duration::from_millis(50),
            max_delay: Duration::from_secs(2),
            max_retries: 5,
        }
    }
}

impl RetryPolicy {
    /// A policy with the given delays and number of retries.
    pub fn new(min_delay: Duration, max_delay: Duration, max_retries: usize) -> Self {
        Self {
            min_delay,
            max_delay,
            max_retries,
        }
    }
}

/// Options of one acquire. Build with [`AcquireOptions::new`] and the chained setters.
///
/// ```
/// use std::time::Duration;
/// use lockkit_core::{AcquireOptions, Wait};
///
/// let opts = AcquireOptions::new()
///     .ttl(Duration::from_secs(10))
///     .wait(Wait::Timeout(Duration::from_secs(2)));
/// assert_eq!(opts.ttl, Duration::from_secs(10));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AcquireOptions {
    /// Lease TTL. Between [`MIN_TTL`] and [`MAX_TTL`]; default [`DEFAULT_TTL`].
    pub ttl: Duration,
    /// How long to wait for a held lock. Default [`Wait::Forever`].
    pub wait: Wait,
    /// Retry of transient failures. Default: `Some(RetryPolicy::default())`.
    pub retry: Option<RetryPolicy>,
    /// Renew the lease automatically about every TTL/3 until it is released. Default `true`.
    /// With `false` the holder must call [`Lease::renew`](crate::Lease::renew) itself.
    pub keepalive: bool,
    /// Release the lock (best effort, in the background) when the [`Lease`](crate::Lease) is
    /// dropped without [`release`](crate::Lease::release). Default `true`.
    pub release_on_drop: bool,
    /// Add the lock name as a `lock` label to this acquire's and its lease's metrics. Default
    /// `false`: lock names are unbounded, and each name makes a new time series. Turn it on only
    /// for a small, fixed set of names.
    pub lock_name_label: bool,
    /// The least time a grant must have left before [`Lease::valid_until`](crate::Lease::valid_until)
    /// when it reaches the caller. A grant that arrives with less (a slow network, a long
    /// queue on the server) is given back at once (compare-and-delete) and the acquire goes on
    /// waiting; a try-once acquire fails with [`Error::GrantTooShort`](crate::Error::GrantTooShort).
    /// `None` (the default) means half the TTL: a grant with less is already
    /// [`Suspect`](crate::LeaseState::Suspect). `Some(Duration::ZERO)` accepts any grant. Must be
    /// shorter than the TTL.
    pub min_validity: Option<Duration>,
    /// Lock-delay (Chubby, section 2.4): when this lease ends *without a release* — it lapsed
    /// unrenewed, its session or connection was lost, its holder died — the lock is granted to
    /// no one until at least this long after the server freed it, so that writes the failed
    /// holder still has in flight drain first. An explicit [`Lease::release`](crate::Lease::release)
    /// (and a release on drop that reaches the server) frees the lock at once. `None` (the
    /// default) or `Some(Duration::ZERO)`: no delay. At most [`MAX_LOCK_DELAY`]. Backends without
    /// it ([`Guarantees::lock_delay`](crate::Guarantees::lock_delay) `false`) refuse a nonzero
    /// delay with [`Error::NotSupported`]. Where the server cannot tell when a failed holder's
    /// lock was freed, the delay counts from when the next acquirer saw it free: longer, never
    /// shorter. During the delay a try-once acquire gets [`Error::Held`] and waiters wait.
    pub lock_delay: Option<Duration>,
    /// The backend name the metrics and spans carry; set by [`Lock::acquire`](crate::Lock::acquire).
    pub(crate) observed_backend: Option<&'static str>,
    /// What the lease is, for its events: `None` a lock's, else a leadership's or a permit's;
    /// set by the slot grant ([`Election::campaign`](crate::Election::campaign),
    /// [`Semaphore::acquire_permit`](crate::Semaphore::acquire_permit)).
    pub(crate) observed_kind: Option<crate::slots::SlotKind>,
}

impl Default for AcquireOptions {
    fn default() -> Self {
        Self {
            ttl: DEFAULT_TTL,
            wait: Wait::Forever,
            retry: Some(RetryPolicy::default()),
            keepalive: true,
            release_on_drop: true,
            lock_name_label: false,
            min_validity: None,
            lock_delay: None,
            observed_backend: None,
            observed_kind: None,
        }
    }
}

impl AcquireOptions {
    /// The defaults: 30 s TTL, wait forever, retry transient errors, keepalive, release on drop.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the lease TTL.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// Sets how long to wait for a held lock.
    pub fn wait(mut self, wait: Wait) -> Self {
        self.wait = wait;
        self
    }

    /// Sets (or with `None` disables) retry of transient failures.
    pub fn retry(mut self, retry: Option<RetryPolicy>) -> Self {
        self.retry = retry;
        self
    }

    /// Turns automatic renewal on or off.
    pub fn keepalive(mut self, on: bool) -> Self {
        self.keepalive = on;
        self
    }

    /// Turns best-effort release on drop on or off.
    pub fn release_on_drop(mut self, on: bool) -> Self {
        self.release_on_drop = on;
        self
    }

    /// Turns the `lock` metric label on or off (see [`lock_name_label`](Self#structfield.lock_name_label)).
    pub fn lock_name_label(mut self, on: bool) -> Self {
        self.lock_name_label = on;
        self
    }

    /// Sets the least validity a grant must have left when it is returned (see
    /// [`min_validity`](Self#structfield.min_validity)); `Duration::ZERO` accepts any grant.
    pub fn min_validity(mut self, min: Duration) -> Self {
        self.min_validity = Some(min);
        self
    }

    /// Sets the lock-delay after a failed (not released) holder (see
    /// [`lock_delay`](Self#structfield.lock_delay)); `Duration::ZERO` turns it off.
    pub fn lock_delay(mut self, delay: Duration) -> Self {
        self.lock_delay = Some(delay);
        self
    }

    /// The lock-delay in force: `None` when off (unset or zero).
    pub fn effective_lock_delay(&self) -> Option<Duration> {
        self.lock_delay.filter(|d| !d.is_zero())
    }

    /// The minimum validity in force: the one set, or half the TTL.
    pub fn effective_min_validity(&self) -> Duration {
        self.min_validity.unwrap_or(self.ttl / 2)
    }

    /// Checks the TTL and the wait timeout.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if the TTL is outside [`MIN_TTL`]..=[`MAX_TTL`], the wait
    /// timeout is longer than [`MAX_TTL`] (almost surely a unit mistake; use [`Wait::Forever`]),
    /// the retry delays are inverted or longer than [`MAX_RETRY_DELAY`], or the minimum validity
    /// is not shorter than the TTL (no grant could ever meet it), or the lock-delay is longer than
    /// [`MAX_LOCK_DELAY`].
    pub fn validate(&self) -> Result<()> {
        validate_ttl(self.ttl)?;
        if let Some(d) = self.lock_delay
            && d > MAX_LOCK_DELAY
        {
            return Err(Error::config(format!(
                "lock-delay {d:?} is longer than {MAX_LOCK_DELAY:?}"
            )));
        }
        if let Some(min) = self.min_validity
            && min >= self.ttl
        {
            return Err(Error::config(format!(
                "minimum validity {min:?} is not shorter than the TTL {:?}",
                self.ttl
            )));
        }
        if let Wait::Timeout(d) = self.wait
            && d > MAX_TTL
        {
            return Err(Error::config(format!(
                "wait timeout {d:?} is longer than {MAX_TTL:?}; use Wait::Forever"
            )));
        }
        if let Some(r) = &self.retry {
            if r.min_delay > r.max_delay {
                return Err(Error::config("retry min_delay is larger than max_delay"));
            }
            if r.max_delay > MAX_RETRY_DELAY {
                return Err(Error::config(format!(
                    "retry max_delay {:?} is longer than {MAX_RETRY_DELAY:?}",
                    r.max_delay
                )));
            }
        }
        Ok(())
    }
}

/// Checks a TTL against [`MIN_TTL`] and [`MAX_TTL`].
///
/// # Errors
/// [`Error::InvalidConfig`] naming the bound that was crossed.
pub fn validate_ttl(ttl: Duration) -> Result<()> {
    if ttl.is_zero() {
        return Err(Error::config("TTL is zero: every lease must expire"));
    }
    if ttl < MIN_TTL {
        return Err(Error::config(format!(
            "TTL {ttl:?} is shorter than the minimum {MIN_TTL:?}"
        )));
    }
    if ttl > MAX_TTL {
        return Err(Error::config(format!(
            "TTL {ttl:?} is longer than the maximum {MAX_TTL:?}"
        )));
    }
    Ok(())
}

/// The longest key prefix (namespace) a backend accepts, in bytes of UTF-8: 64.
pub const MAX_PREFIX_BYTES: usize = 64;

/// Checks a key prefix (the namespace every backend puts its keys under, the `prefix` URL
/// parameter): 1 to [`MAX_PREFIX_BYTES`] bytes, no `/`, not `.` or `..`, no control characters.
/// Backends may add rules of their own (Redis also refuses `:`).
///
/// # Errors
/// [`Error::InvalidConfig`] with the reason.
pub fn validate_prefix(prefix: &str) -> Result<()> {
    let reason = if prefix.is_empty() {
        "is empty"
    } else if prefix.len() > MAX_PREFIX_BYTES {
        "is longer than 64 bytes"
    } else if prefix.contains('/') {
        "contains '/'"
    } else if prefix == "." || prefix == ".." {
        "is '.' or '..'"
    } else if prefix.chars().any(char::is_control) {
        "contains a control character"
    } else {
        return Ok(());
    };
    Err(Error::config(format!("key prefix {reason}")))
}

/// Checks a lock name. The same rules hold on every backend, so a name that works on one works on
/// all:
///
/// - 1 to [`MAX_NAME_BYTES`] bytes of UTF-8;
/// - no `/` (it would reach outside the lock's own node or key prefix on etcd and ZooKeeper);
/// - not `.` or `..` (path components with a meaning);
/// - no control characters (U+0000–U+001F, U+007F–U+009F), which ZooKeeper forbids in node names
///   and which hide in logs.
///
/// Any other Unicode is fine, including spaces, `:` and `*`; backends escape what their key space needs.
///
/// # Errors
/// [`Error::InvalidName`] with the reason.
pub fn validate_name(name: &str) -> Result<()> {
    validate_name_of("lock", name)
}

/// [`validate_name`] for a name of `what` (`"lock"`, `"election"`, `"semaphore"`), which the
/// error names.
pub(crate) fn validate_name_of(what: &'static str, name: &str) -> Result<()> {
    let reason = if name.is_empty() {
        Some("name is empty")
    } else if name.len() > MAX_NAME_BYTES {
        Some("name is longer than 256 bytes")
    } else if name.contains('/') {
        Some("name contains '/'")
    } else if name == "." || name == ".." {
        Some("name is '.' or '..'")
    } else if name.chars().any(char::is_control) {
        Some("name contains a control character (NUL included)")
    } else {
        None
    };
    match reason {
        None => Ok(()),
        Some(reason) => Err(Error::InvalidName {
            what,
            name: shown_name(name),
            reason,
        }),
    }
}

/// At most the first [`SHOWN_NAME_CHARS`] characters of a rejected name, for its error, with `…`
/// where the rest was cut (without it, a long name's error would seem to quote all of it).
fn shown_name(name: &str) -> String {
    let mut chars = name.chars();
    let mut shown: String = chars.by_ref().take(SHOWN_NAME_CHARS).collect();
    if chars.next().is_some() {
        shown.push('…');
    }
    shown
}

/// How many characters of a rejected name its error shows.
const SHOWN_NAME_CHARS: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_names_error_marks_the_cut() {
        let e = validate_name(&"a".repeat(300)).unwrap_err().to_string();
        assert_eq!(
            e,
            format!(
                "invalid lock name \"{}…\": name is longer than 256 bytes",
                "a".repeat(64)
            )
        );
        // A name short enough to show whole is shown without the mark.
        let e = validate_name("a/b").unwrap_err().to_string();
        assert!(!e.contains('…'), "{e}");
        let e = validate_name(&format!("{}/", "b".repeat(63))).unwrap_err();
        assert!(!e.to_string().contains('…'), "{e}");
    }

    #[test]
    fn name_errors_say_what_the_name_was_for() {
        let e = validate_name("a/b").unwrap_err().to_string();
        assert!(e.starts_with("invalid lock name \"a/b\": "), "{e}");
        let e = crate::backend::validate_slot_name(crate::backend::SlotKind::Semaphore, "a/b")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("invalid semaphore name \"a/b\": "), "{e}");
    }

    #[test]
    fn names() {
        for ok in [
            "a",
            "jobs:nightly",
            "ünïcödé lock",
            "a..b",
            &"x".repeat(256),
        ] {
            validate_name(ok).unwrap();
        }
        for bad in ["", "a/b", "..", ".", "a\0b", "tab\t", &"x".repeat(257), "/"] {
            assert!(
                matches!(validate_name(bad), Err(Error::InvalidName { .. })),
                "{bad:?} accepted"
            );
        }
    }

    #[test]
    fn prefixes() {
        for ok in ["lockkit", "app-1", "ünï", &"p".repeat(64)] {
            validate_prefix(ok).unwrap();
        }
        for bad in ["", "a/b", "..", "x\0", &"p".repeat(65)] {
            assert!(
                matches!(validate_prefix(bad), Err(Error::InvalidConfig { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn ttls() {
        validate_ttl(Duration::from_secs(1)).unwrap();
        validate_ttl(MIN_TTL).unwrap();
        validate_ttl(MAX_TTL).unwrap();
        for bad in [
            Duration::ZERO,
            Duration::from_millis(99),
            MAX_TTL + Duration::from_secs(1),
        ] {
            assert!(matches!(
                validate_ttl(bad),
                Err(Error::InvalidConfig { .. })
            ));
        }
    }

    #[test]
    fn options_validate() {
        AcquireOptions::new().validate().unwrap();
        assert!(
            AcquireOptions::new()
                .ttl(Duration::ZERO)
                .validate()
                .is_err()
        );
        assert!(
            AcquireOptions::new()
                .wait(Wait::Timeout(Duration::from_secs(100 * 86_400)))
                .validate()
                .is_err()
        );
    }
}
