//! The judge's clock and the runner's hands: one page of memory both processes map, through which
//! the judge starts every command (build, a call, a batch of calls, teardown) and the runner says it
//! has finished.
//!
//! Why shared memory and not a pipe: the judge stamps each call between writing "go" and seeing
//! "done", so the signal's latency is inside the timed figure. A store to a shared cache line and
//! a spinning reader on another core cost well under a microsecond each way; a pipe round trip costs
//! tens. The judge measures the remaining overhead (a no-op command) and reports it.
//!
//! Protocol: the judge writes the arguments, then the command word `(sequence << 8) | kind` with
//! release ordering; the runner, spinning with acquire loads, sees the new sequence, does the work,
//! writes its status, then the sequence into `ack` with release ordering; the judge sees the ack
//! with an acquire load and stops its clock. The runner then does its bookkeeping (the audit's
//! ranges, the recording's checks) and writes the sequence into `ready`: the judge waits for that
//! before it starts the next command, so no bookkeeping ever falls inside a timed window. Each side
//! only ever writes its own words, so no lock is needed.

use std::os::fd::{OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::memfd::SharedMemory;

/// How long a waiting side spins before it starts to sleep between looks: longer than any timed
/// window (a back-to-back batch of 32 graded calls is ~14 ms), so every timed wait is a pure spin.
const SPIN_BEFORE_SLEEP: Duration = Duration::from_millis(50);
/// The sleep between looks once spinning has stopped (waits for builds, slow submissions).
const SLEEP_BETWEEN_LOOKS: Duration = Duration::from_micros(50);

/// What the judge asks of the runner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Command {
    /// Do nothing and acknowledge: measures the signalling overhead.
    Ping = 1,
    /// Load the submission and call `build_layer`.
    Build = 2,
    /// Run calls `arg0 .. arg0 + arg1` of the schedule back to back, then synchronise the device.
    Calls = 3,
    /// Call `teardown` and unload the submission.
    Teardown = 4,
    /// Write the final report, carrying the nonce `arg0`, and exit.
    Report = 5,
}

impl Command {
    fn from_byte(b: u8) -> Option<Command> {
        [Command::Ping, Command::Build, Command::Calls, Command::Teardown, Command::Report]
            .into_iter()
            .find(|c| *c as u8 == b)
    }
}

/// A command as the runner reads it off the page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Posted {
    /// The judge's sequence number, acknowledged with [`Control::ack`].
    pub seq: u64,
    pub kind: Option<Command>,
    pub arg0: u64,
    pub arg1: u64,
}

/// The runner's answer to a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Ok,
    /// The command failed; the runner writes why on its report channel and exits.
    Failed,
}

/// The page's layout. The judge's words and the runner's words sit on different cache lines, so a
/// spinning reader never contends with the writer of the other line.
#[repr(C, align(64))]
struct Page {
    command: AtomicU64,
    arg0: AtomicU64,
    arg1: AtomicU64,
    /// The last command after which the judge has written the next call's input.
    staged: AtomicU64,
    _judge_pad: [u64; 4],
    ack: AtomicU64,
    status: AtomicU64,
    ready: AtomicU64,
    _runner_pad: [u64; 5],
}

const PAGE_BYTES: usize = 4096;
const _: () = assert!(size_of::<Page>() <= PAGE_BYTES);

/// One side's mapping of the page.
pub struct Control {
    memory: SharedMemory,
}

impl Control {
    /// Creates the page (an anonymous memory file the child inherits as a descriptor).
    pub fn create() -> std::io::Result<Control> {
        Ok(Control { memory: SharedMemory::create(c"persistent-layer-control", PAGE_BYTES)? })
    }

    /// Maps the page from a descriptor the judge passed down (the runner's side).
    pub fn from_fd(fd: OwnedFd) -> std::io::Result<Control> {
        Ok(Control { memory: SharedMemory::map(fd, PAGE_BYTES)? })
    }

