//! What the build scripts do with the CUDA kernels of `kernels/`: compile each `.cu` of an owner's
//! folder with nvcc into a fatbin embedded in the binary, with ptxas's resource report (registers,
//! shared memory, spills) beside it, and generate `kernels.rs` in `OUT_DIR`: a module per owner with
//! one `kernels::Kernel` constant per file, `ALL` and `FOLDER`.
//!
//! The compiler is found, or the pinned one installed, once: by the root package's build script
//! ([`Toolchain::find_or_install`]), which compiles the kernels of every crate the grader is made of
//! and hands the toolchain to the one other build script that compiles kernels (the megakernel's
//! model kernels) through cargo's `links` metadata ([`Toolchain::from_links`]); so the install never
//! races. Every kernel sees the shared headers of `kernels/include/` and its own folder.
//!
//! Files compile in parallel, the longest first, and each compiled file is kept in a cache under the
//! target folder ([`cache`]), keyed by everything that decides its bytes: a build script that runs
//! again with the same inputs (clippy's check builds run every build script again, as do other
//! profiles) copies the kernels instead of compiling them. A failure stops the build with one clear
//! message (never a panic trace), and it never embeds nothing.
//!
//! Kernels are built for sm_90a (Hopper, where every figure of this project is measured) with
//! compute_80 PTX, which the driver compiles for any other card from Ampere on; files that use
//! Hopper-only instructions are built for sm_90a alone (with compute_90a PTX). Files that launch
//! kernels from the device (dynamic parallelism) take a separate path: relocatable device code,
//! device-linked against the toolkit's libcudadevrt.a.

mod cache;
mod nvcc;

use std::env;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

const PORTABLE_TARGETS: &[&str] =
    &["-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_80,code=compute_80"];
const HOPPER_TARGETS: &[&str] =
    &["-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_90a,code=compute_90a"];
/// Relocatable device code is built for Hopper alone (`compile_rdc`).
const RDC_TARGET: &str = "-gencode=arch=compute_90a,code=sm_90a";
/// The flags every kernel file is compiled with. Warnings are errors: an unused variable in a kernel
/// is usually a bug in the making.
const FLAGS: &[&str] = &["-O3", "-std=c++17", "-Xptxas", "-v", "--extended-lambda", "-Werror", "all-warnings"];

/// The device runtime library that device-side launches link against.
const CUDADEVRT: &str = "libcudadevrt.a";

/// The `links` name of the root package (`kernels`), whose build script exports the toolchain.
const LINKS: &str = "PLKERNELS";

/// The compiler every kernel is built with, and what goes with it.
#[derive(Debug, Clone)]
pub struct Toolchain {
    pub nvcc: PathBuf,
    /// The folder of the libcudadevrt.a that belongs to `nvcc`.
    pub cudadevrt_dir: PathBuf,
    /// The shared device headers (`kernels/include/`).
    pub include: PathBuf,
}

impl Toolchain {
    /// In the root package's build script: finds nvcc, or installs the pinned one.
    pub fn find_or_install() -> Toolchain {
        let root = workspace_root();
        nvcc::rerun_triggers(&root);
        // No cargo:warning when the pinned compiler is installed: cargo would replay it on every
        // later build. README.md says where it goes.
        let nvcc = nvcc::find_or_install(&root).unwrap_or_else(|why| fail(&why));
        let cudadevrt_dir = cudadevrt_dir(&nvcc);
        // A toolkit's libcudadevrt.a can change under the build; the pinned install's cannot without
        // a change of pins (already a trigger), and watching it would rebuild once after installing
        // it, since the install writes it after this script started.
        if !nvcc::is_pinned_install(&root, &cudadevrt_dir) {
            println!("cargo:rerun-if-changed={}", cudadevrt_dir.join(CUDADEVRT).display());
        }
        Toolchain { nvcc, cudadevrt_dir, include: kernels_root().join("include") }
    }

    /// Hands the toolchain to the build scripts of the crates that depend on the root package.
    pub fn export(&self) {
        println!("cargo::metadata=nvcc={}", self.nvcc.display());
        println!("cargo::metadata=cudadevrt_dir={}", self.cudadevrt_dir.display());
        println!("cargo::metadata=include={}", self.include.display());
    }

