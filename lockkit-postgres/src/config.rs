//! Connection settings: the `postgres://` URL, the key prefix and lockkit's schema.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use std::path::PathBuf;

use lockkit_core::backend::{BackendUrl, TlsOptions, parse_host_port};
use lockkit_core::{Error, Result};
use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};
use sqlx::postgres::{PgConnectOptions, PgSslMode};

/// The default key prefix (lock namespace).
pub const DEFAULT_PREFIX: &str = "lockkit";

/// The default schema of lockkit's table(s).
pub const DEFAULT_SCHEMA: &str = "lockkit";

/// The default time allowed for opening one connection: 10 s.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The shortest connect timeout accepted: 10 ms.
pub const MIN_CONNECT_TIMEOUT: Duration = Duration::from_millis(10);

/// The longest connect timeout accepted: 1 hour.
pub const MAX_CONNECT_TIMEOUT: Duration = Duration::from_secs(3600);

/// The port used when the URL names none: 5432.
pub const DEFAULT_PORT: u16 = 5432;

/// The URL parameters passed on to sqlx's [`PgConnectOptions`] (besides `options[NAME]`); the
/// TLS ones are read by lockkit first (`sslmode`, `tls_*` and their sqlx spellings).
const SQLX_PARAMS: &[&str] = &[
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "application_name",
    "options",
];

/// Settings of a [`PgLock`](crate::PgLock): where the server is, the lock namespace, lockkit's
/// schema, timeouts.
///
/// Build it from a URL with [`PgConfig::from_url`], or from sqlx's [`PgConnectOptions`] with
/// [`PgConfig::new`] and the chained setters. Both read the usual `PG*` environment variables
/// (`PGHOST`, `PGPORT`, `PGUSER`, `PGPASSWORD`, `PGDATABASE`, `PGSSLMODE`, …) and `~/.pgpass` for
/// what the URL leaves out, exactly as sqlx's [`PgConnectOptions`] does.
///
/// `Debug` never prints the password.
///
/// ```
/// use lockkit_postgres::PgConfig;
///
/// let config = PgConfig::from_url(
///     "postgres://app:secret@db.example:5432/app?prefix=billing&schema=locks",
/// )?;
/// assert_eq!(config.get_prefix(), "billing");
/// assert_eq!(config.get_schema(), "locks");
/// assert!(!format!("{config:?}").contains("secret"));
/// # Ok::<(), lockkit_core::Error>(())
/// ```
#[derive(Clone)]
pub struct PgConfig {
    pub(crate) connect: PgConnectOptions,
    pub(crate) prefix: String,
    pub(crate) schema: String,
    pub(crate) connect_timeout: Duration,
    pub(crate) auto_migrate: bool,
    pub(crate) max_idle: usize,
    tls: TlsOptions,
}

impl fmt::Debug for PgConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.connect;
        f.debug_struct("PgConfig")
            .field("host", &c.get_host())
            .field("port", &c.get_port())
            .field("socket", &c.get_socket())
            .field("user", &c.get_username())
            .field("database", &c.get_database())
            .field("ssl_mode", &c.get_ssl_mode())
            .field("tls_files", &self.tls)
            .field("password", &"<hidden>")
            .field("prefix", &self.prefix)
            .field("schema", &self.schema)
            .field("connect_timeout", &self.connect_timeout)
            .field("auto_migrate", &self.auto_migrate)
            .field("max_idle", &self.max_idle)
            .finish()
    }
}

impl PgConfig {
    /// Settings for the server described by `connect`, with the default prefix (`lockkit`), schema
    /// (`lockkit`), connect timeout (10 s) and automatic migration on.
    pub fn new(connect: PgConnectOptions) -> Self {
        Self {
            connect,
            prefix: DEFAULT_PREFIX.to_owned(),
            schema: DEFAULT_SCHEMA.to_owned(),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            auto_migrate: true,
            max_idle: 8,
            tls: TlsOptions::default(),
        }
    }

