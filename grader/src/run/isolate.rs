//! The judge's side of isolation: starts the runner (this same binary, `grader runner`) with its
//! two private descriptors (the report channel and the control page), drives it command by command
//! under a watchdog, and watches the device for other processes while it lives. A runner that dies,
//! fails, or goes quiet ends the run with status `crashed` or `timeout`; the judge itself, and the
//! GPU, stay usable (the driver tears the runner's context down with it).

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, ChildStderr, Command as Process, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::channel::Collector;
use super::control::{Command, Control, Status};
use super::protocol::{CONTROL_FD, Finished, Job, Message, REPORT_FD};
use super::sandbox::SECCOMP_KILL_SIGNAL;
use super::watch::{ProcessWatch, Watched};
use crate::error::GraderError;

/// Longest wait for the runner to start (open the device, map the region, switch the recording on).
pub const START_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest wait for `build_layer` (a JIT compiler may run there).
pub const BUILD_TIMEOUT: Duration = Duration::from_secs(180);
/// Longest wait for one command of calls, teardown or the report.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Lines of the runner's stderr kept for a crash report.
const STDERR_TAIL_LINES: usize = 12;
/// How long the judge lets the runner's last stderr lines arrive after it exited.
const STDERR_SETTLE: Duration = Duration::from_millis(100);
/// How long a runner that reported a failure gets to exit before it is killed.
const EXIT_GRACE: Duration = Duration::from_secs(5);

/// How an isolated run ended when it did not finish.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "status", content = "reason")]
pub enum Failure {
    /// The runner died, or reported an error from the submission or the device.
    Crashed(String),
    /// The runner went quiet and was killed.
    Timeout(String),
    /// The runner reported that `build_layer` declined the config as one the submission does not
    /// implement, saying why: an honest refusal, still not a pass.
    Unsupported(String),
}

/// When the judge posted a command and when it saw the acknowledgement.
#[derive(Debug, Clone, Copy)]
pub struct Stamps {
    pub posted: Instant,
    pub acked: Instant,
}

impl Stamps {
    pub fn us(&self) -> f64 {
        self.acked.duration_since(self.posted).as_secs_f64() * 1e6
    }
}

/// A live runner.
pub struct Runner {
    child: Child,
    control: Control,
    seq: u64,
    collector: Option<Collector>,
    stderr: Option<Arc<Mutex<String>>>,
    watch: Option<ProcessWatch>,
    /// What the runner was last asked, for the messages of a crash or a timeout.
    last: &'static str,
}

impl Runner {
    /// Starts the runner on `job` (it maps the region and switches the recording on; wait for it
    /// with a [`Command::Ping`]) and starts watching the device at `pci_bus_id`.
    pub fn start(job: &Job, pci_bus_id: &str) -> Result<Runner, GraderError> {
        let exe =
            std::env::current_exe().map_err(|e| GraderError::Runner(format!("cannot find the grader binary: {e}")))?;
        let control = Control::create().map_err(|e| GraderError::Runner(format!("creating the control page: {e}")))?;
        let (read_end, write_end) =
            pipe().map_err(|e| GraderError::Runner(format!("creating the report channel: {e}")))?;
        let (report_fd, control_fd) = (write_end.as_raw_fd(), control.raw_fd());
        let mut process = Process::new(exe);
        process.arg("runner").stdin(Stdio::piped()).stdout(Stdio::null()).stderr(Stdio::piped());
        // SAFETY: only async-signal-safe calls (fcntl, dup2) run between fork and exec.
        unsafe { process.pre_exec(move || place_descriptors(&[(report_fd, REPORT_FD), (control_fd, CONTROL_FD)])) };
        // Contained: whatever the submission starts (in build_layer, where it may) ends with the runner.
        let mut child = submission::child::spawn_contained(&mut process)
            .map_err(|e| GraderError::Runner(format!("cannot start the runner process: {e}")))?;
        drop(write_end);
        let job_line = serde_json::to_string(job).expect("the job serialises") + "\n";
        if let Some(mut stdin) = child.stdin.take() {
            // A runner that died at once cannot read its job; its exit is reported by the first command.
            let _ = stdin.write_all(job_line.as_bytes());
        }
        let stderr = child.stderr.take().map(tail_reader);
        let watch = ProcessWatch::start(pci_bus_id.to_string(), vec![std::process::id(), child.id()]);
        Ok(Runner {
            child,
            control,
            seq: 0,
            collector: Some(Collector::start(read_end)),
            stderr,
            watch: Some(watch),
            last: "its start",
        })
    }

