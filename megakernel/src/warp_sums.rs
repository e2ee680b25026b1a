//! A model of the kernels' warp sums on 32 simulated lanes: `warp_reduce` (a butterfly a value,
//! `kernels/include/layer_math.cuh`), `reduce_scatter` (the values placed by each lane's mask, run_group's)
//! and `reduce_transposed` (the values in place, run_rows's nf4 passes; both in
//! `kernels/megakernel/vm_stream.cuh`). The kernels' bitwise checks rest on one claim about them, which
//! the tests here make of the model on fresh random partials: each sums every value with the same lane
//! pairs at the same offsets, so a row's sum has the same bits from a decode step (run_rows) and a
//! batch step (run_group), and one value's partials, a NaN among them, never reach another's.

const WARP: usize = 32;

/// One value's partial in every lane.
type Lanes = [f32; WARP];

/// `__shfl_xor_sync(FULL_MASK, v, offset)` in every lane.
fn shfl_xor(v: &Lanes, offset: usize) -> Lanes {
    std::array::from_fn(|l| v[l ^ offset])
}

/// `warp_reduce(v, Add{})`: every lane ends with the value's sum (all five levels of `finish`'s).
fn butterfly(v: Lanes) -> Lanes {
    finish(1, v)
}

/// `scatter_mask<N>()` of lane `lane`: which value the lane ends with.
fn scatter_mask(n: usize, lane: usize) -> usize {
    lane / (WARP / n)
}

/// `finish_sums<N>`, which ends both reductions once each lane holds one value: the butterfly over
/// offsets WARP / 2 / N down to 1.
fn finish(n: usize, mut sum: Lanes) -> Lanes {
    let mut offset = WARP / 2 / n;
    while offset > 0 {
        let other = shfl_xor(&sum, offset);
        sum = std::array::from_fn(|l| sum[l] + other[l]);
        offset /= 2;
    }
    sum
}

/// `reduce_scatter<N>` over `values[k]`, value k's partials: lane l holds value k at v[k ^ mask(l)].
fn reduce_scatter(values: &[Lanes]) -> Lanes {
    let n = values.len();
    let mut v: Vec<Lanes> = (0..n).map(|p| std::array::from_fn(|l| values[p ^ scatter_mask(n, l)][l])).collect();
    let mut level = 1;
    while level < n {
        let (half, offset) = (n / 2 / level, WARP / 2 / level);
        for j in 0..half {
            let other = shfl_xor(&v[j + half], offset);
            v[j] = std::array::from_fn(|l| v[j][l] + other[l]);
        }
        level *= 2;
    }
    finish(n, v[0])
}

/// `reduce_transposed<N>` over `values[k]`: every lane holds value k at v[k], and at each level keeps
/// one half and hands over the other by its bit of the offset.
fn reduce_transposed(values: &[Lanes]) -> Lanes {
    let n = values.len();
    let mut v = values.to_vec();
    let mut level = 1;
    while level < n {
        let (half, offset) = (n / 2 / level, WARP / 2 / level);
        for j in 0..half {
            let upper = |l: usize| l & offset != 0;
            let send: Lanes = std::array::from_fn(|l| if upper(l) { v[j][l] } else { v[j + half][l] });
            let keep: Lanes = std::array::from_fn(|l| if upper(l) { v[j + half][l] } else { v[j][l] });
            let other = shfl_xor(&send, offset);
            v[j] = std::array::from_fn(|l| keep[l] + other[l]);
        }
        level *= 2;
    }
    finish(n, v[0])
}

/// Partials whose sums round differently in another order: magnitudes over 2^-20 to 2^20, both signs.
fn partials(n: usize, state: &mut u64) -> Vec<Lanes> {
    let mut next = || {
        // xorshift64: any spread will do.
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    };
    (0..n)
        .map(|_| {
            std::array::from_fn(|_| {
                let r = next();
                let mantissa = 1.0 + (r >> 40) as f32 / (1u64 << 24) as f32;
                let sign = if r & 1 == 0 { 1.0 } else { -1.0 };
                sign * mantissa * 2f32.powi(((r >> 8) % 41) as i32 - 20)
            })
        })
        .collect()
}

#[test]
fn both_reductions_give_every_value_the_butterflys_bits() {
    let seed = crate::cpu::checks::input_seed();
    let mut state = seed | 1;
    for n in [1, 2, 4, 8, 16, 32] {
        for _ in 0..50 {
            let values = partials(n, &mut state);
            let (scattered, transposed) = (reduce_scatter(&values), reduce_transposed(&values));
            for l in 0..WARP {
                let want = butterfly(values[scatter_mask(n, l)])[l];
                assert_eq!(scattered[l].to_bits(), want.to_bits(), "reduce_scatter<{n}>, lane {l}, seed {seed}");
                assert_eq!(transposed[l].to_bits(), want.to_bits(), "reduce_transposed<{n}>, lane {l}, seed {seed}");
            }
        }
    }
}

/// The order matters: summed lane by lane, the same partials give other bits, so the test above
/// can fail.
#[test]
fn another_order_gives_other_bits() {
    let mut state = crate::cpu::checks::input_seed() | 1;
    let differs = (0..50).any(|_| {
        let v = partials(1, &mut state)[0];
        let in_order = v.iter().fold(0.0f32, |a, &x| a + x);
        in_order.to_bits() != butterfly(v)[0].to_bits()
    });
    assert!(differs);
}

#[test]
fn a_stale_rows_nan_stays_in_its_own_sum() {
    let mut state = crate::cpu::checks::input_seed() | 1;
    let mut values = partials(8, &mut state);
    values[3][17] = f32::NAN;
    for sums in [reduce_scatter(&values), reduce_transposed(&values)] {
        for (l, sum) in sums.iter().enumerate() {
            assert_eq!(sum.is_nan(), scatter_mask(8, l) == 3, "lane {l}");
        }
    }
}

/// The model is the kernels' code: their lines, as the model spells them.
#[test]
fn the_model_mirrors_the_kernels() {
    let cu = [crate::kernels::DEVICE_SOURCE, include_str!("../../kernels/include/layer_math.cuh")].concat();
    for line in [
        "for (uint32_t offset = WARP / 2; offset > 0; offset /= 2) v = op(v, __shfl_xor_sync(FULL_MASK, v, offset));",
        "v[j] += __shfl_xor_sync(FULL_MASK, v[j + half], offset);",
        "const float send = upper ? v[j] : v[j + half], keep = upper ? v[j + half] : v[j];",
        "v[j] = keep + __shfl_xor_sync(FULL_MASK, send, offset);",
        "const bool upper = (lane & offset) != 0;",
        "const uint32_t half = N / 2 / level, offset = WARP / 2 / level;",
        "for (uint32_t offset = WARP / 2 / N; offset > 0; offset /= 2) sum += __shfl_xor_sync(FULL_MASK, sum, offset);",
        "__device__ inline uint32_t scatter_mask() { return threadIdx.x % WARP / (WARP / N); }",
        "return finish_sums<N>(v[0]);",
    ] {
        assert!(cu.contains(line), "the kernels no longer read {line}");
    }
}
