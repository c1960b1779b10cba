//! redis backend tests (in progress).
