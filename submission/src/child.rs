//! The processes the grader starts to run code it does not control (the runner, a library's
//! initialisers, a Python interpreter's probe): waiting for one with a deadline, and containing it,
//! so that nothing it starts outlives it.
//!
//! A contained process gets a session of its own (so that nothing it starts can join one of the
//! grader's process groups, which only a process of the same session may), dies with the grader's
//! thread that started it (`PR_SET_PDEATHSIG`), and has the grader as the reaper of its orphans
//! (`PR_SET_CHILD_SUBREAPER`), so that a process that detaches itself (forks twice, starts a session
//! of its own) comes back to the grader as a child instead of going to init. Once the contained
//! process has exited, [`end_session`] kills everything that came of it: every process of its
//! session, and every child of the grader in a session that is neither the grader's nor another
//! contained process's. A signal that ends the grader from outside (Ctrl-C, which no longer reaches a
//! contained session through the terminal's process group) first kills every live contained group.

use std::collections::BTreeSet;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant};

/// How often a waiting caller looks at the child.
const POLL: Duration = Duration::from_millis(10);
/// How long [`end_session`] keeps killing and reaping: a process in the kernel's uninterruptible
/// sleep (inside a driver) dies only when it leaves it.
pub const END_LIMIT: Duration = Duration::from_secs(2);
/// The pause between two of [`end_session`]'s looks at the process table.
const END_ROUND: Duration = Duration::from_millis(5);

/// The sessions of the contained processes not yet ended (a session's number is its leader's pid):
/// their leaders are the grader's children in sessions of their own, and no leftover of another.
static LIVE: Mutex<BTreeSet<u32>> = Mutex::new(BTreeSet::new());

fn live() -> std::sync::MutexGuard<'static, BTreeSet<u32>> {
    LIVE.lock().unwrap_or_else(|p| p.into_inner())
}

/// The same sessions' first process groups (a session's leader leads one, numbered as the session), for
/// [`end_groups_and_reraise`]: slots of atomics, since a signal handler may neither lock nor allocate.
/// More contained processes at once than slots go uncovered by the handler only.
static GROUPS: [AtomicI32; 8] = [const { AtomicI32::new(0) }; 8];
/// The signals that end the grader from outside (Ctrl-C, `kill`, a closed terminal).
const ENDING_SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];
static HANDLERS: Once = Once::new();

/// A contained session is no longer in the terminal's foreground group, so Ctrl-C reaches only the
/// grader; on such a signal this kills each live contained group (the contained process itself
/// dies with the grader through `PR_SET_PDEATHSIG`), then lets the signal end the grader as it would
/// have (`SA_RESETHAND` restored its default action; raised again, it is delivered on return).
extern "C" fn end_groups_and_reraise(signal: libc::c_int) {
    for slot in &GROUPS {
        let group = slot.load(Ordering::Relaxed);
        if group > 0 {
            // SAFETY: kill is async-signal-safe; a group that has gone answers ESRCH.
            unsafe { libc::kill(-group, libc::SIGKILL) };
        }
    }
    // SAFETY: raise is async-signal-safe.
    unsafe { libc::raise(signal) };
}

/// Installs [`end_groups_and_reraise`] for each ending signal whose action is still the default (a
/// program embedding the grader keeps handlers of its own).
fn install_handlers() {
    HANDLERS.call_once(|| {
        for signal in ENDING_SIGNALS {
            // SAFETY: sigaction reads the current action into a zeroed struct, then installs a handler
            // that only calls async-signal-safe functions.
            unsafe {
                let mut old: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(signal, std::ptr::null(), &mut old) != 0 || old.sa_sigaction != libc::SIG_DFL {
                    continue;
                }
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = end_groups_and_reraise as extern "C" fn(libc::c_int) as libc::sighandler_t;
                action.sa_flags = libc::SA_RESETHAND;
                libc::sigemptyset(&mut action.sa_mask);
                libc::sigaction(signal, &action, std::ptr::null_mut());
            }
        }
    });
}

/// The child's exit status, or `None` when it was still running at `timeout` (it is then killed and
/// reaped).
pub fn wait_or_kill(child: &mut Child, timeout: Duration) -> std::io::Result<Option<ExitStatus>> {
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait()? {
            Some(status) => return Ok(Some(status)),
            None if Instant::now() < deadline => std::thread::sleep(POLL),
            None => {
                let _ = child.kill();
                let _ = child.wait();
                return Ok(None);
            }
        }
    }
}

/// Starts `cmd` contained (the module's text says how); end it with [`end_session`] once it has
/// exited and been reaped. The thread that calls this must outlive the child: its exit kills it.
pub fn spawn_contained(cmd: &mut Command) -> std::io::Result<Child> {
    // SAFETY: prctl with integer arguments; makes this process the reaper of its descendants' orphans.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: only async-signal-safe calls (setsid, prctl, getppid, _exit) run between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The grader died before the signal was asked for: nothing would deliver it.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        })
    };
    install_handlers();
    let mut live = live();
    let child = cmd.spawn()?;
    live.insert(child.id());
    let group = child.id() as i32;
    let _ = GROUPS.iter().find(|slot| slot.compare_exchange(0, group, Ordering::Relaxed, Ordering::Relaxed).is_ok());
    Ok(child)
}

