//! What [`lock`](crate::lock) (acquire) and [`lease`](crate::lease) (renew, release) share:
//! requests with timeouts and retries, the session lease shared by the locks of one client and
//! TTL, and its keepalive task.
//!
//! etcd facts relied on (<https://etcd.io/docs/v3.4/learning/api/#lease-api>):
//! - a lease is granted with a TTL in whole seconds; the server may raise it to its minimum TTL
//!   (1.5 × election timeout, rounded up to whole seconds) and says so in the grant response;
//! - every key attached to a lease is deleted, in the same revision, when the lease expires or
//!   is revoked; so "my key exists" implies "my lease is alive";
//! - `LeaseKeepAlive` answers `TTL <= 0` for a lease that no longer exists, and resets the lease
//!   to its full TTL otherwise, counted from when the leader handles the request (so from no
//!   earlier than when we sent it);
//! - the leader checks for expired leases every 500 ms (`lessor.runLoop`), so a lapsed lease is
//!   freed up to 0.5 s after its TTL.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, DeleteOptions, EventType, GetOptions, PutOptions, SortOrder,
    SortTarget, Txn, TxnOp, WatchFilterType, WatchOptions, WatchRequestSender, WatchResponse,
    WatchResponseStream, WatchStream,
};
use lockkit_core::backend::{Backoff, SuspectReason, TrackerHandle};
use lockkit_core::{Error, Instant, LeaseState, LossReason, Result};
use tokio::sync::{Notify, mpsc, watch};

use crate::error::{self, BACKEND, from_client};

/// Runs `fut` with a timeout; on timeout returns [`Error::Unavailable`].
pub(crate) async fn timed<T>(
    limit: Duration,
    what: &'static str,
    fut: impl Future<Output = std::result::Result<T, etcd_client::Error>>,
) -> Result<T> {
    match tokio::time::timeout(limit, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(from_client(e)),
        Err(_) => Err(error::timeout(what)),
    }
}

/// The read of lock `name_prefix`'s holder: the key with the lowest create revision under it
/// (keys only), for a transaction.
pub(crate) fn holder_read(name_prefix: &[u8]) -> TxnOp {
    TxnOp::get(
        name_prefix.to_vec(),
        Some(
            GetOptions::new()
                .with_prefix()
                .with_sort(SortTarget::Create, SortOrder::Ascend)
                .with_limit(1)
                .with_keys_only(),
        ),
    )
}

