//! Attacks shared by the backends' slot tests (breakslots): many contending permit clients
//! that cancel, lapse and try once, checked against what every client believes it holds; and
//! the whole tests that drive them (`*_under_*`, `permits_of_two_ns_never_mix`), which a
//! backend's `break_slots.rs` runs with its slot harness.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockkit::contract_election::SlotHarness;
use lockkit::{AcquireOptions, Error, LeaseState, MemoryFence, Permit, Semaphore, Wait};

use crate::common::proxy::Proxy;
use crate::common::with_prefix;

/// What a stress run saw.
#[derive(Debug, Default)]
pub struct StressReport {
    pub granted: usize,
    pub cancelled: usize,
    pub lapsed: usize,
    pub refused: usize,
    pub mismatched: usize,
    /// Grants whose N differs from the grant before.
    pub switches: usize,
    last_n: u32,
    pub violations: Vec<String>,
}

/// `clients` contend for `name` (N = `permits`) for `rounds` each: most acquires wait and hold
/// briefly, some are dropped after a few ms, some try once, and some stop renewing (`lapse_ttl`;
/// keepalive off; `None`: none) and are left to lapse. Every grant checks, under one mutex, that fewer than N
/// other permits are `Held` and none of them on the same slot, and fences a write per slot.
pub async fn permit_stress(
    clients: Vec<Arc<dyn Semaphore>>,
    name: &str,
    ns: &[u32],
    rounds: usize,
    lapse_ttl: Option<Duration>,
) -> StressReport {
    let ns = ns.to_vec();
    let live: Arc<Mutex<Vec<Arc<Permit>>>> = Arc::default();
    let report: Arc<Mutex<StressReport>> = Arc::default();
    let fence = Arc::new(MemoryFence::<u64>::new());
    let mut joins = Vec::new();
    for client in clients {
        let (live, report, fence, name, ns) = (
            live.clone(),
            report.clone(),
            fence.clone(),
            name.to_owned(),
            ns.clone(),
        );
        joins.push(tokio::spawn(async move {
            for _ in 0..rounds {
                let permits = ns[usize::from(rand::random::<u8>()) % ns.len()];
                if ns.len() > 1 {
                    // Gaps, so that the semaphore goes idle now and then and N may change.
                    tokio::time::sleep(Duration::from_millis(u64::from(rand::random::<u8>() % 40)))
                        .await;
                }
                // With two Ns, no lapses: a lapsed permit keeps the semaphore busy for its whole TTL
                // and N would never change.
                let action = match rand::random::<u8>() % if ns.len() > 1 { 6 } else { 8 } {
                    6 if lapse_ttl.is_none() => 0,
                    a => a,
                };
                let opts = round_options(action, lapse_ttl.unwrap_or_default());
                let acquire = client.acquire_permit(&name, permits, opts);
                let Some(res) = cut_short(action, acquire, &report).await else {
                    continue;
                };
                let p = match res {
                    Ok(p) => Arc::new(p),
                    Err(Error::Held { .. } | Error::Timeout { .. }) => {
                        report.lock().unwrap().refused += 1;
                        continue;
                    }
                    Err(Error::PermitsMismatch { .. }) if ns.len() > 1 => {
                        report.lock().unwrap().mismatched += 1;
                        continue;
                    }
                    Err(e) => {
                        report
                            .lock()
                            .unwrap()
                            .violations
                            .push(format!("acquire failed: {e:?}"));
                        continue;
                    }
                };
                {
                    let mut l = live.lock().unwrap();
                    l.retain(|o| o.state() == LeaseState::Held);
                    if p.state() == LeaseState::Held {
                        if let Some(o) = l.iter().find(|o| o.permits() != p.permits()) {
                            report.lock().unwrap().violations.push(format!(
                                "a permit of N = {} granted while one of N = {} is Held",
                                p.permits(),
                                o.permits()
                            ));
                        }
                        if l.len() >= permits as usize {
                            report.lock().unwrap().violations.push(format!(
                                "{} others Held when slot {} was granted",
                                l.len(),
                                p.slot()
                            ));
                        }
                        if let Some(o) = l.iter().find(|o| o.slot() == p.slot()) {
                            report.lock().unwrap().violations.push(format!(
                                "slot {} Held twice: {:?} and {:?}",
                                p.slot(),
                                o.token(),
                                p.token()
                            ));
                        }
                        l.push(p.clone());
                    }
                    let resource = format!("slot-{}", p.slot());
                    let v = fence.read(&resource).unwrap_or(0);
                    if let Err(e) = fence.write(&resource, p.token(), v + 1) {
                        report
                            .lock()
                            .unwrap()
                            .violations
                            .push(format!("fenced write: {e:?}"));
                    }
                }
                {
                    let mut r = report.lock().unwrap();
                    r.granted += 1;
                    if r.last_n != 0 && r.last_n != p.permits() {
                        r.switches += 1;
                    }
                    r.last_n = p.permits();
                }
                if action == 6 {
                    // Not renewed: lapses after its TTL.
                    p.lost().await;
                    report.lock().unwrap().lapsed += 1;
                    live.lock().unwrap().retain(|o| !Arc::ptr_eq(o, &p));
                    drop(p);
                    continue;
                }
                hold_then_end(p, &live, &report, "release", Permit::release).await;
            }
        }));
    }
    collect(joins, report).await
}

