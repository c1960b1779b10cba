//! The scenarios of issue #15, each applied the same way to every backend, and the table.
//!
//! Every figure comes from events: the holders' JSON lines (stamped with CLOCK_REALTIME, the
//! clock the harness stamps its faults with) and the fence's log. Sleeps only set how long a
//! fault lasts; every wait for a result is bounded.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use lockkit::{AcquireOptions, Wait};
use tokio::sync::Semaphore;
use tokio::time::Instant;

use crate::fence::Fence;
use crate::harness::{Holder, Spec, secs};
use crate::now_ns;
use crate::proxy::Proxy;
use crate::servers::{Kind, Server, signal};

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Backends to run, comma-separated: redis, redis-sentinel, redis-cluster, redlock, etcd,
    /// zk, postgres.
    #[arg(
        long,
        default_value = "redis,redis-sentinel,redis-cluster,redlock,etcd,zk,postgres",
        value_delimiter = ','
    )]
    backends: Vec<String>,
    /// Lease TTL of every holder.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "2s")]
    ttl: Duration,
    /// Stress: holder processes.
    #[arg(long, default_value_t = 8)]
    holders: u32,
    /// Stress: rounds per holder.
    #[arg(long, default_value_t = 250)]
    rounds: u32,
    /// Backends run at once (each on its own private server).
    #[arg(long, default_value_t = 2)]
    jobs: usize,
    /// Where to write the Markdown table.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

/// Added to time bounds for a loaded machine (2 cores shared with other work): scheduling, not
/// the backend.
const LOAD_TOLERANCE: Duration = Duration::from_millis(1500);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Status {
    Pass,
    Fail,
    /// A limit the guarantee table declares.
    Declared,
    /// The scenario does not apply to the mode (the cell says why); nothing was run.
    NotApplicable,
}

#[derive(Clone, Debug)]
struct Cell {
    status: Status,
    /// The figures, short, for the table.
    summary: String,
    /// Everything measured, for the notes under the table.
    details: Vec<String>,
}

const SCENARIOS: [&str; 7] = [
    "1 holder SIGKILL",
    "2 holder SIGSTOP > TTL",
    "3 holder partitioned > TTL",
    "4 server SIGKILL + restart",
    "5 server SIGSTOP > TTL",
    "6 failover",
    "7 stress",
];

/// One backend's private server and what every scenario on it shares.
struct Ctx {
    kind: Kind,
    server: Server,
    fence: Arc<Fence>,
    ttl: Duration,
    holders: u32,
    rounds: u32,
}

/// Collects the checks of one scenario: figures, failed checks and declared limits met.
#[derive(Default)]
struct Checks {
    details: Vec<String>,
    failed: Vec<String>,
    declared: Vec<String>,
}

impl Checks {
    fn note(&mut self, s: impl Into<String>) {
        self.details.push(s.into());
    }
    fn check(&mut self, ok: bool, what: impl Into<String>) {
        if !ok {
            self.failed.push(what.into());
        }
    }
    /// A limit the backend documents was met (the cell is then Declared, unless a check fails).
    fn declare(&mut self, what: impl Into<String>) {
        self.declared.push(what.into());
    }
    fn cell(mut self, summary: String) -> Cell {
        let status = match (self.failed.is_empty(), self.declared.is_empty()) {
            (false, _) => Status::Fail,
            (true, false) => Status::Declared,
            (true, true) => Status::Pass,
        };
        for d in &self.declared {
            self.details.push(format!("declared limit met: {d}"));
        }
        for f in &self.failed {
            self.details.push(format!("FAILED: {f}"));
        }
        let summary = if self.failed.is_empty() {
            summary
        } else {
            format!("{summary}; FAILED: {}", self.failed.join("; "))
        };
        Cell {
            status,
            summary,
            details: self.details,
        }
    }
}

impl Ctx {
    fn prefix(&self, scenario: &str) -> String {
        format!("faults-{scenario}-{:08x}", rand::random::<u32>())
    }

    fn url(&self, prefix: &str) -> String {
        self.url_on(&self.server.url(), prefix)
    }

    /// `base` with the cell's `prefix` (and, for Redlock, `max_ttl` = the TTL: a node restarted
    /// empty votes again one TTL later).
    fn url_on(&self, base: &str, prefix: &str) -> String {
        if self.kind == Kind::Redlock {
            let max_ttl = humantime::format_duration(self.ttl);
            format!("{base}?prefix={prefix}&max_ttl={max_ttl}")
        } else {
            format!("{base}?prefix={prefix}")
        }
    }

    fn spec(&self, prefix: &str) -> Spec {
        Spec {
            url: self.url(prefix),
            name: "lock".into(),
            ttl: self.ttl,
            fence: self.fence.port,
            key: format!("{:?}-{prefix}", self.kind),
            stress_rounds: None,
            native: false,
            wait: Duration::from_secs(30),
            limit: Duration::from_secs(120),
        }
    }

    /// How long after a fault another process may have to wait for the lock.
    fn regrant_bound(&self) -> Duration {
        self.ttl + self.kind.expiry_slack() + LOAD_TOLERANCE
    }

    /// Checks a grant to another process after a fault: a larger token, within the bound.
    fn check_regrant(&self, c: &mut Checks, ta: u64, tb: u64, regrant: f64) {
        c.check(tb > ta, format!("token {tb} not above {ta}"));
        c.check(
            regrant <= self.regrant_bound().as_secs_f64(),
            format!(
                "re-grant {} over the bound {:?}",
                fmt_s(regrant),
                self.regrant_bound()
            ),
        );
    }

    /// Waits (bounded) until the server holds nothing for `prefix` any more, then checks that a
    /// fresh client gets the lock at once: nothing left stuck.
    async fn settle(&self, prefix: &str, c: &mut Checks) {
        self.settle_on(&self.server, &self.url(prefix), prefix, c)
            .await
    }

    /// [`Ctx::settle`] on another instance (the failover cluster), for the lock at `url`.
    async fn settle_on(&self, server: &Server, url: &str, prefix: &str, c: &mut Checks) {
        let deadline = Instant::now() + self.ttl * 2 + self.kind.expiry_slack() + LOAD_TOLERANCE;
        let left = loop {
            match server.leftovers(prefix).await {
                Ok(0) => break Ok(0),
                Ok(n) if Instant::now() > deadline => break Ok(n),
                Err(e) if Instant::now() > deadline => break Err(e),
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        };
        match left {
            Ok(n) => {
                c.note(format!("left on the server afterwards: {n}"));
                c.check(n == 0, format!("{n} lock entries left on the server"));
            }
            Err(e) => c.check(false, format!("leftover count: {e}")),
        }
        let free = async {
            let locks = lockkit::connect(url).await?;
            let lease = locks
                .acquire("lock", AcquireOptions::new().ttl(self.ttl).wait(Wait::No))
                .await?;
            lease.release().await
        };
        match tokio::time::timeout(Duration::from_secs(20), free).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => c.check(false, format!("fresh try-acquire afterwards: {e}")),
            Err(_) => c.check(false, "fresh try-acquire afterwards: no answer in 20 s"),
        }
    }
}

