//! A step as the grid's blocks run it, task by task: the dataflow plan of docs/perf.md, on the CPU first.
//!
//! Each block walks its own list of tasks in a fixed order. A task is one block's share of one phase
//! of one layer (its rows of a GEMV, its KV heads of attention); it waits until counters reach
//! targets, computes its share with the golden model's functions, and adds one to every counter it
//! signals. Nothing else orders two tasks: no barrier, no phase boundary. `TaskGraph::compile` builds
//! the lists from a program and says which counters each task waits on: a phase's whole count for
//! every wait the program's rows name (the kernel's protocol today), or, `Waits::KvHeads`, attention on
//! each of its KV heads' own Qkv rows only (the first narrowing of the dataflow plan: a KV head's
//! attention starts once the blocks that wrote its q, k and v rows are done, whatever the others do).
//!
//! A GEMV's rows split over its blocks as the kernel splits them (`block_rows`, in pairs), so a
//! counter's target (how many Qkv tasks write a KV group's rows) is the one the kernel would wait for;
//! attention's KV heads split over its blocks in ranges, where the kernel deals them to teams (which
//! block takes a head changes nothing it waits for).
//!
//! `run` executes the graph with the blocks interleaved by a seeded choice among those whose next
//! task is ready, so a wait that is missing or too low shows as a step that differs from the golden
//! model's, and a cycle of waits as a deadlock, before a kernel runs the graph. Every buffer a task
//! writes is poisoned (NaN) before the step, so a read that comes too early reads NaN, not last step's
//! value; a part of a GEMV split by columns checks that the parts before it left their partial sums of
//! its rows in its layer (the kernel's same-block chains, which no wait orders), and the last computes
//! the whole product. It runs every plan (one role or two, the MLP in parts) over packed weights.

use std::collections::HashMap;
use std::ops::Range;

use half::bf16;
use reference::golden::{self, KvCache, RopeTable};
use spec::{Config, Tensor};

use super::cpu::{self, Arena, CpuStack, Part, sub_config};
use super::pack::{Groups, qkv_source};
use super::program::{self, Blocks, Op, PREV_LAYER_WAITS, Row, WAITS_WORD, attn, down, gateup, oproj, qkv};

/// A counter of the graph: phase `phase` of layer `layer`, whole (`group` None) or for one KV group's
/// rows (Qkv's, `Waits::KvHeads`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Counter {
    pub layer: usize,
    pub phase: usize,
    pub group: Option<usize>,
}

/// One block's share of phase `phase` of layer `layer`: `units` of its op, a GEMV's in pairs of rows
/// (RoPE's pairs of Qkv, GateUp's gate and up rows of one element of act, two rows of the O projection
/// and of Down), attention's in KV heads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Task {
    pub layer: usize,
    pub phase: usize,
    pub units: Range<usize>,
    /// Counters and the counts they must reach before the task starts.
    pub waits: Vec<(Counter, u32)>,
    pub signals: Vec<Counter>,
}

/// What attention waits for of the Qkv phase of its layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waits {
    /// Every Qkv task (the program's phase-wide wait).
    Phases,
    /// The Qkv tasks that wrote its KV heads' rows.
    KvHeads,
}

/// Every block's list of tasks, in the order it runs them.
#[derive(Debug, Clone)]
pub struct TaskGraph {
    pub blocks: Vec<Vec<Task>>,
}

/// Rows of a GEMV's unit: the kernel's blocks take rows in pairs (`block_rows`, `qkv_unit`).
const PAIR: usize = 2;

/// How many units phase `row` splits among its blocks.
fn units(row: &Row) -> usize {
    match Op::from_word(row[0]).expect("a compiled row") {
        Op::Attention => row[attn::NKv as usize] as usize,
        Op::Qkv | Op::OProj | Op::GateUp | Op::Down => program::gemv_rows(row).unwrap() / PAIR,
        op => panic!("the block machine runs no {op:?} row"),
    }
}

/// The rows of a GEMV's units `u`.
fn pairs(u: &Range<usize>) -> Range<usize> {
    PAIR * u.start..PAIR * u.end
}

