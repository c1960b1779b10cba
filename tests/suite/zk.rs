//! zk backend tests (in progress).
