//! `grader run --dump DIR`: everything needed to re-check a verdict outside the grader, as
//! safetensors files (any framework loads them) and a JSON manifest that says what each tensor is.
//!
//! - `weights.safetensors`: the nine weights, row-major bf16, with the contract's names.
//! - `kv_prefix.safetensors`: `k_cache`, `v_cache` as generated (before any step).
//! - `steps.safetensors`: `x` (calls, d), `out_submission` and `out_reference` (calls, d), `pos` (calls).
//! - `manifest.json`: config, seeds, the schedule of calls, and the verdict.

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};

use cuda::cudarc::driver::CudaSlice;
use cuda::{Context, Device};
use half::bf16;
use reference::gpu::{DeviceCache, DeviceWeights};
use safetensors::tensor::{Dtype, TensorView, serialize_to_file};
use serde::Serialize;
use spec::{Config, Tensor};

use super::report::Seeds;
use crate::error::GraderError;
use spec::Call;

/// The files a dump writes into its folder (the preflight keeps `--json` clear of them).
pub const WEIGHTS_FILE: &str = "weights.safetensors";
pub const PREFIX_FILE: &str = "kv_prefix.safetensors";
pub const STEPS_FILE: &str = "steps.safetensors";
pub const MANIFEST_FILE: &str = "manifest.json";
pub const FILES: [&str; 4] = [WEIGHTS_FILE, PREFIX_FILE, STEPS_FILE, MANIFEST_FILE];

/// What `manifest.json` holds.
#[derive(Serialize)]
struct Manifest<'a> {
    schema_version: u32,
    config: &'a Config,
    seeds: Seeds,
    files: HashMap<&'static str, &'static str>,
    calls: &'a [Call],
    passed: bool,
    failed_gates: &'a [&'static str],
}

/// What a judged run leaves for the dump: the weights on the device, the calls' tensors on the host.
pub struct DumpData<'a> {
    pub pristine: &'a DeviceWeights,
    pub inputs: &'a [Vec<bf16>],
    pub outputs: &'a [Vec<bf16>],
    pub reference_outputs: &'a [Vec<bf16>],
}

fn bytes(v: &[bf16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn write(dir: &Path, file: &str, tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)>) -> Result<(), GraderError> {
    let path = dir.join(file);
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            (name.clone(), TensorView::new(*dtype, shape.clone(), data).expect("shape matches data"))
        })
        .collect();
    serialize_to_file(views, None, &path).map_err(|e| GraderError::Write {
        path: path.display().to_string(),
        source: std::io::Error::other(e.to_string()),
    })
}

