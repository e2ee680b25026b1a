//! Opening the GPU: every way it can fail becomes a [`CudaError`] with one clear sentence, never a
//! panic (cudarc panics on the first driver call when libcuda is absent, so presence is checked
//! first). The facts a report needs are read once, at open.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{CUdevice_attribute as Attr, CUevent_flags};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig};
use cudarc::nvrtc::Ptx;
use serde::Serialize;

use crate::error::{Context, CudaError};
use crate::kernels::Kernel;

/// What the report records about the card.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceFacts {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub sms: i32,
    pub l2_bytes: i32,
    pub total_mem_bytes: usize,
    pub free_mem_bytes_at_open: usize,
    pub sm_clock_mhz: i32,
    pub mem_clock_mhz: i32,
    pub mem_bus_bits: i32,
    pub max_smem_optin_bytes: i32,
    pub cooperative_launch: bool,
    /// `cuDriverGetVersion`, e.g. 13000 for CUDA 13.0.
    pub driver_cuda_version: i32,
    /// `cuDeviceGetPCIBusId`: how NVML finds the same card.
    pub pci_bus_id: String,
}

/// An open GPU: its context, the stream everything runs on, and the kernel modules loaded so far.
pub struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    facts: DeviceFacts,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
}

impl Device {
    /// Opens device `ordinal` (compute capability 8.0 or newer).
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        // SAFETY: only dlopens libcuda and reports whether it loaded.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(CudaError::NoDriver);
        }
        let count = CudaContext::device_count().map_err(|e| CudaError::NoDevice(e.to_string()))?;
        if count <= 0 {
            return Err(CudaError::NoDevice("device count is 0".into()));
        }
        if ordinal >= count as usize {
            return Err(CudaError::BadOrdinal { ordinal, count: count as usize });
        }
        let ctx = CudaContext::new(ordinal).context("creating the context")?;
        // The grader manages ordering itself (one stream, explicit synchronisation); cudarc's
        // per-buffer event tracking would add event records inside timed steps.
        // SAFETY: no buffer is shared between streams without an explicit synchronise.
        unsafe { ctx.disable_event_tracking() };
        let facts = read_facts(&ctx, ordinal)?;
        let (major, minor) = facts.compute_capability;
        if major < 8 {
            return Err(CudaError::ArchTooOld { name: facts.name.clone(), major, minor });
        }
        let stream = ctx.default_stream();
        Ok(Self { ctx, stream, facts, modules: Mutex::new(HashMap::new()) })
    }

    pub fn facts(&self) -> &DeviceFacts {
        &self.facts
    }

    pub fn ctx(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream the grader and the built-in submissions run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// True on an sm_90 card, where the sm_90a code of the megakernel runs.
    pub fn is_hopper(&self) -> bool {
        self.facts.compute_capability == (9, 0)
    }

    /// A kernel function from an embedded file; the module is loaded once and cached.
    pub fn function(&self, kernel: &Kernel, function: &str) -> Result<CudaFunction, CudaError> {
        let module = {
            let mut modules = self.modules.lock().unwrap();
            match modules.get(kernel.name) {
                Some(m) => m.clone(),
                None => {
                    let m = self
                        .ctx
                        .load_module(Ptx::from_binary(kernel.fatbin.to_vec()))
                        .map_err(|source| CudaError::LoadModule { file: kernel.name, source })?;
                    modules.insert(kernel.name, m.clone());
                    m
                }
            }
        };
        module.load_function(function).map_err(|source| CudaError::MissingKernel {
            file: kernel.name,
            function: function.into(),
            source,
        })
    }

    /// Fails with the sizes when fewer than `bytes` are free on the card.
    pub fn require_free(&self, bytes: u64, what: &str) -> Result<(), CudaError> {
        let (free, _) = self.ctx.mem_get_info().context("reading free memory")?;
        if (free as u64) < bytes {
            return Err(CudaError::OutOfMemory {
                what: what.into(),
                need_gib: bytes as f64 / GIB,
                free_gib: free as f64 / GIB,
            });
        }
        Ok(())
    }

    /// GPU time of the work `f` enqueues on [`Device::stream`], in milliseconds, from two events;
    /// `f`'s own error type passes through.
    pub fn time_ms<E: From<CudaError>>(&self, f: impl FnOnce() -> Result<(), E>) -> Result<f32, E> {
        let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.stream.record_event(timing).context("recording a start event")?;
        f()?;
        let end = self.stream.record_event(timing).context("recording an end event")?;
        Ok(start.elapsed_ms(&end).context("reading an event pair's elapsed time")?)
    }

    /// Waits for all work on the device, every stream included.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.ctx.synchronize().context("synchronising the device")
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// A grid-stride launch over `n` elements: enough blocks of `block` threads to fill the card a few
/// times over, never more than the elements need.
pub fn grid_1d(n: usize, block: u32, sms: i32) -> LaunchConfig {
    const BLOCKS_PER_SM: usize = 8;
    let needed = n.div_ceil(block as usize).max(1);
    let blocks = needed.min(sms.max(1) as usize * BLOCKS_PER_SM) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 }
}

fn read_facts(ctx: &Arc<CudaContext>, ordinal: usize) -> Result<DeviceFacts, CudaError> {
    let attr = |a: Attr| ctx.attribute(a).context(format!("reading device attribute {a:?}"));
    let (free, total) = ctx.mem_get_info().context("reading device memory")?;
    let mut driver = 0i32;
    // SAFETY: cuDriverGetVersion writes one int through a valid pointer.
    let rc = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) };
    rc.result().context("reading the driver version")?;
    let mut bus = [0 as std::ffi::c_char; 64];
    // SAFETY: writes at most `bus.len()` bytes, NUL-terminated, for a valid device ordinal.
    unsafe { cudarc::driver::sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as i32, ordinal as i32) }
        .result()
        .context("reading the PCI bus id")?;
    // SAFETY: NUL-terminated by the driver within the buffer.
    let pci_bus_id = unsafe { std::ffi::CStr::from_ptr(bus.as_ptr()) }.to_string_lossy().into_owned();
    Ok(DeviceFacts {
        ordinal,
        name: ctx.name().context("reading the device name")?,
        compute_capability: ctx.compute_capability().context("reading the compute capability")?,
        sms: attr(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
        l2_bytes: attr(Attr::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?,
        total_mem_bytes: total,
        free_mem_bytes_at_open: free,
        sm_clock_mhz: attr(Attr::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)? / 1000,
        mem_clock_mhz: attr(Attr::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)? / 1000,
        mem_bus_bits: attr(Attr::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)?,
        max_smem_optin_bytes: attr(Attr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?,
        cooperative_launch: attr(Attr::CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH)? != 0,
        driver_cuda_version: driver,
        pci_bus_id,
    })
}
