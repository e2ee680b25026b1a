//! From a finished recording to the record the gates read: every GPU activity attributed to the call
//! whose API call launched it, and every way the two views disagree, each as one sentence.
//!
//! Pure code over [`Captured`], so each rule is tested on hand-made records.

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};

use super::callbacks::{Launch, Request, Tag};
use super::summary::StepLaunches;
use super::{Activity, ActivityKind, Captured};

/// Kernels CUPTI's own range profiler runs at range boundaries (between commands, outside every
/// call): they come with no API call, and are set apart only when they also ran outside every
/// call, so a submission's kernel of the same name inside a call is still a problem.
const PROFILER_KERNELS: [&str; 1] = ["WaitNs"];

/// When a call ran on CUPTI's clock: from just before the runner entered `layer_step` to just after
/// the device synchronised. The calls of a back-to-back batch share the batch's window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallWindow {
    pub start_ns: u64,
    pub end_ns: u64,
}

impl CallWindow {
    fn overlaps(&self, a: &Activity) -> bool {
        a.end_ns > self.start_ns && a.start_ns < self.end_ns
    }

    fn holds(&self, at_ns: u64) -> bool {
        (self.start_ns..=self.end_ns).contains(&at_ns)
    }
}

/// The runner's own copies and sets inside one call, and the thread blocks the driver may run for
/// them ([`super::summary::copy_blocks_allowed`], by their sizes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunnerCopies {
    pub copies: usize,
    pub blocks: u64,
}

/// The runner's own GPU work, as the runner counted it when it asked for it: what its tag may
/// cover, and nothing more.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OwnWork {
    /// Kernels the runner launched between calls (one L2 eviction after each command).
    pub kernels: usize,
}

/// The record of a run, attributed: what each call ran, and what is wrong with the record itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// `build_layer`'s GPU work.
    pub build: StepLaunches,
    /// One summary per call of the schedule, in order.
    pub calls: Vec<StepLaunches>,
    /// Each call's activities (kernels, copies, sets), for the report's detail.
    pub activities: Vec<Vec<Activity>>,
    /// Kernel launches the host asked for in each call (the callback view's count).
    pub api_launches: Vec<usize>,
    /// Modules the driver loaded while the submission ran.
    pub modules: usize,
    /// Kernels of the DRAM audit's range profiler, set apart (between calls, no API call).
    pub profiler_kernels: usize,
    /// Copies and sets of the runner's own inside each call (a Python submission's x_out copied into
    /// the judge's buffer): not the submission's, but the hardware counts their thread blocks.
    pub runner_copies: Vec<RunnerCopies>,
    /// Everything that makes the record incomplete or the work unaccounted for; empty when intact.
    pub problems: Vec<String>,
    /// Each call's window on CUPTI's clock, the runner's own stamps (a back-to-back batch's calls share
    /// the batch's): with the activities, where a call's time went on the host's side.
    pub windows: Vec<CallWindow>,
}

