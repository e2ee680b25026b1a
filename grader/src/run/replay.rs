//! The judge's reference, after the runner has exited (so the two never share the GPU while one is
//! timed): layer by layer, the weights and the prefilled cache regenerated from the public seed into
//! the judge's scratch, the shared weights compared with them (a submission that wrote them is caught
//! here), and the eager layer replayed over the very same calls (positions and inputs, the
//! submission's own outputs where a call's input was the previous output), each layer on the input the
//! submission gave it: the call's input for the first, the submission's own hidden state from the
//! layer before for the others. So the judge never holds a second copy of a stack (80 layers of the
//! graded shape fill 138 of the H200's 150 GB), and a slip in one layer is told from the drift honest
//! rounding accumulates over depth (`docs/depth.md`). Its launches are recorded too, for the report's
//! side-by-side line.

use std::time::Instant;

use cuda::{Context, Device};
use half::bf16;
use reference::gpu::{DeviceCache, Eager, generate_weights};
use spec::{Call, Config, Tensor};

use super::Progress;
use super::append::{Slot, read_slot};
use super::check;
use super::gates::{CacheCheck, StepCheck};
use super::pace::Paced;
use super::shared::SharedData;
use crate::cupti::{self, CallWindow, Recording, StepLaunches, Tag};
use crate::error::GraderError;
use crate::metrics::to_f32;

/// What the reference computed, how the submission compares with it, and how it ran.
pub struct Replayed {
    /// Each call's check: its worst layer's.
    pub steps: Vec<StepCheck>,
    /// Every layer's cache against the reference's, summed (differing elements) and at its worst
    /// (the written rows' error).
    pub cache: CacheCheck,
    /// 16-byte vectors of the shared weights, over every layer, that differ from the regenerated ones.
    pub weight_vectors_changed: u64,
    /// The last layer's outputs, for the dump.
    pub outputs: Vec<Vec<bf16>>,
    /// Each call's kernels, over every layer.
    pub launches: Vec<StepLaunches>,
    /// Each call's time over every layer, each layer between two device-wide synchronisations, in
    /// microseconds.
    pub call_us: Vec<f64>,
    /// Each call's appended slot in every layer, as the reference's call left it.
    pub appended: Vec<Vec<Slot>>,
}

pub fn replay(
    dev: &Device,
    cfg: &Config,
    weights_seed: u64,
    calls: &[Call],
    paced: &Paced,
    shared: &SharedData,
    progress: &Progress,
) -> Result<Replayed, GraderError> {
    let (n, layers, row) = (calls.len(), cfg.layers, cfg.batch * cfg.d);
    progress.say(&format!("reference: replaying {n} calls over {layers} layer(s), one layer at a time"));
    let mut eager = Eager::new(dev, cfg)?;
    let s = dev.stream();
    let mut outs = (0..n)
        .map(|_| s.alloc_zeros::<bf16>(row))
        .collect::<Result<Vec<_>, _>>()
        .context("allocating the reference's outputs")?;
    let mut steps: Vec<Option<StepCheck>> = vec![None; n];
    let mut cache = CacheCheck { prefix_differing: 0, unused_differing: 0, written_rel_err: Some(0.0) };
    let mut weight_vectors_changed = 0;
    let mut outputs = Vec::new();
    let mut windows = Vec::with_capacity(n * layers);
    let mut call_us = vec![0.0; n];
    let mut appended = vec![Vec::with_capacity(layers); n];
    let recording = Recording::start()?;
    for l in 0..layers {
        if l > 0 && l % 10 == 0 {
            progress.say(&format!("reference: layer {l} of {layers}"));
        }
        let seed = spec::data::layer_seed(weights_seed, l);
        let weights = generate_weights(dev, cfg, seed)?;
        let mut layer_cache = DeviceCache::generate(dev, cfg, seed)?;
        let theirs = &shared.layers[l];
        for &t in Tensor::WEIGHTS {
            weight_vectors_changed += check::vectors_differing(dev, theirs.weights.get(t), weights.get(t))?;
        }
        // Layer l's input and the submission's output of it, for every call.
        let input =
            |c: usize| if l == 0 { paced.inputs[c].clone() } else { paced.hidden[c][(l - 1) * row..l * row].to_vec() };
        let output =
            |c: usize| if l + 1 == layers { &paced.outputs[c][..] } else { &paced.hidden[c][l * row..(l + 1) * row] };
        let inputs: Vec<Vec<bf16>> = (0..n).map(input).collect();
        let xs = inputs
            .iter()
            .map(|x| s.clone_htod(x).context("uploading a replayed input"))
            .collect::<Result<Vec<_>, _>>()?;
        dev.synchronize()?;
        for c in calls {
            cupti::set_current(Tag::Call(l * n + c.index));
            let start_ns = cupti::timestamp()?;
            let t = Instant::now();
            eager.step(dev, &weights, &mut layer_cache, &xs[c.index], c.pos, &mut outs[c.index])?;
            dev.synchronize()?;
            call_us[c.index] += t.elapsed().as_secs_f64() * 1e6;
            windows.push(CallWindow { start_ns, end_ns: cupti::timestamp()? });
            // The judge's reads are no work of the reference's call.
            cupti::set_current(Tag::Outside);
            appended[c.index].push(read_slot(dev, cfg, &layer_cache, c.pos)?);
        }
        cupti::set_current(Tag::Outside);
        let reference = outs
            .iter()
            .map(|o| s.clone_dtoh(o).context("reading the reference's outputs"))
            .collect::<Result<Vec<_>, _>>()?;
        for c in calls {
            let i = c.index;
            let check = StepCheck::of(*c, l, &to_f32(output(i)), &to_f32(&reference[i]), &to_f32(&inputs[i]));
            steps[i] = Some(match steps[i].take() {
                Some(before) => before.merge(check),
                None => check,
            });
        }
        let read = |v| s.clone_dtoh(v).context("reading a cache");
        let layer_check = check::cache(
            cfg,
            (&read(&theirs.cache.k)?, &read(&theirs.cache.v)?),
            (&read(&layer_cache.k)?, &read(&layer_cache.v)?),
        );
        cache = cache.and(layer_check);
        if l + 1 == layers {
            outputs = reference;
        }
    }
    let record =
        cupti::record::attribute(recording.finish()?, &windows, cupti::OwnWork::default(), |_| Vec::new(), Vec::new());
    // Window l * n + c is call c's layer l.
    let launches = (0..n)
        .map(|c| (1..layers).fold(record.calls[c].clone(), |all, l| all.then(&record.calls[l * n + c])))
        .collect();
    Ok(Replayed {
        steps: steps.into_iter().map(|s| s.expect("every call is checked")).collect(),
        cache,
        weight_vectors_changed,
        outputs,
        launches,
        call_us,
        appended,
    })
}