    /// Waits until the runner is ready for the next command (its bookkeeping after the last one is
    /// done), at most `timeout`. The judge's own work between calls can run meanwhile.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<(), Failure> {
        if self.seq == 0 {
            return Ok(());
        }
        let start = Instant::now();
        let child = &mut self.child;
        let mut exited = false;
        let seen = self.control.wait_ready(self.seq, || {
            exited = matches!(child.try_wait(), Ok(Some(_)));
            exited || start.elapsed() > timeout
        });
        match seen {
            Some(_) => Ok(()),
            None if exited => {
                let last = self.last;
                Err(self.died(last))
            }
            None => {
                kill(&mut self.child);
                Err(Failure::Timeout(format!(
                    "the runner did not get ready within {} s after {}: it was killed",
                    timeout.as_secs(),
                    self.last
                )))
            }
        }
    }

    /// Waits until the runner is ready, posts `kind` and waits for the runner to acknowledge it, at
    /// most `timeout`. The stamps are taken right around the post and the acknowledgement.
    pub fn command(&mut self, kind: Command, arg0: u64, arg1: u64, timeout: Duration) -> Result<Stamps, Failure> {
        self.wait_ready(timeout)?;
        self.seq += 1;
        let seq = self.seq;
        let posted = Instant::now();
        self.control.post(seq, kind, arg0, arg1);
        let child = &mut self.child;
        let mut exited = false;
        let seen = self.control.wait_ack(seq, || {
            exited = matches!(child.try_wait(), Ok(Some(_)));
            exited || posted.elapsed() > timeout
        });
        let what = self.last;
        self.last = describe(kind);
        match seen {
            Some((acked, Status::Ok)) => Ok(Stamps { posted, acked }),
            Some((_, Status::Failed)) => Err(self.failed_report(what)),
            None if exited => Err(self.died(what)),
            None => {
                kill(&mut self.child);
                Err(Failure::Timeout(format!(
                    "no word from the submission for {} s during {}: the runner was killed",
                    timeout.as_secs(),
                    describe(kind)
                )))
            }
        }
    }

    /// Says the judge is done with the device after the last command: its outputs read and the next
    /// call's input written, if there is one. The runner waits for it before its eviction, so the
    /// judge's context is done before the runner's last work ahead of the next call, and the eviction
    /// starts only after the judge has seen the command end.
    pub fn staged(&self) {
        self.control.staged(self.seq);
    }

    /// Asks for the report with `nonce`, waits for the runner to exit, and reads the one message.
    pub fn finish(mut self, nonce: u64) -> (Result<Finished, Failure>, Watched) {
        let outcome = self.command(Command::Report, nonce, 0, CALL_TIMEOUT).and_then(|_| {
            let status = wait_exit(&mut self.child);
            let collector = self.collector.take().expect("collected once");
            match collector.message(Some(nonce)) {
                Ok(Message::Finished(f)) if status.is_some_and(|s| s.success()) => Ok(*f),
                Ok(Message::Finished(_)) => Err(Failure::Crashed(format!(
                    "the runner reported, then ended with {}",
                    status.map_or("no exit".into(), |s| s.to_string())
                ))),
                Ok(Message::Failed { message }) => Err(Failure::Crashed(message)),
                Ok(Message::Unsupported { message }) => Err(Failure::Unsupported(message)),
                Err(channel) => Err(Failure::Crashed(channel)),
            }
        });
        let watched = self.close();
        (outcome, watched)
    }

    /// Ends the runner after a failure; returns what the watch saw.
    pub fn abandon(mut self) -> Watched {
        self.close()
    }

    /// Ends the runner (killed if it still runs) and every process it left behind, then the watch:
    /// what the watch saw, with the leftovers killed.
    fn close(&mut self) -> Watched {
        kill(&mut self.child);
        let leftovers = submission::child::end_session(self.child.id());
        let watched = self.watch.take().map(ProcessWatch::stop).expect("closed once");
        Watched { leftovers, ..watched }
    }

    /// The runner acknowledged a failure: it wrote why on its channel and exits.
    fn failed_report(&mut self, during: &str) -> Failure {
        let _ = wait_exit(&mut self.child);
        match self.collector.take().map(|c| c.message(None)) {
            Some(Ok(Message::Failed { message })) => Failure::Crashed(message),
            Some(Ok(Message::Unsupported { message })) => Failure::Unsupported(message),
            Some(Err(channel)) => Failure::Crashed(format!("the runner failed after {during}, and {channel}")),
            _ => Failure::Crashed(format!("the runner failed after {during}{}", self.stderr_tail())),
        }
    }

    /// The runner died without acknowledging.
    fn died(&mut self, during: &str) -> Failure {
        let status = wait_exit(&mut self.child);
        let tail = self.stderr_tail();
        if status.and_then(|s| s.signal()) == Some(SECCOMP_KILL_SIGNAL) {
            return Failure::Crashed(format!(
                "the submission tried to start a process during the calls (after {during}): the runner's seccomp \
                 filter stopped it (SIGSYS); processes may only be started in build_layer{tail}"
            ));
        }
        // A runner that declines a config acknowledges it (`failed_report`): one that died did not.
        let message = self.collector.take().and_then(|c| match c.message(None) {
            Ok(Message::Failed { message } | Message::Unsupported { message }) => Some(message),
            _ => None,
        });
        match message {
            Some(m) => Failure::Crashed(m),
            None => Failure::Crashed(format!(
                "the runner died ({}) after {during}{tail}",
                status.map_or("no exit status".into(), |s| s.to_string())
            )),
        }
    }

    fn stderr_tail(&mut self) -> String {
        // The last lines reach the reader just after the runner's exit.
        std::thread::sleep(STDERR_SETTLE);
        let text = self.stderr.as_ref().map(|t| t.lock().unwrap_or_else(|p| p.into_inner()).clone());
        tail(&text.unwrap_or_default())
    }
}