/// Runs the request `f` makes until it succeeds, fails with a non-transient error, or `total`
/// has passed. Each attempt gets a fifth of `total` (at least 100 ms): with one member down or
/// frozen, the client's balancer (which picks an endpoint per request) most likely sends the next
/// attempt to a live member. Only for requests that are safe to repeat.
pub(crate) async fn with_retries<T, F, Fut>(total: Duration, what: &'static str, f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = std::result::Result<T, etcd_client::Error>>,
{
    with_retries_every(total, per_attempt(total), what, f).await
}

/// A fifth of `total`, at least 100 ms: the time one attempt of a retried request gets, so
/// that a frozen member (which never answers) leaves time for four more tries elsewhere.
pub(crate) fn per_attempt(total: Duration) -> Duration {
    (total / 5).max(Duration::from_millis(100))
}

/// [`with_retries`] with each attempt limited to `per`.
pub(crate) async fn with_retries_every<T, F, Fut>(
    total: Duration,
    per: Duration,
    what: &'static str,
    mut f: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = std::result::Result<T, etcd_client::Error>>,
{
    let start = Instant::now();
    let end = start.checked_add(total).unwrap_or(start);
    let per = per.min(total);
    // A member that refuses connections answers at once: back off (20 ms up to 500 ms, with
    // jitter) rather than ask again every 20 ms while the cluster comes back.
    let mut backoff = Backoff::new(Duration::from_millis(20), Duration::from_millis(500));
    loop {
        let left = end.saturating_duration_since(Instant::now());
        let res = timed(per.min(left).max(Duration::from_millis(1)), what, f()).await;
        let pause = backoff.next_delay();
        match res {
            Ok(v) => return Ok(v),
            Err(e) if e.is_retryable() && Instant::now() + pause < end => {
                tracing::debug!(error = %e, what, "etcd request failed; retrying");
                tokio::time::sleep(pause).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Opens a watch stream with its first watcher (`key`, `opts`), as [`with_retries`] runs a
/// request: a member that is frozen (or cut off) never answers the stream's headers, so each
/// attempt gets a fifth of `total` and the next one most likely opens the stream on a live
/// member. Opening a stream again is safe: a stream that was dropped cancels its watchers.
///
/// # Errors
/// [`Error::Unavailable`] if no attempt opened the stream within `total`.
pub(crate) async fn open_watch(
    client: &Client,
    total: Duration,
    key: &[u8],
    opts: WatchOptions,
) -> Result<WatchStream> {
    let wc = client.watch_client();
    with_retries(total, "a watch", || {
        let (mut wc, key, opts) = (wc.clone(), key.to_vec(), opts.clone());
        async move { wc.watch(key, Some(opts)).await }
    })
    .await
}

/// Whole seconds for etcd: the TTL rounded up, at least 1.
pub(crate) fn ttl_secs(ttl: Duration) -> i64 {
    let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    i64::try_from(secs.max(1)).unwrap_or(i64::MAX)
}

/// How much longer than its lock's etcd lease a lock-delay marker's lease lives, on top of the
/// delay: the leader's expiry sweep (every 0.5 s) may free the lock's lease late and the
/// marker's on time, and each keepalive tick renews the marker's lease before the lock's (up to
/// 1 s before it is answered).
pub(crate) const MARKER_MARGIN: Duration = Duration::from_millis(1500);

/// The TTL (whole seconds) of the lease for lock-delay markers next to a lock lease the server
/// granted `granted_secs` for: the marker outlives the lock's key by at least `delay`.
pub(crate) fn marker_ttl_secs(granted_secs: i64, delay: Duration) -> i64 {
    granted_secs.saturating_add(ttl_secs(delay.saturating_add(MARKER_MARGIN)))
}

/// `{prefix}/./delay/{name}`, the lock-delay marker of lock `name`, from its `{prefix}/{name}/`
/// (`.` is never a lock name, so no lock's prefix covers it; the fence's guard records live
/// under `{prefix}/./fence/` alike).
pub(crate) fn marker_key(name_prefix: &[u8], name: &str) -> Vec<u8> {
    let prefix_len = name_prefix.len().saturating_sub(name.len() + 1);
    let mut key = name_prefix[..prefix_len].to_vec();
    key.extend_from_slice(b"./delay/");
    key.extend_from_slice(name.as_bytes());
    key
}

/// The lock-delay marker of one grant with a delay: its key ([`marker_key`]), a value no other
/// grant writes (the holder key and a sequence number of its lease, so every compare on the
/// value names this grant), the etcd lease it is attached to while the lock is held (a
/// companion of the lock's lease, kept alive with it, whose TTL is [`marker_ttl_secs`]), and the
/// delay.
#[derive(Clone)]
pub(crate) struct Marker {
    pub(crate) key: Vec<u8>,
    pub(crate) value: Vec<u8>,
    pub(crate) lease: i64,
    pub(crate) delay: Duration,
}

impl Marker {
    /// Whether a marker read with `value` is this grant's own.
    pub(crate) fn is_own(&self, value: &[u8]) -> bool {
        value == self.value.as_slice()
    }

    /// A transaction op that creates this marker on its lease.
    pub(crate) fn put(&self) -> TxnOp {
        TxnOp::put(
            self.key.clone(),
            self.value.clone(),
            Some(PutOptions::new().with_lease(self.lease)),
        )
    }

    /// A transaction op that deletes the marker if it is this grant's (a nested transaction:
    /// etcd ≥ 3.3).
    pub(crate) fn delete_own(&self) -> TxnOp {
        TxnOp::txn(
            Txn::new()
                .when([Compare::value(
                    self.key.clone(),
                    CompareOp::Equal,
                    self.value.clone(),
                )])
                .and_then([TxnOp::delete(self.key.clone(), None::<DeleteOptions>)]),
        )
    }
}

/// The ops that delete a lock key and, with it, the grant's own lock-delay marker (a release:
/// the lock is free at once).
pub(crate) fn delete_key_ops(key: &[u8], marker: Option<&Marker>) -> Vec<TxnOp> {
    let mut ops = vec![TxnOp::delete(key.to_vec(), None::<DeleteOptions>)];
    ops.extend(marker.map(Marker::delete_own));
    ops
}

/// The lock of a grant with a delay was freed without a release while its client lives (an
/// admin deleted its key or revoked its lease, or a leaked lock reached its deadline), but its
/// marker sits on a companion lease that other locks keep alive: moves the marker to a lease of
/// its own that nobody renews, with a TTL of the delay (rounded up to whole seconds), granted
/// after the lock was freed — so the delay counts from when this client heard of it, longer
/// than from the moment etcd freed the lock, never shorter. Retried with [`Backoff`] while
/// `shared` lives; once it is lost (no longer renewed), the companion lease ends the marker by
/// itself, [`MARKER_MARGIN`] + the delay after the lock's lease.
pub(crate) async fn detach_marker(
    client: &Client,
    marker: &Marker,
    limit: Duration,
    shared: &SharedLease,
) {
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    loop {
        if shared.master.state() == LeaseState::Lost {
            return;
        }
        let mut lc = client.lease_client();
        let result = async {
            let own = timed(
                limit,
                "a lease grant",
                lc.grant(ttl_secs(marker.delay), None),
            )
            .await?;
            let moved = Marker {
                lease: own.id(),
                ..marker.clone()
            };
            let txn = Txn::new()
                .when([Compare::value(
                    marker.key.clone(),
                    CompareOp::Equal,
                    marker.value.clone(),
                )])
                .and_then([moved.put()]);
            let mut kv = client.kv_client();
            let resp = timed(limit, "a marker move", kv.txn(txn)).await?;
            if !resp.succeeded() {
                // Gone already (or never put): the lease is of no use.
                let _ = timed(limit, "a lease revoke", lc.revoke(own.id())).await;
            }
            Ok::<_, Error>(())
        };
        match result.await {
            Ok(()) => return,
            Err(e) => {
                tracing::debug!(error = %e, "moving a lock-delay marker failed; retrying");
            }
        }
        tokio::time::sleep(backoff.next_delay()).await;
    }
}

/// The answer to one keepalive.
pub(crate) enum KeepAlive {
    /// The server extended the lease. `term` is the raft term of the member that answered
    /// (from the response header): the renewal counts only if a linearizable read then reports
    /// the same term (see [`renewal_counts`]).
    Alive { term: u64 },
    /// The lease does not exist any more (expired or revoked).
    Gone,
}

/// Sends one `LeaseKeepAlive` for `id` and waits for its answer. Returns the send time of the
/// request that was answered.
///
/// etcd-client's `keep_alive` opens the stream with a first keepalive and keeps that answer to
/// itself, so the renewal that counts is a second one on the same stream, whose response
/// header (with the answering member's raft term) we read: two round trips, every TTL/3.
pub(crate) async fn keep_alive_once(
    client: &Client,
    id: i64,
    limit: Duration,
) -> Result<(Instant, KeepAlive)> {
    let mut lc = client.lease_client();
    let exchange = async {
        let (mut keeper, mut stream) = lc.keep_alive(id).await?;
        let sent = Instant::now();
        keeper.keep_alive().await?;
        Ok::<_, etcd_client::Error>((sent, stream.message().await?))
    };
    match tokio::time::timeout(limit, exchange).await {
        Err(_) => Err(error::timeout("a lease keepalive")),
        Ok(Ok((sent, Some(resp)))) if resp.ttl() > 0 => {
            let term = resp.header().map_or(0, |h| h.raft_term());
            Ok((sent, KeepAlive::Alive { term }))
        }
        Ok(Ok((sent, Some(_)))) => Ok((sent, KeepAlive::Gone)),
        Ok(Ok((_, None))) => Err(error::protocol(STREAM_CLOSED)),
        Ok(Err(e)) if error::is_lease_not_found(&e) => Ok((Instant::now(), KeepAlive::Gone)),
        Ok(Err(e)) => Err(from_client(e)),
    }
}

/// The error of a keepalive whose stream the server ended without an answer.
const STREAM_CLOSED: &str = "etcd closed the keepalive stream";

/// Whether `e` says the server ended a keepalive stream without answering: a failed renewal
/// (the lease turns Suspect at once), not a slow one.
pub(crate) fn is_stream_closed(e: &Error) -> bool {
    matches!(e, Error::Backend { source, .. } if source.to_string() == STREAM_CLOSED)
}

/// Whether an acknowledged keepalive from a member in raft term `ack_term` may move the lease's
/// deadline, given the term `read_term` reported by a linearizable read sent after the
/// acknowledgement arrived.
///
/// etcd 3.4 renews a lease in the lessor of whichever member believes it is the leader, without
/// first confirming its leadership with a quorum. A leader that was paused (SIGSTOP, a long
/// stall) answers keepalives on resuming, before it learns of the newer term, although the
/// real leader never renewed the lease. A linearizable read goes through the current leader
/// (ReadIndex, <https://etcd.io/docs/v3.4/learning/api_guarantees/>), so if it reports the
/// same term, the member that answered was in the current term, and the renewal counts; a
/// different term means "not known to count": the lease turns Suspect and is renewed again.
pub(crate) fn renewal_counts(ack_term: u64, read_term: u64) -> bool {
    ack_term != 0 && ack_term == read_term
}

/// The raft term reported by one linearizable read of `key` (count only). Each attempt gets
/// `per` (the keepalive's hedging interval), so one attempt stuck on a frozen member does not
/// eat the time left before the lease turns suspect.
pub(crate) async fn linearizable_term(
    client: &Client,
    key: &[u8],
    limit: Duration,
    per: Duration,
) -> Result<u64> {
    let kv = client.kv_client();
    let resp = with_retries_every(limit, per, "a term check", || {
        let mut kv = kv.clone();
        let opts = GetOptions::new().with_count_only();
        let key = key.to_vec();
        async move { kv.get(key, Some(opts)).await }
    })
    .await?;
    Ok(resp.header().map_or(0, |h| h.raft_term()))
}

/// The error for a keepalive answered by a member of an older raft term.
pub(crate) fn stale_term(ack_term: u64, read_term: u64) -> Error {
    Error::Unavailable {
        backend: BACKEND,
        source: format!(
            "keepalive answered by an etcd member in raft term {ack_term}, but the cluster is in term {read_term}"
        )
        .into(),
    }
}

/// Keepalive attempts of one lease in flight at once, at most.
const MAX_HEDGED: usize = 8;

/// Keepalives of lease `id` until one is answered or `until` passes: a new attempt starts every
/// `hedge_every` while earlier ones are still in flight (at most [`MAX_HEDGED`] at once), and sooner after
/// an attempt failed (each failure is shown to `on_failure` at once). Returns the answer and
/// the send time of the attempt that got it.
///
/// The client picks the endpoint of each new request at random (tonic's balancer sees every
/// connection as equally loaded), so one attempt stuck on a frozen member must not hold up the
/// others: a hedged attempt most likely goes to a member that answers.
pub(crate) async fn keep_alive_hedged(
    client: &Client,
    id: i64,
    until: Instant,
    hedge_every: Duration,
    on_failure: impl Fn(&Error),
) -> (Instant, Result<KeepAlive>) {
    let mut attempts = tokio::task::JoinSet::new();
    let mut last_err = None;
    let mut next_start = Instant::now();
    let mut first_sent = None;
    loop {
        let now = Instant::now();
        if now >= until {
            let err = last_err.unwrap_or_else(|| error::timeout("a lease keepalive"));
            return (first_sent.unwrap_or(now), Err(err));
        }
        if now >= next_start && attempts.len() < MAX_HEDGED {
            let client = client.clone();
            let limit = until.saturating_duration_since(now);
            first_sent.get_or_insert(now);
            attempts.spawn(async move { keep_alive_once(&client, id, limit).await });
            next_start = now + hedge_every;
        }
        let wake = if attempts.len() < MAX_HEDGED {
            next_start.min(until)
        } else {
            until
        };
        tokio::select! {
            joined = attempts.join_next(), if !attempts.is_empty() => match joined {
                Some(Ok(Ok((sent, answer)))) => return (sent, Ok(answer)),
                Some(Ok(Err(e))) => {
                    on_failure(&e);
                    last_err = Some(e);
                    next_start = next_start.min(Instant::now() + (hedge_every / 4).max(Duration::from_millis(20)));
                }
                Some(Err(_)) | None => {}
            },
            _ = tokio::time::sleep_until(wake) => {}
        }
    }
}

/// How long one keepalive attempt of the session lease may go unanswered before the task sends
/// another next to it: TTL/20 (at least 50 ms, at most the request timeout), so that many
/// attempts fit in the time between the regular keepalive (at TTL/3) and the deadline. With one
/// of three members frozen, each attempt is stuck with probability 1/3, so the chance that all
/// [`MAX_HEDGED`] are is about 1/6500.
pub(crate) fn keepalive_attempt_limit(ttl: Duration, request_timeout: Duration) -> Duration {
    (ttl / 20)
        .max(Duration::from_millis(50))
        .min(request_timeout)
        .max(Duration::from_millis(1))
}

/// Settings the keepalive task needs from its session.
#[derive(Clone)]
pub(crate) struct TaskCtx {
    pub(crate) client: Arc<Client>,
    pub(crate) request_timeout: Duration,
    /// A key under the session's prefix for the linearizable term check (readable by a user
    /// whose permissions cover only that prefix).
    pub(crate) probe_key: Vec<u8>,
    pub(crate) linger: Option<Duration>,
    /// Test hook: while set, keepalives are not sent (as if the network dropped them).
    pub(crate) paused: Arc<AtomicBool>,
    /// Closed (sender dropped) when the client session is dropped.
    pub(crate) closed: watch::Receiver<()>,
    /// The session's table of shared leases, to drop a retired entry.
    pub(crate) table: Weak<Mutex<HashMap<Duration, Arc<SharedLease>>>>,
}

#[derive(Default)]
struct SharedState {
    /// Acquires in progress and granted locks that use the lease.
    users: usize,
    /// When `users` last dropped to zero.
    idle_since: Option<Instant>,
    /// Trackers of the locks held on this lease, confirmed with every keepalive.
    trackers: HashMap<u64, TrackerHandle>,
    next_tracker: u64,
    /// Key slots in use per lock name: `(name, n)` names the key `{prefix}/{name}/{id hex}-{n}`.
    /// A slot is busy from before its key may be created until its deletion is confirmed, so
    /// sequential acquires reuse one key (etcd's index keeps every key ever created until
    /// compaction, and range reads over a lock's prefix would slow down with each new key).
    slots: std::collections::HashSet<(String, u32)>,
    /// Keys of slots that are never reused: a request that may create such a key went
    /// unanswered, so etcd may still apply it late and create a key nobody owns. The keepalive
    /// task deletes any that exist, every tick, until the lease retires.
    burnt: Vec<Vec<u8>>,
    /// Lock-delay markers that a request which went unanswered may still create (with a key of
    /// `burnt`): deleted every tick, like those keys.
    burnt_markers: Vec<Marker>,
    /// Companion leases for lock-delay markers, by TTL in seconds ([`marker_ttl_secs`]): renewed
    /// just before this lease at every tick, revoked with it when it retires idle, and left to
    /// expire (so the delay runs) when it is lost.
    companions: HashMap<i64, i64>,
    /// Numbers the markers of this lease's grants ([`Marker::value`]).
    marker_seq: u64,
    /// No new acquire may join (a lock was leaked, or a cleanup failed).
    no_reuse: bool,
    /// Do not revoke when retiring (a leaked lock must stay until its TTL runs out).
    no_revoke: bool,
    /// The keepalive task has stopped; the lease is no longer renewed.
    retired: bool,
    /// The task wants to hear at once when `users` drops to zero (no linger, or the session
    /// is gone); otherwise it notices on its next keepalive tick, which saves a task wake-up on
    /// every release.
    wake_when_idle: bool,
}

/// One etcd lease, shared by every lock that one client holds with one TTL (or private to one
/// `keepalive(false)` acquire while it waits).
pub(crate) struct SharedLease {
    pub(crate) id: i64,
    /// The TTL asked for (the client-side deadlines use it).
    pub(crate) ttl: Duration,
    /// The TTL the server granted, in seconds (≥ the asked TTL).
    pub(crate) granted_secs: i64,
    /// The etcd lease's own clock: send time of the last acknowledged grant/keepalive.
    pub(crate) master: TrackerHandle,
    state: Mutex<SharedState>,
    wake: Notify,
}

impl fmt::Debug for SharedLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedLease")
            .field("id", &format_args!("{:x}", self.id))
            .field("ttl", &self.ttl)
            .field("granted_secs", &self.granted_secs)
            .field("state", &self.master.state())
            .finish()
    }
}

impl SharedLease {
    pub(crate) fn new(id: i64, ttl: Duration, granted_secs: i64, sent: Instant) -> Arc<Self> {
        Arc::new(Self {
            id,
            ttl,
            granted_secs,
            master: TrackerHandle::new(sent, ttl),
            state: Mutex::new(SharedState::default()),
            wake: Notify::new(),
        })
    }

    fn st(&self) -> MutexGuard<'_, SharedState> {
        // Every critical section leaves the state consistent; recover from a poisoned lock.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Joins the lease for one acquire, unless it is retired, lost or closed to newcomers.
    pub(crate) fn try_reserve(self: &Arc<Self>) -> Option<Reservation> {
        let mut st = self.st();
        if st.retired || st.no_reuse || self.master.state() == LeaseState::Lost {
            return None;
        }
        st.users += 1;
        st.idle_since = None;
        Some(Reservation {
            shared: self.clone(),
        })
    }

    /// A reservation on a lease nobody else can join (the private lease of one acquire).
    pub(crate) fn reserve_private(self: &Arc<Self>) -> Reservation {
        let mut st = self.st();
        st.users += 1;
        st.no_reuse = true;
        // Its keepalive task only bridges the wait; the lock's release revokes the lease.
        st.no_revoke = true;
        Reservation {
            shared: self.clone(),
        }
    }

    /// The first reservation on a freshly granted session lease.
    pub(crate) fn reserve_shared(self: &Arc<Self>) -> Reservation {
        match self.try_reserve() {
            Some(r) => r,
            // Lost already (the grant took longer than the TTL): hand out a reservation anyway;
            // the acquire will find the lease lost and retry with a new one.
            None => self.reserve_private(),
        }
    }

    /// One more user of a lease that has not retired (a task that must finish before the lease
    /// may be revoked as idle), even if it takes no newcomers.
    pub(crate) fn pin(self: &Arc<Self>) -> Option<Reservation> {
        let mut st = self.st();
        if st.retired {
            return None;
        }
        st.users += 1;
        st.idle_since = None;
        Some(Reservation {
            shared: self.clone(),
        })
    }

    /// The marker of a new grant of `key` with lock-delay `delay`, on this lease's companion
    /// lease for that delay (granted on first use: one more round trip).
    ///
    /// # Errors
    /// As a lease grant ([`Error::Unavailable`] if etcd did not answer within `limit`).
    pub(crate) async fn marker(
        &self,
        client: &Client,
        marker_key: Vec<u8>,
        key: &[u8],
        delay: Duration,
        limit: Duration,
    ) -> Result<Marker> {
        let secs = marker_ttl_secs(self.granted_secs, delay);
        let found = self.st().companions.get(&secs).copied();
        let lease = match found {
            Some(id) => id,
            None => {
                let mut lc = client.lease_client();
                let resp = timed(limit, "a lease grant", lc.grant(secs, None)).await?;
                if resp.ttl() <= 0 {
                    return Err(error::protocol(format!(
                        "etcd refused a lease: {}",
                        resp.error()
                    )));
                }
                let mut st = self.st();
                let id = *st.companions.entry(secs).or_insert(resp.id());
                drop(st);
                if id != resp.id() {
                    // Another acquire granted one meanwhile.
                    let other = resp.id();
                    tokio::spawn(async move {
                        let _ = timed(limit, "a lease revoke", lc.revoke(other)).await;
                    });
                }
                id
            }
        };
        let mut value = key.to_vec();
        let seq = {
            let mut st = self.st();
            st.marker_seq += 1;
            st.marker_seq
        };
        value.extend_from_slice(format!("#{seq}").as_bytes());
        Ok(Marker {
            key: marker_key,
            value,
            lease,
            delay,
        })
    }

    /// The companion leases (ids) of this lease.
    pub(crate) fn companions(&self) -> Vec<i64> {
        self.st().companions.values().copied().collect()
    }

    /// Companion lease `id` is gone on the server (revoked by hand): stop renewing it. Markers
    /// on it are gone too, so the locks that put them have no lock-delay any more.
    pub(crate) fn drop_companion(&self, id: i64) {
        tracing::warn!(lease = %format_args!("{id:x}"), "etcd lease of lock-delay markers is gone (revoked?): those locks have no lock-delay any more");
        self.st().companions.retain(|_, v| *v != id);
    }

    /// A tracker for a lock granted on this lease, confirmed by the keepalive from now on.
    /// `None` if the lease is already lost on the client side.
    ///
    /// The tracker starts at the send time of the last acknowledged keepalive of the etcd lease
    /// (not at the time of the acquire's request): that is when the server's countdown for the
    /// key started.
    pub(crate) fn register(&self) -> Option<(u64, TrackerHandle)> {
        let mut st = self.st();
        if self.master.state() == LeaseState::Lost || st.retired {
            return None;
        }
        let tracker = TrackerHandle::new(self.master.confirmed_at(), self.ttl);
        st.next_tracker += 1;
        let id = st.next_tracker;
        st.trackers.insert(id, tracker.clone());
        Some((id, tracker))
    }

    /// The lowest free key slot for lock `name` on this lease, now busy.
    pub(crate) fn take_slot(&self, name: &str) -> u32 {
        let mut st = self.st();
        let mut n = 0;
        while st.slots.contains(&(name.to_owned(), n)) {
            n += 1;
        }
        st.slots.insert((name.to_owned(), n));
        n
    }

    /// The key of slot `n` is known to be gone: the slot may be reused.
    pub(crate) fn free_slot(&self, name: &str, n: u32) {
        self.st().slots.remove(&(name.to_owned(), n));
    }

    /// A request that may create `key` (slot `n` of `name`) went unanswered and may still be
    /// applied: the slot is never reused, the key is swept by the keepalive task, and the lease
    /// takes no new acquires (it retires, and its revoke deletes the key, once its locks are
    /// done).
    pub(crate) fn burn_slot(&self, key: Vec<u8>, marker: Option<Marker>) {
        let mut st = self.st();
        st.burnt.push(key);
        st.burnt_markers.extend(marker);
        drop(st);
        self.close_to_newcomers();
    }

    pub(crate) fn burnt_keys(&self) -> (Vec<Vec<u8>>, Vec<Marker>) {
        let st = self.st();
        (st.burnt.clone(), st.burnt_markers.clone())
    }

    /// Stops confirming lock `id`; returns its tracker (its deadline no longer moves).
    pub(crate) fn unregister(&self, id: u64) -> Option<TrackerHandle> {
        self.st().trackers.remove(&id)
    }

    /// A lock on this lease was leaked and nothing can delete its key: keep the lease from
    /// newcomers and from revocation, so the key ends with the lease's TTL.
    pub(crate) fn keep_leaked_key(&self) {
        let mut st = self.st();
        st.no_reuse = true;
        st.no_revoke = true;
    }

    /// Stops newcomers from joining (a phantom key may be left on the lease).
    pub(crate) fn close_to_newcomers(&self) {
        let mut st = self.st();
        st.no_reuse = true;
        let idle = st.users == 0;
        drop(st);
        if idle {
            self.wake.notify_one();
        }
    }

    /// Records an acknowledged keepalive sent at `sent`. Returns `false` if the lease was
    /// already lost (then every lock on it is marked lost).
    pub(crate) fn confirm(&self, sent: Instant) -> bool {
        let st = self.st();
        if !self.master.confirm(sent) {
            drop(st);
            self.mark_lost(LossReason::DeadlineExpired);
            return false;
        }
        for t in st.trackers.values() {
            t.confirm(sent);
        }
        true
    }

    pub(crate) fn mark_suspect(&self, reason: SuspectReason) {
        let st = self.st();
        self.master.mark_suspect(reason);
        for t in st.trackers.values() {
            t.mark_suspect(reason);
        }
    }

    /// The server said the lease is gone, or its deadline passed: every lock on it is lost.
    pub(crate) fn mark_lost(&self, reason: LossReason) {
        let st = self.st();
        self.master.mark_lost(reason);
        for t in st.trackers.values() {
            t.mark_lost(reason);
        }
    }
}

/// One user (an acquire in progress or a granted lock) of a [`SharedLease`]. Dropping it lets
/// the keepalive task retire an idle lease.
pub(crate) struct Reservation {
    pub(crate) shared: Arc<SharedLease>,
}

impl fmt::Debug for Reservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.shared.fmt(f)
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut st = self.shared.st();
        st.users = st.users.saturating_sub(1);
        if st.users == 0 {
            st.idle_since = Some(Instant::now());
            let wake = st.wake_when_idle || st.no_reuse;
            drop(st);
            if wake {
                self.shared.wake.notify_one();
            }
        }
    }
}

/// Keeps `shared` alive at about TTL/3 and confirms every lock tracker on it with the send time
/// of each acknowledged keepalive. Retires the lease (and revokes it, unless a lock on it was
/// leaked) when nobody has used it for the linger time, when the session is gone and nobody uses
/// it, or when it is lost.
pub(crate) async fn keepalive_task(shared: Arc<SharedLease>, mut ctx: TaskCtx) {
    let ttl = shared.ttl;
    let interval = ttl / 3;
    let retry = (ttl / 12).max(Duration::from_millis(5));
    let attempt_limit = keepalive_attempt_limit(ttl, ctx.request_timeout);
    // Default (no linger): a lease idle at a keepalive tick is retired instead of renewed, so
    // no keepalive is sent after its last lock was released; acquires until then reuse it.
    let linger = ctx.linger.unwrap_or(Duration::ZERO);
    let mut next = shared.master.confirmed_at() + interval;
    let mut session_closed = false;
    if ctx.linger == Some(Duration::ZERO) {
        shared.st().wake_when_idle = true;
    }
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(next) => {}
            _ = shared.wake.notified() => {}
            changed = ctx.closed.changed(), if !session_closed => {
                if changed.is_err() {
                    session_closed = true;
                    shared.st().wake_when_idle = true;
                }
            }
        }
        let now = Instant::now();
        let lost = shared.master.state() == LeaseState::Lost;
        let retire = {
            let mut st = shared.st();
            if st.retired {
                return;
            }
            let idle = st.users == 0
                && (session_closed
                    || st.no_reuse
                    || st
                        .idle_since
                        .is_some_and(|t| t.checked_add(linger).is_some_and(|end| now >= end)));
            if idle || lost {
                st.retired = true;
                let revoke = !st.no_revoke && !ctx.paused.load(Ordering::SeqCst);
                // A lost lease's companions run out by themselves, so the lock-delay of its
                // locks runs; an idle lease has no marker left on them.
                let companions = if revoke && !lost {
                    st.companions.values().copied().collect()
                } else {
                    Vec::new()
                };
                Some((revoke, companions))
            } else {
                None
            }
        };
        if let Some((revoke, companions)) = retire {
            if lost {
                // Each lock's tracker reports the loss, naming the lock.
                tracing::debug!(lease = %format_args!("{:x}", shared.id), "etcd lease lost: keepalive not acknowledged before the deadline");
                shared.mark_lost(LossReason::DeadlineExpired);
            }
            if let Some(table) = ctx.table.upgrade() {
                let mut t = table.lock().unwrap_or_else(|p| p.into_inner());
                if t.get(&ttl).is_some_and(|l| Arc::ptr_eq(l, &shared)) {
                    t.remove(&ttl);
                }
            }
            if revoke {
                let mut lc = ctx.client.lease_client();
                for id in std::iter::once(shared.id).chain(companions) {
                    if let Err(e) =
                        timed(ctx.request_timeout, "a lease revoke", lc.revoke(id)).await
                    {
                        tracing::debug!(error = %e, "revoking an idle etcd lease failed; its TTL will end it");
                    }
                }
            }
            shared.master.mark_lost(LossReason::Released);
            return;
        }
        if now < next {
            continue;
        }
        if ctx.paused.load(Ordering::SeqCst) {
            next = now + interval.min(retry * 4);
            continue;
        }
        // Hedged attempts: one keepalive sent to a frozen member must not hang until the
        // lease's deadline while other members would answer.
        let until = shared
            .master
            .valid_until()
            .min(now.checked_add(ctx.request_timeout).unwrap_or(now));
        // A stream the server ended without an answer is a failed renewal: Suspect at once,
        // while the hedged attempts go on until the deadline.
        let on_failure = |e: &Error| {
            if is_stream_closed(e) {
                shared.mark_suspect(SuspectReason::RenewalFailed);
            }
        };
        // Companion leases (of lock-delay markers) first: the lock's lease is renewed only
        // right after them, so a marker always outlives its lock's key by its delay.
        let (sent, answer, terms) =
            match renew_companions(&ctx.client, &shared, until, attempt_limit).await {
                Ok(terms) => {
                    let (sent, answer) =
                        keep_alive_hedged(&ctx.client, shared.id, until, attempt_limit, on_failure)
                            .await;
                    (sent, answer, terms)
                }
                Err(e) => (now, Err(e), Vec::new()),
            };
        let answer = match answer {
            Ok(KeepAlive::Alive { term }) => {
                let left = shared
                    .master
                    .valid_until()
                    .saturating_duration_since(Instant::now())
                    .min(ctx.request_timeout);
                match linearizable_term(&ctx.client, &ctx.probe_key, left, attempt_limit).await {
                    Ok(current)
                        if renewal_counts(term, current)
                            && terms.iter().all(|t| renewal_counts(*t, current)) =>
                    {
                        Ok(KeepAlive::Alive { term })
                    }
                    Ok(current) => Err(stale_term(term, current)),
                    Err(e) => Err(e),
                }
            }
            other => other,
        };
        match answer {
            Ok(KeepAlive::Alive { .. }) => {
                if !shared.confirm(sent) {
                    next = Instant::now();
                    continue;
                }
                next = sent + interval;
                let (keys, markers) = shared.burnt_keys();
                for key in keys {
                    delete_phantom(&ctx.client, &key, attempt_limit).await;
                }
                for marker in markers {
                    let txn = Txn::new().and_then([marker.delete_own()]);
                    let mut kv = ctx.client.kv_client();
                    let _ = tokio::time::timeout(attempt_limit, kv.txn(txn)).await;
                }
            }
            Ok(KeepAlive::Gone) => {
                tracing::debug!(lease = %format_args!("{:x}", shared.id), "etcd says the lease is gone");
                shared.mark_lost(LossReason::SessionExpired);
                next = Instant::now();
            }
            Err(e) => {
                tracing::warn!(lease = %format_args!("{:x}", shared.id), error = %e, "etcd keepalive not confirmed; retrying");
                shared.mark_suspect(SuspectReason::RenewalFailed);
                next = (Instant::now() + retry).min(shared.master.valid_until());
            }
        }
    }
}

