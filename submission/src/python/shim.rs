//! The Rust side of `shim.py`: one submission module in the embedded interpreter, reached through
//! the shim's four entries. Tensors go in as DLPack capsules over device addresses; the step's
//! output comes back as an address and a dtype, checked by the shim, never as a Python object.

use std::ffi::CStr;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde::Serialize;
use spec::Config;

use super::dlpack;
use super::ffi::{Gil, Object, Python, RawObject};
use super::probe::PythonInfo;
use crate::SubmissionError;

const SHIM: &str = include_str!("shim.py");
/// The file name tracebacks give the shim's frames (the shim leaves them out of its messages).
const SHIM_FILE: &str = "<grader shim>";
const DLTENSOR: &CStr = c"dltensor";
/// `a` of a failed answer whose `build_layer` declined the config (`_UNSUPPORTED` of `shim.py`).
const UNSUPPORTED: u64 = 1;

/// Why `build_layer` did not build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BuildError {
    /// It raised `NotImplementedError`: a config the module does not implement, the exception's text.
    Unsupported(String),
    /// Anything else, said for a Python user (an exception with its traceback, a broken contract).
    Failed(String),
}

impl From<BuildError> for SubmissionError {
    fn from(e: BuildError) -> Self {
        match e {
            BuildError::Unsupported(why) => SubmissionError::Unsupported(why),
            BuildError::Failed(message) => SubmissionError::Python(message),
        }
    }
}

/// An entry's answer: its three ints, or its paragraph and the kind of failure (`a`).
enum Answer {
    Done([u64; 3]),
    Failed { message: String, kind: u64 },
}

/// The element type of a step's output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    Bf16,
    F32,
}

/// A step's output as the shim checked it: `(B, d)`, contiguous, on the runner's device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Output {
    pub address: u64,
    pub dtype: Dtype,
}

/// A device tensor handed to the submission: its address and row-major shape (bf16).
#[derive(Debug, Clone)]
pub struct DeviceTensor<'a> {
    pub name: &'a str,
    pub address: u64,
    pub shape: Vec<usize>,
}

/// The task's `cfg` dict (`wdtype` is added by the shim as `torch.bfloat16`).
#[derive(Serialize)]
struct Cfg {
    layers: usize,
    batch: usize,
    d: usize,
    ffn: usize,
    n_q: usize,
    n_kv: usize,
    hd: usize,
    eps: f64,
    theta: f64,
}

/// One submission module, loaded through its own copy of the shim.
pub struct Shim {
    python: &'static Python,
    /// The shim module, kept for the life of the process (as the interpreter is).
    module: RawObject,
    ordinal: usize,
}

static LOADED: AtomicUsize = AtomicUsize::new(0);

impl Shim {
    /// Embeds the interpreter of `info` (once per process), runs a fresh copy of the shim, and
    /// imports the submission's module through it (torch first).
    pub fn load(info: &PythonInfo, ordinal: usize) -> Result<Shim, String> {
        let python = Python::get(&info.library, &info.home)?;
        let name = format!("_persistent_layer_shim_{}", LOADED.fetch_add(1, Ordering::Relaxed));
        let setup = serde_json::to_string(info).map_err(|e| e.to_string())?;
        let gil = python.gil();
        let shim = Shim { python, module: gil.module(&name, SHIM, SHIM_FILE)?.keep(), ordinal };
        shim.call(&gil, "start", |g| Ok(vec![g.str(&setup)?, g.int(ordinal as i64)?]))?;
        Ok(shim)
    }

