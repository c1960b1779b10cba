//! Private etcd processes (single member or a 3-member cluster on loopback). The proxy that
//! blackholes a client's traffic is `crate::common::proxy::Proxy`.

use std::process::Command;
use std::time::Duration;

use lockkit::etcd::etcd_client::{Client, ConnectOptions};
use tokio::time::Instant;

use crate::common::{ServerProcess, free_port};

/// One private etcd member.
pub struct Member {
    pub client_port: u16,
    pub proc: ServerProcess,
    /// Held by the first member of a cluster: one cluster at a time (see [`start_cluster`]).
    _slot: Option<tokio::sync::OwnedMutexGuard<()>>,
}

/// Cluster tests run one at a time: three etcd members each, SIGSTOPped and restarted, on a
/// 2-core machine shared with the rest of the suite, starve each other into spurious elections.
static CLUSTER_SLOT: std::sync::LazyLock<std::sync::Arc<tokio::sync::Mutex<()>>> =
    std::sync::LazyLock::new(Default::default);

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

/// Starts `n` members forming one cluster (fast timers: 50 ms heartbeat, 500 ms election
/// timeout, so the minimum lease TTL is 1 s) and waits until it has a leader. Waits for any
/// other test's cluster to be dropped first. A new cluster that elects no leader within 20 s
/// (seen once in a full CI run: a member that could not bind a port picked by `free_port`,
/// or starved by the rest of the suite) is killed and started again on fresh ports and data
/// directories, up to three times.
pub async fn start_cluster(n: usize) -> Vec<Member> {
    let slot = CLUSTER_SLOT.clone().lock_owned().await;
    let mut slot = Some(slot);
    for attempt in 1..=3 {
        let members = spawn_cluster(n, &mut slot);
        let eps: Vec<String> = members.iter().map(|m| m.endpoint()).collect();
        match leader_within(&eps, Duration::from_secs(20)).await {
            Ok(()) => return members,
            Err(seen) if attempt < 3 => {
                eprintln!("etcd cluster attempt {attempt}: no leader in 20 s ({seen}); again");
                // The first member holds the cluster slot: keep it across the restart.
                slot = members.into_iter().find_map(|mut m| m._slot.take());
            }
            Err(seen) => panic!("etcd cluster has no leader after 3 starts: {seen}"),
        }
    }
    unreachable!("the loop returns or panics")
}

fn spawn_cluster(n: usize, slot: &mut Option<tokio::sync::OwnedMutexGuard<()>>) -> Vec<Member> {
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
            .arg("50")
            .arg("--election-timeout")
            .arg("500")
            .arg("--logger")
            .arg("zap")
            .arg("--log-outputs")
            .arg("stderr")
            .arg("--log-level")
            .arg("warn");
        members.push(Member {
            client_port: *c,
            proc: ServerProcess::spawn(&format!("etcd-{name}"), dir, cmd),
            _slot: slot.take(),
        });
    }
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
    if let Err(seen) = leader_within(eps, limit).await {
        panic!("etcd cluster has no leader: {seen}");
    }
}

/// `Ok` once every endpoint in `eps` answers and reports the same, nonzero leader; after
/// `limit`, `Err` with what each endpoint last said.
async fn leader_within(eps: &[String], limit: Duration) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    loop {
        let mut leaders = Vec::new();
        for e in eps {
            leaders.push(status(e).await.map(|s| s.1));
        }
        if let Some(Some(l)) = leaders.first()
            && *l != 0
            && leaders.iter().all(|x| *x == Some(*l))
        {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!("{leaders:?}"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The index in `members` of the current leader (from the maintenance status API).
pub async fn leader_index(members: &[Member]) -> usize {
    for (i, m) in members.iter().enumerate() {
        if let Some((me, leader)) = status(&m.endpoint()).await
            && me == leader
        {
            return i;
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
        _slot: None,
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
