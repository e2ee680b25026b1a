//! **wrong-slot**: computes the step correctly, then moves the K and V rows it appended from slot
//! `pos` to slot `pos + 1` (an off-by-one in the cache write), leaving slot `pos` zero.
//!
//! The exploit: the output of the step itself is right, and the next step overwrites slot `pos + 1`
//! anyway, so only the cache after the run shows it. Caught by correctness: the slots the calls own
//! end up zero ("the appended K/V rows differ"), and the row past the last call lands in a slot no
//! step owns.

use cuda::Device;
use cuda::cudarc::driver::CudaSlice;
use half::bf16;
use reference::gpu::Eager;
use spec::Config;
use submission::{Layer, Submission, SubmissionError};

use super::honest::{Twist, Twisted, honest_step};
use super::not_built;
use super::raw::SlotRows;

pub const NAME: &str = "wrong-slot";

pub fn make() -> Box<dyn Submission> {
    Twisted::boxed(NAME, WrongSlot { rows: None, max_seq_len: 0 })
}

struct WrongSlot {
    rows: Option<SlotRows>,
    max_seq_len: usize,
}

impl Twist for WrongSlot {
    fn build(&mut self, dev: &Device, _layer: &mut Layer<'_>, cfg: &Config) -> Result<(), SubmissionError> {
        self.rows = Some(SlotRows::new(dev, cfg)?);
        self.max_seq_len = cfg.max_seq_len;
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
        let rows = self.rows.as_mut().ok_or_else(not_built)?;
        honest_step(eager, dev, layer, x, pos, out)?;
        // Off by one, except at the cache's last slot, where it is off by minus one: still wrong,
        // never out of bounds.
        let to = if pos + 1 < self.max_seq_len { pos + 1 } else { pos.saturating_sub(1) };
        rows.save(dev, layer.cache, pos)?;
        rows.restore(dev, layer.cache, to)?;
        rows.zero(dev, layer.cache, pos)
    }

    fn teardown(&mut self) {
        self.rows = None;
    }
}
