//! The redis backend of lockkit (in progress).
