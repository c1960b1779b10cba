//! The lease tracker reports each change of state before anyone who sees the new state returns,
//! exactly once, and a tracing layer that reads a lease's state while an event of it is being
//! reported does not deadlock.

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use lockkit_core::backend::{LeaseOps, SuspectReason, TrackerHandle};
use lockkit_core::observe::testing;
use lockkit_core::{
    AcquireOptions, FencingToken, Instant, Lease, LeaseState, LeaseTracker, LossReason, Result,
    async_trait,
};
use tracing::Subscriber;
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

#[derive(Debug)]
struct Noop;

#[async_trait]
impl LeaseOps for Noop {
    async fn renew(&self, _ttl: Duration) -> Result<()> {
        Ok(())
    }
    async fn release(&self) -> Result<()> {
        Ok(())
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
}

fn lease(name: &str, ttl: Duration) -> (Lease, TrackerHandle) {
    let t = TrackerHandle::new(Instant::now(), ttl);
    let opts = AcquireOptions::new().ttl(ttl).keepalive(false);
    let l = Lease::new(
        name,
        FencingToken::new(name, 1),
        t.clone(),
        Arc::new(Noop),
        &opts,
    );
    (l, t)
}

/// A layer whose on_event reads the state of the lease (as a user's "alerting" layer might).
struct ReadsState(Arc<OnceLock<LeaseTracker>>, Arc<AtomicUsize>);

impl<S: Subscriber> Layer<S> for ReadsState {
    fn on_event(&self, ev: &tracing::Event<'_>, _: Context<'_, S>) {
        if ev.metadata().target() == "lockkit"
            && let Some(t) = self.0.get()
        {
            let _ = t.state();
            self.1.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// Runs `f` on a thread with a `ReadsState` subscriber; `true` if it finished within 5 s.
fn finishes(f: impl FnOnce(&TrackerHandle) + Send + 'static) -> bool {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let slot = Arc::new(OnceLock::new());
        let seen = Arc::new(AtomicUsize::new(0));
        let sub = tracing_subscriber::registry().with(ReadsState(slot.clone(), seen.clone()));
        testing::with_subscriber(sub, || {
            let rt = runtime();
            let _g = rt.enter();
            let (l, t) = lease("reentrant", Duration::from_secs(30));
            slot.set(l.tracker().clone()).unwrap();
            f(&t);
            drop(l);
        });
        let _ = tx.send(seen.load(Ordering::SeqCst));
    });
    match rx.recv_timeout(Duration::from_secs(5)) {
        Ok(n) => {
            assert!(n > 0, "the layer saw no lockkit event");
            true
        }
        Err(_) => false,
    }
}

#[test]
fn layer_reading_state_on_loss_warning_does_not_deadlock() {
    assert!(
        finishes(|t| t.mark_lost(LossReason::NotHeldOnServer)),
        "deadlock: mark_lost's WARN -> layer -> lease.state() -> reporting lock (held by mark_lost)"
    );
}

#[test]
fn layer_reading_state_on_suspect_warning_does_not_deadlock() {
    assert!(
        finishes(|t| t.mark_suspect(SuspectReason::ConnectionLost)),
        "deadlock on the Suspect WARN"
    );
}

/// One thread moves the state (suspect/confirm, then lost) while the lease is being created;
/// threads poll state() and tasks await lost(): whoever sees Lost finds the WARN already
/// written, and it is written once.
#[test]
fn whoever_sees_the_loss_finds_its_warning_written_once() {
    let buf: Arc<Mutex<Vec<u8>>> = Arc::default();
    #[derive(Clone)]
    struct W(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for W {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let b2 = buf.clone();
    tracing_subscriber::fmt()
        .with_writer(move || W(b2.clone()))
        .with_ansi(false)
        .with_max_level(tracing::Level::DEBUG)
        .init();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let text = |b: &Arc<Mutex<Vec<u8>>>| String::from_utf8_lossy(&b.lock().unwrap()).into_owned();
    let mut duplicates = 0;
    for i in 0..100 {
        let name = format!("ham{i}");
        let needle = format!("lease on lock \"{name}\" lost");
        let t = TrackerHandle::new(Instant::now(), Duration::from_secs(30));
        // Attach racing the loss (double report?).
        let t_mark = t.clone();
        let marker = std::thread::spawn(move || {
            for _ in 0..20 {
                t_mark.mark_suspect(SuspectReason::ConnectionLost);
                t_mark.confirm(Instant::now());
            }
            t_mark.mark_lost(LossReason::NotHeldOnServer);
        });
        let _g = rt.enter();
        let opts = AcquireOptions::new()
            .ttl(Duration::from_secs(30))
            .keepalive(false);
        let l = Lease::new(
            &*name,
            FencingToken::new(&*name, 1),
            t.clone(),
            Arc::new(Noop),
            &opts,
        );
        let mut pollers = Vec::new();
        for _ in 0..4 {
            let (v, b, needle) = (l.tracker().clone(), buf.clone(), needle.clone());
            pollers.push(std::thread::spawn(move || {
                while v.state() != LeaseState::Lost {
                    std::hint::spin_loop();
                }
                assert!(
                    text(&b).contains(&needle),
                    "state() saw Lost before its WARN"
                );
            }));
        }
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let (lost, b, needle) = (l.lost(), buf.clone(), needle.clone());
            tasks.push(rt.spawn(async move {
                lost.await;
                assert!(
                    text(&b).contains(&needle),
                    "lost() resolved before its WARN"
                );
            }));
        }
        marker.join().unwrap();
        for p in pollers {
            p.join().unwrap();
        }
        rt.block_on(async {
            for t in tasks {
                tokio::time::timeout(Duration::from_secs(5), t)
                    .await
                    .expect("lost() never woke")
                    .unwrap();
            }
        });
        let n = text(&buf).matches(&needle).count();
        if n != 1 {
            duplicates += 1;
            eprintln!("{name}: the loss WARN written {n} times");
        }
        drop(l);
    }
    assert_eq!(
        duplicates, 0,
        "leases whose loss was reported more than once"
    );
}

/// The `to` field of lockkit's lease events, and a pause on the "suspect" one.
struct SlowSuspect(Arc<Mutex<Vec<String>>>, Duration);

struct To(Option<String>);

impl tracing::field::Visit for To {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "to" {
            self.0 = Some(value.to_owned());
        }
    }
    fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
}

impl<S: Subscriber> Layer<S> for SlowSuspect {
    fn on_event(&self, ev: &tracing::Event<'_>, _: Context<'_, S>) {
        if ev.metadata().target() != "lockkit" {
            return;
        }
        let mut to = To(None);
        ev.record(&mut to);
        if let Some(to) = to.0 {
            if to == "suspect" {
                // Writing this event takes as long as a loaded machine may take.
                std::thread::sleep(self.1);
            }
            self.0.lock().unwrap().push(to);
        }
    }
}

/// A Suspect reported just before the deadline, its event slow to write, is Lost by the time
/// it is written: the loss is reported too before `lost()` resolves (it resolved with no loss
/// event, CI's `observability::loss_warning_names_lock_leadership_or_permit`).
#[test]
fn a_loss_during_a_slow_suspect_report_is_reported_before_lost_resolves() {
    let ttl = Duration::from_millis(200);
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let sub = tracing_subscriber::registry().with(SlowSuspect(seen.clone(), ttl));
    testing::with_subscriber(sub, || {
        runtime().block_on(async {
            let (l, _t) = lease("slow-suspect", ttl);
            l.lost().await;
            // Before anything else looks at the lease (which would report the loss).
            assert_eq!(*seen.lock().unwrap(), ["suspect", "lost"]);
        });
    });
}
