//! ZooKeeper rows: the hand-written floor (the lock recipe's round trips done by hand with
//! zookeeper-client), zookeeper-client's own lock recipe and lockkit's acquire + release; [`spec`]
//! describes ZooKeeper for the scenarios (`scenario.rs`, hand-off among them).
//!
//! The first three rows are measured **interleaved** (floor, recipe, lockkit, floor, …) so that
//! they see the same server and machine load; measured one after the other, the shared 2-core
//! machine's load swings moved their ratio by ±20 % between runs.

use std::sync::Arc;
use std::time::Duration;

use lockkit::zk::ZkLock;
use lockkit::zk::zookeeper_client as zk;
use lockkit::{AcquireOptions, Lock, Wait};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::scenario::{self, BoxFut, Counters, Counts, Held, Labels, Spec, Variant};
use crate::{Op, Row, interleaved, url};

const BACKEND: &str = "zk";

pub async fn run(iters: usize) -> Vec<Row> {
    let base = url("LOCKKIT_ZK_URL");
    let hostport = base
        .strip_prefix("zk://")
        .expect("LOCKKIT_ZK_URL is zk://host:port")
        .to_owned();
    let run_id = format!("{:08x}", rand::random::<u32>());
    let client = zk::Client::connector()
        .with_session_timeout(Duration::from_secs(10))
        .connect(&hostport)
        .await
        .expect("connect zookeeper-client");
    let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
    let ephemeral_seq = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
    let dir = format!("/lockbench-{run_id}");
    let floor_dir = format!("{dir}/floor");
    let recipe_dir = format!("{dir}/recipe");
    for d in [&dir, &floor_dir] {
        client.create(d, &[], &persistent).await.expect("bench dir");
    }
    let lockkit_url = format!("{base}?prefix=lockbench-{run_id}-lk");
    let locks = ZkLock::connect(&lockkit_url)
        .await
        .expect("connect lockkit");
    let opts = AcquireOptions::new()
        .ttl(Duration::from_secs(10))
        .wait(Wait::No);
    let lock_options = zk::LockOptions::new(zk::Acls::anyone_all())
        .with_ancestor_options(persistent.clone())
        .expect("lock options");

    let (client, floor_dir, recipe_dir) = (&client, &floor_dir, &recipe_dir);
    let (ephemeral_seq, lock_options, locks, opts) = (&ephemeral_seq, &lock_options, &locks, &opts);
    let ops: Vec<(&str, Op<'_>)> = vec![
        // Floor: exactly the round trips of one uncontended grant and release.
        (
            "hand: create ephemeral-seq + getChildren + delete",
            Box::new(move || {
                Box::pin(async move {
                    let prefix = format!("{floor_dir}/n-");
                    let (_, seq) = client
                        .create(&prefix, &[], ephemeral_seq)
                        .await
                        .expect("create");
                    let children = client.list_children(floor_dir).await.expect("children");
                    assert_eq!(children.len(), 1);
                    client
                        .delete(&format!("{prefix}{seq}"), None)
                        .await
                        .expect("delete");
                })
            }),
        ),
        // zookeeper-client's recipe (Client::lock, Curator-style node names). Its LockClient
        // deletes the node in the background on drop; the row deletes it explicitly instead, so
        // the release is inside the measurement, and forgets the guard.
        (
            "zookeeper-client Client::lock + delete (its recipe)",
            Box::new(move || {
                Box::pin(async move {
                    let prefix = zk::LockPrefix::new_curator(recipe_dir, "lock-").expect("prefix");
                    let guard = client
                        .lock(prefix, b"", lock_options.clone())
                        .await
                        .expect("lock");
                    client
                        .delete(guard.lock_path(), None)
                        .await
                        .expect("unlock");
                    std::mem::forget(guard);
                })
            }),
        ),
        (
            "lockkit acquire + release",
            Box::new(move || {
                Box::pin(async move {
                    let l = locks.acquire("bench", opts.clone()).await.expect("acquire");
                    l.release().await.expect("release");
                })
            }),
        ),
    ];
    // Warm-up of iters / 2 rounds: the server is a JVM whose code paths get compiled during the
    // first thousands of requests.
    let rows = interleaved(BACKEND, ops, (iters / 2).max(10), iters).await;

    // Clean up the hand-made nodes (lockkit's are container nodes, removed by the server).
    for p in [recipe_dir.as_str(), floor_dir.as_str(), dir.as_str()] {
        let _ = client.delete(p, None).await;
    }
    rows
}

