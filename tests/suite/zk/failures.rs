//! ZooKeeper-specific behaviour against a real server: bad connects, TTL negotiation, session
//! expiry of a frozen holder, lost create replies, the herd check, name encoding.

use lockkit::backend::LeaseBackendExt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockkit::zk::zookeeper_client as zk;
use lockkit::zk::{ZkConfig, ZkFence, ZkLock};
use lockkit::{AcquireOptions, Error, LeaseState, Lock, LockExt, Wait};
use tokio::time::Instant;

use crate::common::proxy::{Direction, Framing, Proxy, Spotter};
use crate::common::{free_port, fresh_prefix, server_url, with_prefix};

/// Session timeout used by the failure tests: 2 s (the shared server accepts 1 s–60 s).
const TTL: Duration = Duration::from_secs(2);
/// Scheduling slack on a loaded 2-core machine.
const TOLERANCE: Duration = Duration::from_secs(2);

fn shared_url() -> String {
    server_url("LOCKKIT_ZK_URL")
}

fn upstream() -> String {
    shared_url()
        .strip_prefix("zk://")
        .expect("LOCKKIT_ZK_URL is zk://host:port")
        .to_owned()
}

fn unique(name: &str) -> String {
    format!("{name}-{:08x}", rand::random::<u32>())
}

async fn direct(prefix: &str) -> ZkLock {
    ZkLock::connect(&with_prefix(&shared_url(), prefix))
        .await
        .expect("connect")
}

/// A proxy to the shared server that spots replies to lock-node creates, for the traps
/// ([`Proxy::cut_at_next_spotted`], [`Proxy::hold_from_next_spotted`]).
async fn proxy_to_server() -> Proxy {
    Proxy::start_with_spotter(upstream(), Framing::LengthPrefixed, lock_create_reply).await
}

