//! Private server instances the harness owns: started on a free loopback port with their own data
//! dir, and SIGKILLed, SIGSTOPped/SIGCONTed and restarted on the same port and data dir. Started
//! the way `scripts/servers.sh` starts them (see /work/shared/servers.md for the commands).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

use crate::topology::{Mode, Topology};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Redis,
    Etcd,
    Zk,
    Postgres,
    Sentinel,
    Cluster,
    Redlock,
}

impl Kind {
    pub fn label(self) -> &'static str {
        match self {
            Kind::Redis => "Redis (single)",
            Kind::Etcd => "etcd (1 member)",
            Kind::Zk => "ZooKeeper (standalone)",
            Kind::Postgres => "PostgreSQL",
            Kind::Sentinel => "Redis Sentinel (master, replica, 3 sentinels)",
            Kind::Cluster => "Redis Cluster (3 masters + 3 replicas)",
            Kind::Redlock => "Redlock (5 nodes)",
        }
    }

    /// The mode of several Redis processes this is, if it is one.
    pub fn topology(self) -> Option<Mode> {
        match self {
            Kind::Sentinel => Some(Mode::Sentinel),
            Kind::Cluster => Some(Mode::Cluster),
            Kind::Redlock => Some(Mode::Redlock),
            _ => None,
        }
    }

    pub fn parse(s: &str) -> Option<Kind> {
        match s {
            "redis" => Some(Kind::Redis),
            "etcd" => Some(Kind::Etcd),
            "zk" => Some(Kind::Zk),
            "postgres" => Some(Kind::Postgres),
            "redis-sentinel" => Some(Kind::Sentinel),
            "redis-cluster" => Some(Kind::Cluster),
            "redlock" => Some(Kind::Redlock),
            _ => None,
        }
    }

    /// How long after a lapsed TTL the server itself may still hold the lock, per the backend's
    /// docs (README fine print): etcd frees up to max(1 s, min TTL) + 0.5 s late, a ZooKeeper
    /// session expires up to one tick (500 ms here) late, PostgreSQL's idle timeout has ≤ 100 ms,
    /// a Redlock waiter polls ([`REDLOCK_EXPIRY_SLACK`](lockkit::redis::REDLOCK_EXPIRY_SLACK)).
    pub fn expiry_slack(self) -> Duration {
        match self {
            Kind::Redis | Kind::Sentinel | Kind::Cluster => Duration::from_millis(200),
            Kind::Redlock => lockkit::redis::REDLOCK_EXPIRY_SLACK,
            Kind::Etcd => Duration::from_millis(1500),
            Kind::Zk => Duration::from_millis(600),
            Kind::Postgres => Duration::from_millis(200),
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free port")
}

fn pg_bin() -> PathBuf {
    let root = Path::new("/usr/lib/postgresql");
    let mut versions: Vec<u32> = std::fs::read_dir(root)
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    versions.sort();
    root.join(versions.last().map_or("15".into(), |v| v.to_string()))
        .join("bin")
}

fn run(what: &str, cmd: &mut Command) -> Result<String, String> {
    let out = cmd.output().map_err(|e| format!("{what}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{what} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn as_postgres(tool: &str) -> Command {
    let mut c = Command::new("runuser");
    c.args(["-u", "postgres", "--"]).arg(pg_bin().join(tool));
    c
}

/// Sends `sig` ("KILL", "STOP", "CONT") to `pid` with kill(1).
pub fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .stderr(Stdio::null())
        .status();
}

/// The children of `pid` (from /proc), for PostgreSQL's backends.
fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Some(child) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
            continue;
        };
        // pid (comm) state ppid …; comm may hold spaces: split after the last ')'.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(pid) {
            out.push(child);
        }
    }
    out
}

/// True once `pid` is gone or a zombie.
fn gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_none_or(|s| s == "Z" || s == "X"),
    }
}

