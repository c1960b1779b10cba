//! Elections and semaphores of the in-process backend: [`SlotBackend`] for [`MemoryLock`].
//!
//! One table per [`MemoryLock`] table, under one mutex. A released slot is handed straight to
//! the first waiter (granted in the release, the waiter woken once); an expired one is handed on
//! by one reaper task per name, alive only while the name has waiters or observers, sleeping
//! until the earliest expiry. Observers read a broadcast channel of holder snapshots sent under
//! the mutex, so they arrive in change order.

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{Notify, broadcast};
use tokio::time::Instant;

use crate::backend::{
    LeaseOps, LockBackend, SlotBackend, SlotGrant, SlotGuarantees, SlotHolder, SlotHolders,
    SlotKind, SlotOps, SlotRequest, SlotWatch, TrackerHandle, WatchEvent, validate_slot_name,
    wait_deadline,
};
use crate::lock_unpoisoned as lock;
use crate::{AcquireOptions, Error, FencingToken, Lease, MemoryLock, Result, Wait};

/// Changes an observer may leave unread before it gets [`WatchEvent::Missed`].
const OBSERVER_BUFFER: usize = 1024;

type Key = (SlotKind, String);

#[derive(Default)]
struct Table {
    entries: HashMap<Key, Entry>,
    next_id: u64,
}

#[derive(Default)]
struct Entry {
    /// The N in force while the name is active (has holders or waiters).
    permits: u32,
    /// One per slot (`permits` long once granted).
    holders: Vec<Option<Held>>,
    /// The last token granted, for any slot of the name.
    last_token: u64,
    waiters: VecDeque<Waiter>,
    /// Observers' channel, once one observed.
    events: Option<broadcast::Sender<Vec<SlotHolder>>>,
    /// Pokes the name's reaper task, while one runs.
    reaper: Option<Arc<Notify>>,
}

struct Held {
    owner: u64,
    token: u64,
    expires: Instant,
    granted_at: Instant,
    value: Vec<u8>,
}

struct Waiter {
    id: u64,
    ttl: Duration,
    value: Vec<u8>,
    notify: Arc<Notify>,
}

impl Entry {
    fn active(&self) -> bool {
        self.holders.iter().any(Option::is_some) || !self.waiters.is_empty()
    }

    /// Frees the slots whose lease ran out; `true` if any.
    fn reap(&mut self, now: Instant) -> bool {
        let mut changed = false;
        for h in &mut self.holders {
            if h.as_ref().is_some_and(|h| h.expires <= now) {
                *h = None;
                changed = true;
            }
        }
        changed
    }

    /// Grants free slots to the first waiters, waking each once; `true` if any.
    fn hand_off(&mut self, now: Instant) -> bool {
        let mut changed = false;
        while let Some(slot) = self.holders.iter().position(Option::is_none) {
            let Some(w) = self.waiters.pop_front() else {
                break;
            };
            self.last_token += 1;
            self.holders[slot] = Some(Held {
                owner: w.id,
                token: self.last_token,
                expires: now + w.ttl,
                granted_at: now,
                value: w.value,
            });
            w.notify.notify_one();
            changed = true;
        }
        if changed {
            self.poke_reaper();
        }
        changed
    }

    fn poke_reaper(&self) {
        if let Some(p) = &self.reaper {
            p.notify_one();
        }
    }

    fn slot_of(&self, owner: u64) -> Option<(usize, &Held)> {
        self.holders
            .iter()
            .enumerate()
            .find_map(|(i, h)| h.as_ref().filter(|h| h.owner == owner).map(|h| (i, h)))
    }
}

/// The slot tables of one [`MemoryLock`] table. Clones share it.
#[derive(Clone)]
pub(crate) struct Slots {
    table: Arc<Mutex<Table>>,
    /// `memory/{table}/`, the start of every token's lock identity.
    id_prefix: Arc<str>,
}

impl fmt::Debug for Slots {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Slots")
            .field("names", &lock(&self.table).entries.len())
            .finish()
    }
}

impl Slots {
    pub(crate) fn new(id_prefix: Arc<str>) -> Self {
        Self {
            table: Arc::default(),
            id_prefix,
        }
    }

    fn token(&self, key: &Key, slot: usize, value: u64) -> FencingToken {
        let (kind, name) = key;
        let id = match kind {
            SlotKind::Semaphore => format!("{}{}/{name}/{slot}", self.id_prefix, kind.as_str()),
            _ => format!("{}{}/{name}", self.id_prefix, kind.as_str()),
        };
        FencingToken::new(id, value)
    }

