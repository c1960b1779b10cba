//! The `Lock` trait, its extension trait, and what each backend guarantees.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use async_trait::async_trait;
use backon::{BackoffBuilder, ExponentialBuilder};
use tokio::time::Instant;
use tracing::Instrument;

use crate::observe::{Labels, TARGET};
use crate::{AcquireOptions, Error, FencingToken, Lease, Result, Wait};

/// Whether a lock may be trusted for correctness or only for efficiency.
///
/// See Kleppmann, *How to do distributed locking*
/// (<https://martin.kleppmann.com/2016/02/08/how-to-do-distributed-locking.html>): an efficiency
/// lock saves duplicate work and may occasionally grant twice; a correctness lock must not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LockKind {
    /// May grant the same lock to two holders in rare failures (e.g. Redis failover). Use it to
    /// avoid doing work twice, not to protect data — or protect data with a fence as well.
    Efficiency,
    /// Never grants twice while its servers keep their documented promises (consensus or a single
    /// durable server). Fencing tokens still guard against paused holders.
    Correctness,
}

/// What a backend promises. The contract suite checks each backend delivers what it claims.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Guarantees {
    /// Short backend name (`"memory"`, `"redis"`, `"etcd"`, `"zk"`, `"postgres"`).
    pub backend: &'static str,
    /// How this client reaches its backend, where the backend has several ways (Redis:
    /// `"single server"`, `"Sentinel"`, `"Cluster"`); `None` where it has one. `lockkit
    /// guarantees` shows it after the backend's name, since the other answers depend on it.
    pub mode: Option<&'static str>,
    /// Efficiency or correctness lock.
    pub kind: LockKind,
    /// Fencing tokens keep increasing after the server restarts (and, where relevant, after the
    /// lock's data is wiped).
    pub tokens_survive_restart: bool,
    /// A failover to another server never grants a held lock a second time.
    pub safe_across_failover: bool,
    /// Waiters are granted the lock in the order they started waiting.
    pub fifo_waiters: bool,
    /// `keepalive(false)` leases are supported (the holder renews by hand). Backends whose session
    /// heartbeat cannot be paused return [`Error::NotSupported`] for such acquires.
    pub manual_renewal: bool,
    /// How much later than its TTL the server may free a lapsed lease (TTL rounding, session
    /// timeout granularity, expiry sweeps). The contract suite allows this much.
    pub expiry_slack: Duration,
    /// [`AcquireOptions::lock_delay`] is honoured; without it a nonzero delay is refused with
    /// [`Error::NotSupported`].
    pub lock_delay: bool,
    /// When the server itself ends a lease (its key deleted or evicted, its lease revoked, its
    /// session or connection ended), the holder hears of it (turns
    /// [`Lost`](crate::LeaseState::Lost)) within this bound; `None` if the holder cannot hear
    /// of it before its next renewal. Whatever this says, a holder that hears nothing turns Lost
    /// on its own deadline (the TTL from the send time of its last acknowledged renewal).
    pub loss_notice: Option<Duration>,
    /// One line for humans: the fine print.
    pub notes: &'static str,
}

impl Guarantees {
    /// A description with every promise off; backends switch on what they deliver.
    pub fn new(backend: &'static str, kind: LockKind) -> Self {
        Self {
            backend,
            mode: None,
            kind,
            tokens_survive_restart: false,
            safe_across_failover: false,
            fifo_waiters: false,
            manual_renewal: false,
            expiry_slack: Duration::ZERO,
            lock_delay: false,
            loss_notice: None,
            notes: "",
        }
    }
}

/// What a backend can tell about the current holder of a lock, from [`Lock::holder`].
///
/// Each field is `None` when the backend cannot tell it. A snapshot: by the time it is read the
/// holder may have released, lapsed or been replaced.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct HolderInfo {
    /// The holder's fencing token.
    pub token: Option<FencingToken>,
    /// How long the holder's lease has left on the server, unless renewed (for a lease shared by
    /// several locks, such as an etcd session lease or a ZooKeeper session, the shared lease's).
    pub remaining: Option<Duration>,
}

