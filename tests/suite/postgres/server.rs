//! Private PostgreSQL (and PgBouncer) instances for tests that restart a server or need
//! password authentication. Started exactly like `scripts/servers.sh` does: as the `postgres`
//! user, in directories it owns; stopped (`pg_ctl -m immediate`) when dropped.

use std::path::{Path, PathBuf};
use std::process::Command;

use lockkit::postgres::sqlx::{Connection, PgConnection};

use crate::common::{ServerProcess, free_port};

fn pg_bin() -> PathBuf {
    let root = Path::new("/usr/lib/postgresql");
    let mut versions: Vec<u32> = std::fs::read_dir(root)
        .expect("PostgreSQL is not installed (/usr/lib/postgresql missing)")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    versions.sort();
    let v = versions.last().expect("no PostgreSQL version installed");
    root.join(v.to_string()).join("bin")
}

fn run(what: &str, cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn as_postgres(bin: &Path, tool: &str) -> Command {
    let mut c = Command::new("runuser");
    c.args(["-u", "postgres", "--"]).arg(bin.join(tool));
    c
}

/// A PostgreSQL server owned by one test.
pub struct PgServer {
    dir: tempfile::TempDir,
    bin: PathBuf,
    pub port: u16,
    password: Option<String>,
}

impl PgServer {
    /// initdb + start. With a password, TCP connections use scram-sha-256 for user `postgres`.
    pub fn start(password: Option<&str>) -> Self {
        Self::init(password, false)
    }

    /// initdb + start with TLS only: a fresh self-signed certificate, and pg_hba rejecting
    /// every TCP connection that is not TLS.
    pub fn start_tls_only() -> Self {
        Self::init(None, true)
    }

    fn init(password: Option<&str>, tls: bool) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("lockkit-pg-")
            .tempdir()
            .expect("temp dir");
        // The temp dir is root's and 0700: let `postgres` reach its own subdirectory.
        run("chmod", Command::new("chmod").arg("755").arg(dir.path()));
        let root = dir.path().join("pg");
        run(
            "install -d",
            Command::new("install")
                .args(["-d", "-o", "postgres", "-g", "postgres"])
                .arg(&root),
        );
        let bin = pg_bin();
        let mut initdb = as_postgres(&bin, "initdb");
        initdb
            .arg("-D")
            .arg(root.join("data"))
            .args(["-U", "postgres", "-E", "UTF8", "--no-sync"]);
        if let Some(pw) = password {
            let pwfile = root.join("pwfile");
            std::fs::write(&pwfile, pw).expect("pwfile");
            run("chown", Command::new("chown").arg("postgres").arg(&pwfile));
            initdb
                .args(["--auth-local=trust", "--auth-host=scram-sha-256"])
                .arg(format!("--pwfile={}", pwfile.display()));
        } else {
            initdb.args(["-A", "trust"]);
        }
        run("initdb", &mut initdb);
        if tls {
            let data = root.join("data");
            run(
                "openssl",
                Command::new("openssl")
                    .args(["req", "-new", "-x509", "-days", "2", "-nodes"])
                    .args(["-subj", "/CN=127.0.0.1", "-newkey", "rsa:2048"])
                    .arg("-keyout")
                    .arg(data.join("server.key"))
                    .arg("-out")
                    .arg(data.join("server.crt")),
            );
            run(
                "chown",
                Command::new("chown")
                    .arg("postgres:postgres")
                    .arg(data.join("server.key"))
                    .arg(data.join("server.crt")),
            );
            run(
                "chmod",
                Command::new("chmod")
                    .arg("600")
                    .arg(data.join("server.key")),
            );
            let conf = data.join("postgresql.conf");
            let mut c = std::fs::read_to_string(&conf).expect("postgresql.conf");
            c.push_str("\nssl = on\n");
            std::fs::write(&conf, c).expect("postgresql.conf");
            std::fs::write(
                data.join("pg_hba.conf"),
                "local all all trust\n\
                 hostssl all all 127.0.0.1/32 trust\n\
                 hostnossl all all 0.0.0.0/0 reject\n",
            )
            .expect("pg_hba.conf");
        }
        let s = Self {
            dir,
            bin,
            port: free_port(),
            password: password.map(str::to_owned),
        };
        s.pg_ctl_start();
        s
    }

    fn root(&self) -> PathBuf {
        self.dir.path().join("pg")
    }

    fn pg_ctl_start(&self) {
        let root = self.root();
        run(
            "pg_ctl start",
            as_postgres(&self.bin, "pg_ctl")
                .arg("-D")
                .arg(root.join("data"))
                .arg("-l")
                .arg(root.join("postgres.log"))
                .arg("-w")
                .arg("-o")
                .arg(format!(
                    "-c listen_addresses=127.0.0.1 -p {} -k {} -c max_connections=100",
                    self.port,
                    root.display()
                ))
                .arg("start"),
        );
    }

    /// Stops the server like a crash (`-m immediate`: no shutdown checkpoint, every session
    /// killed), then starts it again on the same port and data.
    pub fn crash_restart(&self) {
        self.stop_immediate();
        self.pg_ctl_start();
    }

    /// Starts the server again after [`stop_immediate`](Self::stop_immediate).
    pub fn start_again(&self) {
        self.pg_ctl_start();
    }

    pub fn stop_immediate(&self) {
        let _ = as_postgres(&self.bin, "pg_ctl")
            .arg("-D")
            .arg(self.root().join("data"))
            .args(["-m", "immediate", "-w", "stop"])
            .output();
    }

    /// `postgres://postgres[:password]@127.0.0.1:PORT/postgres`
    pub fn url(&self) -> String {
        match &self.password {
            Some(pw) => format!("postgres://postgres:{pw}@127.0.0.1:{}/postgres", self.port),
            None => format!("postgres://postgres@127.0.0.1:{}/postgres", self.port),
        }
    }

    pub fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(self.root().join("postgres.log")).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("---- private postgres log ----\n{}", self.log_tail());
        }
        self.stop_immediate();
    }
}

/// A PgBouncer in front of `upstream_port`, in `pool_mode`, run as the `postgres` user,
/// ignoring the startup parameters `ignore` (comma-separated).
pub fn pgbouncer(upstream_port: u16, pool_mode: &str, ignore: &str) -> (ServerProcess, u16) {
    let dir = tempfile::Builder::new()
        .prefix("lockkit-pgbouncer-")
        .tempdir()
        .expect("temp dir");
    run("chmod", Command::new("chmod").arg("755").arg(dir.path()));
    let port = free_port();
    let ini = dir.path().join("pgbouncer.ini");
    std::fs::write(
        &ini,
        format!(
            "[databases]\n\
             postgres = host=127.0.0.1 port={upstream_port} dbname=postgres user=postgres\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             auth_type = any\n\
             pool_mode = {pool_mode}\n\
             unix_socket_dir =\n\
             ignore_startup_parameters = {ignore}\n"
        ),
    )
    .expect("pgbouncer.ini");
    let mut cmd = Command::new("/usr/sbin/pgbouncer");
    cmd.args(["-u", "postgres"]).arg(&ini);
    let p = ServerProcess::spawn("pgbouncer", dir, cmd);
    (p, port)
}

/// A plain sqlx connection for checks and setup (no lockkit in between).
pub async fn admin(url: &str) -> PgConnection {
    PgConnection::connect(url)
        .await
        .unwrap_or_else(|e| panic!("admin connection: {e}"))
}
