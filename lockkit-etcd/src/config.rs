//! Connection settings: [`EtcdConfig`], from an `etcd://` URL or built in code.

use std::fmt;
use std::time::Duration;

use std::path::PathBuf;

use lockkit_core::backend::{BackendUrl, TlsOptions, parse_host_port, read_pem};
use lockkit_core::{Error, MAX_TTL, Result};

/// The default key prefix: `lockkit`.
pub const DEFAULT_PREFIX: &str = "lockkit";

/// The default etcd client port, used when an endpoint names no port: 2379.
pub const DEFAULT_PORT: u16 = 2379;

/// How to reach etcd and where to keep the locks.
///
/// From a URL ([`EtcdConfig::from_url`], also via [`FromStr`](std::str::FromStr)):
///
/// ```text
/// etcd[s]://[user[:password]@]host[:port][,host[:port]…][/][?prefix=…&connect_timeout=…&request_timeout=…&tls_ca=…]
/// ```
///
/// The grammar is the one all lockkit backends share
/// ([`BackendUrl`](lockkit_core::backend::BackendUrl)); the parameters:
///
/// | parameter | meaning | default | old spelling (alias) |
/// |---|---|---|---|
/// | `prefix` | key namespace | `lockkit` | |
/// | `connect_timeout` | duration (`500ms`, `2s`, bare seconds) for connecting | `3s` | `connect_timeout_ms` |
/// | `request_timeout` | duration any one request may take | `5s` | `request_timeout_ms` |
/// | `tls_ca` | PEM root certificate(s) to trust (`etcds` only) | system roots | |
/// | `tls_cert`, `tls_key` | PEM client certificate and key (`--client-cert-auth`) | none | |
/// | `tls_server_name` | name the server certificate must carry, if not the host's | the host | |
///
/// Every `host:port` becomes an `http://host:port` endpoint; the client balances requests over
/// them and fails over between them. `user`/`password` (percent-encoded) enable etcd
/// authentication (<https://etcd.io/docs/v3.4/op-guide/authentication/>). `etcds://` turns on
/// TLS for every endpoint (`https://host:port`,
/// <https://etcd.io/docs/v3.4/op-guide/security/>).
///
/// Or in code:
///
/// ```
/// use std::time::Duration;
/// use lockkit_etcd::EtcdConfig;
///
/// let cfg = EtcdConfig::new(["127.0.0.1:2379", "127.0.0.1:22379"])
///     .prefix("billing")
///     .user("app", "s3cret")
///     .request_timeout(Duration::from_secs(2));
/// assert!(!format!("{cfg:?}").contains("s3cret"));
/// ```
///
/// `Debug` never shows the password. With the `serde` feature it deserializes from its URL
/// string.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    endpoints: Vec<String>,
    user: Option<(String, String)>,
    prefix: String,
    connect_timeout: Duration,
    request_timeout: Duration,
    lease_linger: Option<Duration>,
    tls: Option<TlsOptions>,
}

impl fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdConfig")
            .field("endpoints", &self.endpoints)
            .field("user", &self.user.as_ref().map(|(u, _)| u))
            .field("password", &self.user.as_ref().map(|_| "***"))
            .field("prefix", &self.prefix)
            .field("connect_timeout", &self.connect_timeout)
            .field("request_timeout", &self.request_timeout)
            .field("lease_linger", &self.lease_linger)
            .field("tls", &self.tls)
            .finish()
    }
}

impl EtcdConfig {
    /// Settings for these endpoints (`host:port`, `http://host:port`, or `https://host:port`,
    /// which turns TLS on for all, verified against the system's roots unless
    /// [`tls_ca`](Self::tls_ca) is set), with the defaults: prefix
    /// [`DEFAULT_PREFIX`], no authentication, 3 s connect timeout, 5 s request timeout, no
    /// keepalive for a session lease after its last lock is released ([`Self::lease_linger`]).
    ///
    /// Endpoints are checked when connecting ([`EtcdLock::connect_with`](crate::EtcdLock::connect_with)).
    pub fn new<I, S>(endpoints: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let endpoints: Vec<String> = endpoints
            .into_iter()
            .map(|e| e.as_ref().to_owned())
            .collect();
        let https = endpoints.iter().any(|e| {
            e.trim()
                .get(..8)
                .is_some_and(|s| s.eq_ignore_ascii_case("https://"))
        });
        Self {
            endpoints,
            tls: https.then(TlsOptions::default),
            user: None,
            prefix: DEFAULT_PREFIX.to_owned(),
            connect_timeout: Duration::from_secs(3),
            request_timeout: Duration::from_secs(5),
            lease_linger: None,
        }
    }

