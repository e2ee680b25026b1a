//! A Hugging Face checkpoint directory: `config.json` read into the model's shape, every field the
//! loader does not implement refused with a sentence that names it; and the weights, from
//! `model.safetensors` or the shards `model.safetensors.index.json` names, into host buffers in bf16
//! (f32 and f16 tensors rounded to nearest even once, on load; quantised weights dequantised,
//! `quantized`).
//!
//! Supported: `model_type` "llama" (Llama 2 and 3, TinyLlama, SmolLM2 and the like) and "qwen3" (its
//! per-head q/k RMSNorm), RoPE without scaling or with Llama 3.1's "llama3", SiLU, no biases, tied or
//! separate embeddings; docs/model.md has the whole table of what is read and what is refused.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use reference::golden::{self, RopeTable, Weights};
use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;
use spec::Config;
use spec::data::{LayerWeights, Tensor};

use super::quantized::Coded;
use super::quantized::{Part, Quantization};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {why}")]
    Io { path: PathBuf, why: String },
    #[error("config.json: field '{field}': {why}")]
    Unsupported { field: &'static str, why: String },
    #[error("{path}: tensor '{name}': {why}")]
    Tensor { path: PathBuf, name: String, why: String },
}

/// The fields of `config.json` the loader reads; any other is ignored unless it changes the
/// computation, in which case it is listed here so that it can be refused.
#[derive(Debug, Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    rms_norm_eps: f64,
    rope_theta: Option<f64>,
    rope_scaling: Option<serde_json::Value>,
    /// transformers 5's name for `rope_theta` and `rope_scaling` together.
    rope_parameters: Option<serde_json::Value>,
    hidden_act: Option<String>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    tie_word_embeddings: Option<bool>,
    max_position_embeddings: Option<usize>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<serde_json::Value>,
    use_sliding_window: Option<bool>,
    quantization_config: Option<serde_json::Value>,
}

/// A checkpoint's shape: one decoder layer's (`layer`, with `layers` of them) and the vocabulary.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// The decoder layer's shape, `layers` deep; `max_seq_len` the context the model was trained for.
    pub layer: Config,
    pub vocab: usize,
    /// The LM head is the embedding (`tie_word_embeddings`).
    pub tied: bool,
    pub bos: Option<u32>,
    /// The end-of-sequence tokens (one or several).
    pub eos: Vec<u32>,
    pub rope: RopeScaling,
    /// Qwen3's per-head RMSNorm of the queries and keys before RoPE (`golden::QkNorm`).
    pub qk_norm: bool,
    /// How its weights are quantised (`quantization_config`), which a folder's tensors give; None
    /// where they are not.
    pub quantized: Option<Quantization>,
}

/// How the model scales RoPE's frequencies (`theta^(-2i / hd)`, the layer's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    None,
    /// Llama 3.1's (`"rope_type": "llama3"`): frequencies whose wavelength is over
    /// `original_context / low_freq_factor` are divided by `factor`, those under `original_context /
    /// high_freq_factor` kept, those between interpolated.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_context: f64,
    },
}

impl ModelConfig {
    /// RoPE's frequencies, scaled as the checkpoint says (in f64, as transformers' formula reads).
    pub fn inv_freq(&self) -> Vec<f64> {
        let plain = golden::inv_freq(&self.layer);
        let RopeScaling::Llama3 { factor, low_freq_factor: low, high_freq_factor: high, original_context: ctx } =
            self.rope
        else {
            return plain;
        };
        plain
            .into_iter()
            .map(|f| {
                let wavelen = 2.0 * std::f64::consts::PI / f;
                if wavelen < ctx / high {
                    f
                } else if wavelen > ctx / low {
                    f / factor
                } else {
                    let smooth = (ctx / wavelen - low) / (high - low);
                    (1.0 - smooth) * f / factor + smooth * f
                }
            })
            .collect()
    }

    /// RoPE's cos and sin for `positions` positions, with the model's frequencies.
    pub fn rope_table(&self, positions: usize) -> RopeTable {
        RopeTable::from_inv_freq(positions, &self.inv_freq())
    }
}

