//! TLS on real servers, with certificates made at server start by `scripts/certs.sh`
//! (`LOCKKIT_TLS_DIR`): the whole contract suite over mutual TLS against each TLS server from
//! `scripts/servers.sh` (`LOCKKIT_*_TLS_URL`), then every bad-certificate case with the error
//! kind the README documents, fast and without echoing a secret.

use std::time::Duration;

use lockkit::Error;
use tokio::time::Instant;

use crate::common::server_url;

/// A file made by `scripts/certs.sh`.
fn cert(name: &str) -> String {
    format!("{}/{name}", server_url("LOCKKIT_TLS_DIR"))
}

/// The error kinds a TLS failure may have (see the README's TLS table).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Auth,
    InvalidConfig,
    Unavailable,
}

/// Connects to `url` and asserts it fails with `kind` within `limit`, with no private key or
/// password in the error.
async fn refused(what: &str, url: &str, kind: Kind, limit: Duration) {
    let start = Instant::now();
    let r = tokio::time::timeout(limit + Duration::from_secs(5), lockkit::connect(url))
        .await
        .unwrap_or_else(|_| panic!("{what}: connect hung"));
    let e = match r {
        Ok(_) => panic!("{what}: connected"),
        Err(e) => e,
    };
    let got = match e {
        Error::Auth { .. } => Kind::Auth,
        Error::InvalidConfig { .. } => Kind::InvalidConfig,
        Error::Unavailable { .. } => Kind::Unavailable,
        ref other => panic!("{what}: untyped {other:?}"),
    };
    let shown = format!("{e} | {e:#} | {e:?}");
    eprintln!("{what}: {got:?} after {:?}: {e:#}", start.elapsed());
    assert_eq!(got, kind, "{what}: {shown}");
    assert!(
        start.elapsed() <= limit,
        "{what}: took {:?}",
        start.elapsed()
    );
    let key = std::fs::read_to_string(cert("client.key")).expect("client key");
    let key_body = key.lines().nth(1).expect("key line");
    assert!(
        !shown.contains(key_body) && !shown.contains("PRIVATE KEY"),
        "{what}: {shown}"
    );
    assert!(!shown.contains("Zq9Hunter"), "{what}: {shown}");
}

/// The most a bad-certificate connect may take: the cases use a 2 s connect timeout.
const LIMIT: Duration = Duration::from_secs(3);

/// What the bad-certificate cases of one backend are built from: the TLS server's URL without
/// its query, and the good certificate files.
struct Setup {
    base: String,
    ca: String,
    cert: String,
    /// `tls_cert=…&tls_key=…` of the good client certificate.
    mtls: String,
}

impl Setup {
    /// From the TLS server URL in `var`; first connects once with `q` (but a 15 s connect
    /// timeout) and mutual TLS, so each bad case fails for its one reason.
    async fn new(var: &str, q: &str) -> Self {
        let url = server_url(var);
        let base = url.split_once('?').expect("query").0.to_owned();
        let (ca, c, k) = (cert("ca.pem"), cert("client.pem"), cert("client.key"));
        let mtls = format!("tls_cert={c}&tls_key={k}");
        // The good connect only proves the certificates; under CI's load a PostgreSQL mutual-TLS
        // connect once took over the cases' 2 s.
        let relaxed = q.replace("connect_timeout=2s", "connect_timeout=15s");
        lockkit::connect(&format!("{base}?{relaxed}&tls_ca={ca}&{mtls}"))
            .await
            .unwrap_or_else(|e| panic!("{var}: mutual TLS: {e:#}"));
        Self {
            base,
            ca,
            cert: c,
            mtls,
        }
    }

    /// The port of the TLS server.
    fn port(&self) -> String {
        let after_scheme = self.base.split_once("://").expect("scheme").1;
        let authority = after_scheme.split('/').next().expect("authority");
        let hostport = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
        hostport.rsplit_once(':').expect("port").1.to_owned()
    }
}

#[cfg(feature = "redis")]
mod redis {
    use super::*;

