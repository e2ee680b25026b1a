//! `grader profile`: the megakernel's phase-per-launch mode timed phase by phase with events, each
//! phase against its own floor, beside the fused launch; as a table and as an SVG chart. Where the
//! GPU's counters can be read, a second pass measures the DRAM bytes each phase reads (one audit
//! range per phase launch; the ranges' own cost stays out of the timed pass).

use std::fmt::Write as _;

use cuda::{Context, CudaError, Device};
use reference::gpu::DeviceCache;
use reference::gpu::data::generate_input;
use serde::Serialize;
use spec::Config;
use submission::megakernel::program::{Op, phase_bytes};
use submission::megakernel::{Megakernel, Mode};
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
    pub floor_tbps: f64,
    pub phases: Vec<PhaseTime>,
    pub phases_sum_us: f64,
    /// The fused launch (the submission itself) on the same steps.
    pub fused_us: Summary,
    pub fused_x_floor: f64,
    /// Why the DRAM bytes per phase are missing, when they are.
    pub unaudited: Option<String>,
}

pub fn command(device: usize, args: &ProfileArgs) -> Result<Outcome, GraderError> {
    let cfg = Config::load(&args.config.config)?;
    for (flag, path) in [("--json", &args.json), ("--svg", &args.svg)] {
        if let Some(path) = path {
            crate::preflight::output_file(flag, path)?;
        }
    }
    let dev = Device::open(device)?;
    let progress = Progress::new(args.quiet);
    progress.say("measuring the copy bandwidth");
    let bw = bandwidth::measure(&dev, 2 << 30, 20)?;
    progress.say(&format!("generating the '{}' layer and building both modes", cfg.name));
    let profile = measure(&dev, &cfg, args.seed, bw.floor_bytes_per_s())?;
    eprint!("{}", table(&profile));
    if let Some(path) = &args.svg {
        crate::write_output(path, &svg(&profile))?;
    }
    if let Some(path) = &args.json {
        crate::write_output(path, &(serde_json::to_string_pretty(&profile).expect("serialises") + "\n"))?;
    }
    Ok(Outcome::Pass)
}

fn measure(dev: &Device, cfg: &Config, seed: u64, floor_bytes_per_s: f64) -> Result<Profile, GraderError> {
    let w = reference::gpu::generate_weights(dev, cfg, seed)?;
    let mut cache = DeviceCache::generate(dev, cfg, seed)?;
    let mut phased = Megakernel::new(Mode::PerPhase);
    let mut fused = Megakernel::new(Mode::Fused);
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
            let ms = dev.time_ms(|| phased.launch_phases(dev, &x, pos, &mut out, p, p + 1))?;
            if s >= WARMUP_STEPS {
                times.push(ms as f64 * 1e3);
            }
        }
        let ms = dev.time_ms(|| fused.launch_phases(dev, &x, pos, &mut out, 0, phases))?;
        if s >= WARMUP_STEPS {
            fused_us.push(ms as f64 * 1e3);
        }
    }
    let bytes = phase_bytes(cfg, cfg.deepest_timed_pos());
    let medians: Vec<f64> = per_phase.iter().map(|t| Summary::of(t).expect("timed").median).collect();
    let phases_sum_us: f64 = medians.iter().sum();
    let floor_us = |b: u64| b as f64 / floor_bytes_per_s * 1e6;
    let phases = per_phase
        .iter()
        .zip(&bytes)
        .map(|(t, &(op, b)): (&Vec<f64>, &(Op, u64))| {
            let us = Summary::of(t).expect("timed");
            PhaseTime {
                phase: format!("{op:?}"),
                bytes: b,
                x_floor: us.median / floor_us(b),
                share: us.median / phases_sum_us,
                us,
                dram_bytes_read: None,
            }
        })
        .collect::<Vec<PhaseTime>>();
    let mut phases = phases;
    let unaudited = match audit_phases(dev, cfg, &mut phased, input_seed, phases.len() as u32) {
        Ok(read) => {
            for (ph, bytes) in phases.iter_mut().zip(read) {
                ph.dram_bytes_read = Some(bytes);
            }
            None
        }
        Err(reason) => Some(reason),
    };
    let fused_us = Summary::of(&fused_us).expect("timed");
    let total: u64 = bytes.iter().map(|b| b.1).sum();
    Ok(Profile {
        config: cfg.name.clone(),
        floor_tbps: floor_bytes_per_s / 1e12,
        phases,
        phases_sum_us,
        fused_x_floor: fused_us.median / floor_us(total),
        fused_us,
        unaudited,
    })
}

