//! Conversion of `etcd-client` errors into [`lockkit_core::Error`].
//!
//! Unreachable servers, timeouts and "no leader" answers become [`Error::Unavailable`]
//! (retryable), refused credentials become [`Error::Auth`], everything else
//! [`Error::Backend`]. The client's error is kept as `source()`; it never contains the password.

use std::fmt;

use etcd_client::Error as EtcdError;
use lockkit_core::Error;

pub(crate) const BACKEND: &str = "etcd";

/// The gRPC status codes we classify by
/// (<https://grpc.github.io/grpc/core/md_doc_statuscodes.html>), read from the status etcd-client
/// hands us without depending on `tonic` directly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Code {
    Cancelled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
    Unauthenticated,
    Other,
}

/// A request that did not answer within the configured time.
#[derive(Debug)]
pub(crate) struct Elapsed {
    pub(crate) what: &'static str,
}

impl fmt::Display for Elapsed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "etcd did not answer {} in time", self.what)
    }
}

impl std::error::Error for Elapsed {}

pub(crate) fn timeout(what: &'static str) -> Error {
    Error::Unavailable {
        backend: BACKEND,
        source: Box::new(Elapsed { what }),
    }
}

fn code_of(e: &EtcdError) -> Option<(Code, String)> {
    let EtcdError::GRpcStatus(s) = e else {
        return None;
    };
    let code = match i32::from(s.code()) {
        1 => Code::Cancelled,
        2 => Code::Unknown,
        3 => Code::InvalidArgument,
        4 => Code::DeadlineExceeded,
        5 => Code::NotFound,
        7 => Code::PermissionDenied,
        8 => Code::ResourceExhausted,
        14 => Code::Unavailable,
        16 => Code::Unauthenticated,
        _ => Code::Other,
    };
    Some((code, s.message().to_owned()))
}

/// `true` for etcd's "requested lease not found" (the lease expired or was revoked).
pub(crate) fn is_lease_not_found(e: &EtcdError) -> bool {
    match code_of(e) {
        Some((Code::NotFound, msg)) => msg.contains("lease not found"),
        // etcd-client reports an answer with TTL <= 0 as this error; it also uses the variant
        // for a keepalive it could not send (a closed stream), which says nothing of the lease.
        _ => matches!(e, EtcdError::LeaseKeepAliveError(m) if m.contains("lease not found")),
    }
}

/// Converts an `etcd-client` error.
pub(crate) fn from_client(e: EtcdError) -> Error {
    let auth_msg = |m: &str| {
        m.contains("authentication failed")
            || m.contains("invalid auth token")
            || m.contains("user name is empty")
            || m.contains("user name not found")
            || m.contains("permission denied")
            || m.contains("auth: revision in header is old")
    };
    let kind = match (&e, code_of(&e)) {
        // Credentials were configured for a server that has authentication disabled.
        (_, Some((_, m))) if m.contains("authentication is not enabled") => Kind::AuthNotEnabled,
        (_, Some((Code::Unauthenticated | Code::PermissionDenied, _))) => Kind::Auth,
        (_, Some((_, m))) if auth_msg(&m) => Kind::Auth,
        (
            _,
            Some((
                Code::Unavailable
                | Code::DeadlineExceeded
                | Code::Cancelled
                | Code::ResourceExhausted,
                _,
            )),
        ) => Kind::Unavailable,
        // A status that tonic made from a broken connection (it keeps the I/O error as its
        // source: "h2 protocol error", "broken pipe", connection reset), and etcd's "leader
        // changed" / "request timed out" when a proxy or an older server sends them as Unknown.
        (EtcdError::GRpcStatus(s), Some((Code::Unknown, m)))
            if std::error::Error::source(s).is_some()
                || [
                    "leader",
                    "timed out",
                    "transport",
                    "connection",
                    "h2 protocol",
                    "broken pipe",
                ]
                .iter()
                .any(|w| m.contains(w)) =>
        {
            Kind::Unavailable
        }
        (EtcdError::TransportError(_) | EtcdError::IoError(_), _) => Kind::Unavailable,
        (EtcdError::InvalidUri(_) | EtcdError::InvalidArgs(_), _) => Kind::Config,
        _ => Kind::Backend,
    };
    match kind {
        Kind::Auth => Error::Auth {
            backend: BACKEND,
            source: Box::new(e),
        },
        Kind::Unavailable => Error::Unavailable {
            backend: BACKEND,
            source: Box::new(e),
        },
        Kind::Config => Error::config_with("etcd client rejected the configuration", e),
        // The status names no credential: it is safe as the source.
        Kind::AuthNotEnabled => Error::config_with(
            "a user and password were given, but authentication is not enabled on the etcd \
             server: connect without user and password (or enable authentication on the \
             server: etcdctl auth enable)",
            e,
        ),
        Kind::Backend => Error::Backend {
            backend: BACKEND,
            source: Box::new(e),
        },
    }
}

enum Kind {
    Auth,
    /// Credentials given to a server without authentication.
    AuthNotEnabled,
    Unavailable,
    Config,
    Backend,
}

/// Why a connect failed, in plain words: the endpoints tried and the innermost cause (the
/// operating system's "Connection refused", etcd's "no leader", or no answer in time), not the
/// gRPC status wrapping it. Endpoints are `http[s]://host:port` and hold no credentials.
#[derive(Debug)]
struct Unreachable {
    endpoints: String,
    cause: String,
    io: Option<std::io::Error>,
}

impl fmt::Display for Unreachable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "could not connect to etcd at {}: {}",
            self.endpoints, self.cause
        )
    }
}

impl std::error::Error for Unreachable {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.io.as_ref().map(|e| e as _)
    }
}

/// The innermost I/O error under `e` (a refused or reset connection), if any.
fn root_io<'a>(mut e: &'a (dyn std::error::Error + 'static)) -> Option<&'a std::io::Error> {
    let mut found = None;
    loop {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            found = Some(io);
        }
        match e.source() {
            Some(s) => e = s,
            None => return found,
        }
    }
}

/// `e`, an error of the connect to `endpoints`, with an [`Error::Unavailable`]'s source replaced
/// by one that names the endpoints and says in plain words what failed; other errors as they are.
pub(crate) fn at_connect(endpoints: &[String], e: Error) -> Error {
    let Error::Unavailable { backend, source } = e else {
        return e;
    };
    let (cause, io) = match source.downcast_ref::<EtcdError>() {
        Some(ee) => {
            // etcd_client::Error has no `source()`: start from the tonic error it wraps.
            let (inner, msg): (&(dyn std::error::Error + 'static), String) = match ee {
                EtcdError::GRpcStatus(s) => (s, s.message().to_owned()),
                EtcdError::TransportError(t) => (t, t.to_string()),
                other => (other, other.to_string()),
            };
            match root_io(inner) {
                Some(io) => (
                    io.to_string(),
                    Some(std::io::Error::new(io.kind(), io.to_string())),
                ),
                None => (msg, None),
            }
        }
        None => (source.to_string(), None),
    };
    Error::Unavailable {
        backend,
        source: Box::new(Unreachable {
            endpoints: endpoints.join(", "),
            cause,
            io,
        }),
    }
}

/// A backend error without a client error behind it (an answer we did not expect).
pub(crate) fn protocol(msg: impl Into<String>) -> Error {
    Error::Backend {
        backend: BACKEND,
        source: msg.into().into(),
    }
}
