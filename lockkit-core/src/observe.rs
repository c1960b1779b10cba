//! Observability: the spans, events and metrics every backend emits, from the core.
//!
//! The core emits them, not the backends: [`Lock::acquire`](crate::Lock::acquire) is implemented
//! once for every [`LockBackend`](crate::backend::LockBackend) and wraps the backend's grant in a
//! span and the acquire metrics; the lease's state changes (tracked in the core's
//! [`LeaseTracker`](crate::LeaseTracker)) emit the lease events and metrics. So a `RedisLock`
//! built by hand, a lock from `lockkit::connect` and the in-memory backend all report the same
//! names, fields and labels. The full list, with units and labels, is in `docs/observability.md`.
//!
//! Metrics go through the [`metrics`](https://docs.rs/metrics/0.24) facade: nothing is recorded
//! until the application installs a recorder (Prometheus, OpenTelemetry, statsd…). Call
//! [`describe_metrics`] after installing it to register units and help texts.
//!
//! Labels are low-cardinality: `backend` plus `outcome`, `result` or `reason`. The lock name is
//! unbounded and is added as a `lock` label only for acquires that opt in with
//! [`AcquireOptions::lock_name_label`](crate::AcquireOptions::lock_name_label).
//!
//! No span, event or metric carries a URL, user name or password: the fields are the lock name,
//! the backend's short name, the wait mode, the TTL, the fencing token and outcomes.

use std::sync::Arc;
use std::time::Duration;

use metrics::{Label, Unit};

#[cfg(any(test, feature = "contract"))]
#[cfg_attr(docsrs, doc(cfg(feature = "contract")))]
pub mod testing;

/// Histogram, seconds: how long [`Lock::acquire`](crate::Lock::acquire) took, from the call to
/// its result. Labels: `backend`, `outcome`.
pub const ACQUIRE_DURATION_SECONDS: &str = "lockkit_acquire_duration_seconds";
/// Histogram, seconds: for granted acquires, the time from the call to the sending of the
/// request that was granted (queueing behind other holders, retries of transient errors).
/// Near zero for an uncontended lock. Labels: `backend`.
pub const ACQUIRE_WAIT_SECONDS: &str = "lockkit_acquire_wait_seconds";
/// Counter: finished acquires. Labels: `backend`, `outcome` (`granted`, `held`, `timeout`,
/// `error`, `cancelled`: the future was dropped).
pub const ACQUIRES_TOTAL: &str = "lockkit_acquires_total";
/// Counter: lease renewals. Labels: `backend`, `result` (`ok`: acknowledged, the deadline moved;
/// `late`: acknowledged after the deadline, the lease is lost; `failed`: not acknowledged;
/// `not_held`: the server no longer holds the lease).
pub const RENEWALS_TOTAL: &str = "lockkit_renewals_total";
/// Counter: leases lost other than by their holder (release and drop are not counted). Labels:
/// `backend`, `reason` ([`LossReason::as_str`](crate::LossReason::as_str)).
pub const LEASES_LOST_TOTAL: &str = "lockkit_leases_lost_total";
/// Gauge: leases currently held by this process (granted, not yet lost, released, dropped or
/// leaked). Labels: `backend`.
pub const LEASES_HELD: &str = "lockkit_leases_held";
/// Histogram, seconds: how long each lease was held, from its grant to its release, drop, leak
/// or loss. Labels: `backend`.
pub const LEASE_HOLD_SECONDS: &str = "lockkit_lease_hold_duration_seconds";

/// Every metric name above, for tests and dashboards.
pub const METRIC_NAMES: [&str; 7] = [
    ACQUIRE_DURATION_SECONDS,
    ACQUIRE_WAIT_SECONDS,
    ACQUIRES_TOTAL,
    RENEWALS_TOTAL,
    LEASES_LOST_TOTAL,
    LEASES_HELD,
    LEASE_HOLD_SECONDS,
];

/// The tracing target of every span and event lockkit's core emits (`RUST_LOG=lockkit=debug`).
pub const TARGET: &str = "lockkit";

