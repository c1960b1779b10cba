//! The embedded in-process backend.

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::backend::{LeaseOps, LockBackend, TrackerHandle, validate_name, wait_deadline};
use crate::{
    AcquireOptions, Error, FencingToken, Guarantees, HolderInfo, Lease, LockKind, Result, Wait,
};

#[derive(Default)]
struct State {
    locks: HashMap<String, Entry>,
    next_id: u64,
    /// Grant attempts made (to check that waiters sleep rather than spin).
    #[cfg(test)]
    attempts: u64,
}

#[derive(Default)]
struct Entry {
    holder: Option<Holder>,
    last_token: u64,
    waiters: VecDeque<(u64, Arc<Notify>)>,
    /// The lock-delay of a holder whose lease lapsed: granted to no one before this instant.
    delayed_until: Option<Instant>,
}

struct Holder {
    owner: u64,
    expires: Instant,
    /// [`AcquireOptions::effective_lock_delay`] of its acquire.
    lock_delay: Option<Duration>,
}

impl Entry {
    /// The holder whose lease has not lapsed by `now`. A lapsed holder is removed here, and its
    /// lock-delay, if any, starts at the instant its lease lapsed.
    fn holder_live(&mut self, now: Instant) -> Option<&Holder> {
        if let Some(h) = self.holder.take_if(|h| h.expires <= now)
            && let Some(d) = h.lock_delay
        {
            let until = h.expires + d;
            self.delayed_until = Some(self.delayed_until.map_or(until, |u| u.max(until)));
        }
        self.holder.as_ref()
    }

    /// Until when no one can be granted the lock: the live holder's expiry or the end of a
    /// lock-delay; `None` if it is free now.
    fn busy_until(&mut self, now: Instant) -> Option<Instant> {
        if let Some(h) = self.holder_live(now) {
            return Some(h.expires);
        }
        self.delayed_until = self.delayed_until.filter(|t| *t > now);
        self.delayed_until
    }

    fn wake_head(&self) {
        if let Some((_, n)) = self.waiters.front() {
            n.notify_one();
        }
    }
}

/// An in-process lock service with real TTLs, fencing tokens and FIFO waiters; the embedded
/// default (`memory://`).
///
/// A lease with a [`lock_delay`](AcquireOptions::lock_delay) that lapses (not renewed, or
/// dropped with release-on-drop off) keeps the lock from everyone until that long after its TTL
/// ran out; waiters sleep until then. A release frees the lock at once.
///
/// Clones share one lock table, so clones behave like separate clients of one server. Tokens
/// start at 1 and are kept per name for the life of the table (one `u64` per name ever locked).
/// Nothing survives the process.
///
/// The lock identity of a token is `memory/{table}/{name}`, `table` numbering the tables of
/// the process from 1 (see [`FencingToken`]), so tokens of two tables never pass each other's
/// fences.
#[derive(Clone)]
pub struct MemoryLock {
    state: Arc<Mutex<State>>,
    /// `memory/{table}/`, the start of every token's lock identity.
    lock_id_prefix: Arc<str>,
    /// Elections and semaphores (`crate::memory_slots`).
    pub(crate) slots: crate::memory_slots::Slots,
}

impl Default for MemoryLock {
    fn default() -> Self {
        static TABLES: AtomicU64 = AtomicU64::new(1);
        let table = TABLES.fetch_add(1, AtomicOrdering::Relaxed);
        let lock_id_prefix: Arc<str> = format!("memory/{table}/").into();
        Self {
            state: Arc::default(),
            slots: crate::memory_slots::Slots::new(lock_id_prefix.clone()),
            lock_id_prefix,
        }
    }
}

impl fmt::Debug for MemoryLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryLock")
            .field("names", &lock(&self.state).locks.len())
            .finish()
    }
}

// The table is consistent after every statement; a panic elsewhere must not poison it.
use crate::lock_unpoisoned as lock;

/// Removes a waiter from its queue when its acquire ends or is dropped, and passes the turn on.
struct WaiterGuard {
    state: Arc<Mutex<State>>,
    name: String,
    id: u64,
}

