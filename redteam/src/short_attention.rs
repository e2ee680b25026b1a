//! **skip-attention** and **recent-quarter**: the eager layer attending over fewer slots than the
//! whole cache (none, or the most recent quarter), which is most of the attention cost saved.
//!
//! The exploit: with a random cache, attention output is nearly an average of V and a truncated
//! attention would pass. Caught by correctness: the generated prefix holds anchor keys in its oldest
//! three quarters, whose scores stand a few units above the background, so most of the softmax mass
//! sits where these variants do not look and every step misses the tolerance.

use cuda::Device;
use cuda::cudarc::driver::CudaSlice;
use half::bf16;
use reference::gpu::Eager;
use reference::gpu::eager::AttentionSpan;
use submission::{Layer, Submission, SubmissionError};

use super::honest::{Twist, Twisted};

pub const SKIP: &str = "skip-attention";
pub const RECENT_QUARTER: &str = "recent-quarter";

pub fn make_skip() -> Box<dyn Submission> {
    Twisted::boxed(SKIP, ShortAttention(AttentionSpan::Skip))
}

pub fn make_recent_quarter() -> Box<dyn Submission> {
    Twisted::boxed(RECENT_QUARTER, ShortAttention(AttentionSpan::RecentQuarter))
}

/// The eager step over `span` instead of every cached slot.
struct ShortAttention(AttentionSpan);

impl Twist for ShortAttention {
    fn step(
        &mut self,
        eager: &mut Eager,
        dev: &Device,
        layer: &mut Layer<'_>,
        x: &CudaSlice<bf16>,
        pos: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        Ok(eager.step_with(dev, layer.weights, layer.cache, x, pos, out, self.0)?)
    }
}
