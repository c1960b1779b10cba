//! A TCP proxy between one ZooKeeper client and the server that a test can freeze (hold every
//! byte, as a paused process or a partition would), make refuse new connections, or make drop
//! the reply to the next lock-node create and cut the connection right there.
//!
//! It parses ZooKeeper's framing (4-byte big-endian length, then the record): after the connect
//! handshake, client→server records start with `xid: i32, type: i32`, server→client records with
//! `xid: i32, zxid: i64, err: i32` (<https://zookeeper.apache.org/doc/r3.8.0/zookeeperProgrammers.html>,
//! `RequestHeader`/`ReplyHeader` in `zookeeper.jute`).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

const OP_CREATE: i32 = 1;
const OP_CREATE2: i32 = 15;

struct Ctl {
    refuse: AtomicBool,
    cut_next_create: AtomicBool,
    refuse_after_cut: AtomicBool,
    cuts: AtomicUsize,
    hold_next_create: AtomicBool,
    /// Closed (true) while a held create reply waits.
    gate: watch::Sender<bool>,
    /// Create replies held so far.
    held: watch::Sender<usize>,
}

impl Default for Ctl {
    fn default() -> Self {
        Ctl {
            refuse: AtomicBool::new(false),
            cut_next_create: AtomicBool::new(false),
            refuse_after_cut: AtomicBool::new(false),
            cuts: AtomicUsize::new(0),
            hold_next_create: AtomicBool::new(false),
            gate: watch::Sender::new(false),
            held: watch::Sender::new(0),
        }
    }
}

pub struct Proxy {
    pub port: u16,
    ctl: Arc<Ctl>,
    frozen: watch::Sender<bool>,
    cut_tx: watch::Sender<usize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Proxy {
    /// A proxy on a free local port forwarding to `upstream` (`host:port`).
    pub async fn start(upstream: String) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let port = listener.local_addr().expect("proxy addr").port();
        let ctl = Arc::new(Ctl::default());
        let (frozen, frozen_rx) = watch::channel(false);
        let (cut_tx, _) = watch::channel(0usize);
        let task = {
            let (ctl, cut_tx) = (ctl.clone(), cut_tx.clone());
            tokio::spawn(async move {
                let mut conns = tokio::task::JoinSet::new();
                while let Ok((client, _)) = listener.accept().await {
                    if ctl.refuse.load(Ordering::SeqCst) {
                        drop(client);
                        continue;
                    }
                    conns.spawn(serve(
                        client,
                        upstream.clone(),
                        ctl.clone(),
                        frozen_rx.clone(),
                        cut_tx.clone(),
                    ));
                }
            })
        };
        Proxy {
            port,
            ctl,
            frozen,
            cut_tx,
            task,
        }
    }

    /// Holds (true) or releases (false) every byte in both directions, new connections included.
    pub fn freeze(&self, on: bool) {
        self.frozen.send_replace(on);
    }

    /// Drops the server's reply to the next successful lock-node create and cuts that
    /// connection (the create itself reached the server and was applied). With `then_refuse`, every later
    /// connection is refused.
    pub fn cut_next_create(&self, then_refuse: bool) {
        self.ctl
            .refuse_after_cut
            .store(then_refuse, Ordering::SeqCst);
        self.ctl.cut_next_create.store(true, Ordering::SeqCst);
    }

    /// Holds the server's reply to the next successful lock-node create (and everything after
    /// it on that connection) until [`Proxy::release_held`].
    pub fn hold_next_create(&self) {
        self.ctl.gate.send_replace(true);
        self.ctl.hold_next_create.store(true, Ordering::SeqCst);
    }

    /// Resolves once a create reply is being held.
    pub async fn wait_held(&self) {
        let mut rx = self.ctl.held.subscribe();
        let _ = rx.wait_for(|n| *n >= 1).await;
    }

    /// Lets held replies through.
    pub fn release_held(&self) {
        self.ctl.gate.send_replace(false);
    }

    /// Cuts done so far.
    pub fn cuts(&self) -> usize {
        self.ctl.cuts.load(Ordering::SeqCst)
    }

