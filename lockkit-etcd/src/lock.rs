//! [`EtcdLock`]: the lock protocol of etcd's `concurrency` package on etcd-client.
//!
//! Protocol (the v3 lock recipe, <https://etcd.io/docs/v3.4/dev-guide/api_concurrency_reference_v3/>
//! and `clientv3/concurrency/mutex.go`):
//! 1. Each acquire creates its own key `{prefix}/{name}/{lease id hex}-{slot}`, attached to
//!    a lease, in one transaction that also reads the key with the lowest create revision under
//!    `{prefix}/{name}/`. The holder is the key with the lowest create revision.
//! 2. A waiter reads, in one linearizable transaction that also checks its own key still exists
//!    with its create revision (so its lease is alive: etcd deletes a lease's keys when the
//!    lease ends), the two keys just ahead of it (`max_create_revision`, sorted by create
//!    revision, limit 2), and watches them for their `DELETE`. A waiter also re-reads every
//!    TTL/2 (0.5 s to 5 s), in case its watch is stuck on a frozen member.
//! 3. A wake re-reads, except for the hand-off itself: the delete of the only key ahead, whose
//!    grant puts no lock-delay marker ([`NO_MARKER`]), with no marker there, watched together
//!    with our own key by one range watcher ([`EtcdLock::check_and_watch`] says why that is the
//!    lock). A waiter whose key is gone (its lease ended) never gets the lock on it: it deletes
//!    what is left and queues again with a fresh lease, a few times at most, then fails with
//!    [`Error::Unavailable`].
//! 4. The fencing token is the holder key's create revision.
//! 5. Lock-delay: a grant with a delay puts a marker `{prefix}/./delay/{name}` on a companion
//!    lease that outlives its key by the delay; every acquire treats a marker not its own as
//!    "held" (a first-in-line waiter watches it for its delete). See the
//!    [crate docs](crate#lock-delay).

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, SortOrder,
    SortTarget, Txn, TxnOp, TxnOpResponse, WatchFilterType, WatchOptions,
};
use lockkit_core::backend::{
    Backoff, LockBackend, TrackerHandle, retry_transient, validate_name, wait_deadline,
};
use lockkit_core::{
    AcquireOptions, Error, FencingToken, Guarantees, HolderInfo, Instant, Lease, LeaseState,
    LockKind, LossReason, Result, Wait, async_trait,
};
use tokio::sync::watch;

use crate::config::EtcdConfig;
use crate::core::{
    KeyWatch, Marker, Reservation, SharedLease, TaskCtx, delete_key_ops, delete_while_lease_lives,
    holder_read, keepalive_task, marker_key, open_watch, timed, ttl_secs, with_retries,
};
use crate::error::{self, BACKEND, from_client, is_lease_not_found};
use crate::lease::{Binding, EtcdLease};

/// The least time a timed acquire gets (capped by the request timeout), even with a shorter
/// wait: enough for the round trips of a free lock.
const MIN_ATTEMPT: Duration = Duration::from_millis(100);

/// How long past its deadline a timed acquire may take to clean up (delete its key) before it
/// returns anyway, leaving the cleanup to a background task.
const CLEANUP_GRACE: Duration = Duration::from_millis(250);

/// A waiter re-reads the key ahead of it every TTL/2 within these bounds, in case its watch is
/// stuck on a frozen member.
const RECHECK_MIN: Duration = Duration::from_millis(500);
const RECHECK_MAX: Duration = Duration::from_secs(5);

/// [`Guarantees::loss_notice`]: how soon a holder hears that etcd deleted its key.
const LOSS_NOTICE: Duration = Duration::from_millis(500);

/// The value of a contender's key whose grant puts no lock-delay marker (a grant with a delay
/// leaves the value empty, as older clients do for every key): the waiter behind it may take
/// its delete as the hand-off without reading again ([`EtcdLock::check_and_watch`]).
const NO_MARKER: &[u8] = b"no-delay";

/// Leases one acquire may go through (each lost before the lock was granted) before it fails
/// with [`Error::Unavailable`].
const LEASE_ATTEMPTS: usize = 5;

type LeaseTable = Arc<Mutex<HashMap<Duration, Arc<SharedLease>>>>;

/// Where an acquire puts its key: under a lock's prefix, or (for elections and semaphores,
/// [`slots`](crate::slots)) under a slot's, through the same grant path.
pub(crate) struct Space {
    /// The user's name (errors, spans).
    pub(crate) name: String,
    /// What the lease's key slots are counted under ([`SharedLease::take_slot`]): the lock
    /// name, or `elect/{name}`, `sem/{name}/…` (no lock name contains `/`).
    pub(crate) slot_name: String,
    /// The key prefix of every contender.
    pub(crate) prefix: Vec<u8>,
    /// The lock-delay marker key ([`marker_key`]).
    pub(crate) marker_key: Vec<u8>,
    /// The token identity ([`FencingToken::lock`]).
    pub(crate) token_id: String,
    /// The value of the contender's key: `None` for locks (then [`NO_MARKER`] or empty, by
    /// whether the grant may put a lock-delay marker), the user's value for slots.
    pub(crate) value: Option<Vec<u8>>,
    /// More conditions of the transaction that takes a free name (a semaphore's N, its gate
    /// empty): if one fails the name counts as held.
    pub(crate) extra: Vec<Compare>,
}

struct Session {
    /// Shared, not cloned per lock: a `Client` clone copies every gRPC service client.
    client: Arc<Client>,
    config: EtcdConfig,
    /// Session leases by asked TTL.
    leases: LeaseTable,
    /// Serializes grants of session leases, so concurrent acquires share one.
    grant_lock: tokio::sync::Mutex<()>,
    paused: Arc<AtomicBool>,
    /// Dropped with the session: tells keepalive tasks to retire idle leases.
    _closed: watch::Sender<()>,
    closed_rx: watch::Receiver<()>,
    /// The TTL etcd granted for a 1 s request at connect: `max(1 s, server minimum TTL)`.
    min_granted: Duration,
    /// The one watch stream for the keys of every lock this client holds.
    key_watch: KeyWatch,
    /// Counters of the waiting machinery, for tests.
    stats: watch::Sender<WaitStats>,
}

/// Counters of the waiting machinery, for tests (feature `test-hooks`). Not part of the API.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WaitStats {
    /// Acquires now watching the queue for their turn.
    pub waiting: usize,
    /// Deletes of the key just ahead that woke a waiter which then had to read the queue again
    /// (a hand-off that took the watch event alone does not count), since connect.
    pub reads_after_wake: u64,
}

