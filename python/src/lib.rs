//! `persistent_layer._native`: the megakernel's model (`megakernel::model`) for Python. The package
//! around it (`python/persistent_layer/`) is the API its users call, `MegaModel`, with the docstrings
//! and types; this module is the one native class under it. A model runs on the GPU (the model
//! kernel: one launch a decode step, one launch a whole generation) or on the CPU (the golden
//! arithmetic the GPU's logits are checked against, `megakernel check`). Every refusal the command line
//! makes is a `MegakernelError` here, with the command line's sentence.

use std::path::Path;

use cuda::Device;
use megakernel::MAX_BATCH;
use megakernel::model::{CpuModel, GpuModel, ModelConfig, ModelWeights, Text, check_together};
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
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
fn logit_bytes<'py>(py: Python<'py>, logits: &[f32]) -> PyResult<Bound<'py, PyBytes>> {
    PyBytes::new_with(py, logits.len() * 4, |buf| {
        for (dst, v) in buf.chunks_exact_mut(4).zip(logits) {
            dst.copy_from_slice(&v.to_le_bytes());
        }
        Ok(())
    })
}

#[pymethods]
impl Model {
    /// Reads the checkpoint in `path` (config.json, *.safetensors, tokenizer.json if present) and makes
    /// it ready to decode with caches of `max_seq` positions: on the GPU `device` with `max_batch`
    /// sequences' caches, or on the CPU.
    #[new]
    #[pyo3(signature = (path, max_seq = 4096, max_batch = 8, device = 0, on = "gpu"))]
    fn new(path: &str, max_seq: usize, max_batch: usize, device: usize, on: &str) -> PyResult<Model> {
        if on != "gpu" && on != "cpu" {
            return Err(PyValueError::new_err(format!("on = '{on}': the model runs on 'gpu' or 'cpu'")));
        }
        if max_seq == 0 {
            return Err(PyValueError::new_err("max_seq = 0: the caches need a position at least"));
        }
        if max_batch == 0 || max_batch > MAX_BATCH {
            return Err(PyValueError::new_err(format!("max_batch = {max_batch}: 1 to {MAX_BATCH} sequences")));
        }
        let dir = Path::new(path);
        let cfg = ModelConfig::read(dir).map_err(refused)?;
        let weights = ModelWeights::read(dir, &cfg).map_err(refused)?;
        let engine = if on == "gpu" {
            let dev = Device::open(device).map_err(refused)?;
            let model = GpuModel::new(&dev, &cfg, &weights, max_seq, max_batch, &mut |_| ()).map_err(refused)?;
            Engine::Gpu { dev, model: Box::new(model) }
        } else {
            Engine::Cpu(Box::new(CpuModel::new(cfg.clone(), weights, max_seq)))
        };
        Ok(Model { engine, cfg, text: Text::read(dir).map_err(|e| e.to_string()), max_batch })
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

    /// The compiled plan in words (the GPU's), or what the CPU runs.
    fn describe(&self) -> String {
        match &self.engine {
            Engine::Gpu { model, .. } => model.describe(),
            Engine::Cpu(_) => "the CPU model: the golden layers, the f32 head summed in f64".into(),
        }
    }

    /// The logits after `token` at `pos` (its K and V appended at `pos`), as f32 bytes.
    fn decode_step<'py>(&mut self, py: Python<'py>, token: u32, pos: usize) -> PyResult<Bound<'py, PyBytes>> {
        let logits = match &mut self.engine {
            Engine::Gpu { dev, model } => model.decode_step(dev, token, pos).map_err(refused)?,
            Engine::Cpu(model) => model.checked_step(token, pos).map_err(refused)?,
        };
        logit_bytes(py, &logits)
    }

    /// `prompt` from position 0 (on the GPU in one launch): its last position's logits, as f32 bytes.
    fn prefill<'py>(&mut self, py: Python<'py>, prompt: Vec<u32>) -> PyResult<Bound<'py, PyBytes>> {
        let logits = match &mut self.engine {
            Engine::Gpu { dev, model } => {
                model.generate(dev, &prompt, 1, &[]).map_err(refused)?;
                model.last_logits(dev).map_err(refused)?
            }
            Engine::Cpu(model) => model.prefill(&prompt).map_err(refused)?,
        };
        logit_bytes(py, &logits)
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
