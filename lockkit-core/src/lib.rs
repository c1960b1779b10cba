//! # lockkit-core
//!
//! The stable core of [lockkit](https://docs.rs/lockkit): the [`Lock`] trait every backend
//! implements, the [`Lease`] it grants (with its [`FencingToken`], client-side [`LeaseState`] and
//! keepalive), [`AcquireOptions`], the one [`Error`] type, fences for the protected resource, the
//! in-process [`MemoryLock`] backend, and (feature `contract`) the contract suite every backend
//! passes. Leader election ([`Election`], [`Leadership`], [`Observer`]) and semaphores
//! ([`Semaphore`], [`Permit`]) are built on the same leases.
//!
//! ```
//! use std::time::Duration;
//! use lockkit_core::{AcquireOptions, Lock, LockExt, MemoryFence, MemoryLock};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> lockkit_core::Result<()> {
//! let locks = MemoryLock::new();
//! let storage = MemoryFence::new();
//!
//! let lease = locks.acquire("report", AcquireOptions::new().ttl(Duration::from_secs(10))).await?;
//! // Every write to the protected resource carries the token; the resource rejects older ones.
//! storage.write("report.csv", lease.token(), "rows…")?;
//! lease.release().await?;
//! # Ok(()) }
//! ```
//!
//! Backends build on [`backend::LockBackend`], [`Lease::new`], [`backend::TrackerHandle`] and
//! [`backend::LeaseOps`] (see [`backend`]): the core owns the deadlines, the loss signal (with its
//! [`LossReason`]), keepalive (one shared scheduler per Tokio runtime), release-on-drop, and the
//! spans, events and metrics of every acquire, renewal, release and lease state change
//! ([`observe`]; the full list is in
//! [docs/observability.md](https://example.invalid/lockkit/blob/main/docs/observability.md)), so
//! every backend behaves and reports the same.
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations)]
#![deny(rustdoc::broken_intra_doc_links)]
#![cfg_attr(docsrs, feature(doc_cfg))]

// Leader election and semaphores (docs/election-semaphore.md).
mod election;
mod memory_slots;
mod semaphore;
mod slots;

mod backoff;
mod config;
mod error;
mod fence;
mod keeper;
mod lease;
mod lock;
mod memory;
pub mod observe;
mod options;
mod token;
mod tracker;

#[cfg(feature = "contract")]
#[cfg_attr(docsrs, doc(cfg(feature = "contract")))]
pub mod contract;

#[cfg(feature = "contract")]
#[cfg_attr(docsrs, doc(cfg(feature = "contract")))]
pub mod contract_election;

pub use election::{Election, LeaderEvent, LeaderInfo, Leadership, Observer};
pub use error::{BoxError, Error, Result};
pub use fence::MemoryFence;
pub use lease::Lease;
pub use lock::{Guarantees, HolderInfo, Lock, LockExt, LockKind};
pub use memory::MemoryLock;
pub use options::{
    AcquireOptions, DEFAULT_TTL, MAX_LOCK_DELAY, MAX_NAME_BYTES, MAX_PREFIX_BYTES, MAX_RETRY_DELAY,
    MAX_TTL, MIN_TTL, RetryPolicy, Wait,
};
pub use semaphore::{Permit, Semaphore};
pub use slots::{MAX_PERMITS, MAX_VALUE_BYTES, SlotGuarantees, SlotHolder, SlotHolders};

/// For backend authors: what an adapter needs beyond the user-facing API.
///
/// A backend implements [`LockBackend`](backend::LockBackend) (which gives it [`Lock`], with
/// the core's spans and metrics around every acquire) and [`LeaseOps`](backend::LeaseOps),
/// validates input with the shared rules ([`validate_name`](backend::validate_name),
/// [`validate_ttl`](backend::validate_ttl), [`validate_prefix`](backend::validate_prefix), plus
/// [`AcquireOptions::validate`]), retries transient failures with
/// [`retry_transient`](backend::retry_transient) (and backs off in its own retry loops with
/// [`Backoff`](backend::Backoff)) and hands each grant to [`Lease::new`] with a
/// [`TrackerHandle`](backend::TrackerHandle) started at the granting request's send time; the
/// core then owns deadlines, keepalive, the loss signal, release-on-drop, the lease events and
/// metrics. Only the backend holds the `TrackerHandle`, so only it can move the deadline. A fence
/// for data kept in the backend is made from a [`Lease`] (`from_lease`, downcasting
/// [`LeaseBackendExt::ops`](backend::LeaseBackendExt::ops) with
/// [`LeaseOps::as_any`](backend::LeaseOps::as_any)) and keeps a
/// [`LeaseFence`](backend::LeaseFence), which marks the lease lost
/// ([`LossReason::StaleWrite`]) when its own write is rejected as stale; tokens carry the
/// backend's lock identity (`backend/namespace/name`).
/// `lockkit-core/src/memory.rs` is a complete backend to copy from.
///
/// Elections and semaphores: a backend implements [`SlotBackend`](backend::SlotBackend) (grant
/// one of N slots with a value, read the holders, watch them, and a
/// [`SlotOps`](backend::SlotOps) handle to change a value) and gets [`Election`] and
/// [`Semaphore`] from the core; `lockkit-core/src/memory_slots.rs` is the example, and
/// [docs/election-semaphore.md](https://example.invalid/lockkit/blob/main/docs/election-semaphore.md)
/// the design.
///
/// The connection-URL grammar all backends share lives here too: [`BackendUrl`](backend::BackendUrl)
/// (its docs give the rules and the shared parameter names).
pub mod backend {
    // Elections and semaphores.
    pub use crate::slots::{
        SlotBackend, SlotGrant, SlotKind, SlotOps, SlotRequest, SlotWatch, WatchEvent,
        validate_permits, validate_slot_name, validate_value,
    };
    pub use crate::{SlotGuarantees, SlotHolder, SlotHolders};

    pub use crate::backoff::Backoff;
    #[cfg(feature = "serde")]
    #[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
    pub use crate::config::deserialize_url;
    pub use crate::config::{
        BackendUrl, CommonParams, HostPort, MAX_EXCERPT_CHARS, MAX_PEM_BYTES, MAX_URL_BYTES,
        Secret, TlsOptions, excerpt, parse_duration, parse_host_port, read_pem,
    };
    #[cfg(feature = "rustls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "rustls")))]
    pub use crate::config::{TlsFailure, tls_failure};
    pub use crate::fence::LeaseFence;
    pub use crate::lease::LeaseBackendExt;
    pub use crate::lock::{LockBackend, retry_transient, wait_deadline};
    pub use crate::options::{validate_name, validate_prefix, validate_ttl};
    pub use crate::tracker::{LeaseOps, SuspectReason, TrackerHandle};
    /// The serde version lockkit's configs implement `Deserialize` of (feature `serde`).
    #[cfg(feature = "serde")]
    #[doc(hidden)]
    pub use serde;
}
pub use token::{FencingToken, MAX_LOCK_ID_BYTES};
pub use tracker::{LeaseState, LeaseTracker, LossReason, drift_margin};

/// Locks `m`, ignoring poisoning. For the crate's mutexes, whose data is consistent at every
/// point where a panic could occur.
pub(crate) fn lock_unpoisoned<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

// Re-exported so adapters and users name one version of these.
pub use async_trait::async_trait;
pub use tokio::time::Instant;
