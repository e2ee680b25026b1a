//! A whole model, as the megakernel will run it (the model issue): a Hugging Face Llama-family
//! checkpoint read from its directory (`hf`), and its decode step on the CPU (`cpu`): the token's
//! embedding, every decoder layer as the golden model computes it, the final norm, the LM head in f32
//! and a greedy argmax with a fixed tie rule. The CPU side is what the GPU's one-launch decode will
//! be checked against; the GPU side is not built yet.

pub mod cpu;
pub mod hf;

pub use cpu::{CpuModel, argmax};
pub use hf::{ModelConfig, ModelError, ModelWeights};

#[cfg(test)]
mod tests;