/// Spots, on one connection, the server's reply to a lock-node create that succeeded (the
/// create reached the server and was applied).
///
/// ZooKeeper frames every record with a 4-byte big-endian length ([`Framing::LengthPrefixed`]).
/// After the connect handshake (the first record each way, which has no header), client→server
/// records start with `xid: i32, type: i32`, server→client records with `xid: i32, zxid: i64,
/// err: i32` (<https://zookeeper.apache.org/doc/r3.8.0/zookeeperProgrammers.html>,
/// `RequestHeader`/`ReplyHeader` in `zookeeper.jute`).
fn lock_create_reply() -> Spotter {
    const OP_CREATE: i32 = 1;
    const OP_CREATE2: i32 = 15;
    let (mut first_up, mut first_down) = (true, true);
    let mut create_xid = None;
    Box::new(move |dir, record| {
        let first = match dir {
            Direction::ToServer => std::mem::replace(&mut first_up, false),
            Direction::ToClient => std::mem::replace(&mut first_down, false),
        };
        let int = |at: usize| {
            record
                .get(at..at + 4)
                .map(|b| i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
        };
        if first {
            return false;
        }
        match dir {
            Direction::ToServer => {
                let op = int(4);
                // A create of a lock node (not of a parent or a fence node).
                if matches!(op, Some(OP_CREATE | OP_CREATE2))
                    && record.windows(6).any(|w| w == b"-lock-")
                {
                    create_xid = int(0);
                }
                false
            }
            Direction::ToClient => {
                if int(0).is_none() || int(0) != create_xid {
                    return false;
                }
                create_xid = None;
                // A create failing (NoNode before the parent exists) does not count.
                int(12) == Some(0)
            }
        }
    })
}

async fn through(proxy: &Proxy, prefix: &str) -> ZkLock {
    ZkLock::connect(&format!("zk://127.0.0.1:{}?prefix={prefix}", proxy.port))
        .await
        .expect("connect through proxy")
}

fn waiting(ttl: Duration, timeout: Duration) -> AcquireOptions {
    AcquireOptions::new().ttl(ttl).wait(Wait::Timeout(timeout))
}

#[tokio::test]
async fn malformed_urls_are_invalid_config_at_once() {
    for url in [
        "zk://",
        "zk://127.0.0.1",
        "zk://127.0.0.1:notaport",
        "zk://127.0.0.1:2181,",
        "zk://127.0.0.1:2181/trailing/",
        "zk://127.0.0.1:2181?prefix=a/b",
        "zk://127.0.0.1:2181?prefix=zookeeper",
        "zk://127.0.0.1:2181?what=1",
        "zk://user-without-password@127.0.0.1:2181",
        // Finding 6 of the review: a host:port:port, the server's reserved /zookeeper tree as
        // chroot, a repeated parameter; finding 5: a connect timeout whose deadline overflows.
        "zk://127.0.0.1:2181:2181",
        "zk://127.0.0.1:2181/zookeeper",
        "zk://127.0.0.1:2181/zookeeper/quota",
        "zk://127.0.0.1:2181?prefix=a&prefix=b",
        "zk://127.0.0.1:2181?connect_timeout_ms=18446744073709551615",
    ] {
        let start = Instant::now();
        match lockkit::connect(url).await {
            Err(Error::InvalidConfig { .. }) => {}
            other => panic!("{url:?}: expected InvalidConfig, got {other:?}"),
        }
        assert!(
            start.elapsed() < Duration::from_millis(500),
            "{url:?} did I/O"
        );
    }
}

#[tokio::test]
async fn unreachable_server_is_unavailable_quickly() {
    // Nothing listens: refused at once.
    let url = format!("zk://127.0.0.1:{}", free_port());
    let start = Instant::now();
    match lockkit::connect(&url).await {
        Err(e @ Error::Unavailable { .. }) => assert!(e.is_retryable()),
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(
        start.elapsed() < Duration::from_secs(6),
        "took {:?}",
        start.elapsed()
    );

    // Accepts TCP but never answers: bounded by connect_timeout_ms.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!(
        "zk://127.0.0.1:{}?connect_timeout_ms=1000",
        silent.local_addr().unwrap().port()
    );
    let start = Instant::now();
    match lockkit::connect(&url).await {
        Err(Error::Unavailable { .. }) => {}
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(
        start.elapsed() < Duration::from_secs(1) + TOLERANCE,
        "took {:?}",
        start.elapsed()
    );
}

#[tokio::test]
async fn missing_chroot_is_invalid_config() {
    let url = format!(
        "{}/no-such-chroot-{:08x}",
        shared_url(),
        rand::random::<u32>()
    );
    match lockkit::connect(&url).await {
        Err(Error::InvalidConfig { reason, .. }) => assert!(reason.contains("chroot"), "{reason}"),
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}

/// Finding 4 of the review: the shared parent nodes (prefix, lock container) are open to all;
/// only an authenticated holder's own nodes are creator-only. So a client with other (or no)
/// credentials can queue on a lock whose container an authenticated client created. ZooKeeper's
/// `digest` scheme cannot refuse a password: a wrong one is just another identity, which gets a
/// clear "no permission" error (not "authentication failed") where an ACL refuses it, and the
/// password is never shown.
#[tokio::test]
async fn shared_nodes_are_open_and_wrong_password_is_another_identity() {
    let prefix = fresh_prefix();
    let hostport = upstream();
    let alice = ZkLock::connect(&format!("zk://alice:right@{hostport}?prefix={prefix}"))
        .await
        .expect("connect with digest auth");
    let name = unique("acl");
    let lease = alice
        .try_acquire(&name, Duration::from_secs(10))
        .await
        .expect("acquire");
    let data = format!("/{prefix}-alice-data");
    ZkFence::from_lease(&lease)
        .expect("zk lease")
        .write(&data, b"a")
        .await
        .expect("alice's fenced write");

    // No credentials: queues on alice's lock (the container alice created is open).
    let anonymous = direct(&prefix).await;
    match anonymous.try_acquire(&name, TTL).await {
        Err(Error::Held { .. }) => {}
        other => panic!("anonymous acquire of alice's lock: expected Held, got {other:?}"),
    }

    let url = format!("zk://alice:wrong-pass-123@{hostport}?prefix={prefix}");
    let mallory = lockkit::connect(&url)
        .await
        .expect("a wrong digest password is another identity, not a refused one");
    assert!(!format!("{mallory:?}").contains("wrong-pass-123"));
    let cfg = ZkConfig::from_url(&url).unwrap();
    assert!(!format!("{cfg:?}").contains("wrong-pass-123"));
    let mallory = ZkLock::with_config(cfg).await.expect("connect");
    // Mallory holds a lock of her own and tries alice's node (creator-only, as is its guard
    // record).
    let own = mallory
        .try_acquire(&unique("mallory"), TTL)
        .await
        .expect("mallory's own lock");
    let write = ZkFence::from_lease(&own)
        .expect("zk lease")
        .write(&data, b"m")
        .await;
    own.release().await.expect("release");
    match write {
        Err(e @ Error::Backend { .. }) => {
            let shown = format!("{e} {e:?} {:?}", std::error::Error::source(&e));
            assert!(shown.contains("no permission"), "{shown}");
            assert!(
                !shown.contains("wrong-pass-123"),
                "password leaked: {shown}"
            );
        }
        other => panic!("write to alice's creator-only node: expected Backend, got {other:?}"),
    }

    lease.release().await.expect("release");
    let next = anonymous
        .try_acquire(&name, TTL)
        .await
        .expect("anonymous acquires once alice released");
    next.release().await.expect("release");
}

#[tokio::test]
async fn ttl_the_server_cannot_honour_is_refused_naming_both() {
    let locks = direct(&fresh_prefix()).await;
    let name = unique("ttl");
    // minSessionTimeout=1000 and maxSessionTimeout=60000 on the shared server.
    for ttl in [Duration::from_millis(500), Duration::from_secs(120)] {
        match locks.try_acquire(&name, ttl).await {
            Err(Error::InvalidConfig { reason, .. }) => {
                assert!(reason.contains(&format!("{ttl:?}")), "{reason}");
                assert!(reason.contains("negotiated"), "{reason}");
            }
            other => panic!("ttl {ttl:?}: expected InvalidConfig, got {other:?}"),
        }
    }
    match locks
        .try_acquire(&name, Duration::from_micros(1_500_500))
        .await
    {
        Err(Error::InvalidConfig { .. }) => {}
        other => panic!("sub-millisecond TTL: {other:?}"),
    }
    match locks
        .acquire(&name, AcquireOptions::new().keepalive(false))
        .await
    {
        Err(Error::NotSupported { backend: "zk", .. }) => {}
        other => panic!("keepalive(false): {other:?}"),
    }
    // Each TTL gets its own session; both work side by side.
    let a = locks.try_acquire(&unique("ttl-a"), TTL).await.expect("2 s");
    let b = locks
        .try_acquire(&unique("ttl-b"), Duration::from_secs(5))
        .await
        .expect("5 s");
    let (za, zb) = (zk_lease(&a), zk_lease(&b));
    assert_ne!(za.session_id(), zb.session_id());
    a.release().await.unwrap();
    b.release().await.unwrap();
}

fn zk_lease(lease: &lockkit::Lease) -> &lockkit::zk::ZkLease {
    lease
        .ops()
        .as_any()
        .downcast_ref::<lockkit::zk::ZkLease>()
        .expect("a ZooKeeper lease")
}

#[tokio::test]
async fn names_are_encoded_and_stay_distinct() {
    let locks = direct(&fresh_prefix()).await;
    let base = unique("enc");
    let names = [
        format!("{base} 100%"),
        format!("{base} 100%25"),
        format!("{base} 🔒"),
        format!("{base} \u{e000}"),
        format!("{base} \u{fff0}"),
        "zookeeper".to_owned(),
    ];
    let mut leases = Vec::new();
    for n in &names {
        leases.push(
            locks
                .try_acquire(n, Duration::from_secs(10))
                .await
                .expect(n),
        );
    }
    for l in leases {
        l.release().await.expect("release");
    }
}

/// The holder's connection is frozen past its session timeout: the server expires the session
/// and deletes the node, another client gets the lock with a larger token, and the frozen holder,
/// once thawed, reports Lost and has its fenced write rejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_holder_loses_its_session_and_is_fenced() {
    let prefix = fresh_prefix();
    let proxy = proxy_to_server().await;
    let a = through(&proxy, &prefix).await;
    let b = direct(&prefix).await;
    let name = unique("frozen");
    let data = format!("/{prefix}-data");

    let lease_a = a.try_acquire(&name, TTL).await.expect("A acquires");
    let fence_a = ZkFence::from_lease(&lease_a).expect("zk lease");
    fence_a
        .write(&data, b"A1")
        .await
        .expect("A's fenced write while holding");

    let frozen_at = Instant::now();
    proxy.freeze();
    let lost_a = tokio::spawn(lease_a.lost());
    let lease_b = b
        .acquire(&name, waiting(Duration::from_secs(10), TTL * 3 + TOLERANCE))
        .await
        .expect("B gets the lock once A's session expired");
    let granted = Instant::now();
    assert!(
        lease_b.token() > lease_a.token(),
        "{} !> {}",
        lease_b.token(),
        lease_a.token()
    );
    assert!(
        granted - frozen_at >= TTL / 2,
        "B was granted {:?} after the freeze, before A's session could expire",
        granted - frozen_at
    );
    // A's client-side deadline fired no later than B's grant, while A heard nothing.
    assert!(
        lease_a.valid_until() <= granted,
        "A still believed it held the lock when B got it"
    );
    tokio::time::timeout(TOLERANCE, lost_a)
        .await
        .expect("A's loss signal")
        .unwrap();
    assert_eq!(lease_a.state(), LeaseState::Lost);
    let fence_b = ZkFence::from_lease(&lease_b).expect("zk lease");
    fence_b.write(&data, b"B1").await.expect("B's fenced write");

    proxy.thaw();
    // A wakes up and writes anyway: the server-side check on A's node rejects it.
    match fence_a.write(&data, b"A2-stale").await {
        Err(Error::StaleToken { token, current, .. }) => {
            assert_eq!(token, lease_a.token());
            assert_eq!(current, lease_b.token());
        }
        other => panic!("A's stale write: {other:?}"),
    }
    assert_eq!(
        fence_b.read(&data).await.unwrap().as_deref(),
        Some(&b"B1"[..])
    );
    // Reconnecting (under a new session) never revives A's lease.
    assert_eq!(lease_a.state(), LeaseState::Lost);
    match lease_a.release().await {
        Err(Error::NotHeld { .. }) => {}
        other => panic!("A's release after expiry: {other:?}"),
    }
    assert!(matches!(
        b.try_acquire(&name, TTL).await,
        Err(Error::Held { .. })
    ));
    lease_b.release().await.expect("B releases");
    assert!(b.contenders(&name).await.unwrap().is_empty());
}

/// The reply to the create is lost, the client reconnects (same session) and finds its own node
/// by its unique id: it holds the lock with exactly one node, no duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_create_reply_adopts_own_node() {
    let prefix = fresh_prefix();
    let proxy = proxy_to_server().await;
    let a = through(&proxy, &prefix).await;
    let b = direct(&prefix).await;
    let name = unique("lost-reply");

    proxy.cut_at_next_spotted(false);
    let lease = a
        .acquire(&name, waiting(TTL, Duration::from_secs(10)))
        .await
        .expect("acquire survives a lost create reply");
    assert_eq!(proxy.cuts(), 1, "the create reply was not cut");
    let nodes = b.contenders(&name).await.unwrap();
    assert_eq!(nodes.len(), 1, "duplicate or missing node: {nodes:?}");
    assert!(matches!(
        b.try_acquire(&name, TTL).await,
        Err(Error::Held { .. })
    ));
    lease.release().await.expect("release");
    assert!(b.contenders(&name).await.unwrap().is_empty());
}

/// A try-acquire of a held lock whose create reply is lost finds its node after reconnecting,
/// sees it is not first, and deletes it: nothing is left to block others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_create_reply_on_held_lock_leaves_nothing() {
    let prefix = fresh_prefix();
    let proxy = proxy_to_server().await;
    let a = through(&proxy, &prefix).await;
    let b = direct(&prefix).await;
    let name = unique("lost-reply-held");

    let held = b.try_acquire(&name, TTL).await.expect("B holds");
    proxy.cut_at_next_spotted(false);
    match a.try_acquire(&name, TTL).await {
        Err(Error::Held { .. }) => {}
        other => panic!("expected Held, got {other:?}"),
    }
    assert_eq!(proxy.cuts(), 1);
    assert_eq!(b.contenders(&name).await.unwrap().len(), 1);
    held.release().await.unwrap();
    assert!(b.contenders(&name).await.unwrap().is_empty());
}