/// Steps of the audited pass.
const AUDITED_STEPS: usize = 4;

/// The DRAM bytes each phase reads: every phase launch of [`AUDITED_STEPS`] steps in a range of its
/// own, L2 evicted before each (as in a run); the median per phase. `Err` says why not.
fn audit_phases(
    dev: &Device,
    cfg: &Config,
    phased: &mut Megakernel,
    input_seed: u64,
    phases: u32,
) -> Result<Vec<f64>, String> {
    let mut audit = RangeAudit::enable(dev.ctx(), &[DRAM_BYTES_READ], AUDITED_STEPS * phases as usize)
        .map_err(|e| e.to_string())?;
    let cuda = |e: CudaError| e.to_string();
    let mut evict = L2Eviction::new(dev, 2).map_err(cuda)?;
    let mut out = dev.stream().alloc_zeros(cfg.d).map_err(|e| e.to_string())?;
    for s in 0..AUDITED_STEPS {
        let x = generate_input(dev, cfg, input_seed, s).map_err(cuda)?;
        for p in 0..phases {
            evict.enqueue(dev).map_err(cuda)?;
            dev.synchronize().map_err(cuda)?;
            audit.push(&format!("step {s} phase {p}")).map_err(|e| e.to_string())?;
            phased.launch_phases(dev, &x, cfg.prefill + s, &mut out, p, p + 1).map_err(|e| e.to_string())?;
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
    let _ = writeln!(
        s,
        "  {:<10} {:>14} {:>10} {:>10} {:>8} {:>7} {:>14} {:>8}",
        "phase", "bytes", "median us", "p90 us", "x floor", "share", "DRAM read", "TB/s"
    );
    for ph in &p.phases {
        let (read, tbps) = match ph.dram_bytes_read {
            Some(b) => (format!("{b:.0}"), format!("{:.2}", b / (ph.us.median * 1e-6) / 1e12)),
            None => ("-".into(), "-".into()),
        };
        let _ = writeln!(
            s,
            "  {:<10} {:>14} {:>10.1} {:>10.1} {:>8.3} {:>7.3} {read:>14} {tbps:>8}",
            ph.phase, ph.bytes, ph.us.median, ph.us.p90, ph.x_floor, ph.share
        );
    }
    if let Some(why) = &p.unaudited {
        let _ = writeln!(s, "  DRAM bytes per phase: unaudited: {why}");
    }
    let _ = writeln!(s, "  phases, one launch each: {:.1} us", p.phases_sum_us);
    let _ = writeln!(s, "  fused, one launch:       {:.1} us = {:.3}x floor", p.fused_us.median, p.fused_x_floor);
    s
}

/// A horizontal bar per phase, its length the median time, labelled with time and x floor.
pub fn svg(p: &Profile) -> String {
    const W: f64 = 720.0;
    const LABEL: f64 = 110.0;
    const BAR_H: f64 = 26.0;
    let max = p.phases.iter().map(|ph| ph.us.median).fold(1e-9, f64::max);
    let height = 60.0 + BAR_H * p.phases.len() as f64;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{height}\" font-family=\"monospace\" font-size=\"12\">\n"
    );
    let _ = writeln!(
        s,
        "<text x=\"8\" y=\"18\">megakernel phases, '{}': fused {:.1} us = {:.3}x floor</text>",
        p.config, p.fused_us.median, p.fused_x_floor
    );
    for (i, ph) in p.phases.iter().enumerate() {
        let y = 34.0 + BAR_H * i as f64;
        let len = (W - LABEL - 170.0) * ph.us.median / max;
        // Red where a phase is far over its own floor, so the slowest phase stands out.
        let colour = if ph.x_floor > 1.2 { "#d9534f" } else { "#5b9bd5" };
        let _ = writeln!(s, "<text x=\"8\" y=\"{}\">{}</text>", y + 16.0, ph.phase);
        let _ = writeln!(
            s,
            "<rect x=\"{LABEL}\" y=\"{y}\" width=\"{len:.1}\" height=\"{}\" fill=\"{colour}\"/>",
            BAR_H - 6.0
        );
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{}\">{:.1} us, {:.2}x floor</text>",
            LABEL + len + 6.0,
            y + 16.0,
            ph.us.median,
            ph.x_floor
        );
    }
    s + "</svg>\n"
}
