//! One TCP proxy for every backend's failure tests: a test puts it between a client and a server
//! and then cuts that client's network in the ways the tests need.
//!
//! - **Freeze** (a partition, a dead NAT entry, a paused peer): [`Proxy::freeze`] holds every
//!   byte in both directions on every connection, new ones included; [`Proxy::freeze_existing`]
//!   and [`Proxy::freeze_connection`] do the same for chosen connections only, while new ones
//!   pass. Sockets stay open (no FIN, no RST), and a close is held like a byte: a peer never
//!   learns through a frozen connection that the other side went away. [`Proxy::thaw`] delivers
//!   what was held.
//! - **Hold one direction**: [`Proxy::hold_replies`] holds the server's bytes on every
//!   connection while requests still reach the server and take effect.
//! - **Count**: [`Proxy::connections`] (ids, for per-connection control) and [`Proxy::sent`]
//!   (messages forwarded towards the server, awaitable with [`Proxy::wait_sent_more_than`]).
//! - **Traps on one message** (for a proxy started with [`Proxy::start_with_spotter`], whose
//!   [`Spotter`] knows the protocol): [`Proxy::cut_at_next_spotted`] drops the next spotted
//!   message and cuts its connection (optionally refusing every later connection);
//!   [`Proxy::hold_from_next_spotted`] holds it, and everything after it in its direction on its
//!   connection, until [`Proxy::release_held`].
//!
//! Held bytes wait "in the network": each direction reads at most one message ahead and then
//! waits, so the sender's socket buffers fill as they would behind a real partition.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A direction of traffic through the proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Client → server: requests.
    ToServer,
    /// Server → client: replies.
    ToClient,
}

/// How each direction is split into the messages the proxy holds, inspects, counts and forwards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    /// Whatever one read returns (up to 64 KiB) is a message; for protocols the proxy does not
    /// inspect.
    Chunks,
    /// A 4-byte big-endian length, then that many bytes (ZooKeeper's framing); the spotter sees
    /// the bytes after the length. A length outside 0..=64 MiB ends the direction like a close.
    LengthPrefixed,
}

/// Picks out the message a trap waits for, on one connection: called with every message in both
/// directions, in order (requests and replies interleaved as they pass), it returns true for
/// the one to act on. One spotter is made per connection, so it can remember a request to
/// recognise its reply.
pub type Spotter = Box<dyn FnMut(Direction, &[u8]) -> bool + Send>;

/// What holds traffic; one value shared by every connection through a watch channel.
#[derive(Clone, Default)]
struct Rules {
    /// Every connection, new ones included, is frozen.
    freeze_all: bool,
    /// Connections with an id below this are frozen.
    frozen_below: u64,
    /// Further frozen connections.
    frozen: Vec<u64>,
    /// Server → client bytes are held on every connection.
    hold_replies: bool,
    /// New connections are accepted and closed at once.
    refuse: bool,
}

impl Rules {
    fn frozen(&self, id: u64) -> bool {
        self.freeze_all || id < self.frozen_below || self.frozen.contains(&id)
    }

    fn holds(&self, id: u64, dir: Direction) -> bool {
        self.frozen(id) || (dir == Direction::ToClient && self.hold_replies)
    }
}

/// State shared by the proxy handle, its accept loop and every connection.
struct Shared {
    upstream: String,
    framing: Framing,
    spotter: Option<Box<dyn Fn() -> Spotter + Send + Sync>>,
    rules: watch::Sender<Rules>,
    next_id: AtomicU64,
    /// Messages forwarded towards the server, over all connections.
    sent: watch::Sender<u64>,
    /// Armed by [`Proxy::cut_at_next_spotted`].
    cut_next: AtomicBool,
    refuse_after_cut: AtomicBool,
    /// Connections cut by the trap so far.
    cuts: watch::Sender<usize>,
    /// Armed by [`Proxy::hold_from_next_spotted`].
    hold_next: AtomicBool,
    /// Closed (true) while spotted messages must wait.
    gate: watch::Sender<bool>,
    /// Spotted messages held so far.
    held: watch::Sender<usize>,
}

