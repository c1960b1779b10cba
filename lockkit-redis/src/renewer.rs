//! Batched keepalive: one renewer per [`RedisLock`](crate::RedisLock) connection renews all its
//! kept-alive leases together, with one script per [`BATCH`] leases per tick, instead of one
//! script per lease (core's keepalive). The leases declare themselves
//! [`self_renewing`](lockkit_core::backend::LeaseOps::self_renewing), so core schedules nothing.
//!
//! A tick runs every `TTL/3` of the shortest TTL among the registered leases (a lease is renewed
//! within `TTL/3` of its grant, then every `TTL/3`). The script compares and `PEXPIRE`s every
//! lease of the batch (<https://redis.io/docs/latest/commands/pexpire/>) and answers one flag
//! per lease, so a lease whose key is gone is marked lost alone, and a batch whose call failed
//! marks only its own leases suspect (retried after `TTL/12`).
//!
//! In Cluster mode one script may only touch keys of one hash slot, so the leases are grouped
//! by their keys' hash tag (one lock name each, see `Keys::build`) and each group is one script
//! call (of up to [`BATCH`] leases), all in flight together: the cluster connection sends each
//! to its slot's master. Leases of different names mostly get a call each then; what the batch
//! still saves is the per-lease timer.
//!
//! Each tick also starts, in the background, the client's once-per-tick checks (see
//! `waiters.rs`): a `PING` of the pub/sub connection and the server's `run_id`.
//!
//! The task runs while leases are registered and ends with the last one.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, Weak};
use std::time::Duration;

use futures_util::future::join_all;
use redis::Script;
use tokio::sync::Notify;
use tokio::time::Instant;

use lockkit_core::backend::{SuspectReason, TrackerHandle};
use lockkit_core::{LeaseState, LossReason};

use crate::conn::Conn;
use crate::core::{RedisLease, delay_px, hash_tag, ttl_millis};
use crate::error::{bad_reply, from_redis};
use crate::waiters::Hub;

/// The most leases renewed by one script call: 1,000 (a call then runs two or three commands
/// per lease on the server, around a millisecond).
pub const BATCH: usize = 1000;

/// Batched compare-and-pexpire. `KEYS[2i-1]` lock keys, `KEYS[2i]` their lock-delay keys;
/// `ARGV[3i-2]` owner value, `ARGV[3i-1]` TTL in ms, `ARGV[3i]` TTL + lock-delay in ms (`0`: no
/// delay, the delay key is not touched). Returns one integer per lease: 1 if its lock key held
/// our value and was extended (with its delay key), 0 otherwise (a lapsed lock is never
/// re-taken). The `GET` is a `pcall`: a lock key replaced by another type (`WRONGTYPE`) is 0
/// for that lease, not an error that fails the batch's other leases.
static RENEW_BATCH: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local r = {}
for i = 1, #KEYS / 2 do
  if redis.pcall('GET', KEYS[2 * i - 1]) == ARGV[3 * i - 2] then
    if ARGV[3 * i] ~= '0' then
      redis.call('SET', KEYS[2 * i], ARGV[3 * i - 2], 'PX', ARGV[3 * i])
    end
    r[i] = redis.call('PEXPIRE', KEYS[2 * i - 1], ARGV[3 * i - 1])
  else
    r[i] = 0
  end
end
return r
",
    )
});

struct Entry {
    lease: Weak<RedisLease>,
    tracker: TrackerHandle,
}

#[derive(Default)]
struct State {
    entries: HashMap<u64, Entry>,
    next_id: u64,
    running: bool,
    /// Number of the task started last.
    epoch: u64,
    /// The task's current tick.
    tick: Option<Duration>,
}

/// The renewer of one connection.
pub(crate) struct Renewer {
    conn: Conn,
    /// The client's pub/sub side, checked once per tick.
    hub: Arc<Hub>,
    state: Mutex<State>,
    /// Wakes the task when a lease with a shorter TTL than the current tick arrives.
    notify: Notify,
}

impl std::fmt::Debug for Renewer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Renewer")
            .field("leases", &lock(&self.state).entries.len())
            .finish()
    }
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A lease's registration; dropping it stops its renewal.
pub(crate) struct Batched {
    renewer: Arc<Renewer>,
    id: u64,
}

impl Drop for Batched {
    fn drop(&mut self) {
        lock(&self.renewer.state).entries.remove(&self.id);
    }
}

impl Renewer {
    pub(crate) fn new(conn: Conn, hub: Arc<Hub>) -> Arc<Self> {
        Arc::new(Self {
            conn,
            hub,
            state: Mutex::new(State::default()),
            notify: Notify::new(),
        })
    }

    /// Adds a lease to the batch (starting the task on the current runtime if it is not
    /// running). `None` outside a Tokio runtime: nothing could renew the lease.
    pub(crate) fn register(
        self: &Arc<Self>,
        lease: Weak<RedisLease>,
        tracker: &TrackerHandle,
    ) -> Option<Batched> {
        let rt = tokio::runtime::Handle::try_current().ok()?;
        let mut st = lock(&self.state);
        let id = st.next_id;
        st.next_id += 1;
        st.entries.insert(
            id,
            Entry {
                lease,
                tracker: tracker.clone(),
            },
        );
        if st.running {
            let sooner = st.tick.is_some_and(|t| tracker.ttl() / 3 < t);
            drop(st);
            if sooner {
                self.notify.notify_one();
            }
        } else {
            st.running = true;
            st.epoch += 1;
            let epoch = st.epoch;
            drop(st);
            rt.spawn(self.clone().run(epoch));
        }
        Some(Batched {
            renewer: self.clone(),
            id,
        })
    }