/// The RoPE fields of `config.json`: `rope_scaling` (with `rope_theta` beside it) or transformers 5's
/// `rope_parameters` (holding both); the base and the scaling, or why they are refused.
fn rope_of(raw: &RawConfig) -> Result<(f64, RopeScaling), ModelError> {
    let params = raw.rope_parameters.as_ref().filter(|v| !v.is_null());
    let field = if params.is_some() { "rope_parameters" } else { "rope_scaling" };
    let theta = params
        .and_then(|p| p.get("rope_theta"))
        .and_then(|v| v.as_f64())
        .or(raw.rope_theta)
        .unwrap_or(DEFAULT_ROPE_THETA);
    let Some(scaling) = params.or(raw.rope_scaling.as_ref().filter(|v| !v.is_null())) else {
        return Ok((theta, RopeScaling::None));
    };
    let kind = scaling.get("rope_type").or_else(|| scaling.get("type")).and_then(|v| v.as_str()).unwrap_or("default");
    match kind {
        "default" => Ok((theta, RopeScaling::None)),
        "llama3" => {
            let number = |name: &str| {
                scaling
                    .get(name)
                    .and_then(|v| v.as_f64())
                    .filter(|v| v.is_finite() && *v > 0.0)
                    .ok_or_else(|| unsupported(field, format!("llama3 scaling needs a positive '{name}'")))
            };
            let (low, high) = (number("low_freq_factor")?, number("high_freq_factor")?);
            if high <= low {
                return Err(unsupported(field, "llama3 scaling needs high_freq_factor above low_freq_factor"));
            }
            Ok((
                theta,
                RopeScaling::Llama3 {
                    factor: number("factor")?,
                    low_freq_factor: low,
                    high_freq_factor: high,
                    original_context: number("original_max_position_embeddings")?,
                },
            ))
        }
        other => Err(unsupported(field, format!("'{other}' scaling is not built (none and 'llama3' are)"))),
    }
}

/// Llama's default RoPE base, where `config.json` gives none.
const DEFAULT_ROPE_THETA: f64 = 10_000.0;
/// Llama's default context, where `config.json` gives none.
const DEFAULT_CONTEXT: usize = 2048;

fn unsupported(field: &'static str, why: impl Into<String>) -> ModelError {
    ModelError::Unsupported { field, why: why.into() }
}

impl ModelConfig {
    /// Reads `dir/config.json`.
    pub fn read(dir: &Path) -> Result<ModelConfig, ModelError> {
        let path = dir.join("config.json");
        let text =
            std::fs::read_to_string(&path).map_err(|e| ModelError::Io { path: path.clone(), why: e.to_string() })?;
        Self::parse(&dir_name(dir), &path, &text)
    }

    /// The model `name` from the text of a `config.json` (a loaded model's configuration, written as
    /// `save_pretrained` writes it); `origin` is what a syntax error names.
    pub fn parse(name: &str, origin: &Path, text: &str) -> Result<ModelConfig, ModelError> {
        let raw: RawConfig = serde_json::from_str(text)
            .map_err(|e| ModelError::Io { path: origin.to_path_buf(), why: e.to_string() })?;
        Self::from_raw(name, raw)
    }

