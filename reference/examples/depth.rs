//! The residual stream and the honest variants' error over a stack of layers, on the CPU: what the
//! whole-stack task has to design its data and its tolerance around. Layer `l` of the stack has the
//! one-layer recipe's weights and prefix at seed `seed + l` (a placeholder for a per-layer recipe);
//! one decode step runs through every layer, once with the eager reference's rounding and once per
//! variant of `golden::HONEST`, each variant carrying its own hidden state and caches. After each
//! layer it prints the reference's RMS of x, each variant's relative error from the reference, and
//! the two least-rounding variants' (fp32 stream, exact) from each other; then two cheats' errors, to
//! set against the drift: attention over the most recent quarter of the slots in every layer, and in
//! one layer only (CHEAT_LAYER, counted from 1; the middle one by default). Last, each chain's worst error of one layer against the reference's layer
//! on the chain's own input to it: what a judge comparing layer by layer would see.
//!
//! UPDATE scales every layer's `Wo` and `Wdown` (so its update of the residual stream), for trying
//! recipes that keep x O(1).
//!
//!   cargo run --release -p reference --example depth -- [CONFIG=tiny] [LAYERS=80] [SEED=1] [UPDATE=1]
//!       [CHEAT_LAYER=LAYERS/2+1]
//!
//! CONFIG is any name `--config` takes (a family member such as llama-3.2-1b, or a named stack, whose
//! depth LAYERS then defaults to).

use std::thread;

use half::bf16;
use reference::golden::ensemble::rel_err;
use reference::golden::{
    AttentionSpan, HONEST, KvCache, RopeTable, generate_weights, output_bf16, step, step_as, step_with,
};
use spec::Config;
use spec::data::input;

fn rms(x: &[bf16]) -> f64 {
    (x.iter().map(|v| v.to_f64().powi(2)).sum::<f64>() / x.len() as f64).sqrt()
}

/// `||out - reference|| / ||reference - input||`: the error of a layer's update of the residual stream.
fn update_err(input: &[bf16], out: &[bf16], reference: &[bf16]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for ((i, o), r) in input.iter().zip(out).zip(reference) {
        num += (o.to_f64() - r.to_f64()).powi(2);
        den += (r.to_f64() - i.to_f64()).powi(2);
    }
    (num / den).sqrt()
}

fn max2(a: [f64; 2], b: [f64; 2]) -> [f64; 2] {
    [a[0].max(b[0]), a[1].max(b[1])]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cfg = Config::load(args.first().map_or("tiny", String::as_str)).unwrap_or_else(|e| panic!("CONFIG: {e}"));
    let default_layers = if cfg.layers > 1 { cfg.layers as u64 } else { 80 };
    let cfg = Config { layers: 1, ..cfg };
    let layers: u64 = args.get(1).map_or(default_layers, |a| a.parse().expect("LAYERS: a whole number"));
    let seed: u64 = args.get(2).map_or(1, |a| a.parse().expect("SEED: a whole number"));
    let update: f32 = args.get(3).map_or(1.0, |a| a.parse().expect("UPDATE: a number"));
    let cheat_at: u64 = args.get(4).map_or(layers / 2 + 1, |a| a.parse().expect("CHEAT_LAYER: a layer, from 1"));
    let table = RopeTable::new(&cfg);
    let pos = cfg.prefill;
    let mut x = input(&cfg, seed, 0);
    let mut variants = vec![x.clone(); HONEST.len()];
    let (mut short_all, mut short_middle) = (x.clone(), x.clone());
    // Each chain's worst error, over the layers, of its layer on its own input: the variants', then
    // the two cheats'.
    let mut worst_own = [[0f64; 2]; HONEST.len() + 2];
    println!(
        "config {}, {layers} layers, seed {seed}, updates x{update}; x's RMS before the first: {:.3}",
        cfg.name,
        rms(&x)
    );
    let names = HONEST.map(|(n, _)| format!("{n:>24}")).join("");
    println!(
        "{:>5} {:>8}  {names}{:>24}{:>16}{:>16}",
        "layer", "rms(x)", "fp32 stream vs exact", "short, all", "short, one"
    );
    for l in 0..layers {
        let mut w = generate_weights(&cfg, seed + l);
        for m in [&mut w.o, &mut w.down] {
            m.iter_mut().for_each(|v| *v = bf16::from_f32(v.to_f32() * update));
        }
        let cache = KvCache::generate(&cfg, seed + l);
        x = step(&cfg, &w, &mut cache.clone(), &table, &x, pos);
        // Each chain's layer against the reference's layer on the chain's own input.
        // As the output's relative error, and as the update's (out - input against reference - input).
        let own = |input: &[bf16], out: &[bf16]| {
            let reference = step(&cfg, &w, &mut cache.clone(), &table, input, pos);
            [rel_err(out, &reference), update_err(input, out, &reference)]
        };
        thread::scope(|s| {
            for ((v, worst), (_, rounding)) in variants.iter_mut().zip(&mut worst_own).zip(&HONEST) {
                let (cfg, w, cache, own) = (&cfg, &w, &cache, &own);
                s.spawn(move || {
                    let out = output_bf16(&step_as(rounding, cfg, w, &mut cache.clone(), v, pos));
                    *worst = max2(*worst, own(v, &out));
                    *v = out;
                });
            }
        });
        let errors: Vec<String> = variants.iter().map(|v| format!("{:>24.2e}", rel_err(v, &x))).collect();
        // The two variants that round least, against each other.
        let precise = rel_err(&variants[HONEST.len() - 2], &variants[HONEST.len() - 1]);
        let short = |x: &[bf16], span| step_with(&cfg, &w, &mut cache.clone(), &table, x, pos, span);
        let middle = if l + 1 == cheat_at { AttentionSpan::RecentQuarter } else { AttentionSpan::Full };
        let [.., all_worst, middle_worst] = worst_own.as_mut_slice() else { unreachable!("two cheats") };
        for (chain, span, worst) in
            [(&mut short_all, AttentionSpan::RecentQuarter, all_worst), (&mut short_middle, middle, middle_worst)]
        {
            let out = short(chain, span);
            *worst = max2(*worst, own(chain, &out));
            *chain = out;
        }
        let (all, mid) = (rel_err(&short_all, &x), rel_err(&short_middle, &x));
        println!("{:>5} {:>8.3}  {}{precise:>24.2e}{all:>16.2e}{mid:>16.2e}", l + 1, rms(&x), errors.join(""));
    }
    println!("worst error of a layer against the reference's layer on the same input (its output, its update):");
    for (k, what) in ["output", "update"].iter().enumerate() {
        let judged: Vec<String> = worst_own.iter().map(|e| format!("{:>24.2e}", e[k])).collect();
        println!("{what:>16}{}", judged.join(""));
    }
}