/// Renews the companion leases of `shared` (lock-delay markers; usually none), hedged like the
/// lease itself until `until`. Returns the raft terms of the answers (each must pass the term
/// check, as the lease's own). A companion etcd says is gone is dropped.
///
/// # Errors
/// The first failed renewal's error: the caller does not renew the lock lease then.
pub(crate) async fn renew_companions(
    client: &Client,
    shared: &SharedLease,
    until: Instant,
    hedge_every: Duration,
) -> Result<Vec<u64>> {
    let mut terms = Vec::new();
    for id in shared.companions() {
        match keep_alive_hedged(client, id, until, hedge_every, |_| {})
            .await
            .1?
        {
            KeepAlive::Alive { term } => terms.push(term),
            KeepAlive::Gone => shared.drop_companion(id),
        }
    }
    Ok(terms)
}

/// Deletes `key` if it exists, with a compare on the create revision just read (one read, and
/// one transaction if the key exists). For keys of burnt slots, which nobody owns. Errors are
/// ignored: the next keepalive tick tries again.
async fn delete_phantom(client: &Client, key: &[u8], limit: Duration) {
    let mut kv = client.kv_client();
    let Ok(Ok(found)) = tokio::time::timeout(limit, kv.get(key.to_vec(), None)).await else {
        return;
    };
    let Some(rev) = found.kvs().first().map(|kv| kv.create_revision()) else {
        return;
    };
    tracing::debug!(key = %String::from_utf8_lossy(key), "deleting a key created by a late request");
    let txn = Txn::new()
        .when([Compare::create_revision(
            key.to_vec(),
            CompareOp::Equal,
            rev,
        )])
        .and_then([TxnOp::delete(key.to_vec(), None::<DeleteOptions>)]);
    let _ = tokio::time::timeout(limit, kv.txn(txn)).await;
}

