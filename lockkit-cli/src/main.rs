//! `lockkit`: run a command while holding a distributed lock, or hold one from a shell.
//!
//! ```text
//! lockkit run --backend etcd://127.0.0.1:2379 --ttl 30s --wait 1m nightly-report -- ./report.sh
//! lockkit hold --backend redis://127.0.0.1:6379 deploy      # prints the token, holds until stdin closes
//! lockkit guarantees redis://127.0.0.1:6379 [--json]   # or --backend URL, or LOCKKIT_URL
//! lockkit elect --backend postgres://… --value 10.0.0.7:8080 scheduler -- ./scheduler
//! lockkit leader --backend postgres://… [--watch] [--json] scheduler
//! lockkit permit --backend postgres://… --permits 2 transcoders -- ./transcode.sh
//! ```
//!
//! `elect` and `permit` are `run` for a leadership and a semaphore permit: the same code starts,
//! signals and ends the command, with the same exit statuses. `elect` gives the command
//! `LOCKKIT_TERM` (the term's number), `LOCKKIT_FENCING_TOKEN` (the term's token) and
//! `LOCKKIT_ELECTION`; `permit` gives `LOCKKIT_SLOT` (0..N), `LOCKKIT_PERMITS`,
//! `LOCKKIT_FENCING_TOKEN` (the slot's token) and `LOCKKIT_SEMAPHORE`. A `--permits` other than
//! the one in force while the semaphore is in use exits 64. `leader` prints `leader TERM VALUE`
//! (exit 0) or `no-leader` (exit 1); `--watch` prints every change, and `missed` where changes
//! may have been lost, until a signal (exit 0).
//!
//! `--lock-delay D` (`run`, `hold`): should this holder die or its lease lapse without a release,
//! nobody gets the lock until D after the server freed it (refused with 64 where the backend's
//! `guarantees` say it has no lock-delay).
//!
//! `run` acquires the lock, starts the command with `LOCKKIT_FENCING_TOKEN` (the token's string
//! form, `v1:N:LOCK`) and `LOCKKIT_LOCK`
//! in its environment, in a process group of its own, keeps the lease alive while the command
//! runs, and releases the lock only once every process of that group is gone:
//!
//! - SIGTERM, SIGINT or SIGHUP to `lockkit` is forwarded to the command's process group; after
//!   `--grace` (default 10 s) the group gets SIGKILL. A signal that arrives while `lockkit` still
//!   waits for the lock cancels the acquire (nothing stays queued on the server) and `lockkit`
//!   exits 128+N.
//! - If `lockkit` itself dies (even by SIGKILL), the command dies too: on Linux the command's
//!   first process has SIGKILL as its parent-death signal, and on every platform a small watcher
//!   process (`lockkit watch-group`) SIGKILLs the group when `lockkit`'s end of a pipe closes.
//! - If the lease is lost while the command runs, the group gets SIGTERM at once and SIGKILL
//!   [`LOST_GRACE`] later (the lock may already be someone else's), and `lockkit` exits 70 with
//!   the reason on stderr.
//! - Processes the command left running in its group when it exited get SIGTERM (then SIGKILL
//!   after `--grace`) before the lock is released. The SIGKILL deadline is set once: at the
//!   first forwarded signal if there was one, else when the first process exited. A lease lost
//!   in any of these phases ends the group as above (SIGKILL after [`LOST_GRACE`], exit 70).
//!
//! - SIGTSTP, SIGTTIN and SIGTTOU stop the command's group, then `lockkit` (as a shell stops a
//!   job); SIGCONT resumes the group. SIGSTOP of `lockkit` itself cannot be caught: the command
//!   runs on until `lockkit` resumes and sees the lease lost (its fencing token protects that gap).
//!
//! Exit status: the command's own (128+N if a signal N ended it); 75 if the lock is held (with
//! `--wait 0`) or the wait timed out; 70 if the lease was lost; 64 on bad arguments or
//! configuration; 69 if the lock service is unavailable or refused the credentials; 127 if the
//! command cannot be started; 128+N if signal N ended the wait. `hold` exits 0 once it released
//! the lock, 70 if the lease was lost (also when the release finds the lock no longer held), 69
//! if the release failed (the service unavailable: the lock lapses at its TTL), and otherwise as
//! `run`.
//!
//! Unix only (process groups, signals). The parent-death signal is Linux's `PR_SET_PDEATHSIG`;
//! elsewhere the watcher alone ends the command when `lockkit` dies.
#![deny(unsafe_code)] // one documented exception: the parent-death signal in child.rs

/// `eprintln!` that ignores write errors: a closed stderr (EPIPE) must not turn an exit status
/// into a panic (101).
macro_rules! stderr_line {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// `println!` that ignores write errors: a reader that left (`lockkit guarantees | head`) must
/// not turn exit status 0 into a panic (101).
macro_rules! stdout_line {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

mod child;

use std::net::SocketAddr;
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use lockkit::{
    AcquireOptions, Election, Error, HolderInfo, LeaderEvent, LeaderInfo, Leadership, Lease, Lock,
    MAX_LOCK_DELAY, MAX_TTL, MIN_TTL, Permit, Semaphore, SlotGuarantees, SlotHolders, Wait,
};
use nix::sys::signal::Signal;
use tokio::signal::unix::{SignalKind, signal};
use tokio::time::Instant;

/// Bad arguments or configuration (sysexits `EX_USAGE`).
const EX_USAGE: u8 = 64;
/// The lock service is unreachable or refused the credentials (`EX_UNAVAILABLE`).
const EX_UNAVAILABLE: u8 = 69;
/// The lease was lost (`EX_SOFTWARE`).
const EX_LOST: u8 = 70;
/// Held, or the wait timed out (`EX_TEMPFAIL`).
const EX_TEMPFAIL: u8 = 75;
/// The command cannot be started (as in shells).
const EX_NOT_STARTED: u8 = 127;

/// How long a command whose lease was lost has between SIGTERM and SIGKILL: 1 s, whatever
/// `--grace` says, because the lock may already belong to someone else.
pub const LOST_GRACE: Duration = Duration::from_secs(1);

/// The first "waiting for lock" note comes after this long…
const FIRST_NOTE: Duration = Duration::from_secs(1);
/// …and the next ones this far apart.
const NOTE_EVERY: Duration = Duration::from_secs(10);

/// The longest `--grace`: 1 hour.
const MAX_GRACE: Duration = Duration::from_secs(3600);

/// How long `lockkit` lets the background cleanup of a cancelled acquire run before it exits.
const CLEANUP_LIMIT: Duration = Duration::from_secs(3);

#[derive(Parser, Debug)]
#[command(
    name = "lockkit",
    version,
    about = "Run a command while holding a distributed lock"
)]
struct Cli {
    /// More log output on stderr: -v debug, -vv trace. RUST_LOG, when set, decides instead.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    /// Serve the library's metrics for Prometheus at http://ADDR/metrics (e.g. 127.0.0.1:9464).
    #[arg(long, value_name = "ADDR", global = true)]
    metrics_addr: Option<SocketAddr>,
    #[command(subcommand)]
    cmd: Cmd,
}

