//! Fences: the check at the protected resource that makes fencing tokens useful.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Mutex, MutexGuard};

use crate::{Error, FencingToken, Result};

struct Slot<T> {
    highest: FencingToken,
    value: Option<T>,
}

/// An in-memory protected resource: named values, each remembering the highest fencing token
/// that wrote it. A write with a lower token fails with [`Error::StaleToken`]; a write with the
/// same token (the same holder writing again) or a higher one is accepted.
///
/// This is the check a storage service must do for fencing to work; the backends ship the same
/// check for data kept in their own store (etcd, ZooKeeper, PostgreSQL).
///
/// ```
/// use lockkit_core::{Error, FencingToken, MemoryFence};
///
/// let fence = MemoryFence::new();
/// fence.write("file", FencingToken::new(34), "written by B").unwrap();
/// // A paused holder wakes up with an older token:
/// let err = fence.write("file", FencingToken::new(33), "written by A").unwrap_err();
/// assert!(matches!(err, Error::StaleToken { .. }));
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

    /// Writes `value` to `resource` if `token` is not lower than the highest token seen there.
    ///
    /// # Errors
    /// [`Error::StaleToken`] if a higher token already wrote; the value is unchanged.
    pub fn write(&self, resource: &str, token: FencingToken, value: T) -> Result<()> {
        self.update(resource, token, |slot| *slot = Some(value))
    }

    /// Runs `f` on the stored value of `resource` (read-modify-write in one step) if `token` is not
    /// lower than the highest token seen there, and records `token`.
    ///
    /// # Errors
    /// [`Error::StaleToken`] if a higher token already wrote; `f` is not called.
    pub fn update<R>(
        &self,
        resource: &str,
        token: FencingToken,
        f: impl FnOnce(&mut Option<T>) -> R,
    ) -> Result<R> {
        let mut slots = self.lock();
        let slot = slots.entry(resource.to_owned()).or_insert(Slot {
            highest: token,
            value: None,
        });
        if token < slot.highest {
            return Err(Error::StaleToken {
                resource: resource.to_owned(),
                token,
                current: slot.highest,
            });
        }
        slot.highest = token;
        Ok(f(&mut slot.value))
    }

    /// The highest token that wrote `resource`, if any.
    pub fn highest(&self, resource: &str) -> Option<FencingToken> {
        self.lock().get(resource).map(|s| s.highest)
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

    #[test]
    fn equal_and_higher_pass_lower_fails() {
        let f = MemoryFence::new();
        f.write("r", FencingToken::new(5), 1).unwrap();
        f.write("r", FencingToken::new(5), 2).unwrap();
        f.write("r", FencingToken::new(9), 3).unwrap();
        match f.write("r", FencingToken::new(8), 4) {
            Err(Error::StaleToken { token, current, .. }) => {
                assert_eq!(token, FencingToken::new(8));
                assert_eq!(current, FencingToken::new(9));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(f.read("r"), Some(3));
        assert_eq!(f.highest("r"), Some(FencingToken::new(9)));
        // Resources are independent.
        f.write("other", FencingToken::new(1), 0).unwrap();
    }
}