    /// The descriptor, for handing the page to the child.
    pub fn raw_fd(&self) -> RawFd {
        self.memory.raw_fd()
    }

    fn page(&self) -> &Page {
        // SAFETY: the mapping is valid and page-aligned for as long as self lives; a zero-filled
        // page is a valid Page (atomics of zero), and it is only ever accessed through them.
        unsafe { &*self.memory.as_ptr().cast::<Page>() }
    }

    // ---- the judge's side ----

    /// Posts command `kind` with its arguments as command number `seq`.
    pub fn post(&self, seq: u64, kind: Command, arg0: u64, arg1: u64) {
        let p = self.page();
        p.arg0.store(arg0, Ordering::Relaxed);
        p.arg1.store(arg1, Ordering::Relaxed);
        // Release: the arguments are visible to whoever acquires this word.
        p.command.store((seq << 8) | kind as u64, Ordering::Release);
    }

    /// Says the next call's input is on the device, written after command `seq` was acknowledged.
    pub fn staged(&self, seq: u64) {
        // Release: the input was synchronised on the device before this store.
        self.page().staged.store(seq, Ordering::Release);
    }

    /// Waits until the runner has acknowledged command `seq`, or `give_up` says to stop looking
    /// (checked only while sleeping, never during the spin, so it adds nothing to a timed wait).
    /// Returns the time the ack was seen.
    pub fn wait_ack(&self, seq: u64, give_up: impl FnMut() -> bool) -> Option<(Instant, Status)> {
        let p = self.page();
        // Acquire: pairs with the runner's release store of `ack`, so its status and every write it
        // made before (device memory included, synchronised before the ack) is seen.
        let seen = wait_for(|| p.ack.load(Ordering::Acquire) == seq, give_up)?;
        let status = if p.status.load(Ordering::Relaxed) == 0 { Status::Ok } else { Status::Failed };
        Some((seen, status))
    }

    /// Waits until the runner has finished its bookkeeping after command `seq`.
    pub fn wait_ready(&self, seq: u64, give_up: impl FnMut() -> bool) -> Option<Instant> {
        let p = self.page();
        // Acquire: pairs with the runner's release store of `ready`.
        wait_for(|| p.ready.load(Ordering::Acquire) == seq, give_up)
    }

    // ---- the runner's side ----

    /// Waits for the command after `last_seq`. A word that names no command comes back with kind
    /// `None` (the judge never writes one).
    pub fn next_command(&self, last_seq: u64) -> Posted {
        let p = self.page();
        let start = Instant::now();
        loop {
            // Acquire: pairs with the judge's release store, so the arguments are current.
            let word = p.command.load(Ordering::Acquire);
            if word >> 8 != last_seq {
                let kind = Command::from_byte((word & 0xff) as u8);
                return Posted {
                    seq: word >> 8,
                    kind,
                    arg0: p.arg0.load(Ordering::Relaxed),
                    arg1: p.arg1.load(Ordering::Relaxed),
                };
            }
            if start.elapsed() < SPIN_BEFORE_SLEEP {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(SLEEP_BETWEEN_LOOKS);
            }
        }
    }

    /// Waits until the judge has written the input of the call after command `seq`, or `give_up`.
    pub fn wait_staged(&self, seq: u64, give_up: impl FnMut() -> bool) -> Option<Instant> {
        let p = self.page();
        // Acquire: pairs with the judge's release store of `staged`.
        wait_for(|| p.staged.load(Ordering::Acquire) >= seq, give_up)
    }

    /// Acknowledges command `seq` with `status`.
    pub fn ack(&self, seq: u64, status: Status) {
        let p = self.page();
        p.status.store(u64::from(status == Status::Failed), Ordering::Relaxed);
        // Release: the status (and everything this process did before) is visible with the ack.
        p.ack.store(seq, Ordering::Release);
    }

    /// Says the bookkeeping after command `seq` is done: the next command may be timed.
    pub fn ready(&self, seq: u64) {
        // Release: everything the bookkeeping did is visible with it.
        self.page().ready.store(seq, Ordering::Release);
    }
}