/// What `run`, `hold`, `elect` and `permit` share: where, and for how long.
#[derive(Args, Debug)]
struct LeaseArgs {
    /// Lock service URL: redis://, rediss://, redis+sentinel://, redis+cluster://, redlock://, redlocks://, etcd://, etcds://, zk://, postgres://, postgresql://, memory:// [env: LOCKKIT_URL]
    #[arg(long, env = "LOCKKIT_URL", hide_env = true, value_name = "URL")]
    backend: String,
    /// Lease TTL, e.g. "30s", "2m" (100ms to 24h). The lease is renewed every TTL/3.
    #[arg(long, default_value = "30s", value_parser = parse_ttl)]
    ttl: Duration,
    /// How long to wait for a held lock (leadership, permit): "0" to try once, "forever", or a
    /// duration like "1m".
    #[arg(long, default_value = "forever", value_parser = parse_wait)]
    wait: Wait,
    /// If this holder dies or its lease lapses (no release), nobody gets the lock until this long
    /// after the server freed it, e.g. "5s" (0 to 1m). Refused where the backend cannot do it
    /// (see `lockkit guarantees`).
    #[arg(long, value_name = "DURATION", value_parser = parse_lock_delay)]
    lock_delay: Option<Duration>,
    /// Say nothing on stderr while waiting.
    #[arg(short, long)]
    quiet: bool,
}

impl LeaseArgs {
    fn options(&self) -> AcquireOptions {
        let mut opts = AcquireOptions::new().ttl(self.ttl).wait(self.wait);
        if let Some(d) = self.lock_delay {
            opts = opts.lock_delay(d);
        }
        opts
    }
}

/// What `run` and `hold` share: where and which lock, for how long.
#[derive(Args, Debug)]
struct LockArgs {
    #[command(flatten)]
    lease: LeaseArgs,
    /// The lock name.
    lock: String,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Acquire LOCK, run COMMAND with LOCKKIT_FENCING_TOKEN set, release when it exits.
    #[command(after_help = RUN_AFTER_HELP)]
    Run {
        #[command(flatten)]
        lock: LockArgs,
        /// After a forwarded SIGTERM/SIGINT/SIGHUP, how long the command may take to exit before
        /// it gets SIGKILL, e.g. "10s" (0 to 1h).
        #[arg(long, default_value = "10s", value_parser = parse_grace)]
        grace: Duration,
        /// The command and its arguments.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Acquire LOCK, print its fencing token, hold it until SIGTERM/SIGINT/SIGHUP or stdin
    /// closes, then release it.
    #[command(after_help = HOLD_AFTER_HELP)]
    Hold {
        #[command(flatten)]
        lock: LockArgs,
    },
    /// Campaign for leadership of NAME with --value, run COMMAND while leader (the term in
    /// LOCKKIT_TERM and LOCKKIT_FENCING_TOKEN), resign when it exits.
    #[command(after_help = ELECT_AFTER_HELP)]
    Elect {
        #[command(flatten)]
        lease: LeaseArgs,
        /// The value others see for this leader (`lockkit leader`), e.g. its address.
        #[arg(long, value_name = "V")]
        value: String,
        /// As for `run`: after a forwarded signal, how long COMMAND may take to exit.
        #[arg(long, default_value = "10s", value_parser = parse_grace)]
        grace: Duration,
        /// The election name.
        name: String,
        /// The command and its arguments.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Print who leads election NAME (exit 0), or "no-leader" (exit 1); --watch: every change.
    #[command(after_help = LEADER_AFTER_HELP)]
    Leader {
        /// Lock service URL, as for `run` [env: LOCKKIT_URL]
        #[arg(long, env = "LOCKKIT_URL", hide_env = true, value_name = "URL")]
        backend: String,
        /// Print the leader now, then every change, until SIGINT/SIGTERM/SIGHUP.
        #[arg(long)]
        watch: bool,
        /// One JSON object per line instead of text.
        #[arg(long)]
        json: bool,
        /// The election name.
        name: String,
    },
    /// Acquire one of --permits N permits of semaphore NAME, run COMMAND while holding it (the
    /// slot in LOCKKIT_SLOT), release when it exits.
    #[command(after_help = PERMIT_AFTER_HELP)]
    Permit {
        #[command(flatten)]
        lease: LeaseArgs,
        /// How many holders the semaphore admits at once (1 to 1024); every client of NAME must
        /// give the same N while it is in use.
        #[arg(long, value_name = "N")]
        permits: u32,
        /// As for `run`: after a forwarded signal, how long COMMAND may take to exit.
        #[arg(long, default_value = "10s", value_parser = parse_grace)]
        grace: Duration,
        /// The semaphore name.
        name: String,
        /// The command and its arguments.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Print what the backend at URL (or --backend, or LOCKKIT_URL) guarantees.
    Guarantees {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Lock service URL, as for `run` and `hold` [env: LOCKKIT_URL]
        #[arg(long = "backend", value_name = "URL", conflicts_with = "url")]
        backend: Option<String>,
        /// Lock service URL (the same as --backend).
        url: Option<String>,
    },
    /// Internal: SIGKILL the process group whose ID comes on stdin once stdin closes (started
    /// by `run`).
    #[command(hide = true)]
    WatchGroup,
}

const RUN_AFTER_HELP: &str = "\
SIGTERM, SIGINT and SIGHUP go to COMMAND's process group; SIGKILL follows after --grace; the lock
is released once the group is gone. If the lease is lost, the group gets SIGTERM, then SIGKILL
1s later. If lockkit dies, COMMAND is killed.

Exit status: COMMAND's own (128+N if signal N ended it); 64 bad arguments; 69 lock service
unavailable; 70 lease lost; 75 lock held (--wait 0) or --wait ran out; 127 COMMAND cannot be
started; 128+N signal N arrived while waiting.";

const HOLD_AFTER_HELP: &str = "\
Exit status: 0 released; 64 bad arguments; 69 lock service unavailable, or the release failed
(the lock lapses at its TTL); 70 lease lost, also when the release finds the lock no longer
held; 75 lock held (--wait 0) or --wait ran out; 128+N signal N arrived while waiting.";

const ELECT_AFTER_HELP: &str = "\
COMMAND runs only while this process leads NAME, with LOCKKIT_TERM (the term, a number that
grows with every new leader), LOCKKIT_FENCING_TOKEN (the term's token, v1:N:LOCK) and
LOCKKIT_ELECTION. Signals, the loss of leadership and exit statuses are those of `lockkit run`:
if leadership is lost COMMAND gets SIGTERM, then SIGKILL 1s later, and lockkit exits 70; 75 if
another process leads (--wait 0) or --wait ran out.";

const LEADER_AFTER_HELP: &str = "\
Lines: `leader TERM VALUE`, `no-leader`, and with --watch also `missed` (changes may have been
lost here; the next line is the state after them).

Exit status: 0 a leader was printed (--watch: ended by a signal); 1 no leader; 64 bad arguments
or a backend without elections; 69 lock service unavailable, or the watch failed (the backend's
watch could not recover: run it again; its first line is the state then).";

const PERMIT_AFTER_HELP: &str = "\
COMMAND runs with LOCKKIT_SLOT (0..N-1), LOCKKIT_PERMITS (N), LOCKKIT_FENCING_TOKEN (the slot's
token: each slot is its own fencing domain) and LOCKKIT_SEMAPHORE. Signals, the loss of the
permit and exit statuses are those of `lockkit run`; 64 also if the semaphore is in use with
another --permits.";

/// A duration as a user writes one: the largest unit that divides it ("25h", "90s", "1500ms").
fn human(d: Duration) -> String {
    let ms = d.as_millis();
    for (unit, n) in [("h", 3_600_000), ("m", 60_000), ("s", 1000)] {
        if ms >= n && ms.is_multiple_of(n) {
            return format!("{}{unit}", ms / n);
        }
    }
    if ms > 0 && d.subsec_nanos().is_multiple_of(1_000_000) {
        return format!("{ms}ms");
    }
    format!("{d:?}")
}

/// A rounded duration for messages: "3s", "1m 5s", "250ms".
fn rounded(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        return format!("{}ms", d.as_millis());
    }
    humantime::format_duration(Duration::from_secs(d.as_secs())).to_string()
}

