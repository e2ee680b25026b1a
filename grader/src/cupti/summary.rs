//! One call's GPU activities summarised for the launch gates: kernels, their time and the largest
//! one's share, copies and sets, graph and device-launched records, and the thread blocks launched
//! and those the copies and sets may run by their sizes (compared with the hardware's own count when
//! the DRAM audit runs).

use serde::{Deserialize, Serialize};

use super::activity::{Activity, ActivityKind};

/// One step's activities, summarised for the gates.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepLaunches {
    pub kernels: usize,
    /// Sum of the kernels' GPU times.
    pub kernel_ns: u64,
    pub largest_kernel_ns: u64,
    pub largest_kernel: String,
    /// `largest_kernel_ns / kernel_ns` (0 when no kernel time was recorded).
    pub dominant_share: f64,
    /// First kernel start to last kernel end.
    pub span_ns: u64,
    pub memcpys: usize,
    pub memsets: usize,
    /// Kernels that ran as nodes of a CUDA graph.
    pub graph_kernels: usize,
    /// Activities of any kind flagged as launched from the device.
    pub device_launched: usize,
    /// Activities of any other kind.
    pub other: usize,
    /// Thread blocks of the kernels (grid x * y * z, summed).
    pub ctas: u64,
    /// Thread blocks the driver may run for the copies and sets, by their sizes
    /// ([`copy_blocks_allowed`], summed): CUPTI records those as copies and sets, not kernels, but
    /// the hardware counts their blocks.
    #[serde(default)]
    pub copy_blocks: u64,
    /// Time the GPU spent on any of the activities: the union of their intervals.
    pub busy_ns: u64,
}

impl StepLaunches {
    /// This window's launches followed by `next`'s (a call's layers, replayed one at a time): counts,
    /// times and blocks summed, the largest kernel the larger, spans added.
    pub fn then(&self, next: &StepLaunches) -> StepLaunches {
        let largest = if next.largest_kernel_ns > self.largest_kernel_ns { next } else { self };
        let kernel_ns = self.kernel_ns.saturating_add(next.kernel_ns);
        StepLaunches {
            kernels: self.kernels + next.kernels,
            kernel_ns,
            largest_kernel_ns: largest.largest_kernel_ns,
            largest_kernel: largest.largest_kernel.clone(),
            dominant_share: if kernel_ns > 0 { largest.largest_kernel_ns as f64 / kernel_ns as f64 } else { 0.0 },
            span_ns: self.span_ns.saturating_add(next.span_ns),
            memcpys: self.memcpys + next.memcpys,
            memsets: self.memsets + next.memsets,
            graph_kernels: self.graph_kernels + next.graph_kernels,
            device_launched: self.device_launched + next.device_launched,
            other: self.other + next.other,
            ctas: self.ctas.saturating_add(next.ctas),
            copy_blocks: self.copy_blocks.saturating_add(next.copy_blocks),
            busy_ns: self.busy_ns.saturating_add(next.busy_ns),
        }
    }

    pub fn of(activities: &[Activity]) -> StepLaunches {
        let mut s = StepLaunches { busy_ns: busy_ns(activities), ..StepLaunches::default() };
        for a in activities {
            if a.launched_from_device {
                s.device_launched += 1;
            }
            match a.kind {
                ActivityKind::Kernel => {
                    let ns = a.duration_ns();
                    if s.kernels == 0 || ns > s.largest_kernel_ns {
                        s.largest_kernel_ns = ns;
                        s.largest_kernel = a.name.clone();
                    }
                    s.kernels += 1;
                    s.kernel_ns = s.kernel_ns.saturating_add(ns);
                    if a.graph_id != 0 {
                        s.graph_kernels += 1;
                    }
                    let (x, y, z) = a.grid;
                    s.ctas += [x, y, z].iter().map(|&g| g.max(0) as u64).product::<u64>();
                }
                ActivityKind::Memcpy => {
                    s.memcpys += 1;
                    s.copy_blocks = s.copy_blocks.saturating_add(copy_blocks_allowed(a.bytes));
                }
                ActivityKind::Memset => {
                    s.memsets += 1;
                    s.copy_blocks = s.copy_blocks.saturating_add(copy_blocks_allowed(a.bytes));
                }
                ActivityKind::Other(_) => s.other += 1,
            }
        }
        if s.kernel_ns > 0 {
            s.dominant_share = s.largest_kernel_ns as f64 / s.kernel_ns as f64;
        }
        if let Some((first_start, last_end)) = kernel_bounds(activities) {
            s.span_ns = last_end.saturating_sub(first_start);
        }
        s
    }
}

