//! The holder process: one lockkit client that the harness can SIGKILL, SIGSTOP or cut off.
//!
//! Reports JSON lines on stdout, each `{"t": <CLOCK_REALTIME ns>, "ev": <event>, …}`:
//! `connected`, `acquired {token}`, `acquire_error {error}`, `wrote {token, ok}`,
//! `at_risk {state}`, `lost {reason}`, `act {state, reason, write}`, `state {state, reason}`,
//! `released {result}`, `round {i, token, read, write, native, native_t, release}`,
//! `done {rounds}`.
//! `reason` is the lease's [`LossReason`](lockkit::LossReason) label (`deadline_expired`, …),
//! empty while the lease is not Lost.
//!
//! Modes:
//! - `hold`: acquire once (waiting up to `--wait`; `0s` = try once), write once through the
//!   fence, then obey stdin: `act` (check the lease state first, then write through the fence
//!   regardless, as a paused process that checked nothing would), `state`, `release`, `exit`.
//! - `stress`: `--rounds` rounds of acquire → fenced read → `--work` → fenced write of value + 1
//!   → release.
//!
//! Every wait is bounded: the process exits after `--limit` whatever happens.

use std::time::Duration;

use lockkit::{AcquireOptions, Lease, LeaseTracker, Wait};
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
    /// ZkFence, RedisFence, PgFence, each made from the round's lease) under the same lease.
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
    let locks = match lockkit::connect(&args.url).await {
        Ok(l) => l,
        Err(e) => {
            emit("connect_error", json!({ "error": error_kind(&e) }));
            return 2;
        }
    };
    let native = match Native::connect(args).await {
        Ok(n) => n,
        Err(e) => {
            emit("connect_error", json!({ "error": e }));
            return 2;
        }
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

/// The lease's loss reason label, `""` while it is not Lost (or, `None`, released).
fn reason(lease: Option<&Lease>) -> &'static str {
    lease
        .and_then(Lease::loss_reason)
        .map_or("", lockkit::LossReason::as_str)
}

/// Writes `token`'s number to the harness's fence service. Its keys are each written under one
/// lock only, so the number is all it compares.
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
    let tracker: LeaseTracker = lease.tracker().clone();
    tokio::spawn(async move {
        tracker.lost().await;
        let reason = tracker
            .loss_reason()
            .map_or("", lockkit::LossReason::as_str);
        emit("lost", json!({ "reason": reason }));
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
                let reason = reason(lease.as_ref());
                let w = fenced_write(fence, &args.key, token).await;
                emit(
                    "act",
                    json!({ "state": state, "reason": reason, "write": w }),
                );
            }
            "state" => {
                let state = lease.as_ref().map_or("Released".into(), state_name);
                let reason = reason(lease.as_ref());
                emit("state", json!({ "state": state, "reason": reason }));
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
        // When the backend's fence answered: the harness tells writes a server restart without
        // persistence (Redis) forgot from those it kept.
        let native_t = now_ns();
        let release = match lease.release().await {
            Ok(()) => "Ok".to_owned(),
            Err(e) => error_kind(&e),
        };
        emit(
            "round",
            json!({ "i": done, "token": token, "read": read.is_some(), "write": write, "native": native, "native_t": native_t, "release": release }),
        );
        done += 1;
    }
    emit("done", json!({ "rounds": done }));
    0
}

/// The backend's own fence, for the stress counter kept in the backend itself; each round makes
/// the fence from its lease (`from_lease`).
enum Native {
    None,
    /// A plain etcd client for the (unfenced) read (boxed: it is large).
    Etcd(Box<lockkit::etcd::etcd_client::Client>),
    Zk,
    Redis,
    /// Database URL, fence, and a connection of its own (re-opened after a server restart).
    Pg(
        String,
        lockkit::postgres::PgFence,
        tokio::sync::Mutex<Option<lockkit::postgres::sqlx::PgConnection>>,
    ),
}

/// The PostgreSQL table of stress counters (`name text primary key, value bigint, fence_token
/// bigint, fence_lock text`), created by the harness with one row per counter.
pub const PG_TABLE: &str = "faults_counter";

/// The key (etcd, Redis), node (ZooKeeper) or row name (PostgreSQL) of the stress counter at
/// the backend's fence. `key` is a hash tag: in Redis Cluster, RedisFence's script writes the
/// counter and its guard record (`{prefix}:guard:{counter}`), which must share a slot.
pub fn native_key(key: &str) -> String {
    format!("/faults-counter-{{{key}}}")
}

