//! The integration suite: the contract suite against every backend compiled in, plus each
//! backend's own failure tests, against real servers.
//!
//! Shared servers come from `scripts/servers.sh` (see `scripts/test.sh`), which exports
//! `LOCKKIT_{REDIS,ETCD,ZK,POSTGRES}_URL`. Tests that kill, pause or restart a server start a
//! private instance of their own (`common::*`).

mod common;
mod memory;
mod observability;
/// TLS needs a network backend.
#[cfg(any(
    feature = "etcd",
    feature = "postgres",
    feature = "redis",
    feature = "zk"
))]
mod tls;
mod urls;

#[cfg(feature = "etcd")]
mod etcd;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redis")]
mod redis;
#[cfg(feature = "zk")]
mod zk;
