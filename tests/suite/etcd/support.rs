//! Private etcd processes (single member or a 3-member cluster on loopback) and a TCP proxy
//! that can blackhole one client's traffic.

use std::process::Command;
use std::time::Duration;

use lockkit::etcd::etcd_client::{Client, ConnectOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::common::{ServerProcess, free_port};

/// One private etcd member.
pub struct Member {
    pub client_port: u16,
    pub proc: ServerProcess,
}

impl Member {
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }
}

fn data_dir() -> tempfile::TempDir {
    // tmpfs where available: etcd fsyncs every write.
    let base = if std::path::Path::new("/dev/shm").is_dir() {
        "/dev/shm"
    } else {
        "/tmp"
    };
    tempfile::Builder::new()
        .prefix("lockkit-etcd-test-")
        .tempdir_in(base)
        .expect("temp dir")
}

/// Starts `n` members forming one cluster (fast timers: 10 ms heartbeat, 100 ms election
/// timeout, so the minimum lease TTL is 1 s) and waits until it has a leader.
pub async fn start_cluster(n: usize) -> Vec<Member> {
    let ports: Vec<(u16, u16)> = (0..n).map(|_| (free_port(), free_port())).collect();
    let initial: Vec<String> = ports
        .iter()
        .enumerate()
        .map(|(i, (_, p))| format!("m{i}=http://127.0.0.1:{p}"))
        .collect();
    let initial = initial.join(",");
    let token = format!("lockkit-{:08x}", rand::random::<u32>());
    let mut members = Vec::new();
    for (i, (c, p)) in ports.iter().enumerate() {
        let name = format!("m{i}");
        let dir = data_dir();
        let mut cmd = Command::new("etcd");
        cmd.arg("--name")
            .arg(&name)
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .arg("--listen-client-urls")
            .arg(format!("http://127.0.0.1:{c}"))
            .arg("--advertise-client-urls")
            .arg(format!("http://127.0.0.1:{c}"))
            .arg("--listen-peer-urls")
            .arg(format!("http://127.0.0.1:{p}"))
            .arg("--initial-advertise-peer-urls")
            .arg(format!("http://127.0.0.1:{p}"))
            .arg("--initial-cluster")
            .arg(&initial)
            .arg("--initial-cluster-token")
            .arg(&token)
            .arg("--initial-cluster-state")
            .arg("new")
            .arg("--heartbeat-interval")
            .arg("10")
            .arg("--election-timeout")
            .arg("100")
            .arg("--logger")
            .arg("zap")
            .arg("--log-outputs")
            .arg("stderr")
            .arg("--log-level")
            .arg("warn");
        members.push(Member {
            client_port: *c,
            proc: ServerProcess::spawn(&format!("etcd-{name}"), dir, cmd),
        });
    }
    let eps: Vec<String> = members.iter().map(|m| m.endpoint()).collect();
    wait_for_leader(&eps, Duration::from_secs(20)).await;
    members
}

async fn raw(endpoint: &str) -> Option<Client> {
    let opts = ConnectOptions::new()
        .with_connect_timeout(Duration::from_millis(500))
        .with_timeout(Duration::from_millis(500));
    tokio::time::timeout(
        Duration::from_secs(1),
        Client::connect([format!("http://{endpoint}")], Some(opts)),
    )
    .await
    .ok()?
    .ok()
}

/// `(member id, leader id)` as one member sees it.
async fn status(endpoint: &str) -> Option<(u64, u64)> {
    let mut c = raw(endpoint).await?;
    let s = tokio::time::timeout(Duration::from_secs(1), c.status())
        .await
        .ok()?
        .ok()?;
    let me = s.header()?.member_id();
    Some((me, s.leader()))
}

