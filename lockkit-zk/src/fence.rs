//! [`ZkFence`]: writes to data kept in ZooKeeper itself that succeed only while the writer holds
//! its lock.

use lockkit_core::backend::LeaseBackendExt;
use std::fmt;

use lockkit_core::backend::LeaseFence;
use lockkit_core::{Error, FencingToken, Lease, Result};
use zookeeper_client as zk;

use crate::ZkLock;
use crate::config::encode_name;
use crate::core::sorted_children;
use crate::error::from_zk;
use crate::lease::ZkLease;
use crate::session::shared_acls;

/// Fenced writes to nodes of your own, made from a ZooKeeper [`Lease`] (also one obtained as
/// `Arc<dyn Lock>` from `lockkit::connect`).
///
/// Each write is one
/// [multi-op](https://zookeeper.apache.org/doc/r3.8.0/zookeeperProgrammers.html#ch_zkDataModel)
/// transaction
/// - `check(lock node, version 0)`: applied only if the lease's own lock node still exists,
///   that is, only while the lease holds the lock. A holder that paused past its session's
///   expiry wakes up to [`Error::StaleToken`], whatever it believes, and its lease becomes
///   [`Lost`](lockkit_core::LeaseState::Lost) at once.
/// - `check` (or, on the first fenced write of the node, `create`) of the node's **guard
///   record** `/{prefix}/%fence/{path, percent-encoded}` (`%` never starts a lock's node, which
///   encodes it), whose data is the identity of the lock guarding the node
///   ([`FencingToken::lock`]): a write under another lock fails with [`Error::ForeignToken`] and
///   changes nothing.
/// - `setData` (or `create`) of the node.
///
/// The checks run on the server, atomically with the write; they do not depend on the writer's
/// clock or on the lease's session being alive (writes go through a session of their own, the
/// granting [`ZkLock`]'s control session).
///
/// ```no_run
/// use std::time::Duration;
/// use lockkit_core::LockExt;
/// use lockkit_zk::{ZkFence, ZkLock};
///
/// # async fn f() -> lockkit_core::Result<()> {
/// let locks = ZkLock::connect("zk://127.0.0.1:2181").await?;
/// let lease = locks.try_acquire("config-writer", Duration::from_secs(10)).await?;
/// let fence = ZkFence::from_lease(&lease)?;
/// fence.write("/app-config", b"v2").await?; // Err(StaleToken) once the lease is gone
/// lease.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct ZkFence {
    lease: LeaseFence,
    lock: ZkLock,
    /// The lease's lock node.
    node: String,
    /// `/{prefix}`, the parent of the lock containers and of the guard records' directory.
    prefix_dir: String,
}

impl fmt::Debug for ZkFence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZkFence")
            .field("token", self.lease.token())
            .field("node", &self.node)
            .finish()
    }
}

impl ZkFence {
    /// The fence for writes made under `lease`. It keeps what it needs, so it may outlive the
    /// borrow; writes fail once the lease is gone.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if `lease` was not granted by a [`ZkLock`].
    pub fn from_lease(lease: &Lease) -> Result<Self> {
        let not_zk = || Error::config("ZkFence needs a lease granted by a ZkLock");
        let zl = lease
            .ops()
            .as_any()
            .downcast_ref::<ZkLease>()
            .ok_or_else(not_zk)?;
        let lock = zl
            .granted_by
            .downcast_ref::<ZkLock>()
            .ok_or_else(not_zk)?
            .clone();
        // `/{prefix}/{name}/{node}`.
        let prefix_dir = zl
            .path
            .rsplitn(3, '/')
            .nth(2)
            .ok_or_else(not_zk)?
            .to_owned();
        Ok(Self {
            lease: LeaseFence::new(lease),
            lock,
            node: zl.path.clone(),
            prefix_dir,
        })
    }

    /// The fencing token of the lease (its lock node's `czxid`).
    pub fn token(&self) -> &FencingToken {
        self.lease.token()
    }

    /// The path of `path`'s guard record: `path` percent-encoded as a lock name is, and `/` as
    /// `%2F` (unambiguous, since `%` itself is encoded as `%25`).
    pub fn guard_path(&self, path: &str) -> String {
        format!(
            "{}/%fence/{}",
            self.prefix_dir,
            encode_name(path).replace('/', "%2F")
        )
    }

