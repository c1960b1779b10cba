//! PostgreSQL backend: the contract suite, bad connects, and failure tests against private
//! server instances (paused holder, killed session, server restart, cancelled waits).

mod contract {
    use crate::common::UrlHarness;
    lockkit::contract_suite!(UrlHarness::from_env("LOCKKIT_POSTGRES_URL"));
}
