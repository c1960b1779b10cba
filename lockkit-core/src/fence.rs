//! Fences: the check at the protected resource that makes fencing tokens useful.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Mutex, MutexGuard};

use crate::backend::TrackerHandle;
use crate::{Error, FencingToken, Lease, LossReason, Result};

struct Slot<T> {
    /// The highest token that wrote; its lock guards the resource.
    highest: FencingToken,
    value: Option<T>,
}

/// An in-memory protected resource: named values, each bound to the lock of the first token
/// that wrote it and remembering the highest token that wrote it since. A write with a lower
/// token fails with [`Error::StaleToken`], a write with a token of another lock with
/// [`Error::ForeignToken`]; a write with the same token (the same holder writing again) or a
/// higher one is accepted.
///
/// This is the check a storage service must do for fencing to work, given tokens that reach it
/// in their [string form](FencingToken#string-form-version-1); the backends ship the same rules
/// for data kept in their own store (`EtcdFence`, `ZkFence`, `RedisFence`, `PgFence`).
///
/// ```
/// use lockkit_core::{Error, FencingToken, MemoryFence};
///
/// let fence = MemoryFence::new();
/// let b: FencingToken = "v1:34:etcd/lockkit/file".parse().unwrap();
/// fence.write("file", b, "written by B").unwrap();
/// // A paused holder wakes up with an older token:
/// let a: FencingToken = "v1:33:etcd/lockkit/file".parse().unwrap();
/// let err = fence.write("file", a, "written by A").unwrap_err();
/// assert!(matches!(err, Error::StaleToken { .. }));
/// // A holder of another lock, however high its number:
/// let other: FencingToken = "v1:99:etcd/lockkit/other".parse().unwrap();
/// let err = fence.write("file", other, "written by C").unwrap_err();
/// assert!(matches!(err, Error::ForeignToken { .. }));
/// assert_eq!(fence.read("file"), Some("written by B"));
/// ```
pub struct MemoryFence<T> {
    slots: Mutex<HashMap<String, Slot<T>>>,
}

impl<T> fmt::Debug for MemoryFence<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryFence")
            .field("resources", &self.lock().len())
            .finish()
    }
}

impl<T> Default for MemoryFence<T> {
    fn default() -> Self {
        Self {
            slots: Mutex::new(HashMap::new()),
        }
    }
}

impl<T> MemoryFence<T> {
    /// An empty fence.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Slot<T>>> {
        // A panic while holding this mutex cannot leave a slot half-written: recover.
        crate::lock_unpoisoned(&self.slots)
    }

    /// Writes `value` to `resource` if `token` belongs to the lock guarding it (the lock of the
    /// first token that wrote it) and is not lower than the highest token seen there.
    ///
    /// # Errors
    /// [`Error::ForeignToken`] for a token of another lock, [`Error::StaleToken`] if a higher
    /// token already wrote; the value is unchanged.
    pub fn write(&self, resource: &str, token: FencingToken, value: T) -> Result<()> {
        self.update(resource, token, |slot| *slot = Some(value))
    }

    /// Runs `f` on the stored value of `resource` (read-modify-write in one step) if `token`
    /// passes the checks of [`write`](Self::write), and records `token`.
    ///
    /// # Errors
    /// As [`write`](Self::write); `f` is not called.
    pub fn update<R>(
        &self,
        resource: &str,
        token: FencingToken,
        f: impl FnOnce(&mut Option<T>) -> R,
    ) -> Result<R> {
        let mut slots = self.lock();
        let slot = slots.entry(resource.to_owned()).or_insert(Slot {
            highest: token.clone(),
            value: None,
        });
        admit(resource, &slot.highest, &token)?;
        slot.highest = token;
        Ok(f(&mut slot.value))
    }

    /// As [`write`](Self::write), with the token of `lease`; if the write is rejected as stale
    /// (a newer grant of the lock wrote), `lease` becomes [`Lost`](crate::LeaseState::Lost) at
    /// once.
    ///
    /// # Errors
    /// As [`write`](Self::write).
    pub fn write_as(&self, lease: &Lease, resource: &str, value: T) -> Result<()> {
        LeaseFence::new(lease).outcome(self.write(resource, lease.token(), value))
    }

    /// The highest token that wrote `resource`, if any (its lock guards `resource`).
    pub fn highest(&self, resource: &str) -> Option<FencingToken> {
        self.lock().get(resource).map(|s| s.highest.clone())
    }
}

