//! The red team's kernel files: `kernels/redteam/redteam.cu` (the adversaries' own kernels) and
//! `kernels/redteam/redteam_cdp.cu` (launches from the device, built as relocatable device code),
//! compiled by the root build script.

pub use ::kernels::redteam::*;
