//! [`EtcdFence`]: writes to data kept in etcd that succeed only while the writer holds its lock.

use lockkit_core::backend::LeaseBackendExt;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, DeleteOptions, PutOptions, Txn, TxnOp, TxnOpResponse,
};
use lockkit_core::backend::LeaseFence;
use lockkit_core::{Error, FencingToken, Lease, Result};

use crate::core::{holder_read, timed};
use crate::lease::EtcdLease;

/// Fenced writes for data stored in etcd, made from an etcd [`Lease`] (also one obtained as
/// `Arc<dyn Lock>` from `lockkit::connect`).
///
/// Every write is one transaction guarded by
/// - `create_revision(holder key) == token`: it applies only while the lease's key exists, i.e.
///   while this grant still holds the lock (once a key is the lowest under its lock's prefix it
///   stays the holder for as long as it exists; keys created later always have larger
///   revisions). If the lease lapsed, was released, or another client holds the lock now, the
///   write changes nothing, fails with [`Error::StaleToken`], and the lease becomes
///   [`Lost`](lockkit_core::LeaseState::Lost) at once. Unlike a token comparison at a remote
///   resource, this check is atomic with the write itself: a holder that paused past its TTL
///   cannot slip a write in.
/// - the key's **guard record** `{prefix}/./fence/{key}` (`.` is never a lock name): the first
///   fenced write of a key records the lock's identity ([`FencingToken::lock`]) there, and a
///   later write under any other lock fails with [`Error::ForeignToken`], changing nothing. So
///   a key guarded by lock `X` cannot be written by the holder of lock `Y`. A fenced
///   [`delete`](Self::delete) keeps the guard record.
///
/// ```no_run
/// use std::time::Duration;
/// use lockkit_core::{AcquireOptions, Lock};
/// use lockkit_etcd::{EtcdFence, EtcdLock};
///
/// # async fn f() -> lockkit_core::Result<()> {
/// let locks = EtcdLock::connect("etcd://127.0.0.1:2379").await?;
/// let lease = locks.acquire("report", AcquireOptions::new().ttl(Duration::from_secs(10))).await?;
/// EtcdFence::from_lease(&lease)?.put("reports/today", "rows…").await?;
/// lease.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct EtcdFence {
    lease: LeaseFence,
    client: Arc<Client>,
    /// The lease's own key and its create revision (the token).
    key: Vec<u8>,
    create_revision: i64,
    /// `{prefix}/{name}/`, under which the holder is the lowest key.
    name_prefix: Vec<u8>,
    /// `{prefix}/./fence/`, to which a data key is appended for its guard record.
    guard_prefix: Vec<u8>,
    request_timeout: Duration,
}

impl fmt::Debug for EtcdFence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdFence")
            .field("token", self.lease.token())
            .field("key", &String::from_utf8_lossy(&self.key))
            .finish()
    }
}

impl EtcdFence {
    /// The fence for writes made under `lease`. It keeps what it needs (a client handle, the
    /// lease's key and token), so it may outlive the borrow; writes fail once the lease is gone.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if `lease` was not granted by the etcd backend.
    pub fn from_lease(lease: &Lease) -> Result<Self> {
        let etcd = lease
            .ops()
            .as_any()
            .downcast_ref::<EtcdLease>()
            .ok_or_else(|| Error::config("EtcdFence needs a lease granted by lockkit-etcd"))?;
        // `{prefix}/{name}/` minus `{name}/`.
        let prefix_len = etcd.name_prefix.len().saturating_sub(etcd.name.len() + 1);
        let mut guard_prefix = etcd.name_prefix[..prefix_len].to_vec();
        guard_prefix.extend_from_slice(b"./fence/");
        Ok(Self {
            lease: LeaseFence::new(lease),
            client: etcd.client.clone(),
            key: etcd.key.clone(),
            create_revision: etcd.create_revision,
            name_prefix: etcd.name_prefix.clone(),
            guard_prefix,
            request_timeout: etcd.request_timeout,
        })
    }

    /// The fencing token the writes are checked against (the holder key's create revision).
    pub fn token(&self) -> &FencingToken {
        self.lease.token()
    }

    /// The key of `key`'s guard record, which holds the identity of the lock guarding `key`.
    pub fn guard_key(&self, key: &[u8]) -> Vec<u8> {
        let mut g = self.guard_prefix.clone();
        g.extend_from_slice(key);
        g
    }

    /// Puts `key = value` if the lease still holds its lock and `key` is not guarded by another
    /// lock.
    ///
    /// # Errors
    /// [`Error::StaleToken`] if the lease no longer holds its lock (nothing was written; the lease
    /// is now lost); [`Error::ForeignToken`] if another lock guards `key`;
    /// [`Error::InvalidConfig`] if `key` is a guard record; transport errors as
    /// [`Error::Unavailable`] (the write may or may not have been applied).
    ///
    /// # Cancel safety
    /// The transaction is applied entirely or not at all; a dropped call may have applied it.
    pub async fn put(&self, key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) -> Result<()> {
        self.put_all([(key, value)]).await
    }

