//! **lingerer**: the megakernel, honest and fast, plus two processes started in `build_layer` and
//! left running when the runner exits: one in the runner's session, one detached into a session of
//! its own (as a daemon detaches itself, so that its parent's death hands it to init).
//!
//! Not an exploit of a gate but of the machine: a process left behind outlives the grader, keeps
//! what it holds, and can load the host for whatever runs next (another submission's judgement
//! among them). Handled by the judge, outside the submission's reach: the runner is started in a
//! session of its own with the judge as the reaper of its orphans, and once it has exited the judge
//! kills every process of that session and every orphan that came to it (`submission::child`),
//! naming them in the report; the verdict is the megakernel's own.

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

use cuda::Device;
use spec::Config;
use submission::{Layer, Submission, SubmissionError};

use super::honest::{Extra, WithExtra};

pub const NAME: &str = "lingerer";

/// The processes left behind, which the judge must find and kill.
pub const LEFT: usize = 2;
/// How long each would otherwise live, in seconds: far longer than any run.
const LINGER_S: &str = "3600";

pub fn make() -> Box<dyn Submission> {
    WithExtra::boxed(NAME, Lingerer)
}

struct Lingerer;

impl Extra for Lingerer {
    fn build(&mut self, _dev: &Device, _layer: &Layer<'_>, _cfg: &Config) -> Result<(), SubmissionError> {
        for detach in [false, true] {
            let mut sleeper = Command::new("sleep");
            sleeper.arg(LINGER_S).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
            if detach {
                // SAFETY: setsid is async-signal-safe; it makes the child a session (and group) of its own.
                unsafe {
                    sleeper.pre_exec(|| if libc::setsid() < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) })
                };
            }
            // The handle is dropped, not waited for: the process stays when the runner goes.
            sleeper
                .spawn()
                .map_err(|e| SubmissionError::Refused(format!("starting a process to leave behind: {e}")))?;
        }
        Ok(())
    }
}