#[allow(clippy::too_many_arguments)]
pub fn dump(
    dir: &Path,
    dev: &Device,
    cfg: &Config,
    seeds: Seeds,
    calls: &[Call],
    data: DumpData<'_>,
    passed: bool,
    failed_gates: &[&'static str],
) -> Result<(), GraderError> {
    std::fs::create_dir_all(dir).map_err(|source| GraderError::Write { path: dir.display().to_string(), source })?;
    let read = |v: &CudaSlice<bf16>| dev.stream().clone_dtoh(v).context("reading a tensor to dump");

    let mut weights = Vec::new();
    for &t in Tensor::WEIGHTS {
        weights.push((t.name().to_string(), Dtype::BF16, t.shape(cfg), bytes(&read(data.pristine.get(t))?)));
    }
    write(dir, WEIGHTS_FILE, weights)?;

    let prefix = DeviceCache::generate(dev, cfg, seeds.weights)?;
    let shape = Tensor::KCache.shape(cfg);
    write(
        dir,
        PREFIX_FILE,
        vec![
            ("k_cache".into(), Dtype::BF16, shape.clone(), bytes(&read(&prefix.k)?)),
            ("v_cache".into(), Dtype::BF16, shape, bytes(&read(&prefix.v)?)),
        ],
    )?;

    let stack =
        |rows: &[Vec<bf16>]| -> Result<Vec<u8>, GraderError> { Ok(rows.iter().flat_map(|r| bytes(r)).collect()) };
    let rows = vec![calls.len(), cfg.batch * cfg.d];
    let pos: Vec<u8> = calls.iter().flat_map(|c| (c.pos as i64).to_le_bytes()).collect();
    write(
        dir,
        STEPS_FILE,
        vec![
            ("x".into(), Dtype::BF16, rows.clone(), stack(data.inputs)?),
            ("out_submission".into(), Dtype::BF16, rows.clone(), stack(data.outputs)?),
            ("out_reference".into(), Dtype::BF16, rows, stack(data.reference_outputs)?),
            ("pos".into(), Dtype::I64, vec![calls.len()], pos),
        ],
    )?;

    let files = HashMap::from([
        (WEIGHTS_FILE, "the nine weights, row-major bf16 (out, in), applied as h @ W^T"),
        (PREFIX_FILE, "k_cache and v_cache (batch, n_kv, max_seq_len, hd) before the first call"),
        (STEPS_FILE, "per call: x, out_submission, out_reference (calls, d) and pos (calls)"),
    ]);
    let manifest = Manifest { schema_version: 1, config: cfg, seeds, files, calls, passed, failed_gates };
    let path = dir.join(MANIFEST_FILE);
    std::fs::write(&path, serde_json::to_string_pretty(&manifest).expect("serialises") + "\n")
        .map_err(|source| GraderError::Write { path: path.display().to_string(), source })
}

/// `--json` of `grader run`, written after the dump of `--dump` (if any, checked by `preflight::output_dir`):
/// a file as `preflight::output_file` checks, which may lie in the dump's folder before the dump makes it,
/// but is neither that folder (nor a path above it) nor one of the files the dump writes, or one
/// would overwrite the other after the whole judgement.
pub fn report_file(json: &Path, dump: Option<&Path>) -> Result<(), GraderError> {
    let Some(dump) = dump.filter(|_| json != Path::new("-")) else {
        return crate::preflight::output_file("--json", json);
    };
    let (report, folder) = (resolved(json), resolved(dump));
    let clash = if folder.starts_with(&report) {
        "the dump's folder would be made at or inside the report's path".to_string()
    } else if let Some(file) = FILES.iter().find(|&f| report == folder.join(f)) {
        format!("the dump writes its {file} there")
    } else if !folder.exists() && report.parent() == Some(&folder) {
        return Ok(()); // the dump makes the folder, and `output_dir` checked that it can
    } else {
        return crate::preflight::output_file("--json", json);
    };
    Err(GraderError::Usage(format!(
        "cannot write --json {} with --dump {}: {clash}; give the report a path of its own, e.g. {}",
        json.display(),
        dump.display(),
        dump.join("report.json").display()
    )))
}

/// `path` absolute, its deepest existing ancestor with symbolic links resolved and the rest (which
/// holds no link, since it does not exist) with `.` and `..` resolved, so that two spellings of one
/// place compare equal before either exists.
fn resolved(path: &Path) -> PathBuf {
    let path = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let Some((existing, mut real)) = path.ancestors().find_map(|a| Some((a, a.canonicalize().ok()?))) else {
        return path;
    };
    for part in path.strip_prefix(existing).expect("an ancestor is a prefix").components() {
        match part {
            Component::ParentDir => {
                real.pop();
            }
            Component::CurDir => {}
            other => real.push(other),
        }
    }
    real
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preflight::tests::scratch;

    #[test]
    fn the_report_stays_clear_of_the_dump() {
        let dir = scratch("clash");
        let dump = dir.join("dump");
        let at_or_inside = "the dump's folder would be made at or inside the report's path";
        for (json, folder, words) in [
            (dump.clone(), dump.clone(), at_or_inside),
            (dir.join("./dump/../dump"), dump.clone(), at_or_inside),
            (dir.join("out"), dir.join("out/dump"), at_or_inside),
            (dump.join("manifest.json"), dump.clone(), "the dump writes its manifest.json there"),
            (dump.join("weights.safetensors"), dump.clone(), "the dump writes its weights.safetensors there"),
        ] {
            let msg = report_file(&json, Some(&folder)).unwrap_err().to_string();
            assert!(msg.contains(words) && msg.contains("report.json"), "{}: {msg}", json.display());
        }
        // Beside the dump's files, in the folder the dump will make.
        report_file(&dump.join("report.json"), Some(&dump)).unwrap();
        report_file(&dir.join("dump.json"), Some(&dump)).unwrap();
        report_file(Path::new("-"), Some(&dump)).unwrap();
        // Deeper than the folder the dump makes: nothing makes that one.
        let msg = report_file(&dump.join("sub/report.json"), Some(&dump)).unwrap_err().to_string();
        assert!(msg.contains("does not exist"), "{msg}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