/// Deletes `key` (only if its create revision is still `rev`, when given) and, in the same
/// transaction, the grant's own lock-delay `marker` (this is a release, not a failure), retrying with [`Backoff`]
/// (50 ms doubling up to 2 s, with jitter) until etcd confirms the delete or `shared` is lost on the client
/// side (then the etcd lease, no longer renewed, takes the key with it within its TTL). Never
/// gives up while the lease lives: a key left on a lease that other locks keep alive would block
/// its lock for as long as they do. Returns whether the delete was confirmed.
pub(crate) async fn delete_while_lease_lives(
    client: &Client,
    key: &[u8],
    rev: Option<i64>,
    marker: Option<&Marker>,
    limit: Duration,
    shared: &SharedLease,
) -> bool {
    let mut kv = client.kv_client();
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    let lost = shared.master.view().lost();
    tokio::pin!(lost);
    loop {
        if shared.master.state() == LeaseState::Lost {
            return false;
        }
        let del = delete_key_ops(key, marker);
        let txn = match rev {
            Some(rev) => Txn::new()
                .when([Compare::create_revision(
                    key.to_vec(),
                    CompareOp::Equal,
                    rev,
                )])
                .and_then(del),
            None => Txn::new().and_then(del),
        };
        match timed(limit, "a key delete", kv.txn(txn)).await {
            Ok(_) => return true,
            Err(e) => {
                tracing::debug!(error = %e, key = %String::from_utf8_lossy(key), "deleting a lock key failed; retrying while its lease lives");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff.next_delay()) => {}
            _ = &mut lost => return false,
        }
    }
}

