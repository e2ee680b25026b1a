//! The megakernel's kernel files: `kernels/megakernel/megakernel.cu` (one layer and a stack, which
//! the judge launches) and `split.cu` (the stack with Reduce rows, a layer split over GPUs), compiled
//! by the root build script; and with the `model` feature
//! `kernels/megakernel/model/model.cu` (a whole checkpoint; compiled by this crate's build script),
//! both running the device code of `kernels/megakernel/megakernel.cuh` (the machine, `vm_*.cuh`, and
//! one file per kind of task, `op_*.cuh`, with the program's layout, `program.cuh`), built for Hopper.

pub use ::kernels::megakernel::*;

use spec::Config;

/// Mirrors of the kernel's sizes (`kernels/megakernel/vm_config.cuh`, `vm_trace.cuh`, `vm_stream.cuh`; a test
/// checks them against the files).
pub const THREADS: u32 = 512;
pub(crate) const WARPS: u32 = THREADS / 32;
pub(crate) const STAGES: u32 = 3;
pub(crate) const STAGE_BYTES: u32 = 64 * 1024;
pub(crate) const RING_BYTES: u32 = STAGES * STAGE_BYTES;
pub(crate) const ATTN_MAX_HD: usize = 256;
pub(crate) const ATTN_MAX_GROUP: usize = 16;
/// Stamps per block and phase in a trace (`trace_step`): start, input ready, stream done and end, in
/// ns, then the SM the block ran it on (`TRACE_SM`).
pub const TRACE_STAMPS: usize = 5;
/// The last of a phase's times in its stamps: its end.
pub const TRACE_END: usize = 3;
/// Where a phase's stamps hold the SM that ran it (`%smid`, written with its start).
pub const TRACE_SM: usize = 4;
/// Vectors one weight stream serves at most: a model's batch step's lanes, or a prompt chunk's
/// positions (the kernel's `MAX_BATCH`).
pub const MAX_BATCH: usize = 8;
/// The widest GEMV rows that the kernel runs in slices of the block (`row_slices`: half a block's
/// 16-byte vectors of 8 bf16): a layer or model with such rows gets the sliced instance of its kernel
/// (`LayerProgram::kernel`, `model::gpu`'s `model_kernel`). Choosing by a wrong width would cost speed,
/// never a bit of the output.
pub(crate) const SLICED_MAX_COLS: usize = THREADS as usize / 2 * 8;
/// Whether some GEMV of the layer has rows of at most SLICED_MAX_COLS columns: Qkv's and GateUp's have
/// d, the O projection's q_dim, Down's ffn.
pub(crate) fn has_narrow_rows(cfg: &Config) -> bool {
    [cfg.d, cfg.q_dim(), cfg.ffn].into_iter().min().unwrap_or(0) <= SLICED_MAX_COLS
}

/// The row gather of `kernels/megakernel/megakernel.cu` that packs weights (the red team packs cache rows with it).
pub const GATHER: &str = "gather_rows_u4";

/// Threads per block of the packing gather.
pub const GATHER_BLOCK: u32 = 256;