    /// In the build script of a crate that depends on the root package: the toolchain it exported.
    pub fn from_links() -> Toolchain {
        let get = |key: &str| {
            let var = format!("DEP_{LINKS}_{}", key.to_uppercase());
            env::var_os(&var).map(PathBuf::from).unwrap_or_else(|| {
                fail(&format!(
                    "{var} is not set: a crate that builds kernels must depend on the root package `kernels`"
                ))
            })
        };
        Toolchain { nvcc: get("nvcc"), cudadevrt_dir: get("cudadevrt_dir"), include: get("include") }
    }

    /// Rust constants naming the toolchain, for tests that compile CUDA fixtures of their own with
    /// the compiler of the kernels.
    pub fn constants(&self) -> String {
        format!(
            "/// The nvcc that compiled these kernels.\npub const NVCC: &str = {:?};\n\
             /// The folder of the libcudadevrt.a (device runtime) that device-launch kernels are linked against.\n\
             pub const CUDADEVRT_DIR: &str = {:?};\n",
            self.nvcc.display().to_string(),
            self.cudadevrt_dir.display().to_string()
        )
    }

    /// What `nvcc --version` prints: part of every cache key, so that another compiler at the same
    /// path compiles again.
    fn version(&self) -> String {
        let out = Command::new(&self.nvcc)
            .arg("--version")
            .output()
            .unwrap_or_else(|e| fail(&format!("could not run {}: {e}", self.nvcc.display())));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

/// One owner's folder of kernels: `kernels/<name>/` (or deeper), compiled into `pub mod <name>`.
#[derive(Debug, Clone, Copy)]
pub struct Owner<'a> {
    /// The module the generated constants go in: the owning crate's name.
    pub name: &'a str,
    /// The folder under `kernels/`: `grader`, or `megakernel/model`.
    pub folder: &'a str,
    /// Files that need Hopper (sm_90a) and are built for it alone.
    pub hopper_only: &'a [&'a str],
    /// Files that launch kernels from the device: relocatable device code, device-linked.
    pub rdc: &'a [&'a str],
}

/// The `kernels/` folder of the workspace.
pub fn kernels_root() -> PathBuf {
    workspace_root().join("kernels")
}

/// One `.cu` file to compile and where its products go.
struct Job<'a> {
    owner: &'a Owner<'a>,
    src: PathBuf,
    stem: String,
    fatbin: PathBuf,
    report: PathBuf,
}