/// A cell not run, and why.
fn not_applicable(why: &str) -> Cell {
    Cell {
        status: Status::NotApplicable,
        summary: why.to_owned(),
        details: vec![format!("not run: {why}")],
    }
}

fn token(e: &crate::harness::Event) -> u64 {
    e.u64("token")
}

/// Waits for a holder's grant; any other outcome is an error for the scenario.
async fn acquired(
    h: &mut Holder,
    who: &str,
    limit: Duration,
) -> Result<crate::harness::Event, String> {
    match h
        .wait(
            &["acquired", "acquire_error", "connect_error", "fence_error"],
            limit,
        )
        .await
    {
        Some(e) if e.ev() == "acquired" => Ok(e),
        Some(e) => Err(format!("{who}: {} {}", e.ev(), e.str("error"))),
        None => Err(format!("{who}: no grant within {limit:?}")),
    }
}

/// Spawns holder A and waits for its grant and its first fenced write (which must be accepted).
async fn first_holder(spec: &Spec, c: &mut Checks) -> Result<(Holder, u64), String> {
    let mut a = Holder::spawn(spec)?;
    let ta = token(&acquired(&mut a, "A", Duration::from_secs(30)).await?);
    let w = wrote(&mut a, "A").await?;
    c.check(w == "accepted", format!("A's first write: {w}"));
    Ok((a, ta))
}

/// Spawns holder B and waits until it is connected (its acquire then waits for the lock).
async fn waiter(spec: &Spec) -> Result<Holder, String> {
    let mut b = Holder::spawn(spec)?;
    b.wait(&["connected"], Duration::from_secs(30))
        .await
        .ok_or("B did not connect")?;
    Ok(b)
}

async fn wrote(h: &mut Holder, who: &str) -> Result<String, String> {
    h.wait(&["wrote"], Duration::from_secs(10))
        .await
        .map(|e| e.str("write").to_owned())
        .ok_or_else(|| format!("{who}: no fenced write reported"))
}

async fn released(h: &mut Holder) -> String {
    h.send("release").await;
    h.wait(&["released"], Duration::from_secs(15))
        .await
        .map_or("no answer".into(), |e| e.str("result").to_owned())
}

/// Sends `act` and returns (state seen first, its loss reason label, fence answer).
async fn act(h: &mut Holder, who: &str) -> Result<(String, String, String), String> {
    h.send("act").await;
    h.wait(&["act"], Duration::from_secs(15))
        .await
        .map(|e| {
            let (state, reason) = (e.str("state"), e.str("reason"));
            (
                state.to_owned(),
                reason.to_owned(),
                e.str("write").to_owned(),
            )
        })
        .ok_or_else(|| format!("{who}: did not act"))
}

/// A loss reason label, short, for the table: `deadline_expired` → `deadline`.
fn short_reason(label: &str) -> &str {
    match label {
        "deadline_expired" => "deadline",
        "not_held_on_server" => "not held on server",
        "session_expired" => "session expired",
        "stale_write" => "stale write",
        "" => "no reason",
        other => other,
    }
}

/// `state`, with the loss reason when it is `Lost`: `Lost (deadline)`.
fn with_reason(state: &str, reason: &str) -> String {
    if state == "Lost" {
        format!("Lost ({})", short_reason(reason))
    } else {
        state.to_owned()
    }
}

/// The loss signal's time after the fault and its reason: `1.97 s (deadline)`, or `never`.
fn lost_at(lost: Option<&crate::harness::Event>, t_fault: u64) -> String {
    lost.map_or("never".into(), |l| {
        format!(
            "{} ({})",
            fmt_s(secs(t_fault, l.t())),
            short_reason(l.str("reason"))
        )
    })
}

fn fmt_s(d: f64) -> String {
    format!("{d:.2} s")
}

/// Scenario 1: Holder SIGKILLed: time until another process holds the lock, larger token.
async fn holder_killed(ctx: &mut Ctx) -> Result<Cell, String> {
    let mut c = Checks::default();
    let prefix = ctx.prefix("s1");
    let spec = ctx.spec(&prefix);
    let (mut a, ta) = first_holder(&spec, &mut c).await?;
    let mut b = waiter(&spec).await?;
    let t_kill = now_ns();
    a.kill().await;
    let eb = acquired(&mut b, "B", ctx.regrant_bound() + Duration::from_secs(20)).await?;
    let regrant = secs(t_kill, eb.t());
    c.note(format!(
        "re-grant {} after SIGKILL (TTL {:?}, bound {:?}); tokens {ta} -> {}",
        fmt_s(regrant),
        ctx.ttl,
        ctx.regrant_bound(),
        token(&eb)
    ));
    ctx.check_regrant(&mut c, ta, token(&eb), regrant);
    let r = released(&mut b).await;
    c.check(r == "Ok", format!("B's release: {r}"));
    b.finish(Duration::from_secs(10)).await;
    ctx.settle(&prefix, &mut c).await;
    Ok(c.cell(format!(
        "re-grant {} (TTL {}), token ↑",
        fmt_s(regrant),
        humantime::format_duration(ctx.ttl)
    )))
}

/// Scenario 2: Holder SIGSTOPped past its TTL, then resumed.
async fn holder_paused(ctx: &mut Ctx) -> Result<Cell, String> {
    let mut c = Checks::default();
    let prefix = ctx.prefix("s2");
    let spec = ctx.spec(&prefix);
    let (mut a, ta) = first_holder(&spec, &mut c).await?;
    let mut b = waiter(&spec).await?;
    let t_stop = now_ns();
    a.signal("STOP");
    let eb = acquired(&mut b, "B", ctx.regrant_bound() + Duration::from_secs(20)).await;
    let eb = match eb {
        Ok(e) => e,
        Err(e) => {
            a.signal("CONT");
            return Err(e);
        }
    };
    let regrant = secs(t_stop, eb.t());
    let wb = wrote(&mut b, "B").await?;
    c.check(wb == "accepted", format!("B's write: {wb}"));
    // A stays stopped at least 1.5 TTL, and until B has written.
    let min_stop = ctx.ttl.mul_f64(1.5).as_secs_f64();
    let stopped = secs(t_stop, now_ns());
    if stopped < min_stop {
        tokio::time::sleep(Duration::from_secs_f64(min_stop - stopped)).await;
    }
    a.send("act").await; // waits in A's stdin: A's first action after SIGCONT
    let stopped = secs(t_stop, now_ns());
    a.signal("CONT");
    let (state, reason, write) = act(&mut a, "A").await?;
    a.drain();
    let shown = with_reason(&state, &reason);
    c.note(format!(
        "A stopped {}; B granted {} after the SIGSTOP (bound {:?}); tokens {ta} -> {}; \
         A on resume: state {shown}, fenced write {write}",
        fmt_s(stopped),
        fmt_s(regrant),
        ctx.regrant_bound(),
        token(&eb)
    ));
    ctx.check_regrant(&mut c, ta, token(&eb), regrant);
    c.check(state == "Lost", format!("A's lease on resume: {state}"));
    c.check(write == "rejected", format!("A's stale write: {write}"));
    let r = released(&mut a).await;
    c.note(format!("A's release after resuming: {r}"));
    c.check(r != "Ok", "A's release after losing the lease returned Ok");
    let r = released(&mut b).await;
    c.check(r == "Ok", format!("B's release: {r}"));
    a.finish(Duration::from_secs(10)).await;
    b.finish(Duration::from_secs(10)).await;
    ctx.settle(&prefix, &mut c).await;
    Ok(c.cell(format!(
        "re-grant {}; resumed A: {shown}, write {write}",
        fmt_s(regrant)
    )))
}

