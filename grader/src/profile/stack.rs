//! `grader profile --config STACK`: the megakernel over a whole stack, one launch per token. The fused
//! step is timed by events after an L2 eviction (as a timed call of `grader run` finds the GPU) against
//! the stack's floor; then one launch is traced block by block and folded into layers: each layer's
//! time is from the layer before's last block's end to its own last block's end, against the layer's
//! own floor. The layers' spread shows what a stack adds to a layer: nothing between layers if the
//! next layer's weights stream while this one drains, the launch's start in the first. The same launch
//! also reads as `megakernel bench --trace` reads a model's (`megakernel::Trace`): each kind of phase's
//! part of the step (hand-off, median block, later blocks; a block's input, stream and tail) and a
//! layer's critical path.

use std::fmt::Write as _;

use cuda::{Context, Device};
use megakernel::{Megakernel, Mode, PhaseShare, TRACE_END, TRACE_STAMPS};
use reference::gpu::data::generate_input;
use reference::gpu::{DeviceCache, generate_weights};
use serde::Serialize;
use spec::{ByteModel, Config};
use submission::{Layer, Submission};

use crate::bandwidth::L2Eviction;
use crate::error::GraderError;
use crate::run::Progress;
use crate::stats::Summary;

/// Untimed steps first, then timed ones, each after an L2 eviction.
const WARMUP_STEPS: usize = 2;
const TIMED_STEPS: usize = 8;

#[derive(Debug, Clone, Serialize)]
pub struct StackProfile {
    pub config: String,
    pub layers: usize,
    /// The compiled plan in words, and how the weights stream.
    pub plan: String,
    pub floor_tbps: f64,
    /// The fused step, one launch over every layer.
    pub fused_us: Summary,
    pub fused_x_floor: f64,
    /// Each layer's time in the traced launch (see the module's comment), in microseconds; empty when
    /// the trace was incomplete.
    pub layer_us: Vec<f64>,
    /// One layer's floor: its bytes at the deepest timed position over the measured copy bandwidth.
    pub layer_floor_us: f64,
    /// Each kind of phase's part of the traced step (`Trace::step_shares`); empty when the trace was
    /// incomplete.
    pub phase_shares: Vec<PhaseShare>,
    /// Those as `megakernel bench --trace` prints them.
    #[serde(skip)]
    pub phase_table: String,
}

/// Builds the megakernel over `cfg`'s stack (each layer's weights and cache from its layer seed),
/// times it and traces it.
pub fn measure(
    dev: &Device,
    cfg: &Config,
    seed: u64,
    floor_bytes_per_s: f64,
    progress: &Progress,
) -> Result<StackProfile, GraderError> {
    let seeds: Vec<u64> = (0..cfg.layers).map(|l| spec::data::layer_seed(seed, l)).collect();
    let weights = seeds.iter().map(|&s| generate_weights(dev, cfg, s)).collect::<Result<Vec<_>, _>>()?;
    let mut caches = seeds.iter().map(|&s| DeviceCache::generate(dev, cfg, s)).collect::<Result<Vec<_>, _>>()?;
    let mut fused = Megakernel::new(Mode::Fused);
    fused.build_stack(dev, &mut Layer::stack(&weights, &mut caches), cfg)?;
    let in_place = fused.streams_in_place().expect("built");
    progress.say(&format!("built over {} layers; timing {TIMED_STEPS} steps and tracing one", cfg.layers));
    let s = dev.stream();
    let (row, total) = (cfg.batch * cfg.d, fused.phases().expect("built"));
    let mut hidden = s.alloc_zeros((cfg.layers - 1) * row).context("allocating the hidden states")?;
    let mut out = s.alloc_zeros(row).context("allocating the output")?;
    let mut evict = L2Eviction::new(dev, 2)?;
    let input_seed: u64 = rand::random();
    let pos = cfg.deepest_timed_pos();
    let mut fused_us = Vec::with_capacity(TIMED_STEPS);
    for step in 0..WARMUP_STEPS + TIMED_STEPS {
        let x = generate_input(dev, cfg, input_seed, step)?;
        evict.enqueue(dev)?;
        let ms = dev.time_ms(|| fused.launch_phases(dev, &x, pos, Some(&mut hidden), &mut out, 0..total))?;
        if step >= WARMUP_STEPS {
            fused_us.push(ms as f64 * 1e3);
        }
    }
    let x = generate_input(dev, cfg, input_seed, 0)?;
    evict.enqueue(dev)?;
    dev.synchronize()?;
    let trace = fused.trace_step(dev, &x, pos, Some(&mut hidden), &mut out)?;
    let phases = total as usize / cfg.layers;
    let layer_us = layer_times(&trace.stamps, trace.grid, cfg.layers, phases).unwrap_or_default();
    let phase_shares = trace.step_shares().unwrap_or_default();
    let phase_table = trace.table(&phase_shares, &format!("one step at position {pos}, L2 evicted before it"));
    let fused_us = Summary::of(&fused_us).expect("timed");
    let floor_us = |bytes: u64| bytes as f64 / floor_bytes_per_s * 1e6;
    let how = if in_place {
        "Qkv and GateUp streamed in place from the weights as handed over"
    } else {
        "every layer's weights packed"
    };
    Ok(StackProfile {
        config: cfg.name.clone(),
        layers: cfg.layers,
        plan: format!("{}; {how}", fused.describe(cfg, pos).expect("built")),
        floor_tbps: floor_bytes_per_s / 1e12,
        fused_x_floor: fused_us.median / floor_us(ByteModel::stack(cfg).total),
        fused_us,
        layer_us,
        layer_floor_us: floor_us(ByteModel::of(cfg).total),
        phase_shares,
        phase_table,
    })
}

