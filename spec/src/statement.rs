//! The task statement for people, filled in from a configuration (`grader spec`).

use std::fmt::Write;

use crate::{ByteModel, Config, Gates};

const COMPUTATION: &str = "\
h  = rmsnorm(x, in_norm)                 # x * rsqrt(mean(x^2) + eps) * g, sums in fp32
q  = h @ Wq^T ; k = h @ Wk^T ; v = h @ Wv^T   # grouped-query attention
q, k = rope(q, pos), rope(k, pos)        # rotate-half, fp32 tables
K[:, :, pos] = k ; V[:, :, pos] = v      # append this position in place, bf16
a  = softmax(q . K[:pos+1]^T / sqrt(hd)) @ V[:pos+1]
x  = x + a_flat @ Wo^T
h  = rmsnorm(x, post_norm)
x  = x + (silu(h @ Wgate^T) * (h @ Wup^T)) @ Wdown^T
return x";

/// The statement of the task at `cfg`, with its gates and byte model.
pub fn statement(cfg: &Config) -> String {
    let b = ByteModel::of(cfg);
    let g = Gates::TASK;
    let mut s = String::new();
    let _ = writeln!(s, "persistent-layer: one Llama-style decoder layer at batch 1, one decode position per call\n");
    let _ = writeln!(s, "{COMPUTATION}\n");
    let _ = writeln!(s, "config '{}':", cfg.name);
    let _ = writeln!(
        s,
        "  d {}  ffn {}  n_q {}  n_kv {}  hd {}  eps {:e}  theta {}",
        cfg.d, cfg.ffn, cfg.n_q, cfg.n_kv, cfg.hd, cfg.eps, cfg.theta
    );
    let _ = writeln!(
        s,
        "  prefilled KV slots 0..{}  cache capacity {}  bf16 weights and cache",
        cfg.prefill - 1,
        cfg.max_seq_len
    );
    let _ = writeln!(
        s,
        "  schedule: {} calls, every one recorded and compared; each phase starts at pos {}",
        crate::schedule(cfg).len(),
        cfg.prefill
    );
    for phase in crate::Phase::ALL {
        let _ = writeln!(
            s,
            "    {:<12} {:>3} calls  {}",
            format!("{phase:?}").to_lowercase(),
            phase.calls(cfg),
            phase.describe()
        );
    }
    let _ = writeln!(s);
    let _ = writeln!(s, "contract:");
    let _ = writeln!(s, "  build_layer(weights, kv_cache, cfg, max_seq_len) -> handle   untimed");
    let _ = writeln!(s, "  layer_step(handle, x, pos, out)                         timed, one token");
    let _ = writeln!(s, "  weights and x are read-only; the cache is written only at slot pos\n");
    let _ = writeln!(s, "gates:");
    let _ =
        writeln!(s, "  1. relative error ||x_out - ref|| / ||ref|| <= {:e} at every step, no NaN/Inf", g.rel_err_tol);
    let _ = writeln!(s, "  2. kernels per step (CUPTI) <= {}", g.max_kernels_per_step);
    let _ = writeln!(s, "  3. largest kernel's share of a step's kernel time >= {}\n", g.min_dominant_share);
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
    let _ = writeln!(s, "\nfloor = total bytes / stream-copy bandwidth measured on the same device; score = tokens/s.");
    s
}