    /// `shim.<entry>(*args)`, its `(error, a, b, c)` answer turned into a result.
    fn call<'g>(
        &self,
        gil: &'g Gil<'static>,
        entry: &str,
        args: impl FnOnce(&'g Gil<'static>) -> Result<Vec<Object<'g, 'static>>, String>,
    ) -> Result<[u64; 3], String> {
        match self.answer(gil, entry, args)? {
            Answer::Done(values) => Ok(values),
            Answer::Failed { message, .. } => Err(message),
        }
    }

    /// `shim.<entry>(*args)`'s `(error, a, b, c)` answer; `Err` when it could not be called or read.
    fn answer<'g>(
        &self,
        gil: &'g Gil<'static>,
        entry: &str,
        args: impl FnOnce(&'g Gil<'static>) -> Result<Vec<Object<'g, 'static>>, String>,
    ) -> Result<Answer, String> {
        let module = gil.borrowed(self.module);
        let answer = module.call_method(entry, gil.tuple(args(gil)?)?)?;
        let error = answer.item(0)?.to_str()?;
        let values = [answer.item(1)?.to_u64()?, answer.item(2)?.to_u64()?, answer.item(3)?.to_u64()?];
        Ok(if error.is_empty() { Answer::Done(values) } else { Answer::Failed { message: error, kind: values[0] } })
    }

    /// `build_layer(weights, kv_cache, cfg, max_seq_len)` for a stack of `layers.len()` layers (`cfg`'s
    /// `layers` in the dict), layer `l`'s tensors aliasing `layers[l]`.
    pub fn build(&self, cfg: &Config, layers: &[Vec<DeviceTensor<'_>>]) -> Result<(), BuildError> {
        let cfg_json = serde_json::to_string(&Cfg {
            layers: layers.len(),
            batch: cfg.batch,
            d: cfg.d,
            ffn: cfg.ffn,
            n_q: cfg.n_q,
            n_kv: cfg.n_kv,
            hd: cfg.hd,
            eps: f64::from(cfg.eps),
            theta: cfg.theta,
        })
        .map_err(|e| BuildError::Failed(e.to_string()))?;
        let gil = self.python.gil();
        let answer = self
            .answer(&gil, "build", |g| {
                // Per layer, its tensors' names (comma-separated) and their capsules.
                let layer = |tensors: &Vec<DeviceTensor<'_>>| {
                    let names: Vec<&str> = tensors.iter().map(|t| t.name).collect();
                    let capsules =
                        tensors.iter().map(|t| self.capsule(g, t.address, &t.shape)).collect::<Result<_, _>>()?;
                    g.tuple(vec![g.str(&names.join(","))?, g.tuple(capsules)?])
                };
                let layers = layers.iter().map(layer).collect::<Result<_, _>>()?;
                Ok(vec![g.str(&cfg_json)?, g.tuple(layers)?, g.int(cfg.max_seq_len as i64)?])
            })
            .map_err(BuildError::Failed)?;
        match answer {
            Answer::Done(_) => Ok(()),
            Answer::Failed { message, kind: UNSUPPORTED } => Err(BuildError::Unsupported(message)),
            Answer::Failed { message, .. } => Err(BuildError::Failed(message)),
        }
    }

    /// `layer_step(handle, x, pos)` with `x` the `(batch, d)` tensor at `x_address`; for a stack,
    /// `layer_step(handle, x, pos, hidden)` with `hidden = Some((address, rows))` the `(rows, batch, d)`
    /// tensor at `address`, `rows` being the stack's layers but the last.
    pub fn step(
        &self,
        x_address: u64,
        pos: usize,
        batch: usize,
        d: usize,
        hidden: Option<(u64, usize)>,
    ) -> Result<Output, String> {
        let gil = self.python.gil();
        let [address, dtype, _] = self.call(&gil, "step", |g| {
            let mut args = vec![
                self.capsule(g, x_address, &[batch, d])?,
                g.int(pos as i64)?,
                g.int(batch as i64)?,
                g.int(d as i64)?,
            ];
            if let Some((address, rows)) = hidden {
                args.push(self.capsule(g, address, &[rows, batch, d])?);
            }
            Ok(args)
        })?;
        let dtype = match dtype {
            0 => Dtype::Bf16,
            1 => Dtype::F32,
            other => return Err(format!("the shim answered dtype {other}")),
        };
        Ok(Output { address, dtype })
    }

    /// `teardown(handle)`, when the module defines it.
    pub fn teardown(&self) -> Result<(), String> {
        let gil = self.python.gil();
        self.call(&gil, "teardown", |_| Ok(Vec::new())).map(drop)
    }

    fn capsule<'g>(&self, gil: &'g Gil<'static>, address: u64, shape: &[usize]) -> Result<Object<'g, 'static>, String> {
        gil.capsule(dlpack::bf16_tensor(address, shape, self.ordinal)?, DLTENSOR)
    }
}