    /// Parses a `postgres://` (or `postgresql://`) URL, by the grammar all lockkit backends
    /// share ([`BackendUrl`](lockkit_core::backend::BackendUrl)):
    /// `postgres[ql]://[user[:password]@][host][:port][/database][?param=value&…]`.
    ///
    /// | parameter | meaning | default | aliases |
    /// |---|---|---|---|
    /// | `prefix` | lock namespace: names are locked as `{prefix}/{name}` | `lockkit` | |
    /// | `schema` | schema of lockkit's table `{schema}.fence` | `lockkit` | |
    /// | `connect_timeout` | duration for opening one connection: `2s`, `500ms`, or bare seconds as in libpq (`2.5`); 10 ms – 1 h | `10s` | `connect_timeout_ms` |
    /// | `auto_migrate` | create the table on connect if it is missing (`true`/`false`) | `true` | |
    /// | `sslmode` | `disable`, `allow`, `prefer`, `require`, `verify-ca`, `verify-full` | `prefer`, or `verify-full` when `tls_ca` or `tls_cert` is given | `ssl-mode` |
    /// | `tls_ca` | PEM root certificate(s) to verify the server against | system roots | `sslrootcert`, `ssl-root-cert`, `ssl-ca` |
    /// | `tls_cert`, `tls_key` | PEM client certificate and key (`clientcert=verify-full` in `pg_hba.conf`) | none | `sslcert`/`ssl-cert`, `sslkey`/`ssl-key` |
    ///
    /// sqlx's other parameters pass through (`host`, `hostaddr`, `port`, `dbname`, `user`,
    /// `password`, `application_name`, `options`, `options[NAME]`,
    /// `statement-cache-capacity`); anything else (a misspelling such as `ssl_mode`) is an
    /// error, and so is any parameter given twice (under one name or two of its aliases).
    /// What the URL leaves out comes from the `PG*` environment variables, as in sqlx.
    /// `tls_server_name` is refused: sqlx verifies the certificate against the host.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if the URL is malformed, its scheme is not `postgres`/`postgresql`,
    /// or a parameter is invalid. The URL itself is never part of the message (it may hold a
    /// password).
    pub fn from_url(url: &str) -> Result<Self> {
        let mut u = BackendUrl::parse(url, &["postgres", "postgresql"])?;
        if u.fragment().is_some() {
            return Err(Error::config("a postgres:// URL must not have a fragment"));
        }
        // A percent-encoded socket directory (`postgres://%2Fvar%2Frun%2Fpostgresql/db`) is
        // sqlx's to read; anything else must be one host[:port].
        let socket = u
            .hosts()
            .get(..3)
            .is_some_and(|h| h.eq_ignore_ascii_case("%2F"));
        if !u.hosts().is_empty() && !socket {
            parse_host_port(u.hosts(), Some(DEFAULT_PORT))?;
        }
        let common = u.take_common([
            &["sslrootcert", "ssl-root-cert", "ssl-ca"],
            &["sslcert", "ssl-cert"],
            &["sslkey", "ssl-key"],
        ])?;
        let ssl_mode = match u.take("sslmode", &["ssl-mode"])? {
            None => None,
            Some(m) => Some(parse_ssl_mode(&m)?),
        };
        let schema = u.take("schema", &[])?;
        let auto_migrate = u.take_bool("auto_migrate")?;
        let rest = u.take_rest(|k| SQLX_PARAMS.contains(&k) || k.starts_with("options["));
        u.finish(
            "postgres",
            &[
                "prefix",
                "schema",
                "connect_timeout",
                "auto_migrate",
                "sslmode",
                "tls_ca",
                "tls_cert",
                "tls_key",
                "and sqlx's host, hostaddr, port, dbname, user, password, application_name, \
                 options, statement-cache-capacity",
            ],
        )?;
        // The URL sqlx reads: user info re-encoded, lockkit's parameters removed.
        let mut sqlx_url = format!("{}://", u.scheme());
        if let Some(user) = u.username() {
            sqlx_url.push_str(&utf8_percent_encode(user, NON_ALPHANUMERIC).to_string());
        }
        if let Some(pw) = u.password() {
            sqlx_url.push(':');
            sqlx_url.push_str(&utf8_percent_encode(pw, NON_ALPHANUMERIC).to_string());
        }
        if u.username().is_some() || u.password().is_some() {
            sqlx_url.push('@');
        }
        sqlx_url.push_str(u.hosts());
        sqlx_url.push_str(u.path());
        if !rest.is_empty() {
            sqlx_url.push('?');
            sqlx_url.push_str(
                &url::form_urlencoded::Serializer::new(String::new())
                    .extend_pairs(rest)
                    .finish(),
            );
        }
        let connect = PgConnectOptions::from_str(&sqlx_url)
            .map_err(|e| Error::config_with("invalid postgres:// URL", e))?;
        let mut config = Self::new(connect);
        if let Some(p) = common.prefix {
            config = config.prefix(p);
        }
        if let Some(s) = schema {
            config = config.schema(s);
        }
        if let Some(t) = common.connect_timeout {
            config = config.connect_timeout(t);
        }
        if let Some(m) = auto_migrate {
            config = config.auto_migrate(m);
        }
        let tls = common.tls;
        if let Some(ca) = tls.ca.clone() {
            config = config.tls_ca(ca);
        }
        if let (Some(c), Some(k)) = (tls.cert.clone(), tls.key.clone()) {
            config = config.tls_client_cert(c, k);
        }
        config.tls.server_name = tls.server_name;
        if let Some(m) = ssl_mode {
            config = config.ssl_mode(m);
        }
        config.validate()?;
        Ok(config)
    }

