//! CUPTI's callback API: the second, independent view of a call's GPU work, from the host side.
//!
//! The activity API reports what the GPU ran; this reports what the process asked for. Every driver
//! and runtime API call that queues work passes through [`api_callback`] on the calling thread,
//! which notes its correlation id against the call that was running ([`Tag`]), which thread asked
//! and when, and notes every kernel launch. The two views meet on correlation ids: a kernel record
//! whose launch was never seen, or a launch that left no kernel record, means something in the
//! process switched one of them off. The resource domain hands over every module the driver loads
//! (its image, to be scanned for device-side launches) and every context created.
//!
//! The tag is a word in the process's memory, which the submission's code can find and write. So
//! the record never takes it on trust alone: the runner's own tags count only for requests from
//! the runner's own thread, and a call's tag only for requests made while that call ran (the
//! request's time against the call's window).
//!
//! One subscriber per process (CUPTI allows one): made once, before the submission is loaded, so a
//! submission cannot subscribe in its place.

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{CStr, c_void};
use std::panic::AssertUnwindSafe;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI32, AtomicI64, Ordering};

use cuda::cudarc::cupti::sys::{
    self, CUpti_ApiCallbackSite, CUpti_CallbackData, CUpti_CallbackDomain, CUpti_CallbackId, CUpti_CallbackIdResource,
    CUpti_ModuleResourceData, CUpti_ResourceData, CUpti_SubscriberHandle,
};
use serde::{Deserialize, Serialize};

use super::CuptiError;
use super::activity::lock;

/// Who was running when an API call was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tag {
    /// `build_layer`.
    Build,
    /// Call `index` of the schedule.
    Call(usize),
    /// `teardown`.
    Teardown,
    /// The runner's own work between calls (the L2 flush).
    Runner,
    /// The runner's own work inside call `index` (a Python submission's `x_out` copy): counted for
    /// that call alone, also when a back-to-back batch's calls share one window.
    RunnerIn(usize),
    /// None of those: before build, between calls.
    Outside,
}

const OUTSIDE: i64 = -1;
const BUILD: i64 = -2;
const TEARDOWN: i64 = -3;
const RUNNER: i64 = -4;
/// `RunnerIn(i)` is stored as `RUNNER_IN - i`, below every other tag.
const RUNNER_IN: i64 = -16;

/// The tag of the work running now, as the runner sets it around build and each call.
static CURRENT: AtomicI64 = AtomicI64::new(OUTSIDE);

/// Marks what runs from now on (the runner's main thread, before and after each call).
pub fn set_current(tag: Tag) {
    let v = match tag {
        Tag::Build => BUILD,
        Tag::Call(i) => i as i64,
        Tag::Teardown => TEARDOWN,
        Tag::Runner => RUNNER,
        Tag::RunnerIn(i) => RUNNER_IN - i as i64,
        Tag::Outside => OUTSIDE,
    };
    // SeqCst: an API call another thread makes after this store sees the new tag.
    CURRENT.store(v, Ordering::SeqCst);
}

/// The tag of the work running now.
pub fn current() -> Tag {
    match CURRENT.load(Ordering::SeqCst) {
        BUILD => Tag::Build,
        TEARDOWN => Tag::Teardown,
        RUNNER => Tag::Runner,
        i if i >= 0 => Tag::Call(i as usize),
        i if i <= RUNNER_IN => Tag::RunnerIn((RUNNER_IN - i) as usize),
        _ => Tag::Outside,
    }
}

/// The thread that runs the runner's own work (the one that started the recording): the only one
/// whose requests the runner's tags may cover.
static RUNNER_THREAD: AtomicI32 = AtomicI32::new(0);

/// This thread's id in the kernel's numbering.
fn thread_id() -> i32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() }
}

/// A request for GPU work the host made: a launch, a copy, a set, a stream-ordered wait, write or
/// host function, an event record, a graph launch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// CUPTI's name of the entry point (a static string: noting it allocates nothing).
    pub function: &'static str,
    pub tag: Tag,
    /// Whether the runner's own thread made it.
    pub runner_thread: bool,
    /// When it was made, on CUPTI's clock (that of the calls' windows).
    pub at_ns: u64,
}

/// A kernel launch the host asked for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Launch {
    pub correlation_id: u32,
    /// The correlation id of the runtime API call this driver launch ran inside, if any: the kernel
    /// record carries one of the two.
    pub runtime_correlation_id: Option<u32>,
    pub function: String,
    pub tag: Tag,
}

/// A module the driver loaded, as the resource callback handed it over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Module {
    pub id: u32,
    pub image: Vec<u8>,
    pub tag: Tag,
}