impl Drop for WaiterGuard {
    fn drop(&mut self) {
        let mut st = lock(&self.state);
        if let Some(e) = st.locks.get_mut(&self.name) {
            let was_head = e.waiters.front().is_some_and(|(id, _)| *id == self.id);
            e.waiters.retain(|(id, _)| *id != self.id);
            if was_head {
                e.wake_head();
            }
        }
    }
}

impl MemoryLock {
    /// An empty lock table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Grants `name` to `owner` if it is free and `owner` is first in line. Returns the token, or
    /// the instant at which the current holder's lease (or the lock-delay after a lapsed one)
    /// ends.
    fn try_grant(
        &self,
        name: &str,
        owner: u64,
        opts: &AcquireOptions,
    ) -> std::result::Result<u64, Option<Instant>> {
        let now = Instant::now();
        let mut st = lock(&self.state);
        #[cfg(test)]
        {
            st.attempts += 1;
        }
        let e = st.locks.entry(name.to_owned()).or_default();
        if let Some(t) = e.busy_until(now) {
            return Err(Some(t));
        }
        if e.waiters.front().is_some_and(|(id, _)| *id != owner) {
            return Err(None);
        }
        e.last_token += 1;
        e.holder = Some(Holder {
            owner,
            expires: now + opts.ttl,
            lock_delay: opts.effective_lock_delay(),
        });
        Ok(e.last_token)
    }
}

#[async_trait]
impl LockBackend for MemoryLock {
    async fn grant(&self, name: &str, opts: AcquireOptions) -> Result<Lease> {
        validate_name(name)?;
        opts.validate()?;
        let start = Instant::now();
        let deadline = wait_deadline(opts.wait, start);
        let (owner, notify) = {
            let mut st = lock(&self.state);
            st.next_id += 1;
            (st.next_id, Arc::new(Notify::new()))
        };
        let mut guard = None;
        loop {
            let sent = Instant::now();
            let busy_until = match self.try_grant(name, owner, &opts) {
                Ok(token) => {
                    drop(guard);
                    // The next waiter in line now watches the new holder's expiry.
                    if let Some(e) = lock(&self.state).locks.get(name) {
                        e.wake_head();
                    }
                    let ops = Arc::new(MemoryLease {
                        state: self.state.clone(),
                        name: name.to_owned(),
                        owner,
                    });
                    let tracker = TrackerHandle::new(sent, opts.ttl);
                    return Ok(Lease::new(
                        name,
                        FencingToken::new(format!("{}{name}", self.lock_id_prefix), token),
                        tracker,
                        ops,
                        &opts,
                    ));
                }
                Err(expires) => expires,
            };
            if opts.wait == Wait::No {
                return Err(Error::Held {
                    name: name.to_owned(),
                });
            }
            if guard.is_none() {
                let mut st = lock(&self.state);
                let e = st.locks.entry(name.to_owned()).or_default();
                e.waiters.push_back((owner, notify.clone()));
                guard = Some(WaiterGuard {
                    state: self.state.clone(),
                    name: name.to_owned(),
                    id: owner,
                });
                // We may be first in line already: try again before sleeping.
                continue;
            }
            // The head of the line sleeps until the holder's lease or the lock-delay ends (or a
            // release wakes it); the others until the head passes the turn on.
            let expiry = async {
                match busy_until {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            };
            let timeout = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = notify.notified() => {}
                _ = expiry => {}
                _ = timeout => {
                    return Err(Error::Timeout { name: name.to_owned(), waited: start.elapsed() });
                }
            }
        }
    }

    fn guarantees(&self) -> Guarantees {
        Guarantees {
            tokens_survive_restart: false,
            safe_across_failover: true,
            fifo_waiters: true,
            manual_renewal: true,
            expiry_slack: Duration::ZERO,
            lock_delay: true,
            // The table ends a lease only when its TTL runs out, after the holder's own deadline.
            loss_notice: Some(Duration::ZERO),
            notes: "one process only; nothing survives it",
            ..Guarantees::new("memory", LockKind::Correctness)
        }
    }