/// The create is applied but its reply is lost and the client can never reconnect: it gives up,
/// the lock is free for others once the session times out, and no orphan node remains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_create_reply_then_partition_frees_the_lock_within_the_session_timeout() {
    let prefix = fresh_prefix();
    let proxy = proxy_to_server().await;
    let a = through(&proxy, &prefix).await;
    let b = direct(&prefix).await;
    let name = unique("lost-reply-gone");

    proxy.cut_at_next_spotted(true);
    let start = Instant::now();
    let res = a.acquire(&name, waiting(TTL, Duration::from_secs(1))).await;
    assert!(
        matches!(res, Err(Error::Timeout { .. } | Error::Unavailable { .. })),
        "{res:?}"
    );
    proxy.wait_cuts(1).await;
    // A's node exists on the server (the create was applied) until A's session expires.
    let lease_b = b
        .acquire(&name, waiting(TTL, TTL + TOLERANCE * 2))
        .await
        .expect("the lock is obtainable once A's session times out");
    assert!(
        start.elapsed() <= TTL + lockkit::zk::EXPIRY_SLACK + TOLERANCE * 2,
        "took {:?}",
        start.elapsed()
    );
    let nodes = b.contenders(&name).await.unwrap();
    assert_eq!(nodes.len(), 1, "orphans left: {nodes:?}");
    lease_b.release().await.unwrap();
    assert!(b.contenders(&name).await.unwrap().is_empty());
}

