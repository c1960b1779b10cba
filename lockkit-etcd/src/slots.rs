//! Elections and semaphores on etcd: [`SlotBackend`] for [`EtcdLock`].
//!
//! Every slot is a grant of the lock's own acquire path ([`EtcdLock::grant_in`]) in a key
//! space of its own, so the session lease, its keepalive, the key watch and its loss notice,
//! FIFO waiting on the key just ahead, retries and cancel safety are the lock's, unchanged.
//! With `P` the client's prefix (`.` is never a lock name, so no lock's prefix covers these):
//!
//! - election `x`: candidates put `P/./elect/x/{lease id hex}-{n}` (with their value); the
//!   leader is the key with the lowest create revision, and that revision is the term;
//! - semaphore `x`: N in `P/./sem/x/n` (no lease); permit `k` is the one key under
//!   `P/./sem/x/m/s/{k}/`, taken by a transaction that also compares N (and that no one
//!   waits); waiters queue FIFO on the gate `P/./sem/x/m/g/` (a lock), and the first in line
//!   watches the slots for the next delete. Everything under `P/./sem/x/m/` is a member: N may
//!   be replaced only while there is none.
//!
//! See [docs/election-semaphore.md](https://example.invalid/lockkit/blob/main/docs/election-semaphore.md).

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, EventType, GetOptions, PutOptions, SortOrder, SortTarget, Txn,
    TxnOp, TxnOpResponse, WatchFilterType, WatchOptions, WatchStream,
};
use lockkit_core::backend::{
    Backoff, LeaseBackendExt, LockBackend, SlotBackend, SlotGrant, SlotGuarantees, SlotHolder,
    SlotHolders, SlotKind, SlotOps, SlotRequest, SlotWatch, WatchEvent, validate_slot_name,
    wait_deadline,
};
use lockkit_core::{
    AcquireOptions, Error, FencingToken, Instant, Lease, MAX_PERMITS, Result, Wait, async_trait,
};

use crate::core::{open_watch, timed, with_retries};
use crate::error::from_client;
use crate::lease::EtcdLease;
use crate::lock::{EtcdLock, Space};

/// The first in line for a permit re-reads the slots at least this often (TTL/2 within these
/// bounds), in case its watch is stuck on a frozen member (as a waiting lock acquire).
const RECHECK_MIN: Duration = Duration::from_millis(500);
const RECHECK_MAX: Duration = Duration::from_secs(5);

/// How often a mismatched N is read again before `PermitsMismatch` (the name may just have
/// gone idle: its last member's key is being deleted).
const JOIN_TRIES: u32 = 3;

/// The keys of one election or semaphore.
#[derive(Clone)]
struct Names {
    kind: SlotKind,
    name: String,
    /// `P/./{kind}/{name}/`.
    base: Vec<u8>,
}

impl Names {
    fn new(lock: &EtcdLock, kind: SlotKind, name: &str) -> Self {
        let base = format!("{}/./{}/{name}/", lock.config().get_prefix(), kind.as_str());
        Self {
            kind,
            name: name.to_owned(),
            base: base.into_bytes(),
        }
    }

    fn with(&self, rest: &str) -> Vec<u8> {
        let mut k = self.base.clone();
        k.extend_from_slice(rest.as_bytes());
        k
    }

    /// A semaphore's N.
    fn n_key(&self) -> Vec<u8> {
        self.with("n")
    }

    /// Everything a semaphore's holders and waiters put.
    fn members(&self) -> Vec<u8> {
        self.with("m/")
    }

    /// The gate waiting permit acquires queue on.
    fn gate(&self) -> Vec<u8> {
        self.with("m/g/")
    }

    /// The keys that hold slots: the candidates of an election, the permits of a semaphore.
    fn holders_prefix(&self) -> Vec<u8> {
        match self.kind {
            SlotKind::Semaphore => self.with("m/s/"),
            _ => self.base.clone(),
        }
    }

    /// Which slot a key under [`holders_prefix`](Self::holders_prefix) holds (or waits for).
    fn slot_of(&self, key: &[u8]) -> Option<u32> {
        match self.kind {
            SlotKind::Semaphore => {
                let rest = key.strip_prefix(self.holders_prefix().as_slice())?;
                let end = rest.iter().position(|b| *b == b'/')?;
                std::str::from_utf8(&rest[..end]).ok()?.parse().ok()
            }
            _ => Some(0),
        }
    }

