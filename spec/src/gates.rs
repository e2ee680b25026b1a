//! The gates a submission must pass, with their numbers. docs/task.md states them in prose; the
//! grader reads them from here.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Gates {
    /// Largest allowed `||x_out - ref|| / ||ref||` at any call.
    pub rel_err_tol: f64,
    /// Largest allowed number of kernels in any call.
    pub max_kernels_per_step: f64,
    /// Smallest allowed share of a call's kernel time taken by its largest kernel, in any call.
    pub min_dominant_share: f64,
    /// Smallest share of the byte model (weights and KV attended) each call must read from DRAM.
    pub min_bytes_read: f64,
    /// Smallest share of a timed call's time (judge's clock) the recorded GPU work must cover:
    /// work the record does not show must not fill the rest.
    pub min_coverage: f64,
    /// How far under the read-only ceiling measured in the same run a call may seem to run (noise
    /// of the ceiling's own measurement) before its timing is implausible.
    pub read_ceiling_margin: f64,
}

impl Gates {
    pub const TASK: Gates = Gates {
        rel_err_tol: 1.5e-2,
        max_kernels_per_step: 2.0,
        min_dominant_share: 0.95,
        min_bytes_read: 0.98,
        min_coverage: 0.5,
        read_ceiling_margin: 0.03,
    };
}
