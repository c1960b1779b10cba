//! Connection settings: from a `redis://`, `rediss://` or `redis+sentinel://` URL or built by
//! hand.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use lockkit_core::backend::{BackendUrl, TlsOptions, read_pem};
use lockkit_core::{Error, Result};
use redis::{
    ConnectionAddr, ConnectionInfo, IntoConnectionInfo, ProtocolVersion, RedisConnectionInfo,
};

use crate::error::from_redis;

/// The key prefix used when none is given: `lockkit`.
pub const DEFAULT_PREFIX: &str = "lockkit";

pub use lockkit_core::MAX_PREFIX_BYTES;

/// The port used when the URL names none: 6379.
pub const DEFAULT_PORT: u16 = 6379;

/// How long [`RedisLock::connect`](crate::RedisLock::connect) waits for the server by default: 5 s.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a command waits for its reply by default: 2 s.
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);

/// The port of a sentinel when a `redis+sentinel://` URL names none: 26379.
pub const DEFAULT_SENTINEL_PORT: u16 = 26379;

/// How long a replication-confirmed grant waits for its replicas by default
/// ([`RedisConfig::min_replicas`], URL parameter `replica_timeout`): 100 ms.
pub const DEFAULT_REPLICA_TIMEOUT: Duration = Duration::from_millis(100);

/// The most replicas a grant may ask to be confirmed by ([`RedisConfig::min_replicas`]): 64.
pub const MAX_MIN_REPLICAS: u32 = 64;

/// The largest PEM file (`tls_ca`, `tls_cert`, `tls_key`) read, in bytes: 1 MiB.
pub const MAX_CA_FILE_BYTES: u64 = lockkit_core::backend::MAX_PEM_BYTES;

/// lockkit-redis's URL parameters, for error messages.
const KNOWN: &[&str] = &[
    "prefix",
    "connect_timeout",
    "response_timeout",
    "tls_ca",
    "tls_cert",
    "tls_key",
    "protocol",
    "strict",
    "notifications",
    "min_replicas",
    "replica_timeout",
    "sentinel_username",
    "sentinel_password",
];

/// Which Redis deployment a [`RedisConfig`] talks to ([`RedisConfig::mode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RedisMode {
    /// One server named by host and port (`redis://`, `rediss://`).
    Single,
    /// The master of a service monitored by Redis Sentinel, discovered through the sentinels and
    /// discovered again after a failover (`redis+sentinel://`,
    /// <https://redis.io/docs/latest/operate/oss_and_stack/management/sentinel/>).
    Sentinel,
    /// A Redis Cluster, found through seed nodes (`redis+cluster://`): every key of one lock
    /// name lives in one hash slot, and each script goes to that slot's master
    /// (<https://redis.io/docs/latest/operate/oss_and_stack/reference/cluster-spec/>).
    Cluster,
}

impl RedisMode {
    /// The mode's name for people: `"single server"`, `"Sentinel"` or `"Cluster"` (what
    /// [`Guarantees::mode`](lockkit_core::Guarantees::mode) says, and `lockkit guarantees`
    /// shows).
    pub fn name(self) -> &'static str {
        match self {
            Self::Single => "single server",
            Self::Sentinel => "Sentinel",
            Self::Cluster => "Cluster",
        }
    }
}

/// The seed nodes of a [`RedisMode::Cluster`] config.
#[derive(Clone, Debug)]
pub(crate) struct ClusterSettings {
    /// Host and port of each seed node (any node of the cluster; the others are learned from
    /// `CLUSTER SLOTS`).
    pub(crate) nodes: Vec<(String, u16)>,
}

/// The sentinels of a [`RedisMode::Sentinel`] config and how to log in to them.
#[derive(Clone)]
pub(crate) struct SentinelSettings {
    /// Host and port of each sentinel.
    pub(crate) nodes: Vec<(String, u16)>,
    /// The service (master) name the sentinels monitor.
    pub(crate) service: String,
    /// `AUTH` user name for the sentinels (not the master's).
    pub(crate) username: Option<String>,
    /// `AUTH` password for the sentinels (not the master's).
    pub(crate) password: Option<String>,
}

/// Whether lockkit uses (and may turn on) the server's keyspace notifications, through which a
/// holder hears within milliseconds that its lock key was deleted, evicted or expired early
/// ([`RedisConfig::notifications`]; URL parameter `notifications=set|use|off`).
///
/// `notify-keyspace-events` is a server-wide setting: turning it on makes the server publish
/// keyspace events for every client of every database. [`Set`](Self::Set) is the default because
/// a holder that hears late is worse for a lock user; pick [`Use`](Self::Use) on a server you
/// share with others and do not want lockkit to reconfigure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Notifications {
    /// Add the flags lockkit needs (`K`, `g`, `x`, `e`) to `notify-keyspace-events` with
    /// `CONFIG SET` when they are missing (at connect and after a server restart), keeping the
    /// flags already set. The default.
    #[default]
    Set,
    /// Use the notifications if the server already sends them; never `CONFIG SET`.
    Use,
    /// Do not subscribe: holders hear of a lost key at their next renewal (within TTL/3).
    Off,
}

/// Where and how to reach Redis, and under which key prefix to keep the locks.
///
/// Build it from a URL with [`from_url`](Self::from_url) (or [`str::parse`]) or by hand with
/// [`new`](Self::new) and the chained setters, then pass it to
/// [`RedisLock::connect_with`](crate::RedisLock::connect_with). With the `serde` feature it
/// deserializes from its URL string.
///
/// ```
/// use std::time::Duration;
/// use lockkit_redis::RedisConfig;
///
/// let by_hand = RedisConfig::new("127.0.0.1", 6379)
///     .password("s3cret")
///     .prefix("billing")
///     .connect_timeout(Duration::from_secs(2));
/// let from_url: RedisConfig = "redis://:s3cret@127.0.0.1:6379/0?prefix=billing&connect_timeout=2s".parse()?;
/// assert_eq!(by_hand.get_prefix(), from_url.get_prefix());
/// assert_eq!(by_hand.get_connect_timeout(), from_url.get_connect_timeout());
/// // Debug never shows the password.
/// assert!(!format!("{by_hand:?}{from_url:?}").contains("s3cret"));
/// # Ok::<(), lockkit_core::Error>(())
/// ```
#[derive(Clone)]
pub struct RedisConfig {
    addr: ConnectionAddr,
    redis: RedisConnectionInfo,
    pub(crate) prefix: String,
    pub(crate) connect_timeout: Duration,
    pub(crate) response_timeout: Duration,
    pub(crate) tls_root_cert: Option<Vec<u8>>,
    /// `tls_ca`, `tls_cert`, `tls_key`: read when connecting.
    pub(crate) tls: TlsOptions,
    /// Refuse a server that may evict lock keys (see [`strict`](Self::strict)).
    pub(crate) strict: bool,
    /// Keyspace notifications (see [`notifications`](Self::notifications)).
    pub(crate) notifications: Notifications,
    /// The sentinels, in [`RedisMode::Sentinel`].
    pub(crate) sentinel: Option<SentinelSettings>,
    /// The seed nodes, in [`RedisMode::Cluster`].
    pub(crate) cluster: Option<ClusterSettings>,
    /// Replicas that must acknowledge a grant (`0`: no confirmation).
    pub(crate) min_replicas: u32,
    /// How long a grant waits for those acknowledgements.
    pub(crate) replica_timeout: Duration,
}

impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = &self.redis;
        let (host, port, tls) = match &self.addr {
            ConnectionAddr::Tcp(h, p) => (h.as_str(), *p, false),
            ConnectionAddr::TcpTls { host, port, .. } => (host.as_str(), *port, true),
            _ => ("(unix socket)", 0, false),
        };
        let mut d = f.debug_struct("RedisConfig");
        match &self.sentinel {
            None if self.cluster.is_some() => d.field("cluster_nodes", &self.get_cluster_nodes()),
            None => d.field("host", &host).field("port", &port),
            Some(s) => d
                .field("sentinels", &s.nodes)
                .field("service", &s.service)
                .field("sentinel_username", &s.username)
                .field(
                    "sentinel_password",
                    &s.password.as_ref().map(|_| "<hidden>"),
                ),
        };
        d.field("tls", &tls)
            .field("db", &r.db())
            .field("username", &r.username())
            .field("password", &r.password().map(|_| "<hidden>"))
            .field(
                "tls_root_cert",
                &self.tls_root_cert.as_ref().map(|_| "<set>"),
            )
            .field("tls_files", &self.tls)
            .field("prefix", &self.prefix)
            .field("connect_timeout", &self.connect_timeout)
            .field("response_timeout", &self.response_timeout)
            .field("strict", &self.strict)
            .field("notifications", &self.notifications)
            .field("min_replicas", &self.min_replicas)
            .field("replica_timeout", &self.replica_timeout)
            .finish()
    }
}

impl RedisConfig {
    /// Plain TCP to `host:port`, no password, database 0, prefix [`DEFAULT_PREFIX`].
    pub fn new(host: impl Into<String>, port: u16) -> Self {
        Self {
            addr: ConnectionAddr::Tcp(host.into(), port),
            redis: RedisConnectionInfo::default(),
            prefix: DEFAULT_PREFIX.to_owned(),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            response_timeout: DEFAULT_RESPONSE_TIMEOUT,
            tls_root_cert: None,
            tls: TlsOptions::default(),
            strict: false,
            notifications: Notifications::Set,
            sentinel: None,
            cluster: None,
            min_replicas: 0,
            replica_timeout: DEFAULT_REPLICA_TIMEOUT,
        }
    }

    /// The master of service `service`, found through the sentinels at `sentinels` (host, port):
    /// [`RedisMode::Sentinel`]. The master's credentials and database are set with
    /// [`username`](Self::username), [`password`](Self::password) and [`db`](Self::db), the
    /// sentinels' with [`sentinel_username`](Self::sentinel_username) and
    /// [`sentinel_password`](Self::sentinel_password). TLS is not supported in this mode:
    /// connecting with TLS settings fails with [`Error::NotSupported`].
    ///
    /// ```
    /// use lockkit_redis::{RedisConfig, RedisMode};
    ///
    /// let c = RedisConfig::sentinel([("10.0.0.1", 26379), ("10.0.0.2", 26379)], "locks")
    ///     .password("master-secret")
    ///     .sentinel_password("sentinel-secret")
    ///     .min_replicas(1);
    /// assert_eq!(c.mode(), RedisMode::Sentinel);
    /// let u: RedisConfig = "redis+sentinel://:master-secret@10.0.0.1,10.0.0.2/locks?sentinel_password=sentinel-secret&min_replicas=1".parse()?;
    /// assert_eq!((u.get_service_name(), u.get_min_replicas()), (Some("locks"), 1));
    /// let shown = format!("{c:?}{u:?}");
    /// assert!(!shown.contains("master-secret") && !shown.contains("sentinel-secret"));
    /// # Ok::<(), lockkit_core::Error>(())
    /// ```
    pub fn sentinel<S: Into<String>>(
        sentinels: impl IntoIterator<Item = (S, u16)>,
        service: impl Into<String>,
    ) -> Self {
        let nodes: Vec<(String, u16)> = sentinels.into_iter().map(|(h, p)| (h.into(), p)).collect();
        let first = nodes
            .first()
            .cloned()
            .unwrap_or_else(|| (String::new(), DEFAULT_SENTINEL_PORT));
        let mut cfg = Self::new(first.0, first.1);
        cfg.sentinel = Some(SentinelSettings {
            nodes,
            service: service.into(),
            username: None,
            password: None,
        });
        cfg
    }

    /// Sets the user name lockkit sends the sentinels with `AUTH` ([`RedisMode::Sentinel`]; URL
    /// parameter `sentinel_username`). The master's is [`username`](Self::username).
    pub fn sentinel_username(mut self, user: impl Into<String>) -> Self {
        if let Some(s) = &mut self.sentinel {
            s.username = Some(user.into());
        }
        self
    }

    /// Sets the password lockkit sends the sentinels with `AUTH` ([`RedisMode::Sentinel`]; URL
    /// parameter `sentinel_password`). The master's is [`password`](Self::password).
    pub fn sentinel_password(mut self, password: impl Into<String>) -> Self {
        if let Some(s) = &mut self.sentinel {
            s.password = Some(password.into());
        }
        self
    }

    /// Replication-confirmed grants (URL parameter `min_replicas`; default 0, off; at most
    /// [`MAX_MIN_REPLICAS`]): every grant is followed by `WAIT n replica_timeout`
    /// (<https://redis.io/docs/latest/commands/wait/>); if fewer than `n` replicas acknowledged
    /// it within [`replica_timeout`](Self::replica_timeout), the grant is given back and the
    /// attempt fails with [`Error::Unavailable`] whose source is a
    /// [`NotReplicated`](crate::NotReplicated) (retried while the acquire may wait). See the crate
    /// docs, "Replication-confirmed grants", for what this does and does not prevent.
    pub fn min_replicas(mut self, n: u32) -> Self {
        self.min_replicas = n;
        self
    }

    /// How long a replication-confirmed grant waits for its replicas (URL parameter
    /// `replica_timeout`; default [`DEFAULT_REPLICA_TIMEOUT`], 100 ms; whole milliseconds,
    /// rounded up; less than the response timeout).
    pub fn replica_timeout(mut self, timeout: Duration) -> Self {
        self.replica_timeout = timeout;
        self
    }

    /// Single server, Sentinel or Cluster.
    pub fn mode(&self) -> RedisMode {
        if self.sentinel.is_some() {
            RedisMode::Sentinel
        } else if self.cluster.is_some() {
            RedisMode::Cluster
        } else {
            RedisMode::Single
        }
    }

    /// The Sentinel service name ([`RedisMode::Sentinel`]), else `None`.
    pub fn get_service_name(&self) -> Option<&str> {
        self.sentinel.as_ref().map(|s| s.service.as_str())
    }

