//! The fused launch as its blocks lived it: every block stamps the GPU's global timer when it starts
//! and finishes each phase it runs, and a GEMV phase also when its input is ready and when its stream
//! is done (`Megakernel::trace_step`), so the time a phase holds the critical path, the spread of its
//! blocks, where a block's time inside a phase goes and the time they wait for the phases they depend
//! on are visible, as a table and as an SVG timeline (one row per block, a colour per phase, white
//! where a block waits).

use std::fmt::Write as _;

use megakernel::program::Blocks;
use megakernel::{TRACE_END, TRACE_STAMPS};
use serde::Serialize;

/// One phase of the traced launch. Times in microseconds from the launch's first stamp.
#[derive(Debug, Clone, Serialize)]
pub struct TracedPhase {
    pub phase: String,
    /// The earliest start and the latest end of any block.
    pub first_start_us: f64,
    pub last_end_us: f64,
    /// What the phase adds to the launch: how far its last end is past every earlier phase's (zero
    /// for a phase that ran beside a longer one).
    pub critical_us: f64,
    /// `critical_us` over the phase's bytes at the floor bandwidth.
    pub x_floor: f64,
    /// A block's time inside the phase (start to end): median and largest over its blocks.
    pub busy_median_us: f64,
    pub busy_max_us: f64,
    /// Mean time a block of the phase waited after finishing it until it started its next phase.
    pub wait_mean_us: f64,
    /// A GEMV phase's block time in parts (medians over its blocks); `None` for attention.
    pub parts: Option<BusyParts>,
}

/// Where a GEMV phase's block spends its time: from its start to its input in registers (the norm, or
/// the load of the vector it multiplies), then its weight stream, then the rest (the epilogue that
/// writes its outputs, the block's synchronisation).
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct BusyParts {
    pub input_us: f64,
    pub stream_us: f64,
    pub tail_us: f64,
}

/// The traced launch: per-phase figures and each block's stamps.
#[derive(Debug, Clone, Serialize)]
pub struct Timeline {
    pub blocks: usize,
    pub total_us: f64,
    pub phases: Vec<TracedPhase>,
    /// `spans[block][phase] = (start_us, end_us)`, `None` where the block does not run the phase.
    #[serde(skip)]
    pub spans: Vec<Vec<Option<(f64, f64)>>>,
}

