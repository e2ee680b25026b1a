//! **batcher**: the eager reference until the back-to-back phase; at that phase's first call it
//! computes every call of the phase's first attempt at once, and does nothing in the later ones.
//! Like any batched layer it first gathers its batch's inputs (that is what would let it read each
//! weight once for the whole batch): this call's `x`, then, for each later call, the buffer its
//! input will be in, the previous call's output buffer (`k - 1` strides after this call's `out` for
//! the `k`-th, see [`region`](super::region)). Then it runs the rows one by one with the eager
//! reference, writing each call's output into its buffer (`k` strides after `out`) and its cache
//! slot.
//!
//! The exploit: batching the calls of a phase amortises the weights over many tokens, which no
//! batch-1 decode may do. Caught by correctness: in the back-to-back phase each input is the previous
//! call's output, which does not exist yet when the batch is gathered, so every row but the first
//! is the judge's NaN poison and so is its output ("returned NaN or Inf"). The later calls also
//! launch no kernel.

use cuda::cudarc::driver::CudaSlice;
use cuda::{Context, Device};
use half::bf16;
use reference::gpu::Eager;
use spec::Config;
use submission::{Layer, Submission, SubmissionError};

use super::honest::{Twist, Twisted, honest_step};
use super::region::{buffer_after, buffer_stride};
use super::{CallCount, not_built};

pub const NAME: &str = "batcher";

pub fn make() -> Box<dyn Submission> {
    Twisted::boxed(NAME, Batcher { calls: CallCount::default(), batch: None })
}

struct Batch {
    /// The index in the run of the back-to-back phase's first call.
    first: usize,
    /// Each of its calls' position.
    positions: Vec<usize>,
    stride: usize,
    /// One `(d)` row per call of the phase: the gathered inputs.
    rows: Vec<CudaSlice<bf16>>,
}

impl Batch {
    /// Gathers every input of the phase, then computes every call of it; `x` and `out` are its first
    /// call's.
    fn run(
        &mut self,
        eager: &mut Eager,
        dev: &Device,
        layer: &mut Layer<'_>,
        x: &CudaSlice<bf16>,
        out: &CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        let s = dev.stream();
        for (k, row) in self.rows.iter_mut().enumerate() {
            if k == 0 {
                s.memcpy_dtod(x, row).context("gathering the batch's first input")?;
            } else {
                let input = buffer_after(dev, out, k - 1, self.stride)?;
                s.memcpy_dtod(&*input, row).context("gathering an input of the batch")?;
            }
        }
        for (k, (row, &pos)) in self.rows.iter().zip(&self.positions).enumerate() {
            let mut output = buffer_after(dev, out, k, self.stride)?;
            honest_step(eager, dev, layer, row, pos, &mut output)?;
        }
        Ok(())
    }
}

struct Batcher {
    calls: CallCount,
    batch: Option<Batch>,
}

impl Twist for Batcher {
    fn build(&mut self, dev: &Device, _layer: &mut Layer<'_>, cfg: &Config) -> Result<(), SubmissionError> {
        let calls = spec::schedule(cfg);
        let Some(attempt) = spec::back_to_back(&calls).into_iter().next() else {
            return Err(SubmissionError::Refused("the schedule has no back-to-back phase to batch".into()));
        };
        let phase = &calls[attempt];
        let first = &phase[0];
        let rows = (0..phase.len())
            .map(|_| dev.stream().alloc_zeros(cfg.batch * cfg.d).context("allocating a row of the batch"))
            .collect::<Result<_, _>>()?;
        self.batch = Some(Batch {
            first: first.index,
            positions: phase.iter().map(|c| c.pos).collect(),
            stride: buffer_stride(cfg),
            rows,
        });
        Ok(())
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
        let b = self.batch.as_mut().ok_or_else(not_built)?;
        let call = self.calls.next();
        if call < b.first {
            honest_step(eager, dev, layer, x, pos, out)
        } else if call == b.first {
            b.run(eager, dev, layer, x, out)
        } else {
            // Computed at the phase's first call; the later attempts are left undone.
            Ok(())
        }
    }

    fn teardown(&mut self) {
        self.batch = None;
    }
}
