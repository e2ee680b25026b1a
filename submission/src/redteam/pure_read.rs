//! **pure-read**: computes nothing. Each step is one kernel (`read_layer_u4`) that reads every weight
//! and the attended K and V rows once, with the very loop of the grader's read-only bandwidth
//! measurement (`kernels/stream.cuh`, shared with `read_u4`), and copies `x` to `out`.
//!
//! It is the calibration of the plausible_timing bound: the fastest a step that reads its bytes can
//! be, so its time must sit just above the bound (the bytes over the read-only bandwidth measured in
//! the same run, less the stated margin), never under it; the grader's selftest also reads its x-floor
//! figure. Its bytes_read is the byte model's, less the K/V rows it never writes. Caught by
//! correctness: `x_out = x` is over the tolerance at every step, as for pass-through.

use cuda::cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use cuda::kernels::REDTEAM;
use cuda::{Context, Device};
use half::bf16;
use spec::{Config, Tensor};

use super::not_built;
use crate::{Layer, Submission, SubmissionError};

pub const NAME: &str = "pure-read";
/// The kernel of `kernels/redteam.cu`.
pub const KERNEL: &str = "read_layer_u4";

/// Threads per block, as the bandwidth measurement's read-only stream.
const BLOCK: u32 = 512;
/// bf16 per 16-byte vector.
const VEC: usize = 8;

pub fn make() -> Box<dyn Submission> {
    Box::new(PureRead { built: None })
}

/// 16-byte vectors of each weight in [`Tensor::WEIGHTS`] order; `None` if one is not whole vectors.
fn weight_vectors(cfg: &Config) -> Option<Vec<u64>> {
    Tensor::WEIGHTS.iter().map(|t| t.elems(cfg)).map(|n| n.is_multiple_of(VEC).then_some((n / VEC) as u64)).collect()
}

/// 16-byte vectors of each KV head's K (and V) rows a step at `pos` attends over: slots `0..=pos`.
fn attended_vectors(cfg: &Config, pos: usize) -> u64 {
    ((pos + 1) * cfg.hd / VEC) as u64
}

struct Built {
    func: CudaFunction,
    /// One wave of resident blocks of [`BLOCK`] threads, as the bandwidth measurement launches.
    launch: LaunchConfig,
    /// `(blocks)`: where the kernel folds what it read.
    sink: CudaSlice<u32>,
    /// `(weights)`: each weight's device address.
    bases: CudaSlice<u64>,
    /// `(weights)`: each weight's length in 16-byte vectors.
    lens: CudaSlice<u64>,
    n_weights: u32,
    n_kv: u32,
    /// 16-byte vectors of one KV head's block of a cache tensor, `max_seq_len * hd / 8`.
    head_vecs: u64,
    /// 16-byte vectors of `x`.
    x_vecs: u32,
    cfg: Config,
}

struct PureRead {
    built: Option<Built>,
}

impl Submission for PureRead {
    fn name(&self) -> &str {
        NAME
    }

    fn build_layer(&mut self, dev: &Device, layer: Layer<'_>, cfg: &Config) -> Result<(), SubmissionError> {
        let lens = weight_vectors(cfg).filter(|_| cfg.hd.is_multiple_of(VEC) && cfg.d.is_multiple_of(VEC));
        let lens = lens.ok_or_else(|| SubmissionError::Refused("a tensor is not whole 16-byte vectors".into()))?;
        let s = dev.stream();
        let bases: Vec<u64> = Tensor::WEIGHTS.iter().map(|&t| layer.weights.get(t).device_ptr(s).0).collect();
        let func = dev.function(&REDTEAM, KERNEL)?;
        let resident =
            func.occupancy_max_active_blocks_per_multiprocessor(BLOCK, 0, None).context("reading occupancy")?;
        let blocks = resident.max(1) * dev.facts().sms as u32;
        let launch = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        self.built = Some(Built {
            func,
            launch,
            sink: s.alloc_zeros(blocks as usize).context("allocating the sink")?,
            bases: s.clone_htod(&bases).context("uploading the weights' addresses")?,
            lens: s.clone_htod(&lens).context("uploading the weights' lengths")?,
            n_weights: Tensor::WEIGHTS.len() as u32,
            n_kv: cfg.n_kv as u32,
            head_vecs: (cfg.max_seq_len * cfg.hd / VEC) as u64,
            x_vecs: (cfg.d / VEC) as u32,
            cfg: cfg.clone(),
        });
        Ok(())
    }

    fn layer_step(
        &mut self,
        dev: &Device,
        layer: Layer<'_>,
        x: &CudaSlice<bf16>,
        pos: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        let b = self.built.as_mut().ok_or_else(not_built)?;
        let attended = attended_vectors(&b.cfg, pos);
        assert!(pos < b.cfg.max_seq_len && x.len() == b.cfg.d && out.len() == b.cfg.d, "pure-read: a bad call");
        let mut args = dev.stream().launch_builder(&b.func);
        args.arg(&mut b.sink).arg(&b.bases).arg(&b.lens).arg(&b.n_weights);
        args.arg(&layer.cache.k).arg(&layer.cache.v).arg(&b.n_kv).arg(&b.head_vecs).arg(&attended);
        args.arg(out).arg(x).arg(&b.x_vecs);
        // SAFETY: read_layer_u4(sink (blocks), weights (n_weights), weight_vecs (n_weights), n_weights:
        // u32, k_cache, v_cache (n_kv, head_vecs), n_kv: u32, head_vecs: u64, attended_vecs: u64,
        // out (x_vecs), x (x_vecs), x_vecs: u32), in that order. The table holds the base and the
        // whole-vector length of every live weight; each cache tensor is n_kv blocks of head_vecs and
        // attended_vecs <= head_vecs as pos < max_seq_len; x and out hold d = 8 * x_vecs bf16; every
        // buffer is an allocation's base, so the 16-byte accesses are aligned.
        unsafe { args.launch(b.launch) }.context("launching read_layer_u4")?;
        Ok(())
    }

    fn teardown(&mut self) {
        self.built = None;
    }
}

#[cfg(test)]
mod tests {
    use spec::ByteModel;

    use super::*;

    /// The kernel reads what the byte model counts: every weight, the K and V rows up to the deepest
    /// timed position, `x`, and writes `out`; only the appended K/V rows are missing.
    #[test]
    fn a_step_reads_the_byte_model() {
        for cfg in [Config::tiny(), Config::small(), Config::graded()] {
            let model = ByteModel::of(&cfg);
            let weights: u64 = weight_vectors(&cfg).unwrap().iter().sum();
            let kv = 2 * cfg.n_kv as u64 * attended_vectors(&cfg, cfg.deepest_timed_pos());
            let x_and_out = 2 * (cfg.d / VEC) as u64;
            assert_eq!(16 * (weights + kv + x_and_out), model.total - model.kv_append, "{}", cfg.name);
        }
    }
}
