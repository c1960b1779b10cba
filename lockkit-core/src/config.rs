//! The connection-URL grammar every backend shares: [`BackendUrl`].
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use percent_encoding::percent_decode_str;

use crate::{Error, MAX_TTL, Result};

/// The longest URL accepted, in bytes: 16 KiB.
pub const MAX_URL_BYTES: usize = 16 * 1024;

/// The most characters of a parameter name an error message quotes.
pub const MAX_EXCERPT_CHARS: usize = 32;

/// A string that never shows in `Debug` (a password).
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps `s`.
    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }

    /// The secret itself.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<hidden>")
    }
}

/// TLS settings shared by every backend: files are PEM and read when connecting.
///
/// Whether TLS is on at all is the backend's choice (its TLS scheme such as `rediss://`, or
/// `sslmode` on PostgreSQL); [`BackendUrl::take_common`] only collects these. `Debug` shows the
/// paths, never the files' contents.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsOptions {
    /// `tls_ca`: root certificate(s) to trust instead of the system's.
    pub ca: Option<PathBuf>,
    /// `tls_cert`: the client certificate (chain) for mutual TLS.
    pub cert: Option<PathBuf>,
    /// `tls_key`: the client certificate's private key.
    pub key: Option<PathBuf>,
    /// `tls_server_name`: the name to verify the server certificate against (and send as SNI).
    pub server_name: Option<String>,
}

impl TlsOptions {
    /// Whether any TLS parameter is set.
    pub fn is_set(&self) -> bool {
        self.ca.is_some() || self.cert.is_some() || self.key.is_some() || self.server_name.is_some()
    }

    /// Sets `ca` (the backends' `tls_ca` setters).
    pub fn with_ca(mut self, ca: impl Into<PathBuf>) -> Self {
        self.ca = Some(ca.into());
        self
    }

    /// Sets `cert` and `key` (the backends' `tls_client_cert` setters).
    pub fn with_client_cert(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.cert = Some(cert.into());
        self.key = Some(key.into());
        self
    }

    /// Checks that `cert` and `key` come together and the server name is a plausible DNS name or
    /// IP address.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the rule.
    pub fn validate(&self) -> Result<()> {
        if self.cert.is_some() != self.key.is_some() {
            return Err(Error::config(
                "tls_cert and tls_key must be given together (client certificate and its key)",
            ));
        }
        for (name, p) in [
            ("tls_ca", &self.ca),
            ("tls_cert", &self.cert),
            ("tls_key", &self.key),
        ] {
            if p.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
                return Err(Error::config(format!("{name} is empty")));
            }
        }
        if let Some(n) = &self.server_name
            && url::Host::parse(n).is_err()
        {
            return Err(Error::config(
                "tls_server_name is not a DNS name or IP address",
            ));
        }
        Ok(())
    }
}

/// The largest PEM file (`tls_ca`, `tls_cert`, `tls_key`) read, in bytes: 1 MiB.
pub const MAX_PEM_BYTES: u64 = 1 << 20;

/// Reads the PEM file `path` of parameter `what` (`tls_ca`, `tls_cert`, `tls_key`).
///
/// # Errors
/// [`Error::InvalidConfig`] naming `what` if the file is missing, not a regular file (a FIFO or a
/// device would block), larger than [`MAX_PEM_BYTES`] or unreadable. Never the contents.
///
/// # Cancel safety
/// Cancel safe.
pub async fn read_pem(path: &std::path::Path, what: &str) -> Result<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let cannot = |e| Error::config_with(format!("cannot read {what}"), e);
    let meta = tokio::fs::metadata(path).await.map_err(cannot)?;
    if !meta.is_file() {
        return Err(Error::config(format!("{what} is not a regular file")));
    }
    if meta.len() > MAX_PEM_BYTES {
        return Err(Error::config(format!("{what} is larger than 1 MiB")));
    }
    let file = tokio::fs::File::open(path).await.map_err(cannot)?;
    let mut pem = Vec::new();
    file.take(MAX_PEM_BYTES + 1)
        .read_to_end(&mut pem)
        .await
        .map_err(cannot)?;
    if pem.len() as u64 > MAX_PEM_BYTES {
        return Err(Error::config(format!("{what} is larger than 1 MiB")));
    }
    Ok(pem)
}

