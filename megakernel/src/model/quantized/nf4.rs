//! bitsandbytes' nf4 weights, as transformers saves a model loaded with `BitsAndBytesConfig(
//! load_in_4bit=True, bnb_4bit_quant_type="nf4")`. A quantised weight `W` is four or six tensors:
//! `W` (uint8: two 4-bit codes a byte over the weight's elements in row-major order, the first in the
//! high nibble), `W.quant_map` (the 16 values a code names), `W.absmax` (each block's scale: f32; or,
//! with double quantisation, uint8 codes into `W.nested_quant_map`, each scaled by its nested block's
//! `W.nested_absmax` and shifted by an offset) and `W.quant_state.bitsandbytes__nf4` (JSON: the type,
//! the block sizes, the shape, the dtype and the offset). Element i is `quant_map[code i] *
//! absmax[i / blocksize]`, in f32 and rounded once to the weight's dtype, as bitsandbytes computes it:
//! bit for bit (the tests hold the loader to bitsandbytes' own dequantisation of a saved checkpoint).

use half::{bf16, f16};
use safetensors::Dtype;
use serde::Deserialize;

use super::Part;

/// The suffix of the tensor that holds a quantised weight's JSON state.
pub const STATE: &str = "quant_state.bitsandbytes__nf4";

/// The JSON state bitsandbytes writes beside each quantised weight.
#[derive(Deserialize)]
struct State {
    quant_type: String,
    blocksize: usize,
    dtype: String,
    shape: Vec<usize>,
    nested_blocksize: Option<usize>,
    nested_offset: Option<f64>,
}

/// A matrix of nf4 codes as its checkpoint stores it, kept beside its bf16 weights for the model
/// kernel's nf4 stream (`model::code_stream`): `rows x cols` codes, two a byte over the elements in
/// row-major order (the first in the high nibble), each block of `blocksize` elements' absmax in f32
/// (double quantisation resolved as bitsandbytes resolves it), and the 16 values a code names.
#[derive(Debug, Clone, PartialEq)]
pub struct Nf4Matrix {
    pub rows: usize,
    pub cols: usize,
    pub codes: Vec<u8>,
    pub blocksize: usize,
    pub absmax: Vec<f32>,
    pub quant_map: Vec<f32>,
}

impl Nf4Matrix {
    /// Element i's code.
    pub fn code(&self, i: usize) -> u8 {
        let byte = self.codes[i / 2];
        if i.is_multiple_of(2) { byte >> 4 } else { byte & 0xF }
    }

    /// Element i's scale: its block's absmax.
    pub fn scale(&self, i: usize) -> f32 {
        self.absmax[i / self.blocksize]
    }

    /// Every element in bf16, as the loader reads a weight saved from bf16 (`weights`).
    pub fn dequantize(&self) -> Vec<bf16> {
        weights(self, bf16::from_f32)
    }
}

/// The weight of `shape` whose packed codes are `packed`, from its other tensors (`part(suffix)`: the
/// tensor named the weight's name, a dot and the suffix, or None where the checkpoint has none), in
/// bf16: its dtype's rounding of each element, then bf16's (the same bits where the dtype is bf16);
/// and where it is a matrix, its codes as stored (`Nf4Matrix`).
pub fn dequantize(
    shape: &[usize],
    packed: &[u8],
    mut part: impl FnMut(&str) -> Result<Option<Part>, String>,
) -> Result<(Vec<bf16>, Option<Nf4Matrix>), String> {
    let mut need = |suffix: &str| {
        part(suffix)?.ok_or_else(|| format!("uint8 without its '{suffix}': not a bitsandbytes nf4 weight"))
    };
    let state = need(STATE)?;
    let state: State = serde_json::from_slice(&state.data).map_err(|e| format!("its {STATE}: {e}"))?;
    if state.quant_type != "nf4" {
        return Err(format!("bitsandbytes '{}': the loader reads nf4", state.quant_type));
    }
    if state.shape != shape {
        return Err(format!("quantised as shape {:?}, expected {shape:?}", state.shape));
    }
    let elements: usize = shape.iter().product();
    if packed.len() * 2 != elements {
        return Err(format!("{} bytes of codes for {elements} elements", packed.len()));
    }
    if state.blocksize == 0 {
        return Err("a block size of 0".into());
    }
    let round = rounding(&state.dtype)?;
    let quant_map = floats(&need("quant_map")?, 16, "quant_map")?;
    let blocks = elements.div_ceil(state.blocksize);
    let absmax = need("absmax")?;
    let absmax = match absmax.dtype {
        Dtype::F32 => floats(&absmax, blocks, "absmax")?,
        Dtype::U8 => nested(&absmax.data, blocks, &state, &mut need)?,
        other => return Err(format!("absmax in {other:?}: bitsandbytes writes f32, or uint8 codes")),
    };
    // Any other shape as one row: its weights, but no matrix to stream.
    let (rows, cols) = match *shape {
        [rows, cols] => (rows, cols),
        _ => (1, elements),
    };
    let m = Nf4Matrix { rows, cols, codes: packed.to_vec(), blocksize: state.blocksize, absmax, quant_map };
    Ok((weights(&m, round), (shape.len() == 2).then_some(m)))
}

