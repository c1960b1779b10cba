//! `lockkit`: run a command while holding a distributed lock.
//!
//! ```text
//! lockkit run --backend etcd://127.0.0.1:2379 --ttl 30s --wait 1m nightly-report -- ./report.sh
//! lockkit guarantees redis://127.0.0.1:6379
//! ```
//!
//! `run` acquires the lock, starts the command with `LOCKKIT_FENCING_TOKEN` (string form `v1:N:LOCK`) and `LOCKKIT_LOCK` in
//! its environment, keeps the lease alive while the command runs, and releases the lock when it
//! exits. If the lease is lost (the deadline passed without an acknowledged renewal), the command
//! is killed at once: it must not run on past its lease. Pass the token to whatever the command
//! writes, so the storage can reject a stale writer.
//!
//! Exit status: the command's own; 75 if the lock is held (with `--wait 0`) or the wait timed
//! out; 70 if the lease was lost while the command ran; 64 on bad arguments or configuration;
//! 69 if the lock service is unavailable or refused the credentials; 127 if the command cannot
//! be started.
#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use lockkit::{AcquireOptions, Error, Wait};

#[derive(Parser, Debug)]
#[command(
    name = "lockkit",
    version,
    about = "Run a command while holding a distributed lock"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Acquire LOCK, run COMMAND with LOCKKIT_FENCING_TOKEN set, release when it exits.
    Run {
        /// Lock service URL (memory://, redis://, etcd://, zk://, postgres://). Default: $LOCKKIT_URL.
        #[arg(long, env = "LOCKKIT_URL")]
        backend: String,
        /// Lease TTL, e.g. "30s".
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        ttl: Duration,
        /// How long to wait for a held lock: "0" to try once, "forever", or a duration like "1m".
        #[arg(long, default_value = "forever", value_parser = parse_wait)]
        wait: Wait,
        /// The lock name.
        lock: String,
        /// The command and its arguments.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Print what the backend at URL guarantees.
    Guarantees {
        /// Lock service URL.
        backend: String,
    },
}

fn parse_wait(s: &str) -> Result<Wait, String> {
    match s {
        "forever" => Ok(Wait::Forever),
        "0" | "no" => Ok(Wait::No),
        d => humantime::parse_duration(d)
            .map(Wait::Timeout)
            .map_err(|e| e.to_string()),
    }
}

fn fail(e: &Error) -> ExitCode {
    eprintln!("lockkit: {e}");
    ExitCode::from(match e {
        Error::Held { .. } | Error::Timeout { .. } => 75,
        Error::LeaseLost { .. } | Error::NotHeld { .. } => 70,
        Error::InvalidName { .. } | Error::InvalidConfig { .. } | Error::NotSupported { .. } => 64,
        _ => 69,
    })
}

#[tokio::main]
async fn main() -> ExitCode {
    match Cli::parse().cmd {
        Cmd::Guarantees { backend } => match lockkit::connect(&backend).await {
            Ok(l) => {
                println!("{:#?}", l.guarantees());
                ExitCode::SUCCESS
            }
            Err(e) => fail(&e),
        },
        Cmd::Run {
            backend,
            ttl,
            wait,
            lock,
            command,
        } => match run(&backend, ttl, wait, &lock, &command).await {
            Ok(code) => code,
            Err(e) => fail(&e),
        },
    }
}

async fn run(
    url: &str,
    ttl: Duration,
    wait: Wait,
    name: &str,
    command: &[String],
) -> Result<ExitCode, Error> {
    let locks = lockkit::connect(url).await?;
    let lease = locks
        .acquire(name, AcquireOptions::new().ttl(ttl).wait(wait))
        .await?;
    let (program, args) = command
        .split_first()
        .ok_or_else(|| Error::config("no command given"))?;
    let child = tokio::process::Command::new(program)
        .args(args)
        .env("LOCKKIT_FENCING_TOKEN", lease.token().to_string())
        .env("LOCKKIT_LOCK", name)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| Error::config_with(format!("cannot start {program:?}"), e));
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            eprintln!("lockkit: {e}");
            let _ = lease.release().await;
            return Ok(ExitCode::from(127));
        }
    };
    tokio::select! {
        status = child.wait() => {
            let status = status.map_err(|e| Error::config_with("waiting for the command", e))?;
            if let Err(e) = lease.release().await {
                eprintln!("lockkit: release: {e} (the lock lapses at its TTL)");
            }
            Ok(ExitCode::from(status.code().map_or(1, |c| c.clamp(0, 255) as u8)))
        }
        _ = lease.lost() => {
            let _ = child.start_kill();
            let _ = child.wait().await;
            Err(lease.lost_error())
        }
    }
}
