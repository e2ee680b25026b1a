//! The grader binary: parses arguments, runs the command, maps the result to an exit code.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = grader::cli::Cli::parse();
    match grader::run(cli) {
        Ok(outcome) => outcome.exit_code(),
        Err(e) => {
            eprintln!("grader: {e}");
            ExitCode::from(grader::error::EXIT_ERROR)
        }
    }
}