/// An acquire dropped after its create was applied but before the reply arrived: the client does
/// not know its node's path, finds it by the acquire's unique id and deletes it, long before the
/// session (30 s) could expire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_dropped_before_create_reply_leaves_nothing() {
    let prefix = fresh_prefix();
    let proxy = proxy_to_server().await;
    let a = through(&proxy, &prefix).await;
    let b = direct(&prefix).await;
    let name = unique("dropped-mid-create");
    let ttl = Duration::from_secs(30);

    proxy.hold_from_next_spotted();
    {
        let acquire = a.acquire(&name, waiting(ttl, Duration::from_secs(20)));
        tokio::select! {
            res = acquire => panic!("acquire returned while its create reply was held: {res:?}"),
            _ = proxy.wait_held() => {}
        }
        // The acquire future is dropped here, mid-create.
    }
    assert_eq!(
        b.contenders(&name).await.unwrap().len(),
        1,
        "the create was applied"
    );
    let released = Instant::now();
    proxy.release_held();
    let lease = b
        .acquire(&name, waiting(ttl, Duration::from_secs(5)))
        .await
        .expect("the dropped acquire's node was deleted");
    assert!(released.elapsed() < ttl / 2);
    assert_eq!(b.contenders(&name).await.unwrap().len(), 1);
    lease.release().await.unwrap();
    assert!(b.contenders(&name).await.unwrap().is_empty());
}

