//! External submissions: a shared library that speaks the C ABI of
//! `submission/include/persistent_layer.h` (the contract of `docs/task.md` in C), loaded at run time. The
//! header documents the rules; this module mirrors its structs, checks the library's ABI version and
//! forwards the [`Submission`] calls. `submission/examples/external_eager/` is an example library,
//! built by `scripts/build-example`.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::path::Path;

use cuda::cudarc::driver::{CudaSlice, DevicePtrMut};
use cuda::{Context, Device};
use half::bf16;
use libloading::Library;
use reference::gpu::{DeviceCache, DeviceWeights};
use spec::Config;

use crate::{Layer, Submission, SubmissionError, device_address, device_code};

/// `PL_ABI_VERSION` of `submission/include/persistent_layer.h`: the newest version this grader speaks.
pub const PL_ABI_VERSION: u32 = 2;

/// The oldest version this grader loads: version 2 only added stacks, so a version-1 library still runs
/// one layer (and is declined a stack).
pub const PL_ABI_VERSION_ONE_LAYER: u32 = 1;

/// `PL_ERR_UNSUPPORTED` of the header: `pl_build_layer` or `pl_build_stack` declines what it does not
/// implement.
pub const PL_ERR_UNSUPPORTED: c_int = 2;

/// `pl_config`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct PlConfig {
    d: i32,
    ffn: i32,
    n_q: i32,
    n_kv: i32,
    hd: i32,
    max_seq_len: i32,
    batch: i32,
    eps: f32,
    theta: f64,
}

/// `pl_weights`: device pointers, read-only.
#[repr(C)]
#[derive(Clone, Copy)]
struct PlWeights {
    in_norm: *const c_void,
    post_norm: *const c_void,
    q: *const c_void,
    k: *const c_void,
    v: *const c_void,
    o: *const c_void,
    gate: *const c_void,
    up: *const c_void,
    down: *const c_void,
}

/// `pl_kv_cache`: device pointers.
#[repr(C)]
#[derive(Clone, Copy)]
struct PlKvCache {
    k: *mut c_void,
    v: *mut c_void,
}

type AbiVersionFn = unsafe extern "C" fn() -> u32;
type BuildLayerFn = unsafe extern "C" fn(
    cfg: *const PlConfig,
    w: *const PlWeights,
    cache: *const PlKvCache,
    stream: *mut c_void,
    handle: *mut *mut c_void,
) -> c_int;
type LayerStepFn = unsafe extern "C" fn(
    handle: *mut c_void,
    x: *const c_void,
    pos: i32,
    out: *mut c_void,
    stream: *mut c_void,
) -> c_int;
type BuildStackFn = unsafe extern "C" fn(
    cfg: *const PlConfig,
    n_layers: u32,
    w: *const PlWeights,
    caches: *const PlKvCache,
    stream: *mut c_void,
    handle: *mut *mut c_void,
) -> c_int;
type StackStepFn = unsafe extern "C" fn(
    handle: *mut c_void,
    x: *const c_void,
    pos: u32,
    hidden: *mut c_void,
    out: *mut c_void,
    stream: *mut c_void,
) -> c_int;
type TeardownFn = unsafe extern "C" fn(handle: *mut c_void);
type LastErrorFn = unsafe extern "C" fn() -> *const c_char;

/// The library's functions, copied out of it: valid while `ExternalSubmission::_lib` is loaded.
struct Api {
    build_layer: BuildLayerFn,
    layer_step: LayerStepFn,
    teardown: TeardownFn,
    last_error: LastErrorFn,
    /// Version 2's; `None` for a version-1 library, which runs one layer.
    stack: Option<StackApi>,
}

/// `pl_build_stack` and `pl_stack_step`.
#[derive(Clone, Copy)]
struct StackApi {
    build: BuildStackFn,
    step: StackStepFn,
}

/// A submission in a shared library. Reports name it by the library's file stem.
pub struct ExternalSubmission {
    name: String,
    api: Api,
    /// `pl_build_layer`'s or `pl_build_stack`'s handle; null when nothing is built.
    handle: *mut c_void,
    /// How many layers `handle` runs: 1 for `pl_build_layer`'s, 2 or more for `pl_build_stack`'s (which
    /// only `pl_stack_step` takes), 0 with no handle.
    layers: usize,
    /// Declared last so that it is unloaded after `Drop::drop` has called `pl_teardown`.
    _lib: Library,
}

/// Loads the submission library at `path` (see [`ExternalSubmission::open`]).
pub fn load(path: &Path) -> Result<Box<dyn Submission>, SubmissionError> {
    Ok(Box::new(ExternalSubmission::open(path)?))
}

fn refused(msg: impl Into<String>) -> SubmissionError {
    SubmissionError::Refused(msg.into())
}

/// A file that cannot be used as a submission library, and why.
fn not_a_library(msg: String) -> SubmissionError {
    SubmissionError::NotALibrary(msg)
}

/// The reason dlopen gave: libloading's own message is only "dlopen failed", its source has dlerror().
fn dlopen_reason(e: &libloading::Error) -> String {
    std::error::Error::source(e).map_or_else(|| e.to_string(), |source| source.to_string())
}

