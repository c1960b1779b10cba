//! `observe::testing` captures every event of its thread even when another thread, with no
//! subscriber, is the first to hit the event's callsite (tokio-rs/tracing#3611: the loss
//! warning of `observability::loss_warning_names_lock_leadership_or_permit` went missing in CI
//! when another test's lease was lost first on its own thread).
//!
//! Alone in its test binary on purpose: the bug shows only while a single `Dispatch` exists in
//! the process.

use lockkit_core::observe::testing;

fn probe() {
    tracing::warn!(target: "probe", "probed");
}

#[test]
fn an_event_first_hit_on_a_thread_without_a_subscriber_is_still_captured() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let ((), text) = testing::traced(&rt, async {
        // Another thread, with no subscriber, hits the callsite first...
        std::thread::spawn(probe).join().expect("probe thread");
        // ...then this one, whose capturing subscriber must still see it.
        probe();
    });
    assert!(
        text.contains("probed"),
        "the event was not captured:\n{text}"
    );
}
