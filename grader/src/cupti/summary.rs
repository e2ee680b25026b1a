//! One call's GPU activities summarised for the launch gates: kernels, their time and the largest
//! one's share, copies and sets, graph and device-launched records, and the thread blocks launched
//! (compared with the hardware's own count when the DRAM audit runs).

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
    /// Time the GPU spent on any of the activities: the union of their intervals.
    pub busy_ns: u64,
}

impl StepLaunches {
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
                ActivityKind::Memcpy => s.memcpys += 1,
                ActivityKind::Memset => s.memsets += 1,
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
            activity(ActivityKind::Memcpy, "memcpy DtoD 4096 bytes", 0, 50),
            activity(ActivityKind::Memset, "memset 64 bytes", 60, 70),
            activity(ActivityKind::Other(36), "", 0, 0),
        ]);
        assert_eq!((s.kernels, s.memcpys, s.memsets, s.other), (1, 1, 1, 1));
        assert_eq!(s.kernel_ns, 1_000);
        assert_eq!(s.dominant_share, 1.0);
        assert_eq!(s.span_ns, 1_000, "the span covers kernels only");
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
