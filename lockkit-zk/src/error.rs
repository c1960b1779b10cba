//! `zookeeper_client::Error` → [`lockkit_core::Error`].

use lockkit_core::Error;
use zookeeper_client as zk;

pub(crate) const BACKEND: &str = "zk";

/// Classifies a client error: unreachable servers, lost connections (including the client's
/// transport errors), timeouts, throttling and an expired session are [`Error::Unavailable`] (transient: a retry opens a new session); refused
/// credentials and missing permissions are [`Error::Auth`]; everything else is
/// [`Error::Backend`].
pub(crate) fn from_zk(e: zk::Error) -> Error {
    match e {
        zk::Error::ConnectionLoss
        | zk::Error::NoHosts
        | zk::Error::Timeout
        | zk::Error::Throttled
        | zk::Error::SessionExpired
        | zk::Error::SessionMoved
        | zk::Error::ClientClosed
        | zk::Error::Custom(_) => Error::Unavailable {
            backend: BACKEND,
            source: Box::new(e),
        },
        // zookeeper-client's own text is "authentication failed", which the variant says.
        zk::Error::AuthFailed => Error::Auth {
            backend: BACKEND,
            source: "the server refused the URL's user name or password (digest scheme, or SASL \
                     DIGEST-MD5 with sasl=digest-md5)"
                .into(),
        },
        // Not a failed authentication: the credentials (or their absence) were accepted, but a
        // node's ACL does not grant them this operation.
        zk::Error::NoAuth => Error::Backend {
            backend: BACKEND,
            source: "no permission on a ZooKeeper node (NoAuth): its ACL does not grant these \
                     credentials this operation (nodes created by an authenticated client are \
                     creator-only)"
                .into(),
        },
        other => Error::Backend {
            backend: BACKEND,
            source: Box::new(other),
        },
    }
}

/// The request's connection broke before its reply arrived: it may or may not have been applied,
/// and the session may well live on. The client reports this as `ConnectionLoss`, or as a
/// custom error carrying the transport failure (an I/O error, "no response from connection in
/// N ms") for requests in flight when the connection was declared dead.
pub(crate) fn connection_lost(e: &zk::Error) -> bool {
    matches!(e, zk::Error::ConnectionLoss | zk::Error::Custom(_))
}

/// [`Error::Unavailable`] with a message of ours.
pub(crate) fn unavailable(msg: &'static str) -> Error {
    Error::Unavailable {
        backend: BACKEND,
        source: msg.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The refusal says what was refused, once (it read "authentication failed: authentication
    /// failed").
    #[test]
    fn auth_failure_names_the_credentials_once() {
        let text = from_zk(zk::Error::AuthFailed).to_string();
        assert_eq!(text.matches("authentication failed").count(), 1, "{text}");
        assert!(text.contains("user name or password"), "{text}");
    }

    #[test]
    fn classification() {
        assert!(from_zk(zk::Error::ConnectionLoss).is_retryable());
        assert!(from_zk(zk::Error::SessionExpired).is_retryable());
        assert!(matches!(from_zk(zk::Error::AuthFailed), Error::Auth { .. }));
        assert!(matches!(from_zk(zk::Error::NoAuth), Error::Backend { .. }));
        assert!(matches!(
            from_zk(zk::Error::BadVersion),
            Error::Backend { .. }
        ));
    }
}
