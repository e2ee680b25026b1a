//! The grader's error type and its exit codes: 0 every gate passed, 1 a gate (or a selftest check)
//! failed, 2 the grader could not judge.

use std::process::ExitCode;

/// Every gate passed / every check passed.
pub const EXIT_PASS: u8 = 0;
/// A gate or a check failed: the verdict is a fail.
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
