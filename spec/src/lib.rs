//! The persistent-layer task as data: the configuration, the gates, the byte model, the seeded data
//! recipe and the RNG both the CPU and the GPU draw from. TASK.md states the same numbers in prose;
//! tests pin them so the two cannot drift.

pub mod bytes;
pub mod config;
pub mod data;
pub mod gates;
pub mod rng;
pub mod schedule;
mod statement;

pub use bytes::ByteModel;
pub use config::{CONFIG_NAMES, Config};
pub use data::Tensor;
pub use gates::Gates;
pub use schedule::{Call, Input, Phase, schedule};
pub use statement::statement;

/// The public seed of weights and KV prefix when none is given.
pub const DEFAULT_SEED: u64 = 0x5EED_0001;

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("unknown config '{name}': use one of {known}, or the path of a JSON file")]
    UnknownConfig { name: String, known: String },
    #[error("config file {path}: {reason}")]
    BadConfigFile { path: String, reason: String },
    #[error("invalid config: field '{field}': {reason}")]
    InvalidConfig { field: &'static str, reason: String },
}
