//! Connection settings: the `zk://` URL and the [`ZkConfig`] builder.

use std::fmt;
use std::time::Duration;

use std::path::PathBuf;

use lockkit_core::backend::{BackendUrl, TlsOptions, parse_host_port, read_pem};
use lockkit_core::{Error, Result};

/// The key prefix used when none is given: `lockkit`.
pub const DEFAULT_PREFIX: &str = "lockkit";

/// How long [`ZkLock::connect`](crate::ZkLock::connect) and the opening of each new session may
/// take before failing with [`Error::Unavailable`]: 5 s.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest connect timeout [`ZkConfig::validate`] accepts: 1 hour.
pub const MAX_CONNECT_TIMEOUT: Duration = Duration::from_secs(3600);

/// The session timeout asked for by the session that [`ZkLock::connect`](crate::ZkLock::connect)
/// opens to check the server: 30 s ([`lockkit_core::DEFAULT_TTL`]). If the server negotiates
/// another value, that session serves leases of the negotiated TTL instead.
pub const CONTROL_SESSION_TTL: Duration = lockkit_core::DEFAULT_TTL;

/// Where and how to connect to ZooKeeper.
///
/// Build it from a URL with [`ZkConfig::from_url`] or by hand:
///
/// ```
/// use std::time::Duration;
/// use lockkit_zk::ZkConfig;
///
/// let cfg = ZkConfig::new(["zk1:2181", "zk2:2181", "zk3:2181"])
///     .chroot("/apps/billing")
///     .prefix("locks")
///     .digest("billing", "s3cret")
///     .connect_timeout(Duration::from_secs(3));
/// assert_eq!(cfg.connect_string(), "zk1:2181,zk2:2181,zk3:2181/apps/billing");
/// // The password never shows.
/// assert!(!format!("{cfg:?}").contains("s3cret"));
///
/// // SASL DIGEST-MD5 instead of the digest scheme (the server's JAAS `Server` section).
/// let sasl = ZkConfig::new(["zk1:2181"]).sasl_digest_md5("billing", "s3cret");
/// assert!(!format!("{sasl:?}").contains("s3cret"));
/// ```
///
/// With the `serde` feature it deserializes from its URL string.
#[derive(Clone, PartialEq, Eq)]
pub struct ZkConfig {
    hosts: Vec<String>,
    chroot: Option<String>,
    prefix: String,
    credentials: Option<Credentials>,
    connect_timeout: Duration,
    tls: Option<TlsOptions>,
}

impl fmt::Debug for ZkConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZkConfig")
            .field("hosts", &self.hosts)
            .field("chroot", &self.chroot)
            .field("prefix", &self.prefix)
            .field(
                "auth",
                &self.credentials.as_ref().map(|c| c.mechanism.name()),
            )
            .field("user", &self.credentials.as_ref().map(|c| c.user.as_str()))
            .field("password", &self.credentials.as_ref().map(|_| "<hidden>"))
            .field("connect_timeout", &self.connect_timeout)
            .field("tls", &self.tls)
            .finish()
    }
}

impl ZkConfig {
    /// A configuration for the servers `hosts` (`host:port` each), no chroot, prefix
    /// [`DEFAULT_PREFIX`], no authentication, [`DEFAULT_CONNECT_TIMEOUT`].
    pub fn new<I, S>(hosts: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self {
            hosts: hosts.into_iter().map(Into::into).collect(),
            chroot: None,
            prefix: DEFAULT_PREFIX.to_owned(),
            credentials: None,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            tls: None,
        }
    }

