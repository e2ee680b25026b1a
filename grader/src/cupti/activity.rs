//! CUPTI's activity API: the GPU's own record of every kernel, copy and set it ran, whoever
//! launched it and however.
//!
//! - a CUDA graph replays its nodes as ordinary kernel records (with a nonzero `graph_id`), so
//!   capturing ten kernels into a graph still counts ten. Graph-level tracing
//!   (`CUPTI_ACTIVITY_KIND_GRAPH_TRACE`) is deliberately NOT enabled: it replaces the per-node kernel
//!   records by one record per graph launch, which would let a graph hide its kernels;
//! - kernels on side streams, memcpys and memsets show up as their own records;
//! - `CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL` is used (not `KIND_KERNEL`), so tracing does not
//!   serialise kernels;
//! - if CUPTI drops records (no buffer space), [`take`] fails with [`CuptiError::Dropped`] instead of
//!   returning a short list: a dropped record would be a kernel the gates never saw.
//!
//! What CUPTI cannot see on Hopper: kernels launched from the device (CUDA dynamic parallelism).
//! The launching kernel is counted; the modules that could launch from the device are refused by
//! the module scan (see `callbacks`), and the hardware's own count of launched thread blocks (the
//! DRAM audit's range profiler) catches whatever still escapes.

use std::alloc::Layout;
use std::ffi::{CStr, c_char};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use cuda::cudarc::cupti::result::activity;
use cuda::cudarc::cupti::sys;
use cuda::cudarc::driver::sys::CUcontext;
use serde::{Deserialize, Serialize};

use super::CuptiError;

/// One GPU activity CUPTI reported.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Activity {
    pub kind: ActivityKind,
    /// The kernel's name as the module stores it (our kernels are `extern "C"`, so unmangled; a C++
    /// kernel keeps its mangled name); `memcpy DtoD 1234 bytes`; `memset 1234 bytes`.
    pub name: String,
    /// GPU start and end, in ns of CUPTI's clock. Both 0 when CUPTI could not time the activity.
    pub start_ns: u64,
    pub end_ns: u64,
    pub stream_id: u32,
    pub correlation_id: u32,
    /// Bytes a copy or a set moves; 0 for a kernel.
    #[serde(default)]
    pub bytes: u64,
    /// Zeros for anything but a kernel.
    pub grid: (i32, i32, i32),
    pub block: (i32, i32, i32),
    pub registers: u16,
    pub static_smem: i32,
    pub dynamic_smem: i32,
    /// Nonzero when the activity ran as a node of a CUDA graph.
    pub graph_id: u32,
    /// The record's `isDeviceLaunched` flag (new in the CUDA 13.0 records: set for nodes of
    /// device-launched graphs, which CUPTI reports only through the Hardware Event System). False
    /// when the record is an older version without the field.
    pub launched_from_device: bool,
}

impl Activity {
    /// An activity of `kind` named `name` over `start_ns..end_ns`, every other field zero: for
    /// tests and hand-made records.
    pub fn synthetic(kind: ActivityKind, name: &str, start_ns: u64, end_ns: u64) -> Activity {
        Activity {
            kind,
            name: name.to_string(),
            start_ns,
            end_ns,
            stream_id: 0,
            correlation_id: 0,
            bytes: 0,
            grid: (0, 0, 0),
            block: (0, 0, 0),
            registers: 0,
            static_smem: 0,
            dynamic_smem: 0,
            graph_id: 0,
            launched_from_device: false,
        }
    }

    /// GPU time in ns (0 for an activity CUPTI could not time).
    pub fn duration_ns(&self) -> u64 {
        self.end_ns.saturating_sub(self.start_ns)
    }
}

/// What kind of GPU work an [`Activity`] was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ActivityKind {
    Kernel,
    Memcpy,
    Memset,
    /// Any other `CUpti_ActivityKind`, by number (none is enabled, so none is expected).
    Other(u32),
}

/// The activity kinds a recording enables.
const KINDS: [(sys::CUpti_ActivityKind, &str); 3] = [
    (sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, "cuptiActivityEnable(CONCURRENT_KERNEL)"),
    (sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_MEMCPY, "cuptiActivityEnable(MEMCPY)"),
    (sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_MEMSET, "cuptiActivityEnable(MEMSET)"),
];