/// What [`BackendUrl::take_common`] read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CommonParams {
    /// `prefix`, if given.
    pub prefix: Option<String>,
    /// `connect_timeout` (or `connect_timeout_ms`), if given.
    pub connect_timeout: Option<Duration>,
    /// `tls_ca`, `tls_cert`, `tls_key`, `tls_server_name`.
    pub tls: TlsOptions,
}

/// One `host[:port]` of a URL's host list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostPort {
    /// The host: a DNS name, an IPv4 address, or an IPv6 address in brackets (`[::1]`).
    pub host: String,
    /// The port (1–65535).
    pub port: u16,
}

impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

/// A connection URL split by the grammar every backend shares.
///
/// ```text
/// scheme://[user[:password]@]hosts[/path][?name=value&…][#fragment]
/// ```
///
/// [`parse`](Self::parse) splits a URL once, with the same rules for every scheme:
///
/// - The scheme is case-insensitive. The user info ends at the **last `@` before the first
///   `/`**, so a password may hold `@` and `:`, but a raw `?` or `#` before that `@` is refused
///   (percent-encode them, `%3F` / `%23`; an `@` in a query value of a URL without a path is
///   `%40`). User name and password are percent-decoded; a `%` not followed by two hex digits
///   is refused (a literal `%` is `%25`).
/// - Query parameters are form-decoded; each may be given once (an alias and its name count as
///   the same parameter) and every one must be known to the backend: [`finish`](Self::finish)
///   refuses the rest, so a typo never falls back to a default silently.
/// - Errors are [`Error::InvalidConfig`] and never echo the URL: at most a short excerpt of a
///   parameter *name* ([`excerpt`]), never a value, a password or a path.
///
/// The parameters every backend reads the same way ([`take_common`](Self::take_common)):
///
/// | parameter | meaning | alias |
/// |---|---|---|
/// | `prefix` | key namespace | — |
/// | `connect_timeout` | a duration: `500ms`, `2s`, `1m 30s` ([humantime]), or a bare number of seconds (`2.5`) | `connect_timeout_ms` (whole milliseconds) |
/// | `tls_ca` | PEM file with the root certificate(s) to trust instead of the system's | backend's own (`tls_ca_file`, `sslrootcert`) |
/// | `tls_cert` | PEM file with the client certificate (mutual TLS); needs `tls_key` | backend's own (`sslcert`) |
/// | `tls_key` | PEM file with the client certificate's private key; needs `tls_cert` | backend's own (`sslkey`) |
/// | `tls_server_name` | the name the server certificate must carry, if not the host's | — |
///
/// [humantime]: https://docs.rs/humantime
///
/// `Debug` hides the password and shows only the names of the query parameters (a value such as
/// PostgreSQL's `password=` may be a secret).
#[derive(Clone)]
pub struct BackendUrl {
    scheme: String,
    username: Option<String>,
    password: Option<Secret>,
    hosts: String,
    path: String,
    fragment: Option<String>,
    /// Decoded query pairs and whether a `take_*` consumed each.
    params: Vec<(String, String, bool)>,
}

impl fmt::Debug for BackendUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.params.iter().map(|(k, _, _)| k.as_str()).collect();
        f.debug_struct("BackendUrl")
            .field("scheme", &self.scheme)
            .field("username", &self.username)
            .field("password", &self.password)
            .field("hosts", &self.hosts)
            .field("path", &self.path)
            .field("parameters", &names)
            .finish_non_exhaustive()
    }
}

