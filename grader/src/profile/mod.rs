//! `grader profile`: the megakernel's phase-per-launch mode timed phase by phase with events, each
//! phase against its own floor, beside the fused launch; then the fused launch traced block by block
//! (`timeline`), as a table and an SVG timeline; then the launch path in parts (`launch`). Where the
//! GPU's counters can be read, a second pass measures the DRAM bytes each phase reads (one audit range
//! per phase launch; the ranges' own cost stays out of the timed pass). Every phase's bytes are the
//! byte model's (`ByteModel::by_op`), the figures `grader run` judges: its operation's, or the share of
//! them it reads when the program splits the operation into parts (the two-role plan). A stack
//! (`--config stack-70b`) is profiled as a whole and layer by layer instead (`stack`).

mod launch;
mod stack;
mod timeline;

use std::fmt::Write as _;

use cuda::{Context, CudaError, Device};
use megakernel::program::{Blocks, Forced};
use megakernel::{Megakernel, Mode, PhasePlan};
use reference::gpu::DeviceCache;
use reference::gpu::data::generate_input;
use serde::Serialize;
use spec::{ByteModel, Config};
use submission::{Layer, Submission};

use crate::audit::{DRAM_BYTES_READ, RangeAudit};
use crate::bandwidth::{self, L2Eviction};
use crate::cli::ProfileArgs;
use crate::error::{GraderError, Outcome};
use crate::run::Progress;
use crate::stats::Summary;

/// Untimed steps first; then timed steps, each phase timed once per step.
const WARMUP_STEPS: usize = 2;
const TIMED_STEPS: usize = 16;
/// Traced fused launches, L2 evicted before each as in a run; the one of median length is shown.
const TRACED_STEPS: usize = 5;

pub use launch::LaunchPart;
pub use timeline::{Timeline, TracedPhase};