/// What the contained process left behind when it exited, killed by [`end_session`].
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Leftovers {
    /// Each process killed.
    pub killed: Vec<Left>,
    /// Processes still there at the end (stuck in the kernel).
    pub surviving: Vec<Left>,
}

/// A process left behind: its pid and its name when it was found.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Left {
    pub pid: u32,
    pub name: String,
}

impl std::fmt::Display for Left {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.name, self.pid)
    }
}

/// Whether process `pid` still runs (a zombie has ended).
pub fn runs(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| Proc::parse(&s))
        .is_some_and(|p| p.state != 'Z')
}

/// Kills everything the contained process with pid `leader` left behind: every process of its
/// session, and every child of this process in a session that is neither this process's nor a live
/// contained one's (a leftover that started a session of its own, its parent gone). Call after the
/// leader has exited and been reaped. Zombies that come to this process are reaped.
pub fn end_session(leader: u32) -> Leftovers {
    let mut live_sessions = live();
    live_sessions.remove(&leader);
    for slot in &GROUPS {
        let _ = slot.compare_exchange(leader as i32, 0, Ordering::Relaxed, Ordering::Relaxed);
    }
    // SAFETY: getsid(0) reads this process's session.
    let own = Owner { pid: std::process::id(), session: unsafe { libc::getsid(0) } as u32 };
    let mut out = Leftovers::default();
    let start = Instant::now();
    loop {
        let found: Vec<Proc> = processes().into_iter().filter(|p| own.left_by(p, leader, &live_sessions)).collect();
        if found.is_empty() {
            return out;
        }
        if start.elapsed() > END_LIMIT {
            out.surviving = found.iter().filter(|p| p.state != 'Z').map(Proc::left).collect();
            return out;
        }
        for p in &found {
            if p.state == 'Z' {
                if p.ppid == own.pid {
                    // SAFETY: reaps this process's own zombie child by pid, without blocking.
                    unsafe { libc::waitpid(p.pid as libc::pid_t, std::ptr::null_mut(), libc::WNOHANG) };
                }
                continue;
            }
            // SAFETY: kill with a pid read from /proc and SIGKILL. A pid reused since the read would
            // have to belong to a new process of the same session, which is the session's too.
            unsafe { libc::kill(p.pid as libc::pid_t, libc::SIGKILL) };
            if !out.killed.iter().any(|k| k.pid == p.pid) {
                out.killed.push(p.left());
            }
        }
        std::thread::sleep(END_ROUND);
    }
}

/// The process calling [`end_session`]: its pid and its session.
struct Owner {
    pid: u32,
    session: u32,
}

impl Owner {
    /// Whether `p` came of the contained session `leader`: it is in that session, or it is this
    /// process's child in a session of its own that no live contained process leads.
    fn left_by(&self, p: &Proc, leader: u32, live: &BTreeSet<u32>) -> bool {
        p.session == leader || (p.ppid == self.pid && p.session != self.session && !live.contains(&p.session))
    }
}

/// One line of `/proc/<pid>/stat`, the fields [`end_session`] reads.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Proc {
    pid: u32,
    name: String,
    state: char,
    ppid: u32,
    session: u32,
}

impl Proc {
    /// `pid (comm) state ppid pgrp session ...`; the name may hold spaces and parentheses, so it ends
    /// at the last `)`.
    fn parse(stat: &str) -> Option<Proc> {
        let (head, tail) = stat.rsplit_once(')')?;
        let (pid, name) = head.split_once(" (")?;
        let mut fields = tail.split_whitespace();
        let state = fields.next()?.chars().next()?;
        let ppid = fields.next()?.parse().ok()?;
        let _pgrp = fields.next()?;
        let session = fields.next()?.parse().ok()?;
        Some(Proc { pid: pid.trim().parse().ok()?, name: name.to_string(), state, ppid, session })
    }

    fn left(&self) -> Left {
        Left { pid: self.pid, name: self.name.clone() }
    }
}