impl Timeline {
    /// Reads the stamps of `trace_step` (`(block, phase, TRACE_STAMPS)`: start, input, streamed and end
    /// in ns, then the SM) for phases named `names`, run by the blocks `blocks_of[phase]`, whose floors (us at the
    /// floor bandwidth) are `floors_us`. `None` when a start or end stamp is missing (zero) for a block
    /// that runs the phase, any stamp is present for one that does not, the inner stamps are present
    /// for some of a phase's blocks and not others, or stamps are out of order: a trace that cannot be
    /// trusted is not drawn.
    pub fn of(
        stamps: &[u64],
        blocks: usize,
        names: &[String],
        floors_us: &[f64],
        blocks_of: &[Blocks],
    ) -> Option<Timeline> {
        let phases = names.len();
        if phases == 0 || blocks == 0 || stamps.len() != blocks * phases * TRACE_STAMPS || blocks_of.len() != phases {
            return None;
        }
        let at = |b: usize, p: usize| &stamps[(b * phases + p) * TRACE_STAMPS..][..TRACE_STAMPS];
        let inner = |b: usize, p: usize| at(b, p)[1] != 0 && at(b, p)[2] != 0;
        let whole = (0..phases).all(|p| {
            let runs: Vec<usize> = (0..blocks).filter(|&b| blocks_of[p].contains(b)).collect();
            let consistent =
                runs.iter().all(|&b| inner(b, p)) || runs.iter().all(|&b| at(b, p)[1] == 0 && at(b, p)[2] == 0);
            consistent
                && (0..blocks).all(|b| {
                    let s = at(b, p);
                    if blocks_of[p].contains(b) { s[0] != 0 && s[TRACE_END] != 0 } else { s.iter().all(|&v| v == 0) }
                })
        });
        if !whole {
            return None;
        }
        let origin = stamps.chunks(TRACE_STAMPS).flat_map(|s| &s[..=TRACE_END]).copied().filter(|&ns| ns != 0).min()?;
        let us = |ns: u64| (ns - origin) as f64 / 1e3;
        let spans: Vec<Vec<Option<(f64, f64)>>> = (0..blocks)
            .map(|b| {
                (0..phases)
                    .map(|p| blocks_of[p].contains(b).then(|| (us(at(b, p)[0]), us(at(b, p)[TRACE_END]))))
                    .collect()
            })
            .collect();
        let ordered = spans.iter().all(|row| {
            let own: Vec<(f64, f64)> = row.iter().flatten().copied().collect();
            own.iter().all(|&(s, e)| s <= e) && own.windows(2).all(|w| w[0].1 <= w[1].0)
        }) && (0..blocks)
            .all(|b| (0..phases).all(|p| !inner(b, p) || at(b, p)[..=TRACE_END].is_sorted()));
        if !ordered {
            return None;
        }
        // Each GEMV phase's parts: medians over its blocks of input, stream and tail.
        let parts = |p: usize| -> Option<BusyParts> {
            let runs: Vec<&[u64]> = (0..blocks).filter(|&b| inner(b, p)).map(|b| at(b, p)).collect();
            let median = |i: usize| {
                let mut d: Vec<f64> = runs.iter().map(|s| (s[i + 1] - s[i]) as f64 / 1e3).collect();
                d.sort_by(f64::total_cmp);
                d.get(d.len() / 2).copied()
            };
            Some(BusyParts { input_us: median(0)?, stream_us: median(1)?, tail_us: median(2)? })
        };
        let mut ended = 0.0f64;
        let mut out = Vec::with_capacity(phases);
        for p in 0..phases {
            let column: Vec<(f64, f64)> = spans.iter().filter_map(|row| row[p]).collect();
            if column.is_empty() {
                return None;
            }
            let first_start = column.iter().map(|c| c.0).fold(f64::INFINITY, f64::min);
            let last_end = column.iter().map(|c| c.1).fold(0.0, f64::max);
            let mut busy: Vec<f64> = column.iter().map(|c| c.1 - c.0).collect();
            busy.sort_by(f64::total_cmp);
            // Each of the phase's blocks: from its end to the start of its next phase, if any.
            let waits: Vec<f64> =
                spans.iter().filter_map(|row| Some(row[p + 1..].iter().flatten().next()?.0 - row[p]?.1)).collect();
            let critical = (last_end - ended).max(0.0);
            out.push(TracedPhase {
                phase: names[p].clone(),
                first_start_us: first_start,
                last_end_us: last_end,
                critical_us: critical,
                x_floor: critical / floors_us[p],
                busy_median_us: busy[busy.len() / 2],
                busy_max_us: busy[busy.len() - 1],
                wait_mean_us: if waits.is_empty() { 0.0 } else { waits.iter().sum::<f64>() / waits.len() as f64 },
                parts: parts(p),
            });
            ended = ended.max(last_end);
        }
        Some(Timeline { blocks, total_us: ended, phases: out, spans })
    }

