//! Checks of the megakernel on the GPU: its output against the eager reference's, the fused launch
//! against the phase-per-launch mode bit for bit, and a repeated step bit for bit, in each of the
//! plans a shape admits (one role, and two where the layer has two KV heads or more), whichever the
//! compiler would choose for it; and the same over a stack of layers in one launch, each layer against
//! the eager layer on the megakernel's own input to it; and the split kernel over one GPU (the path of
//! a stack split over GPUs, its Reduce rows adding this GPU's own partials) against the stack kernel,
//! bit for bit.

use cuda::cudarc::driver::CudaSlice;
use cuda::{Context, Device};
use half::bf16;
use megakernel::program::Forced;
use megakernel::{Megakernel, Mode};
use reference::gpu::{DeviceCache, DeviceWeights, Eager, generate_weights};
use spec::data::{input, layer_seed};
use spec::{Config, Gates};
use submission::{Layer, Submission};

use super::{Check, CheckResult, Ctx, Failure, ensure};
use crate::metrics::{Diff, rel_err, to_f32};

pub fn checks() -> Vec<Check> {
    vec![
        Check { name: "megakernel matches eager (tiny)", run: |c| matches(c, Config::tiny(), 3) },
        Check { name: "megakernel matches eager (small)", run: |c| matches(c, Config::small(), 3) },
        Check { name: "megakernel matches eager (graded)", run: |c| matches(c, Config::graded(), 3) },
        Check { name: "megakernel matches eager (long context in splits)", run: |c| matches(c, deep_cache(), 2) },
        Check { name: "megakernel matches eager (hd 256)", run: |c| matches(c, shape("small-hd256", 8, 4, 256), 2) },
        Check {
            name: "megakernel matches eager (16 query heads per KV head)",
            run: |c| matches(c, shape("small-g16", 32, 2, 128), 2),
        },
        Check {
            name: "megakernel matches eager (more KV heads than teams)",
            run: |c| matches(c, shape("small-mha", 288, 288, 16), 2),
        },
        Check {
            name: "megakernel matches eager (ffn in three parts)",
            run: |c| matches(c, Config { name: "small-ffn3".into(), ffn: 61_440, ..Config::small() }, 2),
        },
        Check {
            name: "megakernel matches eager over a stack (3 x small-g16, two roles)",
            run: |c| stack_matches(c, Config { layers: 3, ..shape("small-g16", 32, 2, 128) }, 2, false),
        },
        Check {
            name: "megakernel matches eager over a stack (stack-1b, 16 layers)",
            run: |c| stack_matches(c, spec::family::find_stack("stack-1b").expect("a named stack").config(), 2, false),
        },
        Check {
            name: "megakernel matches eager over a stack streamed in place (stack-1b)",
            run: |c| stack_matches(c, spec::family::find_stack("stack-1b").expect("a named stack").config(), 2, true),
        },
        Check {
            name: "megakernel matches eager over a stack streamed in place (3 x graded)",
            run: |c| stack_matches(c, Config { name: "graded-x3".into(), layers: 3, ..Config::graded() }, 2, true),
        },
        Check {
            name: "megakernel split over one GPU equals the stack kernel bit for bit (3 x graded)",
            run: |c| split_over_one(c, Config { name: "graded-x3".into(), layers: 3, ..Config::graded() }, 2),
        },
    ]
}

/// Every layer's output of one step of `mk` over `weights` on `caches`, in order (the hidden states,
/// then out), each output poisoned with NaN before the step.
fn stack_states(
    dev: &Device,
    mk: &mut Megakernel,
    weights: &[DeviceWeights],
    caches: &mut [DeviceCache],
    x: &CudaSlice<bf16>,
    pos: usize,
) -> Result<Vec<bf16>, Failure> {
    let row = x.len();
    let poisoned = |n: usize| dev.stream().clone_htod(&vec![bf16::NAN; n]).context("allocating an output");
    let (mut hidden, mut out) = (poisoned((weights.len() - 1) * row)?, poisoned(row)?);
    mk.stack_step(dev, &mut Layer::stack(weights, caches), x, pos, Some(&mut hidden), &mut out)?;
    let mut states = dev.stream().clone_dtoh(&hidden).context("reading the hidden states")?;
    states.extend(dev.stream().clone_dtoh(&out).context("reading an output")?);
    Ok(states)
}