/// One server process of an instance: its ports and, while it runs, its process.
struct Member {
    /// Client port.
    port: u16,
    /// etcd peer port; ZooKeeper quorum port.
    peer_port: u16,
    /// ZooKeeper leader-election port.
    election_port: u16,
    child: Option<Child>,
}

/// A private instance: one server, or (etcd, ZooKeeper) a 3-member cluster / ensemble, or a
/// Redis topology of several processes (Sentinel, Cluster, Redlock: `topo`, no `members`).
pub struct Server {
    pub kind: Kind,
    members: Vec<Member>,
    dir: tempfile::TempDir,
    pub topo: Option<Topology>,
    /// The topology's nodes SIGSTOPped by [`Server::stop`].
    paused: Vec<usize>,
}

impl Drop for Server {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.signal_member(i, "CONT");
            self.kill_member(i);
        }
    }
}

impl Server {
    /// Starts a fresh single server and waits until a lockkit client can connect (at most 90 s).
    pub async fn start(kind: Kind) -> Result<Server, String> {
        Self::start_n(kind, 1).await
    }

    /// Starts `n` members (etcd cluster or ZooKeeper ensemble when `n` > 1), waits until ready.
    pub async fn start_n(kind: Kind, n: usize) -> Result<Server, String> {
        // etcd and ZooKeeper fsync every write: a tmpfs data dir keeps them fast, and survives a
        // process SIGKILL (what the scenarios do) like a disk would.
        let dir = match kind {
            Kind::Etcd | Kind::Zk if Path::new("/dev/shm").is_dir() => tempfile::Builder::new()
                .prefix("lockkit-faults-")
                .tempdir_in("/dev/shm"),
            _ => tempfile::Builder::new().prefix("lockkit-faults-").tempdir(),
        }
        .map_err(|e| format!("temp dir: {e}"))?;
        let members = (0..n)
            .map(|_| Member {
                port: free_port(),
                peer_port: free_port(),
                election_port: free_port(),
                child: None,
            })
            .collect();
        if let Some(mode) = kind.topology() {
            let topo = Topology::start(mode).await?;
            let s = Server {
                kind,
                members: Vec::new(),
                dir,
                topo: Some(topo),
                paused: Vec::new(),
            };
            s.ready(Duration::from_secs(90)).await?;
            return Ok(s);
        }
        let mut s = Server {
            kind,
            members,
            dir,
            topo: None,
            paused: Vec::new(),
        };
        if kind == Kind::Postgres {
            run("chmod", Command::new("chmod").arg("755").arg(s.dir.path()))?;
            let root = s.pg_root();
            run(
                "install -d",
                Command::new("install")
                    .args(["-d", "-o", "postgres", "-g", "postgres"])
                    .arg(&root),
            )?;
            run(
                "initdb",
                as_postgres("initdb")
                    .arg("-D")
                    .arg(root.join("data"))
                    .args(["-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"]),
            )?;
        }
        for i in 0..n {
            s.spawn(i)?;
        }
        s.ready(Duration::from_secs(90)).await?;
        Ok(s)
    }

    /// The client port of the (first) server.
    pub fn port(&self) -> u16 {
        self.members[0].port
    }

    fn pg_root(&self) -> PathBuf {
        self.dir.path().join("pg")
    }

    pub fn url(&self) -> String {
        let hosts = |ports: Vec<u16>| {
            ports
                .iter()
                .map(|p| format!("127.0.0.1:{p}"))
                .collect::<Vec<_>>()
                .join(",")
        };
        let all = hosts(self.members.iter().map(|m| m.port).collect());
        match self.kind {
            Kind::Redis => format!("redis://{all}"),
            Kind::Etcd => format!("etcd://{all}"),
            Kind::Zk => format!("zk://{all}"),
            Kind::Postgres => format!("postgres://postgres@{all}/postgres"),
            Kind::Sentinel | Kind::Cluster | Kind::Redlock => {
                self.topo.as_ref().map_or_else(String::new, Topology::url)
            }
        }
    }