/// What the callbacks saw.
#[derive(Debug, Default)]
pub struct Seen {
    /// The tag of every API call, by correlation id (to attribute the GPU's records to calls).
    pub tags: HashMap<u32, Tag>,
    /// Every request for GPU work, in order.
    pub requests: Vec<Request>,
    pub launches: Vec<Launch>,
    pub modules: Vec<Module>,
    /// Contexts created after the runner's own (a submission must use the runner's).
    pub contexts_created: Vec<Tag>,
    /// Problems the callback met (it cannot return errors).
    pub faults: Vec<String>,
}

static SEEN: Mutex<Option<Seen>> = Mutex::new(None);

thread_local! {
    /// The correlation id of the runtime API call this thread is inside, if any.
    static RUNTIME_CALL: Cell<Option<u32>> = const { Cell::new(None) };
}

/// A kernel launch entry point of the driver or runtime API, by name (graph launches replay their
/// kernels under the graph launch's correlation id and may hold none, so they are not checked).
pub fn is_kernel_launch(function: &str) -> bool {
    (function.starts_with("cuLaunch") || function.starts_with("cudaLaunch")) && !function.contains("HostFunc")
}

/// The API entry points that queue work on the GPU, by name prefix: kernels (host functions too),
/// graphs, copies, sets, prefetches, and the stream-ordered operations that leave no activity record
/// (waits and writes on a memory word, batches of them, event records and waits, stream callbacks),
/// which can hold up or signal other work. Only these are called back: a callback on every API call
/// (a synchronisation, a context query) would cost every call of every submission time for nothing.
/// A kernel, copy or set that still arrives without a seen API call (one made through an entry
/// point not listed here) is reported, never hidden.
const GPU_WORK: [&str; 19] = [
    "cuLaunch",
    "cuGraphLaunch",
    "cuMemcpy",
    "cuMemset",
    "cuMemPrefetch",
    "cuStreamWaitValue",
    "cuStreamWriteValue",
    "cuStreamBatchMemOp",
    "cuStreamWaitEvent",
    "cuStreamAddCallback",
    "cuEventRecord",
    "cudaLaunch",
    "cudaGraphLaunch",
    "cudaMemcpy",
    "cudaMemset",
    "cudaMemPrefetch",
    "cudaStreamWaitEvent",
    "cudaStreamAddCallback",
    "cudaEventRecord",
];

/// The API domains and how many callback ids each has in the CUDA 13.0 headers.
const API_DOMAINS: [(CUpti_CallbackDomain, u32); 2] = [
    (
        CUpti_CallbackDomain::CUPTI_CB_DOMAIN_DRIVER_API,
        sys::CUpti_driver_api_trace_cbid_enum::CUPTI_DRIVER_TRACE_CBID_SIZE as u32,
    ),
    (
        CUpti_CallbackDomain::CUPTI_CB_DOMAIN_RUNTIME_API,
        sys::CUpti_runtime_api_trace_cbid_enum::CUPTI_RUNTIME_TRACE_CBID_SIZE as u32,
    ),
];

/// The resource callbacks that must stay on: module loads (scanned) and context creation.
const RESOURCES: [CUpti_CallbackIdResource; 2] = [
    CUpti_CallbackIdResource::CUPTI_CBID_RESOURCE_MODULE_LOADED,
    CUpti_CallbackIdResource::CUPTI_CBID_RESOURCE_CONTEXT_CREATED,
];

/// The subscription and the callbacks it enabled; dropping it unsubscribes.
pub struct Subscription {
    handle: CUpti_SubscriberHandle,
    enabled: Vec<(CUpti_CallbackDomain, CUpti_CallbackId, String)>,
}

// SAFETY: the handle is an opaque token CUPTI accepts from any thread.
unsafe impl Send for Subscription {}

/// The callbacks to enable: every GPU-work entry point of the API domains, and the resources.
fn callbacks_to_enable() -> Vec<(CUpti_CallbackDomain, CUpti_CallbackId, String)> {
    let mut all = Vec::new();
    for (domain, size) in API_DOMAINS {
        for cbid in 1..size {
            let mut name: *const std::ffi::c_char = std::ptr::null();
            // SAFETY: a valid out-pointer; CUPTI returns a static NUL-terminated name or an error.
            let r = unsafe { sys::cuptiGetCallbackName(domain, cbid, &mut name) };
            if r != sys::CUptiResult::CUPTI_SUCCESS || name.is_null() {
                continue;
            }
            // SAFETY: non-null and NUL-terminated (CUPTI's static string).
            let name = unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned();
            if GPU_WORK.iter().any(|p| name.starts_with(p)) {
                all.push((domain, cbid, name));
            }
        }
    }
    let resource = CUpti_CallbackDomain::CUPTI_CB_DOMAIN_RESOURCE;
    all.extend(RESOURCES.iter().map(|&r| (resource, r as CUpti_CallbackId, format!("{r:?}"))));
    all
}