/// The layer as a Qkv or attention row sees it: its own query and KV heads (a role's half of them).
fn row_config(cfg: &Config, row: &Row) -> Config {
    let (n_q, n_kv) = match Op::from_word(row[0]) {
        Some(Op::Qkv) => (row[qkv::NQ as usize], row[qkv::NKv as usize]),
        Some(Op::Attention) => (row[attn::NQ as usize], row[attn::NKv as usize]),
        op => panic!("{op:?} names no heads"),
    };
    sub_config(cfg, n_q as usize, n_kv as usize)
}

/// The KV groups, numbered within the row's heads, whose rows packed rows `rows` of Qkv row `row` hold.
fn groups_of(cfg: &Config, row: &Row, rows: Range<usize>) -> Vec<usize> {
    let own = row_config(cfg, row);
    let mut groups: Vec<usize> = rows
        .map(|p| match qkv_source(&own, Groups::all(&own), p) {
            (Tensor::Wq, r) => r / own.hd / own.group(),
            (_, r) => r / own.hd,
        })
        .collect();
    groups.sort_unstable();
    groups.dedup();
    groups
}

/// The first KV head of each Qkv and attention row (a role's half starts past the other's): the Qkv
/// rows write q at their first query head, in the order of their heads, and an attention row reads the
/// q its Qkv row writes.
fn first_kv_heads(program: &[Row]) -> Vec<Option<usize>> {
    let mut writers: Vec<(i64, usize)> = program
        .iter()
        .filter(|r| r[0] == Op::Qkv as i64)
        .map(|r| (r[qkv::QOut as usize], r[qkv::NKv as usize] as usize))
        .collect();
    writers.sort_unstable();
    let mut first = HashMap::new();
    let mut kv0 = 0;
    for (q, n_kv) in writers {
        first.insert(q, kv0);
        kv0 += n_kv;
    }
    program
        .iter()
        .map(|r| match Op::from_word(r[0]) {
            Some(Op::Qkv) => first.get(&r[qkv::QOut as usize]).copied(),
            Some(Op::Attention) => Some(first[&r[attn::Q as usize]]),
            _ => None,
        })
        .collect()
}

impl TaskGraph {
    /// The tasks of `layers` layers of `program` on `grid` blocks: each phase's units split over the
    /// blocks its row names as the kernel splits a GEMV's rows (`block_rows`: block i of n takes units
    /// [i U / n, (i + 1) U / n)); each block's tasks in program order, layer after layer.
    pub fn compile(program: &[Row], layers: usize, cfg: &Config, grid: usize, waits: Waits) -> TaskGraph {
        let n = program.len();
        let kv0 = first_kv_heads(program);
        let shares: Vec<Vec<(usize, Range<usize>)>> = program
            .iter()
            .map(|row| {
                let (total, blocks) = (units(row), Blocks::of(row));
                let count = blocks.count as usize;
                (0..count)
                    .map(|i| {
                        let block = blocks.first as usize + i * blocks.stride as usize;
                        assert!(block < grid, "block {block} of a grid of {grid}");
                        (block, i * total / count..(i + 1) * total / count)
                    })
                    .filter(|(_, u)| !u.is_empty())
                    .collect()
            })
            .collect();
        // The KV heads each Qkv task writes rows of, and how many tasks write each (phase, head).
        let heads_of = |phase: usize, u: &Range<usize>| -> Vec<usize> {
            let first = kv0[phase].expect("a Qkv row");
            groups_of(cfg, &program[phase], pairs(u)).into_iter().map(|g| first + g).collect()
        };
        let mut writers: HashMap<(usize, usize), u32> = HashMap::new();
        for phase in (0..n).filter(|&p| program[p][0] == Op::Qkv as i64) {
            for (_, u) in &shares[phase] {
                for head in heads_of(phase, u) {
                    *writers.entry((phase, head)).or_default() += 1;
                }
            }
        }
        let whole = |layer: usize, phase: usize| (Counter { layer, phase, group: None }, shares[phase].len() as u32);
        let mut blocks = vec![Vec::new(); grid];
        for layer in 0..layers {
            for (phase, row) in program.iter().enumerate() {
                let mask = row[WAITS_WORD];
                let narrowed = waits == Waits::KvHeads && row[0] == Op::Attention as i64;
                for (block, u) in &shares[phase] {
                    let mut task_waits = Vec::new();
                    for w in (0..n).filter(|&w| mask >> w & 1 == 1) {
                        if narrowed && program[w][0] == Op::Qkv as i64 {
                            let first = kv0[phase].expect("an attention row");
                            task_waits.extend(u.clone().map(|h| {
                                let head = first + h;
                                let target = writers.get(&(w, head)).copied();
                                let target = target.unwrap_or_else(|| {
                                    panic!("attention waits on Qkv row {w}, which writes no row of KV head {head}")
                                });
                                (Counter { layer, phase: w, group: Some(head) }, target)
                            }));
                        } else {
                            task_waits.push(whole(layer, w));
                        }
                    }
                    if layer > 0 {
                        task_waits.extend(
                            (0..n).filter(|&w| mask >> (PREV_LAYER_WAITS + w) & 1 == 1).map(|w| whole(layer - 1, w)),
                        );
                    }
                    let mut signals = vec![Counter { layer, phase, group: None }];
                    if row[0] == Op::Qkv as i64 {
                        signals.extend(heads_of(phase, u).into_iter().map(|g| Counter {
                            layer,
                            phase,
                            group: Some(g),
                        }));
                    }
                    blocks[*block].push(Task { layer, phase, units: u.clone(), waits: task_waits, signals });
                }
            }
        }
        TaskGraph { blocks }
    }