    fn from_raw(name: &str, raw: RawConfig) -> Result<ModelConfig, ModelError> {
        let qk_norm = match raw.model_type.as_deref() {
            Some("llama") => false,
            Some("qwen3") => true,
            Some(other) => {
                return Err(unsupported(
                    "model_type",
                    format!("'{other}': the loader reads Llama-family checkpoints ('llama', 'qwen3')"),
                ));
            }
            None => {
                return Err(unsupported(
                    "model_type",
                    "missing: the loader reads Llama-family checkpoints ('llama', 'qwen3')",
                ));
            }
        };
        if raw.use_sliding_window == Some(true) {
            return Err(unsupported("use_sliding_window", "true: every layer attends over the whole cache"));
        }
        let quantized = match &raw.quantization_config {
            None | Some(serde_json::Value::Null) => None,
            Some(q) => Some(Quantization::of(q).map_err(|why| unsupported("quantization_config", why))?),
        };
        let (theta, rope) = rope_of(&raw)?;
        if let Some(act) = raw.hidden_act.as_deref().filter(|&a| a != "silu") {
            return Err(unsupported("hidden_act", format!("'{act}': the layer's MLP is SwiGLU (silu)")));
        }
        for (field, on) in [("attention_bias", raw.attention_bias), ("mlp_bias", raw.mlp_bias)] {
            if on == Some(true) {
                return Err(unsupported(field, "true: the layer's projections have no bias"));
            }
        }
        let n_q = raw.num_attention_heads;
        let n_kv = raw.num_key_value_heads.unwrap_or(n_q);
        if n_q == 0 || n_kv == 0 || !n_q.is_multiple_of(n_kv) {
            return Err(unsupported(
                "num_key_value_heads",
                format!("{n_kv} does not divide num_attention_heads = {n_q}"),
            ));
        }
        let hd = raw.head_dim.unwrap_or(raw.hidden_size / n_q);
        if hd == 0 || !hd.is_multiple_of(2) {
            return Err(unsupported("head_dim", format!("{hd}: RoPE rotates pairs, so it must be even and positive")));
        }
        let eos = match raw.eos_token_id {
            None | Some(serde_json::Value::Null) => Vec::new(),
            Some(v) => serde_json::from_value::<TokenIds>(v)
                .map_err(|e| unsupported("eos_token_id", format!("not a token id or a list of them: {e}")))?
                .into_vec(),
        };
        let context = raw.max_position_embeddings.unwrap_or(DEFAULT_CONTEXT);
        let layer = Config {
            name: name.to_string(),
            layers: raw.num_hidden_layers,
            d: raw.hidden_size,
            ffn: raw.intermediate_size,
            n_q,
            n_kv,
            hd,
            eps: raw.rms_norm_eps as f32,
            theta,
            max_seq_len: context,
            ..Config::tiny()
        };
        Ok(ModelConfig {
            layer,
            vocab: raw.vocab_size,
            tied: raw.tie_word_embeddings.unwrap_or(false),
            bos: raw.bos_token_id,
            eos,
            rope,
            qk_norm,
            quantized,
        })
    }
}

/// `eos_token_id`: one id or a list.
#[derive(Deserialize)]
#[serde(untagged)]
enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    fn into_vec(self) -> Vec<u32> {
        match self {
            TokenIds::One(id) => vec![id],
            TokenIds::Many(ids) => ids,
        }
    }
}

fn dir_name(dir: &Path) -> String {
    dir.file_name().map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into_owned())
}

/// A checkpoint's weights on the host, bf16, row-major as Hugging Face stores them (`(out, in)`,
/// applied as `h @ W.T`).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelWeights {
    /// `(vocab, d)`.
    pub embed: Vec<bf16>,
    pub layers: Vec<Weights>,
    /// `(d)`: the final RMSNorm.
    pub norm: Vec<bf16>,
    /// `(vocab, d)`; `None` when tied to the embedding.
    pub lm_head: Option<Vec<bf16>>,
    /// Each layer's q and k norm weights (`hd` each) when the model has them (`ModelConfig::qk_norm`),
    /// else empty.
    pub qk_norms: Vec<[Vec<bf16>; 2]>,
    /// A quantised checkpoint's layers as stored: each weight's codes and scales where it was quantised
    /// (the norms never are), beside its bf16 in `layers` (the model kernel may stream them:
    /// `model::code_stream`); empty for any other checkpoint.
    pub coded: Vec<LayerWeights<Option<Coded>>>,
}

impl ModelWeights {
    /// The LM head's rows: its own, or the embedding's.
    pub fn head(&self) -> &[bf16] {
        self.lm_head.as_deref().unwrap_or(&self.embed)
    }

    /// Reads every tensor of `cfg`'s model from `dir`'s safetensors files, each checked for its name
    /// and shape.
    pub fn read(dir: &Path, cfg: &ModelConfig) -> Result<ModelWeights, ModelError> {
        let (mut got, mut coded) = read_tensors(dir, &wanted(cfg), cfg.quantized)?;
        let mut weights = Self::from_tensors(cfg, |name, _| {
            Ok(got.remove(name).expect("read_tensors returns every tensor asked for"))
        })?;
        if !coded.is_empty() {
            weights.coded = layer_weights(&cfg.layer, |name| coded.remove(name));
        }
        Ok(weights)
    }

