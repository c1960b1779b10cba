//! The fencing token.

use std::fmt;

/// A fencing token: a number that strictly increases with every grant of the same lock name.
///
/// Every successful acquire returns one inside its [`Lease`](crate::Lease). The protected resource
/// remembers the highest token it has accepted for that lock and rejects any request carrying a
/// lower one (see [`MemoryFence`](crate::MemoryFence) and each backend's fence). That is the only
/// defence against a holder that paused (GC, SIGSTOP, swap) or was partitioned past its TTL and
/// still believes it holds the lock: no timeout can fix that, a token check at the resource can.
/// See Martin Kleppmann, *How to do distributed locking*
/// (<https://martin.kleppmann.com/2016/02/08/how-to-do-distributed-locking.html>).
///
/// Tokens are only comparable between grants of the **same lock name on the same backend
/// deployment**. Inside that scope they are totally ordered and strictly increasing across
/// reconnects, client restarts and (where the backend's [`Guarantees`](crate::Guarantees) say so)
/// server restarts. Where each backend takes its tokens from:
///
/// | backend | source |
/// |---|---|
/// | memory | a per-name counter in the process |
/// | etcd | the holder key's `create_revision` |
/// | ZooKeeper | the holder node's `czxid` |
/// | Redis | a per-name counter bumped in the acquire script, floored at the server's `TIME` |
/// | PostgreSQL | a per-name row in lockkit's own table, bumped in a committed statement |
///
/// Tokens of one name need not be consecutive: only the order is meaningful.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(transparent))]
pub struct FencingToken(u64);

impl FencingToken {
    /// Wraps a raw token value, as read back from a resource that stored it.
    pub const fn new(value: u64) -> Self {
        Self(value)
    }

    /// The raw value, for storing next to the protected data (e.g. a `BIGINT` column).
    ///
    /// It fits in an `i64` on every shipped backend, so it can be stored in PostgreSQL's `bigint`.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Debug for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FencingToken({})", self.0)
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl From<FencingToken> for u64 {
    fn from(t: FencingToken) -> u64 {
        t.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordered_and_printable() {
        let a = FencingToken::new(7);
        let b = FencingToken::new(8);
        assert!(a < b);
        assert_eq!(a.to_string(), "7");
        assert_eq!(format!("{b:?}"), "FencingToken(8)");
        assert_eq!(u64::from(b), 8);
    }
}
