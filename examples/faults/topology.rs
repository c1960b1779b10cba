//! The Redis modes of several processes, for their rows of the fault matrix: Sentinel (a
//! primary, a replica and three sentinels, quorum 2), Cluster (three masters with a replica
//! each) and Redlock (five independent nodes). Started with the settings `scripts/servers.sh`
//! gives them (`start_sentinel`, `start_cluster`, `start_redlock`: no persistence,
//! `down-after-milliseconds 1000`, `cluster-node-timeout 2000`, Redlock nodes declared fresh),
//! here in the harness so it can SIGKILL, SIGSTOP and restart single nodes. The sentinels also
//! know each other from the start (`known-sentinel`) and have `failover-timeout 2000`, as in
//! `tests/suite/redis/sentinel.rs` (servers.sh's 5000 delays a retried election by 10 s).
//!
//! What a server fault means in each mode (see `docs/faults.md`): Sentinel, the current master;
//! Cluster, the master owning the slot of the matrix's lock name; Redlock, a minority (SIGKILL:
//! the lock keeps working) or a majority (SIGSTOP: acquires are `Unavailable`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Sentinel,
    Cluster,
    Redlock,
}

/// The lock name every cell uses (`Ctx::spec`): in Cluster mode its keys hash to the slot of
/// `=lock` (`Keys::build` tags the name as `{=lock}`).
const CLUSTER_TAG: &str = "{=lock}";

/// How long a fault's recovery (a promotion, a replica's resync) may take: 60 s. A promotion
/// once took over 30 s on the shared development machine (load average 20–45); the likely
/// cause, not confirmed (the logs were gone): a sentinel whose timer runs over 2 s late enters
/// TILT mode and does nothing for 30 s. A missed promotion now says whether one did.
const RECOVERY: Duration = Duration::from_secs(60);

struct Node {
    port: u16,
    args: Vec<String>,
    child: Option<Child>,
    sentinel: bool,
}

pub struct Topology {
    pub mode: Mode,
    nodes: Vec<Node>,
    dir: tempfile::TempDir,
    /// The cluster slot of the lock name.
    slot: u16,
}

impl Drop for Topology {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill(i);
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free port")
}

/// A free port whose cluster bus port (+10000) is free too.
fn cluster_port() -> u16 {
    loop {
        let p: u16 = rand::random_range(20000..45000);
        let ok = [p, p + 10000]
            .iter()
            .all(|q| std::net::TcpListener::bind(("127.0.0.1", *q)).is_ok());
        if ok {
            return p;
        }
    }
}

