//! Where an implementation of the layer rounds, and how it adds: the golden model's one knob. The
//! eager reference, the exact computation and each honest variant of [`HONEST`] is a [`Rounding`],
//! and one body of code (`golden.rs`) computes a step for any of them.

use half::bf16;

/// How a value is kept at a rounding point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// Computed in f32 and stored as bf16: rounded to f32, then to bf16.
    Bf16,
    /// Rounded to f32.
    F32,
    /// Kept exactly (as f64).
    Exact,
}

impl Precision {
    pub fn round(self, x: f64) -> f64 {
        match self {
            Precision::Bf16 => bf16::from_f32(x as f32).to_f64(),
            Precision::F32 => f64::from(x as f32),
            Precision::Exact => x,
        }
    }
}

/// The rounding points of a step, in the order a step meets them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Point {
    /// Every intermediate inside an op: the norm's inverse root and products, RoPE's cos, sin and
    /// products, the softmax's exponentials, SiLU's parts.
    Arithmetic,
    /// The normalised vector `x / rms(x)`, before the norm weight multiplies it.
    Normalised,
    /// The norms' outputs `h` and `h2`.
    Normed,
    /// The q, k and v projections.
    Projected,
    /// q after RoPE.
    RopedQ,
    /// k after RoPE. The cache row written at `pos` is bf16 whatever this says.
    RopedK,
    /// The step's own k and v as attention reads them at slot `pos`.
    OwnKv,
    /// Attention scores `q . k / sqrt(hd)`.
    Scores,
    /// Softmax probabilities.
    Probs,
    /// The attention output `a`.
    Attended,
    /// `o = a @ Wo^T`.
    OutProj,
    /// The residual stream between attention and the MLP, `x1 = x + o`.
    Residual,
    /// The MLP's `gate` and `up`.
    GateUp,
    /// `silu(gate)`, before the product with `up`.
    Silu,
    /// `act = silu(gate) * up`.
    Act,
    /// `down = act @ Wdown^T`.
    Down,
}

impl Point {
    pub const ALL: [Point; 16] = [
        Point::Arithmetic,
        Point::Normalised,
        Point::Normed,
        Point::Projected,
        Point::RopedQ,
        Point::RopedK,
        Point::OwnKv,
        Point::Scores,
        Point::Probs,
        Point::Attended,
        Point::OutProj,
        Point::Residual,
        Point::GateUp,
        Point::Silu,
        Point::Act,
        Point::Down,
    ];

    /// Where the eager reference keeps the value: bf16 at every op boundary, f32 inside an op
    /// (scores and probabilities included).
    const fn eager(self) -> Precision {
        match self {
            Point::Arithmetic | Point::Normalised | Point::Scores | Point::Probs | Point::Silu => Precision::F32,
            _ => Precision::Bf16,
        }
    }
}

/// Lanes of a warp: [`Sum::Lanes`] adds like one.
pub const LANES: usize = 32;
/// Terms per lane per load (one 16-byte load of bf16): [`Sum::Lanes`] hands out chunks of this many.
pub const CHUNK: usize = 8;

/// How a reduction (dot product, sum of squares, softmax total, weighted sum of values) adds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sum {
    /// In f64 in index order: exact next to every rounding the model makes.
    Wide,
    /// In f32 as a GPU warp does: lane `l` of [`LANES`] adds the [`CHUNK`]-term chunks `l`,
    /// `l + LANES`, ... by fused multiply-adds, then the lanes are folded pairwise (lane `l` takes
    /// lane `l + 16`, then `l + 8`, ...).
    Lanes,
}

/// How one implementation of the layer computes a step: the precision of each [`Point`] and how its
/// reductions add. The step's output is bf16 for every one (the contract's output).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rounding {
    points: [Precision; Point::ALL.len()],
    pub sum: Sum,
}

impl Rounding {
    /// The eager reference (`reference::gpu::eager`): f32 arithmetic, bf16 between ops.
    pub const EAGER: Rounding = {
        let mut points = [Precision::Exact; Point::ALL.len()];
        let mut i = 0;
        while i < points.len() {
            points[i] = Point::ALL[i].eager();
            i += 1;
        }
        Rounding { points, sum: Sum::Wide }
    };

    /// The layer in exact arithmetic: no rounding anywhere, RoPE by exact angles, the step's own k and
    /// v unrounded (the cache row written is still bf16).
    pub const EXACT: Rounding = Rounding { points: [Precision::Exact; Point::ALL.len()], sum: Sum::Wide };

    /// A fused implementation's: every point f32 (f32 sums in a warp's order) but the step's own k and
    /// v, which attention reads back from the bf16 cache.
    pub const FP32_STREAM: Rounding =
        Rounding { points: [Precision::F32; Point::ALL.len()], sum: Sum::Lanes }.with(Point::OwnKv, Precision::Bf16);

    /// This rounding with `point` kept at `precision`.
    pub const fn with(mut self, point: Point, precision: Precision) -> Self {
        self.points[point as usize] = precision;
        self
    }

    /// This rounding with reductions added as `sum` says.
    pub const fn summing(mut self, sum: Sum) -> Self {
        self.sum = sum;
        self
    }