/// A TCP proxy on a free port of 127.0.0.1 forwarding to one upstream address. Dropping it
/// closes its listener and every connection through it.
pub struct Proxy {
    pub port: u16,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Proxy {
    /// A proxy forwarding to `upstream` (`host:port`), moving bytes as they come.
    pub async fn start(upstream: impl Into<String>) -> Proxy {
        Self::spawn(upstream.into(), Framing::Chunks, None).await
    }

    /// A proxy forwarding to `127.0.0.1:port`.
    pub async fn start_local(port: u16) -> Proxy {
        Self::start(format!("127.0.0.1:{port}")).await
    }

    /// A proxy forwarding to `upstream` that splits traffic by `framing` and shows every
    /// connection's messages to a spotter made by `spotter`, for the traps
    /// ([`Proxy::cut_at_next_spotted`], [`Proxy::hold_from_next_spotted`]).
    pub async fn start_with_spotter(
        upstream: impl Into<String>,
        framing: Framing,
        spotter: impl Fn() -> Spotter + Send + Sync + 'static,
    ) -> Proxy {
        Self::spawn(upstream.into(), framing, Some(Box::new(spotter))).await
    }

    async fn spawn(
        upstream: String,
        framing: Framing,
        spotter: Option<Box<dyn Fn() -> Spotter + Send + Sync>>,
    ) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let port = listener.local_addr().expect("proxy addr").port();
        let shared = Arc::new(Shared {
            upstream,
            framing,
            spotter,
            rules: watch::Sender::new(Rules::default()),
            next_id: AtomicU64::new(0),
            sent: watch::Sender::new(0),
            cut_next: AtomicBool::new(false),
            refuse_after_cut: AtomicBool::new(false),
            cuts: watch::Sender::new(0),
            hold_next: AtomicBool::new(false),
            gate: watch::Sender::new(false),
            held: watch::Sender::new(0),
        });
        let task = tokio::spawn(accept(listener, shared.clone()));
        Proxy { port, shared, task }
    }

    /// `127.0.0.1:PORT` of the proxy.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Connections relayed so far; the next one gets this id (ids count from 0).
    pub fn connections(&self) -> u64 {
        self.shared.next_id.load(Ordering::SeqCst)
    }

    /// Freezes (blackholes) every connection, open or new, in both directions until
    /// [`Proxy::thaw`]: bytes and closes are held, sockets stay open, and a new connection is
    /// accepted but not dialled upstream (the server never sees it).
    pub fn freeze(&self) {
        self.shared.rules.send_modify(|r| r.freeze_all = true);
    }

    /// Freezes every connection open now, until [`Proxy::thaw`]; later ones pass.
    pub fn freeze_existing(&self) {
        let n = self.connections();
        self.shared.rules.send_modify(|r| r.frozen_below = n);
    }

    /// Freezes connection `id` (see [`Proxy::connections`]) until [`Proxy::thaw`].
    pub fn freeze_connection(&self, id: u64) {
        self.shared.rules.send_modify(|r| r.frozen.push(id));
    }

    /// Ends the freeze of connection `id` (one [`Proxy::freeze_connection`] froze): what it held
    /// is delivered, in order; other freezes stay.
    pub fn thaw_connection(&self, id: u64) {
        self.shared
            .rules
            .send_modify(|r| r.frozen.retain(|&f| f != id));
    }

    /// Ends every freeze: what was held is delivered, in order.
    pub fn thaw(&self) {
        self.shared.rules.send_modify(|r| {
            r.freeze_all = false;
            r.frozen_below = 0;
            r.frozen.clear();
        });
    }

    /// Holds (true) or lets through (false) the server's bytes on every connection; requests
    /// still reach the server and take effect.
    pub fn hold_replies(&self, on: bool) {
        self.shared.rules.send_modify(|r| r.hold_replies = on);
    }

    /// Messages forwarded towards the server so far, over all connections.
    pub fn sent(&self) -> u64 {
        *self.shared.sent.borrow()
    }

    /// Resolves once more than `n` messages have been forwarded towards the server.
    pub async fn wait_sent_more_than(&self, n: u64) {
        let mut rx = self.shared.sent.subscribe();
        let _ = rx.wait_for(|sent| *sent > n).await;
    }

    /// Drops the next spotted message and cuts its connection right there (both sockets are
    /// closed). With `then_refuse`, every later connection is refused (accepted and closed).
    pub fn cut_at_next_spotted(&self, then_refuse: bool) {
        self.assert_spotting();
        self.shared
            .refuse_after_cut
            .store(then_refuse, Ordering::SeqCst);
        self.shared.cut_next.store(true, Ordering::SeqCst);
    }

    /// Accepts new connections again after a cut that refused them.
    pub fn accept_again(&self) {
        self.shared.rules.send_modify(|r| r.refuse = false);
    }

    /// Connections cut by [`Proxy::cut_at_next_spotted`] so far.
    pub fn cuts(&self) -> usize {
        *self.shared.cuts.borrow()
    }

    /// Resolves once `n` connections have been cut (after their sockets are closed).
    pub async fn wait_cuts(&self, n: usize) {
        let mut rx = self.shared.cuts.subscribe();
        let _ = rx.wait_for(|c| *c >= n).await;
    }

    /// Holds the next spotted message, and everything after it in its direction on its
    /// connection, until [`Proxy::release_held`].
    pub fn hold_from_next_spotted(&self) {
        self.assert_spotting();
        self.shared.gate.send_replace(true);
        self.shared.hold_next.store(true, Ordering::SeqCst);
    }

