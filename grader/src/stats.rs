//! Summary statistics of repeated timings (statrs): median and spread, and a 95% confidence
//! interval of the median from the binomial order-statistic method (no normality assumed).

use serde::Serialize;
use statrs::distribution::{Binomial, DiscreteCDF};
use statrs::statistics::{Data, Distribution, Max, Min, OrderStatistics};

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub n: usize,
    pub median: f64,
    pub mean: f64,
    pub std: f64,
    pub min: f64,
    pub max: f64,
    pub p10: f64,
    pub p90: f64,
    /// 95% confidence interval of the median: `[lo, hi]` order statistics.
    pub median_ci95: (f64, f64),
}

impl Summary {
    /// Summary of `samples`; `None` when there are none or any is not finite.
    pub fn of(samples: &[f64]) -> Option<Self> {
        if samples.is_empty() || samples.iter().any(|v| !v.is_finite()) {
            return None;
        }
        let mut data = Data::new(samples.to_vec());
        let n = samples.len();
        let mut sorted = samples.to_vec();
        sorted.sort_by(f64::total_cmp);
        Some(Self {
            n,
            median: data.median(),
            mean: data.mean().unwrap(),
            std: if n > 1 { data.std_dev().unwrap() } else { 0.0 },
            min: data.min(),
            max: data.max(),
            p10: data.percentile(10),
            p90: data.percentile(90),
            median_ci95: median_ci95(&sorted),
        })
    }

    /// Relative spread `(p90 - p10) / median`.
    pub fn spread(&self) -> f64 {
        (self.p90 - self.p10) / self.median
    }
}

/// The widest symmetric pair of order statistics `(x_(k), x_(n-1-k))` such that the median lies
/// between them with probability at least 0.95 under Binomial(n, 1/2); the whole range for small n.
fn median_ci95(sorted: &[f64]) -> (f64, f64) {
    let n = sorted.len();
    let binom = Binomial::new(0.5, n as u64).unwrap();
    // With X ~ Binomial(n, 1/2) samples below the median, P(x_(k) <= median <= x_(n-1-k)) =
    // 1 - 2 P(X <= k). Take the largest k whose coverage is still at least 0.95.
    let coverage = |k: usize| 1.0 - 2.0 * binom.cdf(k as u64);
    let mut k = 0usize;
    while k + 1 < n / 2 && coverage(k + 1) >= 0.95 {
        k += 1;
    }
    (sorted[k], sorted[n - 1 - k])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_of_known_samples() {
        let s = Summary::of(&[5.0, 1.0, 3.0, 2.0, 4.0]).unwrap();
        assert_eq!((s.n, s.median, s.mean, s.min, s.max), (5, 3.0, 3.0, 1.0, 5.0));
        assert!((s.std - 2.5f64.sqrt()).abs() < 1e-12);
        assert!(s.p10 >= 1.0 && s.p10 < 2.0 && s.p90 > 4.0 && s.p90 <= 5.0);
    }

    #[test]
    fn median_ci_covers_the_median_and_narrows_with_n() {
        let few: Vec<f64> = (0..10).map(f64::from).collect();
        let many: Vec<f64> = (0..1000).map(f64::from).collect();
        let (a, b) = Summary::of(&few).unwrap().median_ci95;
        let (c, d) = Summary::of(&many).unwrap().median_ci95;
        assert!(a <= 4.5 && b >= 4.5);
        assert!(c <= 499.5 && d >= 499.5);
        // About +-1.96 * sqrt(n)/2 = 31 ranks around the middle at n = 1000.
        assert!((d - c) < 80.0 && (d - c) > 40.0, "{c}..{d}");
    }

    #[test]
    fn refuses_empty_and_non_finite() {
        assert!(Summary::of(&[]).is_none());
        assert!(Summary::of(&[1.0, f64::NAN]).is_none());
        assert!(Summary::of(&[1.0, f64::INFINITY]).is_none());
    }
}
