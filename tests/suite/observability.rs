//! Every backend reports the same: one sequence of acquires, renewal, release and loss must
//! record the same metric names and labels on the in-memory backend and on every server backend
//! compiled in; and no span or event carries a password from the URL.
//!
//! Each run uses its own current-thread runtime with a thread-local recorder
//! (`metrics::with_local_recorder`) and a thread-local subscriber, so tests running in parallel
//! in this binary never see each other's metrics or spans.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use lockkit::observe::testing::{DebugValue, Recorded, keys, recorded, value};
use lockkit::{AcquireOptions, Lock, LockExt, LossReason, MemoryLock, Wait};

use crate::common::wait_until;
#[cfg(any(
    feature = "redis",
    feature = "etcd",
    feature = "zk",
    feature = "postgres"
))]
use crate::common::{fresh_prefix, proxy::Proxy, server_url, with_prefix};

const TTL: Duration = Duration::from_secs(2);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// Runs `f` on a fresh current-thread runtime with a local debugging recorder; returns every
/// metric recorded, keyed `name{label=value,…}` with sorted labels.
fn record(f: impl std::future::Future<Output = ()>) -> Recorded {
    recorded(&runtime(), f).1
}

/// How many renewals `backend` counted as `ok`: the keepalive's (core's loop, or the etcd and
/// ZooKeeper session's) and the manual one of [`sequence`].
fn ok_renewals(m: &Recorded, backend: &str) -> u64 {
    match value(
        m,
        &format!("lockkit_renewals_total{{backend={backend},result=ok}}"),
    ) {
        Some(DebugValue::Counter(n)) => *n,
        other => panic!("{backend}: no ok renewal counter: {other:?}"),
    }
}

/// The sequence: granted, held (another client), timeout, a keepalive renewal, a manual renewal,
/// a release, and a lease lost to its deadline (the network frozen by `freeze`, or for the in-memory backend a
/// lease nobody renews).
async fn sequence(a: Arc<dyn Lock>, b: Arc<dyn Lock>, freeze: Option<&dyn Fn()>) {
    let name = format!("obs-{:08x}", rand::random::<u32>());
    let lease = a.try_acquire(&name, TTL).await.expect("granted");
    assert!(matches!(
        b.try_acquire(&name, TTL).await,
        Err(lockkit::Error::Held { .. })
    ));
    assert!(matches!(
        b.acquire_timeout(&name, TTL, Duration::from_millis(300))
            .await,
        Err(lockkit::Error::Timeout { .. })
    ));
    let granted = lease.tracker().confirmed_at();
    let tracker = lease.tracker().clone();
    wait_until("a keepalive renewal", TTL, || {
        tracker.confirmed_at() > granted
    })
    .await;
    lease.renew().await.expect("renew");
    lease.release().await.expect("release");

    let opts = AcquireOptions::new().ttl(TTL).wait(Wait::No);
    let opts = if freeze.is_some() {
        opts
    } else {
        opts.keepalive(false)
    };
    let doomed = a
        .acquire(&format!("{name}-lost"), opts)
        .await
        .expect("granted");
    if let Some(freeze) = freeze {
        freeze();
    }
    tokio::time::timeout(TTL * 3, doomed.lost())
        .await
        .expect("the lease is lost within its TTL once nothing renews it");
    assert_eq!(doomed.loss_reason(), Some(LossReason::DeadlineExpired));
    doomed.leak();
}

/// The keys with the `backend` label removed; every key must carry `backend=<backend>`.
fn without_backend(keys: &BTreeSet<String>, backend: &str) -> BTreeSet<String> {
    let label = format!("backend={backend}");
    keys.iter()
        .map(|k| {
            assert!(k.contains(&label), "{k} lacks {label}");
            k.replace(&format!("{label},"), "")
                .replace(&format!(",{label}"), "")
                .replace(&label, "")
        })
        .collect()
}

