//! etcd backend tests (in progress).