    /// The tick: `TTL/3` of the shortest registered TTL, or `None` (and the task ends) when no
    /// lease is left.
    fn interval(&self) -> Option<Duration> {
        let mut st = lock(&self.state);
        st.entries
            .retain(|_, e| e.lease.strong_count() > 0 && e.tracker.state() != LeaseState::Lost);
        st.tick = st.entries.values().map(|e| e.tracker.ttl() / 3).min();
        if st.tick.is_none() {
            st.running = false;
        }
        st.tick
    }

    async fn run(self: Arc<Self>, epoch: u64) {
        // If the task is dropped (its runtime shut down), the next registration starts a new one.
        struct Stopped(Arc<Renewer>, u64);
        impl Drop for Stopped {
            fn drop(&mut self) {
                let mut st = lock(&self.0.state);
                if st.epoch == self.1 {
                    st.running = false;
                }
            }
        }
        let this = Stopped(self, epoch);
        let me = &this.0;
        let mut last = Instant::now();
        let mut retry_at = None;
        loop {
            let Some(interval) = me.interval() else {
                return;
            };
            let at = retry_at.unwrap_or(last + interval);
            tokio::select! {
                _ = tokio::time::sleep_until(at) => {}
                // A lease with a shorter TTL: tick sooner.
                _ = me.notify.notified() => continue,
            }
            last = Instant::now();
            me.hub.tick();
            retry_at = if me.renew_all().await {
                None
            } else {
                Some(Instant::now() + (interval / 4).max(Duration::from_millis(5)))
            };
        }
    }

    /// Renews every registered lease, [`BATCH`] per script call, the calls in flight together.
    /// Returns `false` if some call failed (its leases are suspect now).
    async fn renew_all(&self) -> bool {
        let leases: Vec<(Arc<RedisLease>, TrackerHandle)> = {
            let mut st = lock(&self.state);
            st.entries
                .retain(|_, e| e.lease.strong_count() > 0 && e.tracker.state() != LeaseState::Lost);
            st.entries
                .values()
                .filter_map(|e| Some((e.lease.upgrade()?, e.tracker.clone())))
                .collect()
        };
        if self.conn.is_cluster() {
            let mut by_tag: HashMap<String, Vec<(Arc<RedisLease>, TrackerHandle)>> = HashMap::new();
            for entry in leases {
                let tag = hash_tag(&entry.0.keys.lock).to_owned();
                by_tag.entry(tag).or_default().push(entry);
            }
            let calls = by_tag
                .values()
                .flat_map(|group| group.chunks(BATCH))
                .map(|chunk| self.renew_batch(chunk));
            return join_all(calls).await.into_iter().all(|ok| ok);
        }
        let calls = leases.chunks(BATCH).map(|chunk| self.renew_batch(chunk));
        join_all(calls).await.into_iter().all(|ok| ok)
    }

    async fn renew_batch(&self, chunk: &[(Arc<RedisLease>, TrackerHandle)]) -> bool {
        let mut inv = RENEW_BATCH.prepare_invoke();
        for (lease, tracker) in chunk {
            inv.key(&lease.keys.lock)
                .key(&lease.keys.delay)
                .arg(&lease.owner)
                .arg(ttl_millis(tracker.ttl()))
                .arg(delay_px(tracker.ttl(), lease.delay));
        }
        let earliest = chunk
            .iter()
            .map(|(_, t)| t.valid_until())
            .min()
            .unwrap_or_else(Instant::now);
        let sent = Instant::now();
        let reply = tokio::time::timeout_at(earliest, self.conn.invoke::<Vec<i64>>(&inv)).await;
        let flags = match reply {
            Ok(Ok(flags)) if flags.len() == chunk.len() => flags,
            other => {
                let error = match other {
                    Ok(Ok(_)) => bad_reply("batched renew"),
                    Ok(Err(e)) => from_redis(e),
                    Err(_) => lockkit_core::Error::Unavailable {
                        backend: crate::error::BACKEND,
                        source: "the batched renewal did not answer before a lease's deadline"
                            .into(),
                    },
                };
                tracing::warn!(leases = chunk.len(), error = %error, "batched keepalive failed; retrying");
                for (_, tracker) in chunk {
                    tracker.mark_suspect(SuspectReason::RenewalFailed);
                }
                return false;
            }
        };
        for ((lease, tracker), flag) in chunk.iter().zip(flags) {
            if flag == 1 {
                if !tracker.confirm(sent) {
                    // Acknowledged too late: the holder has been told it lost the lock, so give
                    // the lock back rather than keep a lease nobody uses — as lapsed, keeping
                    // its lock-delay (the holder may still have writes in flight).
                    let lease = lease.clone();
                    tokio::spawn(async move {
                        let _ = lease.give_back_lapsed().await;
                    });
                }
            } else if tracker.state() != LeaseState::Lost && lease.is_batched() {
                // (A lease released while this call was in flight is no longer batched: its
                // key is gone because of the release, not lost.)
                tracing::warn!(lock = %lease.name, "keepalive: lease no longer held on the server");
                tracker.mark_lost(LossReason::NotHeldOnServer);
            }
        }
        true
    }
}