    fn snapshot(&self, key: &Key, e: &Entry, now: Option<Instant>) -> Vec<SlotHolder> {
        e.holders
            .iter()
            .enumerate()
            .filter_map(|(slot, h)| {
                let h = h.as_ref()?;
                Some(SlotHolder::new(
                    u32::try_from(slot).unwrap_or(u32::MAX),
                    self.token(key, slot, h.token),
                    h.value.clone(),
                    now.map(|n| h.expires.saturating_duration_since(n)),
                ))
            })
            .collect()
    }

    fn publish(&self, key: &Key, e: &Entry) {
        if let Some(tx) = &e.events
            && tx.receiver_count() > 0
        {
            let _ = tx.send(self.snapshot(key, e, None));
        }
    }

    /// Reaps expired slots and hands free ones to waiters; tells observers if anything changed.
    fn settle(&self, key: &Key, e: &mut Entry, now: Instant) {
        let reaped = e.reap(now);
        let handed = e.hand_off(now);
        if reaped || handed {
            self.publish(key, e);
        }
    }

    /// Starts the name's reaper task unless one runs (or there is no runtime to run it on: the
    /// table is then reaped on each access only).
    fn ensure_reaper(&self, key: &Key, e: &mut Entry) {
        if e.reaper.is_some() {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let poke = Arc::new(Notify::new());
        e.reaper = Some(poke.clone());
        rt.spawn(reaper(self.clone(), key.clone(), poke));
    }

    fn lease(
        &self,
        key: &Key,
        owner: u64,
        slot: usize,
        token: u64,
        granted_at: Instant,
        opts: &AcquireOptions,
    ) -> SlotGrant {
        let ops = Arc::new(MemorySlotLease {
            slots: self.clone(),
            key: key.clone(),
            owner,
            slot,
        });
        let lease = Lease::new(
            key.1.as_str(),
            self.token(key, slot, token),
            TrackerHandle::new(granted_at, opts.ttl),
            ops.clone(),
            opts,
        );
        SlotGrant::new(lease, u32::try_from(slot).unwrap_or(u32::MAX), ops)
    }

    async fn grant(&self, req: SlotRequest<'_>, opts: AcquireOptions) -> Result<SlotGrant> {
        req.validate()?;
        opts.validate()?;
        let start = Instant::now();
        let deadline = wait_deadline(opts.wait, start);
        let key: Key = (req.kind, req.name.to_owned());
        let (id, notify) = {
            let mut t = lock(&self.table);
            t.next_id += 1;
            let id = t.next_id;
            let now = Instant::now();
            let e = t.entries.entry(key.clone()).or_default();
            self.settle(&key, e, now);
            if !e.active() {
                e.permits = req.permits;
                e.holders.clear();
                e.holders.resize_with(req.permits as usize, || None);
            } else if e.permits != req.permits {
                return Err(Error::PermitsMismatch {
                    name: req.name.to_owned(),
                    ours: req.permits,
                    theirs: e.permits,
                });
            }
            let free = e.holders.iter().position(Option::is_none);
            if let (Some(slot), true) = (free, e.waiters.is_empty()) {
                e.last_token += 1;
                let token = e.last_token;
                e.holders[slot] = Some(Held {
                    owner: id,
                    token,
                    expires: now + opts.ttl,
                    granted_at: now,
                    value: req.value.to_vec(),
                });
                e.poke_reaper();
                self.publish(&key, e);
                drop(t);
                return Ok(self.lease(&key, id, slot, token, now, &opts));
            }
            if opts.wait == Wait::No {
                return Err(Error::Held {
                    name: req.name.to_owned(),
                });
            }
            let notify = Arc::new(Notify::new());
            e.waiters.push_back(Waiter {
                id,
                ttl: opts.ttl,
                value: req.value.to_vec(),
                notify: notify.clone(),
            });
            self.ensure_reaper(&key, e);
            (id, notify)
        };
        let mut guard = WaiterGuard {
            slots: self.clone(),
            key,
            id,
            armed: true,
        };
        loop {
            let timeout = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = notify.notified() => {}
                _ = timeout => {
                    return Err(Error::Timeout { name: req.name.to_owned(), waited: start.elapsed() });
                }
            }
            let granted = {
                let mut t = lock(&self.table);
                let now = Instant::now();
                let e = t.entries.entry(guard.key.clone()).or_default();
                let held = e.slot_of(id).map(|(slot, h)| (slot, h.token, h.granted_at));
                if held.is_none() && !e.waiters.iter().any(|w| w.id == id) {
                    // Handed a slot that ran out before this waiter looked (a stalled
                    // runtime): first in line again, and granted now if a slot is free.
                    if !e.active() {
                        e.permits = req.permits;
                        e.holders.clear();
                        e.holders.resize_with(req.permits as usize, || None);
                    }
                    e.waiters.push_front(Waiter {
                        id,
                        ttl: opts.ttl,
                        value: req.value.to_vec(),
                        notify: notify.clone(),
                    });
                    self.settle(&guard.key, e, now);
                    self.ensure_reaper(&guard.key, e);
                }
                held
            };
            if let Some((slot, token, granted_at)) = granted {
                guard.armed = false;
                return Ok(self.lease(&guard.key, id, slot, token, granted_at, &opts));
            }
        }
    }