#[derive(Debug, Clone, Serialize)]
pub struct PhaseTime {
    pub phase: String,
    pub bytes: u64,
    pub us: Summary,
    /// Median time over this phase's own floor (its bytes over the measured copy bandwidth).
    pub x_floor: f64,
    /// Median time over the sum of the phases' medians.
    pub share: f64,
    /// DRAM bytes the phase read (median over the audited steps), when the counters could be read.
    pub dram_bytes_read: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Profile {
    pub config: String,
    /// The compiled plan in words (`Megakernel::describe`) at the deepest timed position.
    pub plan: String,
    pub floor_tbps: f64,
    pub phases: Vec<PhaseTime>,
    pub phases_sum_us: f64,
    /// The fused launch (the submission itself) on the same steps.
    pub fused_us: Summary,
    pub fused_x_floor: f64,
    /// The launch path in parts: launches of kernels that do nothing, adding the megakernel's launch
    /// one respect at a time, and the fused step itself (`launch`).
    pub launch: Vec<LaunchPart>,
    /// Why a row of the launch path could not be measured here (the recording or the audit
    /// unavailable).
    pub launch_unmeasured: Vec<String>,
    /// The fused step's kernel time by events, launched back to back as its round trip in `launch`
    /// was: the round trip less this is what a call pays beyond the kernel on this host, before any
    /// recording or signalling.
    pub step_kernel_us: f64,
    /// Why the DRAM bytes per phase are missing, when they are.
    pub unaudited: Option<String>,
    /// The fused launch traced block by block; `None` when its stamps were incomplete.
    pub timeline: Option<Timeline>,
}

pub fn command(device: usize, args: &ProfileArgs) -> Result<Outcome, GraderError> {
    let cfg = Config::load(&args.config.config)?;
    if cfg.layers > 1 {
        for (flag, given) in [
            ("--svg", args.svg.is_some()),
            ("--roles", args.roles.is_some()),
            ("--mlp-parts", args.mlp_parts.is_some()),
        ] {
            if given {
                return Err(GraderError::Usage(format!(
                    "{flag} studies one layer; '{}' is a stack of {} layers, profiled as a whole and layer by layer \
                     (drop {flag}, or profile one of its layers' shape)",
                    cfg.name, cfg.layers
                )));
            }
        }
    }
    for (flag, path) in [("--json", &args.json), ("--svg", &args.svg)] {
        if let Some(path) = path {
            crate::preflight::output_file(flag, path)?;
        }
    }
    let dev = Device::open(device)?;
    crate::run::fits_one_gpu(&cfg, 0, dev.facts().total_mem_bytes as u64)?;
    let progress = Progress::new(args.quiet);
    progress.say("measuring the copy bandwidth");
    let bw = bandwidth::measure(&dev, 2 << 30, 20)?;
    if cfg.layers > 1 {
        progress
            .say(&format!("generating the '{}' stack's {} layers and building the megakernel", cfg.name, cfg.layers));
        let profile = stack::measure(&dev, &cfg, args.seed, bw.floor_bytes_per_s(), &progress)?;
        eprint!("{}", profile.table());
        if let Some(path) = &args.json {
            crate::output::write_output(path, &(serde_json::to_string_pretty(&profile).expect("serialises") + "\n"))?;
        }
        return Ok(Outcome::Pass);
    }
    progress.say(&format!("generating the '{}' layer and building both modes", cfg.name));
    let forced = Forced { roles: args.roles.map(|r| r as usize), mlp_parts: args.mlp_parts.map(|p| p as usize) };
    let profile = measure(&dev, &cfg, args.seed, bw.floor_bytes_per_s(), forced)?;
    eprint!("{}", table(&profile));
    match &profile.timeline {
        Some(t) => eprint!("{}", t.table()),
        None => eprintln!("  the fused launch's trace was incomplete: no timeline"),
    }
    if let Some(path) = &args.svg {
        let Some(t) = &profile.timeline else {
            return Err(GraderError::Measurement(
                "--svg: the fused launch's trace was incomplete, nothing to draw".into(),
            ));
        };
        let title = format!(
            "megakernel, '{}' config: fused {:.1} us = {:.3}x floor; one row per block, white = waiting",
            profile.config, profile.fused_us.median, profile.fused_x_floor
        );
        crate::output::write_output(path, &t.svg(&title))?;
    }
    if let Some(path) = &args.json {
        crate::output::write_output(path, &(serde_json::to_string_pretty(&profile).expect("serialises") + "\n"))?;
    }
    Ok(Outcome::Pass)
}

fn measure(
    dev: &Device,
    cfg: &Config,
    seed: u64,
    floor_bytes_per_s: f64,
    forced: Forced,
) -> Result<Profile, GraderError> {
    let w = reference::gpu::generate_weights(dev, cfg, seed)?;
    let mut cache = DeviceCache::generate(dev, cfg, seed)?;
    let mut phased = Megakernel::new(Mode::PerPhase).forcing(forced);
    let mut fused = Megakernel::new(Mode::Fused).forcing(forced);
    phased.build_layer(dev, Layer { weights: &w, cache: &mut cache }, cfg)?;
    fused.build_layer(dev, Layer { weights: &w, cache: &mut cache }, cfg)?;
    let phases = phased.phases().expect("built");
    let input_seed: u64 = rand::random();
    let mut out = dev.stream().alloc_zeros(cfg.d).context("allocating the output")?;
    let mut per_phase = vec![Vec::new(); phases as usize];
    let mut fused_us = Vec::new();
    for s in 0..WARMUP_STEPS + TIMED_STEPS {
        let pos = cfg.prefill + s % cfg.timed_steps;
        let x = generate_input(dev, cfg, input_seed, s)?;
        for (p, times) in per_phase.iter_mut().enumerate() {
            let p = p as u32;
            let ms = dev.time_ms(|| phased.launch_phases(dev, &x, pos, None, &mut out, p..p + 1))?;
            if s >= WARMUP_STEPS {
                times.push(ms as f64 * 1e3);
            }
        }
        let ms = dev.time_ms(|| fused.launch_phases(dev, &x, pos, None, &mut out, 0..phases))?;
        if s >= WARMUP_STEPS {
            fused_us.push(ms as f64 * 1e3);
        }
    }
    let model = ByteModel::at(cfg, cfg.deepest_timed_pos());
    let medians: Vec<f64> = per_phase.iter().map(|t| Summary::of(t).expect("timed").median).collect();
    let phases_sum_us: f64 = medians.iter().sum();
    let floor_us = |b: u64| b as f64 / floor_bytes_per_s * 1e6;
    let plan = phased.plan().expect("built").to_vec();
    let phases = per_phase
        .iter()
        .zip(&plan)
        .zip(phase_names(&plan))
        .map(|((t, ph), name)| {
            let us = Summary::of(t).expect("timed");
            let op_bytes = model.by_op.iter().find(|b| b.op == ph.op).expect("every operation has bytes").bytes;
            let bytes = (op_bytes as f64 * ph.share).round() as u64;
            PhaseTime {
                phase: name,
                bytes,
                x_floor: us.median / floor_us(bytes),
                share: us.median / phases_sum_us,
                us,
                dram_bytes_read: None,
            }
        })
        .collect::<Vec<PhaseTime>>();
    let mut phases = phases;
    // One eviction buffer (twice L2) for the audited pass and the traced launches.
    let mut evict = L2Eviction::new(dev, 2)?;
    let unaudited = match audit_phases(dev, cfg, &mut phased, &mut evict, input_seed, phases.len() as u32) {
        Ok(read) => {
            for (ph, bytes) in phases.iter_mut().zip(read) {
                ph.dram_bytes_read = Some(bytes);
            }
            None
        }
        Err(reason) => Some(reason),
    };
    let names: Vec<String> = phases.iter().map(|p| p.phase.clone()).collect();
    let floors: Vec<f64> = phases.iter().map(|p| floor_us(p.bytes)).collect();
    let blocks: Vec<Blocks> = plan.iter().map(|p| p.blocks).collect();
    let timeline = trace(dev, cfg, &mut fused, &mut evict, input_seed, &names, &floors, &blocks)?;
    let fused_us = Summary::of(&fused_us).expect("timed");
    let (grid, smem) = fused.launch_shape().expect("built");
    let mut launch = launch::probes(dev, grid, megakernel::THREADS, smem)?;
    let x = generate_input(dev, cfg, input_seed, 0)?;
    let all = fused.phases().expect("built");
    let mut step = || -> Result<(), GraderError> {
        Ok(fused.launch_phases(dev, &x, cfg.deepest_timed_pos(), None, &mut out, 0..all)?)
    };
    let (api_us, round_trip_us) = launch::time(dev, &mut step)?;
    let step_kernel_us = launch::kernel_us(dev, &mut step)?;
    launch.push(LaunchPart { what: launch::STEP.into(), api_us, round_trip_us });
    let mut launch_unmeasured = Vec::new();
    for row in launch::observed(dev, &mut step) {
        match row {
            Ok(part) => launch.push(part),
            Err(why) => launch_unmeasured.push(why),
        }
    }
    Ok(Profile {
        launch,
        launch_unmeasured,
        step_kernel_us,
        config: cfg.name.clone(),
        plan: fused.describe(cfg, cfg.deepest_timed_pos()).expect("built"),
        floor_tbps: floor_bytes_per_s / 1e12,
        phases,
        phases_sum_us,
        fused_x_floor: fused_us.median / floor_us(model.total),
        fused_us,
        unaudited,
        timeline,
    })
}

/// [`TRACED_STEPS`] fused launches at the deepest timed position, each after an L2 eviction; the
/// timeline of median length, or `None` when any trace was incomplete.
#[allow(clippy::too_many_arguments)]
fn trace(
    dev: &Device,
    cfg: &Config,
    fused: &mut Megakernel,
    evict: &mut L2Eviction,
    input_seed: u64,
    names: &[String],
    floors_us: &[f64],
    blocks_of: &[Blocks],
) -> Result<Option<Timeline>, GraderError> {
    let mut out = dev.stream().alloc_zeros(cfg.d).context("allocating the output")?;
    let mut traced = Vec::with_capacity(TRACED_STEPS);
    for s in 0..TRACED_STEPS {
        let x = generate_input(dev, cfg, input_seed, s)?;
        evict.enqueue(dev)?;
        dev.synchronize()?;
        let t = fused.trace_step(dev, &x, cfg.deepest_timed_pos(), None, &mut out)?;
        match Timeline::of(&t.stamps, t.grid, names, floors_us, blocks_of) {
            Some(t) => traced.push(t),
            None => return Ok(None),
        }
    }
    traced.sort_by(|a, b| a.total_us.total_cmp(&b.total_us));
    Ok(Some(traced.swap_remove(TRACED_STEPS / 2)))
}

/// Each phase's name: its operation's, numbered when the program splits the operation into parts
/// (`Qkv 1/2`, `Qkv 2/2`).
fn phase_names(plan: &[PhasePlan]) -> Vec<String> {
    plan.iter()
        .enumerate()
        .map(|(i, p)| {
            let same: Vec<usize> = (0..plan.len()).filter(|&j| plan[j].op == p.op).collect();
            match same.len() {
                1 => format!("{:?}", p.op),
                n => format!("{:?} {}/{n}", p.op, same.iter().position(|&j| j == i).unwrap() + 1),
            }
        })
        .collect()
}

/// Steps of the audited pass.
const AUDITED_STEPS: usize = 4;

/// The DRAM bytes each phase reads: every phase launch of [`AUDITED_STEPS`] steps in a range of its
/// own, L2 evicted before each (as in a run); the median per phase. `Err` says why not.
fn audit_phases(
    dev: &Device,
    cfg: &Config,
    phased: &mut Megakernel,
    evict: &mut L2Eviction,
    input_seed: u64,
    phases: u32,
) -> Result<Vec<f64>, String> {
    let mut audit = RangeAudit::enable(dev.ctx(), &[DRAM_BYTES_READ], AUDITED_STEPS * phases as usize)
        .map_err(|e| e.to_string())?;
    let cuda = |e: CudaError| e.to_string();
    let mut out = dev.stream().alloc_zeros(cfg.d).map_err(|e| e.to_string())?;
    for s in 0..AUDITED_STEPS {
        let x = generate_input(dev, cfg, input_seed, s).map_err(cuda)?;
        for p in 0..phases {
            evict.enqueue(dev).map_err(cuda)?;
            dev.synchronize().map_err(cuda)?;
            audit.push(&format!("step {s} phase {p}")).map_err(|e| e.to_string())?;
            phased.launch_phases(dev, &x, cfg.prefill + s, None, &mut out, p..p + 1).map_err(|e| e.to_string())?;
            audit.pop().map_err(|e| e.to_string())?;
        }
    }
    let ranges = audit.finish().map_err(|e| e.to_string())?;
    Ok((0..phases as usize)
        .map(|p| {
            let read: Vec<f64> = ranges.iter().skip(p).step_by(phases as usize).map(|r| r.values[0]).collect();
            Summary::of(&read).map_or(f64::NAN, |s| s.median)
        })
        .collect())
}

pub fn table(p: &Profile) -> String {
    let mut s = format!("\nmegakernel phases ('{}' config, floor bandwidth {:.3} TB/s)\n", p.config, p.floor_tbps);
    let _ = writeln!(s, "  plan: {}", p.plan);
    let _ = writeln!(
        s,
        "  {:<15} {:>14} {:>10} {:>10} {:>8} {:>7} {:>14} {:>8}",
        "phase", "bytes", "median us", "p90 us", "x floor", "share", "DRAM read", "TB/s"
    );
    for ph in &p.phases {
        let (read, tbps) = match ph.dram_bytes_read {
            Some(b) => (format!("{b:.0}"), format!("{:.2}", b / (ph.us.median * 1e-6) / 1e12)),
            None => ("-".into(), "-".into()),
        };
        let _ = writeln!(
            s,
            "  {:<15} {:>14} {:>10.1} {:>10.1} {:>8.3} {:>7.3} {read:>14} {tbps:>8}",
            ph.phase, ph.bytes, ph.us.median, ph.us.p90, ph.x_floor, ph.share
        );
    }
    if let Some(why) = &p.unaudited {
        let _ = writeln!(s, "  DRAM bytes per phase: unaudited: {why}");
    }
    let _ = writeln!(s, "  phases, one launch each: {:.1} us", p.phases_sum_us);
    let _ = writeln!(s, "  fused, one launch:       {:.1} us = {:.3}x floor", p.fused_us.median, p.fused_x_floor);
    let _ = writeln!(s, "\nthe launch path (host clock, medians; without the judge's signalling)");
    let _ = writeln!(s, "  {:<74} {:>8} {:>15}", "launch", "call us", "call + sync us");
    for l in &p.launch {
        let _ = writeln!(s, "  {:<74} {:>8.1} {:>15.1}", l.what, l.api_us, l.round_trip_us);
    }
    for why in &p.launch_unmeasured {
        let _ = writeln!(s, "  not measured: {why}");
    }
    if let Some(step) = p.launch.iter().find(|l| l.what == launch::STEP) {
        let _ = writeln!(
            s,
            "  the step's kernel by events, back to back: {:.1} us; its plain round trip beyond it: {:.1} us",
            p.step_kernel_us,
            step.round_trip_us - p.step_kernel_us
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use spec::LayerOp;

    use super::*;

    #[test]
    fn split_operations_are_numbered_and_whole_ones_not() {
        let phase = |op: LayerOp| PhasePlan { op, share: 1.0, blocks: Blocks::first(1) };
        let plan = [phase(LayerOp::Qkv), phase(LayerOp::Qkv), phase(LayerOp::Attention), phase(LayerOp::GateUp)];
        assert_eq!(phase_names(&plan), ["Qkv 1/2", "Qkv 2/2", "Attention", "GateUp"]);
    }
}
