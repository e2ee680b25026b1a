use spec::Gates;
use spec::rng::{normal_bf16, scale_for_std, stream_key};

use super::*;

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(a, b)| a * b).sum()
}

/// `||a - b|| / ||b||`, the grader's measure.
fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    let diff: f64 = a.iter().zip(b).map(|(a, b)| (a - b).powi(2)).sum();
    (diff / dot(b, b)).sqrt()
}

/// A fresh seeded layer at `tiny`: config, weights, cache and RoPE table.
fn tiny(seed: u64) -> (Config, Weights, KvCache, RopeTable) {
    let cfg = Config::tiny();
    let (w, cache, table) = (generate_weights(&cfg, seed), KvCache::generate(&cfg, seed), RopeTable::new(&cfg));
    (cfg, w, cache, table)
}

/// `len` normal bf16 values of standard deviation `std` from a test-only stream.
fn normal(len: usize, stream: u64, std: f64) -> Vec<bf16> {
    let key = stream_key(0x7E57, stream);
    (0..len as u64).map(|i| normal_bf16(key, i, 0.0, scale_for_std(std))).collect()
}

#[test]
fn step_agrees_with_exact_arithmetic() {
    let mut errs = Vec::new();
    for seed in [1, 2, spec::DEFAULT_SEED] {
        let (cfg, w, mut cache, table) = tiny(seed);
        for call in 0..4 {
            let pos = cfg.prefill + call;
            let x = data::input(&cfg, seed, call);
            let exact = step_f64(&cfg, &w, &cache, &x, pos);
            let rounded = to_f64(&step(&cfg, &w, &mut cache, &table, &x, pos));
            let err = rel_err(&rounded, &exact);
            // bf16 rounding must show, yet stay well inside the gate.
            assert!(err > 1e-4 && err < 1e-2, "seed {seed} pos {pos}: relative error {err:e}");
            errs.push(err);
        }
    }
    let (least, most) = (errs.iter().copied().fold(f64::INFINITY, f64::min), errs.iter().copied().fold(0.0, f64::max));
    println!("rounded vs exact step: relative error {least:.3e} to {most:.3e}");
}

/// The generic step with [`Rounding::EAGER`] is the reference's step bit for bit: RoPE by the exact
/// angles rounded to f32 is the table's rotation.
#[test]
fn eager_rounding_is_the_reference_step() {
    let (cfg, w, cache, table) = tiny(3);
    let (mut a, mut b) = (cache.clone(), cache);
    for call in 0..3 {
        let (pos, x) = (cfg.prefill + call, data::input(&cfg, 3, call));
        let want = step(&cfg, &w, &mut a, &table, &x, pos);
        assert_eq!(output_bf16(&step_as(&Rounding::EAGER, &cfg, &w, &mut b, &x, pos)), want, "call {call}");
    }
    assert_eq!(a, b, "the caches differ");
}

#[test]
fn rmsnorm_normalises_and_ignores_scale() {
    let (cfg, w, _, _) = tiny(1);
    let ones = vec![bf16::ONE; cfg.d];
    for call in 0..4 {
        let x = data::input(&cfg, 1, call);
        let y = to_f64(&rmsnorm(&x, &ones, cfg.eps));
        let rms = (dot(&y, &y) / cfg.d as f64).sqrt();
        assert!((rms - 1.0).abs() < 1.0 / 256.0, "rms of the output {rms}");
        // eps breaks exact scale invariance, so this bitwise check leaves it out.
        let base = rmsnorm(&x, &w.in_norm, 0.0);
        for scale in [0.125, 4.0, 1024.0] {
            let scaled: Vec<bf16> = x.iter().map(|v| bf16::from_f32(v.to_f32() * scale)).collect();
            assert_eq!(rmsnorm(&scaled, &w.in_norm, 0.0), base, "x scaled by {scale}");
        }
    }
}

#[test]
fn attention_of_equal_values_is_that_value() {
    let (cfg, _, mut cache, _) = tiny(1);
    let (hd, pos) = (cfg.hd, cfg.prefill + 3);
    let per_head: Vec<Vec<bf16>> = (0..cfg.n_kv as u64).map(|head| normal(hd, head, 1.0)).collect();
    for (head, c) in per_head.iter().enumerate() {
        for p in 0..=pos {
            cache.v[slot_range(&cfg, head, p)].copy_from_slice(c);
        }
    }
    for (stream, std) in [(10, 1.0), (11, 8.0)] {
        let q = normal(cfg.q_dim(), stream, std);
        let a = attention(&cfg, &q, &cache, pos);
        // sum(w V) / sum(w) is c to f64 precision, so rounding to bf16 gives c exactly.
        for (j, out) in a.chunks_exact(hd).enumerate() {
            assert_eq!(out, per_head[j / cfg.group()], "query head {j}, q std {std}");
        }
    }
    // At pos 0 the only weight is exp(0) = 1.
    let a = attention(&cfg, &normal(cfg.q_dim(), 12, 8.0), &cache, 0);
    for (j, out) in a.chunks_exact(hd).enumerate() {
        assert_eq!(out, &cache.v[slot_range(&cfg, j / cfg.group(), 0)], "query head {j}");
    }
}

