//! Elections and semaphores on ZooKeeper: [`SlotBackend`] for [`ZkLock`].
//!
//! - **Election** `x`: the lock recipe in the container node `/{prefix}/%elect/{x}`: each
//!   candidate creates an ephemeral sequential node (named as a lock node, `{unique id}-lock-N`)
//!   carrying its value; the lowest sequence leads; each candidate watches only the node just
//!   ahead of it. The term is the leader node's `czxid`; proclaim is a `setData` of the node.
//!   This is the lock's own grant path ([`ZkLock::grant_at`]), so sessions, keepalive, loss
//!   notice and cancel safety are the lock's.
//! - **Semaphore** `x`: the container node `/{prefix}/%sem/{x}` holds N as its data. Acquirers
//!   queue FIFO as the lock's waiters (ephemeral sequential nodes, each watching its
//!   predecessor); the first in line takes a free slot by creating the ephemeral node
//!   `slot-{k}` (its `czxid` is the permit's token), in one multi-op with a version-checked
//!   rewrite of N, and then leaves the line; when every slot is held it waits on a children
//!   watch of the semaphore node (it alone: one wake per change). The permit's lease is the
//!   slot node.
//! - **N**: a joiner whose N differs from the stored one changes it only when it is alone (no
//!   other queue node, no slot node, in a listing after a `sync`), with a `setData` at the
//!   version it read; every claim rewrites N at the version it read too, so an N change and a
//!   claim under the old N cannot both succeed. Otherwise [`Error::PermitsMismatch`].
//! - **Observers** (elections): a children watch on the election node and a data watch on the
//!   leader's node, re-armed after each event (see [`ZkWatch`]).
//!
//! `%elect` and `%sem` cannot be the node of a lock: lock names are percent-encoded, and an
//! encoded `%` is always followed by two hex digits. See
//! [docs/election-semaphore.md](https://example.invalid/lockkit/blob/main/docs/election-semaphore.md).

use std::collections::{HashSet, VecDeque};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use lockkit_core::backend::{
    LockBackend, SlotBackend, SlotGrant, SlotGuarantees, SlotHolder, SlotHolders, SlotKind,
    SlotOps, SlotRequest, SlotWatch, TrackerHandle, WatchEvent, retry_transient,
    validate_slot_name, wait_deadline,
};
use lockkit_core::{
    AcquireOptions, Error, FencingToken, Instant, Lease, Result, Wait, async_trait,
};
use zookeeper_client as zk;

use crate::config::encode_name;
use crate::core::{
    Ahead, OWN_LEN, Pending, Target, in_line, own_id, sequence_of, sorted_children, wait_ahead,
};
use crate::error::{BACKEND, from_zk, unavailable};
use crate::lease::{ZkLease, watch_own_node};
use crate::lock::ZkLock;
use crate::session::{Session, spawn_delete};

/// Slot nodes of a semaphore: `slot-{k}`.
const SLOT_PREFIX: &str = "slot-";

/// How often a mismatched N is read again before [`Error::PermitsMismatch`] (the name may just
/// be going idle: a holder's release in flight).
const JOIN_TRIES: u32 = 3;

/// How many candidates of its last listing an observer probes before listing again.
const PROBES: usize = 4;

impl ZkLock {
    /// The container node of an election or a semaphore: `/{prefix}/%elect/{name}` or
    /// `/{prefix}/%sem/{name}` (`name` encoded as a lock name).
    fn slot_dir(&self, kind: SlotKind, name: &str) -> String {
        format!(
            "/{}/%{}/{}",
            self.config().get_prefix(),
            kind.as_str(),
            encode_name(name)
        )
    }

    /// The token identity of an election (`zk{chroot}/{prefix}/elect/{name}`) or of a
    /// semaphore's slot (`…/sem/{name}/{slot}`).
    fn slot_token_id(&self, kind: SlotKind, name: &str, slot: u32) -> String {
        match kind {
            SlotKind::Semaphore => self.lock_id(&format!("sem/{name}/{slot}")),
            _ => self.lock_id(&format!("elect/{name}")),
        }
    }

    /// The candidate nodes now in line for election `name`, leader first. For inspection
    /// (operators, tests); the answer may be stale at once.
    ///
    /// # Errors
    /// [`Error::InvalidName`]; [`Error::Unavailable`] if no answer came within the connect
    /// timeout; other errors from the server.
    ///
    /// # Cancel safety
    /// Cancel safe (a read).
    pub async fn candidates(&self, name: &str) -> Result<Vec<String>> {
        validate_slot_name(SlotKind::Election, name)?;
        let dir = self.slot_dir(SlotKind::Election, name);
        self.bounded(async { sorted_children(&*self.control_session().await?, &dir).await })
            .await
    }

