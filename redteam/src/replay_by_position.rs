//! **replay-by-position**: remembers its output for each position the first time it computes it, and
//! replays it (one copy, no computation) whenever that position comes again.
//!
//! The exploit: a grader that times the same positions it checked earlier (the grader's phases all
//! restart at `prefill`) could be served stale answers at no cost. Caught by correctness: every call
//! gets a fresh `x`, and every output is compared, so the replayed ones miss the tolerance by far;
//! the replayed steps also skip their cache writes.

use std::collections::HashMap;

use cuda::cudarc::driver::CudaSlice;
use cuda::{Context, Device};
use half::bf16;
use reference::gpu::Eager;
use submission::{Layer, Submission, SubmissionError};

use super::honest::{Twist, Twisted, honest_step};

pub const NAME: &str = "replay-by-position";

pub fn make() -> Box<dyn Submission> {
    Twisted::boxed(NAME, ReplayByPosition { memo: HashMap::new() })
}

struct ReplayByPosition {
    /// The first output computed at each position.
    memo: HashMap<usize, CudaSlice<bf16>>,
}

impl Twist for ReplayByPosition {
    fn step(
        &mut self,
        eager: &mut Eager,
        dev: &Device,
        layer: &mut Layer<'_>,
        x: &CudaSlice<bf16>,
        pos: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        if let Some(saved) = self.memo.get(&pos) {
            dev.stream().memcpy_dtod(saved, out).context("replaying an output")?;
        } else {
            honest_step(eager, dev, layer, x, pos, out)?;
            self.memo.insert(pos, dev.stream().clone_dtod(out).context("remembering an output")?);
        }
        Ok(())
    }

    fn teardown(&mut self) {
        self.memo.clear();
    }
}
