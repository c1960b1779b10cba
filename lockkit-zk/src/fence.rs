//! A fence for data kept in ZooKeeper itself.

use lockkit_core::{Error, FencingToken, Lease, Result};
use zookeeper_client as zk;

use crate::ZkLock;
use crate::error::from_zk;
use crate::lease::ZkLease;

/// Fenced writes to nodes of your own: each write is one
/// [multi-op](https://zookeeper.apache.org/doc/r3.8.0/zookeeperProgrammers.html#ch_zkDataModel)
/// transaction `check(lock node, version 0) + setData/create(path)`, so it is applied only if the
/// lease's own lock node still exists, that is, only while the lease holds the lock. A holder that
/// paused past its session's expiry wakes up to [`Error::StaleToken`], whatever it believes.
///
/// The check runs on the server, atomically with the write; it does not depend on the writer's
/// clock or on the lease's session being alive (writes go through a session of their own).
///
/// ```no_run
/// use std::time::Duration;
/// use lockkit_core::{Lock, LockExt};
/// use lockkit_zk::ZkLock;
///
/// # async fn f() -> lockkit_core::Result<()> {
/// let locks = ZkLock::connect("zk://127.0.0.1:2181").await?;
/// let fence = locks.fence();
/// let lease = locks.try_acquire("config-writer", Duration::from_secs(10)).await?;
/// fence.write(&lease, "/app-config", b"v2").await?; // Err(StaleToken) once the lease is gone
/// lease.release().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct ZkFence {
    lock: ZkLock,
}

impl ZkFence {
    pub(crate) fn new(lock: ZkLock) -> Self {
        Self { lock }
    }

    /// Writes `data` to the node `path` (below the chroot), creating it as a persistent node if
    /// it does not exist (its parent must exist), if and only if `lease` still holds its lock.
    ///
    /// # Errors
    /// - [`Error::StaleToken`] if the lease's lock node is gone (the lease lapsed; another holder
    ///   may have the lock). Nothing was written. `current` is the current holder's token if
    ///   there is one, else the lease's own.
    /// - [`Error::InvalidConfig`] if `lease` is not a ZooKeeper lease.
    /// - [`Error::Unavailable`] and others from the server. On a lost connection the write may or
    ///   may not have been applied (it was applied only if the lease held the lock).
    ///
    /// # Cancel safety
    /// Cancel safe in the same sense: a dropped write was applied entirely or not at all.
    pub async fn write(&self, lease: &Lease, path: &str, data: &[u8]) -> Result<()> {
        let zl = zk_lease(lease)?;
        let session = self.lock.control_session().await?;
        let mut create = false;
        for _ in 0..4 {
            let mut w = session
                .client
                .new_check_writer(&zl.path, Some(0))
                .map_err(bad_path)?;
            if create {
                let mode = zk::CreateMode::Persistent.with_acls(session.own_acls());
                w.add_create(path, data, &mode).map_err(bad_path)?;
            } else {
                w.add_set_data(path, data, None).map_err(bad_path)?;
            }
            match w.commit().await {
                Ok(_) => return Ok(()),
                Err(zk::CheckWriteError::CheckFailed {
                    source: zk::Error::NoNode | zk::Error::BadVersion,
                }) => {
                    let current = self.current_token(zl).await.unwrap_or(lease.token());
                    return Err(Error::StaleToken {
                        resource: path.to_owned(),
                        token: lease.token(),
                        current,
                    });
                }
                Err(zk::CheckWriteError::OperationFailed {
                    source: zk::Error::NoNode,
                    ..
                }) if !create => create = true,
                Err(zk::CheckWriteError::OperationFailed {
                    source: zk::Error::NodeExists,
                    ..
                }) if create => create = false,
                Err(
                    zk::CheckWriteError::CheckFailed { source }
                    | zk::CheckWriteError::OperationFailed { source, .. }
                    | zk::CheckWriteError::RequestFailed { source },
                ) => return Err(from_zk(source)),
            }
        }
        Err(Error::Backend {
            backend: crate::error::BACKEND,
            source: "the fenced node kept being created and deleted concurrently".into(),
        })
    }

    /// Reads the node `path` (reads are not fenced). `None` if it does not exist.
    ///
    /// # Errors
    /// [`Error::Unavailable`] if no answer came within the connect timeout; others from the
    /// server.
    ///
    /// # Cancel safety
    /// Cancel safe (a read).
    pub async fn read(&self, path: &str) -> Result<Option<Vec<u8>>> {
        self.lock
            .bounded(async {
                let session = self.lock.control_session().await?;
                match session.client.get_data(path).await {
                    Ok((data, _)) => Ok(Some(data)),
                    Err(zk::Error::NoNode) => Ok(None),
                    Err(e @ zk::Error::BadArguments(_)) => Err(bad_path(e)),
                    Err(e) => Err(from_zk(e)),
                }
            })
            .await
    }

    /// The token of the lock's current holder (lowest node), if any.
    async fn current_token(&self, zl: &ZkLease) -> Option<FencingToken> {
        let (dir, _) = zl.path.rsplit_once('/')?;
        let session = self.lock.control_session().await.ok()?;
        let children = session.client.list_children(dir).await.ok()?;
        let lowest = children
            .iter()
            .filter_map(|c| {
                c.rsplit_once("-lock-")
                    .map(|(_, s)| (s.parse::<i64>().ok(), c))
            })
            .filter_map(|(s, c)| s.map(|s| (s, c)))
            .min()?;
        let stat = session
            .client
            .check_stat(&format!("{dir}/{}", lowest.1))
            .await
            .ok()??;
        u64::try_from(stat.czxid).ok().map(FencingToken::new)
    }
}

fn zk_lease(lease: &Lease) -> Result<&ZkLease> {
    lease
        .ops()
        .as_any()
        .downcast_ref::<ZkLease>()
        .ok_or_else(|| Error::config("ZkFence needs a lease granted by a ZkLock"))
}

fn bad_path(e: zk::Error) -> Error {
    Error::config_with("invalid ZooKeeper node path for a fenced write", e)
}
