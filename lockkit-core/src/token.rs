//! The fencing token.

use std::cmp::Ordering;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use crate::Error;

/// A fencing token: the identity of the lock that granted it and a number that strictly
/// increases with every grant of that lock.
///
/// Every successful acquire returns one inside its [`Lease`](crate::Lease). The protected resource
/// remembers the highest token it has accepted and rejects any request carrying a lower one (see
/// [`MemoryFence`](crate::MemoryFence) and each backend's fence). That is the only defence against
/// a holder that paused (GC, SIGSTOP, swap) or was partitioned past its TTL and still believes it
/// holds the lock: no timeout can fix that, a token check at the resource can. See Martin
/// Kleppmann, *How to do distributed locking*
/// (<https://martin.kleppmann.com/2016/02/08/how-to-do-distributed-locking.html>).
///
/// # The lock a token belongs to
/// A number alone would let a token of lock `X` pass (or even lock out the legitimate holder
/// of) a resource guarded by lock `Y`. So a token carries its lock, as Chubby's sequencers carry
/// the lock's name: [`lock`](Self::lock) is `backend/namespace/name`, for example
/// `etcd/lockkit/report` (etcd key prefix `lockkit`), `redis/billing/report` (Redis prefix
/// `billing`), `zk/lockkit/report`, `postgres/public/lockkit/report` (schema and prefix) or
/// `memory/3/report` (the third [`MemoryLock`](crate::MemoryLock) table of the process). The same
/// name on another backend or under another prefix is another lock. Every fence binds each
/// resource to the lock of the first token that wrote it and rejects tokens of any other lock
/// with [`Error::ForeignToken`].
///
/// Tokens are only **ordered** within one lock: `<`, `>` compare the numbers of two tokens of
/// the same lock, and [`partial_cmp`](PartialOrd::partial_cmp) is `None` for tokens of different
/// locks (so neither `a < b` nor `a > b` holds). Within a lock they are totally ordered and
/// strictly increasing across reconnects, client restarts and (where the backend's
/// [`Guarantees`](crate::Guarantees) say so) server restarts. Where each backend takes the
/// numbers from:
///
/// | backend | source |
/// |---|---|
/// | memory | a per-name counter in the process |
/// | etcd | the holder key's `create_revision` |
/// | ZooKeeper | the holder node's `czxid` |
/// | Redis | a per-name counter bumped in the acquire script, floored at the server's `TIME` |
/// | PostgreSQL | a per-name row in lockkit's own table, bumped in a committed statement |
///
/// Numbers of one lock need not be consecutive: only the order is meaningful.
///
/// A token is not a credential: anyone can write `v1:99999:etcd/lockkit/report`. Fences protect
/// the resource from confused and paused holders, not from forgers; authenticate the writer
/// separately where that matters.
///
/// # String form (version 1)
/// To travel to a remote service as one value, a token is written (by [`Display`](fmt::Display),
/// and by serde with feature `serde`) and parsed back (by [`FromStr`], and serde) as
///
/// ```text
/// v1:<number>:<lock>        for example   v1:42:etcd/lockkit/report
/// ```
///
/// `<number>` is the decimal `u64` without sign or leading zeros, `<lock>` the rest of the string
/// (it may contain `:` and `/`, never a control character, at most [`MAX_LOCK_ID_BYTES`]).
/// A future format gets another version prefix; `v1` strings will keep parsing.
///
/// ```
/// use lockkit_core::FencingToken;
///
/// let t: FencingToken = "v1:42:etcd/lockkit/report".parse().unwrap();
/// assert_eq!(t.get(), 42); // for a BIGINT column next to the data
/// assert_eq!(t.lock(), "etcd/lockkit/report");
/// assert_eq!(t.to_string(), "v1:42:etcd/lockkit/report");
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct FencingToken {
    lock: Arc<str>,
    value: u64,
}

/// The longest lock identity a [`FencingToken`] string may carry, in bytes: a backend name, a
/// key prefix and a lock name ([`MAX_NAME_BYTES`](crate::MAX_NAME_BYTES)) with room to spare.
pub const MAX_LOCK_ID_BYTES: usize = 1024;

const VERSION_1: &str = "v1:";

impl FencingToken {
    /// A token of lock `lock` (its identity, `backend/namespace/name`, see
    /// [the type docs](Self#the-lock-a-token-belongs-to)) with number `value`. For backends
    /// granting a lease, and for tests; a resource that stored a token reads it back with
    /// [`FromStr`].
    pub fn new(lock: impl Into<Arc<str>>, value: u64) -> Self {
        Self {
            lock: lock.into(),
            value,
        }
    }

