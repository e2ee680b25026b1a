//! Where a step's time goes in a traced launch: every block stamps the GPU's global timer when it starts
//! a phase (its dependencies met) and when it has finished it, at every position the launch runs (the
//! model kernel's traced instance, `GpuModel::trace`; a stack's one step, `Megakernel::trace_step`,
//! which `grader profile --config STACK` reads). A phase is ready when the last block of the last of the
//! phases it waits for (the program's waits) has ended, and its span runs from then to its own last
//! block's end; it comes apart into the hand-off (from ready to the median block's start: the release,
//! the poll, the block's barrier), the median block's work (its start to its end) and the rest, the time
//! the blocks later than the median add (the slowest block's lead). The critical path runs back from
//! the position's last phase through the phase each one waited for last: its phases' spans add up to
//! the position's time, and the table counts those phases only (phases that ran beside them, such as the
//! two-role plan's second Qkv, are off it). A GEMV phase's blocks also stamp when their input is in
//! registers and when their stream is done, which takes the work apart into the input, the stream and
//! the tail (the epilogue and the block's last barrier). `Trace::table` prints it the same way for
//! both commands.

use std::fmt::Write as _;

use spec::bytes::LayerOp;

use crate::program::PREV_LAYER_WAITS;
use crate::{TRACE_END, TRACE_SM, TRACE_STAMPS};

/// The stamps of a traced launch and what they are of.
#[derive(Debug, Clone)]
pub struct Trace {
    /// `(positions run, grid, layers * phases + head, TRACE_STAMPS)`: times in ns (start to
    /// `TRACE_END`) then the SM (`TRACE_SM`), the head's phase last where there is one; zero where a
    /// block does not run a phase or a stamp is not taken.
    pub stamps: Vec<u64>,
    pub grid: usize,
    /// What each row of the program (one layer's phases) computes.
    pub plan: Vec<LayerOp>,
    /// Each row's waits word (`program::WAITS_WORD`): the phases of its layer (bits from 0) and of the
    /// layer before (bits from `PREV_LAYER_WAITS`) it waits for.
    pub waits: Vec<u64>,
    pub layers: usize,
    /// Whether each position ends with the LM head's phase (a model's; a stack's step has none).
    pub head: bool,
    /// The prompt's positions: the head runs from the last of them on (a stack's step: 0).
    pub prompt: usize,
    /// The traced launch's kernel time by events.
    pub kernel_ms: f32,
}

/// One kind of phase's part of a token's critical path, in microseconds summed over its phases on the
/// path at a position, the mean over the positions traced: `span_us = handoff_us + work_us + later_us`.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct PhaseShare {
    pub what: String,
    /// Phases of this kind on the critical path, per position (the most at any position traced).
    pub phases: usize,
    pub span_us: f64,
    pub handoff_us: f64,
    pub work_us: f64,
    pub later_us: f64,
    /// A GEMV phase's work as its blocks' medians of input, stream and tail (they need not add up to
    /// `work_us`, a median of the whole); `None` for phases without those stamps.
    pub parts_us: Option<[f64; 3]>,
}

const START: usize = 0;
const END: usize = TRACE_END;
/// A phase's times, start to end, at the front of its stamps (the SM after them).
const TIMES: usize = TRACE_END + 1;
/// The kind of the LM head's phase.
const HEAD: &str = "Head";

/// Which SMs run a kind of phase's late blocks: over its phases at the positions read, the last
/// block's mean lead over the median block's end, and the SMs whose blocks end, on their mean, more
/// than half that lead after the median (a block runs on the same SM all launch). Blocks that are late
/// because of the SM they run on are what an even share of rows cannot absorb (docs/perf.md, "Where
/// the later blocks' time comes from").
#[derive(Debug, Clone, PartialEq)]
pub struct LateSms {
    pub what: String,
    pub lead_us: f64,
    /// In ascending order.
    pub sms: Vec<u64>,
}