/// Waits until every endpoint in `eps` answers and reports the same, nonzero leader.
pub async fn wait_for_leader(eps: &[String], limit: Duration) {
    let deadline = Instant::now() + limit;
    loop {
        let mut leaders = Vec::new();
        for e in eps {
            leaders.push(status(e).await.map(|s| s.1));
        }
        if let Some(Some(l)) = leaders.first() {
            if *l != 0 && leaders.iter().all(|x| *x == Some(*l)) {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "etcd cluster has no leader: {leaders:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The index in `members` of the current leader (from the maintenance status API).
pub async fn leader_index(members: &[Member]) -> usize {
    for (i, m) in members.iter().enumerate() {
        if let Some((me, leader)) = status(&m.endpoint()).await {
            if me == leader {
                return i;
            }
        }
    }
    panic!("no member says it is the leader");
}

/// Runs etcdctl (API v3) against `endpoint` and asserts it succeeded.
pub fn etcdctl(endpoint: &str, args: &[&str]) -> String {
    let out = Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints=http://{endpoint}"))
        .args(args)
        .output()
        .expect("run etcdctl");
    assert!(
        out.status.success(),
        "etcdctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A TCP proxy to one etcd endpoint that a test can blackhole: while on, no byte passes in
/// either direction (held, as in a partition), and connections stay open. It can also hold
/// only the replies (requests still reach etcd), and counts the chunks sent towards etcd.
pub struct Proxy {
    pub port: u16,
    /// Holds client → etcd bytes.
    up: watch::Sender<bool>,
    /// Holds etcd → client bytes.
    down: watch::Sender<bool>,
    /// Chunks forwarded client → etcd so far.
    sent: watch::Receiver<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Proxy {
    pub async fn start(upstream: String) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let port = listener.local_addr().expect("proxy addr").port();
        let (up, up_rx) = watch::channel(false);
        let (down, down_rx) = watch::channel(false);
        let (sent_tx, sent) = watch::channel(0u64);
        let sent_tx = std::sync::Arc::new(sent_tx);
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                let (upstream, up_rx, down_rx) = (upstream.clone(), up_rx.clone(), down_rx.clone());
                let sent_tx = sent_tx.clone();
                conns.spawn(async move {
                    let Ok(server) = TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::join!(
                        pipe(cr, sw, up_rx, Some(sent_tx)),
                        pipe(sr, cw, down_rx, None)
                    );
                });
            }
        });
        Proxy {
            port,
            up,
            down,
            sent,
            task,
        }
    }

    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn blackhole(&self, on: bool) {
        self.up.send_replace(on);
        self.down.send_replace(on);
    }

    /// Holds (or releases) etcd's replies only: requests still reach etcd and take effect.
    pub fn hold_replies(&self, on: bool) {
        self.down.send_replace(on);
    }

    /// Chunks forwarded towards etcd so far.
    pub fn sent(&self) -> u64 {
        *self.sent.borrow()
    }

    /// Waits until more than `after` chunks have been forwarded towards etcd.
    pub async fn sent_more_than(&self, after: u64) {
        let mut rx = self.sent.clone();
        rx.wait_for(|n| *n > after).await.expect("proxy gone");
    }
}

async fn hold(bh: &mut watch::Receiver<bool>) -> bool {
    while *bh.borrow_and_update() {
        if bh.changed().await.is_err() {
            return false;
        }
    }
    true
}

async fn pipe(
    mut r: tokio::net::tcp::OwnedReadHalf,
    mut w: tokio::net::tcp::OwnedWriteHalf,
    mut bh: watch::Receiver<bool>,
    sent: Option<std::sync::Arc<watch::Sender<u64>>>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if !hold(&mut bh).await {
            return;
        }
        let n = tokio::select! {
            n = r.read(&mut buf) => match n {
                Ok(0) | Err(_) => {
                    let _ = w.shutdown().await;
                    return;
                }
                Ok(n) => n,
            },
            _ = bh.changed() => continue,
        };
        if !hold(&mut bh).await {
            return;
        }
        if w.write_all(&buf[..n]).await.is_err() {
            return;
        }
        if let Some(sent) = &sent {
            sent.send_modify(|c| *c += 1);
        }
    }
}

/// Starts a single-member etcd on `data` (kept by the caller, so the member can be restarted on
/// it) and waits until it has elected itself.
pub async fn start_single(data: &std::path::Path, client_port: u16, peer_port: u16) -> Member {
    let name = "solo".to_owned();
    let mut cmd = Command::new("etcd");
    cmd.arg("--name")
        .arg(&name)
        .arg("--data-dir")
        .arg(data)
        .arg("--listen-client-urls")
        .arg(format!("http://127.0.0.1:{client_port}"))
        .arg("--advertise-client-urls")
        .arg(format!("http://127.0.0.1:{client_port}"))
        .arg("--listen-peer-urls")
        .arg(format!("http://127.0.0.1:{peer_port}"))
        .arg("--initial-advertise-peer-urls")
        .arg(format!("http://127.0.0.1:{peer_port}"))
        .arg("--initial-cluster")
        .arg(format!("{name}=http://127.0.0.1:{peer_port}"))
        .arg("--initial-cluster-state")
        .arg("new")
        .arg("--heartbeat-interval")
        .arg("10")
        .arg("--election-timeout")
        .arg("100")
        .arg("--logger")
        .arg("zap")
        .arg("--log-outputs")
        .arg("stderr")
        .arg("--log-level")
        .arg("warn");
    let m = Member {
        client_port,
        proc: ServerProcess::spawn("etcd-solo", data_dir(), cmd),
    };
    wait_for_leader(&[m.endpoint()], Duration::from_secs(20)).await;
    m
}

/// A fresh data directory (on tmpfs where available).
pub fn fresh_data_dir() -> tempfile::TempDir {
    data_dir()
}

/// Waits for the next event of `kind` on keys under `prefix`, from a watch created before the
/// action that causes it. Returns the key.
pub struct PrefixWatch {
    stream: lockkit::etcd::etcd_client::WatchStream,
}

impl PrefixWatch {
    pub async fn new(client: &Client, prefix: &[u8]) -> PrefixWatch {
        use lockkit::etcd::etcd_client::WatchOptions;
        let mut wc = client.watch_client();
        let mut stream = wc
            .watch(prefix.to_vec(), Some(WatchOptions::new().with_prefix()))
            .await
            .expect("watch");
        // Wait for the creation confirmation so no event is missed.
        let first = stream.message().await.expect("watch").expect("watch open");
        assert!(first.created());
        PrefixWatch { stream }
    }

    pub async fn next(
        &mut self,
        kind: lockkit::etcd::etcd_client::EventType,
        limit: Duration,
    ) -> Vec<u8> {
        let deadline = Instant::now() + limit;
        loop {
            let msg = tokio::time::timeout_at(deadline, self.stream.message())
                .await
                .unwrap_or_else(|_| panic!("no {kind:?} event within {limit:?}"))
                .expect("watch")
                .expect("watch ended");
            for e in msg.events() {
                if e.event_type() == kind {
                    return e.kv().map(|kv| kv.key().to_vec()).unwrap_or_default();
                }
            }
        }
    }
}
