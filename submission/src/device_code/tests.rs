//! Tests of the device-code scanner on real artefacts: modules, fatbins and libraries compiled here
//! with the nvcc that built the kernels ([`Fixtures`]); and on garbage, which must never panic. The
//! workspace's own embedded kernels are scanned by `grader/src/kernels.rs`, which sees every crate.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use super::*;

/// A kernel that launches children from the device, in every form the toolchain makes of it.
const CDP_SOURCE: &str = r#"
extern "C" __global__ void child(int* p) { p[threadIdx.x] += 1; }
extern "C" __global__ void parent(int* p, int n) {
    for (int i = 0; i < n; ++i) child<<<1, 32>>>(p);
    child<<<1, 32, 0, cudaStreamTailLaunch>>>(p);
}
"#;

/// Device-side graph launch, which compiles without relocatable device code.
const GRAPH_SOURCE: &str = r#"
extern "C" __global__ void relaunch(cudaGraphExec_t g) { cudaGraphLaunch(g, cudaStreamGraphFireAndForget); }
"#;

/// What legitimate kernels use and the driver also binds by name, or that needs the device runtime
/// header, none of which launches anything: grid-wide sync, printf, malloc/free, assert.
const CLEAN_SOURCE: &str = r#"
#include <cassert>
#include <cstdio>
#include <cooperative_groups.h>
extern "C" __global__ void busy(int* p) {
    cooperative_groups::this_grid().sync();
    printf("%d\n", p[0]);
    int* q = static_cast<int*>(malloc(16));
    q[0] = p[0];
    free(q);
    assert(p[0] != 7);
}
"#;

const HOPPER: &str = "-gencode=arch=compute_90a,code=sm_90a";
const HOPPER_PTX: &str = "-gencode=arch=compute_90a,code=compute_90a";

/// A folder of CUDA fixtures compiled with [`cuda::kernels::NVCC`], the compiler of the embedded
/// kernels, so that what is tested is what that toolchain emits.
pub(crate) struct Fixtures {
    dir: PathBuf,
}

impl Fixtures {
    /// A fresh folder `name` in the build's target folder (beside the test binary's `deps/`), so that
    /// `cargo clean` removes it.
    pub(crate) fn new(name: &str) -> Self {
        let f = Self::at(name);
        f.empty();
        f
    }

    /// The folder `name` as an earlier run left it when that run made it from the same `key`, so a
    /// warm test run compiles nothing (nvcc takes most of this binary's time); else emptied and
    /// filled by `make`. The stamp is written last: an interrupted `make` leaves no stamp.
    pub(crate) fn cached(name: &str, key: &str, make: impl FnOnce(&Self)) -> Self {
        const STAMP: &str = "made-from.txt";
        let f = Self::at(name);
        if std::fs::read_to_string(f.path(STAMP)).is_ok_and(|made| made == key) {
            return f;
        }
        f.empty();
        make(&f);
        f.write(STAMP, key);
        f
    }

    fn at(name: &str) -> Self {
        let exe = std::env::current_exe().unwrap();
        Self { dir: exe.ancestors().nth(2).unwrap().join("fixtures").join(name) }
    }

    fn empty(&self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        std::fs::create_dir_all(&self.dir).unwrap();
    }

