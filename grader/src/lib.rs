//! The grader as a library: every command is a function a test can call without the CLI.

pub mod audit;
pub mod bandwidth;
pub mod cli;
pub mod cupti;
pub mod error;
pub mod launches;
pub mod metrics;
pub mod profile;
pub mod run;
pub mod selftest;
pub mod stats;

use std::io::Write;
use std::path::Path;

use cli::{Cli, Command};
use error::{GraderError, Outcome};
use serde::Serialize;
use spec::{ByteModel, Config, Gates};

/// Runs one command of the CLI.
pub fn run(cli: Cli) -> Result<Outcome, GraderError> {
    match cli.command {
        Command::Spec(args) => spec_command(&Config::load(&args.config.config)?, args.json),
        Command::Bandwidth(args) => bandwidth::command(cli.device, &args),
        Command::Selftest(args) => selftest::command(cli.device, &args),
        Command::Run(args) => run::command(cli.device, &args),
        Command::Runner => run::runner::command(),
        Command::Launches(args) => launches::command(cli.device, &args),
        Command::Profile(args) => profile::command(cli.device, &args),
    }
}

/// The JSON `grader spec --json` prints.
#[derive(Serialize)]
struct SpecDocument<'a> {
    config: &'a Config,
    gates: Gates,
    bytes: ByteModel,
}

fn spec_command(cfg: &Config, json: bool) -> Result<Outcome, GraderError> {
    if json {
        let doc = SpecDocument { config: cfg, gates: Gates::TASK, bytes: ByteModel::of(cfg) };
        println!("{}", serde_json::to_string_pretty(&doc).expect("spec serialises"));
    } else {
        print!("{}", spec::statement(cfg));
    }
    Ok(Outcome::Pass)
}

/// Writes `text` to `path`, or to stdout when the path is `-`.
pub fn write_output(path: &Path, text: &str) -> Result<(), GraderError> {
    let err = |source| GraderError::Write { path: path.display().to_string(), source };
    if path == Path::new("-") {
        std::io::stdout().write_all(text.as_bytes()).map_err(err)
    } else {
        std::fs::write(path, text).map_err(err)
    }
}
