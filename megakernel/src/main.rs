//! `megakernel`: a Hugging Face Llama-family checkpoint run by the megakernel, the whole decode step
//! (embedding, every layer, final norm, LM head, greedy argmax) in one launch, a whole generation in one
//! launch. `generate` prints text, `bench` times the decode against the model's copy floor, `check`
//! compares the GPU with the CPU model, `logits` prints teacher-forced logits for other tools, and
//! `batch-gemv` checks and times the batched GEMV (`megakernel::batch`) without a model.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, Subcommand, ValueEnum};
use cuda::{Context, Device};
use megakernel::Trace;
use megakernel::batch::BatchGemv;
use megakernel::model::{
    CpuModel, GpuModel, Lane, MAX_EOS, ModelConfig, ModelWeights, Stop, Text, WeightStream, argmax, gpu,
};
use spec::rng::{bits, stream_key};

#[derive(Parser)]
#[command(
    name = "megakernel",
    about = "Run a Hugging Face Llama-family checkpoint with the megakernel: a whole generation in one launch",
    after_help = "Supported: model_type \"llama\" (Llama 2, 3, 3.1, 3.2 with plain or llama3-scaled RoPE, TinyLlama, SmolLM2, \
                  ...) and \"qwen3\", bf16, f16 or f32 safetensors, or quantised in bitsandbytes nf4 or fine-grained fp8 (read into bf16, their codes streamed where rows are wider than 2048 columns). Anything else is refused naming the config field. Needs an \
                  H100/H200 (sm_90)."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args)]
struct ModelArgs {
    /// The checkpoint's folder: config.json, model.safetensors (or shards and their index),
    /// tokenizer.json for text.
    #[arg(long)]
    model: PathBuf,
    /// The KV caches' positions (at most the model's own context).
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..))]
    context: u32,
    /// The CUDA device.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Stream a quantised checkpoint's weights as bf16 (as the loader dequantised them) rather than as
    /// their fp8 or nf4 codes, which decode steps stream where rows are wider than 2048 columns: outputs
    /// that part from the codes' fused products by the weights' rounding to bf16, for timing one stream
    /// against the other.
    #[arg(long)]
    bf16_stream: bool,
}

