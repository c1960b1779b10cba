//! A byte-level TCP proxy in front of a Redis server that a test can use to black-hole chosen
//! connections (hold every byte, as a dead NAT entry or a partition that drops packets would,
//! while new connections still pass; [`Proxy::thaw`] delivers what was held) or to hold the
//! server's replies on all connections.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

#[derive(Clone, Default)]
struct Rules {
    /// Connections with an id below this are black-holed.
    frozen_below: u64,
    /// Further black-holed connections.
    frozen: Vec<u64>,
    /// Server→client bytes are held on every connection.
    hold_replies: bool,
}

impl Rules {
    fn blocks(&self, id: u64, reply: bool) -> bool {
        id < self.frozen_below || self.frozen.contains(&id) || (reply && self.hold_replies)
    }
}

pub struct Proxy {
    pub port: u16,
    next_id: Arc<AtomicU64>,
    rules: watch::Sender<Rules>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Proxy {
    /// A proxy on a free local port forwarding to `127.0.0.1:upstream`.
    pub async fn start(upstream: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let port = listener.local_addr().expect("proxy addr").port();
        let next_id = Arc::new(AtomicU64::new(0));
        let rules = watch::Sender::new(Rules::default());
        let task = {
            let (next_id, rules) = (next_id.clone(), rules.clone());
            tokio::spawn(async move {
                let mut conns = tokio::task::JoinSet::new();
                while let Ok((client, _)) = listener.accept().await {
                    let id = next_id.fetch_add(1, Ordering::SeqCst);
                    let rx = rules.subscribe();
                    conns.spawn(async move {
                        let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                            return;
                        };
                        let (cr, cw) = client.into_split();
                        let (sr, sw) = server.into_split();
                        // When either direction ends, both sockets are dropped.
                        tokio::select! {
                            _ = pump(id, false, rx.clone(), cr, sw) => {}
                            _ = pump(id, true, rx, sr, cw) => {}
                        }
                    });
                }
            })
        };
        Proxy {
            port,
            next_id,
            rules,
            task,
        }
    }

    /// How many connections were opened so far (the next one gets this id).
    pub fn conns(&self) -> u64 {
        self.next_id.load(Ordering::SeqCst)
    }

    /// Black-holes every connection open now, for good; later ones pass.
    pub fn freeze_existing(&self) {
        let n = self.conns();
        self.rules.send_modify(|r| r.frozen_below = n);
    }

    /// Black-holes connection `id` for good.
    pub fn freeze(&self, id: u64) {
        self.rules.send_modify(|r| r.frozen.push(id));
    }

    /// Lets every black-holed connection carry bytes again.
    pub fn thaw(&self) {
        self.rules.send_modify(|r| {
            r.frozen_below = 0;
            r.frozen.clear();
        });
    }

    /// Holds (true) or lets through (false) every reply from the server.
    pub fn hold_replies(&self, on: bool) {
        self.rules.send_modify(|r| r.hold_replies = on);
    }
}

async fn pump(
    id: u64,
    reply: bool,
    mut rules: watch::Receiver<Rules>,
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        // Bytes "in the network" wait while blocked.
        if rules.wait_for(|r| !r.blocks(id, reply)).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