/// Every element of `m` in bf16 as `round` makes its f32 product: `quant_map[code] * absmax`, the
/// elements shared among the machine's threads (an 8B checkpoint has 7e9).
fn weights(m: &Nf4Matrix, round: fn(f32) -> bf16) -> Vec<bf16> {
    let mut out = vec![bf16::ZERO; m.rows * m.cols];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let each = out.len().div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        for (k, chunk) in out.chunks_mut(each).enumerate() {
            scope.spawn(move || {
                for (j, w) in chunk.iter_mut().enumerate() {
                    let i = k * each + j;
                    *w = round(m.quant_map[m.code(i) as usize] * m.scale(i));
                }
            });
        }
    });
    out
}

/// Double quantisation: each block's scale from its uint8 code, `nested_quant_map[code] *
/// nested_absmax[block / nested_blocksize] + offset`, in f32 as bitsandbytes computes it.
fn nested(
    codes: &[u8],
    blocks: usize,
    state: &State,
    need: &mut impl FnMut(&str) -> Result<Part, String>,
) -> Result<Vec<f32>, String> {
    if codes.len() != blocks {
        return Err(format!("{} absmax codes for {blocks} blocks", codes.len()));
    }
    let (Some(size), Some(offset)) = (state.nested_blocksize.filter(|&s| s > 0), state.nested_offset) else {
        return Err(format!("uint8 absmax, but its {STATE} names no nested block size and offset"));
    };
    let map = floats(&need("nested_quant_map")?, 256, "nested_quant_map")?;
    let scales = floats(&need("nested_absmax")?, blocks.div_ceil(size), "nested_absmax")?;
    // The offset is an f32 that the JSON holds as a decimal: it reads back to the same f32.
    let offset = offset as f32;
    Ok(codes.iter().enumerate().map(|(k, &c)| map[c as usize] * scales[k / size] + offset).collect())
}

/// A tensor of `len` f32.
fn floats(part: &Part, len: usize, what: &str) -> Result<Vec<f32>, String> {
    if part.dtype != Dtype::F32 {
        return Err(format!("{what} in {:?}: bitsandbytes writes f32", part.dtype));
    }
    let values: Vec<f32> = part.data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    if values.len() != len {
        return Err(format!("{what} holds {} values, expected {len}", values.len()));
    }
    Ok(values)
}