/// Attributes `captured` to `windows.len()` calls. `own` is the work the runner itself asked for;
/// `scan` names what a loaded module may not hold (device-side launches); `tampering` lists what the
/// runner found switched off at call boundaries.
pub fn attribute(
    captured: Captured,
    windows: &[CallWindow],
    own: OwnWork,
    scan: impl Fn(&[u8]) -> Vec<String>,
    tampering: Vec<String>,
) -> Record {
    let Captured { activities, seen } = captured;
    let mut problems = tampering;
    problems.extend(forged_requests(&seen.requests, windows));
    let n = windows.len();
    let mut per_call: Vec<Vec<Activity>> = vec![Vec::new(); n];
    let mut build = Vec::new();
    let mut unseen = Vec::new();
    let mut outside = Vec::new();
    let mut recorded_ids = HashSet::new();
    let mut unseen_own = Vec::new();
    let mut foreign: HashMap<usize, Vec<String>> = HashMap::new();
    let mut profiler_kernels = 0;
    let mut runner_copies = vec![RunnerCopies::default(); n];
    let mut runner_kernels = 0;
    for a in activities {
        let tag = seen.tags.get(&a.correlation_id).copied();
        if tag.is_none()
            && a.kind == ActivityKind::Kernel
            && PROFILER_KERNELS.contains(&a.name.as_str())
            && !windows.iter().any(|w| w.overlaps(&a))
        {
            profiler_kernels += 1;
            continue;
        }
        if a.kind == ActivityKind::Kernel {
            recorded_ids.insert(a.correlation_id);
        }
        // Work that did not come from call i but ran while it did: its own call's window excluded.
        for (i, w) in windows.iter().enumerate() {
            let own = matches!(tag, Some(Tag::Call(j)) if windows.get(j) == Some(w));
            if !own && a.kind == ActivityKind::Kernel && w.overlaps(&a) {
                foreign.entry(i).or_default().push(format!("{} ({})", a.name, describe(tag)));
            }
        }
        match tag {
            Some(Tag::Call(i)) if i < n => per_call[i].push(a),
            Some(Tag::Build) => build.push(a),
            Some(Tag::RunnerIn(i)) if i < n && a.kind != ActivityKind::Kernel => {
                let own = &mut runner_copies[i];
                own.copies += 1;
                own.blocks = own.blocks.saturating_add(super::summary::copy_blocks_allowed(a.bytes));
            }
            // The runner's work inside a call is a copy, never a kernel: one under its tag is not its.
            Some(Tag::RunnerIn(i)) => unseen_own.push(format!("{} in call {i}", a.name)),
            Some(Tag::Runner) if a.kind == ActivityKind::Kernel => runner_kernels += 1,
            Some(Tag::Teardown | Tag::Runner) => {}
            Some(Tag::Outside) => outside.push(a),
            // Records of other kinds are not work a call could hide (no kernel, copy or set).
            Some(Tag::Call(_)) | None if matches!(a.kind, ActivityKind::Other(_)) => {}
            Some(Tag::Call(_)) | None => unseen.push(a),
        }
    }
    if runner_kernels != own.kernels {
        problems.push(format!(
            "{runner_kernels} kernel(s) ran under the runner's own tag, which launched {}: the tag was forged to hide \
             the submission's work",
            own.kernels
        ));
    }
    if let Some(first) = unseen_own.first() {
        problems.push(format!(
            "{} kernel(s) (first: {first}) ran under the runner's tag for its copy inside a call: the tag was forged",
            unseen_own.len()
        ));
    }
    if let Some(first) = unseen.first() {
        problems.push(format!(
            "{} GPU record(s) (first: {}) carry no API call the callback view saw: the callbacks were switched off",
            unseen.len(),
            first.name
        ));
    }
    if let Some(first) = outside.iter().find(|a| a.kind == ActivityKind::Kernel) {
        problems.push(format!(
            "{} kernel(s) (first: {}) were launched outside build_layer and the calls (between calls, from another thread?)",
            outside.iter().filter(|a| a.kind == ActivityKind::Kernel).count(),
            first.name
        ));
    }
    let mut foreign: Vec<(usize, Vec<String>)> = foreign.into_iter().collect();
    foreign.sort();
    if let Some((call, names)) = foreign.first() {
        problems.push(format!(
            "kernels launched elsewhere ran during {} call(s) (first: call {call}: {}): a call's work must be launched by that call",
            foreign.len(),
            names.join(", ")
        ));
    }
    // A runtime launch and the driver launch it makes inside are one launch: grouped under the
    // outer call's id, recorded if the kernel record carries either id.
    let mut order = Vec::new();
    let mut grouped: HashMap<u32, (&Launch, bool)> = HashMap::new();
    for l in &seen.launches {
        let id = l.runtime_correlation_id.unwrap_or(l.correlation_id);
        let recorded = recorded_ids.contains(&l.correlation_id) || recorded_ids.contains(&id);
        grouped.entry(id).and_modify(|g| g.1 |= recorded).or_insert_with(|| {
            order.push(id);
            (l, recorded)
        });
    }
    let mut api_launches = vec![0; n];
    for (l, _) in grouped.values() {
        if let Tag::Call(i) = l.tag
            && i < n
        {
            api_launches[i] += 1;
        }
    }
    let missing: Vec<&Launch> = order.iter().map(|id| grouped[id]).filter(|g| !g.1).map(|g| g.0).collect();
    if let Some(first) = missing.first() {
        problems.push(format!(
            "{} kernel launch(es) (first: {} in {}) left no GPU record: the activity recording was switched off",
            missing.len(),
            first.function,
            describe(Some(first.tag))
        ));
    }
    for m in &seen.modules {
        for finding in scan(&m.image) {
            problems.push(format!("module {} loaded in {}: {finding}", m.id, describe(Some(m.tag))));
        }
    }
    if !seen.contexts_created.is_empty() {
        problems.push(format!(
            "{} CUDA context(s) created by the submission (first in {}): all work must run in the grader's context",
            seen.contexts_created.len(),
            describe(seen.contexts_created.first().copied())
        ));
    }
    problems.extend(seen.faults.iter().map(|f| format!("the callback view failed: {f}")));
    Record {
        build: StepLaunches::of(&build),
        calls: per_call.iter().map(|a| StepLaunches::of(a)).collect(),
        activities: per_call,
        api_launches,
        modules: seen.modules.len(),
        profiler_kernels,
        runner_copies,
        problems,
        windows: windows.to_vec(),
    }
}

