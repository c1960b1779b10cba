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
//!
//! [`spec`] describes etcd for the scenarios (`scenario.rs`): lockkit next to etcd's Lock/Unlock.

use std::sync::Arc;
use std::time::Duration;

use lockkit::etcd::EtcdLock;
use lockkit::etcd::etcd_client::{Client, Compare, CompareOp, LockOptions, PutOptions, Txn, TxnOp};
use lockkit::{AcquireOptions, Lock, Wait};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::scenario::{self, BoxFut, Counters, Counts, Held, Labels, Spec, Variant};
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

/// etcd's server-side lock service (v3lock) with a lease of the client's own, kept alive.
struct V3Client {
    client: Client,
    lease: i64,
    prefix: String,
    keeper: tokio::task::JoinHandle<()>,
}

impl Drop for V3Client {
    fn drop(&mut self) {
        self.keeper.abort();
    }
}

struct V3Held {
    client: Client,
    key: Vec<u8>,
}

impl Held for V3Held {
    fn release(self: Box<Self>) -> BoxFut<'static, ()> {
        Box::pin(async move {
            let mut lc = self.client.lock_client();
            lc.unlock(self.key).await.expect("v3lock unlock");
        })
    }
}

impl scenario::Client for V3Client {
    fn acquire<'a>(&'a self, name: &'a str) -> BoxFut<'a, Box<dyn Held>> {
        Box::pin(async move {
            let mut lc = self.client.lock_client();
            let r = lc
                .lock(
                    format!("{}/v3lock/{name}", self.prefix),
                    Some(LockOptions::new().with_lease(self.lease)),
                )
                .await
                .expect("v3lock lock");
            Box::new(V3Held {
                client: self.client.clone(),
                key: r.key().to_vec(),
            }) as Box<dyn Held>
        })
    }
}

fn endpoint(url: &str) -> String {
    url.strip_prefix("etcd://")
        .expect("LOCKKIT_ETCD_URL is etcd://host:port")
        .split(['/', '?', ','])
        .next()
        .unwrap_or_default()
        .to_owned()
}

async fn v3client(endpoint: String, prefix: String) -> V3Client {
    let client = Client::connect([endpoint], None)
        .await
        .expect("etcd-client connect");
    let lease = client
        .lease_client()
        .grant(30, None)
        .await
        .expect("grant")
        .id();
    let keeper = {
        let client = client.clone();
        tokio::spawn(async move {
            let Ok((mut keeper, mut stream)) = client.lease_client().keep_alive(lease).await else {
                return;
            };
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                if keeper.keep_alive().await.is_err() || stream.message().await.is_err() {
                    return;
                }
            }
        })
    };
    V3Client {
        client,
        lease,
        prefix,
        keeper,
    }
}

/// etcd's `/metrics` on its client URL: gRPC messages received (every unary request, every
/// stream message), Raft proposals committed, watch events sent.
struct Metrics(String);

impl Counters for Metrics {
    fn read(&self, _variant: usize) -> BoxFut<'_, Counts> {
        Box::pin(async move {
            let mut s = tokio::net::TcpStream::connect(&self.0)
                .await
                .expect("etcd metrics");
            s.write_all(b"GET /metrics HTTP/1.0\r\nHost: etcd\r\n\r\n")
                .await
                .expect("etcd metrics");
            let mut body = String::new();
            s.read_to_string(&mut body).await.expect("etcd metrics");
            let mut c = Counts {
                requests: 0.0,
                writes: 0.0,
                wakes: 0.0,
            };
            for l in body.lines() {
                let Some((k, v)) = l.rsplit_once(' ') else {
                    continue;
                };
                let v: f64 = v.parse().unwrap_or(0.0);
                if k.starts_with("grpc_server_msg_received_total{") {
                    c.requests += v;
                } else if k == "etcd_server_proposals_committed_total" {
                    c.writes = v;
                } else if k == "etcd_debugging_mvcc_events_total" {
                    c.wakes = v;
                }
            }
            c
        })
    }
}

/// The scenarios' description of etcd: lockkit and etcd's Lock/Unlock.
pub async fn spec(prefix: &str) -> Spec {
    let url = url("LOCKKIT_ETCD_URL");
    let ep = endpoint(&url);
    let peer_prefix = format!("{prefix}-peer");
    let peer_ep = ep.clone();
    Spec {
        backend: "etcd",
        title: "etcd",
        variants: vec![
            scenario::lockkit(format!("{url}?prefix={prefix}")),
            Variant {
                name: "etcd Lock/Unlock".to_owned(),
                connect: Arc::new(move || {
                    let (ep, p) = (peer_ep.clone(), peer_prefix.clone());
                    Box::pin(
                        async move { Box::new(v3client(ep, p).await) as Box<dyn scenario::Client> },
                    )
                }),
            },
        ],
        counters: Arc::new(Metrics(ep)),
        labels: Labels {
            requests: "gRPC messages the server received (`grpc_server_msg_received_total`, \
                       stream messages included)",
            writes: Some("Raft proposals committed (`etcd_server_proposals_committed_total`)"),
            wakes: Some("watch events sent (`etcd_debugging_mvcc_events_total`)"),
        },
        lockkit_url: format!("{url}?prefix={prefix}"),
        notes: "Peer: etcd's server-side lock service (v3lock `Lock` + `Unlock` through \
                etcd-client 0.21, each client with a lease of its own). etcd runs as one member \
                on tmpfs (`scripts/servers.sh`). v3lock's own internal reads and watches do not \
                pass gRPC, so its requests per grant count only the client's calls; its writes \
                (proposals) count all.",
        procs_only: false,
    }
}