/// What the memory backend records for [`sequence`]; the contract for the others.
fn expected() -> BTreeSet<String> {
    [
        "lockkit_acquires_total{outcome=granted}",
        "lockkit_acquires_total{outcome=held}",
        "lockkit_acquires_total{outcome=timeout}",
        "lockkit_acquire_duration_seconds{outcome=granted}",
        "lockkit_acquire_duration_seconds{outcome=held}",
        "lockkit_acquire_duration_seconds{outcome=timeout}",
        "lockkit_acquire_wait_seconds{}",
        "lockkit_renewals_total{result=ok}",
        "lockkit_leases_lost_total{reason=deadline_expired}",
        "lockkit_leases_held{}",
        "lockkit_lease_hold_duration_seconds{}",
    ]
    .into_iter()
    .map(String::from)
    .collect()
}

#[test]
fn memory_records_the_documented_metrics() {
    let m = record(async {
        let locks: Arc<dyn Lock> = Arc::new(MemoryLock::new());
        sequence(locks.clone(), locks, None).await;
    });
    assert_eq!(without_backend(&keys(&m), "memory"), expected());
    assert!(ok_renewals(&m, "memory") >= 2);
}

/// Runs [`sequence`] against the shared server in `var` (`host:port` after `scheme://`) through
/// a proxy that can freeze the network, and compares with the memory backend's keys.
#[cfg(any(
    feature = "redis",
    feature = "etcd",
    feature = "zk",
    feature = "postgres"
))]
fn same_metrics_as_memory(var: &str, backend: &str) {
    let url = server_url(var);
    let m = record(async {
        let (scheme, rest) = url.split_once("://").expect("scheme");
        let (auth, rest) = match rest.rsplit_once('@') {
            Some((a, r)) => (format!("{a}@"), r),
            None => (String::new(), rest),
        };
        let (hostport, path) = match rest.split_once('/') {
            Some((h, p)) => (h, format!("/{p}")),
            None => (rest, String::new()),
        };
        let proxy = Proxy::start(hostport.to_owned()).await;
        let prefix = fresh_prefix();
        let via = with_prefix(
            &format!("{scheme}://{auth}127.0.0.1:{}{path}", proxy.port),
            &prefix,
        );
        let a = lockkit::connect(&via).await.expect("connect via proxy");
        let b = lockkit::connect(&with_prefix(&url, &prefix))
            .await
            .expect("connect");
        let freeze = || proxy.freeze();
        sequence(a, b, Some(&freeze)).await;
    });
    let n = ok_renewals(&m, backend);
    assert!(
        n >= 2,
        "{backend}: {n} ok renewals, expected the keepalive's and the manual one"
    );
    let mut got = without_backend(&keys(&m), backend);
    // A renewal attempt that fails while the network is frozen is counted (result=failed) on
    // backends whose client gives up on a request before the lease's deadline; whether one does
    // depends on timing, so it is not part of the comparison.
    got.remove("lockkit_renewals_total{result=failed}");
    assert_eq!(
        got,
        expected(),
        "{backend} records other metrics than memory"
    );
}

#[cfg(feature = "redis")]
#[test]
fn redis_records_the_same_metrics_as_memory() {
    same_metrics_as_memory("LOCKKIT_REDIS_URL", "redis");
}

#[cfg(feature = "etcd")]
#[test]
fn etcd_records_the_same_metrics_as_memory() {
    same_metrics_as_memory("LOCKKIT_ETCD_URL", "etcd");
}

#[cfg(feature = "zk")]
#[test]
fn zk_records_the_same_metrics_as_memory() {
    same_metrics_as_memory("LOCKKIT_ZK_URL", "zk");
}

#[cfg(feature = "postgres")]
#[test]
fn postgres_records_the_same_metrics_as_memory() {
    same_metrics_as_memory("LOCKKIT_POSTGRES_URL", "postgres");
}

