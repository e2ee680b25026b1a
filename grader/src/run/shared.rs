//! The buffers a submission works on, owned by the judge and mapped by the runner: every layer's
//! weights and KV cache, and per call one input, one output and (in a stack) the hidden states
//! between layers, in one [`SharedRegion`].
//!
//! The judge fills the weights and the caches before the runner starts, poisons every input, output
//! and hidden state with NaN, writes each call's input just before that call, and reads each output and
//! hidden state itself right after it. Nothing the runner says is needed to know what it computed:
//! the outputs, the hidden states, the caches and the inputs are read here, from the judge's own
//! mapping.
//!
//! For one layer, the weights a submission reads are the runner's own copy of the shared ones:
//! streaming from memory mapped through CUDA IPC measured 35-45% slower on the H200 with 16-byte
//! loads (the eager reference's GEMVs at 2.0-3.3 TB/s against 3.6 from local memory), which would
//! penalise a submission for reading the weights in place instead of repacking them. A stack has no
//! room for a second copy (80 layers of the graded shape fill 138 of the H200's 150 GB), so there the
//! submission reads the shared weights in place (bulk copies through the mapping measured at local
//! speed, `docs/stack.md`). The caches, the inputs, the outputs and the hidden states always stay
//! shared: they are what the judge must read itself.

use cuda::cudarc::driver::CudaSlice;
use cuda::ipc::{Borrowed, RegionHandle, SharedRegion, VIEW_ALIGN};
use cuda::{Context, CudaError, Device};
use half::bf16;
use reference::gpu::{DeviceCache, DeviceWeights};
use spec::data::{LayerWeights, Tensor};
use spec::{Call, Config, Input};
use submission::Layer;

/// Where one layer's buffers sit in the region, in bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerLayout {
    pub weights: LayerWeights<(usize, usize)>,
    pub cache_k: (usize, usize),
    pub cache_v: (usize, usize),
}

/// Where each buffer sits in the region, in bytes; the same on both sides (computed from the
/// config and the number of calls).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub layers: Vec<LayerLayout>,
    /// `(offset, elements)` of each call's input and output.
    pub inputs: Vec<(usize, usize)>,
    pub outputs: Vec<(usize, usize)>,
    /// `(offset, elements)` of each call's hidden states, `(layers - 1, batch, d)`; none for one layer.
    pub hidden: Vec<(usize, usize)>,
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
        let layers = (0..cfg.layers)
            .map(|_| LayerLayout {
                weights: LayerWeights::try_from_fn(|t| Ok::<_, std::convert::Infallible>(place(t.elems(cfg))))
                    .unwrap_or_else(|e| match e {}),
                cache_k: place(cfg.cache_elems()),
                cache_v: place(cfg.cache_elems()),
            })
            .collect();
        let row = cfg.batch * cfg.d;
        let inputs = (0..calls).map(|_| place(row)).collect();
        let outputs = (0..calls).map(|_| place(row)).collect();
        let hidden = if cfg.layers > 1 { (0..calls).map(|_| place((cfg.layers - 1) * row)).collect() } else { vec![] };
        Layout { layers, inputs, outputs, hidden, bytes: next }
    }
}

fn release_weights(w: DeviceWeights) {
    w.map(|s| s.leak());
}

fn release_cache(c: DeviceCache) {
    c.k.leak();
    c.v.leak();
}

/// One layer's views.
pub struct SharedLayer {
    pub weights: Borrowed<DeviceWeights>,
    pub cache: Borrowed<DeviceCache>,
}

/// The region and its views, on either side. Views are declared before the region so they are
/// given back before the region is freed or unmapped.
pub struct SharedData {
    pub layers: Vec<SharedLayer>,
    pub inputs: Vec<Borrowed<CudaSlice<bf16>>>,
    pub outputs: Vec<Borrowed<CudaSlice<bf16>>>,
    pub hidden: Vec<Borrowed<CudaSlice<bf16>>>,
    region: SharedRegion,
}

