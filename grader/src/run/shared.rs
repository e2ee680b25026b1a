//! The buffers a submission works on, owned by the judge and mapped by the runner: the weights, the
//! KV cache, and one input and one output buffer per call, in one [`SharedRegion`].
//!
//! The judge fills the weights and the cache before the runner starts, poisons every input and
//! output with NaN, writes each call's input just before that call, and reads each output itself
//! right after it. Nothing the runner says is needed to know what it computed: the outputs, the
//! cache and the inputs are read here, from the judge's own mapping.
//!
//! The weights a submission reads are the runner's own copy of the shared ones: streaming from
//! memory mapped through CUDA IPC measured 35-45% slower on the H200 (the eager reference's GEMVs
//! at 2.0-3.3 TB/s against 3.6 from local memory), which would penalise a submission for reading the
//! weights in place instead of repacking them. The cache, the inputs and the outputs stay shared:
//! they are what the judge must read itself.

use cuda::cudarc::driver::CudaSlice;
use cuda::ipc::{Borrowed, RegionHandle, SharedRegion, VIEW_ALIGN};
use cuda::{Context, CudaError, Device};
use half::bf16;
use reference::gpu::{DeviceCache, DeviceWeights};
use spec::data::{LayerWeights, Tensor};
use spec::{Call, Config, Input};
use submission::Layer;

/// Where each buffer sits in the region, in bytes; the same on both sides (computed from the
/// config and the number of calls).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub weights: LayerWeights<(usize, usize)>,
    pub cache_k: (usize, usize),
    pub cache_v: (usize, usize),
    /// `(offset, elements)` of each call's input and output.
    pub inputs: Vec<(usize, usize)>,
    pub outputs: Vec<(usize, usize)>,
    pub bytes: usize,
}

impl Layout {
    pub fn of(cfg: &Config, calls: usize) -> Layout {
        let mut next = 0usize;
        let mut place = |elems: usize| {
            let at = next;
            next = (at + elems * size_of::<bf16>()).next_multiple_of(VIEW_ALIGN);
            (at, elems)
        };
        let weights = LayerWeights::try_from_fn(|t| Ok::<_, std::convert::Infallible>(place(t.elems(cfg))))
            .unwrap_or_else(|e| match e {});
        let cache_k = place(cfg.cache_elems());
        let cache_v = place(cfg.cache_elems());
        let row = cfg.batch * cfg.d;
        let inputs = (0..calls).map(|_| place(row)).collect();
        let outputs = (0..calls).map(|_| place(row)).collect();
        Layout { weights, cache_k, cache_v, inputs, outputs, bytes: next }
    }
}

fn release_weights(w: DeviceWeights) {
    w.map(|s| s.leak());
}

fn release_cache(c: DeviceCache) {
    c.k.leak();
    c.v.leak();
}

/// The region and its views, on either side. Views are declared before the region so they are
/// given back before the region is freed or unmapped.
pub struct SharedData {
    pub weights: Borrowed<DeviceWeights>,
    pub cache: Borrowed<DeviceCache>,
    pub inputs: Vec<Borrowed<CudaSlice<bf16>>>,
    pub outputs: Vec<Borrowed<CudaSlice<bf16>>>,
    region: SharedRegion,
}

impl SharedData {
    fn with_views(region: SharedRegion, layout: &Layout) -> SharedData {
        let views: Vec<_> =
            Tensor::WEIGHTS.iter().map(|&t| *layout.weights.get(t)).map(|(o, n)| region.view(o, n)).collect();
        let weights = Borrowed::compose(
            views,
            |mut s| {
                let mut it = s.drain(..);
                LayerWeights::try_from_fn(|_| Ok::<_, std::convert::Infallible>(it.next().expect("nine views")))
                    .unwrap_or_else(|e| match e {})
            },
            release_weights,
        );
        let cache = Borrowed::compose(
            vec![region.view(layout.cache_k.0, layout.cache_k.1), region.view(layout.cache_v.0, layout.cache_v.1)],
            |mut s| {
                let v = s.pop().expect("two views");
                DeviceCache { k: s.pop().expect("two views"), v }
            },
            release_cache,
        );
        let inputs = layout.inputs.iter().map(|&(o, n)| region.view(o, n)).collect();
        let outputs = layout.outputs.iter().map(|&(o, n)| region.view(o, n)).collect();
        SharedData { weights, cache, inputs, outputs, region }
    }

