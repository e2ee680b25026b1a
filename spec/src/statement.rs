//! The task statement for people, filled in from a configuration (`grader spec`): the layer, the
//! contract, every call of the schedule, the gates and the byte model. `docs/task.md` says the same
//! in prose; a test pins its figures to these.

use std::fmt::Write;

use crate::{ByteModel, Config, Gates, Phase};

// The first line's indent is escaped: a line continuation swallows leading spaces.
const COMPUTATION: &str = "\
\x20 h  = rmsnorm(x, in_norm)                      # x * rsqrt(mean(x^2) + eps) * g, sums in fp32
  q  = h @ Wq^T ; k = h @ Wk^T ; v = h @ Wv^T   # grouped-query attention
  q, k = rope(q, pos), rope(k, pos)             # rotate-half, fp32 tables
  K[:, :, pos] = k ; V[:, :, pos] = v           # append this position in place, bf16
  a  = softmax(q . K[:pos+1]^T / sqrt(hd)) @ V[:pos+1]
  x  = x + a_flat @ Wo^T
  h  = rmsnorm(x, post_norm)
  x  = x + (silu(h @ Wgate^T) * (h @ Wup^T)) @ Wdown^T
  return x";

const CONTRACT: &str = "\
contract (Rust: trait submission::Submission; C: submission/include/persistent_layer.h):
  build_layer(weights, kv_cache, cfg) -> handle   untimed: repack, build tables, allocate
  layer_step(handle, x, pos, out)                 one token: out from x, K and V written at slot pos
  teardown(handle)                                frees what build_layer made
  tensors: bf16, row-major, a matrix (out, in) applied as h @ W^T: in_norm, post_norm (d);
  q (n_q*hd, d); k, v (n_kv*hd, d); o (d, n_q*hd); gate, up (ffn, d); down (d, ffn);
  cache k, v (batch, n_kv, max_seq_len, hd) each; x, out (batch, d)
