//! The keepalive scheduler: one driver task per Tokio runtime waits out the first TTL/3 of every
//! lease that core renews, and starts that lease's own renewal loop only when it is due.
//!
//! Most leases are released long before their first renewal, so a task per lease (spawned at
//! acquire, aborted at release: two cross-thread wake-ups) would mostly do nothing. Instead
//! [`register`] puts the lease in the driver's queue, keyed by its due time, and a release, drop or
//! leak takes it out again; neither wakes the driver unless the new due time is earlier than the
//! instant the driver sleeps until. A due lease gets its own task running `keepalive_loop`, with
//! exactly the renewal behaviour and timing of a lease renewed from the start by a task of its own.
//!
//! Lock order: a lease locks its [`Slot`] and then the driver's state (to remove its entry). The
//! driver takes due entries out under its state lock, releases it, and only then locks their slots.
//! So the two paths never wait for each other in a cycle.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::time::Duration;

use tokio::runtime::{Handle, Id};
use tokio::sync::Notify;
use tokio::task::AbortHandle;
use tokio::time::Instant;

use tracing::Instrument;

use crate::Error;
use crate::lock_unpoisoned as lock;
use crate::observe::TARGET;
use crate::tracker::{LeaseOps, LeaseState, LossReason, SuspectReason, TrackerHandle};

/// While registrations keep coming, an idle driver (empty queue) still wakes this often, so that a
/// new lease (first renewal at TTL/3 ≥ this, for TTLs ≥ 3 s) lands after its sleep deadline and
/// need not wake it.
const IDLE_TICK: Duration = Duration::from_secs(1);

/// After this long without a registration, an idle driver sleeps until the next one wakes it.
const IDLE_LINGER: Duration = Duration::from_secs(30);

/// The drivers, by runtime. Weak: a driver lives as long as its task or a lease registered with it.
static DRIVERS: LazyLock<Mutex<HashMap<Id, Weak<Driver>>>> = LazyLock::new(Default::default);

/// Where one registered lease's keepalive stands. Shared by the lease and its queue entry.
enum Slot {
    /// In the driver's queue; no task yet.
    Pending,
    /// Its renewal task was started.
    Running(AbortHandle),
    /// The lease stopped keepalive (release, drop, leak); final.
    Stopped,
}

/// A queued lease: everything `keepalive_loop` needs.
struct Entry {
    slot: Arc<Mutex<Slot>>,
    name: String,
    tracker: TrackerHandle,
    ops: Arc<dyn LeaseOps>,
}

/// When the driver wakes next, as registrations must know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wake {
    /// Running (or not yet started): it will look at the queue before sleeping again.
    Awake,
    /// Sleeping until this instant.
    Until(Instant),
    /// Sleeping until notified.
    Never,
}

struct State {
    queue: BTreeMap<(Instant, u64), Entry>,
    /// Sequence number of the next registration; also tells the driver whether any came.
    next_seq: u64,
    wake: Wake,
    #[cfg(test)]
    wakeups: u64,
}

/// The scheduler of one runtime.
pub(crate) struct Driver {
    state: Mutex<State>,
    notify: Notify,
    /// Cleared when the driver's task is dropped (its runtime shut down): the driver is then
    /// replaced on the next registration.
    alive: AtomicBool,
    #[cfg(test)]
    task: Mutex<Option<AbortHandle>>,
}

impl fmt::Debug for Driver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = lock(&self.state);
        f.debug_struct("Driver")
            .field("queued", &st.queue.len())
            .field("wake", &st.wake)
            .field("alive", &self.alive.load(Ordering::Relaxed))
            .finish()
    }
}

/// A lease's registration with the driver. Dropping it stops keepalive: removes the queue entry,
/// or aborts the renewal task if it was started.
pub(crate) struct Registration {
    slot: Arc<Mutex<Slot>>,
    key: (Instant, u64),
    driver: Arc<Driver>,
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match *lock(&self.slot) {
            Slot::Pending => "pending",
            Slot::Running(_) => "running",
            Slot::Stopped => "stopped",
        };
        f.debug_struct("Registration")
            .field("due", &self.key.0)
            .field("state", &state)
            .finish()
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut slot = lock(&self.slot);
        match std::mem::replace(&mut *slot, Slot::Stopped) {
            Slot::Pending => {
                // Slot → driver: the driver never holds its state lock while locking a slot.
                let removed = lock(&self.driver.state).queue.remove(&self.key);
                drop(slot);
                // Dropped outside both locks (it only holds clones of what the lease holds).
                drop(removed);
            }
            Slot::Running(task) => task.abort(),
            Slot::Stopped => {}
        }
    }
}

