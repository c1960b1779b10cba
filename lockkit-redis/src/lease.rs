//! The [`LeaseOps`] of a Redis grant ([`RedisLease`]): renew is compare-and-pexpire and
//! release compare-and-delete on the owner value, with the scripts of [`crate::core`].

use std::any::Any;
use std::time::Duration;

use async_trait::async_trait;

use lockkit_core::Result;
use lockkit_core::backend::LeaseOps;

use crate::core::{RENEW, RedisLease, compare_and_delete, holds, ttl_millis};
use crate::error::{bad_reply, from_redis};

#[async_trait]
impl LeaseOps for RedisLease {
    async fn renew(&self, ttl: Duration) -> Result<()> {
        let n: i64 = self
            .conn
            .invoke(
                RENEW
                    .key(&self.keys.lock)
                    .arg(&self.owner)
                    .arg(ttl_millis(ttl)),
            )
            .await
            .map_err(from_redis)?;
        match n {
            1 => Ok(()),
            0 => Err(self.not_held()),
            _ => Err(bad_reply("renew")),
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
        if compare_and_delete(&self.conn, &self.keys, &self.owner).await? {
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