/// Compiles every `.cu` file directly in each owner's folder, in parallel, and writes
/// `OUT_DIR/kernels.rs`: `preamble`, then a module per owner.
pub fn build(toolchain: &Toolchain, owners: &[Owner<'_>], preamble: &str) {
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let root = kernels_root();
    let version = toolchain.version();
    let mut jobs = Vec::new();
    for owner in owners {
        let dir = root.join(owner.folder);
        // Every folder the key reads headers from (a model kernel includes its parent folder's).
        for watched in include_dirs(toolchain, owner) {
            println!("cargo:rerun-if-changed={}", watched.display());
        }
        let sources = files_in(&dir, "cu");
        if sources.is_empty() {
            fail(&format!("{} holds no .cu file: nothing to embed", dir.display()));
        }
        for src in sources {
            let stem = src.file_stem().unwrap().to_str().unwrap().to_owned();
            let fatbin = out.join(format!("{}-{stem}.fatbin", owner.name));
            let report = out.join(format!("{}-{stem}.ptxas.txt", owner.name));
            jobs.push(Job { owner, src, stem, fatbin, report });
        }
    }
    // The longest first, so that the last to finish started first.
    jobs.sort_by_key(|j| std::cmp::Reverse(std::fs::metadata(&j.src).map_or(0, |m| m.len())));
    let cache = cache::Cache::beside(&out);
    let failures = Mutex::new(Vec::new());
    let next = AtomicUsize::new(0);
    let workers = env::var("NUM_JOBS").ok().and_then(|n| n.parse().ok()).unwrap_or(1).clamp(1, jobs.len());
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| {
                while let Some(job) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) {
                    if let Err(why) = compile_cached(toolchain, &version, cache.as_ref(), job) {
                        failures.lock().unwrap().push(why);
                    }
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    if !failures.is_empty() {
        fail(&failures.join("\n"));
    }
    let mut generated =
        format!("// Generated by cuda-build: one fatbin and one ptxas report per kernels/<owner>/*.cu.\n{preamble}");
    for owner in owners {
        let mine: Vec<&Job> = jobs.iter().filter(|j| j.owner.name == owner.name).collect();
        let _ = writeln!(
            generated,
            "/// The kernels of `kernels/{folder}/`.\npub mod {name} {{\n/// The folder they were compiled from.\n\
             pub const FOLDER: &str = {dir:?};",
            folder = owner.folder,
            name = owner.name,
            dir = root.join(owner.folder).display().to_string()
        );
        for j in &mine {
            let _ = writeln!(
                generated,
                "/// `kernels/{}/{}.cu` as a fatbin.\npub const {}: ::kernels::Kernel = ::kernels::Kernel {{ name: \"{}\", \
                 fatbin: include_bytes!({:?}), ptxas_report: include_str!({:?}) }};",
                owner.folder,
                j.stem,
                j.stem.to_uppercase(),
                j.stem,
                j.fatbin.display().to_string(),
                j.report.display().to_string()
            );
        }
        let names: Vec<String> = mine.iter().map(|j| j.stem.to_uppercase()).collect();
        let _ = writeln!(
            generated,
            "/// Every kernel file of this owner.\npub const ALL: &[::kernels::Kernel] = &[{}];\n}}",
            names.join(", ")
        );
    }
    std::fs::write(out.join("kernels.rs"), generated).unwrap();
}

/// Compiles `job`'s file, or copies it from the cache when it was compiled from the same inputs.
fn compile_cached(
    toolchain: &Toolchain,
    version: &str,
    cache: Option<&cache::Cache>,
    job: &Job<'_>,
) -> Result<(), String> {
    let owner = job.owner;
    let file = job.src.file_name().unwrap().to_str().unwrap();
    let rdc = owner.rdc.contains(&file);
    let targets = if rdc {
        &["-rdc=true", RDC_TARGET][..]
    } else if owner.hopper_only.contains(&file) {
        HOPPER_TARGETS
    } else {
        PORTABLE_TARGETS
    };
    let includes = include_dirs(toolchain, owner);
    let entry =
        cache.map(|c| c.entry(&format!("{}-{}", owner.name, job.stem), &key(version, targets, &job.src, &includes)));
    if let Some(e) = &entry
        && e.restore(&job.fatbin, &job.report)
    {
        return Ok(());
    }
    let includes: Vec<&Path> = includes.iter().map(PathBuf::as_path).collect();
    if rdc {
        compile_rdc(toolchain, &includes, &job.src, &job.fatbin, &job.report)?;
    } else {
        let stderr = run(
            nvcc_compile(&toolchain.nvcc, &includes, &job.src).arg("--fatbin").args(targets).arg("-o").arg(&job.fatbin),
            &job.src,
        )?;
        std::fs::write(&job.report, stderr.as_bytes()).map_err(|e| format!("writing {}: {e}", job.report.display()))?;
    }
    if let Some(e) = &entry {
        e.store(&job.fatbin, &job.report);
    }
    Ok(())
}

/// The folders an owner's files include from: its own, each folder above it up to `kernels/` (so
/// `kernels/megakernel/model/` sees the megakernel's headers), and the shared `kernels/include/`.
fn include_dirs(toolchain: &Toolchain, owner: &Owner<'_>) -> Vec<PathBuf> {
    let root = kernels_root();
    let mut dirs: Vec<PathBuf> = root
        .join(owner.folder)
        .ancestors()
        .take_while(|d| d.starts_with(&root) && *d != root)
        .map(Path::to_path_buf)
        .collect();
    dirs.push(toolchain.include.clone());
    dirs
}

/// Everything that decides a compiled file's bytes: the compiler, the flags and targets, the source,
/// and every header in the folders it includes from.
fn key(version: &str, targets: &[&str], src: &Path, includes: &[PathBuf]) -> cache::Key {
    let mut key = cache::Key::new();
    key.add(version.as_bytes());
    for flag in FLAGS.iter().chain(targets) {
        key.add(flag.as_bytes());
    }
    key.add(&std::fs::read(src).unwrap_or_default());
    for dir in includes {
        for header in files_in(dir, "cuh").into_iter().chain(files_in(dir, "h")) {
            key.add(header.file_name().unwrap().as_encoded_bytes());
            key.add(&std::fs::read(&header).unwrap_or_default());
        }
    }
    key
}

/// The workspace's root: this crate's parent folder (where `.cuda-venv/` goes).
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("cuda-build sits in the workspace").to_path_buf()
}

/// The files of `dir` with extension `ext`, sorted; none when the folder does not exist.
fn files_in(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == ext))
        .collect();
    files.sort();
    files
}

