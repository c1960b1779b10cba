//! Loss notices: the leases held through one [`RedisLock`](crate::RedisLock), by lock key, so
//! that a holder hears within milliseconds that the server ended its lease behind its back.
//!
//! - **Key deleted, expired or evicted**: the waiters' pub/sub connection (`waiters.rs`) also
//!   `PSUBSCRIBE`s to the keyspace channels of the prefix's lock keys,
//!   `__keyspace@DB__:P:lock:*` (<https://redis.io/docs/latest/develop/use/keyspace-notifications/>;
//!   the server must have `notify-keyspace-events` `Kgxe`, see `server.rs`). A `del`, `expired`
//!   or `evicted` event for the key of a lease held here costs one map look-up and one `GET`:
//!   if the key no longer holds the lease's owner value, the lease is
//!   [`Lost`](lockkit_core::LeaseState::Lost) with
//!   [`NotHeldOnServer`](LossReason::NotHeldOnServer). Every other event (a renewal's `expire`,
//!   a key nobody here holds) is one look-up and nothing else. A lease's own release takes it
//!   out of the map before its script is sent, so its `del` is never taken for a loss; an event
//!   that arrives late (a delete before our grant) finds the key ours and changes nothing.
//!   Pub/sub delivery is at-most-once: while the connection is down (until it is resubscribed)
//!   holders hear only at their next renewal, as without notifications.
//! - **Server restart**: the server's `run_id` (`INFO server`) is read at connect, when the
//!   pub/sub connection comes back after a drop, and once per keepalive tick. A new `run_id`
//!   means the server restarted: every lease held here is
//!   [`Lost`](lockkit_core::LeaseState::Lost) with
//!   [`SessionExpired`](LossReason::SessionExpired) (the server run that held it ended; even
//!   with persistence the restart may have dropped its last writes), and its key is given back
//!   as lapsed (compare-and-delete, keeping a lock-delay) in case it survived. A lease the new run granted before the client
//!   saw the new `run_id` is lost too (which run granted it cannot be told apart cheaply): the
//!   holder stops early, and the lock is free again at once.
//! - **New master** (Sentinel mode): a failover also shows as a new `run_id` (the promoted
//!   replica's), but there a lease is not lost for that alone: each lease held here must prove
//!   that the new master holds it, with one compare-and-`PEXPIRE` of its key and owner value
//!   (which also makes good a renewal the old master did not replicate). Until then it is
//!   [`Suspect`](lockkit_core::LeaseState::Suspect) (from the moment the client switched
//!   masters); a key that is missing or holds another value makes it
//!   [`Lost`](lockkit_core::LeaseState::Lost) with
//!   [`NotHeldOnServer`](LossReason::NotHeldOnServer). The same holds for a restart of the
//!   master in Sentinel mode.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use lockkit_core::backend::{SuspectReason, TrackerHandle};
use lockkit_core::{LeaseState, LossReason};

use crate::config::Notifications;
use crate::conn::Conn;
use crate::core::{RedisLease, compare_and_pexpire, holds};
use crate::server::info_field;

/// Within how long a holder hears that its lock key was deleted, evicted or expired on the
/// server, while keyspace notifications are on and the pub/sub connection is up: 200 ms. A
/// deletion or an eviction costs one pub/sub message and one `GET` (0.3–5 ms measured on
/// loopback). An expiry is reported when the server actually removes the key, by its active
/// expiry cycle (10 times a second at the default `hz`) or when the key is next touched: up to
/// about 100 ms after the expiry (38–98 ms measured). Declared as
/// [`Guarantees::loss_notice`](lockkit_core::Guarantees::loss_notice).
pub const LOSS_NOTICE: Duration = Duration::from_millis(200);

/// The keyspace events that may end a lease: `DEL` (and `UNLINK`), expiry, eviction.
const LOSSES: [&str; 4] = ["del", "unlink", "expired", "evicted"];

struct Entry {
    id: u64,
    owner: String,
    tracker: TrackerHandle,
    lease: Weak<RedisLease>,
}

#[derive(Default)]
struct State {
    /// Held leases by lock key (normally one per key).
    by_key: HashMap<String, Vec<Entry>>,
    next: u64,
}

/// The held leases of one client, and what the server's run is.
pub(crate) struct Watch {
    conn: Conn,
    /// Whether the server sends keyspace notifications of lock-key losses and the pub/sub
    /// connection may subscribe to them.
    notifications: AtomicBool,
    /// Whether notifications may be turned on again after a server restart.
    mode: Notifications,
    /// The keyspace channel of lock key `K` is `channel_prefix + K`: `__keyspace@DB__:`.
    channel_prefix: String,
    /// The `PSUBSCRIBE` pattern of the prefix's lock keys.
    pattern: String,
    state: Mutex<State>,
    /// The `run_id` of the server run the client talks to (`None` if `INFO` never answered);
    /// the lock serializes checks.
    run: tokio::sync::Mutex<Option<String>>,
    /// Sentinel mode: on a new `run_id` leases prove they are held instead of being lost.
    prove: bool,
}