    /// One semaphore acquire attempt on one session (see the module docs).
    async fn sem_attempt(
        &self,
        name: &str,
        permits: u32,
        opts: &AcquireOptions,
        start: Instant,
        deadline: Option<Instant>,
    ) -> Result<(Lease, Arc<ZkLease>, u32, String)> {
        // As the lock: requests get at least one connect timeout, waiting is cut by the deadline.
        let floor = start + self.config().get_connect_timeout();
        let io_deadline = deadline.map(|d| d.max(floor));
        let fail = |e| self.fail(e, name, start, opts);
        let session = match io_deadline {
            Some(d) => tokio::time::timeout_at(d, self.session(opts.ttl, true))
                .await
                .map_err(|_| fail(zk::Error::Timeout))??,
            None => self.session(opts.ttl, true).await?,
        };
        let n_text = permits.to_string();
        let t = Target {
            name,
            dir: self.slot_dir(SlotKind::Semaphore, name),
            token_id: String::new(),
            data: &[],
            dir_data: n_text.as_bytes(),
        };
        let dir = t.dir.as_str();
        let own = own_id();
        let mut pending = Pending {
            session: session.clone(),
            dir: dir.to_owned(),
            own: own.clone(),
            path: None,
            armed: true,
        };
        let (node, _, _) = self
            .create_node(&session, &t, &own, io_deadline, &mut pending)
            .await
            .map_err(fail)?;
        let node_name = node.rsplit('/').next().unwrap_or_default().to_owned();
        let mut mismatches = 0;
        loop {
            // N and a listing after a `sync` (queued together, answered in order): the listing
            // shows every claim committed before the `sync`.
            let (read, children) = {
                let read = session.retry_loss(io_deadline, || session.client.get_data(dir));
                let list = session.synced_children(dir, io_deadline);
                tokio::join!(read, list)
            };
            let (data, dstat) = read.map_err(fail)?;
            let children = children.map_err(fail)?;
            let queue = in_line(children.iter().map(String::as_str));
            let held: HashSet<u32> = children.iter().filter_map(|c| slot_of(c)).collect();
            let Some(pos) = queue.iter().position(|(_, c)| *c == node_name) else {
                return Err(unavailable(
                    "the permit's queue node disappeared while waiting (its session expired)",
                ));
            };
            let stored = parse_permits(&data);
            if stored != Some(permits) {
                if queue.len() == 1 && held.is_empty() {
                    // Alone: the name is idle but for us; set our N (at the version read, so
                    // that a claim under the old N, which rewrites N, cannot slip in between).
                    match session
                        .retry_loss(io_deadline, || {
                            session
                                .client
                                .set_data(dir, n_text.as_bytes(), Some(dstat.version))
                        })
                        .await
                    {
                        Ok(_) | Err(zk::Error::BadVersion) => continue,
                        Err(e) => return Err(fail(e)),
                    }
                }
                mismatches += 1;
                if mismatches < JOIN_TRIES {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
                pending.delete_now().await;
                return Err(Error::PermitsMismatch {
                    name: name.to_owned(),
                    ours: permits,
                    theirs: stored.unwrap_or(0),
                });
            }
            if pos > 0 {
                if opts.wait == Wait::No {
                    pending.delete_now().await;
                    return Err(Error::Held {
                        name: name.to_owned(),
                    });
                }
                // FIFO: watch only the node just ahead of ours, as the lock's waiters do.
                let woken = wait_ahead(
                    &session,
                    dir,
                    queue[pos - 1].1,
                    io_deadline,
                    deadline,
                    || (),
                )
                .await
                .map_err(fail)?;
                if let Ahead::Deadline = woken {
                    pending.delete_now().await;
                    return Err(self.timeout(name, start));
                }
                continue;
            }
            // First in line: take the first free slot.
            let mut moved = false;
            for k in (0..permits).filter(|k| !held.contains(k)) {
                let path = format!("{dir}/{SLOT_PREFIX}{k}");
                let mut guard = SlotPending {
                    session: session.clone(),
                    path: path.clone(),
                    own: own.clone(),
                    armed: true,
                };
                let sent = Instant::now();
                let (res, lost) = session
                    .retry_loss_seen(io_deadline, || {
                        claim(
                            &session,
                            dir,
                            n_text.as_bytes(),
                            dstat.version,
                            &path,
                            own.as_bytes(),
                        )
                    })
                    .await;
                // A lost attempt that was applied makes its retry fail: look at the node.
                let adopted = lost
                    && !matches!(res, Ok(Claim::Done))
                    && match session
                        .retry_loss(io_deadline, || session.client.get_data(&path))
                        .await
                    {
                        Ok((d, _)) => d.starts_with(own.as_bytes()),
                        Err(zk::Error::NoNode) => false,
                        Err(e) => return Err(fail(e)),
                    };
                let res = if adopted { Ok(Claim::Done) } else { res };
                match res.map_err(fail)? {
                    Claim::Taken => {
                        guard.armed = false;
                        continue;
                    }
                    Claim::Moved => {
                        guard.armed = false;
                        moved = true;
                        break;
                    }
                    Claim::Done => {}
                }
                let stat = match session
                    .retry_loss(io_deadline, || session.client.check_stat(&path))
                    .await
                    .map_err(fail)?
                {
                    Some(s) if s.ephemeral_owner == session.id => s,
                    _ => {
                        return Err(unavailable(
                            "the permit's slot node disappeared at once (its session expired)",
                        ));
                    }
                };
                // The lease starts at the send time of the claim: a write, which the leader
                // orders after checking the session.
                let tracker = TrackerHandle::new(sent, session.ttl);
                let Some(reg) = session.register(tracker.clone(), path.clone()) else {
                    return Err(unavailable(
                        "the ZooKeeper session ended during the acquire",
                    ));
                };
                guard.armed = false;
                let ops = Arc::new(ZkLease {
                    session: session.clone(),
                    granted_by: Arc::new(self.clone()),
                    name: name.to_owned(),
                    path,
                    czxid: stat.czxid,
                    marker: None,
                    reg,
                    release_attempted: AtomicBool::new(false),
                    written: AtomicBool::new(false),
                });
                watch_own_node(&ops, tracker.clone());
                // Leave the line: the next waiter (watching our queue node) becomes first.
                pending.armed = false;
                spawn_delete(session.clone(), node.clone(), None);
                let token = FencingToken::new(
                    self.slot_token_id(SlotKind::Semaphore, name, k),
                    u64::try_from(stat.czxid).unwrap_or(0),
                );
                let lease = Lease::new(name, token, tracker, ops.clone(), opts);
                return Ok((lease, ops, k, own));
            }
            if moved {
                continue; // N was rewritten since we read it: read again
            }
            if opts.wait == Wait::No {
                pending.delete_now().await;
                return Err(Error::Held {
                    name: name.to_owned(),
                });
            }
            // Every slot is held: wait for a change of the semaphore's children (we alone
            // watch them: a release or an expiry wakes one waiter).
            let (now, _, watcher) = session
                .retry_loss(io_deadline, || session.client.get_and_watch_children(dir))
                .await
                .map_err(fail)?;
            let now_held: HashSet<u32> = now.iter().filter_map(|c| slot_of(c)).collect();
            if (0..permits).any(|k| !now_held.contains(&k)) {
                continue;
            }
            if !wait_for(watcher.changed(), deadline).await {
                pending.delete_now().await;
                return Err(self.timeout(name, start));
            }
        }
    }

    fn timeout(&self, name: &str, start: Instant) -> Error {
        Error::Timeout {
            name: name.to_owned(),
            waited: start.elapsed(),
        }
    }

    /// The current leader of `dir`: its node name, `czxid`, data version and value (`None`
    /// when no candidate is in line); a leader deleted between the two reads is read again.
    async fn read_leader(
        &self,
        session: &Session,
        dir: &str,
    ) -> Result<Option<(i64, i32, Vec<u8>)>> {
        for _ in 0..3 {
            let Some(first) = sorted_children(session, dir).await?.into_iter().next() else {
                return Ok(None);
            };
            match session.client.get_data(&format!("{dir}/{first}")).await {
                Ok((value, stat)) => return Ok(Some((stat.czxid, stat.version, value))),
                Err(zk::Error::NoNode) => continue,
                Err(e) => return Err(from_zk(e)),
            }
        }
        Err(unavailable(
            "the election's leader changed during three reads in a row",
        ))
    }

    /// The semaphore's N and holders (slot, `czxid`, value); `None` when it has neither a
    /// holder nor a waiter.
    async fn read_permits(
        &self,
        session: &Session,
        name: &str,
        dir: &str,
    ) -> Result<Option<SlotHolders>> {
        let (data, _) = match session.client.get_data(dir).await {
            Ok(d) => d,
            Err(zk::Error::NoNode) => return Ok(None),
            Err(e) => return Err(from_zk(e)),
        };
        let children = match session.client.list_children(dir).await {
            Ok(c) => c,
            Err(zk::Error::NoNode) => return Ok(None),
            Err(e) => return Err(from_zk(e)),
        };
        let waiting = children.iter().any(|c| sequence_of(c).is_some());
        let mut slots: Vec<u32> = children.iter().filter_map(|c| slot_of(c)).collect();
        slots.sort_unstable();
        if slots.is_empty() && !waiting {
            return Ok(None);
        }
        let mut holders = Vec::new();
        for k in slots {
            match session
                .client
                .get_data(&format!("{dir}/{SLOT_PREFIX}{k}"))
                .await
            {
                Ok((value, stat)) => holders.push(SlotHolder::new(
                    k,
                    FencingToken::new(
                        self.slot_token_id(SlotKind::Semaphore, name, k),
                        u64::try_from(stat.czxid).unwrap_or(0),
                    ),
                    value.get(OWN_LEN..).unwrap_or_default().to_vec(),
                    None,
                )),
                Err(zk::Error::NoNode) => {}
                Err(e) => return Err(from_zk(e)),
            }
        }
        Ok(Some(SlotHolders::new(
            parse_permits(&data).unwrap_or(0),
            holders,
        )))
    }
}

/// Waits for `event` until `deadline`; `false` at the deadline.
async fn wait_for(
    event: impl Future<Output = zk::WatchedEvent>,
    deadline: Option<Instant>,
) -> bool {
    match deadline {
        Some(d) => tokio::time::timeout_at(d, event).await.is_ok(),
        None => {
            event.await;
            true
        }
    }
}

/// The slot number of a slot node `slot-{k}`.
fn slot_of(child: &str) -> Option<u32> {
    let k = child.strip_prefix(SLOT_PREFIX)?;
    if k.is_empty() || !k.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    k.parse().ok()
}

/// A semaphore node's data: its N.
fn parse_permits(data: &[u8]) -> Option<u32> {
    std::str::from_utf8(data).ok()?.trim().parse().ok()
}

/// The outcome of one claim of a slot.
enum Claim {
    Done,
    /// Another holder has the slot.
    Taken,
    /// N was rewritten since it was read (version check failed).
    Moved,
}

/// Claims slot node `path` (ephemeral, data `own`): one multi-op rewriting N at `version`
/// and creating the node. (The create's stat is read afterwards: ZooKeeper 3.8.0 returns
/// none inside a multi-op, ZOOKEEPER-4026.)
async fn claim(
    session: &Session,
    dir: &str,
    n: &[u8],
    version: i32,
    path: &str,
    own: &[u8],
) -> Result<Claim, zk::Error> {
    let mode = zk::CreateMode::Ephemeral.with_acls(session.own_acls());
    let mut w = session.client.new_multi_writer();
    w.add_set_data(dir, n, Some(version))?;
    w.add_create(path, own, &mode)?;
    match w.commit().await {
        Ok(_) => Ok(Claim::Done),
        Err(zk::MultiWriteError::OperationFailed {
            index: 1,
            source: zk::Error::NodeExists,
        }) => Ok(Claim::Taken),
        Err(zk::MultiWriteError::OperationFailed {
            index: 0,
            source: zk::Error::BadVersion,
        }) => Ok(Claim::Moved),
        Err(e) => Err(e.into()),
    }
}

/// A slot node being claimed, until the lease is handed out: deleted in the background if the
/// acquire is dropped meanwhile (only if its data shows it is ours: the claim's reply may not
/// have come).
struct SlotPending {
    session: Arc<Session>,
    path: String,
    own: String,
    armed: bool,
}

impl Drop for SlotPending {
    fn drop(&mut self) {
        if !self.armed || self.session.is_dead() {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return; // no runtime: the session's end frees the node
        };
        let (session, path, own) = (
            self.session.clone(),
            std::mem::take(&mut self.path),
            std::mem::take(&mut self.own),
        );
        rt.spawn(async move {
            // The `sync` makes a lagging follower apply the claim first (requests on one
            // session are answered in order).
            let read = session
                .retry_loss(None, || {
                    let sync = session.client.sync(&path);
                    let get = session.client.get_data(&path);
                    async move {
                        let (s, g) = tokio::join!(sync, get);
                        s?;
                        g
                    }
                })
                .await;
            if let Ok((data, stat)) = read
                && data.starts_with(own.as_bytes())
            {
                let _ = session
                    .retry_loss(None, || session.client.delete(&path, Some(stat.version)))
                    .await;
            }
        });
    }
}

/// The value side of a granted slot: a `setData` of the grant's own node.
#[derive(Debug)]
struct ZkSlotOps {
    lease: Arc<ZkLease>,
    /// What heads the node's data before the value (a permit's unique id; none for a leader).
    header: Vec<u8>,
}

#[async_trait]
impl SlotOps for ZkSlotOps {
    /// Sets the node's data (any version: the node's name holds the grant's unique id, nothing
    /// else writes it). The node exists only while the grant holds its slot (a leader's node
    /// is the lowest from its grant until it is gone), so success means still held.
    async fn set_value(&self, value: &[u8]) -> Result<()> {
        let l = &self.lease;
        let not_held = || Error::NotHeld {
            name: l.name.clone(),
        };
        if l.session.is_dead() {
            return Err(not_held());
        }
        // Before sending: a dropped call may have written the node, whose release then must
        // not expect version 0.
        l.written.store(true, Ordering::SeqCst);
        let data = [self.header.as_slice(), value].concat();
        let deadline = Instant::now() + l.session.ttl;
        match l
            .session
            .retry_loss(Some(deadline), || {
                l.session.client.set_data(&l.path, &data, None)
            })
            .await
        {
            Ok(stat) if stat.czxid == l.czxid => Ok(()),
            Ok(_) | Err(zk::Error::NoNode | zk::Error::SessionExpired) => Err(not_held()),
            Err(e) => Err(from_zk(e)),
        }
    }
}

/// What an observer saw at one read of an election.
#[derive(Debug, Clone)]
struct Seen {
    /// The election node's `czxid` and `cversion` (0, 0 when it did not exist).
    dir_czxid: i64,
    cversion: i32,
    /// The candidates, by sequence.
    queue: Vec<(i64, String)>,
    /// The leader (the first candidate): `czxid`, data version, value.
    leader: Option<(i64, i32, Vec<u8>)>,
}

impl Seen {
    fn leader_seq(&self) -> Option<i64> {
        self.queue.first().map(|(s, _)| *s)
    }