/// Resolves `name` in `lib` as a function of type `T`.
///
/// # Safety
///
/// `T` must be the function pointer type the header declares for `name`.
unsafe fn symbol<T: Copy>(lib: &Library, path: &Path, name: &str) -> Result<T, SubmissionError> {
    // SAFETY: the caller's contract: T is the symbol's declared type.
    match unsafe { lib.get::<T>(name.as_bytes()) } {
        Ok(sym) => Ok(*sym),
        Err(_) => Err(not_a_library(format!(
            "{} is not a persistent-layer submission: it has no symbol {name} (see submission/include/persistent_layer.h)",
            path.display()
        ))),
    }
}

/// Refuses a library whose device code launches kernels from the device, or cannot be inspected
/// ([`device_code::scan_library`]), reading the file before dlopen runs any of its code.
fn refuse_device_launches(path: &Path) -> Result<(), SubmissionError> {
    let file = std::fs::read(path)
        .map_err(|e| refused(format!("could not read the submission library {}: {e}", path.display())))?;
    match device_code::summary(&device_code::scan_library(&file)) {
        None => Ok(()),
        Some(summary) => Err(refused(format!("{} carries device code the grader refuses, {summary}", path.display()))),
    }
}

impl ExternalSubmission {
    /// Loads the library at `path`, checks that it speaks a version from [`PL_ABI_VERSION_ONE_LAYER`]
    /// to [`PL_ABI_VERSION`] and resolves the functions of `persistent_layer.h` of its version: five for
    /// one layer, and the two of stacks from version 2.
    pub fn open(path: &Path) -> Result<Self, SubmissionError> {
        if path.is_dir() {
            return Err(not_a_library(format!("{} is a directory, not a submission library", path.display())));
        }
        if !path.is_file() {
            return Err(not_a_library(format!("no submission library at {}", path.display())));
        }
        refuse_device_launches(path)?;
        // A bare file name would make dlopen search the system's library folders instead.
        let file = if path.components().count() == 1 { Path::new(".").join(path) } else { path.to_path_buf() };
        // SAFETY: loading runs the library's initialisers; a submission library is trusted code
        // the user asked to run, and it is loaded once, from this thread.
        let lib = unsafe { Library::new(&file) }.map_err(|e| {
            not_a_library(format!(
                "could not load the submission library {}: dlopen: {}",
                path.display(),
                dlopen_reason(&e)
            ))
        })?;
        // SAFETY: pl_abi_version is declared `uint32_t pl_abi_version(void)`.
        let abi_version: AbiVersionFn = unsafe { symbol(&lib, path, "pl_abi_version") }?;
        // SAFETY: it takes no arguments and, per the header, only returns a constant.
        let version = unsafe { abi_version() };
        if !(PL_ABI_VERSION_ONE_LAYER..=PL_ABI_VERSION).contains(&version) {
            return Err(not_a_library(format!(
                "{} was built against ABI version {version}, this grader speaks versions \
                 {PL_ABI_VERSION_ONE_LAYER} to {PL_ABI_VERSION}: rebuild it with this grader's \
                 submission/include/persistent_layer.h",
                path.display()
            )));
        }
        // SAFETY: each type is the declaration of that name in persistent_layer.h, the stack's two
        // resolved only from the version that declares them.
        let api = unsafe {
            Api {
                build_layer: symbol(&lib, path, "pl_build_layer")?,
                layer_step: symbol(&lib, path, "pl_layer_step")?,
                teardown: symbol(&lib, path, "pl_teardown")?,
                last_error: symbol(&lib, path, "pl_last_error")?,
                stack: if version == PL_ABI_VERSION_ONE_LAYER {
                    None
                } else {
                    Some(StackApi {
                        build: symbol(&lib, path, "pl_build_stack")?,
                        step: symbol(&lib, path, "pl_stack_step")?,
                    })
                },
            }
        };
        let name = path.file_stem().map_or_else(|| path.display().to_string(), |s| s.to_string_lossy().into_owned());
        Ok(Self { name, api, handle: std::ptr::null_mut(), layers: 0, _lib: lib })
    }

    /// The stack functions, for a stack of `layers`; a version-1 library has none and declines it.
    fn stack_api(&self, layers: usize) -> Result<StackApi, SubmissionError> {
        self.api.stack.ok_or_else(|| {
            SubmissionError::Unsupported(format!(
                "a stack of {layers} layers: {} speaks ABI version {PL_ABI_VERSION_ONE_LAYER}, which runs one \
                 layer (stacks came with version 2's pl_build_stack and pl_stack_step)",
                self.name
            ))
        })
    }

