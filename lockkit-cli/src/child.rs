//! The command `lockkit run` starts: its own process group, the parent-death signal, the watcher
//! that ends the group if `lockkit` dies, and signals to the whole group.

use std::io::{self, Write};
use std::process::{Child as StdChild, ChildStdin as StdChildStdin, ExitStatus, Stdio};
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::process::{Child, Command};

/// How often `lockkit run` looks whether processes the command left behind are gone (there is
/// no event for "a process group is empty" that a non-parent can wait on).
pub const GROUP_POLL: Duration = Duration::from_millis(20);

/// The started command: its leader process (the group ID is its PID) and the watcher process
/// that SIGKILLs the group if `lockkit` ends without doing so itself.
#[derive(Debug)]
pub struct Group {
    leader: Child,
    pgid: Pid,
    /// The watcher and the write end of its stdin: the watcher acts when that pipe closes,
    /// which the kernel does for any death of `lockkit`, SIGKILL included.
    watcher: Option<(StdChild, StdChildStdin)>,
    /// The group was sent SIGKILL: what is left is dying, not left behind.
    killed: bool,
}

/// Starts `program args` in a process group of its own, with `env` added.
///
/// On Linux the leader also gets SIGKILL as its parent-death signal. Must be called from the
/// thread that runs `main` (the `block_on` future, not a spawned task): Linux sends the
/// parent-death signal when the *thread* that forked exits, and only the main thread lives as
/// long as the process.
///
/// # Errors
/// The OS error of the fork or exec (program not found, not executable, …), or of starting the
/// watcher (`lockkit` re-executes itself as `lockkit watch-group`).
pub fn spawn(program: &str, args: &[String], env: &[(&str, String)]) -> io::Result<Group> {
    // The watcher first, so that no moment passes with the command running and unwatched
    // (but for writing its group ID to the watcher).
    let mut watcher = start_watcher().map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("starting the watcher process (lockkit watch-group): {e}"),
        )
    })?;
    let mut cmd = Command::new(program);
    cmd.args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .process_group(0)
        .kill_on_drop(true);
    set_parent_death_signal(&mut cmd);
    let leader = match cmd.spawn() {
        Ok(l) => l,
        Err(e) => {
            stop_watcher(watcher);
            return Err(e);
        }
    };
    let pgid = Pid::from_raw(leader.id().map_or(0, |id| id as i32));
    let mut group = Group {
        leader,
        pgid,
        watcher: None,
        killed: false,
    };
    if let Err(e) = writeln!(watcher.1, "{}", pgid.as_raw()) {
        group.signal(Signal::SIGKILL);
        stop_watcher(watcher);
        return Err(io::Error::new(
            e.kind(),
            format!("telling the watcher process the command's group: {e}"),
        ));
    }
    group.watcher = Some(watcher);
    Ok(group)
}

/// Linux: the leader gets SIGKILL when `lockkit` dies, even by SIGKILL. The rest of the group
/// is covered by the watcher (which also covers every other platform).
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn set_parent_death_signal(cmd: &mut Command) {
    let parent = nix::unistd::getpid();
    // SAFETY: the closure runs in the child between fork and exec, where only
    // async-signal-safe calls are allowed. It makes two system calls (prctl, getppid) through
    // nix's thin wrappers and builds an io::Error from a raw errno, none of which allocates,
    // locks or touches state shared with other threads of the parent.
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(io::Error::from)?;
            // lockkit may have died between the fork and the prctl: the signal was then never
            // armed for it. Refuse to start.
            if nix::unistd::getppid() != parent {
                return Err(io::Error::from(Errno::ESRCH));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn set_parent_death_signal(_cmd: &mut Command) {}

/// Re-executes this binary as `lockkit watch-group` with a pipe as its stdin.
fn start_watcher() -> io::Result<(StdChild, StdChildStdin)> {
    use std::os::unix::process::CommandExt;
    let exe = std::env::current_exe()?;
    let mut w = std::process::Command::new(exe)
        .arg("watch-group")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        // Its own group: a Ctrl-C at the terminal must not end it before lockkit is done.
        .process_group(0)
        .spawn()?;
    match w.stdin.take() {
        Some(stdin) => Ok((w, stdin)),
        None => {
            let _ = w.kill();
            let _ = w.wait();
            Err(io::Error::other("no stdin pipe"))
        }
    }
}

/// Ends the watcher (SIGKILL, then reaps it): the group it watches is gone or was never started.
fn stop_watcher((mut w, stdin): (StdChild, StdChildStdin)) {
    let _ = w.kill();
    let _ = w.wait();
    drop(stdin);
}

/// `lockkit watch-group`: reads a process group ID line from stdin, waits until stdin closes
/// (lockkit ended), then SIGKILLs that group. Normally lockkit kills the watcher first, once
/// the group is gone; a watcher whose stdin closes before a whole line came does nothing.
pub fn watch_group() {
    use std::io::Read;
    let mut got = Vec::new();
    let mut buf = [0u8; 64];
    loop {
        match io::stdin().read(&mut buf) {
            Ok(0) => break,
            Ok(n) if got.len() < 64 => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() != io::ErrorKind::Interrupted => break,
            _ => {}
        }
    }
    let line = String::from_utf8_lossy(&got);
    let pgid = line
        .split_once('\n')
        .and_then(|(id, _)| id.trim().parse::<i32>().ok());
    if let Some(pgid) = pgid.filter(|p| *p > 0) {
        let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
    }
}

/// Linux: whether /proc lists a process of group `pgid` that is not a zombie.
fn live_in_group_linux(pgid: i32) -> bool {
    if !cfg!(target_os = "linux") || pgid <= 0 {
        return false;
    }
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return false;
    };
    let pgid = pgid.to_string();
    dir.flatten().any(|e| {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            return false;
        };
        // "pid (comm) state ppid pgrp …": comm may hold spaces and parentheses.
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|stat| {
                let (_, tail) = stat.rsplit_once(')')?;
                let f: Vec<&str> = tail.split_whitespace().take(3).collect();
                Some(f.len() == 3 && f[0] != "Z" && f[2] == pgid)
            })
            .unwrap_or(false)
    })
}

impl Group {
    /// Sends `sig` to every process of the group. A group already gone is not an error.
    pub fn signal(&mut self, sig: Signal) {
        self.killed |= sig == Signal::SIGKILL;
        if self.pgid.as_raw() > 0 {
            let _ = killpg(self.pgid, sig);
        }
    }

    /// Whether any process of the group is left. On Linux zombies do not count (an orphaned
    /// zombie waits for whoever reaps orphans, which may be slow in a container); elsewhere
    /// they do until reaped.
    pub fn alive(&self) -> bool {
        if self.pgid.as_raw() <= 0 {
            false
        } else if cfg!(target_os = "linux") {
            live_in_group_linux(self.pgid.as_raw())
        } else {
            killpg(self.pgid, None) != Err(Errno::ESRCH)
        }
    }

    /// Waits for the leader to exit.
    ///
    /// # Errors
    /// The OS error of `waitpid`.
    pub async fn wait(&mut self) -> io::Result<ExitStatus> {
        self.leader.wait().await
    }

    /// Whether the group was sent SIGKILL: what is left of it is dying, not left behind.
    pub fn killed(&self) -> bool {
        self.killed
    }

    /// Stops the watcher: call once the group is gone (or given up on).
    pub fn finish(&mut self) {
        if let Some(w) = self.watcher.take() {
            stop_watcher(w);
        }
    }
}
