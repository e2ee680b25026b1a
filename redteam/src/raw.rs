//! Device writes that a well-behaved submission never makes: single elements of buffers the contract
//! hands out read-only (weights, `x`), and whole cache slots moved or restored behind the step's back.

use std::ops::Range;

use cuda::cudarc::driver::{CudaSlice, DevicePtr, result};
use cuda::{Context, Device};
use half::bf16;
use reference::gpu::DeviceCache;
use spec::Config;

use submission::SubmissionError;

/// Element `index` of `buf`, read back (waits for the device's stream).
pub fn read_one(dev: &Device, buf: &CudaSlice<bf16>, index: usize) -> Result<bf16, SubmissionError> {
    let v = dev.stream().clone_dtoh(&buf.slice(index..index + 1)).context("reading one element back")?;
    Ok(v[0])
}

/// `v` with its lowest mantissa bit flipped: always a different bit pattern, never far from `v`, so
/// only a bitwise check can see it.
pub fn nudged(v: bf16) -> bf16 {
    bf16::from_bits(v.to_bits() ^ 1)
}

/// Element `index` of `buf` with its lowest bit flipped, in place.
///
/// # Safety
///
/// `buf` is shared (`&`): the caller must be the only one reading or writing the element while the
/// copy runs. The grader's buffers qualify: it hands them to the submission and reads them only after
/// synchronising.
pub unsafe fn nudge_in_place(dev: &Device, buf: &CudaSlice<bf16>, index: usize) -> Result<(), SubmissionError> {
    let value = nudged(read_one(dev, buf, index)?);
    let stream = dev.stream();
    let (base, _record) = buf.device_ptr(stream);
    let dst = base + (index * size_of::<bf16>()) as u64;
    let src = [value];
    // SAFETY: dst is element index (< buf.len(), checked by read_one's slice) of a live allocation of
    // bf16; src is one bf16. A copy from pageable memory returns once the driver has staged `src`;
    // the synchronisation below makes that moot, and orders the write before anything that follows.
    unsafe { result::memcpy_htod_async(dst, &src, stream.cu_stream()) }.context("writing one element")?;
    stream.synchronize().context("waiting for a one-element write")?;
    Ok(())
}

/// Scratch for the K and V rows of one cache slot of every KV head, `(2, n_kv, hd)`.
pub struct SlotRows {
    rows: CudaSlice<bf16>,
    n_kv: usize,
    hd: usize,
    max_seq_len: usize,
}

impl SlotRows {
    pub fn new(dev: &Device, cfg: &Config) -> Result<Self, SubmissionError> {
        let rows = dev.stream().alloc_zeros(2 * cfg.kv_dim()).context("allocating slot scratch")?;
        Ok(Self { rows, n_kv: cfg.n_kv, hd: cfg.hd, max_seq_len: cfg.max_seq_len })
    }

    /// Elements of `slot` of KV head `head` in a cache tensor `(n_kv, max_seq_len, hd)`.
    fn in_cache(&self, head: usize, slot: usize) -> Range<usize> {
        assert!(slot < self.max_seq_len, "slot {slot} is past the cache");
        let start = (head * self.max_seq_len + slot) * self.hd;
        start..start + self.hd
    }

    /// Elements of KV head `head` of tensor `t` (0: K, 1: V) in the scratch.
    fn in_scratch(&self, t: usize, head: usize) -> Range<usize> {
        let start = (t * self.n_kv + head) * self.hd;
        start..start + self.hd
    }

    /// Copies slot `slot` of K and V into the scratch.
    pub fn save(&mut self, dev: &Device, cache: &DeviceCache, slot: usize) -> Result<(), SubmissionError> {
        for (t, tensor) in [&cache.k, &cache.v].into_iter().enumerate() {
            for head in 0..self.n_kv {
                let (from, to) = (self.in_cache(head, slot), self.in_scratch(t, head));
                dev.stream()
                    .memcpy_dtod(&tensor.slice(from), &mut self.rows.slice_mut(to))
                    .context("saving a cache row")?;
            }
        }
        Ok(())
    }

    /// Copies the scratch into slot `slot` of K and V.
    pub fn restore(&self, dev: &Device, cache: &mut DeviceCache, slot: usize) -> Result<(), SubmissionError> {
        self.restore_only(dev, cache, slot, [true, true])
    }

    /// Copies the scratch into slot `slot` of K (`which[0]`) and V (`which[1]`).
    pub fn restore_only(
        &self,
        dev: &Device,
        cache: &mut DeviceCache,
        slot: usize,
        which: [bool; 2],
    ) -> Result<(), SubmissionError> {
        let tensors = [&mut cache.k, &mut cache.v].into_iter().enumerate().filter(|(t, _)| which[*t]);
        for (t, tensor) in tensors {
            for head in 0..self.n_kv {
                let (from, to) = (self.in_scratch(t, head), self.in_cache(head, slot));
                dev.stream()
                    .memcpy_dtod(&self.rows.slice(from), &mut tensor.slice_mut(to))
                    .context("restoring a cache row")?;
            }
        }
        Ok(())
    }

    /// Zeroes slot `slot` of K and V, as a slot no step wrote.
    pub fn zero(&self, dev: &Device, cache: &mut DeviceCache, slot: usize) -> Result<(), SubmissionError> {
        for tensor in [&mut cache.k, &mut cache.v] {
            for head in 0..self.n_kv {
                dev.stream().memset_zeros(&mut tensor.slice_mut(self.in_cache(head, slot))).context("zeroing a row")?;
            }
        }
        Ok(())
    }
}
