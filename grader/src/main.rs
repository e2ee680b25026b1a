//! The grader binary: parses arguments, runs the command, maps the result to an exit code (help and
//! version go to stdout with 0; every error is one line on stderr, see `error`).

use std::process::ExitCode;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser};
use grader::error::{EXIT_ERROR, GraderError};

fn main() -> ExitCode {
    let cli = match grader::cli::Cli::try_parse() {
        Ok(cli) => cli,
        // `grader` alone prints the help, and that is no error to shorten.
        Err(e) if !e.use_stderr() || e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = e.print();
            return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(EXIT_ERROR));
        }
        Err(e) => return fail(GraderError::from_clap(&e, &command_path())),
    };
    match grader::run(cli) {
        Ok(outcome) => outcome.exit_code(),
        Err(e) => fail(e),
    }
}

/// `grader SUBCOMMAND` as typed, or `grader` when no subcommand was recognised.
fn command_path() -> String {
    let cli = grader::cli::Cli::command();
    let sub = std::env::args().skip(1).find(|a| cli.find_subcommand(a).is_some());
    sub.map_or_else(|| "grader".into(), |s| format!("grader {s}"))
}

fn fail(e: GraderError) -> ExitCode {
    eprintln!("grader: {e}");
    e.exit_code()
}
