//! What the judge and the runner say to each other, in one place that both import and neither owns:
//! the descriptors the runner inherits, the job it reads on its stdin, and its one report (the
//! runner's word: the launch record, the DRAM audit's counters, its own clock). The control page's
//! commands are `control`'s; how the report travels is `channel`'s.

use std::os::fd::RawFd;

use cuda::ipc::RegionHandle;
use serde::{Deserialize, Serialize};
use spec::Config;

use crate::builtins::Chosen;
use crate::cupti::Record;

/// The report descriptor in the runner.
pub const REPORT_FD: RawFd = 3;
/// The control page's descriptor in the runner.
pub const CONTROL_FD: RawFd = 4;

/// What the judge asks of the runner, as the first line of its stdin. Nothing secret: the inputs
/// arrive one call at a time through the shared region.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Job {
    pub device: usize,
    pub submission: Chosen,
    pub config: Config,
    pub region: RegionHandle,
    /// The judge's PM sampling holds the device's monitors: the runner's range profiler stays off
    /// (the hardware takes one client), and the runner leaves the device idle for a few sampling
    /// intervals after the last call, so that its eviction stays out of that call's last sample.
    pub judge_samples: bool,
}

/// The hardware's counts over one call, or one back-to-back batch of calls.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Counters {
    pub bytes_read: f64,
    pub bytes_written: f64,
    pub ctas: f64,
}

/// The counters of a back-to-back batch of calls, audited as one range.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Batch {
    pub first: usize,
    pub count: usize,
    pub counters: Counters,
}

/// Whether an audit read the counters over every call, and if not, why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "coverage", content = "reason", rename_all = "snake_case")]
pub enum Coverage {
    /// Every command of calls was measured.
    Measured,
    /// Nothing was measured, from the start: the device allows no counters here (the probe before
    /// the submission was loaded said why), or the user said `--no-audit`. Never a pass.
    Unaudited(String),
    /// The counters worked when the run began, then stopped, failed or went missing: a failure.
    Lost(String),
}

/// An audit's outcome: its coverage, and the counters of each call run alone and of each
/// back-to-back batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Audit {
    pub coverage: Coverage,
    pub calls: Vec<Option<Counters>>,
    pub batches: Vec<Batch>,
}

impl Audit {
    /// An audit of `calls` calls that measured nothing, for `coverage`'s reason.
    pub fn without(coverage: Coverage, calls: usize) -> Audit {
        Audit { coverage, calls: vec![None; calls], batches: Vec::new() }
    }

    pub fn measured(&self) -> bool {
        self.coverage == Coverage::Measured
    }
}

/// One command of calls on the runner's own clock: from its first call's start to the device
/// synchronised after its last.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CommandTime {
    pub first: usize,
    pub count: usize,
    pub us: f64,
}

/// The runner's report on success: everything here is the runner's word (measured inside the
/// submission's process), and the judge labels it so.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Finished {
    /// The nonce the judge handed over after teardown.
    pub nonce: u64,
    pub name: String,
    pub build_s: f64,
    pub record: Record,
    /// The range profiler's counters inside the runner: the runner's word, a cross-check of the
    /// judge's own (`run::counters`).
    pub audit: Audit,
    /// The runner's own clock over each command of calls.
    pub runner_us: Vec<CommandTime>,
    /// Each time the persisting L2 was found set: one sentence each.
    pub l2: Vec<String>,
    /// 16-byte vectors of the submission's weights (the runner's copy) that differ from the shared
    /// ones after teardown.
    pub weight_vectors_changed: u64,
}

/// The runner's one message.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Message {
    Finished(Box<Finished>),
    /// The submission or the device failed; the runner exits after this.
    Failed {
        message: String,
    },
    /// `build_layer` declined the config as one the submission does not implement, saying why (a
    /// verdict `unsupported`, not a crash); the runner exits after this.
    Unsupported {
        message: String,
    },
}
