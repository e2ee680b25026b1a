//! `cargo bench -p megakernel`: `layer_step` of the eager reference and the megakernel at the graded size, on the
//! first GPU. Without one it prints why and measures nothing. The grader's report (`grader run`),
//! not this bench, is the figure of record: this is for quick A/B comparisons while editing kernels.

use criterion::{Criterion, criterion_group, criterion_main};
use cuda::Device;
use megakernel::{Megakernel, Mode};
use reference::gpu::DeviceCache;
use reference::gpu::data::generate_input;
use spec::{Config, DEFAULT_SEED};
use submission::{EagerSubmission, Layer, Submission};

fn layer_step(c: &mut Criterion) {
    let dev = match Device::open(0) {
        Ok(dev) => dev,
        Err(e) => {
            eprintln!("layer_step bench skipped: {e}");
            return;
        }
    };
    let cfg = Config::graded();
    let setup = || -> Result<_, Box<dyn std::error::Error>> {
        let weights = reference::gpu::generate_weights(&dev, &cfg, DEFAULT_SEED)?;
        let cache = DeviceCache::generate(&dev, &cfg, DEFAULT_SEED)?;
        let inputs = (0..cfg.timed_steps).map(|s| generate_input(&dev, &cfg, 7, s)).collect::<Result<Vec<_>, _>>()?;
        let out = dev.stream().alloc_zeros(cfg.d)?;
        Ok((weights, cache, inputs, out))
    };
    let (weights, mut cache, inputs, mut out) = setup().expect("the graded layer fits the GPU");
    let mut group = c.benchmark_group("layer_step");
    group.sample_size(30);
    let subs: [(&str, Box<dyn Submission>); 2] =
        [("reference", Box::new(EagerSubmission::default())), ("megakernel", Box::new(Megakernel::new(Mode::Fused)))];
    for (name, mut sub) in subs {
        if let Err(e) = sub.build_layer(&dev, Layer { weights: &weights, cache: &mut cache }, &cfg) {
            eprintln!("{name} skipped: {e}");
            continue;
        }
        let mut s = 0;
        group.bench_function(name, |b| {
            b.iter(|| {
                let pos = cfg.prefill + s % cfg.timed_steps;
                let layer = Layer { weights: &weights, cache: &mut cache };
                sub.layer_step(&dev, layer, &inputs[s % cfg.timed_steps], pos, &mut out).expect("layer_step");
                dev.synchronize().expect("synchronize");
                s += 1;
            })
        });
    }
    group.finish();
}

criterion_group!(benches, layer_step);
criterion_main!(benches);