impl HolderInfo {
    /// A holder with `token` and `remaining` time on its lease, either unknown.
    pub fn new(token: Option<FencingToken>, remaining: Option<Duration>) -> Self {
        Self { token, remaining }
    }
}

/// A distributed lock service: grants [`Lease`]s on named locks.
///
/// Object safe: the facade hands out `Arc<dyn Lock>` chosen from a URL. Implementations hold a
/// client (connection, session) and a key prefix; cloning or sharing it is cheap.
///
/// Implemented once, here, for every [`LockBackend`](crate::backend::LockBackend): backends
/// implement that trait's `grant`, and `acquire` wraps it in the `acquire` span and the acquire
/// metrics (see [`crate::observe`]), so every backend, however it is built, reports the same.
///
/// # Contract
/// - `acquire` validates the name ([`validate_name`](crate::backend::validate_name)) and options
///   ([`AcquireOptions::validate`]) before any I/O.
/// - At most one lease per name is [`Held`](crate::LeaseState::Held) at a time (up to the
///   backend's [`Guarantees`]), and every grant's [`FencingToken`](crate::FencingToken) is larger than every earlier
///   grant's for that name.
/// - Waiting follows [`AcquireOptions::wait`]; transient errors are retried per
///   [`AcquireOptions::retry`].
/// - Dropping the acquire future at any await point leaves nothing held or queued on the
///   server (a backend may keep a short-lived marker of the cancelled attempt, such as Redis's
///   tombstone, so that a request still in flight does nothing when it arrives).
///
/// The contract suite (`lockkit_core::contract`, feature `contract`) tests all of this.
#[async_trait]
pub trait Lock: Send + Sync + fmt::Debug {
    /// Acquires the lock `name` with `opts`, in an `acquire` span (fields `lock`, `backend`,
    /// `wait`, `ttl`; recorded: `outcome`, `waited`, `token`).
    ///
    /// # Errors
    /// - [`Error::InvalidName`], [`Error::InvalidConfig`]: bad input, nothing was sent.
    /// - [`Error::Held`]: with [`Wait::No`], the lock is held.
    /// - [`Error::Timeout`]: with [`Wait::Timeout`], the lock was not granted in time.
    /// - [`Error::Unavailable`], [`Error::Auth`], [`Error::Backend`]: from the server, after the
    ///   retries allowed by [`AcquireOptions::retry`].
    /// - [`Error::NotSupported`]: the options ask for something the backend cannot do.
    /// - [`Error::LeaseLost`]: a waiting acquire whose own server-side session or lease expired
    ///   while it was queued (an outage); it never held the lock, and a new acquire may succeed.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future at any point leaves no lock and no waiter entry behind
    /// (cleanup of a server-side entry may complete shortly after the drop, in the background).
    async fn acquire(&self, name: &str, opts: AcquireOptions) -> Result<Lease>;

    /// What this backend promises.
    fn guarantees(&self) -> Guarantees;

    /// Reads who holds `name` now: `None` if the lock is free, else what the server knows of
    /// the holder. A read only: it takes no lock, queues nothing and changes nothing.
    ///
    /// Backends without a way to tell return [`Error::NotSupported`] (the default of
    /// [`LockBackend::holder`]).
    ///
    /// # Errors
    /// - [`Error::InvalidName`]: bad name, nothing was sent.
    /// - [`Error::NotSupported`]: the backend cannot read the holder.
    /// - [`Error::Unavailable`], [`Error::Auth`], [`Error::Backend`]: from the server (no retry).
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    async fn holder(&self, name: &str) -> Result<Option<HolderInfo>>;
}