/// 20 waiters, each watching only its predecessor: every release wakes exactly one of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_release_wakes_exactly_one_waiter() {
    const WAITERS: usize = 20;
    let prefix = fresh_prefix();
    let holder = direct(&prefix).await;
    let waiters = direct(&prefix).await;
    let name = unique("herd");
    let first = holder
        .try_acquire(&name, Duration::from_secs(10))
        .await
        .expect("holder");

    let stats = waiters.wait_stats();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut joins = Vec::new();
    for _ in 0..WAITERS {
        let (w, name, seen, stats) = (waiters.clone(), name.clone(), seen.clone(), stats.clone());
        joins.push(tokio::spawn(async move {
            let lease = w
                .acquire(
                    &name,
                    waiting(Duration::from_secs(10), Duration::from_secs(60)),
                )
                .await
                .expect("waiter acquires");
            // Wake-ups so far, read while this waiter holds the lock.
            seen.lock()
                .unwrap()
                .push((stats.borrow().wakeups, lease.token()));
            lease.release().await.expect("release");
        }));
    }
    let mut rx = waiters.wait_stats();
    tokio::time::timeout(
        Duration::from_secs(30),
        rx.wait_for(|s| s.waiting == WAITERS),
    )
    .await
    .expect("all waiters blocked on a watch")
    .unwrap();
    assert_eq!(
        rx.borrow().wakeups,
        0,
        "a waiter woke while nothing changed"
    );
    assert_eq!(holder.contenders(&name).await.unwrap().len(), WAITERS + 1);

    first.release().await.expect("release");
    for j in joins {
        j.await.expect("waiter task");
    }
    let seen = seen.lock().unwrap().clone();
    // The k-th waiter to get the lock saw exactly k wake-ups: one per release.
    let wakeups: Vec<u64> = seen.iter().map(|s| s.0).collect();
    assert_eq!(wakeups, (1..=WAITERS as u64).collect::<Vec<_>>());
    assert!(seen.windows(2).all(|w| w[0].1 < w[1].1), "tokens: {seen:?}");
    assert_eq!(waiters.wait_stats().borrow().wakeups, WAITERS as u64);
}

/// A lost connection makes the lease Suspect, a reconnect (same session) confirms it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_disconnect_is_suspect_then_held() {
    let prefix = fresh_prefix();
    let proxy = proxy_to_server().await;
    let a = through(&proxy, &prefix).await;
    let ttl = Duration::from_secs(10);
    let lease = a.try_acquire(&unique("blip"), ttl).await.expect("acquire");
    proxy.freeze();
    // The client declares the connection lost after 2/5 of the session timeout without traffic.
    let start = Instant::now();
    while lease.state() == LeaseState::Held {
        assert!(start.elapsed() < ttl, "never became suspect");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(lease.state(), LeaseState::Suspect);
    proxy.thaw();
    while lease.state() != LeaseState::Held {
        assert!(lease.state() != LeaseState::Lost, "lost after a short blip");
        assert!(start.elapsed() < ttl, "never confirmed again");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    lease.release().await.expect("release");
}

/// A release sent while the connection is frozen is retried once it comes back (same session):
/// it succeeds and the node is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_during_a_blip_is_retried() {
    let prefix = fresh_prefix();
    let proxy = proxy_to_server().await;
    let a = through(&proxy, &prefix).await;
    let b = direct(&prefix).await;
    let name = unique("release-blip");
    let ttl = Duration::from_secs(10);
    let lease = a.try_acquire(&name, ttl).await.expect("acquire");
    proxy.freeze();
    let release = tokio::spawn(lease.release());
    // Let the frozen connection be declared lost (2/5 of the session timeout without an answer),
    // so the delete's first attempt fails with a lost connection.
    tokio::time::sleep(Duration::from_secs(5)).await;
    if release.is_finished() {
        panic!("release returned while frozen: {:?}", release.await);
    }
    proxy.thaw();
    tokio::time::timeout(ttl, release)
        .await
        .expect("release finished")
        .unwrap()
        .expect("release succeeded after the blip");
    assert!(b.contenders(&name).await.unwrap().is_empty());
}

