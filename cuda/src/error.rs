//! The one error type of the CUDA runtime: each variant says what went wrong and what to do.

use cudarc::driver::DriverError;

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA device: the CUDA driver library (libcuda.so) could not be loaded on this machine")]
    NoDriver,
    #[error("no CUDA device: the driver is installed but reports no GPU ({0})")]
    NoDevice(String),
    #[error("CUDA device {ordinal} does not exist: the driver reports {count} device(s)")]
    BadOrdinal { ordinal: usize, count: usize },
    #[error("{name} has compute capability {major}.{minor}; persistent-layer needs 8.0 or newer")]
    ArchTooOld { name: String, major: i32, minor: i32 },
    #[error("{what} needs {kernel_file}.cu built for sm_90a (Hopper); this card is sm_{major}{minor}")]
    NeedsHopper { what: String, kernel_file: &'static str, major: i32, minor: i32 },
    #[error("not enough GPU memory for {what}: {need_gib:.2} GiB needed, {free_gib:.2} GiB free")]
    OutOfMemory { what: String, need_gib: f64, free_gib: f64 },
    #[error("could not load kernel file {file}.cu on this device: {source}")]
    LoadModule { file: &'static str, source: DriverError },
    #[error("kernel {function} is missing from {file}.cu: {source}")]
    MissingKernel { file: &'static str, function: String, source: DriverError },
    #[error("the GPU computed a wrong result: {0}")]
    WrongResult(String),
    #[error("CUDA call failed while {context}: {source}")]
    Driver { context: String, source: DriverError },
}

/// Attaches what was being done to a driver error: `ctx.synchronize().context("synchronising")?`.
pub trait Context<T> {
    fn context(self, what: impl Into<String>) -> Result<T, CudaError>;
}

impl<T> Context<T> for Result<T, DriverError> {
    fn context(self, what: impl Into<String>) -> Result<T, CudaError> {
        self.map_err(|source| CudaError::Driver { context: what.into(), source })
    }
}