    /// The sentinels' addresses (host, port); empty for [`RedisMode::Single`].
    pub fn get_sentinels(&self) -> &[(String, u16)] {
        self.sentinel.as_ref().map_or(&[], |s| s.nodes.as_slice())
    }

    /// The number of replicas that must acknowledge a grant (0: off).
    pub fn get_min_replicas(&self) -> u32 {
        self.min_replicas
    }

    /// How long a grant waits for its replicas' acknowledgements.
    pub fn get_replica_timeout(&self) -> Duration {
        self.replica_timeout
    }

    /// Parses a Redis URL, by the grammar all lockkit backends share
    /// ([`BackendUrl`](lockkit_core::backend::BackendUrl)):
    /// `redis[s]://[[user]:password@]host[:port][/db][?param=value&…][#insecure]`.
    ///
    /// | parameter | meaning | default | old spelling (alias) |
    /// |---|---|---|---|
    /// | `prefix` | key prefix | `lockkit` | |
    /// | `connect_timeout` | duration (`500ms`, `2s`, bare seconds) | `5s` | `connect_timeout_ms` |
    /// | `response_timeout` | duration a command waits for its reply | `2s` | `response_timeout_ms` |
    /// | `tls_ca` | PEM root certificate(s) to trust instead of the system's (`rediss` only) | system roots | `tls_ca_file` |
    /// | `tls_cert`, `tls_key` | PEM client certificate and key for mutual TLS (`rediss` only) | none | |
    /// | `protocol` | `resp2` / `resp3` (or `2` / `3`) | `resp2` | |
    /// | `strict` | `true`: refuse a server that may evict lock keys (see [`strict`](Self::strict)) | `false` (a warning) | |
    /// | `notifications` | `set` / `use` / `off`: keyspace notifications for loss notices (see [`Notifications`]) | `set` | |
    ///
    /// The `#insecure` fragment (`rediss` only) skips certificate verification altogether. The
    /// database goes in the path (`/3`), not in `?db=3`. Any other parameter is an error (a typo
    /// such as `prefx=` must not silently fall back to the default prefix).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a URL that does not parse, a scheme other than `redis` or
    /// `rediss`, a missing host or more than one, a bad or negative database number, an unknown
    /// or repeated query parameter, a bad `prefix` (see [`prefix`](Self::prefix)) or timeout,
    /// TLS parameters on a `redis://` URL, `tls_server_name` (the redis crate verifies against
    /// the host), or `rediss` when the crate was built without its `tls` feature. The URL is
    /// never echoed in the error (it may carry a password). [`Error::NotSupported`] for
    /// `rediss+sentinel://` (TLS in Sentinel mode is not supported yet).
    pub fn from_url(url: &str) -> Result<Self> {
        if url
            .get(..SENTINEL_TLS_SCHEME.len())
            .is_some_and(|s| s.eq_ignore_ascii_case(SENTINEL_TLS_SCHEME))
        {
            return Err(sentinel_tls());
        }
        let mut u = BackendUrl::parse(
            url,
            &[
                "redis",
                "rediss",
                "redis+sentinel",
                "redis+cluster",
                "rediss+cluster",
            ],
        )?;
        if u.scheme() == "redis+cluster" || u.scheme() == "rediss+cluster" {
            return Self::from_cluster_url(u);
        }
        let sentinel = u.scheme() == "redis+sentinel";
        let tls = u.scheme() == "rediss";
        if tls && !cfg!(feature = "tls") {
            return Err(Error::config(
                "rediss:// needs lockkit-redis's Cargo feature \"tls\" (on by default)",
            ));
        }
        let insecure = match u.fragment() {
            None => false,
            Some("insecure") if tls => true,
            Some(_) => {
                return Err(Error::config(
                    "the only URL fragment a redis URL takes is #insecure, on rediss://",
                ));
            }
        };
        let hosts = u.host_list(Some(if sentinel {
            DEFAULT_SENTINEL_PORT
        } else {
            DEFAULT_PORT
        }))?;
        if hosts.len() != 1 && !sentinel {
            return Err(Error::config(
                "a redis URL names exactly one host (several sentinels: redis+sentinel://)",
            ));
        }
        let host = hosts[0].clone();
        let path = u.path().trim_end_matches('/');
        let (service, path) = if sentinel {
            let rest = path.strip_prefix('/').unwrap_or(path);
            let (service, db) = match rest.split_once('/') {
                Some((s, db)) => (s, format!("/{db}")),
                None => (rest, String::new()),
            };
            let service = url::form_urlencoded::parse(format!("s={service}").as_bytes())
                .next()
                .map(|(_, v)| v.into_owned())
                .unwrap_or_default();
            if service.is_empty() {
                return Err(Error::config(
                    "a redis+sentinel URL names the service: redis+sentinel://host:26379/SERVICE[/db]",
                ));
            }
            (Some(service), db)
        } else {
            (None, path.to_owned())
        };
        let db = match path.as_str() {
            "" => 0,
            p => match p[1..].parse::<i64>() {
                Ok(n) if n >= 0 && p[1..].bytes().all(|b| b.is_ascii_digit()) => n,
                _ => {
                    return Err(Error::config(
                        "the path of a redis URL is the database number (/0, /1, …)",
                    ));
                }
            },
        };
        let common = u.take_common([&["tls_ca_file"], &[], &[]])?;
        let response_timeout = u.take_duration("response_timeout", Some("response_timeout_ms"))?;
        let protocol = match u.take("protocol", &[])?.as_deref() {
            None | Some("2" | "resp2") => ProtocolVersion::RESP2,
            Some("3" | "resp3") => ProtocolVersion::RESP3,
            Some(_) => return Err(Error::config("protocol must be resp2 or resp3")),
        };
        let strict = u.take_bool("strict")?;
        let (min_replicas, replica_timeout) = take_replicas(&mut u)?;
        let sentinel_username = u.take("sentinel_username", &[])?;
        let sentinel_password = u.take("sentinel_password", &[])?;
        if !sentinel && (sentinel_username.is_some() || sentinel_password.is_some()) {
            return Err(Error::config(
                "sentinel_username and sentinel_password belong to redis+sentinel:// URLs",
            ));
        }
        let notifications = match u.take("notifications", &[])?.as_deref() {
            None | Some("set") => Notifications::Set,
            Some("use") => Notifications::Use,
            Some("off") => Notifications::Off,
            Some(_) => return Err(Error::config("notifications must be set, use or off")),
        };
        if u.take("db", &[])?.is_some() {
            return Err(Error::config(
                "unknown redis URL parameter \"db\": the database goes in the path (redis://host:6379/3)",
            ));
        }
        u.finish("redis", KNOWN)?;
        let mut redis = RedisConnectionInfo::default()
            .set_db(db)
            .set_protocol(protocol);
        if let Some(user) = u.username() {
            redis = redis.set_username(user);
        }
        if let Some(pw) = u.password().filter(|p| !p.is_empty()) {
            redis = redis.set_password(pw);
        }
        let mut cfg = match service {
            Some(service) => {
                let mut c = Self::sentinel(hosts.into_iter().map(|h| (h.host, h.port)), service);
                if let Some(s) = &mut c.sentinel {
                    s.username = sentinel_username.filter(|u| !u.is_empty());
                    s.password = sentinel_password.filter(|p| !p.is_empty());
                }
                c
            }
            None => Self::new(host.host, host.port),
        };
        if tls {
            let ConnectionAddr::Tcp(host, port) = cfg.addr else {
                unreachable!("new() builds a TCP address")
            };
            cfg.addr = ConnectionAddr::TcpTls {
                host,
                port,
                insecure,
                tls_params: None,
            };
        }
        cfg.redis = redis;
        if let Some(p) = common.prefix {
            cfg.prefix = p;
        }
        cfg.connect_timeout = common.connect_timeout.unwrap_or(DEFAULT_CONNECT_TIMEOUT);
        cfg.response_timeout = response_timeout.unwrap_or(DEFAULT_RESPONSE_TIMEOUT);
        cfg.tls = common.tls;
        cfg.strict = strict.unwrap_or(false);
        cfg.notifications = notifications;
        cfg.min_replicas = min_replicas;
        cfg.replica_timeout = replica_timeout.unwrap_or(DEFAULT_REPLICA_TIMEOUT);
        cfg.validate()?;
        Ok(cfg)
    }

