//! How fast a process streams device memory that another process allocated, by the way it was
//! shared: the first measurement the whole-stack design needs (docs/stack.md, "First measurements").
//! The judge shares its buffers with the runner through legacy CUDA IPC (`cuIpcGetMemHandle`, see
//! `cuda::ipc`), and submissions that streamed the weights through that mapping read them 35-45%
//! slower than from their own memory (docs/perf.md); at 80 layers the runner has no room for a copy.
//! This compares, in a second process, two read-only streams (`read_bulk`, the megakernel's way of
//! reading, by bulk copies into shared memory; and `read_u4`, 16-byte loads, as most kernels read)
//! over: its own allocation, the other process's `cuMemAlloc` opened by legacy IPC, and the
//! other process's `cuMemCreate` allocation (the virtual memory API, the recommended granularity)
//! exported as a file descriptor and mapped read-only.
//!
//!   cargo run --release -p grader --example ipc_stream [-- GIB]
//!
//! The parent allocates and fills both shared buffers, then starts itself as the child (with the
//! legacy handle in hex, and the exported descriptor as the child's standard input), which prints one
//! line per mapping.

use std::ffi::c_void;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::process::{Command, Stdio};

use cuda::cudarc::driver::sys::{
    self, CUdeviceptr, CUmemAccess_flags, CUmemAllocationHandleType, CUmemGenericAllocationHandle,
};
use cuda::cudarc::driver::{CudaSlice, DevicePtr};
use cuda::ipc::{RegionHandle, SharedRegion};
use cuda::{Context, CudaError, Device};
use grader::bandwidth::{self, StreamKernels};

/// Timed passes over each buffer (events), after `bandwidth::timed`'s untimed ones.
const PASSES: usize = 20;
const GIB: usize = 1 << 30;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let outcome = match args.get(1).map(String::as_str) {
        Some("--child") => child(&args[2..]),
        gib => parent(gib.map_or(Ok(2), str::parse::<usize>).unwrap_or_else(|e| panic!("GIB: {e}"))),
    };
    if let Err(e) = outcome {
        eprintln!("ipc_stream: {e}");
        std::process::exit(1);
    }
}

/// The allocation properties of a shareable device allocation on `ordinal`.
fn vmm_props(ordinal: i32) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct for which all-zero is a valid (empty) value.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location = sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal };
    prop
}

/// Reserves an address range for `handle`'s `bytes`, maps it and grants this device `flags` access.
fn map(
    handle: CUmemGenericAllocationHandle,
    bytes: usize,
    ordinal: i32,
    flags: CUmemAccess_flags,
) -> Result<CUdeviceptr, CudaError> {
    let mut ptr: CUdeviceptr = 0;
    let access = sys::CUmemAccessDesc {
        location: sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal },
        flags,
    };
    // SAFETY: valid out-pointers; the range is reserved before it is mapped and mapped before access
    // is set, each over the allocation's whole size.
    unsafe {
        sys::cuMemAddressReserve(&mut ptr, bytes, 0, 0, 0).result().context("reserving an address range")?;
        sys::cuMemMap(ptr, bytes, 0, handle, 0).result().context("mapping the allocation")?;
        sys::cuMemSetAccess(ptr, bytes, &access, 1).result().context("granting access")?;
    }
    Ok(ptr)
}

fn parent(gib: usize) -> Result<(), CudaError> {
    let dev = Device::open(0)?;
    let ordinal = dev.facts().ordinal as i32;
    let bytes = gib * GIB;
    // Legacy IPC: what the judge shares today.
    let legacy = SharedRegion::allocate(&dev, bytes)?;
    fill(&dev, &legacy.view::<u8>(0, bytes))?;
    // The virtual memory API: recommended granularity, exported as a file descriptor.
    let prop = vmm_props(ordinal);
    let mut granularity = 0usize;
    let mut handle: CUmemGenericAllocationHandle = 0;
    let mut fd: i32 = -1;
    // SAFETY: valid out-pointers and properties; the size is rounded up to the granularity.
    let vmm_bytes = unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut granularity,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        )
        .result()
        .context("reading the granularity")?;
        let rounded = bytes.div_ceil(granularity) * granularity;
        sys::cuMemCreate(&mut handle, rounded, &prop, 0).result().context("creating the allocation")?;
        sys::cuMemExportToShareableHandle(
            (&mut fd as *mut i32).cast::<c_void>(),
            handle,
            CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
        .result()
        .context("exporting the allocation")?;
        rounded
    };
    let ptr = map(handle, vmm_bytes, ordinal, CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE)?;
    // SAFETY: the mapping covers vmm_bytes and outlives the view (leaked, never freed through it).
    let view = unsafe { dev.stream().upgrade_device_ptr::<u8>(ptr, vmm_bytes) };
    fill(&dev, &view)?;
    view.leak();
    dev.synchronize()?;
    // SAFETY: the exporter gave this process the descriptor; nothing else owns it.
    let exported = unsafe { OwnedFd::from_raw_fd(fd) };
    let h = legacy.handle()?;
    println!("granularity (recommended): {} KiB; {gib} GiB per buffer, {PASSES} passes each", granularity >> 10);
    let status = Command::new(std::env::current_exe().expect("the example's path"))
        .args(["--child", &h.bytes.to_string(), &h.handle_hex, &vmm_bytes.to_string()])
        .stdin(Stdio::from(exported))
        .status()
        .map_err(|e| CudaError::WrongResult(format!("starting the child: {e}")))?;
    if !status.success() {
        return Err(CudaError::WrongResult(format!("the child failed: {status}")));
    }
    Ok(())
}