/// How an element computed in f32 becomes the weight's dtype, then bf16.
fn rounding(dtype: &str) -> Result<fn(f32) -> bf16, String> {
    match dtype {
        "bfloat16" | "float32" => Ok(bf16::from_f32),
        "float16" => Ok(|v| bf16::from_f32(f16::from_f32(v).to_f32())),
        other => Err(format!("dequantised to '{other}': the loader takes bfloat16, float16 and float32")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(v: &[f32]) -> Part {
        Part { dtype: Dtype::F32, shape: vec![v.len()], data: v.iter().flat_map(|x| x.to_le_bytes()).collect() }
    }

    fn state(json: serde_json::Value) -> Part {
        let data = json.to_string().into_bytes();
        Part { dtype: Dtype::U8, shape: vec![data.len()], data }
    }

    /// A weight's parts by suffix, as the loader hands them over.
    fn parts(list: Vec<(&'static str, Part)>) -> impl FnMut(&str) -> Result<Option<Part>, String> {
        let mut list: std::collections::HashMap<&str, Part> = list.into_iter().collect();
        move |suffix| Ok(list.remove(suffix))
    }

    /// Code k names k - 8 (exact in f32, so each product is exact and its rounding to bf16 shows).
    fn map() -> Vec<f32> {
        (0..16).map(|k| k as f32 - 8.0).collect()
    }

    #[test]
    fn each_code_is_its_bytes_nibble_high_first_scaled_by_its_blocks_absmax() {
        // 2 x 4 elements in blocks of 3: codes 0x1F, 0x2E, 0x3D, 0x4C over elements 0..8.
        let packed = [0x1F, 0x2E, 0x3D, 0x4C];
        let st = state(serde_json::json!({"quant_type": "nf4", "blocksize": 3, "dtype": "bfloat16", "shape": [2, 4]}));
        let got = dequantize(
            &[2, 4],
            &packed,
            parts(vec![(STATE, st), ("quant_map", f32s(&map())), ("absmax", f32s(&[1.0, 0.5, 3.0]))]),
        )
        .unwrap()
        .0;
        let codes = [1, 15, 2, 14, 3, 13, 4, 12];
        let scale = [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 3.0, 3.0];
        let want: Vec<bf16> = codes.iter().zip(scale).map(|(&c, s)| bf16::from_f32((c as f32 - 8.0) * s)).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn double_quantised_scales_are_their_codes_values_scaled_per_nested_block_and_shifted() {
        let nested_map: Vec<f32> = (0..256).map(|k| k as f32 / 128.0).collect();
        let st = state(serde_json::json!({
            "quant_type": "nf4", "blocksize": 2, "dtype": "bfloat16", "shape": [8],
            "nested_blocksize": 3, "nested_offset": 0.25
        }));
        let absmax_codes = Part { dtype: Dtype::U8, shape: vec![4], data: vec![128, 64, 0, 255] };
        let got = dequantize(
            &[8],
            &[0x99; 4],
            parts(vec![
                (STATE, st),
                ("quant_map", f32s(&map())),
                ("absmax", absmax_codes),
                ("nested_quant_map", f32s(&nested_map)),
                ("nested_absmax", f32s(&[2.0, 4.0])),
            ]),
        )
        .unwrap()
        .0;
        // Block k's scale: map[code] * nested_absmax[k / 3] + 0.25; code 9 names 1.0.
        let scales = [1.0 * 2.0 + 0.25, 0.5 * 2.0 + 0.25, 0.25, 255.0 / 128.0 * 4.0 + 0.25];
        let want: Vec<bf16> = (0..8).map(|i| bf16::from_f32(scales[i / 2])).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn a_float16_weight_rounds_to_float16_then_to_bf16() {
        // 1 + 2^-8 + 2^-12: f16 rounds it down to 1 + 2^-8, a tie of bf16's that goes to the even 1;
        // bf16 alone rounds it up to 1 + 2^-7.
        let v = 1.0 + 2f32.powi(-8) + 2f32.powi(-12);
        let st = state(serde_json::json!({"quant_type": "nf4", "blocksize": 2, "dtype": "float16", "shape": [2]}));
        let mut m = map();
        m[9] = v;
        let got =
            dequantize(&[2], &[0x99], parts(vec![(STATE, st), ("quant_map", f32s(&m)), ("absmax", f32s(&[1.0]))]))
                .unwrap()
                .0;
        assert_eq!(got, vec![bf16::from_f32(f16::from_f32(v).to_f32()); 2]);
        assert_ne!(got[0], bf16::from_f32(v));
    }

    #[test]
    fn what_is_not_a_whole_nf4_weight_is_refused_with_what_it_is() {
        let st = |quant: &str, shape: serde_json::Value| {
            state(serde_json::json!({"quant_type": quant, "blocksize": 2, "dtype": "bfloat16", "shape": shape}))
        };
        let refused = |shape: &[usize], packed: &[u8], list: Vec<(&'static str, Part)>| {
            dequantize(shape, packed, parts(list)).unwrap_err()
        };
        let whole = || {
            vec![(STATE, st("nf4", serde_json::json!([4]))), ("quant_map", f32s(&map())), ("absmax", f32s(&[1.0, 1.0]))]
        };
        assert!(refused(&[4], &[0; 2], vec![]).contains(STATE));
        let text = refused(&[4], &[0; 2], vec![(STATE, st("fp4", serde_json::json!([4])))]);
        assert!(text.contains("'fp4'") && text.contains("reads nf4"), "{text}");
        let text = refused(&[2, 2], &[0; 2], whole());
        assert!(text.contains("[4]") && text.contains("[2, 2]"), "{text}");
        let text = refused(&[4], &[0; 3], whole());
        assert!(text.contains("3 bytes of codes for 4 elements"), "{text}");
        let mut no_absmax = whole();
        no_absmax.pop();
        assert!(refused(&[4], &[0; 2], no_absmax).contains("'absmax'"));
        let mut short = whole();
        short[2] = ("absmax", f32s(&[1.0]));
        assert!(refused(&[4], &[0; 2], short).contains("absmax holds 1 values, expected 2"));
        let mut nested = whole();
        nested[2] = ("absmax", Part { dtype: Dtype::U8, shape: vec![2], data: vec![0, 0] });
        assert!(refused(&[4], &[0; 2], nested).contains("no nested block size"));
        let mut f16_map = whole();
        f16_map[1] = ("quant_map", Part { dtype: Dtype::F16, shape: vec![16], data: vec![0; 32] });
        assert!(refused(&[4], &[0; 2], f16_map).contains("quant_map in F16"));
        let text = refused(&[4], &[0; 2], {
            let mut v = whole();
            v[0] =
                (STATE, state(serde_json::json!({"quant_type": "nf4", "blocksize": 2, "dtype": "int8", "shape": [4]})));
            v
        });
        assert!(text.contains("'int8'"), "{text}");
    }
}