/// `steps` steps over a stack through the split kernel over one GPU (its Reduce rows adding this GPU's
/// own partials: `Megakernel::split_over_one`), fused and a launch per phase, and through the stack
/// kernel, each on caches of its own: the split program has two more phases a layer, and every layer's
/// output and every cache are the stack kernel's bit for bit.
fn split_over_one(ctx: &mut Ctx, cfg: Config, steps: usize) -> CheckResult {
    let dev = &ctx.dev;
    if !dev.is_hopper() {
        return Err(Failure("the megakernel needs an sm_90 (Hopper) card".into()));
    }
    let seeds: Vec<u64> = (0..cfg.layers).map(|l| layer_seed(ctx.seed, l)).collect();
    let weights = seeds.iter().map(|&s| generate_weights(dev, &cfg, s)).collect::<Result<Vec<_>, _>>()?;
    let caches = || seeds.iter().map(|&s| DeviceCache::generate(dev, &cfg, s)).collect::<Result<Vec<_>, _>>();
    let mut runs = [
        ("the stack kernel", Megakernel::new(Mode::Fused), caches()?),
        ("the split kernel", Megakernel::new(Mode::Fused).split_over_one(), caches()?),
        ("the split kernel a launch per phase", Megakernel::new(Mode::PerPhase).split_over_one(), caches()?),
    ];
    for (_, mk, c) in &mut runs {
        mk.build_stack(dev, &mut Layer::stack(&weights, c), &cfg)?;
    }
    let (plain, split) = (runs[0].1.phases().unwrap_or(0), runs[1].1.phases().unwrap_or(0));
    ensure(split == plain + 2 * cfg.layers as u32, || {
        format!(
            "the split program has {split} phases over {} layers, the stack's {plain}: not two Reduce rows a layer",
            cfg.layers
        )
    })?;
    let seed: u64 = rand::random();
    for s in 0..steps {
        let pos = cfg.prefill + s;
        let x = dev.stream().clone_htod(&input(&cfg, seed, s)).context("uploading x")?;
        let mut states = Vec::new();
        for (_, mk, c) in &mut runs {
            states.push(stack_states(dev, mk, &weights, c, &x, pos)?);
        }
        for ((what, _, _), got) in runs.iter().zip(&states).skip(1) {
            ensure(bits(got) == bits(&states[0]), || {
                format!("pos {pos}: {what}'s states differ from the stack kernel's: {}", Diff::of(got, &states[0]))
            })?;
        }
    }
    let read = |v: &CudaSlice<bf16>| dev.stream().clone_dtoh(v).context("reading a cache");
    for (what, _, c) in runs.iter().skip(1) {
        for (l, (a, b)) in c.iter().zip(&runs[0].2).enumerate() {
            ensure(bits(&read(&a.k)?) == bits(&read(&b.k)?) && bits(&read(&a.v)?) == bits(&read(&b.v)?), || {
                format!("layer {l}: {what}'s caches differ from the stack kernel's")
            })?;
        }
    }
    Ok(format!(
        "{} layers, {steps} steps: the split kernel's states and caches (fused, and a launch per phase) equal the stack \
         kernel's bit for bit, {} phases a layer against {}; input seed {seed:#x}",
        cfg.layers,
        split / cfg.layers as u32,
        plain / cfg.layers as u32
    ))
}