    /// Uses TLS (`rediss`), verifying the server's certificate against the system's roots.
    /// Requires the crate feature `tls` (on by default); without it, connecting fails with
    /// [`Error::InvalidConfig`].
    pub fn tls(mut self, on: bool) -> Self {
        let (host, port) = match &self.addr {
            ConnectionAddr::Tcp(h, p) => (h.clone(), *p),
            ConnectionAddr::TcpTls { host, port, .. } => (host.clone(), *port),
            _ => return self,
        };
        let addr = if on {
            ConnectionAddr::TcpTls {
                host,
                port,
                insecure: false,
                tls_params: None,
            }
        } else {
            ConnectionAddr::Tcp(host, port)
        };
        self.addr = addr;
        self
    }

    /// Uses TLS and trusts the root certificate(s) in `pem` (PEM format) instead of the system's:
    /// for servers with a private CA or a self-signed certificate.
    pub fn tls_root_cert_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls_root_cert = Some(pem.into());
        self.tls(true)
    }

    /// Uses TLS and trusts the root certificate(s) in the PEM file at `path` instead of the
    /// system's (URL parameter `tls_ca`). The file is read when connecting, within the connect
    /// timeout; it must be a regular file of at most [`MAX_CA_FILE_BYTES`] (1 MiB).
    pub fn tls_ca(mut self, path: impl Into<PathBuf>) -> Self {
        self.tls = std::mem::take(&mut self.tls).with_ca(path);
        self.tls(true)
    }

    /// The old name of [`tls_ca`](Self::tls_ca).
    pub fn tls_ca_file(self, path: impl Into<PathBuf>) -> Self {
        self.tls_ca(path)
    }

    /// Uses TLS and presents the client certificate in the PEM file `cert` with its private key
    /// in `key` (mutual TLS; URL parameters `tls_cert`, `tls_key`). Both are read when
    /// connecting, like [`tls_ca`](Self::tls_ca).
    pub fn tls_client_cert(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.tls = std::mem::take(&mut self.tls).with_client_cert(cert, key);
        self.tls(true)
    }

    /// The TLS files configured (`tls_ca`, `tls_cert`, `tls_key`).
    pub fn get_tls(&self) -> &TlsOptions {
        &self.tls
    }

    /// Whether TLS is on (`rediss`).
    pub fn is_tls(&self) -> bool {
        matches!(self.addr, ConnectionAddr::TcpTls { .. })
    }

    /// The redis crate's client for this configuration's server (TLS files read within the
    /// connect timeout); it connects nothing yet.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for TLS files that cannot be read or used, or TLS without the
    /// `tls` feature; [`Error::Unavailable`] if reading the files takes over the connect timeout.
    pub(crate) async fn client(&self) -> Result<redis::Client> {
        let ct = self.connect_timeout;
        let files = match tokio::time::timeout(ct, self.tls_files()).await {
            Ok(r) => r?,
            Err(_) => return Err(crate::error::timed_out("reading the TLS files", ct)),
        };
        match files {
            TlsFiles {
                root: None,
                client: None,
            } => redis::Client::open(self.connection_info()?),
            #[cfg(feature = "tls")]
            TlsFiles { root, client } => redis::Client::build_with_tls(
                self.connection_info()?,
                redis::TlsCertificates {
                    client_tls: client.map(|(client_cert, client_key)| redis::ClientTlsConfig {
                        client_cert,
                        client_key,
                    }),
                    root_cert: root,
                },
            ),
            #[cfg(not(feature = "tls"))]
            _ => {
                return Err(Error::config(
                    "TLS needs lockkit-redis's Cargo feature \"tls\" (on by default)",
                ));
            }
        }
        .map_err(|e| Error::config_with("cannot use the TLS files (tls_ca, tls_cert, tls_key)", e))
    }

    /// Reads the root certificate (given as PEM, or `tls_ca`) and the client certificate and key,
    /// if set.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if a file is missing, not a regular file (a FIFO or a device
    /// would block), larger than [`MAX_CA_FILE_BYTES`] or unreadable. The message names the
    /// parameter, never the file's contents.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub(crate) async fn tls_files(&self) -> Result<TlsFiles> {
        let root = match (&self.tls_root_cert, &self.tls.ca) {
            (Some(pem), _) => Some(pem.clone()),
            (None, Some(path)) => Some(read_pem(path, "tls_ca").await?),
            (None, None) => None,
        };
        let client = match (&self.tls.cert, &self.tls.key) {
            (Some(c), Some(k)) => Some((
                read_pem(c, "tls_cert").await?,
                read_pem(k, "tls_key").await?,
            )),
            _ => None,
        };
        Ok(TlsFiles { root, client })
    }

    /// Sets the user name for `AUTH` (Redis 6 ACL users).
    pub fn username(mut self, user: impl AsRef<str>) -> Self {
        self.redis = self.redis.set_username(user);
        self
    }

    /// Sets the password for `AUTH`.
    pub fn password(mut self, password: impl AsRef<str>) -> Self {
        self.redis = self.redis.set_password(password);
        self
    }

    /// Selects the logical database (default 0; a number the server does not have fails the
    /// connect with [`Error::InvalidConfig`]). Note that pub/sub channels, which wake waiters,
    /// are shared by all databases of a server; the prefix keeps them apart.
    pub fn db(mut self, db: i64) -> Self {
        self.redis = self.redis.set_db(db);
        self
    }

    /// Sets the key prefix (default [`DEFAULT_PREFIX`]). It must be 1 to [`MAX_PREFIX_BYTES`]
    /// bytes with no `:`, no `/` and no control characters; this is checked when connecting.
    ///
    /// Without `:` in the prefix, the first `:` of every key ends the prefix, so two prefixes
    /// never share a key (see the crate docs, "Keys").
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The key prefix.
    pub fn get_prefix(&self) -> &str {
        &self.prefix
    }

    /// The connect timeout.
    pub fn get_connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// The response timeout.
    pub fn get_response_timeout(&self) -> Duration {
        self.response_timeout
    }

    /// The user name, if set.
    pub fn get_username(&self) -> Option<&str> {
        self.redis.username()
    }

    /// How long connecting may take before it fails with [`Error::Unavailable`]
    /// (default [`DEFAULT_CONNECT_TIMEOUT`], 5 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long a command may wait for its reply before it fails with [`Error::Unavailable`]
    /// (default [`DEFAULT_RESPONSE_TIMEOUT`], 2 s).
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// Refuses, at connect, a server configured so that it may free locks behind their holders'
    /// backs (URL parameter `strict=true`; default `false`): a nonzero `maxmemory` with any
    /// `maxmemory-policy` but `noeviction` (the `volatile-*` policies evict keys with a TTL,
    /// which every lock key has; <https://redis.io/docs/latest/develop/reference/eviction/>), or
    /// a policy that cannot be read (`CONFIG` and `INFO memory` both refused). Connecting then
    /// fails with [`Error::InvalidConfig`] naming the policy. Without `strict` such a server is
    /// used, with a warning logged (`tracing`, at connect).
    ///
    /// Keyspace notifications are not part of it: without them a holder hears of a lost key at
    /// its next renewal instead of within milliseconds, which
    /// [`Guarantees::loss_notice`](lockkit_core::Guarantees::loss_notice) tells.
    pub fn strict(mut self, on: bool) -> Self {
        self.strict = on;
        self
    }

    /// Sets whether lockkit uses, and may turn on, the server's keyspace notifications (URL
    /// parameter `notifications=set|use|off`; default [`Notifications::Set`]).
    pub fn notifications(mut self, mode: Notifications) -> Self {
        self.notifications = mode;
        self
    }

    /// The [`Notifications`] mode.
    pub fn notifications_mode(&self) -> Notifications {
        self.notifications
    }

    /// Whether [`strict`](Self::strict) is on.
    pub fn is_strict(&self) -> bool {
        self.strict
    }

    /// The database number.
    pub(crate) fn db_number(&self) -> i64 {
        self.redis.db()
    }

    /// The master's `AUTH`, database and protocol settings.
    pub(crate) fn redis_settings(&self) -> &RedisConnectionInfo {
        &self.redis
    }

    /// The redis crate's connection settings.
    pub(crate) fn connection_info(&self) -> Result<ConnectionInfo> {
        Ok(self
            .addr
            .clone()
            .into_connection_info()
            .map_err(from_redis)?
            .set_redis_settings(self.redis.clone()))
    }

    /// Checks the prefix, the timeouts and the TLS settings.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming what is wrong.
    pub fn validate(&self) -> Result<()> {
        validate_prefix(&self.prefix)?;
        if self.redis.db() < 0 {
            return Err(Error::config("the database number is negative"));
        }
        if (self.tls_root_cert.is_some() || self.tls.is_set()) && !self.is_tls() {
            return Err(Error::config(
                "TLS parameters (tls_ca, tls_cert, tls_key) are set but TLS is off (use rediss://)",
            ));
        }
        if self.tls.server_name.is_some() {
            return Err(Error::config(
                "tls_server_name is not supported by the redis backend: the certificate is \
                 verified against the URL's host",
            ));
        }
        self.tls.validate()?;
        self.validate_cluster()?;
        if let Some(s) = &self.sentinel {
            if s.nodes.is_empty() || s.nodes.iter().any(|(h, _)| h.is_empty()) {
                return Err(Error::config(
                    "Sentinel mode needs at least one sentinel host",
                ));
            }
            if s.service.is_empty() || s.service.chars().any(char::is_control) {
                return Err(Error::config(
                    "the Sentinel service name is empty or has control characters",
                ));
            }
            if self.is_tls() || self.tls_root_cert.is_some() || self.tls.is_set() {
                return Err(sentinel_tls());
            }
        }
        if self.min_replicas > MAX_MIN_REPLICAS {
            return Err(Error::config(format!(
                "min_replicas is larger than {MAX_MIN_REPLICAS}"
            )));
        }
        if self.min_replicas > 0
            && (self.replica_timeout.is_zero() || self.replica_timeout >= self.response_timeout)
        {
            return Err(Error::config(
                "replica_timeout must be more than zero and less than the response timeout",
            ));
        }
        for (what, d) in [
            ("connect timeout", self.connect_timeout),
            ("response timeout", self.response_timeout),
        ] {
            if d.is_zero() {
                return Err(Error::config(format!("{what} is zero")));
            }
        }
        Ok(())
    }
}