    /// The holder's token and the time left before its lease lapses.
    async fn holder(&self, name: &str) -> Result<Option<HolderInfo>> {
        validate_name(name)?;
        let now = Instant::now();
        let mut st = lock(&self.state);
        let Some(e) = st.locks.get_mut(name) else {
            return Ok(None);
        };
        let token = FencingToken::new(format!("{}{name}", self.lock_id_prefix), e.last_token);
        Ok(e.holder_live(now)
            .map(|h| HolderInfo::new(Some(token), Some(h.expires.saturating_duration_since(now)))))
    }
}

struct MemoryLease {
    state: Arc<Mutex<State>>,
    name: String,
    owner: u64,
}

impl fmt::Debug for MemoryLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryLease")
            .field("name", &self.name)
            .field("owner", &self.owner)
            .finish()
    }
}

#[async_trait]
impl LeaseOps for MemoryLease {
    async fn renew(&self, ttl: Duration) -> Result<()> {
        let now = Instant::now();
        let mut st = lock(&self.state);
        let e = st.locks.get_mut(&self.name);
        match e.and_then(|e| e.holder.as_mut()) {
            Some(h) if h.owner == self.owner && h.expires > now => {
                h.expires = now + ttl;
                Ok(())
            }
            _ => Err(Error::NotHeld {
                name: self.name.clone(),
            }),
        }
    }

    async fn check(&self) -> Result<()> {
        let now = Instant::now();
        let st = lock(&self.state);
        match st.locks.get(&self.name).and_then(|e| e.holder.as_ref()) {
            Some(h) if h.owner == self.owner && h.expires > now => Ok(()),
            _ => Err(Error::NotHeld {
                name: self.name.clone(),
            }),
        }
    }

    async fn release(&self) -> Result<()> {
        let now = Instant::now();
        let mut st = lock(&self.state);
        let Some(e) = st.locks.get_mut(&self.name) else {
            return Err(Error::NotHeld {
                name: self.name.clone(),
            });
        };
        // A lease that lapsed is gone (and its lock-delay runs): only a live one is released,
        // and that frees the lock at once.
        match e.holder_live(now) {
            Some(h) if h.owner == self.owner => {
                e.holder = None;
                e.wake_head();
                Ok(())
            }
            _ => Err(Error::NotHeld {
                name: self.name.clone(),
            }),
        }
    }