/// A leaked lease stays held for its TTL and no longer, though its session lives on; a lease
/// dropped without release-on-drop likewise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaked_and_unreleased_leases_lapse_after_their_ttl() {
    let prefix = fresh_prefix();
    let a = direct(&prefix).await;
    let b = direct(&prefix).await;
    for leak in [true, false] {
        let name = unique("leak");
        let sent = Instant::now();
        let lease = a
            .acquire(
                &name,
                AcquireOptions::new()
                    .ttl(TTL)
                    .wait(Wait::No)
                    .release_on_drop(false),
            )
            .await
            .expect("acquire");
        let token = lease.token();
        if leak {
            lease.leak();
        } else {
            drop(lease);
        }
        let again = b
            .acquire(&name, waiting(TTL, TTL * 2 + TOLERANCE))
            .await
            .expect("freed after its TTL");
        assert!(
            sent.elapsed() >= TTL - TTL / 10,
            "leak={leak}: freed after {:?}, before its TTL",
            sent.elapsed()
        );
        assert!(again.token() > token);
        again.release().await.unwrap();
    }
}

/// A connect string with a dead server first still connects through the live one.
#[tokio::test]
async fn multi_host_connect_string_skips_a_dead_server() {
    let url = format!(
        "zk://127.0.0.1:{},{}?prefix={}",
        free_port(),
        upstream(),
        fresh_prefix()
    );
    let locks = lockkit::connect(&url).await.expect("connect");
    let lease = locks
        .try_acquire(&unique("multi-host"), Duration::from_secs(10))
        .await
        .expect("acquire");
    lease.release().await.expect("release");
}

/// Finding 5 of the review: a huge connect timeout built without a URL panicked (`Instant`
/// overflow) instead of being refused.
#[tokio::test]
async fn huge_connect_timeout_is_invalid_config_not_a_panic() {
    let cfg = ZkConfig::new([upstream()]).connect_timeout(Duration::MAX);
    match ZkLock::with_config(cfg).await {
        Err(Error::InvalidConfig { .. }) => {}
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}

/// Finding 6 of the review: a zero (or 1 µs) wait on a FREE lock is granted, as on the memory
/// backend: only waiting for a holder is cut by the wait deadline, not the first attempt.
#[tokio::test]
async fn zero_wait_timeout_grants_a_free_lock() {
    let locks = direct(&fresh_prefix()).await;
    let name = unique("zero-wait");
    for wait in [Duration::ZERO, Duration::from_micros(1)] {
        let lease = locks
            .acquire(&name, waiting(TTL, wait))
            .await
            .unwrap_or_else(|e| panic!("free lock with Wait::Timeout({wait:?}): {e:?}"));
        match locks.acquire(&name, waiting(TTL, wait)).await {
            Err(Error::Timeout { .. }) => {}
            other => panic!("held lock with Wait::Timeout({wait:?}): {other:?}"),
        }
        lease.release().await.expect("release");
    }
    assert!(locks.contenders(&name).await.unwrap().is_empty());
}

/// Finding 6 of the review: a chroot deleted after connecting is named in the error.
#[tokio::test]
async fn chroot_deleted_after_connect_is_named() {
    let raw = lockkit::zk::zookeeper_client::Client::connect(&upstream())
        .await
        .expect("raw client");
    let chroot = format!("/chroot-{:08x}", rand::random::<u32>());
    let mode = lockkit::zk::zookeeper_client::CreateMode::Persistent
        .with_acls(lockkit::zk::zookeeper_client::Acls::anyone_all());
    raw.create(&chroot, &[], &mode)
        .await
        .expect("create chroot");
    let locks = ZkLock::connect(&format!("{}{chroot}", shared_url()))
        .await
        .expect("connect under the chroot");
    raw.delete(&chroot, None).await.expect("delete chroot");
    match locks.try_acquire(&unique("no-chroot"), TTL).await {
        Err(Error::InvalidConfig { reason, .. }) => {
            assert!(reason.contains(&chroot), "{reason}");
            assert!(reason.contains("does not exist"), "{reason}");
        }
        other => panic!("expected InvalidConfig naming the chroot, got {other:?}"),
    }
}

/// Finding 3 of the review: with the connection frozen (a paused server, a partition), a
/// try-once acquire, `contenders()` and a fence read answer within about the connect timeout
/// (1 s here) instead of waiting for the session to give up and retrying with new sessions
/// (77 s before the fix).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_connection_bounds_try_once_acquire_and_reads() {
    let prefix = fresh_prefix();
    let proxy = proxy_to_server().await;
    let locks = ZkLock::connect(&format!(
        "zk://127.0.0.1:{}?prefix={prefix}&connect_timeout_ms=1000",
        proxy.port
    ))
    .await
    .expect("connect through proxy");
    let name = unique("frozen-try");
    // Open the TTL's session first, so the frozen acquire uses a live session.
    let ttl = Duration::from_secs(20);
    let lease = locks.try_acquire(&name, ttl).await.expect("acquire");
    let fence = ZkFence::from_lease(&lease).expect("zk lease");
    lease.release().await.expect("release");
    proxy.freeze();
    let bound = Duration::from_secs(1) + TOLERANCE * 2;

    let start = Instant::now();
    let res = tokio::time::timeout(Duration::from_secs(30), locks.try_acquire(&name, ttl))
        .await
        .expect("try-once acquire hung for 30 s");
    match res {
        Err(e @ Error::Unavailable { .. }) => assert!(e.is_retryable()),
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(
        start.elapsed() < bound,
        "try-once acquire took {:?}",
        start.elapsed()
    );

    let start = Instant::now();
    let res = tokio::time::timeout(Duration::from_secs(30), locks.contenders(&name))
        .await
        .expect("contenders() hung for 30 s");
    assert!(matches!(res, Err(Error::Unavailable { .. })), "{res:?}");
    assert!(
        start.elapsed() < bound,
        "contenders() took {:?}",
        start.elapsed()
    );

    let start = Instant::now();
    let res = tokio::time::timeout(Duration::from_secs(30), fence.read("/x"))
        .await
        .expect("fence read hung for 30 s");
    assert!(matches!(res, Err(Error::Unavailable { .. })), "{res:?}");
    assert!(
        start.elapsed() < bound,
        "fence read took {:?}",
        start.elapsed()
    );
    proxy.thaw();
}

/// An admin's delete of the holder's lock node turns its lease Lost at once (the watch on its
/// own node; reason `not_held_on_server`), long before its session would notice, and a waiting
/// client gets the lock; the holder's own release later is not mistaken for a loss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_delete_of_the_node_is_lost_at_once() {
    let prefix = fresh_prefix();
    let (a, b) = (direct(&prefix).await, direct(&prefix).await);
    let admin = lockkit::zk::zookeeper_client::Client::connect(&upstream())
        .await
        .expect("admin client");
    let name = unique("node-deleted");
    let ttl = Duration::from_secs(10);
    let held = a.try_acquire(&name, ttl).await.unwrap();
    let kept = a.try_acquire(&unique("kept"), ttl).await.unwrap();
    let lost = held.lost();
    let lost_at = tokio::spawn(async move {
        lost.await;
        Instant::now()
    });
    let t = Instant::now();
    admin
        .delete(zk_lease(&held).node_path(), None)
        .await
        .expect("admin delete");
    let lost_at = tokio::time::timeout(TOLERANCE, lost_at)
        .await
        .expect("node deletion not noticed")
        .unwrap();
    eprintln!("zk: admin delete -> Lost in {:?}", lost_at - t);
    let notice = a.guarantees().loss_notice.expect("a loss-notice bound");
    assert!(lost_at - t < notice, "{:?}", lost_at - t);
    assert_eq!(
        held.loss_reason(),
        Some(lockkit::LossReason::NotHeldOnServer)
    );
    let next = b
        .try_acquire(&name, ttl)
        .await
        .expect("free after the delete");
    assert_eq!(kept.state(), LeaseState::Held);
    kept.release().await.unwrap();
    next.release().await.unwrap();
}