impl BackendUrl {
    /// Splits `url`, whose scheme must be one of `schemes` (lower case).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a URL longer than [`MAX_URL_BYTES`], without `scheme://`,
    /// with another scheme, a raw `?`/`#` in the user info, user info with an invalid
    /// percent-escape (a `%` not followed by two hex digits) or that is not UTF-8 after
    /// percent-decoding, or a repeated query parameter.
    pub fn parse(url: &str, schemes: &[&str]) -> Result<Self> {
        if url.len() > MAX_URL_BYTES {
            return Err(Error::config("the URL is longer than 16 KiB"));
        }
        let expected = || {
            let list: Vec<String> = schemes.iter().map(|s| format!("{s}://")).collect();
            Error::config(format!("expected a {} URL", list.join(" or ")))
        };
        let (scheme, rest) = url.split_once("://").ok_or_else(expected)?;
        let scheme = scheme.to_ascii_lowercase();
        if !schemes.contains(&scheme.as_str()) {
            return Err(expected());
        }
        // The user info ends at the last '@' before the first '/'.
        let slash = rest.find('/').unwrap_or(rest.len());
        let (userinfo, rest) = match rest[..slash].rfind('@') {
            Some(at) => (Some(&rest[..at]), &rest[at + 1..]),
            None => (None, rest),
        };
        let (username, password) = match userinfo {
            None => (None, None),
            Some(u) if u.contains(['?', '#']) => {
                return Err(Error::config(
                    "the URL has a raw '?' or '#' before its '@': percent-encode them in a user \
                     name or password (%3F, %23), and an '@' in a query value (%40)",
                ));
            }
            Some(u) => {
                let (user, pass) = match u.split_once(':') {
                    Some((user, pass)) => (user, Some(pass)),
                    None => (u, None),
                };
                let user = decode(user, "user name")?;
                let pass = pass.map(|p| decode(p, "password")).transpose()?;
                ((!user.is_empty()).then_some(user), pass.map(Secret))
            }
        };
        let (rest, fragment) = match rest.split_once('#') {
            Some((r, f)) => (r, Some(f.to_owned())),
            None => (rest, None),
        };
        let (rest, query) = match rest.split_once('?') {
            Some((r, q)) => (r, q),
            None => (rest, ""),
        };
        let (hosts, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        let mut params: Vec<(String, String, bool)> = Vec::new();
        for (k, v) in url::form_urlencoded::parse(query.as_bytes()) {
            if params.iter().any(|(seen, _, _)| *seen == k) {
                return Err(Error::config(format!(
                    "URL parameter {} is given more than once",
                    excerpt(&k)
                )));
            }
            params.push((k.into_owned(), v.into_owned(), false));
        }
        Ok(Self {
            scheme,
            username,
            password,
            hosts: hosts.to_owned(),
            path: path.to_owned(),
            fragment,
            params,
        })
    }

    /// The scheme, in lower case.
    pub fn scheme(&self) -> &str {
        &self.scheme
    }

    /// The percent-decoded user name, if one was given (an empty one counts as none).
    pub fn username(&self) -> Option<&str> {
        self.username.as_deref()
    }

    /// The percent-decoded password, if one was given.
    pub fn password(&self) -> Option<&str> {
        self.password.as_ref().map(Secret::expose)
    }

    /// The host list as written (`h1:1,h2:2`), between the user info and the path.
    pub fn hosts(&self) -> &str {
        &self.hosts
    }

    /// The path as written (empty, or starting with `/`), not decoded.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The fragment as written (after `#`), if any.
    pub fn fragment(&self) -> Option<&str> {
        self.fragment.as_deref()
    }

    /// The path, percent-decoded.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if it is not UTF-8 after decoding.
    pub fn decoded_path(&self) -> Result<String> {
        decode(&self.path, "path")
    }

    /// Splits the host list on `,` into hosts and ports (see [`parse_host_port`]).
    ///
    /// # Errors
    /// As [`parse_host_port`], and for an empty list.
    pub fn host_list(&self, default_port: Option<u16>) -> Result<Vec<HostPort>> {
        if self.hosts.is_empty() {
            return Err(Error::config("the URL names no host"));
        }
        self.hosts
            .split(',')
            .map(|h| parse_host_port(h, default_port))
            .collect()
    }

    /// Takes parameter `name` or one of its `aliases` (older spellings).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if more than one of them is given.
    pub fn take(&mut self, name: &str, aliases: &[&str]) -> Result<Option<String>> {
        let mut found: Option<String> = None;
        for (k, v, used) in &mut self.params {
            if k == name || aliases.contains(&k.as_str()) {
                if found.is_some() {
                    return Err(Error::config(format!(
                        "URL parameter {name} is given more than once (under several of its \
                         names: {name}, {})",
                        aliases.join(", ")
                    )));
                }
                *used = true;
                found = Some(v.clone());
            }
        }
        Ok(found)
    }

    /// Takes a duration parameter: `name` as a [humantime](https://docs.rs/humantime) duration
    /// or bare seconds ([`parse_duration`]), or the alias `ms_alias` as whole milliseconds.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a malformed, zero or over-24-hour value, or both spellings.
    pub fn take_duration(
        &mut self,
        name: &str,
        ms_alias: Option<&str>,
    ) -> Result<Option<Duration>> {
        let ms = match ms_alias {
            Some(alias) => self.take(alias, &[])?,
            None => None,
        };
        let plain = self.take(name, &[])?;
        match (plain, ms) {
            (Some(_), Some(_)) => Err(Error::config(format!(
                "URL parameter {name} is given twice (as {name} and {})",
                ms_alias.unwrap_or_default()
            ))),
            (Some(v), None) => parse_duration(name, &v).map(Some),
            (None, Some(v)) => {
                let alias = ms_alias.unwrap_or_default();
                match v.parse::<u64>() {
                    Ok(n) if n > 0 => check_duration(alias, Duration::from_millis(n)).map(Some),
                    _ => Err(Error::config(format!(
                        "{alias} must be a positive whole number of milliseconds"
                    ))),
                }
            }
            (None, None) => Ok(None),
        }
    }

    /// Takes a boolean parameter (`true`/`false`, `1`/`0`, `yes`/`no`, `on`/`off`).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for another value.
    pub fn take_bool(&mut self, name: &str) -> Result<Option<bool>> {
        match self.take(name, &[])? {
            None => Ok(None),
            Some(v) => match v.as_str() {
                "true" | "1" | "yes" | "on" => Ok(Some(true)),
                "false" | "0" | "no" | "off" => Ok(Some(false)),
                _ => Err(Error::config(format!("{name} must be true or false"))),
            },
        }
    }

    /// Takes what every backend shares: `prefix`, `connect_timeout` (alias
    /// `connect_timeout_ms`), `tls_ca`, `tls_cert`, `tls_key`, `tls_server_name`, each also
    /// under the backend's own older names in `tls_aliases` (`[ca, cert, key]` alias lists).
    ///
    /// # Errors
    /// As [`take`](Self::take) and [`take_duration`](Self::take_duration), and
    /// [`TlsOptions::validate`].
    pub fn take_common(&mut self, tls_aliases: [&[&str]; 3]) -> Result<CommonParams> {
        let prefix = self.take("prefix", &[])?;
        let connect_timeout = self.take_duration("connect_timeout", Some("connect_timeout_ms"))?;
        let path = |v: Option<String>| v.map(PathBuf::from);
        let tls = TlsOptions {
            ca: path(self.take("tls_ca", tls_aliases[0])?),
            cert: path(self.take("tls_cert", tls_aliases[1])?),
            key: path(self.take("tls_key", tls_aliases[2])?),
            server_name: self.take("tls_server_name", &[])?,
        };
        tls.validate()?;
        Ok(CommonParams {
            prefix,
            connect_timeout,
            tls,
        })
    }

    /// The parameters not taken yet, in URL order (for a backend that passes them on).
    pub fn take_rest(&mut self, allowed: impl Fn(&str) -> bool) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for (k, v, used) in &mut self.params {
            if !*used && allowed(k) {
                *used = true;
                out.push((k.clone(), v.clone()));
            }
        }
        out
    }