impl ModelArgs {
    fn stream(&self) -> WeightStream {
        if self.bf16_stream { WeightStream::Bf16 } else { WeightStream::AsStored }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Generate text greedily from a prompt, prefill and every new token in one launch.
    Generate {
        #[command(flatten)]
        model: ModelArgs,
        /// The prompt (the tokenizer adds the model's start token).
        prompt: String,
        /// New tokens at most; the generation stops earlier at an end-of-sequence token.
        #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
        max_new: u32,
    },
    /// Time the decode: ms per token of a generation in one launch, and of a launch per token, against
    /// the model's copy floor (its bytes per token over the measured device-to-device copy bandwidth);
    /// then `--batch` sequences decoded together, and a prompt prefilled `--batch` positions a launch.
    Bench {
        #[command(flatten)]
        model: ModelArgs,
        /// Tokens generated per timed launch (end-of-sequence ignored).
        #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..))]
        tokens: u32,
        /// Timed launches; the median is reported.
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
        reps: u32,
        /// Sequences decoded together by batch steps, each step one launch for all of them (1: none),
        /// and the prompt's chunk for the chunked prefill's timing.
        #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=gpu::MAX_BATCH as i64))]
        batch: u32,
        /// Then run the generation once more in the model kernel's traced instance (every block stamps
        /// the global timer around each phase) and print where a token's time goes along its critical
        /// path: per kind of phase on it, the hand-off from the end of the phase it waited for last, the
        /// median block's work and what the blocks later than the median add. An fp8 checkpoint whose
        /// decode steps stream codes is traced streaming them (with --bf16-stream, streaming bf16); an
        /// nf4 checkpoint is traced streaming bf16 (its instances have no traced twin), and the trace
        /// says so.
        #[arg(long)]
        trace: bool,
        /// With --trace, also write every stamp of the traced launch to FILE as a NumPy array
        /// (`numpy.load`): u64 of shape (positions, blocks, phases, 5), the phases a position runs in
        /// order (row r of layer l at l * rows + r, the head last), each phase's stamps its start, its
        /// input in registers, its stream done and its end in ns, 0 where a block does not take one,
        /// then the SM the block ran it on. scripts/trace-blocks.py reads it.
        #[arg(long, value_name = "FILE", requires = "trace")]
        trace_stamps: Option<PathBuf>,
    },
    /// Check the GPU against the CPU model on random tokens: each position's logits, the kernel's
    /// greedy token against the argmax of its logits, a generation in one launch against a launch per
    /// token; and batch steps against decode steps, bitwise: a prompt in chunks, and several sequences
    /// decoded together. Ends with an 'N passed, M failed' line; exit status 1 on a failure.
    Check {
        #[command(flatten)]
        model: ModelArgs,
        /// Positions to decode.
        #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(2..))]
        positions: u32,
        /// Sequences of the batched decode's check (each joins a step after the one before).
        #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(2..=gpu::MAX_BATCH as i64))]
        batch: u32,
        /// The random tokens' seed (default: from the clock, printed).
        #[arg(long)]
        seed: Option<u64>,
    },
    /// Print, as JSON, the f32 logits after each of the given tokens, teacher-forced from position 0
    /// ({"logits": [[...], ...], "argmax": [...]}).
    Logits {
        #[command(flatten)]
        model: ModelArgs,
        /// Comma-separated token ids.
        #[arg(long, value_delimiter = ',', required = true)]
        tokens: Vec<u32>,
        /// Where to decode.
        #[arg(long, value_enum, default_value_t = On::Gpu)]
        on: On,
    },
    /// Check and time several vectors through one weight stream, the first piece of batched decode and
    /// chunked prefill: for each row length and batch, a random matrix against random inputs, the
    /// grouped stream (the weights read once per group) against each vector streamed alone as a decode
    /// step streams it (bitwise) and against f64 products on the CPU, and both kernels' time. Ends with
    /// an 'N passed, M failed' line; exit status 1 on a failure.
    BatchGemv {
        /// Row lengths (the GEMV's columns), multiples of 8 up to 28672.
        #[arg(long, value_delimiter = ',', default_value = "2048,4096,8192,14336")]
        cols: Vec<u32>,
        /// Batches: vectors per stream, 1 to 8.
        #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
        vectors: Vec<u32>,
        /// The matrix's size in MiB (its rows follow from the row length).
        #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=16384))]
        mib: u32,
        /// Timed launches of each kind per shape; the median is reported.
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
        reps: u32,
        /// The random data's seed (default: from the clock, printed).
        #[arg(long)]
        seed: Option<u64>,
        /// The CUDA device.
        #[arg(long, default_value_t = 0)]
        device: usize,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum On {
    Cpu,
    Gpu,
}

/// A line on stdout, as println! writes it, but a closed stdout (a pipe into `head`) ends the command
/// quietly with the status a shell gives a process its pipe closed (128 + SIGPIPE), not a panic.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout().lock(), $($arg)*) {
            stdout_failed(e)
        }
    }};
}

fn stdout_failed(e: std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(128 + 13);
    }
    eprintln!("megakernel: error: writing to stdout: {e}");
    std::process::exit(2)
}

/// Relative error of the logits beside the CPU model's that `check` accepts, per square root of the
/// layers: the grader's tolerance for one layer's output, grown as a random walk over the layers (two
/// honest roundings part further with each layer: 6.4e-3 after 3 layers, 2.5e-2 after 16, measured
/// in docs/model.md).
const LOGITS_TOL_PER_SQRT_LAYER: f64 = 1.5e-2;

type Failure = Box<dyn std::error::Error>;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            progress("");
            eprintln!("megakernel: error: {e}");
            ExitCode::from(2)
        }
    }
}

/// Runs a command; `Ok(false)` when a check failed.
fn run(command: Command) -> Result<bool, Failure> {
    match command {
        Command::Generate { model, prompt, max_new } => generate(&model, &prompt, max_new as usize).map(|()| true),
        Command::Bench { model, tokens, reps, batch, trace, trace_stamps } => {
            bench(&model, tokens as usize, reps as usize, batch as usize, trace, trace_stamps.as_deref()).map(|()| true)
        }
        Command::Check { model, positions, batch, seed } => check(&model, positions as usize, batch as usize, seed),
        Command::Logits { model, tokens, on } => logits(&model, &tokens, on).map(|()| true),
        Command::BatchGemv { cols, vectors, mib, reps, seed, device } => {
            batch_gemv(&cols, &vectors, mib, reps as usize, seed, device)
        }
    }
}

/// A progress line on stderr: on a terminal overwritten by the next (and cleared by an empty one),
/// elsewhere one line each.
fn progress(line: &str) {
    if std::io::stderr().is_terminal() {
        eprint!("\r\x1b[2K{line}");
    } else if !line.is_empty() {
        eprintln!("{line}");
    }
}