/// `steps` steps of the fused megakernel over the `cfg.layers` layers of a stack (each with its own
/// weights and cache, in the compiler's plan, packed or streaming Qkv and GateUp `in_place` from the
/// weights as handed over), the phase-per-launch mode, and per layer the eager
/// reference on the fused run's own input to that layer: fused and per-phase hidden states, outputs
/// and caches bitwise equal, every layer within the gate of the eager layer, the last step bitwise
/// equal when repeated.
fn stack_matches(ctx: &mut Ctx, cfg: Config, steps: usize, in_place: bool) -> CheckResult {
    let dev = &ctx.dev;
    if !dev.is_hopper() {
        return Err(Failure("the megakernel needs an sm_90 (Hopper) card".into()));
    }
    let (depth, row) = (cfg.layers, cfg.batch * cfg.d);
    let seeds: Vec<u64> = (0..depth).map(|l| layer_seed(ctx.seed, l)).collect();
    let weights = seeds.iter().map(|&s| generate_weights(dev, &cfg, s)).collect::<Result<Vec<_>, _>>()?;
    let caches = || seeds.iter().map(|&s| DeviceCache::generate(dev, &cfg, s)).collect::<Result<Vec<_>, _>>();
    let (mut fused_caches, mut phases_caches, mut eager_caches) = (caches()?, caches()?, caches()?);
    let mut fused = Megakernel::new(Mode::Fused).in_place(in_place);
    let mut phases = Megakernel::new(Mode::PerPhase).in_place(in_place);
    fused.build_stack(dev, &mut Layer::stack(&weights, &mut fused_caches), &cfg)?;
    phases.build_stack(dev, &mut Layer::stack(&weights, &mut phases_caches), &cfg)?;
    let mut eager = Eager::new(dev, &cfg)?;
    let seed: u64 = rand::random();
    let poisoned = |n: usize| dev.stream().clone_htod(&vec![bf16::NAN; n]).context("allocating an output");
    let read = |v: &CudaSlice<bf16>| dev.stream().clone_dtoh(v).context("reading an output");
    let run = |mk: &mut Megakernel, caches: &mut Vec<DeviceCache>, x: &CudaSlice<bf16>, pos: usize| {
        stack_states(dev, mk, &weights, caches, x, pos)
    };
    let mut worst = (0f64, 0);
    for s in 0..steps {
        let pos = cfg.prefill + s;
        let x_host = input(&cfg, seed, s);
        let x = dev.stream().clone_htod(&x_host).context("uploading x")?;
        let f = run(&mut fused, &mut fused_caches, &x, pos)?;
        let p = run(&mut phases, &mut phases_caches, &x, pos)?;
        ensure(bits(&f) == bits(&p), || format!("pos {pos}: fused and per-phase states differ: {}", Diff::of(&f, &p)))?;
        for (l, (w, cache)) in weights.iter().zip(&mut eager_caches).enumerate() {
            let layer_in = if l == 0 { &x_host[..] } else { &f[(l - 1) * row..l * row] };
            let layer_in = dev.stream().clone_htod(layer_in).context("uploading a layer's input")?;
            let mut e = poisoned(row)?;
            eager.step(dev, w, cache, &layer_in, pos, &mut e)?;
            let err = rel_err(&to_f32(&f[l * row..(l + 1) * row]), &to_f32(&read(&e)?)).unwrap_or(f64::INFINITY);
            ensure(err <= Gates::TASK.rel_err_tol, || {
                format!("pos {pos}, layer {l}: rel error {err:.3e} against the eager layer")
            })?;
            if err > worst.0 {
                worst = (err, l);
            }
        }
        if s + 1 == steps {
            let again = run(&mut fused, &mut fused_caches, &x, pos)?;
            ensure(bits(&again) == bits(&f), || {
                format!("pos {pos}: a repeated step differs: {}", Diff::of(&again, &f))
            })?;
        }
    }
    for (l, (cf, cp)) in fused_caches.iter().zip(&phases_caches).enumerate() {
        let (kf, kp) = (read(&cf.k)?, read(&cp.k)?);
        let (vf, vp) = (read(&cf.v)?, read(&cp.v)?);
        ensure(bits(&kf) == bits(&kp) && bits(&vf) == bits(&vp), || {
            format!("layer {l}: fused and per-phase caches differ")
        })?;
    }
    Ok(format!(
        "{depth} layers, {steps} steps in one launch each: worst rel error {:.2e} (layer {}) vs the eager layer on the \
         same input; fused == per-phase bitwise (states and caches); repeat bitwise; input seed {seed:#x}",
        worst.0, worst.1
    ))
}

/// `small` with 4 KV heads over 60,000 cached positions: 938 attention chunks per head, which the 132
/// teams of each half of an H200's grid take as 63 splits of 15 chunks, their running max and sum kept
/// across a split's chunks while the next chunk loads (the graded layer's splits are two chunks each).
fn deep_cache() -> Config {
    Config { name: "small-deep".into(), n_q: 32, n_kv: 4, prefill: 60_000, max_seq_len: 60_128, ..Config::small() }
}

/// `small` with other heads: at hd 256 a chunk is 32 slots; 16 query heads fill the tensor-core tiles'
/// rows; with more KV heads than a half's teams (288 over 2 halves against 132), a head is one team's
/// item and its team writes the output without a combine.
fn shape(name: &str, n_q: usize, n_kv: usize, hd: usize) -> Config {
    Config { name: name.into(), n_q, n_kv, hd, ..Config::small() }
}

/// [`matches_in`] in one role, and in two where the layer has two KV heads or more.
fn matches(ctx: &mut Ctx, cfg: Config, steps: usize) -> CheckResult {
    let dev = &ctx.dev;
    if !dev.is_hopper() {
        return Err(Failure("the megakernel needs an sm_90 (Hopper) card".into()));
    }
    let w = reference::gpu::generate_weights(dev, &cfg, ctx.seed)?;
    let roles = if cfg.n_kv >= 2 { 1..=2 } else { 1..=1 };
    let said: Vec<String> = roles
        .map(|r| {
            let said = matches_in(ctx, &cfg, &w, Forced { roles: Some(r), mlp_parts: None }, steps);
            said.map(|s| format!("{r} role(s): {s}")).map_err(|Failure(f)| Failure(format!("{r} role(s): {f}")))
        })
        .collect::<Result<_, _>>()?;
    Ok(said.join("; "))
}

