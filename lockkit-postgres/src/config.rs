//! Connection settings: the `postgres://` URL, the key prefix and lockkit's schema.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use lockkit_core::{Error, Result};
use sqlx::postgres::PgConnectOptions;

/// The default key prefix (lock namespace).
pub const DEFAULT_PREFIX: &str = "lockkit";

/// The default schema of lockkit's table(s).
pub const DEFAULT_SCHEMA: &str = "lockkit";

/// The default time allowed for opening one connection: 10 s.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The shortest connect timeout accepted: 10 ms.
pub const MIN_CONNECT_TIMEOUT: Duration = Duration::from_millis(10);

/// The URL parameters sqlx's [`PgConnectOptions`] understands (besides `options[NAME]`).
const SQLX_PARAMS: &[&str] = &[
    "sslmode",
    "ssl-mode",
    "sslrootcert",
    "ssl-root-cert",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
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
        }
    }

    /// Parses a `postgres://` (or `postgresql://`) URL.
    ///
    /// The parameters sqlx's [`PgConnectOptions`] understands are accepted (`sslmode`, `host`,
    /// `options`, …); any other unknown parameter (a misspelling such as `ssl_mode`) is an
    /// error. lockkit's own query parameters are removed before the URL reaches sqlx:
    ///
    /// | parameter | meaning | default |
    /// |---|---|---|
    /// | `prefix` | lock namespace: names are locked as `{prefix}/{name}` | `lockkit` |
    /// | `schema` | schema of lockkit's table `{schema}.fence` | `lockkit` |
    /// | `connect_timeout` | seconds allowed for opening one connection (libpq's name) | `10` |
    /// | `auto_migrate` | create the table on connect if it is missing (`true`/`false`) | `true` |
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if the URL is malformed, its scheme is not `postgres`/`postgresql`,
    /// or a parameter is invalid. The URL itself is never part of the message (it may hold a
    /// password).
    pub fn from_url(url: &str) -> Result<Self> {
        let parsed =
            url::Url::parse(url).map_err(|e| Error::config_with("malformed postgres:// URL", e))?;
        if !matches!(parsed.scheme(), "postgres" | "postgresql") {
            return Err(Error::config(format!(
                "expected a postgres:// or postgresql:// URL, got scheme {:?}",
                parsed.scheme()
            )));
        }
        let mut prefix = None;
        let mut schema = None;
        let mut connect_timeout = None;
        let mut auto_migrate = None;
        let mut rest: Vec<(String, String)> = Vec::new();
        for (k, v) in parsed.query_pairs() {
            match &*k {
                "prefix" => prefix = Some(v.into_owned()),
                "schema" => schema = Some(v.into_owned()),
                "connect_timeout" => {
                    let secs: f64 = v.parse().map_err(|e| {
                        Error::config_with("connect_timeout is not a number of seconds", e)
                    })?;
                    if !(secs >= MIN_CONNECT_TIMEOUT.as_secs_f64() && secs <= 3600.0) {
                        return Err(Error::config(
                            "connect_timeout must be between 0.01 and 3600 seconds",
                        ));
                    }
                    connect_timeout = Some(Duration::from_secs_f64(secs));
                }
                "auto_migrate" => {
                    auto_migrate = Some(match &*v {
                        "true" | "1" | "yes" | "on" => true,
                        "false" | "0" | "no" | "off" => false,
                        _ => return Err(Error::config("auto_migrate must be true or false")),
                    })
                }
                k if SQLX_PARAMS.contains(&k) || k.starts_with("options[") => {
                    rest.push((k.to_owned(), v.into_owned()))
                }
                k => {
                    return Err(Error::config(format!(
                        "unknown URL parameter {k:?} (lockkit's: prefix, schema, \
                         connect_timeout, auto_migrate; sqlx's: {})",
                        SQLX_PARAMS.join(", ")
                    )));
                }
            }
        }
        let mut stripped = parsed.clone();
        if rest.is_empty() {
            stripped.set_query(None);
        } else {
            stripped.query_pairs_mut().clear().extend_pairs(rest);
        }
        let connect = PgConnectOptions::from_str(stripped.as_str())
            .map_err(|e| Error::config_with("invalid postgres:// URL", e))?;
        let mut config = Self::new(connect);
        if let Some(p) = prefix {
            config = config.prefix(p);
        }
        if let Some(s) = schema {
            config = config.schema(s);
        }
        if let Some(t) = connect_timeout {
            config = config.connect_timeout(t);
        }
        if let Some(m) = auto_migrate {
            config = config.auto_migrate(m);
        }
        config.validate()?;
        Ok(config)
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
        Ok(())
    }
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
        ] {
            match PgConfig::from_url(bad) {
                Err(Error::InvalidConfig { .. }) => {}
                other => panic!("{bad}: {other:?}"),
            }
        }
        let err = PgConfig::from_url("postgres://u:hunter2@h:xx/db").unwrap_err();
        assert!(!format!("{err:?}").contains("hunter2"));
    }
}