/// Scenario 3: Holder partitioned (traffic blackholed in the proxy, sockets open) past its TTL.
async fn holder_partitioned(ctx: &mut Ctx) -> Result<Cell, String> {
    let mut c = Checks::default();
    let prefix = ctx.prefix("s3");
    let spec = ctx.spec(&prefix);
    let mut spec_a = spec.clone();
    // A's own way to the server(s): one proxy, or one per Redlock node, all frozen at the cut.
    let proxies = match ctx.kind {
        Kind::Sentinel => {
            return Ok(not_applicable(
                "the holder learns the master's address from the sentinels, so a proxy in its URL \
                 cuts only the sentinels; cutting its own connections on a proxy in front of the \
                 master that every client uses is not built here (the master cut off from \
                 everyone is cell 5)",
            ));
        }
        Kind::Cluster => {
            return Ok(not_applicable(
                "the holder learns the nodes' addresses from the cluster (CLUSTER SLOTS), so a \
                 proxy in its URL cuts only the seeds; proxies the nodes announce, with only the \
                 holder's connections cut, are not built here (the slot's master cut off from \
                 everyone is cell 5)",
            ));
        }
        Kind::Redlock => {
            let ports = ctx
                .server
                .topo
                .as_ref()
                .map(|t| t.redlock_ports())
                .unwrap_or_default();
            let mut proxies = Vec::new();
            for p in ports {
                proxies.push(Proxy::start_local(p).await);
            }
            let hosts: Vec<String> = proxies.iter().map(|p| p.endpoint()).collect();
            spec_a.url = ctx.url_on(&format!("redlock://{}", hosts.join(",")), &prefix);
            proxies
        }
        _ => {
            let proxy = Proxy::start_local(ctx.server.port()).await;
            spec_a.url = ctx.url_on(&ctx.server.url_via(proxy.port), &prefix);
            vec![proxy]
        }
    };
    let (mut a, ta) = first_holder(&spec_a, &mut c).await?;
    let mut b = waiter(&spec).await?;
    let t_cut = now_ns();
    for p in &proxies {
        p.freeze();
    }
    let lost = a.wait(&["lost"], ctx.ttl + Duration::from_secs(5)).await;
    let eb = acquired(&mut b, "B", ctx.regrant_bound() + Duration::from_secs(20)).await?;
    let regrant = secs(t_cut, eb.t());
    let wb = wrote(&mut b, "B").await?;
    c.check(wb == "accepted", format!("B's write: {wb}"));
    let (state, reason, write) = act(&mut a, "A").await?;
    for p in &proxies {
        p.thaw();
    }
    let lost_after = lost.as_ref().map(|l| secs(t_cut, l.t()));
    c.note(format!(
        "A's loss signal {} after the cut (TTL {:?}); B granted {} after the cut; tokens {ta} -> {}; \
         A then: state {}, fenced write {write}",
        lost_at(lost.as_ref(), t_cut),
        ctx.ttl,
        fmt_s(regrant),
        token(&eb),
        with_reason(&state, &reason)
    ));
    match (&lost, lost_after) {
        (Some(l), Some(after)) => {
            // The deadline is the last acknowledged renewal's send time + TTL - margin, so at
            // most one TTL after the cut; 250 ms for the event to be printed on a loaded host.
            c.check(
                after <= ctx.ttl.as_secs_f64() + 0.25,
                format!(
                    "loss signal {} after the cut, TTL {:?}",
                    fmt_s(after),
                    ctx.ttl
                ),
            );
            c.check(
                l.t() < eb.t(),
                "B was granted the lock before A's loss signal fired",
            );
        }
        _ => c.check(false, "A's loss signal never fired while partitioned"),
    }
    ctx.check_regrant(&mut c, ta, token(&eb), regrant);
    c.check(state == "Lost", format!("A's lease: {state}"));
    c.check(write == "rejected", format!("A's stale write: {write}"));
    let r = released(&mut b).await;
    c.check(r == "Ok", format!("B's release: {r}"));
    let r = released(&mut a).await;
    c.note(format!("A's release after the thaw: {r}"));
    c.check(r != "Ok", "A's release after losing the lease returned Ok");
    a.finish(Duration::from_secs(10)).await;
    b.finish(Duration::from_secs(10)).await;
    drop(proxies);
    ctx.settle(&prefix, &mut c).await;
    Ok(c.cell(format!(
        "Lost {} after cut, before B's grant ({}); write {write}",
        lost_at(lost.as_ref(), t_cut),
        fmt_s(regrant)
    )))
}

/// After a server-side fault at `t_fault` (`cause`), A has two TTLs to renew or to learn that
/// its lease is gone. A surviving lease must stay exclusive (another process's try-acquire gets
/// `Held`), and A can still write through the fence and release it; a lost one must have been
/// reported by the loss signal. Returns the outcome for the table and whether A's lease survived.
async fn survived_or_lost(
    ctx: &Ctx,
    a: &mut Holder,
    spec: &Spec,
    t_fault: u64,
    cause: &str,
    c: &mut Checks,
) -> Result<(String, bool), String> {
    let lost = a.wait(&["lost"], ctx.ttl * 2).await;
    a.send("state").await;
    let state = a
        .wait(&["state"], Duration::from_secs(10))
        .await
        .map_or("no answer".into(), |e| e.str("state").to_owned());
    if state == "Held" {
        let mut probe_spec = spec.clone();
        probe_spec.wait = Duration::ZERO;
        let mut p = Holder::spawn(&probe_spec)?;
        let e = p
            .wait(
                &["acquired", "acquire_error", "connect_error"],
                Duration::from_secs(20),
            )
            .await;
        let probe = e.map_or("no answer".into(), |e| {
            if e.ev() == "acquired" {
                "acquired".into()
            } else {
                e.str("error").to_owned()
            }
        });
        c.check(
            probe == "Held",
            format!("try-acquire while A still Held: {probe}"),
        );
        p.finish(Duration::from_secs(10)).await;
        let (_, _, write) = act(a, "A").await?;
        c.check(
            write == "accepted",
            format!("A's write with its surviving lease: {write}"),
        );
        let r = released(a).await;
        c.check(
            r == "Ok",
            format!("A's release of its surviving lease: {r}"),
        );
        c.note(format!(
            "A's lease survived {cause} (Held {} later); another process's try-acquire: {probe}; \
             A's fenced write {write}; A's release: {r}",
            humantime::format_duration(ctx.ttl * 2)
        ));
        Ok(("lease survived".into(), true))
    } else {
        c.check(
            state == "Lost" && lost.is_some(),
            format!(
                "A's state after {cause}: {state} (loss signal: {})",
                lost.is_some()
            ),
        );
        let after = lost_at(lost.as_ref(), t_fault);
        c.note(format!("A's lease reported Lost {after} after {cause}"));
        Ok((format!("Lost {after} after {cause}"), false))
    }
}