/// Writes a pattern over `buf` so that nothing reads never-touched pages.
fn fill(dev: &Device, buf: &CudaSlice<u8>) -> Result<(), CudaError> {
    // SAFETY: memset over the slice's own bytes.
    unsafe { sys::cuMemsetD8_v2(buf.device_ptr(dev.stream()).0, 0x5A, buf.len()) }
        .result()
        .context("filling a buffer")?;
    dev.synchronize()
}

fn child(args: &[String]) -> Result<(), CudaError> {
    let [bytes, hex, vmm_bytes] = args else {
        return Err(CudaError::WrongResult("--child BYTES HEX VMM_BYTES (the descriptor on standard input)".into()));
    };
    let parse = |s: &String| s.parse::<usize>().map_err(|e| CudaError::WrongResult(format!("{s}: {e}")));
    let (bytes, vmm_bytes) = (parse(bytes)?, parse(vmm_bytes)?);
    // The parent's exported descriptor is this process's standard input, duplicated: descriptor 0
    // would travel as a null handle, which the driver refuses.
    // SAFETY: standard input is open for the life of the process.
    let exported = unsafe { BorrowedFd::borrow_raw(0) }
        .try_clone_to_owned()
        .map_err(|e| CudaError::WrongResult(format!("duplicating the descriptor: {e}")))?;
    let fd = exported.as_raw_fd();
    let dev = Device::open(0)?;
    let ordinal = dev.facts().ordinal as i32;
    let (func, cfg) = cuda::kernels::read_bulk(&dev)?.ok_or_else(|| CudaError::WrongResult("needs Hopper".into()))?;
    let mut sink = dev.stream().alloc_zeros::<u32>(cfg.grid_dim.0 as usize).context("allocating the sink")?;
    let kernels = StreamKernels::load(&dev)?;
    let mut wave_sink =
        dev.stream().alloc_zeros::<u32>(kernels.wave.grid_dim.0 as usize).context("allocating the sink")?;
    let mut stream = |name: &str, ptr: CUdeviceptr, len: usize| -> Result<(), CudaError> {
        // SAFETY: ptr maps len readable bytes for the life of this call; the slice is leaked below,
        // never freed through it.
        let buf = unsafe { dev.stream().upgrade_device_ptr::<u8>(ptr, len) };
        let bytes = len as u64;
        let bulk = bandwidth::timed(&dev, PASSES, bytes, || {
            bandwidth::read_bulk(&dev, &func, cfg, &mut sink, &buf.as_view())
        })?;
        let loads =
            bandwidth::timed(&dev, PASSES, bytes, || kernels.read(&dev, &mut wave_sink, &buf.as_view(), kernels.wave))?;
        buf.leak();
        println!(
            "{name:<60} bulk copies {:5.2} TB/s, 16-byte loads {:5.2} TB/s (medians of {PASSES})",
            bulk.median, loads.median
        );
        Ok(())
    };
    let own = dev.stream().alloc_zeros::<u8>(bytes).context("allocating the local buffer")?;
    stream("own cuMemAlloc (stream-ordered pool)", own.device_ptr(dev.stream()).0, bytes)?;
    let legacy = SharedRegion::open(&dev, &RegionHandle { bytes, handle_hex: hex.clone() })?;
    let legacy_ptr = legacy.view::<u8>(0, bytes).device_ptr(dev.stream()).0;
    stream("the other process's cuMemAlloc, legacy IPC", legacy_ptr, bytes)?;
    let mut handle: CUmemGenericAllocationHandle = 0;
    // SAFETY: a POSIX descriptor travels as the pointer-sized integer itself.
    unsafe {
        sys::cuMemImportFromShareableHandle(
            &mut handle,
            fd as usize as *mut c_void,
            CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    }
    .result()
    .context("importing the descriptor")?;
    let read_only = map(handle, vmm_bytes, ordinal, CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ)?;
    stream("the other process's cuMemCreate, imported, mapped read-only", read_only, vmm_bytes)?;
    let local_vmm = {
        let prop = vmm_props(ordinal);
        let mut h: CUmemGenericAllocationHandle = 0;
        // SAFETY: valid out-pointer and properties; vmm_bytes is a multiple of the granularity.
        unsafe { sys::cuMemCreate(&mut h, vmm_bytes, &prop, 0) }.result().context("creating a local allocation")?;
        map(h, vmm_bytes, ordinal, CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE)?
    };
    // SAFETY: memset over the mapping's own bytes, so the stream reads touched pages.
    unsafe { sys::cuMemsetD8_v2(local_vmm, 0x5A, vmm_bytes) }.result().context("filling")?;
    stream("own cuMemCreate", local_vmm, vmm_bytes)?;
    Ok(())
}