    /// Sets `sslmode` ([`PgSslMode`]): up to [`PgSslMode::VerifyFull`], which checks the
    /// certificate chain and that it names the host.
    pub fn ssl_mode(mut self, mode: PgSslMode) -> Self {
        self.connect = self.connect.ssl_mode(mode);
        self
    }

    /// Trusts the root certificate(s) in the PEM file `path` (`tls_ca`, libpq's `sslrootcert`)
    /// and turns `sslmode` to `verify-full` (call [`ssl_mode`](Self::ssl_mode) afterwards for
    /// another).
    pub fn tls_ca(mut self, path: impl Into<PathBuf>) -> Self {
        let path = path.into();
        self.connect = self
            .connect
            .ssl_root_cert(path.clone())
            .ssl_mode(PgSslMode::VerifyFull);
        self.tls.ca = Some(path);
        self
    }

    /// Presents the client certificate in the PEM file `cert` with its key in `key`
    /// (`tls_cert`/`tls_key`, libpq's `sslcert`/`sslkey`) and turns `sslmode` to `verify-full`
    /// unless [`ssl_mode`](Self::ssl_mode) is called afterwards.
    pub fn tls_client_cert(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        let (cert, key) = (cert.into(), key.into());
        self.connect = self
            .connect
            .ssl_client_cert(cert.clone())
            .ssl_client_key(key.clone())
            .ssl_mode(PgSslMode::VerifyFull);
        self.tls.cert = Some(cert);
        self.tls.key = Some(key);
        self
    }

    /// Checks that each TLS file is a regular file (sqlx reads them while connecting; a missing
    /// file would otherwise look like an unreachable server, a FIFO would block).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the parameter.
    pub(crate) fn check_tls_files(&self) -> Result<()> {
        let t = &self.tls;
        for (name, path) in [
            ("tls_ca", &t.ca),
            ("tls_cert", &t.cert),
            ("tls_key", &t.key),
        ] {
            let Some(path) = path else { continue };
            match std::fs::metadata(path) {
                Ok(m) if m.is_file() => {}
                Ok(_) => return Err(Error::config(format!("{name} is not a regular file"))),
                Err(e) => return Err(Error::config_with(format!("cannot read {name}"), e)),
            }
        }
        Ok(())
    }