/// `d` to a tenth of a second below a minute (cut, not rounded: `2.97s` is `2.9s`), else as
/// [`rounded`]: where a time is set beside the TTL, whole seconds mislead ("sent 2s ago, and the
/// TTL is 3s" for a lease lost at its deadline).
fn tenths(d: Duration) -> String {
    if d < Duration::from_secs(1) || d >= Duration::from_secs(60) {
        return rounded(d);
    }
    let t = d.as_millis() / 100;
    format!("{}.{}s", t / 10, t % 10)
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| match e {
        humantime::DurationError::NumberExpected(_)
        | humantime::DurationError::UnknownUnit { .. }
            if s.chars().all(|c| c.is_ascii_digit()) =>
        {
            format!("{s:?} has no unit: write e.g. \"{s}s\", \"{s}m\" or \"{s}ms\"")
        }
        e => format!("{s:?} is not a duration ({e}): write e.g. \"30s\", \"2m\", \"1h\""),
    })
}

fn parse_ttl(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < MIN_TTL {
        return Err(format!(
            "{s} is shorter than the minimum, {}",
            human(MIN_TTL)
        ));
    }
    if d > MAX_TTL {
        return Err(format!(
            "{s} is longer than the maximum, {}",
            human(MAX_TTL)
        ));
    }
    Ok(d)
}

fn parse_wait(s: &str) -> Result<Wait, String> {
    match s {
        "forever" => Ok(Wait::Forever),
        "0" | "no" => Ok(Wait::No),
        _ => {
            let d = parse_duration(s).map_err(|e| {
                format!("{e}; or \"0\" to try once, \"forever\" to wait without limit")
            })?;
            if d > MAX_TTL {
                return Err(format!(
                    "{s} is longer than {}: use --wait forever",
                    human(MAX_TTL)
                ));
            }
            Ok(if d.is_zero() {
                Wait::No
            } else {
                Wait::Timeout(d)
            })
        }
    }
}

fn parse_lock_delay(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d > MAX_LOCK_DELAY {
        return Err(format!(
            "{s} is longer than the maximum, {}",
            human(MAX_LOCK_DELAY)
        ));
    }
    Ok(d)
}

fn parse_grace(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d > MAX_GRACE {
        return Err(format!(
            "{s} is longer than the maximum, {}",
            human(MAX_GRACE)
        ));
    }
    Ok(d)
}

/// Why `lockkit` ends without passing on a command's status: an exit status and what to say.
#[derive(Debug)]
struct Fail {
    code: u8,
    msg: String,
}

impl Fail {
    fn new(code: u8, msg: impl Into<String>) -> Self {
        Self {
            code,
            msg: msg.into(),
        }
    }
}

