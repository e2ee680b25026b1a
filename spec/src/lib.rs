//! The persistent-layer task as data: the configuration, the gates, the byte model, the schedule, the
//! seeded data recipe and the RNG both the CPU and the GPU draw from. `docs/task.md` states the same
//! numbers in prose; tests pin them so the two cannot drift.

pub mod bytes;
pub mod config;
pub mod data;
pub mod family;
pub mod gates;
pub mod parallel;
pub mod rng;
pub mod schedule;
mod statement;

pub use bytes::{ByteModel, LayerOp, OpBytes};
pub use config::{CONFIG_NAMES, Config, MAX_DEVICE_BYTES, MAX_SIZE};
pub use data::Tensor;
pub use gates::Gates;
pub use schedule::{BACK_TO_BACK_ATTEMPTS, Call, Input, Phase, back_to_back, call_count, commands, schedule};
pub use statement::statement;

/// The public seed of weights and KV prefix when none is given.
pub const DEFAULT_SEED: u64 = 0x5EED_0001;

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("unknown config '{name}': it is neither a file nor one of {known}")]
    UnknownConfig { name: String, known: String },
    #[error("config file {path}: {reason}")]
    BadConfigFile { path: String, reason: String },
    #[error("invalid config: field '{field}': {reason}")]
    InvalidConfig { field: &'static str, reason: String },
    #[error(
        "invalid config: one copy of the weights, the KV cache and the calls' inputs and outputs would take {}, \
         more than the {} a device could hold: use smaller sizes",
        bytes.map_or_else(|| "more than 2^64 bytes".to_string(), human_bytes),
        human_bytes(*limit)
    )]
    TooLarge { bytes: Option<u64>, limit: u64 },
    #[error("{name} does not split over {gpus} GPUs: {reason}")]
    Unsplittable { name: String, gpus: usize, reason: String },
}

/// `bytes` in decimal units with two decimals: `5.91 TB`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 7] = ["B", "kB", "MB", "GB", "TB", "PB", "EB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1000.0 && unit + 1 < UNITS.len() {
        value /= 1000.0;
        unit += 1;
    }
    if unit == 0 { format!("{bytes} B") } else { format!("{value:.2} {}", UNITS[unit]) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_bytes_picks_the_unit() {
        assert_eq!(human_bytes(999), "999 B");
        assert_eq!(human_bytes(1_728_184_320), "1.73 GB");
        assert_eq!(human_bytes(5_905_580_032_000), "5.91 TB");
        assert_eq!(human_bytes(u64::MAX), "18.45 EB");
    }
}
