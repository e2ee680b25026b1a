//! The command line: subcommands and their options, with help that teaches. Each subcommand takes
//! only the options it uses, so a misplaced option is refused instead of silently ignored; values
//! are parsed here, and whatever needs the file system is checked by `preflight` before any device
//! opens.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

const ABOUT: &str = "Judges submissions to the persistent-layer task: one Llama-style decoder layer \
(70B class, batch 1, 4096 cached positions) per call, checked for correctness against an eager \
reference, counted for kernel launches with CUPTI, and timed against the bandwidth floor. \
The task statement is docs/task.md; `grader spec` prints its figures.";

const AFTER_HELP: &str = "\
Exit codes: 0 every gate (or check) passed, 1 a gate failed, 2 the grader could not judge (bad
arguments, no GPU, ...). `grader <command> --help` explains each command's options.

Examples:
  grader spec                         the task statement, schedule, gates and byte model
  grader spec --config tiny --json    a small config as JSON, a file --config accepts
  grader list                         every built-in submission and red-team adversary
  grader bandwidth                    measure the HBM bandwidth (the floor's denominator)
  grader selftest                     check the grader's own GPU code against the CPU golden model
  grader selftest --list              name every check, for --filter to pick some
  grader run --submission megakernel  judge a submission (prints a table, writes JSON with --json)
  grader run --submission submission/examples/python/eager_layer.py --config small
                                      judge a Python module (the task's contract in Python)";

const SUBMISSION_HELP: &str = "Submission: a built-in name (`grader list` names them all), the path of a shared \
library speaking the C ABI of submission/include/persistent_layer.h, or the path of a Python module (.py) defining \
build_layer(weights, kv_cache, cfg, max_seq_len) and layer_step(handle, x, pos) with torch tensors (see \
submission/examples/python/). Names come first: a file named like one is given as ./NAME.";

const PYTHON_HELP: &str = "The Python interpreter a .py submission runs in (default: $PYTHON, else python3 on \
PATH). It needs torch, and a shared libpython: the grader embeds it, importing the module in its own runner \
process, so the module is measured like any other submission.";

const SEED_HELP: &str = "Public seed of the weights and the KV prefix (decimal, or hex with 0x).";

#[derive(Debug, Parser)]
#[command(name = "grader", version, about = ABOUT, after_help = AFTER_HELP)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Judge a submission end to end: correctness, launch gates, speed against the floor.
    Run(RunArgs),
    /// Measure HBM bandwidth: a 16-byte stream copy and the driver's copy (the floor takes the faster),
    /// and two read-only streams, 16-byte loads and, on Hopper, bulk copies into shared memory (the
    /// read-only ceiling of plausible_timing takes the faster).
    Bandwidth(BandwidthArgs),
    /// List the kernels of one step of a submission (name, grid, block, registers, time, share).
    Launches(LaunchesArgs),
    /// Time each phase of the megakernel's phase-per-launch mode against its own floor; for a stack
    /// (`--config stack-70b`), the whole step in one launch, each layer's time in it and each kind of
    /// phase's part of it (hand-off, median block, later blocks; a block's input, stream and tail), as
    /// `megakernel bench --trace` reads a model's.
    Profile(ProfileArgs),
    /// Print the task statement, schedule, gates and byte model of a configuration.
    Spec(SpecArgs),
    /// Name every built-in submission and red-team adversary, one line each.
    List,
    /// Check the grader's GPU code (RNG, reference ops, full-size step) against the CPU golden model.
    Selftest(SelftestArgs),
    /// The family check: judge honest submissions over the Llama family's layer shapes and contexts,
    /// and fail if any honest run is failed (a false failure is the grader's bug).
    Sweep(SweepArgs),
    /// The process a submission runs in, started by `grader run` (reads its job on stdin).
    #[command(hide = true)]
    Runner,
    /// Loads a submission library and checks its ABI, in a process of its own so that the library's
    /// code never runs inside the judge; started by the argument checks of `run` and `launches`.
    #[command(hide = true)]
    CheckLibrary(CheckLibraryArgs),
}

#[derive(Debug, Args)]
pub struct DeviceArg {
    /// CUDA device ordinal: 0, 1, 2, ...
    #[arg(long = "device", default_value_t = 0, value_name = "N", value_parser = parse_device, allow_hyphen_values = true)]
    pub ordinal: usize,
}

#[derive(Debug, Args)]
pub struct ConfigArg {
    /// Configuration: graded, small, tiny, a member of the family `grader sweep` judges (llama-3.2-1b,
    /// llama-3-8b, 70b-128k, ...: `grader sweep --help` lists them), a named stack judged as a whole
    /// (stack-1b, stack-8b, stack-70b; stack-405b, 805 GB, is refused where one GPU cannot hold it), or the
    /// path of a JSON file with every field (`grader spec --config tiny --json` prints one).
    #[arg(long, default_value = "graded", value_name = "NAME|FILE")]
    pub config: String,
}

/// The submission, and the interpreter of a `.py` one.
#[derive(Debug, Args)]
pub struct SubmissionArg {
    #[arg(long = "submission", value_name = "NAME|PATH", help = SUBMISSION_HELP)]
    pub name: String,
    #[arg(long, value_name = "PATH", help = PYTHON_HELP)]
    pub python: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub submission: SubmissionArg,
    #[command(flatten)]
    pub config: ConfigArg,
    #[arg(long, default_value_t = spec::DEFAULT_SEED, value_parser = parse_seed, allow_hyphen_values = true,
          help = SEED_HELP)]
    pub seed: u64,
    /// Also write the JSON report to this file ('-' for stdout); the table goes to stderr either way.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Print only the verdict line on stderr.
    #[arg(long)]
    pub quiet: bool,
    /// Also write config, weights, KV prefix, every input and both sides' outputs here as
    /// safetensors with a manifest, to re-check the verdict outside the grader.
    #[arg(long, value_name = "DIR")]
    pub dump: Option<PathBuf>,
    /// Judge without the hardware counters (each call's DRAM bytes and thread blocks, read by the
    /// judge's own PM sampling): the verdict is then UNAUDITED, exit code 1, never PASS. Without this
    /// option a device whose counters cannot be read gives the same verdict, with the reason.
    #[arg(long)]
    pub no_audit: bool,
    #[command(flatten)]
    pub device: DeviceArg,
}

