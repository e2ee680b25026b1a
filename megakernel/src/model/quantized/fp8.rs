//! fp8 weights as transformers saves a model quantised with `FineGrainedFP8Config` (`quant_method`
//! "fp8"; Qwen3's and DeepSeek's FP8 checkpoints are stored the same way). A quantised weight `W.weight`
//! of (rows, cols) is stored in e4m3 (`F8_E4M3`: no infinities, one NaN code a sign) beside
//! `W.weight_scale_inv`, the scale of each block of (block rows, block cols): a grid of
//! (ceil(rows / block rows), ceil(cols / block cols)) scales in f32, or with `scale_fmt` "ue8m0" in
//! e8m0 (`F8_E8M0`: the power of two 2^(byte - 127)). Element (r, c) is `e4m3(W[r, c]) *
//! scale[r / block rows][c / block cols]` in f32, rounded once to bf16, as transformers dequantises a
//! checkpoint it loads in bf16: bit for bit (the tests hold the loader to transformers' own
//! dequantisation of a saved checkpoint). A weight transformers left unquantised (a shape its block
//! does not divide, the LM head, the norms) is stored as it was and read as any bf16 tensor.

use half::bf16;
use safetensors::Dtype;

use super::Part;

/// The name of weight `name`'s scales (transformers' rule: `X.weight` has `X.weight_scale_inv`).
pub fn scale_name(name: &str) -> String {
    format!("{name}_scale_inv")
}

/// An fp8 weight as its checkpoint stores it: `rows x cols` e4m3 codes and the scale of each block of
/// `block` (rows, columns), a grid of `(ceil(rows / block rows), ceil(cols / block cols))` in f32 (a
/// whole-weight scale is one block of the weight's shape). Kept beside its bf16 weights for the model
/// kernel's fp8 stream (`model::code_stream`), which streams the codes and scales as they are.
#[derive(Debug, Clone, PartialEq)]
pub struct Fp8Matrix {
    pub rows: usize,
    pub cols: usize,
    pub codes: Vec<u8>,
    pub block: [usize; 2],
    pub scales: Vec<f32>,
}

impl Fp8Matrix {
    /// The weight of `shape` (rows, cols) whose e4m3 codes are `codes`, with its scales (`scales`: None
    /// where the checkpoint has none) over blocks of `block` (the whole weight where None); or why it
    /// is not a weight the loader reads (a NaN code or a scale that is not finite among them).
    pub fn new(
        shape: &[usize],
        codes: &[u8],
        block: Option<[usize; 2]>,
        scales: Option<Part>,
    ) -> Result<Fp8Matrix, String> {
        let &[rows, cols] = shape else {
            return Err(format!("an fp8 weight of shape {shape:?}: the loader reads fp8 matrices"));
        };
        if codes.len() != rows * cols {
            return Err(format!("{} bytes of e4m3 for {} elements", codes.len(), rows * cols));
        }
        let scales = scales.ok_or("F8_E4M3 without its 'weight_scale_inv': not a fine-grained fp8 weight")?;
        let [block_rows, block_cols] = block.unwrap_or([rows, cols]);
        let grid = [rows.div_ceil(block_rows), cols.div_ceil(block_cols)];
        if scales.shape != grid {
            return Err(format!(
                "weight_scale_inv of shape {:?}, expected {grid:?} (blocks of {block_rows} x {block_cols})",
                scales.shape
            ));
        }
        let scale: Vec<f32> = match scales.dtype {
            Dtype::F32 => scales.data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            Dtype::F8_E8M0 => scales.data.iter().map(|&b| e8m0(b)).collect(),
            other => return Err(format!("weight_scale_inv in {other:?}: transformers writes f32, or e8m0 with ue8m0")),
        };
        if scale.len() != grid[0] * grid[1] {
            return Err(format!("weight_scale_inv holds {} values for its shape {grid:?}", scale.len()));
        }
        if let Some(k) = scale.iter().position(|s| !s.is_finite()) {
            return Err(format!("weight_scale_inv's block {:?} is {}", [k / grid[1], k % grid[1]], scale[k]));
        }
        if let Some(i) = codes.iter().position(|&c| e4m3(c).is_none()) {
            return Err(format!("element ({}, {}) is e4m3's NaN (0x{:02X})", i / cols, i % cols, codes[i]));
        }
        Ok(Fp8Matrix { rows, cols, codes: codes.to_vec(), block: [block_rows, block_cols], scales: scale })
    }

    /// The scale of element (r, c): its block's.
    pub fn scale(&self, r: usize, c: usize) -> f32 {
        self.scales[r / self.block[0] * self.cols.div_ceil(self.block[1]) + c / self.block[1]]
    }