/// The backend half of [`Lock`]: what an adapter implements. Users call [`Lock::acquire`], which
/// every `LockBackend` gets, instrumented, from the core.
#[async_trait]
pub trait LockBackend: Send + Sync + fmt::Debug {
    /// Grants the lock `name` with `opts`, following every rule of [`Lock`]'s contract; the
    /// grant is handed to [`Lease::new`] with `opts`, which carries the backend's metric labels.
    ///
    /// # Errors
    /// As [`Lock::acquire`].
    ///
    /// # Cancel safety
    /// Must be cancel safe, as [`Lock::acquire`] documents.
    async fn grant(&self, name: &str, opts: AcquireOptions) -> Result<Lease>;

    /// What this backend promises.
    fn guarantees(&self) -> Guarantees;

    /// Reads who holds `name` now, as [`Lock::holder`] documents. The default returns
    /// [`Error::NotSupported`]; backends override it where the server can tell.
    ///
    /// # Errors
    /// As [`Lock::holder`].
    ///
    /// # Cancel safety
    /// Must be cancel safe: it only reads.
    async fn holder(&self, name: &str) -> Result<Option<HolderInfo>> {
        crate::backend::validate_name(name)?;
        Err(Error::NotSupported {
            operation: "reading the holder",
            backend: self.guarantees().backend,
        })
    }
}

#[async_trait]
impl<B: LockBackend + ?Sized> Lock for B {
    async fn acquire(&self, name: &str, mut opts: AcquireOptions) -> Result<Lease> {
        let backend = LockBackend::guarantees(self).backend;
        opts.observed_backend = Some(backend);
        let span = tracing::info_span!(
            target: TARGET,
            "acquire",
            lock = %name,
            backend,
            wait = %WaitField(opts.wait),
            ttl = ?opts.ttl,
            outcome = tracing::field::Empty,
            waited = tracing::field::Empty,
            token = tracing::field::Empty,
        );
        let mut watch = AcquireWatch {
            labels: Labels::new(backend, name, opts.lock_name_label),
            start: Instant::now(),
            span: span.clone(),
            finished: false,
        };
        let res = grant_with_min_validity(self, name, opts)
            .instrument(span)
            .await;
        watch.finish(&res);
        res
    }

    fn guarantees(&self) -> Guarantees {
        LockBackend::guarantees(self)
    }

    async fn holder(&self, name: &str) -> Result<Option<HolderInfo>> {
        LockBackend::holder(self, name).await
    }
}

/// How long after its deadline a timed acquire cuts off a grant still in flight: time for the
/// backend to end the wait itself (and clean up at once) first, and for a zero wait on a free
/// lock to get the server's first answer.
const CUT_GRACE: Duration = Duration::from_millis(100);

/// One acquire around the backend's `grant`, for every backend alike:
///
/// - a timed acquire ([`Wait::Timeout`]) returns [`Error::Timeout`] by [`CUT_GRACE`] after its
///   deadline even while a grant's round trip is still on the way (the grant future is dropped:
///   backends' grants are cancel safe, their cleanup then finishes in the background); a
///   backend that ends the wait itself on the deadline returns first, with its cleanup done, and
///   a zero wait on a free lock is still granted (as on the memory backend);
/// - a grant that arrives with less than [`AcquireOptions::effective_min_validity`] left is
///   given back (compare-and-delete, [`Lease::release`]) and the acquire asks again with what is
///   left of its wait; a try-once acquire fails with [`Error::GrantTooShort`].
async fn grant_with_min_validity<B: LockBackend + ?Sized>(
    backend: &B,
    name: &str,
    opts: AcquireOptions,
) -> Result<Lease> {
    crate::backend::validate_name(name)?;
    opts.validate()?;
    if opts.effective_lock_delay().is_some() && !backend.guarantees().lock_delay {
        return Err(Error::NotSupported {
            operation: "lock-delay",
            backend: backend.guarantees().backend,
        });
    }
    with_min_validity(
        name,
        &opts,
        |attempt| backend.grant(name, attempt),
        |l| l,
        |l| l,
    )
    .await
}

