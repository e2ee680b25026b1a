//! The megakernel's kernel files: `kernels/megakernel/megakernel.cu` (one layer and a stack, which
//! the judge launches; compiled by the root build script), and with the `model` feature
//! `kernels/megakernel/model/model.cu` (a whole checkpoint; compiled by this crate's build script),
//! both running the device code of `kernels/megakernel/megakernel.cuh` (with the program's layout,
//! `program.cuh`), built for Hopper.

pub use ::kernels::megakernel::*;

#[cfg(feature = "model")]
include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

/// What the model's kernels may spill, and why.
#[cfg(all(test, feature = "model"))]
const MODEL_ALLOWANCES: &[::kernels::Spills] = &[
    ::kernels::Spills { function: "megakernel_model_bf16", bytes: 8, why: MODEL_SPILLS },
    ::kernels::Spills { function: "megakernel_model_sliced_bf16", bytes: 8, why: MODEL_SPILLS },
    ::kernels::Spills {
        function: "megakernel_model_qk_norm_bf16",
        bytes: 248,
        why: "the model kernel's word (as megakernel_model_bf16), and the narrow phases' and the LM head's groups of one \
          beside the q/k norms' epilogue: 136 bytes stored and 244 loaded (88 and 200 before the index arithmetic's \
          shifts, 28 and 40 before the head's group); measured as it is, Qwen3-0.6B decodes 8% faster than without the \
          head's group (docs/perf.md, the ninth session) and 1% faster than before the shifts (the eleventh)",
    },
    ::kernels::Spills { function: "megakernel_model_traced_bf16", bytes: 256, why: TRACED_SPILLS },
    ::kernels::Spills { function: "megakernel_model_sliced_traced_bf16", bytes: 256, why: TRACED_SPILLS },
    ::kernels::Spills { function: "megakernel_model_qk_norm_traced_bf16", bytes: 256, why: TRACED_SPILLS },
    ::kernels::Spills { function: "megakernel_model_batch_bf16", bytes: 640, why: BATCH_SPILLS },
    ::kernels::Spills { function: "batch_phase", bytes: 3072, why: BATCH_SPILLS },
    ::kernels::Spills { function: "batch_head", bytes: 512, why: BATCH_SPILLS },
];

/// Why the model kernel may spill a word.
#[cfg(all(test, feature = "model"))]
const MODEL_SPILLS: &str = "the model kernel's per-position state (its io, token and head count) cannot live in the \
                            parameter bank as the layer kernels' does; kept in shared memory, one register still \
                            spills around the phases (4 bytes stored, 8 loaded, once per phase); every variant tried \
                            kept it or spilled more (docs/model.md)";

/// Why the batch step (`megakernel_model_batch_bf16`, its phases and head) may spill.
#[cfg(all(test, feature = "model"))]
const BATCH_SPILLS: &str = "a batch step holds a group's inputs, up to 64 f32 a thread, beside a phase's state at the 128 \
                            registers a 512-thread block has; ptxas keeps its GEMV phases as calls and saves registers \
                            around them. Measured as it is (docs/model.md): 8 sequences decode at 2.7-3.1x the \
                            throughput of one; the decode step's kernels spill at most 244 bytes";

/// Why the model kernel's traced instances may spill.
#[cfg(all(test, feature = "model"))]
const TRACED_SPILLS: &str = "a traced instance computes where each phase's stamps go beside the model kernel's state \
                             (4 to 136 bytes stored, 8 to 252 loaded); it runs for `megakernel bench --trace`, to \
                             read where a token's time goes, never for a timed figure";

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