    /// Every task, as (block, index in its list).
    pub fn tasks(&self) -> impl Iterator<Item = (usize, usize, &Task)> {
        self.blocks.iter().enumerate().flat_map(|(b, list)| list.iter().enumerate().map(move |(i, t)| (b, i, t)))
    }
}

/// One step of `stack` at `pos` from `x` as `graph` runs it, the blocks interleaved by a generator
/// seeded with `seed`: each layer's output; or the tasks left when no block's next task is ready, or
/// the first task that found partial sums another had not yet left.
pub fn run(
    stack: &mut CpuStack,
    graph: &TaskGraph,
    x: &[bf16],
    pos: usize,
    seed: u64,
) -> Result<Vec<Vec<bf16>>, String> {
    let (cfg, layers) = (stack.cfg.clone(), stack.layers.len());
    assert!(stack.layers.iter().all(|l| l.in_place.is_none()), "the block machine runs packed weights");
    poison(stack);
    let mut outputs = vec![vec![bf16::NAN; cfg.d]; layers];
    let mut counts: HashMap<Counter, u32> = HashMap::new();
    let mut next = vec![0usize; graph.blocks.len()];
    let mut state = seed | 1;
    loop {
        let ready: Vec<usize> = (0..graph.blocks.len())
            .filter(|&b| {
                graph.blocks[b]
                    .get(next[b])
                    .is_some_and(|t| t.waits.iter().all(|(c, target)| counts.get(c).copied().unwrap_or(0) >= *target))
            })
            .collect();
        if ready.is_empty() {
            let left: Vec<String> = (0..graph.blocks.len())
                .filter_map(|b| graph.blocks[b].get(next[b]).map(|t| format!("block {b}: {t:?}")))
                .collect();
            if left.is_empty() {
                return Ok(outputs);
            }
            return Err(format!("deadlock: no block's next task is ready; {}", left.join("; ")));
        }
        // xorshift64: any interleaving the waits allow must compute the same step.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let b = ready[(state % ready.len() as u64) as usize];
        let task = &graph.blocks[b][next[b]];
        run_task(stack, task, x, &mut outputs, pos).map_err(|e| format!("block {b}: {task:?}: {e}"))?;
        for c in &task.signals {
            *counts.entry(*c).or_insert(0) += 1;
        }
        next[b] += 1;
    }
}

/// The step's scratch (q, the attention output, x1, act), NaN, and the partial sums' too: a task that
/// reads one before its writer has run reads NaN rather than what the layer before or the step before
/// left there. (A cache slot is written at `pos` only; an attention that reads slot `pos` too early
/// reads the step before's value there, which the golden check catches through its output.)
fn poison(stack: &mut CpuStack) {
    let (b, cfg) = (&stack.buffers, &stack.cfg);
    for (addr, n) in [(b.q, cfg.q_dim()), (b.a, cfg.q_dim()), (b.x1, cfg.d), (b.act, cfg.ffn)] {
        stack.arena.write_bf16(addr as i64, &vec![bf16::NAN; n]);
    }
    for addr in [b.x1_part, b.down_part].into_iter().filter(|&a| a != 0) {
        stack.arena.write_f32(addr as i64, &vec![f32::NAN; cfg.d]);
    }
}