/// A layer's part of a token, its critical path: every kind of phase but the head's, summed and spread
/// over `layers` (their input / stream / tail parts are not summed: they are medians of blocks).
pub fn per_layer(shares: &[PhaseShare], layers: usize) -> PhaseShare {
    let layer: Vec<&PhaseShare> = shares.iter().filter(|s| s.what != HEAD).collect();
    let n = layers.max(1);
    let per = |f: fn(&PhaseShare) -> f64| layer.iter().map(|s| f(s)).sum::<f64>() / n as f64;
    PhaseShare {
        what: "a layer".into(),
        phases: layer.iter().map(|s| s.phases).sum::<usize>() / n,
        span_us: per(|s| s.span_us),
        handoff_us: per(|s| s.handoff_us),
        work_us: per(|s| s.work_us),
        later_us: per(|s| s.later_us),
        parts_us: None,
    }
}

impl Trace {
    /// Phases a position runs, the head's included.
    fn per_position(&self) -> usize {
        self.plan.len() * self.layers + usize::from(self.head)
    }

    /// The stamps as a NumPy `.npy` file (`numpy.load` reads it): little-endian u64 of shape
    /// `(positions, grid, phases, TRACE_STAMPS)`, phase `l * plan.len() + r` row r of layer l, the head
    /// last where there is one; the stamps start, input, streamed and end in ns, zero where not taken,
    /// then the SM.
    pub fn to_npy(&self) -> Vec<u8> {
        let shape = format!("({}, {}, {}, {})", self.positions(), self.grid, self.per_position(), TRACE_STAMPS);
        let mut header = format!("{{'descr': '<u8', 'fortran_order': False, 'shape': {shape}, }}");
        // The format pads its header with spaces to a newline that ends 64-byte aligned, after the
        // magic (6 bytes), the version (2) and the header's length (2).
        let unpadded = 10 + header.len() + 1;
        header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
        header.push('\n');
        let mut out = Vec::with_capacity(10 + header.len() + self.stamps.len() * 8);
        out.extend_from_slice(b"\x93NUMPY\x01\x00");
        out.extend_from_slice(&(header.len() as u16).to_le_bytes());
        out.extend_from_slice(header.as_bytes());
        // Whole positions only: a launch's stamps are whole positions (see `positions`).
        let whole = self.positions() * self.grid * self.per_position() * TRACE_STAMPS;
        out.extend(self.stamps[..whole].iter().flat_map(|ns| ns.to_le_bytes()));
        out
    }

    /// Positions the launch ran.
    pub fn positions(&self) -> usize {
        self.stamps.len() / (self.grid * self.per_position() * TRACE_STAMPS).max(1)
    }

    /// Positions whose every phase follows a head (from the prompt's end on; none without a prompt).
    pub fn traced_positions(&self) -> std::ops::Range<usize> {
        if self.prompt == 0 {
            return 0..0;
        }
        self.prompt..self.positions()
    }

    /// The stamps of every block that ran phase `f` of position `p`; `None` if a block took one of
    /// the start and the end, or its stamps are out of order.
    fn spans(&self, p: usize, f: usize) -> Option<Vec<[u64; TRACE_STAMPS]>> {
        let n = self.per_position();
        let mut spans = Vec::new();
        for b in 0..self.grid {
            let s: [u64; TRACE_STAMPS] =
                self.stamps[((p * self.grid + b) * n + f) * TRACE_STAMPS..][..TRACE_STAMPS].try_into().ok()?;
            let taken: Vec<u64> = s[..TIMES].iter().copied().filter(|&ns| ns != 0).collect();
            match (s[START], s[END]) {
                (0, 0) => {}
                (start, end) if start != 0 && end != 0 && taken.is_sorted() => spans.push(s),
                _ => return None,
            }
        }
        Some(spans)
    }

    /// The phases of a position that phase `f` waits for: its row's waits in its layer and, from the
    /// second layer on, in the layer before; the head's, every phase of the last layer. A phase with none
    /// (the first layer's first) waits for the position before.
    fn after(&self, f: usize) -> Vec<usize> {
        let rows = self.plan.len();
        if f >= rows * self.layers {
            return ((self.layers - 1) * rows..self.layers * rows).collect();
        }
        let (l, w) = (f / rows, self.waits[f % rows]);
        let own = (0..rows).filter(|&r| w >> r & 1 == 1).map(|r| l * rows + r);
        let before = (0..rows).filter(|&r| l > 0 && w >> (PREV_LAYER_WAITS + r) & 1 == 1).map(|r| (l - 1) * rows + r);
        own.chain(before).collect()
    }