/// Requests whose tag cannot be theirs: the runner's own tag on a request from another thread, a
/// call's tag on a request made outside that call's window; and work queued between calls (kernels
/// are named by the activity view, which also sees them run).
fn forged_requests(requests: &[Request], windows: &[CallWindow]) -> Vec<String> {
    let mut problems = Vec::new();
    let mut say = |found: Vec<&Request>, what: &str| {
        if let Some(first) = found.first() {
            problems.push(format!("{} request(s) for GPU work (first: {}) {what}", found.len(), first.function));
        }
    };
    say(
        requests.iter().filter(|r| matches!(r.tag, Tag::Runner | Tag::RunnerIn(_)) && !r.runner_thread).collect(),
        "came from another thread under the runner's own tag: the tag was forged",
    );
    say(
        requests.iter().filter(|r| r.tag == Tag::Runner && !is_runner_request(r.function)).collect(),
        "were made under the runner's own tag between calls, where the runner asks only for its eviction kernel \
         and the events that track its buffers: the tag was forged (a signal handler on the runner's thread?)",
    );
    say(
        requests
            .iter()
            .filter(|r| matches!(r.tag, Tag::Call(i) if windows.get(i).is_some_and(|w| !w.holds(r.at_ns))))
            .collect(),
        "were made outside the window of the call whose tag they carry: the tag was forged",
    );
    say(
        requests.iter().filter(|r| r.tag == Tag::Outside && !super::callbacks::is_kernel_launch(r.function)).collect(),
        "were queued outside build_layer and the calls (copies, sets, stream waits or writes, host functions, \
         events: between calls the submission may queue nothing)",
    );
    problems
}

/// What the runner asks for between calls: its eviction kernel, and the event records and waits
/// cudarc makes to track the buffers of a launch.
fn is_runner_request(function: &str) -> bool {
    super::callbacks::is_kernel_launch(function) || function.contains("EventRecord") || function.contains("WaitEvent")
}

