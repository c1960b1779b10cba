//! ZooKeeper backend: the contract suite against the shared server (`LOCKKIT_ZK_URL`), bad
//! connects, and ZooKeeper's own failure modes through a test proxy (session expiry of a frozen
//! holder, a create whose reply is lost, the herd check).

mod contract {
    use std::time::Duration;

    use crate::common::UrlHarness;

    fn harness() -> UrlHarness {
        let mut h = UrlHarness::from_env("LOCKKIT_ZK_URL");
        // The shared server's minSessionTimeout is 1 s; 2 s leaves room for tick rounding.
        h.short_ttl = Duration::from_secs(2);
        h.tolerance = Duration::from_secs(2);
        h
    }

    lockkit::contract_suite!(harness());
}

mod ensemble;
mod failures;
mod fence;
mod private;
mod server;