/// nvcc with the flags every kernel file is compiled with.
fn nvcc_compile(nvcc: &Path, includes: &[&Path], src: &Path) -> Command {
    let mut cmd = Command::new(nvcc);
    cmd.args(FLAGS);
    for dir in includes {
        cmd.arg("-I").arg(dir);
    }
    cmd.arg(src);
    cmd
}

/// Runs `cmd`, an nvcc working on `src`: its stderr (ptxas's report), or its messages when it fails.
fn run(cmd: &mut Command, src: &Path) -> Result<String, String> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let output = cmd.output().map_err(|e| format!("could not run {program}: {e}"))?;
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    if !output.status.success() {
        return Err(format!("nvcc ({program}) failed on {}:\n{stderr}", src.display()));
    }
    Ok(stderr)
}

/// Compiles `src` for sm_90a as relocatable device code, then device-links it with the device runtime
/// (libcudadevrt.a, which implements launches from the device) into a fatbin holding the linked cubin:
/// a module the driver loads as it is. No PTX: a PTX entry would need the same link at load time.
fn compile_rdc(
    toolchain: &Toolchain,
    includes: &[&Path],
    src: &Path,
    fatbin: &Path,
    report: &Path,
) -> Result<(), String> {
    let cubin = fatbin.with_extension("rdc.cubin");
    let stderr = run(
        nvcc_compile(&toolchain.nvcc, includes, src).args(["-cubin", "-rdc=true", RDC_TARGET, "-o"]).arg(&cubin),
        src,
    )?;
    std::fs::write(report, stderr.as_bytes()).map_err(|e| format!("writing {}: {e}", report.display()))?;
    run(
        Command::new(&toolchain.nvcc)
            .args(["--fatbin", "-dlink", RDC_TARGET, "-lcudadevrt", "-L"])
            .arg(&toolchain.cudadevrt_dir)
            .arg("-o")
            .arg(fatbin)
            .arg(&cubin),
        src,
    )?;
    Ok(())
}

/// The folder of the libcudadevrt.a that belongs to `nvcc`: `lib64/` of a toolkit (or its
/// `targets/<arch>/lib/`), `lib/` of the PyPI wheels; `$CUDA_HOME`/`$CUDA_PATH` last.
fn cudadevrt_dir(nvcc: &Path) -> PathBuf {
    let root = nvcc.parent().and_then(Path::parent).map(Path::to_path_buf).unwrap_or_default();
    let targets = std::fs::read_dir(root.join("targets"))
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("lib"));
    let homes =
        ["CUDA_HOME", "CUDA_PATH"].iter().filter_map(|v| env::var(v).ok()).map(|h| PathBuf::from(h).join("lib64"));
    let mut candidates = [root.join("lib64"), root.join("lib")].into_iter().chain(targets).chain(homes);
    candidates.find(|d| d.join(CUDADEVRT).is_file()).unwrap_or_else(|| {
        fail(&format!(
            "{CUDADEVRT} not found beside {} (in lib64/, lib/ or targets/*/lib/ of its toolkit): the \
             device-launch kernels of the red team cannot be linked. A toolkit has it; the pinned wheels \
             (cuda-build/nvcc-requirements.txt) include nvidia-cuda-runtime, which does.",
            nvcc.display()
        ))
    })
}

/// Folders of a default CUDA install and of the driver in containers.
const CUDA_LIB_DIRS: [&str; 3] =
    ["/usr/local/cuda/lib64", "/usr/local/cuda/extras/CUPTI/lib64", "/usr/local/nvidia/lib64"];

/// cudarc dlopens libcuda, libnvrtc and libcupti by name at run time: adds the standard CUDA library
/// folders to the run path of the crate's binaries, so that a default install is found without
/// LD_LIBRARY_PATH (which still takes precedence).
pub fn link_cuda_run_path() {
    for dir in CUDA_LIB_DIRS {
        println!("cargo:rustc-link-arg-bins=-Wl,-rpath,{dir}");
    }
}

/// Stops the build with `message` as cargo's own error lines, one per line of the message. The
/// script then exits 0 on purpose: `cargo::error` alone fails the build, while a nonzero exit would
/// add a dump of every line the script printed.
pub fn fail(message: &str) -> ! {
    for line in message.lines().filter(|l| !l.trim().is_empty()) {
        println!("cargo::error={line}");
    }
    std::process::exit(0)
}