/// After [`survived_or_lost`]: another process B gets the lock with a larger token than A's `ta`
/// and writes; a lost A's write is then rejected. Returns B's token.
async fn regrant_after(
    ctx: &Ctx,
    a: &mut Holder,
    spec: &Spec,
    ta: u64,
    survived: bool,
    c: &mut Checks,
) -> Result<u64, String> {
    let mut b = Holder::spawn(spec)?;
    let eb = acquired(&mut b, "B", ctx.regrant_bound() + Duration::from_secs(20)).await?;
    let tb = token(&eb);
    let wb = wrote(&mut b, "B").await?;
    c.check(wb == "accepted", format!("B's write: {wb}"));
    c.check(tb > ta, format!("token after {tb} not above {ta}"));
    if !survived {
        let (st, reason, write) = act(a, "A").await?;
        c.check(st == "Lost", format!("A's lease after B's grant: {st}"));
        c.check(write == "rejected", format!("A's stale write: {write}"));
        c.note(format!(
            "A after B's grant: state {}, fenced write {write}",
            with_reason(&st, &reason)
        ));
    }
    let r = released(&mut b).await;
    c.check(r == "Ok", format!("B's release: {r}"));
    a.finish(Duration::from_secs(10)).await;
    b.finish(Duration::from_secs(10)).await;
    Ok(tb)
}

#[derive(Clone, Copy, PartialEq)]
enum Restart {
    Kill,
    Clean,
}

/// Scenario 4 (and PostgreSQL's 6): Server SIGKILLed (or cleanly restarted) while a lease is held.
async fn server_restarted(ctx: &mut Ctx, how: Restart) -> Result<Cell, String> {
    let mut c = Checks::default();
    ctx.server.healthy().await?;
    let prefix = ctx.prefix(if how == Restart::Kill { "s4" } else { "s6" });
    let spec = ctx.spec(&prefix);
    let (mut a, ta) = first_holder(&spec, &mut c).await?;
    if ctx.kind == Kind::Redlock {
        // A grant needs a majority only: which nodes hold A's key decides what a minority's
        // SIGKILL does to it.
        let on = ctx.server.leftovers(&prefix).await.unwrap_or(0);
        c.note(format!("A's key on {on} of 5 nodes before the SIGKILL"));
    }
    let t_kill = now_ns();
    match how {
        Restart::Kill => {
            let what = ctx.server.kill_and_restart().await?;
            if !what.is_empty() {
                c.note(what);
            }
        }
        Restart::Clean => ctx.server.clean_restart().await?,
    }
    let down = secs(t_kill, now_ns());
    let cause = match how {
        Restart::Kill => "the SIGKILL",
        Restart::Clean => "the restart began",
    };
    let (outcome, survived) = survived_or_lost(ctx, &mut a, &spec, t_kill, cause, &mut c).await?;
    let tb = regrant_after(ctx, &mut a, &spec, ta, survived, &mut c).await?;
    c.note(format!(
        "server down and back{} in {}; tokens {ta} -> {tb} (after)",
        if ctx.server.topo.is_some() {
            " (and healthy again)"
        } else {
            ""
        },
        fmt_s(down)
    ));
    ctx.settle(&prefix, &mut c).await;
    Ok(c.cell(format!("{outcome}; token after > before")))
}

/// Scenario 5: Server SIGSTOPped past the TTL, then resumed.
async fn server_paused(ctx: &mut Ctx) -> Result<Cell, String> {
    let mut c = Checks::default();
    ctx.server.healthy().await?;
    let prefix = ctx.prefix("s5");
    let spec = ctx.spec(&prefix);
    let (mut a, ta) = first_holder(&spec, &mut c).await?;
    let t_stop = now_ns();
    let what = ctx.server.stop()?;
    // Redlock, a majority stopped: a try-acquire meanwhile must fail as Unavailable (the
    // freeze lasts until it has answered).
    let mut probe = if ctx.kind == Kind::Redlock {
        let mut probe_spec = spec.clone();
        probe_spec.wait = Duration::ZERO;
        Some(Holder::spawn(&probe_spec)?)
    } else {
        None
    };
    let lost = a.wait(&["lost"], ctx.ttl + Duration::from_secs(5)).await;
    let min_stop = ctx.ttl.mul_f64(1.5).as_secs_f64();
    let stopped = secs(t_stop, now_ns());
    if stopped < min_stop {
        tokio::time::sleep(Duration::from_secs_f64(min_stop - stopped)).await;
    }
    let mut probe_said = String::new();
    if let Some(p) = &mut probe {
        let e = p
            .wait(
                &["acquired", "acquire_error", "connect_error"],
                Duration::from_secs(20),
            )
            .await;
        probe_said = e.map_or("no answer in 20 s".into(), |e| {
            if e.ev() == "acquired" {
                "acquired".into()
            } else {
                format!("{} {}", e.ev(), e.str("error"))
            }
        });
        c.check(
            probe_said.ends_with("Unavailable"),
            format!("try-acquire with a majority stopped: {probe_said}"),
        );
    }
    let stopped = secs(t_stop, now_ns());
    let after = ctx.server.cont();
    let t_cont = now_ns();
    if let Some(mut p) = probe {
        p.finish(Duration::from_secs(10)).await;
    }
    if ctx.server.topo.is_some() {
        c.note(format!(
            "stopped: {what}; after SIGCONT: {after}{}",
            if probe_said.is_empty() {
                String::new()
            } else {
                format!("; a try-acquire while stopped: {probe_said}")
            }
        ));
    }
    let lost_after = lost.as_ref().map(|l| secs(t_stop, l.t()));
    c.check(
        lost_after.is_some_and(|s| s <= ctx.ttl.as_secs_f64() + 0.25),
        format!(
            "A's loss signal {} after the server froze (TTL {:?})",
            lost_after.map_or("never".into(), fmt_s),
            ctx.ttl
        ),
    );
    let mut b = Holder::spawn(&spec)?;
    let eb = acquired(&mut b, "B", ctx.regrant_bound() + Duration::from_secs(20)).await?;
    let regrant = secs(t_cont, eb.t());
    let wb = wrote(&mut b, "B").await?;
    let (state, reason, write) = act(&mut a, "A").await?;
    c.note(format!(
        "server stopped {}; A's loss signal {} after the SIGSTOP; B (started after SIGCONT) granted {} \
         after it; tokens {ta} -> {}; B's write {wb}; A then: state {}, write {write}",
        fmt_s(stopped),
        lost_at(lost.as_ref(), t_stop),
        fmt_s(regrant),
        token(&eb),
        with_reason(&state, &reason)
    ));
    c.check(
        token(&eb) > ta,
        format!("token {} not above {ta}", token(&eb)),
    );
    c.check(wb == "accepted", format!("B's write: {wb}"));
    c.check(state == "Lost", format!("A's lease: {state}"));
    c.check(write == "rejected", format!("A's stale write: {write}"));
    let r = released(&mut b).await;
    c.check(r == "Ok", format!("B's release: {r}"));
    a.finish(Duration::from_secs(10)).await;
    b.finish(Duration::from_secs(10)).await;
    ctx.settle(&prefix, &mut c).await;
    let majority = if probe_said.ends_with("Unavailable") {
        "; try-acquire meanwhile Unavailable"
    } else {
        ""
    };
    Ok(c.cell(format!(
        "Lost {} after freeze{majority}; after resume B granted in {}, A's write {write}",
        lost_at(lost.as_ref(), t_stop),
        fmt_s(regrant)
    )))
}