impl Subscription {
    /// Subscribes and enables the GPU-work entry points and the resource callbacks.
    pub fn start() -> Result<Subscription, CuptiError> {
        *lock(&SEEN) = Some(Seen::default());
        RUNNER_THREAD.store(thread_id(), Ordering::SeqCst);
        let mut handle: CUpti_SubscriberHandle = std::ptr::null_mut();
        // SAFETY: a valid out-pointer and a callback with CUPTI's signature; no user data.
        let r = unsafe { sys::cuptiSubscribe(&mut handle, Some(api_callback), std::ptr::null_mut()) };
        check("cuptiSubscribe", r)?;
        let mut sub = Subscription { handle, enabled: Vec::new() };
        sub.enabled = callbacks_to_enable();
        if !sub.enabled.iter().any(|(_, _, name)| name == "cuLaunchKernel") {
            return Err(CuptiError::Call { call: "cuptiGetCallbackName", code: "no cuLaunchKernel callback".into() });
        }
        for (domain, cbid, _) in &sub.enabled {
            // SAFETY: the handle is live (subscribed above).
            check("cuptiEnableCallback", unsafe { sys::cuptiEnableCallback(1, sub.handle, *domain, *cbid) })?;
        }
        Ok(sub)
    }

    /// The callbacks found switched off (and switched back on): each one is something in the
    /// process tampering with the record.
    pub fn reassert(&self) -> Vec<String> {
        let mut off = Vec::new();
        for (domain, cbid, name) in &self.enabled {
            let mut enabled = 0u32;
            // SAFETY: a live handle and a valid out-pointer.
            let r = unsafe { sys::cuptiGetCallbackState(&mut enabled, self.handle, *domain, *cbid) };
            if r != sys::CUptiResult::CUPTI_SUCCESS || enabled == 0 {
                off.push(name.clone());
                // SAFETY: as above; a failure here shows again at the next look.
                let _ = unsafe { sys::cuptiEnableCallback(1, self.handle, *domain, *cbid) };
            }
        }
        off
    }

    /// Unsubscribes and returns what was seen.
    pub fn finish(self) -> Seen {
        drop(self);
        lock(&SEEN).take().unwrap_or_default()
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        // SAFETY: the handle is live; unsubscribing twice is prevented by ownership.
        let _ = unsafe { sys::cuptiUnsubscribe(self.handle) };
    }
}

fn check(call: &'static str, r: sys::CUptiResult) -> Result<(), CuptiError> {
    if r == sys::CUptiResult::CUPTI_SUCCESS { Ok(()) } else { Err(CuptiError::Call { call, code: format!("{r:?}") }) }
}

/// CUPTI's callback: never panics into C, never blocks for long (one short lock).
unsafe extern "C" fn api_callback(
    _userdata: *mut c_void,
    domain: CUpti_CallbackDomain,
    cbid: CUpti_CallbackId,
    cbdata: *const c_void,
) {
    if cbdata.is_null() {
        return;
    }
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| match domain {
        CUpti_CallbackDomain::CUPTI_CB_DOMAIN_DRIVER_API | CUpti_CallbackDomain::CUPTI_CB_DOMAIN_RUNTIME_API => {
            // SAFETY: for the API domains CUPTI passes a CUpti_CallbackData, valid during the call.
            let data = unsafe { &*cbdata.cast::<CUpti_CallbackData>() };
            on_api(domain == CUpti_CallbackDomain::CUPTI_CB_DOMAIN_RUNTIME_API, data);
        }
        CUpti_CallbackDomain::CUPTI_CB_DOMAIN_RESOURCE => {
            // SAFETY: for the resource domain CUPTI passes a CUpti_ResourceData, valid during the call.
            let data = unsafe { &*cbdata.cast::<CUpti_ResourceData>() };
            on_resource(cbid, data);
        }
        _ => {}
    }));
    if outcome.is_err()
        && let Some(seen) = lock(&SEEN).as_mut()
    {
        seen.faults.push("the callback panicked".into());
    }
}