/// The fence rule for a resource whose highest accepted token is `highest`: `token` must be of
/// the same lock and not lower.
fn admit(resource: &str, highest: &FencingToken, token: &FencingToken) -> Result<()> {
    if !token.same_lock(highest) {
        return Err(Error::ForeignToken {
            resource: resource.to_owned(),
            expected_lock: highest.lock().to_owned(),
            token: token.clone(),
        });
    }
    if token.get() < highest.get() {
        return Err(Error::StaleToken {
            resource: resource.to_owned(),
            token: token.clone(),
            current: highest.clone(),
        });
    }
    Ok(())
}

/// What a fence built from a [`Lease`] keeps of it: its token, and the means to mark it lost
/// when the lease's own write is rejected as stale (the server has seen a newer grant, so this
/// lease no longer holds the lock, whatever its clock says). For backend fences.
#[derive(Debug, Clone)]
pub struct LeaseFence {
    token: FencingToken,
    tracker: TrackerHandle,
}

impl LeaseFence {
    /// Takes what the fence needs from `lease`; the fence may outlive the borrow.
    pub fn new(lease: &Lease) -> Self {
        Self {
            token: lease.token(),
            tracker: lease.tracker_handle().clone(),
        }
    }

    /// The lease's token.
    pub fn token(&self) -> &FencingToken {
        &self.token
    }

    /// [`Error::StaleToken`] for the lease's token at `resource`, which has seen `current`; marks
    /// the lease lost.
    pub fn stale(&self, resource: impl Into<String>, current: FencingToken) -> Error {
        self.tracker.mark_lost(LossReason::StaleWrite);
        Error::StaleToken {
            resource: resource.into(),
            token: self.token.clone(),
            current,
        }
    }

    /// [`Error::ForeignToken`] for the lease's token at `resource`, which is guarded by
    /// `expected_lock`. The lease stays as it is: its lock may well be held still.
    pub fn foreign(&self, resource: impl Into<String>, expected_lock: impl Into<String>) -> Error {
        Error::ForeignToken {
            resource: resource.into(),
            expected_lock: expected_lock.into(),
            token: self.token.clone(),
        }
    }

    /// Passes `result` on, marking the lease lost first if it is an [`Error::StaleToken`] of the
    /// lease's own token.
    pub fn outcome<R>(&self, result: Result<R>) -> Result<R> {
        match result {
            Err(Error::StaleToken {
                resource,
                token,
                current,
            }) if token == self.token => Err(self.stale(resource, current)),
            other => other,
        }
    }
}

impl<T: Clone> MemoryFence<T> {
    /// The current value of `resource` (reads are not fenced).
    pub fn read(&self, resource: &str) -> Option<T> {
        self.lock().get(resource).and_then(|s| s.value.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(value: u64) -> FencingToken {
        FencingToken::new("memory/0/l", value)
    }

    #[test]
    fn equal_and_higher_pass_lower_fails() {
        let f = MemoryFence::new();
        f.write("r", t(5), 1).unwrap();
        f.write("r", t(5), 2).unwrap();
        f.write("r", t(9), 3).unwrap();
        match f.write("r", t(8), 4) {
            Err(Error::StaleToken { token, current, .. }) => {
                assert_eq!(token, t(8));
                assert_eq!(current, t(9));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(f.read("r"), Some(3));
        assert_eq!(f.highest("r"), Some(t(9)));
        // Resources are independent.
        f.write("other", t(1), 0).unwrap();
    }

    #[test]
    fn a_token_of_another_lock_is_rejected_whatever_its_number() {
        let f = MemoryFence::new();
        f.write("r", t(5), 1).unwrap();
        for value in [1, 5, 6, u64::MAX] {
            let foreign = FencingToken::new("memory/0/other", value);
            match f.write("r", foreign.clone(), 2) {
                Err(Error::ForeignToken {
                    resource,
                    expected_lock,
                    token,
                }) => {
                    assert_eq!(resource, "r");
                    assert_eq!(expected_lock, "memory/0/l");
                    assert_eq!(token, foreign);
                }
                other => panic!("{other:?}"),
            }
        }
        // The legitimate holder is not locked out.
        f.write("r", t(6), 3).unwrap();
        assert_eq!(f.read("r"), Some(3));
        assert_eq!(f.highest("r"), Some(t(6)));
    }
}
