//! The run's data on the GPU, generated there from the seed by `kernels/reference/rng.cu` with the recipe of
//! `spec::data`, so it equals the CPU's bitwise (checked by `grader selftest`).

use crate::kernels::RNG;
use cuda::cudarc::driver::{CudaSlice, DeviceRepr, PushKernelArg};
use cuda::{Context, CudaError, Device, grid_1d};
use half::bf16;
use spec::Config;
use spec::data::{
    ANCHOR_KEY_STD, Axis, INPUT_STREAM_BASE, LayerWeights, MASSIVE_SPREAD, Tensor, anchor_key, massive_channels,
};
use spec::rng::{scale_for_std, stream_key};

/// Threads per block of the fill kernels.
const FILL_BLOCK: u32 = 256;

/// One layer's weights on the GPU, row-major bf16 as `spec::Tensor::shape` says.
pub type DeviceWeights = LayerWeights<CudaSlice<bf16>>;

/// The KV cache on the GPU: `(batch, n_kv, max_seq_len, hd)` bf16 each.
pub struct DeviceCache {
    pub k: CudaSlice<bf16>,
    pub v: CudaSlice<bf16>,
}

/// `Classes` of `kernels/reference/rng.cu`: the mean and scale of each class of element.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct Classes {
    mean: [f32; 4],
    scale: [f32; 4],
}

// SAFETY: a plain #[repr(C)] struct of f32 arrays, laid out as the kernel's `Classes`.
unsafe impl DeviceRepr for Classes {}

/// Generates every weight from `seed` on the GPU.
pub fn generate_weights(dev: &Device, cfg: &Config, seed: u64) -> Result<DeviceWeights, CudaError> {
    DeviceWeights::try_from_fn(|t| {
        let ((_, cols), layout) = (t.matrix(cfg), t.layout());
        let classes = t.classes(cfg);
        let classes = Classes { mean: classes.map(|c| c.0), scale: classes.map(|c| c.1) };
        fill_weight(
            dev,
            t.elems(cfg),
            cols,
            stream_key(seed, t.stream()),
            [layout.rows, layout.cols].map(|side| side.map(|s| s.0)),
            classes,
        )
    })
}

/// `n` elements of `mean + normal * std` (std folded into `scale`), generated on the GPU.
pub fn fill_normal(dev: &Device, n: usize, key: u64, mean: f32, scale: f32) -> Result<CudaSlice<bf16>, CudaError> {
    fill_weight(dev, n, n.max(1), key, [None, None], Classes { mean: [mean; 4], scale: [scale; 4] })
}

/// An `(n / cols, cols)` matrix whose outlier rows and columns are those of the axes `outliers`
/// (rows, columns; none where `None`), each element drawn with its class's mean and scale.
fn fill_weight(
    dev: &Device,
    n: usize,
    cols: usize,
    key: u64,
    outliers: [Option<Axis>; 2],
    classes: Classes,
) -> Result<CudaSlice<bf16>, CudaError> {
    // SAFETY: the kernel writes all n elements before anything reads them.
    let mut out = unsafe { dev.stream().alloc::<bf16>(n) }.context("allocating a tensor")?;
    let f = dev.function(&RNG, "fill_weight_bf16")?;
    let (n64, cols64) = (n as u64, cols as u64);
    let [row_key, col_key] = outliers.map(|a| a.map_or(0, Axis::key));
    let [rows_on, cols_on] = outliers.map(|a| u32::from(a.is_some()));
    let mut b = dev.stream().launch_builder(&f);
    b.arg(&mut out).arg(&n64).arg(&cols64).arg(&key).arg(&row_key).arg(&col_key);
    b.arg(&rows_on).arg(&cols_on).arg(&classes);
    // SAFETY: arguments match fill_weight_bf16(out, n, cols, key, row_key, col_key, outlier_rows,
    // outlier_cols, classes); out holds n elements.
    unsafe { b.launch(grid_1d(n, FILL_BLOCK, dev.facts().sms)) }.context("launching fill_weight_bf16")?;
    Ok(out)
}