/// A round's options for its `action` (a draw from 0..8): 6 stops renewing (`ttl`, keepalive
/// off) and is left to lapse, 7 tries once, the others wait up to 20 s with a 10 s TTL.
fn round_options(action: u8, ttl: Duration) -> AcquireOptions {
    let mut opts = AcquireOptions::new()
        .ttl(Duration::from_secs(10))
        .wait(Wait::Timeout(Duration::from_secs(20)));
    if action == 6 {
        opts = AcquireOptions::new()
            .ttl(ttl)
            .keepalive(false)
            .wait(Wait::Timeout(Duration::from_secs(20)));
    }
    if action == 7 {
        opts = opts.wait(Wait::No);
    }
    opts
}

/// A round's acquire; for `action` 5 dropped after 1–60 ms (then `None`, counted as cancelled
/// if it had not finished).
async fn cut_short<T>(
    action: u8,
    acquire: impl Future<Output = lockkit::Result<T>>,
    report: &Mutex<StressReport>,
) -> Option<lockkit::Result<T>> {
    if action != 5 {
        return Some(acquire.await);
    }
    let cut = Duration::from_millis(1 + u64::from(rand::random::<u8>() % 60));
    match tokio::time::timeout(cut, acquire).await {
        Ok(r) => Some(r),
        Err(_) => {
            report.lock().unwrap().cancelled += 1;
            None
        }
    }
}

/// Holds a grant for 0–19 ms, takes it off `live` and ends it with `end` (`what` names the
/// call in the violation a failure is); a grant still shared is left to its drop.
async fn hold_then_end<T>(
    held: Arc<T>,
    live: &Mutex<Vec<Arc<T>>>,
    report: &Mutex<StressReport>,
    what: &str,
    end: impl AsyncFnOnce(T) -> lockkit::Result<()>,
) {
    tokio::time::sleep(Duration::from_millis(u64::from(rand::random::<u8>() % 20))).await;
    live.lock().unwrap().retain(|o| !Arc::ptr_eq(o, &held));
    if let Ok(held) = Arc::try_unwrap(held)
        && let Err(e) = end(held).await
    {
        report
            .lock()
            .unwrap()
            .violations
            .push(format!("{what}: {e:?}"));
    }
}

/// Waits for every client task (a panic is a violation) and returns the report.
async fn collect(
    joins: Vec<tokio::task::JoinHandle<()>>,
    report: Arc<Mutex<StressReport>>,
) -> StressReport {
    for j in joins {
        if let Err(e) = j.await {
            report
                .lock()
                .unwrap()
                .violations
                .push(format!("client panicked: {e}"));
        }
    }
    Arc::try_unwrap(report)
        .map(|m| m.into_inner().unwrap())
        .unwrap_or_default()
}