    /// Whether, going from `old` to `self`, a leader or a value may have come and gone
    /// unseen (one-shot watches: changes between a watch firing and the re-read).
    fn missed_since(&self, old: &Seen) -> bool {
        if let (Some(a), Some(b)) = (old.queue.first(), self.queue.first())
            && a == b
        {
            // The same leader: a value proclaimed and replaced before our read.
            let (va, vb) = (
                old.leader.as_ref().map_or(0, |l| l.1),
                self.leader.as_ref().map_or(0, |l| l.1),
            );
            return vb > va + 1;
        }
        if old.queue.is_empty() && self.queue.is_empty() && old.cversion == self.cversion {
            return false;
        }
        if self.leader.as_ref().is_some_and(|l| l.1 > 0) {
            // A new leader whose value was replaced before our read: its first value is unseen.
            return true;
        }
        // A candidate that stood between the old leader and the new one is gone: it may have
        // led in between.
        let new_first = self.leader_seq();
        let between = old.queue.iter().skip(1).any(|(s, _)| match new_first {
            Some(n) => *s < n,
            None => true,
        });
        if between {
            return true;
        }
        let new_is_known = self.queue.first().is_some_and(|f| old.queue.contains(f));
        if new_is_known {
            // It stood in line the whole time: nothing created later could lead before it.
            return false;
        }
        // Candidates created after the old read and gone before this one could have led:
        // count them from the children version (one per create and per delete).
        if old.dir_czxid != 0 && old.dir_czxid != self.dir_czxid {
            // The election node was removed (empty) and created again meanwhile.
            return true;
        }
        let base = if old.dir_czxid == 0 { 0 } else { old.cversion };
        let gone = old.queue.iter().filter(|c| !self.queue.contains(c)).count();
        let new = self.queue.iter().filter(|c| !old.queue.contains(c)).count();
        i64::from(self.cversion) - i64::from(base) > (gone + new) as i64
    }
}

/// The armed watches of an observer: the first event of any of them.
type Wake = Pin<Box<dyn Future<Output = zk::EventType> + Send>>;

/// An observer's watch on one election: a children watch on the election node plus a data
/// watch on the leader's node, both one-shot and re-armed at every read.
///
/// ZooKeeper watches fire once: changes between a watch firing and the re-read are not seen.
/// The watch keeps the last listing and reports [`WatchEvent::Missed`] where a leader or a
/// value may have come and gone unseen: a candidate that stood between the old and the new
/// leader is gone; candidates created and deleted between two reads (the election node's
/// children version moved by more than the changes seen) when the new leader was not already
/// in line; a leader's data version moved by more than one; after a session loss (watches
/// are per session). Within one session no event is lost across a reconnect: the client sets
/// its watches again and the server fires those whose node changed.
pub(crate) struct ZkWatch {
    lock: ZkLock,
    dir: String,
    token_id: String,
    session: Option<Arc<Session>>,
    last: Option<Seen>,
    pending: VecDeque<WatchEvent>,
    wake: Option<Wake>,
    /// The event that ended the last wait, until the read after it is done.
    woke: Option<zk::EventType>,
}

impl fmt::Debug for ZkWatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZkWatch")
            .field("dir", &self.dir)
            .field("pending", &self.pending.len())
            .finish_non_exhaustive()
    }
}

