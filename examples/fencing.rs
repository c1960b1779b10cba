//! The fencing demo: why a lock alone cannot protect data, and how a fencing token does.
//!
//! ```text
//! cargo run --example fencing                                     # embedded in-memory backend
//! cargo run --example fencing --features redis -- --backend redis://127.0.0.1:6379
//! cargo run --example fencing --features redis -- --backend redlock://h1:6379,h2:6379,h3:6379
//! cargo run --example fencing --features etcd  -- --backend etcd://127.0.0.1:2379
//! cargo run --example fencing --features zk    -- --backend zk://127.0.0.1:2181     # TTL: max(2 s, server minimum)
//! ```
//!
//! Client A acquires the lock (token n) and stalls past its TTL, as in a stop-the-world GC pause.
//! Client B then acquires it (token > n) and writes. A wakes up, still believing it holds the
//! lock, and writes with token n: the protected resource rejects the stale write. Last, a holder
//! of another lock writes: its token belongs to that lock, and the resource rejects it too.
//!
//! On a network backend A's stall is simulated by freezing all of A's traffic in a local TCP
//! relay (the server sees a holder that went silent, keepalive included). On `memory://`,
//! `redis+sentinel://` (the sentinels name the master's own address, which a relay in front of
//! them cannot stand in for) and URLs with several hosts A just stops renewing.

use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use lockkit::{AcquireOptions, Error, Lock, MemoryFence, Wait};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;

/// Reproduces the paused-holder failure and shows the fencing token rejecting the stale write.
#[derive(Parser, Debug)]
struct Args {
    /// Lock service URL: memory://, redis://host:port (also redis+sentinel://,
    /// redis+cluster://, redlock://), etcd://host:port, zk://host:port,
    /// postgres://user@host:port/db (network backends need their Cargo feature).
    #[arg(long, default_value = "memory://")]
    backend: String,
    /// Lease TTL, e.g. "2s" or "1500ms". Default 2 s, or the server's minimum if that is longer
    /// (ZooKeeper: its minSessionTimeout, 4 s with the stock tickTime=2000).
    #[arg(long, value_parser = humantime::parse_duration)]
    ttl: Option<Duration>,
    /// Lock name; a random suffix is added, so that each run starts on a fresh lock.
    #[arg(long, default_value = "fencing-demo")]
    name: String,
}

/// 2 s, or the server's shortest TTL if that is longer: a ZooKeeper with the stock
/// `tickTime=2000` refuses sessions under 4 s.
async fn default_ttl(url: &str) -> Result<Duration, Error> {
    let ttl = Duration::from_secs(2);
    #[cfg(feature = "zk")]
    if url.starts_with("zk://") {
        let min = lockkit::zk::ZkLock::connect(url).await?.min_ttl().await?;
        return Ok(ttl.max(min));
    }
    let _ = url;
    Ok(ttl)
}

struct Timeline(Instant);

