//! etcd rows: uncontended acquire + release.
//!
//! (a) the floor: the same two round trips by hand with etcd-client — a put-if-absent
//!     transaction attaching the key to a pre-granted lease, then a delete;
//! (b) etcd's server-side lock service (v3lock `Lock` + `Unlock`) through etcd-client, with a
//!     pre-granted lease;
//! (c) lockkit (session lease already granted: the warm-up acquires grant it; back-to-back
//!     acquires reuse it), waiting acquire (put if the name is free; else a second
//!     transaction queues and reads the holder) and try-acquire (put only if the name is
//!     free), each followed by a release (a delete of the grant's own key);
//! (d) the two requests lockkit's try-acquire + release send, written by hand: what the
//!     library itself adds on top of its round trips is (c) − (d);
//! (e) (a) with the release made a compare-and-delete transaction.

use std::time::Duration;

use lockkit::etcd::EtcdLock;

use lockkit::etcd::etcd_client::{Compare, CompareOp, LockOptions, PutOptions, Txn, TxnOp};
use lockkit::{AcquireOptions, Lock, Wait};

use crate::{Row, interleaved, op, url};

pub async fn run(iters: usize) -> Vec<Row> {
    let url = url("LOCKKIT_ETCD_URL");
    let prefix = format!("lockbench-{:08x}", rand::random::<u32>());
    let locks = EtcdLock::connect(&format!("{url}?prefix={prefix}"))
        .await
        .expect("connect");
    let client = locks.client().clone();
    let lease = client
        .lease_client()
        .grant(30, None)
        .await
        .expect("grant")
        .id();
    // Keep the hand-made lease alive for the run.
    let keeper = {
        let client = client.clone();
        tokio::spawn(async move {
            let (mut keeper, mut stream) = client
                .lease_client()
                .keep_alive(lease)
                .await
                .expect("keepalive");
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                if keeper.keep_alive().await.is_err() || stream.message().await.is_err() {
                    return;
                }
            }
        })
    };

    let floor_key = format!("{prefix}/floor/k");
    let v3lock_name = format!("{prefix}/v3lock");
    let ttl = Duration::from_secs(30);
    let names = [
        "(a) by hand: put-if-absent txn (lease) + delete",
        "(b) etcd server-side Lock + Unlock (v3lock)",
        "(c) lockkit acquire + release (waiting acquire)",
        "(c) lockkit acquire + release (try-acquire)",
        "(d) lockkit's try-acquire requests by hand",
        "(e) by hand: put-if-absent txn + compare-delete txn",
    ];
    let one = |i: usize| {
        let (client, locks) = (&client, &locks);
        let (floor_key, v3lock_name) = (&floor_key, &v3lock_name);
        async move {
            match i {
                0 => {
                    let mut kv = client.kv_client();
                    let txn = Txn::new()
                        .when([Compare::create_revision(
                            floor_key.clone(),
                            CompareOp::Equal,
                            0,
                        )])
                        .and_then([TxnOp::put(
                            floor_key.clone(),
                            "",
                            Some(PutOptions::new().with_lease(lease)),
                        )]);
                    let r = kv.txn(txn).await.expect("txn");
                    assert!(r.succeeded());
                    kv.delete(floor_key.clone(), None).await.expect("delete");
                }
                1 => {
                    let mut lc = client.lock_client();
                    let r = lc
                        .lock(
                            v3lock_name.clone(),
                            Some(LockOptions::new().with_lease(lease)),
                        )
                        .await
                        .expect("lock");
                    lc.unlock(r.key().to_vec()).await.expect("unlock");
                }
                2 => {
                    let l = locks
                        .acquire("bench", AcquireOptions::new().ttl(ttl))
                        .await
                        .expect("acquire");
                    l.release().await.expect("release");
                }
                4 => {
                    let mut kv = client.kv_client();
                    let pfx = format!("{floor_key}d/");
                    let key = format!("{pfx}{lease:016x}-0");
                    let txn = Txn::new()
                        .when([Compare::create_revision(pfx.clone(), CompareOp::Equal, 0)
                            .with_prefix()])
                        .and_then([TxnOp::put(
                            key.clone(),
                            "",
                            Some(PutOptions::new().with_lease(lease)),
                        )]);
                    let r = kv.txn(txn).await.expect("txn");
                    assert!(r.succeeded());
                    let d = kv.delete(key.clone(), None).await.expect("delete");
                    assert_eq!(d.deleted(), 1);
                }
                5 => {
                    let mut kv = client.kv_client();
                    let key = format!("{floor_key}e");
                    let txn = Txn::new()
                        .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
                        .and_then([TxnOp::put(
                            key.clone(),
                            "",
                            Some(PutOptions::new().with_lease(lease)),
                        )]);
                    let r = kv.txn(txn).await.expect("txn");
                    assert!(r.succeeded());
                    let rev = r.header().unwrap().revision();
                    let txn = Txn::new()
                        .when([Compare::create_revision(key.clone(), CompareOp::Equal, rev)])
                        .and_then([TxnOp::delete(key.clone(), None)]);
                    assert!(kv.txn(txn).await.expect("txn").succeeded());
                }
                _ => {
                    let l = locks
                        .acquire("bench-try", AcquireOptions::new().ttl(ttl).wait(Wait::No))
                        .await
                        .expect("acquire");
                    l.release().await.expect("release");
                }
            }
        }
    };
    let one = &one;
    let ops = names
        .iter()
        .enumerate()
        .map(|(i, what)| (*what, op(move || one(i))))
        .collect();
    let rows = interleaved("etcd", ops, (iters / 10).max(10), iters).await;
    keeper.abort();
    let _ = client.lease_client().revoke(lease).await;
    rows
}