    pub fn at(&self, point: Point) -> Precision {
        self.points[point as usize]
    }

    /// `x` as the implementation keeps it at `point`.
    pub fn round(&self, point: Point, x: f64) -> f64 {
        self.at(point).round(x)
    }

    /// `sum(a * b)` over `pairs`, added as [`Rounding::sum`] says (unrounded for [`Sum::Wide`]).
    pub fn dot(&self, pairs: impl Iterator<Item = (f64, f64)>) -> f64 {
        match self.sum {
            Sum::Wide => pairs.map(|(a, b)| a * b).sum(),
            Sum::Lanes => {
                let mut lanes = [0f32; LANES];
                for (i, (a, b)) in pairs.enumerate() {
                    let lane = &mut lanes[(i / CHUNK) % LANES];
                    // A fused multiply-add: the product of two f32 values is exact in f64, the sum is
                    // rounded to f64 and then to f32 (as one rounding but in rare double-rounding
                    // ties), without a call to the library's fmaf.
                    *lane = (f64::from(*lane) + f64::from(a as f32) * f64::from(b as f32)) as f32;
                }
                let mut width = LANES / 2;
                while width > 0 {
                    for l in 0..width {
                        lanes[l] += lanes[l + width];
                    }
                    width /= 2;
                }
                f64::from(lanes[0])
            }
        }
    }
}

/// The honest implementations the selftest's ensemble runs beside the eager reference, by name. Each
/// computes the layer of the task statement and rounds only where an implementation may:
///
/// - **eager, f32 sums**: the reference's rounding points, every reduction added in f32 in a warp's
///   order (the task's eager style, a framework's or a fused kernel's accumulation);
/// - **eager, q fp32 after RoPE**: as above, with q left in f32 after RoPE;
/// - **framework eager**: as an eager framework's layer, which rounds more often than the reference:
///   the normalised vector before the norm weight, SiLU before the product with `up`, and the softmax
///   probabilities, each to bf16;
/// - **fp32 stream**: the residual stream and every intermediate in f32, rounding only where the task
///   demands (the K and V rows written to the bf16 cache, and the bf16 output): a megakernel's style;
/// - **exact**: every operation in exact (f64) arithmetic, the output rounded to bf16.
pub const HONEST: [(&str, Rounding); 5] = [
    ("eager, f32 sums", Rounding::EAGER.summing(Sum::Lanes)),
    ("eager, q fp32 after RoPE", Rounding::EAGER.summing(Sum::Lanes).with(Point::RopedQ, Precision::F32)),
    (
        "framework eager",
        Rounding::EAGER
            .summing(Sum::Lanes)
            .with(Point::Normalised, Precision::Bf16)
            .with(Point::Silu, Precision::Bf16)
            .with(Point::Probs, Precision::Bf16),
    ),
    ("fp32 stream", Rounding::FP32_STREAM),
    ("exact", Rounding::EXACT),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn points_index_their_slot() {
        for (i, p) in Point::ALL.iter().enumerate() {
            assert_eq!(*p as usize, i, "{p:?}");
        }
    }

    #[test]
    fn precisions_round_as_named() {
        let x = 1.0 + 1.0 / 3.0;
        assert_eq!(Precision::Exact.round(x), x);
        assert_eq!(Precision::F32.round(x), f64::from(x as f32));
        assert_eq!(Precision::Bf16.round(x), bf16::from_f32(x as f32).to_f64());
        assert!(Precision::Bf16.round(x) != Precision::F32.round(x) && Precision::F32.round(x) != x);
    }

    /// Lanes adds in f32 (small terms vanish against a large one) and in a warp's order.
    #[test]
    fn lanes_add_in_f32_and_wide_in_f64() {
        let lanes = Rounding::EXACT.summing(Sum::Lanes);
        let tiny = 1e-9;
        let pairs = || [(1.0, 1.0)].into_iter().chain(std::iter::repeat_n((tiny, 1.0), 7));
        assert_eq!(lanes.dot(pairs()), 1.0, "f32 loses terms below half an ulp of 1");
        assert!((Rounding::EXACT.dot(pairs()) - (1.0 + 7.0 * tiny)).abs() < 1e-15);
        // One term per chunk, in chunk c, lands in lane c % LANES: every lane gets a term and the fold
        // adds them all.
        let spread = (0..LANES * CHUNK).map(|i| if i % CHUNK == 0 { (1.0, (i / CHUNK) as f64) } else { (0.0, 0.0) });
        assert_eq!(lanes.dot(spread), (LANES * (LANES - 1) / 2) as f64);
    }

    #[test]
    fn eager_rounds_between_ops_only() {
        let e = Rounding::EAGER;
        assert_eq!(e.at(Point::Projected), Precision::Bf16);
        assert_eq!(e.at(Point::Scores), Precision::F32);
        assert_eq!(e.at(Point::Arithmetic), Precision::F32);
        assert!(Point::ALL.iter().all(|&p| Rounding::EXACT.at(p) == Precision::Exact));
        let names: Vec<&str> = HONEST.iter().map(|h| h.0).collect();
        assert!(HONEST.iter().all(|h| h.1 != Rounding::EAGER), "{names:?}: the reference is not its own variant");
    }
}