/// Rows `rows` of the row-major matrix at `w` of `cols` columns times `h`, as the golden model's GEMV
/// computes each row (a row's sum does not depend on the others).
fn rows_times(arena: &Arena, w: i64, rows: Range<usize>, cols: usize, h: &[bf16]) -> Vec<bf16> {
    golden::gemv(&arena.bf16(w + (2 * rows.start * cols) as i64, rows.len() * cols), rows.len(), cols, h)
}

// The O projection's and Down's rows name their weights, input and columns at the same words.
const _: () = assert!(
    oproj::W as usize == down::W as usize
        && oproj::A as usize == down::Act as usize
        && oproj::Cols as usize == down::Cols as usize
);

/// A part of a GEMV split by columns (the O projection's halves, the MLP's parts), rows `rows` of it,
/// for layer `layer`: checks that the parts before left their partials of these rows in this layer,
/// then leaves its own where it is not the last (the layer's number plus one in each row's partial, a
/// mark no other layer or step leaves); the last computes the whole product of these rows from every
/// part's columns (`cpu::product`, the golden model's rounding) and returns it.
fn column_part(
    stack: &mut CpuStack,
    layer: usize,
    phase: usize,
    rows: Range<usize>,
) -> Result<Option<Vec<bf16>>, String> {
    let (part_in, part_out) = program::partials(&stack.program[phase]).expect("a part of a GEMV split by columns");
    let mark = (layer + 1) as f32;
    if part_in != 0 {
        let left = stack.arena.f32(part_in + 4 * rows.start as i64, rows.len());
        if left.iter().any(|&v| v != mark) {
            return Err(format!("rows {rows:?} read partials the parts before had not left in this layer: {left:?}"));
        }
    }
    if part_out != 0 {
        stack.arena.write_f32(part_out + 4 * rows.start as i64, &vec![mark; rows.len()]);
        return Ok(None);
    }
    // The chain of parts back to the first: each one's partials are the next one's input.
    let mut chain = vec![phase];
    while let Some(before) = program::part_writer(&stack.program, *chain.last().unwrap()) {
        chain.push(before);
    }
    let table = stack.layers[layer].table();
    let parts: Vec<(&Arena, Part)> = chain
        .iter()
        .rev()
        .map(|&p| {
            let r = program::resolve_row(&stack.program[p], &table);
            (&stack.arena, (r[oproj::W as usize], r[oproj::A as usize], r[oproj::Cols as usize] as usize))
        })
        .collect();
    Ok(Some(cpu::product(&parts, rows)))
}

/// Task `t`: its units of its phase, reading the layer's input (`x` for layer 0, else the layer
/// before's output) and writing its rows of the layer's output where it is Down's last part.
fn run_task(stack: &mut CpuStack, t: &Task, x: &[bf16], outputs: &mut [Vec<bf16>], pos: usize) -> Result<(), String> {
    let row = program::resolve_row(&stack.program[t.phase], &stack.layers[t.layer].table());
    let x_l = if t.layer == 0 { x.to_vec() } else { outputs[t.layer - 1].clone() };
    let d = stack.cfg.d;
    let w = |i: usize| row[i];
    let u = t.units.clone();
    match Op::from_word(row[0]).expect("a compiled row") {
        Op::Qkv => qkv_rows(stack, &row, &x_l, pairs(&u), pos),
        Op::Attention => {
            // The row's KV heads from its first: each head's slots and its group's query heads, as a
            // layer of one KV head.
            let own = row_config(&stack.cfg, &row);
            let (g, hd, per_head) = (own.group(), own.hd, own.max_seq_len * own.hd);
            let one = sub_config(&own, g, 1);
            let arena = &mut stack.arena;
            for h in u {
                let at = |word: attn::Word| w(word as usize) + (2 * h * per_head) as i64;
                let cache =
                    KvCache { k: arena.bf16(at(attn::KCache), per_head), v: arena.bf16(at(attn::VCache), per_head) };
                let q = arena.bf16(w(attn::Q as usize) + (2 * h * g * hd) as i64, g * hd);
                let a = golden::attention(&one, &q, &cache, pos);
                arena.write_bf16(w(attn::AOut as usize) + (2 * h * g * hd) as i64, &a);
            }
        }
        Op::OProj => {
            let rows = pairs(&u);
            if let Some(y) = column_part(stack, t.layer, t.phase, rows.clone())? {
                let x1 = golden::add(&x_l[rows.clone()], &y);
                stack.arena.write_bf16(w(oproj::X1Out as usize) + 2 * rows.start as i64, &x1);
            }
        }
        Op::GateUp => {
            let arena = &mut stack.arena;
            let eps = f32::from_bits(w(gateup::EpsBits as usize) as u32);
            let h2 =
                golden::rmsnorm(&arena.bf16(w(gateup::X1 as usize), d), &arena.bf16(w(gateup::Norm as usize), d), eps);
            let y = rows_times(arena, w(gateup::W as usize), pairs(&u), d, &h2);
            let (gate, up): (Vec<bf16>, Vec<bf16>) = y.chunks(2).map(|p| (p[0], p[1])).unzip();
            arena.write_bf16(w(gateup::ActOut as usize) + 2 * u.start as i64, &golden::silu_mul(&gate, &up));
        }
        Op::Down => {
            let rows = pairs(&u);
            if let Some(y) = column_part(stack, t.layer, t.phase, rows.clone())? {
                let x1 = stack.arena.bf16(w(down::X1 as usize) + 2 * rows.start as i64, rows.len());
                outputs[t.layer][rows].copy_from_slice(&golden::add(&x1, &y));
            }
        }
        op => panic!("the block machine runs no {op:?} row"),
    }
    Ok(())
}