/// Spins until `done`, then sleeps between looks; `give_up` is asked only while sleeping, never
/// during the spin, so it adds nothing to a timed wait. Returns when `done` was seen.
fn wait_for(mut done: impl FnMut() -> bool, mut give_up: impl FnMut() -> bool) -> Option<Instant> {
    let start = Instant::now();
    loop {
        if done() {
            return Some(Instant::now());
        }
        if start.elapsed() < SPIN_BEFORE_SLEEP {
            std::hint::spin_loop();
        } else {
            if give_up() {
                return None;
            }
            std::thread::sleep(SLEEP_BETWEEN_LOOKS);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::FromRawFd;

    use super::*;

    #[test]
    fn commands_and_acks_cross_between_two_mappings() {
        let judge = Control::create().unwrap();
        // SAFETY: dup returns a fresh descriptor of the same memory file.
        let dup = unsafe { OwnedFd::from_raw_fd(libc::dup(judge.raw_fd())) };
        let runner = Control::from_fd(dup).unwrap();
        let worker = std::thread::spawn(move || {
            let mut last = 0;
            let mut seen = Vec::new();
            loop {
                let Posted { seq, kind, arg0: a0, arg1: a1 } = runner.next_command(last);
                last = seq;
                seen.push((kind, a0, a1));
                let status = if kind == Some(Command::Teardown) { Status::Failed } else { Status::Ok };
                runner.ack(seq, status);
                runner.ready(seq);
                if kind == Some(Command::Teardown) {
                    return seen;
                }
            }
        });
        judge.post(1, Command::Ping, 0, 0);
        assert_eq!(judge.wait_ack(1, || false).unwrap().1, Status::Ok);
        assert!(judge.wait_ready(1, || false).is_some());
        judge.post(2, Command::Calls, 40, 32);
        assert_eq!(judge.wait_ack(2, || false).unwrap().1, Status::Ok);
        judge.post(3, Command::Teardown, 0, 0);
        assert_eq!(judge.wait_ack(3, || false).unwrap().1, Status::Failed);
        let seen = worker.join().unwrap();
        assert_eq!(
            seen,
            vec![(Some(Command::Ping), 0, 0), (Some(Command::Calls), 40, 32), (Some(Command::Teardown), 0, 0)]
        );
    }

    #[test]
    fn a_silent_runner_is_given_up_on() {
        let judge = Control::create().unwrap();
        judge.post(1, Command::Ping, 0, 0);
        let mut looks = 0;
        assert!(
            judge
                .wait_ack(1, || {
                    looks += 1;
                    looks > 3
                })
                .is_none()
        );
    }

    /// forged-audit reads the report's nonce off the page the way the runner does: what it relies on
    /// is this page's layout and the runner's descriptor numbers.
    #[test]
    fn the_red_teams_forger_reads_the_posted_nonce() {
        use redteam::forged_audit::{CONTROL_FD, REPORT_KIND, posted_nonce};
        assert_eq!(CONTROL_FD, crate::run::protocol::CONTROL_FD);
        assert_eq!(REPORT_KIND, Command::Report as u8);
        let judge = Control::create().unwrap();
        let page = judge.page() as *const Page as *const AtomicU64;
        judge.post(7, Command::Teardown, 0, 0);
        // SAFETY: the page is mapped for as long as `judge` lives.
        assert_eq!(unsafe { posted_nonce(page) }, None);
        judge.post(8, Command::Report, 0x5eed_f00d, 0);
        // SAFETY: as above.
        assert_eq!(unsafe { posted_nonce(page) }, Some(0x5eed_f00d));
    }

    #[test]
    fn unknown_kinds_are_not_commands() {
        assert_eq!(Command::from_byte(0), None);
        assert_eq!(Command::from_byte(99), None);
        assert_eq!(Command::from_byte(3), Some(Command::Calls));
    }
}