    async fn holders(&self, kind: SlotKind, name: &str) -> Result<Option<SlotHolders>> {
        validate_slot_name(kind, name)?;
        let key: Key = (kind, name.to_owned());
        let now = Instant::now();
        let mut t = lock(&self.table);
        let Some(e) = t.entries.get_mut(&key) else {
            return Ok(None);
        };
        self.settle(&key, e, now);
        if !e.active() {
            return Ok(None);
        }
        Ok(Some(SlotHolders::new(
            e.permits,
            self.snapshot(&key, e, Some(now)),
        )))
    }

    async fn watch(&self, kind: SlotKind, name: &str) -> Result<Box<dyn SlotWatch>> {
        validate_slot_name(kind, name)?;
        let key: Key = (kind, name.to_owned());
        let mut t = lock(&self.table);
        let e = t.entries.entry(key.clone()).or_default();
        self.settle(&key, e, Instant::now());
        let rx = e
            .events
            .get_or_insert_with(|| broadcast::channel(OBSERVER_BUFFER).0)
            .subscribe();
        let first = self.snapshot(&key, e, None);
        self.ensure_reaper(&key, e);
        Ok(Box::new(MemoryWatch {
            slots: self.clone(),
            key,
            rx: Some(rx),
            first: Some(first),
        }))
    }
}

/// Frees what the name's expired slots held and hands them on, for as long as anyone waits
/// or observes; sleeps until the earliest expiry or a poke.
async fn reaper(slots: Slots, key: Key, poke: Arc<Notify>) {
    loop {
        let next = {
            let mut t = lock(&slots.table);
            let Some(e) = t.entries.get_mut(&key) else {
                return;
            };
            if !e.reaper.as_ref().is_some_and(|p| Arc::ptr_eq(p, &poke)) {
                return;
            }
            slots.settle(&key, e, Instant::now());
            let observed = e.events.as_ref().is_some_and(|tx| tx.receiver_count() > 0);
            if e.waiters.is_empty() && !observed {
                e.reaper = None;
                return;
            }
            e.holders.iter().flatten().map(|h| h.expires).min()
        };
        let expiry = async {
            match next {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = expiry => {}
            _ = poke.notified() => {}
        }
    }
}

/// Takes a waiter out of line when its grant ends or is dropped; gives back a slot handed to
/// it meanwhile.
struct WaiterGuard {
    slots: Slots,
    key: Key,
    id: u64,
    armed: bool,
}

impl Drop for WaiterGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut t = lock(&self.slots.table);
        let Some(e) = t.entries.get_mut(&self.key) else {
            return;
        };
        e.waiters.retain(|w| w.id != self.id);
        if let Some((slot, _)) = e.slot_of(self.id) {
            e.holders[slot] = None;
            e.hand_off(Instant::now());
            self.slots.publish(&self.key, e);
        }
        e.poke_reaper();
    }
}

struct MemoryWatch {
    slots: Slots,
    key: Key,
    rx: Option<broadcast::Receiver<Vec<SlotHolder>>>,
    first: Option<Vec<SlotHolder>>,
}

impl fmt::Debug for MemoryWatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryWatch")
            .field("name", &self.key.1)
            .finish()
    }
}

#[async_trait]
impl SlotWatch for MemoryWatch {
    async fn next(&mut self) -> Result<WatchEvent> {
        if let Some(first) = self.first.take() {
            return Ok(WatchEvent::Holders(first));
        }
        let closed = || Error::Backend {
            backend: "memory",
            source: "the table's event channel closed".into(),
        };
        let rx = self.rx.as_mut().ok_or_else(closed)?;
        match rx.recv().await {
            Ok(holders) => Ok(WatchEvent::Holders(holders)),
            Err(broadcast::error::RecvError::Lagged(_)) => Ok(WatchEvent::Missed),
            Err(broadcast::error::RecvError::Closed) => Err(closed()),
        }
    }
}