    pub(crate) fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }

    pub(crate) fn write(&self, file: &str, text: &str) {
        std::fs::write(self.path(file), text).unwrap();
    }

    pub(crate) fn read(&self, file: &str) -> Vec<u8> {
        std::fs::read(self.path(file)).unwrap_or_else(|e| panic!("{}: {e}", self.path(file).display()))
    }

    /// Runs nvcc in the folder; `-L` to the device runtime comes last, for the links that need it.
    pub(crate) fn nvcc(&self, args: &[&str]) {
        let out = Command::new(cuda::kernels::NVCC)
            .current_dir(&self.dir)
            .args(args)
            .arg(format!("-L{}", cuda::kernels::CUDADEVRT_DIR))
            .output()
            .unwrap_or_else(|e| panic!("could not run {}: {e}", cuda::kernels::NVCC));
        assert!(out.status.success(), "nvcc {args:?} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    }

    /// A shared library with `source`'s device code, built with relocatable device code as a
    /// library with dynamic parallelism must be.
    pub(crate) fn library(&self, name: &str, source: &str) -> PathBuf {
        let (cu, so) = (format!("{name}.cu"), format!("lib{name}.so"));
        self.write(&cu, source);
        self.nvcc(&["-shared", "-Xcompiler", "-fPIC", "-rdc=true", HOPPER, "-o", &so, &cu]);
        self.path(&so)
    }
}

/// [`CDP_SOURCE`] and the others, compiled once for every test of this binary, and again only when
/// the compiler or this file (the sources and the commands) changed.
fn fixtures() -> &'static Fixtures {
    static FIXTURES: OnceLock<Fixtures> = OnceLock::new();
    let key = format!("{}\n{}", cuda::kernels::NVCC, include_str!("tests.rs"));
    FIXTURES.get_or_init(|| {
        Fixtures::cached("device-code", &key, |f| {
            f.write("cdp.cu", CDP_SOURCE);
            f.write("graph.cu", GRAPH_SOURCE);
            f.write("clean.cu", CLEAN_SOURCE);
            f.nvcc(&["-rdc=true", "-ptx", "-arch=sm_90a", "-o", "cdp.ptx", "cdp.cu"]);
            f.nvcc(&["-rdc=true", "-cubin", HOPPER, "-o", "cdp.rdc.cubin", "cdp.cu"]);
            f.nvcc(&["-dlink", "-cubin", HOPPER, "-o", "cdp.cubin", "cdp.rdc.cubin", "-lcudadevrt"]);
            for (mode, file) in [("default", "cdp.zstd.fatbin"), ("speed", "cdp.lz4.fatbin"), ("none", "cdp.fatbin")] {
                let compress = format!("-compress-mode={mode}");
                let link = ["-dlink", "--fatbin", HOPPER, "-Xfatbin", "-compress-all", "-Xfatbin", &compress];
                f.nvcc(&[&link[..], &["-o", file, "cdp.rdc.cubin", "-lcudadevrt"]].concat());
            }
            // PTX in a fatbin is compressed by default.
            f.nvcc(&["-rdc=true", "--fatbin", HOPPER_PTX, "-o", "cdp.ptx.fatbin", "cdp.cu"]);
            f.nvcc(&["-cubin", HOPPER, "-o", "graph.cubin", "graph.cu"]);
            f.nvcc(&["-rdc=true", "-cubin", HOPPER, "-o", "clean.rdc.cubin", "clean.cu"]);
            f.nvcc(&["-dlink", "-cubin", HOPPER, "-o", "clean.cubin", "clean.rdc.cubin", "-lcudadevrt"]);
            f.library("cdp", CDP_SOURCE);
            f.library("clean", CLEAN_SOURCE);
        })
    })
}

/// The launch findings of `findings` as `(symbol, usage)`.
fn launches(findings: &[Finding]) -> Vec<(&str, Usage)> {
    findings
        .iter()
        .filter_map(|f| match &f.evidence {
            Evidence::Launch { symbol, usage, .. } => Some((symbol.as_str(), *usage)),
            Evidence::Uninspected { .. } => None,
        })
        .collect()
}

