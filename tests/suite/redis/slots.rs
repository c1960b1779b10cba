//! Elections and semaphores on Redis: the contract suite (`election_suite!`) against the shared
//! server, and what only Redis shows: an admin's `DEL` of a leader's key, batched renewal of
//! many permits, and the cost of a hand-over (private servers, where the command counters are
//! ours alone).

use std::time::Duration;

use lockkit::backend::SlotKind;
use lockkit::redis::redis;
use lockkit::redis::{LOSS_NOTICE, MAX_WAIT_POLL, RedisLock};
use lockkit::{
    AcquireOptions, Election, LeaderEvent, LeaseState, LossReason, Semaphore, Wait, async_trait,
};
use tokio::time::Instant;

use super::{
    PrivateRedis, exists, kill_pubsub_connections, plant_ghost_waiter, subscriber_to_every_channel,
};
use crate::common::{ConnectUrl, SlotClients, fresh_prefix, with_prefix};

/// The slot harness: a new `RedisLock` (its own connections) per client, all under one fresh
/// prefix.
pub type RedisSlotHarness = SlotClients<RedisLock>;

#[async_trait]
impl ConnectUrl for RedisLock {
    async fn connect_url(url: &str) -> lockkit::Result<Self> {
        RedisLock::connect(url).await
    }
}

mod contract {
    lockkit::election_suite!(super::RedisSlotHarness::from_env("LOCKKIT_REDIS_URL"));
}

/// A client of `server` under `prefix`.
async fn client(server: &PrivateRedis, prefix: &str) -> RedisLock {
    RedisLock::connect(&with_prefix(&server.url(), prefix))
        .await
        .expect("connect")
}

