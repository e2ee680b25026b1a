//! **int8-rows-down**, **int8-groups-gate** and **fp8-up**: the eager layer with one MLP matrix stored
//! in a cheaper format (int8 with a scale per row, int8 with a scale per group of 128 columns, fp8
//! e4m3 with a scale per row), which would cut that matrix's bytes, and the step time, by half.
//!
//! The exploit: with weights drawn from one smooth distribution, int8 keeps about 7 bits of every
//! value and fp8 3, and either passes a relative tolerance. Caught by correctness: the data's outlier
//! channels put entries many times larger than the rest in every row of the MLP matrices, so an int8
//! scale fitted to them rounds the other entries of the row (or of the group) to a few steps, and the
//! MLP carries most of the output, so even fp8's uniform 3-bit rounding shows. `build_layer` fakes the
//! format on the host: the matrix is quantised, dequantised back to bf16 and used in place of the
//! original (a copy; the read-only weights are not touched).

use cuda::cudarc::driver::CudaSlice;
use cuda::{Context, Device};
use half::bf16;
use reference::gpu::{DeviceWeights, Eager};
use spec::{Config, Tensor};
use submission::{Layer, Submission, SubmissionError};

use super::honest::{Twist, Twisted};
use super::not_built;
use super::quantize::{Scheme, fake_quantize};

pub const INT8_ROWS_DOWN: &str = "int8-rows-down";
pub const INT8_GROUPS_GATE: &str = "int8-groups-gate";
pub const FP8_UP: &str = "fp8-up";

/// Columns per group of [`INT8_GROUPS_GATE`]'s scales.
const GROUP: usize = 128;

pub fn make_int8_rows_down() -> Box<dyn Submission> {
    Twisted::boxed(INT8_ROWS_DOWN, Lossy::new(Tensor::Wdown, Scheme::Int8 { group: None }))
}

pub fn make_int8_groups_gate() -> Box<dyn Submission> {
    Twisted::boxed(INT8_GROUPS_GATE, Lossy::new(Tensor::Wgate, Scheme::Int8 { group: Some(GROUP) }))
}

pub fn make_fp8_up() -> Box<dyn Submission> {
    Twisted::boxed(FP8_UP, Lossy::new(Tensor::Wup, Scheme::Fp8 { per_row: true }))
}

/// The eager step on a copy of the weights whose `tensor` went through `scheme`.
struct Lossy {
    tensor: Tensor,
    scheme: Scheme,
    weights: Option<DeviceWeights>,
}

impl Lossy {
    fn new(tensor: Tensor, scheme: Scheme) -> Self {
        Self { tensor, scheme, weights: None }
    }
}

impl Twist for Lossy {
    fn build(&mut self, dev: &Device, layer: &mut Layer<'_>, cfg: &Config) -> Result<(), SubmissionError> {
        let s = dev.stream();
        let original = s.clone_dtoh(layer.weights.get(self.tensor)).context("reading a weight")?;
        let lossy = fake_quantize(&original, self.tensor.matrix(cfg).1, self.scheme);
        let weights = DeviceWeights::try_from_fn(|t| -> Result<CudaSlice<bf16>, SubmissionError> {
            Ok(if t == self.tensor {
                s.clone_htod(&lossy).context("uploading the lossy weight")?
            } else {
                s.clone_dtod(layer.weights.get(t)).context("copying a weight")?
            })
        })?;
        self.weights = Some(weights);
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
        let weights = self.weights.as_ref().ok_or_else(not_built)?;
        Ok(eager.step(dev, weights, layer.cache, x, pos, out)?)
    }

    fn teardown(&mut self) {
        self.weights = None;
    }
}