    /// Refuses every parameter no `take_*` consumed; `known` lists the backend's parameters for
    /// the message.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming (an excerpt of) the first unknown parameter.
    pub fn finish(&self, backend: &str, known: &[&str]) -> Result<()> {
        match self.params.iter().find(|(_, _, used)| !used) {
            None => Ok(()),
            Some((k, _, _)) => Err(Error::config(format!(
                "unknown {backend} URL parameter {} (known: {})",
                excerpt(k),
                known.join(", ")
            ))),
        }
    }
}

/// `host[:port]`, an IPv6 host in brackets (`[::1]:2181`); the port is 1–65535 in ASCII digits
/// only (no sign); without a port, `default_port` (an error if `None`).
///
/// # Errors
/// [`Error::InvalidConfig`] naming what is wrong, never quoting the input.
pub fn parse_host_port(s: &str, default_port: Option<u16>) -> Result<HostPort> {
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (v6, after) = rest
            .split_once(']')
            .ok_or_else(|| Error::config("an IPv6 host lacks its closing ']'"))?;
        let port = match after {
            "" => None,
            p => Some(
                p.strip_prefix(':')
                    .ok_or_else(|| Error::config("expected ':port' after an IPv6 host"))?,
            ),
        };
        (format!("[{v6}]"), port)
    } else {
        match s.rsplit_once(':') {
            Some((h, p)) => (h.to_owned(), Some(p)),
            None => (s.to_owned(), None),
        }
    };
    if host.is_empty() || host == "[]" {
        return Err(Error::config("a host in the URL is empty"));
    }
    if host.contains(['@', '/', '?', '#', '%', '\\']) || url::Host::parse(&host).is_err() {
        return Err(Error::config(
            "a host in the URL is not a DNS name, an IPv4 address or a bracketed IPv6 address",
        ));
    }
    let port = match port {
        None => default_port.ok_or_else(|| Error::config("a host in the URL has no :port"))?,
        Some(p) => parse_port(p)?,
    };
    Ok(HostPort { host, port })
}

