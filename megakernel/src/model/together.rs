//! Several generations at once, one sequence each: every step takes one lane per unfinished sequence
//! (its next prompt token, or the token it generated last) at the sequences' next position, and runs
//! them together (on the GPU one batch step, `GpuModel::decode_batch`, whose every lane's greedy token
//! is bitwise its own decode step's); each sequence stops as `generate` stops it. So the tokens are those
//! of each prompt's own generation, and the weights stream once a step for all of them.

use super::request::Lane;
use super::request::{Limits, Stop};

/// What generations of `prompts` together may ask for: 1 to `sequences` prompts, each a generation
/// `limits` takes (refused naming the prompt).
pub fn check_together(
    limits: Limits,
    sequences: usize,
    prompts: &[Vec<u32>],
    max_new: usize,
    eos: &[u32],
) -> Result<(), String> {
    if prompts.is_empty() || prompts.len() > sequences {
        return Err(format!("{} prompts: 1 to {sequences} (the sequences the model was loaded for)", prompts.len()));
    }
    for (i, p) in prompts.iter().enumerate() {
        limits.generation(p, max_new, eos).map_err(|why| format!("prompt {i}: {why}"))?;
    }
    Ok(())
}

/// The generations of `prompts` (sequence i for prompt i; at most `sequences` of them), up to `max_new`
/// tokens each, stopping at one of `eos` or where the caches end. `step` runs the lanes together and
/// returns each lane's greedy token (None where every logit was NaN), one for each lane.
pub fn generate_together<E: From<String>>(
    limits: Limits,
    sequences: usize,
    prompts: &[Vec<u32>],
    max_new: usize,
    eos: &[u32],
    mut step: impl FnMut(&[Lane]) -> Result<Vec<Option<u32>>, E>,
) -> Result<Vec<(Vec<u32>, Stop)>, E> {
    check_together(limits, sequences, prompts, max_new, eos)?;
    let mut new: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut done: Vec<Option<Stop>> = vec![None; prompts.len()];
    let mut pos = 0;
    while done.iter().any(Option::is_none) {
        // Every unfinished sequence is at the same position: they all started at 0 and advance together.
        let lanes: Vec<Lane> = (0..prompts.len())
            .filter(|&s| done[s].is_none())
            .map(|s| {
                let token = prompts[s].get(pos).or(new[s].last()).copied();
                Lane { seq: s, token: token.expect("past its prompt, a sequence has generated a token"), pos }
            })
            .collect();
        let next = step(&lanes)?;
        if next.len() != lanes.len() {
            return Err(format!("a step of {} lanes gave {} tokens", lanes.len(), next.len()).into());
        }
        for (lane, next) in lanes.iter().zip(next) {
            let s = lane.seq;
            if pos + 1 < prompts[s].len() {
                continue; // still in its prompt: the next lane's token is given
            }
            let t = next.ok_or_else(|| format!("prompt {s}: every logit was NaN: no token to choose"))?;
            new[s].push(t);
            done[s] = limits.stop(prompts[s].len(), &new[s], max_new, eos);
        }
        pos += 1;
    }
    Ok(new.into_iter().zip(done.into_iter().flatten()).collect())
}
