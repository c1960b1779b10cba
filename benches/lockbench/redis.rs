//! Redis rows: the hand-written floor (`SET NX PX` + Lua compare-and-delete with the redis crate,
//! on the same kind of connection lockkit uses), then lockkit's try-once acquire + release with
//! keepalive on. lockkit's acquire script also bumps the fence counter (floored at `TIME`), and
//! its release script also `PUBLISH`es to wake waiters.

use std::time::Duration;

use lockkit::redis::RedisLock;
use lockkit::redis::redis::{self, Script, aio::ConnectionManager};
use lockkit::{AcquireOptions, Lock, Wait};

use crate::{Row, interleaved, op, url};

const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
";

pub async fn run(iters: usize) -> Vec<Row> {
    let base = url("LOCKKIT_REDIS_URL");
    let prefix = format!("lockbench-{:08x}", rand::random::<u32>());

    let client = redis::Client::open(base.as_str()).expect("redis client");
    let conn = ConnectionManager::new(client)
        .await
        .expect("redis connection");
    let release = Script::new(RELEASE);
    let floor_key = format!("{prefix}:floor");
    let sep = if base.contains('?') { '&' } else { '?' };
    let locks = RedisLock::connect(&format!("{base}{sep}prefix={prefix}"))
        .await
        .expect("lockkit connect");
    let opts = AcquireOptions::new()
        .ttl(Duration::from_secs(10))
        .wait(Wait::No)
        .keepalive(true);
    let floor = op(|| {
        let mut conn = conn.clone();
        let (release, key) = (&release, &floor_key);
        async move {
            let owner = format!("{:032x}", rand::random::<u128>());
            let set: Option<String> = redis::cmd("SET")
                .arg(key)
                .arg(&owner)
                .arg("NX")
                .arg("PX")
                .arg(10_000)
                .query_async(&mut conn)
                .await
                .expect("SET");
            assert!(set.is_some(), "floor lock held");
            let n: i64 = release
                .key(key)
                .arg(&owner)
                .invoke_async(&mut conn)
                .await
                .expect("release");
            assert_eq!(n, 1);
        }
    });

    let lockkit = op(|| async {
        let l = locks.acquire("bench", opts.clone()).await.expect("acquire");
        l.release().await.expect("release");
    });
    let ops = vec![
        ("floor: SET NX PX + Lua compare-and-delete", floor),
        ("lockkit acquire + release", lockkit),
    ];
    interleaved("redis", ops, (iters / 10).max(10), iters).await
}