impl SharedData {
    fn with_views(region: SharedRegion, layout: &Layout) -> SharedData {
        let layers = layout
            .layers
            .iter()
            .map(|l| {
                let views: Vec<_> =
                    Tensor::WEIGHTS.iter().map(|&t| *l.weights.get(t)).map(|(o, n)| region.view(o, n)).collect();
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
                    vec![region.view(l.cache_k.0, l.cache_k.1), region.view(l.cache_v.0, l.cache_v.1)],
                    |mut s| {
                        let v = s.pop().expect("two views");
                        DeviceCache { k: s.pop().expect("two views"), v }
                    },
                    release_cache,
                );
                SharedLayer { weights, cache }
            })
            .collect();
        let views = |spans: &[(usize, usize)]| spans.iter().map(|&(o, n)| region.view(o, n)).collect();
        let (inputs, outputs, hidden) = (views(&layout.inputs), views(&layout.outputs), views(&layout.hidden));
        SharedData { layers, inputs, outputs, hidden, region }
    }

    /// The judge's side: allocates the region, fills each layer's weights and prefilled cache with
    /// what `layer(l)` generates (one layer at a time, so the judge never holds two copies of the
    /// stack), and poisons every input, output and hidden state.
    pub fn create(
        dev: &Device,
        cfg: &Config,
        calls: usize,
        mut layer: impl FnMut(usize) -> Result<(DeviceWeights, DeviceCache), CudaError>,
    ) -> Result<SharedData, CudaError> {
        let layout = Layout::of(cfg, calls);
        dev.require_free(layout.bytes as u64, "the buffers shared with the submission")?;
        let mut shared = Self::with_views(SharedRegion::allocate(dev, layout.bytes)?, &layout);
        let s = dev.stream();
        for (l, into) in shared.layers.iter_mut().enumerate() {
            let (weights, cache) = layer(l)?;
            for &t in Tensor::WEIGHTS {
                s.memcpy_dtod(weights.get(t), into.weights.get_mut(t))
                    .context("copying a weight into the shared region")?;
            }
            s.memcpy_dtod(&cache.k, &mut into.cache.k).context("copying the K cache into the shared region")?;
            s.memcpy_dtod(&cache.v, &mut into.cache.v).context("copying the V cache into the shared region")?;
            // The generated layer is freed before the next one is made.
            dev.synchronize()?;
        }
        let poison = |buf: &mut CudaSlice<bf16>| {
            s.memcpy_htod(&vec![bf16::NAN; buf.len()], buf).context("poisoning an input, output or hidden state")
        };
        for buf in shared.inputs.iter_mut().chain(shared.outputs.iter_mut()).chain(shared.hidden.iter_mut()) {
            poison(buf)?;
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

    /// Reads call `index`'s hidden states as they are now (nothing for one layer).
    pub fn read_hidden(&self, dev: &Device, index: usize) -> Result<Vec<bf16>, CudaError> {
        match self.hidden.get(index) {
            Some(h) => dev.stream().clone_dtoh(&**h).context("reading the hidden states"),
            None => Ok(Vec::new()),
        }
    }

    /// What the calls work on, on the runner's side: the layers as a submission gets them (each one's
    /// weights, `own` where the runner made its own copy, else the shared ones, and its shared cache),
    /// made once for every call, and each call's buffers (`CallIo::for_call`).
    pub fn split<'a>(&'a mut self, own: Option<&'a DeviceWeights>) -> (Vec<Layer<'a>>, CallIo<'a>) {
        let layers = self
            .layers
            .iter_mut()
            .map(|l| Layer { weights: own.unwrap_or(&*l.weights), cache: &mut l.cache })
            .collect();
        (layers, CallIo { inputs: &self.inputs, outputs: &mut self.outputs, hidden: &mut self.hidden })
    }
}

/// Each call's own buffers on the runner's side (`SharedData::split`).
pub struct CallIo<'a> {
    inputs: &'a [Borrowed<CudaSlice<bf16>>],
    outputs: &'a mut [Borrowed<CudaSlice<bf16>>],
    hidden: &'a mut [Borrowed<CudaSlice<bf16>>],
}

impl CallIo<'_> {
    /// What `call` reads and writes: the input buffer (its own, or an earlier call's output), its
    /// hidden states (none for one layer) and the output buffer.
    pub fn for_call(&mut self, call: &Call) -> (&CudaSlice<bf16>, Option<&mut CudaSlice<bf16>>, &mut CudaSlice<bf16>) {
        let hidden = self.hidden.get_mut(call.index).map(|h| &mut **h);
        let (x, out) = match call.input {
            Input::Fresh => (&*self.inputs[call.index], &mut *self.outputs[call.index]),
            Input::OutputOf(j) => {
                assert!(j < call.index, "a call reads the output of an earlier call");
                let (before, rest) = self.outputs.split_at_mut(call.index);
                (&*before[j], &mut *rest[0])
            }
        };
        (x, hidden, out)
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
        let mut spans: Vec<(usize, usize)> = Vec::new();
        for layer in &l.layers {
            spans.extend(Tensor::WEIGHTS.iter().map(|&t| *layer.weights.get(t)));
            spans.extend([layer.cache_k, layer.cache_v]);
        }
        spans.extend(l.inputs.iter().chain(&l.outputs).chain(&l.hidden));
        assert_eq!(spans.len(), cfg.layers * (9 + 2) + (2 + usize::from(cfg.layers > 1)) * calls);
        let mut bytes: Vec<(usize, usize)> = spans.iter().map(|&(o, n)| (o, o + 2 * n)).collect();
        bytes.sort();
        for w in bytes.windows(2) {
            assert!(w[0].1 <= w[1].0, "{:?} overlaps {:?}", w[0], w[1]);
        }
        assert!(bytes.iter().all(|&(o, _)| o % VIEW_ALIGN == 0));
        assert!(bytes.last().unwrap().1 <= l.bytes);
        assert_eq!(l.layers[0].weights.down.1, cfg.d * cfg.ffn);
        assert_eq!(Layout::of(&cfg, calls), l, "both sides compute the same layout");
    }

    /// A stack lays out every layer's weights and cache, then the calls' buffers, hidden states last;
    /// the one-layer layout is the stack's with none of them.
    #[test]
    fn a_stacks_layout_holds_every_layer_and_the_hidden_states() {
        let one = Config::tiny();
        let calls = spec::schedule(&one).len();
        let stack = Config { layers: 3, ..one.clone() };
        let (l1, l3) = (Layout::of(&one, calls), Layout::of(&stack, calls));
        assert_eq!((l3.layers.len(), l3.hidden.len()), (3, calls));
        assert!(l1.hidden.is_empty());
        assert!(l3.hidden.iter().all(|&(_, n)| n == 2 * one.d));
        let (layer_bytes, first_input) = (l1.inputs[0].0, l3.inputs[0].0);
        assert_eq!(first_input, 3 * layer_bytes, "every layer takes the same room");
        assert_eq!(l3.layers[2].weights.in_norm.0, 2 * layer_bytes);
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