/// `CUPTI_ACTIVITY_FLAG_FLUSH_FORCED`: deliver incomplete buffers too.
const FLUSH_FORCED: u32 = sys::CUpti_ActivityFlag::CUPTI_ACTIVITY_FLAG_FLUSH_FORCED as u32;

/// Size of each activity buffer handed to CUPTI (a kernel record is 216 bytes: ~38k records each;
/// CUPTI asks for more buffers as they fill).
const BUFFER_SIZE: usize = 8 << 20;
/// CUPTI requires 8-byte aligned buffers.
const BUFFER_ALIGN: usize = 8;

/// Activities parsed from completed buffers, not yet taken.
static COLLECTED: Mutex<Vec<Activity>> = Mutex::new(Vec::new());
/// Records CUPTI reported dropped since the last `enable`.
static DROPPED: AtomicUsize = AtomicUsize::new(0);
/// Problems the buffer callbacks met since the last `enable` (they cannot return errors).
static FAULTS: Mutex<Vec<String>> = Mutex::new(Vec::new());
/// The outcome of registering the buffer callbacks, done once per process.
static REGISTERED: OnceLock<Result<(), (&'static str, String)>> = OnceLock::new();

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

pub(super) fn describe(e: cuda::cudarc::cupti::result::CuptiError) -> String {
    match e.error_string() {
        Ok(text) => format!("{:?} ({})", e.0, text.to_string_lossy()),
        Err(_) => format!("{:?}", e.0),
    }
}

pub(super) fn call(
    name: &'static str,
    r: Result<(), cuda::cudarc::cupti::result::CuptiError>,
) -> Result<(), CuptiError> {
    r.map_err(|e| CuptiError::Call { call: name, code: describe(e) })
}

/// Reads CUPTI's dropped-record count for the global queue (which also resets it).
fn dropped_global() -> Result<usize, CuptiError> {
    let mut dropped = 0usize;
    // SAFETY: a null context selects the global queue; `dropped` is a valid out-pointer.
    let r = unsafe { activity::get_num_dropped_records(std::ptr::null_mut(), 0, &mut dropped) };
    call("cuptiActivityGetNumDroppedRecords", r)?;
    Ok(dropped)
}

/// Registers the buffer callbacks (once per process), forgets leftovers and enables the kinds.
/// The caller has checked that libcupti is loaded and holds the process's one recording.
pub(super) fn enable() -> Result<(), CuptiError> {
    let registered = REGISTERED.get_or_init(|| {
        activity::register_callbacks(Some(buffer_requested), Some(buffer_completed))
            .map_err(|e| ("cuptiActivityRegisterCallbacks", describe(e)))
    });
    if let Err((name, code)) = registered {
        return Err(CuptiError::Call { call: name, code: code.clone() });
    }
    lock(&COLLECTED).clear();
    lock(&FAULTS).clear();
    // Reading the count resets it. Should the read fail, a stale count can only make `take`
    // refuse a record, never hide one.
    let _ = dropped_global();
    DROPPED.store(0, Ordering::Release);
    for (kind, name) in KINDS {
        call(name, activity::enable(kind))?;
    }
    Ok(())
}

/// Enables the kinds again: idempotent for an intact recording, a repair for one something in the
/// process switched off (which the launch cross-check then reports).
pub(super) fn reassert() -> Result<(), CuptiError> {
    KINDS.iter().try_for_each(|&(kind, name)| call(name, activity::enable(kind)))
}

/// Every record completed so far, sorted by start time. Synchronise the device first: CUPTI
/// delivers a kernel's record only once the kernel has finished.
pub(super) fn take() -> Result<Vec<Activity>, CuptiError> {
    call("cuptiActivityFlushAll", activity::flush_all(FLUSH_FORCED))?;
    let dropped = DROPPED.swap(0, Ordering::AcqRel) + dropped_global()?;
    let mut records = std::mem::take(&mut *lock(&COLLECTED));
    let faults = std::mem::take(&mut *lock(&FAULTS));
    if dropped > 0 {
        return Err(CuptiError::Dropped { records: dropped });
    }
    if let Some(first) = faults.into_iter().next() {
        return Err(CuptiError::Buffer(first));
    }
    records.sort_by_key(|a| (a.start_ns, a.end_ns, a.correlation_id));
    Ok(records)
}

/// Switches the kinds off. Errors are the caller's to report or ignore.
pub(super) fn disable() -> Result<(), CuptiError> {
    let mut first = Ok(());
    for (kind, _) in KINDS {
        let r = call("cuptiActivityDisable", activity::disable(kind));
        if first.is_ok() {
            first = r;
        }
    }
    first
}

fn buffer_layout() -> Layout {
    // BUFFER_ALIGN is a power of two and BUFFER_SIZE a multiple of it far below isize::MAX.
    Layout::from_size_align(BUFFER_SIZE, BUFFER_ALIGN).expect("a valid constant layout")
}

/// CUPTI asks for an empty buffer. A null buffer (allocation failed) makes CUPTI drop records,
/// which `stop` reports.
unsafe extern "C" fn buffer_requested(buffer: *mut *mut u8, size: *mut usize, max_num_records: *mut usize) {
    let allocated = std::panic::catch_unwind(|| {
        // SAFETY: the layout has a nonzero size.
        unsafe { std::alloc::alloc(buffer_layout()) }
    })
    .unwrap_or(std::ptr::null_mut());
    if buffer.is_null() || size.is_null() || max_num_records.is_null() {
        if !allocated.is_null() {
            // SAFETY: allocated just above with this layout and never handed out.
            unsafe { std::alloc::dealloc(allocated, buffer_layout()) };
        }
        return;
    }
    // SAFETY: CUPTI passes valid out-pointers (checked non-null above).
    unsafe {
        *buffer = allocated;
        *size = if allocated.is_null() { 0 } else { BUFFER_SIZE };
        // 0: as many records as fit.
        *max_num_records = 0;
    }
}

/// CUPTI hands back a filled buffer: parse it, note dropped records, free it.
unsafe extern "C" fn buffer_completed(ctx: CUcontext, stream_id: u32, buffer: *mut u8, _size: usize, valid: usize) {
    if buffer.is_null() {
        return;
    }
    let parsed = std::panic::catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `buffer` is one we allocated with BUFFER_SIZE bytes, and CUPTI wrote `valid` of them.
        unsafe { parse_buffer(buffer, valid.min(BUFFER_SIZE)) }
    }));
    match parsed {
        Ok(Ok(activities)) => lock(&COLLECTED).extend(activities),
        Ok(Err(fault)) => lock(&FAULTS).push(fault),
        Err(_) => lock(&FAULTS).push("parsing a completed buffer panicked".to_string()),
    }
    let mut dropped = 0usize;
    // SAFETY: `ctx` and `stream_id` are the queue CUPTI just delivered; `dropped` is a valid out-pointer.
    if unsafe { activity::get_num_dropped_records(ctx, stream_id, &mut dropped) }.is_ok() {
        DROPPED.fetch_add(dropped, Ordering::AcqRel);
    }
    // SAFETY: `buffer` came from `buffer_requested`, allocated with this layout; CUPTI is done with it.
    unsafe { std::alloc::dealloc(buffer, buffer_layout()) };
}

