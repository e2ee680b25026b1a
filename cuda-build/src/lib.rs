//! What every crate's build script does with its CUDA kernels: compiles each `kernels/*.cu` of the
//! crate with nvcc into a fatbin embedded in the binary, plus ptxas's resource report (registers,
//! shared memory, spills) beside it, and generates `kernels.rs` in `OUT_DIR`: one
//! `cuda::kernels::Kernel` constant per file and `ALL`, which `cuda::embed_kernels!` includes.
//!
//! The compiler is found, or the pinned one installed, once: by the `cuda` crate's build script
//! ([`Toolchain::find_or_install`]), which hands it to the crates that depend on it through cargo's
//! `links` metadata ([`Toolchain::from_cuda`]); so the install never races. Every crate's kernels see
//! the shared device headers of `cuda/include/` and their own folder. A failure stops the build with
//! one clear message (never a panic trace), and it never embeds nothing.
//!
//! Kernels are built for sm_80, sm_89 and sm_90a with compute_80 PTX, so the grader runs on any card
//! from Ampere on; files that use Hopper-only instructions are built for sm_90a alone (with
//! compute_90a PTX). Files that launch kernels from the device (dynamic parallelism) take a separate
//! path: relocatable device code, device-linked against the toolkit's libcudadevrt.a.

mod nvcc;

use std::env;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

const PORTABLE_TARGETS: &[&str] = &[
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_89,code=sm_89",
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_80,code=compute_80",
];
const HOPPER_TARGETS: &[&str] =
    &["-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_90a,code=compute_90a"];

/// The device runtime library that device-side launches link against.
const CUDADEVRT: &str = "libcudadevrt.a";

/// The `links` name of the `cuda` crate, whose build script exports the toolchain.
const LINKS: &str = "PLCUDA";

/// The compiler every crate's kernels are built with, and what goes with it.
#[derive(Debug, Clone)]
pub struct Toolchain {
    pub nvcc: PathBuf,
    /// The folder of the libcudadevrt.a that belongs to `nvcc`.
    pub cudadevrt_dir: PathBuf,
    /// The shared device headers (`cuda/include/`).
    pub include: PathBuf,
}

impl Toolchain {
    /// In the `cuda` crate's build script: finds nvcc, or installs the pinned one.
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
        Toolchain { nvcc, cudadevrt_dir, include: root.join("cuda/include") }
    }

    /// Hands the toolchain to the build scripts of the crates that depend on `cuda`.
    pub fn export(&self) {
        println!("cargo::metadata=nvcc={}", self.nvcc.display());
        println!("cargo::metadata=cudadevrt_dir={}", self.cudadevrt_dir.display());
        println!("cargo::metadata=include={}", self.include.display());
    }

    /// In the build script of a crate that depends on `cuda`: the toolchain it exported.
    pub fn from_cuda() -> Toolchain {
        let get = |key: &str| {
            let var = format!("DEP_{LINKS}_{}", key.to_uppercase());
            env::var_os(&var).map(PathBuf::from).unwrap_or_else(|| {
                fail(&format!("{var} is not set: a crate that builds kernels must depend on the `cuda` crate"))
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
}

/// How a crate's kernel files are built: which need Hopper, which launch kernels from the device.
#[derive(Debug, Clone, Copy, Default)]
pub struct Files<'a> {
    /// Files that need Hopper (sm_90a) and are built for it alone.
    pub hopper_only: &'a [&'a str],
    /// Files that launch kernels from the device: relocatable device code, device-linked.
    pub rdc: &'a [&'a str],
}

