//! The CPU golden model of the layer and the eager GPU reference.

pub mod golden;
pub mod gpu;