/// The megakernel's device code, every header of `kernels/megakernel/` in the order `megakernel.cuh`
/// includes them, then the judge's kernels and the split kernel: what the tests that check a Rust mirror against the kernel
/// read (a test checks that no header of the folder is missing here).
#[cfg(test)]
pub const DEVICE_SOURCE: &str = concat!(
    include_str!("../../kernels/megakernel/megakernel.cuh"),
    include_str!("../../kernels/megakernel/program.cuh"),
    include_str!("../../kernels/megakernel/vm_config.cuh"),
    include_str!("../../kernels/megakernel/vm_memory.cuh"),
    include_str!("../../kernels/megakernel/vm_deps.cuh"),
    include_str!("../../kernels/megakernel/vm_trace.cuh"),
    include_str!("../../kernels/megakernel/vm_stream.cuh"),
    include_str!("../../kernels/megakernel/vm_pairs.cuh"),
    include_str!("../../kernels/megakernel/vm_gemv.cuh"),
    include_str!("../../kernels/megakernel/op_qkv.cuh"),
    include_str!("../../kernels/megakernel/op_attention.cuh"),
    include_str!("../../kernels/megakernel/op_oproj.cuh"),
    include_str!("../../kernels/megakernel/op_gateup.cuh"),
    include_str!("../../kernels/megakernel/op_down.cuh"),
    include_str!("../../kernels/megakernel/op_reduce.cuh"),
    include_str!("../../kernels/megakernel/vm_run.cuh"),
    include_str!("../../kernels/megakernel/op_head.cuh"),
    include_str!("../../kernels/megakernel/vm_model.cuh"),
    include_str!("../../kernels/megakernel/vm_batch.cuh"),
    include_str!("../../kernels/megakernel/megakernel.cu"),
    include_str!("../../kernels/megakernel/split.cu"),
);

#[cfg(feature = "model")]
include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

/// What the model's kernels may spill, and why.
#[cfg(all(test, feature = "model"))]
const MODEL_ALLOWANCES: &[::kernels::Spills] = &[
    ::kernels::Spills {
        function: "megakernel_model_qk_norm_bf16",
        bytes: 172,
        why: "the narrow phases' and the LM head's groups of one beside the q/k norms' epilogue, and attention \
          inlined (as a call, as the other model instances run it, this instance spilled 368 bytes stored and \
          1,064 loaded): 92 bytes stored and 172 loaded since the normed input runs on one vector (Qwen3-0.6B \
          1.6% faster with it: docs/perf.md, \"The normed input on one vector\"), 84 and 140 since the waits \
          are polled in parallel (104 and 176 since attention's tiles stop at the live slots, 56 and 84 \
          before, 100 and 208 before the head's bundles, 136 and 244 before a group's passes stopped at the \
          stage's rows); measured as it is, \
          Qwen3-0.6B decodes 8% faster than without the head's group (docs/perf.md, \"The head in full \
          stages\"), 6% faster than with the passes run whole (\"The step as a dataflow graph: the house \
          first\"), 2% faster than before the bundles (\"The head in bundles\") and 0.7% slower than before \
          the live slots, which made the other models 3-6% faster (\"Attention on blocks of its own\")",
    },
    ::kernels::Spills { function: "megakernel_model_qk_norm_traced_bf16", bytes: 176, why: TRACED_SPILLS },
    ::kernels::Spills { function: "megakernel_model_bf16", bytes: 8, why: ROW_BY_VALUE_SPILLS },
    ::kernels::Spills { function: "megakernel_model_traced_bf16", bytes: 8, why: ROW_BY_VALUE_SPILLS },
    ::kernels::Spills { function: "megakernel_model_sliced_bf16", bytes: 8, why: ROW_BY_VALUE_SPILLS },
    ::kernels::Spills { function: "megakernel_model_sliced_traced_bf16", bytes: 8, why: ROW_BY_VALUE_SPILLS },
    ::kernels::Spills { function: "megakernel_model_fp8", bytes: 8, why: FP8_SPILLS },
    ::kernels::Spills { function: "megakernel_model_traced_fp8", bytes: 8, why: FP8_SPILLS },
    ::kernels::Spills { function: "megakernel_model_nf4", bytes: 100, why: NF4_SPILLS },
    ::kernels::Spills {
        function: "megakernel_model_sliced_nf4",
        bytes: 936,
        why: "the nf4 stream's own copy of every stream width beside the bf16 one, and the pair-tile stream of \
          rows of 2048 columns (two tiles a stage) and 4096 (vm_pairs.cuh, NARROW): 280 bytes stored and 936 \
          loaded since the normed input runs on one vector (272 and 816 before; Llama-3.2-1B in nf4 1.5% and \
          SmolLM2-360M in nf4 2.6% faster with it: docs/perf.md, \"The landed build on a GPU\"; 4 and 8 without \
          the pair tiles), one or two reloads a stage in the pair-tile and fused loops, seven in an epilogue's; \
          measured as it is, Llama-3.2-1B in nf4 decodes 16.5% faster and TinyLlama-1.1B 14.3% faster than with \
          their rows of 2048 in bf16 (docs/perf.md, \"nf4 rows of 2048 columns in pair tiles\")",
    },
    ::kernels::Spills {
        function: "attention_call",
        bytes: 4,
        why: "the sliced nf4 instance's attention, a call, reloads one word (4 bytes loaded, none stored) since \
          that instance streams pair tiles too (its allocation moved; every other instance's call spills none)",
    },
    ::kernels::Spills { function: "megakernel_model_batch_bf16", bytes: 640, why: BATCH_SPILLS },
    ::kernels::Spills {
        function: "megakernel_model_batch_fp8",
        bytes: 732,
        why: "as the bf16 batch step's (BATCH_SPILLS), and with one stage of the ring in flight (model_fp8_batch.cu's \
          RING_IN_FLIGHT) 732 bytes stored and 724 loaded (360 and 624 with two); measured as it is, 8 lanes of \
          Llama-3.2-1B in fp8 a step 1.9% faster than with two (docs/perf.md, \"The batch step with one stage in \
          flight\")",
    },
    ::kernels::Spills { function: "megakernel_model_batch_nf4", bytes: 640, why: BATCH_SPILLS },
    ::kernels::Spills { function: "batch_phase", bytes: 4776, why: BATCH_SPILLS },
    ::kernels::Spills { function: "batch_head", bytes: 512, why: BATCH_SPILLS },
];

