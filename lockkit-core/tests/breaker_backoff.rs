//! Breaker tests (helper break1) of `backend::Backoff` on extreme inputs: no panic in library
//! code on any input (STYLE), and pauses stay within `max` × 2.

use std::time::Duration;

use lockkit_core::backend::Backoff;

fn run(min: Duration, max: Duration) -> std::thread::Result<Vec<Duration>> {
    std::panic::catch_unwind(move || {
        let mut b = Backoff::new(min, max);
        (0..200).map(|_| b.next_delay()).collect()
    })
}

#[test]
fn huge_bounds_do_not_panic() {
    let mut failed = Vec::new();
    for (min, max) in [
        (Duration::from_millis(1), Duration::MAX),
        (Duration::MAX, Duration::MAX),
        (Duration::from_secs(u64::MAX / 2), Duration::ZERO),
        (Duration::ZERO, Duration::ZERO),
    ] {
        if run(min, max).is_err() {
            failed.push(format!("Backoff::new({min:?}, {max:?})"));
        }
    }
    assert!(failed.is_empty(), "panicked: {failed:?}");
}

#[test]
fn pauses_stay_between_min_and_twice_max() {
    let (min, max) = (Duration::from_millis(5), Duration::from_millis(40));
    let got = run(min, max).expect("no panic");
    for d in got {
        assert!(d >= min && d <= max * 2, "{d:?}");
    }
}
