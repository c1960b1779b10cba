//! The etcd backend of lockkit (in progress).