    /// The slot's name relative to the prefix: `elect/{name}` or `sem/{name}/{slot}`.
    fn rel(&self, slot: u32) -> String {
        match self.kind {
            SlotKind::Semaphore => format!("sem/{}/{slot}", self.name),
            _ => format!("elect/{}", self.name),
        }
    }
}

impl EtcdLock {
    /// The grant space of one slot (or of a semaphore's gate, `rel` = `sem/{name}/g`).
    fn space(&self, n: &Names, rel: String, prefix: Vec<u8>, value: &[u8]) -> Space {
        let p = self.config().get_prefix();
        Space {
            name: n.name.clone(),
            // Lock-delay is refused for slots: this marker is never put, only read as absent.
            marker_key: format!("{p}/./delay/{rel}").into_bytes(),
            token_id: self.lock_id(&rel),
            slot_name: rel,
            prefix,
            value: Some(value.to_vec()),
            extra: Vec::new(),
        }
    }

    fn slot_space(&self, n: &Names, slot: u32, value: &[u8], extra: &[Compare]) -> Space {
        let prefix = match n.kind {
            SlotKind::Semaphore => n.with(&format!("m/s/{slot}/")),
            _ => n.base.clone(),
        };
        let mut s = self.space(n, n.rel(slot), prefix, value);
        s.extra = extra.to_vec();
        s
    }

    fn token(&self, n: &Names, slot: u32, rev: i64) -> FencingToken {
        FencingToken::new(self.lock_id(&n.rel(slot)), u64::try_from(rev).unwrap_or(0))
    }

    fn limit(&self) -> Duration {
        self.config().request_timeout_value()
    }

    /// A grant of the slot space's lock path, and the handle that changes its value.
    fn slot_grant(&self, lease: Lease, slot: u32) -> Result<SlotGrant> {
        let ops = {
            let l = lease
                .ops()
                .as_any()
                .downcast_ref::<EtcdLease>()
                .ok_or_else(|| crate::error::protocol("a slot grant without an etcd lease"))?;
            Arc::new(ValueOps {
                client: l.client.clone(),
                name: lease.name().to_owned(),
                key: l.key.clone(),
                rev: l.create_revision,
                lease_id: l.lease_id,
                limit: self.limit(),
            })
        };
        Ok(SlotGrant::new(lease, slot, ops))
    }

    /// Makes sure the semaphore's N is `permits`: compares it, or sets it if the name has no
    /// member (holder or waiter) or no N. One transaction, retried (it is idempotent).
    ///
    /// # Errors
    /// [`Error::PermitsMismatch`] if another N is in force (read [`JOIN_TRIES`] times).
    async fn join(&self, n: &Names, permits: u32) -> Result<()> {
        let (n_key, want) = (n.n_key(), permits.to_string().into_bytes());
        let put_n = TxnOp::put(n_key.clone(), want.clone(), None::<PutOptions>);
        let if_absent = Txn::new()
            .when([Compare::create_revision(n_key.clone(), CompareOp::Equal, 0)])
            .and_then([put_n.clone()])
            .or_else([TxnOp::get(n_key.clone(), None)]);
        let if_idle = Txn::new()
            .when([Compare::create_revision(n.members(), CompareOp::Equal, 0).with_prefix()])
            .and_then([put_n])
            .or_else([TxnOp::txn(if_absent)]);
        let txn = Txn::new()
            .when([Compare::value(n_key, CompareOp::Equal, want)])
            .or_else([TxnOp::txn(if_idle)]);
        let mut theirs = 0;
        for attempt in 0..JOIN_TRIES {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let kv = self.client().kv_client();
            let resp = with_retries(self.limit(), "a semaphore join", || {
                let (mut kv, txn) = (kv.clone(), txn.clone());
                async move { kv.txn(txn).await }
            })
            .await?;
            if resp.succeeded() {
                return Ok(());
            }
            let Some(TxnOpResponse::Txn(idle)) = resp.op_responses().into_iter().next() else {
                return Err(crate::error::protocol("semaphore join: no nested answer"));
            };
            if idle.succeeded() {
                return Ok(());
            }
            let Some(TxnOpResponse::Txn(absent)) = idle.op_responses().into_iter().next() else {
                return Err(crate::error::protocol("semaphore join: no nested answer"));
            };
            if absent.succeeded() {
                return Ok(());
            }
            theirs = match absent.op_responses().into_iter().next() {
                Some(TxnOpResponse::Get(g)) => g.kvs().first().map_or(0, |kv| parse_n(kv.value())),
                _ => 0,
            };
        }
        Err(Error::PermitsMismatch {
            name: n.name.clone(),
            ours: permits,
            theirs,
        })
    }