    /// Parses an `etcd://` URL (see the type's docs).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for another scheme, an empty or malformed host list, a bad
    /// prefix, or an unknown query parameter. The message never repeats the URL (it may hold a
    /// password).
    pub fn from_url(url: &str) -> Result<Self> {
        let mut u = BackendUrl::parse(url, &["etcd", "etcds"])?;
        if u.fragment().is_some() {
            return Err(Error::config("etcd URL must not have a fragment"));
        }
        if !matches!(u.path(), "" | "/") {
            return Err(Error::config(
                "etcd URL must not have a path: use ?prefix=… for the key namespace",
            ));
        }
        let hosts = u.host_list(Some(DEFAULT_PORT))?;
        let mut cfg = Self::new(hosts.iter().map(|h| h.to_string()));
        match (u.username(), u.password()) {
            (Some(user), pw) => cfg.user = Some((user.to_owned(), pw.unwrap_or("").to_owned())),
            (None, Some(_)) => return Err(Error::config("etcd URL has an empty user name")),
            (None, None) => {}
        }
        let common = u.take_common([&[], &[], &[]])?;
        if u.scheme() == "etcds" {
            cfg.tls = Some(common.tls);
        } else if common.tls.is_set() {
            return Err(Error::config(
                "TLS parameters (tls_ca, tls_cert, tls_key, tls_server_name) need etcds://",
            ));
        }
        if let Some(p) = common.prefix {
            cfg.prefix = p;
        }
        if let Some(t) = common.connect_timeout {
            cfg.connect_timeout = t;
        }
        if let Some(t) = u.take_duration("request_timeout", Some("request_timeout_ms"))? {
            cfg.request_timeout = t;
        }
        u.finish(
            "etcd",
            &[
                "prefix",
                "connect_timeout",
                "request_timeout",
                "tls_ca",
                "tls_cert",
                "tls_key",
                "tls_server_name",
            ],
        )?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Sets the key prefix (namespace) under which every lock key lives: `{prefix}/{name}/…`.
    /// Checked when connecting: 1 to 64 bytes, no `/`, no control characters.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Authenticates as `user` with `password` (etcd's user/password auth).
    pub fn user(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.user = Some((user.into(), password.into()));
        self
    }

    /// How long [`EtcdLock::connect_with`](crate::EtcdLock::connect_with) may take in total
    /// (TCP connect, authentication, first request) before it fails with
    /// [`Error::Unavailable`]. Default 3 s; at most 24 h.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The longest any single request may take before it counts as [`Error::Unavailable`]
    /// (and is retried per the acquire's retry policy). Default 5 s; at most 24 h.
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// How long a session lease is kept alive after the last lock on it was released, so that
    /// acquires with the same TTL reuse it instead of granting a new one.
    ///
    /// - Default (`None`): no keepalive is sent after the last release. The lease is revoked at
    ///   its next keepalive tick (at most TTL/3 after its last renewal) instead of being
    ///   renewed; acquires until then reuse it.
    /// - `Some(Duration::ZERO)`: revoked at once when its last lock is released.
    /// - `Some(d)`: kept alive for `d` after its last lock is released, then revoked. At most
    ///   [`MAX_TTL`] (24 h); [`EtcdLock::connect_with`](crate::EtcdLock::connect_with) refuses
    ///   longer with [`Error::InvalidConfig`].
    pub fn lease_linger(mut self, linger: Option<Duration>) -> Self {
        self.lease_linger = linger;
        self
    }

    /// Turns TLS on (`https://` endpoints) or off.
    pub fn tls(mut self, on: bool) -> Self {
        self.tls = match (on, self.tls.take()) {
            (true, t) => Some(t.unwrap_or_default()),
            (false, _) => None,
        };
        self
    }

    /// Turns TLS on and trusts the root certificate(s) in the PEM file `path` (`tls_ca`)
    /// instead of the system's. Read when connecting.
    pub fn tls_ca(mut self, path: impl Into<PathBuf>) -> Self {
        self.tls = Some(self.tls.take().unwrap_or_default().with_ca(path));
        self
    }

    /// Turns TLS on and presents the client certificate in the PEM file `cert` with its key in
    /// `key` (`tls_cert`, `tls_key`; etcd's `--client-cert-auth`). Read when connecting.
    pub fn tls_client_cert(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.tls = Some(
            self.tls
                .take()
                .unwrap_or_default()
                .with_client_cert(cert, key),
        );
        self
    }

    /// Turns TLS on and verifies the server certificate against `name` instead of each
    /// endpoint's host (`tls_server_name`).
    pub fn tls_server_name(mut self, name: impl Into<String>) -> Self {
        self.tls.get_or_insert_default().server_name = Some(name.into());
        self
    }

    /// etcd-client's TLS settings, the PEM files read, if TLS is on.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a missing or unreadable file
    /// ([`read_pem`](lockkit_core::backend::read_pem)).
    pub(crate) async fn tls_options(&self) -> Result<Option<etcd_client::TlsOptions>> {
        let Some(t) = &self.tls else { return Ok(None) };
        let mut opts = etcd_client::TlsOptions::new().with_native_roots();
        if let Some(ca) = &t.ca {
            let pem = read_pem(ca, "tls_ca").await?;
            opts = etcd_client::TlsOptions::new()
                .ca_certificate(etcd_client::Certificate::from_pem(pem));
        }
        if let (Some(c), Some(k)) = (&t.cert, &t.key) {
            let (c, k) = (
                read_pem(c, "tls_cert").await?,
                read_pem(k, "tls_key").await?,
            );
            opts = opts.identity(etcd_client::Identity::from_pem(c, k));
        }
        if let Some(n) = &t.server_name {
            opts = opts.domain_name(n.clone());
        }
        Ok(Some(opts))
    }

    /// The TLS settings, if TLS is on.
    pub fn get_tls(&self) -> Option<&TlsOptions> {
        self.tls.as_ref()
    }

    /// The endpoints as given.
    pub fn get_endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// The key prefix.
    pub fn get_prefix(&self) -> &str {
        &self.prefix
    }

    /// The user name, if authentication is configured.
    pub fn get_username(&self) -> Option<&str> {
        self.user.as_ref().map(|(u, _)| u.as_str())
    }

    pub(crate) fn credentials(&self) -> Option<&(String, String)> {
        self.user.as_ref()
    }

    /// The connect timeout.
    pub fn get_connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// The request timeout.
    pub fn get_request_timeout(&self) -> Duration {
        self.request_timeout
    }

    pub(crate) fn connect_timeout_value(&self) -> Duration {
        self.connect_timeout
    }

    pub(crate) fn request_timeout_value(&self) -> Duration {
        self.request_timeout
    }

    pub(crate) fn lease_linger_value(&self) -> Option<Duration> {
        self.lease_linger
    }

    /// Checks everything and returns the `http://host:port` (or, with TLS, `https://`) endpoints.
    pub(crate) fn validate(&self) -> Result<Vec<String>> {
        if let Some(t) = &self.tls {
            t.validate()?;
        }
        validate_prefix(&self.prefix)?;
        if self.connect_timeout.is_zero() || self.request_timeout.is_zero() {
            return Err(Error::config("etcd timeouts must be positive"));
        }
        if self.connect_timeout > MAX_TTL || self.request_timeout > MAX_TTL {
            return Err(Error::config("etcd timeouts must be at most 24 hours"));
        }
        if self.lease_linger.is_some_and(|l| l > MAX_TTL) {
            return Err(Error::config("etcd lease linger must be at most 24 hours"));
        }
        if self.endpoints.is_empty() {
            return Err(Error::config("no etcd endpoints given"));
        }
        self.endpoints
            .iter()
            .map(|e| normalize_endpoint(e, self.tls.is_some()))
            .collect()
    }
}

lockkit_core::impl_url_config!(EtcdConfig);

/// Checks a key prefix with the rules every lockkit backend shares
/// ([`lockkit_core::backend::validate_prefix`]: 1 to 64 bytes, no `/`, not `.` or `..`, no control
/// characters); etcd adds none (its keys are arbitrary bytes).
///
/// # Errors
/// [`Error::InvalidConfig`] naming the rule that was broken.
pub fn validate_prefix(prefix: &str) -> Result<()> {
    lockkit_core::backend::validate_prefix(prefix)
}

/// `host[:port]`, `http://host[:port]` or `https://host[:port]` → `http[s]://host:port`; the
/// scheme must agree with `tls`.
fn normalize_endpoint(e: &str, tls: bool) -> Result<String> {
    let e = e.trim();
    let bare = match e.split_once("://") {
        Some((s, rest)) if s.eq_ignore_ascii_case("http") && !tls => rest,
        Some((s, rest)) if s.eq_ignore_ascii_case("https") && tls => rest,
        Some((s, _)) if s.eq_ignore_ascii_case("http") || s.eq_ignore_ascii_case("https") => {
            return Err(Error::config(
                "etcd endpoints mix http:// and https:// (TLS is on for all or none)",
            ));
        }
        Some(_) => {
            return Err(Error::config(
                "etcd endpoints must be host:port, http://host:port or https://host:port",
            ));
        }
        None => e,
    };
    let bare = bare.strip_suffix('/').unwrap_or(bare);
    let hp = parse_host_port(bare, Some(DEFAULT_PORT))?;
    Ok(format!("{}://{hp}", if tls { "https" } else { "http" }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hosts_user_and_params() {
        let c = EtcdConfig::from_url(
            "etcd://app:p%40ss@127.0.0.1:2379,localhost:22379,[::1]:1/?prefix=jobs&request_timeout_ms=250&connect_timeout=1.5",
        )
        .unwrap();
        assert_eq!(
            c.validate().unwrap(),
            vec![
                "http://127.0.0.1:2379",
                "http://localhost:22379",
                "http://[::1]:1"
            ]
        );
        assert_eq!(c.credentials().unwrap(), &("app".into(), "p@ss".into()));
        assert_eq!(c.get_prefix(), "jobs");
        assert_eq!(c.get_request_timeout(), Duration::from_millis(250));
        assert_eq!(c.get_connect_timeout(), Duration::from_millis(1500));
        let dbg = format!("{c:?}");
        assert!(!dbg.contains("p@ss") && !dbg.contains("p%40ss"), "{dbg}");
        let tls = EtcdConfig::from_url("etcds://h,g:1?tls_ca=ca.pem&tls_server_name=etcd").unwrap();
        assert_eq!(
            tls.validate().unwrap(),
            vec!["https://h:2379", "https://g:1"]
        );
        assert_eq!(tls.get_tls().unwrap().server_name.as_deref(), Some("etcd"));
        assert!(
            EtcdConfig::new(["https://a:1", "http://b:2"])
                .validate()
                .is_err()
        );
        let plain = EtcdConfig::from_url("etcd://h").unwrap();
        assert_eq!(plain.validate().unwrap(), vec!["http://h:2379"]);
        assert_eq!(plain.get_prefix(), DEFAULT_PREFIX);
    }

    #[test]
    fn rejects_bad_urls_without_echoing_them() {
        for bad in [
            "",
            "etcd://",
            "etcd://,",
            "etcd://h:notaport",
            "etcd://h:70000",
            "etcd://h/path",
            "etcd://h?prefix=",
            "etcd://h?prefix=a/b",
            "etcd://h?bogus=1",
            "etcd://h?tls=true",
            "redis://h",
            "etcd://:secretpw@h",
            "etcd://u:secretpw@h:99999",
            "etcd://h:+1",
            "etcd://u:12?secretpw@h",
            "etcd://h?prefix=a&prefix=b",
            "etcd://h?connect_timeout=2s&connect_timeout_ms=9",
            "etcd://h?tls_ca=ca.pem",
            "etcds://h?tls_cert=c.pem",
        ] {
            match EtcdConfig::from_url(bad).and_then(|c| c.validate().map(|_| c)) {
                Err(Error::InvalidConfig { reason, .. }) => {
                    assert!(!reason.contains("secretpw"), "{reason}");
                }
                other => panic!("{bad:?}: {other:?}"),
            }
        }
    }
}
