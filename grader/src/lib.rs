//! The grader as a library: every command is a function a test can call without the CLI.

pub mod audit;
pub mod bandwidth;
pub mod builtins;
pub mod cli;
pub mod cupti;
pub mod ensemble;
pub mod error;
pub mod kernels;
pub mod launches;
pub mod metrics;
pub mod output;
pub mod preflight;
pub mod profile;
pub mod run;
pub mod selftest;
pub mod stats;
pub mod sweep;

use cli::{Cli, Command};
use error::{GraderError, Outcome};
use spec::Config;

/// Runs one command of the CLI.
pub fn run(cli: Cli) -> Result<Outcome, GraderError> {
    match cli.command {
        Command::Spec(args) => spec_command(&Config::load(&args.config.config)?, args.json),
        Command::List => list_command(),
        Command::Bandwidth(args) => bandwidth::command(args.device.ordinal, &args),
        Command::Selftest(args) => selftest::command(args.device.ordinal, &args),
        Command::Sweep(args) => sweep::command(args.device.ordinal, &args),
        Command::Run(args) => run::command(args.device.ordinal, &args),
        Command::Runner => run::runner::command(),
        Command::CheckLibrary(args) => preflight::check_library_command(&args.path),
        Command::Launches(args) => launches::command(args.device.ordinal, &args),
        Command::Profile(args) => profile::command(args.device.ordinal, &args),
    }
}

/// `grader spec`: the statement, or with `--json` the config alone, as a file `--config` accepts.
fn spec_command(cfg: &Config, json: bool) -> Result<Outcome, GraderError> {
    if json {
        println!("{}", serde_json::to_string_pretty(cfg).expect("a config serialises"));
    } else {
        print!("{}", spec::statement(cfg));
    }
    Ok(Outcome::Pass)
}

/// `grader list`: what `--submission` accepts by name, one line each.
fn list_command() -> Result<Outcome, GraderError> {
    print!("{}", list());
    Ok(Outcome::Pass)
}

/// The text of `grader list`.
pub fn list() -> String {
    let width =
        crate::builtins::BUILTIN.iter().map(|b| b.name).chain(redteam::names()).map(str::len).max().unwrap_or_default();
    let mut s = String::from("Built-in submissions (--submission NAME):\n");
    for b in crate::builtins::BUILTIN {
        s += &format!("  {:<width$}  {}\n", b.name, b.what);
    }
    s += "\nRed-team adversaries, each a trick the grader must catch (`grader selftest --filter \"red team\"`):\n";
    for a in redteam::ALL {
        s += &format!("  {:<width$}  {}\n", a.name, a.what);
    }
    s += "\nAny other submission is a shared library given by its path, speaking the C ABI of\n\
          submission/include/persistent_layer.h (scripts/build-example builds an example), or a Python\n\
          module (.py) with the task's contract in torch, run in the interpreter of --python, $PYTHON or\n\
          python3 (examples: submission/examples/python/eager_layer.py and triton_layer.py).\n";
    let python = redteam::python::ALL;
    let width = python.iter().map(|a| a.file.len()).max().unwrap_or_default();
    s += &format!(
        "\nPython red-team adversaries in {}/, each a module the grader must catch\n\
         (`grader selftest --filter python:`):\n",
        redteam::python::FOLDER
    );
    for a in python {
        s += &format!("  {:<width$}  {}\n", a.file, a.what);
    }
    s
}