/// Registers units and help texts of every lockkit metric with the installed recorder. Optional:
/// metrics are recorded without it, but exporters then show no help and no unit.
pub fn describe_metrics() {
    metrics::describe_histogram!(
        ACQUIRE_DURATION_SECONDS,
        Unit::Seconds,
        "Time an acquire took, by outcome"
    );
    metrics::describe_histogram!(
        ACQUIRE_WAIT_SECONDS,
        Unit::Seconds,
        "Time a granted acquire waited before sending the request that was granted"
    );
    metrics::describe_counter!(ACQUIRES_TOTAL, Unit::Count, "Acquires, by outcome");
    metrics::describe_counter!(RENEWALS_TOTAL, Unit::Count, "Lease renewals, by result");
    metrics::describe_counter!(
        LEASES_LOST_TOTAL,
        Unit::Count,
        "Leases lost other than by release or drop, by reason"
    );
    metrics::describe_gauge!(LEASES_HELD, Unit::Count, "Leases currently held");
    metrics::describe_histogram!(
        LEASE_HOLD_SECONDS,
        Unit::Seconds,
        "Time each lease was held"
    );
}

/// The labels every metric of one acquire or lease carries.
#[derive(Debug, Clone)]
pub(crate) struct Labels {
    pub(crate) backend: &'static str,
    /// The lock name, when the acquire opted in.
    lock: Option<Arc<str>>,
}

impl Labels {
    pub(crate) fn new(backend: &'static str, name: &str, with_name: bool) -> Self {
        Self {
            backend,
            lock: with_name.then(|| Arc::from(name)),
        }
    }

    fn base(&self) -> Vec<Label> {
        let mut v = Vec::with_capacity(3);
        v.push(Label::from_static_parts("backend", self.backend));
        if let Some(l) = &self.lock {
            v.push(Label::new("lock", l.to_string()));
        }
        v
    }

    fn with(&self, key: &'static str, value: &'static str) -> Vec<Label> {
        let mut v = self.base();
        v.push(Label::from_static_parts(key, value));
        v
    }

    pub(crate) fn acquired(&self, outcome: &'static str, took: Duration, wait: Option<Duration>) {
        metrics::counter!(ACQUIRES_TOTAL, self.with("outcome", outcome)).increment(1);
        metrics::histogram!(ACQUIRE_DURATION_SECONDS, self.with("outcome", outcome))
            .record(took.as_secs_f64());
        if let Some(w) = wait {
            metrics::histogram!(ACQUIRE_WAIT_SECONDS, self.base()).record(w.as_secs_f64());
        }
    }

    pub(crate) fn renewal(&self, result: &'static str) {
        metrics::counter!(RENEWALS_TOTAL, self.with("result", result)).increment(1);
    }

    pub(crate) fn granted(&self) {
        metrics::gauge!(LEASES_HELD, self.base()).increment(1.0);
    }