#[test]
fn rope_rotates_pairs_by_position() {
    let cfg = Config::tiny();
    let table = RopeTable::new(&cfg);
    let (hd, half) = (cfg.hd, cfg.hd / 2);
    let v = normal(cfg.q_dim(), 20, 1.0);
    let roped = |mut v: Vec<bf16>, heads: usize, pos: usize| {
        rope(&mut v, heads, hd, &table, pos);
        v
    };
    assert_eq!(roped(v.clone(), cfg.n_q, 0), v, "pos 0 is the identity");

    // Rotate-half: the unit vector e_i turns towards e_{i + hd/2} by angle pos * theta^(-2i/hd).
    let pos = 37;
    for i in [0, 1, half - 1] {
        let mut e = vec![bf16::ZERO; hd];
        e[i] = bf16::ONE;
        let e = roped(e, 1, pos);
        let angle = pos as f64 * cfg.theta.powf(-2.0 * i as f64 / hd as f64);
        let (c, s) = (table.cos[pos * half + i], table.sin[pos * half + i]);
        assert!((f64::from(c) - angle.cos()).abs() < 1e-7 && (f64::from(s) - angle.sin()).abs() < 1e-7);
        let mut want = vec![bf16::ZERO; hd];
        (want[i], want[i + half]) = (bf16::from_f32(c), bf16::from_f32(s));
        assert_eq!(e, want, "e_{i} at pos {pos}");
    }

    // Each pair keeps its length, up to the two bf16 roundings.
    let r = roped(v.clone(), cfg.n_q, cfg.max_seq_len - 1);
    let pair_norm = |v: &[bf16], j: usize| {
        let (head, i) = (j / half, j % half);
        f64::from(v[head * hd + i].to_f32()).hypot(f64::from(v[head * hd + i + half].to_f32()))
    };
    for j in 0..cfg.n_q * half {
        let (before, after) = (pair_norm(&v, j), pair_norm(&r, j));
        assert!((after - before).abs() <= before / 128.0, "pair {j}: {before} -> {after}");
    }

    // q . k depends only on the positions' difference (unrounded, so only the f32 table errs).
    let (q, k) = (to_f64(&normal(hd, 21, 1.0)), to_f64(&normal(hd, 22, 1.0)));
    let score = |p1: usize, p2: usize| {
        let (mut a, mut b) = (q.clone(), k.clone());
        rotate(&Rounding::EXACT, Point::RopedQ, &mut a, hd, &table.rotation(p1));
        rotate(&Rounding::EXACT, Point::RopedK, &mut b, hd, &table.rotation(p2));
        dot(&a, &b)
    };
    let tol = 1e-6 * dot(&q, &q).sqrt() * dot(&k, &k).sqrt();
    for (p1, p2) in [(70, 60), (10, 40), (3, 3), (0, 90)] {
        let (s, shifted) = (score(p1, p2), score(p1 + 5, p2 + 5));
        assert!((s - shifted).abs() < tol, "({p1}, {p2}): {s} vs {shifted}");
    }
}

/// `after` is `before` with slot `pos` of every KV head replaced by `k` and `v`, bit for bit.
fn assert_only_slot_written(cfg: &Config, before: &KvCache, after: &KvCache, pos: usize, k: &[bf16], v: &[bf16]) {
    for (name, before, after, new) in [("K", &before.k, &after.k, k), ("V", &before.v, &after.v, v)] {
        for (i, (b, a)) in before.iter().zip(after).enumerate() {
            let (row, e) = (i / cfg.hd, i % cfg.hd);
            let (head, p) = (row / cfg.max_seq_len, row % cfg.max_seq_len);
            let want = if p == pos { new[head * cfg.hd + e] } else { *b };
            assert_eq!(a.to_bits(), want.to_bits(), "{name} head {head} slot {p} element {e}");
        }
    }
}

#[test]
fn append_and_step_write_only_slot_pos() {
    let (cfg, w, cache, table) = tiny(1);
    let pos = cfg.prefill + 2;
    let (k, v) = (normal(cfg.kv_dim(), 30, 1.0), normal(cfg.kv_dim(), 31, 1.0));
    let mut appended = cache.clone();
    append(&mut appended, &cfg, &k, &v, pos);
    assert_only_slot_written(&cfg, &cache, &appended, pos, &k, &v);

    // step writes the k and v that the per-op functions compute.
    let x = data::input(&cfg, 1, 0);
    let h = rmsnorm(&x, &w.in_norm, cfg.eps);
    let mut k = gemv(&w.k, cfg.kv_dim(), cfg.d, &h);
    rope(&mut k, cfg.n_kv, cfg.hd, &table, pos);
    let v = gemv(&w.v, cfg.kv_dim(), cfg.d, &h);
    let mut stepped = cache.clone();
    step(&cfg, &w, &mut stepped, &table, &x, pos);
    assert_only_slot_written(&cfg, &cache, &stepped, pos, &k, &v);
}

