//! A whole model as the megakernel runs it: a Hugging Face Llama-family checkpoint read from its
//! directory (`hf`; bitsandbytes nf4 and fp8 weights dequantised as they are read, `quantized`, and a
//! quantised checkpoint's codes kept for the model kernel to stream, `code_stream`) with
//! its tokenizer (`text`); its decode step on the CPU (`cpu`: the token's embedding, every decoder
//! layer as the golden model computes it, the final norm, the LM head in f32 and a greedy argmax with
//! a fixed tie rule); and the same on the GPU in one launch of the model kernel, for a decode step, a
//! whole generation or a batch step of several sequences or prompt positions (`gpu`), checked against
//! the CPU side (the `megakernel check` command); what a step or a generation may ask for, refused in
//! the same words on both (`request`); several prompts generated together, a batch step per position
//! (`together`). Where a token's time goes in a traced launch is the crate's `trace`, which reads a
//! stack's step the same way.

pub mod code_stream;
pub mod cpu;
pub mod gpu;
pub mod hf;
pub mod quantized;
pub mod request;
pub mod text;
pub mod together;

pub use cpu::{CpuModel, argmax};
pub use gpu::{Generation, GpuModel, GpuModelError, WeightStream};
pub use hf::{Element, ModelConfig, ModelError, ModelWeights};
pub use request::{Lane, Limits, MAX_EOS, Stop};
pub use text::Text;
pub use together::{check_together, generate_together};

#[cfg(test)]
mod tests;
