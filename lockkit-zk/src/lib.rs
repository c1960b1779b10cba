//! The zk backend of lockkit (in progress).