    /// Parses `zk://[user:password@]host:port[,host:port…][/chroot][?prefix=…&sasl=…&connect_timeout=…]`,
    /// by the grammar all lockkit backends share
    /// ([`BackendUrl`](lockkit_core::backend::BackendUrl)).
    ///
    /// - `user:password` (percent-encoded) turns on ZooKeeper `digest` authentication; lock nodes
    ///   (and fenced data nodes) are then created with the `CREATOR_ALL_ACL`, so only that
    ///   identity can touch them; the shared parents (prefix node, lock container nodes) stay
    ///   open to everyone, so that clients with other credentials can queue on the same locks.
    ///   ZooKeeper's `digest` scheme never refuses a password: a wrong one is another identity.
    /// - `sasl=digest-md5` authenticates `user:password` by
    ///   [SASL DIGEST-MD5](https://cwiki.apache.org/confluence/display/ZOOKEEPER/Client-Server+mutual+authentication)
    ///   instead (against the server's JAAS `Server` section, `DigestLoginModule`): the server
    ///   checks the password and refuses a wrong one ([`Error::Auth`]); the identity in ACLs is
    ///   `sasl:user`. Needs `user:password` in the URL. A server without SASL configured,
    ///   which would let the client on unauthenticated, is refused with [`Error::Auth`] too.
    /// - `/chroot` is ZooKeeper's chroot suffix of the connect string: every path lives under it
    ///   (it must exist).
    /// - `prefix` (default `lockkit`) is the node under which lock nodes live.
    /// - `tls_ca`, `tls_cert`, `tls_key` (PEM files): TLS to the servers' `secureClientPort`,
    ///   verified against `tls_ca` (required: there is no ZooKeeper TLS scheme, and the
    ///   client has no system roots), with a client certificate for `ssl.clientAuth=need`.
    ///   `tls_server_name` is refused (the client verifies the host).
    /// - `connect_timeout` (a duration: `500ms`, `2s`, bare seconds; default `5s`, at most 1 h;
    ///   old spelling `connect_timeout_ms`, whole milliseconds) bounds connecting and opening
    ///   each session.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for anything malformed; the URL itself is never echoed (it may
    /// hold a password).
    pub fn from_url(url: &str) -> Result<Self> {
        let mut u = BackendUrl::parse(url, &["zk"])?;
        if u.fragment().is_some() {
            return Err(Error::config(
                "a ZooKeeper URL must not contain a '#' fragment",
            ));
        }
        let hosts = u.host_list(None)?;
        let mut cfg = ZkConfig::new(hosts.iter().map(|h| h.to_string()));
        let sasl = u.take("sasl", &[])?;
        let mechanism = match sasl.as_deref() {
            None => Mechanism::Digest,
            Some(m) if m.eq_ignore_ascii_case("digest-md5") => Mechanism::SaslDigestMd5,
            Some(_) => {
                return Err(Error::config(
                    "sasl must be digest-md5 (the only SASL mechanism the ZooKeeper backend supports)",
                ));
            }
        };
        match (u.username(), u.password()) {
            (Some(user), Some(pass)) => {
                cfg.credentials = Some(Credentials {
                    mechanism,
                    user: user.to_owned(),
                    password: pass.to_owned(),
                });
            }
            (None, None) if sasl.is_some() => {
                return Err(Error::config(
                    "sasl=digest-md5 needs user:password in the ZooKeeper URL",
                ));
            }
            (None, None) => {}
            _ => {
                return Err(Error::config(
                    "ZooKeeper URL credentials must be user:password",
                ));
            }
        }
        let chroot = u.decoded_path()?;
        if !chroot.is_empty() && chroot != "/" {
            cfg = cfg.chroot(chroot);
        }
        let common = u.take_common([&[], &[], &[]])?;
        if common.tls.is_set() {
            cfg.tls = Some(common.tls);
        }
        if let Some(p) = common.prefix {
            cfg = cfg.prefix(p);
        }
        if let Some(t) = common.connect_timeout {
            cfg = cfg.connect_timeout(t);
        }
        u.finish(
            "ZooKeeper",
            &[
                "prefix",
                "sasl",
                "connect_timeout",
                "tls_ca",
                "tls_cert",
                "tls_key",
            ],
        )?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Sets the chroot (an absolute path such as `/apps/billing`; it must exist on the server).
    pub fn chroot(mut self, chroot: impl Into<String>) -> Self {
        self.chroot = Some(chroot.into());
        self
    }

    /// Sets the key prefix: the node (under the chroot) below which all lock nodes live.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Turns on `digest` authentication as `user` with `password` (replacing
    /// [`sasl_digest_md5`](Self::sasl_digest_md5)). The server never refuses a digest password:
    /// a wrong one is another identity.
    pub fn digest(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.credentials = Some(Credentials {
            mechanism: Mechanism::Digest,
            user: user.into(),
            password: password.into(),
        });
        self
    }

    /// Authenticates as `user` with `password` by SASL DIGEST-MD5 (URL: `sasl=digest-md5`),
    /// replacing [`digest`](Self::digest). The server checks the password against its JAAS
    /// `Server` section and refuses a wrong one ([`Error::Auth`]); lock nodes are creator-only,
    /// for the identity `sasl:user`.
    pub fn sasl_digest_md5(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.credentials = Some(Credentials {
            mechanism: Mechanism::SaslDigestMd5,
            user: user.into(),
            password: password.into(),
        });
        self
    }

    /// Bounds connecting and opening each session (duration; default 5 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Uses TLS, trusting the root certificate(s) in the PEM file `path` (`tls_ca`). Read when
    /// each session is opened.
    pub fn tls_ca(mut self, path: impl Into<PathBuf>) -> Self {
        self.tls = Some(self.tls.take().unwrap_or_default().with_ca(path));
        self
    }

    /// Presents the client certificate in the PEM file `cert` with its key in `key`
    /// (`tls_cert`, `tls_key`); needs [`tls_ca`](Self::tls_ca).
    pub fn tls_client_cert(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.tls = Some(
            self.tls
                .take()
                .unwrap_or_default()
                .with_client_cert(cert, key),
        );
        self
    }

    /// The TLS settings, if TLS is on.
    pub fn get_tls(&self) -> Option<&TlsOptions> {
        self.tls.as_ref()
    }

    /// zookeeper-client's TLS options, the PEM files read, if TLS is on.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a missing, unreadable or malformed file.
    pub(crate) async fn tls_options(&self) -> Result<Option<zookeeper_client::TlsOptions>> {
        let Some(t) = &self.tls else { return Ok(None) };
        let text = |pem: Vec<u8>, what: &str| {
            String::from_utf8(pem).map_err(|_| Error::config(format!("{what} is not PEM text")))
        };
        let ca = match &t.ca {
            Some(ca) => text(read_pem(ca, "tls_ca").await?, "tls_ca")?,
            None => return Err(Error::config("ZooKeeper TLS needs tls_ca")),
        };
        let mut opts = zookeeper_client::TlsOptions::new()
            .with_pem_ca(&ca)
            .map_err(|e| Error::config_with("tls_ca holds no usable certificate", e))?;
        if let (Some(c), Some(k)) = (&t.cert, &t.key) {
            let c = text(read_pem(c, "tls_cert").await?, "tls_cert")?;
            let k = text(read_pem(k, "tls_key").await?, "tls_key")?;
            opts = opts
                .with_pem_identity(&c, &k)
                .map_err(|e| Error::config_with("cannot use tls_cert/tls_key", e))?;
        }
        Ok(Some(opts))
    }

    /// The servers, `host:port` each.
    pub fn get_hosts(&self) -> &[String] {
        &self.hosts
    }

    /// The chroot, if any.
    pub fn get_chroot(&self) -> Option<&str> {
        self.chroot.as_deref()
    }

    /// The key prefix.
    pub fn get_prefix(&self) -> &str {
        &self.prefix
    }

    /// The connect-timeout bound (duration).
    pub fn get_connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// The connect string handed to the ZooKeeper client: `host:port,host:port[/chroot]`.
    pub fn connect_string(&self) -> String {
        let mut s = self.hosts.join(",");
        if let Some(c) = &self.chroot {
            s.push_str(c);
        }
        s
    }

    /// The user name authenticated as, if any (never the password).
    pub fn get_user(&self) -> Option<&str> {
        self.credentials.as_ref().map(|c| c.user.as_str())
    }

    /// Whether the client authenticates at all (lock nodes are then creator-only).
    pub(crate) fn authenticated(&self) -> bool {
        self.credentials.is_some()
    }

    /// The `digest` scheme's `user:password`, when that is the mechanism.
    pub(crate) fn digest_auth(&self) -> Option<Vec<u8>> {
        self.credentials
            .as_ref()
            .filter(|c| c.mechanism == Mechanism::Digest)
            .map(|c| format!("{}:{}", c.user, c.password).into_bytes())
    }

    /// zookeeper-client's SASL options, when the mechanism is SASL DIGEST-MD5.
    pub(crate) fn sasl_options(&self) -> Option<zookeeper_client::SaslOptions> {
        self.credentials
            .as_ref()
            .filter(|c| c.mechanism == Mechanism::SaslDigestMd5)
            .map(|c| {
                zookeeper_client::SaslOptions::digest_md5(c.user.clone(), c.password.clone()).into()
            })
    }

    /// Checks hosts, chroot, prefix and timeout (non-zero, at most [`MAX_CONNECT_TIMEOUT`]).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming what is wrong.
    pub fn validate(&self) -> Result<()> {
        if self.hosts.is_empty() || self.hosts.iter().any(|h| h.is_empty()) {
            return Err(Error::config(
                "ZooKeeper URL needs at least one host:port (and no empty entries)",
            ));
        }
        for h in &self.hosts {
            parse_host_port(h, None)?;
        }
        if let Some(c) = &self.chroot {
            let bad = !c.starts_with('/')
                || c.ends_with('/')
                || c[1..]
                    .split('/')
                    .any(|part| part.is_empty() || part == "." || part == "..")
                || c.chars().any(forbidden_in_znode);
            if bad {
                return Err(Error::config(
                    "the ZooKeeper chroot must be an absolute path like /a/b (no empty, '.' or '..' \
                     components, no trailing '/', no characters ZooKeeper forbids)",
                ));
            }
            if c == "/zookeeper" || c.starts_with("/zookeeper/") {
                return Err(Error::config(
                    "the ZooKeeper chroot must not be /zookeeper or below it (reserved by the server)",
                ));
            }
        }
        if let Some(t) = &self.tls {
            t.validate()?;
            if t.ca.is_none() {
                return Err(Error::config("ZooKeeper TLS needs tls_ca"));
            }
            if t.server_name.is_some() {
                return Err(Error::config(
                    "tls_server_name is not supported by the ZooKeeper backend: the client \
                     verifies the certificate against the host",
                ));
            }
        }
        let p = &self.prefix;
        lockkit_core::backend::validate_prefix(p)?;
        if p.chars().any(forbidden_in_znode) || p == "zookeeper" {
            return Err(Error::config(
                "the key prefix contains a character ZooKeeper forbids in node names, or is the reserved name 'zookeeper'",
            ));
        }
        if self.connect_timeout.is_zero() {
            return Err(Error::config("connect timeout is zero"));
        }
        if self.connect_timeout > MAX_CONNECT_TIMEOUT {
            return Err(Error::config(format!(
                "connect timeout {:?} is longer than the maximum {MAX_CONNECT_TIMEOUT:?}",
                self.connect_timeout
            )));
        }
        Ok(())
    }
}

lockkit_core::impl_url_config!(ZkConfig);

/// How `user:password` is presented to the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mechanism {
    /// `addauth digest user:password`: an identity, never refused.
    Digest,
    /// SASL DIGEST-MD5, checked by the server.
    SaslDigestMd5,
}