/// Walks the records of a completed buffer.
///
/// # Safety
/// `buffer..buffer + valid` must be readable and hold CUPTI activity records.
unsafe fn parse_buffer(buffer: *mut u8, valid: usize) -> Result<Vec<Activity>, String> {
    let end = buffer as usize + valid;
    let mut out = Vec::new();
    let mut record: *mut sys::CUpti_Activity = std::ptr::null_mut();
    let mut previous: Option<*const u8> = None;
    loop {
        // SAFETY: the buffer is valid for `valid` bytes; `record` is null (first call) or the
        // record CUPTI returned last.
        let r = unsafe { activity::get_next_record(buffer, valid, &mut record) };
        let next = match r {
            Ok(()) if !record.is_null() => Some(record as *const u8),
            Ok(()) => None,
            Err(e) if e.0 == sys::CUptiResult::CUPTI_ERROR_MAX_LIMIT_REACHED => None,
            Err(e) => return Err(format!("cuptiActivityGetNextRecord failed: {:?}", e.0)),
        };
        if let Some(prev) = previous {
            // A record's readable extent runs to the next record (or the end of the valid bytes):
            // fields past it belong to a newer record version than the library wrote.
            let extent = next.map_or(end, |n| n as usize).saturating_sub(prev as usize);
            // SAFETY: `prev..prev + extent` lies inside the valid part of the buffer.
            if let Some(activity) = unsafe { parse_record(prev, extent) } {
                out.push(activity);
            }
        }
        match next {
            Some(n) if (buffer as usize..end).contains(&(n as usize)) && previous.is_none_or(|p| n > p) => {
                previous = Some(n)
            }
            Some(_) => return Err("CUPTI returned a record outside the valid bytes, or out of order".to_string()),
            None => return Ok(out),
        }
    }
}