    /// `pl_last_error()`, for the message of a failed call.
    fn last_error(&self) -> String {
        // SAFETY: pl_last_error takes no arguments and returns a NUL-terminated string (or, from a
        // library breaking the header's promise, NULL, handled below).
        let p = unsafe { (self.api.last_error)() };
        if p.is_null() {
            return "(pl_last_error returned NULL)".into();
        }
        // SAFETY: non-null, NUL-terminated and valid until the next call into the library (header,
        // rule 8); it is copied out at once.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// The error of a call that returned `code`.
    fn failed(&self, function: &str, code: c_int) -> SubmissionError {
        refused(format!("{function} returned {code}: {}", self.last_error()))
    }

    /// The error of `function` (`pl_build_layer` or `pl_build_stack`) returning `code`, `message` being
    /// the library's sentence: `PL_ERR_UNSUPPORTED` declines the config (judged `unsupported`), any
    /// other code is a failure.
    fn build_failed(function: &str, code: c_int, message: String) -> SubmissionError {
        match code {
            PL_ERR_UNSUPPORTED if message.trim().is_empty() => SubmissionError::Unsupported(format!(
                "{function} returned PL_ERR_UNSUPPORTED without saying why (pl_last_error was empty)"
            )),
            PL_ERR_UNSUPPORTED => SubmissionError::Unsupported(message),
            _ => refused(format!("{function} returned {code}: {message}")),
        }
    }

    /// Keeps the handle a build of `layers` layers by `function` made, or says why there is none.
    fn keep_handle(
        &mut self,
        function: &str,
        code: c_int,
        handle: *mut c_void,
        layers: usize,
    ) -> Result<(), SubmissionError> {
        if code != 0 {
            return Err(Self::build_failed(function, code, self.last_error()));
        }
        if handle.is_null() {
            return Err(refused(format!("{function} returned 0 but no handle")));
        }
        (self.handle, self.layers) = (handle, layers);
        Ok(())
    }

    /// `pl_build_stack` over each layer's weights and cache, layer 0's first, as the header's two arrays.
    fn build_stack_from(
        &mut self,
        stack: StackApi,
        cfg: &PlConfig,
        layers: &[(PlWeights, PlKvCache)],
        stream: *mut c_void,
    ) -> Result<(), SubmissionError> {
        let n_layers = u32::try_from(layers.len())
            .map_err(|_| refused(format!("a stack of {} layers does not fit the ABI's uint32", layers.len())))?;
        let (weights, caches): (Vec<PlWeights>, Vec<PlKvCache>) = layers.iter().copied().unzip();
        let mut handle = std::ptr::null_mut();
        // SAFETY: the structs are repr(C) mirrors of the header's, the arrays hold n_layers entries each
        // and live through the call; the pointers in them are the grader's buffers, which stay
        // allocated and in place for the whole run (`Layer`); the stream is the grader's.
        let code = unsafe { (stack.build)(cfg, n_layers, weights.as_ptr(), caches.as_ptr(), stream, &mut handle) };
        self.keep_handle("pl_build_stack", code, handle, layers.len())
    }

    /// `pl_stack_step` through the `layers` of the handle `pl_build_stack` made, the pointers being
    /// the grader's buffers.
    fn stack_step_at(
        &mut self,
        layers: usize,
        x: *const c_void,
        pos: usize,
        hidden: *mut c_void,
        out: *mut c_void,
        stream: *mut c_void,
    ) -> Result<(), SubmissionError> {
        let stack = match self.api.stack {
            Some(stack) if !self.handle.is_null() && self.layers > 1 => stack,
            _ => return Err(refused("stack_step before build_stack")),
        };
        if layers != self.layers {
            return Err(refused(format!("stack_step over {layers} layers; build_stack built {}", self.layers)));
        }
        let pos = u32::try_from(pos).map_err(|_| refused(format!("position {pos} does not fit the ABI's uint32")))?;
        // SAFETY: the handle came from this library's pl_build_stack and was not torn down; the caller
        // passes the grader's buffers, alive through the call: x and out (batch, d), hidden
        // (layers - 1, batch, d), all bf16; the stream is the grader's.
        let code = unsafe { (stack.step)(self.handle, x, pos, hidden, out, stream) };
        if code != 0 {
            return Err(self.failed("pl_stack_step", code));
        }
        Ok(())
    }

    fn pl_config(cfg: &Config) -> Result<PlConfig, SubmissionError> {
        let int = |field: &str, v: usize| {
            i32::try_from(v).map_err(|_| refused(format!("config field {field} = {v} does not fit the ABI's int32")))
        };
        Ok(PlConfig {
            d: int("d", cfg.d)?,
            ffn: int("ffn", cfg.ffn)?,
            n_q: int("n_q", cfg.n_q)?,
            n_kv: int("n_kv", cfg.n_kv)?,
            hd: int("hd", cfg.hd)?,
            max_seq_len: int("max_seq_len", cfg.max_seq_len)?,
            batch: int("batch", cfg.batch)?,
            eps: cfg.eps,
            theta: cfg.theta,
        })
    }
}

/// A device pointer as the ABI passes it.
fn ptr<T>(dev: &Device, s: &CudaSlice<T>) -> *const c_void {
    device_address(dev, s) as *const c_void
}

/// A writable device pointer as the ABI passes it.
fn ptr_mut<T>(dev: &Device, s: &mut CudaSlice<T>) -> *mut c_void {
    s.device_ptr_mut(dev.stream()).0 as *mut c_void
}

/// A layer's weights as the ABI passes them.
fn pl_weights(dev: &Device, w: &DeviceWeights) -> PlWeights {
    PlWeights {
        in_norm: ptr(dev, &w.in_norm),
        post_norm: ptr(dev, &w.post_norm),
        q: ptr(dev, &w.q),
        k: ptr(dev, &w.k),
        v: ptr(dev, &w.v),
        o: ptr(dev, &w.o),
        gate: ptr(dev, &w.gate),
        up: ptr(dev, &w.up),
        down: ptr(dev, &w.down),
    }
}

/// A layer's cache as the ABI passes it.
fn pl_kv_cache(dev: &Device, cache: &mut DeviceCache) -> PlKvCache {
    PlKvCache { k: ptr_mut(dev, &mut cache.k), v: ptr_mut(dev, &mut cache.v) }
}

/// The grader's stream as the ABI passes it, with the grader's context made current on this thread,
/// which the library's CUDA runtime uses.
fn stream(dev: &Device) -> Result<*mut c_void, SubmissionError> {
    dev.ctx().bind_to_thread().context("making the grader's context current for the submission")?;
    Ok(dev.stream().cu_stream() as *mut c_void)
}

impl Submission for ExternalSubmission {
    fn name(&self) -> &str {
        &self.name
    }

