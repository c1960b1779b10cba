//! The command connection of a [`RedisLock`](crate::RedisLock): the redis crate's
//! auto-reconnecting [`ConnectionManager`], replaced by a fresh one when a command times out.
//!
//! The connection manager reconnects when the connection is closed or reset, but not when a
//! reply merely never comes: a connection that silently stopped carrying bytes (a dead NAT
//! entry, a partition that drops packets, a stuck proxy) would otherwise time out every
//! command forever while new connections work. So a response timeout retires the connection
//! that timed out, and the next command opens a new one.

use std::sync::{Arc, Mutex};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Cmd, FromRedisValue, RedisResult, ScriptInvocation};

/// Cheap to clone: clones share the current connection.
#[derive(Clone)]
pub(crate) struct Conn {
    inner: Arc<Inner>,
}

struct Inner {
    client: redis::Client,
    config: ConnectionManagerConfig,
    /// The connection in use and its generation number (bumped on every replacement).
    current: Mutex<(u64, ConnectionManager)>,
}

impl Conn {
    /// Wraps a connected `first` manager; replacements are built from `client` and `config`.
    pub(crate) fn new(
        client: redis::Client,
        config: ConnectionManagerConfig,
        first: ConnectionManager,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                client,
                config,
                current: Mutex::new((0, first)),
            }),
        }
    }

    fn current(&self) -> (u64, ConnectionManager) {
        self.inner
            .current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Runs a script (`EVALSHA`, loading it on `NOSCRIPT`).
    ///
    /// # Errors
    /// The redis client's error.
    ///
    /// # Cancel safety
    /// Cancel safe; the script may still run on the server.
    pub(crate) async fn invoke<T: FromRedisValue>(
        &self,
        script: &ScriptInvocation<'_>,
    ) -> RedisResult<T> {
        let (generation, mut conn) = self.current();
        let r = script.invoke_async(&mut conn).await;
        self.check(generation, &r);
        r
    }

    /// Runs one command.
    ///
    /// # Errors
    /// The redis client's error.
    ///
    /// # Cancel safety
    /// Cancel safe; the command may still run on the server.
    pub(crate) async fn query<T: FromRedisValue>(&self, cmd: &Cmd) -> RedisResult<T> {
        let (generation, mut conn) = self.current();
        let r = cmd.query_async(&mut conn).await;
        self.check(generation, &r);
        r
    }

    /// After a response timeout, retires connection `generation` (unless it was replaced
    /// already): the next command connects anew.
    fn check<T>(&self, generation: u64, r: &RedisResult<T>) {
        let Err(e) = r else { return };
        if !e.is_timeout() {
            return;
        }
        let mut cur = self.inner.current.lock().unwrap_or_else(|p| p.into_inner());
        if cur.0 != generation {
            return;
        }
        match ConnectionManager::new_lazy_with_config(
            self.inner.client.clone(),
            self.inner.config.clone(),
        ) {
            Ok(fresh) => {
                *cur = (generation + 1, fresh);
                tracing::debug!("a redis command timed out; the next one uses a new connection");
            }
            Err(e) => tracing::debug!(error = %e, "cannot replace a timed-out redis connection"),
        }
    }
}