    /// The lease ended: `lost` is the reason when it was lost other than by its holder.
    pub(crate) fn ended(&self, held: Duration, lost: Option<&'static str>) {
        metrics::gauge!(LEASES_HELD, self.base()).decrement(1.0);
        metrics::histogram!(LEASE_HOLD_SECONDS, self.base()).record(held.as_secs_f64());
        if let Some(reason) = lost {
            metrics::counter!(LEASES_LOST_TOTAL, self.with("reason", reason)).increment(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::sync::Arc;

    use tokio::time::Instant;

    use super::testing::{DebugValue, Recorded, keys, value};
    use super::*;
    use crate::{AcquireOptions, Error, Lock, LockExt, LossReason, MemoryLock, Wait};

    fn paused_runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
    }

    /// Runs `f` on a paused current-thread runtime with a local debugging recorder.
    fn recorded<T>(f: impl std::future::Future<Output = T>) -> (T, Recorded) {
        testing::recorded(&paused_runtime(), f)
    }

    #[test]
    fn every_outcome_and_end_is_counted_with_low_cardinality_labels() {
        let ((), m) = recorded(async {
            let locks = MemoryLock::new();
            let ttl = Duration::from_secs(3);
            let a = locks.try_acquire("a", ttl).await.unwrap();
            assert!(matches!(
                locks.try_acquire("a", ttl).await,
                Err(Error::Held { .. })
            ));
            assert!(matches!(
                locks
                    .acquire_timeout("a", ttl, Duration::from_millis(100))
                    .await,
                Err(Error::Timeout { .. })
            ));
            assert!(matches!(
                locks.try_acquire("", ttl).await,
                Err(Error::InvalidName { .. })
            ));
            a.renew().await.unwrap();
            a.release().await.unwrap();
            // Lost to the deadline: a manual lease nobody renews.
            let b = locks
                .acquire("b", AcquireOptions::new().ttl(ttl).keepalive(false))
                .await
                .unwrap();
            b.lost().await;
            assert_eq!(b.loss_reason(), Some(LossReason::DeadlineExpired));
            drop(b);
            // A dropped acquire future.
            let c = locks.try_acquire("c", ttl).await.unwrap();
            let waiting = locks.acquire("c", AcquireOptions::new().ttl(ttl).wait(Wait::Forever));
            tokio::select! {
                _ = waiting => panic!("granted while held"),
                _ = tokio::time::sleep(Duration::from_millis(10)) => {}
            }
            drop(c);
            tokio::task::yield_now().await;
        });
        let expected: BTreeSet<String> = [
            "lockkit_acquires_total{backend=memory,outcome=granted}",
            "lockkit_acquires_total{backend=memory,outcome=held}",
            "lockkit_acquires_total{backend=memory,outcome=timeout}",
            "lockkit_acquires_total{backend=memory,outcome=error}",
            "lockkit_acquires_total{backend=memory,outcome=cancelled}",
            "lockkit_acquire_duration_seconds{backend=memory,outcome=granted}",
            "lockkit_acquire_duration_seconds{backend=memory,outcome=held}",
            "lockkit_acquire_duration_seconds{backend=memory,outcome=timeout}",
            "lockkit_acquire_duration_seconds{backend=memory,outcome=error}",
            "lockkit_acquire_duration_seconds{backend=memory,outcome=cancelled}",
            "lockkit_acquire_wait_seconds{backend=memory}",
            "lockkit_renewals_total{backend=memory,result=ok}",
            "lockkit_leases_lost_total{backend=memory,reason=deadline_expired}",
            "lockkit_leases_held{backend=memory}",
            "lockkit_lease_hold_duration_seconds{backend=memory}",
        ]
        .into_iter()
        .map(String::from)
        .collect();
        assert_eq!(keys(&m), expected);
        assert!(matches!(
            value(&m, "lockkit_acquires_total{backend=memory,outcome=granted}"),
            Some(DebugValue::Counter(3))
        ));
        assert!(matches!(
            value(&m, "lockkit_leases_held{backend=memory}"),
            Some(DebugValue::Gauge(g)) if g.0 == 0.0
        ));
        assert!(matches!(
            value(&m, "lockkit_lease_hold_duration_seconds{backend=memory}"),
            Some(DebugValue::Histogram(h)) if h.len() == 3
        ));
        for name in keys(&m) {
            assert!(
                METRIC_NAMES
                    .iter()
                    .any(|n| name.starts_with(&format!("{n}{{"))),
                "{name} is not documented in METRIC_NAMES"
            );
        }
    }

    #[test]
    fn lock_label_only_when_asked_for() {
        let ((), m) = recorded(async {
            let locks = MemoryLock::new();
            let opts = AcquireOptions::new().wait(Wait::No).lock_name_label(true);
            locks
                .acquire("named", opts)
                .await
                .unwrap()
                .release()
                .await
                .unwrap();
            locks
                .try_acquire("anonymous", Duration::from_secs(3))
                .await
                .unwrap()
                .release()
                .await
                .unwrap();
        });
        let keys = keys(&m);
        assert!(keys.contains("lockkit_acquires_total{backend=memory,lock=named,outcome=granted}"));
        assert!(keys.contains("lockkit_leases_held{backend=memory,lock=named}"));
        assert!(keys.contains("lockkit_acquires_total{backend=memory,outcome=granted}"));
        assert!(!keys.iter().any(|k| k.contains("anonymous")), "{keys:?}");
    }

    #[test]
    fn renewal_results_and_loss_reasons_are_typed() {
        use crate::backend::{LeaseOps, SuspectReason, TrackerHandle};
        use crate::{FencingToken, Lease, LeaseState};

        #[derive(Debug)]
        struct Gone;
        #[async_trait::async_trait]
        impl LeaseOps for Gone {
            async fn renew(&self, _ttl: Duration) -> crate::Result<()> {
                Err(Error::NotHeld { name: "g".into() })
            }
            async fn release(&self) -> crate::Result<()> {
                Err(Error::NotHeld { name: "g".into() })
            }
            fn as_any(&self) -> &dyn std::any::Any {
                self
            }
        }
        async fn locks_stale() -> Lease {
            MemoryLock::new()
                .try_acquire("fenced", Duration::from_secs(3))
                .await
                .unwrap()
        }
        let ((), m) = recorded(async {
            let ttl = Duration::from_secs(3);
            let opts = AcquireOptions::new().ttl(ttl).keepalive(false);
            let tracker = TrackerHandle::new(Instant::now(), ttl);
            let lease = Lease::new(
                "g",
                FencingToken::new("memory/0/l", 1),
                tracker.clone(),
                Arc::new(Gone),
                &opts,
            );
            tracker.mark_suspect(SuspectReason::RenewalFailed);
            assert_eq!(lease.state(), LeaseState::Suspect);
            assert!(matches!(lease.renew().await, Err(Error::NotHeld { .. })));
            assert_eq!(lease.loss_reason(), Some(LossReason::NotHeldOnServer));
            match lease.renew().await {
                Err(Error::LeaseLost { name, reason }) => {
                    assert_eq!(name, "g");
                    assert_eq!(reason, LossReason::NotHeldOnServer);
                }
                other => panic!("{other:?}"),
            }
            let fenced = locks_stale().await;
            fenced.tracker_handle().mark_lost(LossReason::StaleWrite);
            fenced
                .tracker_handle()
                .mark_lost(LossReason::NotHeldOnServer);
            assert_eq!(fenced.loss_reason(), Some(LossReason::StaleWrite));
            // A late acknowledgement does not revive it, and the first reason stays.
            assert!(!tracker.confirm(Instant::now()));
            tracker.mark_lost(LossReason::SessionExpired);
            assert_eq!(lease.loss_reason(), Some(LossReason::NotHeldOnServer));
            drop(lease);

            // A renewal acknowledged after the deadline counts as late.
            let tracker = TrackerHandle::new(Instant::now(), ttl);
            let late = Lease::new(
                "late",
                FencingToken::new("memory/0/l", 2),
                tracker.clone(),
                Arc::new(Gone),
                &opts,
            );
            let sent = Instant::now();
            tokio::time::advance(ttl).await;
            assert!(!tracker.confirm(sent));
            assert_eq!(late.loss_reason(), Some(LossReason::DeadlineExpired));
            late.leak();
        });
        let keys = keys(&m);
        for k in [
            "lockkit_renewals_total{backend=unknown,result=failed}",
            "lockkit_renewals_total{backend=unknown,result=not_held}",
            "lockkit_renewals_total{backend=unknown,result=late}",
            "lockkit_leases_lost_total{backend=unknown,reason=not_held_on_server}",
            "lockkit_leases_lost_total{backend=unknown,reason=deadline_expired}",
            "lockkit_leases_lost_total{backend=memory,reason=stale_write}",
        ] {
            assert!(keys.contains(k), "{k} missing from {keys:?}");
        }
        assert!(
            !keys.iter().any(|k| k.contains("session_expired")),
            "{keys:?}"
        );
        assert!(matches!(
            value(&m, "lockkit_renewals_total{backend=unknown,result=late}"),
            Some(DebugValue::Counter(1))
        ));
    }
}