impl fmt::Debug for Watch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watch")
            .field("notifications", &self.notifications())
            .field("keys", &lock(&self.state).by_key.len())
            .finish()
    }
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A lease's place in the [`Watch`]; dropping it (at release, or with the lease) takes it out.
pub(crate) struct Watched {
    watch: Arc<Watch>,
    key: String,
    id: u64,
}

impl fmt::Debug for Watched {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watched").field("key", &self.key).finish()
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        let mut st = lock(&self.watch.state);
        if let Some(v) = st.by_key.get_mut(&self.key) {
            v.retain(|e| e.id != self.id);
            if v.is_empty() {
                st.by_key.remove(&self.key);
            }
        }
    }
}

impl Watch {
    /// The watch of a client on database `db` with key prefix `prefix`, for a server whose
    /// `run_id` is `run_id`.
    pub(crate) fn new(
        conn: Conn,
        db: i64,
        prefix: &str,
        notifications: bool,
        mode: Notifications,
        run_id: Option<String>,
        prove: bool,
    ) -> Arc<Self> {
        let channel_prefix = format!("__keyspace@{db}__:");
        let pattern = format!("{channel_prefix}{}:lock:*", glob_escape(prefix));
        Arc::new(Self {
            conn,
            notifications: AtomicBool::new(notifications),
            mode,
            channel_prefix,
            pattern,
            state: Mutex::new(State::default()),
            run: tokio::sync::Mutex::new(run_id),
            prove,
        })
    }

    /// Whether the server sends keyspace notifications of lock-key losses (found or turned on
    /// at connect) and the pub/sub connection was not refused them.
    pub(crate) fn notifications(&self) -> bool {
        self.notifications.load(Ordering::Relaxed)
    }

    /// The subscription to the lock keys' keyspace channels was refused.
    pub(crate) fn disable_notifications(&self) {
        self.notifications.store(false, Ordering::Relaxed);
    }

    /// The `PSUBSCRIBE` pattern for the keyspace channels of the prefix's lock keys.
    pub(crate) fn pattern(&self) -> &str {
        &self.pattern
    }

    /// Adds a held lease (its lock key and owner value are in `lease`) with its tracker.
    pub(crate) fn register(
        self: &Arc<Self>,
        lease: &Arc<RedisLease>,
        tracker: &TrackerHandle,
    ) -> Watched {
        let key = lease.keys.lock.clone();
        let mut st = lock(&self.state);
        let id = st.next;
        st.next += 1;
        st.by_key.entry(key.clone()).or_default().push(Entry {
            id,
            owner: lease.owner.clone(),
            tracker: tracker.clone(),
            lease: Arc::downgrade(lease),
        });
        Watched {
            watch: self.clone(),
            key,
            id,
        }
    }

    /// A keyspace event on `channel` (`__keyspace@DB__:KEY`) with payload `event`: for a loss
    /// of a lease held here, a `GET` is spawned that marks it lost unless the key is still
    /// its. One look-up per event otherwise.
    pub(crate) fn on_event(self: &Arc<Self>, channel: &str, event: &str) {
        if !LOSSES.contains(&event) {
            return;
        }
        let Some(key) = channel.strip_prefix(self.channel_prefix.as_str()) else {
            return;
        };
        let held: Vec<(u64, String, TrackerHandle)> = {
            let st = lock(&self.state);
            let Some(v) = st.by_key.get(key) else {
                return;
            };
            v.iter()
                .filter(|e| e.tracker.state() != LeaseState::Lost)
                .map(|e| (e.id, e.owner.clone(), e.tracker.clone()))
                .collect()
        };
        for (id, owner, tracker) in held {
            let this = self.clone();
            let key = key.to_owned();
            let event = event.to_owned();
            tokio::spawn(async move {
                this.verify(&key, id, &owner, &tracker, &event).await;
            });
        }
    }

    /// Marks the lease `id` on `key` lost if the key does not hold `owner` (one `GET`), unless
    /// the lease left the watch meanwhile (released). A failed `GET` changes nothing: the next
    /// renewal finds out.
    async fn verify(&self, key: &str, id: u64, owner: &str, tracker: &TrackerHandle, why: &str) {
        match holds(&self.conn, key, owner).await {
            Ok(true) => {}
            Ok(false) => {
                if self.is_registered(key, id) {
                    tracing::warn!(key = %key, event = %why,
                        "the lock key was removed on the server: lease lost");
                    tracker.mark_lost(LossReason::NotHeldOnServer);
                }
            }
            Err(e) => {
                tracing::debug!(key = %key, error = %e,
                    "cannot check a lease after a keyspace event; its next renewal will");
            }
        }
    }

    /// Every lease held here that is not lost, with its registration.
    fn held(&self) -> Vec<(String, u64, TrackerHandle, Weak<RedisLease>)> {
        let st = lock(&self.state);
        st.by_key
            .iter()
            .flat_map(|(k, v)| v.iter().map(move |e| (k, e)))
            .filter(|(_, e)| e.tracker.state() != LeaseState::Lost)
            .map(|(k, e)| (k.clone(), e.id, e.tracker.clone(), e.lease.clone()))
            .collect()
    }