/// After a stress run: a fresh client gets all N permits within `within` (nothing is left
/// blocking), and once they are released the idle semaphore takes another N.
pub async fn nothing_left(
    fresh: &dyn Semaphore,
    name: &str,
    permits: u32,
    within: Duration,
) -> Vec<String> {
    let mut bad = Vec::new();
    let mut held = Vec::new();
    for _ in 0..permits {
        match fresh
            .acquire_permit(
                name,
                permits,
                AcquireOptions::new()
                    .ttl(Duration::from_secs(10))
                    .wait(Wait::Timeout(within)),
            )
            .await
        {
            Ok(p) => held.push(p),
            Err(e) => bad.push(format!(
                "after the run, permit {} of {permits}: {e:?}",
                held.len()
            )),
        }
    }
    for p in held {
        let _ = p.release().await;
    }
    // Idle now: another N is taken (a few tries: a dropped grant's key may still be going).
    let mut last = None;
    for _ in 0..20 {
        match fresh
            .acquire_permit(
                name,
                permits + 1,
                AcquireOptions::new()
                    .ttl(Duration::from_secs(10))
                    .wait(Wait::No),
            )
            .await
        {
            Ok(p) => {
                let _ = p.release().await;
                last = None;
                break;
            }
            Err(e) => {
                last = Some(e);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    if let Some(e) = last {
        bad.push(format!("the idle semaphore kept its N: {e:?}"));
    }
    bad
}

/// `clients` campaign for `name` for `rounds` each: most wait and lead briefly (one proclaim),
/// some are dropped after a few ms, some try once, and some stop renewing (`lapse_ttl`; keepalive off)
/// and lapse (`None`: no lapses, for a backend without `keepalive(false)`). Every new leader checks, under one mutex, that no other leadership is `Held`, and
/// fences a write with its term.
pub async fn election_stress(
    clients: Vec<Arc<dyn lockkit::Election>>,
    name: &str,
    rounds: usize,
    lapse_ttl: Option<Duration>,
) -> StressReport {
    let live: Arc<Mutex<Vec<Arc<tokio::sync::Mutex<lockkit::Leadership>>>>> = Arc::default();
    let report: Arc<Mutex<StressReport>> = Arc::default();
    let fence = Arc::new(MemoryFence::<u64>::new());
    let mut joins = Vec::new();
    for client in clients {
        let (live, report, fence, name) =
            (live.clone(), report.clone(), fence.clone(), name.to_owned());
        joins.push(tokio::spawn(async move {
            for _ in 0..rounds {
                let action = match rand::random::<u8>() % 8 {
                    6 if lapse_ttl.is_none() => 0,
                    a => a,
                };
                let opts = round_options(action, lapse_ttl.unwrap_or_default());
                let acquire = client.campaign(&name, b"v", opts);
                let Some(res) = cut_short(action, acquire, &report).await else {
                    continue;
                };
                let l = match res {
                    Ok(l) => l,
                    Err(Error::Held { .. } | Error::Timeout { .. }) => {
                        report.lock().unwrap().refused += 1;
                        continue;
                    }
                    Err(e) => {
                        report
                            .lock()
                            .unwrap()
                            .violations
                            .push(format!("campaign failed: {e:?}"));
                        continue;
                    }
                };
                let term = l.term();
                let l = Arc::new(tokio::sync::Mutex::new(l));
                {
                    let mut v = live.lock().unwrap();
                    v.retain(|o| o.try_lock().map_or(true, |o| o.state() == LeaseState::Held));
                    if !v.is_empty() {
                        report.lock().unwrap().violations.push(format!(
                            "{} other leaders Held when term {term:?} began",
                            v.len()
                        ));
                    }
                    v.push(l.clone());
                    let r = fence.read("r").unwrap_or(0);
                    if let Err(e) = fence.write("r", term.clone(), r + 1) {
                        report
                            .lock()
                            .unwrap()
                            .violations
                            .push(format!("fenced write of term {term:?}: {e:?}"));
                    }
                }
                report.lock().unwrap().granted += 1;
                if action == 6 {
                    let lost = l.lock().await.lost();
                    lost.await;
                    report.lock().unwrap().lapsed += 1;
                    // A lapsed leader's proclaim must fail.
                    if l.lock().await.proclaim(b"late").await.is_ok() {
                        report
                            .lock()
                            .unwrap()
                            .violations
                            .push(format!("proclaim of lapsed term {term:?} succeeded"));
                    }
                    live.lock().unwrap().retain(|o| !Arc::ptr_eq(o, &l));
                    continue;
                }
                if let Err(e) = l.lock().await.proclaim(b"w").await {
                    report
                        .lock()
                        .unwrap()
                        .violations
                        .push(format!("proclaim of term {term:?}: {e:?}"));
                }
                hold_then_end(l, &live, &report, "resign", async |l| {
                    l.into_inner().resign().await
                })
                .await;
            }
        }));
    }
    collect(joins, report).await
}

/// Twelve clients contend for a semaphore of 3 permits with waits, cancels (dropped after
/// 1–60 ms), try-onces and lapses (keepalive off, 2 s TTL): never more than 3 permits Held at
/// once, never one slot twice, every fenced write accepted; afterwards nothing is left blocking
/// and the idle semaphore takes another N. `backend` labels the printed report.
pub async fn permits_hold_under_cancels_and_lapses(h: &dyn SlotHarness, backend: &str) {
    let name = format!("stress-{:08x}", rand::random::<u32>());
    let mut clients = Vec::new();
    for _ in 0..12 {
        clients.push(h.semaphore().await);
    }
    let report = permit_stress(clients, &name, &[3], 12, Some(Duration::from_secs(2))).await;
    println!("{backend} stress: {report:?}");
    let fresh = h.semaphore().await;
    let left = nothing_left(&*fresh, &name, 3, Duration::from_secs(8)).await;
    assert!(
        report.violations.is_empty() && left.is_empty(),
        "{report:?} {left:?}"
    );
}

/// Ten candidates campaign with waits, cancels, try-onces and lapses (keepalive off, 2 s TTL):
/// never two leaders Held at once, every term's fenced write accepted, a lapsed leader's
/// proclaim refused; afterwards a fresh candidate leads (within 8 s).
pub async fn one_leader_under_cancels_and_lapses(h: &dyn SlotHarness, backend: &str) {
    let name = format!("estress-{:08x}", rand::random::<u32>());
    let mut clients = Vec::new();
    for _ in 0..10 {
        clients.push(h.election().await);
    }
    let report = election_stress(clients, &name, 10, Some(Duration::from_secs(2))).await;
    println!("{backend} election stress: {report:?}");
    let fresh = h.election().await;
    let l = fresh
        .campaign(
            &name,
            b"last",
            AcquireOptions::new().wait(Wait::Timeout(Duration::from_secs(8))),
        )
        .await;
    assert!(report.violations.is_empty(), "{report:?}");
    l.expect("a fresh candidate after the run")
        .resign()
        .await
        .expect("resign");
}

/// Five clients contend with N = 2 or N = 3 at random (plus cancels, try-onces and permits left
/// to lapse with a 2 s TTL): a permit is never granted while a permit of the other N is Held,
/// never more than N at once; the losers get `PermitsMismatch`, and after the run a permit of
/// the other N is granted ([`the_other_n_is_taken_once_idle`]).
pub async fn permits_of_two_ns_never_mix(h: &dyn SlotHarness, backend: &str) {
    let name = format!("mixed-{:08x}", rand::random::<u32>());
    let mut clients = Vec::new();
    for _ in 0..5 {
        clients.push(h.semaphore().await);
    }
    let report = permit_stress(clients, &name, &[2, 3], 30, Some(Duration::from_secs(2))).await;
    println!("{backend} mixed-N stress: {report:?}");
    assert!(report.violations.is_empty(), "{report:?}");
    the_other_n_is_taken_once_idle(&*h.semaphore().await, &name, &report, &[2, 3]).await;
}

/// After a run of [`permit_stress`] with two Ns: the semaphore, idle now, takes a permit of the
/// N the run did not end with, so N does change. (The run's own switches, `report.switches`,
/// need the semaphore to go idle between grants, which a loaded machine may not give it: a run
/// under a load average of 6 saw 62 grants and none.)
pub async fn the_other_n_is_taken_once_idle(
    client: &dyn Semaphore,
    name: &str,
    report: &StressReport,
    ns: &[u32],
) {
    let other = ns
        .iter()
        .copied()
        .find(|&n| n != report.last_n)
        .expect("two Ns");
    // Permits the run left to lapse may hold it for their TTL.
    let opts = AcquireOptions::new().wait(Wait::Timeout(Duration::from_secs(20)));
    let p = client
        .acquire_permit(name, other, opts)
        .await
        .unwrap_or_else(|e| panic!("N = {other} after the run ({report:?}): {e:?}"));
    assert_eq!(p.permits(), other);
    p.release().await.expect("release");
}

/// [`cut_off_holder_is_not_held_when_reclaimed`] on the shared server of `env_var` (a
/// `{scheme}://host:port` URL): the holder connects through a [`Proxy`] that freezes, the
/// waiter directly, both under one fresh prefix; `connect` opens a client for a URL.
pub async fn cut_off_through_a_proxy<S, F, Fut>(env_var: &str, scheme: &str, connect: F)
where
    S: Semaphore + 'static,
    F: Fn(String) -> Fut,
    Fut: Future<Output = S>,
{
    let prefix = crate::common::fresh_prefix();
    let direct = crate::common::server_url(env_var);
    let upstream = direct
        .strip_prefix(&format!("{scheme}://"))
        .expect("a scheme://host:port URL");
    let proxy = Proxy::start(upstream.to_owned()).await;
    let via_proxy = format!("{scheme}://{}", proxy.endpoint());
    let holder = connect(with_prefix(&via_proxy, &prefix)).await;
    let waiter = connect(with_prefix(&direct, &prefix)).await;
    let name = format!("cut-{:08x}", rand::random::<u32>());
    cut_off_holder_is_not_held_when_reclaimed(&holder, Arc::new(waiter), &name, || proxy.freeze())
        .await;
}

/// A permit holder cut off from the server (`freeze` cuts its traffic, keepalives included)
/// while a waiter waits: the waiter is granted the slot only once the cut-off holder itself no
/// longer believes it holds (its state is not `Held`), with a higher token of that slot.
pub async fn cut_off_holder_is_not_held_when_reclaimed(
    holder: &dyn Semaphore,
    waiter: Arc<dyn Semaphore>,
    name: &str,
    freeze: impl FnOnce(),
) {
    let ttl = Duration::from_secs(2);
    let held = holder
        .acquire_permit(name, 1, AcquireOptions::new().ttl(ttl).wait(Wait::No))
        .await
        .expect("permit");
    let n = name.to_owned();
    let w = tokio::spawn(async move {
        waiter
            .acquire_permit(
                &n,
                1,
                AcquireOptions::new()
                    .ttl(Duration::from_secs(10))
                    .wait(Wait::Timeout(Duration::from_secs(30))),
            )
            .await
    });
    freeze();
    let p = w.await.expect("task").expect("the waiter's permit");
    let state = held.state();
    assert_ne!(
        state,
        LeaseState::Held,
        "the cut-off holder still believed it held slot {} when {:?} was granted",
        held.slot(),
        p.token()
    );
    assert!(p.token() > held.token());
    let _ = p.release().await;
}