    /// Every element in bf16: its code's value times its block's scale in f32, rounded once (`weight`),
    /// rows shared among the machine's threads (an 8B checkpoint's 7e9 weights took a minute on one).
    pub fn dequantize(&self) -> Vec<bf16> {
        let values: Vec<f32> = (0..=255u8).map(|c| e4m3(c).unwrap_or(f32::NAN)).collect();
        let mut out = vec![bf16::ZERO; self.rows * self.cols];
        if out.is_empty() {
            return out;
        }
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let rows_each = self.rows.div_ceil(threads).max(1);
        std::thread::scope(|scope| {
            for (chunk, rows) in out.chunks_mut(rows_each * self.cols).enumerate() {
                let values = &values;
                scope.spawn(move || {
                    for (i, row) in rows.chunks_mut(self.cols).enumerate() {
                        let r = chunk * rows_each + i;
                        let codes = &self.codes[r * self.cols..(r + 1) * self.cols];
                        for (k, (w, c)) in row.chunks_mut(self.block[1]).zip(codes.chunks(self.block[1])).enumerate() {
                            let scale = self.scale(r, k * self.block[1]);
                            w.iter_mut().zip(c).for_each(|(w, &c)| *w = bf16::from_f32(values[c as usize] * scale));
                        }
                    }
                });
            }
        });
        out
    }
}

/// The loader's bf16 weight of code `code` (not e4m3's NaN) in a block of scale `scale`: the value
/// times the scale in f32, rounded once to bf16, as transformers dequantises (and as the model
/// kernel's fp8 stream computes each weight, `fp8_weights2`).
pub fn weight(code: u8, scale: f32) -> bf16 {
    bf16::from_f32(e4m3(code).expect("a checked code") * scale)
}

/// The weight of `shape` (rows, cols) whose e4m3 codes are `codes`, from its scales (`scales`: None
/// where the checkpoint has none) over blocks of `block` (the whole weight where None): the bf16
/// weights and the codes they came from (`Fp8Matrix`).
pub fn dequantize(
    shape: &[usize],
    codes: &[u8],
    block: Option<[usize; 2]>,
    scales: Option<Part>,
) -> Result<(Vec<bf16>, Fp8Matrix), String> {
    let m = Fp8Matrix::new(shape, codes, block, scales)?;
    Ok((m.dequantize(), m))
}

/// The e4m3 value (sign, four bits of exponent biased by 7, three of mantissa; exponent 0 subnormal)
/// code `b` names, exact in f32; None for its NaN (every bit of exponent and mantissa set).
fn e4m3(b: u8) -> Option<f32> {
    let (exponent, mantissa) = ((b >> 3) & 0xF, b & 0x7);
    if exponent == 0xF && mantissa == 0x7 {
        return None;
    }
    // Normal: (1 + m / 8) * 2^(e - 7) = (8 + m) * 2^(e - 10); subnormal: (m / 8) * 2^-6 = m * 2^-9.
    let magnitude = if exponent == 0 {
        f32::from(mantissa) * 2f32.powi(-9)
    } else {
        f32::from(8 + mantissa) * 2f32.powi(i32::from(exponent) - 10)
    };
    Some(if b & 0x80 != 0 { -magnitude } else { magnitude })
}