/// The `min_replicas` and `replica_timeout` parameters of a URL (checked further by
/// [`RedisConfig::validate`]).
fn take_replicas(u: &mut BackendUrl) -> Result<(u32, Option<Duration>)> {
    let min_replicas = match u.take("min_replicas", &[])? {
        None => 0,
        Some(n) => n
            .parse::<u32>()
            .ok()
            .filter(|_| n.bytes().all(|b| b.is_ascii_digit()))
            .ok_or_else(|| Error::config("min_replicas must be a whole number"))?,
    };
    Ok((min_replicas, u.take_duration("replica_timeout", None)?))
}

/// Redis Cluster ([`RedisMode::Cluster`]).
impl RedisConfig {
    /// A Redis Cluster reached through the seed nodes `nodes` (host, port; any nodes of the
    /// cluster, the rest are learned from it): [`RedisMode::Cluster`]. Credentials with
    /// [`username`](Self::username) and [`password`](Self::password) (the same on every node).
    /// TLS with [`tls`](Self::tls), [`tls_ca`](Self::tls_ca) and
    /// [`tls_client_cert`](Self::tls_client_cert) (URL: `rediss+cluster://`), the same settings
    /// for every node. Not supported in this mode (refused by [`validate`](Self::validate)): a
    /// database other than 0 (a cluster has only database 0), and a prefix with `{` or `}` (it
    /// would change the keys' hash tag).
    ///
    /// ```
    /// use lockkit_redis::{RedisConfig, RedisMode};
    ///
    /// let c = RedisConfig::cluster([("10.0.0.1", 7000), ("10.0.0.2", 7000)]).password("s3cret");
    /// assert_eq!(c.mode(), RedisMode::Cluster);
    /// let u: RedisConfig = "redis+cluster://:s3cret@10.0.0.1:7000,10.0.0.2:7000?prefix=app".parse()?;
    /// assert_eq!(u.get_cluster_nodes(), c.get_cluster_nodes());
    /// assert!(!format!("{c:?}{u:?}").contains("s3cret"));
    /// # Ok::<(), lockkit_core::Error>(())
    /// ```
    pub fn cluster<S: Into<String>>(nodes: impl IntoIterator<Item = (S, u16)>) -> Self {
        let nodes: Vec<(String, u16)> = nodes.into_iter().map(|(h, p)| (h.into(), p)).collect();
        let first = nodes
            .first()
            .cloned()
            .unwrap_or_else(|| (String::new(), DEFAULT_PORT));
        let mut cfg = Self::new(first.0, first.1);
        cfg.cluster = Some(ClusterSettings { nodes });
        cfg
    }