/// The loop of [`grant_with_min_validity`], for locks and for election/semaphore slots alike:
/// asks `grant` (with what is left of the wait), cuts a timed acquire off [`CUT_GRACE`] after its
/// deadline, and gives back (`into_lease(..).release()`) a grant with less than the minimum
/// validity left, asking again or failing as `grant_with_min_validity` documents.
pub(crate) async fn with_min_validity<T, F, Fut>(
    name: &str,
    opts: &AcquireOptions,
    mut grant: F,
    lease_ref: fn(&T) -> &Lease,
    into_lease: fn(T) -> Lease,
) -> Result<T>
where
    F: FnMut(AcquireOptions) -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let start = Instant::now();
    let deadline = wait_deadline(opts.wait, start);
    let min_validity = opts.effective_min_validity();
    loop {
        let mut attempt = opts.clone();
        if let (Wait::Timeout(_), Some(d)) = (opts.wait, deadline) {
            attempt.wait = Wait::Timeout(d.saturating_duration_since(Instant::now()));
        }
        let granted = grant(attempt);
        let granted = match (opts.wait, deadline) {
            (Wait::Timeout(_), Some(d)) => {
                match tokio::time::timeout_at(d + CUT_GRACE, granted).await {
                    Ok(res) => res?,
                    Err(_) => {
                        return Err(Error::Timeout {
                            name: name.to_owned(),
                            waited: start.elapsed(),
                        });
                    }
                }
            }
            _ => granted.await?,
        };
        let remaining = lease_ref(&granted).remaining();
        if remaining >= min_validity {
            return Ok(granted);
        }
        tracing::warn!(
            target: TARGET,
            lock = %name,
            ?remaining,
            ?min_validity,
            "grant arrived with less than the minimum validity left; giving it back"
        );
        // Compare-and-delete: frees the lock unless it already lapsed. A failed give-back
        // leaves the release-on-drop retry and then the TTL.
        let _ = into_lease(granted).release().await;
        match (opts.wait, deadline) {
            (Wait::No, _) => {
                return Err(Error::GrantTooShort {
                    name: name.to_owned(),
                    remaining,
                    min_validity,
                });
            }
            (_, Some(d)) if Instant::now() >= d => {
                return Err(Error::Timeout {
                    name: name.to_owned(),
                    waited: start.elapsed(),
                });
            }
            _ => {}
        }
    }
}

/// `wait` as a span field: `no`, `forever`, or the timeout (`timeout(2s)`).
struct WaitField(Wait);

impl fmt::Display for WaitField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Wait::No => f.write_str("no"),
            Wait::Forever => f.write_str("forever"),
            Wait::Timeout(d) => write!(f, "timeout({d:?})"),
        }
    }
}

/// Records one acquire's outcome; records `cancelled` if the acquire future is dropped first.
struct AcquireWatch {
    labels: Labels,
    start: Instant,
    span: tracing::Span,
    finished: bool,
}

impl AcquireWatch {
    fn finish(&mut self, res: &Result<Lease>) {
        self.finished = true;
        let took = self.start.elapsed();
        let (outcome, wait) = match res {
            Ok(lease) => {
                self.span.record("token", lease.token().get());
                let granted_sent = lease.tracker().confirmed_at();
                (
                    "granted",
                    Some(granted_sent.saturating_duration_since(self.start)),
                )
            }
            Err(Error::Held { .. }) => ("held", None),
            Err(Error::Timeout { .. }) => ("timeout", None),
            Err(_) => ("error", None),
        };
        self.span.record("outcome", outcome);
        self.span.record("waited", tracing::field::debug(took));
        self.labels.acquired(outcome, took, wait);
    }
}

impl Drop for AcquireWatch {
    fn drop(&mut self) {
        if !self.finished {
            let took = self.start.elapsed();
            self.span.record("outcome", "cancelled");
            self.span.record("waited", tracing::field::debug(took));
            self.labels.acquired("cancelled", took, None);
        }
    }
}