/// Counts a waiter in [`WaitStats::waiting`] while it lives.
struct Waiting<'a>(&'a watch::Sender<WaitStats>);

impl<'a> Waiting<'a> {
    fn new(stats: &'a watch::Sender<WaitStats>) -> Self {
        stats.send_modify(|s| s.waiting += 1);
        Self(stats)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.send_modify(|s| s.waiting -= 1);
    }
}

/// Locks on etcd v3: leases with whole-second TTLs, tokens from create revisions, FIFO waiters
/// that watch only their predecessor. A correctness lock (etcd is a Raft consensus store).
///
/// Cheap to clone: clones share one etcd client and one set of session leases. See the
/// [crate docs](crate) for the protocol, the guarantees and their fine print.
#[derive(Clone)]
pub struct EtcdLock {
    inner: Arc<Session>,
}

impl fmt::Debug for EtcdLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdLock")
            .field("config", &self.inner.config)
            .field("min_granted_ttl", &self.inner.min_granted)
            .finish_non_exhaustive()
    }
}

/// [`Error::Auth`] if `e` is a refused TLS certificate ([`tls_failure`](lockkit_core::backend::tls_failure)).
fn tls_refusal(e: &etcd_client::Error) -> Option<Error> {
    // etcd_client::Error has no `source()`: start from the tonic error it wraps.
    let inner: &(dyn std::error::Error + 'static) = match e {
        etcd_client::Error::GRpcStatus(s) => s,
        etcd_client::Error::TransportError(t) => t,
        other => other,
    };
    lockkit_core::backend::tls_failure(inner)
        .map(|f| f.into_error(error::BACKEND, e.to_string().into()))
}

fn lock_table(t: &LeaseTable) -> std::sync::MutexGuard<'_, HashMap<Duration, Arc<SharedLease>>> {
    t.lock().unwrap_or_else(|p| p.into_inner())
}