/// One watch stream per client for the deletes of every granted lock's own key, so that
/// thousands of held locks cost the server one stream (one watcher per key on it, filtered to
/// deletes: an event only when a lock's key is deleted), not a stream each.
///
/// Each lock registers its key with its create revision ([`KeyWatch::watch`]); its watcher
/// starts at the revision after the creation, so a delete that happened before it was set up is
/// still reported. Watch IDs are ours (`WatchCreateRequest.watch_id`, etcd ≥ 3.4), so the
/// answers need no matching. The task keeps a stream open only while some key is watched; after
/// a broken stream it opens a new one (with [`Backoff`]) and sets up every watcher again from
/// the same revisions; a watcher whose revision was compacted is replaced after one read tells
/// whether the key is still ours.
#[derive(Clone)]
pub(crate) struct KeyWatch {
    tx: mpsc::UnboundedSender<WatchCmd>,
    next_id: Arc<AtomicI64>,
}

impl fmt::Debug for KeyWatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyWatch").finish_non_exhaustive()
    }
}

enum WatchCmd {
    Add {
        id: i64,
        key: Vec<u8>,
        rev: i64,
        on_delete: OnDelete,
    },
    Remove {
        id: i64,
    },
}

/// What a watcher runs, once, on the [`KeyWatch`]'s task when etcd deleted its key (or, after a
/// compaction, the key is no longer the one with our create revision). It must not block.
pub(crate) type OnDelete = Box<dyn FnOnce() + Send>;

