//! Test support (feature `contract`): run a future with a local metrics recorder or a capturing
//! subscriber, to check what a backend reports.
//!
//! Both work on the current thread only (`metrics::with_local_recorder`,
//! `tracing::subscriber::with_default`), so pass a current-thread runtime: every task it runs,
//! the backend's included, then reports to them, and tests running in parallel never see each
//! other's metrics or spans.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::{Arc, Mutex, OnceLock};

pub use metrics_util::debugging::DebugValue;
use metrics_util::debugging::DebuggingRecorder;
use tokio::runtime::Runtime;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::fmt::format::FmtSpan;

/// Every metric recorded: `(key, value)`, the key written `name{label=value,…}` with the labels
/// sorted by key.
pub type Recorded = Vec<(String, DebugValue)>;

/// Runs `f` to completion on `rt` (a current-thread runtime) with a local debugging recorder;
/// returns its output and every metric recorded meanwhile.
pub fn recorded<T>(rt: &Runtime, f: impl Future<Output = T>) -> (T, Recorded) {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let out = metrics::with_local_recorder(&recorder, || rt.block_on(f));
    let metrics = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(k, _, _, v)| {
            let key = k.key();
            let mut labels: Vec<String> = key
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            labels.sort();
            (format!("{}{{{}}}", key.name(), labels.join(",")), v)
        })
        .collect();
    (out, metrics)
}

/// The keys of `m`.
pub fn keys(m: &Recorded) -> BTreeSet<String> {
    m.iter().map(|(k, _)| k.clone()).collect()
}

/// The value recorded under `key` (as [`recorded`] writes keys).
pub fn value<'a>(m: &'a Recorded, key: &str) -> Option<&'a DebugValue> {
    m.iter().find(|(k, _)| k == key).map(|(_, v)| v)
}

/// Runs `f` to completion on `rt` (a current-thread runtime) with a subscriber that writes every
/// event and every span (with its fields, at creation, enter, exit and close) at every level, as
/// plain text; returns the output of `f` and the text.
pub fn traced<T>(rt: &Runtime, f: impl Future<Output = T>) -> (T, String) {
    let out = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(out.clone())
        .with_max_level(tracing::Level::TRACE)
        .with_span_events(FmtSpan::FULL)
        .with_ansi(false)
        .finish();
    let res = with_subscriber(subscriber, || rt.block_on(f));
    let text = String::from_utf8_lossy(&crate::lock_unpoisoned(&out.0)).into_owned();
    (res, text)
}

/// Runs `f` on this thread with `subscriber` as its default, so that every event and span of
/// this thread reaches it, whatever other threads log meanwhile.
///
/// `tracing::subscriber::with_default` alone may lose events: while a single `Dispatch` exists
/// in the process, tracing-core 0.1 decides whether a callsite is wanted by asking the default
/// subscriber of whichever thread hits it first; a thread with none answers "never", cached for
/// good ([tokio-rs/tracing#3611](https://github.com/tokio-rs/tracing/issues/3611)). So this
/// keeps a second, idle `Dispatch` alive for the life of the process (which makes tracing-core
/// ask every live subscriber), and rebuilds the cache once `subscriber` is installed (for
/// callsites first hit before it existed).
pub fn with_subscriber<T>(
    subscriber: impl tracing::Subscriber + Send + Sync + 'static,
    f: impl FnOnce() -> T,
) -> T {
    static SECOND: OnceLock<tracing::Dispatch> = OnceLock::new();
    SECOND.get_or_init(|| tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default()));
    tracing::subscriber::with_default(subscriber, || {
        tracing::callsite::rebuild_interest_cache();
        f()
    })
}

/// A `MakeWriter` collecting everything a fmt subscriber writes.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        crate::lock_unpoisoned(&self.0).extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}