/// Packed rows `rows` of Qkv row `row` (its heads from its first, `row_config`) from input `x`: the
/// projection, RoPE and the append at `pos`, as the golden model computes them.
fn qkv_rows(stack: &mut CpuStack, row: &Row, x: &[bf16], rows: Range<usize>, pos: usize) {
    let own = row_config(&stack.cfg, row);
    let (d, hd, max_seq) = (own.d, own.hd, own.max_seq_len);
    let w = |i: qkv::Word| row[i as usize];
    let arena = &mut stack.arena;
    let h = golden::rmsnorm(x, &arena.bf16(w(qkv::Norm), d), f32::from_bits(w(qkv::EpsBits) as u32));
    let y = rows_times(arena, w(qkv::W), rows.clone(), d, &h);
    // RoPE rotates within a pair of packed rows, all in this task: rotate whole vectors that hold this
    // task's rows and keep only those.
    let (mut q, mut k, mut v) =
        (vec![bf16::ZERO; own.q_dim()], vec![bf16::ZERO; own.kv_dim()], vec![bf16::ZERO; own.kv_dim()]);
    let mut mine = Vec::with_capacity(rows.len());
    for (p, &value) in rows.zip(&y) {
        let (tensor, r) = qkv_source(&own, Groups::all(&own), p);
        match tensor {
            Tensor::Wq => q[r] = value,
            Tensor::Wk => k[r] = value,
            _ => v[r] = value,
        }
        mine.push((tensor, r));
    }
    let half = hd / 2;
    let table =
        RopeTable { cos: arena.f32(w(qkv::Cos), max_seq * half), sin: arena.f32(w(qkv::Sin), max_seq * half), half };
    golden::rope(&mut q, own.n_q, hd, &table, pos);
    golden::rope(&mut k, own.n_kv, hd, &table, pos);
    let slot = |r: usize| 2 * ((r / hd * max_seq + pos) * hd + r % hd) as i64;
    for (tensor, r) in mine {
        match tensor {
            Tensor::Wq => arena.write_bf16(w(qkv::QOut) + 2 * r as i64, &[q[r]]),
            Tensor::Wk => arena.write_bf16(w(qkv::KCache) + slot(r), &[k[r]]),
            _ => arena.write_bf16(w(qkv::VCache) + slot(r), &[v[r]]),
        }
    }
}

#[cfg(test)]
mod tests {
    use reference::golden::Weights;

    use super::*;
    use crate::cpu::checks::{self, built};
    use crate::program::{Forced, Plan};

    const ONE_ROLE: Plan = Plan { roles: 1, mlp_parts: 1 };

    /// Three layers of four KV heads, so that layers interleave and Qkv's blocks write some KV groups
    /// and not others.
    fn cfg() -> Config {
        Config { layers: 3, n_kv: 4, ..Config::tiny() }
    }