    /// The seed nodes (host, port) of a [`RedisMode::Cluster`] config; empty otherwise.
    pub fn get_cluster_nodes(&self) -> &[(String, u16)] {
        self.cluster.as_ref().map_or(&[], |c| c.nodes.as_slice())
    }

    /// `redis[s]+cluster://[[user]:password@]host[:port][,host[:port]…][/0][?param=value&…][#insecure]`:
    /// the parameters of `redis://` (see [`from_url`](Self::from_url)), the TLS ones on
    /// `rediss+cluster://` only.
    fn from_cluster_url(mut u: BackendUrl) -> Result<Self> {
        let tls = u.scheme() == "rediss+cluster";
        if tls && !cfg!(feature = "tls") {
            return Err(Error::config(
                "rediss+cluster:// needs lockkit-redis's Cargo feature \"tls\" (on by default)",
            ));
        }
        let insecure = match u.fragment() {
            None => false,
            Some("insecure") if tls => true,
            Some(_) => {
                return Err(Error::config(
                    "the only URL fragment a redis+cluster URL takes is #insecure, on \
                     rediss+cluster://",
                ));
            }
        };
        let hosts = u.host_list(Some(DEFAULT_PORT))?;
        match u.path().trim_end_matches('/') {
            "" | "/0" => {}
            _ => {
                return Err(Error::config(
                    "a redis+cluster URL has no path but /0: a cluster has only database 0",
                ));
            }
        }
        let common = u.take_common([&["tls_ca_file"], &[], &[]])?;
        if common.tls.is_set() && !tls {
            return Err(Error::config(
                "tls_ca, tls_cert and tls_key belong to rediss+cluster:// URLs",
            ));
        }
        let response_timeout = u.take_duration("response_timeout", Some("response_timeout_ms"))?;
        let protocol = match u.take("protocol", &[])?.as_deref() {
            None | Some("2" | "resp2") => ProtocolVersion::RESP2,
            Some("3" | "resp3") => ProtocolVersion::RESP3,
            Some(_) => return Err(Error::config("protocol must be resp2 or resp3")),
        };
        let strict = u.take_bool("strict")?;
        let notifications = match u.take("notifications", &[])?.as_deref() {
            None | Some("off") => Notifications::Off,
            Some(_) => {
                return Err(Error::config(
                    "Cluster mode uses no keyspace notifications yet: notifications=off or none",
                ));
            }
        };
        let (min_replicas, replica_timeout) = take_replicas(&mut u)?;
        u.finish(
            "redis+cluster",
            &[
                "prefix",
                "connect_timeout",
                "response_timeout",
                "protocol",
                "strict",
                "notifications",
                "min_replicas",
                "replica_timeout",
            ],
        )?;
        let mut cfg = Self::cluster(hosts.into_iter().map(|h| (h.host, h.port)));
        if tls {
            cfg = cfg.tls(true);
            if let ConnectionAddr::TcpTls { insecure: i, .. } = &mut cfg.addr {
                *i = insecure;
            }
        }
        let mut redis = RedisConnectionInfo::default().set_protocol(protocol);
        if let Some(user) = u.username() {
            redis = redis.set_username(user);
        }
        if let Some(pw) = u.password().filter(|p| !p.is_empty()) {
            redis = redis.set_password(pw);
        }
        cfg.redis = redis;
        if let Some(p) = common.prefix {
            cfg.prefix = p;
        }
        cfg.connect_timeout = common.connect_timeout.unwrap_or(DEFAULT_CONNECT_TIMEOUT);
        cfg.response_timeout = response_timeout.unwrap_or(DEFAULT_RESPONSE_TIMEOUT);
        cfg.strict = strict.unwrap_or(false);
        cfg.notifications = notifications;
        cfg.min_replicas = min_replicas;
        cfg.replica_timeout = replica_timeout.unwrap_or(DEFAULT_REPLICA_TIMEOUT);
        cfg.tls = common.tls;
        cfg.validate()?;
        Ok(cfg)
    }

    /// The Cluster mode's part of [`validate`](Self::validate).
    fn validate_cluster(&self) -> Result<()> {
        let Some(c) = &self.cluster else {
            return Ok(());
        };
        let reason = if c.nodes.is_empty() || c.nodes.iter().any(|(h, _)| h.is_empty()) {
            "Cluster mode needs at least one seed node"
        } else if self.sentinel.is_some() {
            "a config is either Sentinel or Cluster"
        } else if self.redis.db() != 0 {
            "a Redis Cluster has only database 0"
        } else if self.prefix.contains(['{', '}']) {
            "in Cluster mode the key prefix may not contain '{' or '}' (the keys' hash tag)"
        } else {
            return Ok(());
        };
        Err(Error::config(reason))
    }

    /// The seed nodes as the redis crate's connection settings (with the credentials).
    pub(crate) fn cluster_node_infos(&self) -> Result<Vec<ConnectionInfo>> {
        self.get_cluster_nodes()
            .iter()
            .map(|(h, p)| {
                let addr = match &self.addr {
                    ConnectionAddr::TcpTls { insecure, .. } => ConnectionAddr::TcpTls {
                        host: h.clone(),
                        port: *p,
                        insecure: *insecure,
                        tls_params: None,
                    },
                    _ => ConnectionAddr::Tcp(h.clone(), *p),
                };
                Ok(addr
                    .into_connection_info()
                    .map_err(from_redis)?
                    .set_redis_settings(self.redis.clone()))
            })
            .collect()
    }
}

lockkit_core::impl_url_config!(RedisConfig);

/// The error of a failed first connection: a refused certificate is [`Error::Auth`]
/// ([`tls_failure`](lockkit_core::backend::tls_failure)), the rest as [`from_redis`].
pub(crate) fn connect_error(e: redis::RedisError) -> Error {
    #[cfg(feature = "tls")]
    if let Some(f) = lockkit_core::backend::tls_failure(&e) {
        return f.into_error(crate::error::BACKEND, e.into());
    }
    from_redis(e)
}

/// PEM contents read at connect time.
pub(crate) struct TlsFiles {
    pub(crate) root: Option<Vec<u8>>,
    /// Client certificate chain and key.
    pub(crate) client: Option<(Vec<u8>, Vec<u8>)>,
}

/// Checks a key prefix: the rules of [`lockkit_core::backend::validate_prefix`] (1 to
/// [`MAX_PREFIX_BYTES`] bytes, no `/`, no control characters), and no `:`.
///
/// # Errors
/// [`Error::InvalidConfig`] with the reason.
pub fn validate_prefix(prefix: &str) -> Result<()> {
    if prefix.contains(':') {
        return Err(Error::config(
            "key prefix contains ':' (it separates the prefix from the rest of the key)",
        ));
    }
    lockkit_core::backend::validate_prefix(prefix)
}

/// The scheme a TLS Sentinel URL would have.
const SENTINEL_TLS_SCHEME: &str = "rediss+sentinel://";