fn parse_port(p: &str) -> Result<u16> {
    let bad = || Error::config("a port in the URL is not a number from 1 to 65535");
    if p.is_empty() || p.len() > 5 || !p.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    match p.parse::<u16>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(bad()),
    }
}

/// Parses a duration parameter: a [humantime](https://docs.rs/humantime) duration (`500ms`,
/// `2s`, `1m 30s`) or a bare number of seconds (`2`, `0.25`); positive and at most 24 h.
///
/// # Errors
/// [`Error::InvalidConfig`] naming `name` (the value is not quoted).
pub fn parse_duration(name: &str, value: &str) -> Result<Duration> {
    let v = value.trim();
    let parsed = if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        v.parse::<f64>()
            .ok()
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
    } else {
        humantime::parse_duration(v).ok()
    };
    match parsed {
        Some(d) if !d.is_zero() => check_duration(name, d),
        _ => Err(Error::config(format!(
            "{name} must be a positive duration such as 500ms, 2s or 1.5 (seconds)"
        ))),
    }
}

fn check_duration(name: &str, d: Duration) -> Result<Duration> {
    if d > MAX_TTL {
        return Err(Error::config(format!("{name} is longer than 24 hours")));
    }
    Ok(d)
}

/// `s` as it may appear in an error message: Debug-quoted, at most [`MAX_EXCERPT_CHARS`]
/// characters, control characters escaped, `…` when cut.
pub fn excerpt(s: &str) -> String {
    let mut cut: String = s.chars().take(MAX_EXCERPT_CHARS).collect();
    if cut.len() < s.len() {
        cut.push('…');
    }
    format!("{cut:?}")
}

fn decode(s: &str, what: &str) -> Result<String> {
    // percent_decode_str passes a '%' that starts no escape through as it is: a password
    // `p%ZZw` would be sent as written, which is never what was meant.
    let b = s.as_bytes();
    let bad = b.iter().enumerate().any(|(i, &c)| {
        c == b'%'
            && !(b.get(i + 1).is_some_and(u8::is_ascii_hexdigit)
                && b.get(i + 2).is_some_and(u8::is_ascii_hexdigit))
    });
    if bad {
        return Err(Error::config(format!(
            "the URL's {what} has a '%' that is not followed by two hex digits: write a \
             literal '%' as %25"
        )));
    }
    percent_decode_str(s)
        .decode_utf8()
        .map(|c| c.into_owned())
        .map_err(|_| {
            Error::config(format!(
                "the URL's {what} is not UTF-8 once percent-decoded"
            ))
        })
}

/// Deserializes a configuration from its URL string with its [`FromStr`](std::str::FromStr)
/// (feature `serde`): what each backend config's `Deserialize` does.
///
/// # Errors
/// The config's parse error, as a serde custom error (secret-free, as every config error).
#[cfg(feature = "serde")]
#[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
pub fn deserialize_url<'de, D, T>(d: D) -> std::result::Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: std::str::FromStr<Err = Error>,
{
    let s = <std::borrow::Cow<'de, str> as serde::Deserialize>::deserialize(d)?;
    s.parse().map_err(serde::de::Error::custom)
}

/// Why a TLS handshake failed, as far as the client can tell ([`tls_failure`]).
#[cfg(feature = "rustls")]
#[cfg_attr(docsrs, doc(cfg(feature = "rustls")))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsFailure {
    /// The client rejected the server's certificate: unknown CA, expired, not for this name.
    ServerCertificate,
    /// The server rejected the client's certificate (or its absence) with a TLS alert.
    ClientCertificate,
}