impl Drop for Runner {
    fn drop(&mut self) {
        if self.watch.is_some() {
            self.close();
        }
    }
}

fn describe(kind: Command) -> &'static str {
    match kind {
        Command::Ping => "its start",
        Command::Build => "build_layer",
        Command::Calls => "a call of layer_step",
        Command::Teardown => "teardown",
        Command::Report => "its report",
    }
}

/// A pipe whose two ends are closed on exec (the child gets its end through `place_descriptors`).
fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors through a valid pointer.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: two fresh descriptors owned by nothing else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// In the child, between fork and exec: puts each `from` descriptor at `to`, open across exec.
/// Each is first copied above the targets, so no placement overwrites a descriptor still to move.
fn place_descriptors(moves: &[(RawFd, RawFd)]) -> std::io::Result<()> {
    const ABOVE_TARGETS: RawFd = 64;
    let mut staged = [0; 2];
    for (slot, &(from, _)) in staged.iter_mut().zip(moves) {
        // SAFETY: duplicates an open descriptor (async-signal-safe).
        *slot = unsafe { libc::fcntl(from, libc::F_DUPFD_CLOEXEC, ABOVE_TARGETS) };
        if *slot < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    for (&tmp, &(_, to)) in staged.iter().zip(moves) {
        // SAFETY: dup2 onto a fixed number clears close-on-exec on the copy (async-signal-safe).
        if unsafe { libc::dup2(tmp, to) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Collects the runner's stderr as it comes: a process the submission left behind may hold the
/// stream open forever, so the judge reads what has arrived instead of waiting for its end.
fn tail_reader(stderr: ChildStderr) -> Arc<Mutex<String>> {
    let text = Arc::new(Mutex::new(String::new()));
    let sink = text.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let mut t = sink.lock().unwrap_or_else(|p| p.into_inner());
            t.push_str(&line);
            t.push('\n');
        }
    });
    text
}

fn kill(child: &mut Child) {
    // Already gone is fine; anything else is the OS refusing, seen by wait below.
    let _ = child.kill();
    let _ = child.wait();
}

/// Waits for the child to exit, killing it after a grace period.
fn wait_exit(child: &mut Child) -> Option<std::process::ExitStatus> {
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if start.elapsed() < EXIT_GRACE => std::thread::sleep(Duration::from_millis(1)),
            _ => {
                kill(child);
                return child.try_wait().ok().flatten();
            }
        }
    }
}

/// The last lines of the runner's stderr, as a suffix for a crash report.
fn tail(stderr: &str) -> String {
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    if lines.is_empty() {
        return String::new();
    }
    format!("; its stderr ends: {}", lines[lines.len().saturating_sub(STDERR_TAIL_LINES)..].join(" | "))
}