/// A lock-delay longer than the session timeout's slack, shorter than the tests' waits.
const DELAY: Duration = Duration::from_millis(1500);

fn with_delay(ttl: Duration, wait: Wait, delay: Duration) -> AcquireOptions {
    AcquireOptions::new().ttl(ttl).wait(wait).lock_delay(delay)
}

async fn raw_client() -> zk::Client {
    zk::Client::connect(&upstream()).await.expect("raw client")
}

/// Resolves with the instant the server deletes the holder node of lock `name` (a watch).
async fn holder_node_vanishes(locks: &ZkLock, name: &str) -> tokio::task::JoinHandle<Instant> {
    let node = format!(
        "{}/{}",
        locks.lock_dir(name).unwrap(),
        locks.contenders(name).await.unwrap()[0]
    );
    let raw = raw_client().await;
    let (stat, watcher) = raw.check_and_watch_stat(&node).await.expect("watch");
    assert!(stat.is_some(), "no holder node {node}");
    tokio::spawn(async move {
        let event = watcher.changed().await;
        assert_eq!(event.event_type, zk::EventType::NodeDeleted);
        drop(raw);
        Instant::now()
    })
}

/// Lock-delay on ZooKeeper: the holder's session expires (its connection frozen), the server
/// deletes its node, and the waiter is granted no earlier than the delay after that; a lease
/// granted without a delay leaves no marker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_delay_after_an_expired_holder() {
    let prefix = fresh_prefix();
    let proxy = proxy_to_server().await;
    let a = through(&proxy, &prefix).await;
    let b = direct(&prefix).await;
    assert!(b.guarantees().lock_delay);
    let name = unique("delay-expired");

    let lease_a = a
        .acquire(&name, with_delay(TTL, Wait::No, DELAY))
        .await
        .expect("A acquires");
    let vanished = holder_node_vanishes(&b, &name).await;
    proxy.freeze();
    let waiter = {
        let (b, name) = (b.clone(), name.clone());
        tokio::spawn(async move {
            let lease = b
                .acquire(
                    &name,
                    waiting(Duration::from_secs(10), TTL * 3 + TOLERANCE + DELAY),
                )
                .await
                .expect("B gets the lock after A's session expired and the delay");
            (lease, Instant::now())
        })
    };
    let vanished = vanished.await.unwrap();
    // During the delay B's node is first in line, but B holds nothing: `holder` says so (it
    // reported B's future token before). B queues within moments of A's node vanishing.
    let b_first = async {
        while b.contenders(&name).await.unwrap().is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(DELAY / 2, b_first)
        .await
        .expect("B queued");
    if !waiter.is_finished() {
        assert_eq!(b.holder(&name).await.expect("holder"), None);
    }
    let (lease_b, granted) = waiter.await.unwrap();
    assert!(
        granted - vanished >= DELAY,
        "B was granted {:?} after A's node vanished, before the lock-delay of {DELAY:?}",
        granted - vanished
    );
    assert!(lease_b.token() > lease_a.token());
    eprintln!(
        "zk lock-delay: granted {:?} after the expired holder's node vanished (delay {DELAY:?})",
        granted - vanished
    );
    // B was granted without a delay: its release leaves nothing, the next grant is immediate.
    lease_b.release().await.expect("release");
    let again = b
        .try_acquire(&name, TTL)
        .await
        .expect("free at once after B's release");
    again.release().await.expect("release");
    proxy.thaw();
}