/// Thread blocks a copy or a set of `bytes` may run as kernels of the driver's own. Measured on an
/// H200 (CUDA 13.0, driver 580; `sm__ctas_launched` over one copy or set in Nsight Compute's range
/// replay):
/// - a device-to-device `cudaMemcpyAsync` runs 1 block up to 64 bytes, then one per KB with both
///   ends 4-byte aligned and one per 256 bytes with either end off by 1 or 2 bytes (16 for 4 KB, 256
///   for 64 KB, 1024 for 256 KB), one per 4 KB from 1 MB (65,551 for 256 MB, off by one);
/// - a set (`cudaMemsetAsync`, `cuMemsetD16/D32Async`) runs none below 8 KB, then one per 8 KB;
/// - copies to and from the host run none;
/// - a 2D or 3D copy or set runs one block per row for rows up to 256 bytes (a 1-byte-wide copy of
///   4096 rows runs 4096), one per 512 bytes of wider rows.
///
/// The record holds a copy's bytes, not its shape, so the rule follows the bytes: 2 blocks, and one
/// per 64 bytes. That covers every 1D copy and set with 4x to spare over the worst seen (256 bytes a
/// block), and 2D and 3D ones whose rows are at least 64 bytes (32 bf16 values); one of narrower rows
/// runs more blocks than this, and the launch record reports them. Hidden thread blocks so cost 64
/// bytes of copy or set each, and an operation brings 2 of its own: a thousand 1-byte sets cover
/// 2,000 blocks, not four million.
pub fn copy_blocks_allowed(bytes: u64) -> u64 {
    const BASE: u64 = 2;
    const BYTES_PER_BLOCK: u64 = 64;
    BASE.saturating_add(bytes.div_ceil(BYTES_PER_BLOCK))
}

/// The first kernel's start and the last kernel's end (ns); `None` without a kernel.
pub fn kernel_bounds(activities: &[Activity]) -> Option<(u64, u64)> {
    let kernels = || activities.iter().filter(|a| a.kind == ActivityKind::Kernel);
    Some((kernels().map(|a| a.start_ns).min()?, kernels().map(|a| a.end_ns).max()?))
}