/// The e8m0 value code `b` names: 2^(b - 127), exact in f32 (2^-127 a subnormal); NaN for 0xFF.
fn e8m0(b: u8) -> f32 {
    match b {
        0xFF => f32::NAN,
        0 => f32::from_bits(1 << 22),
        _ => f32::from_bits(u32::from(b) << 23),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_scales(shape: [usize; 2], v: &[f32]) -> Option<Part> {
        Some(Part { dtype: Dtype::F32, shape: shape.to_vec(), data: v.iter().flat_map(|x| x.to_le_bytes()).collect() })
    }

    #[test]
    fn e4m3_codes_name_their_values_and_one_nan_a_sign() {
        for (code, value) in [
            (0x00, 0.0),
            (0x01, 2f32.powi(-9)),
            (0x07, 7.0 * 2f32.powi(-9)),
            (0x08, 2f32.powi(-6)),
            (0x38, 1.0),
            (0x39, 1.125),
            (0x40, 2.0),
            (0x7E, 448.0),
            (0xB8, -1.0),
            (0xFE, -448.0),
        ] {
            assert_eq!(e4m3(code), Some(value), "code 0x{code:02X}");
        }
        assert_eq!(e4m3(0x80).map(f32::to_bits), Some((-0.0f32).to_bits()));
        let nans: Vec<u8> = (0..=255u8).filter(|&b| e4m3(b).is_none()).collect();
        assert_eq!(nans, vec![0x7F, 0xFF]);
        // Every other code is a distinct value, ordered by its bits within a sign.
        let positive: Vec<f32> = (0..0x7Fu8).map(|b| e4m3(b).unwrap()).collect();
        assert!(positive.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn e8m0_scales_are_powers_of_two() {
        assert_eq!(e8m0(127), 1.0);
        assert_eq!(e8m0(130), 8.0);
        assert_eq!(e8m0(120), 2f32.powi(-7));
        assert_eq!(e8m0(0), 2f32.powi(-127));
        assert_eq!(e8m0(254), 2f32.powi(127));
        assert!(e8m0(255).is_nan());
    }

    #[test]
    fn each_element_is_its_code_scaled_by_its_blocks_scale_then_rounded_once_to_bf16() {
        // 3 x 5 in blocks of 2 x 3: a grid of 2 x 2 whose last row and column of blocks are partial.
        let codes: Vec<u8> = (0..15).map(|i| 0x30 + i as u8).collect();
        let scales = [1.0, 3.0, 0.1, 7.0];
        let got = dequantize(&[3, 5], &codes, Some([2, 3]), f32_scales([2, 2], &scales)).unwrap().0;
        let want: Vec<bf16> = (0..15)
            .map(|i| {
                let (r, c) = (i / 5, i % 5);
                bf16::from_f32(e4m3(codes[i]).unwrap() * scales[(r / 2) * 2 + c / 3])
            })
            .collect();
        assert_eq!(got, want);
        // 0x31 (1.125) times 0.1 is not a bf16: the one rounding shows.
        assert_ne!(got[1].to_f32(), 1.125 * 0.1);
        // With no block named, one scale covers the weight.
        let got = dequantize(&[3, 5], &codes, None, f32_scales([1, 1], &[0.5])).unwrap().0;
        assert!(got.iter().zip(&codes).all(|(w, &c)| *w == bf16::from_f32(e4m3(c).unwrap() * 0.5)));
    }

    #[test]
    fn ue8m0_scales_read_as_their_powers_of_two() {
        let scales = Part { dtype: Dtype::F8_E8M0, shape: vec![1, 2], data: vec![126, 131] };
        let got = dequantize(&[1, 4], &[0x38, 0x40, 0x38, 0xC0], Some([1, 2]), Some(scales)).unwrap().0;
        assert_eq!(got, [0.5, 1.0, 16.0, -32.0].map(bf16::from_f32));
    }

    #[test]
    fn what_is_not_a_whole_fp8_weight_is_refused_with_what_it_is() {
        let refused =
            |shape: &[usize], codes: &[u8], block, scales| dequantize(shape, codes, block, scales).unwrap_err();
        let ok = || f32_scales([1, 2], &[1.0, 1.0]);
        let text = refused(&[4], &[0x38; 4], Some([1, 2]), ok());
        assert!(text.contains("[4]") && text.contains("matrices"), "{text}");
        assert!(refused(&[1, 4], &[0x38; 3], Some([1, 2]), ok()).contains("3 bytes of e4m3 for 4 elements"));
        assert!(refused(&[1, 4], &[0x38; 4], Some([1, 2]), None).contains("'weight_scale_inv'"));
        let text = refused(&[1, 4], &[0x38; 4], Some([1, 2]), f32_scales([2, 1], &[1.0, 1.0]));
        assert!(text.contains("shape [2, 1], expected [1, 2]") && text.contains("blocks of 1 x 2"), "{text}");
        let text = refused(&[1, 4], &[0x38; 4], Some([1, 2]), f32_scales([1, 2], &[1.0]));
        assert!(text.contains("holds 1 values"), "{text}");
        let bf16_scales = Part { dtype: Dtype::BF16, shape: vec![1, 2], data: vec![0; 4] };
        assert!(refused(&[1, 4], &[0x38; 4], Some([1, 2]), Some(bf16_scales)).contains("weight_scale_inv in BF16"));
        let text = refused(&[1, 4], &[0x38; 4], Some([1, 2]), f32_scales([1, 2], &[1.0, f32::INFINITY]));
        assert!(text.contains("block [0, 1] is inf"), "{text}");
        let nan_scale = Part { dtype: Dtype::F8_E8M0, shape: vec![1, 2], data: vec![127, 255] };
        assert!(refused(&[1, 4], &[0x38; 4], Some([1, 2]), Some(nan_scale)).contains("block [0, 1] is NaN"));
        let text = refused(&[1, 4], &[0x38, 0x38, 0xFF, 0x38], Some([1, 2]), ok());
        assert!(text.contains("element (0, 2) is e4m3's NaN (0xFF)"), "{text}");
    }
}