impl DeviceCache {
    /// Generates the KV prefix from `seed` (anchors included); slots from `prefill` on are zero.
    pub fn generate(dev: &Device, cfg: &Config, seed: u64) -> Result<Self, CudaError> {
        let fill = |t: Tensor, anchor_std: f64| -> Result<CudaSlice<bf16>, CudaError> {
            let n = t.elems(cfg);
            // SAFETY: the kernel writes all n elements before anything reads them.
            let mut out = unsafe { dev.stream().alloc::<bf16>(n) }.context("allocating the KV cache")?;
            let f = dev.function(&RNG, "fill_cache_bf16")?;
            let (n64, n_kv, msl, hd, pre) =
                (n as u64, cfg.n_kv as u32, cfg.max_seq_len as u32, cfg.hd as u32, cfg.prefill as u32);
            let (key, anchors) = (stream_key(seed, t.stream()), anchor_key(seed));
            let (scale, anchor) = (t.dist(cfg).scale(), scale_for_std(anchor_std));
            let mut b = dev.stream().launch_builder(&f);
            b.arg(&mut out).arg(&n64).arg(&n_kv).arg(&msl).arg(&hd).arg(&pre);
            b.arg(&key).arg(&anchors).arg(&scale).arg(&anchor);
            // SAFETY: arguments match fill_cache_bf16(out, n, n_kv, max_seq_len, hd, prefill, key,
            // anchor_key, scale, anchor_scale); out holds n elements.
            unsafe { b.launch(grid_1d(n, FILL_BLOCK, dev.facts().sms)) }.context("launching fill_cache_bf16")?;
            Ok(out)
        };
        let v_std = Tensor::VCache.dist(cfg).std;
        Ok(Self { k: fill(Tensor::KCache, ANCHOR_KEY_STD)?, v: fill(Tensor::VCache, v_std)? })
    }
}

/// The input `x` of call `call` of a run, `(batch, d)`, as `spec::data::input` draws it.
pub fn generate_input(dev: &Device, cfg: &Config, input_seed: u64, call: usize) -> Result<CudaSlice<bf16>, CudaError> {
    let n = cfg.batch * cfg.d;
    let key = stream_key(input_seed, INPUT_STREAM_BASE + call as u64);
    let magnitude = massive_channels(cfg).first().map_or(0.0, |c| c.1.abs());
    let (scale, massive_scale) = (scale_for_std(1.0), scale_for_std(MASSIVE_SPREAD * f64::from(magnitude)));
    // SAFETY: the kernel writes all n elements before anything reads them.
    let mut out = unsafe { dev.stream().alloc::<bf16>(n) }.context("allocating an input")?;
    let f = dev.function(&RNG, "fill_input_bf16")?;
    let (n64, d, model_key) = (n as u64, cfg.d as u64, Axis::Model.key());
    let mut b = dev.stream().launch_builder(&f);
    b.arg(&mut out).arg(&n64).arg(&d).arg(&key).arg(&scale).arg(&model_key).arg(&magnitude).arg(&massive_scale);
    // SAFETY: arguments match fill_input_bf16(out, n, d, key, scale, model_key, magnitude,
    // massive_scale); out holds n elements.
    unsafe { b.launch(grid_1d(n, FILL_BLOCK, dev.facts().sms)) }.context("launching fill_input_bf16")?;
    Ok(out)
}

/// Device memory the run's data needs: weights, cache, and the per-call inputs and outputs.
pub fn bytes_needed(cfg: &Config, calls: usize) -> u64 {
    spec::bytes::data_bytes(cfg, calls).expect("a validated config's data fits in 64-bit byte counts")
}

#[cfg(test)]
mod tests {
    /// The CUDA fill mirrors spec's constants: the two sides must never drift.
    #[test]
    fn fill_constants_mirror_spec() {
        let cu = include_str!("../../../kernels/reference/rng.cu");
        let cuh = include_str!("../../../kernels/reference/rng.cuh");
        for (name, value) in [
            ("OUTLIER_SPACING", spec::data::OUTLIER_SPACING),
            ("ANCHOR_SPACING", spec::data::ANCHOR_SPACING),
            ("MASSIVE_CHANNELS", spec::data::MASSIVE_CHANNELS),
        ] {
            let line = format!("constexpr uint64_t {name} = {value};");
            assert!(cu.contains(&line), "kernels/reference/rng.cu must define {line}");
        }
        let mean = format!("IRWIN_HALL_MEAN = {};", spec::rng::IRWIN_HALL_MEAN);
        assert!(cuh.contains(&mean), "kernels/reference/rng.cuh must define {mean}");
        let golden = format!("GOLDEN = 0x{:X}ull;", spec::rng::GOLDEN);
        assert!(cuh.contains(&golden), "kernels/reference/rng.cuh must define {golden}");
    }
}