    /// Writes `data` to the node `path` (below the chroot), creating it as a persistent node if
    /// it does not exist (its parent must exist), if and only if the lease still holds its lock
    /// and `path` is not guarded by another lock.
    ///
    /// # Errors
    /// - [`Error::StaleToken`] if the lease's lock node is gone (the lease lapsed; another holder
    ///   may have the lock). Nothing was written; the lease is now lost. `current` is the current
    ///   holder's token if there is one, else the lease's own.
    /// - [`Error::ForeignToken`] if another lock guards `path`. Nothing was written.
    /// - [`Error::InvalidConfig`] for a path ZooKeeper refuses, or a guard record's.
    /// - [`Error::Unavailable`] and others from the server. On a lost connection the write may or
    ///   may not have been applied (it was applied only if the lease held the lock).
    ///
    /// # Cancel safety
    /// Cancel safe in the same sense: a dropped write was applied entirely or not at all.
    pub async fn write(&self, path: &str, data: &[u8]) -> Result<()> {
        if path.starts_with(&format!("{}/%fence", self.prefix_dir)) {
            return Err(Error::config(
                "a fenced write cannot touch a guard record (a node under /{prefix}/%fence)",
            ));
        }
        let session = self.lock.control_session().await?;
        let guard = self.guard_path(path);
        let lock_id = self.token().lock().as_bytes();
        let own = zk::CreateMode::Persistent.with_acls(session.own_acls());
        // What we believe of the guard record (`None`: missing) and of the node.
        let mut recorded = true;
        let mut create = false;
        for _ in 0..8 {
            if recorded {
                match session.client.get_data(&guard).await {
                    Ok((owner, _)) if owner != lock_id => {
                        return Err(self.lease.foreign(path, String::from_utf8_lossy(&owner)));
                    }
                    Ok(_) => {}
                    Err(zk::Error::NoNode) => recorded = false,
                    Err(e @ zk::Error::BadArguments(_)) => return Err(bad_path(e)),
                    Err(e) => return Err(from_zk(e)),
                }
            }
            let mut w = session
                .client
                .new_check_writer(&self.node, Some(0))
                .map_err(bad_path)?;
            if recorded {
                w.add_check_version(&guard, 0).map_err(bad_path)?;
            } else {
                w.add_create(&guard, lock_id, &own).map_err(bad_path)?;
            }
            if create {
                w.add_create(path, data, &own).map_err(bad_path)?;
            } else {
                w.add_set_data(path, data, None).map_err(bad_path)?;
            }
            match w.commit().await {
                Ok(_) => return Ok(()),
                Err(zk::CheckWriteError::CheckFailed {
                    source: zk::Error::NoNode | zk::Error::BadVersion,
                }) => {
                    let current = self
                        .current_token(&session)
                        .await
                        .unwrap_or_else(|| self.token().clone());
                    return Err(self.lease.stale(path, current));
                }
                // The guard record: gone since we read it, or (creating it) its directory is
                // missing, or someone else created it first.
                Err(zk::CheckWriteError::OperationFailed {
                    index: 0,
                    source: zk::Error::NoNode | zk::Error::BadVersion,
                }) => {
                    if !recorded {
                        self.create_guard_dir(&session).await?;
                    }
                    recorded = false;
                }
                Err(zk::CheckWriteError::OperationFailed {
                    index: 0,
                    source: zk::Error::NodeExists,
                }) if !recorded => recorded = true,
                Err(zk::CheckWriteError::OperationFailed {
                    index: 1,
                    source: zk::Error::NoNode,
                }) if !create => create = true,
                Err(zk::CheckWriteError::OperationFailed {
                    index: 1,
                    source: zk::Error::NodeExists,
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
            source: "the fenced node or its guard record kept changing concurrently".into(),
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

    /// Creates `/{prefix}` and `/{prefix}/%fence` as containers open to everyone (as the lock
    /// containers are), if missing.
    async fn create_guard_dir(&self, session: &crate::session::Session) -> Result<()> {
        let mode = zk::CreateMode::Container.with_acls(shared_acls());
        let dir = format!("{}/%fence", self.prefix_dir);
        for path in [self.prefix_dir.as_str(), dir.as_str()] {
            match session.client.create(path, &[], &mode).await {
                Ok(_) | Err(zk::Error::NodeExists) => {}
                Err(e) => return Err(from_zk(e)),
            }
        }
        Ok(())
    }

    /// The token of the lock's current holder (lowest node), if any.
    async fn current_token(&self, session: &crate::session::Session) -> Option<FencingToken> {
        let (dir, _) = self.node.rsplit_once('/')?;
        let lowest = sorted_children(session, dir)
            .await
            .ok()?
            .into_iter()
            .next()?;
        let stat = session
            .client
            .check_stat(&format!("{dir}/{lowest}"))
            .await
            .ok()??;
        let czxid = u64::try_from(stat.czxid).ok()?;
        Some(FencingToken::new(self.token().lock(), czxid))
    }
}

fn bad_path(e: zk::Error) -> Error {
    Error::config_with("invalid ZooKeeper node path for a fenced write", e)
}
