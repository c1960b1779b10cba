//! What the lock recipe (`lock.rs`) and the slots built on it (`slots.rs`) share: the grant's
//! target and result, the acquire's unique id, the pending node's guard, the node names.

use std::sync::Arc;
use std::time::Duration;

use lockkit_core::{Instant, Lease, Result};
use zookeeper_client as zk;

use crate::error::from_zk;
use crate::lease::ZkLease;
use crate::session::{Session, spawn_delete, spawn_delete_own};

/// An acquire's unique id, `{32 hex digits}-lock-`: the head of its sequential node's name (so
/// that an acquire whose create reply was lost finds its node) and of a slot node's data.
pub(crate) fn own_id() -> String {
    format!("{:032x}-lock-", rand::random::<u128>())
}

/// The length of [`own_id`]'s ids.
pub(crate) const OWN_LEN: usize = 38;

/// Where and what one grant of the lock recipe creates.
pub(crate) struct Target<'a> {
    /// The user's name (errors, the lease's name).
    pub(crate) name: &'a str,
    /// The container node the contenders' nodes are created in.
    pub(crate) dir: String,
    /// The token's lock identity ([`FencingToken::lock`](lockkit_core::FencingToken::lock)).
    pub(crate) token_id: String,
    /// The data of our node (a candidate's value).
    pub(crate) data: &'a [u8],
    /// The data `dir` gets when this grant creates it (a semaphore's N).
    pub(crate) dir_data: &'a [u8],
}

/// A grant of the lock recipe: the lease and its server half.
pub(crate) struct Granted {
    pub(crate) lease: Lease,
    pub(crate) ops: Arc<ZkLease>,
}

/// A lock node's creation: its `czxid` (the token) and `ctime` (server clock, ms since epoch).
#[derive(Clone, Copy)]
pub(crate) struct Created {
    pub(crate) czxid: i64,
    pub(crate) ctime: i64,
}

/// The sequence number of a lock node `…-lock-NNNNNNNNNN`.
pub(crate) fn sequence_of(child: &str) -> Option<i64> {
    let (_, seq) = child.rsplit_once("-lock-")?;
    if seq.is_empty() || !seq.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    seq.parse().ok()
}

/// The lock nodes among a container's `children`, each with its sequence number, in grant
/// order (the first in line first); other children (markers, slots) are left out.
pub(crate) fn in_line<S: AsRef<str> + Ord>(children: impl IntoIterator<Item = S>) -> Vec<(i64, S)> {
    let mut queue: Vec<(i64, S)> = children
        .into_iter()
        .filter_map(|c| sequence_of(c.as_ref()).map(|s| (s, c)))
        .collect();
    queue.sort_unstable();
    queue
}

/// The lock nodes in container `dir`, in grant order (see [`in_line`]); none when `dir` does
/// not exist. One unbounded read on `session`: the caller bounds it.
pub(crate) async fn sorted_children(session: &Session, dir: &str) -> Result<Vec<String>> {
    let children = match session.client.list_children(dir).await {
        Ok(c) => c,
        Err(zk::Error::NoNode) => Vec::new(),
        Err(e) => return Err(from_zk(e)),
    };
    Ok(in_line(children).into_iter().map(|(_, c)| c).collect())
}

/// This acquire's node until the lease is handed out: deleted (in the background) if the acquire
/// fails or is dropped at any await point. When the create's reply never came, the node is
/// found by this acquire's unique id.
pub(crate) struct Pending {
    pub(crate) session: Arc<Session>,
    pub(crate) dir: String,
    pub(crate) own: String,
    pub(crate) path: Option<String>,
    pub(crate) armed: bool,
}

impl Pending {
    /// Deletes the node now (bounded wait); on failure the drop retries in the background.
    pub(crate) async fn delete_now(&mut self) {
        if let Some(path) = &self.path {
            let deadline = Instant::now() + Duration::from_secs(2);
            match self
                .session
                .retry_loss(Some(deadline), || self.session.client.delete(path, Some(0)))
                .await
            {
                Ok(()) | Err(zk::Error::NoNode) => self.armed = false,
                Err(_) => {}
            }
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.armed || self.session.is_dead() {
            return;
        }
        match self.path.take() {
            Some(path) => spawn_delete(self.session.clone(), path, None),
            None => spawn_delete_own(
                self.session.clone(),
                std::mem::take(&mut self.dir),
                std::mem::take(&mut self.own),
            ),
        }
    }
}

/// How a waiter's wait on the node just ahead of it in line ended ([`wait_ahead`]).
pub(crate) enum Ahead {
    /// The node changed, or the session's state did (`event` says which): look again.
    Changed(zk::WatchedEvent),
    /// The node was gone between the listing and the watch: look again.
    Gone,
    /// The acquire's deadline passed.
    Deadline,
}

/// Watches only `ahead`, the node just ahead of ours in container `dir` (FIFO: a release wakes
/// exactly one waiter), and waits for it to change until `deadline`, holding what `waiting()`
/// returns (a gauge) while it sleeps. The watch is set with `session`'s retries until
/// `io_deadline`.
///
/// # Errors
/// ZooKeeper's error from setting the watch.
pub(crate) async fn wait_ahead<W>(
    session: &Session,
    dir: &str,
    ahead: &str,
    io_deadline: Option<Instant>,
    deadline: Option<Instant>,
    waiting: impl FnOnce() -> W,
) -> std::result::Result<Ahead, zk::Error> {
    let pred = format!("{dir}/{ahead}");
    let (stat, watcher) = session
        .retry_loss(io_deadline, || session.client.check_and_watch_stat(&pred))
        .await?;
    if stat.is_none() {
        return Ok(Ahead::Gone);
    }
    let _waiting = waiting();
    let event = watcher.changed();
    Ok(match deadline {
        Some(d) => match tokio::time::timeout_at(d, event).await {
            Ok(e) => Ahead::Changed(e),
            Err(_) => Ahead::Deadline,
        },
        None => Ahead::Changed(event.await),
    })
}
