//! What a model's decode step and generation take, the same on both executors (the GPU's model kernel
//! and the CPU model the Python binding also runs): tokens within the vocabulary, positions and prompts
//! within the caches, a new token at least, at most [`MAX_EOS`] end-of-sequence tokens; refused in the
//! same words wherever they are asked for; a batch step's lanes. And why a generation stopped, read
//! from its tokens.

/// End-of-sequence tokens a launch stops at, at most (the kernel's `MODEL_MAX_EOS`, which
/// `gpu.rs`'s tests check).
pub const MAX_EOS: usize = 4;

/// One lane of a batch step: `token` at position `pos` of sequence `seq`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lane {
    pub seq: usize,
    pub token: u32,
    pub pos: usize,
}

impl Lane {
    /// The lanes of a chunk of sequence `seq`'s prompt: `tokens` at positions `pos0, pos0 + 1, ...`.
    pub fn chunk(seq: usize, pos0: usize, tokens: &[u32]) -> Vec<Lane> {
        tokens.iter().enumerate().map(|(i, &token)| Lane { seq, token, pos: pos0 + i }).collect()
    }
}

/// A model's vocabulary and the depth of its caches.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub vocab: usize,
    pub context: usize,
}

impl Limits {
    pub fn tokens(self, tokens: &[u32]) -> Result<(), String> {
        match tokens.iter().find(|&&t| t as usize >= self.vocab) {
            Some(t) => Err(format!("token {t} is outside the vocabulary of {}", self.vocab)),
            None => Ok(()),
        }
    }

    /// A decode step of `token` at `pos`.
    pub fn step(self, token: u32, pos: usize) -> Result<(), String> {
        self.tokens(&[token])?;
        if pos >= self.context {
            return Err(format!("position {pos} is past the caches' {}", self.context));
        }
        Ok(())
    }

    /// A generation of up to `max_new` tokens after `prompt`, from position 0, stopping at `eos`.
    pub fn generation(self, prompt: &[u32], max_new: usize, eos: &[u32]) -> Result<(), String> {
        if prompt.is_empty() || max_new == 0 {
            return Err("a generation needs a prompt and at least one new token".into());
        }
        self.tokens(prompt)?;
        if prompt.len() > self.context {
            return Err(format!(
                "a prompt of {} tokens is longer than the caches' {} positions",
                prompt.len(),
                self.context
            ));
        }
        if eos.len() > MAX_EOS {
            return Err(format!("{} end-of-sequence tokens; the kernel stops at {MAX_EOS}", eos.len()));
        }
        Ok(())
    }

    /// Why a generation after a prompt of `prompt` tokens ends with `tokens` generated, or None while it
    /// goes on: the next token would be decoded at position prompt + tokens - 1, so the caches are full
    /// once that is past them (the kernel's rule, `run_model`).
    pub fn stop(self, prompt: usize, tokens: &[u32], max_new: usize, eos: &[u32]) -> Option<Stop> {
        let stop = Stop::of(tokens, max_new, eos);
        (stop != Stop::Context || prompt + tokens.len() > self.context).then_some(stop)
    }
}

/// Why a generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// It generated an end-of-sequence token (the last of `tokens`).
    Eos,
    /// It generated the tokens it was asked for.
    MaxNew,
    /// The caches are full.
    Context,
}

impl Stop {
    /// Why a generation of `tokens`, asked for up to `max_new` and stopping at `eos`, ended.
    pub fn of(tokens: &[u32], max_new: usize, eos: &[u32]) -> Stop {
        match tokens.last() {
            Some(t) if eos.contains(t) => Stop::Eos,
            _ if tokens.len() == max_new => Stop::MaxNew,
            _ => Stop::Context,
        }
    }

    /// Its name, as the Python binding reports it.
    pub fn name(self) -> &'static str {
        match self {
            Stop::Eos => "eos",
            Stop::MaxNew => "max_new",
            Stop::Context => "context",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_outside_the_model_are_refused_in_words() {
        let l = Limits { vocab: 10, context: 4 };
        assert_eq!(l.step(10, 0).unwrap_err(), "token 10 is outside the vocabulary of 10");
        assert_eq!(l.step(9, 4).unwrap_err(), "position 4 is past the caches' 4");
        assert!(l.step(9, 3).is_ok());
        assert!(l.generation(&[], 1, &[]).unwrap_err().contains("needs a prompt"));
        assert!(l.generation(&[1], 0, &[]).unwrap_err().contains("at least one new token"));
        assert!(l.generation(&[1; 5], 1, &[]).unwrap_err().contains("longer than the caches' 4"));
        assert!(l.generation(&[1], 1, &[1; MAX_EOS + 1]).unwrap_err().contains("end-of-sequence tokens"));
        assert!(l.generation(&[1; 4], 1, &[2; MAX_EOS]).is_ok());
    }

    #[test]
    fn a_generation_names_why_it_stopped() {
        assert_eq!(Stop::of(&[5, 2], 4, &[2]), Stop::Eos);
        assert_eq!(Stop::of(&[5, 6], 2, &[2]), Stop::MaxNew);
        assert_eq!(Stop::of(&[5], 2, &[2]), Stop::Context);
        // Caches of 4 positions: a prompt of 2 and 2 tokens generated leave the next one at position 3,
        // which is in them; a third token would be at 4, which is not.
        let l = Limits { vocab: 10, context: 4 };
        assert_eq!(l.stop(2, &[5, 6], 8, &[2]), None);
        assert_eq!(l.stop(2, &[5, 6, 7], 8, &[2]), Some(Stop::Context));
        assert_eq!(l.stop(2, &[5, 2], 8, &[2]), Some(Stop::Eos));
        assert_eq!(l.stop(1, &[5, 6], 2, &[2]), Some(Stop::MaxNew));
    }
}