/// Wrong answers must miss the reference by three tolerances, or the correctness gate could not tell
/// them from a right answer's rounding.
#[test]
fn wrong_answers_fail_the_gate_by_a_margin() {
    let margin = 3.0 * Gates::TASK.rel_err_tol;
    for seed in [1, 2, spec::DEFAULT_SEED] {
        let (cfg, w, cache, table) = tiny(seed);
        let spans = [AttentionSpan::Full, AttentionSpan::Skip, AttentionSpan::RecentQuarter];
        let mut caches = spans.map(|_| cache.clone());
        // Smallest error over the steps of: pass-through, attention skipped, recent quarter only.
        let mut least = [f64::INFINITY; 3];
        for call in 0..4 {
            let pos = cfg.prefill + call;
            let x = data::input(&cfg, seed, call);
            let mut outs = spans
                .iter()
                .zip(&mut caches)
                .map(|(&span, cache)| to_f64(&step_with(&cfg, &w, cache, &table, &x, pos, span)));
            let reference = outs.next().unwrap();
            for (least, wrong) in least.iter_mut().zip([to_f64(&x)].into_iter().chain(outs)) {
                *least = least.min(rel_err(&wrong, &reference));
            }
        }
        let least_text = least.map(|e| format!("{e:.3e}")).join(", ");
        println!("seed {seed:#x}: least relative error of pass-through, skip, recent quarter: {least_text}");
        for (name, err) in ["pass-through", "attention skipped", "recent quarter only"].iter().zip(least) {
            assert!(err >= margin, "seed {seed}: {name} is only {err:e} from the reference (margin {margin:e})");
        }
    }
}

/// Every honest implementation of [`HONEST`] stays within half the correctness gate's tolerance of the
/// eager reference over [`ensemble::SEEDS`] seeds, on fresh inputs and on chained ones (each call's
/// input the reference's previous output), while the rounding ones do differ from it. The seeds are
/// those `grader selftest` measures the ensemble over by default.
#[test]
fn honest_variants_stay_within_half_the_tolerance() {
    let half = Gates::TASK.rel_err_tol / 2.0;
    for cfg in [Config::tiny(), Config::small()] {
        let mut worst = [0f64; HONEST.len()];
        for seed in (0..ensemble::SEEDS).map(|s| spec::DEFAULT_SEED + s) {
            let (w, cache, table) = (generate_weights(&cfg, seed), KvCache::generate(&cfg, seed), RopeTable::new(&cfg));
            let (mut ens, mut ref_cache) = (ensemble::Ensemble::new(&cfg, &w, &cache), cache.clone());
            let mut x = data::input(&cfg, seed, 0);
            for call in 0..ensemble::calls(&cfg) {
                let pos = cfg.prefill + call;
                let reference = step(&cfg, &w, &mut ref_cache, &table, &x, pos);
                ens.call(&x, pos, &reference);
                x = reference;
            }
            worst.iter_mut().zip(ens.worst()).for_each(|(w, e)| *w = w.max(e));
        }
        for ((name, r), err) in HONEST.iter().zip(worst) {
            println!("{} {name}: worst {err:.2e}, margin {:.2}x", cfg.name, Gates::TASK.rel_err_tol / err);
            assert!(err <= half, "{} {name}: {err:.2e} from the reference, over half the tolerance", cfg.name);
            if r.sum == Sum::Wide {
                assert!(err > 1e-3, "{} {name}: {err:.2e}, no sign of rounding", cfg.name);
            }
        }
    }
}

/// Qwen3's per-head q/k norms normalise each head of the queries and keys: with them, scaling `Wq`
/// and `Wk` by 4 (exact in bf16) moves the output only by its rounding (2.6e-3), where without them
/// the scores, and so the output, move (0.27).
#[test]
fn qk_norms_make_the_layer_blind_to_the_scale_of_wq_and_wk() {
    let (cfg, w, cache, table) = tiny(5);
    let ones = vec![bf16::ONE; cfg.hd];
    let norms = QkNorm { q: &ones, k: &ones };
    let mut scaled = w.clone();
    for v in scaled.q.iter_mut().chain(scaled.k.iter_mut()) {
        *v = bf16::from_f32(v.to_f32() * 4.0);
    }
    let (pos, x) = (cfg.prefill, data::input(&cfg, 5, 0));
    let run = |w: &Weights, n: Option<QkNorm<'_>>| {
        let mut c = cache.clone();
        to_f64(&match n {
            Some(n) => step_qk_norm(&cfg, w, n, &mut c, &table, &x, pos),
            None => step(&cfg, w, &mut c, &table, &x, pos),
        })
    };
    let with = rel_err(&run(&scaled, Some(norms)), &run(&w, Some(norms)));
    let without = rel_err(&run(&scaled, None), &run(&w, None));
    println!("scaling Wq and Wk by 4 moves the output by {with:.3e} with the q/k norms, {without:.3e} without");
    assert!(with < 1e-2 && without > 20.0 * with, "with {with:e}, without {without:e}");
    assert_ne!(run(&w, Some(norms)), run(&w, None), "the norms change the layer");
}
