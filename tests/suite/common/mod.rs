//! Test support: server URLs, harnesses, private server processes, and the TCP proxy that
//! failure tests put between a client and its server.
#![allow(dead_code)] // each backend module uses a part

pub mod proxy;
pub mod slot_stress;

use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use lockkit::contract::Harness;
use lockkit::contract_election::SlotHarness;
use lockkit::{Election, Lock, Semaphore, async_trait};

/// The URL of the shared test server in `var`. Panics loudly when it is missing: a missing server
/// is a failure, never a skip.
pub fn server_url(var: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| {
        panic!(
            "{var} is not set. Run the suite with scripts/test.sh, or start servers with \
             `scripts/servers.sh start` and export the variables in the env file it prints."
        )
    })
}

/// A random key prefix, so runs and tests never see each other's locks.
pub fn fresh_prefix() -> String {
    format!("lockkit-test-{:016x}", rand::random::<u64>())
}

/// `url` with a `prefix=` query parameter added (before any `#fragment`).
pub fn with_prefix(url: &str, prefix: &str) -> String {
    let (base, fragment) = match url.split_once('#') {
        Some((b, f)) => (b, format!("#{f}")),
        None => (url, String::new()),
    };
    let sep = if base.contains('?') { '&' } else { '?' };
    format!("{base}{sep}prefix={prefix}{fragment}")
}

/// `res` is the `ForeignToken` error of a fenced write with `token` to `resource`, which the lock
/// of `guard` guards.
pub fn assert_foreign<T: std::fmt::Debug>(
    res: lockkit::Result<T>,
    resource: &str,
    guard: &lockkit::FencingToken,
    token: &lockkit::FencingToken,
) {
    match res {
        Err(lockkit::Error::ForeignToken {
            resource: r,
            expected_lock,
            token: t,
        }) => {
            assert_eq!(r, resource);
            assert_eq!(expected_lock, guard.lock());
            assert_eq!(t, *token);
        }
        other => panic!("a token of another lock: expected ForeignToken, got {other:?}"),
    }
}

/// After the server freed `lease`'s lock (of TTL `ttl`) behind its back: `check` says
/// `NotHeld` and the lease is Lost at once, long before its deadline. On etcd and ZooKeeper the
/// watch on the lease's own key/node may have told it first (it is then Lost with
/// `not_held_on_server`, and `check` says `LeaseLost` without asking).
pub async fn assert_check_finds_it_freed(lease: &lockkit::Lease, ttl: Duration) {
    use lockkit::{LeaseState, LossReason};
    match (lease.state(), lease.check().await) {
        (LeaseState::Held, Err(lockkit::Error::NotHeld { .. })) => {}
        (
            LeaseState::Lost,
            Err(lockkit::Error::LeaseLost {
                reason: LossReason::NotHeldOnServer,
                ..
            }),
        ) => {}
        (state, other) => panic!("check of a freed lock ({state:?} before): {other:?}"),
    }
    assert_eq!(lease.state(), LeaseState::Lost);
    assert_eq!(lease.loss_reason(), Some(LossReason::NotHeldOnServer));
    assert!(lease.valid_until() > tokio::time::Instant::now() + ttl / 2);
}

/// A backend fence's `from_lease` refuses a lease of another backend (memory) with a typed
/// error.
pub async fn refuses_a_memory_lease<T: std::fmt::Debug>(
    from_lease: impl FnOnce(&lockkit::Lease) -> lockkit::Result<T>,
) {
    use lockkit::LockExt;
    let memory = lockkit::connect("memory://").await.unwrap();
    let lease = memory
        .try_acquire("m", Duration::from_secs(10))
        .await
        .unwrap();
    let made = from_lease(&lease);
    assert!(
        matches!(made, Err(lockkit::Error::InvalidConfig { .. })),
        "a fence from a memory lease: {made:?}"
    );
    lease.release().await.unwrap();
}

/// A harness that connects a new client through `lockkit::connect` for every `client()` call.
pub struct UrlHarness {
    pub url: String,
    pub short_ttl: Duration,
    pub tolerance: Duration,
}