impl EtcdLock {
    /// Connects with an `etcd://host:port[,host:port…]` URL (see [`EtcdConfig`] for the form and
    /// its parameters, such as `prefix`).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a malformed URL; otherwise as [`connect_with`](Self::connect_with).
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future leaves nothing behind but, at most, the probe lease
    /// (1 s TTL, no keys), which etcd expires by itself.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_with(EtcdConfig::from_url(url)?).await
    }

    /// Connects with `config`. Authenticates if a user is configured, then grants (and revokes
    /// in the background) a 1 s probe lease, which proves the cluster answers writes and tells
    /// the server's minimum lease TTL (see [`Guarantees::expiry_slack`]), and reads (count only)
    /// under the key prefix, which proves the client may. Each probe is retried on transient
    /// errors within the connect timeout.
    ///
    /// # Errors
    /// - [`Error::InvalidConfig`] for bad settings.
    /// - [`Error::Unavailable`] if no endpoint answers within the connect timeout (3 s by
    ///   default) or the cluster has no leader.
    /// - [`Error::Auth`] if etcd refuses the user name or password, or has authentication
    ///   enabled and none was given (or the user may not read under the prefix).
    /// - [`Error::InvalidConfig`] also if credentials are given and etcd has authentication
    ///   disabled (the message says so; it never holds the password), or a TLS file (`tls_ca`, `tls_cert`, `tls_key`) is missing or unreadable.
    /// - [`Error::Auth`] also if TLS refused the server's certificate (unknown CA, expired, not
    ///   for the host or `tls_server_name`). A server that refuses *our* certificate (or its
    ///   absence) just closes the connection: [`Error::Unavailable`] after the connect timeout.
    ///
    /// # Cancel safety
    /// As [`connect`](Self::connect).
    pub async fn connect_with(config: EtcdConfig) -> Result<Self> {
        let endpoints = config.validate()?;
        Self::open(config, &endpoints)
            .await
            .map_err(|e| error::at_connect(&endpoints, e))
    }

    /// [`connect_with`](Self::connect_with) once the configuration is checked.
    async fn open(config: EtcdConfig, endpoints: &[String]) -> Result<Self> {
        let limit = config.connect_timeout_value();
        let mut opts = ConnectOptions::new()
            .with_connect_timeout(limit)
            .with_timeout(config.request_timeout_value())
            .with_require_leader(true)
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5));
        if let Some(tls) = config.tls_options().await? {
            opts = opts.with_tls(tls);
        }
        if let Some((user, password)) = config.credentials() {
            opts = opts
                .with_user(user.clone(), password.clone())
                .with_auto_token_refresh(true);
        }
        let started = Instant::now();
        let client = match tokio::time::timeout(limit, Client::connect(endpoints, Some(opts))).await
        {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(tls_refusal(&e).unwrap_or_else(|| from_client(e))),
            Err(_) => return Err(error::timeout("the connect")),
        };
        if config.get_tls().is_some() {
            // One unretried request first: a refused certificate is final, not worth the
            // probe's retries until the connect timeout.
            let mut m = client.maintenance_client();
            if let Ok(Err(e)) = tokio::time::timeout(limit, m.status()).await
                && let Some(refused) = tls_refusal(&e)
            {
                return Err(refused);
            }
        }
        let left = limit
            .saturating_sub(started.elapsed())
            .max(Duration::from_millis(1));
        let mut lc = client.lease_client();
        // Retried within the connect timeout: with one endpoint down, the next attempt likely
        // goes to another.
        let probe = with_retries(left, "the connect probe", || {
            let mut lc = lc.clone();
            async move { lc.grant(1, None).await }
        })
        .await?;
        if probe.ttl() <= 0 {
            return Err(error::protocol(format!(
                "etcd refused the probe lease: {}",
                probe.error()
            )));
        }
        let probe_id = probe.id();
        // A lease grant needs no permission; a read under our prefix does. So a server with
        // authentication enabled refuses a client without (valid) credentials here, with
        // `Error::Auth`, rather than at its first acquire.
        let left = limit
            .saturating_sub(started.elapsed())
            .max(Duration::from_millis(1));
        let kv = client.kv_client();
        let probe_key = format!("{}/", config.get_prefix()).into_bytes();
        with_retries(left, "the connect probe", || {
            let (mut kv, key) = (kv.clone(), probe_key.clone());
            let opts = GetOptions::new()
                .with_prefix()
                .with_count_only()
                .with_limit(1);
            async move { kv.get(key, Some(opts)).await }
        })
        .await?;
        let revoke_limit = config.request_timeout_value();
        tokio::spawn(async move {
            let _ = timed(revoke_limit, "a lease revoke", lc.revoke(probe_id)).await;
        });
        let (tx, rx) = watch::channel(());
        let client = Arc::new(client);
        let key_watch = KeyWatch::spawn(client.clone(), config.request_timeout_value());
        Ok(Self {
            inner: Arc::new(Session {
                client,
                config,
                leases: Arc::new(Mutex::new(HashMap::new())),
                grant_lock: tokio::sync::Mutex::new(()),
                paused: Arc::new(AtomicBool::new(false)),
                _closed: tx,
                closed_rx: rx,
                min_granted: Duration::from_secs(probe.ttl().unsigned_abs()),
                key_watch,
                stats: watch::channel(WaitStats::default()).0,
            }),
        })
    }

    /// The etcd client, for reading data the locks protect (writes should go through
    /// [`EtcdFence`](crate::EtcdFence)).
    pub fn client(&self) -> &Client {
        &self.inner.client
    }

    /// The configuration this client was built with.
    pub fn config(&self) -> &EtcdConfig {
        &self.inner.config
    }

    /// The identity of lock `name` in its tokens ([`FencingToken::lock`]): `etcd/{prefix}/{name}`.
    pub fn lock_id(&self, name: &str) -> String {
        format!("etcd/{}/{}", self.inner.config.get_prefix(), name)
    }

    /// `{prefix}/{name}/`, the key prefix of every contender for lock `name`.
    ///
    /// Names contain no `/` ([`validate_name`]), and the prefix ends with `/`, so no name's
    /// prefix is a prefix of another name's keys (`a/` does not cover `ab/…`). No further
    /// escaping is needed: etcd keys are arbitrary bytes.
    pub fn name_prefix(&self, name: &str) -> Vec<u8> {
        format!("{}/{}/", self.inner.config.get_prefix(), name).into_bytes()
    }

    /// The key space of lock `name`.
    fn lock_space(&self, name: &str) -> Space {
        let prefix = self.name_prefix(name);
        Space {
            name: name.to_owned(),
            slot_name: name.to_owned(),
            marker_key: marker_key(&prefix, name),
            prefix,
            token_id: self.lock_id(name),
            value: None,
            extra: Vec::new(),
        }
    }

    /// Test hook (feature `test-hooks`): stops (or resumes) every keepalive this client sends for
    /// its session leases, as if the network dropped them. Held leases then turn suspect and lost
    /// on their deadline.
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub fn pause_keepalive_for_tests(&self, paused: bool) {
        self.inner.paused.store(paused, Ordering::SeqCst);
    }

    /// Waiting counters, for tests (feature `test-hooks`).
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub fn wait_stats(&self) -> watch::Receiver<WaitStats> {
        self.inner.stats.subscribe()
    }

    fn task_ctx(&self) -> TaskCtx {
        TaskCtx {
            client: self.inner.client.clone(),
            request_timeout: self.inner.config.request_timeout_value(),
            probe_key: format!("{}/", self.inner.config.get_prefix()).into_bytes(),
            linger: self.inner.config.lease_linger_value(),
            paused: self.inner.paused.clone(),
            closed: self.inner.closed_rx.clone(),
            table: Arc::downgrade(&self.inner.leases),
        }
    }

    fn try_reserve(&self, ttl: Duration) -> Option<Reservation> {
        let mut table = lock_table(&self.inner.leases);
        let shared = table.get(&ttl)?.clone();
        match shared.try_reserve() {
            Some(r) => Some(r),
            None => {
                table.remove(&ttl);
                None
            }
        }
    }

    async fn grant(&self, ttl: Duration) -> Result<Arc<SharedLease>> {
        let mut lc = self.inner.client.lease_client();
        let sent = Instant::now();
        let resp = timed(
            self.inner.config.request_timeout_value(),
            "a lease grant",
            lc.grant(ttl_secs(ttl), None),
        )
        .await?;
        if resp.ttl() <= 0 {
            return Err(error::protocol(format!(
                "etcd refused a lease: {}",
                resp.error()
            )));
        }
        Ok(SharedLease::new(resp.id(), ttl, resp.ttl(), sent))
    }

    /// A reservation on the session lease for `ttl`, granting it if needed.
    async fn session_lease(&self, ttl: Duration) -> Result<Reservation> {
        if let Some(r) = self.try_reserve(ttl) {
            return Ok(r);
        }
        let _grant = self.inner.grant_lock.lock().await;
        if let Some(r) = self.try_reserve(ttl) {
            return Ok(r);
        }
        let shared = self.grant(ttl).await?;
        let reservation = shared.reserve_shared();
        lock_table(&self.inner.leases).insert(ttl, shared.clone());
        tokio::spawn(keepalive_task(shared, self.task_ctx()));
        Ok(reservation)
    }

    /// A private lease for a `keepalive(false)` acquire: kept alive only while the acquire
    /// waits, renewed by hand afterwards.
    async fn private_lease(&self, ttl: Duration) -> Result<Reservation> {
        Ok(self.grant(ttl).await?.reserve_private())
    }

    fn request_timeout(&self) -> Duration {
        self.inner.config.request_timeout_value()
    }

    /// Creates (or, on a retry, finds) our key and reads the current holder, in one
    /// transaction. With `only_if_free` the key is created only if no key exists under the
    /// name, so a try-acquire of a held lock leaves nothing behind; a waiting acquire sends that
    /// transaction first too (the uncontended case is then one small transaction) and queues
    /// with a second one only if the name is taken.
    ///
    /// Every acquire also reads the lock's lock-delay marker ([`marker_key`]): a marker that is
    /// not this acquire's own (`marker`) means the last holder failed less than its delay ago,
    /// so the lock is granted to no one (`blocked` in [`Enqueued::Queued`]). With `only_if_free`
    /// the name counts as free only without a marker, and a grant with a delay puts its own
    /// marker in the same transaction as its key.
    async fn enqueue(
        &self,
        space: &Space,
        key: &[u8],
        lease_id: i64,
        (marker_key, marker): (&[u8], Option<&Marker>),
        only_if_free: bool,
        uncertain: &AtomicBool,
    ) -> std::result::Result<Enqueued, Error> {
        let name_prefix = space.prefix.as_slice();
        let owner = holder_read(name_prefix);
        let marker_read = TxnOp::get(marker_key.to_vec(), None);
        // A lock's value tells the waiter behind us whether our grant may put a lock-delay
        // marker; a slot's is the user's (slots put no markers: a waiter behind one reads again
        // after its wake unless the value happens to be `NO_MARKER`, which is then also true).
        let value = match (&space.value, marker) {
            (Some(v), _) => v.clone(),
            (None, Some(_)) => Vec::new(),
            (None, None) => NO_MARKER.to_vec(),
        };
        let put = TxnOp::put(
            key.to_vec(),
            value,
            Some(PutOptions::new().with_lease(lease_id)),
        );
        let (cond, then) = if only_if_free {
            let free =
                Compare::create_revision(name_prefix.to_vec(), CompareOp::Equal, 0).with_prefix();
            let no_marker = Compare::create_revision(marker_key.to_vec(), CompareOp::Equal, 0);
            let mut then = vec![put];
            then.extend(marker.map(Marker::put));
            let mut cond = vec![free, no_marker];
            cond.extend(space.extra.iter().cloned());
            (cond, then)
        } else {
            let absent = Compare::create_revision(key.to_vec(), CompareOp::Equal, 0);
            (vec![absent], vec![put, owner.clone(), marker_read.clone()])
        };
        // Our key exists (a retry after a lost reply): read it, the holder and the marker.
        let txn = Txn::new().when(cond).and_then(then).or_else([
            TxnOp::get(key.to_vec(), None),
            owner,
            marker_read,
        ]);
        let mut kv = self.inner.client.kv_client();
        let resp = match tokio::time::timeout(self.request_timeout(), kv.txn(txn)).await {
            Err(_) => {
                uncertain.store(true, Ordering::SeqCst);
                return Err(error::timeout("a lock request"));
            }
            Ok(Err(e)) if is_lease_not_found(&e) => return Ok(Enqueued::LeaseGone),
            Ok(Err(e)) => {
                // Sent or not, we cannot tell: it may still be applied.
                uncertain.store(true, Ordering::SeqCst);
                return Err(from_client(e));
            }
            Ok(Ok(r)) => r,
        };
        // The revision of the transaction: our key's create revision if it put it.
        let revision = resp.header().map(|h| h.revision()).unwrap_or(0);
        let ops = resp.op_responses();
        let rev_of = |i: usize| match ops.get(i) {
            Some(TxnOpResponse::Get(g)) => g.kvs().first().map(|kv| kv.create_revision()),
            _ => None,
        };
        // The marker read, last of the ops when present: (blocked, own marker in place).
        let marker_at = |i: usize| match ops.get(i) {
            Some(TxnOpResponse::Get(g)) => match g.kvs().first() {
                Some(kv) if marker.is_some_and(|m| m.is_own(kv.value())) => (false, true),
                Some(_) => (true, false),
                None => (false, false),
            },
            _ => (false, false),
        };
        if resp.succeeded() {
            // Our key was put; the holder is the first key by create revision (ours if the
            // transaction only put when the name was free, which reads no holder, and put our
            // marker if we have a delay).
            let (blocked, marker_placed) = if only_if_free {
                (false, marker.is_some())
            } else {
                marker_at(2)
            };
            return Ok(Enqueued::Queued {
                my_rev: revision,
                owner_rev: rev_of(1).unwrap_or(revision),
                blocked,
                marker_placed,
            });
        }
        let (blocked, marker_placed) = marker_at(2);
        match (rev_of(0), rev_of(1)) {
            (Some(my_rev), owner_rev) => Ok(Enqueued::Queued {
                my_rev,
                owner_rev: owner_rev.unwrap_or(my_rev),
                blocked,
                marker_placed,
            }),
            (None, _) if only_if_free => Ok(Enqueued::Held),
            (None, _) => Err(error::protocol(
                "lock transaction found neither a free key nor our key",
            )),
        }
    }

    /// Waits until our key (create revision `my_rev`) has no key ahead of it. Every round is one
    /// linearizable read (our key still ours + the key just ahead) and, if a key is ahead, one
    /// watch of that key for its deletion.
    async fn wait_turn(
        &self,
        name: &str,
        (name_prefix, key, my_rev): (&[u8], &[u8], i64),
        (marker_key, marker): (&[u8], Option<&Marker>),
        opts: &AcquireOptions,
    ) -> Result<()> {
        let mut failures = 0usize;
        let policy = opts.retry.unwrap_or_default();
        let mut backoff = Backoff::new(policy.min_delay, policy.max_delay);
        loop {
            let recheck = (opts.ttl / 2).clamp(RECHECK_MIN, RECHECK_MAX);
            match self
                .check_and_watch(
                    name,
                    (name_prefix, key, my_rev),
                    (marker_key, marker),
                    recheck,
                )
                .await
            {
                Ok(Turn::Mine) => return Ok(()),
                Ok(Turn::Again) => {
                    // A round that reached etcd: the next outage starts from the first step.
                    failures = 0;
                    backoff.reset();
                }
                Err(e) if e.is_retryable() => {
                    failures += 1;
                    // A Wait::Forever acquire waits out any outage (as `retry_transient`).
                    let forever = opts.wait == Wait::Forever;
                    if opts
                        .retry
                        .is_none_or(|p| !forever && failures > p.max_retries)
                    {
                        return Err(e);
                    }
                    let delay = backoff.next_delay();
                    tracing::debug!(error = %e, ?delay, "etcd unavailable while waiting; retrying");
                    tokio::time::sleep(delay).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// One linearizable read of the queue from our key (create revision `my_rev`): whether our
    /// key still exists with it, the two keys just ahead, and the lock-delay marker.
    ///
    /// # Errors
    /// [`Error::LeaseLost`] if our key is gone (our lease lapsed, or someone deleted the key):
    /// never a lease on it. [`Error::Unavailable`] if etcd did not answer (retried within the
    /// request timeout: it only reads).
    async fn read_queue(
        &self,
        name: &str,
        (name_prefix, key, my_rev): (&[u8], &[u8], i64),
        (marker_key, marker): (&[u8], Option<&Marker>),
    ) -> Result<Queue> {
        let ahead = TxnOp::get(
            name_prefix.to_vec(),
            Some(
                GetOptions::new()
                    .with_prefix()
                    .with_max_create_revision(my_rev - 1)
                    .with_sort(SortTarget::Create, SortOrder::Descend)
                    .with_limit(2),
            ),
        );
        let txn = Txn::new()
            .when([Compare::create_revision(
                key.to_vec(),
                CompareOp::Equal,
                my_rev,
            )])
            .and_then([ahead, TxnOp::get(marker_key.to_vec(), None)]);
        let kv = self.inner.client.kv_client();
        let resp = with_retries(self.request_timeout(), "a lock check", || {
            let (mut kv, txn) = (kv.clone(), txn.clone());
            async move { kv.txn(txn).await }
        })
        .await?;
        if !resp.succeeded() {
            return Err(Error::LeaseLost {
                name: name.to_owned(),
                reason: LossReason::NotHeldOnServer,
            });
        }
        let revision = resp.header().map(|h| h.revision()).unwrap_or(0);
        let ops = resp.op_responses();
        let ahead = match ops.first() {
            Some(TxnOpResponse::Get(g)) => g.kvs().to_vec(),
            _ => Vec::new(),
        };
        // A marker that is not ours: the last holder failed less than its lock-delay ago.
        let foreign_marker = match ops.get(1) {
            Some(TxnOpResponse::Get(g)) => g
                .kvs()
                .first()
                .is_some_and(|kv| !marker.is_some_and(|m| m.is_own(kv.value()))),
            _ => false,
        };
        let last = ahead.len() == 1
            && !foreign_marker
            && ahead.first().is_some_and(|kv| kv.value() == NO_MARKER);
        let mut keys = ahead.into_iter().map(|kv| kv.key().to_vec());
        Ok(Queue {
            revision,
            nearest: keys.next(),
            second: keys.next(),
            foreign_marker,
            last,
        })
    }

    /// One round of [`wait_turn`](Self::wait_turn): reads the queue ([`read_queue`](Self::read_queue)),
    /// then watches the key just ahead of ours (or else a lock-delay marker that is not ours)
    /// for its delete, and the key ahead of that one too, so that a waiter reads again as soon as
    /// it is next in line.
    ///
    /// The hand-off itself needs no read: when the key ahead is the only one ahead and its grant
    /// puts no marker ([`NO_MARKER`]), no marker exists, and the watcher covers the key range
    /// from that key to ours, its delete makes us the holder at that revision. Create revisions
    /// only grow, so no key can get ahead of ours later; no marker can appear (only the first in
    /// line puts one); and one watcher reports every event of a revision in one answer and the
    /// answers in revision order, so a delete of our own key (our lease ended) at or before that
    /// revision is seen first. The watchers start at the current revision (so the server
    /// streams to them at once, instead of replaying from its history every 100 ms); if writes
    /// came between the read and the watch, the queue is read once more.
    async fn check_and_watch(
        &self,
        name: &str,
        own: (&[u8], &[u8], i64),
        delay: (&[u8], Option<&Marker>),
        recheck: Duration,
    ) -> Result<Turn> {
        let key = own.1;
        let mut queue = self.read_queue(name, own, delay).await?;
        let recheck_at = Instant::now() + recheck;
        'watch: loop {
            let Some(target) = queue
                .nearest
                .clone()
                .or_else(|| queue.foreign_marker.then(|| delay.0.to_vec()))
            else {
                return Ok(Turn::Mine);
            };
            let mut wopts = WatchOptions::new().with_filters([WatchFilterType::NoPut]);
            let mut from = target.clone();
            if queue.last {
                // From the lower of the two keys to the higher, both included.
                let mut to = key.to_vec();
                if to < from {
                    std::mem::swap(&mut to, &mut from);
                }
                to.push(0);
                wopts = wopts.with_range(to);
            }
            let mut stream =
                open_watch(&self.inner.client, self.request_timeout(), &from, wopts).await?;
            if let Some(second) = &queue.second {
                let wopts = WatchOptions::new().with_filters([WatchFilterType::NoPut]);
                timed(
                    self.request_timeout(),
                    "a watch",
                    stream.watch(second.clone(), Some(wopts)),
                )
                .await?;
            }
            // Both watchers (on `target`, and on `second` if there is one) must be in place
            // before the wait counts as begun: each starts at the revision it was created at,
            // and a delete between the read and a watcher's creation (the second one is
            // created a round trip after the first) is only in a new read. Before, only the
            // first watcher's revision was checked: a holder that released in that window
            // cost the waiter two places back a read after its wake.
            let watchers = 1 + usize::from(queue.second.is_some());
            let mut created = 0;
            let mut waiting = None;
            loop {
                let msg = match tokio::time::timeout_at(recheck_at, stream.message()).await {
                    // A watch served by a frozen member never reports anything (the client
                    // notices the dead connection only after its HTTP/2 keepalive, 15 s).
                    Err(_) => return Ok(Turn::Again),
                    Ok(m) => m.map_err(from_client)?,
                };
                let Some(msg) = msg else {
                    return Ok(Turn::Again);
                };
                if msg.canceled() {
                    // Compacted or cancelled by the server (e.g. no leader): read again.
                    return Ok(Turn::Again);
                }
                if msg.created() {
                    created += 1;
                    let from = msg.header().map_or(i64::MAX, |h| h.revision());
                    if from > queue.revision {
                        // Writes between our read and this watcher: what they did to the
                        // queue is only in a new read.
                        let again = self.read_queue(name, own, delay).await?;
                        let same = queue.same_as(&again);
                        queue = again;
                        if !same {
                            continue 'watch;
                        }
                    }
                    if created == watchers {
                        waiting = Some(Waiting::new(&self.inner.stats));
                    }
                    continue;
                }
                // Deletes after the last read (a watcher may start earlier, on a member
                // behind the one that answered the read; a key name may have been deleted
                // before, when an earlier grant used its slot).
                let deleted = |k: &[u8]| {
                    msg.events().iter().any(|e| {
                        e.event_type() == EventType::Delete
                            && e.kv().is_some_and(|kv| {
                                kv.key() == k && kv.mod_revision() > queue.revision
                            })
                    })
                };
                if queue.last && deleted(key) {
                    return Err(Error::LeaseLost {
                        name: name.to_owned(),
                        reason: LossReason::NotHeldOnServer,
                    });
                }
                if deleted(&target) {
                    if queue.last {
                        return Ok(Turn::Mine);
                    }
                    self.inner.stats.send_modify(|s| s.reads_after_wake += 1);
                    drop(waiting);
                    return Ok(Turn::Again);
                }
                if queue.second.as_deref().is_some_and(deleted) {
                    return Ok(Turn::Again);
                }
            }
        }
    }

    /// Waits (if `wait`) until our key is first and no lock-delay marker but ours exists; then,
    /// with a delay of our own, puts our `marker` ([`put_marker`](Self::put_marker)) unless it
    /// is in place, and waits again if a marker got in first.
    async fn wait_grant(
        &self,
        name: &str,
        own: (&[u8], &[u8], i64),
        (marker_key, marker): (&[u8], Option<&Marker>),
        mut wait: bool,
        opts: &AcquireOptions,
    ) -> Result<()> {
        loop {
            if wait {
                self.wait_turn(name, own, (marker_key, marker), opts)
                    .await?;
            }
            let Some(m) = marker else {
                return Ok(());
            };
            if self.put_marker(name, own.1, own.2, m).await? {
                return Ok(());
            }
            wait = true;
        }
    }

    /// Puts a grant's lock-delay marker once its key is first in line: one transaction, if our
    /// key still exists and no marker does. Returns `false` if another marker is there (wait
    /// for it to go).
    ///
    /// # Errors
    /// [`Error::LeaseLost`] if our key is gone (its lease ended); [`Error::Unavailable`] if etcd
    /// did not answer (retried within the request timeout: the put is idempotent, as a marker
    /// found with our value is ours).
    async fn put_marker(
        &self,
        name: &str,
        key: &[u8],
        my_rev: i64,
        marker: &Marker,
    ) -> Result<bool> {
        let txn = Txn::new()
            .when([
                Compare::create_revision(key.to_vec(), CompareOp::Equal, my_rev),
                Compare::create_revision(marker.key.clone(), CompareOp::Equal, 0),
            ])
            .and_then([marker.put()])
            .or_else([
                TxnOp::get(key.to_vec(), None),
                TxnOp::get(marker.key.clone(), None),
            ]);
        let kv = self.inner.client.kv_client();
        let resp = with_retries(self.request_timeout(), "a lock-delay marker", || {
            let (mut kv, txn) = (kv.clone(), txn.clone());
            async move { kv.txn(txn).await }
        })
        .await?;
        if resp.succeeded() {
            return Ok(true);
        }
        let found = |i: usize| match resp.op_responses().get(i) {
            Some(TxnOpResponse::Get(g)) => g.kvs().first().cloned(),
            _ => None,
        };
        if found(0).is_none_or(|kv| kv.create_revision() != my_rev) {
            return Err(Error::LeaseLost {
                name: name.to_owned(),
                reason: LossReason::NotHeldOnServer,
            });
        }
        Ok(found(1).is_some_and(|kv| marker.is_own(kv.value())))
    }

    async fn acquire_once(
        &self,
        space: &Space,
        opts: &AcquireOptions,
        start: Instant,
        deadline: Option<Instant>,
    ) -> Result<Option<Lease>> {
        let reservation = if opts.keepalive {
            retry_transient(opts, deadline, || self.session_lease(opts.ttl)).await?
        } else {
            retry_transient(opts, deadline, || self.private_lease(opts.ttl)).await?
        };
        let shared = reservation.shared.clone();
        let name = space.name.as_str();
        let name_prefix = space.prefix.clone();
        let slot = shared.take_slot(&space.slot_name);
        let mut key = name_prefix.clone();
        key.extend_from_slice(format!("{:016x}-{slot}", shared.id).as_bytes());
        // Armed before the first request that may create the key: from here on, dropping the
        // acquire (or failing) deletes the key, and only then frees its slot.
        let mut guard = KeyGuard {
            client: self.inner.client.clone(),
            key: Some(key.clone()),
            reservation: Some(reservation),
            limit: self.request_timeout(),
            name: space.slot_name.clone(),
            slot,
            uncertain: AtomicBool::new(false),
            marker: None,
        };
        // A private lease is revoked if the acquire fails or is cancelled (which also deletes
        // its key).
        let mut private_revoke = (!opts.keepalive).then(|| RevokeOnDrop {
            client: self.inner.client.clone(),
            shared: Some(shared.clone()),
            limit: self.request_timeout(),
        });
        // A private lease is kept alive by a task while its acquire waits, and no longer.
        let private_keepalive = (!opts.keepalive).then(|| {
            AbortOnDrop(
                tokio::spawn(keepalive_task(shared.clone(), self.task_ctx())).abort_handle(),
            )
        });
        // A grant with a lock-delay puts a marker on a companion lease of its lease.
        let marker_key = space.marker_key.clone();
        let marker = match opts.effective_lock_delay() {
            Some(delay) => Some(
                retry_transient(opts, deadline, || {
                    let client = &self.inner.client;
                    shared.marker(
                        client,
                        marker_key.clone(),
                        &key,
                        delay,
                        self.request_timeout(),
                    )
                })
                .await?,
            ),
            None => None,
        };
        guard.marker = marker.clone();
        let delay = (marker_key.as_slice(), marker.as_ref());
        let mut enq = retry_transient(opts, deadline, || {
            self.enqueue(space, &key, shared.id, delay, true, &guard.uncertain)
        })
        .await?;
        if matches!(enq, Enqueued::Held) && opts.wait != Wait::No {
            enq = retry_transient(opts, deadline, || {
                self.enqueue(space, &key, shared.id, delay, false, &guard.uncertain)
            })
            .await?;
        }
        let (my_rev, owner_rev, blocked, marker_placed) = match enq {
            Enqueued::LeaseGone => {
                shared.mark_lost(LossReason::SessionExpired);
                guard.nothing_created();
                return Ok(None);
            }
            Enqueued::Held => {
                guard.nothing_created();
                return Err(Error::Held {
                    name: name.to_owned(),
                });
            }
            Enqueued::Queued {
                my_rev,
                owner_rev,
                blocked,
                marker_placed,
            } => (my_rev, owner_rev, blocked, marker_placed),
        };
        let wait = owner_rev != my_rev || blocked;
        if wait || (marker.is_some() && !marker_placed) {
            if wait && opts.wait == Wait::No {
                guard.delete_now().await;
                return Err(Error::Held {
                    name: name.to_owned(),
                });
            }
            let lost = shared.master.view().lost();
            let timeout = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            };
            let outcome = tokio::select! {
                r = self.wait_grant(name, (&name_prefix, &key, my_rev), delay, wait, opts) => r,
                _ = lost => Err(Error::LeaseLost { name: name.to_owned(), reason: LossReason::SessionExpired }),
                _ = timeout => Err(Error::Timeout { name: name.to_owned(), waited: start.elapsed() }),
            };
            match outcome {
                Ok(()) => {}
                // Our lease ended while we waited (an outage longer than the TTL, or it was
                // revoked): the lock was never ours, so start over with a fresh lease (at the
                // back of the queue) rather than fail the caller's wait.
                Err(Error::LeaseLost { .. }) => {
                    tracing::debug!(
                        lock = name,
                        "the lease of a waiting acquire ended; retrying with a new lease"
                    );
                    guard.delete_now().await;
                    return Ok(None);
                }
                Err(e) => {
                    guard.delete_now().await;
                    return Err(e);
                }
            }
        }
        // Granted. The tracker starts at the last acknowledged renewal of the etcd lease.
        let binding_tracker = if opts.keepalive {
            shared.register()
        } else if shared.master.state() != LeaseState::Lost {
            Some((
                0,
                TrackerHandle::new(shared.master.confirmed_at(), opts.ttl),
            ))
        } else {
            None
        };
        let Some((tracker_id, tracker)) = binding_tracker else {
            // Lost just as it was granted, before anyone was told: start over.
            guard.delete_now().await;
            return Ok(None);
        };
        // From here on a private lease is renewed by hand only, and belongs to the lock.
        drop(private_keepalive);
        if let Some(r) = private_revoke.as_mut() {
            r.shared = None;
        }
        let create_uncertain = guard.uncertain.load(Ordering::SeqCst);
        let reservation = guard.disarm();
        let binding = match reservation {
            Some(reservation) if opts.keepalive => Binding::Shared {
                reservation,
                tracker_id,
            },
            _ => Binding::Dedicated,
        };
        let ops = Arc::new(EtcdLease {
            client: self.inner.client.clone(),
            name: space.slot_name.clone(),
            name_prefix,
            key,
            create_revision: my_rev,
            lease_id: shared.id,
            binding,
            request_timeout: self.request_timeout(),
            released: AtomicBool::new(false),
            slot,
            create_uncertain,
            release_attempted: AtomicBool::new(false),
            marker,
            marker_frozen: AtomicBool::new(false),
            key_watch: OnceLock::new(),
        });
        crate::lease::watch_own_key(&ops, tracker.clone(), &self.inner.key_watch);
        let token = FencingToken::new(space.token_id.clone(), u64::try_from(my_rev).unwrap_or(0));
        Ok(Some(Lease::new(name, token, tracker, ops, opts)))
    }
}

enum Enqueued {
    /// Our key exists with `my_rev`; the holder's key has `owner_rev`. `blocked`: a lock-delay
    /// marker not ours exists (no grant until it goes); `marker_placed`: ours exists.
    Queued {
        my_rev: i64,
        owner_rev: i64,
        blocked: bool,
        marker_placed: bool,
    },
    /// Try-acquire of a held lock: nothing was created.
    Held,
    /// The lease we attached to no longer exists on the server.
    LeaseGone,
}

enum Turn {
    Mine,
    Again,
}

/// What one read of the queue ([`EtcdLock::read_queue`]) found ahead of our key.
struct Queue {
    /// The read's revision.
    revision: i64,
    /// The key just ahead of ours (the largest create revision below ours).
    nearest: Option<Vec<u8>>,
    /// The key ahead of that one.
    second: Option<Vec<u8>>,
    /// A lock-delay marker not ours exists.
    foreign_marker: bool,
    /// `nearest` is the only key ahead, its grant puts no marker, and there is none: its delete
    /// hands us the lock.
    last: bool,
}

impl Queue {
    /// Whether `other` (a later read) found the same keys ahead and the same marker.
    fn same_as(&self, other: &Queue) -> bool {
        (&self.nearest, &self.second, self.foreign_marker, self.last)
            == (
                &other.nearest,
                &other.second,
                other.foreign_marker,
                other.last,
            )
    }
}

struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Revokes the private lease of a failed or cancelled `keepalive(false)` acquire, in a
/// background task that retries until etcd confirms or the lease's deadline passes (then it has
/// expired anyway). Disarmed (`shared: None`) once the lock is granted.
struct RevokeOnDrop {
    client: Arc<Client>,
    shared: Option<Arc<SharedLease>>,
    limit: Duration,
}

impl Drop for RevokeOnDrop {
    fn drop(&mut self) {
        let Some(shared) = self.shared.take() else {
            return;
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (client, limit) = (self.client.clone(), self.limit);
        rt.spawn(async move {
            let mut lc = client.lease_client();
            // Companions of the acquire's marker first: no marker of a grant is on them.
            for id in shared.companions() {
                let _ = timed(limit, "a lease revoke", lc.revoke(id)).await;
            }
            let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
            loop {
                match timed(limit, "a lease revoke", lc.revoke(shared.id)).await {
                    Ok(_) => break,
                    // "lease not found" (already expired) and other definite answers.
                    Err(e) if !e.is_retryable() => break,
                    Err(e) => {
                        tracing::debug!(error = %e, "revoking a private etcd lease failed; retrying");
                    }
                }
                let delay = backoff.next_delay();
                if Instant::now() + delay >= shared.master.valid_until() {
                    break;
                }
                tokio::time::sleep(delay).await;
            }
            shared.mark_lost(LossReason::Released);
        });
    }
}

/// Deletes an acquire's key unless disarmed: at once with [`delete_now`](Self::delete_now), or
/// in a background task when dropped (the acquire was cancelled or failed).
struct KeyGuard {
    client: Arc<Client>,
    key: Option<Vec<u8>>,
    /// A request that may create the key went unanswered (it may still be applied late): the
    /// slot is burnt instead of freed.
    uncertain: AtomicBool,
    reservation: Option<Reservation>,
    limit: Duration,
    name: String,
    slot: u32,
    /// The acquire's lock-delay marker, deleted with the key (an acquire that did not complete
    /// frees the lock at once).
    marker: Option<Marker>,
}

impl KeyGuard {
    /// Granted: the key and its slot now belong to the lock.
    fn disarm(&mut self) -> Option<Reservation> {
        self.key = None;
        self.reservation.take()
    }

    /// The request that would have created the key did not: the slot is free again (unless
    /// an earlier attempt went unanswered and may still create it: then the slot is burnt).
    fn nothing_created(&mut self) {
        let Some(key) = self.key.take() else {
            return;
        };
        if let Some(r) = &self.reservation {
            if self.uncertain.load(Ordering::SeqCst) {
                r.shared.burn_slot(key, self.marker.clone());
            } else {
                r.shared.free_slot(&self.name, self.slot);
            }
        }
    }

    /// Deletes the key now; if that fails the drop retries in the background.
    async fn delete_now(&mut self) {
        if let Some(key) = &self.key {
            let txn = Txn::new().and_then(delete_key_ops(key, self.marker.as_ref()));
            let res = timed(self.limit, "a key delete", self.client.kv_client().txn(txn)).await;
            if res.is_ok() {
                self.nothing_created();
            }
        }
    }
}

impl Drop for KeyGuard {
    fn drop(&mut self) {
        let Some(key) = self.key.take() else {
            return;
        };
        let reservation = self.reservation.take();
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            if let Some(r) = &reservation {
                r.shared.close_to_newcomers();
            }
            return;
        };
        let Some(reservation) = reservation else {
            return;
        };
        let client = self.client.clone();
        let limit = self.limit;
        let uncertain = self.uncertain.load(Ordering::SeqCst);
        let marker = self.marker.take();
        // Keeps the reservation (so the lease and the slot) until the key is gone.
        rt.spawn(async move {
            let shared = &reservation.shared;
            if uncertain {
                shared.burn_slot(key.clone(), marker.clone());
            }
            // The slot is not freed: this delete (no revision to compare, the key's creation
            // may not have been answered) or an earlier attempt may still land late.
            delete_while_lease_lives(&client, &key, None, marker.as_ref(), limit, shared).await;
        });
    }
}

impl EtcdLock {
    /// A grant in `space` (a lock's, or a slot's): the lock's whole acquire, with its retries
    /// on lost leases and its bounds on the caller's wait.
    pub(crate) async fn grant_in(&self, space: &Space, opts: AcquireOptions) -> Result<Lease> {
        let start = Instant::now();
        let deadline = wait_deadline(opts.wait, start);
        let run = async {
            // A lease that expired just before we attached a key to it, or while we waited:
            // take a fresh one, a few times at most.
            for _ in 0..LEASE_ATTEMPTS {
                if let Some(lease) = self.acquire_once(space, &opts, start, deadline).await? {
                    return Ok(lease);
                }
            }
            Err(Error::Unavailable {
                backend: BACKEND,
                source: "etcd expired every lease granted for this acquire".into(),
            })
        };
        // A hanging etcd must not stretch the caller's wait: a timed acquire ends at its
        // deadline, a try-acquire after one request timeout, whatever request is in flight
        // (dropping the attempt cleans up as a cancelled acquire does).
        match opts.wait {
            Wait::Forever => run.await,
            Wait::Timeout(_) => {
                // Past the deadline by a grace period, so that an acquire that timed out on
                // its own still deletes its key before it returns.
                let limit = deadline
                    .unwrap_or(start)
                    .max(start + MIN_ATTEMPT.min(self.request_timeout()))
                    + CLEANUP_GRACE.min(self.request_timeout());
                match tokio::time::timeout_at(limit, run).await {
                    Ok(r) => r,
                    Err(_) => Err(Error::Timeout {
                        name: space.name.clone(),
                        waited: start.elapsed(),
                    }),
                }
            }
            Wait::No => match tokio::time::timeout(self.request_timeout(), run).await {
                Ok(r) => r,
                Err(_) => Err(error::timeout("a try-acquire")),
            },
        }
    }
}

#[async_trait]
impl LockBackend for EtcdLock {
    async fn grant(&self, name: &str, opts: AcquireOptions) -> Result<Lease> {
        validate_name(name)?;
        opts.validate()?;
        self.grant_in(&self.lock_space(name), opts).await
    }

    /// Correctness lock: consensus-backed, durable tokens, FIFO waiters, manual renewal,
    /// lock-delay ([crate docs](crate#lock-delay)).
    /// `expiry_slack` is `max(1 s, minimum lease TTL of the server) + 0.5 s`: TTLs are rounded up
    /// to whole seconds and raised to the server's minimum (1.5 × election timeout, measured at
    /// connect), and the leader sweeps expired leases every 500 ms.
    fn guarantees(&self) -> Guarantees {
        let mut g = Guarantees::new("etcd", LockKind::Correctness);
        g.tokens_survive_restart = true;
        g.safe_across_failover = true;
        g.fifo_waiters = true;
        g.manual_renewal = true;
        g.lock_delay = true;
        // The delete of a lock's key (an admin's delete or lease revoke) reaches the holder on
        // the client's key watch stream: 2–50 ms measured, 500 ms promised while the member
        // serving the stream answers (else the next keepalive, within TTL/3, or the deadline).
        g.loss_notice = Some(LOSS_NOTICE);
        g.expiry_slack =
            self.inner.min_granted.max(Duration::from_secs(1)) + Duration::from_millis(500);
        g.notes = "etcd TTLs are whole seconds (rounded up, at least the server's minimum), and \
                   so is a lock-delay (its marker lease outlives the key by the delay + 1.5 s, \
                   rounded up); \
                   tokens are create revisions and go back only if the cluster is restored \
                   from an old snapshot; etcd 3.4 releases without the fix for \
                   etcd-io/etcd#15247 (Debian's 3.4.23 included) may free a lock early when a \
                   stalled former leader resumes: fence your writes";
        g
    }

    /// Reads the key with the lowest create revision under the name's prefix (the holder; its
    /// create revision is the token; no holder while another grant's lock-delay marker says a
    /// failed holder's delay runs), then its lease's remaining TTL (whole seconds, as etcd
    /// reports it; the lease may be a session lease shared by other locks).
    ///
    /// # Errors
    /// As [`Lock::holder`](lockkit_core::Lock::holder). Each request is bounded by the client's request timeout.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    async fn holder(&self, name: &str) -> Result<Option<HolderInfo>> {
        validate_name(name)?;
        let opts = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_limit(1)
            .with_keys_only();
        let mut kv = self.inner.client.kv_client();
        let resp = timed(
            self.request_timeout(),
            "a holder read",
            kv.get(self.name_prefix(name), Some(opts)),
        )
        .await?;
        let Some(first) = resp.kvs().first() else {
            return Ok(None);
        };
        // A lock-delay marker of another grant (`{key}#{seq}`): a failed holder's delay runs,
        // and the first key is a waiter sitting it out, not a holder.
        let marker = timed(
            self.request_timeout(),
            "a lock-delay marker read",
            kv.get(marker_key(&self.name_prefix(name), name), None),
        )
        .await?;
        if let Some(m) = marker.kvs().first() {
            let own = m
                .value()
                .strip_prefix(first.key())
                .is_some_and(|rest| rest.starts_with(b"#"));
            if !own {
                return Ok(None);
            }
        }
        let token = u64::try_from(first.create_revision())
            .ok()
            .map(|rev| FencingToken::new(self.lock_id(name), rev));
        let mut lc = self.inner.client.lease_client();
        let remaining = match first.lease() {
            0 => None,
            id => timed(
                self.request_timeout(),
                "a lease TTL read",
                lc.time_to_live(id, None),
            )
            .await
            .ok()
            .and_then(|t| u64::try_from(t.ttl()).ok())
            .map(Duration::from_secs),
        };
        Ok(Some(HolderInfo::new(token, remaining)))
    }
}