    /// `cfg`'s model from `fetch`, which gives each tensor by its Hugging Face name in bf16 and is
    /// told the shape it must have (the folder's loader above, or a loaded model's tensors).
    pub fn from_tensors(
        cfg: &ModelConfig,
        mut fetch: impl FnMut(&str, &[usize]) -> Result<Vec<bf16>, ModelError>,
    ) -> Result<ModelWeights, ModelError> {
        let l = &cfg.layer;
        let mut got = HashMap::new();
        for (name, shape) in wanted(cfg) {
            let values = fetch(&name, &shape)?;
            got.insert(name, values);
        }
        let mut take = |name: &str| got.remove(name).expect("every tensor wanted was fetched");
        let embed = take("model.embed_tokens.weight");
        let layers = layer_weights(l, &mut take);
        let qk_norms =
            if cfg.qk_norm { (0..l.layers).map(|i| qk_names(i).map(|n| take(&n))).collect() } else { Vec::new() };
        let norm = take("model.norm.weight");
        let lm_head = (!cfg.tied).then(|| take("lm_head.weight"));
        Ok(ModelWeights { embed, layers, norm, lm_head, qk_norms, coded: Vec::new() })
    }
}

/// Every layer's weights of a model of `l`'s layers, each from `take` given its Hugging Face name.
fn layer_weights<T>(l: &Config, mut take: impl FnMut(&str) -> T) -> Vec<LayerWeights<T>> {
    (0..l.layers)
        .map(|i| {
            LayerWeights::try_from_fn(|t| {
                Ok::<_, std::convert::Infallible>(take(&format!("model.layers.{i}.{}", layer_tensor(t, l).0)))
            })
            .unwrap_or_else(|e| match e {})
        })
        .collect()
}

/// Every tensor `cfg`'s model reads, by its Hugging Face name, with its shape.
fn wanted(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let l = &cfg.layer;
    let (d, vocab) = (l.d, cfg.vocab);
    let mut wanted = vec![("model.embed_tokens.weight".to_string(), vec![vocab, d])];
    for i in 0..l.layers {
        for &t in Tensor::WEIGHTS {
            let (name, shape) = layer_tensor(t, l);
            wanted.push((format!("model.layers.{i}.{name}"), shape));
        }
    }
    if cfg.qk_norm {
        wanted.extend((0..l.layers).flat_map(qk_names).map(|name| (name, vec![l.hd])));
    }
    wanted.push(("model.norm.weight".to_string(), vec![d]));
    if !cfg.tied {
        wanted.push(("lm_head.weight".to_string(), vec![vocab, d]));
    }
    wanted
}

/// Qwen3's q and k norms of layer `i`.
fn qk_names(i: usize) -> [String; 2] {
    ["q_norm", "k_norm"].map(|n| format!("model.layers.{i}.self_attn.{n}.weight"))
}

/// The element types a tensor may come in; each is read into bf16.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Element {
    Bf16,
    F16,
    F32,
}

impl Element {
    pub fn bytes(self) -> usize {
        match self {
            Element::Bf16 | Element::F16 => 2,
            Element::F32 => 4,
        }
    }

    /// Little-endian `data` of this type in bf16: f32 and f16 rounded to nearest even once.
    pub fn to_bf16(self, data: &[u8]) -> Vec<bf16> {
        let words = |n: usize| data.chunks_exact(n);
        match self {
            Element::Bf16 => words(2).map(|b| bf16::from_le_bytes([b[0], b[1]])).collect(),
            Element::F16 => words(2).map(|b| bf16::from_f32(f16::from_le_bytes([b[0], b[1]]).to_f32())).collect(),
            Element::F32 => words(4).map(|b| bf16::from_f32(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))).collect(),
        }
    }
}

/// The Hugging Face name (below `model.layers.{i}.`) and shape of a layer's weight.
fn layer_tensor(t: Tensor, cfg: &Config) -> (&'static str, Vec<usize>) {
    let (q, kv) = (cfg.n_q * cfg.hd, cfg.n_kv * cfg.hd);
    match t {
        Tensor::InNorm => ("input_layernorm.weight", vec![cfg.d]),
        Tensor::PostNorm => ("post_attention_layernorm.weight", vec![cfg.d]),
        Tensor::Wq => ("self_attn.q_proj.weight", vec![q, cfg.d]),
        Tensor::Wk => ("self_attn.k_proj.weight", vec![kv, cfg.d]),
        Tensor::Wv => ("self_attn.v_proj.weight", vec![kv, cfg.d]),
        Tensor::Wo => ("self_attn.o_proj.weight", vec![cfg.d, q]),
        Tensor::Wgate => ("mlp.gate_proj.weight", vec![cfg.ffn, cfg.d]),
        Tensor::Wup => ("mlp.up_proj.weight", vec![cfg.ffn, cfg.d]),
        Tensor::Wdown => ("mlp.down_proj.weight", vec![cfg.d, cfg.ffn]),
        Tensor::KCache | Tensor::VCache => unreachable!("a cache is not a weight"),
    }
}

