//! A layer split over the GPUs of one host (tensor parallelism, `spec::parallel`): each GPU's share of
//! the host weights and caches, and the CPU executor of the split program, every GPU's share compiled
//! and run as that GPU's kernel would run it, with the Reduce rows done across the shares. It checks
//! the split (which rows and columns each GPU holds, every share's packing, where the partials go and
//! where the Reduce rows sit) against the one-GPU arithmetic: the split step must be the golden
//! model's step bit for bit, as the one-GPU executor's is. The multi-GPU kernel's own sums across
//! GPUs round differently from one GPU's; that is its GPU check, not this one.

use half::bf16;
use reference::golden::{self, KvCache, Weights};
use spec::{Config, SpecError};

use super::cpu::{self, Arena, CpuStack, Ran};
use super::program::{Plan, Row, Split, reduce};

/// GPU `rank`'s share of a layer's weights split `ranks` ways: its query heads' rows of Wq, its KV
/// heads' rows of Wk and Wv, its ffn columns' rows of Wgate and Wup, the matching columns of Wo and
/// Wdown, and the norms whole.
pub fn shard_weights(cfg: &Config, w: &Weights, rank: usize, ranks: usize) -> Weights {
    let (qd, kvd, ffn) = (cfg.q_dim() / ranks, cfg.kv_dim() / ranks, cfg.ffn / ranks);
    let rows = |m: &[bf16], n: usize| m[rank * n * cfg.d..(rank + 1) * n * cfg.d].to_vec();
    let cols = |m: &[bf16], width: usize, n: usize| -> Vec<bf16> {
        m.chunks_exact(width).flat_map(|row| row[rank * n..(rank + 1) * n].iter().copied()).collect()
    };
    Weights {
        in_norm: w.in_norm.clone(),
        post_norm: w.post_norm.clone(),
        q: rows(&w.q, qd),
        k: rows(&w.k, kvd),
        v: rows(&w.v, kvd),
        o: cols(&w.o, cfg.q_dim(), qd),
        gate: rows(&w.gate, ffn),
        up: rows(&w.up, ffn),
        down: cols(&w.down, cfg.ffn, ffn),
    }
}

/// GPU `rank`'s share of a layer's cache split `ranks` ways: its KV heads, whose slots lie together.
pub fn shard_cache(cache: &KvCache, rank: usize, ranks: usize) -> KvCache {
    let n = cache.k.len() / ranks;
    KvCache { k: cache.k[rank * n..(rank + 1) * n].to_vec(), v: cache.v[rank * n..(rank + 1) * n].to_vec() }
}

/// A stack split over GPUs on the CPU: one `CpuStack` per GPU, each its share's program over its own
/// arena. Every arena is laid out alike, so a buffer has the same address on every GPU, as a symmetric
/// allocation gives the multi-GPU kernel.
pub struct SplitCpu {
    pub gpus: Vec<CpuStack>,
}

impl SplitCpu {
    /// `layers` split over `ranks` GPUs, each share packed (or, `in_place`, left as handed over) and
    /// compiled for a grid of `grid` blocks laid out as `plan` says (`None`: the compiler's plan for the
    /// share, or in place one role and one MLP part, as the GPU streams in place). Refused where the
    /// layer does not split `ranks` ways.
    pub fn build(
        cfg: &Config,
        layers: &[(Weights, KvCache)],
        ranks: usize,
        grid: u32,
        plan: Option<Plan>,
        in_place: bool,
    ) -> Result<Self, SpecError> {
        let share = spec::parallel::shard(cfg, ranks)?;
        let shares = (0..ranks)
            .map(|r| layers.iter().map(|(w, c)| (shard_weights(cfg, w, r, ranks), shard_cache(c, r, ranks))).collect())
            .collect();
        let chosen = if in_place { Plan { roles: 1, mlp_parts: 1 } } else { Plan::choose(&share, grid) };
        Ok(Self::of_shares(&share, shares, grid, plan.unwrap_or(chosen), in_place))
    }