fn on_api(runtime: bool, data: &CUpti_CallbackData) {
    let corr = data.correlationId;
    if data.callbackSite == CUpti_ApiCallbackSite::CUPTI_API_EXIT {
        if runtime {
            RUNTIME_CALL.with(|c| {
                if c.get() == Some(corr) {
                    c.set(None)
                }
            });
        }
        return;
    }
    let outer = RUNTIME_CALL.with(|c| {
        let outer = c.get();
        if runtime && outer.is_none() {
            c.set(Some(corr));
        }
        outer
    });
    let tag = current();
    let function: &'static str = if data.functionName.is_null() {
        ""
    } else {
        // SAFETY: CUPTI's function name is a NUL-terminated static string.
        unsafe { CStr::from_ptr(data.functionName) }.to_str().unwrap_or("(a name that is not UTF-8)")
    };
    let runner_thread = thread_id() == RUNNER_THREAD.load(Ordering::SeqCst);
    let mut at_ns = 0;
    // SAFETY: a valid out-pointer; on failure the request keeps time 0, before every window.
    let _ = unsafe { sys::cuptiGetTimestamp(&mut at_ns) };
    let mut guard = lock(&SEEN);
    let Some(seen) = guard.as_mut() else { return };
    seen.tags.insert(corr, tag);
    // A runtime call and the driver call inside it are one request: the outer one is noted.
    if runtime || outer.is_none() {
        seen.requests.push(Request { function, tag, runner_thread, at_ns });
    }
    if is_kernel_launch(function) {
        let runtime_correlation_id = if runtime { None } else { outer };
        seen.launches.push(Launch { correlation_id: corr, runtime_correlation_id, function: function.into(), tag });
    }
}

fn on_resource(cbid: CUpti_CallbackId, data: &CUpti_ResourceData) {
    let tag = current();
    if cbid == CUpti_CallbackIdResource::CUPTI_CBID_RESOURCE_MODULE_LOADED as CUpti_CallbackId {
        if data.resourceDescriptor.is_null() {
            return;
        }
        // SAFETY: for MODULE_LOADED the descriptor is a CUpti_ModuleResourceData, valid during the call.
        let m = unsafe { &*data.resourceDescriptor.cast::<CUpti_ModuleResourceData>() };
        let image = if m.pCubin.is_null() || m.cubinSize == 0 {
            Vec::new()
        } else {
            // SAFETY: CUPTI hands `cubinSize` readable bytes at `pCubin` for the callback's duration;
            // they are copied out at once.
            unsafe { std::slice::from_raw_parts(m.pCubin.cast::<u8>(), m.cubinSize) }.to_vec()
        };
        if let Some(seen) = lock(&SEEN).as_mut() {
            seen.modules.push(Module { id: m.moduleId, image, tag });
        }
    } else if cbid == CUpti_CallbackIdResource::CUPTI_CBID_RESOURCE_CONTEXT_CREATED as CUpti_CallbackId
        && let Some(seen) = lock(&SEEN).as_mut()
    {
        seen.contexts_created.push(tag);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_launch_entry_points_by_name() {
        for f in ["cuLaunchKernel", "cuLaunchKernelEx_ptsz", "cuLaunchCooperativeKernel", "cudaLaunchKernel_v7000"] {
            assert!(is_kernel_launch(f), "{f}");
        }
        for f in ["cuLaunchHostFunc", "cudaLaunchHostFunc", "cuGraphLaunch", "cuMemcpyDtoD_v2", "cuCtxSynchronize"] {
            assert!(!is_kernel_launch(f), "{f}");
        }
    }

    #[test]
    fn tags_round_trip_through_the_current_marker() {
        for tag in [
            Tag::Build,
            Tag::Call(0),
            Tag::Call(71),
            Tag::Teardown,
            Tag::Runner,
            Tag::RunnerIn(0),
            Tag::RunnerIn(71),
            Tag::Outside,
        ] {
            set_current(tag);
            assert_eq!(current(), tag);
        }
        set_current(Tag::Outside);
    }

    #[test]
    fn every_way_to_queue_gpu_work_is_called_back_and_nothing_else() {
        for f in [
            "cuLaunchKernel",
            "cuLaunchHostFunc",
            "cuMemcpyDtoDAsync_v2",
            "cudaMemsetAsync",
            "cuGraphLaunch",
            "cuStreamWaitValue32_v2",
            "cuStreamWriteValue64_v2",
            "cuStreamBatchMemOp_v2",
            "cuStreamWaitEvent",
            "cuEventRecord",
            "cuEventRecordWithFlags",
            "cuMemPrefetchAsync_v2",
            "cudaStreamWaitEvent",
            "cudaLaunchHostFunc",
            "cudaStreamAddCallback",
            "cudaEventRecord",
        ] {
            assert!(GPU_WORK.iter().any(|p| f.starts_with(p)), "{f}");
        }
        for f in ["cuCtxSynchronize", "cuStreamQuery", "cuEventQuery", "cudaDeviceSynchronize", "cuStreamSynchronize"] {
            assert!(!GPU_WORK.iter().any(|p| f.starts_with(p)), "{f}");
        }
    }
}