#[cfg(feature = "rustls")]
impl TlsFailure {
    /// The [`Error::Auth`] for this failure: names what to check, keeps `source`.
    pub fn into_error(self, backend: &'static str, source: crate::BoxError) -> Error {
        let what = match self {
            TlsFailure::ServerCertificate => {
                "TLS: the server's certificate was not accepted (is tls_ca the CA that signed \
                 it, is it valid now, does it name the host?)"
            }
            TlsFailure::ClientCertificate => {
                "TLS: the server refused the client certificate (tls_cert/tls_key missing, \
                 signed by a CA the server does not trust, or not accepted)"
            }
        };
        Error::Auth {
            backend,
            source: format!("{what}: {source}").into(),
        }
    }
}

/// Looks through `err`'s source chain for a rustls error that means a certificate was
/// refused. Backends turn that into [`Error::Auth`] (a wrong CA, an expired or mismatched
/// certificate and a missing or foreign client certificate are all authentication failures;
/// retrying does not help), and leave other TLS errors, such as a TLS client talking to a
/// plain-text server, as they are (`Unavailable`).
#[cfg(feature = "rustls")]
#[cfg_attr(docsrs, doc(cfg(feature = "rustls")))]
pub fn tls_failure(err: &(dyn std::error::Error + 'static)) -> Option<TlsFailure> {
    use rustls::AlertDescription as A;
    let mut next = Some(err);
    while let Some(e) = next {
        // Some clients (redis) keep their cause behind an `Arc<dyn Error>`, whose own
        // `source()` skips the cause itself.
        if let Some(inner) = e.downcast_ref::<std::sync::Arc<dyn std::error::Error + Send + Sync>>()
        {
            next = Some(&**inner);
            continue;
        }
        let tls = e.downcast_ref::<rustls::Error>().or_else(|| {
            e.downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        });
        match tls {
            Some(rustls::Error::InvalidCertificate(_)) => {
                return Some(TlsFailure::ServerCertificate);
            }
            Some(rustls::Error::AlertReceived(
                A::BadCertificate
                | A::UnsupportedCertificate
                | A::CertificateRevoked
                | A::CertificateExpired
                | A::CertificateUnknown
                | A::UnknownCA
                | A::AccessDenied
                | A::CertificateRequired
                | A::NoCertificate
                | A::HandshakeFailure,
            )) => return Some(TlsFailure::ClientCertificate),
            _ => {}
        }
        next = e.source();
    }
    None
}

/// Implements [`FromStr`](std::str::FromStr) (by its `from_url`) and, with the backend crate's
/// `serde` feature, `Deserialize` from the URL string ([`deserialize_url`]) for a backend's
/// config type, so every backend's config offers the same ways in.
///
/// `impl_url_config!(RedisConfig);` in the defining crate; the type must have
/// `fn from_url(&str) -> lockkit_core::Result<Self>`.
#[macro_export]
macro_rules! impl_url_config {
    ($ty:ty) => {
        impl ::std::str::FromStr for $ty {
            type Err = $crate::Error;

            fn from_str(s: &str) -> $crate::Result<Self> {
                Self::from_url(s)
            }
        }

        /// Deserializes from the URL string (its `from_url`).
        #[cfg(feature = "serde")]
        #[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
        impl<'de> $crate::backend::serde::Deserialize<'de> for $ty {
            fn deserialize<D: $crate::backend::serde::Deserializer<'de>>(
                d: D,
            ) -> ::std::result::Result<Self, D::Error> {
                $crate::backend::deserialize_url(d)
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(s: &str) -> BackendUrl {
        BackendUrl::parse(s, &["x", "xs"]).unwrap()
    }

    #[test]
    fn splits_userinfo_before_the_query() {
        let u = url("X://app:p%40ss:w@h1:1,[::1]:2/some/path?prefix=a&b=c#frag");
        assert_eq!(u.scheme(), "x");
        assert_eq!(u.username(), Some("app"));
        assert_eq!(u.password(), Some("p@ss:w"));
        assert_eq!(u.hosts(), "h1:1,[::1]:2");
        assert_eq!(u.path(), "/some/path");
        assert_eq!(u.fragment(), Some("frag"));
        assert_eq!(
            u.host_list(None).unwrap(),
            [
                HostPort {
                    host: "h1".into(),
                    port: 1
                },
                HostPort {
                    host: "[::1]".into(),
                    port: 2
                }
            ]
        );
        assert!(!format!("{u:?}").contains("p@ss"));
        // An '@' inside the password, the query or the path does not move the split.
        let u = url("x://u:a@b@h/p@q?tls_ca=/a@b");
        assert_eq!((u.password(), u.hosts()), (Some("a@b"), "h"));
    }

    #[test]
    fn raw_question_mark_in_password_is_refused_without_echo() {
        for bad in ["x://app:123?hunter2@host", "x://app:12#hunter2@host"] {
            let e = BackendUrl::parse(bad, &["x"]).unwrap_err();
            let shown = format!("{e} {e:?}");
            assert!(!shown.contains("hunter2"), "{shown}");
            assert!(matches!(e, Error::InvalidConfig { .. }));
        }
    }

    #[test]
    fn invalid_percent_escape_in_userinfo_is_refused_without_echo() {
        for bad in [
            "x://:p%ZZwhunter2@h",
            "x://u:hunter2%4@h",
            "x://u:hunter2%@h",
            "x://hunter2%zz:pw@h",
        ] {
            let e = BackendUrl::parse(bad, &["x"]).unwrap_err();
            let shown = format!("{e} {e:?}");
            assert!(!shown.contains("hunter2"), "{shown}");
            assert!(matches!(e, Error::InvalidConfig { .. }), "{bad}");
        }
        assert_eq!(url("x://:p%25ZZ%41@h").password(), Some("p%ZZA"));
    }

    #[test]
    fn repeated_aliases_unknown_and_long_names() {
        assert!(BackendUrl::parse("x://h?prefix=a&prefix=b", &["x"]).is_err());
        let mut u = url("x://h?connect_timeout=2s&connect_timeout_ms=5");
        assert!(u.take_common([&[], &[], &[]]).is_err());
        let mut u = url("x://h?tls_ca=a&tls_ca_file=b");
        assert!(u.take_common([&["tls_ca_file"], &[], &[]]).is_err());
        let long = format!("x://h?{}=1", "k".repeat(10_000));
        let e = url(&long).finish("x", &["prefix"]).unwrap_err();
        assert!(e.to_string().len() < 200, "{}", e.to_string().len());
        let e = BackendUrl::parse(&format!("x://h?{}", "k".repeat(20_000)), &["x"]).unwrap_err();
        assert!(e.to_string().len() < 200);
    }

    #[test]
    fn durations_and_ports() {
        let d = |v: &str| parse_duration("t", v);
        assert_eq!(d("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(d("2s").unwrap(), Duration::from_secs(2));
        assert_eq!(d("1.5").unwrap(), Duration::from_millis(1500));
        assert_eq!(d("1m 30s").unwrap(), Duration::from_secs(90));
        for bad in [
            "", "0", "0s", "-1", "nan", "inf", "1e400", "25h", "soon", "1.2.3",
        ] {
            assert!(d(bad).is_err(), "{bad}");
        }
        let mut u = url("x://h?connect_timeout_ms=250");
        let c = u.take_common([&[], &[], &[]]).unwrap();
        assert_eq!(c.connect_timeout, Some(Duration::from_millis(250)));
        for bad in [
            "h:+1", "h:0", "h:65536", "h:", "h: 1", ":1", "[::1", "a b:1", "h:1:2",
        ] {
            assert!(parse_host_port(bad, None).is_err(), "{bad}");
        }
        assert_eq!(parse_host_port("h", Some(7)).unwrap().port, 7);
    }

    #[test]
    fn tls_cert_needs_key() {
        let mut u = url("x://h?tls_cert=c.pem");
        assert!(u.take_common([&[], &[], &[]]).is_err());
        let mut u = url("x://h?tls_cert=c.pem&tls_key=k.pem&tls_ca=ca.pem&tls_server_name=db");
        let c = u.take_common([&[], &[], &[]]).unwrap();
        assert_eq!(c.tls.server_name.as_deref(), Some("db"));
        u.finish("x", &[]).unwrap();
    }
}
