//! postgres backend tests (in progress).