    fn build_layer(&mut self, dev: &Device, layer: Layer<'_>, cfg: &Config) -> Result<(), SubmissionError> {
        self.teardown();
        let pl_cfg = Self::pl_config(cfg)?;
        let (weights, cache) = (pl_weights(dev, layer.weights), pl_kv_cache(dev, layer.cache));
        let stream = stream(dev)?;
        let mut handle = std::ptr::null_mut();
        // SAFETY: the structs are repr(C) mirrors of the header's and live through the call; the
        // pointers are the grader's buffers, which stay allocated and in place for the whole run
        // (`Layer`); the stream is the grader's (NULL is the legacy default stream, as the header says).
        let code = unsafe { (self.api.build_layer)(&pl_cfg, &weights, &cache, stream, &mut handle) };
        self.keep_handle("pl_build_layer", code, handle, 1)
    }

    fn layer_step(
        &mut self,
        dev: &Device,
        layer: Layer<'_>,
        x: &CudaSlice<bf16>,
        pos: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        // The cache was handed over in build_layer; the library writes it through those pointers.
        let _ = layer;
        if self.handle.is_null() || self.layers != 1 {
            return Err(refused("layer_step before build_layer"));
        }
        let pos = i32::try_from(pos).map_err(|_| refused(format!("position {pos} does not fit the ABI's int32")))?;
        let (x, out) = (ptr(dev, x), ptr_mut(dev, out));
        let stream = stream(dev)?;
        // SAFETY: the handle came from this library's pl_build_layer and was not torn down; x and out
        // are the grader's (batch, d) bf16 buffers, alive through the call; the stream is the grader's.
        let code = unsafe { (self.api.layer_step)(self.handle, x, pos, out, stream) };
        if code != 0 {
            return Err(self.failed("pl_layer_step", code));
        }
        Ok(())
    }