/// Why the batch step (`megakernel_model_batch_bf16`, its phases and head) may spill.
#[cfg(all(test, feature = "model"))]
const BATCH_SPILLS: &str = "a batch step holds a group's inputs, up to 64 f32 a thread, beside a phase's state at the 128 \
                            registers a 512-thread block has; ptxas keeps its GEMV phases as calls and saves registers \
                            around them. Measured as it is (docs/perf.md): 8 sequences decode at 2.0-3.3x the \
                            throughput of one; the decode step's kernels spill at most 176 bytes. The fp8 batch \
                            step's GEMVs (their mangled names carry batch_phase too) hold a vector's 8 code values \
                            beside the group: up to 1,504 bytes stored and 4,776 loaded (4,632 before its ring kept one \
                            stage in flight; the nf4 batch step's 1,384 and 3,956, and 1,388 and 4,016 with two), the \
                            bf16 ones' 736 and 2,240";

/// Why the model kernel's bf16 instances without q/k norms may spill.
#[cfg(all(test, feature = "model"))]
const ROW_BY_VALUE_SPILLS: &str = "attention's row passed to its call by value (attention_call): 4 bytes stored and 8 loaded \
                                   where they spilled none, against the 50 local loads of the row passed by reference in \
                                   attention's copy loops; measured as it is, Llama-3.2-1B decodes 1.3% faster, chain-1b \
                                   0.9% and SmolLM2-360M 0.5% (docs/perf.md, \"Attention's row by value in the bf16 \
                                   instances\")";

/// Why the model kernel's fp8 instances may spill.
#[cfg(all(test, feature = "model"))]
const FP8_SPILLS: &str = "the fp8 stream's own copy of every stream width beside the bf16 one, in the instance for wide \
                          rows and its traced twin (128 registers were full before it): 4 bytes stored and 8 \
                          loaded; the sliced instance and its twin spill none. With each stage's scales loaded from \
                          global memory inside the products they spilled 68 / 204 and 32 / 216 (docs/perf.md, \
                          \"The fp8 stream, run\")";

