//! [`EtcdFence`]: writes to data kept in etcd that succeed only while the writer holds its lock.

use std::fmt;

use etcd_client::{
    Compare, CompareOp, DeleteOptions, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
    TxnOpResponse, TxnResponse,
};
use lockkit_core::{Error, FencingToken, Lease, Result};

use crate::lease::{EtcdLease, timed};

/// Fenced writes for data stored in etcd, bound to one etcd [`Lease`].
///
/// Every write is one transaction guarded by `create_revision(holder key) == token`: it applies
/// only while the lease's key exists, i.e. while this grant still holds the lock (once a key is
/// the lowest under its lock's prefix it stays the holder for as long as it exists; keys created
/// later always have larger revisions). If the lease lapsed, was released, or another client
/// holds the lock now, the write changes nothing and fails with [`Error::StaleToken`]. Unlike a
/// token comparison at a remote resource, this check is atomic with the write itself: a holder
/// that paused past its TTL cannot slip a write in.
///
/// ```no_run
/// use std::time::Duration;
/// use lockkit_core::{AcquireOptions, Lock};
/// use lockkit_etcd::{EtcdFence, EtcdLock};
///
/// # async fn f() -> lockkit_core::Result<()> {
/// let locks = EtcdLock::connect("etcd://127.0.0.1:2379").await?;
/// let lease = locks.acquire("report", AcquireOptions::new().ttl(Duration::from_secs(10))).await?;
/// EtcdFence::new(&lease)?.put("reports/today", "rows…").await?;
/// lease.release().await?;
/// # Ok(()) }
/// ```
pub struct EtcdFence<'a> {
    lease: &'a Lease,
    etcd: &'a EtcdLease,
}

impl fmt::Debug for EtcdFence<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdFence")
            .field("lease", &self.etcd)
            .finish()
    }
}

impl<'a> EtcdFence<'a> {
    /// A fence for writes made under `lease`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if `lease` was not granted by the etcd backend.
    pub fn new(lease: &'a Lease) -> Result<Self> {
        let etcd = lease
            .ops()
            .as_any()
            .downcast_ref::<EtcdLease>()
            .ok_or_else(|| Error::config("EtcdFence needs a lease granted by lockkit-etcd"))?;
        Ok(Self { lease, etcd })
    }

    /// The fencing token the writes are checked against (the holder key's create revision).
    pub fn token(&self) -> FencingToken {
        self.lease.token()
    }

    /// Puts `key = value` if the lease still holds its lock.
    ///
    /// # Errors
    /// [`Error::StaleToken`] if it does not (nothing was written); transport errors as
    /// [`Error::Unavailable`] (the write may or may not have been applied).
    ///
    /// # Cancel safety
    /// The transaction is applied entirely or not at all; a dropped call may have applied it.
    pub async fn put(&self, key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) -> Result<()> {
        let key = key.into();
        let resource = String::from_utf8_lossy(&key).into_owned();
        self.txn_for(resource, vec![TxnOp::put(key, value, None::<PutOptions>)])
            .await
            .map(|_| ())
    }

    /// Deletes `key` if the lease still holds its lock.
    ///
    /// # Errors
    /// As [`put`](Self::put).
    ///
    /// # Cancel safety
    /// As [`put`](Self::put).
    pub async fn delete(&self, key: impl Into<Vec<u8>>) -> Result<()> {
        let key = key.into();
        let resource = String::from_utf8_lossy(&key).into_owned();
        self.txn_for(resource, vec![TxnOp::delete(key, None::<DeleteOptions>)])
            .await
            .map(|_| ())
    }

    /// Runs `ops` atomically if the lease still holds its lock, and returns etcd's answer (the
    /// responses of `ops`, in order).
    ///
    /// # Errors
    /// As [`put`](Self::put); the `resource` of a [`Error::StaleToken`] is the lock key.
    ///
    /// # Cancel safety
    /// As [`put`](Self::put).
    pub async fn txn(&self, ops: Vec<TxnOp>) -> Result<TxnResponse> {
        let resource = String::from_utf8_lossy(&self.etcd.key).into_owned();
        self.txn_for(resource, ops).await
    }

    async fn txn_for(&self, resource: String, ops: Vec<TxnOp>) -> Result<TxnResponse> {
        let e = self.etcd;
        let holder = TxnOp::get(
            e.name_prefix.clone(),
            Some(
                GetOptions::new()
                    .with_prefix()
                    .with_sort(SortTarget::Create, SortOrder::Ascend)
                    .with_limit(1)
                    .with_keys_only(),
            ),
        );
        let txn = Txn::new()
            .when([Compare::create_revision(
                e.key.clone(),
                CompareOp::Equal,
                e.create_revision,
            )])
            .and_then(ops)
            .or_else([holder]);
        let mut kv = e.client.kv_client();
        let resp = timed(e.request_timeout, "a fenced write", kv.txn(txn)).await?;
        if resp.succeeded() {
            return Ok(resp);
        }
        // The current holder's token, or (lock free) the store's revision, which every later
        // holder's token will exceed.
        let current = match resp.op_responses().first() {
            Some(TxnOpResponse::Get(g)) => g.kvs().first().map(|kv| kv.create_revision()),
            _ => None,
        }
        .or_else(|| resp.header().map(|h| h.revision()))
        .unwrap_or(0);
        Err(Error::StaleToken {
            resource,
            token: self.lease.token(),
            current: FencingToken::new(u64::try_from(current).unwrap_or(0)),
        })
    }
}
