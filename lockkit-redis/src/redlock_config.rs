//! Connection settings of a [`RedlockLock`](crate::RedlockLock): a `redlock://` or `redlocks://`
//! URL naming N independent Redis masters, or built by hand from one [`RedisConfig`] per node.

use std::fmt;
use std::time::Duration;

use lockkit_core::backend::BackendUrl;
use lockkit_core::{Error, MAX_TTL, MIN_TTL, Result};

use crate::config::{DEFAULT_PORT, RedisConfig};

/// The longest TTL a Redlock client grants by default, and how long a node restarted without
/// its data refuses to vote ([`RedlockConfig::max_ttl`], URL parameter `max_ttl`): 60 s.
pub const DEFAULT_REDLOCK_MAX_TTL: Duration = Duration::from_secs(60);

/// The most nodes a Redlock config may name: 15.
pub const MAX_REDLOCK_NODES: usize = 15;

/// URL parameters of a single-node `redis://` URL that have no meaning for Redlock.
const NOT_FOR_REDLOCK: &[&str] = &[
    // The eviction check of `strict` is not run on Redlock nodes yet: refused, not ignored.
    "strict",
    "notifications",
    "min_replicas",
    "replica_timeout",
    "sentinel_username",
    "sentinel_password",
];

/// The parameters (and old spellings) each node's `redis://` URL takes from a Redlock URL.
const FOR_THE_NODES: &[&str] = &[
    "prefix",
    "connect_timeout",
    "connect_timeout_ms",
    "response_timeout",
    "response_timeout_ms",
    "tls_ca",
    "tls_ca_file",
    "tls_cert",
    "tls_key",
    "tls_server_name",
    "protocol",
    "db",
];

/// The parameters a Redlock URL takes, for the message about an unknown one.
const KNOWN: &[&str] = &[
    "prefix",
    "connect_timeout",
    "response_timeout",
    "tls_ca",
    "tls_cert",
    "tls_key",
    "protocol",
    "max_ttl",
];

/// N independent Redis masters for [`RedlockLock`](crate::RedlockLock), and the longest TTL
/// any client of them grants.
///
/// Every node gets the same credentials, database, prefix, timeouts and TLS settings (those of
/// `redis://`, see [`RedisConfig::from_url`]); by hand, each node is a [`RedisConfig`] of its
/// own ([`RedlockConfig::new`]).
///
/// ```
/// use std::time::Duration;
/// use lockkit_redis::RedlockConfig;
///
/// let c: RedlockConfig =
///     "redlock://:s3cret@10.0.0.1:6379,10.0.0.2,10.0.0.3:7000/2?prefix=billing&max_ttl=30s".parse()?;
/// assert_eq!(c.nodes().len(), 3);
/// assert_eq!(c.quorum(), 2);
/// assert_eq!(c.get_max_ttl(), Duration::from_secs(30));
/// assert_eq!(c.nodes()[1].get_prefix(), "billing");
/// assert!(!format!("{c:?}").contains("s3cret"));
/// # Ok::<(), lockkit_core::Error>(())
/// ```
#[derive(Clone)]
pub struct RedlockConfig {
    pub(crate) nodes: Vec<RedisConfig>,
    /// `host:port` of each node, for logs and errors.
    pub(crate) addrs: Vec<String>,
    pub(crate) max_ttl: Duration,
}

impl fmt::Debug for RedlockConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedlockConfig")
            .field("nodes", &self.nodes)
            .field("max_ttl", &self.max_ttl)
            .finish()
    }
}

impl RedlockConfig {
    /// One node per [`RedisConfig`] (each a single server: Sentinel configs and
    /// replication-confirmed grants are refused by [`validate`](Self::validate)), with
    /// [`DEFAULT_REDLOCK_MAX_TTL`]. All nodes should use the same prefix.
    pub fn new(nodes: impl IntoIterator<Item = RedisConfig>) -> Self {
        let nodes: Vec<RedisConfig> = nodes.into_iter().collect();
        let addrs = nodes
            .iter()
            .map(|c| {
                c.connection_info()
                    .map(|i| i.addr().to_string())
                    .unwrap_or_default()
            })
            .collect();
        Self {
            nodes,
            addrs,
            max_ttl: DEFAULT_REDLOCK_MAX_TTL,
        }
    }

    /// Sets the longest TTL a grant may have (URL parameter `max_ttl`; default
    /// [`DEFAULT_REDLOCK_MAX_TTL`], 60 s). It is also how long a node that lost its data
    /// refuses to vote after a restart (the *delayed restart*, see the crate docs, "Redlock"),
    /// so **every client of the same nodes must use the same value**. An acquire with a longer
    /// TTL fails with [`Error::InvalidConfig`].
    pub fn max_ttl(mut self, max_ttl: Duration) -> Self {
        self.max_ttl = max_ttl;
        self
    }

    /// The longest TTL a grant may have.
    pub fn get_max_ttl(&self) -> Duration {
        self.max_ttl
    }

    /// The nodes.
    pub fn nodes(&self) -> &[RedisConfig] {
        &self.nodes
    }