/// The union of the activities' intervals, in ns.
fn busy_ns(activities: &[Activity]) -> u64 {
    let mut spans: Vec<(u64, u64)> =
        activities.iter().filter(|a| a.end_ns > a.start_ns).map(|a| (a.start_ns, a.end_ns)).collect();
    spans.sort_unstable();
    let (mut total, mut reach) = (0u64, 0u64);
    for (start, end) in spans {
        let from = start.max(reach);
        if end > from {
            total += end - from;
        }
        reach = reach.max(end);
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    fn activity(kind: ActivityKind, name: &str, start_ns: u64, end_ns: u64) -> Activity {
        Activity { stream_id: 7, correlation_id: 1, ..Activity::synthetic(kind, name, start_ns, end_ns) }
    }

    fn kernel(name: &str, start_ns: u64, end_ns: u64) -> Activity {
        Activity {
            grid: (132, 1, 1),
            block: (256, 1, 1),
            registers: 64,
            ..activity(ActivityKind::Kernel, name, start_ns, end_ns)
        }
    }

    #[test]
    fn one_dominant_kernel_and_a_trivial_one() {
        let s = StepLaunches::of(&[kernel("zero_flags", 1_000, 1_040), kernel("layer", 0, 960)]);
        assert!(s.dominant_share >= spec::Gates::TASK.min_dominant_share);
        assert_eq!(s.kernels, 2);
        assert_eq!(s.kernel_ns, 1_000);
        assert_eq!(s.largest_kernel, "layer");
        assert_eq!(s.largest_kernel_ns, 960);
        assert!((s.dominant_share - 0.96).abs() < 1e-12, "{}", s.dominant_share);
        assert_eq!(s.span_ns, 1_040);
        assert_eq!((s.memcpys, s.memsets, s.graph_kernels, s.device_launched, s.other), (0, 0, 0, 0, 0));
    }

    #[test]
    fn attention_and_mlp_split_fails_the_share() {
        let s = StepLaunches::of(&[kernel("attention", 0, 18_000), kernel("mlp", 18_500, 100_500)]);
        assert_eq!(s.kernels, 2);
        assert_eq!(s.largest_kernel, "mlp");
        assert!((s.dominant_share - 0.82).abs() < 1e-12, "{}", s.dominant_share);
        assert!(s.dominant_share < spec::Gates::TASK.min_dominant_share);
        assert_eq!(s.span_ns, 100_500);
    }

    #[test]
    fn copies_and_sets_are_counted_apart_from_kernels() {
        let s = StepLaunches::of(&[
            kernel("layer", 100, 1_100),
            Activity { bytes: 4096, ..activity(ActivityKind::Memcpy, "memcpy DtoD 4096 bytes", 0, 50) },
            Activity { bytes: 64, ..activity(ActivityKind::Memset, "memset 64 bytes", 60, 70) },
            activity(ActivityKind::Other(36), "", 0, 0),
        ]);
        assert_eq!((s.kernels, s.memcpys, s.memsets, s.other), (1, 1, 1, 1));
        assert_eq!(s.copy_blocks, (2 + 64) + (2 + 1), "4096 and 64 bytes");
        assert_eq!(s.kernel_ns, 1_000);
        assert_eq!(s.dominant_share, 1.0);
        assert_eq!(s.span_ns, 1_000, "the span covers kernels only");
    }

    /// The allowance against the blocks the driver's copies and sets were seen to run on an H200.
    #[test]
    fn copy_allowances_cover_the_drivers_blocks_by_size() {
        // (bytes, blocks seen): misaligned device-to-device copies (the most per byte of any 1D
        // copy or set), a 2D copy of 64-byte rows, and sets.
        for (bytes, seen) in [
            (1, 1),
            (64, 1),
            (1000, 4),
            (4096, 16),
            (65_536, 256),
            (262_144, 1024),
            (1 << 20, 271),
            (256 << 20, 65_551),
            (64 * 4096, 4096),
            (16_384, 2),
        ] {
            let allowed = copy_blocks_allowed(bytes);
            assert!(allowed >= seen, "{bytes} bytes: {allowed} allowed, {seen} seen");
        }
        assert_eq!(copy_blocks_allowed(0), 2);
    }

    #[test]
    fn graph_and_device_launched_kernels_are_counted() {
        let mut a = kernel("node_a", 0, 500);
        a.graph_id = 3;
        let mut b = kernel("node_b", 500, 1_000);
        b.graph_id = 3;
        b.launched_from_device = true;
        let s = StepLaunches::of(&[a, b, kernel("plain", 1_000, 1_010)]);
        assert_eq!(s.kernels, 3);
        assert_eq!(s.graph_kernels, 2);
        assert_eq!(s.device_launched, 1);
        assert_eq!(s.largest_kernel, "node_a", "ties keep the first");
    }

    #[test]
    fn no_activity_is_all_zeros() {
        let s = StepLaunches::of(&[]);
        let zero = StepLaunches::default();
        assert_eq!(s, zero);
    }

    #[test]
    fn untimed_kernels_count_but_weigh_nothing() {
        let s = StepLaunches::of(&[kernel("untimed", 0, 0)]);
        assert_eq!(s.kernels, 1);
        assert_eq!(s.kernel_ns, 0);
        assert_eq!(s.dominant_share, 0.0);
        assert_eq!(s.largest_kernel, "untimed");
    }

    #[test]
    fn activities_serialise() {
        let json = serde_json::to_value(kernel("layer", 5, 9)).unwrap();
        assert_eq!(json["kind"], "Kernel");
        assert_eq!(json["name"], "layer");
        assert_eq!(json["grid"], serde_json::json!([132, 1, 1]));
        assert_eq!(json["launched_from_device"], false);
        let other = serde_json::to_value(activity(ActivityKind::Other(36), "", 0, 0)).unwrap();
        assert_eq!(other["kind"], serde_json::json!({ "Other": 36 }));
        let step = serde_json::to_value(StepLaunches::of(&[kernel("layer", 5, 9)])).unwrap();
        assert_eq!(step["kernels"], 1);
        assert_eq!(step["dominant_share"], 1.0);
    }

    #[test]
    fn busy_time_is_the_union_and_ctas_add_up() {
        let mut a = kernel("a", 0, 100);
        a.grid = (2, 3, 4);
        let s = StepLaunches::of(&[
            a,
            kernel("b", 50, 150),
            activity(ActivityKind::Memcpy, "memcpy DtoD 8 bytes", 200, 210),
            kernel("untimed", 0, 0),
        ]);
        assert_eq!(s.busy_ns, 160, "0..150 and 200..210");
        assert_eq!(s.ctas, 24 + 132 + 132);
    }
}
