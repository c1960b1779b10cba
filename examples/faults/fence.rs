//! The fenced resource: a tiny loopback TCP service in the harness process that keeps, per key,
//! a value and the highest fencing token it has seen, and rejects any read or write carrying a
//! lower one. One service for every backend, so "stale writes accepted" is checked at a
//! resource the faults never touch. (The stress scenario also keeps a counter at the backend's
//! own fence: EtcdFence, ZkFence, RedisFence or PgFence.)
//!
//! It stores a token's number ([`FencingToken::get`](lockkit::FencingToken::get)) and compares
//! numbers within one lock only: each key is written by the holders of one lock (one cell's).
//!
//! Protocol, one line each way:
//! - `R key token` → `OK value` (and `token` becomes the highest seen) or `STALE highest`
//! - `W key token value` → `OK` (value stored, `token` the highest) or `STALE highest`
//!
//! A token equal to the highest is accepted (one holder reads, then writes, with one token).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

/// What the fence knows about one key.
#[derive(Clone, Debug, Default)]
pub struct Cell {
    pub value: u64,
    pub highest: u64,
    /// Tokens of accepted writes, in the order they were accepted.
    pub accepted: Vec<u64>,
    /// Reads and writes refused for a stale token.
    pub rejected: u64,
}

/// The fence service; dropping it stops accepting connections.
pub struct Fence {
    pub port: u16,
    cells: Arc<Mutex<HashMap<String, Cell>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Fence {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Fence {
    pub async fn start() -> std::io::Result<Fence> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let cells = Arc::new(Mutex::new(HashMap::new()));
        let shared = cells.clone();
        let task = tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                tokio::spawn(serve(conn, shared.clone()));
            }
        });
        Ok(Fence { port, cells, task })
    }

    pub fn cell(&self, key: &str) -> Cell {
        let cells = self.cells.lock().unwrap_or_else(|p| p.into_inner());
        cells.get(key).cloned().unwrap_or_default()
    }
}

async fn serve(conn: TcpStream, cells: Arc<Mutex<HashMap<String, Cell>>>) {
    let _ = conn.set_nodelay(true);
    let (r, mut w) = conn.into_split();
    let mut lines = BufReader::new(r).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let reply = answer(&line, &cells);
        if w.write_all(format!("{reply}\n").as_bytes()).await.is_err() {
            return;
        }
    }
}

fn answer(line: &str, cells: &Mutex<HashMap<String, Cell>>) -> String {
    let parts: Vec<&str> = line.split_whitespace().collect();
    let (op, key, token, value) = match parts.as_slice() {
        ["R", key, token] => ("R", *key, token.parse::<u64>(), Ok(0)),
        ["W", key, token, value] => ("W", *key, token.parse::<u64>(), value.parse::<u64>()),
        _ => return "ERR bad request".into(),
    };
    let (Ok(token), Ok(value)) = (token, value) else {
        return "ERR bad number".into();
    };
    let mut cells = cells.lock().unwrap_or_else(|p| p.into_inner());
    let cell = cells.entry(key.to_owned()).or_default();
    if token < cell.highest {
        cell.rejected += 1;
        return format!("STALE {}", cell.highest);
    }
    cell.highest = token;
    if op == "W" {
        cell.value = value;
        cell.accepted.push(token);
        "OK".into()
    } else {
        format!("OK {}", cell.value)
    }
}

/// A holder's connection to the fence. Every call is bounded (30 s: longer than the longest SIGSTOP a holder gets).
pub struct FenceClient {
    lines: tokio::io::Lines<BufReader<tokio::net::tcp::OwnedReadHalf>>,
    w: tokio::net::tcp::OwnedWriteHalf,
}

/// A fence answer: accepted (with the value read, for a read) or rejected as stale.
pub enum Answer {
    Ok(u64),
    Stale,
}

impl FenceClient {
    pub async fn connect(addr: &str) -> std::io::Result<FenceClient> {
        let s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        let (r, w) = s.into_split();
        Ok(FenceClient {
            lines: BufReader::new(r).lines(),
            w,
        })
    }

    async fn call(&mut self, req: String) -> std::io::Result<Answer> {
        let io = async {
            self.w.write_all(format!("{req}\n").as_bytes()).await?;
            let line = self.lines.next_line().await?.unwrap_or_default();
            if let Some(rest) = line.strip_prefix("OK") {
                Ok(Answer::Ok(rest.trim().parse().unwrap_or(0)))
            } else if line.starts_with("STALE") {
                Ok(Answer::Stale)
            } else {
                Err(std::io::Error::other(format!("fence: {line:?}")))
            }
        };
        tokio::time::timeout(Duration::from_secs(30), io)
            .await
            .map_err(|_| std::io::Error::other("fence: no answer in 30 s"))?
    }

    pub async fn read(&mut self, key: &str, token: u64) -> std::io::Result<Answer> {
        self.call(format!("R {key} {token}")).await
    }

    pub async fn write(&mut self, key: &str, token: u64, value: u64) -> std::io::Result<Answer> {
        self.call(format!("W {key} {token} {value}")).await
    }
}