/// The checkpoint in `dir`, once `accept` has taken its config (so that a refusal comes before the
/// weights are read).
fn read_model(
    dir: &Path,
    accept: impl Fn(&ModelConfig) -> Result<(), Failure>,
) -> Result<(ModelConfig, ModelWeights), Failure> {
    progress(&format!("reading {}", dir.join("config.json").display()));
    let cfg = ModelConfig::read(dir)?;
    accept(&cfg)?;
    progress(&format!("reading the weights of {} layers", cfg.layer.layers));
    let weights = ModelWeights::read(dir, &cfg)?;
    Ok((cfg, weights))
}

/// The model read (see read_model) and uploaded with caches for `sequences` sequences.
fn load(
    args: &ModelArgs,
    sequences: usize,
    accept: impl Fn(&ModelConfig) -> Result<(), Failure>,
) -> Result<(Device, GpuModel, ModelConfig, ModelWeights), Failure> {
    let (cfg, weights) = read_model(&args.model, accept)?;
    let dev = Device::open(args.device)?;
    let model =
        GpuModel::new(&dev, &cfg, &weights, args.context as usize, sequences, args.stream(), &mut |s| progress(s))?;
    progress("");
    eprintln!("{}", summary(&cfg, &model));
    Ok((dev, model, cfg, weights))
}

fn summary(cfg: &ModelConfig, model: &GpuModel) -> String {
    let l = &cfg.layer;
    // A quantised checkpoint: what its decode steps stream, and so which bytes a floor counts.
    let weights = model.streams().map_or(String::new(), |w| format!("\nweights: {w}"));
    format!(
        "model: {} layers, d {}, ffn {}, {} heads / {} KV heads of {}, vocab {}, {} head; caches of {} positions\n\
         program: {}{weights}",
        l.layers,
        l.d,
        l.ffn,
        l.n_q,
        l.n_kv,
        l.hd,
        cfg.vocab,
        if cfg.tied { "tied" } else { "separate" },
        model.context(),
        model.describe()
    )
}

fn generate(args: &ModelArgs, prompt: &str, max_new: usize) -> Result<(), Failure> {
    let text = Text::read(&args.model)?;
    let (dev, mut model, cfg, _) = load(args, 1, |cfg| match cfg.eos.len() {
        n if n > MAX_EOS => {
            Err(format!("config.json names {n} end-of-sequence tokens; the kernel stops at {}", MAX_EOS).into())
        }
        _ => Ok(()),
    })?;
    let tokens = text.encode(prompt)?;
    let room = model.context().saturating_sub(tokens.len());
    let g = model.generate(&dev, &tokens, max_new.min(room.max(1)), &cfg.eos)?;
    out!("{}{}", prompt, text.decode(&g.tokens)?);
    let why = match g.stop {
        Stop::Eos => "an end-of-sequence token",
        Stop::MaxNew => "--max-new",
        Stop::Context => "the end of the caches",
    };
    eprintln!(
        "{} new tokens after a prompt of {} in one launch: {:.1} ms in the kernel ({:.1} ms on the host), {:.1} tokens/s \
         over the {} positions; stopped at {why}",
        g.tokens.len(),
        tokens.len(),
        g.kernel_ms,
        g.elapsed.as_secs_f64() * 1e3,
        g.positions as f64 / (f64::from(g.kernel_ms) / 1e3),
        g.positions
    );
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The device-to-device copy bandwidth in bytes per second (read plus written), the median of ten
/// driver copies between two 1 GiB buffers of random data after three untimed ones.
fn copy_bandwidth(dev: &Device) -> Result<f64, Failure> {
    const BYTES: usize = 1 << 30;
    let src = reference::gpu::data::fill_normal(dev, BYTES / 2, 0xC0_B7, 0.0, 1.0)?;
    let mut dst = dev.stream().alloc_zeros::<half::bf16>(BYTES / 2).context("allocating the copy's destination")?;
    let mut times = Vec::new();
    for rep in 0..13 {
        let ms = dev.time_ms(|| dev.stream().memcpy_dtod(&src, &mut dst).context("copying"))?;
        if rep >= 3 {
            times.push(f64::from(ms));
        }
    }
    Ok(2.0 * BYTES as f64 / (median(times) / 1e3))
}

/// `stamps`: where to write the traced launch's stamps (`--trace-stamps`, with `trace` only).
fn bench(
    args: &ModelArgs,
    tokens: usize,
    reps: usize,
    batch: usize,
    trace: bool,
    stamps: Option<&Path>,
) -> Result<(), Failure> {
    let (dev, mut model, cfg, _) = load(args, batch, |_| Ok(()))?;
    let tokens = tokens.min(model.context());
    let bandwidth = copy_bandwidth(&dev)?;
    // Positions 0 .. tokens, each a decode step with the LM head.
    let bytes: u64 = (0..tokens).map(|p| model.bytes_at(p)).sum();
    let floor_ms = bytes as f64 / tokens as f64 / bandwidth * 1e3;
    let start = [cfg.bos.unwrap_or(0)];
    model.generate(&dev, &start, tokens, &[])?; // warm-up
    let one_launch = median(
        (0..reps)
            .map(|_| model.generate(&dev, &start, tokens, &[]).map(|g| f64::from(g.kernel_ms) / g.positions as f64))
            .collect::<Result<_, _>>()?,
    );
    let per_token = median(
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                let mut token = start[0];
                for pos in 0..tokens {
                    let logits = model.decode_step(&dev, token, pos)?;
                    token = argmax(&logits).unwrap_or(0) as u32;
                }
                Ok::<_, Failure>(t.elapsed().as_secs_f64() * 1e3 / tokens as f64)
            })
            .collect::<Result<_, _>>()?,
    );
    out!(
        "copy bandwidth {:.2} TB/s; {:.3} GB per token on average over positions 0..{tokens}: floor {floor_ms:.3} ms/token",
        bandwidth / 1e12,
        bytes as f64 / tokens as f64 / 1e9
    );
    out!("{:<44} {:>10} {:>9} {:>9}", "decode", "ms/token", "tokens/s", "x floor");
    for (what, ms) in [
        (format!("one launch for {tokens} tokens (kernel time)"), one_launch),
        ("a launch per token, logits read back (host)".to_string(), per_token),
    ] {
        out!("{what:<44} {ms:>10.3} {:>9.1} {:>9.3}", 1e3 / ms, ms / floor_ms);
    }
    if batch > 1 {
        bench_batch(&dev, &mut model, cfg.bos.unwrap_or(0), tokens, reps, batch, one_launch)?;
    }
    if trace {
        if model.streams_codes() && !model.traces_codes() {
            out!("the traced launch streams bf16: the nf4 instances have no traced twin");
        }
        let trace = model.trace(&dev, &start, tokens)?;
        print_trace(&trace);
        if let Some(path) = stamps {
            std::fs::write(path, trace.to_npy())
                .map_err(|e| format!("writing the stamps to {}: {e}", path.display()))?;
            out!("the traced launch's stamps: {}", path.display());
        }
    }
    Ok(())
}