    /// A stack of one through `pl_build_layer`, exactly as version 1; a deeper one through
    /// `pl_build_stack`, which a version-1 library lacks and so declines.
    fn build_stack(&mut self, dev: &Device, layers: &mut [Layer<'_>], cfg: &Config) -> Result<(), SubmissionError> {
        let stack = match layers {
            [] => return Err(refused("a stack of no layers")),
            [one] => return self.build_layer(dev, one.reborrow(), cfg),
            _ => self.stack_api(layers.len())?,
        };
        self.teardown();
        let pl_cfg = Self::pl_config(cfg)?;
        let args: Vec<_> = layers.iter_mut().map(|l| (pl_weights(dev, l.weights), pl_kv_cache(dev, l.cache))).collect();
        let stream = stream(dev)?;
        self.build_stack_from(stack, &pl_cfg, &args, stream)
    }

    fn stack_step(
        &mut self,
        dev: &Device,
        layers: &mut [Layer<'_>],
        x: &CudaSlice<bf16>,
        pos: usize,
        hidden: Option<&mut CudaSlice<bf16>>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        let depth = layers.len();
        // The caches were handed over in build_stack; the library writes them through those pointers,
        // and `hidden` in full (checked_hidden checks its size).
        let Some(hidden) = crate::checked_hidden(depth, out.len(), hidden)? else {
            return self.layer_step(dev, layers[0].reborrow(), x, pos, out);
        };
        let (x, hidden, out) = (ptr(dev, x), ptr_mut(dev, hidden), ptr_mut(dev, out));
        let stream = stream(dev)?;
        self.stack_step_at(depth, x, pos, hidden, out, stream)
    }

    fn teardown(&mut self) {
        if self.handle.is_null() {
            return;
        }
        let handle = std::mem::replace(&mut self.handle, std::ptr::null_mut());
        self.layers = 0;
        // SAFETY: the handle came from this library's pl_build_layer or pl_build_stack and is torn down
        // exactly once (it is nulled above).
        unsafe { (self.api.teardown)(handle) };
    }
}

impl Drop for ExternalSubmission {
    fn drop(&mut self) {
        self.teardown();
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::process::Command;

    use super::*;

    fn workspace() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
    }

    fn open_err(path: &Path) -> String {
        match ExternalSubmission::open(path) {
            Ok(_) => panic!("{} loaded as a submission", path.display()),
            Err(e) => e.to_string(),
        }
    }

    /// The example library: `$PL_EXAMPLE_SO` when set, else built by `scripts/build-example`.
    fn example_library() -> PathBuf {
        if let Some(p) = std::env::var_os("PL_EXAMPLE_SO") {
            return PathBuf::from(p);
        }
        let root = workspace();
        let out = Command::new(root.join("scripts/build-example"))
            .current_dir(&root)
            .output()
            .expect("could not run scripts/build-example");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "scripts/build-example failed:\n{stderr}");
        let printed = String::from_utf8_lossy(&out.stdout).trim().to_string();
        assert_eq!(printed, "target/examples/libexternal_eager.so", "scripts/build-example printed {printed:?}");
        root.join(printed)
    }

    #[test]
    fn abi_version_mirrors_the_header() {
        let header = workspace().join("submission/include/persistent_layer.h");
        let text = std::fs::read_to_string(&header).unwrap();
        let defined: Vec<u32> = text
            .lines()
            .filter_map(|l| l.trim().strip_prefix("#define PL_ABI_VERSION "))
            .map(|v| v.trim().parse().unwrap())
            .collect();
        assert_eq!(defined, [PL_ABI_VERSION], "{} defines PL_ABI_VERSION as {defined:?}", header.display());
    }

    /// The header's code for a declined config is the one this module reads.
    #[test]
    fn pl_err_unsupported_mirrors_the_header() {
        let text = std::fs::read_to_string(workspace().join("submission/include/persistent_layer.h")).unwrap();
        let defined: Vec<c_int> = text
            .lines()
            .filter_map(|l| l.trim().strip_prefix("#define PL_ERR_UNSUPPORTED "))
            .map(|v| v.split_whitespace().next().unwrap().parse().unwrap())
            .collect();
        assert_eq!(defined, [PL_ERR_UNSUPPORTED]);
    }

    /// `PL_ERR_UNSUPPORTED` from pl_build_layer is a declined config with the library's own sentence;
    /// any other code stays a failure naming the function and the code.
    #[test]
    fn build_layers_unsupported_code_declines_the_config() {
        let said = "hd = 256 is over this kernel's 128";
        match ExternalSubmission::build_failed("pl_build_layer", PL_ERR_UNSUPPORTED, said.into()) {
            SubmissionError::Unsupported(m) => assert_eq!(m, said),
            other => panic!("{other:?}"),
        }
        match ExternalSubmission::build_failed("pl_build_stack", PL_ERR_UNSUPPORTED, String::new()) {
            SubmissionError::Unsupported(m) => {
                assert!(m.starts_with("pl_build_stack returned PL_ERR_UNSUPPORTED without saying why"), "{m}")
            }
            other => panic!("{other:?}"),
        }
        for code in [1, 3, 4, -1] {
            match ExternalSubmission::build_failed("pl_build_layer", code, "out of memory".into()) {
                SubmissionError::Refused(m) => assert_eq!(m, format!("pl_build_layer returned {code}: out of memory")),
                other => panic!("code {code}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_missing_library_is_named() {
        let msg = open_err(Path::new("/nonexistent/libnothing.so"));
        assert!(msg.contains("no submission library at /nonexistent/libnothing.so"), "{msg}");
    }

    #[test]
    fn a_library_without_the_symbols_is_refused() {
        let libc =
            ["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/lib/aarch64-linux-gnu"]
                .iter()
                .map(|d| Path::new(d).join("libc.so.6"))
                .find(|p| p.is_file())
                .expect("no libc.so.6 in the usual folders to test with");
        let msg = open_err(&libc);
        assert!(msg.contains("not a persistent-layer submission: it has no symbol pl_abi_version"), "{msg}");
    }

    /// A library with dynamic parallelism is refused before it is loaded, naming the library, the
    /// module and the symbol.
    #[test]
    fn a_library_that_launches_from_the_device_is_refused() {
        let fixtures = crate::device_code::tests::Fixtures::new("external");
        let path = crate::device_code::tests::cdp_library(&fixtures);
        let msg = open_err(&path);
        let library = path.display().to_string();
        let named =
            [library.as_str(), "section .nv_fatbin", "entry 1 of 1: cubin sm_90", "__cuda_syscall_cnpv2LaunchDeviceV2"];
        for part in named {
            assert!(msg.contains(part), "no '{part}' in: {msg}");
        }
        assert!(msg.contains("device-side launch"), "{msg}");
    }

    #[test]
    fn a_file_that_is_no_library_is_refused_with_dlopens_reason() {
        let msg = open_err(&workspace().join("submission/include/persistent_layer.h"));
        assert!(msg.contains("could not load the submission library"), "{msg}");
        // dlerror()'s own words, not libloading's bare "dlopen failed".
        assert!(msg.contains("dlopen: ") && !msg.contains("dlopen failed"), "{msg}");
        let msg = open_err(&workspace().join("submission/include"));
        assert!(msg.ends_with("is a directory, not a submission library"), "{msg}");
    }

    #[test]
    fn pl_config_mirrors_the_config() {
        let cfg = Config::graded();
        let c = ExternalSubmission::pl_config(&cfg).unwrap();
        assert_eq!((c.d, c.ffn, c.n_q, c.n_kv, c.hd, c.max_seq_len, c.batch), (8192, 28672, 64, 8, 128, 4224, 1));
        assert_eq!((c.eps, c.theta), (cfg.eps, cfg.theta));
        // The C layout: seven int32, a float, then a double at offset 32.
        assert_eq!((std::mem::size_of::<PlConfig>(), std::mem::offset_of!(PlConfig, theta)), (40, 32));
        let mut big = cfg;
        big.d = 1 << 31;
        assert!(ExternalSubmission::pl_config(&big).is_err());
    }

    #[test]
    fn example_loads_and_speaks_our_abi() {
        let path = example_library();
        let sub = ExternalSubmission::open(&path).unwrap();
        assert_eq!(sub.name(), "libexternal_eager");
        assert_eq!(sub.last_error(), "");
        assert!(sub.api.stack.is_some(), "the example speaks version {PL_ABI_VERSION}, stacks included");
    }

    /// A library of ABI version `FAKE_VERSION` that does no work: pl_build_layer fails, and with
    /// `FAKE_STACK` pl_build_stack and pl_stack_step echo what reached them into pl_last_error, as the
    /// header's structs (eps and theta by their bits), so the loader's mirrors are checked against
    /// the header itself. pl_build_stack declines batch 2, else succeeds; pl_stack_step fails.
    const FAKE_SOURCE: &str = r#"
#include <cstdio>
#include <cstring>
#include "persistent_layer.h"

static char message[4096];
static int handle;

static unsigned long long address(const void* p) { return (unsigned long long)(uintptr_t)p; }

extern "C" {
uint32_t pl_abi_version(void) { return FAKE_VERSION; }
int pl_build_layer(const pl_config*, const pl_weights*, const pl_kv_cache*, void*, void**) {
    snprintf(message, sizeof message, "no layer here");
    return PL_ERR_INTERNAL;
}
int pl_layer_step(void*, const void*, int32_t, void*, void*) { return PL_ERR_INTERNAL; }
void pl_teardown(void*) {}
const char* pl_last_error(void) { return message; }
#ifdef FAKE_STACK
int pl_build_stack(const pl_config* c, uint32_t n, const pl_weights* w, const pl_kv_cache* caches, void* stream,
                   void** h) {
    uint32_t eps;
    unsigned long long theta;
    memcpy(&eps, &c->eps, 4);
    memcpy(&theta, &c->theta, 8);
    int at = snprintf(message, sizeof message, "%d %d %d %d %d %d %d %08x %016llx %u %llx", c->d, c->ffn, c->n_q,
                      c->n_kv, c->hd, c->max_seq_len, c->batch, eps, theta, n, address(stream));
    for (uint32_t l = 0; l < n; ++l) {
        const void* given[] = {w[l].in_norm, w[l].post_norm, w[l].q, w[l].k, w[l].v, w[l].o, w[l].gate, w[l].up,
                               w[l].down, caches[l].k, caches[l].v};
        for (const void* p : given) at += snprintf(message + at, sizeof message - at, " %llx", address(p));
    }
    if (c->batch == 2) return PL_ERR_UNSUPPORTED;
    *h = &handle;
    return PL_OK;
}
int pl_stack_step(void* h, const void* x, uint32_t pos, void* hidden, void* out, void* stream) {
    snprintf(message, sizeof message, "%s %llx %u %llx %llx %llx", h == &handle ? "ours" : "foreign", address(x), pos,
             address(hidden), address(out), address(stream));
    return PL_ERR_INTERNAL;
}
#endif
}
"#;

    /// [`FAKE_SOURCE`] built as each kind of library the loader tells apart, by file stem: `v1`, `v2`,
    /// `v2_no_stack` (version 2 without the stack's functions) and `v3`; compiled again only when the
    /// source, the header or the compiler changed.
    fn fake_library(stem: &str) -> PathBuf {
        use crate::device_code::tests::Fixtures;
        static FIXTURES: std::sync::OnceLock<Fixtures> = std::sync::OnceLock::new();
        let include = workspace().join("submission/include");
        let header = std::fs::read_to_string(include.join("persistent_layer.h")).unwrap();
        let key = format!("{}\n{FAKE_SOURCE}\n{header}", cuda::kernels::NVCC);
        let fixtures = FIXTURES.get_or_init(|| {
            Fixtures::cached("external-abi", &key, |f| {
                f.write("fake.cpp", FAKE_SOURCE);
                let include = format!("-I{}", include.display());
                for (stem, defines) in [
                    ("v1", &["-DFAKE_VERSION=1"][..]),
                    ("v2", &["-DFAKE_VERSION=2", "-DFAKE_STACK"]),
                    ("v2_no_stack", &["-DFAKE_VERSION=2"]),
                    ("v3", &["-DFAKE_VERSION=3", "-DFAKE_STACK"]),
                ] {
                    let so = format!("lib{stem}.so");
                    let args = [&["-shared", "-Xcompiler", "-fPIC", &include, "-o", &so, "fake.cpp"][..], defines];
                    f.nvcc(&args.concat());
                }
            })
        });
        fixtures.path(&format!("lib{stem}.so"))
    }

    /// Versions 1 and 2 load, the stack's functions resolved for version 2 only; a version-1 library
    /// is declined a stack in a sentence naming its version, and any other version is refused.
    #[test]
    fn a_version_1_library_loads_and_declines_a_stack() {
        let v1 = ExternalSubmission::open(&fake_library("v1")).unwrap();
        assert!(v1.api.stack.is_none());
        match v1.stack_api(3) {
            Err(SubmissionError::Unsupported(m)) => assert_eq!(
                m,
                "a stack of 3 layers: libv1 speaks ABI version 1, which runs one layer (stacks came with version \
                 2's pl_build_stack and pl_stack_step)"
            ),
            Err(other) => panic!("{other:?}"),
            Ok(_) => panic!("a version-1 library has stack functions"),
        }
        let v2 = ExternalSubmission::open(&fake_library("v2")).unwrap();
        assert!(v2.stack_api(3).is_ok());
        let msg = open_err(&fake_library("v2_no_stack"));
        assert!(
            msg.contains("libv2_no_stack.so is not a persistent-layer submission: it has no symbol pl_build_stack"),
            "{msg}"
        );
        let msg = open_err(&fake_library("v3"));
        assert!(
            msg.contains("was built against ABI version 3, this grader speaks versions 1 to 2: rebuild it"),
            "{msg}"
        );
    }

    /// pl_build_stack gets the config and one pl_weights and one pl_kv_cache per layer, in order, as
    /// the header lays them out; pl_stack_step gets its handle and buffers; PL_ERR_UNSUPPORTED from
    /// pl_build_stack declines the stack in the library's words.
    #[test]
    fn a_stack_reaches_the_library_as_the_headers_arrays() {
        let mut sub = ExternalSubmission::open(&fake_library("v2")).unwrap();
        let stack = sub.stack_api(3).unwrap();
        let cfg = Config::tiny();
        let pl_cfg = ExternalSubmission::pl_config(&cfg).unwrap();
        // Made-up addresses, each its own: layer l's i-th pointer is 0x1000 * (11 l + i + 1).
        let at = |l: usize, i: usize| (0x1000 * (11 * l + i + 1)) as *mut c_void;
        let layers: Vec<_> = (0..3)
            .map(|l| {
                let p = |i| at(l, i).cast_const();
                let weights = PlWeights {
                    in_norm: p(0),
                    post_norm: p(1),
                    q: p(2),
                    k: p(3),
                    v: p(4),
                    o: p(5),
                    gate: p(6),
                    up: p(7),
                    down: p(8),
                };
                (weights, PlKvCache { k: at(l, 9), v: at(l, 10) })
            })
            .collect();
        let stream = 0x5a5a as *mut c_void;
        // What the library echoes of a config of `batch` and the layers.
        let echoed = |batch: usize| {
            let (c, eps, theta) = (&cfg, cfg.eps.to_bits(), cfg.theta.to_bits());
            let mut echo = format!(
                "{} {} {} {} {} {} {batch} {eps:08x} {theta:016x} 3 5a5a",
                c.d, c.ffn, c.n_q, c.n_kv, c.hd, c.max_seq_len
            );
            for (l, i) in (0..3).flat_map(|l| (0..11).map(move |i| (l, i))) {
                echo += &format!(" {:x}", at(l, i) as usize);
            }
            echo
        };
        sub.build_stack_from(stack, &pl_cfg, &layers, stream).unwrap();
        assert_eq!(sub.last_error(), echoed(cfg.batch));

        let (x, hidden, out) = (0xa0 as *const c_void, 0xb0 as *mut c_void, 0xc0 as *mut c_void);
        match sub.stack_step_at(3, x, 4100, hidden, out, stream) {
            Err(SubmissionError::Refused(m)) => assert_eq!(m, "pl_stack_step returned 4: ours a0 4100 b0 c0 5a5a"),
            other => panic!("{other:?}"),
        }
        match sub.stack_step_at(2, x, 4100, hidden, out, stream) {
            Err(SubmissionError::Refused(m)) => assert_eq!(m, "stack_step over 2 layers; build_stack built 3"),
            other => panic!("{other:?}"),
        }
        sub.teardown();
        match sub.stack_step_at(3, x, 4100, hidden, out, stream) {
            Err(SubmissionError::Refused(m)) => assert_eq!(m, "stack_step before build_stack"),
            other => panic!("{other:?}"),
        }
        let declined = PlConfig { batch: 2, ..pl_cfg };
        match sub.build_stack_from(stack, &declined, &layers, stream) {
            Err(SubmissionError::Unsupported(m)) => assert_eq!(m, echoed(2)),
            other => panic!("{other:?}"),
        }
        assert!(sub.handle.is_null() && sub.layers == 0, "a declined stack keeps no handle");
    }

    /// The example against the eager reference on a GPU, for a few steps of each named config: every
    /// output within 1e-2 and the cache as the reference's. `cargo test -p submission -- --ignored`.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn example_matches_the_reference_on_the_gpu() {
        use reference::gpu::data::{DeviceCache, generate_input};
        use reference::gpu::{Eager, generate_weights};

        fn rel_err(got: &[bf16], want: &[bf16]) -> f64 {
            let (mut num, mut den) = (0f64, 0f64);
            for (g, w) in got.iter().zip(want) {
                let (g, w) = (g.to_f64(), w.to_f64());
                assert!(g.is_finite(), "non-finite output");
                num += (g - w).powi(2);
                den += w.powi(2);
            }
            (num / den).sqrt()
        }

        let dev = Device::open(0).expect("no GPU");
        let path = example_library();
        for cfg in [Config::tiny(), Config::small(), Config::graded()] {
            let steps = 3;
            let weights = generate_weights(&dev, &cfg, 7).unwrap();
            let mut want_cache = DeviceCache::generate(&dev, &cfg, 7).unwrap();
            let mut cache = DeviceCache::generate(&dev, &cfg, 7).unwrap();
            let mut eager = Eager::new(&dev, &cfg).unwrap();
            let mut sub = ExternalSubmission::open(&path).unwrap();
            sub.build_layer(&dev, Layer { weights: &weights, cache: &mut cache }, &cfg).unwrap();
            let mut worst = 0f64;
            for step in 0..steps {
                let pos = cfg.prefill + step;
                let x = generate_input(&dev, &cfg, 11, step).unwrap();
                let mut want = dev.stream().alloc_zeros::<bf16>(cfg.d).unwrap();
                let mut got = dev.stream().alloc_zeros::<bf16>(cfg.d).unwrap();
                eager.step(&dev, &weights, &mut want_cache, &x, pos, &mut want).unwrap();
                sub.layer_step(&dev, Layer { weights: &weights, cache: &mut cache }, &x, pos, &mut got).unwrap();
                dev.synchronize().unwrap();
                let (got, want) = (dev.stream().clone_dtoh(&got).unwrap(), dev.stream().clone_dtoh(&want).unwrap());
                let e = rel_err(&got, &want);
                assert!(e < 1e-2, "{}: step {step} (pos {pos}) rel err {e:.3e}", cfg.name);
                worst = worst.max(e);
            }
            sub.teardown();
            for (mine, theirs) in [(&cache.k, &want_cache.k), (&cache.v, &want_cache.v)] {
                let (mine, theirs) = (dev.stream().clone_dtoh(mine).unwrap(), dev.stream().clone_dtoh(theirs).unwrap());
                let (mut got, mut want) = (Vec::new(), Vec::new());
                for (row, (m, t)) in mine.chunks(cfg.hd).zip(theirs.chunks(cfg.hd)).enumerate() {
                    let slot = row % cfg.max_seq_len;
                    if slot < cfg.prefill {
                        assert!(m.iter().zip(t).all(|(a, b)| a.to_bits() == b.to_bits()), "prefix slot {slot} changed");
                    } else if slot < cfg.prefill + steps {
                        got.extend_from_slice(m);
                        want.extend_from_slice(t);
                    } else {
                        assert!(m.iter().all(|v| v.to_bits() == 0), "{}: unused slot {slot} written", cfg.name);
                    }
                }
                let e = rel_err(&got, &want);
                assert!(e < 1e-2, "{}: cache rel err {e:.3e}", cfg.name);
            }
            eprintln!("{}: {steps} steps, worst rel err {worst:.3e}", cfg.name);
        }
    }

    /// The example's stack on a GPU: three layers through pl_build_stack and pl_stack_step give, bit
    /// for bit, what its one layer gives layer after layer (every hidden row, out, every cache), for a
    /// few steps of two configs. `cargo test -p submission -- --ignored`.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn example_stack_is_its_layers_one_after_another_on_the_gpu() {
        use reference::gpu::data::generate_input;
        use reference::gpu::generate_weights;

        let bits = |dev: &Device, s: &CudaSlice<bf16>| -> Vec<u16> {
            dev.stream().clone_dtoh(s).unwrap().iter().map(|v| v.to_bits()).collect()
        };
        let dev = Device::open(0).expect("no GPU");
        let path = example_library();
        let (depth, steps) = (3, 3);
        for mut cfg in [Config::tiny(), Config::small()] {
            cfg.layers = depth;
            let seeds: Vec<u64> = (0..depth).map(|l| spec::data::layer_seed(7, l)).collect();
            let weights: Vec<_> = seeds.iter().map(|&s| generate_weights(&dev, &cfg, s).unwrap()).collect();
            let caches = || seeds.iter().map(|&s| DeviceCache::generate(&dev, &cfg, s).unwrap()).collect::<Vec<_>>();
            let (mut stack_caches, mut layer_caches) = (caches(), caches());
            let mut stack = ExternalSubmission::open(&path).unwrap();
            let mut layers: Vec<_> =
                weights.iter().zip(&mut stack_caches).map(|(weights, cache)| Layer { weights, cache }).collect();
            stack.build_stack(&dev, &mut layers, &cfg).unwrap();
            let mut one: Vec<_> = (0..depth).map(|_| ExternalSubmission::open(&path).unwrap()).collect();
            for (l, sub) in one.iter_mut().enumerate() {
                sub.build_layer(&dev, Layer { weights: &weights[l], cache: &mut layer_caches[l] }, &cfg).unwrap();
            }
            let row = cfg.batch * cfg.d;
            let zeros = |n: usize| dev.stream().alloc_zeros::<bf16>(n).unwrap();
            let (mut hidden, mut out) = (zeros((depth - 1) * row), zeros(row));
            let mut outs: Vec<_> = (0..depth).map(|_| zeros(row)).collect();
            for step in 0..steps {
                let pos = cfg.prefill + step;
                let x = generate_input(&dev, &cfg, 11, step).unwrap();
                stack.stack_step(&dev, &mut layers, &x, pos, Some(&mut hidden), &mut out).unwrap();
                for (l, sub) in one.iter_mut().enumerate() {
                    let (before, rest) = outs.split_at_mut(l);
                    let layer = Layer { weights: &weights[l], cache: &mut layer_caches[l] };
                    sub.layer_step(&dev, layer, before.last().unwrap_or(&x), pos, &mut rest[0]).unwrap();
                }
                dev.synchronize().unwrap();
                let hidden = bits(&dev, &hidden);
                for (l, want) in outs.iter().enumerate() {
                    let got = if l + 1 < depth { hidden[l * row..(l + 1) * row].to_vec() } else { bits(&dev, &out) };
                    assert!(got == bits(&dev, want), "{}: step {step}, layer {l}'s output differs", cfg.name);
                }
            }
            drop(layers);
            stack.teardown();
            one.iter_mut().for_each(Submission::teardown);
            for (l, (mine, theirs)) in stack_caches.iter().zip(&layer_caches).enumerate() {
                for (a, b) in [(&mine.k, &theirs.k), (&mine.v, &theirs.v)] {
                    assert!(bits(&dev, a) == bits(&dev, b), "{}: layer {l}'s cache differs", cfg.name);
                }
            }
            eprintln!("{}: {depth} layers, {steps} steps, the stack bit for bit its layers", cfg.name);
        }
    }
}