    pub fn table(&self) -> String {
        let mut s =
            format!("\nfused launch, traced ({} blocks, {:.1} us stamp to stamp)\n", self.blocks, self.total_us);
        let _ = writeln!(
            s,
            "  {:<15} {:>9} {:>9} {:>11} {:>8} {:>12} {:>9} {:>10} {:>22}",
            "phase",
            "start us",
            "end us",
            "critical us",
            "x floor",
            "busy med us",
            "busy max",
            "wait after",
            "input / stream / tail"
        );
        for p in &self.phases {
            // A phase that ended before one listed above it added nothing to the launch's length.
            let (critical, x_floor) = if p.critical_us > 0.0 {
                (format!("{:.1}", p.critical_us), format!("{:.3}", p.x_floor))
            } else {
                ("-".to_string(), "-".to_string())
            };
            let parts = p
                .parts
                .map_or("-".to_string(), |b| format!("{:.1} / {:.1} / {:.1}", b.input_us, b.stream_us, b.tail_us));
            let _ = writeln!(
                s,
                "  {:<15} {:>9.1} {:>9.1} {critical:>11} {x_floor:>8} {:>12.1} {:>9.1} {:>10.1} {parts:>22}",
                p.phase, p.first_start_us, p.last_end_us, p.busy_median_us, p.busy_max_us, p.wait_mean_us
            );
        }
        s + "  critical: how far the phase moved the launch's end past the phases above it ('-': it ended\n  \
             under one of them, beside whose work it ran). input / stream / tail: a GEMV block's median time\n  \
             to its input in registers (norm or load), in its weight stream, and after it (epilogue)\n"
    }