    /// The TLS files configured (`tls_ca`, `tls_cert`, `tls_key`).
    pub fn get_tls(&self) -> &TlsOptions {
        &self.tls
    }

    /// The `sslmode`.
    pub fn get_ssl_mode(&self) -> PgSslMode {
        self.connect.get_ssl_mode()
    }

    /// The connect timeout.
    pub fn get_connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// Sets the lock namespace (checked by [`validate`](Self::validate)).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Sets the schema of lockkit's table (checked by [`validate`](Self::validate)).
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// Sets the time allowed for opening one connection (TCP, TLS, authentication).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Whether [`PgLock::with_config`](crate::PgLock::with_config) creates lockkit's table when it
    /// is missing (default `true`). With `false`, run [`PgLock::migrate`](crate::PgLock::migrate)
    /// yourself (for example from a role that may create tables).
    pub fn auto_migrate(mut self, on: bool) -> Self {
        self.auto_migrate = on;
        self
    }

    /// How many idle connections (holding no lock) are kept for later acquires. Default 8.
    pub fn max_idle(mut self, n: usize) -> Self {
        self.max_idle = n;
        self
    }

    /// The lock namespace.
    pub fn get_prefix(&self) -> &str {
        &self.prefix
    }

    /// The schema of lockkit's table.
    pub fn get_schema(&self) -> &str {
        &self.schema
    }

    /// The server's host name (or socket directory).
    pub fn get_host(&self) -> &str {
        self.connect.get_host()
    }

    /// The server's port.
    pub fn get_port(&self) -> u16 {
        self.connect.get_port()
    }

    /// The user name.
    pub fn get_username(&self) -> &str {
        self.connect.get_username()
    }

    /// The database, if set.
    pub fn get_database(&self) -> Option<&str> {
        self.connect.get_database()
    }

    /// Checks the prefix, the schema name and the timeout.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if the prefix is empty, longer than 64 bytes, or contains `/` or a
    /// control character; if the schema is not a plain lower-case SQL identifier
    /// (`[a-z_][a-z0-9_]*`, at most 63 bytes); or if the connect timeout is shorter than
    /// [`MIN_CONNECT_TIMEOUT`].
    pub fn validate(&self) -> Result<()> {
        lockkit_core::backend::validate_prefix(&self.prefix)?;
        validate_schema(&self.schema)?;
        if self.connect_timeout < MIN_CONNECT_TIMEOUT {
            return Err(Error::config("connect_timeout is shorter than 10 ms"));
        }
        if self.connect_timeout > MAX_CONNECT_TIMEOUT {
            return Err(Error::config("connect_timeout is longer than 1 hour"));
        }
        if self.tls.server_name.is_some() {
            return Err(Error::config(
                "tls_server_name is not supported by the postgres backend: sqlx verifies the \
                 certificate against the host",
            ));
        }
        self.tls.validate()
    }
}

lockkit_core::impl_url_config!(PgConfig);

fn parse_ssl_mode(m: &str) -> Result<PgSslMode> {
    Ok(match m {
        "disable" => PgSslMode::Disable,
        "allow" => PgSslMode::Allow,
        "prefer" => PgSslMode::Prefer,
        "require" => PgSslMode::Require,
        "verify-ca" => PgSslMode::VerifyCa,
        "verify-full" => PgSslMode::VerifyFull,
        _ => {
            return Err(Error::config(
                "sslmode must be disable, allow, prefer, require, verify-ca or verify-full",
            ));
        }
    })
}

