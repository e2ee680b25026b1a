//! Quantised checkpoints the loader reads: what `config.json`'s `quantization_config` names
//! (`Quantization`), and each quantised weight dequantised to bf16 as it is read, bit for bit as the
//! library that wrote it dequantises it: bitsandbytes' nf4 (`nf4`), and transformers' fine-grained fp8
//! (`fp8`). Any other method, or a variant of these the loader does not compute, is refused with a
//! sentence that names it. A quantised matrix keeps its codes too (`Coded`), which the model kernel
//! streams where its rows are wide (`model::code_stream`; docs/model.md).

pub mod fp8;
pub mod nf4;

use half::bf16;
use safetensors::Dtype;

/// How a checkpoint's weights are quantised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quantization {
    /// bitsandbytes nf4: a quantised weight is stored as uint8 codes beside its parts (`nf4`).
    Nf4,
    /// transformers' `FineGrainedFP8Config` (`quant_method` "fp8", as Qwen3's and DeepSeek's FP8
    /// checkpoints are saved): a quantised weight is stored in e4m3 with one scale a block of
    /// `block` (rows, columns), or one for the whole weight where the config names no block (`fp8`).
    Fp8 { block: Option<[usize; 2]> },
}

/// A quantised matrix's codes and scales as its checkpoint stores them, kept beside its bf16 weights
/// for the model kernel's code stream (`model::code_stream`).
#[derive(Debug, Clone, PartialEq)]
pub enum Coded {
    Fp8(fp8::Fp8Matrix),
    Nf4(nf4::Nf4Matrix),
}

/// A tensor of a quantised weight, as its file holds it.
pub struct Part {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

/// What the loader says it reads, in every refusal of a quantisation.
const TAKES: &str = "the loader reads bitsandbytes nf4 (load_in_4bit, bnb_4bit_quant_type 'nf4') and fp8 e4m3 \
                     (quant_method 'fp8', dynamic activations) besides bf16, f16 and f32";

impl Quantization {
    /// The quantisation `quantization_config` names, or why the loader does not read it.
    pub fn of(q: &serde_json::Value) -> Result<Quantization, String> {
        let field = |name: &str| {
            q.get(name).and_then(|v| v.as_str().map(str::to_string).or_else(|| v.as_bool().map(|b| b.to_string())))
        };
        match field("quant_method").as_deref() {
            Some("bitsandbytes") => nf4_of(&field).map(|()| Quantization::Nf4),
            Some("fp8") => fp8_of(q, &field).map(|block| Quantization::Fp8 { block }),
            Some(other) => Err(format!("quant_method '{other}': {TAKES}")),
            None => Err(format!("no quant_method: {TAKES}")),
        }
    }

    /// The quantisation in words.
    pub fn name(self) -> &'static str {
        match self {
            Quantization::Nf4 => "bitsandbytes nf4",
            Quantization::Fp8 { .. } => "fine-grained fp8",
        }
    }

    /// The stored type of a weight quantised this way.
    pub fn stored(self) -> Dtype {
        match self {
            Quantization::Nf4 => Dtype::U8,
            Quantization::Fp8 { .. } => Dtype::F8_E4M3,
        }
    }

    /// Why weight `name`, stored unquantised, cannot be read as stored: a part of a quantised weight
    /// beside it (`exists` says whether the checkpoint has a tensor), which would say it is scaled.
    /// transformers 5.25 leaves an fp8 weight its block does not divide in bf16 and saves an
    /// uninitialised scale beside it, which its own loader then multiplies in.
    pub fn stray_part(self, name: &str, exists: impl Fn(&str) -> bool) -> Option<String> {
        let Quantization::Fp8 { .. } = self else { return None };
        let scale = fp8::scale_name(name);
        exists(&scale).then(|| {
            format!(
                "stored unquantised beside a '{scale}', which would scale it (transformers saves one, \
                 uninitialised, for a weight its block does not divide): quantise with a block that divides \
                 every weight"
            )
        })
    }

    /// Weight `name` of `shape`, stored as `data` in this quantisation's type, in bf16, and where it is a
    /// matrix its codes and scales too (which the model kernel can stream as they are); `part(name)`
    /// gives any other tensor of the checkpoint by its name, or None where it has none.
    pub fn dequantize(
        self,
        name: &str,
        shape: &[usize],
        data: &[u8],
        mut part: impl FnMut(&str) -> Result<Option<Part>, String>,
    ) -> Result<(Vec<bf16>, Option<Coded>), String> {
        match self {
            Quantization::Nf4 => nf4::dequantize(shape, data, |suffix| part(&format!("{name}.{suffix}")))
                .map(|(w, m)| (w, m.map(Coded::Nf4))),
            Quantization::Fp8 { block } => fp8::dequantize(shape, data, block, part(&fp8::scale_name(name))?)
                .map(|(w, m)| (w, Some(Coded::Fp8(m)))),
        }
    }
}

/// bitsandbytes' config: the loader reads its 4-bit nf4 with the codes stored as uint8.
fn nf4_of(field: &impl Fn(&str) -> Option<String>) -> Result<(), String> {
    if field("load_in_8bit").as_deref() == Some("true") {
        return Err(format!("load_in_8bit (LLM.int8): {TAKES}"));
    }
    if field("load_in_4bit").as_deref() != Some("true") {
        return Err(format!("bitsandbytes without load_in_4bit: {TAKES}"));
    }
    match field("bnb_4bit_quant_type").as_deref() {
        Some("nf4") => {}
        other => {
            let named = other.map_or("missing".into(), |t| format!("'{t}'"));
            return Err(format!("bnb_4bit_quant_type {named}: {TAKES}"));
        }
    }
    match field("bnb_4bit_quant_storage").as_deref() {
        None | Some("uint8") => Ok(()),
        Some(other) => Err(format!("bnb_4bit_quant_storage '{other}' (it reads the codes stored as uint8): {TAKES}")),
    }
}

/// The fp8 config: e4m3 weights (`fmt`, where given), activations quantised dynamically (a static
/// scheme stores activation scales, which a loader that keeps activations in bf16 would ignore), and
/// the block the scales cover (`weight_block_size`: two positive sizes, or none for a scale a weight).
fn fp8_of(q: &serde_json::Value, field: &impl Fn(&str) -> Option<String>) -> Result<Option<[usize; 2]>, String> {
    if let Some(fmt) = field("fmt").filter(|f| f != "e4m3") {
        return Err(format!("fp8 fmt '{fmt}': {TAKES}"));
    }
    if let Some(scheme) = field("activation_scheme").filter(|s| s != "dynamic") {
        let why = "its activation scales would go unused: activations stay bf16 here";
        return Err(format!("fp8 activation_scheme '{scheme}' ({why}): {TAKES}"));
    }
    if let Some(fmt) = field("scale_fmt").filter(|f| f != "float" && f != "ue8m0") {
        return Err(format!("fp8 scale_fmt '{fmt}' (it reads 'float' and 'ue8m0'): {TAKES}"));
    }
    match q.get("weight_block_size") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => match serde_json::from_value::<[usize; 2]>(v.clone()) {
            Ok(block) if block.iter().all(|&b| b > 0) => Ok(Some(block)),
            _ => Err(format!("fp8 weight_block_size {v} (two positive sizes, rows and columns, or none): {TAKES}")),
        },
    }
}