/// Scenario 6: Failover, where the backend has one in this matrix.
async fn failover(ctx: &mut Ctx) -> Result<Cell, String> {
    match ctx.kind {
        Kind::Redis => Ok(Cell {
            status: Status::Declared,
            summary:
                "single Redis has no failover (with a replica promoted, a failover can grant twice)"
                    .into(),
            details: vec![
                "not run: a single node has nothing to fail over to (README guarantee table: \
                           'safe across failover: no')"
                    .into(),
            ],
        }),
        Kind::Postgres => {
            let mut cell = server_restarted(ctx, Restart::Clean).await?;
            cell.details.insert(
                0,
                "PostgreSQL's failover case here is a server restart (pg_ctl stop -m fast, then start): \
                 advisory locks are not replicated, so a promoted standby holds none (declared)"
                    .into(),
            );
            if cell.status == Status::Pass {
                cell.status = Status::Declared;
                cell.summary = format!(
                    "restart: {} (standby promotion not covered: advisory locks are not replicated)",
                    cell.summary
                );
            }
            Ok(cell)
        }
        Kind::Etcd | Kind::Zk => leader_killed(ctx).await,
        Kind::Redlock => Ok(not_applicable(
            "Redlock has no replicas to fail over to: its nodes are independent masters (a \
             minority SIGKILLed is cell 4, a majority stopped cell 5)",
        )),
        Kind::Sentinel | Kind::Cluster => coordinated_failover(ctx).await,
    }
}

/// Scenario 6 for Sentinel and Cluster: a coordinated failover while A holds (`SENTINEL
/// FAILOVER`; `CLUSTER FAILOVER` on the replica of the slot's master); checked as 4.
async fn coordinated_failover(ctx: &mut Ctx) -> Result<Cell, String> {
    let mut c = Checks::default();
    ctx.server.healthy().await?;
    let prefix = ctx.prefix("s6");
    let spec = ctx.spec(&prefix);
    let (mut a, ta) = first_holder(&spec, &mut c).await?;
    let t_fail = now_ns();
    let how = match ctx.server.topo.as_mut() {
        Some(t) => t.failover().await,
        None => None,
    }
    .ok_or("no failover in this mode")??;
    c.note(how.clone());
    let (outcome, survived) =
        survived_or_lost(ctx, &mut a, &spec, t_fail, "the failover", &mut c).await?;
    let tb = regrant_after(ctx, &mut a, &spec, ta, survived, &mut c).await?;
    c.note(format!("tokens {ta} -> {tb} (after)"));
    ctx.settle(&prefix, &mut c).await;
    let how = how.split(':').next().unwrap_or_default().to_owned();
    Ok(c.cell(format!("{how}: {outcome}; token after > before")))
}

/// Polls the members (every 100 ms, at most `limit`) until one leads.
async fn wait_leader(cluster: &Server, limit: Duration) -> Option<usize> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(l) = cluster.leader().await {
            return Some(l);
        }
        if Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Scenario 6 for etcd and ZooKeeper: on a 3-member cluster / ensemble of its own, the leader is
/// SIGKILLed while a lease is held (the holder connected to every member).
async fn leader_killed(ctx: &mut Ctx) -> Result<Cell, String> {
    let mut c = Checks::default();
    let t = Instant::now();
    let mut cluster = Server::start_n(ctx.kind, 3).await?;
    let leader = wait_leader(&cluster, Duration::from_secs(30))
        .await
        .ok_or("no leader in 30 s")?;
    c.note(format!(
        "3 members up with a leader in {}",
        fmt_s(t.elapsed().as_secs_f64())
    ));
    let prefix = ctx.prefix("s6");
    let url = format!("{}?prefix={prefix}", cluster.url());
    let mut spec = ctx.spec(&prefix);
    spec.url = url.clone();
    let (mut a, ta) = first_holder(&spec, &mut c).await?;
    let t_kill = now_ns();
    cluster.kill_member(leader);
    let new_leader = wait_leader(&cluster, Duration::from_secs(30)).await;
    let elected = secs(t_kill, now_ns());
    c.check(new_leader.is_some(), "no new leader within 30 s");
    c.note(format!(
        "leader (member {leader}) SIGKILLed; new leader {} after {}",
        new_leader.map_or("none".into(), |l| format!("member {l}")),
        fmt_s(elected)
    ));
    let (outcome, survived) =
        survived_or_lost(ctx, &mut a, &spec, t_kill, "the leader's SIGKILL", &mut c).await?;
    let tb = regrant_after(ctx, &mut a, &spec, ta, survived, &mut c).await?;
    c.note(format!("tokens {ta} -> {tb} (after)"));
    cluster.restart_member(leader)?;
    ctx.settle_on(&cluster, &url, &prefix, &mut c).await;
    Ok(c.cell(format!(
        "leader SIGKILL, new leader in {}: {outcome}; token after > before",
        fmt_s(elected)
    )))
}