/// Integer and pointer types: every bit pattern is a valid value, so they may be read from a
/// record whatever CUPTI wrote (unlike the records' enum fields, which are never read).
trait Plain: Copy {}
impl Plain for u8 {}
impl Plain for u16 {}
impl Plain for u32 {}
impl Plain for i32 {}
impl Plain for u64 {}
impl Plain for *const c_char {}

/// Reads one field of record type `S` at `offset` through `project`, or `None` when the field lies
/// past the `len` readable bytes of the record (an older, shorter version of the record).
///
/// # Safety
/// `ptr..ptr + len` must be readable; `project` must only project to a field of `S` at `offset`.
unsafe fn read_field<S, F: Plain>(
    ptr: *const u8,
    len: usize,
    offset: usize,
    project: fn(*const S) -> *const F,
) -> Option<F> {
    if offset.checked_add(size_of::<F>())? > len {
        return None;
    }
    // SAFETY: the field's bytes lie within the readable extent (checked above), so the projection
    // stays inside the buffer; the read is unaligned-tolerant and `F: Plain` accepts any bits.
    Some(unsafe { project(ptr.cast::<S>()).read_unaligned() })
}

/// `field!(ptr, len, Struct, field)`: the field of the record at `ptr`, if the record has it.
macro_rules! field {
    ($ptr:expr, $len:expr, $S:ty, $f:ident) => {{
        let project = |s: *const $S| {
            // SAFETY: a raw projection (no reference, no read) of a pointer `read_field` has
            // checked to hold the field in bounds.
            unsafe { &raw const (*s).$f }
        };
        // SAFETY: `parse_record`'s contract makes `ptr..ptr + len` readable; `project` projects
        // to the field `offset_of!` measured.
        unsafe { read_field::<$S, _>($ptr, $len, ::core::mem::offset_of!($S, $f), project) }
    }};
}

/// The CUDA 13.0 record versions (CUPTI appends fields in newer versions, so a newer library's
/// records read correctly through these, and fields missing from an older one read as `None`).
type Kernel = sys::CUpti_ActivityKernel10;
type Memcpy = sys::CUpti_ActivityMemcpy6;
type Memset = sys::CUpti_ActivityMemset4;

const KIND_MEMCPY: u32 = sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_MEMCPY as u32;
const KIND_MEMSET: u32 = sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_MEMSET as u32;
const KIND_KERNEL: u32 = sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_KERNEL as u32;
const KIND_CONCURRENT_KERNEL: u32 = sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL as u32;