/// Each layer's time from the trace's stamps (`(block, layer * phases + phase, TRACE_STAMPS)`, ns,
/// zero where a block does not run a phase): from the launch's first start (layer 0) or the layer
/// before's last end to the layer's last end. `None` when a layer has no stamp.
fn layer_times(stamps: &[u64], grid: usize, layers: usize, phases: usize) -> Option<Vec<f64>> {
    let stamp = |b: usize, f: usize, which: usize| stamps[(b * layers * phases + f) * TRACE_STAMPS + which];
    let (start, end) = (0, TRACE_END);
    let first = (0..grid).flat_map(|b| (0..phases).map(move |f| (b, f))).map(|(b, f)| stamp(b, f, start));
    let mut before = first.filter(|&t| t != 0).min()?;
    (0..layers)
        .map(|l| {
            let ends = (0..grid).flat_map(|b| (l * phases..(l + 1) * phases).map(move |f| (b, f)));
            let last = ends.map(|(b, f)| stamp(b, f, end)).max().filter(|&t| t != 0)?;
            let us = last.saturating_sub(before) as f64 / 1e3;
            before = last;
            Some(us)
        })
        .collect()
}

impl StackProfile {
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "\nmegakernel over a stack ('{}' config: {} layers, floor bandwidth {:.3} TB/s)",
            self.config, self.layers, self.floor_tbps
        );
        let _ = writeln!(s, "  plan: {}", self.plan);
        let _ = writeln!(
            s,
            "  fused, one launch per token: {:.1} us = {:.3}x floor (median of {}, L2 evicted before each; p10 {:.1}, p90 {:.1})",
            self.fused_us.median, self.fused_x_floor, self.fused_us.n, self.fused_us.p10, self.fused_us.p90
        );
        let Some(sorted) = Summary::of(&self.layer_us) else {
            let _ = writeln!(s, "  the traced launch's stamps were incomplete: no per-layer times");
            return s;
        };
        let _ = writeln!(
            s,
            "  traced launch, per layer (from the layer before's last block's end to its own; one layer's floor {:.1} us):",
            self.layer_floor_us
        );
        let _ = writeln!(
            s,
            "  layers' median {:.1} us ({:.3}x), p10 {:.1}, p90 {:.1}, max {:.1}; sum {:.1} us",
            sorted.median,
            sorted.median / self.layer_floor_us,
            sorted.p10,
            sorted.p90,
            sorted.max,
            self.layer_us.iter().sum::<f64>()
        );
        for (l, us) in self.layer_us.iter().enumerate() {
            let _ = write!(s, "{}{l:>4} {us:>8.1}", if l % 6 == 0 { "\n  " } else { "   " });
        }
        s.push('\n');
        if !self.phase_shares.is_empty() {
            for line in self.phase_table.lines() {
                let _ = writeln!(s, "  {line}");
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two blocks, two layers of two phases: layer 0 from the first start to its last end, layer 1
    /// from there to its last end, whichever block holds them; a layer with no stamp gives none.
    #[test]
    fn layers_fold_from_the_last_end_before_them() {
        let (grid, layers, phases) = (2, 2, 2);
        let mut stamps = vec![0u64; grid * layers * phases * TRACE_STAMPS];
        let mut set = |b: usize, f: usize, start: u64, end: u64| {
            let at = (b * layers * phases + f) * TRACE_STAMPS;
            stamps[at] = start;
            stamps[at + TRACE_END] = end;
        };
        set(0, 0, 1_000, 5_000);
        set(1, 1, 2_000, 9_000);
        set(0, 2, 9_500, 20_000);
        set(1, 3, 10_000, 30_000);
        assert_eq!(layer_times(&stamps, grid, layers, phases), Some(vec![8.0, 21.0]));
        let none = vec![0u64; stamps.len()];
        assert_eq!(layer_times(&none, grid, layers, phases), None);
    }
}