/// Scenario 7: Stress: N holder processes × R rounds of acquire → fenced read-increment-write → release,
/// with SIGSTOPs of 1.5–3× the TTL (random length, a random holder among those holding the lock
/// at that moment) and one server SIGKILL + restart.
async fn stress(ctx: &mut Ctx) -> Result<Cell, String> {
    let mut c = Checks::default();
    let prefix = ctx.prefix("s7");
    let mut spec = ctx.spec(&prefix);
    spec.stress_rounds = Some(ctx.rounds);
    spec.native = true;
    ctx.server
        .prepare_native(&crate::holder::native_key(&spec.key))?;
    spec.limit = Duration::from_secs(300);
    let started = Instant::now();
    let mut holders = Vec::new();
    for _ in 0..ctx.holders {
        holders.push(Holder::spawn(&spec)?);
    }
    let total = u64::from(ctx.holders) * u64::from(ctx.rounds);
    let progress = |f: &Fence| {
        let cell = f.cell(&spec.key);
        cell.accepted.len() as u64 + cell.rejected
    };
    // The chaos plan, by progress (fenced operations over all rounds): SIGSTOP a random
    // holder at 10 %, 60 % and 80 %, SIGKILL + restart the server at 35 %.
    let plan = [(10, "stop"), (35, "server"), (60, "stop"), (80, "stop")];
    let deadline = started + spec.limit;
    let mut stops = Vec::new();
    let mut faults = Vec::new();
    // The server's SIGKILL and its being back (CLOCK_REALTIME ns).
    let mut restart = (0u64, 0u64);
    for (pct, what) in plan {
        let mut all_exited = false;
        while progress(&ctx.fence) * 100 < total * pct && Instant::now() < deadline {
            all_exited = holders.iter_mut().all(|h| {
                h.drain();
                h.log.iter().any(|e| FINAL_EVENTS.contains(&e.ev()))
            });
            if all_exited {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if all_exited || Instant::now() >= deadline {
            break;
        }
        if what == "stop" {
            // A random one of the holders that hold the lock now (their last event is a
            // grant), so the pause lands inside a critical section; looked for during at most
            // one second, then any holder.
            let look = Instant::now() + Duration::from_secs(1);
            let (i, in_lock) = loop {
                let holding: Vec<usize> = holders
                    .iter_mut()
                    .enumerate()
                    .filter_map(|(i, h)| {
                        h.drain();
                        (h.log.last().map(|e| e.ev()) == Some("acquired")).then_some(i)
                    })
                    .collect();
                if !holding.is_empty() {
                    break (holding[rand::random_range(0..holding.len())], true);
                }
                if Instant::now() > look {
                    break (rand::random_range(0..holders.len()), false);
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            };
            let pid = holders[i].pid;
            let d = ctx.ttl.mul_f64(rand::random_range(1.5..3.0));
            faults.push(format!(
                "SIGSTOP holder {i} ({}) for {} at {pct} %",
                if in_lock {
                    "holding the lock"
                } else {
                    "not holding"
                },
                fmt_s(d.as_secs_f64())
            ));
            stops.push(tokio::spawn(async move {
                signal(pid, "STOP");
                tokio::time::sleep(d).await;
                signal(pid, "CONT");
            }));
        } else {
            // A topology first gets ready to fail over (no-op for one server).
            ctx.server.healthy().await?;
            let t = Instant::now();
            restart.0 = now_ns();
            let what = ctx.server.kill_and_restart().await?;
            restart.1 = now_ns();
            faults.push(format!(
                "server SIGKILL + restart at {pct} % (back in {}{})",
                fmt_s(t.elapsed().as_secs_f64()),
                if what.is_empty() {
                    String::new()
                } else {
                    format!(": {what}")
                }
            ));
        }
    }
    for s in stops {
        let _ = s.await;
    }
    let mut rounds = 0u64;
    let mut accepted_by_holders = 0u64;
    let (mut native_accepted, mut native_rejected, mut native_errors) = (0u64, 0u64, 0u64);
    let mut native_foreign = 0u64;
    // Redis runs without persistence: its restart forgets the counter (and its guard record).
    // Increments answered before the SIGKILL are forgotten, those answered while it was down
    // or restarting may have landed on either server.
    let forgets = ctx.kind == Kind::Redis;
    // Sentinel and Cluster fail over to the replica at the "restart": increments it had not
    // received yet are gone, the others kept, so those answered before count as unknown.
    let fails_over = matches!(ctx.kind, Kind::Sentinel | Kind::Cluster);
    let (mut native_forgotten, mut native_unsure) = (0u64, 0u64);
    let mut rejected_by_holders = 0u64;
    for (i, h) in holders.iter_mut().enumerate() {
        let left = deadline.saturating_duration_since(Instant::now());
        let done = h
            .wait(&["done", "limit", "fence_error", "connect_error"], left)
            .await;
        match done {
            Some(e) if e.ev() == "done" => {}
            Some(e) => c.check(false, format!("holder {i}: {} {}", e.ev(), e.str("error"))),
            None => c.check(false, format!("holder {i} did not finish in time")),
        }
        h.finish(Duration::from_secs(10)).await;
        for e in h.log.iter().filter(|e| e.ev() == "round") {
            rounds += 1;
            match e.str("write") {
                "accepted" => accepted_by_holders += 1,
                _ => rejected_by_holders += 1,
            }
            let native_t = e.u64("native_t");
            match e.str("native") {
                "accepted" if forgets && native_t < restart.0 => native_forgotten += 1,
                "accepted" if (forgets || fails_over) && native_t <= restart.1 => {
                    native_unsure += 1
                }
                "accepted" => native_accepted += 1,
                "rejected" => native_rejected += 1,
                "foreign" => native_foreign += 1,
                "none" => {}
                _ => native_errors += 1,
            }
        }
    }
    let took = started.elapsed().as_secs_f64();
    let cell = ctx.fence.cell(&spec.key);
    let accepted = cell.accepted.len() as u64;
    // Accepted writes whose token is not above every earlier accepted one: a second grant
    // with the same token (the fence itself refuses lower tokens).
    let not_increasing = cell.accepted.windows(2).filter(|w| w[1] <= w[0]).count();
    c.note(format!(
        "{} holders × {} rounds: {rounds} rounds in {}; faults: {}",
        ctx.holders,
        ctx.rounds,
        fmt_s(took),
        faults.join(", ")
    ));
    c.note(format!(
        "fence: final value {}, accepted writes {accepted} (holders saw {accepted_by_holders}), \
         stale reads/writes rejected {}, accepted tokens not strictly increasing: {not_increasing}",
        cell.value, cell.rejected
    ));
    c.check(rounds == total, format!("{rounds} of {total} rounds done"));
    c.check(
        cell.value == accepted,
        format!(
            "final value {} != accepted writes {accepted} (lost update)",
            cell.value
        ),
    );
    c.check(
        accepted == accepted_by_holders,
        format!("fence accepted {accepted}, holders saw {accepted_by_holders}"),
    );
    c.check(
        not_increasing == 0,
        format!("{not_increasing} accepted writes with a token not above the previous"),
    );
    c.check(
        faults.len() == plan.len(),
        "not every planned fault was applied",
    );
    // Increments that may or may not have been applied (or kept).
    let native_unknown = native_errors + native_unsure;
    let key = crate::holder::native_key(&spec.key);
    let counter = match ctx.server.native_counter(&key).await {
        _ if ctx.kind == Kind::Redlock => {
            c.note(
                "no backend fence counter: lockkit has no fence for Redlock (RedisFence needs a \
                 lease of one Redis server, Sentinel or Cluster); the harness's fence alone",
            );
            None
        }
        Ok(v) => Some(v),
        Err(e) => {
            c.check(false, format!("backend counter: {e}"));
            None
        }
    };
    if let Some(v) = counter {
        c.note(format!(
            "backend's own fence ({}): counter {v}, increments accepted {native_accepted}, \
             rejected as stale {native_rejected}, rejected as foreign {native_foreign}, \
             failed (server down) {native_errors}{}",
            match ctx.kind {
                Kind::Etcd => "EtcdFence: plain get + fenced put",
                Kind::Zk => "ZkFence: read + fenced write",
                Kind::Redis | Kind::Sentinel | Kind::Cluster | Kind::Redlock => {
                    "RedisFence: get + fenced set"
                }
                Kind::Postgres => "PgFence: SELECT … FOR UPDATE + fenced UPDATE, one transaction",
            },
            if fails_over {
                format!(
                    "; the failover may have dropped increments the replica had not received: \
                     the {native_unsure} accepted before the promotion count as unknown (only \
                     increments after it are in 'accepted')"
                )
            } else if forgets {
                format!(
                    "; the server restart (no persistence) forgot the {native_forgotten} \
                     increments accepted before it; {native_unsure} accepted while it restarted \
                     count as unknown (only increments after it are in 'accepted')"
                )
            } else {
                String::new()
            }
        ));
        c.check(
            native_foreign == 0,
            format!("{native_foreign} increments rejected as another lock's"),
        );
        // A failed call (server restarting) may or may not have been applied. Every applied
        // write stores one more than a value some earlier write stored: never above.
        c.check(
            v <= native_accepted + native_unknown,
            format!(
                "backend counter {v} above accepted {native_accepted} + unknown {native_unknown}"
            ),
        );
        if v < native_accepted && (forgets || fails_over) {
            // RedisFence compares tokens when writing, not when reading: a holder whose lease
            // lapsed between its get and its set may write before the next holder's first
            // write, and that holder's increment then overwrites it (documented on RedisFence).
            c.declare(format!(
                "RedisFence counter {v} below accepted {native_accepted}: a lapsed holder's \
                 write landed between the next holder's get and set"
            ));
        } else {
            c.check(
                v >= native_accepted,
                format!("backend counter {v} below accepted {native_accepted} (lost update)"),
            );
        }
    }
    ctx.settle(&prefix, &mut c).await;
    let _ = rejected_by_holders;
    let own = match counter {
        Some(v) => format!(
            "; own fence: counter {v} {}{}, {native_rejected} stale rejected",
            match v.cmp(&native_accepted) {
                std::cmp::Ordering::Equal => format!("= {native_accepted} increments"),
                std::cmp::Ordering::Greater => {
                    format!("within {native_accepted} increments + {native_unknown} unknown")
                }
                std::cmp::Ordering::Less => format!("< {native_accepted} increments"),
            },
            if forgets {
                " since the restart"
            } else if fails_over {
                " since the failover"
            } else {
                ""
            }
        ),
        None => String::new(),
    };
    Ok(c.cell(format!(
        "{rounds} rounds in {}: value {} {} accepted {accepted}; stale rejected {}, accepted {not_increasing}{own}",
        fmt_s(took),
        cell.value,
        if cell.value == accepted { "=" } else { "≠" },
        cell.rejected,
    )))
}

/// What each column does and checks, for the Markdown page.
const METHOD: &str = "\
## What each column does

Every backend runs on a private server of its own (SIGKILLed, SIGSTOPped and restarted on the \
same port and data dir); A, B are holder processes (`examples/faults`, `holder` mode) reporting \
JSON events stamped with CLOCK_REALTIME; times are from the fault to the event. The Redis modes \
of several processes run on private topologies with the settings `scripts/servers.sh` gives \
them: Sentinel (a master, a replica, three sentinels, quorum 2, `down-after-milliseconds 1000`, \
`failover-timeout 2000`), Cluster (three masters with a replica each, `cluster-node-timeout \
2000`), Redlock (five independent nodes, `max_ttl` = the TTL), all without persistence. \
\"n/a\" marks a scenario that does not apply to a mode: not run, and the cell says why.

1. A holds the lock, B waits; A is SIGKILLed. Re-grant = B's grant − the kill; B's token must be \
   larger; bound TTL + the backend's declared expiry slack + 1.5 s for the loaded host.
2. A holds and has written, B waits; A is SIGSTOPped until B holds and wrote (≥ 1.5 TTL), then \
   resumed: A's first action sees its lease Lost, and its fenced write is rejected.
3. As 2, but A's traffic is blackholed in a TCP proxy (sockets stay open): A's loss signal must \
   fire within one TTL of the cut, before B's grant. Redlock: one proxy per node, all frozen. \
   Sentinel, Cluster: n/a (the holder learns the master's address from the sentinels or the \
   cluster, so a proxy in its URL cuts only those; cutting only its connections on a proxy every \
   client goes through is not built here).
4. A holds; the server is SIGKILLed and restarted. Within 2 TTLs A's lease is either still Held \
   (then another process's try-acquire gets Held, A writes and releases) or reported Lost; then B \
   gets a larger token and a Lost A's write is rejected. Sentinel: the master is SIGKILLed; once \
   the sentinels have promoted the replica, the old master comes back (empty) as its replica. \
   Cluster: the master owning the lock name's slot is SIGKILLed; once its replica is promoted, it \
   comes back and rejoins as a replica. Redlock: two of the five nodes (a minority) are SIGKILLed \
   and restarted empty, and vote again one `max_ttl` later (delayed restart); the lock keeps \
   working, and A's lease survives only if its key is on a majority of the others (a grant needs \
   a majority, not every node: the figures say on how many nodes it was).
5. A holds; the server is SIGSTOPped 1.5 TTL: A's loss signal within one TTL; after SIGCONT a new \
   process gets a larger token and A's write is rejected. Sentinel: the master is stopped, \
   Cluster: the slot's master (either may be failed over meanwhile; the figures say). Redlock: \
   three of five nodes (a majority), and a try-acquire meanwhile must fail as `Unavailable`.
6. etcd, ZooKeeper: a 3-member cluster / ensemble of its own; the leader is SIGKILLed while A \
   holds; checked as 4. PostgreSQL: a clean restart (`pg_ctl stop -m fast`), checked as 4. \
   Redis (single): nothing to fail over to. Sentinel: `SENTINEL FAILOVER`; Cluster: `CLUSTER \
   FAILOVER` on the replica of the slot's master; checked as 4. Redlock: n/a (no replicas).
7. 8 holders × 250 rounds of acquire → fenced read → 5 ms → fenced write of value + 1 → release; \
   three SIGSTOPs of 1.5–3 TTL, each of a holder that holds the lock at that moment, and one server \
   SIGKILL + restart. Final value = accepted writes; stale writes accepted (an accepted \
   token not above the one accepted before it) = 0; every round done. Each round then also \
   increments a second counter at the backend's own fence under the round's lease (EtcdFence, \
   ZkFence, RedisFence made with `from_lease`: plain get + fenced put, read + fenced write, get + \
   fenced set; PgFence: `SELECT … FOR UPDATE` + `update_as` in one transaction): it must equal \
   its accepted increments (an increment whose call failed while the server was down may or may \
   not count), and no increment may be refused as another lock's. Redis runs without persistence, \
   so its restart forgets the counter: only increments answered after the restart count. \
   RedisFence compares tokens when writing, not reading: should a lapsed holder's set land between \
   the next holder's get and set, the counter falls short, which is a declared limit. In the \
   Sentinel, Cluster and Redlock rows the server fault is cell 4's; Sentinel and Cluster fail \
   over to a replica that may lack the last increments (asynchronous replication), so those \
   answered before the promotion count as unknown; Redlock has no backend fence in lockkit, so \
   its cell checks the harness's fence only.

The harness's own fence service stores a token's number only (`FencingToken::get`) and compares \
numbers within one lock only: each of its keys is written under one lock, so that is all it \
needs; a resource shared by several locks needs the lock too (as the backends' fences keep).

After every cell: nothing of the cell's locks left on the server (Redis lock keys: on the \
masters for Sentinel and Cluster, on every node for Redlock; etcd keys under the prefix, ZooKeeper ephemerals, PostgreSQL advisory locks), and a fresh try-acquire \
succeeds.
";

/// A stress holder's last event.
const FINAL_EVENTS: [&str; 4] = ["done", "limit", "fence_error", "connect_error"];

fn failed(e: String) -> Cell {
    Cell {
        status: Status::Fail,
        summary: format!("FAILED: {e}"),
        details: vec![format!("FAILED: {e}")],
    }
}

async fn run_backend(kind: Kind, fence: Arc<Fence>, args: &RunArgs) -> Vec<Cell> {
    let t = Instant::now();
    let server = match Server::start(kind).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("faults: {kind:?} server did not start: {e}");
            return vec![failed(format!("server did not start: {e}")); SCENARIOS.len()];
        }
    };
    eprintln!(
        "faults: {kind:?} server up in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let mut ctx = Ctx {
        kind,
        server,
        fence,
        ttl: args.ttl,
        holders: args.holders,
        rounds: args.rounds,
    };
    let mut cells = Vec::new();
    for (i, name) in SCENARIOS.iter().enumerate() {
        let t = Instant::now();
        let r = match i {
            0 => holder_killed(&mut ctx).await,
            1 => holder_paused(&mut ctx).await,
            2 => holder_partitioned(&mut ctx).await,
            3 => server_restarted(&mut ctx, Restart::Kill).await,
            4 => server_paused(&mut ctx).await,
            5 => failover(&mut ctx).await,
            _ => stress(&mut ctx).await,
        };
        let cell = r.unwrap_or_else(failed);
        eprintln!(
            "faults: {kind:?} {name}: {:?} in {:.1} s: {}",
            cell.status,
            t.elapsed().as_secs_f64(),
            cell.summary
        );
        cells.push(cell);
    }
    cells
}