impl From<Error> for Fail {
    fn from(e: Error) -> Self {
        let code = match &e {
            Error::Held { .. } | Error::Timeout { .. } => EX_TEMPFAIL,
            // From an acquire, LeaseLost means its own session expired while it was queued (an
            // outage): it never held the lock. A loss while holding is handled in `run`/`hold`.
            Error::LeaseLost { .. } => EX_UNAVAILABLE,
            Error::NotHeld { .. } => EX_LOST,
            Error::InvalidName { .. }
            | Error::InvalidConfig { .. }
            | Error::NotSupported { .. }
            | Error::PermitsMismatch { .. } => EX_USAGE,
            _ => EX_UNAVAILABLE,
        };
        let msg = match &e {
            // The library's text shows a Rust Duration ("1.501195341s").
            Error::Timeout { name, waited } => {
                format!(
                    "lock {name:?} was still held after waiting {} (--wait)",
                    rounded(*waited)
                )
            }
            e => chain(e),
        };
        Self::new(code, msg)
    }
}

/// `e` and its sources, each once: "invalid configuration: bad URL: invalid port number".
fn chain(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        let s_msg = s.to_string();
        if !msg.contains(&s_msg) {
            msg = format!("{msg}: {s_msg}");
        }
        src = s.source();
    }
    msg
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            // --help and --version are not errors.
            return ExitCode::from(if e.use_stderr() { EX_USAGE } else { 0 });
        }
    };
    if let Cmd::WatchGroup = cli.cmd {
        child::watch_group();
        return ExitCode::SUCCESS;
    }
    init_logging(cli.verbose);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return report(Fail::new(EX_UNAVAILABLE, format!("tokio runtime: {e}"))),
    };
    // The main thread runs this future: commands are spawned from it (see child::spawn).
    let out = rt.block_on(run_cli(cli));
    // Not a plain drop, which would wait for the blocking thread still reading stdin (`hold`).
    rt.shutdown_background();
    match out {
        Ok(code) => ExitCode::from(code),
        Err(f) => report(f),
    }
}

fn report(f: Fail) -> ExitCode {
    stderr_line!("lockkit: {}", f.msg);
    ExitCode::from(f.code)
}

/// Warnings only, and none from sqlx's slow-statement log: a waiting `pg_advisory_lock` is slow
/// on purpose.
const QUIET_LOGS: &str = "warn,sqlx::query=error";

