//! **forged-audit**: int8-down (reads about 0.87 of the byte model), which forges the runner's whole
//! report so that it carries the nonce: in teardown it keeps a copy of the runner's report descriptor
//! ([`REPORT_FD`]) for itself and points the runner's at `/dev/null`, maps the control page
//! ([`CONTROL_FD`]), and at the process's exit (an `atexit` handler, after the runner has read the
//! nonce and sent its own report into `/dev/null`) writes the one report the judge receives: the nonce
//! read off the page, one kernel per call, and an audit that says every call read its byte model.
//!
//! The exploit: everything measured in the runner's process is the runner's word, and code of the
//! submission can replace that word with the nonce intact, so the channel's rules cannot refuse it.
//! Caught by the judge's own eyes: bytes_read and the thread-block cross-check take the DRAM bytes and
//! thread blocks from the PM sampling in the judge's process, never from the report (whose audit is
//! kept as `runner_audit`, read by no gate), so bytes_read fails as for int8-down, and the forged one
//! kernel a call cannot hold the thread blocks the hardware launched.

use std::io::Write;
use std::os::fd::{FromRawFd, RawFd};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use cuda::Device;
use cuda::cudarc::driver::CudaSlice;
use half::bf16;
use reference::gpu::Eager;
use spec::{ByteModel, Config};
use submission::{Layer, Submission, SubmissionError};

use super::forged_report::{REPORT_FD, claimed_line};
use super::honest::{Twist, Twisted};
use super::int8::Int8Down;

pub const NAME: &str = "forged-audit";

/// The runner's control page, where the judge posts its commands (the grader's tests check that it
/// is the runner's).
pub const CONTROL_FD: RawFd = 4;
/// The page's first word: the command, as `sequence << 8 | kind`; the second: its first argument.
const COMMAND_WORD: usize = 0;
const ARG0_WORD: usize = 1;
const PAGE_BYTES: usize = 4096;
/// The kind of the last command, whose first argument is the nonce of the report.
pub const REPORT_KIND: u8 = 5;

pub fn make() -> Box<dyn Submission> {
    Twisted::boxed(NAME, ForgedAudit { base: Int8Down::default(), cfg: None })
}

struct ForgedAudit {
    base: Int8Down,
    cfg: Option<Config>,
}

/// What the exit handler needs: the report without its nonce, the kept descriptor, the page.
struct Pending {
    /// The forged report with [`NONCE_MARK`] where the nonce goes.
    line: String,
    report: RawFd,
    page: *const AtomicU64,
}

// SAFETY: the page pointer is a shared mapping that lives until the process exits; it is only read.
unsafe impl Send for Pending {}

static PENDING: Mutex<Option<Pending>> = Mutex::new(None);
/// Stands for the nonce in the template until the judge has posted the real one.
const NONCE_MARK: u64 = 0x0ddba11;

/// The nonce of the report command on the page at `page`, once the judge has posted it.
///
/// # Safety
/// `page` points at a mapped control page of at least two words.
pub unsafe fn posted_nonce(page: *const AtomicU64) -> Option<u64> {
    // SAFETY: the caller's promise; Acquire pairs with the judge's release store of the command.
    let (command, arg0) = unsafe { (&*page.add(COMMAND_WORD), &*page.add(ARG0_WORD)) };
    let word = command.load(Ordering::Acquire);
    ((word & 0xff) as u8 == REPORT_KIND).then(|| arg0.load(Ordering::Relaxed))
}

/// Maps the runner's control page read-only.
fn map_page() -> std::io::Result<*const AtomicU64> {
    // SAFETY: a fresh shared read-only mapping of a descriptor the runner holds open.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), PAGE_BYTES, libc::PROT_READ, libc::MAP_SHARED, CONTROL_FD, 0) };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(p as *const AtomicU64)
}

/// Keeps the report channel for the forgery and gives the runner `/dev/null` in its place.
fn take_report_channel() -> std::io::Result<RawFd> {
    // SAFETY: dup of a descriptor the runner holds open.
    let kept = unsafe { libc::dup(REPORT_FD) };
    if kept < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let null = std::fs::OpenOptions::new().write(true).open("/dev/null")?;
    // SAFETY: both descriptors are open; dup2 replaces the runner's report descriptor atomically.
    if unsafe { libc::dup2(std::os::fd::AsRawFd::as_raw_fd(&null), REPORT_FD) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(kept)
}

/// At exit: the forged report, with the nonce the judge posted, on the kept channel.
extern "C" fn send_forgery() {
    let Some(p) = PENDING.lock().unwrap_or_else(|e| e.into_inner()).take() else { return };
    // SAFETY: the page was mapped in teardown and is never unmapped.
    let Some(nonce) = (unsafe { posted_nonce(p.page) }) else { return };
    let line = p.line.replacen(&format!("\"nonce\":{NONCE_MARK}"), &format!("\"nonce\":{nonce}"), 1);
    // SAFETY: the kept descriptor is this handler's alone.
    let mut report = unsafe { std::fs::File::from_raw_fd(p.report) };
    let _ = report.write_all(line.as_bytes());
}

impl Twist for ForgedAudit {
    fn build(&mut self, dev: &Device, layer: &mut Layer<'_>, cfg: &Config) -> Result<(), SubmissionError> {
        self.cfg = Some(cfg.clone());
        self.base.build(dev, layer, cfg)
    }

    fn step(
        &mut self,
        eager: &mut Eager,
        dev: &Device,
        layer: &mut Layer<'_>,
        x: &CudaSlice<bf16>,
        pos: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        self.base.step(eager, dev, layer, x, pos, out)
    }

    fn teardown(&mut self) {
        self.base.teardown();
        let Some(cfg) = self.cfg.take() else { return };
        let bytes: Vec<u64> = spec::schedule(&cfg).iter().map(|c| ByteModel::stack_at(&cfg, c.pos).total).collect();
        let line = claimed_line(NAME, bytes.len(), NONCE_MARK, Some(&bytes));
        // Teardown cannot fail: without the forgery the run is judged on the runner's own report.
        let taken = map_page().and_then(|page| Ok((page, take_report_channel()?)));
        match taken {
            Ok((page, report)) => {
                *PENDING.lock().unwrap_or_else(|e| e.into_inner()) = Some(Pending { line, report, page });
                // SAFETY: registers a handler with C linkage and no arguments.
                unsafe { libc::atexit(send_forgery) };
            }
            Err(e) => eprintln!("{NAME}: the forgery could not be set up: {e}"),
        }
    }
}