/// Compiles every `kernels/*.cu` of the crate whose build script calls it and writes
/// `OUT_DIR/kernels.rs`, starting with `preamble`.
pub fn build(toolchain: &Toolchain, files: Files<'_>, preamble: &str) {
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let kernels = root.join("kernels");
    println!("cargo:rerun-if-changed={}", kernels.display());
    for header in files_in(&toolchain.include, "cuh") {
        println!("cargo:rerun-if-changed={}", header.display());
    }
    let sources = files_in(&kernels, "cu");
    if sources.is_empty() {
        fail(&format!("{} holds no .cu file: nothing to embed", kernels.display()));
    }
    let includes = [kernels.as_path(), toolchain.include.as_path()];
    let mut generated =
        format!("// Generated by cuda-build: one fatbin and one ptxas report per kernels/*.cu.\n{preamble}");
    for src in &sources {
        println!("cargo:rerun-if-changed={}", src.display());
        let stem = src.file_stem().unwrap().to_str().unwrap().to_owned();
        let file = src.file_name().unwrap().to_str().unwrap();
        let fatbin = out.join(format!("{stem}.fatbin"));
        let report = out.join(format!("{stem}.ptxas.txt"));
        if files.rdc.contains(&file) {
            compile_rdc(toolchain, &includes, src, &fatbin, &report);
        } else {
            let targets = if files.hopper_only.contains(&file) { HOPPER_TARGETS } else { PORTABLE_TARGETS };
            let stderr = run(
                nvcc_compile(&toolchain.nvcc, &includes, src).arg("--fatbin").args(targets).arg("-o").arg(&fatbin),
                src,
            );
            std::fs::write(&report, stderr.as_bytes()).unwrap();
        }
        let _ = writeln!(
            generated,
            "/// `kernels/{file}` as a fatbin.\npub const {}: cuda::kernels::Kernel = cuda::kernels::Kernel {{ name: \"{stem}\", \
             fatbin: include_bytes!(\"{}\"), ptxas_report: include_str!(\"{}\") }};",
            stem.to_uppercase(),
            fatbin.display(),
            report.display()
        );
    }
    let names: Vec<String> = sources.iter().map(|s| s.file_stem().unwrap().to_str().unwrap().to_uppercase()).collect();
    let _ = writeln!(
        generated,
        "/// Every kernel file of this crate.\npub const ALL: &[cuda::kernels::Kernel] = &[{}];",
        names.join(", ")
    );
    std::fs::write(out.join("kernels.rs"), generated).unwrap();
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
        .filter(|p| p.extension().is_some_and(|x| x == ext))
        .collect();
    files.sort();
    files
}

/// nvcc with the flags every kernel file is compiled with.
fn nvcc_compile(nvcc: &Path, includes: &[&Path], src: &Path) -> Command {
    let mut cmd = Command::new(nvcc);
    // Warnings are errors: an unused variable in a kernel is usually a bug in the making.
    cmd.args(["-O3", "-std=c++17", "-Xptxas", "-v", "--extended-lambda", "-Werror", "all-warnings"]);
    for dir in includes {
        cmd.arg("-I").arg(dir);
    }
    cmd.arg(src);
    cmd
}

/// Runs `cmd`, an nvcc working on `src`; stops the build with its messages when it fails, else
/// returns its stderr (ptxas's report).
fn run(cmd: &mut Command, src: &Path) -> String {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let output = cmd.output().unwrap_or_else(|e| fail(&format!("could not run {program}: {e}")));
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    if !output.status.success() {
        fail(&format!("nvcc ({program}) failed on {}:\n{stderr}", src.display()));
    }
    stderr
}

/// Compiles `src` for sm_90a as relocatable device code, then device-links it with the device runtime
/// (libcudadevrt.a, which implements launches from the device) into a fatbin holding the linked cubin:
/// a module the driver loads as it is. No PTX: a PTX entry would need the same link at load time.
fn compile_rdc(toolchain: &Toolchain, includes: &[&Path], src: &Path, fatbin: &Path, report: &Path) {
    const TARGET: &str = "-gencode=arch=compute_90a,code=sm_90a";
    let cubin = fatbin.with_extension("rdc.cubin");
    let stderr =
        run(nvcc_compile(&toolchain.nvcc, includes, src).args(["-cubin", "-rdc=true", TARGET, "-o"]).arg(&cubin), src);
    std::fs::write(report, stderr.as_bytes()).unwrap();
    run(
        Command::new(&toolchain.nvcc)
            .args(["--fatbin", "-dlink", TARGET, "-lcudadevrt", "-L"])
            .arg(&toolchain.cudadevrt_dir)
            .arg("-o")
            .arg(fatbin)
            .arg(&cubin),
        src,
    );
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

/// Stops the build with `message` as cargo's own error lines, one per line of the message. The
/// script then exits 0 on purpose: `cargo::error` alone fails the build, while a nonzero exit would
/// add a dump of every line the script printed.
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

pub fn fail(message: &str) -> ! {
    for line in message.lines().filter(|l| !l.trim().is_empty()) {
        println!("cargo::error={line}");
    }
    std::process::exit(0)
}
