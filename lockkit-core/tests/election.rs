//! The election and semaphore contract suite against the in-process backend.

use std::sync::Arc;
use std::time::Duration;

use lockkit_core::contract_election::SlotHarness;
use lockkit_core::{Election, MemoryLock, Semaphore, async_trait};

struct MemoryHarness(MemoryLock);

#[async_trait]
impl SlotHarness for MemoryHarness {
    async fn election(&self) -> Arc<dyn Election> {
        // Clones share one table: separate clients of one "server".
        Arc::new(self.0.clone())
    }
    async fn semaphore(&self) -> Arc<dyn Semaphore> {
        Arc::new(self.0.clone())
    }
    fn short_ttl(&self) -> Duration {
        Duration::from_millis(500)
    }
}

lockkit_core::election_suite!(MemoryHarness(MemoryLock::new()));