    /// The GPUs holding `shares` (GPU r the r-th, one `(weights, cache)` per layer, of the share's shape
    /// `share`).
    pub fn of_shares(
        share: &Config,
        shares: Vec<Vec<(Weights, KvCache)>>,
        grid: u32,
        plan: Plan,
        in_place: bool,
    ) -> Self {
        let ranks = shares.len();
        let gpus: Vec<CpuStack> =
            shares.iter().map(|s| CpuStack::build(share, s, grid, plan, in_place, Split::Over(ranks))).collect();
        assert!(gpus.windows(2).all(|g| g[0].program == g[1].program), "every GPU runs the same program");
        Self { gpus }
    }

    /// One step on every GPU, row by row in step, each Reduce row done across them; returns each
    /// layer's output, which every GPU then holds.
    pub fn step(&mut self, x: &[bf16], pos: usize) -> Vec<Vec<bf16>> {
        let order: Vec<usize> = (0..self.gpus[0].program.len() * self.gpus[0].layers.len()).collect();
        self.step_in_order(x, pos, &order).unwrap_or_else(|e| panic!("{e}"))
    }

    /// The same with the phases run in `order` (as `CpuStack::step_in_order` takes it), every GPU in
    /// the same order.
    pub fn step_in_order(&mut self, x: &[bf16], pos: usize, order: &[usize]) -> Result<Vec<Vec<bf16>>, String> {
        let (program, layers) = (self.gpus[0].program.clone(), self.gpus[0].layers.len());
        cpu::walk_order(&program, layers, order, x, |l, row, x_l| {
            let ran: Vec<Ran> = self.gpus.iter_mut().map(|g| g.run_row(l, row, x_l, pos)).collect();
            match &ran[0] {
                Ran::Done => None,
                Ran::Output(_) => panic!("a GPU's share wrote the layer's output alone: only a Reduce row may"),
                Ran::Reduce(r) => {
                    assert!(ran.iter().all(|o| matches!(o, Ran::Reduce(q) if q == r)), "every GPU reduces alike");
                    self.reduce(r, x_l)
                }
            }
        })
    }

    /// A Reduce row: the residual plus the GEMV whose parts every GPU holds, its columns in rank order
    /// (each GPU's parts in its own order), written to every GPU, or returned as the layer's output.
    fn reduce(&mut self, row: &Row, x: &[bf16]) -> Option<Vec<bf16>> {
        let w = |i: reduce::Word| row[i as usize];
        let rows = w(reduce::Rows) as usize;
        let parts: Vec<Vec<cpu::Part>> = self.gpus.iter_mut().map(|g| g.take_parts(w(reduce::Parts))).collect();
        let all: Vec<(&Arena, cpu::Part)> =
            self.gpus.iter().zip(&parts).flat_map(|(g, ps)| ps.iter().map(move |&p| (&g.arena, p))).collect();
        let y = cpu::product(&all, 0..rows);
        let residual = match w(reduce::Residual) {
            0 => x.to_vec(),
            at => {
                let r = self.gpus[0].arena.bf16(at, rows);
                assert!(self.gpus.iter().all(|g| g.arena.bf16(at, rows) == r), "the residual is whole on every GPU");
                r
            }
        };
        let out = golden::add(&residual, &y);
        match w(reduce::Out) {
            0 => Some(out),
            at => {
                for g in &mut self.gpus {
                    g.arena.write_bf16(at, &out);
                }
                None
            }
        }
    }

