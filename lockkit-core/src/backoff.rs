//! One backoff for every retry loop in lockkit: exponential with jitter, from backon.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};

/// Pauses between retries: exponential from `min` to `max` with jitter (backon's
/// [`ExponentialBuilder::with_jitter`]: each pause lies between 1× and 2× the current step, so
/// clients that failed together do not retry together), never ending, and [`reset`](Self::reset)
/// after a success.
///
/// Adapters use it for every retry they run themselves (release, revoke, reconnect, a waiter's
/// retries), so all backends back off alike.
///
/// ```
/// use std::time::Duration;
/// use lockkit_core::backend::Backoff;
///
/// let mut b = Backoff::new(Duration::from_millis(10), Duration::from_millis(100));
/// let first = b.next_delay();
/// assert!(first >= Duration::from_millis(10) && first <= Duration::from_millis(20));
/// for _ in 0..20 {
///     assert!(b.next_delay() <= Duration::from_millis(200));
/// }
/// b.reset();
/// assert!(b.next_delay() <= Duration::from_millis(20));
/// ```
#[derive(Debug)]
pub struct Backoff {
    builder: ExponentialBuilder,
    current: ExponentialBackoff,
    max: Duration,
}

impl Backoff {
    /// A backoff whose steps double from `min` up to `max` (`min` is raised to at least 1 ms and
    /// `max` to at least `min`); each pause is its step plus up to one step of jitter.
    pub fn new(min: Duration, max: Duration) -> Self {
        let min = min.max(Duration::from_millis(1));
        let max = max.max(min);
        let builder = ExponentialBuilder::default()
            .with_min_delay(min)
            .with_max_delay(max)
            .without_max_times()
            .with_jitter();
        Self {
            current: builder.build(),
            builder,
            max,
        }
    }

    /// The next pause (`Duration`), between the current step and twice it.
    pub fn next_delay(&mut self) -> Duration {
        // Without a retry limit the iterator never ends; `max * 2` covers the jitter bound should
        // a future backon end it anyway.
        self.current.next().unwrap_or(self.max.saturating_mul(2))
    }

    /// Starts again from the first step (after a success).
    pub fn reset(&mut self) {
        self.current = self.builder.build();
    }
}
