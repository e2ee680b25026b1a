//! The grader's error type and its exit codes: 0 every gate passed, 1 a gate (or a selftest check)
//! failed or the run ended crashed, timeout or unsupported, 2 the grader could not judge. Every error, a parse error of the command line included,
//! reaches the user as one line, `grader: <what went wrong and what to do>`.

use std::process::ExitCode;

/// Every gate passed / every check passed.
pub const EXIT_PASS: u8 = 0;
/// A gate or a check failed, or the submission crashed, timed out or declined the config
/// (`unsupported`): the verdict is not a pass.
pub const EXIT_FAIL: u8 = 1;
/// Nothing could be judged: bad arguments, no device, an internal error.
pub const EXIT_ERROR: u8 = 2;

#[derive(Debug, thiserror::Error)]
pub enum GraderError {
    #[error(transparent)]
    Spec(#[from] spec::SpecError),
    #[error(transparent)]
    Cuda(#[from] cuda::CudaError),
    #[error(transparent)]
    Submission(#[from] submission::SubmissionError),
    #[error(transparent)]
    Cupti(#[from] crate::cupti::CuptiError),
    #[error("could not write {path}: {source}")]
    Write { path: String, source: std::io::Error },
    #[error("{0}")]
    Usage(String),
    #[error("the runner (the submission's process) could not be used: {0}")]
    Runner(String),
    /// A measurement came back unusable (e.g. a trace with missing stamps).
    #[error("{0}")]
    Measurement(String),
}

impl GraderError {
    /// The exit code of a command that ended in this error: nothing could be judged.
    pub fn exit_code(&self) -> ExitCode {
        ExitCode::from(EXIT_ERROR)
    }

    /// A command-line parse error as one line: clap's first paragraph without its `error:` prefix
    /// and line breaks, clap's tips (`a similar argument exists: '--json'`), and where to read what
    /// `command` (`grader run`, say) takes.
    pub fn from_clap(e: &clap::Error, command: &str) -> Self {
        let rendered = e.render().to_string();
        let one_line = |text: &str| text.split_whitespace().collect::<Vec<_>>().join(" ");
        let mut paragraphs = rendered.split("\n\n").map(one_line);
        let first = paragraphs.next().unwrap_or_default();
        let mut message = first.strip_prefix("error: ").unwrap_or(&first).to_string();
        for tip in paragraphs.filter(|p| p.starts_with("tip: ")) {
            message += &format!("; {tip}");
        }
        GraderError::Usage(format!("{message} (`{command} --help` lists what it takes)"))
    }
}

/// What a command concluded, mapped to the exit code in one place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Pass,
    Fail,
}

impl Outcome {
    pub fn exit_code(self) -> ExitCode {
        ExitCode::from(match self {
            Outcome::Pass => EXIT_PASS,
            Outcome::Fail => EXIT_FAIL,
        })
    }
}