/// One lock's watcher on the [`KeyWatch`] (its [`OnDelete`] runs on the key's delete). Dropping
/// it cancels the watcher. No task waits on it: a held lock costs the client its entry in the
/// task's map, not a task of its own (which took 1,408 B per held lease, heaptrack of the
/// many-leases benchmark).
pub(crate) struct KeyWatched {
    id: i64,
    tx: mpsc::UnboundedSender<WatchCmd>,
}

impl Drop for KeyWatched {
    fn drop(&mut self) {
        let _ = self.tx.send(WatchCmd::Remove { id: self.id });
    }
}

impl KeyWatch {
    /// Starts the task (on the current runtime). It ends once this handle and every
    /// [`KeyWatched`] are dropped.
    pub(crate) fn spawn(client: Arc<Client>, limit: Duration) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(key_watch_task(client, rx, limit));
        Self {
            tx,
            next_id: Arc::new(AtomicI64::new(1)),
        }
    }

    /// Watches `key` (created at revision `rev`) for its delete, on which `on_delete` runs.
    pub(crate) fn watch(&self, key: Vec<u8>, rev: i64, on_delete: OnDelete) -> KeyWatched {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let _ = self.tx.send(WatchCmd::Add {
            id,
            key,
            rev,
            on_delete,
        });
        KeyWatched {
            id,
            tx: self.tx.clone(),
        }
    }
}