    /// Marks every lease held here suspect (the client switched to a new master; they have not
    /// proved it holds them yet).
    pub(crate) fn suspect_all(&self) {
        for (_, _, tracker, _) in self.held() {
            tracker.mark_suspect(SuspectReason::ConnectionLost);
        }
    }

    /// After the server run changed from `old` to `now` (Sentinel mode): each lease held here
    /// proves the new run holds it (compare-and-`PEXPIRE`, which also restarts its expiry
    /// there), or is lost. A lease whose call fails stays as it is: its renewal decides.
    async fn prove_all(&self, old: &str, now: &str) {
        let held = self.held();
        tracing::warn!(old_run_id = %old, new_run_id = %now, leases = held.len(),
            "the redis master changed: every lease held through this client must prove the new              master holds it");
        let proofs = held.into_iter().map(|(key, id, tracker, lease)| async move {
            let Some(lease) = lease.upgrade() else { return };
            let sent = tokio::time::Instant::now();
            match compare_and_pexpire(
                &lease.conn,
                &lease.keys,
                &lease.owner,
                tracker.ttl(),
                lease.delay,
            )
            .await
            {
                Ok(true) => {
                    tracker.confirm(sent);
                    tracing::info!(key = %key, "the new master holds the lease: kept");
                }
                Ok(false) => {
                    if self.is_registered(&key, id) {
                        tracing::warn!(key = %key,
                            "the new master does not hold the lease (not replicated before the                              failover, or expired since): lease lost");
                        tracker.mark_lost(LossReason::NotHeldOnServer);
                    }
                }
                Err(e) => {
                    tracing::debug!(key = %key, error = %e,
                        "cannot prove a lease on the new master; its next renewal will");
                }
            }
        });
        futures_util::future::join_all(proofs).await;
    }

    fn is_registered(&self, key: &str, id: u64) -> bool {
        lock(&self.state)
            .by_key
            .get(key)
            .is_some_and(|v| v.iter().any(|e| e.id == id))
    }

    /// Reads the server's `run_id` (one `INFO server`); if it changed since the last look, the
    /// server restarted: every lease held here is lost
    /// ([`SessionExpired`](LossReason::SessionExpired)) and its key given back in the
    /// background, and keyspace notifications are turned on again. A failed `INFO` changes
    /// nothing: then `false`.
    ///
    /// # Cancel safety
    /// Cancel safe: a dropped check leaves the last known run as it was.
    pub(crate) async fn check_run(&self) -> bool {
        if self.conn.is_cluster() {
            // Many servers, no one run_id: a lease on a restarted or failed-over master is
            // found lost by its renewal (compare-and-PEXPIRE on the slot's master).
            return true;
        }
        let mut run = self.run.lock().await;
        let info = match self
            .conn
            .query::<String>(redis::cmd("INFO").arg("server"))
            .await
        {
            Ok(info) => info,
            Err(e) => {
                tracing::debug!(error = %e, "INFO server failed; the restart check waits");
                return false;
            }
        };
        let Some(now) = info_field(&info, "run_id") else {
            return true; // a server that does not tell (a proxy): nothing to compare
        };
        if run.as_deref() == Some(now) {
            return true;
        }
        let Some(old) = run.replace(now.to_owned()) else {
            return true; // the first answer: nothing to compare with
        };
        if self.prove {
            self.prove_all(&old, now).await;
            if self.notifications() && !crate::server::renotify(&self.conn, self.mode).await {
                self.disable_notifications();
            }
            return true;
        }
        let held: Vec<Weak<RedisLease>> = {
            let st = lock(&self.state);
            st.by_key
                .values()
                .flatten()
                .filter(|e| e.tracker.state() != LeaseState::Lost)
                .map(|e| {
                    e.tracker.mark_lost(LossReason::SessionExpired);
                    e.lease.clone()
                })
                .collect()
        };
        tracing::warn!(old_run_id = %old, new_run_id = %now, lost = held.len(),
            "the redis server restarted: every lease held through this client is lost");
        if let (false, Ok(rt)) = (held.is_empty(), tokio::runtime::Handle::try_current()) {
            // Give back keys that survived (persistence) or that the new run granted, as lapsed:
            // a lock-delay is kept (the holders may still have writes in flight).
            rt.spawn(async move {
                for lease in held.iter().filter_map(Weak::upgrade) {
                    let _ = lease.give_back_lapsed().await;
                }
            });
        }
        if self.notifications() && !crate::server::renotify(&self.conn, self.mode).await {
            self.disable_notifications();
        }
        true
    }
}

/// `s` with the glob characters of `PSUBSCRIBE` patterns (`*`, `?`, `[`, `]`, `\`) escaped.
fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_escape_the_prefix() {
        assert_eq!(glob_escape("app"), "app");
        assert_eq!(glob_escape("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
    }
}
