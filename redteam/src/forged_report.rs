//! **forged-report**: the eager reference (21 kernels per call), and in teardown it writes a report of
//! its own on the runner's report descriptor ([`REPORT_FD`]): one line in the shape of the runner's
//! finished report ([`forged_line`]) claiming a clean run of one kernel per call.
//!
//! The exploit: the verdict on kernels, shares and DRAM traffic rests on what the runner reports, and
//! the report travels on a descriptor any code in the runner's process can find and write to. Caught
//! by the channel's rules: the judge hands the runner a nonce only after teardown has returned, so a
//! forgery cannot carry it, and the judge accepts exactly one message; the runner's own report follows
//! the forged one, and two messages on the channel end the run as crashed ("the runner's report
//! channel carried 2 messages").

use std::io::Write;

use cuda::Device;
use cuda::cudarc::driver::CudaSlice;
use half::bf16;
use reference::gpu::Eager;
use submission::{Layer, Submission, SubmissionError};

use super::CallCount;
use super::honest::{Twist, Twisted, honest_step};

pub const NAME: &str = "forged-report";

/// The runner's report descriptor, where the finished report goes (the grader's tests check that it
/// is the runner's).
pub const REPORT_FD: i32 = 3;

/// The nonce the forgery carries: the real one is handed over only after teardown.
const GUESSED_NONCE: u64 = 0;
/// What the forgery claims for every call: one kernel of a graded step's time, on one wave of an
/// H200's SMs, holding all of the call's kernel time.
const CLAIMED_KERNEL: &str = "megakernel_bf16";
const CLAIMED_KERNEL_NS: u64 = 400_000;
const CLAIMED_CTAS: u64 = 132;

pub fn make() -> Box<dyn Submission> {
    Twisted::boxed(NAME, ForgedReport { calls: CallCount::default() })
}

/// `{"key":value,...}` from keys and values already written as JSON.
fn object(fields: &[(&str, String)]) -> String {
    let fields: Vec<String> = fields.iter().map(|(key, value)| format!("\"{key}\":{value}")).collect();
    format!("{{{}}}", fields.join(","))
}

/// A finished report for `calls` calls, one line: every call one kernel with a share of 1, nothing
/// wrong with the record, the DRAM audit unavailable (which an unaudited run allows).
pub fn forged_line(calls: usize) -> String {
    claimed_line(NAME, calls, GUESSED_NONCE, None)
}

/// [`forged_line`] under `name`, carrying `nonce`; with `bytes_read` (one figure per call), an audit
/// that says it measured each call reading exactly that.
pub(crate) fn claimed_line(name: &str, calls: usize, nonce: u64, bytes_read: Option<&[u64]>) -> String {
    let ns = CLAIMED_KERNEL_NS.to_string();
    let zero = || "0".to_string();
    let step = object(&[
        ("kernels", "1".into()),
        ("kernel_ns", ns.clone()),
        ("largest_kernel_ns", ns.clone()),
        ("largest_kernel", format!("\"{CLAIMED_KERNEL}\"")),
        ("dominant_share", "1.0".into()),
        ("span_ns", ns.clone()),
        ("memcpys", zero()),
        ("memsets", zero()),
        ("graph_kernels", zero()),
        ("device_launched", zero()),
        ("other", zero()),
        ("ctas", CLAIMED_CTAS.to_string()),
        ("busy_ns", ns),
    ]);
    let each = |item: &str| format!("[{}]", vec![item; calls].join(","));
    let record = object(&[
        ("build", step.clone()),
        ("calls", each(&step)),
        ("activities", each("[]")),
        ("api_launches", each("1")),
        ("modules", "1".into()),
        ("profiler_kernels", zero()),
        ("runner_copies", each("{\"copies\":0,\"blocks\":0}")),
        ("problems", "[]".into()),
        ("windows", each("{\"start_ns\":0,\"end_ns\":0}")),
    ]);
    let audit = match bytes_read {
        None => object(&[
            (
                "coverage",
                object(&[
                    ("coverage", "\"unaudited\"".into()),
                    ("reason", "\"no access to the hardware counters\"".into()),
                ]),
            ),
            ("calls", each("null")),
            ("batches", "[]".into()),
        ]),
        Some(bytes) => {
            let counters: Vec<String> = bytes
                .iter()
                .map(|&b| {
                    object(&[
                        ("bytes_read", b.to_string()),
                        ("bytes_written", zero()),
                        ("ctas", CLAIMED_CTAS.to_string()),
                    ])
                })
                .collect();
            object(&[
                ("coverage", object(&[("coverage", "\"measured\"".into())])),
                ("calls", format!("[{}]", counters.join(","))),
                ("batches", "[]".into()),
            ])
        }
    };
    let report = object(&[
        ("outcome", "\"finished\"".into()),
        ("nonce", nonce.to_string()),
        ("name", format!("\"{name}\"")),
        ("build_s", "1.0".into()),
        ("record", record),
        ("audit", audit),
        ("runner_us", "[]".into()),
        ("l2", "[]".into()),
        ("weight_vectors_changed", "0".into()),
    ]);
    report + "\n"
}

/// Writes `line` into the runner's report pipe: opened anew through `/proc/self/fd`, so that the
/// runner's own descriptor stays open for its report. Anything but a pipe there is left alone.
fn write_report(line: &str) -> std::io::Result<()> {
    let path = format!("/proc/self/fd/{REPORT_FD}");
    let target = std::fs::read_link(&path)?;
    if !target.to_string_lossy().starts_with("pipe:") {
        return Err(std::io::Error::other(format!("descriptor {REPORT_FD} is {}, not a pipe", target.display())));
    }
    std::fs::OpenOptions::new().write(true).open(&path)?.write_all(line.as_bytes())
}

struct ForgedReport {
    calls: CallCount,
}

impl Twist for ForgedReport {
    fn step(
        &mut self,
        eager: &mut Eager,
        dev: &Device,
        layer: &mut Layer<'_>,
        x: &CudaSlice<bf16>,
        pos: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        self.calls.next();
        honest_step(eager, dev, layer, x, pos, out)
    }

    fn teardown(&mut self) {
        // Teardown cannot fail; without the forgery the run is judged on the runner's report alone.
        if let Err(e) = write_report(&forged_line(self.calls.made())) {
            eprintln!("{NAME}: the forged report could not be written: {e}");
        }
    }
}