/// `redis-cli -p PORT ARGS…`'s output, bounded by 3 s (a SIGSTOPped server never answers).
fn cli(port: u16, args: &[&str]) -> String {
    Command::new("timeout")
        .args(["3", "redis-cli", "-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// Polls `check` every 100 ms until it holds, at most `limit`.
async fn until(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if check() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn data_args(port: u16, dir: &Path, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "--bind",
        "127.0.0.1",
        "--port",
        &port.to_string(),
        "--dir",
        &dir.display().to_string(),
        "--save",
        "",
        "--appendonly",
        "no",
        "--repl-diskless-sync-delay",
        "0",
        "--daemonize",
        "no",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

/// One line of `CLUSTER NODES`: id, port, master (not a replica), failed, the master's id, slots.
struct ClusterNode {
    id: String,
    port: u16,
    master: bool,
    failed: bool,
    of: String,
    slots: Vec<(u16, u16)>,
}

fn cluster_nodes(port: u16) -> Vec<ClusterNode> {
    cli(port, &["cluster", "nodes"])
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.len() < 8 {
                return None;
            }
            let port = f[1].split('@').next()?.rsplit(':').next()?.parse().ok()?;
            let slots = f[8..]
                .iter()
                .filter(|s| !s.starts_with('['))
                .filter_map(|s| {
                    let (a, b) = s.split_once('-').unwrap_or((s, s));
                    Some((a.parse().ok()?, b.parse().ok()?))
                })
                .collect();
            Some(ClusterNode {
                id: f[0].to_owned(),
                port,
                master: f[2].contains("master"),
                failed: f[2].contains("fail"),
                of: f[3].to_owned(),
                slots,
            })
        })
        .collect()
}

impl Topology {
    pub async fn start(mode: Mode) -> Result<Topology, String> {
        let dir = tempfile::Builder::new()
            .prefix("lockkit-faults-")
            .tempdir()
            .map_err(|e| format!("temp dir: {e}"))?;
        let mut t = Topology {
            mode,
            nodes: Vec::new(),
            dir,
            slot: 0,
        };
        match mode {
            Mode::Sentinel => t.start_sentinel().await?,
            Mode::Cluster => t.start_cluster().await?,
            Mode::Redlock => t.start_redlock().await?,
        }
        Ok(t)
    }

    fn node_dir(&self, i: usize) -> PathBuf {
        let d = self.dir.path().join(format!("n{i}"));
        let _ = std::fs::create_dir_all(&d);
        d
    }

    fn add(&mut self, port: u16, args: Vec<String>, sentinel: bool) -> Result<usize, String> {
        self.nodes.push(Node {
            port,
            args,
            child: None,
            sentinel,
        });
        let i = self.nodes.len() - 1;
        self.spawn(i)?;
        Ok(i)
    }

    fn spawn(&mut self, i: usize) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("n{i}.log")))
            .map_err(|e| e.to_string())?;
        let err = log.try_clone().map_err(|e| e.to_string())?;
        let child = Command::new("redis-server")
            .args(&self.nodes[i].args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("spawn redis-server: {e} (run scripts/install-deps.sh)"))?;
        self.nodes[i].child = Some(child);
        Ok(())
    }

    async fn ping(&self, i: usize) -> Result<(), String> {
        let port = self.nodes[i].port;
        if until(Duration::from_secs(10), || {
            cli(port, &["ping"]).trim() == "PONG"
        })
        .await
        {
            Ok(())
        } else {
            Err(format!("redis-server :{port} did not answer PING in 10 s"))
        }
    }

    /// SIGKILL of node `i`, reaped.
    fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.nodes[i].child.take() {
            crate::servers::signal(c.id(), "CONT");
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn signal(&self, i: usize, sig: &str) {
        if let Some(c) = &self.nodes[i].child {
            crate::servers::signal(c.id(), sig);
        }
    }

    fn index_of(&self, port: u16) -> Option<usize> {
        self.nodes.iter().position(|n| n.port == port)
    }

    fn data_nodes(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.nodes.len()).filter(|&i| !self.nodes[i].sentinel)
    }

    fn live(&self, i: usize) -> bool {
        self.nodes[i].child.is_some()
    }

    async fn start_sentinel(&mut self) -> Result<(), String> {
        let (m, r) = (free_port(), free_port());
        let args = data_args(m, &self.node_dir(0), &[]);
        self.add(m, args, false)?;
        self.ping(0).await?;
        let args = data_args(
            r,
            &self.node_dir(1),
            &["--replicaof", "127.0.0.1", &m.to_string()],
        );
        self.add(r, args, false)?;
        if !until(Duration::from_secs(10), || {
            cli(r, &["info", "replication"]).contains("master_link_status:up")
        })
        .await
        {
            return Err("sentinel topology: the replica did not sync in 10 s".into());
        }
        let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let ids: Vec<String> = (0..3)
            .map(|_| format!("{:040x}", rand::random::<u128>()))
            .collect();
        for (i, port) in ports.iter().enumerate() {
            let d = self.node_dir(2 + i);
            let mut conf = format!(
                "port {port}\nbind 127.0.0.1\ndir {}\nsentinel myid {}\n\
                 sentinel monitor lockkit 127.0.0.1 {m} 2\n\
                 sentinel down-after-milliseconds lockkit 1000\n\
                 sentinel failover-timeout lockkit 2000\n\
                 sentinel known-replica lockkit 127.0.0.1 {r}\n",
                d.display(),
                ids[i]
            );
            for (j, other) in ports.iter().enumerate() {
                if j != i {
                    conf.push_str(&format!(
                        "sentinel known-sentinel lockkit 127.0.0.1 {other} {}\n",
                        ids[j]
                    ));
                }
            }
            let path = d.join("sentinel.conf");
            std::fs::write(&path, conf).map_err(|e| e.to_string())?;
            self.add(
                *port,
                vec![path.display().to_string(), "--sentinel".into()],
                true,
            )?;
        }
        for &s in &ports {
            if !until(Duration::from_secs(10), || {
                cli(s, &["sentinel", "get-master-addr-by-name", "lockkit"]).contains(&m.to_string())
            })
            .await
            {
                return Err(format!("sentinel :{s} did not name the master in 10 s"));
            }
        }
        Ok(())
    }

    async fn start_cluster(&mut self) -> Result<(), String> {
        for i in 0..6 {
            let p = cluster_port();
            let d = self.node_dir(i);
            let conf = d.join("nodes.conf").display().to_string();
            let args = data_args(
                p,
                &d,
                &[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    &conf,
                    "--cluster-node-timeout",
                    "2000",
                ],
            );
            self.add(p, args, false)?;
        }
        for i in 0..6 {
            self.ping(i).await?;
        }
        let hosts: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&hosts)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("redis-cli --cluster create: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "redis-cli --cluster create: {}",
                String::from_utf8_lossy(&out.stdout)
            ));
        }
        self.slot = cli(self.nodes[0].port, &["cluster", "keyslot", CLUSTER_TAG])
            .trim()
            .parse()
            .map_err(|e| format!("cluster keyslot: {e}"))?;
        self.healthy().await
    }

    async fn start_redlock(&mut self) -> Result<(), String> {
        for i in 0..5 {
            let p = free_port();
            let args = data_args(p, &self.node_dir(i), &[]);
            self.add(p, args, false)?;
            self.ping(i).await?;
            self.declare_fresh(i)?;
        }
        Ok(())
    }

    /// A brand-new node holds no lease: it may vote at once (`scripts/servers.sh` does the same).
    fn declare_fresh(&self, i: usize) -> Result<(), String> {
        let out = cli(
            self.nodes[i].port,
            &["set", lockkit::redis::REDLOCK_BOOT_KEY, "0"],
        );
        if out.trim() == "OK" {
            Ok(())
        } else {
            Err(format!("SET boot marker: {out:?}"))
        }
    }

    /// The lockkit URL (without parameters).
    pub fn url(&self) -> String {
        let hosts = |idx: Vec<usize>| {
            idx.iter()
                .map(|&i| format!("127.0.0.1:{}", self.nodes[i].port))
                .collect::<Vec<_>>()
                .join(",")
        };
        match self.mode {
            Mode::Sentinel => format!("redis+sentinel://{}/lockkit", hosts(vec![2, 3, 4])),
            // The three nodes `--cluster create` made masters, as seeds.
            Mode::Cluster => format!("redis+cluster://{}", hosts(vec![0, 1, 2])),
            Mode::Redlock => format!("redlock://{}", hosts((0..5).collect())),
        }
    }

    /// Redlock's node ports (the holder partitioned in cell 3 reaches them through proxies).
    pub fn redlock_ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|n| n.port).collect()
    }

    /// The data node serving the lock now: Sentinel's master (as the first sentinel that
    /// answers names it), the Cluster master owning the lock's slot; `None` for Redlock.
    fn serving(&self) -> Option<usize> {
        match self.mode {
            Mode::Sentinel => (2..5).filter(|&s| self.live(s)).find_map(|s| {
                let out = cli(
                    self.nodes[s].port,
                    &["sentinel", "get-master-addr-by-name", "lockkit"],
                );
                let port = out.lines().nth(1)?.trim().parse().ok()?;
                self.index_of(port)
            }),
            Mode::Cluster => self.slot_master(),
            Mode::Redlock => None,
        }
    }

    /// The master owning the lock's slot, as a live node sees it.
    fn slot_master(&self) -> Option<usize> {
        let seen = self.data_nodes().find(|&i| self.live(i))?;
        cluster_nodes(self.nodes[seen].port)
            .into_iter()
            .find(|n| {
                n.master
                    && !n.failed
                    && n.slots
                        .iter()
                        .any(|&(a, b)| a <= self.slot && self.slot <= b)
            })
            .and_then(|n| self.index_of(n.port))
    }

    /// The replica of master `m` (Cluster), or the other data node (Sentinel).
    fn replica_of(&self, m: usize) -> Option<usize> {
        match self.mode {
            Mode::Sentinel => self.data_nodes().find(|&i| i != m),
            Mode::Cluster => {
                let nodes = cluster_nodes(self.nodes[m].port);
                let id = nodes
                    .iter()
                    .find(|n| n.port == self.nodes[m].port)?
                    .id
                    .clone();
                nodes
                    .iter()
                    .find(|n| !n.master && n.of == id)
                    .and_then(|n| self.index_of(n.port))
            }
            Mode::Redlock => None,
        }
    }

    /// Every data node up and answering, every replica linked to its master, the lock's
    /// master known (Sentinel: by all three sentinels alike, each seeing the replica linked,
    /// which after a fault happens at its next INFO of the replica, ≤ 10 s; Cluster:
    /// `cluster_state:ok` on every node and the lock's master listing its replica), within
    /// [`RECOVERY`]: awaited before each server fault, so that a master's failure can be
    /// failed over.
    pub async fn healthy(&self) -> Result<(), String> {
        let ok = until(RECOVERY, || {
            let data_ok = self.data_nodes().all(|i| {
                let p = self.nodes[i].port;
                let role = cli(p, &["role"]);
                match role.lines().next().map(str::trim) {
                    Some("master") => {
                        self.mode != Mode::Cluster
                            || cli(p, &["cluster", "info"]).contains("cluster_state:ok")
                    }
                    Some("slave") => {
                        cli(p, &["info", "replication"]).contains("master_link_status:up")
                            && (self.mode != Mode::Cluster
                                || cli(p, &["cluster", "info"]).contains("cluster_state:ok"))
                    }
                    _ => false,
                }
            });
            data_ok
                && match self.mode {
                    Mode::Sentinel => {
                        let named: Vec<String> = (2..5)
                            .map(|s| {
                                cli(
                                    self.nodes[s].port,
                                    &["sentinel", "get-master-addr-by-name", "lockkit"],
                                )
                            })
                            .collect();
                        let m = self.serving();
                        // Each sentinel sees the replica linked (else it would not promote it).
                        let replica_ok = (2..5).all(|s| {
                            let out = cli(self.nodes[s].port, &["sentinel", "replicas", "lockkit"]);
                            let f: Vec<&str> = out.lines().map(str::trim).collect();
                            let value = |k: &str| {
                                f.iter()
                                    .position(|l| *l == k)
                                    .and_then(|i| f.get(i + 1).copied())
                            };
                            value("flags") == Some("slave")
                                && value("master-link-status") == Some("ok")
                        });
                        replica_ok
                            && named.iter().all(|n| n == &named[0])
                            && m.is_some_and(|m| {
                                cli(self.nodes[m].port, &["role"]).starts_with("master")
                                    && cli(self.nodes[m].port, &["info", "replication"])
                                        .contains("connected_slaves:1")
                            })
                    }
                    Mode::Cluster => {
                        let masters = cluster_nodes(self.nodes[0].port)
                            .iter()
                            .filter(|n| n.master && !n.failed)
                            .count();
                        // The lock's master lists a replica of its own (after a restart, the
                        // master's view of its new replica comes by gossip, after the link).
                        masters == 3
                            && self
                                .slot_master()
                                .is_some_and(|m| self.replica_of(m).is_some())
                    }
                    Mode::Redlock => true,
                }
        })
        .await;
        if ok {
            Ok(())
        } else {
            Err(format!(
                "{:?} topology not healthy within {RECOVERY:?}",
                self.mode
            ))
        }
    }

    /// Waits until a node other than `old` serves the lock (a promotion), at most [`RECOVERY`].
    async fn promoted(&self, old: usize) -> Result<(usize, f64), String> {
        let t = Instant::now();
        let mut new = None;
        until(RECOVERY, || {
            new = self.serving().filter(|&n| n != old);
            new.is_some()
        })
        .await;
        new.map(|n| (n, t.elapsed().as_secs_f64())).ok_or_else(|| {
            format!(
                "no replica promoted within {RECOVERY:?}{}",
                if self.tilted() {
                    " (a sentinel entered TILT mode: its timer ran over 2 s late)"
                } else {
                    ""
                }
            )
        })
    }

    /// Whether a sentinel's log says it entered TILT mode.
    fn tilted(&self) -> bool {
        (0..self.nodes.len())
            .filter(|&i| self.nodes[i].sentinel)
            .any(|i| {
                std::fs::read_to_string(self.dir.path().join(format!("n{i}.log")))
                    .is_ok_and(|l| l.contains("+tilt"))
            })
    }

    /// "Server SIGKILL + restart" in this mode; returns what was done, for the figures.
    /// Sentinel: the master is SIGKILLed, the sentinels promote the replica, the old master
    /// comes back (empty) as the new master's replica. Cluster: the master owning the lock's
    /// slot is SIGKILLed, its replica is promoted, the old master comes back (its nodes.conf)
    /// and rejoins as a replica. Redlock: two of five nodes (a minority) are SIGKILLed and
    /// restarted at once without their data: the other three keep the lock working, the two
    /// refuse to vote for one `max_ttl` (delayed restart).
    pub async fn kill_and_restart(&mut self) -> Result<String, String> {
        match self.mode {
            Mode::Redlock => {
                for i in [0, 1] {
                    self.kill(i);
                    self.spawn(i)?;
                }
                for i in [0, 1] {
                    self.ping(i).await?;
                }
                Ok(
                    "nodes 1 and 2 of 5 (a minority) SIGKILLed and restarted empty (they vote \
                    again one max_ttl later)"
                        .into(),
                )
            }
            Mode::Sentinel | Mode::Cluster => {
                // A replica the sentinels or the cluster will promote.
                self.healthy().await?;
                let m = self.serving().ok_or("no master serves the lock")?;
                let port = self.nodes[m].port;
                self.kill(m);
                let (new, took) = self.promoted(m).await?;
                if self.mode == Mode::Sentinel {
                    // Back as the new master's replica (as an operator restarts it), empty.
                    let p = self.nodes[new].port.to_string();
                    let mut args = data_args(port, &self.node_dir(m), &[]);
                    args.extend(["--replicaof".into(), "127.0.0.1".into(), p]);
                    self.nodes[m].args = args;
                }
                self.spawn(m)?;
                self.ping(m).await?;
                Ok(format!(
                    "master :{port} SIGKILLed; replica :{} promoted {took:.2} s later; the old \
                     master back as its replica",
                    self.nodes[new].port
                ))
            }
        }
    }

    /// "Server SIGSTOP": Sentinel's master, the lock slot's master in Cluster (either may be
    /// failed over while stopped), three of five Redlock nodes (a majority). Returns what was
    /// stopped.
    pub fn stop(&mut self) -> Result<(Vec<usize>, String), String> {
        let (idx, what) = match self.mode {
            Mode::Redlock => (vec![0, 1, 2], "nodes 1–3 of 5 (a majority)".to_owned()),
            _ => {
                let m = self.serving().ok_or("no master serves the lock")?;
                (vec![m], format!("master :{}", self.nodes[m].port))
            }
        };
        for &i in &idx {
            self.signal(i, "STOP");
        }
        Ok((idx, what))
    }

    /// SIGCONT of what [`Topology::stop`] stopped; says which node serves the lock afterwards
    /// (as the sentinels or the cluster say right then).
    pub fn cont(&mut self, idx: &[usize]) -> String {
        for &i in idx {
            self.signal(i, "CONT");
        }
        match self.serving() {
            Some(m) if idx.contains(&m) => format!("master :{} again", self.nodes[m].port),
            Some(m) => format!("replica :{} promoted meanwhile", self.nodes[m].port),
            None => "all nodes resumed".into(),
        }
    }

    /// A coordinated failover (Sentinel: `SENTINEL FAILOVER`; Cluster: `CLUSTER FAILOVER` on the
    /// slot master's replica, which first catches up); `None` for Redlock (no replicas).
    pub async fn failover(&mut self) -> Option<Result<String, String>> {
        if self.mode == Mode::Redlock {
            return None;
        }
        Some(self.coordinated().await)
    }

    async fn coordinated(&mut self) -> Result<String, String> {
        self.healthy().await?;
        let m = self.serving().ok_or("no master serves the lock")?;
        let r = self.replica_of(m).ok_or("the master has no replica")?;
        let (how, out) = match self.mode {
            Mode::Sentinel => (
                "SENTINEL FAILOVER",
                cli(self.nodes[2].port, &["sentinel", "failover", "lockkit"]),
            ),
            _ => (
                "CLUSTER FAILOVER on its replica",
                cli(self.nodes[r].port, &["cluster", "failover"]),
            ),
        };
        if out.trim() != "OK" {
            return Err(format!("{how}: {out:?}"));
        }
        let (new, took) = self.promoted(m).await?;
        Ok(format!(
            "{how}: master :{} → :{} in {took:.2} s",
            self.nodes[m].port, self.nodes[new].port
        ))
    }

    /// Lock keys under `prefix` on the masters (Redlock: on every node).
    pub fn leftovers(&self, prefix: &str) -> Result<usize, String> {
        let pattern = format!("{prefix}:lock:*");
        let mut n = 0;
        for i in self.data_nodes().filter(|&i| self.live(i)) {
            let p = self.nodes[i].port;
            if self.mode != Mode::Redlock && !cli(p, &["role"]).starts_with("master") {
                continue;
            }
            n += cli(p, &["--scan", "--pattern", &pattern])
                .lines()
                .filter(|l| !l.trim().is_empty())
                .count();
        }
        Ok(n)
    }

    /// `GET key` on the master keeping it (Cluster: following the redirect to its slot's
    /// master). Redlock has no such counter.
    pub fn counter(&self, key: &str) -> Result<String, String> {
        match self.mode {
            Mode::Cluster => {
                let seen = self.data_nodes().find(|&i| self.live(i)).ok_or("no node")?;
                Ok(cli(self.nodes[seen].port, &["-c", "get", key]))
            }
            _ => {
                let m = self.serving().ok_or("no master serves the lock")?;
                Ok(cli(self.nodes[m].port, &["get", key]))
            }
        }
    }
}