struct Watched {
    key: Vec<u8>,
    /// The key's create revision.
    rev: i64,
    /// The revision the watcher starts at.
    from: i64,
    on_delete: OnDelete,
}

fn watcher_opts(id: i64, from: i64) -> WatchOptions {
    WatchOptions::new()
        .with_start_revision(from)
        .with_filters([WatchFilterType::NoPut])
        .with_watch_id(id)
}

/// A request waiting to be sent on the key watch stream. Requests are queued and sent one at a
/// time between reads of the answers: sending thousands of creates without reading would fill
/// the server's answer buffer, and the server stops reading requests then.
#[derive(Clone, Copy, PartialEq, Eq)]
enum WatchReq {
    Create(i64),
    Cancel(i64),
}

async fn next_watch_message(
    rx: &mut Option<WatchResponseStream>,
) -> std::result::Result<Option<WatchResponse>, etcd_client::Error> {
    match rx {
        Some(rx) => rx.message().await,
        None => std::future::pending().await,
    }
}

async fn send_watch_req(
    tx: &mut Option<WatchRequestSender>,
    req: Option<(WatchReq, Option<WatchOptions>, Vec<u8>)>,
) -> std::result::Result<(), etcd_client::Error> {
    match (tx, req) {
        (Some(tx), Some((WatchReq::Create(_), opts, key))) => tx.watch(key, opts).await,
        (Some(tx), Some((WatchReq::Cancel(id), _, _))) => tx.cancel(id).await,
        _ => std::future::pending().await,
    }
}

