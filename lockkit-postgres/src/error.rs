//! sqlx errors → [`lockkit_core::Error`].

use lockkit_core::Error;

pub(crate) const BACKEND: &str = "postgres";

/// Classifies a sqlx error: unreachable server, broken connection and timeouts →
/// [`Error::Unavailable`]; refused credentials → [`Error::Auth`]; bad connection options and a
/// database that does not exist → [`Error::InvalidConfig`]; everything else →
/// [`Error::Backend`].
pub(crate) fn from_sqlx(e: sqlx::Error) -> Error {
    match &e {
        sqlx::Error::Configuration(_) => {
            Error::config_with("invalid PostgreSQL connection options", e)
        }
        // TLS refused by the server or a certificate that does not verify: retrying will
        // not help.
        sqlx::Error::Tls(_) => Error::config_with("TLS connection failed", e),
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => unavailable(e),
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            match code.as_str() {
                // invalid_password, invalid_authorization_specification
                "28P01" | "28000" => Error::Auth {
                    backend: BACKEND,
                    source: Box::new(e),
                },
                // invalid_catalog_name: the database in the URL does not exist (a typo or a
                // database not created yet): a configuration error, not a server fault.
                "3D000" => Error::config_with("the database named in the URL does not exist", e),
                // connection exceptions, too many connections, operator intervention
                // (admin/crash shutdown, cannot connect now, idle session timeout)
                c if c.starts_with("08") || c == "53300" || c.starts_with("57P") => unavailable(e),
                // lock_not_available: a holder session's `lock_timeout` ran out while a
                // statement waited for a lock on lockkit's tables (an operator's `LOCK TABLE`,
                // `VACUUM FULL`): the tables are busy for now, retrying may help.
                "55P03" => unavailable(e),
                _ => backend(e),
            }
        }
        _ => backend(e),
    }
}

pub(crate) fn unavailable(e: impl Into<lockkit_core::BoxError>) -> Error {
    Error::Unavailable {
        backend: BACKEND,
        source: e.into(),
    }
}

pub(crate) fn backend(e: impl Into<lockkit_core::BoxError>) -> Error {
    Error::Backend {
        backend: BACKEND,
        source: e.into(),
    }
}

/// The SQLSTATE of a database error, if `e` is one.
pub(crate) fn sqlstate(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

/// Whether `e` is `query_canceled` (SQLSTATE 57014): an admin's `pg_cancel_backend` of the
/// running statement (a routine action against long queries). For a waiting statement it is not
/// a reason to give up the wait: the caller waits again on a new session.
pub(crate) fn cancelled(e: &sqlx::Error) -> bool {
    sqlstate(e).as_deref() == Some("57014")
}

/// A plain message as an error source.
#[derive(Debug)]
pub(crate) struct Msg(pub String);

impl std::fmt::Display for Msg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Msg {}
