//! Compiles the kernels of every crate the grader is made of (`kernels/<owner>/*.cu`) once, in
//! parallel, with the workspace's nvcc (found, or the pinned one installed: cuda-build), and hands the
//! toolchain on to the megakernel crate's build script, which compiles the model's kernels
//! (`kernels/megakernel/model/`) only with its `model` feature, so that the grader never waits for
//! them. kernels/lib.rs embeds what this writes.

use cuda_build::{Owner, Toolchain};

/// Each owner's folder under `kernels/`, and its files that need Hopper or launch from the device.
const OWNERS: &[Owner<'static>] = &[
    // The bulk read stream (bulk copies and mbarriers): the bandwidth measurement and the red team.
    Owner { name: "cuda", folder: "cuda", hopper_only: &["bulk_read.cu"], rdc: &[] },
    Owner { name: "grader", folder: "grader", hopper_only: &[], rdc: &[] },
    Owner { name: "reference", folder: "reference", hopper_only: &[], rdc: &[] },
    // redteam_cdp.cu launches kernels from the device: relocatable device code, device-linked.
    Owner { name: "redteam", folder: "redteam", hopper_only: &[], rdc: &["redteam_cdp.cu"] },
    Owner { name: "megakernel", folder: "megakernel", hopper_only: &["megakernel.cu", "split.cu"], rdc: &[] },
];

fn main() {
    let toolchain = Toolchain::find_or_install();
    toolchain.export();
    cuda_build::build(&toolchain, OWNERS, &toolchain.constants());
}