    /// `url()` of a single server with its port replaced (to go through a proxy).
    pub fn url_via(&self, port: u16) -> String {
        self.url()
            .replace(&format!(":{}", self.port()), &format!(":{port}"))
    }

    fn log(&self, i: usize) -> std::fs::File {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("server-{i}.log")))
            .expect("server log")
    }

    /// Starts member `i` on its ports and data dir.
    fn spawn(&mut self, i: usize) -> Result<(), String> {
        let d = self.dir.path().join(format!("m{i}"));
        std::fs::create_dir_all(&d).map_err(|e| e.to_string())?;
        let p = self.members[i].port;
        let mut cmd = match self.kind {
            Kind::Redis => {
                let mut c = Command::new("redis-server");
                c.args(["--bind", "127.0.0.1", "--port", &p.to_string()])
                    .arg("--dir")
                    .arg(&d)
                    .args(["--save", "", "--appendonly", "no", "--daemonize", "no"]);
                c
            }
            Kind::Etcd => {
                let pp = self.members[i].peer_port;
                let cluster = self
                    .members
                    .iter()
                    .enumerate()
                    .map(|(j, m)| format!("m{j}=http://127.0.0.1:{}", m.peer_port))
                    .collect::<Vec<_>>()
                    .join(",");
                // A cluster gets the timers the suite's cluster tests use on this loaded host
                // (10/100 ms starved 3 members into elections); a single member elects itself.
                let (hb, el) = if self.members.len() > 1 {
                    ("50", "500")
                } else {
                    ("10", "100")
                };
                let mut c = Command::new("etcd");
                c.args(["--name", &format!("m{i}"), "--data-dir"])
                    .arg(d.join("etcd"))
                    .args(["--listen-client-urls", &format!("http://127.0.0.1:{p}")])
                    .args(["--advertise-client-urls", &format!("http://127.0.0.1:{p}")])
                    .args(["--listen-peer-urls", &format!("http://127.0.0.1:{pp}")])
                    .args([
                        "--initial-advertise-peer-urls",
                        &format!("http://127.0.0.1:{pp}"),
                    ])
                    .args(["--initial-cluster", &cluster])
                    .args(["--initial-cluster-state", "new"])
                    .args(["--initial-cluster-token", "lockkit-faults"])
                    .args(["--heartbeat-interval", hb, "--election-timeout", el])
                    .args([
                        "--logger",
                        "zap",
                        "--log-outputs",
                        "stderr",
                        "--log-level",
                        "warn",
                    ]);
                c
            }
            Kind::Zk => {
                let cfg = d.join("zoo.cfg");
                let data = d.join("data");
                std::fs::create_dir_all(&data).map_err(|e| e.to_string())?;
                let mut ensemble = String::new();
                if self.members.len() > 1 {
                    std::fs::write(data.join("myid"), format!("{}\n", i + 1))
                        .map_err(|e| e.to_string())?;
                    ensemble.push_str("initLimit=20\nsyncLimit=5\n");
                    for (j, m) in self.members.iter().enumerate() {
                        ensemble.push_str(&format!(
                            "server.{}=127.0.0.1:{}:{}\n",
                            j + 1,
                            m.peer_port,
                            m.election_port
                        ));
                    }
                }
                std::fs::write(
                    &cfg,
                    format!(
                        "tickTime=500\nminSessionTimeout=1000\nmaxSessionTimeout=60000\n\
                         dataDir={}\nclientPortAddress=127.0.0.1\nclientPort={p}\n\
                         admin.enableServer=false\n4lw.commands.whitelist=ruok,srvr,stat,mntr,conf,cons\n{ensemble}",
                        data.display()
                    ),
                )
                .map_err(|e| e.to_string())?;
                let mut c = Command::new("/usr/share/zookeeper/bin/zkServer.sh");
                c.arg("start-foreground")
                    .arg(&cfg)
                    .env("ZOO_LOG_DIR", &d)
                    .env("ZOO_LOG4J_PROP", "WARN,CONSOLE");
                c
            }
            Kind::Postgres => {
                let root = self.pg_root();
                run(
                    "pg_ctl start",
                    as_postgres("pg_ctl")
                        .arg("-D")
                        .arg(root.join("data"))
                        .arg("-l")
                        .arg(root.join("postgres.log"))
                        .arg("-w")
                        .arg("-o")
                        .arg(format!(
                            "-c listen_addresses=127.0.0.1 -p {p} -k {} -c fsync=off -c max_connections=100",
                            root.display()
                        ))
                        .arg("start"),
                )?;
                return Ok(());
            }
            Kind::Sentinel | Kind::Cluster | Kind::Redlock => {
                return Err("a Redis topology starts its own processes".into());
            }
        };
        let log = self.log(i);
        let err = log.try_clone().map_err(|e| e.to_string())?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("spawn {:?}: {e} (run scripts/install-deps.sh)", self.kind))?;
        self.members[i].child = Some(child);
        Ok(())
    }

    /// Waits until a lockkit client connects (each try bounded by 5 s), at most `limit`.
    pub async fn ready(&self, limit: Duration) -> Result<(), String> {
        let deadline = Instant::now() + limit;
        loop {
            let url = format!("{}?prefix=faults-ready", self.url());
            if let Ok(Ok(_)) =
                tokio::time::timeout(Duration::from_secs(5), lockkit::connect(&url)).await
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("{:?} not ready after {limit:?}", self.kind));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Every process of member `i`: the one process, or PostgreSQL's postmaster and backends.
    fn pids(&self, i: usize) -> Vec<u32> {
        match self.kind {
            Kind::Postgres => {
                let pidfile = self.pg_root().join("data/postmaster.pid");
                let Some(pm) = std::fs::read_to_string(pidfile)
                    .ok()
                    .and_then(|s| s.lines().next()?.trim().parse::<u32>().ok())
                else {
                    return Vec::new();
                };
                let mut all = vec![pm];
                all.extend(children(pm));
                all
            }
            _ => self.members[i]
                .child
                .as_ref()
                .map(|c| vec![c.id()])
                .unwrap_or_default(),
        }
    }

    fn signal_member(&self, i: usize, sig: &str) {
        for pid in self.pids(i) {
            signal(pid, sig);
        }
    }

    /// SIGKILL of every process of member `i`, waiting until they are gone (at most 10 s).
    pub fn kill_member(&mut self, i: usize) {
        let pids = self.pids(i);
        for &pid in &pids {
            signal(pid, "KILL");
        }
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !pids.iter().all(|&p| gone(p)) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        if self.kind == Kind::Postgres && pids.iter().all(|&p| gone(p)) {
            // The postmaster is dead, but init reaps it late here: while it is a zombie,
            // PostgreSQL's lock-file checks take it for alive and refuse to start.
            let root = self.pg_root();
            let _ = std::fs::remove_file(root.join("data/postmaster.pid"));
            let _ = std::fs::remove_file(root.join(format!(".s.PGSQL.{}.lock", self.port())));
        }
    }

    /// Starts member `i` again on its ports and data dir (after [`Server::kill_member`]).
    pub fn restart_member(&mut self, i: usize) -> Result<(), String> {
        self.spawn(i)
    }

    /// SIGSTOP of every server process (a topology: of its master, or a Redlock majority, see
    /// [`Topology::stop`]); says what was stopped.
    pub fn stop(&mut self) -> Result<String, String> {
        if let Some(t) = &mut self.topo {
            let (idx, what) = t.stop()?;
            self.paused = idx;
            return Ok(what);
        }
        self.signal_member(0, "STOP");
        Ok("the server".into())
    }

    /// SIGCONT of what [`Server::stop`] stopped; says what serves afterwards (a topology).
    pub fn cont(&mut self) -> String {
        if let Some(t) = &mut self.topo {
            let idx = std::mem::take(&mut self.paused);
            return t.cont(&idx);
        }
        self.signal_member(0, "CONT");
        String::new()
    }

    /// A topology: waits until it can take the next fault (see [`Topology::healthy`]).
    pub async fn healthy(&self) -> Result<(), String> {
        match &self.topo {
            Some(t) => t.healthy().await,
            None => Ok(()),
        }
    }

    /// SIGKILL, then start again on the same port and data dir, and wait until ready (a
    /// topology: see [`Topology::kill_and_restart`]); says what was done, if more than that.
    pub async fn kill_and_restart(&mut self) -> Result<String, String> {
        if let Some(t) = &mut self.topo {
            let what = t.kill_and_restart().await?;
            self.ready(Duration::from_secs(90)).await?;
            return Ok(what);
        }
        self.kill_member(0);
        self.spawn(0)?;
        self.ready(Duration::from_secs(90)).await?;
        Ok(String::new())
    }

    /// A clean restart (PostgreSQL: `pg_ctl stop -m fast`, then start), for the
    /// restart-as-failover cell.
    pub async fn clean_restart(&mut self) -> Result<(), String> {
        if self.kind == Kind::Postgres {
            run(
                "pg_ctl stop",
                as_postgres("pg_ctl")
                    .arg("-D")
                    .arg(self.pg_root().join("data"))
                    .args(["-m", "fast", "-w", "stop"]),
            )?;
        } else if let Some(pid) = self.pids(0).first().copied() {
            signal(pid, "TERM");
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            while !gone(pid) && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            self.kill_member(0);
        }
        self.spawn(0)?;
        self.ready(Duration::from_secs(90)).await
    }

    /// The index of the member that leads now (etcd: its member id is the leader it reports;
    /// ZooKeeper: `srvr` says `Mode: leader`), asking each running member (bounded).
    pub async fn leader(&self) -> Option<usize> {
        for (i, m) in self.members.iter().enumerate() {
            if m.child.is_none() {
                continue;
            }
            let leads = match self.kind {
                Kind::Etcd => {
                    let out = Command::new("etcdctl")
                        .env("ETCDCTL_API", "3")
                        .arg(format!("--endpoints=http://127.0.0.1:{}", m.port))
                        .args(["endpoint", "status", "-w", "json", "--command-timeout=2s"])
                        .output()
                        .ok()?;
                    let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
                    let st = &v[0]["Status"];
                    st["leader"].as_u64().is_some()
                        && st["leader"].as_u64() == st["header"]["member_id"].as_u64()
                }
                Kind::Zk => four_letter(m.port, b"srvr")
                    .await
                    .is_some_and(|out| out.contains("Mode: leader")),
                _ => i == 0,
            };
            if leads {
                return Some(i);
            }
        }
        None
    }

    /// What the server still holds for locks under `prefix` (all locks, for the ZooKeeper and
    /// PostgreSQL counts, which are per server; every scenario has the server to itself). Fence
    /// guard records are not locks and not counted.
    pub async fn leftovers(&self, prefix: &str) -> Result<usize, String> {
        if let Some(t) = &self.topo {
            return t.leftovers(prefix);
        }
        let port = self
            .members
            .iter()
            .find(|m| m.child.is_some() || self.kind == Kind::Postgres)
            .map_or(0, |m| m.port);
        let p = port.to_string();
        match self.kind {
            Kind::Redis => {
                let out = run(
                    "redis-cli --scan",
                    Command::new("redis-cli")
                        .args(["-p", &p, "--scan", "--pattern"])
                        .arg(format!("{prefix}:lock:*")),
                )?;
                Ok(out.lines().filter(|l| !l.trim().is_empty()).count())
            }
            Kind::Etcd => {
                let out = run(
                    "etcdctl get",
                    Command::new("etcdctl")
                        .env("ETCDCTL_API", "3")
                        .arg(format!("--endpoints=http://127.0.0.1:{p}"))
                        .args(["get", "--prefix", "--keys-only"])
                        .arg(format!("{prefix}/")),
                )?;
                // EtcdFence's guard records ({prefix}/./fence/…) are data, kept on purpose.
                let guards = format!("{prefix}/./fence/");
                Ok(out
                    .lines()
                    .filter(|l| !l.trim().is_empty() && !l.starts_with(&guards))
                    .count())
            }
            Kind::Zk => four_letter(port, b"mntr")
                .await
                .and_then(|out| {
                    out.lines()
                        .find_map(|l| l.strip_prefix("zk_ephemerals_count"))
                        .and_then(|v| v.trim().parse::<usize>().ok())
                })
                .ok_or_else(|| "mntr did not answer".to_owned()),
            Kind::Postgres => self
                .psql("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'")?
                .trim()
                .parse()
                .map_err(|e| format!("psql: {e}")),
            Kind::Sentinel | Kind::Cluster | Kind::Redlock => Err("a topology".into()),
        }
    }
}