/// `steps` steps of the fused megakernel laid out as `forced` says, the phase-per-launch mode and the
/// eager reference on fresh inputs, each on its own cache: fused and per-phase outputs and caches
/// bitwise equal, within the gate of the eager reference, and the last step bitwise equal when
/// repeated.
fn matches_in(
    ctx: &Ctx,
    cfg: &Config,
    w: &reference::gpu::DeviceWeights,
    forced: Forced,
    steps: usize,
) -> Result<String, Failure> {
    let dev = &ctx.dev;
    let mut fused_cache = DeviceCache::generate(dev, cfg, ctx.seed)?;
    let mut phases_cache = DeviceCache::generate(dev, cfg, ctx.seed)?;
    let mut eager_cache = DeviceCache::generate(dev, cfg, ctx.seed)?;
    let mut fused = Megakernel::new(Mode::Fused).forcing(forced);
    let mut phases = Megakernel::new(Mode::PerPhase).forcing(forced);
    fused.build_layer(dev, Layer { weights: w, cache: &mut fused_cache }, cfg)?;
    phases.build_layer(dev, Layer { weights: w, cache: &mut phases_cache }, cfg)?;
    let mut eager = Eager::new(dev, cfg)?;
    let seed: u64 = rand::random();
    let poisoned = || dev.stream().clone_htod(&vec![bf16::NAN; cfg.d]).context("allocating an output");
    let read = |v: &CudaSlice<bf16>| dev.stream().clone_dtoh(v).context("reading an output");
    let mut worst = 0f64;
    for s in 0..steps {
        let pos = cfg.prefill + s;
        let x = dev.stream().clone_htod(&input(cfg, seed, s)).context("uploading x")?;
        let (mut of, mut op, mut oe) = (poisoned()?, poisoned()?, poisoned()?);
        fused.layer_step(dev, Layer { weights: w, cache: &mut fused_cache }, &x, pos, &mut of)?;
        phases.layer_step(dev, Layer { weights: w, cache: &mut phases_cache }, &x, pos, &mut op)?;
        eager.step(dev, w, &mut eager_cache, &x, pos, &mut oe)?;
        let (f, p, e) = (read(&of)?, read(&op)?, read(&oe)?);
        ensure(bits(&f) == bits(&p), || {
            format!("pos {pos}: fused and per-phase outputs differ: {}", Diff::of(&f, &p))
        })?;
        let err = rel_err(&to_f32(&f), &to_f32(&e)).unwrap_or(f64::INFINITY);
        ensure(err <= Gates::TASK.rel_err_tol, || {
            format!("pos {pos}: rel error {err:.3e} against the eager reference")
        })?;
        worst = worst.max(err);
        if s + 1 == steps {
            // The same step again: same input, same position, same bits.
            let mut again = poisoned()?;
            fused.layer_step(dev, Layer { weights: w, cache: &mut fused_cache }, &x, pos, &mut again)?;
            let again = read(&again)?;
            ensure(bits(&again) == bits(&f), || {
                format!("pos {pos}: a repeated step differs: {}", Diff::of(&again, &f))
            })?;
        }
    }
    let cache = |c: &DeviceCache| -> Result<Vec<bf16>, Failure> {
        let mut kv = dev.stream().clone_dtoh(&c.k).context("reading K")?;
        kv.extend(dev.stream().clone_dtoh(&c.v).context("reading V")?);
        Ok(kv)
    };
    let (cf, cp, ce) = (cache(&fused_cache)?, cache(&phases_cache)?, cache(&eager_cache)?);
    ensure(bits(&cf) == bits(&cp), || format!("fused and per-phase caches differ: {}", Diff::of(&cf, &cp)))?;
    let cache_err = rel_err(&to_f32(&cf), &to_f32(&ce)).unwrap_or(f64::INFINITY);
    ensure(cache_err <= 1e-3, || format!("cache differs from the eager reference's by {cache_err:.2e}"))?;
    Ok(format!(
        "{steps} steps: worst rel error {worst:.2e} vs eager; fused == per-phase bitwise; repeat bitwise; cache rel {cache_err:.1e}; input seed {seed:#x}"
    ))
}

fn bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}