    /// Resolves once `n` cuts happened.
    pub async fn wait_cuts(&self, n: usize) {
        let mut rx = self.cut_tx.subscribe();
        let _ = rx.wait_for(|c| *c >= n).await;
    }
}

async fn wait_thawed(frozen: &mut watch::Receiver<bool>) {
    let _ = frozen.wait_for(|f| !*f).await;
}

async fn serve(
    client: TcpStream,
    upstream: String,
    ctl: Arc<Ctl>,
    mut frozen: watch::Receiver<bool>,
    cut_tx: watch::Sender<usize>,
) {
    wait_thawed(&mut frozen).await;
    let Ok(server) = TcpStream::connect(&upstream).await else {
        return;
    };
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let drop_xid = Arc::new(Mutex::new(None::<i32>));
    let up = pump(
        cr,
        sw,
        frozen.clone(),
        Dir::Up,
        ctl.clone(),
        drop_xid.clone(),
    );
    let down = pump(sr, cw, frozen, Dir::Down, ctl.clone(), drop_xid);
    // When either side ends (or a cut happens), both sockets are dropped.
    let cut = tokio::select! {
        c = up => c,
        c = down => c,
    };
    if cut {
        if ctl.refuse_after_cut.load(Ordering::SeqCst) {
            ctl.refuse.store(true, Ordering::SeqCst);
        }
        let n = ctl.cuts.fetch_add(1, Ordering::SeqCst) + 1;
        cut_tx.send_replace(n);
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Dir {
    Up,
    Down,
}

/// Forwards whole records. Returns true if it cut the connection on purpose.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut frozen: watch::Receiver<bool>,
    dir: Dir,
    ctl: Arc<Ctl>,
    drop_xid: Arc<Mutex<Option<i32>>>,
) -> bool {
    let mut first = true; // the connect request/response has no header
    loop {
        let mut len = [0u8; 4];
        if from.read_exact(&mut len).await.is_err() {
            return false;
        }
        let n = i32::from_be_bytes(len);
        if !(0..=64 << 20).contains(&n) {
            return false;
        }
        let mut body = vec![0u8; n as usize];
        if from.read_exact(&mut body).await.is_err() {
            return false;
        }
        wait_thawed(&mut frozen).await;
        let xid = (!first && body.len() >= 4)
            .then(|| i32::from_be_bytes([body[0], body[1], body[2], body[3]]));
        match dir {
            Dir::Up if !first && body.len() >= 8 => {
                let op = i32::from_be_bytes([body[4], body[5], body[6], body[7]]);
                let is_lock_create = (op == OP_CREATE || op == OP_CREATE2)
                    && body.windows(6).any(|w| w == b"-lock-");
                let armed = ctl.cut_next_create.load(Ordering::SeqCst)
                    || ctl.hold_next_create.load(Ordering::SeqCst);
                if is_lock_create && armed {
                    *drop_xid.lock().unwrap() = xid;
                }
            }
            Dir::Down if xid.is_some() && *drop_xid.lock().unwrap() == xid => {
                // Reply header: xid i32, zxid i64, err i32. Cut only a create that succeeded (a
                // create failing with NoNode before the parent exists does not count).
                let err = body
                    .get(12..16)
                    .map(|b| i32::from_be_bytes([b[0], b[1], b[2], b[3]]));
                if err == Some(0) && ctl.cut_next_create.swap(false, Ordering::SeqCst) {
                    return true; // the create was applied; its reply never arrives
                }
                if err == Some(0) && ctl.hold_next_create.swap(false, Ordering::SeqCst) {
                    // The create was applied; its reply (and everything after it on this
                    // connection) waits until the gate opens.
                    let mut gate = ctl.gate.subscribe();
                    ctl.held.send_modify(|n| *n += 1);
                    let _ = gate.wait_for(|closed| !*closed).await;
                }
                *drop_xid.lock().unwrap() = None;
            }
            _ => {}
        }
        first = false;
        if to.write_all(&len).await.is_err() || to.write_all(&body).await.is_err() {
            return false;
        }
    }
}
