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
}

/// The DRAM audit's counters of one range, or why there are none.
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

/// The audit's outcome: a reason it could not run, or the counters of each call run alone and of
/// each back-to-back batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Audit {
    pub unavailable: Option<String>,
    pub calls: Vec<Option<Counters>>,
    pub batches: Vec<Batch>,
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
    pub audit: Audit,
    /// The runner's own clock over each command of calls: `(first call, calls, us)`.
    pub runner_us: Vec<(usize, usize, f64)>,
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