#[derive(Debug, Args)]
pub struct LaunchesArgs {
    #[command(flatten)]
    pub submission: SubmissionArg,
    #[command(flatten)]
    pub config: ConfigArg,
    #[arg(long, default_value_t = spec::DEFAULT_SEED, value_parser = parse_seed, allow_hyphen_values = true,
          help = SEED_HELP)]
    pub seed: u64,
    /// Print no progress lines, only the table.
    #[arg(long)]
    pub quiet: bool,
    #[command(flatten)]
    pub device: DeviceArg,
}

#[derive(Debug, Args)]
pub struct ProfileArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    #[arg(long, default_value_t = spec::DEFAULT_SEED, value_parser = parse_seed, allow_hyphen_values = true,
          help = SEED_HELP)]
    pub seed: u64,
    /// Also write the phases as JSON to this file ('-' for stdout).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Also draw the fused launch's timeline as SVG into this file: one row per block, a colour per
    /// phase, white where a block waits for the phases it depends on; blocks that run the same phases
    /// are drawn together.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
    /// Lay the layer out in this many roles instead of the compiler's choice (the plan line says
    /// which it chose): 2, the grid's halves taking turns between streaming weights and attention; 1,
    /// one role: every phase on every block, but Qkv and the O projection leave attention's first
    /// blocks to it.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=2))]
    pub roles: Option<u32>,
    /// Run the MLP in this many parts of ffn instead of the compiler's choice (1 to 3; a layer whose
    /// ffn is over the stream's row of 28672 needs at least 2).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=3))]
    pub mlp_parts: Option<u32>,
    /// Print no progress lines, only the table.
    #[arg(long)]
    pub quiet: bool,
    #[command(flatten)]
    pub device: DeviceArg,
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
    #[command(flatten)]
    pub device: DeviceArg,
}

