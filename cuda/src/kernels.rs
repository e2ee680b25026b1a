//! A compiled kernel file ([`Kernel`]) and how each crate embeds its own ([`crate::embed_kernels!`]); this
//! crate's one kernel file, the bulk read stream that the grader's bandwidth measurement and the red
//! team both launch, with its launch shape ([`read_bulk`]); and the toolchain that compiled every
//! crate's kernels ([`NVCC`], [`CUDADEVRT_DIR`]), for tests that compile fixtures of their own.

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, LaunchConfig};

use crate::{Context, CudaError, Device};

/// One compiled kernel file.
#[derive(Debug, Clone, Copy)]
pub struct Kernel {
    /// The file's stem: `bulk_read` for `kernels/bulk_read.cu`.
    pub name: &'static str,
    /// Machine code for each target architecture plus PTX, as nvcc's `--fatbin` writes it.
    pub fatbin: &'static [u8],
    /// ptxas's `-v` report: registers, shared memory, stack frame and spills of every function.
    pub ptxas_report: &'static str,
}

/// Embeds the calling crate's kernel files (compiled by its build script with `cuda_build::build`):
/// one [`Kernel`] constant per `kernels/*.cu` and `ALL`, with a test that every file is there with
/// code and spills no register, but for the functions named as [`Spills`] (each with its bound and
/// the reason it may spill).
#[macro_export]
macro_rules! embed_kernels {
    ($($spills:expr),* $(,)?) => {
        include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

        #[cfg(test)]
        #[test]
        fn every_kernel_file_is_embedded_with_code() {
            $crate::kernels::assert_embedded(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels"), ALL, &[$($spills),*]);
        }
    };
}

/// A kernel function allowed to spill, at most `bytes` of spill stores and loads each, and why: spills
/// are a defect anywhere a register can be found instead. `function` names a kernel, or a device
/// function whose own functions (its lambdas and the templates instantiated for them, which ptxas
/// reports under their mangled names) are allowed too.
#[derive(Debug, Clone, Copy)]
pub struct Spills {
    pub function: &'static str,
    pub bytes: u32,
    pub why: &'static str,
}

impl Spills {
    /// Whether ptxas's function `name` is this one or, mangled, one within it (the Itanium mangling
    /// writes each enclosing name as its length and then the name: `11batch_phase`).
    fn covers(&self, name: &str) -> bool {
        name == self.function
            || (name.starts_with("_Z") && name.contains(&format!("{}{}", self.function.len(), self.function)))
    }
}

embed_kernels!();

/// Panics unless `all` holds one kernel per `.cu` file of `folder`, each with machine code and a
/// ptxas report, none of its functions spilling registers beyond what `allowed` grants them: the test
/// [`crate::embed_kernels!`] gives each crate.
pub fn assert_embedded(folder: &str, all: &[Kernel], allowed: &[Spills]) {
    let on_disk = std::fs::read_dir(folder)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().path().extension().is_some_and(|x| x == "cu"))
        .count();
    assert_eq!(all.len(), on_disk, "{folder}");
    for k in all {
        // A fatbin starts with its magic number 0xBA55ED50 (little-endian).
        assert_eq!(&k.fatbin[..4], &[0x50, 0xED, 0x55, 0xBA], "{}", k.name);
        assert!(k.ptxas_report.contains("Used"), "{}: no ptxas report", k.name);
        let mut function = "";
        for line in k.ptxas_report.lines() {
            if let Some((_, name)) = line.split_once("Function properties for ") {
                function = name.trim();
            }
            if !line.contains("spill") {
                continue;
            }
            let allowance = allowed.iter().find(|a| a.covers(function));
            let bound = allowance.map_or(0, |a| a.bytes);
            let bytes = |what: &str| -> u32 {
                let before = line.split(what).next().unwrap_or("");
                before
                    .rsplit(',')
                    .next()
                    .unwrap_or("")
                    .trim()
                    .trim_end_matches(" bytes")
                    .trim()
                    .parse()
                    .unwrap_or(u32::MAX)
            };
            let (stores, loads) = (bytes(" bytes spill stores"), bytes(" bytes spill loads"));
            assert!(
                stores <= bound && loads <= bound,
                "{}: {function}: {line} (allowed {bound} bytes{})",
                k.name,
                allowance.map_or(String::new(), |a| format!(" because {}", a.why))
            );
        }
    }
}

/// The launch shape of `read_bulk` (`kernels/bulk_read.cu`, a test checks the mirror): blocks of this
/// many threads, one per SM, each with its ring of bulk-copy slots in dynamic shared memory.
const BULK_READ_FUNCTION: &str = "read_bulk";
const BULK_READ_THREADS: u32 = 512;
const BULK_READ_RING_BYTES: u32 = 3 * 64 * 1024;

/// `read_bulk(sink (blocks), src (n), n: u64)` of `kernels/bulk_read.cu`, its shared memory limit raised,
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
        let cu = include_str!("../kernels/bulk_read.cu");
        assert!(cu.contains(&format!("__global__ void {BULK_READ_FUNCTION}(")));
        assert!(cu.contains(&format!("constexpr uint32_t BULK_THREADS = {BULK_READ_THREADS};")));
        assert!(
            cu.contains("constexpr uint32_t SLOTS = 3;") && cu.contains("constexpr uint32_t SLOT_BYTES = 64 * 1024;")
        );
        assert_eq!(BULK_READ_RING_BYTES, 3 * 64 * 1024);
    }

    #[test]
    fn an_allowance_covers_its_function_and_the_functions_within_it_only() {
        let a = Spills { function: "batch_phase", bytes: 8, why: "" };
        assert!(a.covers("batch_phase"));
        assert!(a.covers("_Z10lanes_gemvIZ11batch_phaseRK5OpRowjEUljjE_EvS2_"));
        assert!(!a.covers("_Z12batch_phase2v"), "another function whose name starts alike");
        assert!(!a.covers("_Z10batch_headv"));
        assert!(!a.covers("x11batch_phase"), "only a mangled name is searched");
    }
}
