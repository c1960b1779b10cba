//! The holder process: one lockkit client that the harness can SIGKILL, SIGSTOP or cut off.
//!
//! Reports JSON lines on stdout, each `{"t": <CLOCK_REALTIME ns>, "ev": <event>, …}`:
//! `connected`, `acquired {token}`, `acquire_error {error}`, `wrote {token, ok}`,
//! `at_risk {state}`, `lost`, `act {state, write}`, `state {state}`, `released {result}`,
//! `round {i, token, read, write, release}`, `done {rounds}`.
//!
//! Modes:
//! - `hold`: acquire once (waiting up to `--wait`; `0s` = try once), write once through the
//!   fence, then obey stdin: `act` (check the lease state first, then write through the fence
//!   regardless, as a paused process that checked nothing would), `state`, `release`, `exit`.
//! - `stress`: `--rounds` rounds of acquire → fenced read → `--work` → fenced write of value + 1
//!   → release.
//!
//! Every wait is bounded: the process exits after `--limit` whatever happens.

use std::sync::Arc;
use std::time::Duration;

use lockkit::{AcquireOptions, Lease, Wait};
use serde_json::{Value, json};

use crate::fence::{Answer, FenceClient};
use crate::{error_kind, now_ns};

#[derive(clap::Args, Debug)]
pub struct HolderArgs {
    /// Lock service URL.
    #[arg(long)]
    url: String,
    /// Lock name.
    #[arg(long)]
    name: String,
    /// Lease TTL.
    #[arg(long, value_parser = humantime::parse_duration)]
    ttl: Duration,
    /// The fence service, host:port.
    #[arg(long)]
    fence: String,
    /// The fence key this holder writes.
    #[arg(long)]
    key: String,
    #[arg(long, value_enum, default_value = "hold")]
    mode: Mode,
    /// How long one acquire may wait (0s: try once).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "30s")]
    wait: Duration,
    /// Stress rounds.
    #[arg(long, default_value_t = 250)]
    rounds: u32,
    /// Stress: also read-increment-write a counter at the backend's own fence (EtcdFence,
    /// ZkFence, PgFence; Redis has none) under the same lease.
    #[arg(long)]
    native: bool,
    /// Stress: time spent between the fenced read and the fenced write.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5ms")]
    work: Duration,
    /// The process exits after this long, whatever happens.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "300s")]
    limit: Duration,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum Mode {
    Hold,
    Stress,
}

/// Prints one event line (stdout is line-buffered: each line is flushed as written).
pub fn emit(ev: &str, mut fields: Value) {
    fields["t"] = json!(now_ns());
    fields["ev"] = json!(ev);
    println!("{fields}");
}

pub async fn run(args: HolderArgs) -> i32 {
    match tokio::time::timeout(args.limit, body(&args)).await {
        Ok(code) => code,
        Err(_) => {
            emit("limit", json!({}));
            3
        }
    }
}

async fn body(args: &HolderArgs) -> i32 {
    let connected = async {
        // ZooKeeper's fence comes from the concrete lock; every other backend via connect().
        if args.url.starts_with("zk://") {
            let zl = lockkit::zk::ZkLock::connect(&args.url).await?;
            let fence = zl.fence();
            Ok::<_, lockkit::Error>((Arc::new(zl) as Arc<dyn lockkit::Lock>, Some(fence)))
        } else {
            Ok((lockkit::connect(&args.url).await?, None))
        }
    };
    let (locks, zk_fence) = match connected.await {
        Ok(l) => l,
        Err(e) => {
            emit("connect_error", json!({ "error": error_kind(&e) }));
            return 2;
        }
    };
    let native = match (args.native, zk_fence) {
        (false, _) => Native::None,
        (true, Some(f)) => Native::Zk(f),
        (true, None) if args.url.starts_with("etcd://") => Native::Etcd,
        (true, None) if args.url.starts_with("postgres://") => {
            // sqlx takes the URL without lockkit's own parameters.
            let db = args.url.split('?').next().unwrap_or_default().to_owned();
            match lockkit::postgres::PgFence::new(PG_TABLE, "fence_token") {
                Ok(f) => Native::Pg(db, f, tokio::sync::Mutex::new(None)),
                Err(e) => {
                    emit("connect_error", json!({ "error": error_kind(&e) }));
                    return 2;
                }
            }
        }
        (true, None) => Native::None,
    };
    let mut fence = match FenceClient::connect(&args.fence).await {
        Ok(f) => f,
        Err(e) => {
            emit("fence_error", json!({ "error": e.to_string() }));
            return 2;
        }
    };
    emit("connected", json!({ "pid": std::process::id() }));
    let wait = if args.wait.is_zero() {
        Wait::No
    } else {
        Wait::Timeout(args.wait)
    };
    let opts = AcquireOptions::new().ttl(args.ttl).wait(wait);
    match args.mode {
        Mode::Hold => hold(args, &*locks, opts, &mut fence).await,
        Mode::Stress => stress(args, &*locks, opts, &mut fence, &native).await,
    }
}

fn state_name(lease: &Lease) -> String {
    format!("{:?}", lease.state())
}

async fn fenced_write(fence: &mut FenceClient, key: &str, token: u64) -> &'static str {
    match fence.write(key, token, token).await {
        Ok(Answer::Ok(_)) => "accepted",
        Ok(Answer::Stale) => "rejected",
        Err(_) => "error",
    }
}