/// Waits (bounded, polling the server) until `n` waiters queue in `queue`.
async fn await_queued(conn: &mut redis::aio::MultiplexedConnection, queue: &str, n: i64) {
    let start = Instant::now();
    loop {
        let queued: i64 = redis::cmd("ZCARD")
            .arg(queue)
            .query_async(conn)
            .await
            .expect("ZCARD");
        if queued == n {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{queued} waiters queued in {queue}, want {n}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The client round trips (script calls, `EVAL` and `EVALSHA`) the server counted since the last
/// `CONFIG RESETSTAT`, and all commands but `INFO`/`CONFIG`/`PING`/`SUBSCRIBE` (commands inside
/// scripts count here too).
async fn script_calls(conn: &mut redis::aio::MultiplexedConnection) -> (u64, u64) {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .expect("INFO commandstats");
    let (mut scripts, mut all) = (0, 0);
    for line in info.lines() {
        let Some((cmd, stats)) = line
            .strip_prefix("cmdstat_")
            .and_then(|l| l.split_once(':'))
        else {
            continue;
        };
        let calls: u64 = stats
            .split(',')
            .find_map(|kv| kv.strip_prefix("calls="))
            .and_then(|c| c.parse().ok())
            .expect("calls=");
        if cmd.starts_with("eval") {
            scripts += calls;
        }
        if !["info", "config", "ping", "subscribe", "psubscribe"].contains(&cmd)
            && !cmd.starts_with("config|")
        {
            all += calls;
        }
    }
    (scripts, all)
}

async fn reset_stats(conn: &mut redis::aio::MultiplexedConnection) {
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async::<()>(conn)
        .await
        .expect("CONFIG RESETSTAT");
}

/// An administrator's `DEL` of the leader's key: the leader hears of it through the keyspace
/// notifications within [`LOSS_NOTICE`] (not at its next renewal, 20 s away), the candidate in
/// line takes over with a higher term (at its next look, within [`MAX_WAIT_POLL`]), and an
/// observer sees the new term.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_del_of_the_leader_key_ends_the_leadership() {
    let server = PrivateRedis::start(None).await;
    let prefix = fresh_prefix();
    let (a, b, watcher) = (
        client(&server, &prefix).await,
        client(&server, &prefix).await,
        client(&server, &prefix).await,
    );
    assert_eq!(a.loss_notice(), Some(LOSS_NOTICE));
    let name = format!("deleted-{:08x}", rand::random::<u32>());
    let long = AcquireOptions::new().ttl(Duration::from_secs(60));
    let leader = a
        .campaign(&name, b"a", long.clone().wait(Wait::No))
        .await
        .expect("campaign");
    let mut observer = watcher.observe(&name).await.expect("observe");
    assert_eq!(
        observer.next().await.expect("first event"),
        LeaderEvent::Leader(lockkit::LeaderInfo::new(leader.term(), b"a".to_vec()))
    );
    let next = tokio::spawn({
        let (b, name, opts) = (b.clone(), name.clone(), long.clone());
        async move {
            b.campaign(
                &name,
                b"b",
                opts.wait(Wait::Timeout(Duration::from_secs(20))),
            )
            .await
        }
    });
    let mut admin = server.raw().await;
    await_queued(&mut admin, &format!("{}:queue:elect/{name}", a.prefix()), 1).await;
    let lost = tokio::spawn(leader.lost());
    let key = a.slot_key(SlotKind::Election, &name, 0);
    let deleted = Instant::now();
    let n: i64 = redis::cmd("DEL")
        .arg(&key)
        .query_async(&mut admin)
        .await
        .expect("DEL");
    assert_eq!(n, 1, "the leader's key {key} was not there");
    tokio::time::timeout(LOSS_NOTICE, lost)
        .await
        .expect("the leader did not hear of the DEL within LOSS_NOTICE")
        .unwrap();
    let heard = deleted.elapsed();
    assert_eq!(leader.state(), LeaseState::Lost);
    assert_eq!(leader.loss_reason(), Some(LossReason::NotHeldOnServer));
    let lb = tokio::time::timeout(MAX_WAIT_POLL * 3, next)
        .await
        .expect("the next candidate did not lead after the DEL")
        .unwrap()
        .expect("campaign");
    let took_over = deleted.elapsed();
    assert!(
        lb.term() > leader.term(),
        "{} <= {}",
        lb.term(),
        leader.term()
    );
    eprintln!("admin DEL: leader lost after {heard:?}, next leader after {took_over:?}");
    // The observer reaches the new term (a NoLeader or Missed may come first).
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let e = tokio::time::timeout_at(until, observer.next())
            .await
            .expect("the observer never saw the new leader")
            .expect("observer");
        match e {
            LeaderEvent::Leader(l) if l.term == lb.term() => {
                assert_eq!(l.value, b"b");
                break;
            }
            LeaderEvent::Leader(l) => panic!("observer: unexpected leader {l:?}"),
            LeaderEvent::NoLeader | LeaderEvent::Missed => {}
            other => panic!("observer: {other:?}"),
        }
    }
    assert!(matches!(
        leader.resign().await,
        Err(lockkit::Error::NotHeld { .. })
    ));
    lb.resign().await.expect("resign");
}

/// 100 permits held through one client are renewed by the connection's batch: one script call
/// per tick (TTL/3) for all of them, not one per permit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_of_100_held_permits_are_batched() {
    const PERMITS: u32 = 100;
    let server = PrivateRedis::start(None).await;
    let s = client(&server, &fresh_prefix()).await;
    let name = format!("batched-{:08x}", rand::random::<u32>());
    // A tick every second (TTL/3).
    let ttl = Duration::from_secs(3);
    let mut held = Vec::new();
    for _ in 0..PERMITS {
        held.push(
            s.acquire_permit(
                &name,
                PERMITS,
                AcquireOptions::new().ttl(ttl).wait(Wait::No),
            )
            .await
            .expect("permit"),
        );
    }
    let mut admin = server.raw().await;
    reset_stats(&mut admin).await;
    let window = Duration::from_secs(4);
    tokio::time::sleep(window).await;
    let (scripts, all) = script_calls(&mut admin).await;
    for p in &held {
        assert_eq!(p.state(), LeaseState::Held, "permit {} not kept", p.slot());
    }
    // Four ticks in 4 s, each renewing every permit (the leases outlived their TTL): about four
    // script calls; one per permit per tick would be 400.
    eprintln!(
        "{PERMITS} permits over {window:?}: {scripts} script calls, {all} commands on the server"
    );
    assert!(
        scripts >= 2,
        "no renewal in {window:?}: {scripts} script calls"
    );
    assert!(
        scripts <= 10,
        "{scripts} script calls in {window:?} for {PERMITS} permits: renewals are not batched"
    );
    for p in held {
        p.release().await.expect("release");
    }
}