    /// Resolves once a spotted message is being held.
    pub async fn wait_held(&self) {
        let mut rx = self.shared.held.subscribe();
        let _ = rx.wait_for(|n| *n >= 1).await;
    }

    /// Lets held spotted messages (and what queued behind them) through.
    pub fn release_held(&self) {
        self.shared.gate.send_replace(false);
    }

    fn assert_spotting(&self) {
        assert!(
            self.shared.spotter.is_some(),
            "a trap needs a proxy started with Proxy::start_with_spotter"
        );
    }
}

async fn accept(listener: TcpListener, shared: Arc<Shared>) {
    let mut conns = tokio::task::JoinSet::new();
    while let Ok((client, _)) = listener.accept().await {
        while conns.try_join_next().is_some() {}
        if shared.rules.borrow().refuse {
            drop(client);
            continue;
        }
        let id = shared.next_id.fetch_add(1, Ordering::SeqCst);
        conns.spawn(relay(id, client, shared.clone()));
    }
}

/// How a direction ended.
#[derive(PartialEq)]
enum End {
    /// Closed (or failed): the close was passed on.
    Closed,
    /// Cut by the trap: the whole connection goes.
    Cut,
}

async fn relay(id: u64, client: TcpStream, shared: Arc<Shared>) {
    // A frozen connection is not dialled: the server sees nothing until the thaw.
    let mut rules = shared.rules.subscribe();
    if rules.wait_for(|r| !r.frozen(id)).await.is_err() {
        return;
    }
    let Ok(server) = TcpStream::connect(&shared.upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let spotter = shared
        .spotter
        .as_ref()
        .map(|make| Arc::new(Mutex::new(make())));
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let cut = {
        let up = pump(id, Direction::ToServer, cr, sw, &shared, spotter.clone());
        let down = pump(id, Direction::ToClient, sr, cw, &shared, spotter);
        tokio::pin!(up, down);
        // A close travels on in its direction while the other one goes on (half-close); a cut
        // ends both at once.
        tokio::select! {
            e = &mut up => e == End::Cut || down.await == End::Cut,
            e = &mut down => e == End::Cut || up.await == End::Cut,
        }
    }; // both sockets are closed here
    if cut {
        shared.cuts.send_modify(|n| *n += 1);
    }
}

/// Forwards one direction, message by message, holding each while the rules say so.
async fn pump(
    id: u64,
    dir: Direction,
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    shared: &Shared,
    spotter: Option<Arc<Mutex<Spotter>>>,
) -> End {
    let mut rules = shared.rules.subscribe();
    let mut msg = Vec::new();
    loop {
        let body = read_message(shared.framing, &mut from, &mut msg).await;
        // Bytes, and a close, "in the network" wait while this direction is held.
        if rules.wait_for(|r| !r.holds(id, dir)).await.is_err() {
            return End::Closed;
        }
        let Some(body) = body else {
            let _ = to.shutdown().await;
            return End::Closed;
        };
        let spotted = match &spotter {
            Some(s) => (s.lock().expect("spotter"))(dir, &msg[body..]),
            None => false,
        };
        if spotted && shared.cut_next.swap(false, Ordering::SeqCst) {
            if shared.refuse_after_cut.load(Ordering::SeqCst) {
                // Before the sockets close, so that the client's reconnect is refused.
                shared.rules.send_modify(|r| r.refuse = true);
            }
            return End::Cut;
        }
        if spotted && shared.hold_next.swap(false, Ordering::SeqCst) {
            let mut gate = shared.gate.subscribe();
            shared.held.send_modify(|n| *n += 1);
            let _ = gate.wait_for(|closed| !*closed).await;
        }
        if to.write_all(&msg).await.is_err() {
            return End::Closed;
        }
        if dir == Direction::ToServer {
            shared.sent.send_modify(|n| *n += 1);
        }
    }
}

/// Reads the next message into `msg` (all of it, as it is to be forwarded); returns where its
/// body starts (after any length prefix), or `None` on a close, an error or a bad length.
async fn read_message(
    framing: Framing,
    from: &mut OwnedReadHalf,
    msg: &mut Vec<u8>,
) -> Option<usize> {
    match framing {
        Framing::Chunks => {
            msg.resize(64 * 1024, 0);
            match from.read(msg).await {
                Ok(0) | Err(_) => None,
                Ok(n) => {
                    msg.truncate(n);
                    Some(0)
                }
            }
        }
        Framing::LengthPrefixed => {
            let mut len = [0u8; 4];
            from.read_exact(&mut len).await.ok()?;
            let n = i32::from_be_bytes(len);
            if !(0..=64 << 20).contains(&n) {
                return None;
            }
            msg.clear();
            msg.extend_from_slice(&len);
            msg.resize(4 + n as usize, 0);
            from.read_exact(&mut msg[4..]).await.ok()?;
            Some(4)
        }
    }
}
