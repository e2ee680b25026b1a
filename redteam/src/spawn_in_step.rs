//! **spawn-in-step**: the megakernel, honest and fast; on its third call it starts a process
//! (`true`) before launching.
//!
//! The exploit: a process started during the calls could do work the runner's records never see (or
//! a compiler could run where no build time is allowed). Caught by the runner's sandbox: once
//! `build_layer` has returned, a seccomp filter kills the runner on any system call that makes a
//! process, and the judge reads the death by SIGSYS as "tried to start a process during the calls".

use std::process::Command;

use cuda::Device;
use submission::{Submission, SubmissionError};

use super::CallCount;
use super::honest::{Extra, WithExtra};

pub const NAME: &str = "spawn-in-step";

/// The call (from 0) that starts a process: the third, so the run is well under way.
const SPAWN_AT_CALL: usize = 2;

pub fn make() -> Box<dyn Submission> {
    WithExtra::boxed(NAME, SpawnInStep { calls: CallCount::default() })
}

struct SpawnInStep {
    calls: CallCount,
}

impl Extra for SpawnInStep {
    fn before_step(&mut self, _dev: &Device) -> Result<(), SubmissionError> {
        if self.calls.next() == SPAWN_AT_CALL {
            // Under the runner's filter this never returns; anywhere else its outcome does not matter.
            let _ = Command::new("true").status();
        }
        Ok(())
    }
}