/// Schedules keepalive for a lease: its first renewal is due at `tracker.confirmed_at() + TTL/3`.
///
/// Returns `None` outside a Tokio runtime (nothing could run the renewals; the lease then simply
/// expires at its deadline).
pub(crate) fn register(
    name: &str,
    tracker: &TrackerHandle,
    ops: &Arc<dyn LeaseOps>,
) -> Option<Registration> {
    let handle = Handle::try_current().ok()?;
    let driver = driver_for(&handle);
    let due = tracker.confirmed_at() + tracker.ttl() / 3;
    let slot = Arc::new(Mutex::new(Slot::Pending));
    let entry = Entry {
        slot: slot.clone(),
        name: name.to_owned(),
        tracker: tracker.clone(),
        ops: ops.clone(),
    };
    let (key, wake) = {
        let mut st = lock(&driver.state);
        let key = (due, st.next_seq);
        st.next_seq += 1;
        st.queue.insert(key, entry);
        let wake = match st.wake {
            Wake::Awake => false,
            Wake::Until(t) => due < t,
            Wake::Never => true,
        };
        if wake {
            // The driver will look at the queue again: no need for a second notification.
            st.wake = Wake::Awake;
        }
        (key, wake)
    };
    if wake {
        driver.notify.notify_one();
    }
    Some(Registration { slot, key, driver })
}

/// The live driver of the runtime `handle` belongs to; starts one if there is none (first lease on
/// this runtime, or the previous driver's task died with its runtime).
fn driver_for(handle: &Handle) -> Arc<Driver> {
    let id = handle.id();
    let mut drivers = lock(&DRIVERS);
    if let Some(d) = drivers.get(&id).and_then(Weak::upgrade)
        && d.alive.load(Ordering::Acquire)
    {
        return d;
    }
    drivers.retain(|_, d| d.upgrade().is_some_and(|d| d.alive.load(Ordering::Acquire)));
    let driver = Arc::new(Driver {
        state: Mutex::new(State {
            queue: BTreeMap::new(),
            next_seq: 0,
            wake: Wake::Awake,
            #[cfg(test)]
            wakeups: 0,
        }),
        notify: Notify::new(),
        alive: AtomicBool::new(true),
        #[cfg(test)]
        task: Mutex::new(None),
    });
    // Created outside the task's future so that it also runs if the task is dropped unpolled
    // (spawned onto a runtime that is shutting down).
    let guard = AliveGuard(driver.clone());
    let _task = handle.spawn(async move {
        let guard = guard;
        run(&guard.0).await;
    });
    #[cfg(test)]
    {
        *lock(&driver.task) = Some(_task.abort_handle());
    }
    drivers.insert(id, Arc::downgrade(&driver));
    driver
}

/// Marks the driver dead when its task is dropped, and drops the entries it will never start.
struct AliveGuard(Arc<Driver>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.alive.store(false, Ordering::Release);
        let orphans = std::mem::take(&mut lock(&self.0.state).queue);
        drop(orphans);
    }
}

