//! The [`LeaseOps`] of a Redis grant ([`RedisLease`]): renew is compare-and-pexpire and
//! release compare-and-delete on the owner value (a release frees the lock at once, without
//! lock-delay), with the scripts of [`crate::core`].

use std::any::Any;
use std::time::Duration;

use async_trait::async_trait;

use lockkit_core::Result;
use lockkit_core::backend::LeaseOps;

use crate::core::{RedisLease, compare_and_delete, compare_and_pexpire, holds};

#[async_trait]
impl LeaseOps for RedisLease {
    async fn renew(&self, ttl: Duration) -> Result<()> {
        if compare_and_pexpire(&self.conn, &self.keys, &self.owner, ttl, self.delay).await? {
            Ok(())
        } else {
            Err(self.not_held())
        }
    }

    async fn release(&self) -> Result<()> {
        // Out of the batch first, so that no renewal of a released lease is sent, and out of
        // the loss notices, so that the release's own DEL is not taken for a loss.
        drop(self.batch.lock().unwrap_or_else(|p| p.into_inner()).take());
        drop(
            self.watched
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(),
        );
        if compare_and_delete(&self.conn, &self.keys, &self.owner, None).await? {
            Ok(())
        } else {
            Err(self.not_held())
        }
    }

    async fn relinquish(&self) -> Result<()> {
        if self.give_back_lapsed().await? {
            Ok(())
        } else {
            Err(self.not_held())
        }
    }

    async fn check(&self) -> Result<()> {
        holds(&self.conn, &self.keys.lock, &self.owner)
            .await?
            .then_some(())
            .ok_or_else(|| self.not_held())
    }

    fn self_renewing(&self) -> bool {
        self.self_renewing
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