fn describe(tag: Option<Tag>) -> String {
    match tag {
        Some(Tag::Build) => "build_layer".into(),
        Some(Tag::Call(i)) => format!("call {i}"),
        Some(Tag::Teardown) => "teardown".into(),
        Some(Tag::Runner) => "the runner's own work".into(),
        Some(Tag::RunnerIn(i)) => format!("the runner's own work in call {i}"),
        Some(Tag::Outside) => "no call".into(),
        None => "an unseen API call".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::super::callbacks::{Module, Seen};
    use super::*;

    fn kernel(name: &str, corr: u32, start: u64, end: u64) -> Activity {
        Activity {
            correlation_id: corr,
            grid: (132, 1, 1),
            ..Activity::synthetic(ActivityKind::Kernel, name, start, end)
        }
    }

    fn launch(corr: u32, tag: Tag) -> Launch {
        Launch { correlation_id: corr, runtime_correlation_id: None, function: "cuLaunchKernel".into(), tag }
    }

    fn seen(launches: Vec<Launch>) -> Seen {
        let mut s = Seen::default();
        for l in &launches {
            s.tags.insert(l.correlation_id, l.tag);
        }
        s.launches = launches;
        s
    }

    const W: [CallWindow; 2] = [CallWindow { start_ns: 100, end_ns: 200 }, CallWindow { start_ns: 300, end_ns: 400 }];

    fn no_scan(_: &[u8]) -> Vec<String> {
        Vec::new()
    }

    #[test]
    fn an_intact_record_attributes_each_kernel_to_its_call() {
        let captured = Captured {
            activities: vec![kernel("build_pack", 1, 10, 20), kernel("mega", 2, 110, 190), kernel("mega", 3, 310, 390)],
            seen: seen(vec![launch(1, Tag::Build), launch(2, Tag::Call(0)), launch(3, Tag::Call(1))]),
        };
        let r = attribute(captured, &W, OwnWork::default(), no_scan, vec![]);
        assert!(r.problems.is_empty(), "{:?}", r.problems);
        assert_eq!((r.build.kernels, r.calls[0].kernels, r.calls[1].kernels), (1, 1, 1));
        assert_eq!(r.api_launches, vec![1, 1]);
        assert_eq!(r.calls[0].ctas, 132);
    }

    #[test]
    fn switched_off_views_show_as_disagreements() {
        // The activity view off during call 1: its launch left no record.
        let captured = Captured {
            activities: vec![kernel("mega", 2, 110, 190)],
            seen: seen(vec![launch(2, Tag::Call(0)), launch(3, Tag::Call(1))]),
        };
        let r = attribute(captured, &W, OwnWork::default(), no_scan, vec![]);
        assert!(
            r.problems.iter().any(|p| p.contains("left no GPU record") && p.contains("call 1")),
            "{:?}",
            r.problems
        );
        // The callback view off during call 1: a kernel nobody asked for.
        let captured = Captured {
            activities: vec![kernel("mega", 2, 110, 190), kernel("hidden", 9, 310, 390)],
            seen: seen(vec![launch(2, Tag::Call(0))]),
        };
        let r = attribute(captured, &W, OwnWork::default(), no_scan, vec![]);
        assert!(r.problems.iter().any(|p| p.contains("no API call") && p.contains("hidden")), "{:?}", r.problems);
    }

    /// recording-off and recording-off-waiter expect launch_record to fail with a word of the sentence
    /// for launches the activity view never recorded (a recorded waiter beside them or not).
    #[test]
    fn hidden_launches_are_named_as_the_recording_adversaries_expect() {
        use redteam::{self, Expect};
        let captured = Captured {
            activities: vec![kernel("waiter", 2, 110, 190)],
            seen: seen(vec![launch(2, Tag::Call(0)), launch(3, Tag::Call(0)), launch(4, Tag::Call(0))]),
        };
        let r = attribute(captured, &W[..1], OwnWork::default(), no_scan, vec![]);
        for name in ["recording-off", "recording-off-waiter"] {
            let Some(Expect::GateFails { gate: "launch_record", word }) = redteam::find(name).map(|a| a.expect) else {
                panic!("{name} must expect launch_record to fail");
            };
            assert!(r.problems.iter().any(|p| p.contains(word)), "{name}: {:?}", r.problems);
        }
    }

    /// A Python submission's x_out is copied by the runner inside the call, under its own tag
    /// (`run::runner::as_runner`): the copy is never the call's, and is no problem; it is counted
    /// apart, for the hardware's thread blocks (a device-to-device copy may run as blocks).
    #[test]
    fn the_runners_copy_inside_a_call_is_not_the_calls() {
        let copy = Activity { correlation_id: 7, ..Activity::synthetic(ActivityKind::Memcpy, "DtoD", 180, 185) };
        let mut s = seen(vec![launch(2, Tag::Call(0))]);
        s.tags.insert(7, Tag::RunnerIn(0));
        let captured = Captured { activities: vec![kernel("add", 2, 110, 170), copy], seen: s };
        let r = attribute(captured, &W[..1], OwnWork::default(), no_scan, vec![]);
        assert!(r.problems.is_empty(), "{:?}", r.problems);
        assert_eq!((r.calls[0].kernels, r.calls[0].memcpys), (1, 0));
        assert_eq!(r.runner_copies.iter().map(|c| c.copies).collect::<Vec<_>>(), vec![1]);
    }

    /// The calls of a back-to-back batch share the batch's window: each runner copy still counts for
    /// its own call only (counted by window it would count k times in a batch of k, and the thread-block
    /// check would allow k^2 copies' blocks).
    #[test]
    fn the_runners_copies_in_a_batch_count_once_each() {
        let batch = CallWindow { start_ns: 100, end_ns: 400 };
        let mut s = seen((0..3).map(|i| launch(2 * i as u32 + 1, Tag::Call(i))).collect());
        let mut activities = Vec::new();
        for i in 0..3u32 {
            activities.push(kernel("add", 2 * i + 1, 110 + 100 * u64::from(i), 170 + 100 * u64::from(i)));
            activities.push(Activity {
                correlation_id: 2 * i + 2,
                ..Activity::synthetic(ActivityKind::Memcpy, "DtoD", 180 + 100 * u64::from(i), 185 + 100 * u64::from(i))
            });
            s.tags.insert(2 * i + 2, Tag::RunnerIn(i as usize));
        }
        let r = attribute(Captured { activities, seen: s }, &[batch; 3], OwnWork::default(), no_scan, vec![]);
        assert!(r.problems.is_empty(), "{:?}", r.problems);
        assert_eq!(r.runner_copies.iter().map(|c| c.copies).collect::<Vec<_>>(), vec![1, 1, 1]);
    }

    #[test]
    fn a_runtime_launch_and_its_driver_launch_count_once() {
        let mut outer = launch(5, Tag::Call(0));
        outer.function = "cudaLaunchKernel_v7000".into();
        let inner = Launch { correlation_id: 6, runtime_correlation_id: Some(5), ..launch(6, Tag::Call(0)) };
        let captured = Captured { activities: vec![kernel("k", 5, 110, 150)], seen: seen(vec![outer, inner]) };
        let r = attribute(captured, &W[..1], OwnWork::default(), no_scan, vec![]);
        assert!(r.problems.is_empty(), "{:?}", r.problems);
        assert_eq!(r.api_launches, vec![1]);
    }

    #[test]
    fn kernels_from_build_running_into_a_call_and_kernels_between_calls_are_named() {
        let captured = Captured {
            activities: vec![kernel("server", 1, 10, 390), kernel("mega", 2, 110, 190), kernel("stray", 4, 250, 260)],
            seen: seen(vec![launch(1, Tag::Build), launch(2, Tag::Call(0)), launch(4, Tag::Outside)]),
        };
        let r = attribute(captured, &W, OwnWork::default(), no_scan, vec![]);
        assert!(
            r.problems.iter().any(|p| p.contains("ran during 2 call(s)") && p.contains("server")),
            "{:?}",
            r.problems
        );
        assert!(
            r.problems.iter().any(|p| p.contains("outside build_layer") && p.contains("stray")),
            "{:?}",
            r.problems
        );
    }

    #[test]
    fn modules_with_findings_and_new_contexts_are_problems() {
        let mut s = seen(vec![launch(2, Tag::Call(0))]);
        s.modules.push(Module { id: 7, image: b"cdp".to_vec(), tag: Tag::Build });
        s.modules.push(Module { id: 8, image: b"clean".to_vec(), tag: Tag::Build });
        s.contexts_created.push(Tag::Build);
        let captured = Captured { activities: vec![kernel("mega", 2, 110, 190)], seen: s };
        let scan = |img: &[u8]| {
            if img == b"cdp" { vec!["calls cudaLaunchDeviceV2: device-side launch".into()] } else { vec![] }
        };
        let r = attribute(
            captured,
            &W[..1],
            OwnWork::default(),
            scan,
            vec!["driver API callbacks found off after call 0".into()],
        );
        assert_eq!(r.modules, 2);
        assert!(
            r.problems
                .iter()
                .any(|p| p.starts_with("module 7 loaded in build_layer") && p.contains("device-side launch"))
        );
        assert!(r.problems.iter().any(|p| p.contains("context")));
        assert!(r.problems.iter().any(|p| p.contains("found off")));
    }

    fn request(function: &'static str, tag: Tag, runner_thread: bool, at_ns: u64) -> Request {
        Request { function, tag, runner_thread, at_ns }
    }

    /// An intact call with the requests that go with it, and `extra` ones.
    fn with_requests(extra: Vec<Request>) -> Captured {
        let mut s = seen(vec![launch(2, Tag::Call(0))]);
        s.requests = vec![request("cuLaunchKernel", Tag::Call(0), true, 105)];
        s.requests.extend(extra);
        Captured { activities: vec![kernel("mega", 2, 110, 190)], seen: s }
    }

    /// The tag is a word in the runner's memory: whatever another thread writes there, its requests
    /// are not the runner's, and a call's tag holds only while that call runs.
    #[test]
    fn forged_tags_are_found_by_thread_and_by_time() {
        let intact = attribute(with_requests(vec![]), &W[..1], OwnWork::default(), no_scan, vec![]);
        assert!(intact.problems.is_empty(), "{:?}", intact.problems);
        let cases = [
            (request("cuMemcpyHtoDAsync_v2", Tag::Runner, false, 250), "another thread under the runner's own tag"),
            (request("cuMemcpyDtoHAsync_v2", Tag::Runner, true, 250), "where the runner asks only for its eviction"),
            (request("cuMemsetD8Async", Tag::RunnerIn(0), false, 150), "another thread under the runner's own tag"),
            (request("cuLaunchKernel", Tag::Call(1), true, 250), "outside the window of the call"),
            (request("cuStreamWaitValue32_v2", Tag::Outside, false, 250), "queued outside build_layer"),
            (request("cuLaunchHostFunc", Tag::Outside, false, 250), "queued outside build_layer"),
            (request("cuEventRecord", Tag::Outside, false, 250), "queued outside build_layer"),
        ];
        for (r, word) in cases {
            let function = r.function;
            let found = attribute(with_requests(vec![r]), &W, OwnWork::default(), no_scan, vec![]).problems;
            assert!(found.iter().any(|p| p.contains(word) && p.contains(function)), "{function}: {found:?}");
        }
    }

    /// The runner's tag covers the kernels it counted itself, and its copy inside a call is never a
    /// kernel.
    #[test]
    fn kernels_under_the_runners_tag_must_be_the_ones_it_launched() {
        let mut s = seen(vec![launch(2, Tag::Call(0)), launch(5, Tag::Runner)]);
        s.tags.insert(6, Tag::RunnerIn(0));
        let activities = vec![kernel("mega", 2, 110, 190), kernel("read_u4", 5, 220, 260)];
        let one = OwnWork { kernels: 1 };
        let r = attribute(Captured { activities: activities.clone(), seen: s }, &W[..1], one, no_scan, vec![]);
        assert!(r.problems.is_empty(), "{:?}", r.problems);
        let mut s = seen(vec![launch(2, Tag::Call(0)), launch(5, Tag::Runner), launch(7, Tag::Runner)]);
        s.tags.insert(6, Tag::RunnerIn(0));
        let mut more = activities;
        more.push(kernel("hidden", 7, 230, 290));
        more.push(kernel("hidden_in_call", 6, 120, 130));
        let r = attribute(Captured { activities: more, seen: s }, &W[..1], one, no_scan, vec![]);
        assert!(
            r.problems.iter().any(|p| p.contains("2 kernel(s) ran under the runner's own tag")),
            "{:?}",
            r.problems
        );
        assert!(r.problems.iter().any(|p| p.contains("hidden_in_call in call 0")), "{:?}", r.problems);
    }

    #[test]
    fn the_profilers_kernels_between_calls_are_set_apart_but_not_inside_a_call() {
        let captured = Captured {
            activities: vec![kernel("WaitNs", 0, 50, 90), kernel("mega", 2, 110, 190), kernel("WaitNs", 0, 150, 160)],
            seen: seen(vec![launch(2, Tag::Call(0))]),
        };
        let r = attribute(captured, &W[..1], OwnWork::default(), no_scan, vec![]);
        assert_eq!(r.profiler_kernels, 1);
        assert!(r.problems.iter().any(|p| p.contains("no API call") && p.contains("WaitNs")), "{:?}", r.problems);
    }
}