    /// One row per block, a coloured bar per phase from its start to its end; white is waiting. Blocks
    /// that run the same phases are drawn together (in block order), so each role is one band.
    pub fn svg(&self, title: &str) -> String {
        const W: f64 = 960.0;
        const LEFT: f64 = 60.0;
        const TOP: f64 = 40.0;
        const ROW: f64 = 3.0;
        // One per phase a program can hold.
        const COLOURS: [&str; megakernel::program::MAX_PHASES] = [
            "#5b9bd5", "#d9534f", "#f0ad4e", "#5cb85c", "#8e6fb8", "#777777", "#17becf", "#bcbd22", "#e377c2",
            "#8c564b", "#1f3a93", "#ff9896",
        ];
        // The legend: an entry per phase, LEGEND_ROW to a line.
        const LEGEND_W: f64 = 170.0;
        const LEGEND_ROW: usize = 5;
        let plot_h = ROW * self.blocks as f64;
        let height = TOP + plot_h + 42.0 + 18.0 * self.phases.len().div_ceil(LEGEND_ROW) as f64;
        let scale = (W - LEFT - 20.0) / self.total_us.max(1e-9);
        let mut s = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{height}\" font-family=\"monospace\" font-size=\"12\">\n"
        );
        let _ = writeln!(s, "<text x=\"8\" y=\"18\">{title}</text>");
        let _ = writeln!(s, "<text x=\"8\" y=\"{}\">blocks, grouped by the phases they run</text>", TOP - 6.0);
        let runs =
            |row: &Vec<Option<(f64, f64)>>| row.iter().rev().fold(0u64, |m, span| m << 1 | span.is_some() as u64);
        let mut order: Vec<&Vec<Option<(f64, f64)>>> = self.spans.iter().collect();
        order.sort_by_key(|row| runs(row));
        for (b, row) in order.into_iter().enumerate() {
            let y = TOP + ROW * b as f64;
            for (p, &(start, end)) in row.iter().enumerate().filter_map(|(p, span)| Some((p, span.as_ref()?))) {
                let _ = writeln!(
                    s,
                    "<rect x=\"{:.2}\" y=\"{y:.1}\" width=\"{:.2}\" height=\"{ROW}\" fill=\"{}\"/>",
                    LEFT + start * scale,
                    ((end - start) * scale).max(0.5),
                    COLOURS[p % COLOURS.len()]
                );
            }
        }
        // A tick every 50 us, then the legend: each phase's colour and its critical time.
        let axis = TOP + plot_h + 14.0;
        let mut t = 0.0;
        while t <= self.total_us {
            let _ = writeln!(s, "<text x=\"{:.1}\" y=\"{axis}\">{t:.0}</text>", LEFT + t * scale);
            t += 50.0;
        }
        let _ = writeln!(s, "<text x=\"{:.1}\" y=\"{axis}\">us</text>", W - 18.0);
        for (p, ph) in self.phases.iter().enumerate() {
            let (x, y) = (LEFT + LEGEND_W * (p % LEGEND_ROW) as f64, axis + 22.0 + 18.0 * (p / LEGEND_ROW) as f64);
            let _ = writeln!(
                s,
                "<rect x=\"{x:.1}\" y=\"{}\" width=\"12\" height=\"12\" fill=\"{}\"/>",
                y - 10.0,
                COLOURS[p % COLOURS.len()]
            );
            // Its critical time, as in the table ('-': it ran beside an earlier phase's work).
            let critical = if ph.critical_us > 0.0 { format!("{:.1} us", ph.critical_us) } else { "-".to_string() };
            let _ = writeln!(s, "<text x=\"{:.1}\" y=\"{y}\">{} {critical}</text>", x + 16.0, ph.phase);
        }
        s + "</svg>\n"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|p| format!("P{p}")).collect()
    }

    fn span(first: u32, count: u32) -> Blocks {
        Blocks { first, count, stride: 1 }
    }

    fn ns(us: u64) -> u64 {
        1_000_000 + us * 1000
    }

    /// A phase's four times as traced stamps: the SM (a number below the times, so that a check of the
    /// times' order that took it in would fail) where the block ran the phase, zero where it did not.
    fn stamped(times: [u64; 4]) -> [u64; TRACE_STAMPS] {
        [times[0], times[1], times[2], times[3], if times[0] == 0 { 0 } else { 7 }]
    }

    /// `[start, end]` pairs as traced stamps with no inner ones (attention's, or none at all).
    fn outer(pairs: &[u64]) -> Vec<u64> {
        pairs.chunks(2).flat_map(|p| stamped([p[0], 0, 0, p[1]])).collect()
    }

    #[test]
    fn critical_times_add_up_and_waits_are_measured() {
        // Two blocks, two phases; block 1 finishes phase 0 late, block 0 waits 3 us for it.
        let stamps = outer(&[ns(0), ns(10), ns(13), ns(20), ns(1), ns(13), ns(13), ns(25)]);
        let t = Timeline::of(&stamps, 2, &names(2), &[5.0, 6.0], &[span(0, 2), span(0, 2)]).expect("a complete trace");
        assert_eq!(t.total_us, 25.0);
        assert_eq!(t.phases[0].critical_us, 13.0);
        assert_eq!(t.phases[1].critical_us, 12.0);
        assert_eq!(t.phases[0].x_floor, 13.0 / 5.0);
        assert_eq!(t.phases[0].wait_mean_us, 1.5);
        assert_eq!(t.phases[0].busy_max_us, 12.0);
        assert_eq!(t.phases[1].first_start_us, 13.0);
        let svg = t.svg("test");
        assert_eq!(svg.matches("<rect").count(), 4 + 2, "a bar per block and phase, a legend box per phase");
    }

    /// Phases run by part of the grid: a phase beside a longer one adds nothing, waits run to the block's
    /// own next phase.
    #[test]
    fn phases_of_part_of_the_grid() {
        // Phase 0 on both blocks, phase 1 on block 1 (10..30), phase 2 on block 0 (12..20), phase 3 on
        // both.
        let stamps = outer(&[
            ns(0),
            ns(10),
            0,
            0,
            ns(12),
            ns(20),
            ns(31),
            ns(40), //
            ns(0),
            ns(9),
            ns(10),
            ns(30),
            0,
            0,
            ns(32),
            ns(41),
        ]);
        let sets = [span(0, 2), span(1, 1), span(0, 1), span(0, 2)];
        let t = Timeline::of(&stamps, 2, &names(4), &[1.0; 4], &sets).expect("a complete trace");
        let critical: Vec<f64> = t.phases.iter().map(|p| p.critical_us).collect();
        assert_eq!(critical, [10.0, 20.0, 0.0, 11.0]);
        assert_eq!(t.total_us, 41.0);
        assert_eq!(t.phases[0].wait_mean_us, (2.0 + 1.0) / 2.0);
        assert_eq!(t.phases[2].wait_mean_us, 11.0);
        // The table shows the phase that ran beside a longer one as off the critical path.
        let hidden = t.table().lines().find(|l| l.trim_start().starts_with("P2")).unwrap().to_string();
        assert_eq!(hidden.split_whitespace().nth(3), Some("-"), "{hidden}");
        let svg = t.svg("test");
        assert_eq!(svg.matches("<rect").count(), 6 + 4);
        assert!(svg.contains(">P2 -<") && svg.contains(">P1 20.0 us<"), "the legend as the table: {svg}");
        // Block 1 (phases 0, 1, 3) is drawn above block 0 (phases 0, 2, 3): phase 1's bar is in the top row.
        let bar =
            |fill: &str| svg.lines().find(|l| l.contains("height=\"3\"") && l.contains(fill)).unwrap().to_string();
        assert!(bar("#d9534f").contains("y=\"40.0\"") && bar("#f0ad4e").contains("y=\"43.0\""), "{svg}");
        // A stamp where the block does not run the phase, or none where it does: not drawn.
        let mut stray = stamps.clone();
        stray[TRACE_STAMPS] = ns(11); // block 0, phase 1 (which block 0 does not run), start
        assert!(Timeline::of(&stray, 2, &names(4), &[1.0; 4], &sets).is_none());
        assert!(
            Timeline::of(&stamps, 2, &names(4), &[1.0; 4], &[span(0, 2), span(0, 2), span(0, 1), span(0, 2)]).is_none()
        );
    }

    #[test]
    fn a_missing_or_disordered_stamp_is_not_drawn() {
        let one = [span(0, 1)];
        let of =
            |stamps: &[u64], blocks, sets: &[Blocks]| Timeline::of(stamps, blocks, &names(sets.len()), &[1.0; 2], sets);
        assert!(of(&outer(&[5, 0]), 1, &one).is_none(), "a zero stamp: the block never wrote it");
        assert!(of(&outer(&[9, 5]), 1, &one).is_none(), "an end before its start");
        assert!(
            of(&outer(&[1, 5, 4, 9]), 1, &[span(0, 1), span(0, 1)]).is_none(),
            "a phase starting before the last ended"
        );
        assert!(of(&outer(&[1, 5]), 2, &[span(0, 2)]).is_none(), "too few stamps for the grid");
        assert!(of(&stamped([1, 3, 6, 9]), 1, &one).is_some(), "in order, the SM after the times");
        assert!(of(&stamped([1, 6, 3, 9]), 1, &one).is_none(), "an input stamp after the stream's");
        assert!(of(&stamped([1, 3, 0, 9]), 1, &one).is_none(), "an input stamp without the stream's");
        assert!(of(&[1, 2, 3, 9], 1, &one).is_none(), "a phase's stamps without its SM: too few");
        let one_inner: Vec<u64> = [[1, 2, 3, 9], [1, 0, 0, 9]].into_iter().flat_map(stamped).collect();
        assert!(
            of(&one_inner, 2, &[span(0, 2)]).is_none(),
            "inner stamps from one block of the phase and not the other"
        );
    }

    /// A GEMV phase's inner stamps split each block's time into input, stream and tail (medians over
    /// its blocks); a phase without them has no parts.
    #[test]
    fn inner_stamps_split_a_gemv_blocks_time() {
        let stamps: Vec<u64> = [
            [ns(0), ns(2), ns(10), ns(11)],
            [ns(12), 0, 0, ns(20)], // block 0: GEMV 2 / 8 / 1, then attention
            [ns(0), ns(4), ns(10), ns(13)],
            [ns(13), 0, 0, ns(21)], // block 1: GEMV 4 / 6 / 3
        ]
        .into_iter()
        .flat_map(stamped)
        .collect();
        let t = Timeline::of(&stamps, 2, &names(2), &[1.0; 2], &[span(0, 2), span(0, 2)]).expect("a complete trace");
        // Medians of two: the larger (index len / 2).
        assert_eq!(t.phases[0].parts, Some(BusyParts { input_us: 4.0, stream_us: 8.0, tail_us: 3.0 }));
        assert_eq!(t.phases[1].parts, None);
        assert!(t.table().contains("4.0 / 8.0 / 3.0"), "{}", t.table());
    }
}
