//! `grader launches`: the kernels of one step of a submission, as CUPTI saw them.

use std::fmt::Write as _;

use cuda::{Context, Device};
use reference::gpu::DeviceCache;
use reference::gpu::data::generate_input;
use spec::Config;
use submission::{Layer, SubmissionError};

use crate::cli::LaunchesArgs;
use crate::cupti::{self, Activity, ActivityKind, CallWindow, Recording, Tag};
use crate::error::{GraderError, Outcome};
use crate::run::Progress;

/// Untimed steps before the recorded one, so module loads and first-touch costs stay out of it.
const WARMUP_STEPS: usize = 2;

pub fn command(device: usize, args: &LaunchesArgs) -> Result<Outcome, GraderError> {
    // Every argument is checked before the device opens, as `grader run` does.
    let cfg = Config::load(&args.config.config)?;
    cfg.require_one_layer("`grader launches`")?;
    let chosen = crate::preflight::submission(&args.submission.name, args.submission.python.as_deref())?;
    let dev = Device::open(device)?;
    // A Python module is imported only now, with the device open, as the runner does.
    let mut sub = chosen.load(device, crate::run::runner::as_runner)?;
    let progress = Progress::new(args.quiet);
    progress.say(&format!("generating the '{}' layer on the GPU", cfg.name));
    let weights = reference::gpu::generate_weights(&dev, &cfg, args.seed)?;
    let mut cache = DeviceCache::generate(&dev, &cfg, args.seed)?;
    match sub.build_layer(&dev, Layer { weights: &weights, cache: &mut cache }, &cfg) {
        // Declining a config is an answer, not an error of the grader's: said as `grader run` says it.
        Err(SubmissionError::Unsupported(why)) => {
            eprint!("{}", unsupported(sub.name(), &cfg.name, &why));
            return Ok(Outcome::Fail);
        }
        built => built?,
    }
    let input_seed: u64 = rand::random();
    let mut out = dev.stream().alloc_zeros(cfg.batch * cfg.d).context("allocating the output")?;
    let xs = (0..=WARMUP_STEPS).map(|s| generate_input(&dev, &cfg, input_seed, s)).collect::<Result<Vec<_>, _>>()?;
    dev.synchronize()?;
    let recording = Recording::start()?;
    let mut windows = Vec::new();
    for (s, x) in xs.iter().enumerate() {
        cupti::set_current(Tag::Call(s));
        let start_ns = cupti::timestamp()?;
        sub.layer_step(&dev, Layer { weights: &weights, cache: &mut cache }, x, cfg.prefill + s, &mut out)?;
        dev.synchronize()?;
        windows.push(CallWindow { start_ns, end_ns: cupti::timestamp()? });
    }
    cupti::set_current(Tag::Outside);
    let mut record =
        cupti::record::attribute(recording.finish()?, &windows, cupti::OwnWork::default(), |_| Vec::new(), Vec::new());
    let activities = record.activities.pop().unwrap_or_default();
    sub.teardown();
    eprint!("{}", table(sub.name(), &activities));
    Ok(Outcome::Pass)
}

/// One row per activity of the step, with each kernel's share of the step's kernel time.
pub fn table(submission: &str, activities: &[Activity]) -> String {
    let kernel_ns: u64 =
        activities.iter().filter(|a| a.kind == ActivityKind::Kernel).map(|a| a.end_ns - a.start_ns).sum();
    let mut s = format!("\nkernels of one step of '{submission}' ({} activities)\n", activities.len());
    let _ = writeln!(
        s,
        "  {:<3} {:<28} {:>16} {:>14} {:>5} {:>9} {:>10} {:>7}",
        "#", "name", "grid", "block", "regs", "smem B", "time us", "share"
    );
    for (i, a) in activities.iter().enumerate() {
        let ns = a.end_ns - a.start_ns;
        let share = if a.kind == ActivityKind::Kernel && kernel_ns > 0 { ns as f64 / kernel_ns as f64 } else { 0.0 };
        let dims = |d: (i32, i32, i32)| format!("{}x{}x{}", d.0, d.1, d.2);
        let _ = writeln!(
            s,
            "  {:<3} {:<28} {:>16} {:>14} {:>5} {:>9} {:>10.2} {:>7.3}",
            i,
            truncate(&a.name, 28),
            dims(a.grid),
            dims(a.block),
            a.registers,
            a.static_smem + a.dynamic_smem,
            ns as f64 / 1e3,
            share
        );
    }
    let _ = writeln!(s, "  total kernel time {:.2} us", kernel_ns as f64 / 1e3);
    s
}

/// What `grader launches` says when the submission declines the config: no step to record, and why.
fn unsupported(submission: &str, config: &str, why: &str) -> String {
    format!("\nno kernels of '{submission}': it does not support config '{config}'\nUNSUPPORTED  {why}\n")
}

fn truncate(name: &str, width: usize) -> String {
    if name.chars().count() <= width { name.into() } else { name.chars().take(width - 1).collect::<String>() + "~" }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_declined_config_is_said_with_its_reason() {
        let said = unsupported("megakernel", "big", "ffn = 53248 is over the megakernel's 28672");
        assert_eq!(
            said,
            "\nno kernels of 'megakernel': it does not support config 'big'\n\
             UNSUPPORTED  ffn = 53248 is over the megakernel's 28672\n"
        );
    }
}