#[test]
fn lock_label_is_opt_in() {
    let keys = keys(&record(async {
        let locks = MemoryLock::new();
        let opts = AcquireOptions::new().wait(Wait::No);
        let named = locks
            .acquire("labelled", opts.clone().lock_name_label(true))
            .await
            .unwrap();
        named.release().await.unwrap();
        locks
            .acquire("plain", opts)
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    }));
    assert!(keys.contains("lockkit_acquires_total{backend=memory,lock=labelled,outcome=granted}"));
    assert!(keys.contains("lockkit_acquires_total{backend=memory,outcome=granted}"));
    assert!(!keys.iter().any(|k| k.contains("plain")), "{keys:?}");
}

/// The password of a URL that had one is in no span field and no event, whether the
/// connection is accepted (PostgreSQL trusts local connections: the password is ignored) or
/// refused (Redis has no password set).
#[cfg(all(feature = "postgres", feature = "redis"))]
#[test]
fn spans_carry_no_password_from_the_url() {
    const SECRET: &str = "pw-5ecr3t-in-url";
    let pg =
        server_url("LOCKKIT_POSTGRES_URL").replacen("postgres@", &format!("postgres:{SECRET}@"), 1);
    assert!(pg.contains(SECRET), "{pg}");
    let redis =
        server_url("LOCKKIT_REDIS_URL").replacen("redis://", &format!("redis://:{SECRET}@"), 1);
    let ((), text) = lockkit::observe::testing::traced(&runtime(), async {
        let locks = lockkit::connect(&with_prefix(&pg, &fresh_prefix()))
            .await
            .expect("connect with a password PostgreSQL ignores");
        let lease = locks.try_acquire("no-secret", TTL).await.expect("acquire");
        lease.renew().await.expect("renew");
        lease.release().await.expect("release");
        // The wrong password is refused, at connect or at the first command.
        let refused = match lockkit::connect(&redis).await {
            Err(e) => e,
            Ok(l) => l
                .try_acquire("no-secret", TTL)
                .await
                .expect_err("Redis has no password: AUTH fails"),
        };
        let shown = format!("{refused} {refused:?} {refused:#}");
        assert!(!shown.contains(SECRET), "{shown}");
    });
    // The capture works: the spans are there, with their fields.
    assert!(
        text.contains("acquire{lock=no-secret backend=\"postgres\""),
        "no acquire span captured:\n{text}"
    );
    assert!(text.contains("renew{"), "no renew span:\n{text}");
    assert!(text.contains("release{"), "no release span:\n{text}");
    let leaks: Vec<&str> = text.lines().filter(|l| l.contains(SECRET)).collect();
    assert!(
        leaks.is_empty(),
        "the password appears in:\n{}",
        leaks.join("\n")
    );
}

/// The loss warning says what was lost: `lease on lock "x"`, `leadership of election "x"`,
/// `permit of semaphore "x"` (it said `lease on lock` for all three), here for leases of a real
/// server that lapse unrenewed.
#[cfg(feature = "postgres")]
#[test]
fn loss_warning_names_lock_leadership_or_permit() {
    use lockkit::{Election, Semaphore};
    let url = with_prefix(&server_url("LOCKKIT_POSTGRES_URL"), &fresh_prefix());
    let ((), text) = lockkit::observe::testing::traced(&runtime(), async {
        let pg = lockkit::postgres::PgLock::connect(&url)
            .await
            .expect("connect");
        let once = AcquireOptions::new()
            .ttl(Duration::from_millis(500))
            .wait(Wait::No)
            .keepalive(false);
        let lease = pg.acquire("lapse-l", once.clone()).await.expect("lock");
        let leader = pg
            .campaign("lapse-e", b"v", once.clone())
            .await
            .expect("leadership");
        let permit = pg.acquire_permit("lapse-s", 2, once).await.expect("permit");
        lease.lost().await;
        leader.lease().lost().await;
        permit.lease().lost().await;
    });
    for what in [
        "lease on lock \"lapse-l\" lost",
        "leadership of election \"lapse-e\" lost",
        "permit of semaphore \"lapse-s\" lost",
    ] {
        let line = text.lines().find(|l| l.contains(what));
        assert!(
            line.is_some_and(|l| l.contains("WARN")),
            "no warning {what:?}; the lines about these leases:\n{}",
            text.lines()
                .filter(|l| l.contains("lapse-"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}
