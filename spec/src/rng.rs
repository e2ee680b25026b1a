//! The counter-based hash RNG, defined once here and mirrored line for line in
//! `kernels/reference/rng.cuh`. A value depends only on (seed, stream, index), so any element of any tensor can
//! be regenerated anywhere, in any order, on the CPU or the GPU, bitwise identical.
//!
//! Only integer hashing and two correctly rounded f32 operations are used (no logf/cosf, whose last
//! bit differs between CUDA and Rust): a normal is approximated by the Irwin-Hall sum of four 16-bit
//! uniforms, exact in integers, then scaled by one f32 multiply and shifted by one f32 add.

use half::bf16;

/// 2^64 / golden ratio: the splitmix64 increment.
pub const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
/// Mean of the sum of four 16-bit uniforms, `4 * 65535 / 2`.
pub const IRWIN_HALL_MEAN: i32 = 131_070;
/// Standard deviation of that sum is `65536 / sqrt(3)`; multiplying by this gives unit variance.
pub const IRWIN_HALL_UNIT: f64 = 1.732_050_807_568_877_2 / 65536.0;

/// The splitmix64 finaliser: a bijection on u64 with full avalanche.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The key of one stream of one seed; each tensor has its own stream.
#[inline]
pub fn stream_key(seed: u64, stream: u64) -> u64 {
    mix64(seed ^ mix64(stream.wrapping_mul(GOLDEN)))
}

/// 64 random bits for element `index` of a stream. Distinct indices give distinct bits (both mixes
/// are bijections).
#[inline]
pub fn bits(key: u64, index: u64) -> u64 {
    mix64(key ^ mix64(index))
}

/// The centred Irwin-Hall integer: the sum of the four 16-bit lanes of `bits` minus its mean, in
/// `[-131070, 131070]`, exactly representable in f32.
#[inline]
pub fn centred_sum(bits: u64) -> i32 {
    let lanes = (bits & 0xFFFF) + ((bits >> 16) & 0xFFFF) + ((bits >> 32) & 0xFFFF) + (bits >> 48);
    lanes as i32 - IRWIN_HALL_MEAN
}

/// The f32 multiplier that turns [`centred_sum`] into a normal of standard deviation `std`.
pub fn scale_for_std(std: f64) -> f32 {
    (std * IRWIN_HALL_UNIT) as f32
}

/// `mean + centred_sum * scale`, each operation rounded once to f32 (the CUDA side uses
/// `__fmul_rn`/`__fadd_rn` so no fused multiply-add changes the last bit).
#[inline]
pub fn normal_f32(key: u64, index: u64, mean: f32, scale: f32) -> f32 {
    let product = centred_sum(bits(key, index)) as f32 * scale;
    mean + product
}

/// [`normal_f32`] rounded to bf16 (round to nearest even, as `__float2bfloat16_rn`).
#[inline]
pub fn normal_bf16(key: u64, index: u64, mean: f32, scale: f32) -> bf16 {
    bf16::from_f32(normal_f32(key, index, mean, scale))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pinned values: if any of these changes, every stored dump and the CUDA mirror drift apart.
    #[test]
    fn stream_is_pinned() {
        assert_eq!(mix64(0), 0);
        assert_eq!(mix64(1), 0x5692_161D_100B_05E5);
        let key = stream_key(0x5EED, 3);
        let got: Vec<u16> = (0..4).map(|i| normal_bf16(key, i, 0.0, scale_for_std(1.0)).to_bits()).collect();
        assert_eq!(got, PINNED_BF16, "got {got:04x?}");
    }
    const PINNED_BF16: [u16; 4] = [0xbf79, 0x4004, 0x3f64, 0xbd61];

    #[test]
    fn normal_has_unit_moments() {
        let key = stream_key(7, 1);
        let n = 200_000u64;
        let scale = scale_for_std(1.0);
        let (mut s1, mut s2, mut s4) = (0f64, 0f64, 0f64);
        for i in 0..n {
            let v = normal_f32(key, i, 0.0, scale) as f64;
            s1 += v;
            s2 += v * v;
            s4 += v * v * v * v;
        }
        let (mean, var) = (s1 / n as f64, s2 / n as f64);
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.01, "var {var}");
        // Irwin-Hall(4) kurtosis is 3 - 6/20 = 2.7: close to normal, with bounded tails.
        let kurt = s4 / n as f64 / (var * var);
        assert!((kurt - 2.7).abs() < 0.05, "kurtosis {kurt}");
    }

    #[test]
    fn streams_and_seeds_differ() {
        let a = stream_key(1, 1);
        let b = stream_key(1, 2);
        let c = stream_key(2, 1);
        assert_ne!(bits(a, 0), bits(b, 0));
        assert_ne!(bits(a, 0), bits(c, 0));
        assert_ne!(bits(a, 0), bits(a, 1));
    }
}
