//! The gates a submission must pass, with the numbers of the task statement (`docs/task.md`).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Gates {
    /// Largest allowed `||x_out - ref|| / ||ref||` at any compared step.
    pub rel_err_tol: f64,
    /// Largest allowed mean kernel launches per step over the profiled steps.
    pub max_kernels_per_step: f64,
    /// Smallest allowed share of a step's kernel time taken by its largest kernel.
    pub min_dominant_share: f64,
    /// A time under this multiple of the floor is physically implausible and flagged.
    pub implausible_x_floor: f64,
}

impl Gates {
    pub const TASK: Gates =
        Gates { rel_err_tol: 1.5e-2, max_kernels_per_step: 2.0, min_dominant_share: 0.95, implausible_x_floor: 0.9 };
}