impl Server {
    /// Creates what the stress counter at the backend's own fence needs before the first
    /// holder writes it: PostgreSQL's table and row (etcd, ZooKeeper and Redis create it on
    /// write).
    pub fn prepare_native(&self, key: &str) -> Result<(), String> {
        if self.kind == Kind::Postgres {
            let t = crate::holder::PG_TABLE;
            self.psql(&format!(
                "CREATE TABLE IF NOT EXISTS {t} (name text PRIMARY KEY, value bigint NOT NULL, \
                 fence_token bigint, fence_lock text); \
                 INSERT INTO {t} VALUES ('{key}', 0, NULL, NULL)"
            ))?;
        }
        Ok(())
    }

    fn psql(&self, sql: &str) -> Result<String, String> {
        run(
            "psql",
            Command::new("psql")
                .args(["-h", "127.0.0.1", "-p", &self.port().to_string()])
                .args(["-U", "postgres", "-v", "ON_ERROR_STOP=1", "-Atc", sql]),
        )
    }

    /// The stress counter kept at the backend's own fence under `key` (0 if never written).
    pub async fn native_counter(&self, key: &str) -> Result<u64, String> {
        let raw = match self.kind {
            Kind::Etcd => run(
                "etcdctl get",
                Command::new("etcdctl")
                    .env("ETCDCTL_API", "3")
                    .arg(format!("--endpoints=http://127.0.0.1:{}", self.port()))
                    .args(["get", "--print-value-only", key]),
            )?,
            Kind::Zk => {
                use lockkit::zk::zookeeper_client as zk;
                let client = zk::Client::connect(&format!("127.0.0.1:{}", self.port()))
                    .await
                    .map_err(|e| format!("zk connect: {e}"))?;
                match client.get_data(key).await {
                    Ok((data, _)) => String::from_utf8_lossy(&data).into_owned(),
                    Err(zk::Error::NoNode) => String::new(),
                    Err(e) => return Err(format!("zk get {key}: {e}")),
                }
            }
            Kind::Postgres => self.psql(&format!(
                "SELECT value FROM {} WHERE name = '{key}'",
                crate::holder::PG_TABLE
            ))?,
            Kind::Redis => run(
                "redis-cli GET",
                Command::new("redis-cli").args(["-p", &self.port().to_string(), "GET", key]),
            )?,
            Kind::Sentinel | Kind::Cluster | Kind::Redlock => match &self.topo {
                Some(t) => t.counter(key)?,
                None => String::new(),
            },
        };
        let raw = raw.trim();
        if raw.is_empty() {
            return Ok(0);
        }
        raw.parse().map_err(|e| format!("counter {raw:?}: {e}"))
    }
}

/// A ZooKeeper four-letter word's answer (bounded: 3 s).
async fn four_letter(port: u16, word: &[u8]) -> Option<String> {
    let ask = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        s.write_all(word).await.ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).await.ok()?;
        Some(out)
    };
    tokio::time::timeout(Duration::from_secs(3), ask)
        .await
        .ok()
        .flatten()
}
