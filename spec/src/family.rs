//! The Llama family around the graded layer: the shapes a user of `--config` will judge, each one
//! layer at the task's schedule, named as `grader sweep` and `--config` accept them. The graded
//! layer is the task; these are the neighbourhood its verdict must hold in. Also the named stacks
//! ([`STACKS`]): whole models' depths of one member's layer, which `grader run` judges as a whole
//! (docs/stack.md); the deepest, Llama-3.1-405B's, holds more than one GPU's memory and waits for the
//! split over GPUs (docs/parallel.md).

use crate::Config;

/// One member: its name, layer shape and context (prefilled positions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    pub name: &'static str,
    /// What the shape is taken from.
    pub what: &'static str,
    pub d: usize,
    pub ffn: usize,
    pub n_q: usize,
    pub n_kv: usize,
    pub hd: usize,
    pub prefill: usize,
}

/// Shapes of published models (d / ffn / n_q / n_kv / hd) at 4k context, the graded layer, and the
/// graded shape at longer contexts.
pub const FAMILY: [Member; 14] = [
    member("llama-3.2-1b", "Llama-3.2-1B (hd 64)", 2048, 8192, 32, 8, 64, 4096),
    member("llama-3.2-3b", "Llama-3.2-3B", 3072, 8192, 24, 8, 128, 4096),
    member("llama-3-8b", "Llama-3-8B", 4096, 14336, 32, 8, 128, 4096),
    member("qwen-7b", "Qwen2-7B-like (7 query heads per KV head)", 3584, 18944, 28, 4, 128, 4096),
    member("llama-2-13b", "Llama-2-13B (multi-head: n_kv = n_q)", 5120, 13824, 40, 40, 128, 4096),
    member("qwen-32b", "Qwen-32B-like", 5120, 27648, 40, 8, 128, 4096),
    member("glm-4-9b", "GLM-4-9B-like (16 query heads per KV head)", 4096, 13696, 32, 2, 128, 4096),
    member("gemma-hd256", "Gemma-2-9B-like (hd 256)", 3584, 14336, 16, 8, 256, 4096),
    member("graded", "the graded 70B layer", 8192, 28672, 64, 8, 128, 4096),
    member("70b-8k", "the 70B layer at 8k context", 8192, 28672, 64, 8, 128, 8192),
    member("70b-16k", "the 70B layer at 16k context", 8192, 28672, 64, 8, 128, 16384),
    member("70b-32k", "the 70B layer at 32k context", 8192, 28672, 64, 8, 128, 32768),
    member("70b-128k", "the 70B layer at 128k context", 8192, 28672, 64, 8, 128, 131072),
    member("405b", "Llama-3.1-405B", 16384, 53248, 128, 8, 128, 4096),
];

#[allow(clippy::too_many_arguments)]
const fn member(
    name: &'static str,
    what: &'static str,
    d: usize,
    ffn: usize,
    n_q: usize,
    n_kv: usize,
    hd: usize,
    prefill: usize,
) -> Member {
    Member { name, what, d, ffn, n_q, n_kv, hd, prefill }
}

impl Member {
    /// The member as a configuration: the graded one's schedule, eps and theta; the cache holds the
    /// context plus room for every step, as the graded one does.
    pub fn config(&self) -> Config {
        let graded = Config::graded();
        let room = graded.max_seq_len - graded.prefill;
        Config {
            name: self.name.into(),
            d: self.d,
            ffn: self.ffn,
            n_q: self.n_q,
            n_kv: self.n_kv,
            hd: self.hd,
            prefill: self.prefill,
            max_seq_len: self.prefill + room,
            ..graded
        }
    }
}

/// The member named `name`.
pub fn find(name: &str) -> Option<&'static Member> {
    FAMILY.iter().find(|m| m.name == name)
}

/// A named stack: `layers` layers of one member's shape, each with its own weights and cache
/// (`crate::data::layer_seed`), at the member's context and the task's schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stack {
    pub name: &'static str,
    /// The model whose depth it has.
    pub what: &'static str,
    /// The member whose layer it repeats.
    pub member: &'static str,
    pub layers: usize,
}

/// The whole-model depths the task statement names (16 to 80 layers), and Llama-3.1-405B's (126), which
/// needs eight H200s (`crate::parallel::fewest_gpus`).
pub const STACKS: [Stack; 4] = [
    Stack { name: "stack-405b", what: "Llama-3.1-405B: 126 layers (eight GPUs' memory)", member: "405b", layers: 126 },
    Stack { name: "stack-70b", what: "a 70B model: 80 layers of the graded shape", member: "graded", layers: 80 },
    Stack { name: "stack-8b", what: "Llama-3-8B: 32 layers", member: "llama-3-8b", layers: 32 },
    Stack { name: "stack-1b", what: "Llama-3.2-1B: 16 layers", member: "llama-3.2-1b", layers: 16 },
];

impl Stack {
    /// The stack as a configuration: its member's, with `layers` layers.
    pub fn config(&self) -> Config {
        let member = find(self.member).expect("a stack names a member of the family");
        Config { name: self.name.into(), layers: self.layers, ..member.config() }
    }
}

/// The stack named `name`.
pub fn find_stack(name: &str) -> Option<&'static Stack> {
    STACKS.iter().find(|s| s.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_member_is_a_valid_config_and_the_graded_one_is_the_task() {
        for m in &FAMILY {
            m.config().validate().unwrap_or_else(|e| panic!("{}: {e}", m.name));
            assert_eq!(Config::load(m.name).unwrap(), m.config(), "--config {} names the member", m.name);
        }
        assert_eq!(find("graded").unwrap().config(), Config::graded());
        let names: std::collections::HashSet<_> =
            FAMILY.iter().map(|m| m.name).chain(STACKS.iter().map(|s| s.name)).collect();
        assert_eq!(names.len(), FAMILY.len() + STACKS.len(), "names are unique");
    }

    /// Each named stack is its member's layer repeated, valid, found by `--config`, and refused by
    /// what grades one layer.
    #[test]
    fn stacks_repeat_their_members_layer() {
        for s in &STACKS {
            let cfg = s.config();
            cfg.validate().unwrap_or_else(|e| panic!("{}: {e}", s.name));
            assert_eq!(Config::load(s.name).unwrap(), cfg);
            assert_eq!(Config { name: s.member.into(), layers: 1, ..cfg.clone() }, find(s.member).unwrap().config());
            assert!(cfg.require_one_layer("this").is_err(), "{}", s.name);
        }
        assert_eq!(find_stack("stack-70b").unwrap().config().layers, 80);
    }
}
