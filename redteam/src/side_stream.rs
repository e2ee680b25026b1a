//! **side-stream**: the megakernel, honest and fast, plus extra GPU work every step on a stream of
//! its own that it never joins back: a 4 GiB device-to-device copy (about 2 ms at H200 bandwidth).
//!
//! The exploit: a grader that times a step with events on its own stream, or synchronises only that
//! stream, sees the step end when the megakernel does, while work the step enqueued elsewhere is
//! still running (and could be the real work). Caught by the timing itself: the grader synchronises
//! the whole device before and after every timed step, so the copy is inside the measured time. The
//! side work is a copy rather than a spinning kernel so that the launch gates still pass (CUPTI
//! counts memcpys apart from kernels): nothing fails, but every step takes at least
//! [`MIN_STEP_US`].

use std::sync::Arc;

use cuda::cudarc::driver::{CudaSlice, CudaStream};
use cuda::{Context, Device};
use spec::Config;
use submission::{Layer, Submission, SubmissionError};

use super::honest::{Extra, WithExtra};
use super::not_built;

pub const NAME: &str = "side-stream";

/// Bytes of the hidden copy: 4 GiB read and 4 GiB written, 8.6 GB of traffic, about 2.0 ms at the
/// 4.2 TB/s an H200 copies at, and more while the megakernel competes for the same bandwidth.
const COPY_BYTES: usize = 4 << 30;

/// The least time a step can take with the copy inside it, with a quarter of margin under 2.0 ms.
pub const MIN_STEP_US: f64 = 1500.0;

pub fn make() -> Box<dyn Submission> {
    WithExtra::boxed(NAME, SideStream { side: None })
}

/// The stream the grader never hears of, and the copy's buffers.
struct Side {
    stream: Arc<CudaStream>,
    src: CudaSlice<u8>,
    dst: CudaSlice<u8>,
}

struct SideStream {
    side: Option<Side>,
}

impl Extra for SideStream {
    fn build(&mut self, dev: &Device, _layer: &Layer<'_>, _cfg: &Config) -> Result<(), SubmissionError> {
        // A non-blocking stream: nothing on the device's stream waits for it, nor it for that.
        let stream = dev.ctx().new_stream().context("creating the side stream")?;
        let src = stream.alloc_zeros::<u8>(COPY_BYTES).context("allocating the side copy's source")?;
        let dst = stream.alloc_zeros::<u8>(COPY_BYTES).context("allocating the side copy's destination")?;
        self.side = Some(Side { stream, src, dst });
        Ok(())
    }

    fn after_step(&mut self, _dev: &Device) -> Result<(), SubmissionError> {
        let side = self.side.as_mut().ok_or_else(not_built)?;
        side.stream.memcpy_dtod(&side.src, &mut side.dst).context("the hidden copy")?;
        Ok(())
    }

    fn teardown(&mut self) {
        if let Some(side) = self.side.take() {
            // Teardown cannot fail: a failed wait leaves the buffers to be freed in stream order.
            let _ = side.stream.synchronize();
        }
    }
}