/// Where a token's time goes in a traced launch (`Trace::shares`).
fn print_trace(trace: &Trace) {
    let positions = trace.traced_positions();
    match trace.shares() {
        None => {
            out!("the traced launch's stamps are incomplete ({} positions run): nothing to read", trace.positions())
        }
        Some(shares) => {
            let over = format!(
                "the mean over positions {}..{}; the traced instance's machine code is not the timed one's",
                positions.start, positions.end
            );
            out!("{}", trace.table(&shares, &over).trim_end());
            out!("the SMs whose blocks end later than half the last block's lead after the median block (their mean):");
            for late in trace.late_sms() {
                let sms: Vec<String> = late.sms.iter().map(u64::to_string).collect();
                out!("{:<10} lead {:>5.2} us: {} SM(s): {}", late.what, late.lead_us, sms.len(), sms.join(" "));
            }
        }
    }
}

/// The batch steps' timing: `batch` sequences decoded together from position 0, greedily, one launch a
/// step (kernel time by events, summed over the steps; median of `reps`), beside `one_launch` ms per
/// token of a single sequence; and a prompt of `tokens` random tokens prefilled in chunks of `batch`
/// positions, beside the same prompt in one launch position by position (`generate` of one token).
fn bench_batch(
    dev: &Device,
    model: &mut GpuModel,
    start: u32,
    tokens: usize,
    reps: usize,
    batch: usize,
    one_launch: f64,
) -> Result<(), Failure> {
    let decode = |model: &mut GpuModel| -> Result<f64, Failure> {
        let (mut next, mut ms) = (vec![start; batch], 0.0);
        for pos in 0..tokens {
            let lanes: Vec<Lane> = (0..batch).map(|seq| Lane { seq, token: next[seq], pos }).collect();
            ms += f64::from(model.decode_batch(dev, &lanes)?);
            next = model.batch_next(dev, batch)?.into_iter().map(|t| t.unwrap_or(0)).collect();
        }
        Ok(ms / (tokens * batch) as f64)
    };
    decode(model)?; // warm-up
    let batched = median((0..reps).map(|_| decode(model)).collect::<Result<_, _>>()?);
    out!(
        "{:<44} {batched:>10.3} {:>9.1}   ({:.2}x the throughput of one sequence)",
        format!("{batch} sequences, a launch per step (kernel time)"),
        1e3 / batched,
        one_launch / batched
    );
    let prompt = tokens_from(clock_seed(), tokens, model.vocab());
    let chunked = |model: &mut GpuModel| -> Result<f64, Failure> {
        let mut ms = 0.0;
        for (c, chunk) in prompt.chunks(batch).enumerate() {
            ms += f64::from(model.decode_batch(dev, &Lane::chunk(0, c * batch, chunk))?);
        }
        Ok(ms)
    };
    chunked(model)?; // warm-up
    let in_chunks = median((0..reps).map(|_| chunked(model)).collect::<Result<_, _>>()?);
    let by_position = median(
        (0..reps)
            .map(|_| model.generate(dev, &prompt, 1, &[]).map(|g| f64::from(g.kernel_ms)))
            .collect::<Result<_, _>>()?,
    );
    out!(
        "prefill of {tokens} tokens: {in_chunks:.3} ms in chunks of {batch} (a launch each), {by_position:.3} ms position by \
         position in one launch ({:.2}x)",
        by_position / in_chunks
    );
    Ok(())
}

