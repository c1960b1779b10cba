//! The harness side of a holder process: spawn it, read its events, send it commands, signal it.

use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::servers::signal;

/// One event from a holder: its `ev`, its `t` (CLOCK_REALTIME ns) and every field.
#[derive(Clone, Debug)]
pub struct Event(pub Value);

impl Event {
    pub fn ev(&self) -> &str {
        self.0["ev"].as_str().unwrap_or("")
    }
    pub fn t(&self) -> u64 {
        self.0["t"].as_u64().unwrap_or(0)
    }
    pub fn u64(&self, k: &str) -> u64 {
        self.0[k].as_u64().unwrap_or(0)
    }
    pub fn str(&self, k: &str) -> &str {
        self.0[k].as_str().unwrap_or("")
    }
}

/// What a holder is told at spawn.
#[derive(Clone, Debug)]
pub struct Spec {
    pub url: String,
    pub name: String,
    pub ttl: Duration,
    pub fence: u16,
    pub key: String,
    pub stress_rounds: Option<u32>,
    /// Stress: also use the backend's own fence (see the holder's `--native`).
    pub native: bool,
    pub wait: Duration,
    pub limit: Duration,
}

pub struct Holder {
    child: Child,
    pub pid: u32,
    stdin: Option<ChildStdin>,
    events: mpsc::UnboundedReceiver<Event>,
    /// Every event received so far.
    pub log: Vec<Event>,
    /// Events of `log` before this one have been looked at by [`Holder::wait`].
    cursor: usize,
}

impl Holder {
    pub fn spawn(spec: &Spec) -> Result<Holder, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut cmd = Command::new(exe);
        cmd.arg("holder")
            .args(["--url", &spec.url, "--name", &spec.name])
            .args(["--ttl", &humantime::format_duration(spec.ttl).to_string()])
            .args(["--fence", &format!("127.0.0.1:{}", spec.fence)])
            .args(["--key", &spec.key])
            .args(["--wait", &humantime::format_duration(spec.wait).to_string()])
            .args([
                "--limit",
                &humantime::format_duration(spec.limit).to_string(),
            ]);
        if let Some(r) = spec.stress_rounds {
            cmd.args(["--mode", "stress", "--rounds", &r.to_string()]);
            if spec.native {
                cmd.arg("--native");
            }
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            // A holder that dies (a panic, an abort) says why on the run's stderr.
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("spawn holder: {e}"))?;
        let pid = child.id().unwrap_or(0);
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let (tx, events) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if let Ok(v) = serde_json::from_str::<Value>(&line) {
                    let _ = tx.send(Event(v));
                }
            }
        });
        Ok(Holder {
            stdin: child.stdin.take(),
            child,
            pid,
            events,
            log: Vec::new(),
            cursor: 0,
        })
    }

    /// The next event named one of `evs` not looked at yet (others are skipped), within `limit`.
    pub async fn wait(&mut self, evs: &[&str], limit: Duration) -> Option<Event> {
        let deadline = Instant::now() + limit;
        loop {
            while self.cursor < self.log.len() {
                let e = &self.log[self.cursor];
                self.cursor += 1;
                if evs.contains(&e.ev()) {
                    return Some(e.clone());
                }
            }
            let e = tokio::time::timeout_at(deadline, self.events.recv())
                .await
                .ok()??;
            self.log.push(e);
        }
    }

    /// Logs every event already received, without waiting (a later [`Holder::wait`] still sees
    /// them).
    pub fn drain(&mut self) {
        while let Ok(e) = self.events.try_recv() {
            self.log.push(e);
        }
    }

    pub async fn send(&mut self, cmd: &str) {
        if let Some(s) = &mut self.stdin {
            let _ = s.write_all(format!("{cmd}\n").as_bytes()).await;
            let _ = s.flush().await;
        }
    }

    pub fn signal(&self, sig: &str) {
        signal(self.pid, sig);
    }

    /// SIGKILL and reap.
    pub async fn kill(&mut self) {
        let _ = self.child.start_kill();
        let _ = tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await;
    }

    /// Tells the holder to exit (closes its stdin) and waits for it (at most `limit`, then
    /// SIGKILL).
    pub async fn finish(&mut self, limit: Duration) {
        self.signal("CONT");
        self.stdin = None;
        if tokio::time::timeout(limit, self.child.wait())
            .await
            .is_err()
        {
            self.kill().await;
        }
        self.drain();
    }
}

/// Seconds between two CLOCK_REALTIME nanosecond stamps (negative if `b` is before `a`).
pub fn secs(a: u64, b: u64) -> f64 {
    (b as f64 - a as f64) / 1e9
}
