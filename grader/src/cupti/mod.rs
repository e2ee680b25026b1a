//! Counting the GPU work of every call with CUPTI, the CUDA profiling interface.
//!
//! Gates 2 and 3 (at most 2 kernels per call, dominant share at least 0.95) must count what the GPU
//! ran, not what the submission says it launched, on every call: a [`Recording`] runs from before
//! the submission is loaded until after its last call, so no call is "the one that is watched". It
//! combines two views that must agree ([`record::attribute`] checks them):
//!
//! - [`activity`]: the GPU's records of kernels, copies and sets;
//! - [`callbacks`]: the host's API calls, tagged with the call that made them, and the modules the
//!   driver loads.
//!
//! Usage: one recording per process (CUPTI is process-global). [`Recording::start`], mark build and
//! each call with [`callbacks::set_current`], call [`Recording::reassert`] at call boundaries (it
//! reports whatever switched the recording off), and [`Recording::finish`] after synchronising.

pub mod activity;
pub mod callbacks;
pub mod record;
pub mod summary;

use std::sync::atomic::{AtomicBool, Ordering};

pub use activity::{Activity, ActivityKind};
pub use callbacks::{Tag, current, set_current};
pub use record::{CallWindow, OwnWork, Record, RunnerCopies};
pub use summary::{StepLaunches, kernel_bounds};

use cuda::cudarc::cupti::sys;

#[derive(Debug, thiserror::Error)]
pub enum CuptiError {
    #[error("CUPTI (libcupti.so) could not be loaded: set LD_LIBRARY_PATH to the CUDA lib64 folder")]
    NotLoaded,
    #[error("a CUPTI recording is already active in this process (CUPTI is process-global: finish the first one)")]
    AlreadyActive,
    #[error("CUPTI call {call} failed: {code}")]
    Call { call: &'static str, code: String },
    #[error("CUPTI dropped {records} activity records for lack of buffer space: the launch count would be incomplete")]
    Dropped { records: usize },
    #[error("a CUPTI activity buffer could not be read: {0}")]
    Buffer(String),
}

/// Whether a recording is active in this process.
static ACTIVE: AtomicBool = AtomicBool::new(false);

/// Both views, on from `start` to `finish`.
pub struct Recording {
    subscription: Option<callbacks::Subscription>,
}

/// What a finished recording holds: the GPU's records and the host's view, not yet attributed.
pub struct Captured {
    pub activities: Vec<Activity>,
    pub seen: callbacks::Seen,
}

impl Recording {
    /// Starts both views. Synchronise the device first, or work still running from before may be
    /// recorded.
    pub fn start() -> Result<Recording, CuptiError> {
        // SAFETY: only dlopens libcupti and reports whether it loaded (cudarc panics on the first
        // CUPTI call otherwise).
        if !unsafe { sys::is_culib_present() } {
            return Err(CuptiError::NotLoaded);
        }
        if ACTIVE.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire).is_err() {
            return Err(CuptiError::AlreadyActive);
        }
        // From here on Drop switches everything off again if a step fails.
        let mut recording = Recording { subscription: None };
        recording.subscription = Some(callbacks::Subscription::start()?);
        activity::enable()?;
        Ok(recording)
    }

    /// Switches both views back on and returns what had been found off: each entry is something in
    /// the process tampering with the record. (The activity API cannot be queried for what is
    /// enabled, so its kinds are simply enabled again; switching them off shows up as launches
    /// without records.)
    pub fn reassert(&self) -> Result<Vec<String>, CuptiError> {
        let off = self.subscription.as_ref().map(|s| s.reassert()).unwrap_or_default();
        activity::reassert()?;
        Ok(off)
    }

    /// Stops both views and returns everything recorded. Synchronise the device first: CUPTI
    /// delivers a kernel's record only once the kernel has finished.
    pub fn finish(mut self) -> Result<Captured, CuptiError> {
        let activities = activity::take();
        let disabled = activity::disable();
        let seen = self.subscription.take().map(callbacks::Subscription::finish).unwrap_or_default();
        ACTIVE.store(false, Ordering::Release);
        let activities = activities?;
        disabled?;
        Ok(Captured { activities, seen })
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        if let Some(sub) = self.subscription.take() {
            // Never panics: errors are ignored, the records discarded.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let _ = activity::take();
                let _ = activity::disable();
                drop(sub.finish());
            }));
            ACTIVE.store(false, Ordering::Release);
        }
    }
}

/// CUPTI's clock now, in ns: the time base of every activity record.
pub fn timestamp() -> Result<u64, CuptiError> {
    let mut t = 0u64;
    // SAFETY: a valid out-pointer.
    let r = unsafe { sys::cuptiGetTimestamp(&mut t) };
    if r == sys::CUptiResult::CUPTI_SUCCESS {
        Ok(t)
    } else {
        Err(CuptiError::Call { call: "cuptiGetTimestamp", code: format!("{r:?}") })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_without_cupti_is_a_clear_error() {
        // SAFETY: only dlopens libcupti.
        if unsafe { sys::is_culib_present() } {
            return; // a machine with CUPTI: covered by the GPU runs.
        }
        let err = Recording::start().err().expect("no CUPTI, no recording");
        assert!(matches!(err, CuptiError::NotLoaded));
        assert!(err.to_string().contains("LD_LIBRARY_PATH"));
        assert!(!ACTIVE.load(Ordering::Acquire), "a failed start leaves no recording active");
    }
}