    /// How many nodes must agree: a strict majority, `N / 2 + 1`.
    pub fn quorum(&self) -> usize {
        self.nodes.len() / 2 + 1
    }

    /// The key prefix (the first node's).
    pub fn get_prefix(&self) -> &str {
        self.nodes.first().map_or("", RedisConfig::get_prefix)
    }

    /// Parses `redlock://[[user]:password@]host[:port],host[:port],…[/db][?param=value&…]`
    /// (`redlocks://` for TLS, with the `#insecure` fragment as on `rediss://`): the hosts are the
    /// N independent masters (default port 6379), at least 3 and at most [`MAX_REDLOCK_NODES`];
    /// an odd N is recommended (an even N needs N/2 + 1 nodes, so it tolerates no more failed
    /// nodes than N − 1). The user info, database and parameters apply to every node and are
    /// those of `redis://` ([`RedisConfig::from_url`]: `prefix`, `connect_timeout`,
    /// `response_timeout`, `tls_ca`, `tls_cert`, `tls_key`, `protocol`), plus:
    ///
    /// | parameter | meaning | default |
    /// |---|---|---|
    /// | `max_ttl` | the longest TTL, and the delayed restart of a node that lost its data (see [`max_ttl`](Self::max_ttl)) | `60s` |
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a URL that does not parse, another scheme, fewer than 3 or
    /// more than [`MAX_REDLOCK_NODES`] hosts, a host named twice, a parameter that only
    /// single-node or Sentinel URLs take (`strict`, `notifications`, `min_replicas`, `replica_timeout`,
    /// `sentinel_*`), a bad `max_ttl`, or anything [`RedisConfig::from_url`] refuses. The URL is
    /// never echoed (it may carry a password).
    pub fn from_url(url: &str) -> Result<Self> {
        let mut u = BackendUrl::parse(url, &["redlock", "redlocks"])?;
        let hosts = u.host_list(Some(DEFAULT_PORT))?;
        let max_ttl = u.take_duration("max_ttl", None)?;
        for p in NOT_FOR_REDLOCK {
            if u.take(p, &[])?.is_some() {
                return Err(Error::config(format!(
                    "the parameter {p} is not taken by redlock:// URLs"
                )));
            }
        }
        // An unknown parameter is refused here, against Redlock's own list: each node's
        // redis:// URL would refuse it too, but naming the single server's parameters (those
        // refused above among them, `max_ttl` not).
        for p in FOR_THE_NODES {
            u.take(p, &[])?;
        }
        u.finish("redlock", KNOWN)?;
        // Every node's URL is the same URL with one host and the redis scheme, so that each node
        // takes the parameters exactly as a redis:// URL does.
        let scheme = if u.scheme() == "redlocks" {
            "rediss"
        } else {
            "redis"
        };
        let after_scheme = url
            .split_once("://")
            .map(|(_, r)| r)
            .ok_or_else(|| Error::config("malformed redlock URL"))?;
        let auth_end = after_scheme
            .find(['/', '?', '#'])
            .unwrap_or(after_scheme.len());
        let (authority, rest) = after_scheme.split_at(auth_end);
        let userinfo = authority.rfind('@').map(|i| &authority[..=i]).unwrap_or("");
        let rest = strip_param(rest, "max_ttl");
        let mut nodes = Vec::with_capacity(hosts.len());
        for h in &hosts {
            let node_url = format!("{scheme}://{userinfo}{}:{}{rest}", h.host, h.port);
            nodes.push(RedisConfig::from_url(&node_url)?);
        }
        let mut cfg = Self::new(nodes);
        if let Some(t) = max_ttl {
            cfg.max_ttl = t;
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the node count, that no node is named twice, that each node is a valid single
    /// server config, and the `max_ttl`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming what is wrong.
    pub fn validate(&self) -> Result<()> {
        let n = self.nodes.len();
        if !(3..=MAX_REDLOCK_NODES).contains(&n) {
            return Err(Error::config(format!(
                "Redlock needs 3 to {MAX_REDLOCK_NODES} independent nodes (5 recommended), got {n}"
            )));
        }
        let mut seen = std::collections::HashSet::new();
        for (node, addr) in self.nodes.iter().zip(&self.addrs) {
            node.validate()?;
            if node.mode() != crate::RedisMode::Single || node.get_min_replicas() != 0 {
                return Err(Error::config(
                    "every Redlock node is a single master (no Sentinel, no min_replicas)",
                ));
            }
            if !seen.insert(addr.to_ascii_lowercase()) {
                return Err(Error::config(
                    "a Redlock node is named twice: the nodes must be independent",
                ));
            }
        }
        if self
            .nodes
            .iter()
            .any(|c| c.get_prefix() != self.get_prefix())
        {
            return Err(Error::config("every Redlock node must use the same prefix"));
        }
        if self.max_ttl < MIN_TTL || self.max_ttl > MAX_TTL {
            return Err(Error::config(format!(
                "max_ttl must be between {MIN_TTL:?} and {MAX_TTL:?}"
            )));
        }
        Ok(())
    }
}

lockkit_core::impl_url_config!(RedlockConfig);

/// `rest` (path, query, fragment of a URL) without the query parameter `name`.
fn strip_param(rest: &str, name: &str) -> String {
    let (before_frag, frag) = match rest.split_once('#') {
        Some((a, f)) => (a, Some(f)),
        None => (rest, None),
    };
    let (path, query) = match before_frag.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (before_frag, None),
    };
    let mut out = path.to_owned();
    if let Some(q) = query {
        let kept: Vec<&str> = q
            .split('&')
            .filter(|kv| kv.split('=').next() != Some(name))
            .collect();
        if !kept.is_empty() {
            out.push('?');
            out.push_str(&kept.join("&"));
        }
    }
    if let Some(f) = frag {
        out.push('#');
        out.push_str(f);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_give_one_node_config_per_host() {
        let c = RedlockConfig::from_url(
            "redlock://app:p%40ss@a:7000,b,[::1]:7002/3?prefix=p&max_ttl=20s&response_timeout=500ms",
        )
        .unwrap();
        assert_eq!(c.addrs, ["a:7000", "b:6379", "[::1]:7002"]);
        assert_eq!(c.quorum(), 2);
        assert_eq!(c.get_max_ttl(), Duration::from_secs(20));
        for n in c.nodes() {
            assert_eq!(n.get_prefix(), "p");
            assert_eq!(n.get_username(), Some("app"));
            assert_eq!(n.db_number(), 3);
            assert_eq!(n.get_response_timeout(), Duration::from_millis(500));
            assert!(!n.is_tls());
        }
        let dbg = format!("{c:?}");
        assert!(!dbg.contains("p@ss") && !dbg.contains("p%40ss"), "{dbg}");
        let five = RedlockConfig::from_url("redlock://h1,h2,h3,h4,h5").unwrap();
        assert_eq!(
            (five.quorum(), five.get_max_ttl()),
            (3, DEFAULT_REDLOCK_MAX_TTL)
        );
        assert_eq!(five.get_prefix(), crate::DEFAULT_PREFIX);
        let four = RedlockConfig::from_url("redlock://h1,h2,h3,h4").unwrap();
        assert_eq!(four.quorum(), 3);
        let tls = RedlockConfig::from_url("redlocks://h1,h2,h3?tls_ca=ca.pem#insecure").unwrap();
        assert!(tls.nodes().iter().all(RedisConfig::is_tls));
    }

    #[test]
    fn bad_urls_are_typed_errors_without_secrets() {
        for bad in [
            "",
            "redlock://",
            "redlock://h1",
            "redlock://h1,h2",
            "redlock://h1,h2,h1",
            "redlock://h1,h2,h3:6379,H3",
            "redlock://:hunter2@h1,h2,h3?max_ttl=0s",
            "redlock://:hunter2@h1,h2,h3?max_ttl=x",
            "redlock://:hunter2@h1,h2,h3?max_ttl=2d",
            "redlock://:hunter2@h1,h2,h3?notifications=off",
            "redlock://:hunter2@h1,h2,h3?strict=true",
            "redlock://:hunter2@h1,h2,h3?min_replicas=1",
            "redlock://:hunter2@h1,h2,h3?sentinel_password=x",
            "redlock://:hunter2@h1,h2,h3?prefx=a",
            "redlock://:hunter2@h1,h2,h3?prefix=a:b",
            "redlock://:hunter2@h1,h2,h3/x",
            "redlock://:hunter2@h1,h2,h3?tls_ca=ca.pem",
            "redlock://:hunter2@h1,h2,h3#insecure",
            "redis://h1,h2,h3",
            "redlock://h1,h2,h3,h4,h5,h6,h7,h8,h9,h10,h11,h12,h13,h14,h15,h16",
        ] {
            match RedlockConfig::from_url(bad) {
                Err(Error::InvalidConfig { reason, .. }) => {
                    assert!(!reason.contains("hunter2"), "secret echoed: {reason}")
                }
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        // A typo is told against Redlock's parameters, not a single server's.
        match RedlockConfig::from_url("redlock://h1,h2,h3?prefx=a") {
            Err(Error::InvalidConfig { reason, .. }) => {
                assert!(reason.contains("unknown redlock URL parameter"), "{reason}");
                assert!(reason.contains("max_ttl"), "{reason}");
                assert!(!reason.contains("strict"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        // The old spellings still reach the nodes.
        let old = RedlockConfig::from_url(
            "redlock://h1,h2,h3?connect_timeout_ms=1500&response_timeout_ms=700",
        )
        .unwrap();
        assert_eq!(old.nodes().len(), 3);
        let mixed = RedlockConfig::new([
            RedisConfig::new("a", 1).prefix("x"),
            RedisConfig::new("b", 1),
            RedisConfig::new("c", 1),
        ]);
        assert!(matches!(mixed.validate(), Err(Error::InvalidConfig { .. })));
    }

    #[test]
    fn strip_param_keeps_the_rest() {
        assert_eq!(
            strip_param("/2?max_ttl=1s&prefix=p#x", "max_ttl"),
            "/2?prefix=p#x"
        );
        assert_eq!(strip_param("?max_ttl=1s", "max_ttl"), "");
        assert_eq!(strip_param("", "max_ttl"), "");
    }
}
