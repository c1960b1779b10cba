//! The `lockkit` command, run as a user would.

use std::process::{Command, Stdio};

fn lockkit() -> Command {
    Command::new(env!("CARGO_BIN_EXE_lockkit"))
}

#[test]
fn runs_the_command_with_the_token_and_passes_its_exit_code() {
    let out = lockkit()
        .args(["run", "--backend", "memory://", "job", "--", "sh", "-c"])
        .arg("echo \"$LOCKKIT_LOCK $LOCKKIT_FENCING_TOKEN\"; exit 3")
        .output()
        .expect("run lockkit");
    assert_eq!(out.status.code(), Some(3));
    // The token's string form: version, number, lock identity (`memory/{table}/{name}`).
    let shown = String::from_utf8_lossy(&out.stdout);
    let (lock, token) = shown.trim().split_once(' ').expect("two words");
    assert_eq!(lock, "job");
    let token: lockkit::FencingToken = token.parse().expect("a fencing token");
    assert_eq!(token.get(), 1);
    assert!(token.lock().starts_with("memory/") && token.lock().ends_with("/job"));
}

#[test]
fn bad_input_is_a_usage_error_not_a_panic() {
    for args in [
        &["run", "--backend", "bogus://x", "job", "--", "true"][..],
        &["run", "--backend", "memory://", "a/b", "--", "true"][..],
        &[
            "run",
            "--backend",
            "memory://",
            "--ttl",
            "0s",
            "job",
            "--",
            "true",
        ][..],
    ] {
        let out = lockkit()
            .args(args)
            .stderr(Stdio::piped())
            .output()
            .expect("run lockkit");
        assert_eq!(
            out.status.code(),
            Some(64),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"));
    }
}

/// Against the shared Redis (scripts/test.sh sets LOCKKIT_REDIS_URL): a second run of a held
/// lock with `--wait 0` exits 75 at once; after the first exits, the lock is free again.
#[test]
fn held_lock_exits_75() {
    let url = std::env::var("LOCKKIT_REDIS_URL")
        .expect("LOCKKIT_REDIS_URL is not set: run scripts/test.sh");
    let name = format!("cli-{:08x}", std::process::id());
    // The holder waits on its stdin, so the test decides when it exits.
    let mut holder = lockkit()
        .args([
            "run",
            "--backend",
            &url,
            &name,
            "--",
            "sh",
            "-c",
            "echo held; read _; exit 0",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn holder");
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(holder.stdout.take().unwrap()),
        &mut line,
    )
    .expect("holder output");
    assert_eq!(line.trim(), "held");
    let second = lockkit()
        .args(["run", "--backend", &url, "--wait", "0", &name, "--", "true"])
        .status()
        .expect("run lockkit");
    assert_eq!(second.code(), Some(75));
    drop(holder.stdin.take()); // EOF: the holder's command exits and the lock is released
    assert!(holder.wait().expect("holder").success());
    let third = lockkit()
        .args([
            "run",
            "--backend",
            &url,
            "--wait",
            "5s",
            &name,
            "--",
            "true",
        ])
        .status()
        .expect("run lockkit");
    assert_eq!(third.code(), Some(0));
}

#[test]
fn a_command_that_cannot_start_exits_127() {
    let out = lockkit()
        .args([
            "run",
            "--backend",
            "memory://",
            "job",
            "--",
            "/nonexistent/program",
        ])
        .output()
        .expect("run lockkit");
    assert_eq!(out.status.code(), Some(127));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot start"));
}
