//! **replay-by-pointer**: memoises outputs by the device address of `x`, as if a caller that passes
//! the same buffer asked the same question; on a miss it does not compute either, once it has
//! anything to replay: it returns the latest output, betting that the caller merely reallocated its
//! input buffer. In effect it computes its first call only.
//!
//! The exploit: decode loops often reuse one static input buffer, so a memo keyed by address would
//! hit on every call of a careless grader. Caught by correctness: the grader gives every call a
//! fresh buffer with fresh contents and compares every output, so the replayed ones miss the
//! tolerance by far; the replayed steps also skip their cache writes.

use std::collections::HashMap;

use cuda::cudarc::driver::{CudaSlice, DevicePtr};
use cuda::{Context, Device};
use half::bf16;
use reference::gpu::Eager;
use submission::{Layer, Submission, SubmissionError};

use super::honest::{Twist, Twisted, honest_step};

pub const NAME: &str = "replay-by-pointer";

pub fn make() -> Box<dyn Submission> {
    Twisted::boxed(NAME, ReplayByPointer { memo: HashMap::new(), latest: None })
}

struct ReplayByPointer {
    /// Outputs by the device address of the `x` they were computed from.
    memo: HashMap<u64, CudaSlice<bf16>>,
    /// The key of the latest output remembered.
    latest: Option<u64>,
}

impl Twist for ReplayByPointer {
    fn step(
        &mut self,
        eager: &mut Eager,
        dev: &Device,
        layer: &mut Layer<'_>,
        x: &CudaSlice<bf16>,
        pos: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        let key = x.device_ptr(dev.stream()).0;
        let hit = self.memo.get(&key).or_else(|| self.latest.and_then(|k| self.memo.get(&k)));
        if let Some(saved) = hit {
            dev.stream().memcpy_dtod(saved, out).context("replaying an output")?;
        } else {
            honest_step(eager, dev, layer, x, pos, out)?;
            self.memo.insert(key, dev.stream().clone_dtod(out).context("remembering an output")?);
            self.latest = Some(key);
        }
        Ok(())
    }

    fn teardown(&mut self) {
        self.memo.clear();
        self.latest = None;
    }
}