impl Drop for MemoryWatch {
    fn drop(&mut self) {
        // Unsubscribe first, so that the reaper, poked, sees one observer less.
        drop(self.rx.take());
        let mut t = lock(&self.slots.table);
        let Some(e) = t.entries.get_mut(&self.key) else {
            return;
        };
        if e.events.as_ref().is_some_and(|tx| tx.receiver_count() == 0) {
            // The last observer: free the channel's buffer.
            e.events = None;
        }
        e.poke_reaper();
        if e.events.is_none() && !e.active() && e.last_token == 0 {
            // Observed only, never granted: nothing (no token) to remember.
            t.entries.remove(&self.key);
        }
    }
}

/// One granted slot: its lease and its value.
struct MemorySlotLease {
    slots: Slots,
    key: Key,
    owner: u64,
    slot: usize,
}

impl fmt::Debug for MemorySlotLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemorySlotLease")
            .field("kind", &self.key.0)
            .field("name", &self.key.1)
            .field("slot", &self.slot)
            .field("owner", &self.owner)
            .finish()
    }
}

impl MemorySlotLease {
    fn not_held(&self) -> Error {
        Error::NotHeld {
            name: self.key.1.clone(),
        }
    }

    /// Runs `f` on this grant's slot if it still holds it (live).
    fn with_held<R>(&self, f: impl FnOnce(&Slots, &Key, &mut Entry, Instant) -> R) -> Result<R> {
        let now = Instant::now();
        let mut t = lock(&self.slots.table);
        let e = t
            .entries
            .get_mut(&self.key)
            .ok_or_else(|| self.not_held())?;
        match e.holders.get(self.slot).and_then(Option::as_ref) {
            Some(h) if h.owner == self.owner && h.expires > now => {
                Ok(f(&self.slots, &self.key, e, now))
            }
            _ => Err(self.not_held()),
        }
    }
}

#[async_trait]
impl LeaseOps for MemorySlotLease {
    async fn renew(&self, ttl: Duration) -> Result<()> {
        let slot = self.slot;
        self.with_held(|_, _, e, now| {
            if let Some(h) = e.holders.get_mut(slot).and_then(Option::as_mut) {
                h.expires = now + ttl;
            }
        })
    }

    async fn check(&self) -> Result<()> {
        self.with_held(|_, _, _, _| ())
    }