/// Resign → the next candidate leads: measured over 20 hand-overs between two clients, with
/// the server's command counters. A hand-over costs two round trips: the release script (which
/// hands the slot over and tells the waiter) and the new leader's confirmation; the waiter is
/// told, so it takes over well before its next periodic look.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resign_hands_over_in_two_round_trips() {
    const ROUNDS: usize = 20;
    let server = PrivateRedis::start(None).await;
    let prefix = fresh_prefix();
    let clients = [
        client(&server, &prefix).await,
        client(&server, &prefix).await,
    ];
    let name = format!("handover-{:08x}", rand::random::<u32>());
    let opts = AcquireOptions::new()
        .ttl(Duration::from_secs(60))
        .wait(Wait::Timeout(Duration::from_secs(20)));
    let queue = format!("{}:queue:elect/{name}", clients[0].prefix());
    let mut admin = server.raw().await;
    let mut leader = clients[0]
        .campaign(&name, b"0", opts.clone())
        .await
        .expect("campaign");
    let (mut scripts, mut commands, mut took) = (0, 0, Vec::new());
    for round in 1..=ROUNDS {
        let next = tokio::spawn({
            let (c, name, opts) = (clients[round % 2].clone(), name.clone(), opts.clone());
            async move { c.campaign(&name, format!("{round}").as_bytes(), opts).await }
        });
        await_queued(&mut admin, &queue, 1).await;
        reset_stats(&mut admin).await;
        let resigned = Instant::now();
        let old = leader.term();
        leader.resign().await.expect("resign");
        leader = next.await.unwrap().expect("campaign");
        took.push(resigned.elapsed());
        let (s, a) = script_calls(&mut admin).await;
        scripts += s;
        commands += a;
        assert!(leader.term() > old);
    }
    leader.resign().await.expect("resign");
    took.sort();
    eprintln!(
        "resign -> next leader over {ROUNDS} hand-overs: min {:?} / median {:?} / max {:?}; \
         {:.2} round trips and {:.1} server commands (in scripts) per hand-over",
        took[0],
        took[ROUNDS / 2],
        took[ROUNDS - 1],
        scripts as f64 / ROUNDS as f64,
        commands as f64 / ROUNDS as f64,
    );
    // The waiter is told (one PUBLISH to its client): it does not wait for its next look.
    assert!(
        took[ROUNDS / 2] < MAX_WAIT_POLL / 2,
        "median hand-over {:?}: the waiter found the slot by polling",
        took[ROUNDS / 2]
    );
    // Two per hand-over; a waiter's periodic look (about once a second) may add one.
    assert!(
        scripts >= 2 * ROUNDS as u64 && scripts <= 2 * ROUNDS as u64 + 4,
        "{scripts} script calls for {ROUNDS} hand-overs"
    );
}

/// The observer's events up to the next `Leader`, which must be of `term` (10 s per event).
async fn events_until_a_leader(
    observer: &mut lockkit::Observer,
    term: lockkit::FencingToken,
) -> Vec<LeaderEvent> {
    let mut seen = Vec::new();
    loop {
        let e = tokio::time::timeout(Duration::from_secs(10), observer.next())
            .await
            .unwrap_or_else(|_| panic!("no observer event; so far {seen:?}"))
            .expect("observer");
        seen.push(e.clone());
        if let LeaderEvent::Leader(l) = e {
            assert_eq!(l.term, term, "events {seen:?}");
            return seen;
        }
    }
}

/// An observer whose pub/sub connection is killed (changes published meanwhile are lost to it)
/// says so: `Missed`, then the state it reads on resubscribing, even where the term moved by
/// only one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observer_that_lost_its_connection_says_missed() {
    let server = PrivateRedis::start(None).await;
    let prefix = fresh_prefix();
    let (a, b, watcher) = (
        client(&server, &prefix).await,
        client(&server, &prefix).await,
        client(&server, &prefix).await,
    );
    let name = format!("reconnect-{:08x}", rand::random::<u32>());
    let once = AcquireOptions::new()
        .ttl(Duration::from_secs(60))
        .wait(Wait::No);
    let la = a
        .campaign(&name, b"a", once.clone())
        .await
        .expect("campaign");
    let mut observer = watcher.observe(&name).await.expect("observe");
    assert_eq!(
        observer.next().await.expect("first event"),
        LeaderEvent::Leader(lockkit::LeaderInfo::new(la.term(), b"a".to_vec()))
    );
    let mut admin = server.raw().await;
    let killed = kill_pubsub_connections(&mut admin).await;
    assert!(killed >= 1, "no pub/sub connection to kill");
    let term_a = la.term();
    la.resign().await.expect("resign");
    let lb = b.campaign(&name, b"b", once).await.expect("campaign");
    assert!(lb.term() > term_a);
    let seen = events_until_a_leader(&mut observer, lb.term()).await;
    assert_eq!(
        seen.first(),
        Some(&LeaderEvent::Missed),
        "a resubscribe without Missed: {seen:?}"
    );
    lb.resign().await.expect("resign");
}