/// The driver's task: starts due leases' renewal loops, then sleeps until the next due time (or
/// an idle tick), or until a registration that is due earlier notifies it.
async fn run(driver: &Driver) {
    let mut seen_seq = u64::MAX;
    let mut active_at = Instant::now();
    loop {
        let now = Instant::now();
        let mut due = Vec::new();
        let until = {
            let mut st = lock(&driver.state);
            #[cfg(test)]
            {
                st.wakeups += 1;
            }
            while let Some(entry) = st.queue.first_entry() {
                if entry.key().0 > now {
                    break;
                }
                due.push(entry.remove_entry());
            }
            if !st.queue.is_empty() || st.next_seq != seen_seq {
                seen_seq = st.next_seq;
                active_at = now;
            }
            let until = match st.queue.first_key_value() {
                Some(((t, _), _)) => Some(*t),
                None if now.saturating_duration_since(active_at) < IDLE_LINGER => {
                    Some(now + IDLE_TICK)
                }
                None => None,
            };
            st.wake = until.map_or(Wake::Never, Wake::Until);
            until
        };
        for ((first, _), e) in due {
            let mut slot = lock(&e.slot);
            if matches!(*slot, Slot::Pending) {
                let task = tokio::spawn(keepalive_loop(e.name, e.tracker, e.ops, first));
                *slot = Slot::Running(task.abort_handle());
            }
        }
        match until {
            Some(t) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(t) => {}
                    _ = driver.notify.notified() => {}
                }
            }
            None => driver.notify.notified().await,
        }
    }
}

/// Renews at about TTL/3 from the last acknowledged send time; a failed renewal is retried every
/// TTL/12 until the deadline. Stops when the lease is lost or the task is aborted. Each renewal
/// runs in a `renew` span with `keepalive = true`.
///
/// `first` is when the first renewal is due: the grant's `confirmed_at() + TTL/3`. The keepalive
/// scheduler starts the loop at that instant.
async fn keepalive_loop(
    name: String,
    tracker: TrackerHandle,
    ops: Arc<dyn LeaseOps>,
    first: Instant,
) {
    let ttl = tracker.ttl();
    let interval = ttl / 3;
    let retry = (ttl / 12).max(Duration::from_millis(5));
    let (backend, token) = tracker.span_labels();
    let mut next = first;
    loop {
        tokio::time::sleep_until(next).await;
        if tracker.state() == LeaseState::Lost {
            return;
        }
        let span = tracing::debug_span!(target: TARGET, "renew", lock = %name, backend, token, keepalive = true, outcome = tracing::field::Empty);
        let sent = Instant::now();
        let answer = tokio::time::timeout_at(tracker.valid_until(), ops.renew(ttl))
            .instrument(span.clone())
            .await;
        match answer {
            Ok(Ok(())) => {
                if !tracker.confirm(sent) {
                    span.record("outcome", "late");
                    // Acknowledged too late: the holder has been told it lost the lock, so give
                    // the lock back (as lapsed: its lock-delay runs) rather than keep a lease
                    // nobody uses.
                    let _ = ops.relinquish().await;
                    return;
                }
                span.record("outcome", "ok");
                next = sent + interval;
            }
            Ok(Err(Error::NotHeld { .. })) => {
                span.record("outcome", "not_held");
                tracker.renewal("not_held");
                tracker.mark_lost(LossReason::NotHeldOnServer);
                return;
            }
            Ok(Err(e)) => {
                span.record("outcome", "error");
                // The renewal failed: the lease may still be valid, but can no longer be counted on.
                tracing::debug!(target: TARGET, lock = %name, backend, error = %e, "keepalive failed; retrying");
                tracker.mark_suspect(SuspectReason::RenewalFailed);
                next = Instant::now() + retry;
            }
            Err(_elapsed) => {
                span.record("outcome", "timeout");
                tracker.renewal("failed");
                tracing::debug!(target: TARGET, lock = %name, backend, "keepalive did not answer before the deadline");
                next = Instant::now();
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    use super::*;

    /// The current runtime's driver, if one was started.
    pub(crate) fn current_driver() -> Option<Arc<Driver>> {
        let id = Handle::current().id();
        lock(&DRIVERS).get(&id).and_then(Weak::upgrade)
    }

    impl Driver {
        pub(crate) fn queue_len(&self) -> usize {
            lock(&self.state).queue.len()
        }

        pub(crate) fn wakeups(&self) -> u64 {
            lock(&self.state).wakeups
        }

        pub(crate) fn is_alive(&self) -> bool {
            self.alive.load(Ordering::Acquire)
        }

        /// Kills the driver's task, as if it had died.
        pub(crate) fn abort_task(&self) {
            if let Some(t) = lock(&self.task).take() {
                t.abort();
            }
        }
    }
}