/// Why the model kernel's nf4 instances may spill.
#[cfg(all(test, feature = "model"))]
const NF4_SPILLS: &str = "the nf4 stream's own copy of every stream width beside the bf16 one and the codebook's address \
                          beside the scale slots' (128 registers were full before it), and the pair-tile stream on \
                          the tensor cores (vm_pairs.cuh): 20 bytes stored and 72 loaded (4 and 8 before the pair \
                          tiles), none in a stream's loop. Measured as it is, Llama-3.1-8B in nf4 decodes 7% faster \
                          than with the fused nf4 form alone and 2.2x faster than streaming bf16 (docs/perf.md, \"Pair \
                          tiles in the megakernel\")";

/// Why the model kernel's traced instance with q/k norms may spill.
#[cfg(all(test, feature = "model"))]
const TRACED_SPILLS: &str = "the traced instance computes where each phase's stamps go beside the q/k-norm instance's \
                             state (96 bytes stored, 176 loaded; the other traced instances spill what their twins do); it runs for \
                             `megakernel bench --trace` and `decode_step_timed`, to read where a token's time goes, \
                             never for a timed figure";

#[cfg(all(test, feature = "model"))]
mod tests {
    /// The model's kernels are all there, with code, spilling no more than their allowances, and
    /// none launches from the device (the judge's scanner, as the grader's test runs it on the rest).
    #[test]
    fn the_models_kernels_are_embedded_and_spill_only_as_allowed() {
        ::kernels::assert_embedded(super::model::FOLDER, super::model::ALL, super::MODEL_ALLOWANCES);
        for k in super::model::ALL {
            assert!(submission::device_code::scan(k.fatbin).is_empty(), "{}", k.name);
        }
    }
}

#[cfg(test)]
mod mirror_tests {
    use super::*;
    use crate::program::{self, Blocks};

    use super::DEVICE_SOURCE as CU;
    // The attention's shared-memory layout, mirrored to check that every head size fits.
    const KS_PAD: usize = 8;
    const PS_PAD: usize = 4;
    const PB_PAD: usize = 8;
    /// Chunk buffers per attention team.
    const ATTN_BUFFERS: usize = 2;

    #[test]
    fn narrow_rows_are_those_that_run_in_slices() {
        let with = |d, nq, hd, ffn| Config { d, n_q: nq, hd, ffn, ..Config::graded() };
        // SmolLM2-360M, Llama-3.2-1B (d 2048, the widest rows in slices), Qwen3-0.6B.
        assert!(has_narrow_rows(&with(960, 15, 64, 2560)));
        assert!(has_narrow_rows(&with(2048, 32, 64, 8192)));
        assert!(has_narrow_rows(&with(1024, 16, 128, 3072)));
        // Llama-3.1-8B, Llama-3.2-3B (3072 wide), the graded layer: no row in slices.
        assert!(!has_narrow_rows(&with(4096, 32, 128, 14336)));
        assert!(!has_narrow_rows(&with(3072, 24, 128, 8192)));
        assert!(!has_narrow_rows(&Config::graded()));
    }

    #[test]
    fn constants_mirror_the_kernel() {
        for line in [
            format!("constexpr uint32_t THREADS = {THREADS};"),
            format!("constexpr uint32_t TRACE_STAMPS = {TRACE_STAMPS};"),
            format!("constexpr uint32_t TRACE_END = {TRACE_END};"),
            format!("constexpr uint32_t TRACE_SM = {TRACE_SM};"),
            format!("constexpr uint32_t STAGES = {STAGES};"),
            format!("constexpr uint32_t STAGE_BYTES = {} * 1024;", STAGE_BYTES / 1024),
            format!("constexpr uint32_t MAX_VPT = {};", program::MAX_ROW / (THREADS as usize * 8)),
            format!("constexpr uint32_t ATTN_MAX_HD = {ATTN_MAX_HD};"),
            format!("constexpr uint32_t ATTN_MAX_GROUP = {ATTN_MAX_GROUP};"),
            format!("constexpr uint32_t ATTN_MAX_CHUNK = {};", program::ATTN_MAX_CHUNK),
            format!("constexpr uint32_t ATTN_CHUNK_ELEMS = {} * 128;", program::ATTN_CHUNK_ELEMS / 128),
            format!("constexpr uint32_t ATTN_MAX_SPLITS = {};", program::ATTN_MAX_SPLITS),
            format!("constexpr uint32_t TEAMS = {};", program::ATTN_TEAMS),
            format!("constexpr uint32_t KS_PAD = {KS_PAD};"),
            format!("constexpr uint32_t PS_PAD = {PS_PAD};"),
            format!("constexpr uint32_t ATTN_BUFFERS = {ATTN_BUFFERS};"),
            format!("constexpr uint32_t PB_PAD = {PB_PAD};"),
            "return (2 * ATTN_BUFFERS * chunk + ATTN_MAX_GROUP) * (hd + KS_PAD) * 2 + ATTN_MAX_GROUP * (chunk + PS_PAD) * 4 + 3 * ATTN_MAX_GROUP * 4 +".to_string(),
            "ATTN_MAX_GROUP * (chunk + PB_PAD) * 2;".to_string(),
            format!("__global__ void {GATHER}("),
        ] {
            assert!(CU.contains(&line), "kernels/megakernel/ lacks `{line}`");
        }
    }