    /// Layer `l`'s cache as the GPUs left it, their KV heads in rank order.
    pub fn cache(&self, l: usize) -> KvCache {
        let shares: Vec<KvCache> = self.gpus.iter().map(|g| g.cache(l)).collect();
        KvCache {
            k: shares.iter().flat_map(|c| c.k.iter().copied()).collect(),
            v: shares.iter().flat_map(|c| c.v.iter().copied()).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::checks;
    use crate::program::{self, BLOCKS_WORD, Forced, Op, PREV_LAYER_WAITS, WAITS_WORD};

    /// A tiny layer with four KV heads, so that it splits two and four ways and a two-way share still
    /// has the two heads the two-role plan needs.
    fn four_heads(layers: usize) -> Config {
        Config { name: "tiny-kv4".into(), n_q: 8, n_kv: 4, layers, ..Config::tiny() }
    }

    fn layers_of(cfg: &Config) -> Vec<(Weights, KvCache)> {
        (0..cfg.layers)
            .map(|l| {
                let s = spec::data::layer_seed(0x5EED ^ 0x5917, l);
                (golden::generate_weights(cfg, s), KvCache::generate(cfg, s))
            })
            .collect()
    }

    /// Steps the split stack and the golden model side by side, each step's phases in the order
    /// `order(step index)` gives (`None`: the program's): `Ok` where every layer's output and, at the end,
    /// every cache are the golden model's bit for bit; else where they first differ.
    fn against_golden(
        cfg: &Config,
        layers: &[(Weights, KvCache)],
        split: &mut SplitCpu,
        steps: usize,
        order: impl Fn(usize) -> Option<Vec<usize>>,
    ) -> Result<(), String> {
        let caches = checks::against_golden(cfg, layers, steps, |x, pos, s| match order(s) {
            Some(o) => split.step_in_order(x, pos, &o),
            None => Ok(split.step(x, pos)),
        })?;
        checks::same_caches(&caches, |l| split.cache(l))
    }

    #[test]
    fn the_shares_put_back_together_are_the_layer() {
        let cfg = four_heads(1);
        let (w, cache) = &layers_of(&cfg)[0];
        for ranks in [1, 2, 4] {
            let shares: Vec<Weights> = (0..ranks).map(|r| shard_weights(&cfg, w, r, ranks)).collect();
            let share = spec::parallel::shard(&cfg, ranks).unwrap();
            let cat =
                |f: fn(&Weights) -> &Vec<bf16>| -> Vec<bf16> { shares.iter().flat_map(|s| f(s).clone()).collect() };
            assert_eq!((cat(|s| &s.q), cat(|s| &s.k), cat(|s| &s.v)), (w.q.clone(), w.k.clone(), w.v.clone()));
            assert_eq!((cat(|s| &s.gate), cat(|s| &s.up)), (w.gate.clone(), w.up.clone()));
            // Wo and Wdown are cut by columns: row i of the layer's is row i of every share's, side by side.
            let side_by_side = |part: fn(&Weights) -> &Vec<bf16>, width: usize| -> Vec<bf16> {
                (0..cfg.d)
                    .flat_map(|i| shares.iter().flat_map(move |s| part(s)[i * width..(i + 1) * width].to_vec()))
                    .collect()
            };
            for (whole, rows) in
                [(&w.o, side_by_side(|s| &s.o, share.q_dim())), (&w.down, side_by_side(|s| &s.down, share.ffn))]
            {
                assert_eq!(&rows, whole);
            }
            for s in &shares {
                assert_eq!((&s.in_norm, &s.post_norm), (&w.in_norm, &w.post_norm));
                assert_eq!(s.q.len(), share.q_dim() * cfg.d);
            }
            let caches: Vec<KvCache> = (0..ranks).map(|r| shard_cache(cache, r, ranks)).collect();
            assert_eq!(caches.iter().flat_map(|c| c.k.clone()).collect::<Vec<_>>(), cache.k);
            assert_eq!(caches.iter().flat_map(|c| c.v.clone()).collect::<Vec<_>>(), cache.v);
        }
    }

    /// On one GPU the program has no Reduce row; split, one after O's last phase and one after Down's
    /// last, each on every block and waiting for the phases that leave its partials, GateUp waiting for
    /// the first and the next layer's Qkv for the second: two more phases on the layer's longest chain.
    #[test]
    fn a_split_program_reduces_after_o_and_after_down() {
        let cfg = four_heads(1);
        let buffers = CpuStack::build(&cfg, &layers_of(&cfg), 132, Plan::choose(&cfg, 132), false, Split::None).buffers;
        for (roles, parts) in [(1, 1), (1, 3), (2, 2)] {
            let plan = Plan::with(&cfg, 132, Forced { roles: Some(roles), mlp_parts: Some(parts) }).unwrap();
            let one = program::compile(&cfg, &buffers, 132, plan, Split::None);
            assert!(one.iter().all(|r| r[0] != Op::Reduce as i64));
            let split = program::compile(&cfg, &buffers, 132, plan, Split::Over(2));
            assert_eq!(split.len(), one.len() + 2, "{roles} roles, {parts} parts");
            let at = |op: Op| -> Vec<usize> { (0..split.len()).filter(|&k| split[k][0] == op as i64).collect() };
            let (reduces, opros, downs, gateups) = (at(Op::Reduce), at(Op::OProj), at(Op::Down), at(Op::GateUp));
            let waits = |k: usize| split[k][WAITS_WORD];
            let bits = |ks: &[usize], shift: usize| ks.iter().map(|&k| 1i64 << (k + shift)).sum::<i64>();
            assert_eq!(reduces, vec![*opros.last().unwrap() + 1, split.len() - 1]);
            assert_eq!(waits(reduces[0]), bits(&opros, 0));
            assert_eq!(waits(reduces[1]), bits(&downs, 0));
            assert!(gateups.iter().all(|&g| waits(g) == bits(&reduces[..1], 0)));
            assert_eq!(
                waits(0) >> PREV_LAYER_WAITS,
                1 << reduces[1],
                "the next layer's Qkv waits for the output's Reduce"
            );
            for &k in &reduces {
                assert_eq!(split[k][BLOCKS_WORD], program::Blocks::first(132).word());
            }
            assert_eq!(program::longest_chain(&split), program::longest_chain(&one) + 2, "two more hand-offs a layer");
            assert_eq!(split[reduces[0]][reduce::Parts as usize], buffers.x1_part as i64);
            assert_eq!(split[reduces[1]][reduce::Parts as usize], buffers.down_part as i64);
        }
    }

    /// Split one, two and four ways (one: the split's own path, its Reduce rows over one GPU), packed
    /// and in place, in one role and two and the MLP in one to three parts, over three layers: every
    /// layer's output and every cache are the golden model's.
    #[test]
    fn the_split_step_is_the_golden_step() {
        let cfg = four_heads(3);
        let layers = layers_of(&cfg);
        for ranks in [1, 2, 4] {
            let share = spec::parallel::shard(&cfg, ranks).unwrap();
            let mut plans = vec![None, Some(Plan { roles: 1, mlp_parts: 3 })];
            if share.n_kv >= 2 {
                plans.push(Some(Plan::with(&share, 132, Forced { roles: Some(2), mlp_parts: Some(2) }).unwrap()));
            }
            for plan in plans {
                for in_place in [false, true] {
                    if in_place && plan.is_some_and(|p| p.roles != 1 || p.mlp_parts != 1) {
                        continue; // in place runs one role, one part (as the GPU's stack does)
                    }
                    let mut split = SplitCpu::build(&cfg, &layers, ranks, 132, plan, in_place).unwrap();
                    against_golden(&cfg, &layers, &mut split, 2, |_| None)
                        .unwrap_or_else(|e| panic!("{ranks} GPUs, {plan:?}, in place {in_place}: {e}"));
                    // Then in orders the dependencies allow: the Reduce rows' waits are all they need.
                    let after = program::dependencies(&split.gpus[0].program, cfg.layers);
                    against_golden(&cfg, &layers, &mut split, 6, |s| Some(checks::order_from(&after, s as u64)))
                        .unwrap_or_else(|e| panic!("{ranks} GPUs, {plan:?}, in place {in_place}, reordered: {e}"));
                }
            }
        }
    }

    /// The check can fail: the same shares on the wrong GPUs are caught.
    #[test]
    fn shares_in_the_wrong_order_are_caught() {
        let cfg = four_heads(1);
        let layers = layers_of(&cfg);
        let share = spec::parallel::shard(&cfg, 2).unwrap();
        let mut shares: Vec<Vec<(Weights, KvCache)>> = (0..2)
            .map(|r| layers.iter().map(|(w, c)| (shard_weights(&cfg, w, r, 2), shard_cache(c, r, 2))).collect())
            .collect();
        shares.reverse();
        let mut swapped = SplitCpu::of_shares(&share, shares, 132, Plan::choose(&share, 132), false);
        assert!(against_golden(&cfg, &layers, &mut swapped, 1, |_| None).is_err());
    }

    #[test]
    fn a_layer_that_does_not_split_is_refused() {
        let cfg = Config::tiny();
        let err = SplitCpu::build(&cfg, &layers_of(&cfg), 4, 132, None, false).err().unwrap();
        assert!(err.to_string().contains("2 KV heads do not split into 4"), "{err}");
    }
}