fn mark(s: Status) -> &'static str {
    match s {
        Status::Pass => "✅",
        Status::Fail => "❌",
        Status::Declared => "⚠️ declared limit:",
        Status::NotApplicable => "n/a:",
    }
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

pub async fn run(args: RunArgs) -> i32 {
    let started = Instant::now();
    let date = humantime::format_rfc3339_seconds(std::time::SystemTime::now());
    let load_before = loadavg();
    let mut kinds = Vec::new();
    for b in &args.backends {
        match Kind::parse(b) {
            Some(k) => kinds.push(k),
            None => {
                eprintln!(
                    "faults: unknown backend {b:?} (redis, redis-sentinel, redis-cluster, \
                     redlock, etcd, zk, postgres)"
                );
                return 64;
            }
        }
    }
    let fence = match Fence::start().await {
        Ok(f) => Arc::new(f),
        Err(e) => {
            eprintln!("faults: fence: {e}");
            return 1;
        }
    };
    let args = Arc::new(args);
    let jobs = Arc::new(Semaphore::new(args.jobs.max(1)));
    let mut tasks = Vec::new();
    for &k in &kinds {
        let (fence, args, jobs) = (fence.clone(), args.clone(), jobs.clone());
        tasks.push(tokio::spawn(async move {
            let _permit = jobs.acquire_owned().await;
            run_backend(k, fence, &args).await
        }));
    }
    let mut rows = Vec::new();
    for (k, t) in kinds.iter().zip(tasks) {
        let cells = t
            .await
            .unwrap_or_else(|e| vec![failed(format!("harness task: {e}")); SCENARIOS.len()]);
        rows.push((*k, cells));
    }
    let took = started.elapsed().as_secs_f64();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());

    let mut md = String::new();
    let _ = writeln!(md, "# Fault matrix\n");
    let _ = writeln!(
        md,
        "Produced by `scripts/faults.sh` on {date} in {:.0} s ({cpus} cores; load average {load_before} \
         at the start, {} at the end). TTL {}; holders are separate processes; the fenced resource is \
         the harness's own fence service (highest token number per key, one lock per key; stale \
         reads and writes refused), and in the stress cell also a counter at the backend's own fence \
         (EtcdFence, ZkFence, RedisFence, PgFence, each used under the round's lease). A Lost lease shows \
         why (`Lease::loss_reason`): (deadline) its deadline passed without an acknowledged \
         renewal, (not held on server) a renewal found the server no longer holds it, (session \
         expired) its backend session ended, (stale write) a fenced write was rejected.\n",
        took,
        loadavg(),
        humantime::format_duration(args.ttl)
    );
    let _ = write!(md, "| backend |");
    for s in SCENARIOS {
        let _ = write!(md, " {s} |");
    }
    let _ = write!(md, "\n|---|");
    for _ in SCENARIOS {
        let _ = write!(md, "---|");
    }
    md.push('\n');
    for (k, cells) in &rows {
        let _ = write!(md, "| {} |", k.label());
        for c in cells {
            let _ = write!(md, " {} {} |", mark(c.status), c.summary.replace('|', "/"));
        }
        md.push('\n');
    }
    let _ = writeln!(
        md,
        "\n✅ pass · ❌ fail · ⚠️ a limit the guarantee table declares · n/a: the scenario does not \
         apply to the mode (not run; the cell says why)\n\n{METHOD}\n## Figures\n"
    );
    for (k, cells) in &rows {
        let _ = writeln!(md, "### {}\n", k.label());
        for (s, c) in SCENARIOS.iter().zip(cells) {
            let _ = writeln!(md, "- **{s}** ({:?}): {}", c.status, c.details.join("; "));
        }
        md.push('\n');
    }
    println!("{md}");
    if let Some(out) = &args.out
        && let Err(e) = std::fs::write(out, &md)
    {
        eprintln!("faults: write {}: {e}", out.display());
        return 1;
    }
    let any_failed = rows
        .iter()
        .any(|(_, cells)| cells.iter().any(|c| c.status == Status::Fail));
    if any_failed { 1 } else { 0 }
}