    /// The kind of phase `f` of a position: its layer operation's name, or the head's.
    fn kind(&self, f: usize) -> String {
        match self.plan.get(f % self.plan.len()) {
            Some(op) if f < self.plan.len() * self.layers => format!("{op:?}"),
            _ => HEAD.to_string(),
        }
    }

    /// The kinds of a position's first `n` phases, each once, in the program's order.
    fn kinds(&self, n: usize) -> Vec<String> {
        let mut kinds: Vec<String> = Vec::new();
        for what in (0..n).map(|f| self.kind(f)) {
            if !kinds.contains(&what) {
                kinds.push(what);
            }
        }
        kinds
    }

    /// Each kind of phase's part of a token (the layer's operations in the program's order, then the
    /// head), over `traced_positions`; `None` when no position was traced, the launch ran no head, or
    /// the stamps are incomplete (a phase that no block ran, a block with one stamp of a phase's two).
    pub fn shares(&self) -> Option<Vec<PhaseShare>> {
        if !self.head {
            return None;
        }
        let n = self.per_position();
        // The position before's head ended the position before.
        self.shares_over(self.traced_positions(), |p| self.spans(p - 1, n - 1)?.iter().map(|s| s[END]).max())
    }

    /// `shares` of a launch of one step (`GpuModel::trace_step`, with its head; a stack's step,
    /// without), its first phase's hand-off from the first block's start of it: the step's critical
    /// path from its first phase to its last.
    pub fn step_shares(&self) -> Option<Vec<PhaseShare>> {
        if self.positions() != 1 || (self.head && self.prompt != 1) {
            return None;
        }
        self.shares_over(0..1, |_| self.spans(0, 0)?.iter().map(|s| s[START]).min())
    }

    /// `LateSms` for each kind of phase but the head's, in the program's order, over `traced_positions`
    /// (a single step's position where there are none); a kind with no phase of two blocks or more is
    /// left out.
    pub fn late_sms(&self) -> Vec<LateSms> {
        let positions =
            if self.traced_positions().is_empty() { 0..self.positions().min(1) } else { self.traced_positions() };
        let phases = self.plan.len() * self.layers;
        let kind_of: Vec<String> = (0..phases).map(|f| self.kind(f)).collect();
        let mut late = Vec::new();
        for what in self.kinds(phases) {
            // Per SM: the sum of its blocks' ends after the median's (ns, signed) and how many.
            let mut per_sm: std::collections::BTreeMap<u64, (i64, i64)> = std::collections::BTreeMap::new();
            let mut leads: Vec<i64> = Vec::new();
            for p in positions.clone() {
                for f in (0..phases).filter(|&f| kind_of[f] == what) {
                    let Some(spans) = self.spans(p, f).filter(|s| s.len() > 1) else { continue };
                    let mut ends: Vec<i64> = spans.iter().map(|s| s[END] as i64).collect();
                    ends.sort_unstable();
                    let median = ends[ends.len() / 2];
                    leads.push(ends[ends.len() - 1] - median);
                    for s in &spans {
                        let e = per_sm.entry(s[TRACE_SM]).or_default();
                        *e = (e.0 + s[END] as i64 - median, e.1 + 1);
                    }
                }
            }
            if leads.is_empty() {
                continue;
            }
            let lead = leads.iter().sum::<i64>() as f64 / leads.len() as f64;
            let sms = per_sm
                .into_iter()
                .filter(|(_, (sum, n))| *sum as f64 / *n as f64 > lead / 2.0)
                .map(|(sm, _)| sm)
                .collect();
            late.push(LateSms { what, lead_us: lead / 1e3, sms });
        }
        late
    }