    /// The slots held now and the revision of the read.
    async fn held_slots(&self, n: &Names) -> Result<(HashSet<u32>, i64)> {
        let kv = self.client().kv_client();
        let prefix = n.holders_prefix();
        let resp = with_retries(self.limit(), "a slot read", || {
            let (mut kv, key) = (kv.clone(), prefix.clone());
            let opts = GetOptions::new().with_prefix().with_keys_only();
            async move { kv.get(key, Some(opts)).await }
        })
        .await?;
        let held = resp
            .kvs()
            .iter()
            .filter_map(|kv| n.slot_of(kv.key()))
            .collect();
        Ok((held, resp.header().map_or(0, |h| h.revision())))
    }

    /// Tries the free slots (not in `held`) in order, each with one try-once grant whose
    /// transaction also checks `extra`. With `stop_at_held`, gives up at the first refusal.
    async fn try_free(
        &self,
        n: &Names,
        permits: u32,
        held: &HashSet<u32>,
        opts: &AcquireOptions,
        extra: &[Compare],
        stop_at_held: bool,
    ) -> Result<Option<SlotGrant>> {
        let mut once = opts.clone();
        once.wait = Wait::No;
        for slot in (0..permits).filter(|s| !held.contains(s)) {
            match self
                .grant_in(&self.slot_space(n, slot, &[], extra), once.clone())
                .await
            {
                Ok(lease) => return self.slot_grant(lease, slot).map(Some),
                Err(Error::Held { .. }) if stop_at_held => return Ok(None),
                Err(Error::Held { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    /// Fails with `PermitsMismatch` if the name's N is no longer `permits`.
    async fn check_n(&self, n: &Names, permits: u32) -> Result<()> {
        let kv = self.client().kv_client();
        let key = n.n_key();
        let resp = with_retries(self.limit(), "a semaphore read", || {
            let (mut kv, key) = (kv.clone(), key.clone());
            async move { kv.get(key, None).await }
        })
        .await?;
        match resp.kvs().first().map(|kv| parse_n(kv.value())) {
            Some(theirs) if theirs != permits => Err(Error::PermitsMismatch {
                name: n.name.clone(),
                ours: permits,
                theirs,
            }),
            _ => Ok(()),
        }
    }

    /// Waits for a delete under the slots (from revision `from`), at most `recheck`.
    async fn slot_freed(&self, n: &Names, from: i64, recheck: Duration) -> Result<()> {
        let opts = WatchOptions::new()
            .with_prefix()
            .with_start_revision(from)
            .with_filters([WatchFilterType::NoPut]);
        let until = Instant::now() + recheck;
        let mut stream = open_watch(self.client(), self.limit(), &n.holders_prefix(), opts).await?;
        loop {
            match tokio::time::timeout_at(until, stream.message()).await {
                Err(_) | Ok(Ok(None)) => return Ok(()),
                Ok(Err(e)) => return Err(from_client(e)),
                Ok(Ok(Some(msg))) => {
                    if msg.canceled()
                        || msg
                            .events()
                            .iter()
                            .any(|e| e.event_type() == EventType::Delete)
                    {
                        return Ok(());
                    }
                }
            }
        }
    }

    /// A permit: join (N), take a free slot if no one waits, else queue on the gate and, first
    /// in line, take the next slot that frees.
    async fn grant_permit(&self, req: SlotRequest<'_>, opts: &AcquireOptions) -> Result<SlotGrant> {
        let n = Names::new(self, SlotKind::Semaphore, req.name);
        let permits = req.permits;
        let start = Instant::now();
        let deadline = wait_deadline(opts.wait, start);
        self.join(&n, permits).await?;
        let n_is = Compare::value(n.n_key(), CompareOp::Equal, permits.to_string());
        let no_waiter = Compare::create_revision(n.gate(), CompareOp::Equal, 0).with_prefix();
        // FIFO after earlier waiters: a slot is taken here only while no one waits.
        let (held, _) = self.held_slots(&n).await?;
        let direct = [n_is.clone(), no_waiter];
        if let Some(g) = self
            .try_free(&n, permits, &held, opts, &direct, true)
            .await?
        {
            return Ok(g);
        }
        self.check_n(&n, permits).await?;
        if opts.wait == Wait::No {
            return Err(Error::Held {
                name: n.name.clone(),
            });
        }
        let recheck = (opts.ttl / 2).clamp(RECHECK_MIN, RECHECK_MAX);
        let mut backoff = Backoff::new(Duration::from_millis(20), Duration::from_millis(500));
        loop {
            // Queue on the gate, always on the session lease (the gate must stay alive while
            // its holder waits for a slot) and given back on drop.
            let mut gate_opts = opts.clone();
            gate_opts.keepalive = true;
            gate_opts.release_on_drop = true;
            gate_opts.min_validity = None;
            gate_opts.lock_delay = None;
            if let Some(d) = deadline {
                gate_opts.wait = Wait::Timeout(d.saturating_duration_since(Instant::now()));
            }
            let gate_space = self.space(&n, format!("sem/{}/g", n.name), n.gate(), &[]);
            let gate = self.grant_in(&gate_space, gate_opts).await?;
            let lost = gate.lost();
            tokio::pin!(lost);
            // First in line: take the next slot that frees.
            let got = loop {
                let round = async {
                    let (held, rev) = self.held_slots(&n).await?;
                    if let Some(g) = self
                        .try_free(&n, permits, &held, opts, std::slice::from_ref(&n_is), false)
                        .await?
                    {
                        return Ok(Some(g));
                    }
                    self.check_n(&n, permits).await?;
                    self.slot_freed(&n, rev + 1, recheck).await?;
                    Ok::<_, Error>(None)
                };
                let timeout = async {
                    match deadline {
                        Some(d) => tokio::time::sleep_until(d).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    r = round => match r {
                        Ok(Some(g)) => break Some(g),
                        Ok(None) => backoff.reset(),
                        Err(e) if e.is_retryable() => {
                            tracing::debug!(error = %e, "etcd unavailable while waiting for a permit; retrying");
                            tokio::time::sleep(backoff.next_delay()).await;
                        }
                        Err(e) => return Err(e),
                    },
                    _ = &mut lost => break None,
                    _ = timeout => return Err(Error::Timeout { name: n.name.clone(), waited: start.elapsed() }),
                }
            };
            match got {
                Some(g) => {
                    // The next waiter becomes first in line: released in the background (the
                    // drop), so the grant returns at once.
                    drop(gate);
                    return Ok(g);
                }
                // The gate's lease ended (revoked, or etcd unreachable for longer than the
                // TTL): queue again.
                None => tracing::debug!(name = %n.name, "lost the semaphore gate; queueing again"),
            }
        }
    }
}

/// A semaphore's N as stored (0 if unreadable, which no acquire asks for).
fn parse_n(v: &[u8]) -> u32 {
    std::str::from_utf8(v)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// Changes the value of a granted slot's key: a put on its lease if the key still has its
/// create revision (so the grant still holds the slot).
struct ValueOps {
    client: Arc<Client>,
    name: String,
    key: Vec<u8>,
    rev: i64,
    lease_id: i64,
    limit: Duration,
}

impl fmt::Debug for ValueOps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ValueOps")
            .field("key", &String::from_utf8_lossy(&self.key))
            .field("create_revision", &self.rev)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl SlotOps for ValueOps {
    /// One transaction: the put happens only if the key still has the grant's create revision
    /// (retried within the request timeout; repeating it is harmless).
    async fn set_value(&self, value: &[u8]) -> Result<()> {
        let txn = Txn::new()
            .when([Compare::create_revision(
                self.key.clone(),
                CompareOp::Equal,
                self.rev,
            )])
            .and_then([TxnOp::put(
                self.key.clone(),
                value.to_vec(),
                Some(PutOptions::new().with_lease(self.lease_id)),
            )]);
        let kv = self.client.kv_client();
        let resp = with_retries(self.limit, "a proclaim", || {
            let (mut kv, txn) = (kv.clone(), txn.clone());
            async move { kv.txn(txn).await }
        })
        .await?;
        if resp.succeeded() {
            Ok(())
        } else {
            Err(Error::NotHeld {
                name: self.name.clone(),
            })
        }
    }
}

/// Keys under a holders prefix: key → (create revision, value).
type Keys = BTreeMap<Vec<u8>, (i64, Vec<u8>)>;

/// The holders among `keys`: per slot, the key with the lowest create revision.
fn holders_of(lock: &EtcdLock, n: &Names, keys: &Keys) -> Vec<(SlotHolder, i64)> {
    let mut first: BTreeMap<u32, (i64, &Vec<u8>, &Vec<u8>)> = BTreeMap::new();
    for (key, (rev, value)) in keys {
        let Some(slot) = n.slot_of(key) else {
            continue;
        };
        let e = first.entry(slot).or_insert((*rev, key, value));
        if *rev < e.0 {
            *e = (*rev, key, value);
        }
    }
    first
        .into_iter()
        .map(|(slot, (rev, _, value))| {
            (
                SlotHolder::new(slot, lock.token(n, slot, rev), value.clone(), None),
                rev,
            )
        })
        .collect()
}

/// An observer's watch: one etcd watch stream on the holders prefix, from the revision after
/// the initial read; each revision's events are applied together, in order. A broken stream
/// is opened again from the next revision (nothing is lost); a start revision that was
/// compacted gives `Missed`, then the state read anew.
struct EtcdWatch {
    lock: EtcdLock,
    names: Names,
    keys: Keys,
    /// The revision the stream (re)starts at.
    next_rev: i64,
    stream: Option<WatchStream>,
    /// The start revision was compacted: read the state again.
    resync: bool,
    last: Vec<SlotHolder>,
    pending: VecDeque<WatchEvent>,
    backoff: Backoff,
}

impl fmt::Debug for EtcdWatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdWatch")
            .field("name", &self.names.name)
            .field("next_rev", &self.next_rev)
            .finish_non_exhaustive()
    }
}

impl EtcdWatch {
    /// Reads every key under the holders prefix: the keys and the revision of the read.
    async fn read(&self) -> Result<(Keys, i64)> {
        let kv = self.lock.client().kv_client();
        let prefix = self.names.holders_prefix();
        let resp = with_retries(self.lock.limit(), "an observer read", || {
            let (mut kv, key) = (kv.clone(), prefix.clone());
            async move { kv.get(key, Some(GetOptions::new().with_prefix())).await }
        })
        .await?;
        let keys = resp
            .kvs()
            .iter()
            .map(|kv| {
                (
                    kv.key().to_vec(),
                    (kv.create_revision(), kv.value().to_vec()),
                )
            })
            .collect();
        Ok((keys, resp.header().map_or(0, |h| h.revision())))
    }

    fn emit(&mut self) {
        let now: Vec<SlotHolder> = holders_of(&self.lock, &self.names, &self.keys)
            .into_iter()
            .map(|(h, _)| h)
            .collect();
        if now != self.last {
            self.last = now.clone();
            self.pending.push_back(WatchEvent::Holders(now));
        }
    }

    async fn open(&mut self) -> Result<()> {
        let opts = WatchOptions::new()
            .with_prefix()
            .with_start_revision(self.next_rev);
        let stream = open_watch(
            self.lock.client(),
            self.lock.limit(),
            &self.names.holders_prefix(),
            opts,
        )
        .await?;
        self.stream = Some(stream);
        Ok(())
    }

    fn apply(&mut self, resp: &etcd_client::WatchResponse) {
        if resp.canceled() {
            self.stream = None;
            if resp.compact_revision() > 0 {
                tracing::debug!(name = %self.names.name, compacted = resp.compact_revision(), "observer's revision was compacted; reading the state again");
                self.resync = true;
            }
            return;
        }
        let mut group = None;
        for e in resp.events() {
            let Some(kv) = e.kv() else {
                continue;
            };
            let rev = kv.mod_revision();
            if group.is_some_and(|g| g != rev) {
                self.emit();
            }
            group = Some(rev);
            match e.event_type() {
                EventType::Put => {
                    self.keys.insert(
                        kv.key().to_vec(),
                        (kv.create_revision(), kv.value().to_vec()),
                    );
                }
                EventType::Delete => {
                    self.keys.remove(kv.key());
                }
            }
            self.next_rev = self.next_rev.max(rev + 1);
        }
        if group.is_some() {
            self.emit();
        }
    }
}

#[async_trait]
impl SlotWatch for EtcdWatch {
    /// The next event; reconnects (with backoff) for as long as it takes.
    ///
    /// # Cancel safety
    /// Cancel safe: the state changes only after each await, all at once.
    async fn next(&mut self) -> Result<WatchEvent> {
        loop {
            if let Some(e) = self.pending.pop_front() {
                return Ok(e);
            }
            if self.resync {
                match self.read().await {
                    Ok((keys, rev)) => {
                        self.keys = keys;
                        self.next_rev = rev + 1;
                        self.resync = false;
                        self.pending.push_back(WatchEvent::Missed);
                        let now = holders_of(&self.lock, &self.names, &self.keys)
                            .into_iter()
                            .map(|(h, _)| h)
                            .collect::<Vec<_>>();
                        self.last = now.clone();
                        self.pending.push_back(WatchEvent::Holders(now));
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "observer read failed; retrying");
                        tokio::time::sleep(self.backoff.next_delay()).await;
                    }
                }
                continue;
            }
            let Some(stream) = self.stream.as_mut() else {
                if let Err(e) = self.open().await {
                    tracing::debug!(error = %e, "observer watch failed; retrying");
                    tokio::time::sleep(self.backoff.next_delay()).await;
                }
                continue;
            };
            match stream.message().await {
                Ok(Some(resp)) => {
                    self.apply(&resp);
                    if !resp.canceled() {
                        self.backoff.reset();
                    } else if !self.resync {
                        // Cancelled by the server for another reason (no leader, …): open
                        // it again from the next revision, not in a hot loop.
                        tokio::time::sleep(self.backoff.next_delay()).await;
                    }
                }
                Ok(None) | Err(_) => {
                    tracing::debug!(name = %self.names.name, "observer watch stream ended; opening another");
                    self.stream = None;
                    tokio::time::sleep(self.backoff.next_delay()).await;
                }
            }
        }
    }
}

/// Elections and semaphores on etcd: every slot a grant of the lock's path in a key space of
/// its own (see the module docs and docs/election-semaphore.md).
#[async_trait]
impl SlotBackend for EtcdLock {
    /// Grants a slot.
    ///
    /// - **Election**: the lock's acquire in `P/./elect/{name}/`, the candidate's key carrying
    ///   its value: the leader is the lowest create revision (the term), waiters watch the key
    ///   just ahead (FIFO, one wake per resign).
    /// - **Semaphore**: N compared (or set, while the name has no member) in `P/./sem/{name}/n`;
    ///   a free slot is taken by a try-once grant in `P/./sem/{name}/m/s/{k}/` whose transaction
    ///   also compares N and that no one waits; a waiting acquire queues on the gate lock
    ///   `P/./sem/{name}/m/g/` (FIFO) and, first in line, watches the slots for a delete.
    ///
    /// # Errors
    /// As [`Lock::acquire`](lockkit_core::Lock::acquire), plus [`Error::PermitsMismatch`].
    ///
    /// # Cancel safety
    /// Cancel safe, as the lock's acquire: a dropped grant deletes its key (candidate, slot,
    /// gate) in the background.
    async fn grant_slot(&self, req: SlotRequest<'_>, opts: AcquireOptions) -> Result<SlotGrant> {
        req.validate()?;
        opts.validate()?;
        match req.kind {
            SlotKind::Semaphore => self.grant_permit(req, &opts).await,
            _ => {
                let n = Names::new(self, req.kind, req.name);
                let lease = self
                    .grant_in(&self.slot_space(&n, 0, req.value, &[]), opts)
                    .await?;
                self.slot_grant(lease, 0)
            }
        }
    }

    /// One read of the holders prefix (and, for a semaphore, N and whether it has members),
    /// then one lease TTL read per holder (whole seconds, as etcd reports it; the lease may be
    /// a session lease shared by other grants).
    ///
    /// # Errors
    /// [`Error::InvalidName`]; [`Error::Unavailable`] if etcd did not answer in time.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    async fn slot_holders(&self, kind: SlotKind, name: &str) -> Result<Option<SlotHolders>> {
        validate_slot_name(kind, name)?;
        let n = Names::new(self, kind, name);
        let txn = Txn::new().and_then([
            TxnOp::get(
                n.holders_prefix(),
                Some(
                    GetOptions::new()
                        .with_prefix()
                        .with_sort(SortTarget::Create, SortOrder::Ascend),
                ),
            ),
            TxnOp::get(n.n_key(), None),
            TxnOp::get(
                n.members(),
                Some(GetOptions::new().with_prefix().with_count_only()),
            ),
        ]);
        let kv = self.client().kv_client();
        let resp = with_retries(self.limit(), "a holder read", || {
            let (mut kv, txn) = (kv.clone(), txn.clone());
            async move { kv.txn(txn).await }
        })
        .await?;
        let ops = resp.op_responses();
        let get = |i: usize| match ops.get(i) {
            Some(TxnOpResponse::Get(g)) => Some(g.clone()),
            _ => None,
        };
        let found = get(0).ok_or_else(|| crate::error::protocol("holder read: no answer"))?;
        let mut keys = Keys::new();
        let mut leases = BTreeMap::new();
        for kv in found.kvs() {
            keys.insert(
                kv.key().to_vec(),
                (kv.create_revision(), kv.value().to_vec()),
            );
            leases.insert(kv.create_revision(), kv.lease());
        }
        let (permits, active) = match kind {
            SlotKind::Semaphore => (
                get(1)
                    .and_then(|g| g.kvs().first().map(|kv| parse_n(kv.value())))
                    .unwrap_or(0),
                get(2).is_some_and(|g| g.count() > 0),
            ),
            _ => (1, !keys.is_empty()),
        };
        if !active {
            return Ok(None);
        }
        let mut holders = Vec::new();
        let mut lc = self.client().lease_client();
        for (mut h, rev) in holders_of(self, &n, &keys) {
            if let Some(&id) = leases.get(&rev).filter(|id| **id != 0) {
                h.remaining = timed(self.limit(), "a lease TTL read", lc.time_to_live(id, None))
                    .await
                    .ok()
                    .and_then(|t| u64::try_from(t.ttl()).ok())
                    .map(Duration::from_secs);
            }
            holders.push(h);
        }
        Ok(Some(SlotHolders::new(permits, holders)))
    }

    /// A watch stream on the holders prefix from the revision after one read of it.
    ///
    /// # Errors
    /// [`Error::InvalidName`]; [`Error::Unavailable`] if etcd did not answer in time.
    ///
    /// # Cancel safety
    /// Cancel safe: a dropped call leaves no watch (the stream is dropped with it).
    async fn watch_slots(&self, kind: SlotKind, name: &str) -> Result<Box<dyn SlotWatch>> {
        validate_slot_name(kind, name)?;
        let mut w = EtcdWatch {
            lock: self.clone(),
            names: Names::new(self, kind, name),
            keys: Keys::new(),
            next_rev: 0,
            stream: None,
            resync: false,
            last: Vec::new(),
            pending: VecDeque::new(),
            backoff: Backoff::new(Duration::from_millis(50), Duration::from_secs(1)),
        };
        let (keys, rev) = w.read().await?;
        w.keys = keys;
        w.next_rev = rev + 1;
        w.open().await?;
        let now: Vec<SlotHolder> = holders_of(self, &w.names, &w.keys)
            .into_iter()
            .map(|(h, _)| h)
            .collect();
        w.last = now.clone();
        w.pending.push_back(WatchEvent::Holders(now));
        Ok(Box::new(w))
    }

    fn slot_guarantees(&self) -> SlotGuarantees {
        let mut lock = LockBackend::guarantees(self);
        lock.lock_delay = false;
        let mut g = SlotGuarantees::new(lock);
        g.observe = true;
        g.every_change_observed = true;
        g.max_permits = MAX_PERMITS;
        g.notes = "slots are grants of the lock's path in their own key spaces (leader = lowest \
                   create revision = the term; permit k = the one key of its slot, token its \
                   create revision): the lock's guarantees hold; observers watch the keys from \
                   the revision of their first read and see every change unless etcd compacted \
                   past where a reconnecting watch resumes (then Missed)";
        g
    }
}