/// During a lock-delay a try-once acquire is `Held` and leaves no node behind; a try-once
/// acquire after the delay is granted (no waiter needed to clear it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_once_during_a_lock_delay_is_held() {
    let prefix = fresh_prefix();
    let proxy = proxy_to_server().await;
    let a = through(&proxy, &prefix).await;
    let b = direct(&prefix).await;
    let name = unique("delay-try");

    let _lease_a = a
        .acquire(&name, with_delay(TTL, Wait::No, DELAY))
        .await
        .expect("A acquires");
    let vanished = holder_node_vanishes(&b, &name).await;
    proxy.freeze();
    let vanished = tokio::time::timeout(TTL * 3 + TOLERANCE, vanished)
        .await
        .expect("A's session never expired")
        .unwrap();
    match b.try_acquire(&name, TTL).await {
        Err(Error::Held { .. }) => {}
        other => panic!("try-once during the lock-delay: {other:?}"),
    }
    let held_at = Instant::now();
    assert!(
        held_at - vanished < DELAY,
        "the machine was too slow to try within the delay"
    );
    assert!(
        b.contenders(&name).await.unwrap().is_empty(),
        "the refused try-once left its node behind"
    );
    // Nothing signals the end of a lock-delay: wait it out (from the refusal, which is when the
    // lock was seen free), then a try-once gets the lock.
    tokio::time::sleep_until(held_at + DELAY + Duration::from_millis(300)).await;
    let lease = b
        .try_acquire(&name, TTL)
        .await
        .expect("try-once after the lock-delay");
    lease.release().await.expect("release");
    proxy.thaw();
}

/// An explicit release (and a release on drop) frees a lock granted with a lock-delay at once,
/// and removes its marker.
#[tokio::test]
async fn release_frees_a_lock_delay_lock_at_once() {
    let prefix = fresh_prefix();
    let a = direct(&prefix).await;
    let b = direct(&prefix).await;
    let name = unique("delay-release");
    let lease = a
        .acquire(&name, with_delay(TTL, Wait::No, lockkit::MAX_LOCK_DELAY))
        .await
        .expect("A acquires");
    let dir = a.lock_dir(&name).unwrap();
    let raw = raw_client().await;
    assert!(
        raw.list_children(&dir)
            .await
            .unwrap()
            .contains(&"lock-delay".to_owned()),
        "no lock-delay marker while A holds"
    );
    lease.release().await.expect("release");
    let lease_b = b
        .try_acquire(&name, TTL)
        .await
        .expect("B at once after A's release");
    assert!(
        !raw.list_children(&dir)
            .await
            .unwrap()
            .contains(&"lock-delay".to_owned()),
        "A's release left its marker"
    );
    lease_b.release().await.expect("release");
    // A release on drop reaches the server: free at once too.
    drop(
        a.acquire(&name, with_delay(TTL, Wait::No, lockkit::MAX_LOCK_DELAY))
            .await
            .expect("A acquires again"),
    );
    let lease_b = b
        .acquire_timeout(&name, TTL, TOLERANCE * 3)
        .await
        .expect("B soon after A's lease was dropped (released on drop)");
    lease_b.release().await.expect("release");
}
