//! The run's data on the GPU, generated there from the seed by `kernels/rng.cu` with the recipe of
//! `spec::data`, so it equals the CPU's bitwise (checked by `grader selftest`).

use cuda::cudarc::driver::{CudaSlice, PushKernelArg};
use cuda::kernels::RNG;
use cuda::{Context, CudaError, Device, grid_1d};
use half::bf16;
use spec::Config;
use spec::data::{ANCHOR_KEY_STD, INPUT_STREAM_BASE, LayerWeights, Tensor, anchor_positions};
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

/// Generates every weight from `seed` on the GPU.
pub fn generate_weights(dev: &Device, cfg: &Config, seed: u64) -> Result<DeviceWeights, CudaError> {
    DeviceWeights::try_from_fn(|t| {
        fill_normal(dev, t.elems(cfg), stream_key(seed, t.stream()), t.dist(cfg).mean, t.dist(cfg).scale())
    })
}

impl DeviceCache {
    /// Generates the KV prefix from `seed` (anchors included); slots from `prefill` on are zero.
    pub fn generate(dev: &Device, cfg: &Config, seed: u64) -> Result<Self, CudaError> {
        let anchors = anchor_positions(cfg, seed);
        let anchors = dev.stream().clone_htod(&anchors).context("uploading anchor positions")?;
        let fill = |t: Tensor, anchor_std: f64| -> Result<CudaSlice<bf16>, CudaError> {
            let n = t.elems(cfg);
            // SAFETY: the kernel writes all n elements before anything reads them.
            let mut out = unsafe { dev.stream().alloc::<bf16>(n) }.context("allocating the KV cache")?;
            let f = dev.function(&RNG, "fill_cache_bf16")?;
            let (n64, n_kv, msl, hd, pre) =
                (n as u64, cfg.n_kv as u32, cfg.max_seq_len as u32, cfg.hd as u32, cfg.prefill as u32);
            let (key, scale, anchor) = (stream_key(seed, t.stream()), t.dist(cfg).scale(), scale_for_std(anchor_std));
            let mut b = dev.stream().launch_builder(&f);
            b.arg(&mut out).arg(&anchors).arg(&n64).arg(&n_kv).arg(&msl).arg(&hd).arg(&pre);
            b.arg(&key).arg(&scale).arg(&anchor);
            // SAFETY: arguments match fill_cache_bf16(out, anchors, n, n_kv, max_seq_len, hd, prefill, key, scale, anchor_scale).
            unsafe { b.launch(grid_1d(n, FILL_BLOCK, dev.facts().sms)) }.context("launching fill_cache_bf16")?;
            Ok(out)
        };
        let v_std = Tensor::VCache.dist(cfg).std;
        Ok(Self { k: fill(Tensor::KCache, ANCHOR_KEY_STD)?, v: fill(Tensor::VCache, v_std)? })
    }
}

/// The input `x` of call `call` of a run, `(batch, d)`, as `spec::data::input` draws it.
pub fn generate_input(dev: &Device, cfg: &Config, input_seed: u64, call: usize) -> Result<CudaSlice<bf16>, CudaError> {
    let key = stream_key(input_seed, INPUT_STREAM_BASE + call as u64);
    fill_normal(dev, cfg.batch * cfg.d, key, 0.0, scale_for_std(1.0))
}

/// `n` elements of `mean + normal * std` (std folded into `scale`), generated on the GPU.
pub fn fill_normal(dev: &Device, n: usize, key: u64, mean: f32, scale: f32) -> Result<CudaSlice<bf16>, CudaError> {
    // SAFETY: the kernel writes all n elements before anything reads them.
    let mut out = unsafe { dev.stream().alloc::<bf16>(n) }.context("allocating a tensor")?;
    let f = dev.function(&RNG, "fill_normal_bf16")?;
    let n64 = n as u64;
    let mut b = dev.stream().launch_builder(&f);
    b.arg(&mut out).arg(&n64).arg(&key).arg(&mean).arg(&scale);
    // SAFETY: arguments match fill_normal_bf16(out, n, key, mean, scale).
    unsafe { b.launch(grid_1d(n, FILL_BLOCK, dev.facts().sms)) }.context("launching fill_normal_bf16")?;
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
        let cu = include_str!("../../../kernels/rng.cu");
        let cuh = include_str!("../../../kernels/rng.cuh");
        let anchors = format!("ANCHORS_PER_HEAD = {};", spec::data::ANCHORS_PER_HEAD);
        assert!(cu.contains(&anchors), "kernels/rng.cu must define {anchors}");
        let mean = format!("IRWIN_HALL_MEAN = {};", spec::rng::IRWIN_HALL_MEAN);
        assert!(cuh.contains(&mean), "kernels/rng.cuh must define {mean}");
        let golden = format!("GOLDEN = 0x{:X}ull;", spec::rng::GOLDEN);
        assert!(cuh.contains(&golden), "kernels/rng.cuh must define {golden}");
    }
}