    /// The kernel's `blocks_of` takes the fields where `Blocks::word` puts them.
    #[test]
    fn the_kernel_decodes_the_blocks_word_as_it_is_encoded() {
        assert!(CU.contains("return {(uint32_t)(w >> 32) & 0xFFFFu, (uint32_t)w, (uint32_t)(w >> 48) & 0x7FFFu};"));
        let w = Blocks { first: 1, count: 66, stride: 2 }.word() as u64;
        assert_eq!(((w >> 32) & 0xFFFF, w & 0xFFFF_FFFF, (w >> 48) & 0x7FFF), (1, 66, 2));
    }

    /// A team's shared memory for attention chunks of `chunk` slots at head size `hd` (the kernel's
    /// `attn_smem_bytes`: K and V rows of each buffer and Q rows, padded; scores; running statistics;
    /// softmax weights).
    fn attention_smem_bytes(chunk: usize, hd: usize) -> usize {
        (2 * ATTN_BUFFERS * chunk + ATTN_MAX_GROUP) * (hd + KS_PAD) * 2
            + ATTN_MAX_GROUP * (chunk + PS_PAD) * 4
            + 3 * ATTN_MAX_GROUP * 4
            + ATTN_MAX_GROUP * (chunk + PB_PAD) * 2
    }

    /// The attention chunk keeps a team's shared memory within its share of the ring at every head size
    /// the kernel takes.
    #[test]
    fn the_attention_chunk_fits_a_teams_share_at_every_head_size() {
        for hd in (16..=ATTN_MAX_HD).step_by(16) {
            let chunk = program::chunk(&Config { hd, ..Config::graded() });
            assert!(chunk.is_multiple_of(16) && chunk >= 32, "hd {hd}: chunk {chunk}");
            assert!(attention_smem_bytes(chunk, hd) <= RING_BYTES as usize / program::ATTN_TEAMS, "hd {hd}");
        }
        assert_eq!(program::chunk(&Config::graded()), 64);
        assert_eq!(program::chunk(&Config { hd: 64, ..Config::graded() }), 128);
        assert_eq!(program::chunk(&Config { hd: 256, ..Config::graded() }), 32);
    }

    /// Every header of the megakernel's folder is in DEVICE_SOURCE, and megakernel.cuh, the index,
    /// includes each.
    #[test]
    fn the_device_source_holds_every_header() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../kernels/megakernel");
        let index = std::fs::read_to_string(dir.join("megakernel.cuh")).unwrap();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|e| e != "cuh") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let name = path.file_name().unwrap().to_str().unwrap();
            assert!(CU.contains(&text), "DEVICE_SOURCE lacks kernels/megakernel/{name}");
            if name != "megakernel.cuh" {
                assert!(index.contains(&format!("#include \"{name}\"")), "megakernel.cuh does not include {name}");
            }
        }
    }
}
