//! The command line: subcommands and their options, with help that teaches.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

const ABOUT: &str = "Judges submissions to the persistent-layer task: one Llama-style decoder layer \
(70B class, batch 1, 4096 cached positions) per call, checked for correctness against an eager \
reference, counted for kernel launches with CUPTI, and timed against the bandwidth floor.";

const AFTER_HELP: &str = "\
Exit codes: 0 every gate (or check) passed, 1 a gate failed, 2 the grader could not judge.

Examples:
  grader spec                         the task statement and byte model of the graded config
  grader spec --config tiny --json    a small config as JSON
  grader bandwidth                    measure the HBM stream-copy bandwidth (the floor's denominator)
  grader selftest                     check the grader's own GPU code against the CPU golden model
  grader run --submission megakernel  judge a submission (prints a table, writes JSON with --json)";

#[derive(Debug, Parser)]
#[command(name = "grader", version, about = ABOUT, after_help = AFTER_HELP)]
pub struct Cli {
    /// CUDA device ordinal.
    #[arg(long, global = true, default_value_t = 0)]
    pub device: usize,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Judge a submission end to end: correctness, launch gates, speed against the floor.
    Run(SubmissionArgs),
    /// Measure HBM bandwidth with a 16-byte stream copy, a read-only stream and the driver's copy.
    Bandwidth(BandwidthArgs),
    /// List the kernels of one step of a submission (name, grid, block, registers, time, share).
    Launches(SubmissionArgs),
    /// Time each phase of the megakernel's phase-per-launch mode against its own floor.
    Profile(ProfileArgs),
    /// Print the task statement, gates and byte model of a configuration.
    Spec(SpecArgs),
    /// Check the grader's GPU code (RNG, reference ops, full-size step) against the CPU golden model.
    Selftest(SelftestArgs),
    /// The process a submission runs in, started by `grader run` (reads its job on stdin).
    #[command(hide = true)]
    Runner,
}

#[derive(Debug, Args)]
pub struct ConfigArg {
    /// Configuration: graded, small, tiny, or the path of a JSON file with every field.
    #[arg(long, default_value = "graded", value_name = "NAME|FILE")]
    pub config: String,
}

/// The arguments of `run`.
pub type RunArgs = SubmissionArgs;

#[derive(Debug, Args)]
pub struct SubmissionArgs {
    /// Submission to judge: a built-in name (reference, megakernel) or the path of a shared library.
    #[arg(long, value_name = "NAME|PATH")]
    pub submission: String,
    #[command(flatten)]
    pub config: ConfigArg,
    /// Public seed of the weights and the KV prefix.
    #[arg(long, default_value_t = spec::DEFAULT_SEED)]
    pub seed: u64,
    /// Write the JSON report here instead of stdout.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Print only the verdict line on stderr.
    #[arg(long)]
    pub quiet: bool,
    /// (run) Fail the run when the DRAM-traffic audit cannot run (no access to hardware counters);
    /// a leaderboard sets this.
    #[arg(long)]
    pub require_audit: bool,
    /// (run) Also write config, weights, KV prefix, every input and both sides' outputs here as
    /// safetensors with a manifest, to re-check the verdict outside the grader.
    #[arg(long, value_name = "DIR")]
    pub dump: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct ProfileArgs {
    #[command(flatten)]
    pub submission: SubmissionArgs,
    /// Also draw the phases as an SVG bar chart into this file.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct BandwidthArgs {
    /// Size of each buffer in GiB (source and destination); far larger than L2 by default.
    #[arg(long, default_value_t = 2.0, value_parser = positive_gib)]
    pub gib: f64,
    /// Timed repetitions of each measurement.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u32).range(3..=10_000))]
    pub reps: u32,
    /// Also write the result as JSON to this file ('-' for stdout).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct SpecArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// Print the configuration, gates and byte model as JSON instead of the statement.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct SelftestArgs {
    /// Run only the checks whose name contains this text.
    #[arg(long, value_name = "TEXT")]
    pub filter: Option<String>,
    /// Write every check's full detail to this file.
    #[arg(long, value_name = "FILE")]
    pub log: Option<PathBuf>,
    /// Public seed of the weights and the KV prefix.
    #[arg(long, default_value_t = spec::DEFAULT_SEED)]
    pub seed: u64,
}

fn positive_gib(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|_| format!("'{s}' is not a number"))?;
    if (0.0625..=64.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{v} GiB is out of range: use 0.0625 to 64 (several times the L2 size)"))
    }
}