    /// The table of `shares` (of `shares` or `step_shares`): a row per kind of phase, the whole step,
    /// and a layer's critical path. `over`: what the figures are the mean over, for the heading.
    pub fn table(&self, shares: &[PhaseShare], over: &str) -> String {
        let mut t = String::new();
        let row = |t: &mut String, what: &str, phases: usize, f: [f64; 4], rest: &str| {
            let _ = writeln!(
                t,
                "{what:<10} {phases:>6} {:>8.1} {:>9.1} {:>13.1} {:>13.1}   {rest}",
                f[0], f[1], f[2], f[3]
            );
        };
        let _ = writeln!(t, "where a step's time goes along its critical path, traced (us a step, {over}):");
        let _ = writeln!(
            t,
            "{:<10} {:>6} {:>8} {:>9} {:>13} {:>13}   a block's input / stream / tail (medians)",
            "phase", "phases", "span", "hand-off", "median block", "later blocks"
        );
        let figures = |s: &PhaseShare| [s.span_us, s.handoff_us, s.work_us, s.later_us];
        for s in shares {
            let parts = s.parts_us.map_or("-".to_string(), |[i, st, tail]| format!("{i:.1} / {st:.1} / {tail:.1}"));
            row(&mut t, &s.what, s.phases, figures(s), &parts);
        }
        let all = shares.iter().map(figures).fold([0.0; 4], |a, f| [0, 1, 2, 3].map(|i| a[i] + f[i]));
        let events = f64::from(self.kernel_ms) * 1e3 / self.positions().max(1) as f64;
        let phases = shares.iter().map(|s| s.phases).sum();
        row(&mut t, "all", phases, all, &format!("(the traced launch: {events:.1} us a step by events)"));
        let layer = per_layer(shares, self.layers);
        let why = format!("(a layer's critical path: every phase but the head's, over {} layers)", self.layers);
        row(&mut t, &layer.what, layer.phases, figures(&layer), &why);
        t
    }