impl ZkWatch {
    /// A live session for the watch; `true` if it is not the one the last read used (its
    /// watches are gone with it).
    async fn session(&mut self) -> Result<(Arc<Session>, bool)> {
        let limit = Instant::now() + self.lock.config().get_connect_timeout();
        loop {
            let s = self.lock.bounded(self.lock.control_session()).await?;
            if !s.is_dead() && !s.client.state().is_terminated() {
                let changed = self.session.as_ref().is_some_and(|o| !Arc::ptr_eq(o, &s));
                self.session = Some(s.clone());
                return Ok((s, changed));
            }
            // The session ended but its monitor has not marked it dead yet.
            if Instant::now() >= limit {
                return Err(unavailable("the observer's ZooKeeper session ended"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Reads the election, arms the watches, queues the events.
    async fn read(&mut self) -> Result<()> {
        let (mut session, mut missed) = self.session().await?;
        let dir = self.dir.clone();
        // Probes of the first candidates of the last listing, sent before the new listing
        // (a session's requests are answered in order): a candidate that led between the two
        // listings is seen if it still stands when its probe is read.
        let probes: Vec<_> = match (&self.last, missed) {
            (Some(old), false) => old
                .queue
                .iter()
                .take(PROBES)
                .map(|(_, n)| session.client.get_data(&format!("{dir}/{n}")))
                .collect(),
            _ => Vec::new(),
        };
        let (seen, wake) = loop {
            let ended =
                |e: &zk::Error| matches!(e, zk::Error::SessionExpired | zk::Error::ClientClosed);
            let listing = session
                .retry_loss(None, || session.client.get_and_watch_children(&dir))
                .await;
            let (children, stat, cw) = match listing {
                Ok(l) => l,
                Err(zk::Error::NoNode) => {
                    match session
                        .retry_loss(None, || session.client.check_and_watch_stat(&dir))
                        .await
                    {
                        Ok((Some(_), _)) => continue, // created meanwhile
                        Ok((None, w)) => {
                            let wake: Wake = Box::pin(async move { w.changed().await.event_type });
                            let seen = Seen {
                                dir_czxid: 0,
                                cversion: 0,
                                queue: Vec::new(),
                                leader: None,
                            };
                            break (seen, wake);
                        }
                        Err(e) if ended(&e) || session.is_dead() => {
                            (session, _) = self.session().await?;
                            missed = true;
                            continue;
                        }
                        Err(e) => return Err(from_zk(e)),
                    }
                }
                Err(e) if ended(&e) || session.is_dead() => {
                    (session, _) = self.session().await?;
                    missed = true;
                    continue;
                }
                Err(e) => return Err(from_zk(e)),
            };
            let queue = in_line(children);
            let mut seen = Seen {
                dir_czxid: stat.czxid,
                cversion: stat.cversion,
                queue,
                leader: None,
            };
            let Some((_, first)) = seen.queue.first() else {
                let wake: Wake = Box::pin(async move { cw.changed().await.event_type });
                break (seen, wake);
            };
            let path = format!("{dir}/{first}");
            match session
                .retry_loss(None, || session.client.get_and_watch_data(&path))
                .await
            {
                Ok((value, dstat, dw)) => {
                    seen.leader = Some((dstat.czxid, dstat.version, value));
                    let wake: Wake = Box::pin(async move {
                        tokio::select! {
                            e = cw.changed() => e.event_type,
                            e = dw.changed() => e.event_type,
                        }
                    });
                    break (seen, wake);
                }
                Err(zk::Error::NoNode) => continue, // the leader went: list again
                Err(e) if ended(&e) || session.is_dead() => {
                    (session, _) = self.session().await?;
                    missed = true;
                    continue;
                }
                Err(e) => return Err(from_zk(e)),
            }
        };
        let mut base = self.last.clone();
        if let Some(old) = &self.last {
            for (i, probe) in probes.into_iter().enumerate() {
                match probe.await {
                    Ok((value, stat)) => {
                        // The leader when the probe was read: every candidate before it in
                        // the last listing was gone, and later ones stand behind it.
                        let at_probe = Seen {
                            dir_czxid: old.dir_czxid,
                            cversion: old.cversion + i32::try_from(i).unwrap_or(0),
                            queue: old.queue[i..].to_vec(),
                            leader: Some((stat.czxid, stat.version, value)),
                        };
                        let same = i == 0 && old.leader.as_ref().map(|l| l.1) == Some(stat.version);
                        if !same {
                            missed |= at_probe.missed_since(old);
                            self.emit(missed, &at_probe);
                            missed = false;
                            base = Some(at_probe);
                        }
                        break;
                    }
                    Err(zk::Error::NoNode) => continue,
                    Err(_) => break,
                }
            }
        }
        if let Some(old) = &base {
            // The election node removed (the server deletes an empty container) as the first
            // change after a listing without candidates: nothing came and went before.
            let reaped = old.queue.is_empty()
                && old.dir_czxid != 0
                && seen.dir_czxid == 0
                && self.woke == Some(zk::EventType::NodeDeleted);
            missed |= !reaped && seen.missed_since(old);
        }
        self.emit(missed, &seen);
        self.last = Some(seen);
        self.wake = Some(wake);
        self.woke = None;
        Ok(())
    }
}

impl ZkWatch {
    /// Queues `Missed` (if `missed`) and the holders of `seen`.
    fn emit(&mut self, missed: bool, seen: &Seen) {
        if missed {
            self.pending.push_back(WatchEvent::Missed);
        }
        let holders = seen
            .leader
            .iter()
            .map(|(czxid, _, value)| {
                SlotHolder::new(
                    0,
                    FencingToken::new(self.token_id.clone(), u64::try_from(*czxid).unwrap_or(0)),
                    value.clone(),
                    None,
                )
            })
            .collect();
        self.pending.push_back(WatchEvent::Holders(holders));
    }
}

#[async_trait]
impl SlotWatch for ZkWatch {
    async fn next(&mut self) -> Result<WatchEvent> {
        loop {
            if let Some(e) = self.pending.pop_front() {
                return Ok(e);
            }
            if let Some(w) = self.wake.as_mut() {
                self.woke = Some(w.await);
                self.wake = None;
            }
            // A read dropped half-way changes nothing: the next call reads again.
            self.read().await?;
        }
    }
}

/// Elections and semaphores on ZooKeeper (see the module docs and docs/election-semaphore.md).
#[async_trait]
impl SlotBackend for ZkLock {
    /// Grants a slot.
    ///
    /// - **Election**: the lock recipe in `/{prefix}/%elect/{name}`, with the value as the
    ///   candidate node's data; the term is the node's `czxid`.
    /// - **Semaphore**: queue FIFO in `/{prefix}/%sem/{name}` (N checked against its data);
    ///   first in line, claim the first free `slot-{k}` (its `czxid` is the token), else wait
    ///   for a slot to free.
    ///
    /// # Errors
    /// As [`Lock::acquire`](lockkit_core::Lock::acquire) on [`ZkLock`], plus
    /// [`Error::PermitsMismatch`].
    ///
    /// # Cancel safety
    /// Cancel safe: a node created by a dropped acquire (candidate, queue or slot node) is
    /// deleted in the background (found by the acquire's unique id if the create's reply had
    /// not come); if the connection is down, the session's expiry deletes it.
    async fn grant_slot(&self, req: SlotRequest<'_>, opts: AcquireOptions) -> Result<SlotGrant> {
        req.validate()?;
        ZkLock::check_opts(&opts)?;
        match req.kind {
            SlotKind::Semaphore => {
                let start = Instant::now();
                let deadline = wait_deadline(opts.wait, start);
                let attempts = retry_transient(&opts, deadline, || {
                    self.sem_attempt(req.name, req.permits, &opts, start, deadline)
                });
                let (lease, ops, slot, own) = if opts.wait == Wait::No {
                    self.bounded(attempts).await?
                } else {
                    attempts.await?
                };
                let ops = Arc::new(ZkSlotOps {
                    header: own.into_bytes(),
                    lease: ops,
                });
                Ok(SlotGrant::new(lease, slot, ops))
            }
            _ => {
                let t = Target {
                    name: req.name,
                    dir: self.slot_dir(SlotKind::Election, req.name),
                    token_id: self.slot_token_id(SlotKind::Election, req.name, 0),
                    data: req.value,
                    dir_data: &[],
                };
                let g = self.grant_at(&t, opts).await?;
                let ops = Arc::new(ZkSlotOps {
                    lease: g.ops,
                    header: Vec::new(),
                });
                Ok(SlotGrant::new(g.lease, 0, ops))
            }
        }
    }

    /// Reads the election's first candidate node (its `czxid` and value), or the semaphore's
    /// N and slot nodes. The remaining time is unknown (a node does not tell its session's
    /// timeout).
    ///
    /// # Errors
    /// [`Error::InvalidName`]; [`Error::Unavailable`] if no answer came within the connect
    /// timeout.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    async fn slot_holders(&self, kind: SlotKind, name: &str) -> Result<Option<SlotHolders>> {
        validate_slot_name(kind, name)?;
        let dir = self.slot_dir(kind, name);
        self.bounded(async {
            let session = self.control_session().await?;
            match kind {
                SlotKind::Semaphore => self.read_permits(&session, name, &dir).await,
                _ => Ok(self
                    .read_leader(&session, &dir)
                    .await?
                    .map(|(czxid, _, value)| {
                        let token = FencingToken::new(
                            self.slot_token_id(kind, name, 0),
                            u64::try_from(czxid).unwrap_or(0),
                        );
                        SlotHolders::new(1, vec![SlotHolder::new(0, token, value, None)])
                    })),
            }
        })
        .await
    }

    /// Watches an election: a children watch on its node and a data watch on the leader's
    /// node, re-armed at every read (one-shot watches). Before each new listing it reads the
    /// first candidates of the last one, so a leader that came and went between two listings
    /// is still seen if it stood in line at the last one and is there when read. It reports
    /// [`WatchEvent::Missed`] where a leader or a value may have come and gone unseen (a
    /// candidate that stood between the old and the new leader is gone; more creates and
    /// deletes than seen, by the node's children version; a data version that moved by more
    /// than one; a new leader that proclaimed before it was read) and after a session loss.
    /// Semaphores are not observed.
    ///
    /// # Errors
    /// [`Error::InvalidName`]; [`Error::NotSupported`] for a semaphore; transport errors.
    ///
    /// # Cancel safety
    /// Cancel safe: a dropped call leaves only one-shot watches, which fire once and go.
    async fn watch_slots(&self, kind: SlotKind, name: &str) -> Result<Box<dyn SlotWatch>> {
        validate_slot_name(kind, name)?;
        if kind != SlotKind::Election {
            return Err(Error::NotSupported {
                operation: "observing a semaphore",
                backend: BACKEND,
            });
        }
        let mut w = ZkWatch {
            lock: self.clone(),
            dir: self.slot_dir(kind, name),
            token_id: self.slot_token_id(kind, name, 0),
            session: None,
            last: None,
            pending: VecDeque::new(),
            wake: None,
            woke: None,
        };
        // The first state is the one when `observe` returned.
        w.read().await?;
        Ok(Box::new(w))
    }

    fn slot_guarantees(&self) -> SlotGuarantees {
        let mut lock = LockBackend::guarantees(self);
        lock.lock_delay = false;
        let mut g = SlotGuarantees::new(lock);
        g.observe = true;
        g.every_change_observed = false;
        g.notes = "elections are the lock recipe with the value as node data (term = the \
                   leader node's czxid); semaphores queue FIFO and hold ephemeral slot nodes \
                   (token = slot node czxid); observers use one-shot watches re-armed after \
                   each event and get Missed where a leader or value may have come and gone \
                   unseen, or after a session loss";
        g
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_nodes() {
        assert_eq!(slot_of("slot-0"), Some(0));
        assert_eq!(slot_of("slot-1023"), Some(1023));
        assert_eq!(slot_of("slot-"), None);
        assert_eq!(slot_of("slot-1x"), None);
        assert_eq!(slot_of("abc-lock-0000000001"), None);
        assert_eq!(parse_permits(b"3"), Some(3));
        assert_eq!(parse_permits(b""), None);
        assert_eq!(own_id().len(), OWN_LEN);
    }

    fn seen(cversion: i32, queue: &[i64], version: i32) -> Seen {
        Seen {
            dir_czxid: 1,
            cversion,
            queue: queue.iter().map(|s| (*s, format!("n-{s}"))).collect(),
            leader: queue.first().map(|s| (*s, version, Vec::new())),
        }
    }

    #[test]
    fn gaps() {
        // The next in line took over: nothing missed.
        assert!(!seen(4, &[2], 0).missed_since(&seen(3, &[1, 2], 0)));
        // A candidate between the old and the new leader went: it may have led.
        assert!(seen(5, &[3], 0).missed_since(&seen(3, &[1, 2, 3], 0)));
        // A new candidate came and the old leader went, counted exactly: nothing missed.
        assert!(!seen(5, &[4], 0).missed_since(&seen(3, &[1], 0)));
        // One more create and delete than seen: an unseen candidate may have led.
        assert!(seen(7, &[6], 0).missed_since(&seen(3, &[1], 0)));
        // The same leader proclaimed once, or twice.
        assert!(!seen(3, &[1], 1).missed_since(&seen(3, &[1], 0)));
        assert!(seen(3, &[1], 2).missed_since(&seen(3, &[1], 0)));
        // A candidate came and went with no leader before or after.
        assert!(seen(5, &[], 0).missed_since(&seen(3, &[], 0)));
        assert!(!seen(3, &[], 0).missed_since(&seen(3, &[], 0)));
    }
}