/// A safetensors file's header (an 8-byte little-endian length, then that many bytes of JSON: each
/// tensor's dtype, shape and byte range after the header), open at its end.
struct Header {
    file: std::fs::File,
    /// The header's length with its own 8 bytes: where the tensors' bytes start.
    data_start: u64,
    entries: BTreeMap<String, serde_json::Value>,
}

impl Header {
    fn read(path: &Path) -> Result<Header, String> {
        use std::io::Read;
        /// The safetensors format's own bound on the header.
        const MAX_HEADER_BYTES: u64 = 100_000_000;
        let mut file = std::fs::File::open(path).map_err(|e| e.to_string())?;
        let mut len = [0u8; 8];
        file.read_exact(&mut len).map_err(|e| format!("reading the header's length: {e}"))?;
        let len = u64::from_le_bytes(len);
        if len > MAX_HEADER_BYTES {
            return Err(format!("a header of {len} bytes: not a safetensors file"));
        }
        let mut header = vec![0u8; len as usize];
        file.read_exact(&mut header).map_err(|e| format!("reading the header: {e}"))?;
        let mut entries: BTreeMap<String, serde_json::Value> =
            serde_json::from_slice(&header).map_err(|e| format!("the header: {e}"))?;
        entries.remove("__metadata__");
        Ok(Header { file, data_start: 8 + len, entries })
    }

    /// Tensor `name`'s dtype and bytes, read alone; None where the file has no such tensor.
    fn tensor(mut self, name: &str) -> Result<Option<Part>, String> {
        use std::io::{Read, Seek, SeekFrom};
        #[derive(Deserialize)]
        struct Entry {
            dtype: Dtype,
            shape: Vec<usize>,
            data_offsets: [u64; 2],
        }
        let Some(entry) = self.entries.remove(name) else { return Ok(None) };
        let Entry { dtype, shape, data_offsets: [begin, end] } =
            serde_json::from_value(entry).map_err(|e| format!("the header's '{name}': {e}"))?;
        let len = end.checked_sub(begin).ok_or(format!("the header's '{name}': its range ends before it begins"))?;
        let mut data = vec![0u8; len as usize];
        self.file.seek(SeekFrom::Start(self.data_start + begin)).map_err(|e| e.to_string())?;
        self.file.read_exact(&mut data).map_err(|e| format!("reading '{name}': {e}"))?;
        Ok(Some(Part { dtype, shape, data }))
    }
}

/// The names of the tensors in a safetensors file, from its header alone, so that finding which file
/// holds what reads no weights.
fn tensor_names(path: &Path) -> Result<Vec<String>, ModelError> {
    let header = Header::read(path).map_err(|why| ModelError::Io { path: path.to_path_buf(), why })?;
    Ok(header.entries.into_keys().collect())
}

/// Which file of `dir` holds each tensor: `model.safetensors.index.json`'s weight map, or else every
/// `*.safetensors` file's own names.
fn tensor_files(dir: &Path) -> Result<BTreeMap<String, PathBuf>, ModelError> {
    let io = |path: &Path, e: &dyn std::fmt::Display| ModelError::Io { path: path.to_path_buf(), why: e.to_string() };
    let index_path = dir.join("model.safetensors.index.json");
    let mut index = BTreeMap::new();
    if index_path.exists() {
        let text = std::fs::read_to_string(&index_path).map_err(|e| io(&index_path, &e))?;
        let doc: serde_json::Value = serde_json::from_str(&text).map_err(|e| io(&index_path, &e))?;
        let map = doc.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| io(&index_path, &"no weight_map"))?;
        for (name, file) in map {
            let file = file.as_str().ok_or_else(|| io(&index_path, &format!("'{name}' names no file")))?;
            index.insert(name.clone(), dir.join(file));
        }
        return Ok(index);
    }
    let entries = std::fs::read_dir(dir).map_err(|e| io(dir, &e))?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(io(dir, &"no *.safetensors file and no model.safetensors.index.json"));
    }
    for path in files {
        for name in tensor_names(&path)? {
            index.insert(name, path.clone());
        }
    }
    Ok(index)
}

