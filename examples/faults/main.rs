//! The fault matrix: the same faults applied to every backend, results in one table produced by
//! the run itself (issue #15). Run it with `scripts/faults.sh`.
//!
//! ```text
//! cargo run --features full --example faults -- run --out docs/faults.md
//! ```
//!
//! One binary, two roles:
//! - `run`: the harness. Starts a private server per backend (one it can SIGKILL, SIGSTOP and
//!   restart on the same port and data dir), a fence server and a TCP fault proxy in its own
//!   process, spawns holder processes, applies the faults, computes every figure from the
//!   holders' events and the fence's log, prints the table and writes it as Markdown.
//! - `holder`: one lockkit client in its own process (so it can be SIGKILLed and SIGSTOPped),
//!   reporting JSON lines on stdout, each with `t` = CLOCK_REALTIME in nanoseconds (the clock the
//!   harness uses too), and taking commands on stdin.

mod fence;
mod harness;
mod holder;
#[path = "../../tests/suite/common/proxy.rs"]
#[allow(dead_code)] // the harness uses the freeze, not the traps
mod proxy;
mod scenarios;
mod servers;
mod topology;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run the fault matrix and print (and write) the table.
    Run(scenarios::RunArgs),
    /// One holder process (spawned by `run`).
    Holder(holder::HolderArgs),
}

fn main() {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let code = match cli.cmd {
        Cmd::Run(args) => rt.block_on(scenarios::run(args)),
        Cmd::Holder(args) => rt.block_on(holder::run(args)),
    };
    // Leave at once: a holder's background tasks (keepalives) must not outlive its report.
    std::process::exit(code);
}

/// CLOCK_REALTIME in nanoseconds: the clock every event of the harness and the holders carries.
pub fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// The variant name of a lockkit error (`Held`, `Timeout`, `LeaseLost`, …), for reports.
pub fn error_kind(e: &lockkit::Error) -> String {
    let dbg = format!("{e:?}");
    dbg.split(|c: char| !c.is_alphanumeric())
        .next()
        .unwrap_or("Error")
        .to_owned()
}