/// Stdin's lines, read on a thread of their own (closed at EOF).
fn stdin_lines() -> tokio::sync::mpsc::UnboundedReceiver<String> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

async fn hold(
    args: &HolderArgs,
    locks: &dyn lockkit::Lock,
    opts: AcquireOptions,
    fence: &mut FenceClient,
) -> i32 {
    let lease = match locks.acquire(&args.name, opts).await {
        Ok(l) => l,
        Err(e) => {
            emit("acquire_error", json!({ "error": error_kind(&e) }));
            return 0;
        }
    };
    let token = lease.token().get();
    emit("acquired", json!({ "token": token }));
    let lost = lease.lost();
    tokio::spawn(async move {
        lost.await;
        emit("lost", json!({}));
    });
    let risk = lease.at_risk();
    tokio::spawn(async move {
        let state = risk.await;
        emit("at_risk", json!({ "state": format!("{state:?}") }));
    });
    let w = fenced_write(fence, &args.key, token).await;
    emit("wrote", json!({ "token": token, "write": w }));

    let mut lease = Some(lease);
    let mut stdin = stdin_lines();
    while let Some(cmd) = stdin.recv().await {
        match cmd.trim() {
            "act" => {
                // The state first: a holder that checks before acting sees Lost here.
                let state = lease.as_ref().map_or("Released".into(), state_name);
                let w = fenced_write(fence, &args.key, token).await;
                emit("act", json!({ "state": state, "write": w }));
            }
            "state" => {
                let state = lease.as_ref().map_or("Released".into(), state_name);
                emit("state", json!({ "state": state }));
            }
            "release" => {
                let result = match lease.take() {
                    Some(l) => match l.release().await {
                        Ok(()) => "Ok".to_owned(),
                        Err(e) => error_kind(&e),
                    },
                    None => "AlreadyReleased".to_owned(),
                };
                emit("released", json!({ "result": result }));
            }
            _ => break,
        }
    }
    0
}