/// A quantised checkpoint's matrices as stored, by name.
type CodedByName = HashMap<String, Coded>;

/// The tensors `wanted` (name and shape), in bf16, by name: each file read once, each tensor checked
/// for its shape and converted (f32 and f16 rounded to nearest even once; a weight stored in the
/// type of the checkpoint's quantisation, `quantized`, dequantised); and each quantised matrix's codes
/// and scales, by name.
fn read_tensors(
    dir: &Path,
    wanted: &[(String, Vec<usize>)],
    quantized: Option<Quantization>,
) -> Result<(HashMap<String, Vec<bf16>>, CodedByName), ModelError> {
    let files = tensor_files(dir)?;
    let mut by_file: BTreeMap<&PathBuf, Vec<&(String, Vec<usize>)>> = BTreeMap::new();
    for w in wanted {
        let path = files.get(&w.0).ok_or_else(|| ModelError::Tensor {
            path: dir.to_path_buf(),
            name: w.0.clone(),
            why: "missing".into(),
        })?;
        by_file.entry(path).or_default().push(w);
    }
    let (mut got, mut coded) = (HashMap::with_capacity(wanted.len()), HashMap::new());
    for (path, tensors) in by_file {
        let bytes = std::fs::read(path).map_err(|e| ModelError::Io { path: path.clone(), why: e.to_string() })?;
        let file =
            SafeTensors::deserialize(&bytes).map_err(|e| ModelError::Io { path: path.clone(), why: e.to_string() })?;
        for (name, shape) in tensors {
            let bad = |why: String| ModelError::Tensor { path: path.clone(), name: name.clone(), why };
            let view = file.tensor(name).map_err(|e| bad(e.to_string()))?;
            // nf4's codes are stored packed, in a shape of their own: its state names the weight's.
            if view.dtype() != Dtype::U8 && view.shape() != shape.as_slice() {
                return Err(bad(format!("shape {:?}, expected {shape:?}", view.shape())));
            }
            let element = match view.dtype() {
                Dtype::BF16 => Element::Bf16,
                Dtype::F16 => Element::F16,
                Dtype::F32 => Element::F32,
                stored => {
                    let q = quantized.filter(|q| q.stored() == stored).ok_or_else(|| {
                        bad(match quantized {
                            None => format!("dtype {stored:?}, but config.json names no quantisation"),
                            Some(q) => format!("dtype {stored:?}: {} stores its weights in {:?}", q.name(), q.stored()),
                        })
                    })?;
                    let part = |other: &str| quantization_part(&files, &file, path, other);
                    let (values, stored) = q.dequantize(name, shape, view.data(), part).map_err(bad)?;
                    got.insert(name.clone(), values);
                    if let Some(m) = stored {
                        coded.insert(name.clone(), m);
                    }
                    continue;
                }
            };
            if let Some(why) = quantized.and_then(|q| q.stray_part(name, |part| files.contains_key(part))) {
                return Err(bad(why));
            }
            got.insert(name.clone(), element.to_bf16(view.data()));
        }
    }
    Ok((got, coded))
}

/// Tensor `name` of a quantised weight, or None where the checkpoint has none: from `file` (the
/// weight's own, at `path`), or, read alone, from the file the index names for it (a shard's boundary
/// may fall between a weight and its parts).
fn quantization_part(
    files: &BTreeMap<String, PathBuf>,
    file: &SafeTensors,
    path: &Path,
    name: &str,
) -> Result<Option<Part>, String> {
    let part = |view: safetensors::tensor::TensorView| Part {
        dtype: view.dtype(),
        shape: view.shape().to_vec(),
        data: view.data().to_vec(),
    };
    let Some(other) = files.get(name).filter(|&p| p != path) else {
        return Ok(file.tensor(name).ok().map(part));
    };
    Header::read(other).and_then(|h| h.tensor(name)).map_err(|e| format!("{}: {e}", other.display()))
}
