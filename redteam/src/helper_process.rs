//! **helper-process**: the megakernel, honest and fast, plus a helper process started in `build_layer`
//! that holds a GPU context of its own for the whole run: the binary running this submission (the
//! grader itself, in a `grader run`) measuring bandwidth, `grader bandwidth` with [`HELPER_ARGS`].
//! `build_layer` returns only once the helper holds the GPU (its first buffer shows in the device's
//! free memory); teardown, or dropping the submission, kills and reaps it.
//!
//! The exploit: work done by another process escapes every in-process measurement (CUPTI records,
//! hardware counters of the runner's context); a helper could compute the layer, or keep weights
//! warm, while the runner's own calls look small. Caught by the judge's watch of the device, outside
//! the submission's reach: NVML lists the helper among the processes holding the GPU, and
//! exclusive_gpu fails ("other process(es) held the GPU").

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cuda::{Context, Device};
use spec::Config;
use submission::{Layer, Submission, SubmissionError};

use super::honest::{Extra, WithExtra};

pub const NAME: &str = "helper-process";

/// The helper's command after the binary (its `--device` follows): a bandwidth measurement over
/// 1 GiB buffers with the most repetitions the command accepts, tens of seconds of GPU work, far
/// longer than a run of the red team's config; its report goes to stderr, which is discarded.
const HELPER_ARGS: [&str; 5] = ["bandwidth", "--gib", "1", "--reps", "10000"];
/// The helper's first buffer, 1 GiB as `--gib` says: once the device's free memory has dropped by that
/// much, the helper holds a context.
const HELPER_BUFFER_BYTES: usize = 1 << 30;
/// How long `build_layer` waits for the helper to hold the GPU (starting a CUDA process takes about a
/// second), well inside the grader's limit on `build_layer`.
const START_LIMIT: Duration = Duration::from_secs(60);
/// The pause between two looks at the device's free memory.
const LOOK_INTERVAL: Duration = Duration::from_millis(10);

pub fn make() -> Box<dyn Submission> {
    WithExtra::boxed(NAME, HelperProcess { helper: None })
}

/// The helper process; dropping it kills and reaps it.
struct Helper {
    child: Child,
}

impl Helper {
    /// Starts the helper on `dev`'s device and waits until it holds the GPU.
    fn start(dev: &Device) -> Result<Helper, SubmissionError> {
        let refused = |what: &str, e: std::io::Error| SubmissionError::Refused(format!("{what}: {e}"));
        let exe = std::env::current_exe().map_err(|e| refused("finding the running binary", e))?;
        let (free_before, _) = dev.ctx().mem_get_info().context("reading free memory")?;
        let child = Command::new(exe)
            .args(HELPER_ARGS)
            .args(["--device", &dev.facts().ordinal.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| refused("starting the helper", e))?;
        let mut helper = Helper { child };
        let start = Instant::now();
        loop {
            if let Some(status) = helper.child.try_wait().map_err(|e| refused("watching the helper", e))? {
                return Err(SubmissionError::Refused(format!("the helper ended ({status}) before it held the GPU")));
            }
            let (free, _) = dev.ctx().mem_get_info().context("reading free memory")?;
            if free_before.saturating_sub(free) >= HELPER_BUFFER_BYTES {
                return Ok(helper);
            }
            if start.elapsed() > START_LIMIT {
                return Err(SubmissionError::Refused(format!(
                    "the helper did not take the GPU within {} s",
                    START_LIMIT.as_secs()
                )));
            }
            std::thread::sleep(LOOK_INTERVAL);
        }
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        // Already gone is fine; the wait reaps it either way.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct HelperProcess {
    helper: Option<Helper>,
}

impl Extra for HelperProcess {
    fn build(&mut self, dev: &Device, _layer: &Layer<'_>, _cfg: &Config) -> Result<(), SubmissionError> {
        // After the megakernel's allocations have settled, so that the drop in free memory is the
        // helper's alone.
        dev.synchronize()?;
        self.helper = Some(Helper::start(dev)?);
        Ok(())
    }

    fn teardown(&mut self) {
        self.helper = None;
    }
}
