//! The verdict as pure code: each gate from what was measured, with who measured it. Nothing here
//! touches the GPU, so every rule is tested on synthetic data.
//!
//! - [`correctness`]: the judge's own reads (outputs, cache, read-only buffers);
//! - [`launches`]: kernels per call, dominant share, the integrity of the launch record (recorded
//!   inside the runner, cross-checked against the hardware) and its coverage of the judge's clock;
//! - [`physics`]: DRAM bytes read (hardware counters) and the timing bound (the read-only ceiling
//!   measured in the same run);
//! - [`environment`]: no other process on the GPU, no persisting L2.

pub mod correctness;
pub mod environment;
pub mod launches;
pub mod physics;

use serde::Serialize;

pub use correctness::{CacheCheck, Integrity, StepCheck, correctness_gate};

/// Who measured what a gate rests on: a submission can reach everything inside its runner process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// The judge's own process: its clock, its reads of the shared buffers, NVML.
    Judge,
    /// CUPTI inside the runner, where the submission's code also runs: the runner's word,
    /// cross-checked against the judge's clock.
    Runner,
    /// The GPU's hardware counters, read through CUPTI inside the runner.
    Hardware,
}

/// One gate's verdict and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Gate {
    pub name: &'static str,
    pub source: Source,
    pub passed: bool,
    /// What was measured (its meaning depends on the gate).
    pub value: f64,
    /// The limit it was held to.
    pub limit: f64,
    /// One sentence a person reads.
    pub detail: String,
}

/// The gates' names, in the order a report lists them.
pub const NAMES: [&str; 9] = [
    "correctness",
    "kernels_per_step",
    "dominant_share",
    "launch_record",
    "record_coverage",
    "exclusive_gpu",
    "bytes_read",
    "l2_persisting",
    "plausible_timing",
];

#[cfg(test)]
mod tests {
    /// The red team names gates by these strings; the two lists must agree.
    #[test]
    fn the_red_team_names_these_gates() {
        for g in redteam::GATES {
            assert!(super::NAMES.contains(&g), "the red team expects a gate '{g}' the grader does not have");
        }
    }
}