impl Timeline {
    fn say(&self, who: &str, what: impl std::fmt::Display) {
        println!("[{:>7.3}s] {who:<8} {what}", self.0.elapsed().as_secs_f64());
    }
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    if let Err(e) = run(args).await {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

async fn run(args: Args) -> Result<(), Error> {
    let t = Arc::new(Timeline(Instant::now()));
    let memory = args.backend.starts_with("memory://");
    // A relay stands in for one server. The sentinels name the master's own address, and a URL
    // with several hosts names several servers: there A just stops renewing.
    let authority = args.backend.split_once("://").map_or("", |(_, rest)| {
        rest.split(['/', '?']).next().unwrap_or_default()
    });
    let unrelayed = args.backend.starts_with("redis+sentinel://") || authority.contains(',');
    let name = format!("{}-{:06x}", args.name, rand::random::<u32>() & 0xff_ffff);

    // B connects directly (first: a bad URL gets the library's own error); A reaches the server
    // through a relay we can freeze.
    type Clients = (Arc<dyn Lock>, Arc<dyn Lock>, Option<watch::Sender<bool>>);
    let b = lockkit::connect(&args.backend).await?;
    let (a, b, freeze): Clients = if memory {
        (b.clone(), b, None)
    } else if unrelayed {
        (lockkit::connect(&args.backend).await?, b, None)
    } else {
        let (url_a, freeze) = relay(&args.backend).await?;
        (lockkit::connect(&url_a).await?, b, Some(freeze))
    };
    let g = a.guarantees();
    let ttl = match args.ttl {
        Some(ttl) => ttl,
        None => default_ttl(&args.backend).await?,
    };
    t.say(
        "setup",
        format!(
            "backend {} ({:?} lock), lock {name:?}, TTL {:?}",
            g.backend, g.kind, ttl
        ),
    );

    let storage = MemoryFence::<String>::new();
    let file = "report.csv";

    let lease_a = a
        .acquire(
            &name,
            AcquireOptions::new()
                .ttl(ttl)
                .keepalive(freeze.is_some())
                .wait(Wait::No),
        )
        .await?;
    t.say(
        "A",
        format!("acquired the lock, fencing token {}", lease_a.token()),
    );
    storage.write(file, lease_a.token(), "v1 written by A".into())?;
    t.say(
        "A",
        format!("wrote {file:?} with token {}  -> accepted", lease_a.token()),
    );

    t.say(
        "A",
        "stalls (stop-the-world GC pause): no code runs, no keepalive gets out",
    );
    if let Some(f) = &freeze {
        let _ = f.send(true);
    }
    let lost_a = {
        let (t, lost) = (t.clone(), lease_a.lost());
        tokio::spawn(async move {
            lost.await;
            t.say(
                "A's lib",
                "lease deadline passed: loss signal fired (A is paused and cannot see it)",
            );
        })
    };

    let wait = ttl + g.expiry_slack + Duration::from_secs(10);
    t.say("B", "waits for the lock");
    let lease_b = b
        .acquire(
            &name,
            AcquireOptions::new().ttl(ttl * 5).wait(Wait::Timeout(wait)),
        )
        .await?;
    t.say(
        "B",
        format!(
            "acquired the lock after A's lease expired, fencing token {}",
            lease_b.token()
        ),
    );
    storage.write(file, lease_b.token(), "v2 written by B".into())?;
    t.say(
        "B",
        format!("wrote {file:?} with token {}  -> accepted", lease_b.token()),
    );

    // A's client-side deadline had already passed by the time B got the lock.
    tokio::time::timeout(Duration::from_secs(1), lost_a)
        .await
        .map_err(|_| Error::config("A's loss signal did not fire"))
        .and_then(|r| r.map_err(|e| Error::config_with("loss watcher failed", e)))?;
    if let Some(f) = &freeze {
        let _ = f.send(false);
    }
    t.say(
        "A",
        format!(
            "wakes up; its lease is {:?}, but a paused process checked nothing and writes anyway",
            lease_a.state()
        ),
    );
    match storage.write(
        file,
        lease_a.token(),
        "v1' written by A after its pause".into(),
    ) {
        Err(e @ Error::StaleToken { .. }) => t.say("storage", format!("REJECTED A's write: {e}")),
        Err(e) => return Err(e),
        Ok(()) => {
            t.say("storage", "accepted A's stale write: fencing failed!");
            std::process::exit(2);
        }
    }
    match lease_a.release().await {
        Err(Error::NotHeld { .. } | Error::LeaseLost { .. }) => t.say(
            "A",
            "release -> NotHeld: compare-and-delete left B's lock alone",
        ),
        Err(e) => t.say("A", format!("release failed ({e}); B's lock is untouched")),
        Ok(()) => t.say("A", "release returned Ok (the lock had been freed already)"),
    }
    // A token belongs to one lock: a holder of another lock cannot write the file, however
    // large its number.
    let other = b
        .acquire(
            &format!("{name}-other"),
            AcquireOptions::new().ttl(ttl * 5).wait(Wait::No),
        )
        .await?;
    t.say(
        "C",
        format!("holds another lock, token {}, and writes", other.token()),
    );
    match storage.write(file, other.token(), "written under another lock".into()) {
        Err(e @ Error::ForeignToken { .. }) => t.say("storage", format!("REJECTED C's write: {e}")),
        Err(e) => return Err(e),
        Ok(()) => {
            t.say(
                "storage",
                "accepted a token of another lock: fencing failed!",
            );
            std::process::exit(2);
        }
    }
    other.release().await?;
    t.say(
        "storage",
        format!("{file:?} = {:?}", storage.read(file).unwrap_or_default()),
    );
    lease_b.release().await?;
    t.say("B", "released the lock");
    Ok(())
}

/// Starts a local TCP relay to the first host of `url` and returns the URL rewritten to go through
/// it, plus a switch that freezes (true) or resumes (false) all traffic through the relay.
async fn relay(url: &str) -> Result<(String, watch::Sender<bool>), Error> {
    let parsed =
        url::Url::parse(url).map_err(|e| Error::config_with("malformed --backend URL", e))?;
    let host = parsed
        .host_str()
        .ok_or_else(|| Error::config("--backend URL has no host"))?
        .to_owned();
    let port = parsed
        .port()
        .ok_or_else(|| Error::config("--backend URL needs an explicit port"))?;
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| Error::config_with("cannot bind the relay", e))?;
    let local = listener
        .local_addr()
        .map_err(|e| Error::config_with("relay address", e))?;
    let mut through = parsed.clone();
    through
        .set_host(Some("127.0.0.1"))
        .map_err(|e| Error::config_with("URL host", e))?;
    through
        .set_port(Some(local.port()))
        .map_err(|_| Error::config("URL port"))?;
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let (host, rx) = (host.clone(), rx.clone());
            tokio::spawn(async move {
                if let Ok(server) = TcpStream::connect((host.as_str(), port)).await {
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::join!(pipe(cr, sw, rx.clone()), pipe(sr, cw, rx));
                }
            });
        }
    });
    Ok((through.to_string(), tx))
}

/// Copies bytes while not frozen; while frozen, holds them (the connection stays open, silent).
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut frozen: watch::Receiver<bool>,
) {
    use tokio::io::AsyncReadExt;
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        // A frozen holder's bytes wait, as in a stalled process: they flow again on thaw.
        while *frozen.borrow_and_update() {
            if frozen.changed().await.is_err() {
                return;
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