/// A candidate passed over at a hand-off (its client is gone) takes a term that nobody holds:
/// the observer sees the resign and the next leader with no `Missed` between, since it missed
/// no change (the grant's `PREV` is the term before the skipped one; the breaker found a
/// `Missed` at every pass-over).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observer_sees_no_gap_for_a_candidate_passed_over() {
    let server = PrivateRedis::start(None).await;
    let prefix = fresh_prefix();
    let (a, b, watcher) = (
        client(&server, &prefix).await,
        client(&server, &prefix).await,
        client(&server, &prefix).await,
    );
    let prefix = a.prefix().to_owned();
    let mut admin = server.raw().await;
    let name = "passed-over";
    let opts = |wait| {
        AcquireOptions::new()
            .ttl(Duration::from_secs(30))
            .wait(wait)
    };
    let la = a
        .campaign(name, b"a", opts(Wait::No))
        .await
        .expect("campaign");
    let mut observer = watcher.observe(name).await.expect("observe");
    assert_eq!(
        observer.next().await.expect("first event"),
        LeaderEvent::Leader(lockkit::LeaderInfo::new(la.term(), b"a".to_vec()))
    );
    let queue = format!("{prefix}:queue:elect/{name}");
    plant_ghost_waiter(&mut admin, &prefix, &queue).await;
    let waiting = tokio::spawn(async move {
        b.campaign(name, b"b", opts(Wait::Timeout(Duration::from_secs(20))))
            .await
    });
    await_queued(&mut admin, &queue, 2).await;
    let term_a = la.term();
    la.resign().await.expect("resign");
    let lb = waiting.await.expect("b").expect("b leads");
    assert!(lb.term() > term_a);
    let seen = events_until_a_leader(&mut observer, lb.term()).await;
    assert!(
        !seen.contains(&LeaderEvent::Missed),
        "a Missed although no change was missed: {seen:?}"
    );
    lb.resign().await.expect("resign");
}

/// A try-once campaign whose first attempts time out against a stopped server, one of which
/// takes the leadership once the server runs again, reports neither `Held` (for its own
/// orphaned grant) nor leaves that grant behind: it gives it back and leads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_campaign_that_took_the_slot_is_not_reported_as_held() {
    let server = PrivateRedis::start(None).await;
    let url = format!(
        "{}?prefix={}&response_timeout_ms=300",
        server.url(),
        fresh_prefix()
    );
    let elections = RedisLock::connect(&url).await.expect("connect");
    let once = AcquireOptions::new()
        .ttl(Duration::from_secs(60))
        .keepalive(false)
        .wait(Wait::No);
    elections
        .campaign("warm", b"w", once.clone())
        .await
        .expect("warm-up")
        .resign()
        .await
        .expect("resign");
    let name = "stopped";
    server.proc.signal("STOP");
    let e = elections.clone();
    let pending = tokio::spawn(async move { e.campaign(name, b"v", once).await });
    // Let the stop outlast a few response timeouts (retries on new connections).
    tokio::time::sleep(Duration::from_millis(1000)).await;
    server.proc.signal("CONT");
    let leader = pending
        .await
        .expect("task")
        .expect("the campaign leads (no other candidate exists)");
    assert_eq!(
        elections.leader(name).await.expect("leader()"),
        Some(lockkit::LeaderInfo::new(leader.term(), b"v".to_vec()))
    );
    leader.resign().await.expect("resign");
    assert_eq!(elections.leader(name).await.expect("leader()"), None);
}

/// A queued permit waiter whose client is gone (killed: nobody is subscribed to its channel,
/// while its queue entry and waiter key live on for up to WAITER_TTL) is passed over: its
/// channel has no subscriber, so the live waiter behind it gets the permit at once, not after
/// the dead waiter's 30 s lease. Also while another client subscribes to every channel by
/// pattern, which a PUBLISH's count would include (the breaker's find).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_waiter_whose_client_is_gone_is_passed_over_at_once() {
    let server = PrivateRedis::start(None).await;
    let prefix = fresh_prefix();
    let (holder, live) = (
        client(&server, &prefix).await,
        client(&server, &prefix).await,
    );
    let prefix = holder.prefix().to_owned();
    let mut admin = server.raw().await;
    let name = "gone";
    let opts = |wait| {
        AcquireOptions::new()
            .ttl(Duration::from_secs(30))
            .keepalive(false)
            .wait(wait)
    };
    let held = holder
        .acquire_permit(name, 1, opts(Wait::No))
        .await
        .expect("permit");
    let queue = format!("{prefix}:queue:sem/{name}");
    let ghost_key = plant_ghost_waiter(&mut admin, &prefix, &queue).await;
    let _every_channel = subscriber_to_every_channel(&server.url()).await;
    let waiting = tokio::spawn(async move {
        let p = live
            .acquire_permit(name, 1, opts(Wait::Timeout(Duration::from_secs(20))))
            .await;
        (Instant::now(), p)
    });
    await_queued(&mut admin, &queue, 2).await;
    let released = Instant::now();
    held.release().await.expect("release");
    let (at, p) = waiting.await.expect("live waiter");
    let p = p.expect("the live waiter got the permit");
    let took = at - released;
    // A PUBLISH to the live waiter: no poll (MAX_WAIT_POLL, 1 s) is needed.
    assert!(
        took < MAX_WAIT_POLL * 9 / 10,
        "the live waiter waited {took:?}"
    );
    assert_eq!(p.state(), LeaseState::Held);
    assert!(
        !exists(&mut admin, &ghost_key).await,
        "the ghost's waiter key"
    );
    await_queued(&mut admin, &queue, 0).await;
    p.release().await.expect("release");
}
