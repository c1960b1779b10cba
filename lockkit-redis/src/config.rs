//! Connection settings: from a `redis://` / `rediss://` URL or built by hand.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use lockkit_core::{Error, Result};
use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo, RedisConnectionInfo};

use crate::error::from_redis;

/// The key prefix used when none is given: `lockkit`.
pub const DEFAULT_PREFIX: &str = "lockkit";

pub use lockkit_core::MAX_PREFIX_BYTES;

/// How long [`RedisLock::connect`](crate::RedisLock::connect) waits for the server by default: 5 s.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a command waits for its reply by default: 2 s.
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);

/// The largest `tls_ca_file` read, in bytes: 1 MiB.
pub const MAX_CA_FILE_BYTES: u64 = 1 << 20;

/// The query parameters the redis crate itself understands and that pass through to it.
const REDIS_CRATE_PARAMS: &[&str] = &["protocol"];

/// Where and how to reach Redis, and under which key prefix to keep the locks.
///
/// Build it from a URL with [`from_url`](Self::from_url) or by hand with [`new`](Self::new) and
/// the chained setters, then pass it to [`RedisLock::with_config`](crate::RedisLock::with_config).
///
/// ```
/// use std::time::Duration;
/// use lockkit_redis::RedisConfig;
///
/// let by_hand = RedisConfig::new("127.0.0.1", 6379)
///     .password("s3cret")
///     .prefix("billing")
///     .connect_timeout(Duration::from_secs(2));
/// let from_url = RedisConfig::from_url("redis://:s3cret@127.0.0.1:6379/0?prefix=billing&connect_timeout_ms=2000")?;
/// assert_eq!(by_hand.get_prefix(), from_url.get_prefix());
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
    /// Read when connecting (see [`RedisConfig::tls_ca_file`]).
    pub(crate) tls_ca_file: Option<PathBuf>,
}

impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = &self.redis;
        let (host, port, tls) = match &self.addr {
            ConnectionAddr::Tcp(h, p) => (h.as_str(), *p, false),
            ConnectionAddr::TcpTls { host, port, .. } => (host.as_str(), *port, true),
            _ => ("(unix socket)", 0, false),
        };
        f.debug_struct("RedisConfig")
            .field("host", &host)
            .field("port", &port)
            .field("tls", &tls)
            .field("db", &r.db())
            .field("username", &r.username())
            .field("password", &r.password().map(|_| "<hidden>"))
            .field(
                "tls_root_cert",
                &self.tls_root_cert.as_ref().map(|_| "<set>"),
            )
            .field("tls_ca_file", &self.tls_ca_file)
            .field("prefix", &self.prefix)
            .field("connect_timeout", &self.connect_timeout)
            .field("response_timeout", &self.response_timeout)
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
            tls_ca_file: None,
        }
    }

    /// Parses a Redis URL:
    /// `redis[s]://[[user]:password@]host[:port][/db][?prefix=P&connect_timeout_ms=N&response_timeout_ms=N&tls_ca_file=PATH][#insecure]`.
    ///
    /// `prefix`, `connect_timeout_ms`, `response_timeout_ms` and `tls_ca_file` (a PEM file with the
    /// root certificate to trust instead of the system's; `rediss` only; read when connecting, see
    /// [`tls_ca_file`](Self::tls_ca_file)) are lockkit's own query parameters and are removed
    /// before the rest goes to the redis crate, which understands `protocol` (`resp2`/`resp3`)
    /// and, for `rediss`, the `#insecure` fragment that skips certificate verification
    /// altogether. Any other query parameter is an error (a typo such as `prefx=` must not
    /// silently fall back to the default prefix; the database goes in the path, `/3`, not in
    /// `?db=3`). The user name and password are percent-decoded.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a URL that does not parse, a scheme other than `redis` or
    /// `rediss`, a missing host, a bad or negative database number, an unknown or repeated query
    /// parameter, a bad `prefix` (see [`prefix`](Self::prefix)) or timeout, `tls_ca_file` on a
    /// `redis://` URL, or `rediss` when the crate was built without its `tls` feature. The URL is
    /// never echoed in the error (it may carry a password).
    pub fn from_url(url: &str) -> Result<Self> {
        let mut parsed =
            url::Url::parse(url).map_err(|e| Error::config_with("malformed redis URL", e))?;
        match parsed.scheme() {
            "redis" => {}
            "rediss" => {
                if !cfg!(feature = "tls") {
                    return Err(Error::config(
                        "rediss:// needs lockkit-redis's Cargo feature \"tls\" (on by default)",
                    ));
                }
            }
            other => {
                return Err(Error::config(format!(
                    "unsupported scheme {other:?} for the redis backend: expected redis or rediss"
                )));
            }
        }
        if parsed.host_str().is_none_or(str::is_empty) {
            return Err(Error::config("redis URL has no host"));
        }
        let mut prefix = DEFAULT_PREFIX.to_owned();
        let mut connect_timeout = DEFAULT_CONNECT_TIMEOUT;
        let mut response_timeout = DEFAULT_RESPONSE_TIMEOUT;
        let mut tls_ca_file = None;
        let mut rest = Vec::new();
        let mut seen: Vec<String> = Vec::new();
        for (k, v) in parsed.query_pairs() {
            if seen.iter().any(|s| *s == k) {
                return Err(Error::config(format!(
                    "query parameter {:?} is given twice",
                    shorten(&k)
                )));
            }
            seen.push(k.clone().into_owned());
            match k.as_ref() {
                "prefix" => prefix = v.into_owned(),
                "connect_timeout_ms" => connect_timeout = parse_ms(&k, &v)?,
                "response_timeout_ms" => response_timeout = parse_ms(&k, &v)?,
                "tls_ca_file" => {
                    if parsed.scheme() != "rediss" {
                        return Err(Error::config(
                            "tls_ca_file is given but TLS is off (use rediss://)",
                        ));
                    }
                    tls_ca_file = Some(PathBuf::from(v.as_ref()));
                }
                k if REDIS_CRATE_PARAMS.contains(&k) => rest.push((k.to_owned(), v.into_owned())),
                "db" => {
                    return Err(Error::config(
                        "unknown query parameter \"db\": the database goes in the path (redis://host:6379/3)",
                    ));
                }
                other => {
                    return Err(Error::config(format!(
                        "unknown query parameter {:?} (known: prefix, connect_timeout_ms, \
                         response_timeout_ms, tls_ca_file, protocol)",
                        shorten(other)
                    )));
                }
            }
        }
        if rest.is_empty() {
            parsed.set_query(None);
        } else {
            parsed.query_pairs_mut().clear().extend_pairs(rest);
        }
        let info = parsed.into_connection_info().map_err(from_redis)?;
        let cfg = Self {
            addr: info.addr().clone(),
            redis: info.redis_settings().clone(),
            prefix,
            connect_timeout,
            response_timeout,
            tls_root_cert: None,
            tls_ca_file,
        };
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
    /// system's. The file is read when connecting, within the connect timeout; it must be a
    /// regular file of at most [`MAX_CA_FILE_BYTES`] (1 MiB).
    pub fn tls_ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.tls_ca_file = Some(path.into());
        self.tls(true)
    }

    /// Reads [`tls_ca_file`](Self::tls_ca_file) if one is set and no PEM was given directly.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if the file is missing, not a regular file (a FIFO or a device
    /// would block), larger than [`MAX_CA_FILE_BYTES`] or unreadable.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub(crate) async fn root_cert(&self) -> Result<Option<Vec<u8>>> {
        if let Some(pem) = &self.tls_root_cert {
            return Ok(Some(pem.clone()));
        }
        match &self.tls_ca_file {
            None => Ok(None),
            Some(path) => read_ca_file(path).await.map(Some),
        }
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

    /// The redis crate's connection settings.
    pub(crate) fn connection_info(&self) -> Result<ConnectionInfo> {
        Ok(self
            .addr
            .clone()
            .into_connection_info()
            .map_err(from_redis)?
            .set_redis_settings(self.redis.clone()))
    }

    /// Checks the prefix and the timeouts.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming what is wrong.
    pub fn validate(&self) -> Result<()> {
        validate_prefix(&self.prefix)?;
        if self.redis.db() < 0 {
            return Err(Error::config("the database number is negative"));
        }
        if (self.tls_root_cert.is_some() || self.tls_ca_file.is_some())
            && !matches!(self.addr, ConnectionAddr::TcpTls { .. })
        {
            return Err(Error::config(
                "a TLS root certificate is set but TLS is off (use rediss://)",
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

/// A query parameter name for an error message: at most 32 characters.
fn shorten(k: &str) -> String {
    k.chars().take(32).collect()
}

async fn read_ca_file(path: &Path) -> Result<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let meta = tokio::fs::metadata(path)
        .await
        .map_err(|e| Error::config_with("cannot read tls_ca_file", e))?;
    if !meta.is_file() {
        return Err(Error::config("tls_ca_file is not a regular file"));
    }
    if meta.len() > MAX_CA_FILE_BYTES {
        return Err(Error::config("tls_ca_file is larger than 1 MiB"));
    }
    let file = tokio::fs::File::open(path)
        .await
        .map_err(|e| Error::config_with("cannot read tls_ca_file", e))?;
    let mut pem = Vec::new();
    file.take(MAX_CA_FILE_BYTES + 1)
        .read_to_end(&mut pem)
        .await
        .map_err(|e| Error::config_with("cannot read tls_ca_file", e))?;
    if pem.len() as u64 > MAX_CA_FILE_BYTES {
        return Err(Error::config("tls_ca_file is larger than 1 MiB"));
    }
    Ok(pem)
}

fn parse_ms(key: &str, v: &str) -> Result<Duration> {
    match v.parse::<u64>() {
        Ok(ms) if ms > 0 => Ok(Duration::from_millis(ms)),
        _ => Err(Error::config(format!(
            "{key} must be a positive number of milliseconds"
        ))),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_parsing_strips_our_params_and_hides_the_password() {
        let c = RedisConfig::from_url(
            "redis://user:p%40ss@localhost:7000/3?prefix=app&connect_timeout_ms=250",
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
        let secret = "redis://:hunter2@localhost/x";
        let e = RedisConfig::from_url(secret).unwrap_err();
        assert!(!format!("{e:?} {e}").contains("hunter2"));
    }
}
