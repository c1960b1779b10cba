//! Private server instances the harness owns: started on a free loopback port with their own data
//! dir, and SIGKILLed, SIGSTOPped/SIGCONTed and restarted on the same port and data dir. Started
//! the way `scripts/servers.sh` starts them (see /work/shared/servers.md for the commands).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Redis,
    Etcd,
    Zk,
    Postgres,
}

impl Kind {
    pub fn label(self) -> &'static str {
        match self {
            Kind::Redis => "Redis (single)",
            Kind::Etcd => "etcd (1 member)",
            Kind::Zk => "ZooKeeper (standalone)",
            Kind::Postgres => "PostgreSQL",
        }
    }

    pub fn parse(s: &str) -> Option<Kind> {
        match s {
            "redis" => Some(Kind::Redis),
            "etcd" => Some(Kind::Etcd),
            "zk" => Some(Kind::Zk),
            "postgres" => Some(Kind::Postgres),
            _ => None,
        }
    }

    /// How long after a lapsed TTL the server itself may still hold the lock, per the backend's
    /// docs (README fine print): etcd frees up to max(1 s, min TTL) + 0.5 s late, a ZooKeeper
    /// session expires up to one tick (500 ms here) late, PostgreSQL's idle timeout has ≤ 100 ms.
    pub fn expiry_slack(self) -> Duration {
        match self {
            Kind::Redis => Duration::from_millis(200),
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

pub struct Server {
    pub kind: Kind,
    pub port: u16,
    peer_port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.cont();
        self.kill();
    }
}

impl Server {
    /// Starts a fresh instance and waits until a lockkit client can connect (at most 90 s).
    pub async fn start(kind: Kind) -> Result<Server, String> {
        // etcd and ZooKeeper fsync every write: a tmpfs data dir keeps them fast, and survives a
        // process SIGKILL (what the scenarios do) like a disk would.
        let dir = match kind {
            Kind::Etcd | Kind::Zk if Path::new("/dev/shm").is_dir() => tempfile::Builder::new()
                .prefix("lockkit-faults-")
                .tempdir_in("/dev/shm"),
            _ => tempfile::Builder::new().prefix("lockkit-faults-").tempdir(),
        }
        .map_err(|e| format!("temp dir: {e}"))?;
        let mut s = Server {
            kind,
            port: free_port(),
            peer_port: free_port(),
            dir,
            child: None,
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
        s.spawn()?;
        s.ready(Duration::from_secs(90)).await?;
        Ok(s)
    }

    fn pg_root(&self) -> PathBuf {
        self.dir.path().join("pg")
    }

    pub fn url(&self) -> String {
        match self.kind {
            Kind::Redis => format!("redis://127.0.0.1:{}", self.port),
            Kind::Etcd => format!("etcd://127.0.0.1:{}", self.port),
            Kind::Zk => format!("zk://127.0.0.1:{}", self.port),
            Kind::Postgres => format!("postgres://postgres@127.0.0.1:{}/postgres", self.port),
        }
    }

    /// `url()` with the port replaced (to go through a proxy).
    pub fn url_via(&self, port: u16) -> String {
        self.url()
            .replace(&format!(":{}", self.port), &format!(":{port}"))
    }

    fn log(&self) -> std::fs::File {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("server.log"))
            .expect("server log")
    }

    /// Starts the server process on this instance's port and data dir.
    fn spawn(&mut self) -> Result<(), String> {
        let d = self.dir.path().to_path_buf();
        let p = self.port;
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
                let pp = self.peer_port;
                let mut c = Command::new("etcd");
                c.args(["--name", "n1", "--data-dir"])
                    .arg(d.join("etcd"))
                    .args(["--listen-client-urls", &format!("http://127.0.0.1:{p}")])
                    .args(["--advertise-client-urls", &format!("http://127.0.0.1:{p}")])
                    .args(["--listen-peer-urls", &format!("http://127.0.0.1:{pp}")])
                    .args([
                        "--initial-advertise-peer-urls",
                        &format!("http://127.0.0.1:{pp}"),
                    ])
                    .args(["--initial-cluster", &format!("n1=http://127.0.0.1:{pp}")])
                    .args(["--initial-cluster-state", "new"])
                    .args(["--heartbeat-interval", "10", "--election-timeout", "100"])
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
                std::fs::create_dir_all(d.join("data")).map_err(|e| e.to_string())?;
                std::fs::write(
                    &cfg,
                    format!(
                        "tickTime=500\nminSessionTimeout=1000\nmaxSessionTimeout=60000\n\
                         dataDir={}\nclientPortAddress=127.0.0.1\nclientPort={p}\n\
                         admin.enableServer=false\n4lw.commands.whitelist=ruok,srvr,stat,mntr,conf,cons\n",
                        d.join("data").display()
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
        };
        let log = self.log();
        let err = log.try_clone().map_err(|e| e.to_string())?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("spawn {:?}: {e} (run scripts/install-deps.sh)", self.kind))?;
        self.child = Some(child);
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

    /// Every process of the server: the one process, or PostgreSQL's postmaster and backends.
    fn pids(&self) -> Vec<u32> {
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
            _ => self
                .child
                .as_ref()
                .map(|c| vec![c.id()])
                .unwrap_or_default(),
        }
    }

    /// SIGKILL of every server process, waiting until they are gone (at most 10 s).
    pub fn kill(&mut self) {
        let pids = self.pids();
        for &pid in &pids {
            signal(pid, "KILL");
        }
        if let Some(mut c) = self.child.take() {
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
            let _ = std::fs::remove_file(self.pg_root().join("data/postmaster.pid"));
            let _ =
                std::fs::remove_file(self.pg_root().join(format!(".s.PGSQL.{}.lock", self.port)));
        }
    }

    /// SIGSTOP of every server process.
    pub fn stop(&self) {
        for pid in self.pids() {
            signal(pid, "STOP");
        }
    }

    /// SIGCONT of every server process.
    pub fn cont(&self) {
        for pid in self.pids() {
            signal(pid, "CONT");
        }
    }

    /// SIGKILL, then start again on the same port and data dir, and wait until ready.
    pub async fn kill_and_restart(&mut self) -> Result<(), String> {
        self.kill();
        self.spawn()?;
        self.ready(Duration::from_secs(90)).await
    }

    /// A clean restart (PostgreSQL: `pg_ctl restart -m fast`), for the restart-as-failover cell.
    pub async fn clean_restart(&mut self) -> Result<(), String> {
        if self.kind == Kind::Postgres {
            run(
                "pg_ctl stop",
                as_postgres("pg_ctl")
                    .arg("-D")
                    .arg(self.pg_root().join("data"))
                    .args(["-m", "fast", "-w", "stop"]),
            )?;
        } else if let Some(c) = &self.child {
            signal(c.id(), "TERM");
            let pid = c.id();
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            while !gone(pid) && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            self.kill();
        }
        self.spawn()?;
        self.ready(Duration::from_secs(90)).await
    }

    /// What the server still holds for locks under `prefix` (all locks, for the ZooKeeper and
    /// PostgreSQL counts, which are per server; every scenario has the server to itself).
    pub async fn leftovers(&self, prefix: &str) -> Result<usize, String> {
        let p = self.port.to_string();
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
                Ok(out.lines().filter(|l| !l.trim().is_empty()).count())
            }
            Kind::Zk => {
                let ask = async {
                    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", self.port))
                        .await
                        .ok()?;
                    s.write_all(b"mntr").await.ok()?;
                    let mut out = String::new();
                    s.read_to_string(&mut out).await.ok()?;
                    out.lines()
                        .find_map(|l| l.strip_prefix("zk_ephemerals_count"))
                        .and_then(|v| v.trim().parse::<usize>().ok())
                };
                tokio::time::timeout(Duration::from_secs(3), ask)
                    .await
                    .ok()
                    .flatten()
                    .ok_or_else(|| "mntr did not answer".to_owned())
            }
            Kind::Postgres => {
                let out = run(
                    "psql",
                    Command::new("psql")
                        .args(["-h", "127.0.0.1", "-p", &p, "-U", "postgres", "-Atc"])
                        .arg("select count(*) from pg_locks where locktype = 'advisory'"),
                )?;
                out.trim().parse().map_err(|e| format!("psql: {e}"))
            }
        }
    }
}