contract (Python: a .py module, torch tensors; submission/examples/python/):
  build_layer(weights, kv_cache, cfg, max_seq_len) -> handle   untimed; imports and JIT go here
  layer_step(handle, x, pos) -> x_out                          one token, K and V written at slot pos
  teardown(handle)                                             optional
  weights  {\"layers\": [{\"in_norm\", \"post_norm\", \"q\", \"k\", \"v\", \"o\", \"gate\", \"up\", \"down\"}]},
           CUDA tensors of the shapes above
  kv_cache [(k, v)], each (batch, n_kv, max_seq_len, hd) bf16, slot pos written in place
  cfg      dict: layers = 1, batch, d, ffn, n_q, n_kv, hd, eps, theta, wdtype = torch.bfloat16
  x        (batch, d) bf16 CUDA tensor; x_out a plain, contiguous (batch, d) torch.Tensor, bf16 or
           fp32, on the same GPU
  weights and x are read-only; the cache is written only at slot pos; the judge process owns the
  inputs, the outputs and the clock, the submission runs in a child 'runner' process";

/// The statement of the task at `cfg`, with its schedule, gates and byte model; for a stack of layers,
/// how it is judged and what it moves.
pub fn statement(cfg: &Config) -> String {
    if cfg.layers > 1 {
        return stack_statement(cfg);
    }
    let mut s = String::new();
    let _ = writeln!(s, "persistent-layer: one Llama-style decoder layer at batch 1, one decode position per call");
    let _ = writeln!(s, "(the task statement in full: docs/task.md)\n");
    let _ = writeln!(s, "the layer:\n{COMPUTATION}\n");
    let _ = writeln!(s, "config '{}':", cfg.name);
    let _ = writeln!(s, "{}", shape(cfg));
    let _ = writeln!(
        s,
        "  KV cache: {} slots, 0..{} prefilled; weights and cache bf16\n",
        cfg.max_seq_len,
        cfg.prefill - 1
    );
    let _ = writeln!(s, "{CONTRACT}\n");
    schedule(&mut s, cfg);
    gates(&mut s);
    byte_model(&mut s, cfg);
    s
}

/// A stack: its layers, how a call through all of them is judged, and the bytes a token moves through
/// all of them, which give the floor.
fn stack_statement(cfg: &Config) -> String {
    let mut s = String::new();
    let b = ByteModel::of(cfg);
    let layers = cfg.layers as u64;
    let _ = writeln!(
        s,
        "persistent-layer: a stack of {} Llama-style decoder layers at batch 1, one decode position per call",
        cfg.layers
    );
    let _ = writeln!(
        s,
        "(judged layer by layer: each layer's output against the eager reference's layer on the submission's own\n\
         input to it, at the one-layer tolerance; docs/stack.md has the design, docs/depth.md the measurements)\n"
    );
    let _ = writeln!(s, "each layer:\n{COMPUTATION}\n");
    let _ = writeln!(s, "config '{}': {} layers, each of", cfg.name, cfg.layers);
    let _ = writeln!(s, "{}", shape(cfg));
    let _ = writeln!(
        s,
        "  KV cache per layer: {} slots, 0..{} prefilled; layer l's weights and cache from the weight seed's\n  \
         layer seed (spec::data::layer_seed: layer 0 is the one-layer config's own)\n",
        cfg.max_seq_len,
        cfg.prefill - 1
    );
    let _ = writeln!(
        s,
        "contract: build_stack / stack_step (Rust), pl_build_stack / pl_stack_step (C ABI version 2), the task\n  \
         statement's lists (Python): every layer's weights and cache; a step writes out and hidden, (layers - 1, batch,\n  \
         d), row l the output of layer l; the weights are read in place (no room for a second copy)\n"
    );
    schedule(&mut s, cfg);
    gates(&mut s);
    let _ = writeln!(
        s,
        "in a stack, correctness holds for every layer of every call, on the submission's own input to it:\n  \
         ||out - ref|| / ||ref|| <= {:e}, and ||out - ref|| / ||ref - input|| <= {} (the error over the layer's update)\n",
        Gates::TASK.rel_err_tol,
        Gates::TASK.stack_update_tol
    );
    let _ = writeln!(s, "byte model (one step at the deepest timed position):");
    for (name, v) in [
        ("weight matrices", b.matrices),
        ("KV read to deepest timed pos", b.kv_read),
        ("total (floor numerator)", b.total),
    ] {
        let _ = writeln!(s, "  {name:<30} {v:>15} bytes per layer {:>18} bytes the stack", v * layers);
    }
    let _ = writeln!(
        s,
        "  device memory for one copy of the weights and caches: {:.1} GB",
        crate::bytes::data_bytes(cfg, 0).unwrap_or(u64::MAX) as f64 / 1e9
    );
    s
}

/// A layer's shape on one line.
fn shape(cfg: &Config) -> String {
    format!(
        "  d {}  ffn {}  n_q {}  n_kv {}  hd {}  eps {:e}  theta {}",
        cfg.d, cfg.ffn, cfg.n_q, cfg.n_kv, cfg.hd, cfg.eps, cfg.theta
    )
}

/// Every phase of the run: which calls, at which positions, and what the judge does around them.
fn schedule(s: &mut String, cfg: &Config) {
    let calls = crate::schedule(cfg);
    let _ = writeln!(
        s,
        "schedule: {} calls of layer_step, every one recorded (CUPTI) and compared with the reference;\n\
         each phase starts again at pos {}:",
        calls.len(),
        cfg.prefill
    );
    for phase in Phase::ALL {
        let of_phase: Vec<_> = calls.iter().filter(|c| c.phase == phase).collect();
        let (first, last) = (of_phase[0], of_phase[of_phase.len() - 1]);
        let _ = writeln!(
            s,
            "  {:<11} calls {:>3}..{:<3} pos {}..{}  {}",
            format!("{phase:?}").to_lowercase(),
            first.index,
            last.index,
            first.pos,
            last.pos,
            phase.describe()
        );
    }
    let _ = writeln!(s);
}

/// The gates, by the names reports give them, each with what it checks in one line.
fn gate_lines() -> [(&'static str, String); 9] {
    let g = Gates::TASK;
    [
        (
            "correctness",
            format!(
                "||out - ref|| / ||ref|| <= {:e} on every call, no NaN/Inf; every call's appends, the cache and read-only buffers intact",
                g.rel_err_tol
            ),
        ),
        ("kernels_per_step", format!("at most {} kernels on every call, every call recorded", g.max_kernels_per_step)),
        ("dominant_share", format!("the largest kernel takes >= {} of each call's kernel time", g.min_dominant_share)),
        (
            "launch_record",
            "two independent CUPTI paths agree, recording never off, no device-side launches, every thread block the hardware counted in a recorded kernel"
                .into(),
        ),
        (
            "record_coverage",
            format!(
                "recorded GPU work covers >= {} of most timed calls and of one back-to-back attempt; HOST BUSY, never a pass, where only this fails on a host busy before or after the run",
                g.min_coverage
            ),
        ),
        ("exclusive_gpu", "no process but the judge and its runner on the GPU, none started during the steps".into()),
        (
            "bytes_read",
            "DRAM bytes each call reads (the judge's hardware counters) >= 0.98x the byte model; UNAUDITED, never a pass, without them"
                .into(),
        ),
        ("l2_persisting", "no persisting-L2 set-aside or access-policy window".into()),
        (
            "plausible_timing",
            "no faster than the read-only bandwidth measured in the run allows; runner and judge clocks agree".into(),
        ),
    ]
}

fn gates(s: &mut String) {
    let _ = writeln!(s, "gates (each must pass):");
    for (name, what) in gate_lines() {
        let _ = writeln!(s, "  {name:<17} {what}");
    }
    let _ = writeln!(s);
}

/// The bytes one step must move, and the floor and score they give.
fn byte_model(s: &mut String, cfg: &Config) {
    let b = ByteModel::of(cfg);
    let _ = writeln!(s, "byte model (one step):");
    for (name, v) in [
        ("weight matrices", b.matrices),
        ("norm vectors", b.norms),
        ("KV read to deepest timed pos", b.kv_read),
        ("KV append", b.kv_append),
        ("x in + x_out", b.activations),
        ("weights + KV", b.weights_plus_kv),
        ("total (floor numerator)", b.total),
    ] {
        let _ = writeln!(s, "  {name:<30} {v:>15} bytes");
    }
    let _ = writeln!(
        s,
        "\nfloor = total bytes / copy bandwidth measured on the same device in the same run;\n\
         score = tokens/s (1 / median time of a timed call); x floor = median time / floor."
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_statement_shows_every_phase_and_gate() {
        let text = statement(&Config::graded());
        assert!(text.contains("136 calls"), "{text}");
        for line in ["correctness calls   0..7   pos 4096..4103", "timed       calls   8..39  pos 4096..4127"] {
            assert!(text.contains(line), "no '{line}' in\n{text}");
        }
        assert!(text.contains("throughput  calls  40..135 pos 4096..4127  timed back to back"), "{text}");
        for gate in
            ["correctness", "kernels_per_step", "dominant_share", "launch_record", "record_coverage", "bytes_read"]
        {
            assert!(text.lines().any(|l| l.trim_start().starts_with(gate)), "no gate {gate}");
        }
        assert!(text.contains("1728253952 bytes"), "{text}");
        for form in PYTHON_FORMS {
            assert!(text.contains(form), "no Python form '{form}' in\n{text}");
        }
        assert!(text.contains("the layer:\n  h  = rmsnorm(x, in_norm)"), "the layer's first line is indented: {text}");
    }

    /// A stack's statement says how it is judged, and gives the stack's bytes as the layer's times its
    /// depth.
    #[test]
    fn a_stacks_statement_multiplies_the_layer_and_says_how_it_is_judged() {
        let stack = crate::family::find_stack("stack-70b").unwrap().config();
        let text = statement(&stack);
        assert!(text.starts_with("persistent-layer: a stack of 80 Llama-style decoder layers"), "{text}");
        assert!(text.contains("judged layer by layer"), "{text}");
        let total = ByteModel::of(&stack).total;
        assert_eq!(total, ByteModel::of(&Config::graded()).total);
        assert!(text.contains(&format!("{total:>15} bytes per layer {:>18} bytes the stack", 80 * total)), "{text}");
        assert!(text.contains("device memory for one copy of the weights and caches: 138.3 GB"), "{text}");
        assert!(text.contains("gates (each must pass)"), "{text}");
        assert!(text.contains("||out - ref|| / ||ref - input|| <= 0.1"), "{text}");
    }

    /// The Python contract's calls, as the statement prints them and `docs/task.md` states them.
    const PYTHON_FORMS: [&str; 3] = [
        "build_layer(weights, kv_cache, cfg, max_seq_len) -> handle",
        "layer_step(handle, x, pos) -> x_out",
        "teardown(handle)",
    ];

    /// `docs/task.md` quotes the graded figures in prose: they must be the ones `grader spec` prints.
    #[test]
    fn the_task_document_quotes_these_figures() {
        let doc = include_str!("../../docs/task.md");
        let cfg = Config::graded();
        let with_commas = |v: u64| {
            let digits = v.to_string();
            let mut out = String::new();
            for (i, c) in digits.chars().enumerate() {
                if i > 0 && (digits.len() - i).is_multiple_of(3) {
                    out.push(',');
                }
                out.push(c);
            }
            out
        };
        let b = ByteModel::of(&cfg);
        for v in [b.matrices, b.norms, b.kv_read, b.kv_append, b.activations, b.weights_plus_kv, b.total] {
            assert!(doc.contains(&format!("| {} |", with_commas(v))), "docs/task.md lacks {}", with_commas(v));
        }
        for (field, v) in [("d", cfg.d), ("ffn", cfg.ffn), ("prefill", cfg.prefill), ("max_seq_len", cfg.max_seq_len)] {
            assert!(doc.contains(&format!("| {field} | {v} |")), "docs/task.md lacks the row of {field}");
        }
        let g = Gates::TASK;
        for quoted in [
            format!("at most {:e}", g.rel_err_tol),
            format!("at most {} kernels", g.max_kernels_per_step),
            format!("at least {} of the call's kernel time", g.min_dominant_share),
            format!("makes {} calls", crate::schedule(&cfg).len()),
        ] {
            assert!(doc.contains(&quoted), "docs/task.md lacks '{quoted}'");
        }
        for phase in Phase::ALL {
            let row = format!("| {} | {} calls", format!("{phase:?}").to_lowercase(), phase.calls(&cfg));
            assert!(doc.contains(&row), "docs/task.md lacks '{row}'");
        }
        for (gate, _) in gate_lines() {
            assert!(doc.contains(&format!("| {gate} |")), "docs/task.md lacks the gate {gate}");
        }
        let flat = doc.split_whitespace().collect::<Vec<_>>().join(" ");
        for form in PYTHON_FORMS {
            assert!(flat.contains(&format!("`{form}`")), "docs/task.md lacks the Python form '{form}'");
        }
        assert!(
            flat.contains("or by the path of a Python module (a `.py` file"),
            "docs/task.md: naming a .py submission"
        );
    }
}
