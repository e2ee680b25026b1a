//! `persistent_layer._native`: the megakernel's model (`megakernel::model`) for Python. The package
//! around it (`python/persistent_layer/`) is the API its users call, `MegaModel`, with the docstrings
//! and types; this module is the one native class under it. A model runs on the GPU (the model
//! kernel: one launch a decode step, one launch a whole generation) or on the CPU (the golden
//! arithmetic the GPU's logits are checked against, `megakernel check`). Every refusal the command line
//! makes is a `MegakernelError` here, with the command line's sentence.

mod dlpack;

use std::path::Path;

use cuda::Device;
use megakernel::MAX_BATCH;
use megakernel::model::{
    CpuModel, GpuModel, ModelConfig, ModelError, ModelWeights, Text, WeightStream, check_together,
};
use pyo3::create_exception;
use pyo3::exceptions::{PyKeyError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

create_exception!(
    _native,
    MegakernelError,
    PyRuntimeError,
    "What the megakernel's model refused or what failed, in the words of the `megakernel` command."
);

fn refused(e: impl std::fmt::Display) -> PyErr {
    MegakernelError::new_err(e.to_string())
}

/// A traced step: its logits, each kind of phase's ms, the traced launch's ms.
type TimedStep = (Py<PyAny>, Vec<(String, f64)>, f32);

/// Where the model runs.
enum Engine {
    Gpu { dev: Device, model: Box<GpuModel> },
    Cpu(Box<CpuModel>),
}

/// A checkpoint loaded for decoding (`MegaModel` in Python wraps it).
#[pyclass(unsendable, module = "persistent_layer._native")]
struct Model {
    engine: Engine,
    cfg: ModelConfig,
    /// The checkpoint's tokenizer, or why there is none (tokens in and out need none).
    text: Result<Text, String>,
    /// Sequences `generate_batch` takes at most (on the GPU, those with caches of their own).
    max_batch: usize,
}

/// f32 logits as the bytes of a little-endian f32 array (the package turns them into a tensor).
fn logit_bytes(py: Python<'_>, logits: &[f32]) -> PyResult<Py<PyAny>> {
    let bytes = PyBytes::new_with(py, logits.len() * 4, |buf| {
        for (dst, v) in buf.chunks_exact_mut(4).zip(logits) {
            dst.copy_from_slice(&v.to_le_bytes());
        }
        Ok(())
    })?;
    Ok(bytes.into_any().unbind())
}

/// The GPU model's last logits: a DLPack capsule of a copy on the GPU (`on_device`), else f32 bytes.
fn gpu_logits(py: Python<'_>, dev: &Device, model: &GpuModel, on_device: bool) -> PyResult<Py<PyAny>> {
    if on_device {
        dlpack::export_logits(py, model.last_logits_on_device(dev).map_err(refused)?, dev.facts().ordinal)
    } else {
        logit_bytes(py, &model.last_logits(dev).map_err(refused)?)
    }
}

/// The arguments every model takes, checked before any work; then the GPU opened where the model runs
/// on one.
fn where_to_run(max_seq: usize, max_batch: usize, device: usize, on: &str) -> PyResult<Option<Device>> {
    if on != "gpu" && on != "cpu" {
        return Err(PyValueError::new_err(format!("on = '{on}': the model runs on 'gpu' or 'cpu'")));
    }
    if max_seq == 0 {
        return Err(PyValueError::new_err("max_seq = 0: the caches need a position at least"));
    }
    if max_batch == 0 || max_batch > MAX_BATCH {
        return Err(PyValueError::new_err(format!("max_batch = {max_batch}: 1 to {MAX_BATCH} sequences")));
    }
    (on == "gpu").then(|| Device::open(device)).transpose().map_err(refused)
}

impl Model {
    /// The model of `cfg` and `weights` on the GPU `dev` (opened by the caller) or on the CPU.
    fn build(
        cfg: ModelConfig,
        weights: ModelWeights,
        text: Result<Text, String>,
        dev: Option<Device>,
        max_seq: usize,
        max_batch: usize,
    ) -> PyResult<Model> {
        let engine = match dev {
            Some(dev) => {
                let model =
                    GpuModel::new(&dev, &cfg, &weights, max_seq, max_batch, WeightStream::AsStored, &mut |_| ())
                        .map_err(refused)?;
                Engine::Gpu { dev, model: Box::new(model) }
            }
            None => Engine::Cpu(Box::new(CpuModel::new(cfg.clone(), weights, max_seq))),
        };
        Ok(Model { engine, cfg, text, max_batch })
    }
}

/// The tokenizer of `json` (a loaded tokenizer's).
fn tokenizer_of(json: &str) -> Result<Text, String> {
    Text::parse(Path::new("the tokenizer given"), json).map_err(|e| e.to_string())
}

/// What a model is read from.
#[derive(FromPyObject)]
enum Source<'py> {
    /// A checkpoint folder's path: config.json, *.safetensors, tokenizer.json if present.
    Folder(String),
    /// A loaded model: its name (for its plan), its configuration as `save_pretrained` writes
    /// config.json, and a mapping from Hugging Face names to tensors (`loaded_weights`).
    Loaded(String, String, Bound<'py, PyAny>),
}

/// `cfg`'s weights from `tensors` taken through DLPack (on the host or a GPU; bf16, f16 or f32,
/// compact), read once into the model's bf16 as the folder's loader reads them; memory on a GPU is
/// read in that GPU's context (`dev`'s where it is the model's).
fn loaded_weights(
    cfg: &ModelConfig,
    tensors: &Bound<'_, PyAny>,
    dev: Option<&Device>,
) -> Result<ModelWeights, ModelError> {
    // GPUs other than the model's, opened to read tensors that live there.
    let mut others: Vec<Device> = Vec::new();
    let mut gpu = |ordinal: usize, address: u64, dst: &mut [u8]| -> Result<(), String> {
        let owner = match dev.filter(|d| d.facts().ordinal == ordinal) {
            Some(d) => d,
            None => match others.iter().position(|d| d.facts().ordinal == ordinal) {
                Some(i) => &others[i],
                None => {
                    others.push(Device::open(ordinal).map_err(|e| e.to_string())?);
                    others.last().expect("just pushed")
                }
            },
        };
        owner.ctx().bind_to_thread().map_err(|e| format!("binding GPU {ordinal}'s context: {e:?}"))?;
        dlpack::read_device(address, dst)
    };
    let state = Path::new("state_dict");
    let tensor_error = |name: &str, why: String| ModelError::Tensor { path: state.into(), name: name.into(), why };
    ModelWeights::from_tensors(cfg, |name, shape| {
        let tensor = match tensors.get_item(name) {
            Ok(t) => t,
            Err(e) if e.is_instance_of::<PyKeyError>(tensors.py()) => return Err(tensor_error(name, "missing".into())),
            Err(e) => return Err(tensor_error(name, e.to_string())),
        };
        dlpack::take_tensor(&tensor, shape, &mut gpu).map_err(|why| tensor_error(name, why))
    })
}

/// Why a quantised model is read from its folder: a loaded model's tensors come through DLPack in
/// bf16, f16 or f32 (`loaded_weights`), where the folder's loader reads the codes and their scales.
const LOADED_QUANTIZED: &str =
    "is read from the folder it was saved to: model.save_pretrained(DIR), then from_pretrained(DIR)";

/// Why a loaded model without a tokenizer given has no text.
const NO_TOKENIZER: &str = "no tokenizer: pass a loaded one to from_pretrained (tokenizer=) for text in and out";

#[pymethods]
impl Model {
    /// Reads the model `source` names and makes it ready to decode with caches of `max_seq` positions:
    /// on the GPU `device` with `max_batch` sequences' caches, or on the CPU. `tokenizer_json` (a
    /// loaded tokenizer's) gives it text, in place of a folder's tokenizer.json.
    #[new]
    #[pyo3(signature = (source, max_seq = 4096, max_batch = 8, device = 0, on = "gpu", tokenizer_json = None))]
    fn new(
        source: Source<'_>,
        max_seq: usize,
        max_batch: usize,
        device: usize,
        on: &str,
        tokenizer_json: Option<&str>,
    ) -> PyResult<Model> {
        let dev = where_to_run(max_seq, max_batch, device, on)?;
        let given = tokenizer_json.map(tokenizer_of);
        let (cfg, weights, text) = match source {
            Source::Folder(path) => {
                let dir = Path::new(&path);
                let cfg = ModelConfig::read(dir).map_err(refused)?;
                let weights = ModelWeights::read(dir, &cfg).map_err(refused)?;
                (cfg, weights, given.unwrap_or_else(|| Text::read(dir).map_err(|e| e.to_string())))
            }
            Source::Loaded(name, config_json, tensors) => {
                let cfg = ModelConfig::parse(&name, Path::new("the model's config"), &config_json).map_err(refused)?;
                if let Some(q) = cfg.quantized {
                    return Err(refused(ModelError::Unsupported {
                        field: "quantization_config",
                        why: format!("a model loaded in {} {LOADED_QUANTIZED}", q.name()),
                    }));
                }
                let weights = loaded_weights(&cfg, &tensors, dev.as_ref()).map_err(refused)?;
                (cfg, weights, given.unwrap_or_else(|| Err(NO_TOKENIZER.into())))
            }
        };
        Model::build(cfg, weights, text, dev, max_seq, max_batch)
    }

    /// 'gpu' or 'cpu'.
    #[getter]
    fn on(&self) -> &'static str {
        match self.engine {
            Engine::Gpu { .. } => "gpu",
            Engine::Cpu(_) => "cpu",
        }
    }

    #[getter]
    fn vocab(&self) -> usize {
        self.cfg.vocab
    }

    /// The caches' depth in positions.
    #[getter]
    fn context(&self) -> usize {
        match &self.engine {
            Engine::Gpu { model, .. } => model.context(),
            Engine::Cpu(model) => model.context(),
        }
    }

    #[getter]
    fn eos(&self) -> Vec<u32> {
        self.cfg.eos.clone()
    }

    #[getter]
    fn bos(&self) -> Option<u32> {
        self.cfg.bos
    }

    /// The compiled plan in words (the GPU's, and for a quantised checkpoint what its decode steps
    /// stream), or what the CPU runs.
    fn describe(&self) -> String {
        match &self.engine {
            Engine::Gpu { model, .. } => match model.streams() {
                Some(weights) => format!("{}; weights: {weights}", model.describe()),
                None => model.describe(),
            },
            Engine::Cpu(_) => "the CPU model: the golden layers, the f32 head summed in f64".into(),
        }
    }

    /// The logits after `token` at `pos` (its K and V appended at `pos`): on the GPU a DLPack capsule
    /// of them there (`on_device`) or f32 bytes; on the CPU f32 bytes.
    #[pyo3(signature = (token, pos, on_device = false))]
    fn decode_step(&mut self, py: Python<'_>, token: u32, pos: usize, on_device: bool) -> PyResult<Py<PyAny>> {
        match &mut self.engine {
            Engine::Gpu { dev, model } => {
                model.step(dev, token, pos).map_err(refused)?;
                gpu_logits(py, dev, model, on_device)
            }
            Engine::Cpu(model) => logit_bytes(py, &model.checked_step(token, pos).map_err(refused)?),
        }
    }

    /// `decode_step` in the model kernel's traced instance, on the GPU only: the logits, each kind of
    /// phase's ms on the step's critical path (summed over the layers; the head last), and the traced
    /// launch's ms by events.
    #[pyo3(signature = (token, pos, on_device = false))]
    fn decode_step_timed(&mut self, py: Python<'_>, token: u32, pos: usize, on_device: bool) -> PyResult<TimedStep> {
        let Engine::Gpu { dev, model } = &mut self.engine else {
            return Err(refused("decode_step_timed times the model kernel's phases: this model runs on the CPU"));
        };
        let trace = model.trace_step(dev, token, pos).map_err(refused)?;
        let shares = trace.step_shares().ok_or_else(|| refused("the traced step's stamps are incomplete"))?;
        let phases = shares.iter().map(|s| (s.what.clone(), s.span_us / 1e3)).collect();
        Ok((gpu_logits(py, dev, model, on_device)?, phases, trace.kernel_ms))
    }

    /// `prompt` from position 0 (on the GPU in one launch): its last position's logits, as
    /// `decode_step` gives them.
    #[pyo3(signature = (prompt, on_device = false))]
    fn prefill(&mut self, py: Python<'_>, prompt: Vec<u32>, on_device: bool) -> PyResult<Py<PyAny>> {
        match &mut self.engine {
            Engine::Gpu { dev, model } => {
                model.generate(dev, &prompt, 1, &[]).map_err(refused)?;
                gpu_logits(py, dev, model, on_device)
            }
            Engine::Cpu(model) => logit_bytes(py, &model.prefill(&prompt).map_err(refused)?),
        }
    }

    /// Forgets every sequence: the caches zeroed, as a new model's are.
    fn reset(&mut self) -> PyResult<()> {
        match &mut self.engine {
            Engine::Gpu { dev, model } => model.reset(dev).map_err(refused),
            Engine::Cpu(model) => {
                model.reset();
                Ok(())
            }
        }
    }

    /// `prompt` from position 0 and up to `max_new` greedy tokens, stopping at one of `eos` or at the
    /// caches' end, on the GPU in one launch: the tokens, why it stopped ('eos', 'max_new', 'context')
    /// and the kernel's ms (None on the CPU).
    fn generate(
        &mut self,
        prompt: Vec<u32>,
        max_new: usize,
        eos: Vec<u32>,
    ) -> PyResult<(Vec<u32>, &'static str, Option<f32>)> {
        let (tokens, stop, kernel_ms) = match &mut self.engine {
            Engine::Gpu { dev, model } => {
                let g = model.generate(dev, &prompt, max_new, &eos).map_err(refused)?;
                (g.tokens, g.stop, Some(g.kernel_ms))
            }
            Engine::Cpu(model) => {
                let (tokens, stop) = model.generate(&prompt, max_new, &eos).map_err(refused)?;
                (tokens, stop, None)
            }
        };
        Ok((tokens, stop.name(), kernel_ms))
    }

    /// The generations of `prompts` (at most `max_batch`), each the tokens `generate` would give it alone,
    /// with why it stopped: on the GPU one batch step per position for all of them, on the CPU one
    /// generation after another.
    fn generate_batch(
        &mut self,
        prompts: Vec<Vec<u32>>,
        max_new: usize,
        eos: Vec<u32>,
    ) -> PyResult<Vec<(Vec<u32>, &'static str)>> {
        let done = match &mut self.engine {
            Engine::Gpu { dev, model } => model.generate_batch(dev, &prompts, max_new, &eos).map_err(refused)?,
            Engine::Cpu(model) => {
                check_together(model.limits(), self.max_batch, &prompts, max_new, &eos).map_err(refused)?;
                let mut done = Vec::with_capacity(prompts.len());
                for p in &prompts {
                    done.push(model.generate(p, max_new, &eos).map_err(refused)?);
                }
                done
            }
        };
        Ok(done.into_iter().map(|(tokens, stop)| (tokens, stop.name())).collect())
    }

    /// The tokens of `text`, the model's special tokens added (the checkpoint's tokenizer.json).
    fn encode(&self, text: &str) -> PyResult<Vec<u32>> {
        self.text.as_ref().map_err(refused)?.encode(text).map_err(refused)
    }

    /// The text of `tokens`, special tokens left out.
    fn decode(&self, tokens: Vec<u32>) -> PyResult<String> {
        self.text.as_ref().map_err(refused)?.decode(&tokens).map_err(refused)
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Model>()?;
    m.add("MegakernelError", m.py().get_type::<MegakernelError>())?;
    Ok(())
}