impl UrlHarness {
    /// A harness on the shared server in env var `var`, with a fresh prefix.
    pub fn from_env(var: &str) -> Self {
        Self {
            url: with_prefix(&server_url(var), &fresh_prefix()),
            // 2 s, not less: CI has 2 cores and runs tests in parallel, and a 1 s lease's
            // keepalive (every 333 ms) once missed its deadline under that load.
            short_ttl: Duration::from_secs(2),
            tolerance: Duration::from_secs(2),
        }
    }
}

#[async_trait]
impl Harness for UrlHarness {
    async fn client(&self) -> Arc<dyn Lock> {
        lockkit::connect(&self.url)
            .await
            .unwrap_or_else(|e| panic!("connect {}: {e:#?}", self.url))
    }
    fn short_ttl(&self) -> Duration {
        self.short_ttl
    }
    fn tolerance(&self) -> Duration {
        self.tolerance
    }
}

/// A backend's own client type, connected from its URL (what [`SlotClients`] hands out).
#[async_trait]
pub trait ConnectUrl: Election + Semaphore + Sized + 'static {
    /// The backend's `connect(url)`.
    async fn connect_url(url: &str) -> lockkit::Result<Self>;
}

/// Hands out a new client `L` (its own connections or sessions) per call, all under one fresh
/// prefix: the slot suite's harness on every network backend.
pub struct SlotClients<L> {
    /// This harness's key prefix.
    pub prefix: String,
    /// The server URL with `prefix` added.
    pub url: String,
    backend: PhantomData<fn() -> L>,
}

impl<L: ConnectUrl> SlotClients<L> {
    /// Clients of the shared server in env var `var`, under a fresh prefix.
    pub fn from_env(var: &str) -> Self {
        let prefix = fresh_prefix();
        Self {
            url: with_prefix(&server_url(var), &prefix),
            prefix,
            backend: PhantomData,
        }
    }

    /// A new client.
    pub async fn client(&self) -> L {
        L::connect_url(&self.url)
            .await
            .unwrap_or_else(|e| panic!("connect {}: {e:#?}", self.url))
    }
}

#[async_trait]
impl<L: ConnectUrl> SlotHarness for SlotClients<L> {
    async fn election(&self) -> Arc<dyn Election> {
        Arc::new(self.client().await)
    }
    async fn semaphore(&self) -> Arc<dyn Semaphore> {
        Arc::new(self.client().await)
    }
    // 2 s, as the lock suite: CI has 2 cores and runs tests in parallel (and ZooKeeper's
    // shared server has minSessionTimeout 1 s: 2 s leaves room for tick rounding).
    fn short_ttl(&self) -> Duration {
        Duration::from_secs(2)
    }
    fn tolerance(&self) -> Duration {
        Duration::from_secs(2)
    }
}

/// A free TCP port on 127.0.0.1 (bound, then released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free port")
}

/// A server process owned by one test: killed (SIGKILL) and reaped on drop; its data dir is a
/// temp dir removed on drop; its log is printed if the test panics.
pub struct ServerProcess {
    pub name: String,
    child: Option<Child>,
    pub dir: tempfile::TempDir,
    pub log: PathBuf,
}

impl ServerProcess {
    /// Spawns `cmd` (stdout and stderr to `<dir>/<name>.log`).
    pub fn spawn(name: &str, dir: tempfile::TempDir, mut cmd: Command) -> Self {
        let log = dir.path().join(format!("{name}.log"));
        let out = std::fs::File::create(&log).expect("log file");
        let err = out.try_clone().expect("log file");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {name}: {e} (run scripts/install-deps.sh)"));
        Self {
            name: name.to_owned(),
            child: Some(child),
            dir,
            log,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).expect("process gone")
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Sends `signal` (e.g. "STOP", "CONT", "KILL", "TERM") with kill(1).
    pub fn signal(&self, signal: &str) {
        let st = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid().to_string())
            .status()
            .expect("kill");
        assert!(st.success(), "kill -{signal} {} failed", self.pid());
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The last lines of the log.
    pub fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("---- {} log ----\n{}", self.name, self.log_tail());
        }
        self.kill();
    }
}

/// Polls `check` every 50 ms until it returns true or `limit` passes. For waiting on a process
/// that has no readiness signal other than answering (a server starting up).
pub async fn wait_until(what: &str, limit: Duration, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + limit;
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what} not ready after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