impl Mechanism {
    fn name(self) -> &'static str {
        match self {
            Mechanism::Digest => "digest",
            Mechanism::SaslDigestMd5 => "sasl-digest-md5",
        }
    }
}

/// Credentials; no `Debug` (the password): [`ZkConfig`]'s own `Debug` shows the user only.
#[derive(Clone, PartialEq, Eq)]
struct Credentials {
    mechanism: Mechanism,
    user: String,
    password: String,
}

/// Characters ZooKeeper refuses in node names (`PathUtils.validatePath`): U+0000–U+001F,
/// U+007F–U+009F, U+D800–U+F8FF, U+FFF0–U+FFFF, and, because the server works in UTF-16, every
/// character above U+FFFF (it becomes a surrogate pair, inside the forbidden U+D800–U+DFFF).
pub(crate) fn forbidden_in_znode(c: char) -> bool {
    let u = u32::from(c);
    u <= 0x1f
        || (0x7f..=0x9f).contains(&u)
        || (0xd800..=0xf8ff).contains(&u)
        || (0xfff0..=0xffff).contains(&u)
        || u > 0xffff
}

/// The node name of lock `name`: `%` and every character ZooKeeper forbids
/// ([`forbidden_in_znode`]) are percent-encoded (UTF-8 bytes), the rest is kept, so the mapping is
/// one-to-one and readable. Names were checked by [`lockkit_core::backend::validate_name`] (no `/`, not
/// `.`/`..`, no control characters), so the result is always a valid node name.
pub(crate) fn encode_name(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        if c == '%' || forbidden_in_znode(c) {
            let mut buf = [0u8; 4];
            for b in c.encode_utf8(&mut buf).bytes() {
                out.push_str(&format!("%{b:02X}"));
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_full_url() {
        let cfg = ZkConfig::from_url(
            "zk://u%40x:p%3Ass@h1:2181,h2:2182/apps/x?prefix=locks&connect_timeout_ms=1500",
        )
        .unwrap();
        assert_eq!(cfg.get_hosts(), ["h1:2181", "h2:2182"]);
        assert_eq!(cfg.connect_string(), "h1:2181,h2:2182/apps/x");
        assert_eq!(cfg.get_prefix(), "locks");
        assert_eq!(cfg.digest_auth().unwrap(), b"u@x:p:ss".to_vec());
        assert_eq!(cfg.get_connect_timeout(), Duration::from_millis(1500));
        let dbg = format!("{cfg:?}");
        assert!(!dbg.contains("p:ss") && !dbg.contains("p%3Ass"), "{dbg}");
    }

    #[test]
    fn defaults() {
        let cfg = ZkConfig::from_url("zk://127.0.0.1:2181").unwrap();
        assert_eq!(cfg.get_prefix(), DEFAULT_PREFIX);
        assert_eq!(cfg.connect_string(), "127.0.0.1:2181");
        assert!(cfg.digest_auth().is_none());
        assert_eq!(
            ZkConfig::from_url("zk://h:1/").unwrap().connect_string(),
            "h:1"
        );
    }

    #[test]
    fn rejects_malformed() {
        for bad in [
            "redis://h:1",
            "zk://",
            "zk://h",
            "zk://h:0",
            "zk://h:99999",
            "zk://h:1,",
            "zk://h:x",
            "zk://h:1/a/",
            "zk://h:1//a",
            "zk://h:1/a/../b",
            "zk://h:1?prefix=",
            "zk://h:1?prefix=a/b",
            "zk://h:1?prefix=zookeeper",
            "zk://h:1?prefix=%01",
            "zk://h:1?bogus=1",
            "zk://h:1?connect_timeout_ms=soon",
            "zk://h:1?connect_timeout_ms=0",
            "zk://user@h:1",
            "zk://h:1#frag",
            "zk://127.0.0.1:2181:2181",
            "zk://h:1/zookeeper",
            "zk://h:1/zookeeper/quota",
            "zk://h:1?prefix=a&prefix=b",
            "zk://h:1?connect_timeout_ms=18446744073709551615",
            "zk://h:1?connect_timeout_ms=3600001",
            "zk://h:+1",
            "zk://h:1?connect_timeout=2s&connect_timeout_ms=5",
            "zk://u:12?pw@h:1",
            "zk://h:1?tls_cert=c.pem&tls_key=k.pem",
            "zk://h:1?tls_ca=ca.pem&tls_server_name=x",
        ] {
            match ZkConfig::from_url(bad) {
                Err(Error::InvalidConfig { .. }) => {}
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        let long = format!("zk://h:1?prefix={}", "x".repeat(65));
        assert!(ZkConfig::from_url(&long).is_err());
    }

    #[test]
    fn chroot_is_percent_decoded() {
        let cfg = ZkConfig::from_url("zk://h:1/apps%20x/b").unwrap();
        assert_eq!(cfg.connect_string(), "h:1/apps x/b");
        assert!(ZkConfig::from_url("zk://[::1]:2181").is_ok());
        let c: ZkConfig = "zk://h:1?connect_timeout=750ms&tls_ca=ca.pem"
            .parse()
            .unwrap();
        assert!(c.get_tls().is_some_and(|t| t.ca.is_some()));
        assert_eq!(c.get_connect_timeout(), Duration::from_millis(750));
    }

    #[test]
    fn sasl_digest_md5() {
        let cfg = ZkConfig::from_url("zk://app:s%40cret@h:1?sasl=digest-md5").unwrap();
        assert!(cfg.sasl_options().is_some());
        assert!(cfg.digest_auth().is_none() && cfg.authenticated());
        assert_eq!(cfg.get_user(), Some("app"));
        let dbg = format!("{cfg:?}");
        assert!(
            !dbg.contains("s@cret") && !dbg.contains("s%40cret"),
            "{dbg}"
        );
        assert!(dbg.contains("sasl-digest-md5"), "{dbg}");
        assert_eq!(cfg, ZkConfig::new(["h:1"]).sasl_digest_md5("app", "s@cret"));
        assert!(ZkConfig::from_url("zk://app:pw@h:1?sasl=DIGEST-MD5").is_ok());
        for bad in [
            "zk://h:1?sasl=digest-md5",
            "zk://app:pw@h:1?sasl=gssapi",
            "zk://app:pw@h:1?sasl=",
            "zk://app:pw@h:1?sasl=digest-md5&sasl=digest-md5",
        ] {
            match ZkConfig::from_url(bad) {
                Err(e @ Error::InvalidConfig { .. }) => {
                    assert!(!format!("{e:?} {e}").contains("pw"), "{bad}: {e}")
                }
                other => panic!("{bad:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn secret_never_in_errors() {
        let e = ZkConfig::from_url("zk://u:hunter2@h:1?bogus=1").unwrap_err();
        assert!(!format!("{e:?} {e}").contains("hunter2"));
    }

    #[test]
    fn name_encoding() {
        assert_eq!(encode_name("jobs:nightly *?[]ü"), "jobs:nightly *?[]ü");
        assert_eq!(encode_name("100%"), "100%25");
        assert_eq!(encode_name("a\u{e000}b"), "a%EE%80%80b");
        assert_eq!(encode_name("🔒"), "%F0%9F%94%92");
        assert_eq!(encode_name("zookeeper"), "zookeeper");
        assert_ne!(encode_name("%25"), encode_name("%"));
        assert!(!encode_name("x\u{fff0}").chars().any(forbidden_in_znode));
    }
}