    mod contract {
        use crate::common::UrlHarness;
        lockkit::contract_suite!(UrlHarness::from_env("LOCKKIT_REDIS_TLS_URL"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bad_certificates_are_typed_fast_errors() {
        let q = "connect_timeout=2s&response_timeout=2s";
        let setup = Setup::new("LOCKKIT_REDIS_TLS_URL", q).await;
        let port = setup.port();
        let Setup {
            base: tls,
            ca,
            cert: c,
            mtls,
        } = setup;
        let cases = [
            (
                "redis: wrong CA",
                format!("{tls}?{q}&tls_ca={}&{mtls}", cert("other-ca.pem")),
                Kind::Auth,
            ),
            (
                "redis: system roots",
                format!("{tls}?{q}&{mtls}"),
                Kind::Auth,
            ),
            (
                "redis: name mismatch",
                format!("rediss://localhost:{port}?{q}&tls_ca={ca}&{mtls}"),
                Kind::Auth,
            ),
            (
                "redis: no client certificate",
                format!("{tls}?{q}&tls_ca={ca}"),
                Kind::Auth,
            ),
            (
                "redis: client certificate of another CA",
                format!(
                    "{tls}?{q}&tls_ca={ca}&tls_cert={}&tls_key={}",
                    cert("other-client.pem"),
                    cert("other-client.key")
                ),
                Kind::Auth,
            ),
            (
                "redis: key that does not match",
                format!(
                    "{tls}?{q}&tls_ca={ca}&tls_cert={c}&tls_key={}",
                    cert("other-client.key")
                ),
                Kind::InvalidConfig,
            ),
            (
                "redis: missing CA file",
                format!("{tls}?{q}&tls_ca=/nonexistent/ca.pem&{mtls}"),
                Kind::InvalidConfig,
            ),
            (
                "redis: key file is not PEM",
                format!("{tls}?{q}&tls_ca={ca}&tls_cert={c}&tls_key=/etc/hostname"),
                Kind::InvalidConfig,
            ),
            (
                "redis: plain client, TLS-only server",
                format!("redis://:Zq9Hunter@127.0.0.1:{port}?{q}"),
                Kind::Unavailable,
            ),
            (
                "redis: TLS client, plain server",
                format!(
                    "{}?{q}&tls_ca={ca}&{mtls}",
                    server_url("LOCKKIT_REDIS_URL").replacen("redis://", "rediss://", 1)
                ),
                Kind::Unavailable,
            ),
        ];
        for (what, url, kind) in cases {
            refused(what, &url, kind, LIMIT).await;
        }
    }

    /// A private TLS redis-server presenting a certificate that expired in 2001 (signed by the
    /// trusted test CA, for 127.0.0.1): refused as `Auth`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn expired_server_certificate_is_auth() {
        use crate::common::{ServerProcess, free_port, wait_until};
        let port = free_port();
        let dir = tempfile::tempdir().expect("temp dir");
        let mut cmd = std::process::Command::new("redis-server");
        cmd.args([
            "--bind",
            "127.0.0.1",
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
        ])
        .args([
            "--tls-cert-file",
            &cert("expired.pem"),
            "--tls-key-file",
            &cert("expired.key"),
        ])
        .args([
            "--tls-auth-clients",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .arg("--dir")
        .arg(dir.path());
        let _server = ServerProcess::spawn("redis-tls-expired", dir, cmd);
        wait_until(
            "expired-certificate redis-server",
            Duration::from_secs(10),
            || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok(),
        )
        .await;
        let url = format!(
            "rediss://127.0.0.1:{port}?connect_timeout=2s&tls_ca={}",
            cert("ca.pem")
        );
        refused(
            "redis: expired server certificate",
            &url,
            Kind::Auth,
            Duration::from_secs(3),
        )
        .await;
    }
}

#[cfg(feature = "etcd")]
mod etcd {
    use super::*;

    mod contract {
        use crate::common::UrlHarness;
        lockkit::contract_suite!(UrlHarness::from_env("LOCKKIT_ETCD_TLS_URL"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bad_certificates_are_typed_fast_errors() {
        let q = "connect_timeout=2s&request_timeout=2s";
        let setup = Setup::new("LOCKKIT_ETCD_TLS_URL", q).await;
        let port = setup.port();
        let Setup {
            base: tls,
            ca,
            mtls,
            ..
        } = setup;
        let plain_port = server_url("LOCKKIT_ETCD_URL");
        let plain_port = plain_port.rsplit_once(':').expect("port").1;
        let cases = [
            (
                "etcd: wrong CA",
                format!("{tls}?{q}&tls_ca={}&{mtls}", cert("other-ca.pem")),
                Kind::Auth,
            ),
            (
                "etcd: system roots",
                format!("{tls}?{q}&{mtls}"),
                Kind::Auth,
            ),
            (
                "etcd: name mismatch",
                format!("etcds://localhost:{port}?{q}&tls_ca={ca}&{mtls}"),
                Kind::Auth,
            ),
            (
                "etcd: server name override that does not match",
                format!("{tls}?{q}&tls_ca={ca}&{mtls}&tls_server_name=other.invalid"),
                Kind::Auth,
            ),
            // etcd (Go, TLS 1.3) closes the connection after the handshake without an alert
            // the client sees: indistinguishable from a server going away, so Unavailable
            // after the connect timeout.
            (
                "etcd: no client certificate",
                format!("{tls}?{q}&tls_ca={ca}"),
                Kind::Unavailable,
            ),
            (
                "etcd: client certificate of another CA",
                format!(
                    "{tls}?{q}&tls_ca={ca}&tls_cert={}&tls_key={}",
                    cert("other-client.pem"),
                    cert("other-client.key")
                ),
                Kind::Unavailable,
            ),
            (
                "etcd: missing CA file",
                format!("{tls}?{q}&tls_ca=/nonexistent/ca.pem&{mtls}"),
                Kind::InvalidConfig,
            ),
            (
                "etcd: plain client, TLS-only server",
                format!("etcd://127.0.0.1:{port}?{q}"),
                Kind::Unavailable,
            ),
            (
                "etcd: TLS client, plain server",
                format!("etcds://127.0.0.1:{plain_port}?{q}&tls_ca={ca}&{mtls}"),
                Kind::Unavailable,
            ),
        ];
        for (what, url, kind) in cases {
            refused(what, &url, kind, LIMIT).await;
        }
    }
}

#[cfg(feature = "etcd")]
mod etcd_expired {
    use super::*;
    use crate::common::{ServerProcess, free_port, wait_until};

    /// A private etcd whose https client port presents a certificate that expired in 2001
    /// (signed by the trusted test CA, for 127.0.0.1): refused as `Auth`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn expired_server_certificate_is_auth() {
        let (c, p) = (free_port(), free_port());
        let dir = tempfile::tempdir().expect("temp dir");
        let mut cmd = std::process::Command::new("etcd");
        cmd.args(["--name", "x1", "--data-dir"])
            .arg(dir.path().join("data"))
            .arg(format!("--listen-client-urls=https://127.0.0.1:{c}"))
            .arg(format!("--advertise-client-urls=https://127.0.0.1:{c}"))
            .args([
                "--cert-file",
                &cert("expired.pem"),
                "--key-file",
                &cert("expired.key"),
            ])
            .arg(format!("--listen-peer-urls=http://127.0.0.1:{p}"))
            .arg(format!(
                "--initial-advertise-peer-urls=http://127.0.0.1:{p}"
            ))
            .arg(format!("--initial-cluster=x1=http://127.0.0.1:{p}"))
            .args(["--heartbeat-interval", "10", "--election-timeout", "100"])
            .args([
                "--logger",
                "zap",
                "--log-outputs",
                "stderr",
                "--log-level",
                "warn",
            ]);
        let _server = ServerProcess::spawn("etcd-tls-expired", dir, cmd);
        wait_until("expired-certificate etcd", Duration::from_secs(10), || {
            std::net::TcpStream::connect(("127.0.0.1", c)).is_ok()
        })
        .await;
        let url = format!(
            "etcds://127.0.0.1:{c}?connect_timeout=2s&tls_ca={}",
            cert("ca.pem")
        );
        refused(
            "etcd: expired server certificate",
            &url,
            Kind::Auth,
            Duration::from_secs(3),
        )
        .await;
    }
}

#[cfg(feature = "zk")]
mod zk {
    use super::*;

    mod contract {
        use crate::common::UrlHarness;
        lockkit::contract_suite!(UrlHarness::from_env("LOCKKIT_ZK_TLS_URL"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bad_certificates_are_typed_fast_errors() {
        let q = "connect_timeout=2s";
        let setup = Setup::new("LOCKKIT_ZK_TLS_URL", q).await;
        let port = setup.port();
        let Setup {
            base: tls,
            ca,
            cert: c,
            mtls,
            ..
        } = setup;
        let plain = server_url("LOCKKIT_ZK_URL");
        let cases = [
            (
                "zk: wrong CA",
                format!("{tls}?{q}&tls_ca={}&{mtls}", cert("other-ca.pem")),
                Kind::Unavailable,
            ),
            (
                "zk: name mismatch",
                format!("zk://localhost:{port}?{q}&tls_ca={ca}&{mtls}"),
                Kind::Unavailable,
            ),
            (
                "zk: no client certificate",
                format!("{tls}?{q}&tls_ca={ca}"),
                Kind::Unavailable,
            ),
            (
                "zk: client certificate of another CA",
                format!(
                    "{tls}?{q}&tls_ca={ca}&tls_cert={}&tls_key={}",
                    cert("other-client.pem"),
                    cert("other-client.key")
                ),
                Kind::Unavailable,
            ),
            (
                "zk: missing CA file",
                format!("{tls}?{q}&tls_ca=/nonexistent/ca.pem&{mtls}"),
                Kind::InvalidConfig,
            ),
            (
                "zk: key file is not PEM",
                format!("{tls}?{q}&tls_ca={ca}&tls_cert={c}&tls_key=/etc/hostname"),
                Kind::InvalidConfig,
            ),
            (
                "zk: plain client, TLS-only port",
                format!("zk://127.0.0.1:{port}?{q}"),
                Kind::Unavailable,
            ),
            (
                "zk: TLS client, plain server",
                format!("{plain}?{q}&tls_ca={ca}&{mtls}"),
                Kind::Unavailable,
            ),
        ];
        for (what, url, kind) in cases {
            refused(what, &url, kind, LIMIT).await;
        }
    }
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;

    mod contract {
        use crate::common::UrlHarness;
        lockkit::contract_suite!(UrlHarness::from_env("LOCKKIT_POSTGRES_TLS_URL"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bad_certificates_are_typed_fast_errors() {
        let q = "connect_timeout=2s";
        let setup = Setup::new("LOCKKIT_POSTGRES_TLS_URL", q).await;
        let port = setup.port();
        let hostport = format!("127.0.0.1:{port}");
        let Setup {
            base,
            ca,
            cert: c,
            mtls,
            ..
        } = setup;
        let cases = [
            (
                "postgres: wrong CA",
                format!("{base}?{q}&tls_ca={}&{mtls}", cert("other-ca.pem")),
                Kind::Auth,
            ),
            (
                "postgres: system roots",
                format!("{base}?{q}&sslmode=verify-full&{mtls}"),
                Kind::Auth,
            ),
            (
                "postgres: name mismatch",
                format!("postgres://postgres@localhost:{port}/postgres?{q}&tls_ca={ca}&{mtls}"),
                Kind::Auth,
            ),
            (
                "postgres: no client certificate",
                format!("{base}?{q}&tls_ca={ca}"),
                Kind::Auth,
            ),
            (
                "postgres: client certificate of another CA",
                format!(
                    "{base}?{q}&tls_ca={ca}&tls_cert={}&tls_key={}",
                    cert("other-client.pem"),
                    cert("other-client.key")
                ),
                Kind::Auth,
            ),
            (
                "postgres: missing CA file",
                format!("{base}?{q}&tls_ca=/nonexistent/ca.pem&{mtls}"),
                Kind::InvalidConfig,
            ),
            (
                "postgres: key file is not PEM",
                format!("{base}?{q}&tls_ca={ca}&tls_cert={c}&tls_key=/etc/hostname"),
                Kind::InvalidConfig,
            ),
            (
                "postgres: plain client, TLS-only server",
                format!("postgres://postgres:Zq9Hunter@{hostport}/postgres?{q}&sslmode=disable"),
                Kind::Auth,
            ),
            (
                "postgres: TLS client, plain server",
                format!(
                    "{}?{q}&tls_ca={ca}&{mtls}",
                    server_url("LOCKKIT_POSTGRES_URL")
                ),
                Kind::InvalidConfig,
            ),
        ];
        for (what, url, kind) in cases {
            refused(what, &url, kind, LIMIT).await;
        }
    }
}