impl Native {
    /// What the holder needs for `--native` on the backend of `args.url`.
    async fn connect(args: &HolderArgs) -> Result<Native, String> {
        if !args.native {
            return Ok(Native::None);
        }
        let (scheme, rest) = args.url.split_once("://").unwrap_or_default();
        match scheme {
            "etcd" => {
                let hosts = rest.split(['?', '/']).next().unwrap_or_default();
                let endpoints: Vec<String> =
                    hosts.split(',').map(|h| format!("http://{h}")).collect();
                lockkit::etcd::etcd_client::Client::connect(endpoints, None)
                    .await
                    .map(|c| Native::Etcd(Box::new(c)))
                    .map_err(|e| format!("etcd client: {e}"))
            }
            "zk" => Ok(Native::Zk),
            "redis" | "redis+sentinel" | "redis+cluster" => Ok(Native::Redis),
            "postgres" => {
                // sqlx takes the URL without lockkit's own parameters.
                let db = args.url.split('?').next().unwrap_or_default().to_owned();
                let fence = lockkit::postgres::PgFence::new(PG_TABLE, "fence_token", "fence_lock")
                    .map_err(|e| error_kind(&e))?;
                Ok(Native::Pg(db, fence, tokio::sync::Mutex::new(None)))
            }
            _ => Ok(Native::None),
        }
    }

    /// Reads the counter and writes it + 1 through the backend's fence under `lease`:
    /// `accepted`, `rejected` (StaleToken), `foreign` (ForeignToken), `none` (no `--native`) or
    /// `error:Kind`.
    async fn increment(&self, lease: &Lease, key: &str) -> String {
        let path = native_key(key);
        let parse = |b: &[u8]| std::str::from_utf8(b).ok()?.parse::<u64>().ok();
        let next = |v: Option<u64>| (v.unwrap_or(0) + 1).to_string();
        let result = match self {
            Native::None => return "none".into(),
            Native::Pg(url, fence, conn) => {
                return pg_increment(url, fence, conn, lease, &path).await;
            }
            Native::Etcd(client) => {
                // A plain read is enough: the put applies only while this grant's key is the
                // holder, so nobody else can have written since the read.
                let Ok(got) = client.kv_client().get(path.clone(), None).await else {
                    return "error:get".into();
                };
                let v = got.kvs().first().and_then(|kv| parse(kv.value()));
                match lockkit::etcd::EtcdFence::from_lease(lease) {
                    Ok(f) => f.put(path, next(v)).await,
                    Err(e) => Err(e),
                }
            }
            Native::Zk => {
                async {
                    let f = lockkit::zk::ZkFence::from_lease(lease)?;
                    let v = f.read(&path).await?.and_then(|b| parse(&b));
                    f.write(&path, next(v).as_bytes()).await
                }
                .await
            }
            Native::Redis => {
                async {
                    // RedisFence checks tokens when writing, not reading (see docs/faults.md).
                    let f = lockkit::redis::RedisFence::from_lease(lease)?;
                    let v = f.get(&path).await?.and_then(|b| parse(&b));
                    f.set(&path, next(v)).await
                }
                .await
            }
        };
        match result {
            Ok(()) => "accepted".into(),
            Err(lockkit::Error::StaleToken { .. }) => "rejected".into(),
            Err(lockkit::Error::ForeignToken { .. }) => "foreign".into(),
            Err(e) => format!("error:{}", error_kind(&e)),
        }
    }
}

/// One transaction: `SELECT value … FOR UPDATE`, then `PgFence::update_as` to value + 1; the
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
        let answer = match fence
            .update_as(&mut tx, lease, "value = $1", "name = $2", args)
            .await
        {
            Ok(_) => {
                tx.commit().await.map_err(|_| "error:commit".to_owned())?;
                return Ok("accepted".to_owned());
            }
            Err(lockkit::Error::StaleToken { .. }) => "rejected",
            Err(lockkit::Error::ForeignToken { .. }) => "foreign",
            Err(e) => return Err(format!("error:{}", error_kind(&e))),
        };
        // Now, not lazily on the next use: until then the row stays locked, while this
        // holder waits for the lock that the row's next reader holds.
        tx.rollback()
            .await
            .map_err(|_| "error:rollback".to_owned())?;
        Ok(answer.to_owned())
    };
    match fenced.await {
        Ok(answer) => answer,
        Err(e) => {
            *guard = None;
            e
        }
    }
}