fn init_logging(verbose: u8) {
    use tracing_subscriber::EnvFilter;
    let ours = [
        "lockkit",
        "lockkit_core",
        "lockkit_redis",
        "lockkit_etcd",
        "lockkit_zk",
    ];
    let filter = std::env::var("RUST_LOG")
        .ok()
        .and_then(|v| EnvFilter::try_new(v).ok())
        .unwrap_or_else(|| {
            let level = match verbose {
                0 => return EnvFilter::new(QUIET_LOGS),
                1 => "debug",
                _ => "trace",
            };
            let mut spec = String::from(QUIET_LOGS);
            for c in ours.iter().chain(&["lockkit_postgres"]) {
                spec.push_str(&format!(",{c}={level}"));
            }
            EnvFilter::new(spec)
        });
    use std::io::IsTerminal;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour codes only for a person at a terminal, not in a log file or a pipe.
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

async fn run_cli(cli: Cli) -> Result<u8, Fail> {
    if let Some(addr) = cli.metrics_addr {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .install()
            .map_err(|e| Fail::new(EX_USAGE, format!("--metrics-addr {addr}: {}", chain(&e))))?;
    }
    match cli.cmd {
        Cmd::Guarantees { json, backend, url } => {
            // Not clap's `env`: a LOCKKIT_URL in the environment must not conflict with a URL
            // on the command line.
            let backend = backend
                .or(url)
                .or_else(|| std::env::var("LOCKKIT_URL").ok())
                .ok_or_else(|| {
                    Fail::new(
                        EX_USAGE,
                        "no lock service URL: give it as an argument, with --backend URL, or in \
                         LOCKKIT_URL",
                    )
                })?;
            let locks = lockkit::connect(&backend).await?;
            let slots = match lockkit::connect_election(&backend).await {
                Ok(e) => Some(e.election_guarantees()),
                Err(Error::NotSupported { .. }) => None,
                Err(e) => return Err(e.into()),
            };
            print_guarantees(&locks.guarantees(), slots.as_ref(), json);
            Ok(0)
        }
        Cmd::Run {
            lock,
            grace,
            command,
        } => {
            let mut sigs = Signals::new()?;
            let (locks, lease) = acquire(&lock, &mut sigs).await?;
            let what = format!("lock {:?}", lock.lock);
            let env = vec![
                ("LOCKKIT_FENCING_TOKEN", lease.token().to_string()),
                ("LOCKKIT_LOCK", lock.lock.clone()),
            ];
            let code = run(lease, &what, env, grace, &command, &mut sigs).await;
            drop(locks);
            code
        }
        Cmd::Hold { lock } => {
            let mut sigs = Signals::new()?;
            let (_locks, lease) = acquire(&lock, &mut sigs).await?;
            hold(lease, &format!("lock {:?}", lock.lock), &mut sigs).await
        }
        Cmd::Elect {
            lease,
            value,
            grace,
            name,
            command,
        } => {
            let mut sigs = Signals::new()?;
            let (elections, leadership) = campaign(&lease, &name, &value, &mut sigs).await?;
            let term = leadership.term();
            let what = format!("the leadership of election {name:?}");
            let env = vec![
                ("LOCKKIT_FENCING_TOKEN", term.to_string()),
                ("LOCKKIT_TERM", term.get().to_string()),
                ("LOCKKIT_ELECTION", name),
            ];
            let code = run(
                leadership.into_lease(),
                &what,
                env,
                grace,
                &command,
                &mut sigs,
            )
            .await;
            drop(elections);
            code
        }
        Cmd::Permit {
            lease,
            permits,
            grace,
            name,
            command,
        } => {
            let mut sigs = Signals::new()?;
            let (semaphores, permit) = acquire_permit(&lease, &name, permits, &mut sigs).await?;
            let what = format!("permit {} of semaphore {name:?}", permit.slot());
            let env = vec![
                ("LOCKKIT_FENCING_TOKEN", permit.token().to_string()),
                ("LOCKKIT_SLOT", permit.slot().to_string()),
                ("LOCKKIT_PERMITS", permits.to_string()),
                ("LOCKKIT_SEMAPHORE", name),
            ];
            let code = run(permit.into_lease(), &what, env, grace, &command, &mut sigs).await;
            drop(semaphores);
            code
        }
        Cmd::Leader {
            backend,
            watch,
            json,
            name,
        } => {
            let mut sigs = Signals::new()?;
            leader(&backend, &name, watch, json, &mut sigs).await
        }
        Cmd::WatchGroup => unreachable!("handled before the runtime starts"),
    }
}

fn print_guarantees(g: &lockkit::Guarantees, slots: Option<&SlotGuarantees>, json: bool) {
    let kind = match g.kind {
        lockkit::LockKind::Correctness => "correctness",
        lockkit::LockKind::Efficiency => "efficiency",
    };
    if json {
        let v = serde_json::json!({
            "backend": g.backend,
            "mode": g.mode,
            "kind": kind,
            "tokens_survive_restart": g.tokens_survive_restart,
            "safe_across_failover": g.safe_across_failover,
            "fifo_waiters": g.fifo_waiters,
            "manual_renewal": g.manual_renewal,
            "expiry_slack_ms": g.expiry_slack.as_millis() as u64,
            "lock_delay": g.lock_delay,
            "loss_notice_ms": g.loss_notice.map(|d| d.as_millis() as u64),
            "notes": g.notes,
            // null: this backend has no elections and semaphores (yet).
            "elections": slots.map(|s| serde_json::json!({
                "fifo_waiters": s.lock.fifo_waiters,
                "lock_delay": s.lock.lock_delay,
                "observe": s.observe,
                "every_change_observed": s.every_change_observed,
                "max_permits": s.max_permits,
                "notes": s.notes,
            })),
        });
        stdout_line!("{v}");
        return;
    }
    let yes = |b: bool| if b { "yes" } else { "no" };
    match g.mode {
        Some(mode) => stdout_line!("backend                 {} ({mode})", g.backend),
        None => stdout_line!("backend                 {}", g.backend),
    }
    stdout_line!("kind                    {kind} lock");
    stdout_line!("tokens survive restart  {}", yes(g.tokens_survive_restart));
    stdout_line!("safe across failover    {}", yes(g.safe_across_failover));
    stdout_line!("FIFO waiters            {}", yes(g.fifo_waiters));
    stdout_line!("manual renewal          {}", yes(g.manual_renewal));
    stdout_line!("expiry slack            {}", human(g.expiry_slack));
    stdout_line!("lock-delay              {}", yes(g.lock_delay));
    let notice = g.loss_notice.map_or("at the next renewal".to_owned(), |d| {
        if d.is_zero() {
            "at once".to_owned()
        } else {
            format!("within {}", human(d))
        }
    });
    stdout_line!("loss notice             {notice}");
    stdout_line!("notes                   {}", g.notes);
    let Some(s) = slots else {
        stdout_line!("elections, semaphores   not supported by this backend yet");
        return;
    };
    stdout_line!(
        "elections, semaphores   yes (up to {} permits)",
        s.max_permits
    );
    stdout_line!("  FIFO candidates       {}", yes(s.lock.fifo_waiters));
    stdout_line!("  lock-delay            {}", yes(s.lock.lock_delay));
    let observers = match (s.observe, s.every_change_observed) {
        (false, _) => "not supported",
        (true, true) => "see every change (missed only when far behind)",
        (true, false) => "may miss changes (each such place is marked missed)",
    };
    stdout_line!("  observers             {observers}");
    stdout_line!("  notes                 {}", s.notes);
}

/// SIGTERM, SIGINT and SIGHUP, caught from the start so that none ends `lockkit` before it has
/// cleaned up.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

/// The job-control signals of `lockkit run`: SIGTSTP (Ctrl-Z), SIGTTIN and SIGTTOU stop the
/// command's group and then `lockkit`; SIGCONT resumes the group.
struct JobSignals {
    tstp: tokio::signal::unix::Signal,
    ttin: tokio::signal::unix::Signal,
    ttou: tokio::signal::unix::Signal,
    cont: tokio::signal::unix::Signal,
}

impl JobSignals {
    fn new() -> Result<Self, Fail> {
        let catch = |s: Signal| {
            signal(SignalKind::from_raw(s as i32))
                .map_err(|e| Fail::new(EX_UNAVAILABLE, format!("catching {s}: {e}")))
        };
        Ok(Self {
            tstp: catch(Signal::SIGTSTP)?,
            ttin: catch(Signal::SIGTTIN)?,
            ttou: catch(Signal::SIGTTOU)?,
            cont: catch(Signal::SIGCONT)?,
        })
    }

    /// The next to arrive: `true` for a stop signal, `false` for SIGCONT.
    async fn recv(&mut self) -> bool {
        tokio::select! {
            _ = self.tstp.recv() => true,
            _ = self.ttin.recv() => true,
            _ = self.ttou.recv() => true,
            _ = self.cont.recv() => false,
        }
    }
}

impl Signals {
    fn new() -> Result<Self, Fail> {
        let catch = |k: SignalKind| {
            signal(k).map_err(|e| Fail::new(EX_UNAVAILABLE, format!("catching signals: {e}")))
        };
        Ok(Self {
            term: catch(SignalKind::terminate())?,
            int: catch(SignalKind::interrupt())?,
            hup: catch(SignalKind::hangup())?,
        })
    }

    /// The next of the three to arrive.
    async fn recv(&mut self) -> Signal {
        tokio::select! {
            _ = self.term.recv() => Signal::SIGTERM,
            _ = self.int.recv() => Signal::SIGINT,
            _ = self.hup.recv() => Signal::SIGHUP,
        }
    }
}

/// The exit status for "ended by signal `sig`": 128 + its number.
fn signal_status(sig: Signal) -> u8 {
    128u8.saturating_add(sig as i32 as u8)
}

fn refuse_memory(url: &str) -> Result<(), Fail> {
    let scheme = url.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
    if scheme.as_deref() == Some("memory") {
        return Err(Fail::new(
            EX_USAGE,
            "memory:// locks live inside one process: every lockkit command would hold its own \
             copy of the lock, so two of them would both \"hold\" it. Use a lock server: \
             --backend redis://…, etcd://…, zk://… or postgres://…",
        ));
    }
    Ok(())
}

/// A boxed future that owns what it needs (the client is an `Arc` moved into it).
type Boxed<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// What a "waiting for …" note says about the holder, from `read` (at most 2 s).
async fn holder_note<T>(
    read: impl Future<Output = lockkit::Result<T>>,
    describe: impl FnOnce(T) -> String,
) -> String {
    match tokio::time::timeout(Duration::from_secs(2), read).await {
        Ok(Ok(h)) => describe(h),
        Ok(Err(Error::NotSupported { backend, .. })) => {
            format!("holder unknown (the {backend} backend cannot tell)")
        }
        Ok(Err(e)) => format!("holder unknown (cannot read it: {e})"),
        Err(_) => "holder unknown (the server did not answer within 2s)".into(),
    }
}

fn lock_note(holder: Option<HolderInfo>) -> String {
    match holder {
        Some(h) => {
            let token = h
                .token
                .as_ref()
                .map_or("unknown".into(), |t| t.get().to_string());
            match h.remaining {
                Some(r) => format!(
                    "held with token {token}, its lease ends in {} unless renewed",
                    rounded(r)
                ),
                None => format!("held with token {token}"),
            }
        }
        None => {
            "no holder now (free, the grant is on its way; or a failed holder's lock-delay runs)"
                .into()
        }
    }
}

fn leader_note(leader: Option<LeaderInfo>) -> String {
    match leader {
        Some(l) => format!("led in term {} by {}", l.term.get(), text_value(&l.value)),
        None => "no leader now (the grant is on its way)".into(),
    }
}

fn permits_note(holders: Option<SlotHolders>) -> String {
    let Some(h) = holders else {
        return "no holder now (the grant is on its way)".into();
    };
    let first = h.holders.iter().filter_map(|h| h.remaining).min();
    let held = format!("{} of {} permits held", h.holders.len(), h.permits);
    match first {
        Some(r) => format!(
            "{held}, the first lease ends in {} unless renewed",
            rounded(r)
        ),
        None => held,
    }
}

/// What one acquire waits for, for its messages.
struct Target {
    /// `lock "x"`, `the leadership of election "x"`, …
    what: String,
    /// What a try-once that found it held says: `lock "x" is held by another holder`.
    held: String,
    /// What a timeout says: `lock "x" was still held` (after waiting …).
    busy: String,
}

/// Connects and acquires, saying on stderr what it waits for; a signal cancels it.
async fn acquire(args: &LockArgs, sigs: &mut Signals) -> Result<(Arc<dyn Lock>, Lease), Fail> {
    lockkit::backend::validate_name(&args.lock)?;
    let name = args.lock.clone();
    let target = Target {
        what: format!("lock {name:?}"),
        held: format!("lock {name:?} is held by another holder"),
        busy: format!("lock {name:?} was still held"),
    };
    let opts = args.lease.options();
    let n = name.clone();
    acquire_with(
        &args.lease,
        target,
        sigs,
        lockkit::connect(&args.lease.backend),
        move |locks: Arc<dyn Lock>| Box::pin(async move { locks.acquire(&n, opts).await }),
        move |locks| {
            let name = name.clone();
            Box::pin(async move { holder_note(locks.holder(&name), lock_note).await })
        },
    )
    .await
}

/// `elect`: connects and campaigns, as [`acquire`].
async fn campaign(
    args: &LeaseArgs,
    name: &str,
    value: &str,
    sigs: &mut Signals,
) -> Result<(Arc<dyn Election>, Leadership), Fail> {
    lockkit::backend::validate_slot_name(lockkit::backend::SlotKind::Election, name)?;
    lockkit::backend::validate_value(value.as_bytes())?;
    let target = Target {
        what: format!("the leadership of election {name:?}"),
        held: format!("election {name:?} has another leader, or candidates ahead in line"),
        busy: format!("election {name:?} still had another leader"),
    };
    let opts = args.options();
    let (n, v, name) = (name.to_owned(), value.to_owned(), name.to_owned());
    acquire_with(
        args,
        target,
        sigs,
        lockkit::connect_election(&args.backend),
        move |e: Arc<dyn Election>| {
            Box::pin(async move { e.campaign(&n, v.as_bytes(), opts).await })
        },
        move |e| {
            let name = name.clone();
            Box::pin(async move { holder_note(e.leader(&name), leader_note).await })
        },
    )
    .await
}

/// `permit`: connects and acquires one of `permits` permits, as [`acquire`].
async fn acquire_permit(
    args: &LeaseArgs,
    name: &str,
    permits: u32,
    sigs: &mut Signals,
) -> Result<(Arc<dyn Semaphore>, Permit), Fail> {
    lockkit::backend::validate_slot_name(lockkit::backend::SlotKind::Semaphore, name)?;
    lockkit::backend::validate_permits(permits)?;
    let target = Target {
        what: format!("a permit of semaphore {name:?}"),
        held: format!("all {permits} permits of semaphore {name:?} are held, or others wait first"),
        busy: format!("all {permits} permits of semaphore {name:?} were still held"),
    };
    let opts = args.options();
    let (n, name) = (name.to_owned(), name.to_owned());
    acquire_with(
        args,
        target,
        sigs,
        lockkit::connect_semaphore(&args.backend),
        move |s: Arc<dyn Semaphore>| {
            Box::pin(async move { s.acquire_permit(&n, permits, opts).await })
        },
        move |s| {
            let name = name.clone();
            Box::pin(async move { holder_note(s.permit_holders(&name), permits_note).await })
        },
    )
    .await
}

/// The one acquire loop of `run`, `hold`, `elect` and `permit`: connects with `connect`,
/// acquires with `grant`, says every 10 s on stderr what it waits for (`note`), and cancels on
/// a signal (128+N, after the client's background cleanup ran).
async fn acquire_with<C: ?Sized + Send + Sync + 'static, T>(
    args: &LeaseArgs,
    target: Target,
    sigs: &mut Signals,
    connect: impl Future<Output = lockkit::Result<Arc<C>>>,
    grant: impl FnOnce(Arc<C>) -> Boxed<lockkit::Result<T>>,
    note: impl Fn(Arc<C>) -> Boxed<String>,
) -> Result<(Arc<C>, T), Fail> {
    refuse_memory(&args.backend)?;
    let baseline = tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks();
    let client = tokio::select! {
        c = connect => c?,
        sig = sigs.recv() => return Err(Fail::new(signal_status(sig), format!("{sig} while connecting"))),
    };
    let started = Instant::now();
    let mut acquiring = grant(client.clone());
    let mut next_note = started + FIRST_NOTE;
    let mut query: Option<Boxed<String>> = None;
    let outcome = loop {
        tokio::select! {
            r = &mut acquiring => break Ok(r),
            sig = sigs.recv() => break Err(sig),
            _ = tokio::time::sleep_until(next_note), if !args.quiet && query.is_none() => {
                query = Some(note(client.clone()));
            }
            about = async { query.as_mut().expect("guarded").await }, if query.is_some() => {
                query = None;
                stderr_line!("lockkit: waiting for {} for {}: {about}", target.what, rounded(started.elapsed()));
                next_note = Instant::now() + NOTE_EVERY;
            }
        }
    };
    drop(query);
    drop(acquiring);
    match outcome {
        Ok(Ok(granted)) => Ok((client, granted)),
        Ok(Err(Error::Timeout { waited, .. })) => Err(Fail::new(
            EX_TEMPFAIL,
            format!("{} after waiting {} (--wait)", target.busy, rounded(waited)),
        )),
        Ok(Err(Error::Held { .. })) => Err(Fail::new(EX_TEMPFAIL, target.held)),
        Ok(Err(e)) => Err(e.into()),
        Err(sig) => {
            drop(client);
            drain_background(baseline).await;
            Err(Fail::new(
                signal_status(sig),
                format!("{sig} while waiting for {}: gave up waiting", target.what),
            ))
        }
    }
}