    async fn release(&self) -> Result<()> {
        let now = Instant::now();
        let mut t = lock(&self.slots.table);
        let e = t
            .entries
            .get_mut(&self.key)
            .ok_or_else(|| self.not_held())?;
        let live = match e.holders.get(self.slot).and_then(Option::as_ref) {
            Some(h) if h.owner == self.owner => h.expires > now,
            _ => return Err(self.not_held()),
        };
        e.holders[self.slot] = None;
        e.reap(now);
        e.hand_off(now);
        self.slots.publish(&self.key, e);
        if live { Ok(()) } else { Err(self.not_held()) }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[async_trait]
impl SlotOps for MemorySlotLease {
    async fn set_value(&self, value: &[u8]) -> Result<()> {
        let slot = self.slot;
        self.with_held(|slots, key, e, _| {
            if let Some(h) = e.holders.get_mut(slot).and_then(Option::as_mut) {
                h.value = value.to_vec();
            }
            slots.publish(key, e);
        })
    }
}

/// Elections and semaphores in the same table as the locks (each kind in a key space of its
/// own). Observers see every change unless they leave more than 1024 changes unread.
#[async_trait]
impl SlotBackend for MemoryLock {
    async fn grant_slot(&self, req: SlotRequest<'_>, opts: AcquireOptions) -> Result<SlotGrant> {
        self.slots.grant(req, opts).await
    }

    async fn slot_holders(&self, kind: SlotKind, name: &str) -> Result<Option<SlotHolders>> {
        self.slots.holders(kind, name).await
    }

    async fn watch_slots(&self, kind: SlotKind, name: &str) -> Result<Box<dyn SlotWatch>> {
        self.slots.watch(kind, name).await
    }

    fn slot_guarantees(&self) -> SlotGuarantees {
        let mut lock = LockBackend::guarantees(self);
        lock.lock_delay = false;
        SlotGuarantees {
            observe: true,
            every_change_observed: true,
            notes: "one process only; an observer more than 1024 changes behind gets Missed",
            ..SlotGuarantees::new(lock)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Election, LeaderEvent, Semaphore};

    fn waiters(m: &MemoryLock, kind: SlotKind, name: &str) -> usize {
        lock(&m.slots.table)
            .entries
            .get(&(kind, name.to_owned()))
            .map_or(0, |e| e.waiters.len())
    }

    fn has_reaper(m: &MemoryLock, kind: SlotKind, name: &str) -> bool {
        lock(&m.slots.table)
            .entries
            .get(&(kind, name.to_owned()))
            .is_some_and(|e| e.reaper.is_some())
    }

    async fn settle_tasks() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_release_wakes_the_first_waiter_only() {
        let m = MemoryLock::new();
        let held = m
            .acquire_permit("s", 1, AcquireOptions::new())
            .await
            .unwrap();
        let mut tasks = Vec::new();
        for _ in 0..3 {
            let m = m.clone();
            tasks.push(tokio::spawn(async move {
                m.acquire_permit("s", 1, AcquireOptions::new()).await
            }));
            settle_tasks().await;
        }
        assert_eq!(waiters(&m, SlotKind::Semaphore, "s"), 3);
        held.release().await.unwrap();
        settle_tasks().await;
        assert!(tasks[0].is_finished(), "the first waiter was not granted");
        assert!(!tasks[1].is_finished() && !tasks[2].is_finished());
        assert_eq!(waiters(&m, SlotKind::Semaphore, "s"), 2);
        let first = tasks.remove(0).await.unwrap().unwrap();
        first.release().await.unwrap();
        settle_tasks().await;
        assert!(tasks[0].is_finished() && !tasks[1].is_finished());
        for t in &tasks {
            t.abort();
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_candidate_dropped_after_the_hand_off_hands_on() {
        let m = MemoryLock::new();
        let a = m.campaign("e", b"a", AcquireOptions::new()).await.unwrap();
        let spawn = |v: &'static [u8]| {
            let m = m.clone();
            tokio::spawn(async move { m.campaign("e", v, AcquireOptions::new()).await })
        };
        let b = spawn(b"b");
        settle_tasks().await;
        let c = spawn(b"c");
        settle_tasks().await;
        a.resign().await.unwrap();
        // B was handed the leadership but has not run since: drop it.
        b.abort();
        let lc = c.await.unwrap().unwrap();
        assert_eq!(lc.value(), b"c");
        let info = m.leader("e").await.unwrap().unwrap();
        assert_eq!((info.term, info.value), (lc.term(), b"c".to_vec()));
        assert_eq!(waiters(&m, SlotKind::Election, "e"), 0);
        lc.resign().await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn an_observer_that_falls_behind_gets_missed_then_goes_on_in_order() {
        let m = MemoryLock::new();
        let mut obs = m.observe("e").await.unwrap();
        assert_eq!(obs.next().await.unwrap(), LeaderEvent::NoLeader);
        let mut l = m.campaign("e", b"0", AcquireOptions::new()).await.unwrap();
        for i in 1..=OBSERVER_BUFFER + 10 {
            l.proclaim(i.to_string().as_bytes()).await.unwrap();
        }
        assert_eq!(obs.next().await.unwrap(), LeaderEvent::Missed);
        let mut last = 0;
        for _ in 0..OBSERVER_BUFFER {
            match obs.next().await.unwrap() {
                LeaderEvent::Leader(info) => {
                    let v: usize = std::str::from_utf8(&info.value).unwrap().parse().unwrap();
                    assert!(v > last, "{v} after {last}");
                    last = v;
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(last, OBSERVER_BUFFER + 10);
        l.resign().await.unwrap();
        assert_eq!(obs.next().await.unwrap(), LeaderEvent::NoLeader);
    }

    #[tokio::test(start_paused = true)]
    async fn the_reaper_runs_only_while_someone_waits_or_observes() {
        let m = MemoryLock::new();
        let ttl = Duration::from_secs(1);
        let l = m
            .campaign("e", b"a", AcquireOptions::new().ttl(ttl).keepalive(false))
            .await
            .unwrap();
        assert!(!has_reaper(&m, SlotKind::Election, "e"), "no one watches");
        let mut obs = m.observe("e").await.unwrap();
        assert!(has_reaper(&m, SlotKind::Election, "e"));
        assert!(matches!(obs.next().await.unwrap(), LeaderEvent::Leader(_)));
        // The reaper tells the observer of the lapse, on time.
        let start = Instant::now();
        assert_eq!(obs.next().await.unwrap(), LeaderEvent::NoLeader);
        assert_eq!(start.elapsed(), ttl);
        drop(obs);
        settle_tasks().await;
        assert!(!has_reaper(&m, SlotKind::Election, "e"));
        drop(l);
    }
}
