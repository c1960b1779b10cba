//! The postgres backend of lockkit (in progress).