    /// Puts every `key = value` of `pairs` in one transaction, all or nothing, under the
    /// conditions of [`put`](Self::put) for each key.
    ///
    /// # Errors
    /// As [`put`](Self::put); the `resource` of an error is the (first offending) key.
    ///
    /// # Cancel safety
    /// As [`put`](Self::put).
    pub async fn put_all<K, V>(&self, pairs: impl IntoIterator<Item = (K, V)>) -> Result<()>
    where
        K: Into<Vec<u8>>,
        V: Into<Vec<u8>>,
    {
        let (keys, ops) = pairs
            .into_iter()
            .map(|(k, v)| {
                let k = k.into();
                (k.clone(), TxnOp::put(k, v, None::<PutOptions>))
            })
            .unzip();
        self.guarded(keys, ops).await
    }

    /// Deletes `key` if the lease still holds its lock and `key` is not guarded by another lock.
    ///
    /// # Errors
    /// As [`put`](Self::put).
    ///
    /// # Cancel safety
    /// As [`put`](Self::put).
    pub async fn delete(&self, key: impl Into<Vec<u8>>) -> Result<()> {
        let key = key.into();
        let op = TxnOp::delete(key.clone(), None::<DeleteOptions>);
        self.guarded(vec![key], vec![op]).await
    }

    /// Runs `ops` (which touch exactly `keys`) in one transaction if the lease holds its lock and
    /// every key's guard record names the lease's lock; a missing record is created in the same
    /// transaction. A record found missing, then created by someone else, is looked at again.
    async fn guarded(&self, keys: Vec<Vec<u8>>, ops: Vec<TxnOp>) -> Result<()> {
        if keys.iter().any(|k| k.starts_with(&self.guard_prefix)) {
            return Err(Error::config(
                "a fenced write cannot touch a guard record (a key under {prefix}/./fence/)",
            ));
        }
        let lock = self.lease.token().lock().to_owned();
        let guards: Vec<Vec<u8>> = keys.iter().map(|k| self.guard_key(k)).collect();
        // Whether each record is believed to exist already; first try the common case.
        let mut recorded = vec![true; keys.len()];
        for _ in 0..4 {
            let mut when = vec![Compare::create_revision(
                self.key.clone(),
                CompareOp::Equal,
                self.create_revision,
            )];
            let mut then = ops.clone();
            for (g, &known) in guards.iter().zip(&recorded) {
                if known {
                    when.push(Compare::value(g.clone(), CompareOp::Equal, lock.clone()));
                } else {
                    when.push(Compare::create_revision(g.clone(), CompareOp::Equal, 0));
                    then.push(TxnOp::put(g.clone(), lock.clone(), None::<PutOptions>));
                }
            }
            let mut otherwise = vec![holder_read(&self.name_prefix)];
            otherwise.extend(guards.iter().map(|g| TxnOp::get(g.clone(), None)));
            let txn = Txn::new().when(when).and_then(then).or_else(otherwise);
            let mut kv = self.client.kv_client();
            let resp = timed(self.request_timeout, "a fenced write", kv.txn(txn)).await?;
            if resp.succeeded() {
                return Ok(());
            }
            let answers = resp.op_responses();
            for (i, answer) in answers.iter().skip(1).enumerate() {
                let TxnOpResponse::Get(g) = answer else {
                    continue;
                };
                match g.kvs().first() {
                    Some(kv) if kv.value() != lock.as_bytes() => {
                        return Err(self.lease.foreign(
                            String::from_utf8_lossy(&keys[i]),
                            String::from_utf8_lossy(kv.value()),
                        ));
                    }
                    Some(_) => recorded[i] = true,
                    None => recorded[i] = false,
                }
            }
            // The current holder's token, or (lock free) the store's revision, which every
            // later holder's token will exceed.
            let holder = match answers.first() {
                Some(TxnOpResponse::Get(g)) => g.kvs().first().map(|kv| kv.create_revision()),
                _ => None,
            };
            if holder != Some(self.create_revision) {
                let current = holder
                    .or_else(|| resp.header().map(|h| h.revision()))
                    .unwrap_or(0);
                let resource = keys
                    .first()
                    .map(|k| String::from_utf8_lossy(k).into_owned())
                    .unwrap_or_default();
                return Err(self.lease.stale(
                    resource,
                    FencingToken::new(
                        self.lease.token().lock(),
                        u64::try_from(current).unwrap_or(0),
                    ),
                ));
            }
        }
        Err(Error::Backend {
            backend: crate::error::BACKEND,
            source: "the guard records of the fenced keys kept changing concurrently".into(),
        })
    }
}
