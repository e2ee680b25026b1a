//! The GPU side of the reference: the run's data generated on the device, and the eager reference.

pub mod data;
pub mod eager;

pub use data::{DeviceCache, DeviceWeights, generate_weights};
pub use eager::Eager;
