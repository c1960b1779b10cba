//! A private ZooKeeper server for tests that restart it or change its JVM settings.

use std::process::Command;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::{ServerProcess, free_port};

pub struct PrivateZk {
    proc: Option<ServerProcess>,
    pub port: u16,
    jvm_flags: String,
    extra_cfg: String,
}

impl PrivateZk {
    /// Starts a standalone server (tickTime 500 ms, session timeouts 1–60 s, fsynced log) with
    /// extra JVM system properties `jvm_flags` (e.g. `-Dznode.container.checkIntervalMs=100`).
    pub async fn start(jvm_flags: &str) -> Self {
        Self::start_with(jvm_flags, "").await
    }

    /// [`start`](Self::start) with extra `zoo.cfg` lines (e.g. `maxClientCnxns=20\n`).
    pub async fn start_with(jvm_flags: &str, extra_cfg: &str) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let port = free_port();
        let mut zk = PrivateZk {
            proc: None,
            port,
            jvm_flags: jvm_flags.to_owned(),
            extra_cfg: extra_cfg.to_owned(),
        };
        zk.spawn(dir).await;
        zk
    }

    pub fn url(&self) -> String {
        format!("zk://127.0.0.1:{}", self.port)
    }

    async fn spawn(&mut self, dir: tempfile::TempDir) {
        let cfg = dir.path().join("zoo.cfg");
        let data = dir.path().join("data");
        std::fs::create_dir_all(&data).expect("data dir");
        std::fs::write(
            &cfg,
            format!(
                "tickTime=500\nminSessionTimeout=1000\nmaxSessionTimeout=60000\n\
                 dataDir={}\nclientPortAddress=127.0.0.1\nclientPort={}\n\
                 admin.enableServer=false\n4lw.commands.whitelist=ruok,srvr,stat,mntr,conf,cons,wchc,wchs\n{}",
                data.display(),
                self.port,
                self.extra_cfg
            ),
        )
        .expect("zoo.cfg");
        let mut cmd = Command::new("/usr/share/zookeeper/bin/zkServer.sh");
        cmd.arg("start-foreground")
            .arg(&cfg)
            .env("ZOO_LOG_DIR", dir.path())
            .env("ZOO_LOG4J_PROP", "WARN,CONSOLE")
            .env("SERVER_JVMFLAGS", &self.jvm_flags);
        let proc = ServerProcess::spawn("zookeeper", dir, cmd);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while !(ruok(self.port).await && session_ok(self.port).await) {
            if tokio::time::Instant::now() > deadline {
                panic!("private ZooKeeper not ready:\n{}", proc.log_tail());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.proc = Some(proc);
    }

    /// SIGKILL, then start again on the same port and data directory.
    pub async fn kill_and_restart(&mut self) {
        let mut proc = self.proc.take().expect("running");
        let dir = std::mem::replace(&mut proc.dir, tempfile::tempdir().expect("temp dir"));
        proc.kill();
        drop(proc);
        self.spawn(dir).await;
    }
}

/// A session can be established (`ruok` answers before the server accepts sessions).
async fn session_ok(port: u16) -> bool {
    let addr = format!("127.0.0.1:{port}");
    let connect = lockkit::zk::zookeeper_client::Client::connector()
        .with_fail_eagerly()
        .connect(&addr);
    matches!(
        tokio::time::timeout(Duration::from_secs(5), connect).await,
        Ok(Ok(_))
    )
}

/// The number of client connections the server at `port` has open (`cons` four-letter word,
/// one line per connection; the asking connection itself is not counted).
pub async fn connections(port: u16) -> usize {
    let ask = async {
        let mut s = TcpStream::connect(("127.0.0.1", port)).await.ok()?;
        s.write_all(b"cons").await.ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).await.ok()?;
        Some(out.lines().filter(|l| l.contains("queued=")).count())
    };
    tokio::time::timeout(Duration::from_secs(2), ask)
        .await
        .ok()
        .flatten()
        .expect("cons")
        .saturating_sub(1)
}

/// ZooKeeper's `ruok` four-letter word answered `imok` (bounded: never hangs).
async fn ruok(port: u16) -> bool {
    let check = async {
        let mut s = TcpStream::connect(("127.0.0.1", port)).await.ok()?;
        s.write_all(b"ruok").await.ok()?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.ok()?;
        Some(buf == b"imok")
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(2), check).await,
        Ok(Some(true))
    )
}
