//! The contract suite against the in-process backend.

use std::sync::Arc;
use std::time::Duration;

use lockkit::contract::Harness;
use lockkit::{Lock, MemoryLock, async_trait};

struct MemoryHarness(MemoryLock);

#[async_trait]
impl Harness for MemoryHarness {
    async fn client(&self) -> Arc<dyn Lock> {
        // Clones share one lock table: separate clients of one "server".
        Arc::new(self.0.clone())
    }
    fn short_ttl(&self) -> Duration {
        Duration::from_millis(500)
    }
}

lockkit::contract_suite!(MemoryHarness(MemoryLock::new()));