/// Turns one record into an [`Activity`]; `None` for a record too short to hold its kind.
///
/// # Safety
/// `ptr..ptr + len` must be readable, and be one CUPTI activity record (possibly followed by padding).
unsafe fn parse_record(ptr: *const u8, len: usize) -> Option<Activity> {
    if len < size_of::<u32>() {
        return None;
    }
    // The kind is read as a number (offset 0 of every record): an unknown value must not become an
    // invalid Rust enum.
    // SAFETY: at least 4 bytes at `ptr` are readable (contract and the check above); any u32 is valid.
    let kind = unsafe { ptr.cast::<u32>().read_unaligned() };
    let mut activity = Activity::synthetic(ActivityKind::Other(kind), "", 0, 0);
    match kind {
        KIND_KERNEL | KIND_CONCURRENT_KERNEL => {
            macro_rules! k {
                ($f:ident) => {
                    field!(ptr, len, Kernel, $f).unwrap_or_default()
                };
            }
            let name = field!(ptr, len, Kernel, name).unwrap_or(std::ptr::null());
            activity.kind = ActivityKind::Kernel;
            activity.name = if name.is_null() {
                "<unnamed kernel>".to_string()
            } else {
                // SAFETY: CUPTI's kernel name is a NUL-terminated string it owns and keeps alive
                // (shared by every record of the kernel); it is copied out at once.
                unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
            };
            activity.start_ns = k!(start);
            activity.end_ns = k!(end);
            activity.stream_id = k!(streamId);
            activity.correlation_id = k!(correlationId);
            activity.grid = (k!(gridX), k!(gridY), k!(gridZ));
            activity.block = (k!(blockX), k!(blockY), k!(blockZ));
            activity.registers = k!(registersPerThread);
            activity.static_smem = k!(staticSharedMemory);
            activity.dynamic_smem = k!(dynamicSharedMemory);
            activity.graph_id = k!(graphId);
            activity.launched_from_device = field!(ptr, len, Kernel, isDeviceLaunched).unwrap_or(0) != 0;
        }
        KIND_MEMCPY => {
            macro_rules! m {
                ($f:ident) => {
                    field!(ptr, len, Memcpy, $f).unwrap_or_default()
                };
            }
            let bytes: u64 = m!(bytes);
            activity.kind = ActivityKind::Memcpy;
            activity.name = format!("memcpy {} {bytes} bytes", copy_kind_name(m!(copyKind)));
            activity.bytes = bytes;
            activity.start_ns = m!(start);
            activity.end_ns = m!(end);
            activity.stream_id = m!(streamId);
            activity.correlation_id = m!(correlationId);
            activity.graph_id = m!(graphId);
            activity.launched_from_device = field!(ptr, len, Memcpy, isDeviceLaunched).unwrap_or(0) != 0;
        }
        KIND_MEMSET => {
            macro_rules! m {
                ($f:ident) => {
                    field!(ptr, len, Memset, $f).unwrap_or_default()
                };
            }
            let bytes: u64 = m!(bytes);
            activity.kind = ActivityKind::Memset;
            activity.name = format!("memset {bytes} bytes");
            activity.bytes = bytes;
            activity.start_ns = m!(start);
            activity.end_ns = m!(end);
            activity.stream_id = m!(streamId);
            activity.correlation_id = m!(correlationId);
            activity.graph_id = m!(graphId);
            activity.launched_from_device = field!(ptr, len, Memset, isDeviceLaunched).unwrap_or(0) != 0;
        }
        _ => {}
    }
    Some(activity)
}