/// Convenience calls on every [`Lock`], implemented once for all.
pub trait LockExt: Lock {
    /// Tries once: a lease, or [`Error::Held`] at once.
    ///
    /// # Errors
    /// As [`Lock::acquire`].
    ///
    /// # Cancel safety
    /// As [`Lock::acquire`].
    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        ttl: Duration,
    ) -> impl Future<Output = Result<Lease>> + Send + 'a {
        self.acquire(name, AcquireOptions::new().ttl(ttl).wait(Wait::No))
    }

    /// Waits up to `timeout` for the lock.
    ///
    /// # Errors
    /// As [`Lock::acquire`]; [`Error::Timeout`] when `timeout` runs out.
    ///
    /// # Cancel safety
    /// As [`Lock::acquire`].
    fn acquire_timeout<'a>(
        &'a self,
        name: &'a str,
        ttl: Duration,
        timeout: Duration,
    ) -> impl Future<Output = Result<Lease>> + Send + 'a {
        self.acquire(
            name,
            AcquireOptions::new().ttl(ttl).wait(Wait::Timeout(timeout)),
        )
    }

    /// Runs `f` while holding the lock, then releases it.
    ///
    /// `f` gets the [`Lease`]: take what the critical section needs from it (its
    /// [`token`](Lease::token), or a backend fence built from it, such as
    /// `EtcdFence::from_lease(lease)`) and return a future that owns it. If the lease is lost
    /// before that future finishes, it is **dropped** and [`Error::LeaseLost`] is returned: the
    /// critical section never runs on past the lease.
    ///
    /// ```
    /// # use lockkit_core::{AcquireOptions, LockExt, MemoryFence, MemoryLock};
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lockkit_core::Result<()> {
    /// # let (locks, storage) = (MemoryLock::new(), std::sync::Arc::new(MemoryFence::new()));
    /// locks
    ///     .with_lock("report", AcquireOptions::new(), |lease| {
    ///         let (token, storage) = (lease.token(), storage.clone());
    ///         async move { storage.write("report.csv", token, "rows…") }
    ///     })
    ///     .await??;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`Lock::acquire`]; [`Error::LeaseLost`] as above. A failed release after `f` finished is
    /// ignored (the TTL frees the lock): `f`'s result is returned.
    ///
    /// # Cancel safety
    /// Dropping the future drops `f` and the lease (best-effort release in the background).
    fn with_lock<T, F, Fut>(
        &self,
        name: &str,
        opts: AcquireOptions,
        f: F,
    ) -> impl Future<Output = Result<T>> + Send
    where
        F: FnOnce(&Lease) -> Fut + Send,
        Fut: Future<Output = T> + Send,
        T: Send,
    {
        async move {
            let lease = self.acquire(name, opts).await?;
            let lost = lease.lost();
            let section = f(&lease);
            let out = tokio::select! {
                biased;
                _ = lost => None,
                out = section => Some(out),
            };
            match out {
                Some(out) => {
                    let _ = lease.release().await;
                    Ok(out)
                }
                None => Err(lease.lost_error()),
            }
        }
    }
}

impl<L: Lock + ?Sized> LockExt for L {}

/// When an acquire started waiting with `wait` must give up, if ever.
pub fn wait_deadline(wait: Wait, start: Instant) -> Option<Instant> {
    match wait {
        Wait::No => Some(start),
        Wait::Timeout(d) => Some(start + d),
        Wait::Forever => None,
    }
}