/// Every process whose stat can be read (one that exits meanwhile is skipped).
fn processes() -> Vec<Proc> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(Result::ok)
        .filter(|e| e.file_name().to_str().is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit())))
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .filter_map(|s| Proc::parse(&s))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Stdio;

    #[test]
    fn a_stat_line_is_read_past_a_name_with_spaces_and_parentheses() {
        let p = Proc::parse("4242 (a (b) c) S 17 4242 4242 0 -1 4194560 99 0 0 0\n").expect("parsed");
        assert_eq!(p, Proc { pid: 4242, name: "a (b) c".into(), state: 'S', ppid: 17, session: 4242 });
        assert_eq!(p.left().to_string(), "a (b) c (4242)");
        assert_eq!(Proc::parse("12 (x) Z"), None, "too few fields");
    }

    /// Only what came of the ended session: its own processes, and this process's children in
    /// sessions nobody live leads; never this process's own session, nor a live contained one.
    #[test]
    fn what_a_session_left_is_told_from_the_grader_s_other_children() {
        let own = Owner { pid: 100, session: 50 };
        let live = BTreeSet::from([300]);
        let p = |ppid, session| Proc { pid: 999, name: "x".into(), state: 'S', ppid, session };
        assert!(own.left_by(&p(1, 200), 200, &live), "in the ended session, whoever its parent");
        assert!(own.left_by(&p(100, 999), 200, &live), "a child of ours that started a session of its own");
        assert!(!own.left_by(&p(100, 50), 200, &live), "a child of ours in our session");
        assert!(!own.left_by(&p(100, 300), 200, &live), "a live contained process");
        assert!(!own.left_by(&p(1, 999), 200, &live), "someone else's process");
    }

    /// Held by each test that ends or interrupts contained processes: this test process is their
    /// orphans' reaper, so one test's orphans would be another's leftovers.
    static SERIAL: Mutex<()> = Mutex::new(());

    /// A contained shell that leaves two sleepers behind, one in its session and one detached into a
    /// session of its own, and exits: both are killed, and no process of either is left.
    #[test]
    fn a_contained_process_leaves_nothing_behind() {
        let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let script = "sleep 300 >/dev/null & setsid sleep 301 >/dev/null & echo $!; exit 0";
        let mut cmd = Command::new("sh");
        cmd.args(["-c", script]).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::null());
        let child = spawn_contained(&mut cmd).expect("sh starts");
        let leader = child.id();
        let out = child.wait_with_output().expect("sh ends");
        assert!(out.status.success(), "{:?}", out.status);
        let detached: u32 = String::from_utf8_lossy(&out.stdout).trim().parse().expect("the detached pid");
        let left = end_session(leader);
        assert_eq!(left.killed.len(), 2, "{left:?}");
        // Named as they were when killed: `sleep`, or the shell or `setsid` not yet replaced by it.
        assert!(left.killed.iter().any(|k| k.pid == detached), "{left:?}");
        assert!(left.surviving.is_empty(), "{left:?}");
        let still = processes().into_iter().filter(|p| p.session == leader || p.pid == detached).count();
        assert_eq!(still, 0, "nothing of the session is left, zombies included");
        assert_eq!(end_session(leader), Leftovers::default(), "ending it again finds nothing");
    }

    /// Set in the copy of this test binary that the interrupt test starts.
    const CHILD: &str = "PERSISTENT_LAYER_CONTAINED_CHILD";

    /// A grader interrupted while a contained shell and its sleeper run: the sleeper dies with it,
    /// and the grader ends by the signal, as it would have without the handler.
    #[test]
    fn an_interrupted_grader_takes_its_contained_group_with_it() {
        use std::io::{BufRead, BufReader};
        use std::os::unix::process::ExitStatusExt;
        if std::env::var_os(CHILD).is_some() {
            // SIGINT as a terminal's foreground job has it (a shell's background job inherits it
            // ignored, and the handler leaves an ignored signal alone).
            // SAFETY: resets one signal's action to the default.
            unsafe { libc::signal(libc::SIGINT, libc::SIG_DFL) };
            let mut cmd = Command::new("sh");
            cmd.args(["-c", "sleep 302 >/dev/null & echo $!; wait"]).stdin(Stdio::null()).stdout(Stdio::piped());
            let mut child = spawn_contained(&mut cmd).expect("sh starts");
            let mut line = String::new();
            BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line).expect("the sleeper's pid");
            println!("sleeper {}", line.trim());
            // SAFETY: raises SIGINT in this process, as Ctrl-C would.
            unsafe { libc::raise(libc::SIGINT) };
            std::process::exit(7);
        }
        let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let name = "child::tests::an_interrupted_grader_takes_its_contained_group_with_it";
        let out = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--test-threads=1", "--nocapture"])
            .env(CHILD, "1")
            .stderr(Stdio::null())
            .output()
            .unwrap();
        assert_eq!(out.status.signal(), Some(libc::SIGINT), "ended by the signal: {:?}", out.status);
        let text = String::from_utf8_lossy(&out.stdout);
        // The harness's own "test NAME ... " precedes it on the line.
        let printed = text.split("sleeper ").nth(1).and_then(|t| t.split_whitespace().next());
        let sleeper: u32 = printed.and_then(|p| p.parse().ok()).expect("the pid printed");
        // SIGKILL has been sent before the signal ended the child; its exit reaches init soon after.
        let start = Instant::now();
        while processes().iter().any(|p| p.pid == sleeper && p.state != 'Z') && start.elapsed() < END_LIMIT {
            std::thread::sleep(END_ROUND);
        }
        assert!(!processes().iter().any(|p| p.pid == sleeper && p.state != 'Z'), "sleeper {sleeper} still runs");
    }
}
