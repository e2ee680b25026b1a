//! The judge's kernel files: `kernels/grader/bandwidth.cu` (the copy and read streams of the floor's
//! bandwidth, and the L2 eviction), `kernels/grader/launch_probe.cu` (`grader profile`'s launch path)
//! and `kernels/grader/verify.cu` (the checks of the runner's buffers), compiled by the root build
//! script.

pub use ::kernels::grader::*;

#[cfg(test)]
mod tests {
    use cuda::kernels::Kernel;

    /// Every kernel file the workspace builds, from every crate that owns one.
    fn workspace() -> impl Iterator<Item = &'static Kernel> {
        cuda::kernels::ALL
            .iter()
            .chain(reference::kernels::ALL)
            .chain(megakernel::kernels::ALL)
            .chain(redteam::kernels::ALL)
            .chain(super::ALL)
    }

    /// The scanner finds the red team's device-launch module, and nothing in any other kernel file
    /// of the workspace, the megakernel included.
    #[test]
    fn only_the_device_launch_adversary_scans_as_a_device_launch() {
        for k in workspace() {
            let findings: Vec<String> =
                submission::device_code::scan(k.fatbin).iter().map(ToString::to_string).collect();
            if k.name == redteam::kernels::REDTEAM_CDP.name {
                let first = findings.first().map_or("", String::as_str);
                assert!(first.starts_with("fatbin entry 1 of 1: cubin sm_90 ("), "{first}");
                assert!(first.contains("device-side launch"), "{first}");
            } else {
                assert!(findings.is_empty(), "kernels/{}.cu:\n{}", k.name, findings.join("\n"));
            }
        }
    }
}