/// Runs one acquire attempt `attempt` and retries it on [`Error::is_retryable`] errors with
/// exponential backoff and jitter (backon's `ExponentialBuilder::with_jitter`: each pause is
/// between 1× and 2× the current delay), as configured by `opts.retry`, never sleeping past
/// `deadline` (for [`Wait::No`], no pause ends later than `max_delay` after the first
/// attempt). A [`Wait::Forever`] acquire is not bounded by
/// [`max_retries`](crate::RetryPolicy::max_retries): it retries (every `max_delay` once the
/// backoff reached it) until an attempt succeeds or fails permanently, or the future is dropped,
/// so that it lives through a restart of the server. For backends' `acquire` implementations:
/// `attempt` itself must respect `deadline` (a single attempt is not cut short here).
///
/// # Errors
/// The last attempt's error.
///
/// # Cancel safety
/// As cancel safe as `attempt`.
pub async fn retry_transient<T, F, Fut>(
    opts: &AcquireOptions,
    deadline: Option<Instant>,
    mut attempt: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let mut delays = opts.retry.map(|r| {
        let b = ExponentialBuilder::default()
            .with_min_delay(r.min_delay)
            .with_max_delay(r.max_delay)
            .with_jitter();
        match opts.wait {
            Wait::Forever => b.without_max_times(),
            _ => b.with_max_times(r.max_retries),
        }
        .build()
    });
    // A try-once acquire (`Wait::No`) still retries transient errors, but only for about one
    // `max_delay` (it promised an answer "at once"); a timed one stops when the pause would run
    // past its deadline.
    let limit = match opts.wait {
        Wait::No => opts
            .retry
            .and_then(|r| Instant::now().checked_add(r.max_delay)),
        _ => deadline,
    };
    loop {
        match attempt().await {
            Err(e) if e.is_retryable() => {
                let Some(delay) = delays.as_mut().and_then(Iterator::next) else {
                    return Err(e);
                };
                let Some(wake) = Instant::now().checked_add(delay) else {
                    return Err(e);
                };
                if limit.is_some_and(|d| wake >= d) {
                    return Err(e);
                }
                tracing::debug!(target: TARGET, error = %e, ?delay, "transient error; retrying");
                tokio::time::sleep_until(wake).await;
            }
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn unavailable() -> Error {
        Error::Unavailable {
            backend: "test",
            source: "down".into(),
        }
    }

    /// Memory's grant, handed back only after `delay`: a slow network's reply.
    #[derive(Debug)]
    struct SlowGrant {
        inner: crate::MemoryLock,
        delay: Duration,
    }

    #[async_trait]
    impl LockBackend for SlowGrant {
        async fn grant(&self, name: &str, opts: AcquireOptions) -> Result<Lease> {
            let lease = self.inner.grant(name, opts).await?;
            tokio::time::sleep(self.delay).await;
            Ok(lease)
        }

        fn guarantees(&self) -> Guarantees {
            LockBackend::guarantees(&self.inner)
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_grant_below_the_minimum_validity_is_given_back() {
        let ttl = Duration::from_secs(1);
        let slow = SlowGrant {
            inner: crate::MemoryLock::new(),
            delay: Duration::from_millis(700),
        };
        let once = AcquireOptions::new()
            .ttl(ttl)
            .wait(Wait::No)
            .keepalive(false);
        match slow.acquire("m", once.clone()).await {
            Err(Error::GrantTooShort {
                remaining,
                min_validity,
                ..
            }) => {
                assert!(remaining < ttl / 2, "{remaining:?}");
                assert_eq!(min_validity, ttl / 2);
            }
            other => panic!("expected GrantTooShort, got {other:?}"),
        }
        // Nothing was left behind: the lock is free at once.
        let lease = slow.inner.acquire("m", once.clone()).await.unwrap();
        lease.release().await.unwrap();
        // A lower minimum accepts the same grant.
        let lease = slow
            .acquire("m", once.clone().min_validity(Duration::from_millis(200)))
            .await
            .unwrap();
        assert!(lease.remaining() >= Duration::from_millis(200));
        lease.release().await.unwrap();
        // A waiting acquire keeps asking and gives up on its deadline with Timeout.
        let t = Instant::now();
        let res = slow
            .acquire("m", once.wait(Wait::Timeout(Duration::from_secs(2))))
            .await;
        assert!(matches!(res, Err(Error::Timeout { .. })), "{res:?}");
        assert!(
            t.elapsed() <= Duration::from_secs(2) + CUT_GRACE,
            "{:?}",
            t.elapsed()
        );
        // The last grant, cut off by the deadline, is released on drop in the background.
        let mut free = false;
        for _ in 0..100 {
            tokio::task::yield_now().await;
            let try_once = AcquireOptions::new().wait(Wait::No);
            if slow.inner.acquire("m", try_once).await.is_ok() {
                free = true;
                break;
            }
        }
        assert!(free, "the cut-off grant was left on the server");
    }

    #[tokio::test(start_paused = true)]
    async fn a_timed_acquire_times_out_on_time_during_a_slow_round_trip() {
        let slow = SlowGrant {
            inner: crate::MemoryLock::new(),
            delay: Duration::from_secs(5),
        };
        let t = Instant::now();
        let res = slow
            .acquire(
                "t",
                AcquireOptions::new().wait(Wait::Timeout(Duration::from_millis(300))),
            )
            .await;
        assert!(matches!(res, Err(Error::Timeout { .. })), "{res:?}");
        assert_eq!(t.elapsed(), Duration::from_millis(300) + CUT_GRACE);
    }

    #[test]
    fn a_minimum_validity_not_below_the_ttl_is_refused() {
        let opts = AcquireOptions::new()
            .ttl(Duration::from_secs(1))
            .min_validity(Duration::from_secs(1));
        assert!(matches!(opts.validate(), Err(Error::InvalidConfig { .. })));
    }

    #[tokio::test(start_paused = true)]
    async fn retries_transient_then_succeeds() {
        let n = AtomicUsize::new(0);
        let opts = AcquireOptions::new();
        let out = retry_transient(&opts, None, || async {
            if n.fetch_add(1, Ordering::SeqCst) < 2 {
                Err(unavailable())
            } else {
                Ok(7)
            }
        })
        .await
        .unwrap();
        assert_eq!(out, 7);
        assert_eq!(n.load(Ordering::SeqCst), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn gives_up_after_max_retries_and_never_retries_permanent() {
        let n = AtomicUsize::new(0);
        let opts = AcquireOptions::new()
            .wait(Wait::Timeout(Duration::from_secs(60)))
            .retry(Some(crate::RetryPolicy::new(
                Duration::from_millis(1),
                Duration::from_millis(4),
                3,
            )));
        let r: Result<()> = retry_transient(&opts, None, || async {
            n.fetch_add(1, Ordering::SeqCst);
            Err(unavailable())
        })
        .await;
        assert!(matches!(r, Err(Error::Unavailable { .. })));
        assert_eq!(n.load(Ordering::SeqCst), 4);

        // Try-once: retries stop about one max_delay after the first attempt.
        let k = AtomicUsize::new(0);
        let once = AcquireOptions::new().wait(Wait::No);
        let start = Instant::now();
        let r: Result<()> = retry_transient(&once, Some(start), || async {
            k.fetch_add(1, Ordering::SeqCst);
            Err(unavailable())
        })
        .await;
        assert!(matches!(r, Err(Error::Unavailable { .. })));
        assert!(start.elapsed() <= crate::RetryPolicy::default().max_delay);
        assert!(k.load(Ordering::SeqCst) >= 2);

        // Wait::Forever is not bounded by max_retries: it retries until the server answers.
        let f = AtomicUsize::new(0);
        let forever = opts.clone().wait(Wait::Forever);
        let out = retry_transient(&forever, None, || async {
            if f.fetch_add(1, Ordering::SeqCst) < 50 {
                Err(unavailable())
            } else {
                Ok(())
            }
        })
        .await;
        assert!(out.is_ok(), "{out:?}");
        assert_eq!(f.load(Ordering::SeqCst), 51);
        // ... unless retries are off.
        let g = AtomicUsize::new(0);
        let r: Result<()> = retry_transient(&forever.retry(None), None, || async {
            g.fetch_add(1, Ordering::SeqCst);
            Err(unavailable())
        })
        .await;
        assert!(matches!(r, Err(Error::Unavailable { .. })));
        assert_eq!(g.load(Ordering::SeqCst), 1);

        let m = AtomicUsize::new(0);
        let r: Result<()> = retry_transient(&opts, None, || async {
            m.fetch_add(1, Ordering::SeqCst);
            Err(Error::Held { name: "x".into() })
        })
        .await;
        assert!(matches!(r, Err(Error::Held { .. })));
        assert_eq!(m.load(Ordering::SeqCst), 1);
    }
}