async fn stress(
    args: &HolderArgs,
    locks: &dyn lockkit::Lock,
    opts: AcquireOptions,
    fence: &mut FenceClient,
    native: &Native,
) -> i32 {
    let mut done = 0;
    while done < args.rounds {
        let lease = match locks.acquire(&args.name, opts.clone()).await {
            Ok(l) => l,
            Err(e) => {
                // The server may be down for a restart: try again, within --limit.
                emit("acquire_error", json!({ "error": error_kind(&e) }));
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let token = lease.token().get();
        emit("acquired", json!({ "token": token }));
        let read = match fence.read(&args.key, token).await {
            Ok(Answer::Ok(v)) => Some(v),
            Ok(Answer::Stale) => None,
            Err(e) => {
                emit("fence_error", json!({ "error": e.to_string() }));
                return 2;
            }
        };
        // The work on the resource between the read and the write: where a pause hurts.
        tokio::time::sleep(args.work).await;
        let write = match read {
            Some(v) => fence.write(&args.key, token, v + 1).await,
            None => Ok(Answer::Stale),
        };
        let write = match write {
            Ok(Answer::Ok(_)) => "accepted",
            Ok(Answer::Stale) => "rejected",
            Err(e) => {
                emit("fence_error", json!({ "error": e.to_string() }));
                return 2;
            }
        };
        let native = native.increment(&lease, &args.key).await;
        let release = match lease.release().await {
            Ok(()) => "Ok".to_owned(),
            Err(e) => error_kind(&e),
        };
        emit(
            "round",
            json!({ "i": done, "token": token, "read": read.is_some(), "write": write, "native": native, "release": release }),
        );
        done += 1;
    }
    emit("done", json!({ "rounds": done }));
    0
}

/// The backend's own fence, for the stress counter kept in the backend itself.
enum Native {
    None,
    Etcd,
    Zk(lockkit::zk::ZkFence),
    /// Database URL, fence, and a connection of its own (re-opened after a server restart).
    Pg(
        String,
        lockkit::postgres::PgFence,
        tokio::sync::Mutex<Option<lockkit::postgres::sqlx::PgConnection>>,
    ),
}

/// The PostgreSQL table of stress counters (`name text primary key, value bigint, fence_token
/// bigint`), created by the harness with one row per counter.
pub const PG_TABLE: &str = "faults_counter";

/// The key (etcd), node (ZooKeeper) or row name (PostgreSQL) of the stress counter at the
/// backend's fence.
pub fn native_key(key: &str) -> String {
    format!("/faults-counter-{key}")
}

impl Native {
    /// Reads the counter and writes it + 1, both through the backend's fence under `lease`:
    /// `accepted`, `rejected` (StaleToken), `none` (no native fence) or `error:Kind`.
    async fn increment(&self, lease: &Lease, key: &str) -> String {
        let path = native_key(key);
        let parse = |b: &[u8]| std::str::from_utf8(b).ok()?.parse::<u64>().ok();
        let result = match self {
            Native::None => return "none".into(),
            Native::Pg(url, fence, conn) => {
                return pg_increment(url, fence, conn, lease, &path).await;
            }
            Native::Etcd => {
                async {
                    use lockkit::etcd::etcd_client::{TxnOp, TxnOpResponse};
                    let f = lockkit::etcd::EtcdFence::new(lease)?;
                    // The read is fenced too: one transaction, applied only while the lease holds.
                    let r = f.txn(vec![TxnOp::get(path.clone(), None)]).await?;
                    let v = match r.op_responses().first() {
                        Some(TxnOpResponse::Get(g)) => {
                            g.kvs().first().and_then(|kv| parse(kv.value()))
                        }
                        _ => None,
                    };
                    f.put(path, (v.unwrap_or(0) + 1).to_string()).await
                }
                .await
            }
            Native::Zk(f) => {
                async {
                    let v = f.read(&path).await?.and_then(|b| parse(&b));
                    f.write(lease, &path, (v.unwrap_or(0) + 1).to_string().as_bytes())
                        .await
                }
                .await
            }
        };
        match result {
            Ok(()) => "accepted".into(),
            Err(lockkit::Error::StaleToken { .. }) => "rejected".into(),
            Err(e) => format!("error:{}", error_kind(&e)),
        }
    }
}

/// One transaction: `SELECT value … FOR UPDATE`, then `PgFence::update` to value + 1; the
/// answer as [`Native::increment`]'s. A broken connection is opened afresh next time.
async fn pg_increment(
    url: &str,
    fence: &lockkit::postgres::PgFence,
    conn: &tokio::sync::Mutex<Option<lockkit::postgres::sqlx::PgConnection>>,
    lease: &Lease,
    name: &str,
) -> String {
    use lockkit::postgres::sqlx::{self, Arguments, Connection, Row, postgres::PgArguments};
    let mut guard = conn.lock().await;
    if guard.is_none() {
        match sqlx::PgConnection::connect(url).await {
            Ok(c) => *guard = Some(c),
            Err(_) => return "error:connect".into(),
        }
    }
    let Some(c) = guard.as_mut() else {
        return "error:connect".into();
    };
    let fenced = async {
        let mut tx = c.begin().await.map_err(|_| "error:begin".to_owned())?;
        let row = sqlx::query(&format!(
            "SELECT value FROM {PG_TABLE} WHERE name = $1 FOR UPDATE"
        ))
        .bind(name)
        .fetch_one(&mut *tx)
        .await
        .map_err(|_| "error:select".to_owned())?;
        let v: i64 = row.try_get(0).map_err(|_| "error:select".to_owned())?;
        let mut args = PgArguments::default();
        args.add(v + 1).map_err(|_| "error:bind".to_owned())?;
        args.add(name).map_err(|_| "error:bind".to_owned())?;
        match fence
            .update(&mut tx, lease.token(), "value = $1", "name = $2", args)
            .await
        {
            Ok(_) => {}
            Err(lockkit::Error::StaleToken { .. }) => {
                // Now, not lazily on the next use: until then the row stays locked, while this
                // holder waits for the lock that the row's next reader holds.
                tx.rollback()
                    .await
                    .map_err(|_| "error:rollback".to_owned())?;
                return Ok("rejected".to_owned());
            }
            Err(e) => return Err(format!("error:{}", error_kind(&e))),
        }
        tx.commit().await.map_err(|_| "error:commit".to_owned())?;
        Ok("accepted".to_owned())
    };
    match fenced.await {
        Ok(answer) => answer,
        Err(e) => {
            *guard = None;
            e
        }
    }
}
