//! Checks that the GPU generates the run's data bitwise equal to the CPU recipe of `spec::data`.

use cuda::Context;
use half::bf16;
use reference::gpu::data::{DeviceCache, fill_normal, generate_input};
use spec::Config;
use spec::data::Tensor;
use spec::rng::{normal_bf16, scale_for_std, stream_key};

use super::{Check, CheckResult, Ctx, Failure, ensure};

pub fn checks() -> Vec<Check> {
    vec![
        Check { name: "rng: fill equals CPU bitwise", run: fill_bitwise },
        Check { name: "rng: tiny layer equals CPU bitwise", run: |c| layer_bitwise(c, Config::tiny()) },
        Check { name: "rng: small layer equals CPU bitwise", run: |c| layer_bitwise(c, Config::small()) },
    ]
}

/// The first index where two bf16 tensors differ in any bit.
fn first_difference(gpu: &[bf16], cpu: &[bf16]) -> Option<usize> {
    if gpu.len() != cpu.len() {
        return Some(gpu.len().min(cpu.len()));
    }
    gpu.iter().zip(cpu).position(|(a, b)| a.to_bits() != b.to_bits())
}

fn compare(what: &str, gpu: &[bf16], cpu: &[bf16]) -> Result<(), Failure> {
    match first_difference(gpu, cpu) {
        None => Ok(()),
        Some(i) => Err(Failure(format!(
            "{what}: element {i} differs (gpu {:?}, cpu {:?}) of {}",
            gpu.get(i),
            cpu.get(i),
            cpu.len()
        ))),
    }
}

/// Plain fills of several sizes (odd ones included), seeds, means and scales.
fn fill_bitwise(ctx: &mut Ctx) -> CheckResult {
    let cases: [(usize, u64, f32, f64); 5] = [
        (1, 1, 0.0, 1.0),
        (1000, 2, 1.0, 0.1),
        ((1 << 20) + 3, 3, 0.0, 0.011),
        (10_000_019, 0xDEAD_BEEF, -2.0, 3.0),
        (77, u64::MAX, 0.0, 1e-3),
    ];
    let mut total = 0;
    for (n, seed, mean, std) in cases {
        let key = stream_key(seed, 42);
        let scale = scale_for_std(std);
        let gpu = fill_normal(&ctx.dev, n, key, mean, scale)?;
        let gpu = ctx.dev.stream().clone_dtoh(&gpu).context("reading a fill")?;
        let cpu: Vec<bf16> = (0..n as u64).map(|i| normal_bf16(key, i, mean, scale)).collect();
        compare(&format!("n={n} seed={seed}"), &gpu, &cpu)?;
        ensure(cpu.iter().any(|v| v.to_f32() != cpu[0].to_f32()) || n == 1, || format!("n={n}: constant fill"))?;
        total += n;
    }
    Ok(format!("{} cases, {total} elements identical", cases.len()))
}

/// Every weight, both cache tensors and a few inputs of a whole layer.
fn layer_bitwise(ctx: &mut Ctx, cfg: Config) -> CheckResult {
    let dev = &ctx.dev;
    let weights = reference::gpu::generate_weights(dev, &cfg, ctx.seed)?;
    let mut total = 0;
    for &t in Tensor::WEIGHTS {
        let gpu = dev.stream().clone_dtoh(weights.get(t)).context("reading a weight")?;
        compare(t.name(), &gpu, &spec::data::weight(&cfg, ctx.seed, t))?;
        total += gpu.len();
    }
    let cache = DeviceCache::generate(dev, &cfg, ctx.seed)?;
    for (t, buf) in [(Tensor::KCache, &cache.k), (Tensor::VCache, &cache.v)] {
        let gpu = dev.stream().clone_dtoh(buf).context("reading the cache")?;
        compare(t.name(), &gpu, &spec::data::cache(&cfg, ctx.seed, t))?;
        total += gpu.len();
    }
    for call in [0, 1, 31] {
        let gpu = generate_input(dev, &cfg, ctx.seed ^ 0xABCD, call)?;
        let gpu = dev.stream().clone_dtoh(&gpu).context("reading an input")?;
        compare(&format!("input {call}"), &gpu, &spec::data::input(&cfg, ctx.seed ^ 0xABCD, call))?;
        total += gpu.len();
    }
    Ok(format!("{} tensors, {total} elements identical", Tensor::ALL.len() + 3))
}
