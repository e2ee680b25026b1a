//! After a run, from the judge's own mapping of the shared buffers: a submission's cache against the
//! reference's, and the read-only buffers (weights, inputs) against what the judge put there.

use cuda::cudarc::driver::{CudaSlice, PushKernelArg};
use cuda::{Context, CudaError, Device, grid_1d};
use half::bf16;
use spec::{Call, Config, Input};

use super::gates::CacheCheck;
use super::shared::SharedData;
use crate::kernels::VERIFY;
use crate::metrics::{rel_err, to_f32};

/// Threads per block of the comparison kernel.
const VERIFY_BLOCK: u32 = 256;

/// 16-byte vectors in which `a` and `b` differ, counted on the device.
pub fn vectors_differing(dev: &Device, a: &CudaSlice<bf16>, b: &CudaSlice<bf16>) -> Result<u64, CudaError> {
    assert_eq!(a.len(), b.len(), "compared buffers differ in length");
    assert_eq!(a.len() % 8, 0, "compared buffers are whole 16-byte vectors");
    let mut count = dev.stream().alloc_zeros::<u64>(1).context("allocating a counter")?;
    let f = dev.function(&VERIFY, "count_differences_u4")?;
    let n = (a.len() / 8) as u64;
    let mut b_ = dev.stream().launch_builder(&f);
    b_.arg(&mut count).arg(a).arg(b).arg(&n);
    // SAFETY: count_differences_u4(count (1), a (n), b (n), n): both buffers hold n 16-byte vectors.
    unsafe { b_.launch(grid_1d(n as usize, VERIFY_BLOCK, dev.facts().sms)) }
        .context("launching count_differences_u4")?;
    Ok(dev.stream().clone_dtoh(&count).context("reading the counter")?[0])
}

/// Each fresh input against what the judge handed over (a chained input is an earlier output, which
/// its own call's check covers). The weights are compared layer by layer in the replay.
pub fn inputs_changed(
    dev: &Device,
    shared: &SharedData,
    calls: &[Call],
    inputs: &[Vec<bf16>],
) -> Result<usize, CudaError> {
    let mut changed = 0;
    for c in calls.iter().filter(|c| c.input == Input::Fresh) {
        let now = dev.stream().clone_dtoh(&*shared.inputs[c.index]).context("reading a shared input")?;
        let same = now.iter().zip(&inputs[c.index]).all(|(a, b)| a.to_bits() == b.to_bits());
        changed += usize::from(!same);
    }
    Ok(changed)
}

/// The submission's cache against the reference's after the same calls, `(k, v)` on the host: the
/// prefix bitwise, the slots the calls wrote within the relative tolerance, the rest still zero.
pub fn cache(cfg: &Config, cache: (&[bf16], &[bf16]), reference: (&[bf16], &[bf16])) -> CacheCheck {
    let written = cfg.prefill..cfg.prefill + cfg.steps_per_phase_max();
    let mut check = CacheCheck { prefix_differing: 0, unused_differing: 0, written_rel_err: Some(0.0) };
    let (mut got, mut want) = (Vec::new(), Vec::new());
    for (mine, theirs) in [(cache.0, reference.0), (cache.1, reference.1)] {
        for (row, (m, t)) in mine.chunks(cfg.hd).zip(theirs.chunks(cfg.hd)).enumerate() {
            let slot = row % cfg.max_seq_len;
            if slot < cfg.prefill {
                check.prefix_differing += m.iter().zip(t).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            } else if written.contains(&slot) {
                got.extend(to_f32(m));
                want.extend(to_f32(t));
            } else {
                check.unused_differing += m.iter().filter(|v| v.to_bits() != 0).count();
            }
        }
    }
    check.written_rel_err = rel_err(&got, &want);
    check
}