/// `CUpti_ActivityMemcpyKind` as nsys prints it.
fn copy_kind_name(kind: u8) -> &'static str {
    match kind {
        1 => "HtoD",
        2 => "DtoH",
        3 => "HtoA",
        4 => "AtoH",
        5 => "AtoA",
        6 => "AtoD",
        7 => "DtoA",
        8 => "DtoD",
        9 => "HtoH",
        10 => "PtoP",
        _ => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use std::mem::offset_of;

    use super::*;

    /// The field offsets of the CUDA 13.0 records, worked out by hand from cupti_activity.h
    /// (`#pragma pack(8)`): a change in cudarc's bindings shows up here before it shows up on a GPU.
    #[test]
    fn record_layouts_match_cupti_13_0() {
        assert_eq!(offset_of!(Kernel, registersPerThread), 6);
        assert_eq!(offset_of!(Kernel, start), 16);
        assert_eq!(offset_of!(Kernel, end), 24);
        assert_eq!(offset_of!(Kernel, streamId), 48);
        assert_eq!(offset_of!(Kernel, gridX), 52);
        assert_eq!(offset_of!(Kernel, blockX), 64);
        assert_eq!(offset_of!(Kernel, staticSharedMemory), 76);
        assert_eq!(offset_of!(Kernel, dynamicSharedMemory), 80);
        assert_eq!(offset_of!(Kernel, correlationId), 92);
        assert_eq!(offset_of!(Kernel, name), 104);
        assert_eq!(offset_of!(Kernel, launchType), 136);
        assert_eq!(offset_of!(Kernel, graphNodeId), 144);
        assert_eq!(offset_of!(Kernel, graphId), 156);
        assert_eq!(offset_of!(Kernel, isDeviceLaunched), 208);
        assert_eq!(size_of::<Kernel>(), 216);

        assert_eq!(offset_of!(Memcpy, copyKind), 4);
        assert_eq!(offset_of!(Memcpy, bytes), 8);
        assert_eq!(offset_of!(Memcpy, start), 16);
        assert_eq!(offset_of!(Memcpy, streamId), 40);
        assert_eq!(offset_of!(Memcpy, correlationId), 44);
        assert_eq!(offset_of!(Memcpy, graphId), 72);
        assert_eq!(offset_of!(Memcpy, isDeviceLaunched), 84);
        assert_eq!(size_of::<Memcpy>(), 96);

        assert_eq!(offset_of!(Memset, bytes), 8);
        assert_eq!(offset_of!(Memset, start), 16);
        assert_eq!(offset_of!(Memset, streamId), 40);
        assert_eq!(offset_of!(Memset, correlationId), 44);
        assert_eq!(offset_of!(Memset, graphId), 72);
        assert_eq!(offset_of!(Memset, isDeviceLaunched), 84);
        assert_eq!(size_of::<Memset>(), 88);
    }

    /// An 8-aligned scratch buffer standing in for a CUPTI activity buffer.
    struct FakeRecord(Vec<u64>);

    impl FakeRecord {
        fn new(kind: u32) -> Self {
            let mut r = FakeRecord(vec![0; 64]);
            r.put(0, kind);
            r
        }

        fn put<T: Copy>(&mut self, offset: usize, value: T) {
            assert!(offset + size_of::<T>() <= self.0.len() * 8);
            // SAFETY: in bounds (asserted); an unaligned write of plain data into our own buffer.
            unsafe { self.0.as_mut_ptr().cast::<u8>().add(offset).cast::<T>().write_unaligned(value) }
        }

        fn parse(&self, len: usize) -> Option<Activity> {
            assert!(len <= self.0.len() * 8);
            // SAFETY: `len` bytes of the buffer are readable (asserted).
            unsafe { parse_record(self.0.as_ptr().cast::<u8>(), len) }
        }
    }

    #[test]
    fn kernel_records_parse() {
        static NAME: &CStr = c"layer_step";
        let mut r = FakeRecord::new(KIND_CONCURRENT_KERNEL);
        r.put(offset_of!(Kernel, registersPerThread), 96u16);
        r.put(offset_of!(Kernel, start), 1_000u64);
        r.put(offset_of!(Kernel, end), 2_500u64);
        r.put(offset_of!(Kernel, streamId), 13u32);
        r.put(offset_of!(Kernel, gridX), 132i32);
        r.put(offset_of!(Kernel, gridY), 2i32);
        r.put(offset_of!(Kernel, gridZ), 1i32);
        r.put(offset_of!(Kernel, blockX), 512i32);
        r.put(offset_of!(Kernel, blockY), 1i32);
        r.put(offset_of!(Kernel, blockZ), 1i32);
        r.put(offset_of!(Kernel, staticSharedMemory), 1024i32);
        r.put(offset_of!(Kernel, dynamicSharedMemory), 200_000i32);
        r.put(offset_of!(Kernel, correlationId), 77u32);
        r.put(offset_of!(Kernel, name), NAME.as_ptr());
        r.put(offset_of!(Kernel, graphId), 5u32);
        r.put(offset_of!(Kernel, isDeviceLaunched), 1u8);
        let a = r.parse(size_of::<Kernel>()).unwrap();
        let expected = Activity {
            kind: ActivityKind::Kernel,
            name: "layer_step".to_string(),
            start_ns: 1_000,
            end_ns: 2_500,
            stream_id: 13,
            correlation_id: 77,
            bytes: 0,
            grid: (132, 2, 1),
            block: (512, 1, 1),
            registers: 96,
            static_smem: 1024,
            dynamic_smem: 200_000,
            graph_id: 5,
            launched_from_device: true,
        };
        assert_eq!(a, expected);
        assert_eq!(a.duration_ns(), 1_500);

        // A shorter, older record version (CUDA 12's Kernel9 ends before isDeviceLaunched).
        let old = r.parse(offset_of!(Kernel, isDeviceLaunched)).unwrap();
        assert_eq!(old, Activity { launched_from_device: false, ..expected.clone() });

        // The serialising KIND_KERNEL record has the same layout; a null name is named.
        r.put(0, KIND_KERNEL);
        r.put(offset_of!(Kernel, name), std::ptr::null::<c_char>());
        let unnamed = r.parse(size_of::<Kernel>()).unwrap();
        assert_eq!(unnamed.kind, ActivityKind::Kernel);
        assert_eq!(unnamed.name, "<unnamed kernel>");
    }

    #[test]
    fn copy_and_set_records_parse() {
        let mut r = FakeRecord::new(KIND_MEMCPY);
        r.put(offset_of!(Memcpy, copyKind), 8u8);
        r.put(offset_of!(Memcpy, bytes), 1234u64);
        r.put(offset_of!(Memcpy, start), 10u64);
        r.put(offset_of!(Memcpy, end), 20u64);
        r.put(offset_of!(Memcpy, streamId), 3u32);
        r.put(offset_of!(Memcpy, correlationId), 4u32);
        r.put(offset_of!(Memcpy, graphId), 9u32);
        let a = r.parse(size_of::<Memcpy>()).unwrap();
        assert_eq!(a.kind, ActivityKind::Memcpy);
        assert_eq!((a.name.as_str(), a.bytes), ("memcpy DtoD 1234 bytes", 1234));
        assert_eq!((a.start_ns, a.end_ns, a.stream_id, a.correlation_id, a.graph_id), (10, 20, 3, 4, 9));
        assert_eq!((a.grid, a.block, a.registers), ((0, 0, 0), (0, 0, 0), 0));

        let mut r = FakeRecord::new(KIND_MEMSET);
        r.put(offset_of!(Memset, bytes), 64u64);
        r.put(offset_of!(Memset, start), 30u64);
        r.put(offset_of!(Memset, end), 31u64);
        r.put(offset_of!(Memset, isDeviceLaunched), 1u8);
        let a = r.parse(size_of::<Memset>()).unwrap();
        assert_eq!(a.kind, ActivityKind::Memset);
        assert_eq!((a.name.as_str(), a.bytes), ("memset 64 bytes", 64));
        assert_eq!((a.start_ns, a.end_ns, a.launched_from_device), (30, 31, true));
    }

    #[test]
    fn unknown_and_truncated_records() {
        let r = FakeRecord::new(999);
        assert_eq!(r.parse(16).unwrap().kind, ActivityKind::Other(999));
        assert_eq!(r.parse(3), None);
        // A kernel record cut short reads what it holds and defaults the rest.
        let mut k = FakeRecord::new(KIND_CONCURRENT_KERNEL);
        k.put(offset_of!(Kernel, start), 5u64);
        k.put(offset_of!(Kernel, end), 6u64);
        let a = k.parse(offset_of!(Kernel, end)).unwrap();
        assert_eq!((a.kind, a.start_ns, a.end_ns, a.name.as_str()), (ActivityKind::Kernel, 5, 0, "<unnamed kernel>"));
    }

    #[test]
    fn requested_buffers_are_aligned_and_sized() {
        let mut buffer: *mut u8 = std::ptr::null_mut();
        let (mut size, mut max) = (0usize, 1usize);
        // SAFETY: valid out-pointers, as CUPTI passes.
        unsafe { buffer_requested(&mut buffer, &mut size, &mut max) };
        assert!(!buffer.is_null());
        assert_eq!(buffer as usize % BUFFER_ALIGN, 0);
        assert_eq!((size, max), (BUFFER_SIZE, 0));
        // SAFETY: allocated by `buffer_requested` with this layout.
        unsafe { std::alloc::dealloc(buffer, buffer_layout()) };
    }
}