    /// The judge's side: allocates the region, copies in the weights and the prefilled cache, and
    /// poisons every input and output.
    pub fn create(
        dev: &Device,
        cfg: &Config,
        calls: usize,
        weights: &DeviceWeights,
        cache: &DeviceCache,
    ) -> Result<SharedData, CudaError> {
        let layout = Layout::of(cfg, calls);
        dev.require_free(layout.bytes as u64, "the buffers shared with the submission")?;
        let mut shared = Self::with_views(SharedRegion::allocate(dev, layout.bytes)?, &layout);
        let s = dev.stream();
        for &t in Tensor::WEIGHTS {
            s.memcpy_dtod(weights.get(t), shared.weights.get_mut(t))
                .context("copying a weight into the shared region")?;
        }
        s.memcpy_dtod(&cache.k, &mut shared.cache.k).context("copying the K cache into the shared region")?;
        s.memcpy_dtod(&cache.v, &mut shared.cache.v).context("copying the V cache into the shared region")?;
        let nan = vec![bf16::NAN; cfg.batch * cfg.d];
        for buf in shared.inputs.iter_mut().chain(shared.outputs.iter_mut()) {
            s.memcpy_htod(&nan, &mut **buf).context("poisoning an input or output")?;
        }
        dev.synchronize()?;
        Ok(shared)
    }

    /// The runner's side: maps the judge's region.
    pub fn open(dev: &Device, cfg: &Config, calls: usize, handle: &RegionHandle) -> Result<SharedData, CudaError> {
        let layout = Layout::of(cfg, calls);
        if handle.bytes != layout.bytes {
            return Err(CudaError::WrongResult(format!(
                "the judge's region holds {} bytes but this config needs {}",
                handle.bytes, layout.bytes
            )));
        }
        Ok(Self::with_views(SharedRegion::open(dev, handle)?, &layout))
    }

    pub fn handle(&self) -> Result<RegionHandle, CudaError> {
        self.region.handle()
    }

    /// Writes call `index`'s input (the judge's side), and waits until it is on the device.
    pub fn write_input(&mut self, dev: &Device, index: usize, x: &[bf16]) -> Result<(), CudaError> {
        dev.stream().memcpy_htod(x, &mut *self.inputs[index]).context("writing an input")?;
        dev.stream().synchronize().context("writing an input")
    }

    /// Reads call `index`'s output as it is now.
    pub fn read_output(&self, dev: &Device, index: usize) -> Result<Vec<bf16>, CudaError> {
        dev.stream().clone_dtoh(&*self.outputs[index]).context("reading an output")
    }

    /// What `call` works on, on the runner's side: the layer (`weights`, the runner's own copy, and
    /// the shared cache), the input buffer it reads (its own, or an earlier call's output) and the
    /// output buffer it writes.
    pub fn for_call<'a>(
        &'a mut self,
        weights: &'a DeviceWeights,
        call: &Call,
    ) -> (Layer<'a>, &'a CudaSlice<bf16>, &'a mut CudaSlice<bf16>) {
        let layer = Layer { weights, cache: &mut self.cache };
        match call.input {
            Input::Fresh => (layer, &*self.inputs[call.index], &mut *self.outputs[call.index]),
            Input::OutputOf(j) => {
                assert!(j < call.index, "a call reads the output of an earlier call");
                let (before, rest) = self.outputs.split_at_mut(call.index);
                (layer, &*before[j], &mut *rest[0])
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_aligned_disjoint_and_in_bounds() {
        let cfg = Config::small();
        let calls = spec::schedule(&cfg).len();
        let l = Layout::of(&cfg, calls);
        let mut spans: Vec<(usize, usize)> = Tensor::WEIGHTS.iter().map(|&t| *l.weights.get(t)).collect();
        spans.extend([l.cache_k, l.cache_v]);
        spans.extend(l.inputs.iter().chain(&l.outputs));
        assert_eq!(spans.len(), 9 + 2 + 2 * calls);
        let mut bytes: Vec<(usize, usize)> = spans.iter().map(|&(o, n)| (o, o + 2 * n)).collect();
        bytes.sort();
        for w in bytes.windows(2) {
            assert!(w[0].1 <= w[1].0, "{:?} overlaps {:?}", w[0], w[1]);
        }
        assert!(bytes.iter().all(|&(o, _)| o % VIEW_ALIGN == 0));
        assert!(bytes.last().unwrap().1 <= l.bytes);
        assert_eq!(l.weights.down.1, cfg.d * cfg.ffn);
        assert_eq!(Layout::of(&cfg, calls), l, "both sides compute the same layout");
    }

    /// The red team reaches later calls' buffers one stride apart (lookahead, batcher): the stride
    /// between consecutive inputs, consecutive outputs, and the last input and the first output.
    #[test]
    fn the_red_teams_stride_is_the_layouts() {
        for cfg in [Config::tiny(), Config::small(), Config::graded()] {
            let l = Layout::of(&cfg, spec::schedule(&cfg).len());
            let stride = redteam::buffer_stride(&cfg);
            let starts: Vec<usize> = l.inputs.iter().chain(&l.outputs).map(|&(o, _)| o).collect();
            assert!(starts.windows(2).all(|w| w[1] - w[0] == stride), "{}", cfg.name);
        }
    }
}