/// A schema name lockkit can put into SQL text unquoted: a plain lower-case identifier.
pub(crate) fn validate_schema(s: &str) -> Result<()> {
    let mut chars = s.chars();
    let ok_first = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    let ok_rest = chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !ok_first || !ok_rest || s.len() > 63 {
        return Err(Error::config(
            "schema must be a plain lower-case SQL identifier ([a-z_][a-z0-9_]*, at most 63 bytes)",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_lockkit_params_and_hides_password() {
        let c = PgConfig::from_url(
            "postgres://u:hunter2@h:5433/db?prefix=p1&schema=s_1&sslmode=disable&connect_timeout=2.5",
        )
        .unwrap();
        assert_eq!(c.get_prefix(), "p1");
        assert_eq!(c.get_schema(), "s_1");
        assert_eq!(c.connect_timeout, Duration::from_millis(2500));
        assert_eq!(c.connect.get_port(), 5433);
        assert_eq!(c.connect.get_database(), Some("db"));
        let dbg = format!("{c:?}");
        assert!(!dbg.contains("hunter2"), "{dbg}");
    }

    #[test]
    fn both_schemes_and_defaults() {
        let c = PgConfig::from_url("postgresql://u@h/db").unwrap();
        assert_eq!(c.get_prefix(), DEFAULT_PREFIX);
        assert_eq!(c.get_schema(), DEFAULT_SCHEMA);
        assert_eq!(c.connect_timeout, DEFAULT_CONNECT_TIMEOUT);
        assert!(c.auto_migrate);
        let c =
            PgConfig::from_url("postgres://u@h/db?auto_migrate=false&application_name=x").unwrap();
        assert!(!c.auto_migrate);
        assert_eq!(c.connect.get_application_name(), Some("x"));
    }

    #[test]
    fn rejects_bad_input() {
        for bad in [
            "not a url",
            "mysql://h/db",
            "postgres://h/db?prefix=",
            "postgres://h/db?prefix=a%2Fb",
            "postgres://h/db?schema=Bad",
            "postgres://h/db?schema=a;drop",
            "postgres://h/db?connect_timeout=0",
            "postgres://h/db?connect_timeout=0.000001",
            "postgres://h/db?ssl_mode=require",
            "postgres://h/db?sslmod=require",
            "postgres://h/db?auto_migrate=maybe",
            "postgres://h:notaport/db",
            "postgres://h:+1/db",
            "postgres://h/db?prefix=a&prefix=b",
            "postgres://h/db?prefix=a%2Fb&prefix=ok",
            "postgres://h/db?sslrootcert=a&tls_ca=b",
            "postgres://h/db?sslmode=verify-everything",
            "postgres://h/db?tls_cert=c.pem",
            "postgres://h/db?tls_server_name=x",
            "postgres://h/db?connect_timeout=2h",
            "postgres://u:12?hunter2@h/db",
        ] {
            match PgConfig::from_url(bad) {
                Err(Error::InvalidConfig { .. }) => {}
                other => panic!("{bad}: {other:?}"),
            }
        }
        let c: PgConfig = "postgres://u:p%3Fw%40@h/db?tls_ca=ca.pem&sslcert=c.pem&sslkey=k.pem&connect_timeout=500ms"
            .parse()
            .unwrap();
        assert!(matches!(c.get_ssl_mode(), PgSslMode::VerifyFull));
        assert_eq!(c.get_tls().key, Some(PathBuf::from("k.pem")));
        assert_eq!(c.get_connect_timeout(), Duration::from_millis(500));
        let c = PgConfig::from_url("postgres://h/db?sslmode=require&tls_ca=ca.pem").unwrap();
        assert!(PgConfig::from_url("postgres://u@%2Fvar%2Frun%2Fpostgresql/db").is_ok());
        assert!(matches!(c.get_ssl_mode(), PgSslMode::Require));
        let err = PgConfig::from_url("postgres://u:hunter2@h:xx/db").unwrap_err();
        assert!(!format!("{err:?}").contains("hunter2"));
    }
}