#[derive(Debug, Args)]
pub struct SpecArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// Print the configuration as JSON (a file `--config` accepts) instead of the statement.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct SelftestArgs {
    /// Run only the checks whose name contains this text, in any case (`grader selftest --list`
    /// names them all).
    #[arg(long, value_name = "TEXT")]
    pub filter: Option<String>,
    /// Name every check (those --filter selects, with it), one line each, and run none.
    #[arg(long, conflicts_with_all = ["log", "seed", "ordinal"])]
    pub list: bool,
    /// Write every check's full detail to this file.
    #[arg(long, value_name = "FILE")]
    pub log: Option<PathBuf>,
    #[arg(long, default_value_t = spec::DEFAULT_SEED, value_parser = parse_seed, allow_hyphen_values = true,
          help = SEED_HELP)]
    pub seed: u64,
    #[command(flatten)]
    pub device: DeviceArg,
}

#[derive(Debug, Args)]
pub struct SweepArgs {
    /// Family members to judge, comma-separated (default: all): llama-3.2-1b, llama-3.2-3b,
    /// llama-3-8b, qwen-7b, llama-2-13b, qwen-32b, glm-4-9b, gemma-hd256, graded, 70b-8k, 70b-16k,
    /// 70b-32k, 70b-128k, 405b. `grader spec --config NAME` prints any of them.
    #[arg(long, value_delimiter = ',', value_name = "NAME,...")]
    pub configs: Option<Vec<String>>,
    /// Built-in submissions to judge at each member, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "megakernel,reference", value_name = "NAME,...")]
    pub submissions: Vec<String>,
    /// Runs of each submission at each member.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub runs: u32,
    /// Weight seeds of the honest ensemble at each member (the CPU variants of `grader selftest`'s
    /// ensemble beside the eager reference, each to stay within half the tolerance); 0 skips it.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(0..=64), value_name = "N")]
    pub ensemble_seeds: u64,
    /// Write every run's whole table to this file.
    #[arg(long, value_name = "FILE")]
    pub log: Option<PathBuf>,
    #[command(flatten)]
    pub device: DeviceArg,
}

#[derive(Debug, Args)]
pub struct CheckLibraryArgs {
    /// The library to load.
    pub path: PathBuf,
}

fn positive_gib(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|_| format!("'{s}' is not a number"))?;
    if (0.0625..=64.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{v} GiB is out of range: use 0.0625 to 64 (several times the L2 size)"))
    }
}

/// A seed: any u64, in decimal or as 0x-prefixed hex. Negative values reach this parser (rather
/// than being taken for an option) so that `--seed -1` is answered with the range.
fn parse_seed(s: &str) -> Result<u64, String> {
    let parsed = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => s.parse(),
    };
    parsed.map_err(|_| format!("a seed is a whole number from 0 to {} (decimal, or hex with 0x)", u64::MAX))
}

/// A device ordinal. Negative values reach this parser (rather than being taken for an option) so
/// that `--device -1` is answered with what an ordinal is.
fn parse_device(s: &str) -> Result<usize, String> {
    s.parse().map_err(|_| "a device is a CUDA ordinal: 0, 1, 2, ...".to_string())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn the_cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn seeds_parse_in_decimal_and_hex_and_refuse_negatives() {
        assert_eq!(parse_seed("42"), Ok(42));
        assert_eq!(parse_seed("0x5EED0001"), Ok(spec::DEFAULT_SEED));
        assert_eq!(parse_seed(&u64::MAX.to_string()), Ok(u64::MAX));
        for bad in ["-1", "1e3", "0x", "18446744073709551616", ""] {
            assert!(parse_seed(bad).unwrap_err().contains("whole number from 0"), "{bad}");
        }
    }

    #[test]
    fn devices_are_ordinals() {
        assert_eq!(parse_device("1"), Ok(1));
        for bad in ["-1", "gpu0", ""] {
            assert!(parse_device(bad).unwrap_err().contains("a device is a CUDA ordinal"), "{bad}");
        }
    }
}
