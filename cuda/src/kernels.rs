//! The embedded kernels as every crate names them (the root package's, `kernels`: [`Kernel`], the
//! toolchain that compiled them, [`NVCC`] and [`CUDADEVRT_DIR`], for tests that compile fixtures of
//! their own), and this crate's one kernel file, the bulk read stream that the grader's bandwidth
//! measurement and the red team both launch, with its launch shape ([`read_bulk`]).

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, LaunchConfig};

use crate::{Context, CudaError, Device};

pub use ::kernels::cuda::{ALL, BULK_READ};
pub use ::kernels::{CUDADEVRT_DIR, Kernel, NVCC};

/// The launch shape of `read_bulk` (`kernels/cuda/bulk_read.cu`, a test checks the mirror): blocks of this
/// many threads, one per SM, each with its ring of bulk-copy slots in dynamic shared memory.
const BULK_READ_FUNCTION: &str = "read_bulk";
const BULK_READ_THREADS: u32 = 512;
const BULK_READ_RING_BYTES: u32 = 3 * 64 * 1024;

/// `read_bulk(sink (blocks), src (n), n: u64)` of `kernels/cuda/bulk_read.cu`, its shared memory limit raised,
/// and its launch: one block per SM. `None` before Hopper, which has no bulk copies.
pub fn read_bulk(dev: &Device) -> Result<Option<(CudaFunction, LaunchConfig)>, CudaError> {
    if !dev.is_hopper() {
        return Ok(None);
    }
    let func = dev.function(&BULK_READ, BULK_READ_FUNCTION)?;
    func.set_attribute(
        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        BULK_READ_RING_BYTES as i32,
    )
    .context("raising read_bulk's shared memory limit")?;
    let cfg = LaunchConfig {
        grid_dim: (dev.facts().sms as u32, 1, 1),
        block_dim: (BULK_READ_THREADS, 1, 1),
        shared_mem_bytes: BULK_READ_RING_BYTES,
    };
    Ok(Some((func, cfg)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bulk_reads_launch_shape_mirrors_its_file() {
        let cu = include_str!("../../kernels/cuda/bulk_read.cu");
        assert!(cu.contains(&format!("__global__ void {BULK_READ_FUNCTION}(")));
        assert!(cu.contains(&format!("constexpr uint32_t BULK_THREADS = {BULK_READ_THREADS};")));
        assert!(
            cu.contains("constexpr uint32_t SLOTS = 3;") && cu.contains("constexpr uint32_t SLOT_BYTES = 64 * 1024;")
        );
        assert_eq!(BULK_READ_RING_BYTES, 3 * 64 * 1024);
    }
}