    /// `steps` steps of `graph` over `stack`, each with its own interleaving: the golden step and caches,
    /// or where they first differ.
    fn against_golden(
        stack: &mut CpuStack,
        layers: &[(Weights, KvCache)],
        graph: &TaskGraph,
        steps: usize,
        seed: u64,
    ) -> Result<(), String> {
        let cfg = stack.cfg.clone();
        let caches = checks::against_golden(&cfg, layers, steps, |x, pos, s| {
            run(stack, graph, x, pos, seed ^ (s as u64) << 32)
        })?;
        checks::same_caches(&caches, |l| stack.cache(l))
    }

    /// The plan of `roles` roles and `parts` MLP parts on `grid` blocks.
    fn plan(cfg: &Config, grid: usize, roles: usize, parts: usize) -> Plan {
        Plan::with(cfg, grid as u32, Forced { roles: Some(roles), mlp_parts: Some(parts) }).unwrap()
    }

    /// Any interleaving of the blocks computes the golden step, with the program's phase-wide waits
    /// and with attention waiting only for its KV heads' Qkv writers: one role and two, the MLP in one
    /// to three parts, on one block, on grids whose blocks' rows straddle KV groups, and on the H200's
    /// 132.
    #[test]
    fn every_interleaving_of_the_blocks_computes_the_golden_step() {
        let cfg = cfg();
        for (roles, parts, grids) in
            [(1, 1, &[1, 5, 16, 132][..]), (1, 3, &[5, 132]), (2, 2, &[5, 16, 132]), (2, 3, &[16])]
        {
            for &grid in grids {
                let (mut stack, layers) = built(&cfg, grid as u32, plan(&cfg, grid, roles, parts), false);
                for waits in [Waits::Phases, Waits::KvHeads] {
                    let graph = TaskGraph::compile(&stack.program, cfg.layers, &cfg, grid, waits);
                    against_golden(&mut stack, &layers, &graph, 4, grid as u64)
                        .unwrap_or_else(|e| panic!("{roles} roles, {parts} parts, {grid} blocks, {waits:?}: {e}"));
                }
            }
        }
    }

    /// The checks of partial sums can fail: the O projection's second half without its wait for the
    /// first, or Down's second part on other rows than the first's on a block (whose partials then
    /// come from a block no wait orders before it), reads partials not yet left in some interleaving.
    #[test]
    fn a_part_that_reads_partials_not_yet_left_is_caught() {
        let cfg = cfg();
        let (mut stack, layers) = built(&cfg, 16, plan(&cfg, 16, 2, 2), false);
        let of = |op: Op, stack: &CpuStack| -> Vec<usize> {
            (0..stack.program.len()).filter(|&p| stack.program[p][0] == op as i64).collect()
        };
        let (oprojs, downs) = (of(Op::OProj, &stack), of(Op::Down, &stack));
        let program = stack.program.clone();
        assert!(program[oprojs[1]][WAITS_WORD] >> oprojs[0] & 1 == 1);
        stack.program[oprojs[1]][WAITS_WORD] &= !(1 << oprojs[0]);
        let graph = TaskGraph::compile(&stack.program, cfg.layers, &cfg, 16, Waits::Phases);
        let e = against_golden(&mut stack, &layers, &graph, 24, 3).unwrap_err();
        assert!(e.contains("read partials the parts before had not left"), "{e}");
        stack.program = program;
        let mut blocks = Blocks::of(&stack.program[downs[1]]);
        blocks.count -= 1;
        stack.program[downs[1]][program::BLOCKS_WORD] = blocks.word();
        let graph = TaskGraph::compile(&stack.program, cfg.layers, &cfg, 16, Waits::Phases);
        let e = against_golden(&mut stack, &layers, &graph, 24, 4).unwrap_err();
        assert!(e.contains("read partials the parts before had not left"), "{e}");
    }

    /// At a real layer's shape and grid (Llama-3.2-1B's, two layers, on the H200's 132 blocks, the
    /// compiler's own plan): both protocols compute the golden step.
    #[test]
    fn the_machine_runs_a_real_layers_shape_on_132_blocks() {
        let member = spec::family::find("llama-3.2-1b").unwrap().config();
        let cfg = Config { layers: 2, prefill: 200, max_seq_len: 256, ..member };
        let (mut stack, layers) = built(&cfg, 132, Plan::choose(&cfg, 132), false);
        for waits in [Waits::Phases, Waits::KvHeads] {
            let graph = TaskGraph::compile(&stack.program, cfg.layers, &cfg, 132, waits);
            against_golden(&mut stack, &layers, &graph, 2, 5).unwrap_or_else(|e| panic!("{waits:?}: {e}"));
        }
    }