/// TLS in Sentinel mode (a `rediss+sentinel://` URL, or TLS settings on a
/// [`RedisConfig::sentinel`] config) is not supported yet: the redis crate's [`Sentinel`] takes
/// custom CA and client certificates only through its `SentinelClientBuilder`, which hides the
/// sentinels' connections that the `+switch-master` subscription needs.
///
/// [`Sentinel`]: redis::sentinel::Sentinel
fn sentinel_tls() -> Error {
    Error::NotSupported {
        operation: "TLS in Sentinel mode (rediss+sentinel://)",
        backend: crate::error::BACKEND,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_parsing_strips_our_params_and_hides_the_password() {
        let c = RedisConfig::from_url(
            "redis://user:p%40ss@localhost:7000/3?prefix=app&connect_timeout_ms=250&protocol=resp3",
        )
        .unwrap();
        assert_eq!(c.prefix, "app");
        assert_eq!(c.connect_timeout, Duration::from_millis(250));
        assert_eq!(c.redis.password(), Some("p@ss"));
        assert_eq!(c.redis.username(), Some("user"));
        assert_eq!(c.redis.db(), 3);
        let dbg = format!("{c:?}");
        assert!(!dbg.contains("p@ss") && !dbg.contains("p%40ss"), "{dbg}");
        assert!(dbg.contains("<hidden>"));
    }

    #[test]
    fn bad_urls_and_prefixes() {
        for bad in [
            "",
            "not a url",
            "http://localhost",
            "redis://",
            "redis://localhost/notadb",
            "redis://localhost?prefix=",
            "redis://localhost?prefix=a:b",
            "redis://localhost?prefix=a/b",
            "redis://localhost?prefix=a%00b",
            "redis://localhost?connect_timeout_ms=0",
            "redis://localhost?connect_timeout_ms=x",
            "redis://localhost?tls_ca_file=/etc/hostname",
            "redis://localhost?prefx=a",
            "redis://localhost?db=3",
            "redis://localhost?prefix=a&prefix=b",
            "redis://localhost/-1",
            "redis://localhost/+1",
            "redis://localhost:+1",
            "redis://a,b",
            "redis://localhost#insecure",
            "rediss://localhost#other",
            "redis://localhost?protocol=4",
            "rediss://localhost?tls_cert=c.pem",
            "rediss://localhost?tls_server_name=x",
            "rediss://localhost?tls_ca=a&tls_ca_file=b",
            "redis://localhost?connect_timeout=1s&connect_timeout_ms=5",
            "redis://app:123?hunter2@localhost",
        ] {
            match RedisConfig::from_url(bad) {
                Err(Error::InvalidConfig { reason, .. }) => {
                    assert!(!reason.contains("localhost"), "URL echoed: {reason}")
                }
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        let tls_off = RedisConfig::new("localhost", 6379)
            .tls_root_cert_pem("pem")
            .tls(false);
        assert!(matches!(
            tls_off.validate(),
            Err(Error::InvalidConfig { .. })
        ));
        let long = format!("redis://localhost?prefix={}", "p".repeat(65));
        assert!(RedisConfig::from_url(&long).is_err());
        let c = RedisConfig::from_url(
            "rediss://localhost?tls_ca_file=ca.pem&tls_cert=c.pem&tls_key=k.pem&connect_timeout=750ms&response_timeout=1.5",
        )
        .unwrap();
        assert_eq!(
            c.get_tls().ca.as_deref(),
            Some(std::path::Path::new("ca.pem"))
        );
        assert_eq!(c.get_connect_timeout(), Duration::from_millis(750));
        assert_eq!(c.get_response_timeout(), Duration::from_millis(1500));
        assert!(!c.is_strict());
        let strict = RedisConfig::from_url("redis://localhost?strict=true").unwrap();
        assert!(strict.is_strict() && format!("{strict:?}").contains("strict: true"));
        assert!(RedisConfig::from_url("redis://localhost?strict=maybe").is_err());
        assert_eq!(c.notifications_mode(), Notifications::Set);
        for (v, mode) in [
            ("set", Notifications::Set),
            ("use", Notifications::Use),
            ("off", Notifications::Off),
        ] {
            let c = RedisConfig::from_url(&format!("redis://localhost?notifications={v}")).unwrap();
            assert_eq!(c.notifications_mode(), mode);
        }
        assert!(RedisConfig::from_url("redis://localhost?notifications=yes").is_err());
        let secret = "redis://:hunter2@localhost/x";
        let e = RedisConfig::from_url(secret).unwrap_err();
        assert!(!format!("{e:?} {e}").contains("hunter2"));
    }

    #[test]
    fn sentinel_urls_keep_the_two_sets_of_credentials_apart() {
        let c = RedisConfig::from_url(
            "redis+sentinel://app:m%40ster@s1:5000,s2,[::1]:5002/my%20svc/3?sentinel_username=sen&sentinel_password=s3nt&min_replicas=2&replica_timeout=250ms&prefix=p",
        )
        .unwrap();
        assert_eq!(c.mode(), RedisMode::Sentinel);
        assert_eq!(c.get_service_name(), Some("my svc"));
        let hosts: Vec<(&str, u16)> = c
            .get_sentinels()
            .iter()
            .map(|(h, p)| (h.as_str(), *p))
            .collect();
        assert_eq!(
            hosts,
            [("s1", 5000), ("s2", DEFAULT_SENTINEL_PORT), ("[::1]", 5002)]
        );
        // The user info is the master's; the parameters are the sentinels'.
        assert_eq!(c.redis.username(), Some("app"));
        assert_eq!(c.redis.password(), Some("m@ster"));
        assert_eq!(c.redis.db(), 3);
        let s = c.sentinel.as_ref().unwrap();
        assert_eq!(s.username.as_deref(), Some("sen"));
        assert_eq!(s.password.as_deref(), Some("s3nt"));
        assert_eq!(c.get_min_replicas(), 2);
        assert_eq!(c.get_replica_timeout(), Duration::from_millis(250));
        let dbg = format!("{c:?}");
        assert!(!dbg.contains("m@ster") && !dbg.contains("s3nt"), "{dbg}");
        let plain = RedisConfig::from_url("redis+sentinel://s1/svc").unwrap();
        assert_eq!(plain.redis.db(), 0);
        assert_eq!(plain.get_min_replicas(), 0);
        let single = RedisConfig::from_url("redis://h?min_replicas=1").unwrap();
        assert_eq!(single.mode(), RedisMode::Single);
        assert_eq!(
            (single.get_min_replicas(), single.get_replica_timeout()),
            (1, DEFAULT_REPLICA_TIMEOUT)
        );
        for bad in [
            "redis+sentinel://s1",
            "redis+sentinel://s1/",
            "redis+sentinel://s1/svc/x",
            "redis+sentinel://:hunter2@s1/svc?tls_ca=ca.pem",
            "redis+sentinel://s1/svc#insecure",
            "redis+sentinel://s1/svc?min_replicas=-1",
            "redis+sentinel://s1/svc?min_replicas=65",
            "redis+sentinel://s1/svc?min_replicas=1&replica_timeout=0ms",
            "redis+sentinel://s1/svc?min_replicas=1&replica_timeout=2s",
            "redis+sentinel://s1/svc?sentinel_pasword=x",
            "redis://:hunter2@h?sentinel_password=hunter2",
        ] {
            match RedisConfig::from_url(bad) {
                Err(Error::InvalidConfig { reason, .. }) => {
                    assert!(!reason.contains("hunter2"), "secret echoed: {reason}")
                }
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        let by_hand = RedisConfig::sentinel(Vec::<(String, u16)>::new(), "svc");
        assert!(by_hand.validate().is_err());
    }

    /// TLS in Sentinel mode is a typed `NotSupported`, by URL or by hand, and shows no secret.
    #[test]
    fn tls_in_sentinel_mode_is_not_supported() {
        let by_hand = RedisConfig::sentinel([("s1", 26379)], "svc");
        for r in [
            RedisConfig::from_url("rediss+sentinel://:hunter2@s1,s2/svc?sentinel_password=hunter2"),
            RedisConfig::from_url("REDISS+SENTINEL://s1/svc"),
            by_hand
                .clone()
                .tls(true)
                .validate()
                .map(|()| by_hand.clone()),
            by_hand
                .clone()
                .tls_root_cert_pem("pem")
                .validate()
                .map(|()| by_hand.clone()),
        ] {
            match r {
                Err(e @ Error::NotSupported { operation, .. }) => {
                    assert!(operation.contains("Sentinel"), "{operation}");
                    assert!(!format!("{e} {e:?}").contains("hunter2"));
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn cluster_urls_parse_into_a_typed_config_and_bad_ones_are_typed_errors() {
        let c = RedisConfig::from_url(
            "redis+cluster://app:p%40ss@n1:7000,n2,[::1]:7002?prefix=p&response_timeout=1s&strict=true",
        )
        .unwrap();
        assert_eq!(c.mode(), RedisMode::Cluster);
        let nodes: Vec<(&str, u16)> = c
            .get_cluster_nodes()
            .iter()
            .map(|(h, p)| (h.as_str(), *p))
            .collect();
        assert_eq!(nodes, [("n1", 7000), ("n2", DEFAULT_PORT), ("[::1]", 7002)]);
        assert_eq!(c.redis.username(), Some("app"));
        assert_eq!(c.redis.password(), Some("p@ss"));
        assert_eq!(
            (c.get_prefix(), c.get_response_timeout(), c.is_strict()),
            ("p", Duration::from_secs(1), true)
        );
        assert_eq!(c.notifications_mode(), Notifications::Off);
        assert!(!format!("{c:?}").contains("p@ss"));
        assert_eq!(
            RedisConfig::from_url("redis+cluster://n1:7000/0")
                .unwrap()
                .mode(),
            RedisMode::Cluster
        );
        assert_eq!(
            RedisConfig::from_url("redis://n1").unwrap().mode(),
            RedisMode::Single
        );
        for bad in [
            "redis+cluster://",
            "redis+cluster://:hunter2@n1:7000/1",
            "redis+cluster://:hunter2@n1:7000/x",
            "redis+cluster://:hunter2@n1:70000",
            "redis+cluster://:hunter2@n1?tls_ca=ca.pem",
            "redis+cluster://:hunter2@n1#insecure",
            "redis+cluster://:hunter2@n1?min_replicas=1&replica_timeout=2s",
            "redis+cluster://:hunter2@n1?min_replicas=x",
            "redis+cluster://:hunter2@n1?notifications=set",
            "redis+cluster://:hunter2@n1?prefix=a%7Bb",
            "redis+cluster://:hunter2@n1?prefix=a:b",
            "redis+cluster://:hunter2@n1?prefx=a",
            "redis+cluster://:hunter2@n1?sentinel_password=hunter2",
            "rediss+cluster://:hunter2@n1#other",
        ] {
            match RedisConfig::from_url(bad) {
                Err(Error::InvalidConfig { reason, .. }) => {
                    assert!(!reason.contains("hunter2"), "secret echoed: {reason}")
                }
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        assert!(
            RedisConfig::cluster(Vec::<(String, u16)>::new())
                .validate()
                .is_err()
        );
        assert!(
            RedisConfig::cluster([("n1", 7000)])
                .db(2)
                .validate()
                .is_err()
        );
        let c = RedisConfig::from_url("redis+cluster://n1?min_replicas=1&replica_timeout=250ms")
            .unwrap();
        assert_eq!(
            (c.get_min_replicas(), c.get_replica_timeout()),
            (1, Duration::from_millis(250))
        );
        assert!(
            RedisConfig::cluster([("n1", 7000)])
                .min_replicas(1)
                .validate()
                .is_ok()
        );
        assert!(
            RedisConfig::cluster([("n1", 7000)])
                .prefix("a}")
                .validate()
                .is_err()
        );
        assert!(RedisConfig::cluster([("n1", 7000)]).validate().is_ok());
    }

    #[test]
    fn rediss_cluster_urls_give_every_seed_tls_with_the_same_files() {
        let c = RedisConfig::from_url(
            "rediss+cluster://:hunter2@n1:7000,n2:7001?tls_ca=ca.pem&tls_cert=c.pem&tls_key=c.key",
        )
        .unwrap();
        assert_eq!(c.mode(), RedisMode::Cluster);
        assert!(c.is_tls());
        let infos = c.cluster_node_infos().unwrap();
        assert_eq!(infos.len(), 2);
        for i in &infos {
            assert!(
                matches!(
                    i.addr(),
                    ConnectionAddr::TcpTls {
                        insecure: false,
                        ..
                    }
                ),
                "{:?}",
                i.addr()
            );
        }
        assert!(!format!("{c:?}").contains("hunter2"));
        let insecure = RedisConfig::from_url("rediss+cluster://n1:7000#insecure").unwrap();
        assert!(matches!(
            insecure.cluster_node_infos().unwrap()[0].addr(),
            ConnectionAddr::TcpTls { insecure: true, .. }
        ));
        let plain = RedisConfig::from_url("redis+cluster://n1:7000").unwrap();
        assert!(matches!(
            plain.cluster_node_infos().unwrap()[0].addr(),
            ConnectionAddr::Tcp(..)
        ));
        assert!(
            RedisConfig::cluster([("n1", 7000)])
                .tls(true)
                .validate()
                .is_ok()
        );
    }

    #[cfg(feature = "serde")]
    #[test]
    fn deserializes_from_its_url_without_echoing_secrets() {
        use lockkit_core::backend::serde::Deserialize;
        use lockkit_core::backend::serde::de::value::{Error as DeError, StrDeserializer};
        let de = StrDeserializer::<DeError>::new("redis://:hunter2@h:1/2?prefix=app");
        let c = RedisConfig::deserialize(de).unwrap();
        assert_eq!((c.get_prefix(), c.redis.db()), ("app", 2));
        let de = StrDeserializer::<DeError>::new("redis://:hunter2@h:1/2?prefx=app");
        let e = RedisConfig::deserialize(de).unwrap_err();
        assert!(!e.to_string().contains("hunter2"), "{e}");
    }
}