async fn key_watch_task(
    client: Arc<Client>,
    mut cmds: mpsc::UnboundedReceiver<WatchCmd>,
    limit: Duration,
) {
    let mut entries: HashMap<i64, Watched> = HashMap::new();
    let mut tx: Option<WatchRequestSender> = None;
    let mut rx: Option<WatchResponseStream> = None;
    let mut pending: std::collections::VecDeque<WatchReq> = Default::default();
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
    let mut retry_at = Instant::now();
    loop {
        if rx.is_none() && !entries.is_empty() && Instant::now() >= retry_at {
            // A new stream, opened with one watcher; the others are queued.
            let first = entries
                .iter()
                .next()
                .map(|(id, w)| (*id, w.key.clone(), w.from));
            if let Some((id, key, from)) = first {
                // A frozen member never answers (see open_watch).
                let opened = tokio::time::timeout(
                    per_attempt(limit),
                    client
                        .watch_client()
                        .watch(key, Some(watcher_opts(id, from))),
                )
                .await;
                match opened {
                    Ok(Ok(stream)) => {
                        let (t, r) = stream.split();
                        (tx, rx) = (Some(t), Some(r));
                        pending = entries
                            .keys()
                            .filter(|k| **k != id)
                            .map(|k| WatchReq::Create(*k))
                            .collect();
                    }
                    _ => retry_at = Instant::now() + backoff.next_delay(),
                }
            }
        }
        // The next request to send (a create whose key is no longer watched is dropped).
        let req = loop {
            match pending.front().copied() {
                Some(WatchReq::Create(id)) => match entries.get(&id) {
                    Some(w) => {
                        break Some((
                            WatchReq::Create(id),
                            Some(watcher_opts(id, w.from)),
                            w.key.clone(),
                        ));
                    }
                    None => {
                        pending.pop_front();
                    }
                },
                Some(cancel) => break Some((cancel, None, Vec::new())),
                None => break None,
            }
        };
        let reconnecting = rx.is_none() && !entries.is_empty();
        let mut broken = false;
        tokio::select! {
            cmd = cmds.recv() => match cmd {
                None => return,
                Some(WatchCmd::Add { id, key, rev, on_delete }) => {
                    let from = rev + 1;
                    entries.insert(id, Watched { key, rev, from, on_delete });
                    if rx.is_some() {
                        pending.push_back(WatchReq::Create(id));
                    }
                }
                Some(WatchCmd::Remove { id }) => {
                    if entries.remove(&id).is_some() && rx.is_some() {
                        let queued = pending.len();
                        pending.retain(|r| *r != WatchReq::Create(id));
                        if pending.len() == queued {
                            pending.push_back(WatchReq::Cancel(id));
                        }
                    }
                    if entries.is_empty() {
                        // Nothing to watch: close the stream.
                        (tx, rx) = (None, None);
                        pending.clear();
                    }
                }
            },
            sent = send_watch_req(&mut tx, req) => {
                pending.pop_front();
                broken = sent.is_err();
            },
            msg = next_watch_message(&mut rx) => match msg {
                Ok(Some(resp)) => {
                    backoff.reset();
                    broken = !on_watch_response(&client, &mut entries, &mut pending, resp, limit).await;
                }
                Ok(None) | Err(_) => {
                    tracing::debug!("etcd watch stream of held locks ended; opening another");
                    broken = true;
                }
            },
            _ = tokio::time::sleep_until(retry_at), if reconnecting => {}
        }
        if broken {
            (tx, rx) = (None, None);
            pending.clear();
            retry_at = Instant::now() + backoff.next_delay();
        }
    }
}

/// Handles one answer on the key watch stream (queueing the requests it calls for). Returns
/// `false` if the stream should be opened again.
async fn on_watch_response(
    client: &Client,
    entries: &mut HashMap<i64, Watched>,
    pending: &mut std::collections::VecDeque<WatchReq>,
    resp: WatchResponse,
    limit: Duration,
) -> bool {
    let id = resp.watch_id();
    if resp
        .events()
        .iter()
        .any(|e| e.event_type() == EventType::Delete)
    {
        if let Some(w) = entries.remove(&id) {
            (w.on_delete)();
        }
        pending.push_back(WatchReq::Cancel(id));
        return true;
    }
    if !resp.canceled() {
        return true;
    }
    let Some(w) = entries.get_mut(&id) else {
        return true;
    };
    if resp.compact_revision() <= 0 {
        // Cancelled by the server for another reason (no leader, …): start over.
        return false;
    }
    // Compacted past our start: is the key still ours?
    let read = tokio::time::timeout(limit, client.kv_client().get(w.key.clone(), None)).await;
    let Ok(Ok(found)) = read else {
        return false;
    };
    let ours = found
        .kvs()
        .first()
        .is_some_and(|kv| kv.create_revision() == w.rev);
    if !ours {
        if let Some(w) = entries.remove(&id) {
            (w.on_delete)();
        }
        return true;
    }
    w.from = found.header().map_or(w.from, |h| h.revision() + 1);
    pending.push_back(WatchReq::Create(id));
    true
}
