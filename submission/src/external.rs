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
use spec::Config;

use crate::{Layer, Submission, SubmissionError, device_address, device_code};

/// `PL_ABI_VERSION` of `submission/include/persistent_layer.h`: the only version this grader speaks.
pub const PL_ABI_VERSION: u32 = 1;

/// `PL_ERR_UNSUPPORTED` of the header: `pl_build_layer` declines a config it does not implement.
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
type TeardownFn = unsafe extern "C" fn(handle: *mut c_void);
type LastErrorFn = unsafe extern "C" fn() -> *const c_char;

/// The library's functions, copied out of it: valid while `ExternalSubmission::_lib` is loaded.
struct Api {
    build_layer: BuildLayerFn,
    layer_step: LayerStepFn,
    teardown: TeardownFn,
    last_error: LastErrorFn,
}

/// A submission in a shared library. Reports name it by the library's file stem.
pub struct ExternalSubmission {
    name: String,
    api: Api,
    /// `pl_build_layer`'s handle; null when no layer is built.
    handle: *mut c_void,
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
    /// Loads the library at `path`, checks that it speaks [`PL_ABI_VERSION`] and resolves the
    /// five functions of `persistent_layer.h`.
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
        if version != PL_ABI_VERSION {
            return Err(not_a_library(format!(
                "{} was built against ABI version {version}, this grader speaks {PL_ABI_VERSION}: \
                 rebuild it with this grader's submission/include/persistent_layer.h",
                path.display()
            )));
        }
        // SAFETY: each type is the declaration of that name in persistent_layer.h, version 1.
        let api = unsafe {
            Api {
                build_layer: symbol(&lib, path, "pl_build_layer")?,
                layer_step: symbol(&lib, path, "pl_layer_step")?,
                teardown: symbol(&lib, path, "pl_teardown")?,
                last_error: symbol(&lib, path, "pl_last_error")?,
            }
        };
        let name = path.file_stem().map_or_else(|| path.display().to_string(), |s| s.to_string_lossy().into_owned());
        Ok(Self { name, api, handle: std::ptr::null_mut(), _lib: lib })
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

    /// The error of `pl_build_layer` returning `code`, `message` being the library's sentence:
    /// `PL_ERR_UNSUPPORTED` declines the config (judged `unsupported`), any other code is a failure.
    fn build_failed(code: c_int, message: String) -> SubmissionError {
        match code {
            PL_ERR_UNSUPPORTED if message.trim().is_empty() => SubmissionError::Unsupported(
                "pl_build_layer returned PL_ERR_UNSUPPORTED without saying why (pl_last_error was empty)".into(),
            ),
            PL_ERR_UNSUPPORTED => SubmissionError::Unsupported(message),
            _ => refused(format!("pl_build_layer returned {code}: {message}")),
        }
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

impl Submission for ExternalSubmission {
    fn name(&self) -> &str {
        &self.name
    }

    fn build_layer(&mut self, dev: &Device, layer: Layer<'_>, cfg: &Config) -> Result<(), SubmissionError> {
        self.teardown();
        let pl_cfg = Self::pl_config(cfg)?;
        let w = layer.weights;
        let weights = PlWeights {
            in_norm: ptr(dev, &w.in_norm),
            post_norm: ptr(dev, &w.post_norm),
            q: ptr(dev, &w.q),
            k: ptr(dev, &w.k),
            v: ptr(dev, &w.v),
            o: ptr(dev, &w.o),
            gate: ptr(dev, &w.gate),
            up: ptr(dev, &w.up),
            down: ptr(dev, &w.down),
        };
        let cache = PlKvCache { k: ptr_mut(dev, &mut layer.cache.k), v: ptr_mut(dev, &mut layer.cache.v) };
        // The library's CUDA runtime uses the context current on this thread: make it the grader's.
        dev.ctx().bind_to_thread().context("making the grader's context current for the submission")?;
        let mut handle = std::ptr::null_mut();
        // SAFETY: the structs are repr(C) mirrors of the header's and live through the call; the
        // pointers are the grader's buffers, which stay allocated and in place for the whole run
        // (`Layer`); the stream is the grader's (NULL is the legacy default stream, as the header says).
        let code = unsafe {
            (self.api.build_layer)(&pl_cfg, &weights, &cache, dev.stream().cu_stream() as *mut c_void, &mut handle)
        };
        if code != 0 {
            return Err(Self::build_failed(code, self.last_error()));
        }
        if handle.is_null() {
            return Err(refused("pl_build_layer returned 0 but no handle"));
        }
        self.handle = handle;
        Ok(())
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
        if self.handle.is_null() {
            return Err(refused("layer_step before build_layer"));
        }
        let pos = i32::try_from(pos).map_err(|_| refused(format!("position {pos} does not fit the ABI's int32")))?;
        let (x, out) = (ptr(dev, x), ptr_mut(dev, out));
        dev.ctx().bind_to_thread().context("making the grader's context current for the submission")?;
        // SAFETY: the handle came from this library's pl_build_layer and was not torn down; x and out
        // are the grader's (batch, d) bf16 buffers, alive through the call; the stream is the grader's.
        let code = unsafe { (self.api.layer_step)(self.handle, x, pos, out, dev.stream().cu_stream() as *mut c_void) };
        if code != 0 {
            return Err(self.failed("pl_layer_step", code));
        }
        Ok(())
    }

    fn teardown(&mut self) {
        if self.handle.is_null() {
            return;
        }
        let handle = std::mem::replace(&mut self.handle, std::ptr::null_mut());
        // SAFETY: the handle came from this library's pl_build_layer and is torn down exactly once
        // (it is nulled above).
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
        match ExternalSubmission::build_failed(PL_ERR_UNSUPPORTED, said.into()) {
            SubmissionError::Unsupported(m) => assert_eq!(m, said),
            other => panic!("{other:?}"),
        }
        match ExternalSubmission::build_failed(PL_ERR_UNSUPPORTED, String::new()) {
            SubmissionError::Unsupported(m) => assert!(m.contains("without saying why"), "{m}"),
            other => panic!("{other:?}"),
        }
        for code in [1, 3, 4, -1] {
            match ExternalSubmission::build_failed(code, "out of memory".into()) {
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
}