    /// Narrowed, an attention task waits on its own KV groups' counters, each for every Qkv task that
    /// writes a row of the group, and some wait for fewer Qkv tasks than the whole phase.
    #[test]
    fn attention_waits_only_for_the_qkv_tasks_that_write_its_heads() {
        let cfg = cfg();
        let (stack, _) = built(&cfg, 16, ONE_ROLE, false);
        let graph = TaskGraph::compile(&stack.program, cfg.layers, &cfg, 16, Waits::KvHeads);
        let qkv = stack.program.iter().position(|r| r[0] == Op::Qkv as i64).unwrap();
        let attention = stack.program.iter().position(|r| r[0] == Op::Attention as i64).unwrap();
        let qkv_tasks: Vec<&Task> =
            graph.tasks().map(|(_, _, t)| t).filter(|t| t.layer == 0 && t.phase == qkv).collect();
        let mut narrower = 0;
        for (_, _, t) in graph.tasks().filter(|(_, _, t)| t.phase == attention) {
            let on_qkv: Vec<&(Counter, u32)> =
                t.waits.iter().filter(|(c, _)| c.phase == qkv && c.layer == t.layer).collect();
            assert_eq!(
                on_qkv.iter().map(|(c, _)| c.group.unwrap()).collect::<Vec<_>>(),
                t.units.clone().collect::<Vec<_>>()
            );
            for (c, target) in on_qkv {
                let writers = qkv_tasks.iter().filter(|q| q.signals.iter().any(|s| s.group == c.group)).count();
                assert_eq!(*target as usize, writers, "{t:?}");
            }
            let waited: usize = t.waits.iter().filter(|(c, _)| c.phase == qkv).map(|&(_, n)| n as usize).sum();
            narrower += usize::from(waited < qkv_tasks.len());
        }
        assert!(narrower > 0, "every attention task waits for all of Qkv");
    }

    /// The check can fail: attention waiting on the next KV group's writers, or for one writer fewer
    /// than its group has, reads rows not yet written in some interleaving.
    #[test]
    fn a_wait_on_the_wrong_head_or_one_short_is_caught() {
        let cfg = cfg();
        let (mut stack, layers) = built(&cfg, 16, ONE_ROLE, false);
        let graph = TaskGraph::compile(&stack.program, cfg.layers, &cfg, 16, Waits::KvHeads);
        let mutated = |change: &dyn Fn(&mut Counter, &mut u32)| {
            let mut g = graph.clone();
            for list in &mut g.blocks {
                for t in list.iter_mut() {
                    for (c, target) in t.waits.iter_mut().filter(|(c, _)| c.group.is_some()) {
                        change(c, target);
                    }
                }
            }
            g
        };
        let n_kv = cfg.n_kv;
        let wrong_head = mutated(&|c, _| c.group = c.group.map(|g| (g + 1) % n_kv));
        assert!(
            against_golden(&mut stack, &layers, &wrong_head, 24, 1).is_err(),
            "waits on the next head's writers all passed"
        );
        let short = mutated(&|_, target| *target -= 1);
        assert!(against_golden(&mut stack, &layers, &short, 24, 2).is_err(), "waits one writer short all passed");
    }

    /// A cycle of waits stops every block: layer 0's first Qkv task waiting for its layer's Down.
    #[test]
    fn a_cycle_of_waits_is_reported_as_a_deadlock() {
        let cfg = cfg();
        let (mut stack, _) = built(&cfg, 5, ONE_ROLE, false);
        let mut graph = TaskGraph::compile(&stack.program, cfg.layers, &cfg, 5, Waits::Phases);
        let down = stack.program.iter().position(|r| r[0] == Op::Down as i64).unwrap();
        let first = graph.blocks.iter_mut().find_map(|list| list.first_mut()).unwrap();
        first.waits.push((Counter { layer: 0, phase: down, group: None }, 1));
        let x = spec::data::input(&cfg, checks::input_seed(), 0);
        let e = run(&mut stack, &graph, &x, cfg.prefill, 7).unwrap_err();
        assert!(e.starts_with("deadlock: no block's next task is ready"), "{e}");
    }
}
