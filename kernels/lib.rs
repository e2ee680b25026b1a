//! Every CUDA kernel the grader is made of, compiled by the root build script (`build.rs`, through
//! cuda-build) and embedded: a module per owning crate (`kernels::grader::VERIFY` is
//! `kernels/grader/verify.cu`), each with `ALL` and the `FOLDER` it came from; and the toolchain that
//! compiled them ([`NVCC`], [`CUDADEVRT_DIR`]), for tests that compile fixtures of their own. The
//! megakernel's model kernels (`kernels/megakernel/model/`) are compiled by the megakernel crate with
//! its `model` feature, as the same [`Kernel`] type.
//!
//! Also the test every owner's kernels pass: each file embedded with machine code, and no function
//! spilling registers beyond what an allowance grants it, with the reason ([`assert_embedded`]).

// The generated constants name `::kernels::Kernel`, here as in the megakernel crate.
extern crate self as kernels;

/// One compiled kernel file.
#[derive(Debug, Clone, Copy)]
pub struct Kernel {
    /// The file's stem: `bulk_read` for `kernels/cuda/bulk_read.cu`.
    pub name: &'static str,
    /// Machine code for each target architecture plus PTX, as nvcc's `--fatbin` writes it.
    pub fatbin: &'static [u8],
    /// ptxas's `-v` report: registers, shared memory, stack frame and spills of every function.
    pub ptxas_report: &'static str,
}

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

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

/// Panics unless `all` holds one kernel per `.cu` file of `folder`, each with machine code and a
/// ptxas report, none of its functions spilling registers beyond what `allowed` grants them.
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernels of every owner this crate compiles are all there, and none spills a register.
    #[test]
    fn every_owners_kernels_are_embedded_with_code_and_no_spills() {
        for (folder, all) in [
            (cuda::FOLDER, cuda::ALL),
            (grader::FOLDER, grader::ALL),
            (reference::FOLDER, reference::ALL),
            (redteam::FOLDER, redteam::ALL),
            (megakernel::FOLDER, megakernel::ALL),
        ] {
            assert_embedded(folder, all, &[]);
        }
    }

    /// The probes of `scripts/probes/` (the measurements docs/perf.md quotes) still compile, host code
    /// included, with the kernels' nvcc: a probe that rots would otherwise fail only at its next device
    /// call. Compiled again only when the compiler, a probe or a header it can include changed.
    #[test]
    fn every_probe_compiles() {
        use std::hash::{DefaultHasher, Hash, Hasher};
        use std::path::Path;
        use std::process::{Command, Stdio};
        // Probes that need what a build does not have, and why.
        const NOT_HERE: &[(&str, &str)] = &[("nccl_hop.cu", "NCCL's headers, from its wheel on the device machine")];
        // Flags beyond the common ones, as the probe's own build line gives them.
        const EXTRA: &[(&str, &[&str])] =
            &[("nf4_mma.cu", &["-Xcompiler", "-fpermissive", "-I", "kernels/megakernel"])];
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let files = |dir: &str, ext: &str| -> Vec<std::path::PathBuf> {
            let mut v: Vec<_> = std::fs::read_dir(root.join(dir))
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| p.extension().is_some_and(|e| e == ext))
                .collect();
            v.sort();
            v
        };
        let probes = files("scripts/probes", "cu");
        let name = |p: &Path| p.file_name().unwrap().to_str().unwrap().to_string();
        for probe in NOT_HERE.iter().map(|(p, _)| p).chain(EXTRA.iter().map(|(p, _)| p)) {
            assert!(probes.iter().any(|p| name(p) == *probe), "{probe} is named here but is not a probe");
        }
        let mut key = DefaultHasher::new();
        NVCC.hash(&mut key);
        for f in [
            probes.clone(),
            files("scripts/probes", "cuh"),
            files("kernels/include", "cuh"),
            files("kernels/megakernel", "cuh"),
        ]
        .concat()
        {
            (name(&f), std::fs::read(&f).unwrap()).hash(&mut key);
        }
        let key = format!("{:016x}", key.finish());
        let dir = std::env::current_exe().unwrap().ancestors().nth(2).unwrap().join("fixtures").join("probes");
        let stamp = dir.join("compiled-from.txt");
        if std::fs::read_to_string(&stamp).is_ok_and(|k| k == key) {
            return;
        }
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let runs: Vec<_> = probes
            .iter()
            .filter(|p| !NOT_HERE.iter().any(|(n, _)| *n == name(p)))
            .map(|p| {
                let extra = EXTRA.iter().find(|(n, _)| *n == name(p)).map_or(&[][..], |(_, e)| *e);
                let out = dir.join(name(p)).with_extension("o");
                let child = Command::new(NVCC)
                    .current_dir(root)
                    .args(["-O3", "-std=c++17", "-arch=sm_90a", "-I", "kernels/include", "-c", "-o"])
                    .arg(&out)
                    .args(extra)
                    .arg(p)
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn();
                (name(p), child)
            })
            .collect();
        for (probe, run) in runs {
            // Every probe's nvcc runs at once; each is waited for here.
            let out = run.and_then(|c| c.wait_with_output()).unwrap_or_else(|e| panic!("could not run {NVCC}: {e}"));
            assert!(out.status.success(), "{probe} does not compile:\n{}", String::from_utf8_lossy(&out.stderr));
        }
        std::fs::write(&stamp, key).unwrap();
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