/// After a cancelled acquire, its client dropped: waits until the runtime has no more live tasks
/// than `baseline` (those before the client, such as the metrics listener), for at most
/// [`CLEANUP_LIMIT`]. The acquire's background cleanup (deleting a queued key, unsubscribing)
/// then ran to its end, and so did the client's connections, which that cleanup keeps open.
/// A cleanup still running at the limit is named on stderr: what it had left to do is left to
/// the server (which drops a closed connection's waits and locks).
async fn drain_background(baseline: usize) {
    let metrics = tokio::runtime::Handle::current().metrics();
    let limit = Instant::now() + CLEANUP_LIMIT;
    // A poll: the end of a task has no event that can be awaited from outside it.
    while metrics.num_alive_tasks() > baseline {
        if Instant::now() >= limit {
            stderr_line!(
                "lockkit: the cancelled acquire's cleanup was still running after {}; exiting without it",
                rounded(CLEANUP_LIMIT)
            );
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// What the lease state says about a lost lease on `what` (`lock "x"`), for stderr.
fn loss_text(lease: &Lease, what: &str) -> String {
    let t = lease.tracker();
    let why = lease
        .loss_reason()
        .map_or_else(|| "lost".to_owned(), |r| r.to_string());
    format!(
        "lease on {what} (token {}) was lost ({why}): the last renewal the server \
         acknowledged was sent {} ago, and the TTL is {}",
        lease.token(),
        tenths(t.confirmed_at().elapsed()),
        human(lease.ttl()),
    )
}

async fn release(lease: Lease) {
    if let Err(e) = lease.release().await
        && !matches!(e, Error::NotHeld { .. })
    {
        stderr_line!(
            "lockkit: release: {} (the lock lapses at its TTL)",
            chain(&e)
        );
    }
}

/// Runs the command with `env` while `lease` (on `what`: `lock "x"`) holds, and ends it as the
/// module docs say. `run`, `elect` and `permit` alike.
async fn run(
    lease: Lease,
    what: &str,
    env: Vec<(&str, String)>,
    grace: Duration,
    command: &[String],
    sigs: &mut Signals,
) -> Result<u8, Fail> {
    let (program, args) = command
        .split_first()
        .ok_or_else(|| Fail::new(EX_USAGE, "no command given"))?;
    let mut job = JobSignals::new()?;
    let mut group = match child::spawn(program, args, &env) {
        Ok(g) => g,
        Err(e) => {
            release(lease).await;
            return Err(Fail::new(
                EX_NOT_STARTED,
                format!("cannot start {program:?}: {e}"),
            ));
        }
    };
    let mut lost = Box::pin(lease.lost());
    let mut loss: Option<String> = None;
    // When the group gets SIGKILL: fixed at the first forwarded signal (or when the leader exits
    // leaving processes behind), only ever brought forward (a lost lease: LOST_GRACE).
    let mut kill_at: Option<Instant> = None;
    // The leader's exit status, once it exited; then the loop waits for the rest of the group.
    let mut status = None;
    // After the leader exited: when to stop waiting for a group that outlives its SIGKILL.
    let mut give_up: Option<Instant> = None;
    let mut leftovers = false;
    let status = loop {
        // Once the leader exited: done when the group is gone, or given up on.
        if let Some(st) =
            status.take_if(|_| !group.alive() || give_up.is_some_and(|g| Instant::now() >= g))
        {
            break st;
        }
        tokio::select! {
            st = group.wait(), if status.is_none() => {
                status = Some(st);
                if group.alive() {
                    leftovers = !group.killed();
                    let sig = if group.killed() { Signal::SIGKILL } else { Signal::SIGTERM };
                    group.signal(sig);
                    let now = Instant::now();
                    let k = *kill_at.get_or_insert(now + grace);
                    give_up = Some(k.max(now) + LOST_GRACE);
                }
            }
            sig = sigs.recv() => {
                group.signal(sig);
                kill_at.get_or_insert(Instant::now() + grace);
            }
            stop = job.recv() => {
                // A shell's job control: the command (its own process group) stops with us and
                // resumes with us. Resumed past the TTL, `lost` fires next: exit 70.
                if stop {
                    group.signal(Signal::SIGSTOP);
                    let _ = nix::sys::signal::raise(Signal::SIGSTOP);
                }
                group.signal(Signal::SIGCONT);
            }
            _ = &mut lost, if loss.is_none() => {
                loss = Some(loss_text(&lease, what));
                group.signal(Signal::SIGTERM);
                let now = Instant::now();
                let at = now + LOST_GRACE;
                kill_at = Some(kill_at.map_or(at, |k| k.min(at)));
                give_up = give_up.map(|_| now + LOST_GRACE + LOST_GRACE);
            }
            _ = tokio::time::sleep_until(kill_at.unwrap_or_else(Instant::now)),
                if kill_at.is_some() && !group.killed() => {
                group.signal(Signal::SIGKILL);
            }
            _ = tokio::time::sleep(child::GROUP_POLL), if status.is_some() => {}
        }
    };
    group.finish();
    if leftovers {
        stderr_line!("lockkit: the command left processes running in its group; they were ended");
    }
    if let Some(loss) = loss {
        drop(lease); // lost: nothing of ours is left on the server to release
        return Err(Fail::new(
            EX_LOST,
            format!("{loss}; the command was terminated"),
        ));
    }
    release(lease).await;
    let status =
        status.map_err(|e| Fail::new(EX_UNAVAILABLE, format!("waiting for the command: {e}")))?;
    use std::os::unix::process::ExitStatusExt;
    Ok(match (status.code(), status.signal()) {
        (Some(c), _) => c.clamp(0, 255) as u8,
        (None, Some(sig)) => 128u8.saturating_add(sig.clamp(0, 127) as u8),
        (None, None) => 1,
    })
}

/// `hold`: prints the token, holds until a signal or EOF on stdin, releases.
async fn hold(lease: Lease, what: &str, sigs: &mut Signals) -> Result<u8, Fail> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut out = tokio::io::stdout();
    let line = format!("{}\n", lease.token());
    let _ = out.write_all(line.as_bytes()).await;
    let _ = out.flush().await;
    let stdin_closed = async {
        let mut stdin = tokio::io::stdin();
        let mut buf = [0u8; 256];
        loop {
            match stdin.read(&mut buf).await {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
    };
    tokio::select! {
        _ = lease.lost() => return Err(Fail::new(EX_LOST, loss_text(&lease, what))),
        _ = sigs.recv() => {}
        _ = stdin_closed => {}
    }
    // hold's only result is the release: a failed one is its exit status (as `run`'s errors
    // map to theirs), not a note behind exit 0.
    let ttl = lease.ttl();
    match lease.release().await {
        Ok(()) => Ok(0),
        Err(Error::NotHeld { .. }) => Err(Fail::new(
            EX_LOST,
            format!("lease on {what} was lost before its release: the server no longer held it"),
        )),
        Err(e) => {
            let msg = format!(
                "release of {what} failed: {} (no longer renewed, it may stay held until its \
                 TTL of {} runs out)",
                chain(&e),
                human(ttl)
            );
            // The exit status of the error, as for any other (69: the service unavailable).
            Err(Fail::new(Fail::from(e).code, msg))
        }
    }
}

/// A holder's value for a text line: UTF-8 (invalid bytes replaced), control characters
/// escaped so that one event stays one line.
fn text_value(value: &[u8]) -> String {
    String::from_utf8_lossy(value)
        .chars()
        .map(|c| {
            if c.is_control() {
                c.escape_debug().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// One line of `lockkit leader`: `leader TERM VALUE`, `no-leader`, `missed` (or JSON).
fn leader_line(event: &LeaderEvent, json: bool) -> String {
    match (event, json) {
        (LeaderEvent::Leader(l), false) => {
            format!("leader {} {}", l.term.get(), text_value(&l.value))
        }
        (LeaderEvent::Leader(l), true) => serde_json::json!({
            "event": "leader",
            "term": l.term.get(),
            "token": l.term.to_string(),
            "value": String::from_utf8_lossy(&l.value),
        })
        .to_string(),
        (LeaderEvent::NoLeader, false) => "no-leader".into(),
        (LeaderEvent::NoLeader, true) => r#"{"event":"no-leader"}"#.into(),
        (_, false) => "missed".into(),
        (_, true) => r#"{"event":"missed"}"#.into(),
    }
}

/// Writes one line to stdout; `false` once stdout is closed (a reader such as `head` left).
fn print_line(line: &str) -> bool {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").and_then(|()| out.flush()).is_ok()
}

/// `leader`: prints who leads `name` (exit 0) or `no-leader` (exit 1); with `watch`, every
/// change until a signal (exit 0) or until stdout closes.
async fn leader(
    backend: &str,
    name: &str,
    watch: bool,
    json: bool,
    sigs: &mut Signals,
) -> Result<u8, Fail> {
    lockkit::backend::validate_slot_name(lockkit::backend::SlotKind::Election, name)?;
    refuse_memory(backend)?;
    let interrupted =
        |sig: Signal| Fail::new(signal_status(sig), format!("{sig} while connecting"));
    let elections = tokio::select! {
        e = lockkit::connect_election(backend) => e?,
        sig = sigs.recv() => return Err(interrupted(sig)),
    };
    if !watch {
        let now = tokio::select! {
            l = elections.leader(name) => l?,
            sig = sigs.recv() => return Err(interrupted(sig)),
        };
        let event = now.map_or(LeaderEvent::NoLeader, LeaderEvent::Leader);
        print_line(&leader_line(&event, json));
        return Ok(if matches!(event, LeaderEvent::Leader(_)) {
            0
        } else {
            1
        });
    }
    let mut observer = tokio::select! {
        o = elections.observe(name) => o?,
        sig = sigs.recv() => return Err(interrupted(sig)),
    };
    loop {
        tokio::select! {
            event = observer.next() => {
                if !print_line(&leader_line(&event?, json)) {
                    return Ok(0);
                }
            }
            _ = sigs.recv() => return Ok(0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_beside_the_ttl_keep_tenths() {
        assert_eq!(tenths(Duration::from_millis(2970)), "2.9s");
        assert_eq!(tenths(Duration::from_millis(3000)), "3.0s");
        assert_eq!(tenths(Duration::from_millis(1050)), "1.0s");
        assert_eq!(tenths(Duration::from_millis(59_990)), "59.9s");
        assert_eq!(tenths(Duration::from_millis(250)), "250ms");
        assert_eq!(
            tenths(Duration::from_secs(90)),
            rounded(Duration::from_secs(90))
        );
    }
}
