//! The red team's kernel files: `kernels/redteam.cu` (the adversaries' own kernels) and
//! `kernels/redteam_cdp.cu` (launches from the device, built as relocatable device code).

cuda::embed_kernels!();