    /// The number, for storing next to the protected data (e.g. a `BIGINT` column). Only
    /// comparable with numbers of tokens of the same [`lock`](Self::lock).
    ///
    /// It fits in an `i64` on every shipped backend, so it can be stored in PostgreSQL's `bigint`.
    pub fn get(&self) -> u64 {
        self.value
    }

    /// The identity of the lock that granted this token, `backend/namespace/name`.
    pub fn lock(&self) -> &str {
        &self.lock
    }

    /// Whether `other` was granted by the same lock (its numbers are comparable with ours).
    pub fn same_lock(&self, other: &FencingToken) -> bool {
        self.lock == other.lock
    }
}

impl PartialOrd for FencingToken {
    /// Compares the numbers of two tokens of the same lock; `None` across locks.
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        self.same_lock(other).then(|| self.value.cmp(&other.value))
    }
}

impl fmt::Debug for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FencingToken({}#{})", self.lock, self.value)
    }
}

/// The [string form](FencingToken#string-form-version-1): `v1:<number>:<lock>`.
impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{VERSION_1}{}:{}", self.value, self.lock)
    }
}

/// Parses the [string form](FencingToken#string-form-version-1).
///
/// # Errors
/// [`Error::InvalidToken`] for anything else.
impl FromStr for FencingToken {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        let invalid = |reason| Error::InvalidToken { reason };
        let rest = s
            .strip_prefix(VERSION_1)
            .ok_or_else(|| invalid("does not start with the version prefix `v1:`"))?;
        let (number, lock) = rest
            .split_once(':')
            .ok_or_else(|| invalid("no `:` between the number and the lock"))?;
        let canonical = !number.is_empty()
            && number.bytes().all(|b| b.is_ascii_digit())
            && (number == "0" || !number.starts_with('0'));
        if !canonical {
            return Err(invalid("the number is not a decimal without leading zeros"));
        }
        let value = number
            .parse()
            .map_err(|_| invalid("the number does not fit in a u64"))?;
        if lock.is_empty() {
            return Err(invalid("the lock is empty"));
        }
        if lock.len() > MAX_LOCK_ID_BYTES {
            return Err(invalid("the lock is longer than 1024 bytes"));
        }
        if lock.chars().any(char::is_control) {
            return Err(invalid("the lock contains a control character"));
        }
        Ok(Self::new(lock, value))
    }
}

#[cfg(feature = "serde")]
impl serde::Serialize for FencingToken {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for FencingToken {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordered_within_a_lock_only() {
        let a = FencingToken::new("memory/1/x", 7);
        let b = FencingToken::new("memory/1/x", 8);
        let other = FencingToken::new("memory/1/y", 9);
        assert!(a < b);
        assert_eq!(a.partial_cmp(&other), None);
        let (lt, gt) = (a < other, a > other);
        assert!(!lt && !gt && a != other);
        assert_ne!(a, FencingToken::new("memory/1/y", 7));
        assert_eq!(format!("{b:?}"), "FencingToken(memory/1/x#8)");
        assert_eq!(b.get(), 8);
    }

    #[test]
    fn string_form_round_trips() {
        for t in [
            FencingToken::new("etcd/lockkit/report", 42),
            FencingToken::new("redis/billing:eu/jobs:nightly ü", u64::MAX),
            FencingToken::new("memory/1/x", 0),
        ] {
            let s = t.to_string();
            assert_eq!(s.parse::<FencingToken>().unwrap(), t, "{s}");
        }
        assert_eq!(
            FencingToken::new("etcd/lockkit/report", 42).to_string(),
            "v1:42:etcd/lockkit/report"
        );
    }

    #[test]
    fn malformed_strings_are_typed_errors() {
        let long = format!("v1:1:{}", "x".repeat(MAX_LOCK_ID_BYTES + 1));
        for bad in [
            "",
            "42",
            "v1:",
            "v1:42",
            "v1:42:",
            "v2:42:etcd/x",
            "v1:-1:etcd/x",
            "v1:+1:etcd/x",
            "v1:01:etcd/x",
            "v1: 1:etcd/x",
            "v1:18446744073709551616:etcd/x",
            "v1:1:etcd/x\n",
            long.as_str(),
        ] {
            assert!(
                matches!(bad.parse::<FencingToken>(), Err(Error::InvalidToken { .. })),
                "{bad:?}"
            );
        }
    }

    #[cfg(feature = "serde")]
    #[test]
    fn serde_uses_the_string_form() {
        let t = FencingToken::new("zk/lockkit/a:b", 5);
        let json = serde_json::to_string(&t).unwrap();
        assert_eq!(json, "\"v1:5:zk/lockkit/a:b\"");
        assert_eq!(serde_json::from_str::<FencingToken>(&json).unwrap(), t);
        assert!(serde_json::from_str::<FencingToken>("5").is_err());
        assert!(serde_json::from_str::<FencingToken>("\"v1:x:y\"").is_err());
    }
}