    async fn relinquish(&self) -> Result<()> {
        let now = Instant::now();
        let mut st = lock(&self.state);
        let Some(e) = st.locks.get_mut(&self.name) else {
            return Err(Error::NotHeld {
                name: self.name.clone(),
            });
        };
        // Lapses now: `holder_live` removes it and starts its lock-delay.
        match e.holder.as_mut() {
            Some(h) if h.owner == self.owner && h.expires > now => {
                h.expires = now;
                let _ = e.holder_live(now);
                e.wake_head();
                Ok(())
            }
            _ => Err(Error::NotHeld {
                name: self.name.clone(),
            }),
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::LeaseBackendExt;
    use crate::{Lock, LockExt};

    #[tokio::test(start_paused = true)]
    async fn fifo_order() {
        let l = MemoryLock::new();
        let first = l.acquire("q", AcquireOptions::new()).await.unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for i in 0..3 {
            let l = l.clone();
            let tx = tx.clone();
            tokio::spawn(async move {
                let lease = l.acquire("q", AcquireOptions::new()).await.unwrap();
                tx.send((i, lease.token())).unwrap();
                lease.release().await.unwrap();
            });
            // Let each waiter enqueue before the next one starts.
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        first.release().await.unwrap();
        let mut got = vec![];
        for _ in 0..3 {
            got.push(rx.recv().await.unwrap());
        }
        assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), vec![0, 1, 2]);
        assert!(got.windows(2).all(|w| w[0].1 < w[1].1));
    }

    #[tokio::test(start_paused = true)]
    async fn expiry_frees_and_renew_after_regrant_is_not_held() {
        let l = MemoryLock::new();
        let ttl = Duration::from_secs(1);
        let a = l
            .acquire("e", AcquireOptions::new().ttl(ttl).keepalive(false))
            .await
            .unwrap();
        let b = l
            .acquire_timeout("e", ttl, Duration::from_secs(5))
            .await
            .unwrap();
        assert!(b.token() > a.token());
        assert!(matches!(
            a.ops().renew(ttl).await,
            Err(Error::NotHeld { .. })
        ));
        assert!(matches!(a.release().await, Err(Error::NotHeld { .. })));
        assert!(matches!(
            l.try_acquire("e", ttl).await,
            Err(Error::Held { .. })
        ));
        b.release().await.unwrap();
    }

    fn delayed(ttl: Duration, delay: Duration) -> AcquireOptions {
        AcquireOptions::new()
            .ttl(ttl)
            .keepalive(false)
            .release_on_drop(false)
            .lock_delay(delay)
            .wait(Wait::No)
    }

    #[tokio::test(start_paused = true)]
    async fn lock_delay_after_a_lapsed_lease_and_waiters_sleep_through_it() {
        let l = MemoryLock::new();
        let (ttl, delay) = (Duration::from_secs(1), Duration::from_secs(2));
        let start = Instant::now();
        drop(l.acquire("d", delayed(ttl, delay)).await.unwrap());
        // Lapsed at 1 s; during the delay a try-once is refused.
        tokio::time::sleep(ttl + delay / 2).await;
        assert!(matches!(
            l.try_acquire("d", ttl).await,
            Err(Error::Held { .. })
        ));
        let before = lock(&l.state).attempts;
        let lease = l
            .acquire("d", AcquireOptions::new().ttl(ttl))
            .await
            .unwrap();
        assert_eq!(start.elapsed(), ttl + delay, "granted at the delay's end");
        // Queued (one try before sleeping, one after joining the line), woken once at the end.
        let attempts = lock(&l.state).attempts - before;
        assert!(attempts <= 3, "{attempts} grant attempts: the waiter spun");
        lease.release().await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn lock_delay_starts_when_the_lease_lapsed_not_when_seen() {
        let l = MemoryLock::new();
        let (ttl, delay) = (Duration::from_secs(1), Duration::from_secs(2));
        let start = Instant::now();
        let lapsed = l.acquire("s", delayed(ttl, delay)).await.unwrap();
        // Nobody looks until after the delay: the lock is free then.
        tokio::time::sleep(ttl + delay).await;
        assert!(matches!(lapsed.release().await, Err(Error::NotHeld { .. })));
        let lease = l.try_acquire("s", ttl).await.unwrap();
        assert_eq!(start.elapsed(), ttl + delay);
        lease.release().await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn no_lock_delay_after_a_release_or_a_release_on_drop() {
        let l = MemoryLock::new();
        let (ttl, delay) = (Duration::from_secs(10), Duration::from_secs(30));
        l.acquire("r", delayed(ttl, delay))
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
        let lease = l.try_acquire("r", ttl).await.expect("free at once");
        lease.release().await.unwrap();
        drop(
            l.acquire("r", delayed(ttl, delay).release_on_drop(true))
                .await
                .unwrap(),
        );
        tokio::task::yield_now().await; // the release on drop
        l.try_acquire("r", ttl).await.expect("free at once").leak();
    }

    #[tokio::test(start_paused = true)]
    async fn without_lock_delay_a_lapsed_lease_frees_at_its_ttl() {
        let l = MemoryLock::new();
        let ttl = Duration::from_secs(1);
        let start = Instant::now();
        drop(l.acquire("n", delayed(ttl, Duration::ZERO)).await.unwrap());
        let lease = l
            .acquire("n", AcquireOptions::new().ttl(ttl))
            .await
            .unwrap();
        assert_eq!(start.elapsed(), ttl);
        lease.release().await.unwrap();
    }
}