    /// Each kind of phase's part of a token's critical path over `positions`, where a phase that waits
    /// for none of its position's counts from `ready(p)`.
    fn shares_over(
        &self,
        positions: std::ops::Range<usize>,
        ready: impl Fn(usize) -> Option<u64>,
    ) -> Option<Vec<PhaseShare>> {
        assert_eq!(self.waits.len(), self.plan.len(), "a trace names each row's waits");
        if positions.is_empty() || self.plan.is_empty() {
            return None;
        }
        let n = self.per_position();
        let median = |mut v: Vec<u64>| {
            v.sort_unstable();
            v[v.len() / 2]
        };
        let us = |ns: i64| ns as f64 / 1e3;
        // The medians of input, stream and tail over the blocks that stamped all three.
        let parts = |spans: &[[u64; TRACE_STAMPS]]| -> Option<[f64; 3]> {
            let inner: Vec<&[u64; TRACE_STAMPS]> =
                spans.iter().filter(|s| s[..TIMES].iter().all(|&ns| ns != 0)).collect();
            if inner.is_empty() {
                return None;
            }
            Some([0, 1, 2].map(|i| us(median(inner.iter().map(|s| s[i + 1] - s[i]).collect()) as i64)))
        };
        // A kind per layer operation in the program's order, then the head's; none is dropped for being
        // off the path.
        let mut kinds: Vec<PhaseShare> = self
            .kinds(n)
            .into_iter()
            .map(|what| PhaseShare {
                what,
                phases: 0,
                span_us: 0.0,
                handoff_us: 0.0,
                work_us: 0.0,
                later_us: 0.0,
                parts_us: Some([0.0; 3]),
            })
            .collect();
        for p in positions.clone() {
            let start = ready(p)?;
            // Each phase's last end, the phase it waited for last (None: the position's start), its
            // figures and its blocks' stamps.
            let mut ends = vec![0u64; n];
            let mut from: Vec<Option<usize>> = vec![None; n];
            let mut figures = Vec::with_capacity(n);
            for f in 0..n {
                let spans = self.spans(p, f)?;
                ends[f] = spans.iter().map(|s| s[END]).max()?;
                let (ready_f, pred) = self
                    .after(f)
                    .into_iter()
                    .map(|g| (ends[g], Some(g)))
                    .max_by_key(|&(end, _)| end)
                    .unwrap_or((start, None));
                from[f] = pred;
                let first = median(spans.iter().map(|s| s[START]).collect());
                let work = us(median(spans.iter().map(|s| s[END] - s[START]).collect()) as i64);
                let (span, handoff) = (us(ends[f] as i64 - ready_f as i64), us(first as i64 - ready_f as i64));
                figures.push((span, handoff, work, parts(&spans)));
            }
            // Back from the phase that ended last through the phase each waited for last.
            let mut path = vec![false; n];
            let mut f = (0..n).max_by_key(|&f| ends[f])?;
            loop {
                path[f] = true;
                match from[f] {
                    Some(g) => f = g,
                    None => break,
                }
            }
            let mut on_path = vec![0usize; kinds.len()];
            for f in (0..n).filter(|&f| path[f]) {
                let k = kinds.iter().position(|k| k.what == self.kind(f)).expect("every kind was listed above");
                let (span, handoff, work, phase_parts) = figures[f];
                on_path[k] += 1;
                let k = &mut kinds[k];
                k.span_us += span;
                k.handoff_us += handoff;
                k.work_us += work;
                k.later_us += span - handoff - work;
                // A kind's parts only where every phase of it on the path at every position has them.
                k.parts_us = match (k.parts_us, phase_parts) {
                    (Some(sum), Some(add)) => Some([0, 1, 2].map(|i| sum[i] + add[i])),
                    _ => None,
                };
            }
            for (k, count) in kinds.iter_mut().zip(on_path) {
                k.phases = k.phases.max(count);
            }
        }
        let count = positions.len() as f64;
        for k in &mut kinds {
            for v in [&mut k.span_us, &mut k.handoff_us, &mut k.work_us, &mut k.later_us] {
                *v /= count;
            }
            if k.phases == 0 {
                k.parts_us = None;
            }
            if let Some(parts) = &mut k.parts_us {
                parts.iter_mut().for_each(|v| *v /= count);
            }
        }
        Some(kinds)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A trace of `positions` positions of one layer of [Qkv, Down] on three blocks, each phase taking
    /// block b (b + 1) `work` ns from `gap` ns after the phase before's last end.
    fn trace(positions: usize, work: u64, gap: u64) -> Trace {
        let (grid, n) = (3, 3);
        let mut stamps = vec![0u64; positions * grid * n * TRACE_STAMPS];
        let mut ended = 1_000;
        for p in 0..positions {
            for f in 0..n {
                let start = ended + gap;
                for b in 0..grid {
                    let at = ((p * grid + b) * n + f) * TRACE_STAMPS;
                    stamps[at + START] = start;
                    stamps[at + END] = start + work * (b as u64 + 1);
                    // An SM below every time: read as one, it would break their order.
                    stamps[at + TRACE_SM] = 2 * b as u64 + 1;
                    // Qkv's input takes a sixth of the work, its stream a half.
                    if f == 0 {
                        stamps[at + 1] = start + work * (b as u64 + 1) / 6;
                        stamps[at + 2] = start + work * (b as u64 + 1) * 2 / 3;
                    }
                }
                ended = start + 3 * work;
            }
        }
        Trace {
            stamps,
            grid,
            plan: vec![LayerOp::Qkv, LayerOp::Down],
            waits: vec![0, 1],
            layers: 1,
            head: true,
            prompt: 1,
            kernel_ms: 0.0,
        }
    }

    #[test]
    fn a_phase_comes_apart_into_hand_off_median_block_and_later_blocks() {
        let t = trace(4, 3_000, 1_000);
        assert_eq!(t.positions(), 4);
        assert_eq!(t.traced_positions(), 1..4);
        let shares = t.shares().expect("complete");
        let names: Vec<&str> = shares.iter().map(|s| s.what.as_str()).collect();
        assert_eq!(names, ["Qkv", "Down", "Head"]);
        // The median block works 6 us, the last 3 us longer.
        for s in &shares {
            assert_eq!((s.phases, s.span_us, s.handoff_us, s.work_us, s.later_us), (1, 10.0, 1.0, 6.0, 3.0), "{s:?}");
        }
        assert_eq!(shares[0].parts_us, Some([1.0, 3.0, 2.0]));
        assert_eq!(shares[1].parts_us, None);
        // A layer: Qkv and Down, the head left out.
        let layer = per_layer(&shares, 1);
        assert_eq!(
            (layer.phases, layer.span_us, layer.handoff_us, layer.work_us, layer.later_us),
            (2, 20.0, 2.0, 12.0, 6.0)
        );
        assert_eq!(per_layer(&shares, 2).span_us, 10.0);
    }

    /// Block b works (b + 1) times as long: block 2 (SM 5) ends 3 us after the median block, block 0
    /// 3 us before it.
    #[test]
    fn the_late_blocks_are_named_by_their_sm() {
        let t = trace(4, 3_000, 1_000);
        let late = t.late_sms();
        let named: Vec<(&str, f64, &[u64])> =
            late.iter().map(|l| (l.what.as_str(), l.lead_us, l.sms.as_slice())).collect();
        assert_eq!(named, [("Qkv", 3.0, &[5u64][..]), ("Down", 3.0, &[5u64][..])]);
    }

    #[test]
    fn the_stamps_write_as_numpy_reads_them() {
        let t = trace(4, 3_000, 1_000);
        let npy = t.to_npy();
        assert_eq!(&npy[..8], b"\x93NUMPY\x01\x00");
        let len = u16::from_le_bytes([npy[8], npy[9]]) as usize;
        assert_eq!((10 + len) % 64, 0, "the data starts 64-byte aligned");
        let header = std::str::from_utf8(&npy[10..10 + len]).expect("ASCII");
        assert!(header.ends_with('\n'), "{header:?}");
        assert!(header.contains(&format!("'shape': (4, {}, 3, {TRACE_STAMPS})", t.grid)), "{header}");
        let data: Vec<u64> =
            npy[10 + len..].chunks(8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes"))).collect();
        assert_eq!(data, t.stamps);
    }

    #[test]
    fn a_single_step_counts_from_its_first_blocks_start() {
        let mut t = trace(1, 3_000, 1_000);
        assert_eq!(t.shares(), None, "no head before the launch's one position");
        let shares = t.step_shares().expect("one position with its head");
        // Qkv counts from its first block's start (no hand-off), the others as in a generation.
        let spans: Vec<_> = shares.iter().map(|s| (s.what.as_str(), s.span_us, s.handoff_us)).collect();
        assert_eq!(spans, [("Qkv", 9.0, 0.0), ("Down", 10.0, 1.0), ("Head", 10.0, 1.0)]);
        t.prompt = 2;
        assert_eq!(t.step_shares(), None, "a prompt of two is not a step");
        assert_eq!(trace(2, 3_000, 1_000).step_shares(), None, "two positions are not a step");
    }

    /// A stack's step: one position, no head; its phases read as a decode step's without the head's
    /// row, and the table names each kind, the whole step and a layer.
    #[test]
    fn a_stacks_step_reads_without_a_head() {
        let mut t = trace(1, 3_000, 1_000);
        // The head's phase (the third of each position) dropped from the stamps.
        t.stamps = t
            .stamps
            .chunks(TRACE_STAMPS)
            .enumerate()
            .filter(|(i, _)| i % 3 != 2)
            .flat_map(|(_, s)| s.to_vec())
            .collect();
        (t.head, t.prompt) = (false, 0);
        assert_eq!(t.positions(), 1);
        assert_eq!(t.shares(), None, "no head: no generation's positions");
        let shares = t.step_shares().expect("one step");
        let spans: Vec<_> = shares.iter().map(|s| (s.what.as_str(), s.span_us, s.handoff_us)).collect();
        assert_eq!(spans, [("Qkv", 9.0, 0.0), ("Down", 10.0, 1.0)]);
        let table = t.table(&shares, "one step");
        let rows: Vec<&str> = table.lines().map(|l| l.split_whitespace().next().unwrap_or("")).collect();
        assert_eq!(rows, ["where", "phase", "Qkv", "Down", "all", "a"], "{table}");
        assert!(table.contains("   19.0 "), "the step's span, 9 + 10 us: {table}");
    }

    /// Phases that run side by side: two attention phases both wait for Qkv and Down for both, the
    /// first of them the longer. The critical path runs Qkv, the longer attention, Down, the head: their
    /// spans add up to the position's time, each counted from the end of the phase it waited for last,
    /// and the shorter attention is off the path.
    #[test]
    fn phases_side_by_side_are_read_along_the_critical_path() {
        let (grid, positions) = (3usize, 3usize);
        // Per phase: the phases it starts 1 us after the last end of (none: the position's start), and
        // block b's work, (b + 1) times this many ns.
        let phases: [(&[usize], u64); 5] =
            [(&[], 3_000), (&[0], 4_000), (&[0], 1_000), (&[1, 2], 3_000), (&[3], 3_000)];
        let n = phases.len();
        let mut stamps = vec![0u64; positions * grid * n * TRACE_STAMPS];
        let mut position_end = 1_000;
        for p in 0..positions {
            let mut ends = [0u64; 5];
            for (f, &(after, work)) in phases.iter().enumerate() {
                let start = 1_000 + after.iter().map(|&g| ends[g]).max().unwrap_or(position_end);
                for b in 0..grid {
                    let at = ((p * grid + b) * n + f) * TRACE_STAMPS;
                    stamps[at + START] = start;
                    stamps[at + END] = start + work * (b as u64 + 1);
                }
                ends[f] = start + work * grid as u64;
            }
            position_end = ends[n - 1];
        }
        let t = Trace {
            stamps,
            grid,
            plan: vec![LayerOp::Qkv, LayerOp::Attention, LayerOp::Attention, LayerOp::Down],
            waits: vec![0, 0b1, 0b1, 0b110],
            layers: 1,
            head: true,
            prompt: 1,
            kernel_ms: 0.0,
        };
        let shares = t.shares().expect("complete");
        let rows: Vec<_> = shares
            .iter()
            .map(|s| (s.what.as_str(), s.phases, s.span_us, s.handoff_us, s.work_us, s.later_us))
            .collect();
        assert_eq!(
            rows,
            [
                ("Qkv", 1, 10.0, 1.0, 6.0, 3.0),
                ("Attention", 1, 13.0, 1.0, 8.0, 4.0),
                ("Down", 1, 10.0, 1.0, 6.0, 3.0),
                ("Head", 1, 10.0, 1.0, 6.0, 3.0)
            ]
        );
        // The path's spans are the position's time: 43 us from one head's end to the next's.
        assert_eq!(shares.iter().map(|s| s.span_us).sum::<f64>(), 43.0);
        // Read as if Down waited for the shorter attention alone (the one before it in program order, as
        // the trace read every phase before it followed the program's waits), Down's hand-off holds the
        // longer attention's lead over the shorter: 10 us where it is 1.
        let misread = Trace { waits: vec![0, 0b1, 0b1, 0b100], ..t };
        let down = misread.shares().expect("complete")[2].clone();
        assert_eq!((down.span_us, down.handoff_us), (19.0, 10.0));
    }

    /// Two layers of [Qkv, Down] as the compiler writes their waits: Qkv waits for the layer before's
    /// Down (a bit from `PREV_LAYER_WAITS`, none in the first layer), Down for its Qkv. Each phase starts
    /// 1 us after the phase before and its blocks take 3, 6 and 9 us: every phase is on the path, and
    /// the second layer's Qkv counts from the first layer's Down.
    #[test]
    fn a_layers_first_phase_waits_for_the_layer_before() {
        let (grid, n) = (3usize, 5usize);
        let mut stamps = vec![0u64; 2 * grid * n * TRACE_STAMPS];
        let mut ended = 1_000;
        for p in 0..2 {
            for f in 0..n {
                let start = ended + 1_000;
                for b in 0..grid {
                    let at = ((p * grid + b) * n + f) * TRACE_STAMPS;
                    (stamps[at + START], stamps[at + END]) = (start, start + 3_000 * (b as u64 + 1));
                }
                ended = start + 9_000;
            }
        }
        let t = Trace {
            stamps,
            grid,
            plan: vec![LayerOp::Qkv, LayerOp::Down],
            waits: vec![1 << (PREV_LAYER_WAITS + 1), 1],
            layers: 2,
            head: true,
            prompt: 1,
            kernel_ms: 0.0,
        };
        assert_eq!(t.after(2), [1], "the second layer's Qkv waits for the first layer's Down");
        assert_eq!(t.after(0), [] as [usize; 0], "the first layer's Qkv waits for the position before");
        assert_eq!(t.after(4), [2, 3], "the head waits for the last layer");
        let rows: Vec<_> =
            t.shares().expect("complete").iter().map(|s| (s.what.clone(), s.phases, s.span_us)).collect();
        assert_eq!(rows, [("Qkv".to_string(), 2, 20.0), ("Down".to_string(), 2, 20.0), ("Head".to_string(), 1, 10.0)]);
    }

    #[test]
    fn incomplete_stamps_are_not_read() {
        let mut t = trace(3, 3_000, 1_000);
        // Block 1 starts phase 1 of position 2 and never ends it.
        t.stamps[((2 * 3 + 1) * 3 + 1) * TRACE_STAMPS + END] = 0;
        assert_eq!(t.shares(), None);
        // A launch of the prompt alone traces no position after a head, nor one without a prompt.
        let mut t = trace(3, 3_000, 1_000);
        t.prompt = 3;
        assert_eq!(t.shares(), None);
        t.prompt = 0;
        assert_eq!(t.shares(), None);
    }
}