/// zookeeper-client's lock recipe (`Client::lock`, Curator-style names) on a session of its own.
struct RecipeClient {
    client: zk::Client,
    dir: String,
    options: zk::LockOptions<'static>,
}

struct RecipeHeld {
    client: zk::Client,
    path: String,
}

impl Held for RecipeHeld {
    fn release(self: Box<Self>) -> BoxFut<'static, ()> {
        Box::pin(async move {
            self.client
                .delete(&self.path, None)
                .await
                .expect("recipe unlock");
        })
    }
}

impl scenario::Client for RecipeClient {
    fn acquire<'a>(&'a self, name: &'a str) -> BoxFut<'a, Box<dyn Held>> {
        Box::pin(async move {
            let dir = format!("{}/{name}", self.dir);
            let prefix = zk::LockPrefix::new_curator(&dir, "lock-").expect("prefix");
            let guard = self
                .client
                .lock(prefix, b"", self.options.clone())
                .await
                .expect("recipe lock");
            // Its guard deletes the node in the background on drop; release deletes it
            // explicitly instead, so that the release is awaited (as in the uncontended row).
            let path = guard.lock_path().to_owned();
            std::mem::forget(guard);
            Box::new(RecipeHeld {
                client: self.client.clone(),
                path,
            }) as Box<dyn Held>
        })
    }
}

/// ZooKeeper's `mntr`: packets received (every request, pings included), watches triggered
/// (the sums of `node_{created,deleted,changed,children}_watch_count`).
struct Mntr(String);

impl Counters for Mntr {
    fn read(&self, _variant: usize) -> BoxFut<'_, Counts> {
        Box::pin(async move {
            let mut s = tokio::net::TcpStream::connect(&self.0)
                .await
                .expect("zk mntr");
            s.write_all(b"mntr").await.expect("zk mntr");
            let mut body = String::new();
            s.read_to_string(&mut body).await.expect("zk mntr");
            let mut c = Counts {
                requests: 0.0,
                writes: f64::NAN,
                wakes: 0.0,
            };
            for l in body.lines() {
                let Some((k, v)) = l.split_once('\t') else {
                    continue;
                };
                let v: f64 = v.trim().parse().unwrap_or(0.0);
                match k {
                    // mntr itself counts as one packet.
                    "zk_packets_received" => c.requests = v - 1.0,
                    "zk_sum_node_created_watch_count"
                    | "zk_sum_node_deleted_watch_count"
                    | "zk_sum_node_changed_watch_count"
                    | "zk_sum_node_children_watch_count" => c.wakes += v,
                    _ => {}
                }
            }
            c
        })
    }
}

/// The scenarios' description of ZooKeeper: lockkit and zookeeper-client's lock recipe.
pub async fn spec(prefix: &str) -> Spec {
    let base = url("LOCKKIT_ZK_URL");
    let hostport = base
        .strip_prefix("zk://")
        .expect("LOCKKIT_ZK_URL is zk://host:port")
        .to_owned();
    let peer_hp = hostport.clone();
    let dir = format!("/lockbench-{prefix}-recipe");
    Spec {
        backend: "zk",
        title: "ZooKeeper",
        variants: vec![
            scenario::lockkit(format!("{base}?prefix=lockbench-{prefix}")),
            Variant {
                name: "zookeeper-client lock recipe".to_owned(),
                connect: Arc::new(move || {
                    let (hp, dir) = (peer_hp.clone(), dir.clone());
                    Box::pin(async move {
                        let client = zk::Client::connector()
                            .with_session_timeout(Duration::from_secs(10))
                            .connect(&hp)
                            .await
                            .expect("connect zookeeper-client");
                        let persistent =
                            zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
                        let options = zk::LockOptions::new(zk::Acls::anyone_all())
                            .with_ancestor_options(persistent)
                            .expect("lock options");
                        Box::new(RecipeClient {
                            client,
                            dir,
                            options,
                        }) as Box<dyn scenario::Client>
                    })
                }),
            },
        ],
        counters: Arc::new(Mntr(hostport)),
        labels: Labels {
            requests: "packets the server received (`mntr` `zk_packets_received`, session \
                       pings included)",
            writes: None,
            wakes: Some(
                "watches triggered (`mntr` sums of `node_{created,deleted,changed,children}_watch_count`)",
            ),
        },
        lockkit_url: format!("{base}?prefix=lockbench-{prefix}"),
        notes: "Peer: zookeeper-client 0.11's lock recipe (`Client::lock` with \
                `LockPrefix::new_curator`), each client on a session of its own; its release \
                deletes the lock node and awaits it. ZooKeeper 3.8 standalone, `forceSync=no`.",
        procs_only: false,
    }
}