/// The check's random tokens: element `i` of the project's hash RNG (`spec::rng`) for `seed`.
fn tokens_from(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let key = stream_key(seed, CHECK_TOKENS_STREAM);
    (0..n as u64).map(|i| (bits(key, i) % vocab as u64) as u32).collect()
}

/// The RNG stream of the check's tokens (any stream: the seed is the check's own).
const CHECK_TOKENS_STREAM: u64 = 0xC4EC;

/// The gates' relative error, a NaN or an Inf in `out` counting as infinitely far.
fn rel_err(out: &[f32], reference: &[f32]) -> f64 {
    spec::gates::rel_err(out, reference).unwrap_or(f64::INFINITY)
}

fn check(args: &ModelArgs, positions: usize, batch: usize, seed: Option<u64>) -> Result<bool, Failure> {
    let (dev, mut model, cfg, weights) = load(args, batch, |_| Ok(()))?;
    let positions = positions.min(model.context());
    let seed = seed.unwrap_or_else(clock_seed);
    out!("seed {seed} (--seed {seed} repeats it), {positions} positions");
    let tokens = tokens_from(seed, positions, cfg.vocab);
    let mut cpu = CpuModel::new(cfg.clone(), weights, positions);
    let (mut passed, mut failed) = (0, 0);
    let mut verdict = |ok: bool, what: String| {
        out!("{} {what}", if ok { "pass" } else { "FAIL" });
        if ok { passed += 1 } else { failed += 1 }
    };
    // Teacher-forced: each position's logits against the CPU model's.
    let (mut worst, mut agree, mut gpu_logits) = (0.0f64, 0, Vec::new());
    for (pos, &t) in tokens.iter().enumerate() {
        let g = model.decode_step(&dev, t, pos)?;
        let c = cpu.decode_step(t, pos);
        worst = worst.max(rel_err(&g, &c));
        agree += usize::from(argmax(&g) == argmax(&c));
        gpu_logits.push(g);
    }
    let tol = LOGITS_TOL_PER_SQRT_LAYER * (cfg.layer.layers as f64).sqrt();
    verdict(
        worst <= tol,
        format!("logits beside the CPU model's, worst of {positions} positions {worst:.3e} (at most {tol:.2e})"),
    );
    out!("     greedy token equal to the CPU model's at {agree} of {positions} positions (a near-tie may differ)");
    // A quantised checkpoint whose decode steps stream its codes: the same positions again through the bf16
    // stream of the loader's weights (the caches written again). The codes' fused products round no
    // weight to bf16, so the two part by those roundings alone: held to the CPU model's bound.
    if model.streams_codes() {
        model.reset(&dev)?;
        let mut apart = 0.0f64;
        for (pos, &t) in tokens.iter().enumerate() {
            apart = apart.max(rel_err(&model.decode_step_bf16(&dev, t, pos)?, &gpu_logits[pos]));
        }
        verdict(
            apart <= tol,
            format!(
                "decode steps streaming the codes beside the bf16 stream of the loader's weights, worst of \
                 {positions} positions {apart:.3e} (at most {tol:.2e})"
            ),
        );
    }
    // A generation in one launch from the first half of the tokens, against a launch per token fed the
    // argmax of its own logits: the same tokens, and the kernel's choice is the logits' argmax.
    let prompt = &tokens[..positions / 2];
    let want = positions - prompt.len();
    let g = model.generate(&dev, prompt, want, &[])?;
    let (mut chained, mut token) = (Vec::new(), None);
    for pos in 0..positions - 1 {
        let t = if pos < prompt.len() { prompt[pos] } else { token.expect("a generated token") };
        let logits = model.decode_step(&dev, t, pos)?;
        if pos + 1 >= prompt.len() {
            token = argmax(&logits).map(|i| i as u32);
            chained.push(token.ok_or("every logit was NaN")?);
        }
    }
    verdict(
        g.tokens == chained,
        format!("{} tokens generated in one launch equal the argmax of a launch per token", g.tokens.len()),
    );
    // An end-of-sequence token: the one generated at the middle of the run stops the same generation
    // at its first occurrence, that token included.
    let eos = chained[chained.len() / 2];
    let first = chained.iter().position(|&t| t == eos).expect("it is in the run");
    let g = model.generate(&dev, prompt, want, &[eos])?;
    verdict(
        g.stop == Stop::Eos && g.tokens == chained[..=first],
        format!("a generation stops at its end-of-sequence token ({eos}, generated token {} of {want})", first + 1),
    );
    // The last teacher-forced position again, as the head of a generation in one launch over the same
    // tokens: the same arithmetic, so the same bits.
    let last = positions - 1;
    model.generate(&dev, &tokens[..=last], 1, &[])?;
    let again = model.last_logits(&dev)?;
    let bitwise = same_bits(&gpu_logits[last], &again);
    verdict(
        bitwise,
        format!("position {last}'s logits the same bits from a decode step and from a generation's launch"),
    );
    // The tokens again as a prompt in chunks of MAX_BATCH positions, a batch step each: every position's
    // logits the bits of its decode step above.
    let mut differ = Differ::new();
    for (c, chunk) in tokens.chunks(gpu::MAX_BATCH).enumerate() {
        model.decode_batch(&dev, &Lane::chunk(0, c * gpu::MAX_BATCH, chunk))?;
        for (i, logits) in model.batch_logits(&dev, chunk.len())?.iter().enumerate() {
            let pos = c * gpu::MAX_BATCH + i;
            differ.compare(pos, logits, &gpu_logits[pos]);
        }
    }
    verdict(
        differ.none(),
        format!(
            "a prompt of {positions} tokens in chunks of {}: every position's logits the bits of its decode step{}",
            gpu::MAX_BATCH,
            differ.describe("positions")
        ),
    );
    let Batched { differ: bitwise, greedy, steps } = check_batched_decode(&dev, &mut model, seed, positions, batch)?;
    verdict(
        bitwise.none(),
        format!(
            "{batch} sequences decoded together ({steps} steps of 1 to {batch} lanes, sequence b joining at step b): \
             every lane's logits the bits of its sequence's own decode steps{}",
            bitwise.describe("(sequence, position)")
        ),
    );
    verdict(greedy, "every lane's greedy token of those steps the argmax of its logits".into());
    out!("{passed} passed, {failed} failed");
    Ok(failed == 0)
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Where logits meant to be the same bits as others are not: the places (positions, or (sequence,
/// position) pairs), and the relative error of the farthest pair, so that a failure says whether the
/// computations parted in their last bits or one of them is wrong.
struct Differ<P> {
    at: Vec<P>,
    farthest: f64,
}

impl<P: std::fmt::Debug> Differ<P> {
    fn new() -> Self {
        Differ { at: Vec::new(), farthest: 0.0 }
    }

    /// Records `at` unless `got` is `want` bit for bit.
    fn compare(&mut self, at: P, got: &[f32], want: &[f32]) {
        if !same_bits(got, want) {
            self.farthest = self.farthest.max(rel_err(got, want));
            self.at.push(at);
        }
    }

    fn none(&self) -> bool {
        self.at.is_empty()
    }

    /// Nothing where every pair was the same bits; else the places (`what` names them) and the farthest.
    fn describe(&self, what: &str) -> String {
        if self.none() {
            return String::new();
        }
        format!(" (not at {what} {:?}; the farthest {:.3e} apart, relative)", self.at, self.farthest)
    }
}

/// What `check_batched_decode` found.
struct Batched {
    /// The (sequence, position) pairs whose logits differ from the decode step's in any bit.
    differ: Differ<(usize, usize)>,
    /// Whether every lane's greedy token was its logits' argmax.
    greedy: bool,
    /// The batch steps run.
    steps: usize,
}

/// `batch` sequences of `positions / 2` random tokens each (at least 2), decoded together by batch
/// steps, sequence b joining at step b (so the lanes' positions differ, and their count grows and
/// shrinks); then each sequence alone by decode steps.
fn check_batched_decode(
    dev: &Device,
    model: &mut GpuModel,
    seed: u64,
    positions: usize,
    batch: usize,
) -> Result<Batched, Failure> {
    let len = (positions / 2).max(2);
    let seqs: Vec<Vec<u32>> =
        (0..batch).map(|b| tokens_from(seed.wrapping_add(1 + b as u64), len, model.vocab())).collect();
    let mut batched: Vec<Vec<Vec<f32>>> = vec![Vec::new(); batch];
    let (mut greedy, steps) = (true, len + batch - 1);
    for k in 0..steps {
        let lanes: Vec<Lane> = (0..batch)
            .filter(|&b| k >= b && k - b < len)
            .map(|b| Lane { seq: b, token: seqs[b][k - b], pos: k - b })
            .collect();
        model.decode_batch(dev, &lanes)?;
        let next = model.batch_next(dev, lanes.len())?;
        for ((lane, logits), next) in lanes.iter().zip(model.batch_logits(dev, lanes.len())?).zip(next) {
            greedy &= next.map(|t| t as usize) == argmax(&logits);
            batched[lane.seq].push(logits);
        }
    }
    let mut differ = Differ::new();
    for (b, tokens) in seqs.iter().enumerate() {
        for (pos, &t) in tokens.iter().enumerate() {
            differ.compare((b, pos), &batched[b][pos], &model.decode_step(dev, t, pos)?);
        }
    }
    Ok(Batched { differ, greedy, steps })
}

fn logits(args: &ModelArgs, tokens: &[u32], on: On) -> Result<(), Failure> {
    let (cfg, weights) = read_model(&args.model, |_| Ok(()))?;
    progress("");
    let logits: Vec<Vec<f32>> = match on {
        On::Cpu => {
            let mut model = CpuModel::new(cfg, weights, tokens.len());
            tokens.iter().enumerate().map(|(pos, &t)| model.decode_step(t, pos)).collect()
        }
        On::Gpu => {
            let dev = Device::open(args.device)?;
            let mut model = GpuModel::new(&dev, &cfg, &weights, tokens.len(), 1, args.stream(), &mut |_| ())?;
            tokens.iter().enumerate().map(|(pos, &t)| model.decode_step(&dev, t, pos)).collect::<Result<_, _>>()?
        }
    };
    let chosen: Vec<Option<usize>> = logits.iter().map(|l| argmax(l)).collect();
    out!("{}", serde_json::json!({ "logits": logits, "argmax": chosen }));
    Ok(())
}

/// A seed from the clock, for checks that draw fresh data each run (and print the seed).
fn clock_seed() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
}

fn batch_gemv(
    cols: &[u32],
    vectors: &[u32],
    mib: u32,
    reps: usize,
    seed: Option<u64>,
    device: usize,
) -> Result<bool, Failure> {
    // Every shape refused before the device is opened.
    let shapes: Vec<BatchGemv> = cols
        .iter()
        .flat_map(|&c| {
            let rows = ((mib as usize) << 20) / (2 * c.max(1) as usize);
            vectors.iter().map(move |&v| BatchGemv { rows: rows.max(1), cols: c as usize, vectors: v as usize })
        })
        .collect();
    for shape in &shapes {
        shape.validate()?;
    }
    let dev = Device::open(device)?;
    let seed = seed.unwrap_or_else(clock_seed);
    out!("seed {seed} (--seed {seed} repeats it); kernel time, median of {reps}");
    out!(
        "{:>6} {:>7} {:>7} {:>6} {:>10} {:>10} {:>8} {:>13} {:>9} {:>9}",
        "cols",
        "rows",
        "vectors",
        "passes",
        "solo us",
        "grouped us",
        "speedup",
        "weights GB/s",
        "bitwise",
        "vs f64"
    );
    let (mut passed, mut failed) = (0, 0);
    for (i, shape) in shapes.iter().enumerate() {
        let r = shape.run(&dev, seed.wrapping_add(i as u64), reps)?;
        let (solo, grouped) = (median(r.solo_us.clone()), median(r.grouped_us.clone()));
        out!(
            "{:>6} {:>7} {:>7} {:>6} {:>10.1} {:>10.1} {:>7.2}x {:>13.0} {:>9} {:>9}",
            shape.cols,
            shape.rows,
            shape.vectors,
            r.passes,
            solo,
            grouped,
            solo / grouped,
            (shape.weight_bytes() * r.passes as u64) as f64 / (grouped * 1e3),
            match (r.mismatches, r.not_finite) {
                (0, 0) => "equal".to_string(),
                (0, n) => format!("{n} unset"),
                (m, _) => format!("{m} differ"),
            },
            r.cpu_rel_err.map_or("not finite".to_string(), |e| format!("{e:.1e}"))
        );
        if r.passed() { passed += 1 } else { failed += 1 }
    }
    out!("{passed} passed, {failed} failed");
    Ok(failed == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn differing_logits_are_placed_and_measured() {
        let seed = clock_seed();
        let logits: Vec<f32> = tokens_from(seed, 64, 1 << 16).iter().map(|&t| t as f32 / 4096.0 - 8.0).collect();
        let mut d = Differ::new();
        d.compare(0, &logits, &logits.clone());
        assert!(d.none() && d.describe("positions").is_empty(), "seed {seed}");
        // One logit a last bit away, then another logit far off: both differ in bits, the second far
        // more.
        let mut near = logits.clone();
        near[3] = f32::from_bits(near[3].to_bits() ^ 1);
        d.compare(1, &near, &logits);
        let after_one = d.farthest;
        assert!(after_one > 0.0 && after_one < 1e-6, "seed {seed}: {after_one}");
        let mut wrong = logits.clone();
        wrong[7] += 100.0;
        d.compare(2, &wrong, &logits);
        let text = d.describe("positions");
        assert_eq!(d.at, [1, 2], "seed {seed}");
        assert!(d.farthest > after_one && text.contains("not at positions [1, 2]"), "seed {seed}: {text}");
        // A NaN counts as infinitely far.
        let mut nan = logits.clone();
        nan[0] = f32::NAN;
        d.compare(3, &nan, &logits);
        assert!(d.farthest.is_infinite(), "seed {seed}");
    }

    #[test]
    fn bad_values_are_refused_before_any_work() {
        let parse = |args: &[&str]| Cli::try_parse_from(std::iter::once("megakernel").chain(args.iter().copied()));
        assert!(parse(&["generate", "--model", "m", "hi"]).is_ok());
        for bad in [
            &["generate", "--model", "m", "--max-new", "0", "hi"][..],
            &["generate", "--model", "m"],
            &["bench", "--model", "m", "--context", "0"],
            &["check", "--model", "m", "--positions", "1"],
            &["logits", "--model", "m"],
            &["logits", "--model", "m", "--tokens", "1,x"],
            &["logits", "--model", "m", "--tokens", "1", "--on", "tpu"],
            &["check", "--model", "m", "--batch", "1"],
            &["check", "--model", "m", "--batch", "9"],
            &["bench", "--model", "m", "--batch", "0"],
            &["bench", "--model", "m", "--batch", "9"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?} parsed");
        }
        let Ok(Cli { command: Command::Logits { tokens, .. } }) =
            parse(&["logits", "--model", "m", "--tokens", "3,1,4"])
        else {
            panic!("logits parses");
        };
        assert_eq!(tokens, [3, 1, 4]);
    }

    #[test]
    fn a_batch_gemv_shape_the_kernel_cannot_run_is_refused_before_the_device_opens() {
        let parse = |args: &[&str]| Cli::try_parse_from(std::iter::once("megakernel").chain(args.iter().copied()));
        let Ok(Cli { command: Command::BatchGemv { cols, vectors, mib, .. } }) = parse(&["batch-gemv"]) else {
            panic!("batch-gemv parses with its defaults");
        };
        assert_eq!((cols, vectors, mib), (vec![2048, 4096, 8192, 14336], vec![1, 2, 4, 8], 256));
        assert!(parse(&["batch-gemv", "--mib", "0"]).is_err());
        // No device on the test machine: these must fail on the shape, naming it, not on the device.
        for (cols, vectors, needle) in [(100, 1, "cols 100"), (2048, 9, "9 vectors"), (2048, 0, "0 vectors")] {
            let e = batch_gemv(&[cols], &[vectors], 1, 1, Some(1), 0).unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        }
    }

    #[test]
    fn the_checks_random_tokens_are_the_seeds_and_in_the_vocabulary() {
        let a = tokens_from(7, 1000, 97);
        assert_eq!(a, tokens_from(7, 1000, 97));
        assert_ne!(a, tokens_from(8, 1000, 97));
        assert!(a.iter().all(|&t| t < 97));
        assert!((0..97).all(|t| a.contains(&t)), "every token is drawn at 1000 draws of 97");
    }

    #[test]
    fn a_non_finite_logit_is_an_infinite_error() {
        assert_eq!(rel_err(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!((rel_err(&[1.0, 0.0], &[0.0, 1.0]) - 2f64.sqrt()).abs() < 1e-12);
        assert_eq!(rel_err(&[f32::NAN, 2.0], &[1.0, 2.0]), f64::INFINITY);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
    }
}
