//! The spans and events of one lease's life, as a subscriber sees them.
//!
//! A test binary of its own: tracing caches each callsite's interest process-wide, and in the
//! unit-test binary other tests hitting the same callsites on other threads, with no subscriber,
//! made this capture miss spans now and then (7 of 40 runs).

use std::time::Duration;

use lockkit_core::observe::testing;
use lockkit_core::{AcquireOptions, Lock, LockExt, MemoryLock};

fn paused_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap()
}

#[test]
fn spans_record_outcome_and_token_and_events_name_the_lock() {
    let ((), text) = testing::traced(&paused_runtime(), async {
        let locks = MemoryLock::new();
        let ttl = Duration::from_secs(3);
        let lease = locks
            .acquire("spanned", AcquireOptions::new().ttl(ttl).keepalive(false))
            .await
            .unwrap();
        let _ = locks.try_acquire("spanned", ttl).await;
        lease.renew().await.unwrap();
        lease.lost().await;
        let _ = lease.release().await;
    });
    // The span's close line, or the event's line: the first line with every needle.
    let line = |needle: &str| {
        text.lines()
            .find(|l| {
                l.contains(needle)
                    && ![": new", ": enter", ": exit"]
                        .iter()
                        .any(|e| l.ends_with(e))
            })
            .unwrap_or_else(|| panic!("no line with {needle:?} in:\n{text}"))
            .to_owned()
    };
    let granted = line("outcome=\"granted\"");
    assert!(
        granted.contains("acquire{lock=spanned backend=\"memory\" wait=forever"),
        "{granted}"
    );
    assert!(granted.contains("token=1"), "{granted}");
    assert!(line("outcome=\"held\"").contains("wait=no"));
    assert!(line("renew{").contains("outcome=\"ok\""), "{text}");
    let lost = line("reason=\"deadline_expired\"");
    assert!(
        lost.contains("WARN") && lost.contains("lock=\"spanned\""),
        "{lost}"
    );
    assert!(lost.contains("from=\"suspect\" to=\"lost\""), "{lost}");
    assert!(line("reason=\"renewal_overdue\"").contains("to=\"suspect\""));
}
