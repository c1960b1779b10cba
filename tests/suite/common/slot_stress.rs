//! Attacks shared by the backends' slot tests (breakslots): many contending permit clients
//! that cancel, lapse and try once, checked against what every client believes it holds.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockkit::{AcquireOptions, Error, LeaseState, MemoryFence, Permit, Semaphore, Wait};

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
                let ttl = lapse_ttl.unwrap_or_default();
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
                let res = if action == 5 {
                    let cut = Duration::from_millis(1 + u64::from(rand::random::<u8>() % 60));
                    match tokio::time::timeout(cut, client.acquire_permit(&name, permits, opts))
                        .await
                    {
                        Ok(r) => r,
                        Err(_) => {
                            report.lock().unwrap().cancelled += 1;
                            continue;
                        }
                    }
                } else {
                    client.acquire_permit(&name, permits, opts).await
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
                tokio::time::sleep(Duration::from_millis(u64::from(rand::random::<u8>() % 20)))
                    .await;
                live.lock().unwrap().retain(|o| !Arc::ptr_eq(o, &p));
                if let Ok(p) = Arc::try_unwrap(p) {
                    if let Err(e) = p.release().await {
                        report
                            .lock()
                            .unwrap()
                            .violations
                            .push(format!("release: {e:?}"));
                    }
                }
            }
        }));
    }
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
                let ttl = lapse_ttl.unwrap_or_default();
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
                let res = if action == 5 {
                    let cut = Duration::from_millis(1 + u64::from(rand::random::<u8>() % 60));
                    match tokio::time::timeout(cut, client.campaign(&name, b"v", opts)).await {
                        Ok(r) => r,
                        Err(_) => {
                            report.lock().unwrap().cancelled += 1;
                            continue;
                        }
                    }
                } else {
                    client.campaign(&name, b"v", opts).await
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
                tokio::time::sleep(Duration::from_millis(u64::from(rand::random::<u8>() % 20)))
                    .await;
                live.lock().unwrap().retain(|o| !Arc::ptr_eq(o, &l));
                if let Ok(l) = Arc::try_unwrap(l) {
                    if let Err(e) = l.into_inner().resign().await {
                        report
                            .lock()
                            .unwrap()
                            .violations
                            .push(format!("resign: {e:?}"));
                    }
                }
            }
        }));
    }
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