fn callers<'a>(findings: &'a [Finding], symbol: &str) -> &'a [String] {
    findings
        .iter()
        .find_map(|f| match &f.evidence {
            Evidence::Launch { symbol: s, callers, .. } if s == symbol => Some(callers.as_slice()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no finding for {symbol} in {findings:#?}"))
}

fn all_text(findings: &[Finding]) -> String {
    findings.iter().map(|f| format!("{f}\n")).collect()
}

/// A linked module whose kernel `parent` launches from the device: the driver's imports first, then
/// the runtime's wrappers.
fn assert_linked_cdp(findings: &[Finding], parent: &str) {
    let found = launches(findings);
    assert_eq!(
        found[..2],
        [
            ("__cuda_syscall_cnpv2LaunchDeviceV2", Usage::Imports),
            ("__cuda_syscall_cnpv2GetParameterBufferV2", Usage::Imports)
        ],
        "{}",
        all_text(findings)
    );
    assert!(found.contains(&("__cudaCDP2LaunchDeviceV2", Usage::Defines)), "{}", all_text(findings));
    assert_eq!(callers(findings, "__cudaCDP2LaunchDeviceV2"), [parent]);
    assert_eq!(callers(findings, "__cuda_syscall_cnpv2LaunchDeviceV2"), ["__cudaCDP2LaunchDeviceV2"]);
    assert!(findings.iter().all(Finding::is_launch), "{}", all_text(findings));
}

#[test]
fn entry_point_names() {
    for name in [
        "__cuda_syscall_cnpv2LaunchDeviceV2",
        "__cuda_syscall_cnpGetParameterBuffer",
        "__cudaCDP2LaunchDeviceV2_ptsz",
        "__cudaCDP2MemcpyAsync",
        "cnpLaunchDevice",
        "cudaLaunchDeviceV2",
        "cudaGetParameterBuffer",
        "cudaGraphLaunch",
        "cudaMemset2DAsync_ptsz",
    ] {
        assert!(is_launch_entry_point(name), "{name}");
    }
    for name in [
        "vprintf",
        "malloc",
        "__assertfail",
        "cudaCGGetIntrinsicHandle",
        "__cuda_syscall_CGS_sync",
        "__cuda_syscall_cnpv2SetLastError",
        "__cudaCDP2GetLastError",
        "myLaunchDeviceV2",
        "cudaLaunchDeviceV3",
        "parent",
        "",
    ] {
        assert!(!is_launch_entry_point(name), "{name}");
    }
}

#[test]
fn a_linked_cubin_imports_the_drivers_launch() {
    let findings = scan(&fixtures().read("cdp.cubin"));
    assert_linked_cdp(&findings, "parent");
    let text = findings[0].to_string();
    assert!(
        text.starts_with("cubin (")
            && text.contains(
                ") imports __cuda_syscall_cnpv2LaunchDeviceV2 (called by __cudaCDP2LaunchDeviceV2): device-side launch"
            ),
        "{text}"
    );
}

#[test]
fn every_compression_of_a_linked_fatbin_is_read() {
    for (file, compression) in
        [("cdp.zstd.fatbin", Some(Compression::Zstd)), ("cdp.lz4.fatbin", Some(Compression::Lz4)), ("cdp.fatbin", None)]
    {
        let findings = scan(&fixtures().read(file));
        assert_linked_cdp(&findings, "parent");
        assert_eq!(findings[0].module.compression, compression, "{file}");
        assert_eq!(findings[0].module.location, ["fatbin entry 1 of 1"], "{file}");
        assert_eq!((findings[0].module.kind, findings[0].module.arch), (Some(Kind::Cubin), Some(90)), "{file}");
    }
}

#[test]
fn before_the_device_link_the_wrappers_are_the_imports() {
    let findings = scan(&fixtures().read("cdp.rdc.cubin"));
    assert_eq!(
        launches(&findings),
        [("__cudaCDP2GetParameterBufferV2", Usage::Imports), ("__cudaCDP2LaunchDeviceV2", Usage::Imports)],
        "{}",
        all_text(&findings)
    );
    assert_eq!(callers(&findings, "__cudaCDP2LaunchDeviceV2"), ["parent"]);
}

#[test]
fn ptx_names_the_launch_with_its_line() {
    let ptx = fixtures().read("cdp.ptx");
    let findings = scan(&ptx);
    let found = launches(&findings);
    assert_eq!(found.len(), 2, "{}", all_text(&findings));
    for (symbol, usage) in found {
        let Usage::Names { line } = usage else { panic!("{usage:?}") };
        let text = String::from_utf8_lossy(&ptx);
        assert!(text.lines().nth(line - 1).unwrap().contains(symbol), "line {line} does not name {symbol}");
    }
    // The same PTX, compressed inside a fatbin as nvcc does by default.
    let findings = scan(&fixtures().read("cdp.ptx.fatbin"));
    assert_eq!(launches(&findings).len(), 2, "{}", all_text(&findings));
    assert_eq!(findings[0].module.compression, Some(Compression::Zstd));
    assert!(findings[0].to_string().starts_with("fatbin entry 1 of 1: PTX compute_90 ("), "{}", findings[0]);
}

#[test]
fn device_graph_launch_is_an_import_even_without_rdc() {
    let findings = scan(&fixtures().read("graph.cubin"));
    assert_eq!(launches(&findings), [("cudaGraphLaunch", Usage::Imports)], "{}", all_text(&findings));
    // Its address goes to a constant bank, not into code, so no caller is named.
    let text = findings[0].to_string();
    assert!(text.starts_with("cubin (") && text.contains(" KB) imports cudaGraphLaunch: device-side launch"), "{text}");
}

#[test]
fn grid_sync_printf_malloc_and_assert_are_no_launch() {
    for file in ["clean.rdc.cubin", "clean.cubin"] {
        let findings = scan(&fixtures().read(file));
        assert!(findings.is_empty(), "{file}:\n{}", all_text(&findings));
    }
}

/// A library with dynamic parallelism carries the device runtime's relocatable code and its own
/// linked module; a library with relocatable device code but no device launch carries neither.
#[test]
fn libraries_are_scanned_before_loading() {
    let cdp = scan_library(&fixtures().read("libcdp.so"));
    let linked: Vec<&Finding> = cdp.iter().filter(|x| x.module.location[0] == "section .nv_fatbin").collect();
    assert!(
        linked[0].to_string().contains(", entry 1 of 1: cubin sm_90 (")
            && linked[0].to_string().contains("imports __cuda_syscall_cnpv2LaunchDeviceV2"),
        "{}",
        linked[0]
    );
    assert!(cdp.iter().any(|x| x.module.location[0] == "section __nv_relfatbin"), "{}", all_text(&cdp));
    assert!(cdp.iter().all(Finding::is_launch), "{}", all_text(&cdp));

    let clean = scan_library(&fixtures().read("libclean.so"));
    assert!(clean.is_empty(), "{}", all_text(&clean));
}

/// A fatbin where the toolchain keeps them that this scanner cannot read is reported, not passed over.
#[test]
fn an_unreadable_fatbin_in_a_library_is_reported() {
    let mut file = fixtures().read("libclean.so");
    let at = find(&file, &fatbin::MAGIC.to_le_bytes(), 0).unwrap();
    // The container's version, which no nvcc writes as 2.
    file[at + 4] = 2;
    let findings = scan_library(&file);
    assert_eq!(findings.len(), 1, "{}", all_text(&findings));
    let text = findings[0].to_string();
    let place = format!("section .nv_fatbin, fatbin at {at:#x}: fatbin (");
    assert!(text.starts_with(&place) && text.contains("not inspected, malformed (fatbin version 2"), "{text}");
}

#[test]
fn the_summary_quotes_the_most_telling_finding() {
    assert_eq!(summary(&[]), None);
    let mut findings = scan(b"no module");
    findings.extend(scan(&fixtures().read("cdp.ptx")));
    findings.extend(scan(&fixtures().read("cdp.cubin")));
    let text = summary(&findings).unwrap();
    let most_telling = format!("{} findings, the most telling: cubin (", findings.len());
    assert!(text.starts_with(&most_telling) && text.contains(") imports __cuda_syscall_cnpv2LaunchDeviceV2"), "{text}");
    assert!(summary(&findings[..1]).unwrap().starts_with("1 finding: unrecognised bytes (9 bytes): not inspected"));
}

/// PTX kept as plain data in a host file (for cuModuleLoadData at run time) is found by its names.
#[test]
fn device_names_outside_any_fatbin_are_found() {
    let ptx = fixtures().read("cdp.ptx");
    let mut file = b"host code and data ".repeat(100);
    file.extend_from_slice(&ptx);
    let findings = scan_library(&file);
    assert_eq!(
        launches(&findings),
        [
            ("__cudaCDP2GetParameterBufferV2", Usage::Contains { offset: 1900 + find_in(&ptx, "__cudaCDP2Get") }),
            ("__cudaCDP2LaunchDeviceV2", Usage::Contains { offset: 1900 + find_in(&ptx, "__cudaCDP2Launch") }),
        ]
    );
    assert_eq!(findings[0].module.location, [format!("bytes at {:#x}", 1900 + find_in(&ptx, "__cudaCDP2Get"))]);
    // The host API's names are host code, not evidence.
    assert!(scan_library(b"cudaGraphLaunch cudaMemcpyAsync cudaLaunchDevice").is_empty());
}

fn find_in(haystack: &[u8], needle: &str) -> usize {
    find(haystack, needle.as_bytes(), 0).unwrap()
}

#[test]
fn an_unknown_compression_is_reported_not_passed() {
    let mut fatbin = fixtures().read("cdp.zstd.fatbin");
    // The entry's flags (offset 40 of the entry header, which follows the 16-byte container header):
    // both compression bits at once, which no nvcc writes.
    fatbin[HEADER_FLAGS] |= 0x20;
    let findings = scan(&fatbin);
    assert_eq!(findings.len(), 1, "{}", all_text(&findings));
    let text = findings[0].to_string();
    assert!(
        text.starts_with("fatbin entry 1 of 1: cubin sm_90 (")
            && text.contains("not inspected, compressed with an unknown method (flags 0x10a011)")
            && text.contains("rebuild with"),
        "{text}"
    );
}

/// The low byte of the second byte of the first entry's flags.
const HEADER_FLAGS: usize = fatbin::HEADER_BYTES + 40 + 1;

#[test]
fn unrecognised_images_are_reported() {
    let findings = scan(b"just some bytes");
    assert_eq!(findings.len(), 1);
    assert_eq!(
        findings[0].to_string(),
        "unrecognised bytes (15 bytes): not inspected, neither a fatbin, a cubin nor PTX text: no module format \
         the driver loads"
    );
    // A host ELF file is no cubin.
    let host = std::fs::read(std::env::current_exe().unwrap()).unwrap();
    let findings = scan(&host[..4096.min(host.len())]);
    assert!(!findings.is_empty() && !findings[0].is_launch(), "{}", all_text(&findings));
}

/// Deterministic pseudo-random bytes (xorshift64*), so that failures reproduce.
struct Noise(u64);

impl Noise {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// Every cut of a device-launch module is reported, as a launch or as not inspected: never passed.
#[test]
fn truncated_modules_are_never_passed() {
    let mut noise = Noise(0x9e37_79b9_7f4a_7c15);
    for file in ["cdp.zstd.fatbin", "cdp.lz4.fatbin", "cdp.fatbin", "cdp.cubin", "cdp.ptx.fatbin"] {
        let whole = fixtures().read(file);
        let cuts = (0..300).map(|_| noise.next() as usize % whole.len()).chain([1, 4, 15, 16, 17, 63, 64, 65, 80]);
        for cut in cuts.filter(|&c| c < whole.len()) {
            let findings = scan(&whole[..cut]);
            assert!(!findings.is_empty(), "{file} cut at {cut} of {} passed as clean", whole.len());
        }
    }
}

/// Bytes at either end of a module where its headers and tables are.
const HEADERS: usize = 1024;

/// Garbage, and real modules with bytes overwritten, never panic.
#[test]
fn garbage_never_panics() {
    let mut noise = Noise(0x2545_f491_4f6c_dd1d);
    for n in [0, 1, 3, 4, 15, 16, 64, 100, 1000, 100_000] {
        for _ in 0..20 {
            let junk = noise.bytes(n);
            assert!(scan(&junk).iter().all(|f| !f.is_launch()));
            assert!(scan_library(&junk).is_empty());
        }
    }
    // Valid magic numbers in front of garbage reach the parsers' inner layers.
    for magic in [&fatbin::MAGIC.to_le_bytes()[..], elf::MAGIC, b"\x7fELF\x02\x01"] {
        for _ in 0..200 {
            let mut junk = magic.to_vec();
            let n = noise.next() as usize % 4096;
            junk.extend(noise.bytes(n));
            scan(&junk);
            scan_library(&junk);
        }
    }
    for file in ["cdp.zstd.fatbin", "cdp.lz4.fatbin", "cdp.cubin", "cdp.ptx.fatbin"] {
        let whole = fixtures().read(file);
        for _ in 0..300 {
            let mut broken = whole.clone();
            for _ in 0..1 + noise.next() % 8 {
                // Headers (first kilobyte) and section tables (last) are where parsers go wrong: each
                // takes a quarter of the hits, the rest land anywhere.
                let (len, edge) = (broken.len(), HEADERS.min(broken.len()));
                let at = match noise.next() % 4 {
                    0 => noise.next() as usize % edge,
                    1 => len - 1 - noise.next() as usize % edge,
                    _ => noise.next() as usize % len,
                };
                broken[at] = noise.next() as u8;
            }
            scan(&broken);
            scan_library(&broken);
        }
    }
}

/// [`Fixtures::library`] for other modules' tests.
pub(crate) fn cdp_library(f: &Fixtures) -> PathBuf {
    f.library("cdp", CDP_SOURCE)
}
